//! An in-memory network of the collective's machines: N nodes and the root, their frames delivered in a
//! seeded random order (in order on each connection, as TCP delivers them), with one peer lost at a
//! chosen point if asked. The hosts it plays do what the module's documentation asks of real ones: a
//! node's shell contributes, and says it is done after the last exchange; a node's job error is reported
//! to the root, whose host then fails the job. The tests and the tree benchmark (`benches/tree`) run on it.

use super::frame::{be32, Bytes, Parts};
use super::output::Output;
use super::tree::{Peer, Tree};
use super::{Allgather, Bound, Bounds, Node, Root};
use std::collections::{HashMap, VecDeque};

/// What to simulate.
#[derive(Debug, Clone)]
pub struct Config {
    pub nodes: u32,
    pub width: u32,
    /// Every exchange turns at node 0 ([`Tree::top_at_first_node`]) rather than at the root.
    pub top_at_first_node: bool,
    /// How the parts reach every node.
    pub allgather: Allgather,
    /// Exchanges every node's shell joins.
    pub epochs: u32,
    /// Bytes of every node's part (at least 8: its node and its epoch, then zeros).
    pub part: usize,
    pub seed: u64,
    /// Lose this peer (close all its connections, drop its machine) after this many deliveries, or once
    /// nothing else is left to happen if that is sooner.
    pub loss: Option<(Peer, u64)>,
    /// After its last exchange, every node says it is done and later closes its connections; once all is
    /// quiet the root ends the job.
    pub finish: bool,
    /// Check every part of the results of every `verify_every`-th node (the others: how many parts).
    pub verify_every: u32,
    pub bounds: Bounds,
    /// The largest ALL a node takes.
    pub all_max: usize,
}

impl Config {
    /// Three exchanges of 8-byte parts, then goodbyes; every result checked, no loss, bounds far off.
    pub fn new(nodes: u32, width: u32) -> Config {
        let far = |option| Bound { bytes: usize::MAX / 4, option };
        Config {
            nodes,
            width,
            top_at_first_node: false,
            allgather: Allgather::Tree,
            epochs: 3,
            part: 8,
            seed: 1,
            loss: None,
            finish: true,
            verify_every: 1,
            bounds: Bounds { part_max: far("part_max"), exchange_max: far("exchange_max") },
            all_max: usize::MAX / 4,
        }
    }
}

/// What happened.
#[derive(Debug, Clone, Default)]
pub struct Run {
    /// Exchanges each node completed.
    pub done: Vec<u32>,
    /// The exchange each node's shell saw fail, if any.
    pub failed: Vec<Option<u32>>,
    /// Nodes still running whose shell waits for a result that nobody will send.
    pub waiting: Vec<u32>,
    /// Every job error: who reported it, the node at fault (`None`: the root) and the message.
    pub job_errors: Vec<(Peer, Option<u32>, String)>,
    /// Reports that reached the root.
    pub reports: usize,
    /// What went wrong that no machine reported: a wrong result, a frame for a peer with no connection.
    pub problems: Vec<String>,
    /// Bytes each participant sent, length prefixes included: nodes 0..N, then the root.
    pub sent: Vec<u64>,
    /// The most bytes each participant's machine held at once: nodes 0..N, then the root.
    pub peak: Vec<usize>,
    pub deliveries: u64,
}

/// A tiny xorshift generator: the order of events, from the seed.
#[derive(Debug, Clone)]
pub struct XorShift(u64);

impl XorShift {
    pub fn new(seed: u64) -> XorShift {
        XorShift(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A number below `n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// Node `node`'s part of exchange `epoch`, `size` bytes.
pub fn part(node: u32, epoch: u32, size: usize) -> Vec<u8> {
    let mut p = vec![0; size.max(8)];
    p[..4].copy_from_slice(&node.to_be_bytes());
    p[4..8].copy_from_slice(&epoch.to_be_bytes());
    p
}

/// What is in flight on one direction of a connection.
#[derive(Debug)]
enum Delivery {
    Frame(Bytes),
    Closed,
}

/// A node's shell, as the simulation plays it.
#[derive(Debug, Default, Clone, Copy)]
struct Shell {
    /// The next exchange to join.
    next: u32,
    waiting: bool,
    /// Its exchange failed: it joins no more.
    failed: bool,
    finished: bool,
}

struct Sim {
    config: Config,
    tree: Tree,
    root: Option<Root>,
    nodes: Vec<Option<Node>>,
    shells: Vec<Shell>,
    /// Four per node i: i to the root, the root to i, i to its parent node, its parent node to i; then one
    /// each way between nodes that are peers only in Bruck's rounds.
    links: Vec<VecDeque<Delivery>>,
    /// The links after the tree's: (from, to) by number, and their numbers.
    sideways: Vec<(u32, u32)>,
    sideways_link: HashMap<(u32, u32), u32>,
    /// Links with something in flight, and shells with something to do (numbered after the links).
    active: Vec<u32>,
    queued: Vec<bool>,
    rng: XorShift,
    run: Run,
}

/// Runs `config` until nothing is left to happen.
pub fn run(config: &Config) -> Run {
    let tree = match Tree::new(config.nodes, config.width) {
        Ok(t) if config.top_at_first_node => t.top_at_first_node(),
        Ok(t) => t,
        Err(e) => return Run { problems: vec![e.to_string()], ..Run::default() },
    };
    let n = config.nodes as usize;
    let node = |i| Some(Node::new(tree, i, config.bounds, config.all_max).ok()?.with_allgather(config.allgather));
    let nodes: Vec<Option<Node>> = (0..config.nodes).map(node).collect();
    // A connection each way between peers that the tree does not already join.
    let joined = |a: u32, b: u32| tree.parent(a) == Peer::Node(b) || tree.parent(b) == Peer::Node(a);
    let sideways: Vec<(u32, u32)> = nodes
        .iter()
        .flatten()
        .enumerate()
        .flat_map(|(i, node)| node.peers().into_iter().map(move |p| (i as u32, p)))
        .filter(|&(i, p)| !joined(i, p))
        .collect();
    let sideways_link = sideways.iter().enumerate().map(|(l, &pair)| (pair, (4 * n + l) as u32)).collect();
    let tasks = 5 * n + sideways.len();
    let mut sim = Sim {
        config: config.clone(),
        tree,
        root: Some(Root::new(tree, config.bounds)),
        nodes,
        shells: vec![Shell::default(); n],
        links: (0..4 * n + sideways.len()).map(|_| VecDeque::new()).collect(),
        sideways,
        sideways_link,
        active: Vec::with_capacity(tasks),
        queued: vec![false; tasks],
        rng: XorShift::new(config.seed),
        run: Run {
            done: vec![0; n],
            failed: vec![None; n],
            sent: vec![0; n + 1],
            peak: vec![0; n + 1],
            ..Run::default()
        },
    };
    for i in 0..config.nodes {
        sim.activate(sim.shell_task(i));
    }
    sim.go();
    sim.run
}

impl Sim {
    fn go(&mut self) {
        let mut loss = self.config.loss;
        let mut ended = false;
        loop {
            if let Some((peer, at)) = loss {
                if self.run.deliveries >= at || self.active.is_empty() {
                    loss = None;
                    self.close(peer);
                    continue;
                }
            }
            if self.active.is_empty() {
                if self.config.finish && !ended {
                    ended = true;
                    if let Some(root) = &mut self.root {
                        root.end();
                    }
                    self.drain_root();
                    continue;
                }
                break;
            }
            let at = self.rng.below(self.active.len() as u64) as usize;
            let task = self.active[at];
            let link = task as usize;
            let delivery = self.links.get_mut(link).and_then(VecDeque::pop_front);
            if self.links.get(link).is_none_or(VecDeque::is_empty) {
                self.active.swap_remove(at);
                self.queued[task as usize] = false;
            }
            match delivery {
                Some(d) => self.deliver(task, d),
                None => self.shell(task - self.links.len() as u32),
            }
        }
        for (i, s) in self.shells.iter().enumerate() {
            if s.waiting && self.nodes[i].is_some() {
                self.run.waiting.push(i as u32);
            }
        }
    }

    fn shell_task(&self, node: u32) -> u32 {
        self.links.len() as u32 + node
    }

    fn activate(&mut self, task: u32) {
        if let Some(q) = self.queued.get_mut(task as usize) {
            if !*q {
                *q = true;
                self.active.push(task);
            }
        }
    }

    /// The link from `from` to `to`, if they have a connection.
    fn link(&self, from: Peer, to: Peer) -> Option<u32> {
        let n = self.tree.nodes();
        let parent_of = |c: u32| (c < n).then(|| self.tree.parent(c));
        match (from, to) {
            (Peer::Node(i), Peer::Root) if i < n => Some(4 * i),
            (Peer::Root, Peer::Node(i)) if i < n => Some(4 * i + 1),
            (Peer::Node(i), Peer::Node(p)) if parent_of(i) == Some(Peer::Node(p)) => Some(4 * i + 2),
            (Peer::Node(p), Peer::Node(c)) if parent_of(c) == Some(Peer::Node(p)) => Some(4 * c + 3),
            (Peer::Node(a), Peer::Node(b)) => self.sideways_link.get(&(a, b)).copied(),
            _ => None,
        }
    }

    /// Who sends and who receives on `link`.
    fn ends(&self, link: u32) -> (Peer, Peer) {
        if let Some(&(from, to)) = (link as usize).checked_sub(4 * self.nodes.len()).and_then(|l| self.sideways.get(l))
        {
            return (Peer::Node(from), Peer::Node(to));
        }
        let i = link / 4;
        let parent = self.tree.parent(i);
        match link % 4 {
            0 => (Peer::Node(i), Peer::Root),
            1 => (Peer::Root, Peer::Node(i)),
            2 => (Peer::Node(i), parent),
            _ => (parent, Peer::Node(i)),
        }
    }

    fn send(&mut self, from: Peer, to: Peer, frame: Bytes) {
        let Some(link) = self.link(from, to) else {
            self.run.problems.push(format!("{from} sent a frame to {to}, with which it has no connection"));
            return;
        };
        let sender = match from {
            Peer::Node(i) => i as usize,
            Peer::Root => self.config.nodes as usize,
        };
        self.run.sent[sender] += 4 + frame.len() as u64;
        self.links[link as usize].push_back(Delivery::Frame(frame));
        self.activate(link);
    }

    /// Closes every connection of `peer` (what it sent is still delivered first) and drops its machine.
    fn close(&mut self, peer: Peer) {
        let out: Vec<u32> = match peer {
            Peer::Root => {
                self.root = None;
                (0..self.config.nodes).map(|i| 4 * i + 1).collect()
            }
            Peer::Node(x) => {
                let Some(slot) = self.nodes.get_mut(x as usize) else { return };
                *slot = None;
                let mut out = vec![4 * x];
                if self.tree.parent(x) != Peer::Root {
                    out.push(4 * x + 2);
                }
                out.extend(self.tree.children(Peer::Node(x)).map(|c| 4 * c + 3));
                let sideways = self.sideways.iter().enumerate().filter(|(_, &(from, _))| from == x);
                out.extend(sideways.map(|(l, _)| (4 * self.nodes.len() + l) as u32));
                out
            }
        };
        for link in out {
            self.links[link as usize].push_back(Delivery::Closed);
            self.activate(link);
        }
    }

    fn deliver(&mut self, link: u32, delivery: Delivery) {
        self.run.deliveries += 1;
        let (from, to) = self.ends(link);
        match to {
            Peer::Root => {
                let (Some(root), Peer::Node(i)) = (&mut self.root, from) else { return };
                match delivery {
                    Delivery::Frame(f) => root.receive(i, f),
                    Delivery::Closed => root.lost(i),
                }
                self.drain_root();
            }
            Peer::Node(i) => {
                let Some(node) = self.nodes.get_mut(i as usize).and_then(Option::as_mut) else { return };
                match delivery {
                    Delivery::Frame(f) => node.receive(from, f),
                    Delivery::Closed => node.lost(from),
                }
                self.drain_node(i);
            }
        }
    }

    /// Node `i`'s shell does its next step: join the next exchange, or say it is done, or leave.
    fn shell(&mut self, i: u32) {
        let config = (self.config.epochs, self.config.part, self.config.finish);
        let (Some(shell), Some(Some(node))) = (self.shells.get_mut(i as usize), self.nodes.get_mut(i as usize)) else {
            return;
        };
        let (epochs, size, finish) = config;
        if shell.waiting || shell.failed {
            return;
        }
        if shell.next < epochs {
            shell.waiting = true;
            if let Err(e) = node.contribute(part(i, shell.next, size)) {
                self.run.problems.push(format!("node {i}'s contribution was refused: {e}"));
            }
        } else if finish && !shell.finished {
            shell.finished = true;
            node.finish();
            // It leaves some time later, as a node's host does once its tasks have exited.
            let task = self.shell_task(i);
            self.activate(task);
        } else if shell.finished {
            return self.close(Peer::Node(i));
        }
        self.drain_node(i);
    }

    fn drain_node(&mut self, i: u32) {
        loop {
            let Some(node) = self.nodes.get_mut(i as usize).and_then(Option::as_mut) else { return };
            let Some(o) = node.poll() else {
                self.run.peak[i as usize] = node.peak_held();
                return;
            };
            match o {
                Output::Send { to, frame } => self.send(Peer::Node(i), to, frame),
                Output::Done { epoch, parts } => self.done(i, epoch, &parts),
                Output::Failed { epoch, .. } => {
                    self.run.failed[i as usize] = Some(epoch);
                    let shell = &mut self.shells[i as usize];
                    shell.waiting = false;
                    shell.failed = true;
                }
                Output::JobError { node: at_fault, message } => {
                    // The node's host tells the root's.
                    if node.report(message.as_bytes()).is_err() {
                        self.run.problems.push(format!("node {i} could not report {message}"));
                    }
                    self.run.job_errors.push((Peer::Node(i), at_fault, message));
                }
                Output::Report { .. } => self.run.problems.push(format!("node {i} handed back a report")),
            }
        }
    }

    fn drain_root(&mut self) {
        loop {
            let Some(root) = &mut self.root else { return };
            let Some(o) = root.poll() else {
                let peak = root.peak_held();
                self.run.peak[self.config.nodes as usize] = peak;
                return;
            };
            match o {
                Output::Send { to, frame } => self.send(Peer::Root, to, frame),
                Output::Report { bytes, .. } => {
                    self.run.reports += 1;
                    // The root's host ends the job for it.
                    root.fail(&String::from_utf8_lossy(&bytes));
                }
                Output::JobError { node, message } => self.run.job_errors.push((Peer::Root, node, message)),
                Output::Done { .. } | Output::Failed { .. } => {
                    self.run.problems.push("the root handed back a node's result".into())
                }
            }
        }
    }

    /// Checks node `i`'s result of exchange `epoch`, and lets its shell go on.
    fn done(&mut self, i: u32, epoch: u32, parts: &Parts) {
        let shell = &mut self.shells[i as usize];
        let nodes = self.config.nodes;
        let mut wrong = None;
        if !shell.waiting || epoch != shell.next {
            wrong = Some(format!("a result of exchange {epoch} while at {} (waiting: {})", shell.next, shell.waiting));
        } else if parts.len() != nodes as usize {
            wrong = Some(format!("{} parts", parts.len()));
        } else if i.is_multiple_of(self.config.verify_every.max(1)) {
            let size = self.config.part.max(8);
            let bad = parts.iter().enumerate().find(|&(at, (node, bytes))| {
                at != node as usize
                    || bytes.len() != size
                    || be32(bytes, 0) != Some(node)
                    || be32(bytes, 4) != Some(epoch)
            });
            if let Some((at, (node, _))) = bad {
                wrong = Some(format!("a wrong part {at} (for node {node}) in exchange {epoch}"));
            }
        }
        if let Some(w) = wrong {
            self.run.problems.push(format!("node {i} got {w}"));
        }
        shell.waiting = false;
        shell.next = epoch.wrapping_add(1);
        self.run.done[i as usize] += 1;
        let task = self.shell_task(i);
        self.activate(task);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WIDTHS: [u32; 5] = [1, 2, 3, 8, 32];

    /// `config` with the top at the root, then at node 0, then by Bruck's allgather (up to 1,024 nodes: each
    /// node builds its own rounds, N·S bytes in all, where the tree's nodes share the frames they pass on).
    fn shapes(config: Config) -> Vec<Config> {
        let top_at_first_node = Config { top_at_first_node: true, ..config.clone() };
        let bruck = Config { allgather: Allgather::Bruck, ..top_at_first_node.clone() };
        let bruck = (config.nodes <= 1024).then_some(bruck);
        [config, top_at_first_node].into_iter().chain(bruck).collect()
    }

    fn shape(c: &Config) -> String {
        format!("{} nodes of width {}, top at node 0 {}, {:?}", c.nodes, c.width, c.top_at_first_node, c.allgather)
    }

    fn assert_complete(c: &Config, r: &Run) {
        let what = format!("{}, seed {}", shape(c), c.seed);
        assert!(r.problems.is_empty(), "{what}: {:?}", &r.problems[..r.problems.len().min(5)]);
        assert!(r.job_errors.is_empty(), "{what}: {:?}", &r.job_errors[..r.job_errors.len().min(5)]);
        assert!(r.done.iter().all(|&d| d == c.epochs), "{what}: {:?}", r.done);
        assert!(r.waiting.is_empty() && r.failed.iter().all(Option::is_none), "{what}");
    }

    #[test]
    fn every_node_gets_every_part_once_and_in_order() {
        for width in WIDTHS {
            for nodes in [1, 2, 3, 4, 5, 7, 8, 9, 10, 16, 31, 32, 33, 64, 65, 100, 257, 1000] {
                for seed in 0..2 {
                    for c in shapes(Config { seed, ..Config::new(nodes, width) }) {
                        assert_complete(&c, &run(&c));
                    }
                }
            }
        }
    }

    #[test]
    fn thousands_of_nodes() {
        for (nodes, width, epochs) in
            [(2048, 1, 1), (4096, 2, 2), (4096, 3, 2), (4096, 8, 2), (4096, 32, 2), (16384, 32, 1)]
        {
            for c in shapes(Config { epochs, verify_every: 97, ..Config::new(nodes, width) }) {
                assert_complete(&c, &run(&c));
            }
        }
        let bruck = Config { top_at_first_node: true, allgather: Allgather::Bruck, ..Config::new(2048, 4) };
        let c = Config { epochs: 1, verify_every: 97, ..bruck };
        assert_complete(&c, &run(&c));
    }

    /// Loses `lost` at a point chosen by `seed` (the job runs its exchanges and never ends on its own) and
    /// checks that the job ends with job errors naming it, and with nobody left waiting.
    fn assert_lost(nodes: u32, width: u32, epochs: u32, lost: Peer, seed: u64) {
        let mut rng = XorShift::new(seed);
        let at = rng.below(2 * u64::from(epochs) * u64::from(nodes));
        let c = Config { epochs, seed, loss: Some((lost, at)), finish: false, ..Config::new(nodes, width) };
        for c in shapes(c) {
            assert_lost_in(&c, lost, at);
        }
    }

    fn assert_lost_in(c: &Config, lost: Peer, at: u64) {
        let (nodes, epochs) = (c.nodes, c.epochs);
        let r = run(c);
        let what = format!("{}, {lost} lost after {at} deliveries", shape(c));
        assert!(r.problems.is_empty(), "{what}: {:?}", r.problems);
        assert!(r.waiting.is_empty(), "{what}: left waiting: {:?}", r.waiting);
        let named = match lost {
            Peer::Root => None,
            Peer::Node(x) => Some(x),
        };
        assert!(!r.job_errors.is_empty(), "{what}: no job error");
        assert!(r.job_errors.iter().all(|(_, node, _)| *node == named), "{what}: {:?}", r.job_errors);
        // Every other node completed its exchanges or heard that one failed.
        for n in (0..nodes).filter(|&n| lost != Peer::Node(n)) {
            assert!(r.done[n as usize] == epochs || r.failed[n as usize].is_some(), "{what}: node {n}");
        }
    }

    #[test]
    fn a_lost_peer_anywhere_ends_the_job_naming_it_and_nobody_waits() {
        for width in WIDTHS {
            for nodes in [1, 2, 3, 5, 8, 13, 21, 33, 64] {
                assert_lost(nodes, width, 3, Peer::Root, u64::from(nodes));
                for x in 0..nodes {
                    assert_lost(nodes, width, 3, Peer::Node(x), u64::from(x) * 31 + u64::from(width));
                }
            }
        }
    }

    #[test]
    fn a_lost_peer_in_a_large_tree() {
        for (nodes, width) in [(1000, 1), (1000, 2), (1000, 3), (1000, 8), (1000, 32), (4096, 32)] {
            for x in [0, 1, width - 1, width, width + 1, nodes / 2, nodes - 1] {
                assert_lost(nodes, width, 1, Peer::Node(x), u64::from(x));
            }
            assert_lost(nodes, width, 1, Peer::Root, 5);
        }
    }

    #[test]
    fn nodes_that_say_goodbye_and_leave_end_the_job_normally() {
        for width in WIDTHS {
            for nodes in [1, 2, 7, 40, 300] {
                for seed in 0..3 {
                    for c in shapes(Config { seed, finish: true, ..Config::new(nodes, width) }) {
                        assert_complete(&c, &run(&c));
                    }
                }
            }
        }
    }

    #[test]
    fn a_part_over_its_bound_ends_the_job_and_releases_every_waiting_node() {
        for mut c in
            [2, 32].into_iter().flat_map(|width| shapes(Config { part: 64, finish: false, ..Config::new(100, width) }))
        {
            c.bounds.part_max.bytes = 63;
            let r = run(&c);
            assert!(r.waiting.is_empty(), "{:?}", r.waiting);
            assert!(r.done.iter().all(|&d| d == 0));
            assert!(r.failed.iter().all(|f| *f == Some(0)), "{:?}", r.failed);
            assert!(r.reports > 0 && r.job_errors.iter().all(|(_, _, m)| m.contains("over the limit of 63 bytes")));
        }
    }
}

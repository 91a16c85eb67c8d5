//! A node's side of the collective: its shell's part, its children's, the CONTRIB up and the ALL down.

use super::bruck::Bruck;
use super::frame::{self, Bytes, Frame, Parts, TooLarge, CONTROL_MAX};
use super::gather::{self, Gather, Refusal};
use super::output::{Outbox, Output};
use super::tree::{Peer, Tree, TreeError};
use super::{Allgather, Bounds};
use std::fmt;

/// Why a contribution was not taken: the host broke the machine's contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContributeError {
    /// The shell's part of exchange `epoch` is in and its result has not come.
    Outstanding { epoch: u32 },
    /// The node said it is done ([`Node::finish`]).
    Finished,
}

impl fmt::Display for ContributeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ContributeError::Outstanding { epoch } => {
                write!(f, "a second contribution while PMI exchange {epoch} is outstanding")
            }
            ContributeError::Finished => f.write_str("a contribution after the node said it was done"),
        }
    }
}

impl std::error::Error for ContributeError {}

/// Who a peer is to this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Parent,
    Child(u32),
    /// The root, when it is not the parent: only the node's own frames to it use this connection.
    Root,
    Stranger,
}

/// The collective as one node runs it. Feed it the shell's part ([`Node::contribute`]), frames
/// ([`Node::receive`]) and closed connections ([`Node::lost`]); take what to do from [`Node::poll`].
#[derive(Debug)]
pub struct Node {
    tree: Tree,
    me: u32,
    parent: Peer,
    bounds: Bounds,
    all_max: usize,
    gather: Gather,
    /// The exchange's rounds, where the parts go by Bruck's allgather rather than up the tree.
    bruck: Option<Bruck>,
    /// The exchange in progress: how many have completed.
    epoch: u32,
    /// The shell's part is in and it waits for the result.
    waiting: bool,
    /// The exchange's CONTRIB went up: only the parent's ALL or FAIL is due.
    sent: bool,
    finished: bool,
    /// The parent said BYE.
    parent_done: bool,
    /// The parent or the root closed its connection after it said it was done, and the first exchange that
    /// therefore fails: the next one (with Bruck's allgather, a parent that is done may leave while this node
    /// still completes the exchange in progress).
    gone: Option<(Peer, u32)>,
    /// Failed for good (an error, a FAIL, or the root's END), and why.
    failed: Option<String>,
    outbox: Outbox,
    peak: usize,
}

impl Node {
    /// Node `me` of `tree`, which takes an ALL of at most `all_max` bytes.
    pub fn new(tree: Tree, me: u32, bounds: Bounds, all_max: usize) -> Result<Node, TreeError> {
        if me >= tree.nodes() {
            return Err(TreeError::NoSuchNode { node: me, nodes: tree.nodes() });
        }
        Ok(Node {
            tree,
            me,
            parent: tree.parent(me),
            bounds,
            all_max,
            gather: Gather::new(tree, Peer::Node(me), bounds),
            bruck: None,
            epoch: 0,
            waiting: false,
            sent: false,
            finished: false,
            parent_done: false,
            gone: None,
            failed: None,
            outbox: Outbox::default(),
            peak: 0,
        })
    }

    /// The same node, its exchanges' parts going by `allgather`. Bruck's needs the tree's top at node 0 (the
    /// root takes no parts); with the top at the root the node keeps the tree.
    pub fn with_allgather(mut self, allgather: Allgather) -> Node {
        let bruck = allgather == Allgather::Bruck && self.tree.top() == Peer::Node(0);
        self.bruck = bruck.then(|| Bruck::new(self.tree.nodes(), self.me, self.bounds, self.all_max));
        self
    }

    /// The nodes this node has a connection with, in node order: its parent and children, and its peers in
    /// Bruck's rounds.
    pub fn peers(&self) -> Vec<u32> {
        let allgather = if self.bruck.is_some() { Allgather::Bruck } else { Allgather::Tree };
        allgather.peers(&self.tree, self.me)
    }

    /// The next thing for the host to do.
    pub fn poll(&mut self) -> Option<Output> {
        self.outbox.pop()
    }

    /// The exchange in progress (or next): how many have completed.
    pub fn epoch(&self) -> u32 {
        self.epoch
    }

    /// The largest frame this node takes from `from`, for the transport to check a length before reading.
    pub fn frame_max(&self, from: Peer) -> usize {
        let tree = match self.role(from) {
            Role::Parent if self.under_root_above_top() || self.bruck.is_some() => CONTROL_MAX,
            Role::Parent => self.all_max.max(CONTROL_MAX),
            Role::Child(_) if self.bruck.is_some() => CONTROL_MAX,
            Role::Child(c) => gather::contrib_max(&self.tree, &self.bounds, c),
            Role::Root | Role::Stranger => CONTROL_MAX,
        };
        match (&self.bruck, from) {
            (Some(b), Peer::Node(p)) => tree.max(b.frame_max(p)),
            _ => tree,
        }
    }

    /// Whether the collective failed for good: every later part fails at once.
    pub fn failed(&self) -> bool {
        self.failed.is_some()
    }

    /// Bytes this node holds: parts gathered and frames not yet taken by [`Node::poll`].
    pub fn held(&self) -> usize {
        self.gather.held() + self.bruck.as_ref().map_or(0, Bruck::held) + self.outbox.held()
    }

    /// The most bytes this node has held at once.
    pub fn peak_held(&self) -> usize {
        self.peak
    }

    /// The shell's part of the exchange in progress. Its result comes as [`Output::Done`] or
    /// [`Output::Failed`]; until then no other part is taken.
    pub fn contribute(&mut self, part: Vec<u8>) -> Result<(), ContributeError> {
        if self.finished {
            return Err(ContributeError::Finished);
        }
        if self.waiting {
            return Err(ContributeError::Outstanding { epoch: self.epoch });
        }
        if let Some(why) = &self.failed {
            let failed = Output::Failed { epoch: self.epoch, message: why.clone() };
            self.outbox.push(failed);
            return Ok(());
        }
        self.waiting = true;
        let taken = match &mut self.bruck {
            Some(b) => b.own(self.epoch, part),
            None => self.gather.own(self.epoch, part),
        };
        match taken {
            Ok(()) => self.advance(),
            Err(r) => self.refuse(r),
        }
        self.note_peak();
        Ok(())
    }

    /// A frame from `from`.
    pub fn receive(&mut self, from: Peer, frame: Bytes) {
        if self.failed.is_some() {
            return;
        }
        let decoded = match super::read(from, Peer::Node(self.me), &frame, self.frame_max(from), self.bounds.part_max) {
            Ok(f) => f,
            Err(what) => return self.fail_from(from, what),
        };
        if let (Some(b), Peer::Node(p), Frame::Bye) = (&mut self.bruck, from, &decoded) {
            b.peer_done(p);
        }
        let bruck_peer = |p: Peer| matches!((&self.bruck, p), (Some(b), Peer::Node(n)) if b.is_peer(n));
        let from_peer = bruck_peer(from);
        match (self.role(from), decoded) {
            (_, Frame::Round { epoch, round, parts }) if from_peer => self.round(from, epoch, round, parts, false),
            (Role::Child(c), Frame::Contrib { epoch, parts }) if self.bruck.is_none() => {
                self.contribution(c, epoch, parts)
            }
            (Role::Parent, Frame::All { epoch, parts }) if self.bruck.is_none() => self.result(epoch, parts),
            (Role::Parent, Frame::Fail { epoch, message }) if epoch == self.epoch => self.stop(frame, message, None),
            // A root above the top counts no exchanges: its FAIL is for the one in progress, and goes down so.
            (Role::Parent, Frame::Fail { message, .. }) if self.under_root_above_top() => {
                self.stop(frame::fail(self.epoch, &message), message, None)
            }
            (Role::Parent, Frame::End) => self.stop(frame, "the root ended the job".into(), None),
            // A peer in the rounds, or the parent, failed whichever exchange it is in (with Bruck's allgather a
            // node may be one ahead): the job is ending.
            (role, Frame::Fail { message, .. }) if from_peer || (self.bruck.is_some() && role == Role::Parent) => {
                self.stop(frame::fail(self.epoch, &message), message, None)
            }
            (Role::Parent, Frame::Bye) if from != Peer::Root => {
                self.parent_done = true;
                // A parent that is also a source of a round may leave the exchange in progress blocked.
                if self.bruck.is_some() {
                    self.advance();
                }
            }
            (Role::Child(c), Frame::Bye) => {
                self.gather.done(c);
                self.advance();
            }
            (Role::Stranger, Frame::Bye) if from_peer => self.advance(),
            (role, f) => {
                let why = match (role, &f) {
                    (Role::Parent, Frame::Fail { .. }) => format!("during PMI exchange {}", self.epoch),
                    (_, Frame::Contrib { .. } | Frame::All { .. }) if self.bruck.is_some() => {
                        "whose exchanges go by Bruck's allgather".into()
                    }
                    (_, Frame::Round { .. }) => "which exchanges no rounds with it".into(),
                    (_, Frame::Contrib { .. }) => "which is not its parent".into(),
                    (_, Frame::Lost { .. } | Frame::Report(_)) => "which only the root takes".into(),
                    (Role::Parent, Frame::Bye) => "which the root never sends".into(),
                    _ => format!("whose parent is {}", self.parent),
                };
                let what = format!("{from} sent {f} to node {}, {why}", self.me);
                self.fail_from(from, what);
            }
        }
        self.note_peak();
    }

    /// `peer` closed its connection to this node.
    pub fn lost(&mut self, peer: Peer) {
        if self.failed.is_some() {
            return;
        }
        let pending = self.waiting || self.started();
        match self.role(peer) {
            Role::Child(c) if !self.gather.is_done(c) => {
                self.outbox.send(Peer::Root, frame::lost(c));
                // The top has no one above it to fail the exchange: it does, rather than wait for the root.
                if self.tree.top() == Peer::Node(self.me) {
                    self.fail_from(peer, super::lost_node(c, self.me));
                }
            }
            Role::Child(_) | Role::Stranger => {
                let lost_peer = match (&self.bruck, peer) {
                    (Some(b), Peer::Node(p)) if b.is_peer(p) && !b.is_done(p) => Some(p),
                    _ => None,
                };
                // A peer in the rounds that leaves without a goodbye can be no one's normal end.
                if let Some(p) = lost_peer.filter(|_| !self.finished) {
                    self.fail_from(peer, super::lost_node(p, self.me));
                }
            }
            Role::Parent | Role::Root => {
                let said_done = self.finished || (peer == self.parent && self.parent_done);
                if said_done && !pending {
                    self.gone = Some((peer, self.epoch));
                    return;
                }
                if said_done && self.bruck.is_some() && peer != Peer::Root {
                    self.gone = Some((peer, self.epoch.wrapping_add(1)));
                    return;
                }
                let during = if pending { format!(" during PMI exchange {}", self.epoch) } else { String::new() };
                let what = format!("node {} lost its connection to {peer}{during}", self.me);
                self.fail_from(peer, what);
            }
        }
    }

    /// The shell is done: every task has closed its PMI connection. Tells the parent, the root and the
    /// children, so that this node's connections closing later is not taken for a failure.
    pub fn finish(&mut self) {
        if std::mem::replace(&mut self.finished, true) {
            return;
        }
        let bye = frame::bye();
        self.outbox.send(Peer::Root, bye.clone());
        for p in self.peers() {
            self.outbox.send(Peer::Node(p), bye.clone());
        }
        if self.failed.is_none() {
            self.gather.done(self.me);
            if let Some(b) = &mut self.bruck {
                b.own_done();
            }
            self.advance();
        }
    }

    /// Sends the host's report (of an abort or an error) to the root.
    pub fn report(&mut self, bytes: &[u8]) -> Result<(), TooLarge> {
        self.outbox.send(Peer::Root, frame::report(bytes)?);
        Ok(())
    }

    /// This node is the top and its parent the root, which hears only control frames.
    fn under_root_above_top(&self) -> bool {
        self.parent == Peer::Root && self.tree.top() != Peer::Root
    }

    fn role(&self, peer: Peer) -> Role {
        match peer {
            p if p == self.parent => Role::Parent,
            Peer::Root => Role::Root,
            Peer::Node(n) if self.tree.is_child(Peer::Node(self.me), n) => Role::Child(n),
            Peer::Node(_) => Role::Stranger,
        }
    }

    /// Child `child`'s CONTRIB.
    fn contribution(&mut self, child: u32, epoch: u32, parts: Parts) {
        if self.sent && epoch == self.epoch {
            let what = format!("node {child} sent its parts of PMI exchange {epoch} twice");
            return self.fail_from(Peer::Node(child), what);
        }
        match self.gather.child(self.epoch, child, epoch, parts) {
            Ok(()) => self.advance(),
            Err(r) => self.refuse(r),
        }
    }

    /// Whether anyone's part of the exchange in progress is in here.
    fn started(&self) -> bool {
        self.bruck.as_ref().map_or_else(|| self.gather.started(), Bruck::started)
    }

    /// Round `round` of exchange `epoch` from `from`: as it comes, or `replayed` once its exchange is the one in
    /// progress (it came early, before any goodbye of its sender's).
    fn round(&mut self, from: Peer, epoch: u32, round: u8, parts: Parts, replayed: bool) {
        let (Some(b), Peer::Node(p)) = (&mut self.bruck, from) else { return };
        match b.round(self.epoch, p, epoch, round, parts, replayed) {
            Ok(()) => self.advance(),
            Err(r) => self.refuse(r),
        }
    }

    /// Sends the exchange's CONTRIB up (or its rounds) once every part they need is in, or fails it if it
    /// cannot complete.
    fn advance(&mut self) {
        let blocked = match &self.bruck {
            // This node's own absence is for its peers to find, from its goodbye: each has it as the source of a
            // round, and their reports come with their word that they wait (which names the rank that left).
            Some(b) => b.blocked(self.epoch).filter(|r| r.node != self.me),
            None => self.gather.blocked(self.epoch),
        };
        if let Some(r) = blocked {
            return self.refuse(r);
        }
        if let Some((peer, _)) = self.gone.filter(|&(_, first)| first == self.epoch && self.started()) {
            let what = format!(
                "PMI exchange {} cannot complete: {peer} has closed its connection to node {}",
                self.epoch, self.me
            );
            return self.fail_from(peer, what);
        }
        if self.bruck.is_some() {
            return self.advance_rounds();
        }
        if !self.gather.complete() {
            return;
        }
        let top = self.tree.top() == Peer::Node(self.me);
        match self.gather.frame(self.epoch) {
            Ok(frame) => {
                self.peak = self.peak.max(self.held() + frame.len());
                self.gather.clear();
                if !top {
                    self.outbox.send(self.parent, frame);
                    self.sent = true;
                    return;
                }
                self.complete_own(&frame);
            }
            Err(e) => {
                let what = format!("node {} cannot send up PMI exchange {}: {e}", self.me, self.epoch);
                self.fail_from(Peer::Node(self.me), what);
            }
        }
    }

    /// Sends the rounds due; once every round is in, makes the result and takes the next exchange's rounds
    /// that came early.
    fn advance_rounds(&mut self) {
        let Some(b) = &mut self.bruck else { return };
        let epoch = self.epoch;
        let made = b.sends(epoch).and_then(|due| {
            let all = if b.complete() { Some(b.result(epoch)?) } else { None };
            Ok((due, all))
        });
        let (due, all) = match made {
            Ok(made) => made,
            Err(e) => {
                let what = format!("node {} cannot send its rounds of PMI exchange {epoch}: {e}", self.me);
                return self.fail_from(Peer::Node(self.me), what);
            }
        };
        for (to, frame) in due {
            self.outbox.send(Peer::Node(to), frame);
        }
        let Some(all) = all else { return };
        self.peak = self.peak.max(self.held() + all.len());
        let Some(b) = &mut self.bruck else { return };
        let early = b.clear();
        if !self.complete_own(&all) {
            return;
        }
        for (round, parts) in early {
            let from = Peer::Node(super::bruck::source(self.tree.nodes(), self.me, u32::from(round)));
            self.round(from, self.epoch, round, parts, true);
        }
    }

    /// Completes the exchange with a result this node made itself (an ALL it decodes, since it checked every
    /// part as it took it); false if it could not.
    fn complete_own(&mut self, all: &Bytes) -> bool {
        match Frame::decode(all, usize::MAX) {
            Ok(Frame::All { epoch, parts }) => {
                self.complete(epoch, parts);
                true
            }
            _ => {
                self.fail_from(Peer::Node(self.me), format!("node {} made an unreadable result", self.me));
                false
            }
        }
    }

    /// Exchange `epoch`'s result: passed on to the children unchanged (in the tree), then the exchange is
    /// done here.
    fn complete(&mut self, epoch: u32, parts: Parts) {
        let children = if self.bruck.is_some() { 0..0 } else { self.tree.children(Peer::Node(self.me)) };
        for c in children {
            self.outbox.send(Peer::Node(c), parts.frame().clone());
        }
        self.outbox.push(Output::Done { epoch, parts });
        self.epoch = self.epoch.wrapping_add(1);
        self.sent = false;
        self.waiting = false;
    }

    /// The parent's ALL.
    fn result(&mut self, epoch: u32, parts: Parts) {
        let parent = self.parent;
        let why = if !self.sent {
            format!("which nobody at node {} waits for", self.me)
        } else if epoch != self.epoch {
            format!("while node {} waits for exchange {}", self.me, self.epoch)
        } else if parts.frame().len() > self.all_max {
            format!("{} bytes, more than the {} node {} takes", parts.frame().len(), self.all_max, self.me)
        } else if parts.len() != self.tree.nodes() as usize {
            format!("{} parts for {} nodes", parts.len(), self.tree.nodes())
        } else if let Some((place, node)) = parts.misplaced() {
            format!("its part {place} for node {node}")
        } else {
            return self.complete(epoch, parts);
        };
        self.fail_from(parent, format!("{parent} sent the result of PMI exchange {epoch}, {why}"));
    }

    fn refuse(&mut self, r: Refusal) {
        self.fail_from(Peer::Node(r.node), r.message);
    }

    /// Fails for good with a job error that `at` caused.
    fn fail_from(&mut self, at: Peer, message: String) {
        let node = match at {
            Peer::Root => None,
            Peer::Node(n) => Some(n),
        };
        self.stop(frame::fail(self.epoch, &message), message.clone(), Some(Output::JobError { node, message }));
    }

    /// Fails for good: reports `error` if any, sends `down` (a FAIL or END) to the children, and a FAIL to
    /// the peers in Bruck's rounds too (whose parents may have left), and fails the shell's exchange if it
    /// waits.
    fn stop(&mut self, down: Bytes, message: String, error: Option<Output>) {
        if let Some(error) = error {
            self.outbox.push(error);
        }
        let to = match &self.bruck {
            Some(_) if frame::is_fail(&down) => self.peers(),
            _ => self.tree.children(Peer::Node(self.me)).collect(),
        };
        // The parent hears a failure from below only where it is a peer in the rounds, which takes it.
        let peer = |p: u32| self.bruck.as_ref().is_some_and(|b| b.is_peer(p));
        for p in to.into_iter().filter(|&p| Peer::Node(p) != self.parent || peer(p)) {
            self.outbox.send(Peer::Node(p), down.clone());
        }
        if std::mem::replace(&mut self.waiting, false) {
            self.outbox.push(Output::Failed { epoch: self.epoch, message: message.clone() });
        }
        self.gather.clear();
        self.failed = Some(message);
    }

    fn note_peak(&mut self) {
        self.peak = self.peak.max(self.held());
    }
}

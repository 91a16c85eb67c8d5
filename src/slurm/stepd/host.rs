//! The I/O around a slurmstepd's [`NodeMonitor`]: the engine's host on the node's progress thread. Its epoll
//! loop serves, beside the tasks' connections (the [`crate::runtime`] runtime's), every connection of the tree
//! (non-blocking, each with a queue: a slow peer never holds the tasks' answers), the admission of the
//! node's higher peers ([`super::super::admit`]), the fork-notice pipe and a timer. It reads whole frames and
//! hands them to the monitor, and carries out what the monitor asks, in order; it decides nothing.

use super::join::TreeLinks;
use super::monitor::{NodeAction, NodeMonitor, NodeShape, END_PATIENCE, JOINED_AFTER};
use super::plan::Place;
use crate::collective::{frame, Peer};
use crate::driver::{HostFds, Watcher};
use crate::os;
use crate::runtime::{ChildEnds, NodeHost};
use crate::server::{GroupExchange, Host, HostRequest, JobError, Server, Speaker, TaskId};
use crate::slurm::admit::{Acceptor, Admission};
use crate::slurm::link::{Link, Read, Watch, CONTROL_QUEUED_MAX};
use crate::slurm::protocol;
use crate::slurm::sys::Slurm;
use crate::slurm::trace::Trace;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long `fini` lets the progress thread say BYE before it cuts the connection.
pub const FINI_GRACE: Duration = Duration::from_secs(2);
/// At its end a stepd waits for its peers to take its last frames (a large last result, say) as long as
/// they keep taking them, but no longer than their bytes take at this rate (bytes a second, about half what
/// gigabit Ethernet carries), and [`DRAIN_LONGEST`] at most: Slurm's own end of the step waits for `fini`.
const DRAIN_RATE_MIN: u64 = 64 << 20;
const DRAIN_LONGEST: Duration = Duration::from_secs(30);
/// How long a node that said BYE waits, at most, for srun and its peers to close their ends after it.
const LINGER: Duration = Duration::from_millis(500);

/// The fork notice a task child writes: every task is forked, and whether its task info confirmed the ids.
pub const NOTICE_FORKED: u8 = 0;
pub const NOTICE_IDS_CONFIRMED: u8 = 1;

/// Asks slurmctld to end the step this stepd serves, once a task has confirmed its ids.
fn kill_own_step(slurm: &Slurm, ids_confirmed: bool, place: &Place) -> Result<(), String> {
    if !ids_confirmed {
        return Err(format!(
            "not ending step {}.{} from here: no task has confirmed that Slurm runs it under these ids",
            place.job, place.step
        ));
    }
    slurm.kill_step(&place.id, libc::SIGKILL, place.leads_hetjob)
}

/// The epoll tokens of the stepd's own fds in the progress loop.
const UPLINK: u64 = 0;
const NOTICE: u64 = 1;
const TIMER: u64 = 2;
/// The connection of the i-th peer, in node order, has `PEERS + i`.
const PEERS: u64 = 16;

/// The engine's host on a slurmstepd: the I/O around the node's [`NodeMonitor`]. It runs on the progress
/// thread and serves, beside the tasks, every connection of the tree, the admission of the node's higher
/// peers and the fork-notice pipe in the same loop: nothing it does blocks the tasks' answers.
pub struct SlurmHost {
    place: Place,
    /// Every node's name, for messages.
    names: Vec<String>,
    /// Decides; this host carries out what it asks.
    monitor: NodeMonitor,
    epoll: Option<Arc<dyn Watch>>,
    /// The connection to srun, while the monitor serves it.
    uplink: Option<Link>,
    /// Each peer's connection (lower peers' from prefork, higher peers' once admitted), in node order, while
    /// the monitor serves it.
    peers: Vec<(u32, Option<Link>)>,
    /// Admits the higher peers still to come (a node with none has none).
    acceptor: Option<Acceptor>,
    /// Higher peers admitted in prefork, whose input is heard once the loop watches them.
    unheard: Vec<u32>,
    /// Wakes the loop at the acceptor's deadlines, at `end_by` and at `tell_joined_at`.
    timer: OwnedFd,
    /// What `timer` is set to, so that it is set only when that changes (not on every event).
    timer_at: Option<Instant>,
    /// When to look whether the shell has waited [`JOINED_AFTER`] in the exchange it joined last; then srun
    /// is told ([`NodeMonitor::waited_long`]). Set when the shell joins and nothing is set: a fence costs
    /// the timer nothing, and it wakes the loop at most once per [`JOINED_AFTER`].
    tell_joined_at: Option<Instant>,
    /// When the shell joined an exchange last.
    joined_since: Option<Instant>,
    /// When srun was told the step must end: if the step still runs then, this node ends it (srun is the
    /// user's, and may not act).
    end_by: Option<Instant>,
    slurm: &'static Slurm,
    /// The wire trace (`PMI_DEBUG`); its writer stops when the progress thread drops its host.
    trace: Option<Trace>,
    /// The read end of the fork-notice pipe, and the node's copies of the tasks' ends it closes.
    notify: OwnedFd,
    pub child_ends: Option<ChildEnds>,
    /// A task child found Slurm's task info naming the step read from the step record: only then does the
    /// stepd ask slurmctld to end that step.
    ids_confirmed: bool,
    /// Set by `fini`: the step ending now is the normal end.
    stopping: Arc<AtomicBool>,
    /// The most output a link may hold that its peer has not taken.
    queued_max: usize,
    buf: Vec<u8>,
}

impl SlurmHost {
    /// The host of node `place.node` of `tree`, over the connections it made in prefork.
    pub fn new(
        shape: NodeShape,
        links: TreeLinks,
        slurm: &'static Slurm,
        trace: Option<Trace>,
        notify: OwnedFd,
        stopping: Arc<AtomicBool>,
    ) -> Result<SlurmHost, String> {
        let socket = |e: io::Error| format!("socket: {e}");
        let all_max = frame::parts_len(shape.names.len(), shape.limits.kvs_bytes_max);
        // What a link may hold unsent: an exchange's frame, the group exchanges' parts (held to the store's
        // bound) and the control frames the tasks' requests make.
        let queued_max = all_max.saturating_add(shape.limits.kvs_bytes_max).saturating_add(CONTROL_QUEUED_MAX);
        let (place, names) = (shape.place.clone(), shape.names.clone());
        let mut monitor = NodeMonitor::new(shape)?;
        let mut peers: Vec<(u32, Option<Link>)> = monitor.peers().into_iter().map(|p| (p, None)).collect();
        let token = |p: u32| peers.iter().position(|(q, _)| *q == p).map(|i| PEERS + i as u64);
        let mut below = Vec::new();
        for (p, stream) in links.below {
            match (stream, token(p)) {
                (Some(s), Some(t)) => below.push((p, Link::new(s, t, Default::default(), queued_max).map_err(socket)?)),
                _ => monitor.peer_done(p),
            }
        }
        let mut above = Vec::new();
        for j in links.above {
            let t = token(j.node).ok_or_else(|| format!("node {} was admitted, which is no peer", j.node))?;
            above.push((j.node, Link::new(j.stream, t, j.input, queued_max).map_err(socket)?));
        }
        for (p, link) in below.into_iter().chain(above) {
            if let Some(slot) = peers.iter_mut().find(|(q, _)| *q == p) {
                slot.1 = Some(link);
            }
        }
        let mut host = SlurmHost {
            peers,
            unheard: Vec::new(),
            place,
            names,
            monitor,
            epoll: None,
            uplink: Some(Link::new(links.srun, UPLINK, Default::default(), queued_max).map_err(socket)?),
            queued_max,
            timer: timer()?,
            timer_at: None,
            end_by: None,
            tell_joined_at: None,
            joined_since: None,
            acceptor: links.acceptor,
            slurm,
            trace,
            notify,
            child_ends: None,
            ids_confirmed: false,
            stopping,
            buf: vec![0; 64 * 1024],
        };
        // The higher peers admitted in prefork: what they sent after their proof is read once the loop runs.
        let me = host.place.node;
        host.unheard = host.peers.iter().filter(|(p, l)| *p > me && l.is_some()).map(|(p, _)| *p).collect();
        for p in host.unheard.clone() {
            host.monitor.peer_joined(p);
        }
        Ok(host)
    }

    /// Where the connection to `peer` is kept while it is served.
    fn slot(&mut self, peer: Peer) -> Option<&mut Option<Link>> {
        match peer {
            Peer::Root => Some(&mut self.uplink),
            Peer::Node(p) => {
                let i = self.peers.binary_search_by_key(&p, |(q, _)| *q).ok()?;
                Some(&mut self.peers[i].1)
            }
        }
    }

    /// Does what the monitor asks, then tells it of the links that broke while this node sent on them (a peer
    /// that stopped reading leaves the link broken at once, not its output growing), as the peer's close
    /// would, until nothing is left to do.
    fn carry_out(&mut self) {
        loop {
            while let Some(action) = self.monitor.poll() {
                self.act(action);
            }
            let peers = self.peers.iter().filter_map(|(p, l)| Some((Peer::Node(*p), l.as_ref()?)));
            let mut links = self.uplink.as_ref().map(|l| (Peer::Root, l)).into_iter().chain(peers);
            match links.find(|(_, l)| l.is_broken()).map(|(peer, l)| (peer, l.broke_why())) {
                Some((peer, why)) => self.monitor.closed(peer, &why),
                None => return,
            }
        }
    }

    fn act(&mut self, action: NodeAction) {
        match action {
            NodeAction::Report(frame) => {
                if let Some(l) = &mut self.uplink {
                    l.send(frame);
                }
            }
            NodeAction::Send { to, direction, frame } => {
                if let Some(l) = self.slot(to).and_then(Option::as_mut) {
                    let _ = l.send_collective(direction, &frame);
                }
            }
            NodeAction::Drop(peer) => {
                if let Some(slot) = self.slot(peer) {
                    *slot = None;
                }
            }
            NodeAction::Log { level, text } => self.slurm.log(level, &text),
            NodeAction::Trace(line) => {
                if let Some(t) = &self.trace {
                    t.line(&line);
                }
            }
            NodeAction::EndHere { why } if self.stopping.load(SeqCst) => self.monitor.log(log::Level::Info, &why),
            NodeAction::EndHere { why } => {
                let Place { job, step, node_name, .. } = &self.place;
                self.slurm.error(&format!("step {job}.{step} on {node_name}: {why}; ending the step"));
                if let Err(e) = kill_own_step(self.slurm, self.ids_confirmed, &self.place) {
                    self.slurm.info(&e);
                }
            }
            NodeAction::AwaitEnd => {
                self.end_by = Some(Instant::now() + END_PATIENCE);
                self.arm_timer();
            }
        }
    }

    /// Notices from the task children: every task is forked (see the module's documentation). The pipe stays
    /// open (a child writing to a pipe nobody reads would die of SIGPIPE) and is drained.
    fn take_notices(&mut self) {
        if let Some(ends) = &self.child_ends {
            ends.close_all();
        }
        let mut notices = [0u8; 256];
        // SAFETY: reading into our buffer from our non-blocking pipe.
        let n = unsafe { libc::read(self.notify.as_raw_fd(), notices.as_mut_ptr().cast(), notices.len()) };
        if n == 0 {
            // Every child and the stepd's own copy closed the write end: nothing more will come.
            if let Some(w) = &self.epoll {
                let _ = w.remove(self.notify.as_raw_fd());
            }
        }
        if notices[..n.max(0) as usize].contains(&NOTICE_IDS_CONFIRMED) {
            self.ids_confirmed = true;
        }
    }

    /// Reads once from `peer`'s connection (at most the buffer's length) and hands the monitor every whole
    /// frame now in its input, then why the connection is done, if it is. Frames that came before a close
    /// are handed over before it. One read per wake-up: a peer that writes without pause (srun is the
    /// user's) is served a buffer at a time, epoll (level-triggered) calls again for the rest, and what the
    /// node holds of it stays within one buffer's frames; the rest waits in the socket, and TCP holds the
    /// writer back.
    fn hear(&mut self, peer: Peer, events: u32) {
        let max = self.monitor.frame_max(peer);
        // Out of its slot while the monitor hears it (the monitor's actions are carried out after).
        if let Some(mut link) = self.slot(peer).and_then(Option::take) {
            if events & libc::EPOLLOUT as u32 != 0 {
                link.flush();
            }
            let closed = match link.read(&mut self.buf) {
                Read::Data(_) | Read::Blocked => None,
                Read::Closed(why) => Some(why),
            };
            loop {
                match link.next_owned(max) {
                    Ok(None) => break,
                    // Nobody can have put together a result with this node's parts while they are still
                    // here: a peer that sends one anyway would have this node hold its parts, queued, beside
                    // results and the next exchanges for as long as it does not read.
                    Ok(Some(payload)) if protocol::is_result(&payload) && link.holds_unwritten_contrib() => {
                        let why = "sent the result of a PMI exchange before this node's part of it was sent";
                        self.monitor.broke(peer, why);
                        break;
                    }
                    Ok(Some(payload)) => self.monitor.heard(peer, payload),
                    Err(e) => {
                        self.monitor.broke(peer, &format!("sent {e}"));
                        break;
                    }
                }
            }
            // Every frame was handed out: a small frame's buffer need not stay allocated.
            link.release();
            if let Some(slot) = self.slot(peer) {
                *slot = Some(link);
            }
            if let Some(why) = closed {
                self.monitor.closed(peer, &why);
            }
        }
        self.carry_out();
    }

    /// Takes what the acceptor has: admitted higher peers, and lines about refusals.
    fn admissions(&mut self) {
        while let Some(event) = self.acceptor.as_mut().and_then(Acceptor::poll) {
            match event {
                Admission::Debug(line) => self.monitor.log(log::Level::Debug, &line),
                Admission::Joined(j) => {
                    let Ok(i) = self.peers.binary_search_by_key(&j.node, |(q, _)| *q) else { continue };
                    let link = Link::new(j.stream, PEERS + i as u64, j.input, self.queued_max).and_then(|mut l| {
                        if let Some(w) = &self.epoll {
                            l.watch(w.clone())?;
                        }
                        Ok(l)
                    });
                    match link {
                        Ok(l) => {
                            self.peers[i].1 = Some(l);
                            self.monitor.peer_joined(j.node);
                            // What it sent right after its proof.
                            self.hear(Peer::Node(j.node), 0);
                        }
                        Err(e) => {
                            let what = format!("cannot serve the connection of {}: {e}", self.names[j.node as usize]);
                            self.monitor.fault(&what);
                        }
                    }
                }
            }
        }
        self.carry_out();
    }

    /// Arms the timer for the next deadline (the acceptor's, `end_by` or `tell_joined_at`), or disarms it.
    fn arm_timer(&mut self) {
        let deadlines = [self.end_by, self.tell_joined_at].into_iter().flatten();
        let next = self.acceptor.as_ref().and_then(Acceptor::deadline).into_iter().chain(deadlines).min();
        if next == self.timer_at {
            return;
        }
        self.timer_at = next;
        let after = next.map(|at| at.saturating_duration_since(Instant::now()));
        // Setting a live timerfd to a valid time does not fail.
        let _ = os::set_timer(&self.timer, after);
    }

    /// Every connection of the tree this node still has.
    fn links(&mut self) -> Vec<&mut Link> {
        let peers = self.peers.iter_mut().filter_map(|(_, l)| l.as_mut());
        self.uplink.iter_mut().chain(peers).collect()
    }
}

impl HostFds for SlurmHost {
    fn watch(&mut self, watcher: Watcher) {
        let epoll: Arc<dyn Watch> = Arc::new(watcher);
        let events = libc::EPOLLIN as u32;
        let mut failed = Vec::new();
        for link in self.links() {
            if let Err(e) = link.watch(epoll.clone()) {
                failed.push(e);
            }
        }
        if let Some(a) = &mut self.acceptor {
            if let Err(e) = a.watch(epoll.clone()) {
                failed.push(e);
            }
        }
        if let Err(e) = epoll.add(self.timer.as_raw_fd(), events, TIMER) {
            failed.push(e);
        }
        if let Err(e) = epoll.add(self.notify.as_raw_fd(), events, NOTICE) {
            self.slurm.error(&format!("cannot watch the tasks' notices: {e}"));
        }
        self.epoll = Some(epoll);
        if let Some(e) = failed.first() {
            self.monitor.fault(&format!("cannot watch the connections of the PMI tree: {e}"));
            self.carry_out();
        }
        for p in std::mem::take(&mut self.unheard) {
            self.hear(Peer::Node(p), 0);
        }
    }

    fn ready(&mut self, token: u64, events: u32) {
        match token {
            NOTICE => self.take_notices(),
            TIMER => {
                os::drain_counter(&self.timer);
                self.timer_at = None;
                if let Some(a) = &mut self.acceptor {
                    a.tick();
                }
                self.admissions();
                if self.end_by.is_some_and(|at| at <= Instant::now()) {
                    self.end_by = None;
                    self.monitor.srun_too_slow();
                    self.carry_out();
                }
                let now = Instant::now();
                if self.tell_joined_at.is_some_and(|at| at <= now) {
                    self.tell_joined_at = None;
                    match self.joined_since.map(|since| since + JOINED_AFTER) {
                        // The shell joined another exchange since: look again when it has waited long in that.
                        Some(at) if at > now => self.tell_joined_at = Some(at),
                        _ => {
                            self.monitor.waited_long();
                            self.carry_out();
                        }
                    }
                }
            }
            UPLINK => self.hear(Peer::Root, events),
            t if self.acceptor.as_ref().is_some_and(|a| a.owns(t)) => {
                if let Some(a) = &mut self.acceptor {
                    a.ready(t);
                }
                self.admissions();
            }
            t if t >= PEERS => {
                if let Some(&(p, _)) = self.peers.get((t - PEERS) as usize) {
                    self.hear(Peer::Node(p), events);
                }
            }
            _ => {}
        }
        self.arm_timer();
    }

    /// Hands the shell what the collective completed for it, and srun's answers.
    fn complete(&mut self, server: &mut Server) {
        match self.monitor.take_completion() {
            Some(Ok(parts)) => {
                let parts: Vec<&[u8]> = parts.iter().map(|(_, bytes)| bytes).collect();
                server.collective_complete(Ok(&parts));
            }
            Some(Err(why)) => server.collective_complete(Err(&why)),
            None => {}
        }
        for (task, reply) in self.monitor.take_answers() {
            server.host_reply(task, reply);
        }
        for done in self.monitor.take_groups_done() {
            // One slice per member node: srun's frame had exactly that many parts.
            let parts: Vec<&[u8]> = done.parts().collect();
            server.group_complete(done.id(), Ok(&parts));
        }
    }
}

impl Host for SlurmHost {
    fn collective(&mut self, contribution: &[u8]) -> Result<(), String> {
        let joined = self.monitor.contribute(contribution);
        self.carry_out();
        if joined.is_ok() {
            let now = Instant::now();
            self.joined_since = Some(now);
            if self.tell_joined_at.is_none() {
                self.tell_joined_at = Some(now + JOINED_AFTER);
                self.arm_timer();
            }
        }
        joined
    }

    fn serves_groups(&self) -> bool {
        true
    }

    fn group_collective(&mut self, exchange: &GroupExchange<'_>, contribution: &[u8]) -> Result<(), String> {
        let asked = self.monitor.group(exchange, contribution);
        self.carry_out();
        asked
    }

    fn abort(&mut self, rank: u32, exit_code: i32, message: &str) {
        self.monitor.abort(rank, exit_code, message);
        self.carry_out();
    }

    fn job_error(&mut self, error: &JobError) {
        self.monitor.job_error(error);
        self.carry_out();
    }

    fn log(&mut self, level: log::Level, message: &str) {
        self.monitor.log(level, message);
        self.carry_out();
    }

    fn trace(&mut self, rank: u32, speaker: Speaker, line: &[u8]) {
        if let Some(t) = &self.trace {
            t.line(&format!("rpmi: rank {rank} {speaker}: {}", String::from_utf8_lossy(line)));
        }
    }

    fn task_started(&mut self, rank: u32) {
        self.monitor.task_started(rank);
        self.carry_out();
    }

    fn task_closed(&mut self, rank: u32, finalized: bool) {
        self.monitor.task_closed(rank, finalized);
        self.carry_out();
    }

    fn request(&mut self, task: TaskId, request: HostRequest) -> Result<(), String> {
        let asked = self.monitor.request(task, &request);
        self.carry_out();
        asked
    }
}

impl NodeHost for SlurmHost {
    fn served(&mut self, result: Result<(), String>) {
        self.monitor.served(result);
        if let Some(a) = &mut self.acceptor {
            a.close();
        }
        self.admissions();
        // The loop no longer runs: what is queued goes now, within `fini`'s grace; to the peers (a large last
        // result, which node 0 queued for its children as its own tasks took it), for as long as they take it.
        Link::drain(&mut self.links(), Instant::now() + FINI_GRACE);
        let mut peers: Vec<&mut Link> = self.peers.iter_mut().filter_map(|(_, l)| l.as_mut()).collect();
        Link::drain_moving(&mut peers, FINI_GRACE, DRAIN_RATE_MIN, DRAIN_LONGEST);
        // Then each connection closes once its peer has read it all (srun and the peers close theirs on the
        // goodbye and the end that follows it).
        Link::linger(&mut self.links(), Instant::now() + LINGER);
    }
}

/// A timerfd for the acceptor's and the step's deadlines.
fn timer() -> Result<OwnedFd, String> {
    os::timerfd().map_err(|e| format!("timerfd: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::Allgather;
    use crate::collective::Bounds;
    use crate::runtime::{JobVars, Looping, NodeRuntime};
    use crate::server::{JobInfo, Limits, TaskMap};
    use crate::slurm::auth::Secret;
    use crate::slurm::client::bounds;
    use crate::slurm::protocol::{Down, FrameBuf, Up, CONTROL_MAX};
    use crate::slurm::records::slurm_step_id_t;
    use crate::slurm::root::tests::Record;
    use crate::slurm::root::{Outcome, RootThread, Step};
    use crate::slurm::stepd::join::{join_tree, Wiring};
    use std::io::{BufRead, BufReader, Write};
    use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};
    use std::os::fd::FromRawFd;
    use std::os::unix::net::UnixStream;

    const KVSNAME: &str = "rpmi_1.0";

    fn names(nodes: u32) -> Vec<String> {
        (1..=nodes).map(|n| format!("n{n}")).collect()
    }

    /// srun's root for a step of `nodes` nodes with one rank each, the width left to the stepds.
    fn srun(nodes: u32, secret: &Secret) -> (RootThread, Record) {
        let record = Record::default();
        let step = Step {
            node_names: names(nodes),
            node_of: (0..nodes).collect(),
            secret: secret.clone(),
            addresses: None,
            bounds: bounds(1 << 20, 4 << 20),
            width: None,
            allgather: None,
            spawn: None,
            spawned_by: None,
        };
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        (RootThread::start(listener, step, Box::new(record.clone())).unwrap(), record)
    }

    /// Every node on this machine, as a local cluster's slurm.conf has them.
    fn loopback(_: u32, _: &str) -> Result<IpAddr, String> {
        Ok(Ipv4Addr::LOCALHOST.into())
    }

    /// A task's PMI connection.
    struct Task(BufReader<UnixStream>);

    impl Task {
        fn ask(&mut self, line: &str) -> String {
            self.0.get_mut().write_all(format!("{line}\n").as_bytes()).unwrap();
            let mut answer = String::new();
            self.0.read_line(&mut answer).unwrap();
            answer.trim_end().to_string()
        }
    }

    /// Node `node`'s stepd, as prefork makes it (joined to srun at `port` and to its parent), serving its one
    /// task (rank `node`) on a progress thread; and that task's connection.
    fn stepd(
        port: u16,
        nodes: u32,
        (width, allgather): (u32, Allgather),
        node: u32,
        secret: &Secret,
        bounds: Bounds,
    ) -> (NodeRuntime<SlurmHost>, Task) {
        let tree = crate::slurm::options::step_tree(nodes, width).unwrap();
        let names = names(nodes);
        let srun = [SocketAddr::from((Ipv4Addr::LOCALHOST, port))];
        let links = join_tree(&srun, Wiring { tree, allgather, node }, secret, &names, &loopback).unwrap();
        // SAFETY: slurm_step_id_t is plain integers: all zeroes is a valid value.
        let mut id: slurm_step_id_t = unsafe { std::mem::zeroed() };
        (id.job_id, id.step_id) = (1, 0);
        let place = Place { job: 1, step: 0, id, leads_hetjob: false, node, node_name: names[node as usize].clone() };
        let (notify, _) = os::pipe().unwrap();
        let stopping = Arc::new(AtomicBool::new(false));
        let shape = NodeShape {
            place,
            names: names.clone(),
            tree,
            allgather,
            bounds,
            limits: Limits::default(),
            spawned_ranks: None,
            traced: false,
        };
        let host = SlurmHost::new(shape, links, crate::slurm::sys::slurm(), None, notify, stopping).unwrap();
        let info = JobInfo::new(KVSNAME, TaskMap::new((0..nodes).collect()), vec![node], names);
        let server = Server::new(info, Limits::default()).unwrap();
        let mut rt = NodeRuntime::new(server, host, JobVars { job_id: "1.0".into() }).unwrap();
        let end = rt.connect_task(0).unwrap().child_fd;
        // SAFETY: a copy of the task's end, which the node closes once the task is "forked".
        let task = unsafe { UnixStream::from_raw_fd(libc::dup(end)) };
        rt.forked_all();
        rt.start(Looping::OwnThread).unwrap();
        task.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        (rt, Task(BufReader::new(task)))
    }

    /// Every node's stepd of a step of `nodes` nodes over a tree of `width`, each set up on a thread of its
    /// own (a child's prefork waits for its parent's progress loop, as on a cluster).
    fn stepds(port: u16, nodes: u32, wiring: (u32, Allgather), secret: &Secret) -> Vec<(NodeRuntime<SlurmHost>, Task)> {
        let threads: Vec<_> = (0..nodes)
            .rev()
            .map(|n| {
                let secret = secret.clone();
                std::thread::spawn(move || stepd(port, nodes, wiring, n, &secret, bounds(1 << 20, 4 << 20)))
            })
            .collect();
        let mut all: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        all.reverse();
        all
    }

    /// Each rank puts its key, all meet in a barrier, each reads every key; then they finalize and leave.
    fn exchange_every_put(tasks: &mut [Task]) {
        let nodes = tasks.len();
        for (rank, t) in tasks.iter_mut().enumerate() {
            assert!(t.ask("cmd=init pmi_version=1 pmi_subversion=2").contains("pmi_subversion=2"));
            let put = t.ask(&format!("cmd=put kvsname={KVSNAME} key=k{rank} value=v{rank}"));
            assert_eq!(put, "cmd=put_result rc=0");
        }
        for t in tasks.iter_mut() {
            t.0.get_mut().write_all(b"cmd=barrier_in\n").unwrap();
        }
        for t in tasks.iter_mut() {
            let mut answer = String::new();
            t.0.read_line(&mut answer).unwrap();
            // The stepd answers 1.2 to a client that asks for it: a plain barrier's answer carries tag 0.
            assert_eq!(answer.trim_end(), "cmd=barrier_out rc=0 tag=0");
        }
        for t in tasks.iter_mut() {
            for other in 0..nodes {
                let got = t.ask(&format!("cmd=get kvsname={KVSNAME} key=k{other}"));
                assert_eq!(got, format!("cmd=get_result rc=0 value=v{other}"));
            }
            assert_eq!(t.ask("cmd=finalize"), "cmd=finalize_ack rc=0");
        }
    }

    #[test]
    fn every_put_reaches_every_node_over_chains_and_trees() {
        let (tree, bruck) = (Allgather::Tree, Allgather::Bruck);
        for (nodes, wiring) in [(3, (1, tree)), (7, (2, tree)), (5, (8, tree)), (7, (2, bruck)), (5, (8, bruck))] {
            let secret = crate::slurm::random::secret().unwrap();
            let (root, record) = srun(nodes, &secret);
            let (nodes_rt, mut tasks): (Vec<_>, Vec<_>) =
                stepds(root.port(), nodes, wiring, &secret).into_iter().unzip();
            exchange_every_put(&mut tasks);
            drop(tasks);
            // Every task gone: each stepd says goodbye as its loop ends.
            drop(nodes_rt);
            let outcome = root.stop();
            let lines = record.lines();
            assert_eq!(outcome, Outcome::default(), "{nodes} nodes, {wiring:?}: {lines:?}");
            assert!(!lines.iter().any(|l| l.starts_with("error")), "{nodes} nodes, {wiring:?}: {lines:?}");
        }
    }

    /// The child process of [`srun_s_largest_frames_cost_a_stepd_their_bytes`] runs this attack.
    const SRUN_ATTACK: &str = "RPMI_TEST_SRUN_ATTACK";

    /// A figure of this process's `/proc/self/status`, in bytes.
    fn status(field: &str) -> usize {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with(field)).unwrap();
        line[field.len()..].trim().trim_end_matches("kB").trim().parse::<usize>().unwrap() * 1024
    }

    /// srun's side of the handshake, by hand, on the one connection a stepd makes: then srun is whoever
    /// holds this connection.
    fn admit(listener: &TcpListener, secret: &Secret) -> (std::net::TcpStream, FrameBuf) {
        use crate::slurm::auth::{self, Prover, Transcript};
        let (mut s, _) = listener.accept().unwrap();
        let mut input = FrameBuf::default();
        let mut next = |s: &mut std::net::TcpStream| loop {
            if let Some(payload) = input.next(CONTROL_MAX).unwrap() {
                return Up::decode(payload).unwrap();
            }
            let mut buf = [0; 4096];
            let n = std::io::Read::read(s, &mut buf).unwrap();
            assert!(n > 0, "the stepd closed its connection");
            input.extend(&buf[..n]);
        };
        let Up::Hello { node, nonce: joiner_nonce, .. } = next(&mut s) else { panic!("no HELLO") };
        let acceptor_nonce = crate::slurm::random::nonce().unwrap();
        s.write_all(&Down::Challenge { nonce: acceptor_nonce }.encode().unwrap()).unwrap();
        let t = Transcript { node, to: auth::ROOT, joiner_nonce, acceptor_nonce };
        let Up::Proof { proof } = next(&mut s) else { panic!("no PROOF") };
        assert!(secret.verify(Prover::Joiner, &t, &proof));
        s.write_all(&Down::Welcome { proof: secret.prove(Prover::Acceptor, &t) }.encode().unwrap()).unwrap();
        (s, input)
    }

    /// srun (the user's, modified) answers a task's barrier with a frame as large as a stepd takes at the
    /// default bounds (the store's, 512 MiB): the end of a group exchange made of nothing but empty parts (4
    /// bytes each on the wire), or of one part per member node as it should be, the first of them that large;
    /// or an exchange's result (ALL) of two parts as large as a node may bring. Each costs the stepd the
    /// frame's bytes, once (docs/security.md).
    #[test]
    fn srun_s_largest_frames_cost_a_stepd_their_bytes() {
        if let Some(attack) = std::env::var_os(SRUN_ATTACK) {
            return srun_attack(attack.to_str().unwrap());
        }
        for attack in ["group-empty", "group-large", "all"] {
            let exe = std::env::current_exe().unwrap();
            let test = "slurm::stepd::host::tests::srun_s_largest_frames_cost_a_stepd_their_bytes";
            let out = std::process::Command::new(exe)
                .args(["--exact", test, "--nocapture", "--test-threads=1"])
                .env(SRUN_ATTACK, attack)
                .output()
                .unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success(), "{}\n{stdout}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
            let figure = |key: &str| -> usize {
                let at = stdout.find(&format!("{key}=")).unwrap_or_else(|| panic!("no {key} in {stdout}"));
                stdout[at + key.len() + 1..].split_whitespace().next().unwrap().parse().unwrap()
            };
            let (frame, growth) = (figure("frame"), figure("growth"));
            eprintln!("{attack}: a frame of {frame} bytes from srun grew the stepd by {growth} bytes");
            assert!(growth <= frame + (64 << 20), "{attack}: {growth} bytes for a frame of {frame}");
        }
    }

    /// A frame as srun's side writes it: bytes, and runs of zeros written a piece at a time, so that the
    /// writer holds none of them.
    enum Piece {
        Bytes(Vec<u8>),
        Zeros(usize),
    }

    /// One attack of [`srun_s_largest_frames_cost_a_stepd_their_bytes`], in its own process.
    fn srun_attack(attack: &str) {
        let secret = crate::slurm::random::secret().unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let srun_secret = secret.clone();
        let group = attack.starts_with("group");
        let store = Limits::default().kvs_bytes_max;
        let attack = attack.to_string();
        let srun = std::thread::spawn(move || {
            let (mut s, mut input) = admit(&listener, &srun_secret);
            // The task's barrier reaches srun: a group's part, or (the node's part goes to no one: node 0 is the
            // tree's top, and node 1 never comes) that the node has waited in the exchange.
            let id = loop {
                if let Some(payload) = input.next(1 << 20).unwrap() {
                    match Up::decode(payload).unwrap() {
                        Up::Group { id, .. } if group => break id,
                        Up::Joined { .. } if !group => break Vec::new(),
                        _ => continue,
                    }
                }
                let mut buf = [0; 4096];
                let n = std::io::Read::read(&mut s, &mut buf).unwrap();
                assert!(n > 0, "the stepd closed its connection before its barrier reached srun");
                input.extend(&buf[..n]);
            };
            let mut head = vec![];
            let pieces = match attack.as_str() {
                "group-empty" | "group-large" => {
                    // Kind, id, count, then the parts: each empty (4 zero bytes), or one of all the rest
                    // (zeros, which no store takes) and one empty.
                    let rest = store - 1 - 2 - id.len() - 4;
                    let empty = attack == "group-empty";
                    head.push(0x8A);
                    head.extend((id.len() as u16).to_be_bytes());
                    head.extend(&id);
                    head.extend((if empty { rest / 4 } else { 2 } as u32).to_be_bytes());
                    match empty {
                        true => vec![Piece::Bytes(head), Piece::Zeros(rest / 4 * 4)],
                        false => {
                            head.extend(((rest - 8) as u32).to_be_bytes());
                            vec![Piece::Bytes(head), Piece::Zeros(rest - 8), Piece::Zeros(4)]
                        }
                    }
                }
                _ => {
                    // COLLECTIVE, then ALL of exchange 0: node 0's part and node 1's, each as large as a node
                    // may bring (half the store).
                    let part = store / 2 - 64;
                    head.extend([0x88, 0x81]);
                    head.extend([0u32, 2, 0, part as u32].iter().flat_map(|n| n.to_be_bytes()));
                    let second = [1u32, part as u32].iter().flat_map(|n| n.to_be_bytes()).collect();
                    vec![Piece::Bytes(head), Piece::Zeros(part), Piece::Bytes(second), Piece::Zeros(part)]
                }
            };
            let payload: usize = pieces
                .iter()
                .map(|p| match p {
                    Piece::Bytes(b) => b.len(),
                    Piece::Zeros(n) => *n,
                })
                .sum();
            s.write_all(&(payload as u32).to_be_bytes()).unwrap();
            let zeros = vec![0; 1 << 20];
            // The stepd may refuse the frame from its head and close before all of it is sent.
            let _ = pieces.iter().try_for_each(|p| match p {
                Piece::Bytes(b) => s.write_all(b),
                Piece::Zeros(n) => {
                    (0..*n).step_by(zeros.len()).try_for_each(|at| s.write_all(&zeros[..zeros.len().min(n - at)]))
                }
            });
            (4 + payload, s)
        });
        std::fs::write("/proc/self/clear_refs", "5").unwrap();
        let base = status("VmRSS:");
        // Node 0 of 2 (the tree's top, srun's child), with rank 0; node 1 never comes.
        let (rt, mut task) = stepd(port, 2, (2, Allgather::Tree), 0, &secret, bounds(store / 2, store));
        assert!(task.ask("cmd=init pmi_version=1 pmi_subversion=2").contains("pmi_subversion=2"));
        let barrier: &[u8] = if group { b"cmd=barrier_in group=0,1:5\n" } else { b"cmd=barrier_in\n" };
        task.0.get_mut().write_all(barrier).unwrap();
        let (frame, srun) = srun.join().unwrap();
        // Until the stepd has dealt with it: it drops srun or tells it something, or answers the task.
        let mut fds = [srun.as_raw_fd(), task.0.get_ref().as_raw_fd()].map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        });
        // SAFETY: a live array of pollfds, its length passed.
        assert!(unsafe { libc::poll(fds.as_mut_ptr(), 2, 20_000) } > 0, "the stepd did nothing with the frame");
        println!("frame={frame} growth={}", status("VmHWM:").saturating_sub(base));
        drop(task);
        drop(rt);
    }

    /// srun (the user's, modified) answers a barrier with a result it made up: srun sends no results (node 0 is
    /// the tree's top), so the stepd refuses it and drops srun, and the task's barrier fails.
    #[test]
    fn a_result_from_srun_is_refused() {
        let secret = crate::slurm::random::secret().unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let srun_secret = secret.clone();
        let srun = std::thread::spawn(move || {
            let (mut s, mut input) = admit(&listener, &srun_secret);
            let mut buf = [0; 4096];
            // The node has waited in exchange 0 (node 1 never comes).
            loop {
                if let Some(payload) = input.next(1 << 20).unwrap() {
                    if matches!(Up::decode(payload).unwrap(), Up::Joined { epoch: 0 }) {
                        break;
                    }
                    continue;
                }
                let n = std::io::Read::read(&mut s, &mut buf).unwrap();
                assert!(n > 0, "the stepd closed its connection before it joined the exchange");
                input.extend(&buf[..n]);
            }
            let all = frame::all(0, [(0, &[][..]), (1, &[][..])].into_iter()).unwrap();
            s.write_all(&Down::Collective(all).encode().unwrap()).unwrap();
            // The stepd drops srun (the connection ends) or goes on (it does not).
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            loop {
                match std::io::Read::read(&mut s, &mut buf) {
                    Ok(0) => return true,
                    Ok(_) => {}
                    Err(_) => return false,
                }
            }
        });
        let (rt, mut task) = stepd(port, 2, (2, Allgather::Tree), 0, &secret, bounds(1 << 20, 1 << 20));
        assert!(task.ask("cmd=init pmi_version=1 pmi_subversion=1").contains("rc=0"));
        let barrier = task.ask("cmd=barrier_in");
        assert!(barrier.starts_with("cmd=barrier_out rc=-1"), "{barrier}");
        assert!(srun.join().unwrap(), "the stepd took a result from srun");
        drop(task);
        drop(rt);
    }
}

//! A slurmstepd's monitor of its node of a step, sans-I/O: what srun and the node's peers (its parent and
//! children in the tree, and with Bruck's allgather its peers in the rounds) send (as the bytes of whole frames), that a connection closed, and what the node's shell asks of its
//! host ([`crate::server::Host`]) go in; what to do comes out as [`NodeAction`]s (queue a frame, drop a
//! connection, log a line, end the step from here), in order, for the I/O loop around it ([`super`]) to
//! carry out, and the shell's answers wait until the loop hands them over. It decides who is at fault, when
//! the step must end and who ends it; it holds no socket, thread or clock.
//!
//! **Who ends the step.** A fault found here (an abort, a job error, a peer that broke the protocol) goes to
//! srun, which tells its user and ends the step; if srun has not ended it [`END_PATIENCE`] later (srun is the
//! user's, and may be stopped), or srun is gone or at fault, or the parent's connection closed while it
//! mattered, this node ends it itself ([`NodeAction::EndHere`]). Once every local task has closed its
//! connection, or srun said it is done (END), connections closing are the normal end.
//!
//! **Who joined.** srun tells a node that can no longer join an exchange others wait in (every rank on it
//! gone, or one gone without finalize) from which exchange each node's shell joined last (JOINED). It hears
//! that only when it matters, not from every node on every fence: when the shell has waited
//! [`JOINED_AFTER`] in the exchange ([`NodeMonitor::waited_long`]), before this node says that a rank or every
//! rank is gone (GONE, BYE), and before it says the exchange cannot complete.

use super::plan::{Place, LOGGED_TEXT_MAX};
use crate::collective::groups::DoneParts;
use crate::collective::{self, frame, Allgather, Bounds, Bytes, Output, Parts, Peer, Tree};
use crate::launch::{check_preputs, SpawnedJob};
use crate::server::{GroupExchange, HostReply, HostRequest, JobError, Limits, TaskId};
use crate::slurm::layout::with_node_names;
use crate::slurm::protocol::{self, Direction, Down, NameOp, Owned, Up, CONTROL_MAX, MESSAGE_MAX, NAME_MAX, SPAWN_MAX};
use crate::slurm::trace::escape_text;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

/// How long srun, told that the step must end (an abort, a job error), has to end it before the stepd that
/// told it ends it itself: srun is the user's own process, and a stopped one must not keep a failed step.
pub const END_PATIENCE: Duration = Duration::from_secs(5);
/// How long the node's shell waits in an exchange before srun is told that it joined it: far below what a
/// user waits before suspecting a hang, and above what most fences take, which then cost srun no frame.
pub const JOINED_AFTER: Duration = Duration::from_millis(100);
/// The most lines one step logs into slurmd's log.
const LOGGED_LINES_MAX: usize = 200;

/// What the monitor asks of the I/O around it, in the order it must happen.
#[derive(Debug, PartialEq, Eq)]
pub enum NodeAction {
    /// Queue a control frame (an encoded [`Up`]) for srun.
    Report(Vec<u8>),
    /// Queue a frame of the collective for `to`: srun or a linked peer.
    Send { to: Peer, direction: Direction, frame: Bytes },
    /// Stop serving `peer`'s connection: it closed, or is not trusted any more.
    Drop(Peer),
    /// A line for slurmd's log (and, at warning and above, the job's stderr), escaped and within the step's
    /// quota.
    Log { level: log::Level, text: String },
    /// Ask slurmctld to end the step from this node, for `why`, unless `fini` has begun (then the end is
    /// the normal one and `why` is only logged).
    EndHere { why: String },
    /// srun was told to end the step: if it has not within [`END_PATIENCE`], call
    /// [`NodeMonitor::srun_too_slow`].
    AwaitEnd,
    /// What the tree's top sent for an exchange, for the job's trace (`PMI_DEBUG`), if it is on.
    Trace(String),
}

/// A peer's connection, as this node serves it.
enum PeerState {
    /// A higher peer not admitted yet: what the collective sends it waits here (a FAIL, END or BYE, or a
    /// round of Bruck's allgather: at most a few).
    Awaited(Vec<Bytes>),
    Linked,
    /// Its connection closed, or a lower peer finished before this node joined it.
    Gone,
}

/// A request a task made of srun.
#[derive(Debug, Clone, Copy)]
enum Asked {
    Name(NameOp),
    /// A spawn of this many processes.
    Spawn(u64),
}

impl Asked {
    /// srun's answer, as the shell takes it.
    fn reply(self, ok: bool, text: String) -> HostReply {
        match (ok, self) {
            (false, _) => HostReply::Failed(text),
            (true, Asked::Name(NameOp::Lookup)) => HostReply::Port(text),
            (true, Asked::Name(NameOp::Publish | NameOp::Unpublish)) => HostReply::Done,
            // One code for every process: a step starts all of its tasks or none.
            (true, Asked::Spawn(procs)) => match text.parse::<i32>() {
                Ok(code) => HostReply::Spawned { errcodes: vec![code; procs as usize] },
                Err(_) => HostReply::Failed(format!("srun answered the spawn with '{}'", escape_text(&text, 32))),
            },
        }
    }
}

/// The node as the monitor sees it, from prefork.
pub struct NodeShape {
    pub place: Place,
    /// Every node's name, for messages.
    pub names: Vec<String>,
    pub tree: Tree,
    pub allgather: Allgather,
    pub bounds: Bounds,
    pub limits: Limits,
    /// In a spawned step: the local ranks, each of which must send a PMI line (see [`NodeMonitor`]'s
    /// `unspoken`).
    pub spawned_ranks: Option<BTreeSet<u32>>,
    /// The job's trace (`PMI_DEBUG`) is on: the tree's top says in it what it sent for each exchange.
    pub traced: bool,
}

/// A slurmstepd's monitor of its node of a step.
pub struct NodeMonitor {
    place: Place,
    names: Vec<String>,
    tree: Tree,
    /// The node's side of the collective.
    machine: collective::Node,
    /// What the collective completed for the shell (every part, or why it failed), until the shell takes it.
    completion: Option<Result<Parts, String>>,
    /// srun's connection is served: it is open and srun is trusted.
    srun: bool,
    /// Every peer (lower ones joined in prefork, higher ones as they are admitted), in node order.
    peers: Vec<(u32, PeerState)>,
    /// Every local task has closed its connection: the connections closing now is the normal end.
    finished: bool,
    /// srun said it is done with the step (END): its close is the normal end.
    srun_done: bool,
    /// The step's end was decided (by srun, or from here): srun's user has been told.
    ending: bool,
    /// An abort or job error was sent: srun ends the step; say it once.
    ended: bool,
    /// This node has asked slurmctld to end the step itself.
    ended_here: bool,
    /// The collective is being told that the parent's connection closed: what fails now, fails for that.
    parent_lost: bool,
    /// Lines this step has logged.
    logged: usize,
    /// The requests sent to srun that it has not answered, by local task.
    asked: BTreeMap<TaskId, Asked>,
    /// The step's limits, which a spawn's preputs must keep to in the new step.
    limits: Limits,
    /// srun's answers, until the shell takes them.
    answers: Vec<(TaskId, HostReply)>,
    /// The group exchanges sent to srun that it has not ended, and the member nodes of each.
    groups_asked: BTreeMap<Vec<u8>, usize>,
    /// Group exchanges srun ended, until the shell takes them.
    groups_done: Vec<DoneParts>,
    /// The exchange the node's shell joined last, and whether srun was told (JOINED).
    joined: Option<(u32, bool)>,
    /// The largest result of a group exchange srun may send.
    group_result_max: usize,
    /// In a spawned step, until each has sent its first PMI line: the local ranks that have not. STARTED goes
    /// to srun when none is left (srun's root then answers the spawn); one that exits before is a program
    /// that did not start, and fails the step.
    unspoken: Option<BTreeSet<u32>>,
    /// The local ranks that have sent a PMI line: srun ends the step when one of them leaves without
    /// finalize while other ranks run.
    spoke: BTreeSet<u32>,
    /// The job's trace is on ([`NodeShape::traced`]).
    traced: bool,
    allgather: Allgather,
    actions: VecDeque<NodeAction>,
}

impl NodeMonitor {
    /// The monitor of node `shape.place.node`, connected to srun and its parent.
    pub fn new(shape: NodeShape) -> Result<NodeMonitor, String> {
        let NodeShape { place, names, tree, allgather, bounds, limits, spawned_ranks, traced } = shape;
        let all_max = frame::parts_len(names.len(), limits.kvs_bytes_max);
        let group_result_max = collective::groups::done_max(names.len() as u32, &bounds);
        let machine = collective::Node::new(tree, place.node, bounds, all_max).map_err(|e| e.to_string())?;
        let machine = machine.with_allgather(allgather);
        let me = place.node;
        let state = |p: u32| if p < me { PeerState::Linked } else { PeerState::Awaited(Vec::new()) };
        Ok(NodeMonitor {
            peers: machine.peers().into_iter().map(|p| (p, state(p))).collect(),
            place,
            names,
            tree,
            machine,
            completion: None,
            srun: true,
            finished: false,
            srun_done: false,
            ending: false,
            ended: false,
            ended_here: false,
            parent_lost: false,
            logged: 0,
            asked: BTreeMap::new(),
            limits,
            answers: Vec::new(),
            groups_asked: BTreeMap::new(),
            groups_done: Vec::new(),
            joined: None,
            group_result_max,
            unspoken: spawned_ranks,
            spoke: BTreeSet::new(),
            traced,
            allgather,
            actions: VecDeque::new(),
        })
    }

    /// srun said lower peer `p` finished before this node reached it: as if it had said goodbye and left.
    pub fn peer_done(&mut self, p: u32) {
        let was = self.peer_mut(p).map(|s| std::mem::replace(s, PeerState::Gone));
        if matches!(was, Some(PeerState::Linked)) {
            self.machine.receive(Peer::Node(p), frame::bye());
            self.machine.lost(Peer::Node(p));
            self.pump();
        }
    }

    /// The next thing to do, in order.
    pub fn poll(&mut self) -> Option<NodeAction> {
        self.actions.pop_front()
    }

    /// The parent's node index, if the parent is a stepd.
    pub fn parent_node(&self) -> Option<u32> {
        match self.tree.parent(self.place.node) {
            Peer::Node(p) => Some(p),
            Peer::Root => None,
        }
    }

    /// This node's peers, in node order.
    pub fn peers(&self) -> Vec<u32> {
        self.peers.iter().map(|(p, _)| *p).collect()
    }

    fn peer_mut(&mut self, p: u32) -> Option<&mut PeerState> {
        let i = self.peers.binary_search_by_key(&p, |(q, _)| *q).ok()?;
        Some(&mut self.peers[i].1)
    }

    fn peer(&self, p: u32) -> Option<&PeerState> {
        let i = self.peers.binary_search_by_key(&p, |(q, _)| *q).ok()?;
        Some(&self.peers[i].1)
    }

    /// The largest frame `from` may send.
    pub fn frame_max(&self, from: Peer) -> usize {
        let collective = self.machine.frame_max(from) + 1;
        match from {
            Peer::Root => CONTROL_MAX.max(collective).max(self.group_result_max + 1),
            Peer::Node(_) => collective,
        }
    }

    /// The bytes of one whole frame from `from`. Frames from a connection no longer served are ignored.
    pub fn heard(&mut self, from: Peer, payload: Owned) {
        match from {
            // The end of a group exchange is checked by its head (one this node started, one part per member
            // node) before anything else of it is read or kept: srun is the user's, and a frame of many empty
            // parts would otherwise cost far more than its bytes.
            Peer::Root if self.srun => match self.unasked_group(&payload) {
                Some(why) => self.broke(from, &why),
                None => match Down::decode_owned(payload) {
                    Ok(m) => self.heard_srun(m),
                    Err(e) => self.broke(from, &format!("sent a {e}")),
                },
            },
            // A lower peer sends as srun does (down), a higher one as to srun (up).
            Peer::Node(p) if p < self.place.node && matches!(self.peer(p), Some(PeerState::Linked)) => {
                match Down::decode_owned(payload) {
                    Ok(Down::Collective(frame)) => {
                        self.machine.receive(from, frame);
                        self.pump();
                    }
                    Ok(other) => self.broke(from, &format!("sent {}, which only srun sends", other.name())),
                    Err(e) => self.broke(from, &format!("sent a {e}")),
                }
            }
            Peer::Node(c) if matches!(self.peer(c), Some(PeerState::Linked)) => match Up::decode_owned(payload) {
                Ok(Up::Collective(frame)) => {
                    self.machine.receive(from, frame);
                    self.pump();
                }
                Ok(other) => self.broke(from, &format!("sent {}, which only srun takes", other.name())),
                Err(e) => self.broke(from, &format!("sent a {e}")),
            },
            _ => {}
        }
    }

    /// Why `payload`, if it is the end of a group exchange, is not one this node waits for.
    fn unasked_group(&self, payload: &[u8]) -> Option<String> {
        let (id, count) = match protocol::group_head(payload)? {
            Ok(head) => head,
            Err(e) => return Some(format!("sent a {e}")),
        };
        match self.groups_asked.get(id) {
            None => Some("ended a group exchange this node did not start".into()),
            Some(&members) if members != count as usize => Some(format!(
                "ended group exchange {} of {members} member nodes with {count} parts",
                escape_text(&String::from_utf8_lossy(id), 64)
            )),
            Some(_) => None,
        }
    }

    fn heard_srun(&mut self, m: Down) {
        match m {
            Down::Collective(frame) => self.machine.receive(Peer::Root, frame),
            Down::End => self.srun_done = true,
            Down::Answer { task, ok, text } => match self.asked.remove(&(task as TaskId)) {
                Some(asked) => self.answers.push((task as TaskId, asked.reply(ok, text))),
                None => return self.broke(Peer::Root, &format!("answered a request task {task} did not make")),
            },
            Down::Group(done) => {
                self.groups_asked.remove(done.id());
                self.groups_done.push(done);
            }
            // Taken at prefork; the peers' own connections say the rest.
            Down::Peer { .. } | Down::PeerDone { .. } => {}
            Down::Challenge { .. } | Down::Welcome { .. } => {
                return self.broke(Peer::Root, "sent a handshake frame after the handshake")
            }
        }
        self.pump();
    }

    /// `peer`'s connection closed (or failed) for `why`.
    pub fn closed(&mut self, peer: Peer, why: &str) {
        match peer {
            Peer::Root => self.lost_srun(&format!("lost the connection to srun (the collective root): {why}")),
            Peer::Node(n) => self.lost_node(n, None),
        }
    }

    /// `peer` sent what it may not (`why` says what): its connection is dropped, and the step ends.
    pub fn broke(&mut self, peer: Peer, why: &str) {
        match peer {
            Peer::Root => self.lost_srun(&format!("srun {why}")),
            Peer::Node(n) => {
                let from = self.names.get(n as usize).map_or("?", String::as_str);
                let what = format!("the slurmstepd of {from} {why} to {}", self.place.node_name);
                self.lost_node(n, Some(what));
            }
        }
    }

    /// The connection to srun is gone, or srun broke the protocol: no exchange can complete any more, and
    /// unless the step is ending anyway, this node ends it.
    fn lost_srun(&mut self, why: &str) {
        if std::mem::replace(&mut self.srun, false) {
            self.actions.push_back(NodeAction::Drop(Peer::Root));
        }
        self.end_from_here(why);
        self.machine.lost(Peer::Root);
        self.pump();
    }

    /// Node `n`'s connection (a peer's) is gone; `fault` if it broke the protocol.
    fn lost_node(&mut self, n: u32, fault: Option<String>) {
        let is_parent = Some(n) == self.parent_node();
        let Some(state) = self.peer_mut(n) else { return };
        if !matches!(std::mem::replace(state, PeerState::Gone), PeerState::Linked) {
            return;
        }
        self.actions.push_back(NodeAction::Drop(Peer::Node(n)));
        if let Some(what) = fault {
            self.fault_of(Some(n), what);
        }
        self.parent_lost = is_parent;
        self.machine.lost(Peer::Node(n));
        self.pump();
        self.parent_lost = false;
    }

    /// Higher peer `c` was admitted: what the collective sent it meanwhile goes now.
    pub fn peer_joined(&mut self, c: u32) {
        let Some(slot) = self.peer_mut(c) else { return };
        if let PeerState::Awaited(waiting) = std::mem::replace(slot, PeerState::Linked) {
            for frame in waiting {
                self.actions.push_back(NodeAction::Send { to: Peer::Node(c), direction: Direction::Down, frame });
            }
        }
    }

    /// A message of the collective's machines as the user reads it: nodes by name.
    fn named(&self, text: &str) -> String {
        with_node_names(text, &self.names)
    }

    /// Queues a control frame for srun; false if srun is not served.
    fn report(&mut self, message: &Up) -> bool {
        match (self.srun, message.encode()) {
            (true, Ok(frame)) => {
                self.actions.push_back(NodeAction::Report(frame));
                true
            }
            _ => false,
        }
    }

    /// The step must end, with `message` for the user: srun prints it on its stderr and ends the step.
    /// Without srun (it is gone), the stepd does both: its errors reach the job's stderr.
    fn end_step(&mut self, message: Up, text: &str) {
        if std::mem::replace(&mut self.ended, true) {
            self.log(log::Level::Info, text);
            return;
        }
        if self.report(&message) {
            self.ending = true;
            self.actions.push_back(NodeAction::AwaitEnd);
            self.log(log::Level::Info, text);
            return;
        }
        self.end_from_here(&format!("{text}; srun (the collective root) is gone"));
    }

    /// Ends the step from this node (once), unless the step is ending normally.
    fn end_from_here(&mut self, why: &str) {
        let normal = self.finished || self.srun_done;
        if normal || std::mem::replace(&mut self.ended_here, true) {
            self.log(log::Level::Info, why);
            return;
        }
        self.ending = true;
        self.actions.push_back(NodeAction::EndHere { why: why.to_string() });
    }

    /// srun did not end the step within [`END_PATIENCE`] of being told to: this node ends it.
    pub fn srun_too_slow(&mut self) {
        self.end_from_here(&format!("srun did not end the step within {END_PATIENCE:?} of being told to"));
    }

    /// Something this node cannot go on without failed (`message` says what): the step ends.
    pub fn fault(&mut self, message: &str) {
        let m = Up::Error { rank: u32::MAX, failed: false, message: message.to_string() };
        self.end_step(m, message);
    }

    /// Does what the collective asks.
    fn pump(&mut self) {
        while let Some(output) = self.machine.poll() {
            match output {
                Output::Send { to, frame } => self.send(to, frame),
                Output::Done { epoch, parts } => {
                    self.tell_completed(epoch);
                    self.note_result(epoch, &parts);
                    self.completion = Some(Ok(parts));
                }
                Output::Failed { message, .. } => {
                    self.completion = Some(Err(escape_text(&self.named(&message), MESSAGE_MAX)));
                }
                Output::JobError { node, message } => {
                    // srun first hears that this node waits in the exchange, so that it names a rank that left
                    // a node which cannot join it, rather than the node alone.
                    self.tell_joined();
                    let text = self.named(&message);
                    self.fault_of(node, text);
                }
                Output::Report { .. } => {}
            }
        }
    }

    /// A frame of the collective for `to`: up to srun and the lower peers, down to the higher ones.
    fn send(&mut self, to: Peer, frame: Bytes) {
        let direction = match to {
            Peer::Node(p) if p > self.place.node => Direction::Down,
            _ => Direction::Up,
        };
        let send = NodeAction::Send { to, direction, frame: frame.clone() };
        match to {
            Peer::Root if self.srun => self.actions.push_back(send),
            Peer::Root => {}
            Peer::Node(p) => match self.peer_mut(p) {
                Some(PeerState::Linked) => self.actions.push_back(send),
                Some(PeerState::Awaited(waiting)) => waiting.push(frame),
                Some(PeerState::Gone) | None => {}
            },
        }
    }

    /// The collective cannot go on; `node` is at fault (`None`: srun). srun ends the step when this node
    /// tells it why; when srun itself is at fault, or the parent's connection closed while it mattered (as
    /// when srun's does), this node ends it itself.
    fn fault_of(&mut self, node: Option<u32>, text: String) {
        match node {
            None => {
                // srun broke the protocol (or is gone): it is not trusted any more.
                if std::mem::replace(&mut self.srun, false) {
                    self.actions.push_back(NodeAction::Drop(Peer::Root));
                }
                self.end_from_here(&text);
            }
            Some(p) if Some(p) == self.parent_node() && self.parent_lost => {
                self.end_step(Up::Error { rank: u32::MAX, failed: true, message: text.clone() }, &text);
                self.end_from_here(&text);
            }
            Some(n) => {
                let failed = n != self.place.node;
                self.end_step(Up::Error { rank: u32::MAX, failed, message: text.clone() }, &text);
            }
        }
    }

    /// What the collective completed for the shell, once.
    pub fn take_completion(&mut self) -> Option<Result<Parts, String>> {
        let completion = self.completion.take();
        // The node that found why the exchange failed has told srun, which tells the user (or, without srun,
        // has ended the step itself): the barrier failing here follows from it, and what the shell says of it
        // is no new fault for the job's stderr. Over a chain, a node hears its parent's failure before srun's
        // end reaches it.
        if matches!(completion, Some(Err(_))) {
            self.ending = true;
        }
        completion
    }

    /// srun's answers to the tasks' requests, for the shell.
    pub fn take_answers(&mut self) -> Vec<(TaskId, HostReply)> {
        std::mem::take(&mut self.answers)
    }

    /// The group exchanges srun ended, for the shell.
    pub fn take_groups_done(&mut self) -> Vec<DoneParts> {
        std::mem::take(&mut self.groups_done)
    }

    // What the shell asks of its host ([`crate::server::Host`]).

    /// The node's shell joins the exchange in progress with `contribution`.
    pub fn contribute(&mut self, contribution: &[u8]) -> Result<(), String> {
        // srun is told later, if at all (the module's "Who joined"); once the collective failed, no one can
        // join, and a task's every later barrier must not cost srun's link a frame.
        if !self.machine.failed() {
            self.joined = Some((self.machine.epoch(), false));
        }
        self.machine.contribute(contribution.to_vec()).map_err(|e| e.to_string())?;
        // What this completes, a failure found at once included, the host hands the shell with the rest
        // ([`Self::take_completion`]).
        self.pump();
        Ok(())
    }

    /// The host's timer: the shell joined an exchange [`JOINED_AFTER`] ago. If it still waits in it, srun is
    /// told, so that it can end the step should a node that has not joined no longer be able to.
    pub fn waited_long(&mut self) {
        let epoch = self.machine.epoch();
        if self.joined.is_some_and(|(joined, _)| joined == epoch) && !self.machine.failed() {
            self.tell_joined();
        }
    }

    /// Exchange `epoch` completed here: srun, if it was told that the shell joined it, hears that no one
    /// waits in it any more.
    fn tell_completed(&mut self, epoch: u32) {
        if self.joined == Some((epoch, true)) {
            self.report(&Up::Completed { epoch });
        }
    }

    /// At the tree's top, what it sent its children for exchange `epoch`, for the job's trace if it is on.
    fn note_result(&mut self, epoch: u32, parts: &Parts) {
        let me = self.place.node;
        if !self.traced || self.tree.top() != Peer::Node(me) || self.allgather != Allgather::Tree {
            return;
        }
        let children = self.tree.children(Peer::Node(me)).len();
        // Each frame goes with the link's 5-byte header.
        let sent = children * (5 + parts.frame().len());
        let (gathered, nodes) = (parts.bytes(), self.tree.nodes());
        self.actions.push_back(NodeAction::Trace(format!(
            "rpmi: PMI exchange {epoch}: node {me} sent {sent} bytes to its {children} children in the PMI tree; \
             the exchange gathered {gathered} bytes from {nodes} nodes"
        )));
    }

    /// Tells srun which exchange the shell joined last, unless it was told; and, if that one has completed
    /// since, that it did, so that srun takes no one to wait in it.
    fn tell_joined(&mut self) {
        if let Some((epoch, false)) = self.joined {
            self.joined = Some((epoch, true));
            self.report(&Up::Joined { epoch });
            if epoch != self.machine.epoch() && !self.machine.failed() {
                self.report(&Up::Completed { epoch });
            }
        }
    }

    /// A group exchange: a star through srun ([`crate::collective::groups`]), which checks the parts' bounds.
    pub fn group(&mut self, exchange: &GroupExchange<'_>, contribution: &[u8]) -> Result<(), String> {
        let up = Up::Group { id: exchange.id.to_vec(), part: contribution.to_vec() };
        if !self.report(&up) {
            return Err("srun (the collective root) is gone".into());
        }
        self.groups_asked.insert(exchange.id.to_vec(), exchange.shells.len());
        Ok(())
    }

    pub fn abort(&mut self, rank: u32, exit_code: i32, message: &str) {
        // The message reaches srun's stderr (the user's) whole, and slurmd's log escaped and cut.
        let logged = format!(
            "rank {rank} called PMI_Abort with exit code {exit_code}{}{}",
            if message.is_empty() { "" } else { ": " },
            escape_text(message, LOGGED_TEXT_MAX)
        );
        self.end_step(Up::Abort { rank, code: exit_code, message: message.to_string() }, &logged);
    }

    pub fn job_error(&mut self, error: &JobError) {
        // A spawned task lost before its first line: that it never spoke says more than the barrier it left.
        let unspoken = match error {
            JobError::TaskLost { rank, .. } => self.left_unspoken(*rank),
            JobError::Protocol { .. } => None,
        };
        let message = unspoken.unwrap_or_else(|| error.to_string());
        let failed = matches!(error, JobError::TaskLost { .. });
        self.end_step(Up::Error { rank: error.rank(), failed, message: message.clone() }, &message);
    }

    pub fn log(&mut self, level: log::Level, message: &str) {
        // What reaches slurmd's log may carry what tasks or srun sent: it is escaped and cut, and a step
        // logs at most LOGGED_LINES_MAX lines (tasks can make the engine say something per request).
        self.logged += 1;
        if self.logged > LOGGED_LINES_MAX {
            if self.logged == LOGGED_LINES_MAX + 1 {
                let text = "this step's further PMI messages are not logged".to_string();
                self.actions.push_back(NodeAction::Log { level: log::Level::Info, text });
            }
            return;
        }
        // A stepd's errors also reach the job's stderr: once the user has been told why the step ends, the
        // consequences (every barrier failing) go to the slurmd log only.
        let level = if level <= log::Level::Warn && self.ending { log::Level::Info } else { level };
        self.actions.push_back(NodeAction::Log { level, text: escape_text(message, MESSAGE_MAX) });
    }

    pub fn task_started(&mut self, rank: u32) {
        self.spoke.insert(rank);
        if let Some(unspoken) = &mut self.unspoken {
            unspoken.remove(&rank);
            if unspoken.is_empty() {
                self.unspoken = None;
                self.report(&Up::Started);
            }
        }
    }

    pub fn task_closed(&mut self, rank: u32, finalized: bool) {
        if let Some(message) = self.left_unspoken(rank) {
            self.end_step(Up::Error { rank, failed: true, message: message.clone() }, &message);
        }
        // srun fails a barrier of another node that waits for it: a plain one if it left without finalize,
        // a group barrier whichever way it left; and ends the step if it spoke PMI and left without finalize.
        self.tell_joined();
        self.report(&Up::Gone { rank, finalized, spoke: self.spoke.contains(&rank) });
    }

    /// Names go to srun's table for the step, spawns to srun, which starts each as a step of the job.
    pub fn request(&mut self, task: TaskId, request: &HostRequest) -> Result<(), String> {
        let (op, name, port) = match request {
            HostRequest::Publish { service, port } => (NameOp::Publish, service.as_str(), port.as_str()),
            HostRequest::Unpublish { service } => (NameOp::Unpublish, service.as_str(), ""),
            HostRequest::Lookup { service } => (NameOp::Lookup, service.as_str(), ""),
            HostRequest::Spawn(spawn) => {
                // Bounded here: srun is the user's, and its answer makes an error code per process. The
                // preputs are checked now, as the new step will (a spawn answered and then refused by that
                // step would end this one).
                let job = SpawnedJob::of(spawn)?;
                check_preputs(&self.limits, job.preputs.iter().map(|(k, v)| (k.as_bytes(), v.as_bytes())))?;
                let request = crate::abi::spawn_json(spawn);
                if request.len() > SPAWN_MAX {
                    return Err(format!(
                        "a spawn request of more than {SPAWN_MAX} bytes, the most srun --mpi=rpmi takes"
                    ));
                }
                return self.ask(task, Asked::Spawn(spawn.total_procs()), Up::Spawn { task: task as u32, request });
            }
        };
        if name.len() > NAME_MAX || port.len() > NAME_MAX {
            return Err(format!("a service name or port longer than {NAME_MAX} bytes, the most srun --mpi=rpmi takes"));
        }
        self.ask(task, Asked::Name(op), Up::Name { task: task as u32, op, name: name.into(), port: port.into() })
    }

    /// Why this spawned step fails if rank `rank`, which has not sent its first PMI line, left: its spawner
    /// would wait for it without end. `None` once it spoke, or in a step no spawn started.
    fn left_unspoken(&self, rank: u32) -> Option<String> {
        let Place { job, step, .. } = self.place;
        self.unspoken.as_ref().filter(|u| u.contains(&rank)).map(|_| {
            format!(
                "rank {rank} of spawned step {job}.{step} closed its PMI connection before its first PMI line: its \
                 program could not be run (see Slurm's execve error), was killed, or does not call PMI_Init \
                 (MPI_Init), as spawned processes must"
            )
        })
    }

    /// Sends task `task`'s request to srun, whose answer the task then waits for.
    fn ask(&mut self, task: TaskId, asked: Asked, message: Up) -> Result<(), String> {
        if !self.report(&message) {
            return Err("srun (the collective root) is gone".into());
        }
        self.asked.insert(task, asked);
        Ok(())
    }

    /// The node's progress loop ended: every task closed its connection (`Ok`), or it failed.
    pub fn served(&mut self, result: Result<(), String>) {
        match result {
            Ok(()) => {
                self.finished = true;
                self.tell_joined();
                // The collective's goodbyes to srun and the peers, then srun's own.
                self.machine.finish();
                self.pump();
                self.report(&Up::Bye);
            }
            Err(why) => self.fault(&format!("the PMI progress loop stopped: {why}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::Bound;
    use crate::slurm::records::slurm_step_id_t;

    const BOUNDS: Bounds = Bounds {
        part_max: Bound { bytes: 1 << 20, option: "RPMI_TEST_PART_MAX" },
        exchange_max: Bound { bytes: 3 << 20, option: "RPMI_TEST_EXCHANGE_MAX" },
    };

    /// Node `node`'s watch in a step of `nodes` nodes (named n1, n2, ...) over a tree of `width`; a spawned
    /// step's if `spawned_ranks` (its local ranks) is given.
    fn watch_of(nodes: u32, width: u32, node: u32, spawned_ranks: Option<&[u32]>) -> NodeMonitor {
        // SAFETY: slurm_step_id_t is plain integers: all zeroes is a valid value.
        let mut id: slurm_step_id_t = unsafe { std::mem::zeroed() };
        (id.job_id, id.step_id) = (1, 0);
        let names: Vec<String> = (1..=nodes).map(|n| format!("n{n}")).collect();
        let place = Place { job: 1, step: 0, id, leads_hetjob: false, node, node_name: names[node as usize].clone() };
        let shape = NodeShape {
            place,
            names,
            tree: crate::slurm::options::step_tree(nodes, width).unwrap(),
            allgather: Allgather::Tree,
            bounds: BOUNDS,
            limits: Limits::default(),
            spawned_ranks: spawned_ranks.map(|r| r.iter().copied().collect()),
            traced: true,
        };
        NodeMonitor::new(shape).unwrap()
    }

    fn drain(w: &mut NodeMonitor) -> Vec<NodeAction> {
        std::iter::from_fn(|| w.poll()).collect()
    }

    /// The control frames among `actions`, decoded.
    fn reports(actions: &[NodeAction]) -> Vec<Up> {
        actions
            .iter()
            .filter_map(|a| match a {
                NodeAction::Report(frame) => Some(Up::decode(&frame[4..]).unwrap()),
                _ => None,
            })
            .collect()
    }

    /// A frame from srun or a parent, as the link hands it over (without its length prefix).
    fn down(m: Down) -> Owned {
        m.encode().unwrap()[4..].to_vec().into()
    }

    /// The lines for slurmd's log among `actions`.
    fn logged(actions: &[NodeAction]) -> Vec<(log::Level, String)> {
        actions
            .iter()
            .filter_map(|a| match a {
                NodeAction::Log { level, text } => Some((*level, text.clone())),
                _ => None,
            })
            .collect()
    }

    /// Why the node ends the step itself, if `actions` say it does.
    fn ended_here(actions: &[NodeAction]) -> Option<&str> {
        actions.iter().find_map(|a| match a {
            NodeAction::EndHere { why } => Some(why.as_str()),
            _ => None,
        })
    }

    #[test]
    fn a_node_whose_parent_finished_before_it_came_goes_on_without_it() {
        // A chain: srun, n1, n2. n1 finished before n2's stepd reached it.
        let mut w = watch_of(2, 1, 1, None);
        w.peer_done(0);
        assert_eq!(drain(&mut w), []);
        // n2's exchange cannot complete: srun is told why, and ends the step.
        w.contribute(b"part").unwrap();
        let failed = match w.take_completion() {
            Some(Err(why)) => why,
            other => panic!("{other:?}"),
        };
        assert!(failed.contains("the slurmstepd of n1 has closed its connection to the slurmstepd of n2"), "{failed}");
        let actions = drain(&mut w);
        assert!(!actions.iter().any(|a| matches!(a, NodeAction::Send { .. } | NodeAction::Drop(_))), "{actions:?}");
        match &reports(&actions)[..] {
            [Up::Joined { epoch: 0 }, Up::Error { failed: true, message, .. }] => assert!(message.contains("n1")),
            other => panic!("{other:?}"),
        }
        assert!(actions.contains(&NodeAction::AwaitEnd));
        assert_eq!(ended_here(&actions), None);
    }

    /// srun hears that the shell joined an exchange only once it has waited long in it, or before a rank, or
    /// every rank, is said to be gone: a fence that completes at once costs srun no JOINED. One it heard of,
    /// it hears completed. (Node 1 of 2, below node 0, the tree's top.)
    #[test]
    fn srun_hears_of_a_join_after_a_long_wait_or_before_a_rank_is_gone() {
        let all = |epoch| down(Down::Collective(frame::all(epoch, [(0, &[][..]), (1, &[][..])].into_iter()).unwrap()));
        let mut w = watch_of(2, 2, 1, None);
        w.contribute(b"").unwrap();
        assert_eq!(reports(&drain(&mut w)), []);
        w.waited_long();
        assert_eq!(reports(&drain(&mut w)), [Up::Joined { epoch: 0 }]);
        w.waited_long();
        assert_eq!(reports(&drain(&mut w)), []);
        w.heard(Peer::Node(0), all(0));
        assert!(matches!(w.take_completion(), Some(Ok(_))));
        assert_eq!(reports(&drain(&mut w)), [Up::Completed { epoch: 0 }]);
        w.task_closed(0, true);
        assert_eq!(reports(&drain(&mut w)), [Up::Gone { rank: 0, finalized: true, spoke: false }]);

        // A fence that completes at once: the wait after it tells srun nothing; a rank gone, the join first, and
        // that it completed (no one waits in it).
        let mut w = watch_of(2, 2, 1, None);
        w.contribute(b"").unwrap();
        w.heard(Peer::Node(0), all(0));
        assert!(matches!(w.take_completion(), Some(Ok(_))));
        w.waited_long();
        assert_eq!(reports(&drain(&mut w)), []);
        w.task_closed(0, false);
        let gone = Up::Gone { rank: 0, finalized: false, spoke: false };
        assert_eq!(reports(&drain(&mut w)), [Up::Joined { epoch: 0 }, Up::Completed { epoch: 0 }, gone]);
        w.served(Ok(()));
        assert_eq!(reports(&drain(&mut w)), [Up::Bye]);

        // Every rank gone: the join before BYE.
        let mut w = watch_of(2, 2, 1, None);
        w.contribute(b"").unwrap();
        w.heard(Peer::Node(0), all(0));
        w.served(Ok(()));
        assert_eq!(reports(&drain(&mut w)), [Up::Joined { epoch: 0 }, Up::Completed { epoch: 0 }, Up::Bye]);

        // A rank gone while the shell waits: the join alone.
        let mut w = watch_of(2, 2, 1, None);
        w.contribute(b"").unwrap();
        w.task_closed(0, false);
        assert_eq!(
            reports(&drain(&mut w)),
            [Up::Joined { epoch: 0 }, Up::Gone { rank: 0, finalized: false, spoke: false }]
        );
    }

    /// The tree's top completes each exchange itself, and says in the job's trace what it sent its children.
    #[test]
    fn the_top_completes_each_exchange_and_traces_what_it_sent() {
        let contrib = |node: u32| {
            let frame = frame::contrib(0, [(node, &b"card"[..])].into_iter()).unwrap();
            Owned::from(Up::Collective(frame).encode().unwrap()[4..].to_vec())
        };
        let mut w = watch_of(3, 2, 0, None);
        w.peer_joined(1);
        w.peer_joined(2);
        w.contribute(b"top").unwrap();
        w.heard(Peer::Node(1), contrib(1));
        assert!(w.take_completion().is_none());
        w.heard(Peer::Node(2), contrib(2));
        let Some(Ok(parts)) = w.take_completion() else {
            panic!("the exchange did not complete at the top: {:?}", drain(&mut w))
        };
        assert_eq!(
            parts.iter().map(|(n, b)| (n, b.to_vec())).collect::<Vec<_>>(),
            [(0, b"top".to_vec()), (1, b"card".to_vec()), (2, b"card".to_vec())]
        );
        let actions = drain(&mut w);
        let sent: Vec<u32> = actions
            .iter()
            .filter_map(|a| match a {
                NodeAction::Send { to: Peer::Node(c), direction: Direction::Down, .. } => Some(*c),
                _ => None,
            })
            .collect();
        assert_eq!(sent, [1, 2]);
        assert!(!actions.iter().any(|a| matches!(a, NodeAction::Send { to: Peer::Root, .. })), "{actions:?}");
        let trace: Vec<&String> = actions
            .iter()
            .filter_map(|a| match a {
                NodeAction::Trace(line) => Some(line),
                _ => None,
            })
            .collect();
        assert_eq!(trace.len(), 1, "{actions:?}");
        assert!(
            trace[0].contains("PMI exchange 0: node 0 sent ") && trace[0].contains("to its 2 children"),
            "{trace:?}"
        );
        assert!(trace[0].contains("gathered 11 bytes from 3 nodes"), "{trace:?}");
    }

    #[test]
    fn a_spawned_steps_tasks_start_at_their_first_line_or_fail_it() {
        let mut w = watch_of(1, 2, 0, Some(&[0, 1]));
        w.task_started(0);
        assert_eq!(drain(&mut w), []);
        w.task_started(1);
        w.task_started(1);
        assert_eq!(reports(&drain(&mut w)), [Up::Started]);

        // Rank 1 leaves before its first line while rank 0 waits in a barrier: the engine names it as lost
        // first, and the step fails for what it is (a program that did not start).
        let mut w = watch_of(1, 2, 0, Some(&[0, 1]));
        w.task_started(0);
        w.job_error(&JobError::TaskLost { rank: 1, finalized: false });
        w.task_closed(1, false);
        let actions = drain(&mut w);
        match &reports(&actions)[..] {
            [Up::Error { rank: 1, failed: true, message }, Up::Gone { rank: 1, finalized: false, spoke: false }] => {
                assert!(
                    message
                        .starts_with("rank 1 of spawned step 1.0 closed its PMI connection before its first PMI line"),
                    "{message}"
                )
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(actions.iter().filter(|a| **a == NodeAction::AwaitEnd).count(), 1);
        // Said once; the close that follows is only logged.
        assert_eq!(logged(&actions).len(), 2);
        // Rank 0 spoke: srun hears so with its leaving.
        w.task_closed(0, false);
        assert_eq!(reports(&drain(&mut w)), [Up::Gone { rank: 0, finalized: false, spoke: true }]);
    }

    #[test]
    fn srun_breaking_the_protocol_is_dropped_and_the_node_ends_the_step() {
        let cases: [(&[u8], &str); 4] = [
            (
                &down(Down::Answer { task: 3, ok: true, text: String::new() }),
                "srun answered a request task 3 did not make",
            ),
            (
                &down(Down::Group(DoneParts::new(b"g", &[]).unwrap())),
                "srun ended a group exchange this node did not start",
            ),
            (&down(Down::Challenge { nonce: [0; 32] }), "srun sent a handshake frame after the handshake"),
            (&[0xff], "srun sent a malformed"),
        ];
        for (frame, why) in cases {
            let mut w = watch_of(2, 2, 0, None);
            w.heard(Peer::Root, frame.to_vec().into());
            // What it sends after is not heard.
            w.heard(Peer::Root, down(Down::End));
            let actions = drain(&mut w);
            assert_eq!(actions[0], NodeAction::Drop(Peer::Root));
            assert!(ended_here(&actions).is_some_and(|w| w.starts_with(why)), "{why}: {actions:?}");
            // Nor is srun asked anything more.
            w.abort(0, 1, "");
            let after = drain(&mut w);
            assert!(reports(&after).is_empty() && ended_here(&after).is_none(), "{after:?}");
        }
    }

    #[test]
    fn the_end_of_a_group_exchange_is_taken_only_with_one_part_per_member_node() {
        let started = || {
            let mut w = watch_of(3, 3, 0, None);
            w.group(&GroupExchange { id: b"0,2:1", shells: &[0, 2] }, b"0 k=v\n").unwrap();
            drain(&mut w);
            w
        };
        for (parts, why) in [
            (vec![vec![]; 3], "srun ended group exchange 0,2:1 of 2 member nodes with 3 parts"),
            (vec![], "srun ended group exchange 0,2:1 of 2 member nodes with 0 parts"),
        ] {
            let mut w = started();
            w.heard(Peer::Root, down(Down::Group(DoneParts::new(b"0,2:1", &parts).unwrap())));
            assert_eq!(ended_here(&drain(&mut w)), Some(why));
            assert!(w.take_groups_done().is_empty());
        }
        let mut w = started();
        let parts = [b"0 k=v\n".to_vec(), b"2 q=r\n".to_vec()];
        w.heard(Peer::Root, down(Down::Group(DoneParts::new(b"0,2:1", &parts).unwrap())));
        let done = w.take_groups_done();
        assert_eq!(done.len(), 1);
        assert!(done[0].parts().eq(parts.iter().map(Vec::as_slice)));
        // Once ended, the exchange is not waited for any more.
        w.heard(Peer::Root, down(Down::Group(DoneParts::new(b"0,2:1", &parts).unwrap())));
        assert_eq!(ended_here(&drain(&mut w)), Some("srun ended a group exchange this node did not start"));
    }

    #[test]
    fn a_group_part_goes_to_srun_without_the_member_nodes() {
        // A WORLD exchange of a 1000-node step: the frame is its id and part, whatever the node count.
        let mut w = watch_of(1000, 4, 7, None);
        drain(&mut w);
        let shells: Vec<u32> = (0..1000).collect();
        w.group(&GroupExchange { id: b"WORLD:3", shells: &shells }, b"7 k=v\n").unwrap();
        let sent: Vec<usize> = drain(&mut w)
            .iter()
            .filter_map(|a| match a {
                NodeAction::Report(frame) => Some(frame.len()),
                _ => None,
            })
            .collect();
        assert_eq!(sent, [4 + 1 + 2 + b"WORLD:3".len() + b"7 k=v\n".len()]);
    }

    #[test]
    fn srun_closing_ends_the_step_unless_it_said_it_was_done_or_every_task_left() {
        let mut w = watch_of(2, 2, 0, None);
        w.closed(Peer::Root, "reset by peer");
        let actions = drain(&mut w);
        assert_eq!(actions[0], NodeAction::Drop(Peer::Root));
        assert_eq!(ended_here(&actions), Some("lost the connection to srun (the collective root): reset by peer"));

        let mut w = watch_of(2, 2, 0, None);
        w.heard(Peer::Root, down(Down::End));
        w.closed(Peer::Root, "closed");
        assert_eq!(ended_here(&drain(&mut w)), None);

        let mut w = watch_of(2, 2, 0, None);
        w.served(Ok(()));
        assert_eq!(reports(&drain(&mut w)).last(), Some(&Up::Bye));
        w.closed(Peer::Root, "closed");
        assert_eq!(ended_here(&drain(&mut w)), None);
    }

    #[test]
    fn an_abort_goes_to_srun_once_and_the_node_ends_the_step_if_srun_does_not() {
        let mut w = watch_of(2, 2, 0, None);
        w.abort(0, 7, "bad input");
        let actions = drain(&mut w);
        assert_eq!(reports(&actions), [Up::Abort { rank: 0, code: 7, message: "bad input".into() }]);
        assert!(actions.contains(&NodeAction::AwaitEnd));
        assert_eq!(ended_here(&actions), None);
        // A second fault is only logged: srun ends the step for the first.
        w.abort(0, 8, "");
        w.job_error(&JobError::TaskLost { rank: 0, finalized: false });
        let actions = drain(&mut w);
        assert!(reports(&actions).is_empty() && !actions.contains(&NodeAction::AwaitEnd), "{actions:?}");
        // srun did not end it in time: this node does, once.
        w.srun_too_slow();
        assert_eq!(ended_here(&drain(&mut w)), Some("srun did not end the step within 5s of being told to"));
        w.srun_too_slow();
        assert_eq!(ended_here(&drain(&mut w)), None);

        // Without srun, the node has ended the step already; the abort is logged.
        let mut w = watch_of(2, 2, 0, None);
        w.closed(Peer::Root, "reset");
        drain(&mut w);
        w.abort(0, 7, "");
        let actions = drain(&mut w);
        assert!(reports(&actions).is_empty() && ended_here(&actions).is_none(), "{actions:?}");
        let why = "rank 0 called PMI_Abort with exit code 7; srun (the collective root) is gone";
        assert_eq!(logged(&actions), [(log::Level::Info, why.to_string())]);
    }

    #[test]
    fn a_stepd_that_breaks_the_protocol_is_named_and_dropped() {
        // A chain: srun, n1, n2, n3; this is n2.
        let mut w = watch_of(3, 1, 1, None);
        w.peer_joined(2);
        w.heard(Peer::Node(2), Up::Bye.encode().unwrap()[4..].to_vec().into());
        let actions = drain(&mut w);
        assert_eq!(actions[0], NodeAction::Drop(Peer::Node(2)));
        match &reports(&actions)[..] {
            [Up::Error { failed: true, message, .. }] => {
                assert_eq!(message, "the slurmstepd of n3 sent BYE, which only srun takes to n2")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(ended_here(&actions), None);

        let mut w = watch_of(3, 1, 1, None);
        w.heard(Peer::Node(0), down(Down::End));
        match &reports(&drain(&mut w))[..] {
            [Up::Error { failed: true, message, .. }] => {
                assert_eq!(message, "the slurmstepd of n1 sent END, which only srun sends to n2")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_parent_lost_during_an_exchange_ends_the_step_from_here_too() {
        let mut w = watch_of(3, 1, 1, None);
        w.peer_joined(2);
        w.contribute(b"part").unwrap();
        drain(&mut w);
        w.closed(Peer::Node(0), "reset");
        let actions = drain(&mut w);
        assert_eq!(actions[0], NodeAction::Drop(Peer::Node(0)));
        let why = "the slurmstepd of n2 lost its connection to the slurmstepd of n1 during PMI exchange 0";
        // srun hears first that this node joined the exchange (it names whoever can no longer join it).
        let reports = reports(&actions);
        assert!(
            matches!(&reports[..], [Up::Joined { epoch: 0 }, Up::Error { failed: true, message, .. }] if message == why)
        );
        // srun may be cut off from this node as well: the node does not count on it.
        assert_eq!(ended_here(&actions), Some(why));
        // The child hears that the exchange failed.
        assert!(actions
            .iter()
            .any(|a| matches!(a, NodeAction::Send { to: Peer::Node(2), direction: Direction::Down, .. })));
    }

    #[test]
    fn frames_for_a_child_not_yet_admitted_wait_for_it() {
        // A chain: srun, n1, n2; this is n1, and srun fails the exchange before n2 is admitted.
        let mut w = watch_of(2, 1, 0, None);
        w.heard(Peer::Root, down(Down::Collective(frame::fail(0, "no"))));
        let actions = drain(&mut w);
        assert!(!actions.iter().any(|a| matches!(a, NodeAction::Send { .. })), "{actions:?}");
        w.peer_joined(1);
        match &drain(&mut w)[..] {
            [NodeAction::Send { to: Peer::Node(1), direction: Direction::Down, frame }] => {
                assert_eq!(frame, &frame::fail(0, "no"))
            }
            other => panic!("{other:?}"),
        }
        // Once it is gone, nothing more is sent to it.
        w.closed(Peer::Node(1), "closed");
        assert_eq!(drain(&mut w)[0], NodeAction::Drop(Peer::Node(1)));
        w.served(Ok(()));
        assert!(!drain(&mut w).iter().any(|a| matches!(a, NodeAction::Send { to: Peer::Node(1), .. })));
    }

    #[test]
    fn a_step_logs_its_quota_and_what_follows_the_users_message_quietly() {
        let mut w = watch_of(2, 2, 0, None);
        w.log(log::Level::Warn, "before");
        w.abort(0, 1, "");
        w.log(log::Level::Error, "after");
        let lines = logged(&drain(&mut w));
        assert_eq!(lines[0], (log::Level::Warn, "before".into()));
        assert_eq!(lines.last().unwrap(), &(log::Level::Info, "after".into()));
        for i in 0..300 {
            w.log(log::Level::Debug, &format!("line {i}\n"));
        }
        let lines = logged(&drain(&mut w));
        assert_eq!(lines.len(), LOGGED_LINES_MAX - 3 + 1);
        assert_eq!(lines[0].1, "line 0\\n");
        assert_eq!(lines.last().unwrap().1, "this step's further PMI messages are not logged");
    }

    #[test]
    fn names_go_to_srun_within_its_bounds_and_its_answers_to_the_asker() {
        let mut w = watch_of(2, 2, 0, None);
        let long = "x".repeat(NAME_MAX + 1);
        assert!(w.request(0, &HostRequest::Lookup { service: long }).is_err());
        w.request(3, &HostRequest::Lookup { service: "svc".into() }).unwrap();
        let asked = Up::Name { task: 3, op: NameOp::Lookup, name: "svc".into(), port: String::new() };
        assert_eq!(reports(&drain(&mut w)), [asked]);
        w.heard(Peer::Root, down(Down::Answer { task: 3, ok: true, text: "port-1".into() }));
        assert!(matches!(&w.take_answers()[..], [(3, HostReply::Port(p))] if p == "port-1"));
        // Answered once: a second answer is srun's fault.
        w.heard(Peer::Root, down(Down::Answer { task: 3, ok: true, text: "port-1".into() }));
        assert!(ended_here(&drain(&mut w)).is_some());
        assert_eq!(
            w.request(1, &HostRequest::Lookup { service: "svc".into() }),
            Err("srun (the collective root) is gone".into())
        );
    }
}

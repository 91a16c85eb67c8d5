//! srun's monitor of a step, sans-I/O: what the stepds say (decoded [`Up`] messages), that a connection
//! closed, and what the sruns of spawned steps did go in; what to do comes out as [`Action`]s (send a frame,
//! tell the user, end the step, start a spawn, tell the spawner), in order, for the I/O loop around it
//! ([`super`]) to carry out. It decides who waits for whom, who is at fault and what srun exits with; it
//! holds no socket, thread or clock but [`crate::os::monotonic_ns`]'s timestamp of when the step began to fail.
//!
//! **Who waits.** srun does not see every node's part, so each stepd says straight which exchange its own
//! shell joined (JOINED), when that matters: once the shell has waited in it a while, and before the stepd
//! says a rank or every rank on it is gone (`stepd::monitor`'s "Who joined"). While some node's shell waits
//! in an exchange, a node that has not joined it and has finished (every rank on it closed its PMI
//! connection), was lost, or lost a rank without finalize cannot join it any more: the step ends, naming it.
//!
//! **Bounds.** A node's part of one exchange is at most [`Bounds`]' `part_max` bytes and all parts together
//! at most its `exchange_max`: srun and every stepd with children check what they gather, and over either,
//! the step ends with a message naming the node, the size and the option that sets the bound.

use super::super::link::CONTROL_QUEUED_MAX;
#[cfg(test)]
use super::super::protocol::NameOp;
use super::super::protocol::{Down, Up, CONTROL_MAX, SPAWN_FRAME_MAX};
use super::super::spawn::{Asker, SrunEvent};
use super::Outcome;
use crate::collective::groups::DoneParts;
use crate::collective::{self, Allgather, Blocked, Bounds, Bytes, GroupRoot, Output, Peer, Tree};
use crate::server::{Names, TaskMap};
use crate::slurm::layout::with_node_names;
use crate::slurm::options::step_tree;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a rank that spoke PMI and left without finalize may stay the only one gone before the step ends
/// for it: when Slurm kills a step every task goes within it, and a barrier that waits for the rank names it
/// more exactly.
pub const LEFT_GRACE: Duration = Duration::from_secs(1);
/// How long srun holds a node's report that something failed elsewhere (a node at fault, or one that cannot
/// join an exchange) before it ends the step for it: the node where the cause lies reports it directly, one hop
/// sooner, but its frames may be read after the report (more so where several nodes find the same fault, as
/// Bruck's peers do); the cause's own words name the rank that left.
pub const CAUSE_GRACE: Duration = Duration::from_millis(100);

/// The step as the monitor sees it.
pub struct Shape {
    /// The name of every node, by node index.
    pub node_names: Vec<String>,
    /// The node of every rank.
    pub node_of: Vec<u32>,
    /// What one exchange may gather, and the options that set it.
    pub bounds: Bounds,
    /// The tree's width, where srun's environment sets it; `None` takes the stepds'.
    pub width: Option<u32>,
    /// How the exchanges go, where srun's environment sets it; `None` takes the stepds'.
    pub allgather: Option<Allgather>,
    /// Another step spawned this one: its spawner hears when every task runs, and when this step begins to
    /// fail.
    pub spawned: bool,
    /// This srun can start the steps that tasks spawn.
    pub can_spawn: bool,
}

/// What the monitor asks of the I/O around it, in the order it must happen.
#[derive(Debug, PartialEq, Eq)]
pub enum Action {
    /// Queue `frame` (an encoded [`Down`]) for node `node`, if it is connected.
    Send { node: u32, frame: Vec<u8> },
    /// Queue one frame's shared bytes for node `node` (a group exchange's result, the same for every member).
    SendShared { node: u32, frame: Bytes },
    /// Queue a frame of the collective for node `node`.
    SendCollective { node: u32, frame: Bytes },
    /// The first fatal event of the step, for the user.
    Error(String),
    /// What only someone debugging wants.
    Debug(String),
    /// End the step (srun: `slurm_kill_job_step`).
    EndStep,
    /// End every step this one spawned.
    EndSpawned,
    /// Start the spawn `request` of `asker`; if it cannot start, answer it with [`StepMonitor::answer`].
    StartSpawn { asker: Asker, request: String },
    /// Tell the srun that spawned this step that every task of it runs.
    TellStarted,
    /// Tell the srun that spawned this step that it began to fail.
    TellFailing,
}

#[derive(Default, Clone, Copy, PartialEq, Eq, Debug)]
enum NodeState {
    #[default]
    Unconnected,
    Connected,
    /// Said BYE: every task of the node has closed its PMI connection.
    Finished,
    /// Closed without BYE.
    Lost,
}

/// The collective over the tree, once its width and allgather are known.
struct Collective {
    tree: Tree,
    allgather: Allgather,
    root: collective::Root,
    /// The node whose HELLO set the width, and the allgather (`None`: srun's environment).
    width_from: Option<u32>,
    allgather_from: Option<u32>,
}

impl Collective {
    /// The collective of `nodes` nodes from `shape`'s width and allgather, else from node `node`'s HELLO.
    fn new(nodes: usize, shape: &Shape, node: u32, width: u32, allgather: Allgather) -> Result<Collective, String> {
        let tree = step_tree(nodes as u32, shape.width.unwrap_or(width)).map_err(|e| e.to_string())?;
        Ok(Collective {
            tree,
            allgather: shape.allgather.unwrap_or(allgather),
            root: collective::Root::new(tree, shape.bounds),
            width_from: shape.width.is_none().then_some(node),
            allgather_from: shape.allgather.is_none().then_some(node),
        })
    }

    /// Node `node`'s peers below it (its parent, its lower peers in Bruck's rounds), which it joins, or above
    /// it, which join it.
    fn peers(&self, node: u32, below: bool) -> impl Iterator<Item = u32> {
        self.allgather.peers(&self.tree, node).into_iter().filter(move |&p| (p < node) == below)
    }
}

/// srun's monitor of one step.
pub struct StepMonitor {
    shape: Shape,
    nodes: Vec<NodeState>,
    /// Where each admitted node listens for its higher peers.
    ports: Vec<u16>,
    /// The exchange each node's shell said it joined last (JOINED).
    joined: Vec<Option<u32>>,
    /// The latest of those a node said completed (COMPLETED).
    completed: Option<u32>,
    /// The nodes whose tasks have all sent a PMI line (STARTED), and how many have not.
    started: Vec<bool>,
    unstarted: usize,
    collective: Option<Collective>,
    /// PMI 1.2's group exchanges, a star through srun.
    groups: GroupRoot,
    /// Ranks that closed their connection without finalize, with their node.
    gone: Vec<(u32, u32)>,
    /// Ranks that closed it after finalize, with their node: no group barrier can wait for them.
    finalized: Vec<(u32, u32)>,
    gone_seen: Vec<bool>,
    /// The first rank that spoke PMI and left without finalize while others ran, its node, and when the step
    /// ends for it if the others still run ([`LEFT_GRACE`]).
    left: Option<(u32, u32, Instant)>,
    /// A node's report that something failed elsewhere, held until its cause has had [`CAUSE_GRACE`] to say
    /// more.
    held: Option<(String, Instant)>,
    /// The step's published names (PMI_Publish_name): one table for the step.
    names: Names,
    /// When this step began to fail ([`crate::os::monotonic_ns`]).
    failed_at: Option<u64>,
    /// The spawned step whose failure ended this one, named as such to the user.
    failed_for: Option<u32>,
    outcome: Outcome,
    /// srun is done with the step: the monitor takes in what is left.
    stopping: bool,
    actions: VecDeque<Action>,
}

impl StepMonitor {
    pub fn new(shape: Shape) -> Result<StepMonitor, String> {
        let n = shape.node_names.len();
        let collective = match (shape.width, shape.allgather) {
            (Some(width), Some(allgather)) => Some(Collective::new(n, &shape, 0, width, allgather)?),
            _ => None,
        };
        let size = shape.node_of.len();
        let groups = GroupRoot::new(TaskMap::new(shape.node_of.clone()), shape.bounds);
        Ok(StepMonitor {
            nodes: vec![NodeState::default(); n],
            ports: vec![0; n],
            joined: vec![None; n],
            completed: None,
            started: vec![false; n],
            unstarted: n,
            collective,
            groups,
            gone: Vec::new(),
            finalized: Vec::new(),
            gone_seen: vec![false; size],
            left: None,
            held: None,
            names: Names::new(),
            failed_at: None,
            failed_for: None,
            outcome: Outcome::default(),
            stopping: false,
            actions: VecDeque::new(),
            shape,
        })
    }

    /// The next thing to do, in order.
    pub fn poll(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    pub fn outcome(&self) -> &Outcome {
        &self.outcome
    }

    pub fn node_name(&self, node: u32) -> String {
        self.shape.node_names.get(node as usize).cloned().unwrap_or_else(|| format!("node {node}"))
    }

    /// A message of the collective's machines as the user reads it: nodes by name.
    fn named(&self, text: &str) -> String {
        with_node_names(text, &self.shape.node_names)
    }

    /// Node `node`'s stepd proved it serves the step, building the tree with `width`, exchanging by
    /// `allgather` and listening for its higher peers on `port`: what srun may queue unsent for it, or `None`
    /// if the step ends instead.
    pub fn admit(&mut self, node: u32, width: u32, allgather: Allgather, port: u16) -> Option<usize> {
        let name = self.node_name(node);
        if self.collective.is_none() {
            match Collective::new(self.nodes.len(), &self.shape, node, width, allgather) {
                Ok(c) => self.collective = Some(c),
                Err(e) => {
                    self.fatal(format!("the slurmstepd of {name} cannot build the PMI tree: {e}"), None);
                    return None;
                }
            }
        }
        let c = self.collective.as_ref()?;
        let (tree, width_from) = (c.tree, c.width_from);
        let from = |f: Option<u32>| {
            f.map_or("srun's environment".to_string(), |f| format!("the slurmstepd of {}", self.node_name(f)))
        };
        if allgather != c.allgather {
            let what = format!(
                "{} exchanges by allgather {}, the slurmstepd of {name} by {} (mpi.conf's RpmiAllgather differs \
                 between the nodes; SLURM_RPMI_ALLGATHER in srun's environment sets one for the job)",
                from(c.allgather_from),
                c.allgather.name(),
                allgather.name()
            );
            self.fatal(what, None);
            return None;
        }
        let listens_for = c.peers(node, false).next().is_some();
        if width != tree.width() {
            let what = format!(
                "{} builds the PMI tree with width {}, the slurmstepd of {name} with {width} (mpi.conf's \
                 RpmiTreeWidth differs between the nodes; SLURM_RPMI_TREE_WIDTH in srun's environment sets one \
                 width for the job)",
                from(width_from),
                tree.width(),
            );
            self.fatal(what, None);
            return None;
        }
        if listens_for && port == 0 {
            let what =
                format!("the slurmstepd of {name} has peers above it in the PMI tree but does not listen for them");
            self.fatal(what, None);
            return None;
        }
        // What srun may hold unsent for a stepd: an exchange's result, the group exchanges' and the answers.
        let groups = collective::groups::done_max(self.nodes.len() as u32, &self.shape.bounds);
        Some(self.shape.bounds.exchange_max.bytes.saturating_add(groups).saturating_add(CONTROL_QUEUED_MAX))
    }

    /// Node `node`, admitted, is connected: it hears where its lower peers listen, and its higher peers where
    /// it does, as far as they are known.
    pub fn connected(&mut self, node: u32, port: u16) {
        let Some(c) = &self.collective else { return };
        let (below, above): (Vec<u32>, Vec<u32>) = (c.peers(node, true).collect(), c.peers(node, false).collect());
        self.nodes[node as usize] = NodeState::Connected;
        self.ports[node as usize] = port;
        for p in below {
            match self.nodes[p as usize] {
                NodeState::Connected => self.send(node, &Down::Peer { node: p, port: self.ports[p as usize] }),
                NodeState::Finished => self.send(node, &Down::PeerDone { node: p }),
                NodeState::Unconnected | NodeState::Lost => {}
            }
        }
        for q in above {
            if self.nodes[q as usize] == NodeState::Connected {
                self.send(q, &Down::Peer { node, port });
            }
        }
    }

    /// The I/O around failed for `what`: the step cannot go on.
    pub fn broken(&mut self, what: String) {
        self.fatal(what, None);
    }

    /// The largest frame a node may send: a control frame, a spawn request or a group exchange's part. No
    /// exchange's parts come to srun: the tree's top is node 0.
    pub fn frame_max(&self) -> usize {
        CONTROL_MAX.max(SPAWN_FRAME_MAX).max(self.groups.contribution_max() + 1)
    }

    /// Node `node` sent a frame of `len` bytes, over [`Self::frame_max`]: refused unread, and the step ends.
    pub fn too_large(&mut self, node: u32, len: usize) {
        let what =
            format!("the slurmstepd of {} sent srun a frame of {len} bytes, more than it takes", self.node_name(node));
        self.fatal(what, None);
        self.disconnected(node);
    }

    /// Node `node` sent a frame that does not decode (`what` says why).
    pub fn malformed(&mut self, node: u32, what: &str) {
        let what = format!("the slurmstepd of {} sent a {what}", self.node_name(node));
        self.fatal(what, None);
        self.disconnected(node);
    }

    /// A message from admitted node `n`; false if its connection is to be dropped (then it is no longer
    /// connected, as the monitor sees it).
    pub fn message(&mut self, n: u32, message: Up) -> bool {
        let kept = self.take(n, message);
        if !kept {
            self.disconnected(n);
        }
        kept
    }

    fn take(&mut self, n: u32, message: Up) -> bool {
        let name = self.node_name(n);
        match message {
            Up::Hello { .. } | Up::Proof { .. } => {
                self.fatal(format!("the slurmstepd of {name} authenticated twice"), None);
                false
            }
            Up::Collective(frame) => {
                // The link takes frames as large as a group exchange's part: the collective's (control frames
                // only: srun takes no exchange's parts) are bounded here.
                if self.collective.as_ref().is_some_and(|c| frame.len() > c.root.frame_max(n)) {
                    self.too_large(n, frame.len() + 1);
                    return false;
                }
                if let Some(c) = &mut self.collective {
                    c.root.receive(n, frame);
                }
                self.pump();
                true
            }
            Up::Joined { epoch } => {
                self.joined[n as usize] = Some(epoch);
                self.check_blocked();
                true
            }
            Up::Completed { epoch } => {
                if self.joined[n as usize] == Some(epoch) {
                    self.completed = Some(self.completed.map_or(epoch, |c| c.max(epoch)));
                }
                true
            }
            Up::Started => {
                if !std::mem::replace(&mut self.started[n as usize], true) {
                    self.unstarted -= 1;
                    // The step's spawner answers the spawn now; a step that began to fail has said so instead.
                    if self.unstarted == 0 && self.shape.spawned && !self.outcome.ended {
                        self.actions.push_back(Action::TellStarted);
                    }
                }
                true
            }
            Up::Abort { rank, code, message } => {
                let what = format!(
                    "rank {rank} on {name} called PMI_Abort with exit code {code}{}{}",
                    if message.is_empty() { "" } else { ": " },
                    message
                );
                self.fatal(what, Some(code));
                true
            }
            Up::Error { rank: _, failed, message } => {
                if !self.outcome.ended && !failed {
                    self.outcome.job_error = true;
                }
                // The collective's own messages name the nodes already.
                let own = message.contains(&format!("the slurmstepd of {name}"));
                let elsewhere = failed && !own && message.contains("the slurmstepd of ");
                let what = match own {
                    true => message,
                    false => format!("{message} (on {name})"),
                };
                // srun may be done with a spawned step whose tasks have not all run because they all exited
                // (a missing program): its spawner must still hear that none started, and the user why.
                let starting = self.shape.spawned && self.unstarted > 0;
                match self.stopping && starting && !self.outcome.ended {
                    true => self.fail(what, None),
                    // Something failed on another node: its own report may name the rank.
                    false if elsewhere && !self.outcome.ended && !self.stopping => {
                        self.held.get_or_insert((what, Instant::now() + CAUSE_GRACE));
                    }
                    false => self.fatal(what, None),
                }
                true
            }
            Up::Gone { rank, finalized, spoke } => {
                if self.shape.node_of.get(rank as usize) != Some(&n) {
                    self.fatal(format!("the slurmstepd of {name} reported rank {rank}, not one of its own"), None);
                    return false;
                }
                if std::mem::replace(&mut self.gone_seen[rank as usize], true) {
                    return true;
                }
                match finalized {
                    true => self.finalized.push((rank, n)),
                    false => self.gone.push((rank, n)),
                }
                self.check_blocked();
                // An MPI process that leaves without finalize has failed its job: the others would wait for it
                // outside PMI (in MPI_Finalize's own shutdown, a receive) where no barrier tells, and Slurm
                // does not end a step for one failed task ([`Self::tick`]).
                if !finalized && spoke && self.left.is_none() && !self.outcome.ended && !self.stopping {
                    self.left = Some((rank, n, Instant::now() + LEFT_GRACE));
                }
                true
            }
            Up::Name { task, op, name, port } => {
                let (ok, text) = match self.names.serve(op, &name, &port) {
                    Ok(port) => (true, port),
                    Err(why) => (false, why),
                };
                self.send(n, &Down::Answer { task, ok, text });
                true
            }
            Up::Spawn { task, request } => {
                let Some(rank) = self.rank_of(n, task) else {
                    let what = format!("the slurmstepd of {name} asked a spawn for task {task}, not one of its own");
                    self.fatal(what, None);
                    return false;
                };
                let asker = Asker { node: n, task, rank };
                match () {
                    _ if self.outcome.ended || self.stopping => self.answer(asker, Err("the step is ending".into())),
                    _ if !self.shape.can_spawn => self.answer(
                        asker,
                        Err("this srun cannot start steps (it does not know its own executable)".into()),
                    ),
                    _ => self.actions.push_back(Action::StartSpawn { asker, request }),
                }
                true
            }
            Up::Group { id, part } => {
                match self.groups.contribute(n, &id, part) {
                    // A member may have finished or left before the first part came.
                    Ok(None) => self.check_groups_blocked(),
                    Ok(Some(done)) => {
                        // Encoded once, and the same bytes queued to every member; the parts are let go of as
                        // soon as their message is made.
                        let end = DoneParts::new(&done.id, &done.parts).map(Down::Group);
                        drop(done.parts);
                        if let Some(frame) = end.and_then(|end| end.encode().ok()).map(Arc::new) {
                            for &node in done.shells.iter() {
                                self.actions.push_back(Action::SendShared { node, frame: frame.clone() });
                            }
                        }
                    }
                    Err(what) => {
                        let what = self.named(&what);
                        self.fatal(what, None);
                        return false;
                    }
                }
                true
            }
            Up::Bye => {
                // Not a loss: the connection is dropped as the stepd asked.
                self.nodes[n as usize] = NodeState::Finished;
                // Its higher peers that have not reached it yet never will.
                let above: Vec<u32> = self.collective.as_ref().map_or(Vec::new(), |c| c.peers(n, false).collect());
                for q in above {
                    self.send(q, &Down::PeerDone { node: n });
                }
                self.check_blocked();
                false
            }
        }
    }

    /// Answers the spawn of `asker`: every process's error code, or why no step was made.
    pub fn answer(&mut self, asker: Asker, result: Result<i32, String>) {
        let (ok, text) = match result {
            Ok(code) => (true, code.to_string()),
            Err(why) => (false, why),
        };
        self.send(asker.node, &Down::Answer { task: asker.task, ok, text });
    }

    /// What the sruns of steps this one spawned did; `job` is the job's id, for the messages.
    pub fn spawned(&mut self, job: u32, events: Vec<SrunEvent>) {
        for event in events {
            match event {
                SrunEvent::Answer { asker, result } => self.answer(asker, result),
                // Its srun has said why on the job's stderr; this step ends with it.
                SrunEvent::Failing { rank, step } => {
                    if !self.outcome.ended && !self.stopping {
                        self.failed_for = Some(step);
                    }
                    self.fatal(format!("step {job}.{step}, which rank {rank} spawned, failed"), None)
                }
                // Its own srun's message, if it had one, is on the job's stderr.
                SrunEvent::Unstarted { rank, step, status } => self.actions.push_back(Action::Error(format!(
                    "step {job}.{step}, which rank {rank} spawned, ended with status {status} before all of its \
                     tasks ran: the spawn failed"
                ))),
                SrunEvent::Ended { status: 0, .. } => {}
                SrunEvent::Ended { rank, step, status, failing_at } => {
                    // srun's status is that of the step that began to fail first (ending a step kills the ones
                    // it spawned, and their failures follow from it; a failure in a spawned step may make this
                    // step's tasks fail too, before its srun says so).
                    let first = match (failing_at, self.failed_at) {
                        (Some(t), Some(ours)) => t <= ours,
                        (_, None) => true,
                        (None, Some(_)) => false,
                    };
                    if first {
                        self.outcome.spawned_status.get_or_insert(status);
                    }
                    let what = format!(
                        "step {job}.{step}, which rank {rank} spawned, failed: its srun exited with status {status}"
                    );
                    match (self.outcome.ended, self.stopping) {
                        (false, false) => self.fail(what, None),
                        // srun's own step is over: nothing to end, but srun's user hears why srun fails.
                        (false, true) => {
                            self.outcome.ended = true;
                            self.actions.push_back(Action::Error(what));
                        }
                        // A failure that followed from this one ended the step first: srun's status is this
                        // step's, and its user hears why.
                        (true, _) if first && self.failed_for != Some(step) => {
                            self.actions.push_back(Action::Error(what))
                        }
                        (true, _) => self.actions.push_back(Action::Debug(what)),
                    }
                }
            }
        }
    }

    /// When [`Self::tick`] has something to do.
    pub fn deadline(&self) -> Option<Instant> {
        self.left.map(|(_, _, due)| due).into_iter().chain(self.held.as_ref().map(|(_, due)| *due)).min()
    }

    /// Time has come to `now`: a rank that left without finalize [`LEFT_GRACE`] ago ends the step if any other
    /// rank still runs. Once every other rank has left there is nothing to end: Slurm's status says it. Nor
    /// when Slurm is ending the job (`job_ending`, asked only then): a cancelled or timed-out job's tasks get
    /// SIGTERM and their KillWait before SIGKILL, and those that take it to write a checkpoint must keep it.
    pub fn tick(&mut self, now: Instant, job_ending: impl FnOnce() -> bool) {
        if let Some((what, _)) = self.held.take_if(|(_, due)| *due <= now) {
            self.fatal(what, None);
        }
        let Some((rank, node, due)) = self.left else { return };
        if now < due {
            return;
        }
        self.left = None;
        if !self.gone_seen.contains(&false) || self.outcome.ended || self.stopping {
            return;
        }
        let what = format!(
            "rank {rank} on {} closed its PMI connection (exited or crashed) without PMI_Finalize while other ranks \
             run",
            self.node_name(node)
        );
        if job_ending() {
            self.actions.push_back(Action::Debug(format!("{what}, as Slurm ends the job: the step is Slurm's to end")));
            return;
        }
        self.fatal(what, None);
    }

    /// srun is done with the step: what the stepds sent before it ended (an abort from the last task) is
    /// still taken in, but a lost connection means nothing now, and there is no step left to end.
    pub fn draining(&mut self) {
        self.stopping = true;
    }

    /// The drain is over: every stepd still connected hears that the close which follows is the normal end.
    pub fn stop(&mut self) {
        self.stopping = true;
        if let Some(c) = &mut self.collective {
            c.root.end();
        }
        self.pump();
        for n in 0..self.nodes.len() as u32 {
            if self.nodes[n as usize] == NodeState::Connected {
                self.send(n, &Down::End);
            }
        }
    }

    /// Node `node`'s connection ended. A stepd says BYE before it closes, even when its step is cancelled:
    /// one that closes without it was killed or failed, and the step cannot go on, whether or not a barrier
    /// waits for it (its tasks went with it; Slurm's srun would wait for them for ever, as it does for a
    /// killed slurmstepd at finalize). What the barriers waiting for it say comes first.
    pub fn closed(&mut self, node: u32) {
        self.disconnected(node);
        // srun must not exit 0 for it: the statuses of that node's tasks are lost with it (whoever says so
        // first: the collective, a barrier waiting for it, or the loss itself).
        if !self.outcome.ended && !self.stopping {
            self.outcome.job_error = true;
        }
        if let Some(c) = &mut self.collective {
            c.root.lost(node);
        }
        self.pump();
        self.check_blocked();
        let what =
            format!("lost the connection to the slurmstepd of {}: it was killed or failed", self.node_name(node));
        self.fatal(what, None);
    }

    /// A connected node's link is gone: lost, unless it said BYE.
    fn disconnected(&mut self, node: u32) {
        if let Some(s) = self.nodes.get_mut(node as usize).filter(|s| **s == NodeState::Connected) {
            *s = NodeState::Lost;
        }
    }

    /// The rank of local task `task` of node `node`.
    fn rank_of(&self, node: u32, task: u32) -> Option<u32> {
        let mut local = self.shape.node_of.iter().enumerate().filter(|(_, &n)| n == node);
        local.nth(task as usize).map(|(rank, _)| rank as u32)
    }

    /// Does what the collective's root machine asks.
    fn pump(&mut self) {
        while let Some(output) = self.collective.as_mut().and_then(|c| c.root.poll()) {
            match output {
                Output::Send { to: Peer::Node(node), frame } => {
                    self.actions.push_back(Action::SendCollective { node, frame })
                }
                Output::Report { from, bytes } => {
                    let what = format!("{} (on {})", String::from_utf8_lossy(&bytes), self.node_name(from));
                    self.fatal(what, None);
                }
                Output::JobError { message, .. } => {
                    let what = self.named(&message);
                    self.fatal(what, None);
                }
                Output::Send { to: Peer::Root, .. } | Output::Done { .. } | Output::Failed { .. } => {}
            }
        }
    }

    /// The exchange in progress, as far as srun knows: the latest one a node's shell said it joined, until a
    /// node says it completed. srun takes no part in exchanges (the tree's top is node 0), and hears of one
    /// only from a node that waited in it ([`Up::Joined`]).
    fn exchange(&self) -> Option<u32> {
        let epoch = self.joined.iter().flatten().max().copied()?;
        self.completed.is_none_or(|c| c < epoch).then_some(epoch)
    }

    /// An exchange cannot complete if a node whose shell has not joined it is gone, or a rank on such a node
    /// left without finalize. The rank is named first: when it was its node's only rank, the node is
    /// finished too, and the GONE that names it may have come before the first JOINED.
    fn check_blocked(&mut self) {
        if self.outcome.ended {
            return;
        }
        self.check_groups_blocked();
        let Some(epoch) = self.exchange() else { return };
        if self.outcome.ended {
            return;
        }
        if let Some(&(rank, node)) = self.gone.iter().find(|(_, n)| self.joined[*n as usize] != Some(epoch)) {
            let what = format!(
                "rank {rank} on {} closed its PMI connection (exited or crashed) without PMI_Finalize while other \
                 ranks wait for it in a barrier",
                self.node_name(node)
            );
            return self.fatal(what, None);
        }
        for n in 0..self.nodes.len() {
            if self.joined[n] == Some(epoch) {
                continue;
            }
            let Some(why) = cannot_join(self.nodes[n]) else { continue };
            let what = format!("ranks wait in a PMI barrier that {} cannot join: {why}", self.node_name(n as u32));
            return self.fatal(what, None);
        }
    }

    /// Ends the step when a group exchange waits for a rank that left without finalize, or for a node that
    /// can bring nothing more.
    fn check_groups_blocked(&mut self) {
        let left =
            self.gone.iter().map(|&(r, n)| (r, n, false)).chain(self.finalized.iter().map(|&(r, n)| (r, n, true)));
        let nodes = &self.nodes;
        let what = match self.groups.blocked(left, nodes.len() as u32, |n| cannot_join(nodes[n as usize]).is_some()) {
            None => return,
            Some(Blocked::Rank { id, rank, node, finalized }) => {
                let how = match finalized {
                    true => "called PMI_Finalize",
                    false => "closed its PMI connection (exited or crashed) without PMI_Finalize",
                };
                format!(
                    "rank {rank} on {} {how} while other ranks wait for it in group barrier {id}",
                    self.node_name(node)
                )
            }
            Some(Blocked::Node { id, node }) => {
                let why = cannot_join(self.nodes[node as usize]).unwrap_or_default();
                format!("ranks wait in group barrier {id} that {} cannot join: {why}", self.node_name(node))
            }
        };
        self.fatal(what, None);
    }

    /// The first fatal event ends the step; later ones follow from the ending (the tasks it kills leave
    /// their barriers) and are logged at debug level only, not on the job's stderr as new faults. Once srun
    /// is done with the step (the final drain) a lost connection means nothing, and there is no step left
    /// to end.
    fn fatal(&mut self, what: String, abort_code: Option<i32>) {
        if self.outcome.ended || (self.stopping && abort_code.is_none()) {
            self.actions.push_back(Action::Debug(what));
            return;
        }
        self.fail(what, abort_code);
    }

    /// Ends the step for `what`, its first fatal event.
    fn fail(&mut self, what: String, abort_code: Option<i32>) {
        self.outcome.ended = true;
        self.outcome.abort_code = abort_code;
        self.failed_at = Some(crate::os::monotonic_ns());
        if self.shape.spawned {
            self.actions.push_back(Action::TellFailing);
        }
        // Every node waiting in the exchange in progress hears it failed, down the tree.
        if let Some(c) = &mut self.collective {
            c.root.fail(&what);
        }
        self.actions.push_back(Action::Error(what));
        if !self.stopping {
            self.actions.push_back(Action::EndStep);
        }
        // The steps it spawned end with it.
        self.actions.push_back(Action::EndSpawned);
        self.pump();
    }

    /// Queues `message` for node `node`.
    fn send(&mut self, node: u32, message: &Down) {
        if let Ok(frame) = message.encode() {
            self.actions.push_back(Action::Send { node, frame });
        }
    }
}

/// Why a node in `state` cannot join an exchange any more, if it cannot.
fn cannot_join(state: NodeState) -> Option<&'static str> {
    match state {
        NodeState::Finished => Some("every rank on it has closed its PMI connection"),
        NodeState::Lost => Some("its slurmstepd closed the connection (it was killed or failed)"),
        NodeState::Unconnected | NodeState::Connected => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::{frame::Frame, Bound};

    const BOUNDS: Bounds = Bounds {
        part_max: Bound { bytes: 1 << 20, option: "RPMI_TEST_PART_MAX" },
        exchange_max: Bound { bytes: 3 << 20, option: "RPMI_TEST_EXCHANGE_MAX" },
    };

    /// A step of `nodes` nodes, one rank each, as a star about node 0 (which listens for the others), every
    /// node connected.
    fn watch_of(nodes: usize, spawned: bool) -> StepMonitor {
        let shape = Shape {
            node_names: (1..=nodes).map(|n| format!("n{n}")).collect(),
            node_of: (0..nodes as u32).collect(),
            bounds: BOUNDS,
            width: Some(nodes as u32),
            allgather: Some(Allgather::Tree),
            spawned,
            can_spawn: true,
        };
        let mut w = StepMonitor::new(shape).unwrap();
        for n in 0..nodes as u32 {
            let port = if n == 0 { 20000 } else { 0 };
            assert!(w.admit(n, nodes as u32, Allgather::Tree, port).is_some());
            w.connected(n, port);
        }
        // Where node 0 listens, for the others.
        let parents = drain(&mut w);
        assert!(parents.iter().all(|a| matches!(a, Action::Send { .. })), "{parents:?}");
        w
    }

    fn drain(w: &mut StepMonitor) -> Vec<Action> {
        std::iter::from_fn(|| w.poll()).collect()
    }

    /// The user-facing lines among `actions`: errors as `error: ...`, debug lines as `debug: ...`.
    fn said(actions: &[Action]) -> Vec<String> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Error(m) => Some(format!("error: {m}")),
                Action::Debug(m) => Some(format!("debug: {m}")),
                _ => None,
            })
            .collect()
    }

    fn errors(actions: &[Action]) -> Vec<String> {
        said(actions).into_iter().filter(|l| l.starts_with("error: ")).collect()
    }

    /// Node `node`'s shell has waited in exchange `epoch` (JOINED): srun hears no parts, the tree's top is
    /// node 0.
    fn join(w: &mut StepMonitor, node: u32, epoch: u32) {
        assert!(w.message(node, Up::Joined { epoch }));
    }

    /// A chain of `nodes` nodes (srun, n1, n2, ...), every node connected and told where its parent listens.
    fn chain(nodes: usize) -> StepMonitor {
        let mut w = StepMonitor::new(Shape { width: Some(1), ..watch_of(nodes, false).shape }).unwrap();
        for n in 0..nodes as u32 {
            assert!(w.admit(n, 1, Allgather::Tree, 20000 + n as u16).is_some());
            w.connected(n, 20000 + n as u16);
        }
        drain(&mut w);
        w
    }

    /// Whether `actions` fail the exchange of node `node` (a FAIL sent down to it).
    fn fails(actions: &[Action], node: u32) -> bool {
        actions.iter().any(|a| match a {
            Action::SendCollective { node: n, frame } if *n == node => {
                matches!(Frame::decode(frame, usize::MAX), Ok(Frame::Fail { .. }))
            }
            _ => false,
        })
    }

    #[test]
    fn an_exchange_a_finished_node_cannot_join_fails_down_the_tree() {
        let mut w = watch_of(2, false);
        assert!(!w.message(1, Up::Bye));
        join(&mut w, 0, 0);
        let actions = drain(&mut w);
        assert!(fails(&actions, 0), "{actions:?}");
        assert!(errors(&actions)[0].contains("ranks wait in a PMI barrier that n2 cannot join: every rank on it"));
    }

    #[test]
    fn a_rank_gone_from_a_node_that_finished_before_the_exchange_is_named_not_its_node() {
        // Its only rank gone, n2 says GONE and BYE before n1 joins: the step ends naming the rank, not n2.
        let mut w = watch_of(2, false);
        assert!(w.message(1, Up::Gone { rank: 1, finalized: false, spoke: false }));
        assert!(!w.message(1, Up::Bye));
        assert!(!drain(&mut w).contains(&Action::EndStep), "no exchange yet");
        join(&mut w, 0, 0);
        let actions = drain(&mut w);
        assert!(fails(&actions, 0), "{actions:?}");
        let e = errors(&actions);
        assert!(e[0].contains("rank 1 on n2 closed its PMI connection"), "{e:?}");
        assert!(!said(&actions).iter().any(|l| l.contains("cannot join")), "{actions:?}");
    }

    #[test]
    fn a_finished_node_deep_in_the_tree_is_named_and_the_wait_failed_from_srun() {
        // A chain: srun, n1, n2, n3. n3 finished; n1 joins (srun sees no part yet: n1 waits for n2's).
        let mut w = chain(3);
        assert!(!w.message(2, Up::Bye));
        assert!(w.message(0, Up::Joined { epoch: 0 }));
        let actions = drain(&mut w);
        assert!(errors(&actions)[0].contains("ranks wait in a PMI barrier that n3 cannot join"), "{actions:?}");
        assert!(fails(&actions, 0), "{actions:?}");
    }

    #[test]
    fn a_node_lost_below_srun_is_named_by_its_parents_report() {
        let mut w = chain(3);
        // n1's machine says its child n2 closed its connection without saying it was done.
        assert!(w.message(0, Up::Collective(crate::collective::frame::lost(1))));
        let e = errors(&drain(&mut w));
        assert!(e[0].contains("the slurmstepd of n2 was lost: its connection to the slurmstepd of n1 closed"), "{e:?}");
    }

    #[test]
    fn a_node_that_finished_before_joining_the_exchange_in_progress_ends_the_step() {
        let mut w = watch_of(3, false);
        assert!(w.message(0, Up::Joined { epoch: 0 }));
        assert!(errors(&drain(&mut w)).is_empty());
        // Node 2 finished (BYE) without joining: its connection is dropped, and the barrier cannot complete.
        assert!(!w.message(2, Up::Bye));
        let actions = drain(&mut w);
        assert_eq!(
            errors(&actions),
            ["error: ranks wait in a PMI barrier that n3 cannot join: every rank on it has closed its PMI connection"]
        );
        assert!(actions.contains(&Action::EndStep));
        assert_eq!((w.outcome().ended, w.outcome().job_error), (true, false));
    }

    /// A node reports that another cannot join the exchange (every rank on it closed its connection) before
    /// that node's own GONE is read: the report waits [`CAUSE_GRACE`], and the GONE names the rank.
    #[test]
    fn a_report_of_a_failure_elsewhere_waits_for_its_causes_own() {
        let mut w = watch_of(3, false);
        let peer = "ranks wait in PMI exchange 0 that the slurmstepd of n3 cannot join: every rank on it has closed \
                    its PMI connection";
        assert!(w.message(0, Up::Joined { epoch: 0 }));
        assert!(w.message(0, Up::Error { rank: u32::MAX, failed: true, message: peer.into() }));
        assert!(errors(&drain(&mut w)).is_empty());
        assert!(w.deadline().is_some());
        assert!(w.message(2, Up::Gone { rank: 2, finalized: false, spoke: true }));
        let e = errors(&drain(&mut w));
        assert_eq!(e.len(), 1, "{e:?}");
        assert!(e[0].contains("rank 2 on n3 closed its PMI connection"), "{e:?}");
        w.tick(Instant::now() + CAUSE_GRACE, || false);
        assert!(errors(&drain(&mut w)).is_empty(), "the held report is said once the step ended: not at all");
        // Without more from the cause, the report ends the step once the grace is over.
        let mut w = watch_of(3, false);
        assert!(w.message(0, Up::Error { rank: u32::MAX, failed: true, message: peer.into() }));
        w.tick(Instant::now() + CAUSE_GRACE, || false);
        assert_eq!(errors(&drain(&mut w)), [format!("error: {peer} (on n1)")]);
        // A fault of the node's own, or a failure there, ends the step at once.
        for failed in [false, true] {
            let mut w = watch_of(3, false);
            assert!(w.message(0, Up::Error { rank: 0, failed, message: "rank 0 left".into() }));
            assert_eq!(errors(&drain(&mut w)).len(), 1);
        }
    }

    #[test]
    fn a_rank_gone_without_finalize_is_named_before_its_node() {
        let mut w = watch_of(2, false);
        // The GONE may come before any JOINED: nothing waits yet.
        assert!(w.message(1, Up::Gone { rank: 1, finalized: false, spoke: false }));
        assert!(!w.message(1, Up::Bye));
        assert!(errors(&drain(&mut w)).is_empty());
        assert!(w.message(0, Up::Joined { epoch: 0 }));
        let e = errors(&drain(&mut w));
        assert_eq!(e.len(), 1, "{e:?}");
        assert!(e[0].contains("rank 1 on n2 closed its PMI connection (exited or crashed) without PMI_Finalize"));
    }

    /// srun takes no part in exchanges: it knows one is in progress from a node that said it waits in it
    /// (JOINED), until a node says it completed (COMPLETED). A rank that leaves after that is not blamed for
    /// a barrier nobody waits in; once a node waits in the next, it is.
    #[test]
    fn an_exchange_said_completed_waits_no_more() {
        let mut w = watch_of(3, false);
        assert!(w.message(0, Up::Joined { epoch: 0 }));
        assert!(w.message(2, Up::Completed { epoch: 0 }), "a node that did not say it joined is ignored");
        assert!(w.message(0, Up::Completed { epoch: 0 }));
        assert!(w.message(1, Up::Gone { rank: 1, finalized: false, spoke: true }));
        assert!(errors(&drain(&mut w)).is_empty());
        assert!(w.message(2, Up::Joined { epoch: 1 }));
        let e = errors(&drain(&mut w));
        assert_eq!(e.len(), 1, "{e:?}");
        assert!(
            e[0].contains("rank 1 on n2 closed its PMI connection (exited or crashed) without PMI_Finalize"),
            "{e:?}"
        );
    }

    #[test]
    fn a_rank_that_spoke_and_left_without_finalize_ends_the_step_while_others_run() {
        // Rank 1 spoke PMI and left without finalize, no barrier waiting: rank 0 runs on, in MPI.
        let mut w = watch_of(2, false);
        assert!(w.message(1, Up::Gone { rank: 1, finalized: false, spoke: true }));
        assert_eq!(drain(&mut w), []);
        let due = w.deadline().unwrap();
        w.tick(due - LEFT_GRACE / 2, || unreachable!("asked before the grace is over"));
        assert_eq!(drain(&mut w), []);
        w.tick(due, || false);
        assert_eq!(w.deadline(), None);
        let actions = drain(&mut w);
        assert_eq!(
            errors(&actions),
            ["error: rank 1 on n2 closed its PMI connection (exited or crashed) without PMI_Finalize while other \
              ranks run"]
        );
        assert!(actions.contains(&Action::EndStep));
        assert_eq!((w.outcome().ended, w.outcome().job_error), (true, false));

        // Every other rank had left, or leaves within the grace (Slurm ends the step: scancel, the time
        // limit): nothing to end, Slurm's status says the rest.
        for first in [0, 1] {
            let mut w = watch_of(2, false);
            for rank in [first, 1 - first] {
                assert!(w.message(rank, Up::Gone { rank, finalized: rank == 0, spoke: true }));
            }
            w.tick(Instant::now() + LEFT_GRACE, || unreachable!("no rank runs"));
            assert_eq!(drain(&mut w), []);
            assert!(!w.outcome().ended);
        }

        // Slurm is ending the job (scancel, the time limit): the other ranks have their KillWait.
        let mut w = watch_of(2, false);
        assert!(w.message(1, Up::Gone { rank: 1, finalized: false, spoke: true }));
        w.tick(Instant::now() + LEFT_GRACE, || true);
        assert!(!drain(&mut w).iter().any(|a| matches!(a, Action::EndStep | Action::Error(_))));
        assert!(!w.outcome().ended);

        // A task that never spoke PMI (no MPI process, or one that failed before PMI_Init) ends nothing.
        let mut w = watch_of(2, false);
        assert!(w.message(1, Up::Gone { rank: 1, finalized: false, spoke: false }));
        assert_eq!(w.deadline(), None);
        assert_eq!(drain(&mut w), []);
    }

    #[test]
    fn nodes_that_joined_the_exchange_are_not_blamed() {
        let mut w = watch_of(2, false);
        assert!(w.message(0, Up::Joined { epoch: 0 }));
        assert!(w.message(1, Up::Joined { epoch: 0 }));
        assert!(!w.message(1, Up::Bye));
        assert!(errors(&drain(&mut w)).is_empty());
        assert!(!w.outcome().ended);
    }

    #[test]
    fn a_stepd_that_closes_without_bye_ends_the_step_as_a_job_error() {
        let mut w = watch_of(2, false);
        w.closed(1);
        let e = errors(&drain(&mut w));
        assert_eq!(e, ["error: lost the connection to the slurmstepd of n2: it was killed or failed"]);
        assert!(w.outcome().job_error);
        // In srun's final drain, a close is the normal end.
        let mut w = watch_of(2, false);
        w.draining();
        w.closed(1);
        assert!(errors(&drain(&mut w)).is_empty());
        assert!(!w.outcome().ended);
    }

    #[test]
    fn the_first_fault_is_the_error_and_what_follows_is_debug() {
        let mut w = watch_of(2, false);
        assert!(w.message(0, Up::Abort { rank: 0, code: 7, message: "oops".into() }));
        assert!(w.message(1, Up::Abort { rank: 1, code: 9, message: String::new() }));
        let actions = drain(&mut w);
        let said = said(&actions);
        assert_eq!(said[0], "error: rank 0 on n1 called PMI_Abort with exit code 7: oops");
        assert_eq!(said[1], "debug: rank 1 on n2 called PMI_Abort with exit code 9");
        assert_eq!(actions.iter().filter(|a| **a == Action::EndStep).count(), 1);
        assert_eq!(w.outcome().abort_code, Some(7));
    }

    #[test]
    fn a_job_error_that_no_failure_explains_is_srun_s_to_say() {
        let mut w = watch_of(1, false);
        let message = "rank 0: PMI protocol error: unknown command, in line 'x'".to_string();
        assert!(w.message(0, Up::Error { rank: 0, failed: false, message }));
        assert_eq!(errors(&drain(&mut w)), ["error: rank 0: PMI protocol error: unknown command, in line 'x' (on n1)"]);
        assert!(w.outcome().job_error);
        let mut w = watch_of(1, false);
        assert!(w.message(0, Up::Error { rank: 0, failed: true, message: "rank 0 left".into() }));
        assert!(!w.outcome().job_error);
    }

    /// Two nodes of one rank each, not yet connected, the tree's width `width` (`None`: the stepds').
    fn two_nodes(width: Option<u32>) -> StepMonitor {
        let names = vec!["n1".into(), "n2".into()];
        let shape = Shape {
            node_names: names,
            node_of: vec![0, 1],
            bounds: BOUNDS,
            width,
            allgather: Some(Allgather::Tree),
            spawned: false,
            can_spawn: false,
        };
        StepMonitor::new(shape).unwrap()
    }

    #[test]
    fn stepds_building_the_tree_with_another_width_end_the_step() {
        let mut w = two_nodes(None);
        assert!(w.admit(0, 1, Allgather::Tree, 4000).is_some());
        w.connected(0, 4000);
        assert_eq!(w.admit(1, 2, Allgather::Tree, 0), None);
        let e = errors(&drain(&mut w));
        assert!(e[0].contains("the slurmstepd of n1 builds the PMI tree with width 1, the slurmstepd of n2 with 2"));
    }

    #[test]
    fn a_node_hears_where_its_parent_listens_once_both_are_in() {
        let mut w = two_nodes(Some(1));
        // A chain: n2 below n1. The child comes first and waits for its parent's port.
        assert!(w.admit(1, 1, Allgather::Tree, 0).is_some());
        w.connected(1, 0);
        assert!(drain(&mut w).is_empty());
        assert!(w.admit(0, 1, Allgather::Tree, 4321).is_some());
        w.connected(0, 4321);
        let parent = Down::Peer { node: 0, port: 4321 }.encode().unwrap();
        assert_eq!(drain(&mut w), [Action::Send { node: 1, frame: parent }]);
        // Width 2 over 5 nodes: node 0 is the top, 1 and 2 its children, 3 and 4 node 1's. The child that came
        // first hears where its parent listens when the parent comes; one after its parent at once; one whose
        // parent finished first, that it did; node 0 hears nothing of parents.
        let mut w = StepMonitor::new(Shape { width: Some(2), ..watch_of(5, false).shape }).unwrap();
        let come = |w: &mut StepMonitor, n: u32| {
            assert!(w.admit(n, 2, Allgather::Tree, 20000 + n as u16).is_some());
            w.connected(n, 20000 + n as u16);
            drain(w)
        };
        let parent = |node, port| Down::Peer { node, port }.encode().unwrap();
        assert!(come(&mut w, 4).is_empty());
        assert!(come(&mut w, 0).is_empty());
        assert_eq!(come(&mut w, 2), [Action::Send { node: 2, frame: parent(0, 20000) }]);
        let both =
            [Action::Send { node: 1, frame: parent(0, 20000) }, Action::Send { node: 4, frame: parent(1, 20001) }];
        assert_eq!(come(&mut w, 1), both);
        assert!(!w.message(1, Up::Bye));
        drain(&mut w);
        let done = Down::PeerDone { node: 1 }.encode().unwrap();
        assert_eq!(come(&mut w, 3), [Action::Send { node: 3, frame: done }]);
        // A parent with children that does not listen is refused.
        let mut w = two_nodes(Some(1));
        assert_eq!(w.admit(0, 1, Allgather::Tree, 0), None);
        assert!(errors(&drain(&mut w))[0].contains("has peers above it in the PMI tree but does not listen for them"));
        // With Bruck's allgather over 5 nodes (width 4: every node a child of node 0), node 4 joins nodes 0 to
        // 3, node 3 joins nodes 0 to 2, node 1 node 0: each hears where the lower peers listen that are in.
        let bruck = Shape { width: Some(4), allgather: Some(Allgather::Bruck), ..watch_of(5, false).shape };
        let mut w = StepMonitor::new(bruck).unwrap();
        let come = |w: &mut StepMonitor, n: u32| {
            assert!(w.admit(n, 4, Allgather::Bruck, 20000 + n as u16).is_some());
            w.connected(n, 20000 + n as u16);
            drain(w)
        };
        let tell = |node: u32, p: u32| Action::Send { node, frame: parent(p, 20000 + p as u16) };
        assert!(come(&mut w, 4).is_empty());
        assert_eq!(come(&mut w, 0), [tell(4, 0)]);
        assert_eq!(come(&mut w, 1), [tell(1, 0), tell(4, 1)]);
        assert_eq!(come(&mut w, 3), [tell(3, 0), tell(3, 1), tell(4, 3)]);
        // Nodes that exchange by another allgather end the step.
        assert!(w.admit(2, 4, Allgather::Tree, 20002).is_none());
        assert!(errors(&drain(&mut w))[0].contains("exchanges by allgather bruck, the slurmstepd of n3 by tree"));
    }

    #[test]
    fn spawns_are_started_by_the_io_and_refused_while_the_step_ends() {
        let mut w = watch_of(2, false);
        assert!(w.message(1, Up::Spawn { task: 0, request: "{}".into() }));
        let asker = Asker { node: 1, task: 0, rank: 1 };
        assert_eq!(drain(&mut w), [Action::StartSpawn { asker, request: "{}".into() }]);
        // A task the node does not have is the stepd's fault.
        assert!(!w.message(1, Up::Spawn { task: 1, request: "{}".into() }));
        assert!(errors(&drain(&mut w))[0].contains("asked a spawn for task 1, not one of its own"));
        // The step ends: a spawn is answered at once.
        assert!(w.message(0, Up::Spawn { task: 0, request: "{}".into() }));
        let answer = Down::Answer { task: 0, ok: false, text: "the step is ending".into() }.encode().unwrap();
        assert_eq!(drain(&mut w), [Action::Send { node: 0, frame: answer }]);
    }

    /// A spawned step tells its spawner `started` once every node's tasks run, and not after it began to fail.
    #[test]
    fn a_spawned_step_says_started_once_every_node_has() {
        for fail_first in [false, true] {
            let mut w = watch_of(2, true);
            assert!(w.message(0, Up::Started));
            assert!(w.message(0, Up::Started));
            if fail_first {
                assert!(w.message(1, Up::Error { rank: 1, failed: true, message: "rank 1 left".into() }));
            }
            assert!(w.message(1, Up::Started));
            let actions = drain(&mut w);
            assert_eq!(actions.contains(&Action::TellStarted), !fail_first, "{actions:?}");
            assert_eq!(actions.contains(&Action::TellFailing), fail_first, "{actions:?}");
        }
    }

    /// In srun's final drain (srun is done with the step: its tasks all exited), a stepd's error about a
    /// spawned step whose tasks have not all run still fails the spawn and reaches the user; another step's
    /// is only logged (its end is normal).
    #[test]
    fn a_spawned_steps_error_in_the_final_drain_still_fails_its_spawn() {
        for spawned in [true, false] {
            let mut w = watch_of(1, spawned);
            w.draining();
            let message = "rank 0 of spawned step 1.1 exited before its first PMI line".to_string();
            assert!(w.message(0, Up::Error { rank: 0, failed: true, message }));
            let actions = drain(&mut w);
            assert_eq!(errors(&actions).len(), usize::from(spawned), "{actions:?}");
            assert_eq!(actions.contains(&Action::TellFailing), spawned);
        }
    }

    /// srun's status is that of the step that began to fail first, and its user hears why in every order.
    #[test]
    fn the_step_that_began_to_fail_first_gives_srun_its_status() {
        let asker_rank = 0;
        // The spawned step says it is failing first: one error line, naming it.
        let mut w = watch_of(2, false);
        w.spawned(42, vec![SrunEvent::Failing { rank: asker_rank, step: 7 }]);
        assert!(w.message(1, Up::Abort { rank: 1, code: 5, message: "lost my children".into() }));
        w.spawned(42, vec![SrunEvent::Ended { rank: 0, step: 7, status: 42, failing_at: Some(1) }]);
        let actions = drain(&mut w);
        assert_eq!(errors(&actions), ["error: step 42.7, which rank 0 spawned, failed"]);
        assert!(actions.contains(&Action::EndSpawned));
        assert_eq!((w.outcome().spawned_status, w.outcome().abort_code), (Some(42), None));
        // This step's abort, which followed from it, is read first: srun's status is still the spawned
        // step's, and the user hears that too.
        let mut w = watch_of(2, false);
        assert!(w.message(1, Up::Abort { rank: 1, code: 5, message: "lost my children".into() }));
        w.spawned(42, vec![SrunEvent::Failing { rank: asker_rank, step: 8 }]);
        w.spawned(42, vec![SrunEvent::Ended { rank: 0, step: 8, status: 42, failing_at: Some(1) }]);
        let e = errors(&drain(&mut w));
        assert_eq!(e.len(), 2, "{e:?}");
        assert!(e[1].contains("step 42.8, which rank 0 spawned, failed: its srun exited with status 42"));
        assert_eq!((w.outcome().spawned_status, w.outcome().abort_code), (Some(42), Some(5)));
        // A spawned step that failed after this one (its failure followed from ours) changes nothing.
        let mut w = watch_of(2, false);
        assert!(w.message(1, Up::Abort { rank: 1, code: 5, message: String::new() }));
        w.spawned(42, vec![SrunEvent::Ended { rank: 0, step: 9, status: 137, failing_at: Some(u64::MAX) }]);
        let e = errors(&drain(&mut w));
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!(w.outcome().spawned_status, None);
    }

    #[test]
    fn names_are_served_for_the_step() {
        let mut w = watch_of(2, false);
        let publish = Up::Name { task: 0, op: NameOp::Publish, name: "svc".into(), port: "p1".into() };
        assert!(w.message(0, publish));
        let lookup = Up::Name { task: 0, op: NameOp::Lookup, name: "svc".into(), port: String::new() };
        assert!(w.message(1, lookup));
        let actions = drain(&mut w);
        let ok = Down::Answer { task: 0, ok: true, text: String::new() }.encode().unwrap();
        let found = Down::Answer { task: 0, ok: true, text: "p1".into() }.encode().unwrap();
        assert_eq!(actions, [Action::Send { node: 0, frame: ok }, Action::Send { node: 1, frame: found }]);
    }

    #[test]
    fn a_rank_reported_by_another_node_is_that_stepd_s_fault() {
        let mut w = watch_of(2, false);
        assert!(!w.message(0, Up::Gone { rank: 1, finalized: true, spoke: true }));
        assert!(errors(&drain(&mut w))[0].contains("the slurmstepd of n1 reported rank 1, not one of its own"));
    }
}

//! The slurmstepd side: one [`Shell`] per node serving the node's tasks, and the node's place in the
//! collective's tree ([`crate::collective::Node`]): a connection to srun for the step's control frames (and,
//! for srun's children in the tree, the exchange), one to its parent stepd, and one from each child stepd.
//!
//! `mpi_p_slurmstepd_prefork` (before the tasks are forked, as root) takes the step's ids, this node's index
//! and the step's shape from Slurm's step record, and from the environment what srun's side of the plugin
//! put there (the root's port, the secret, the task map, the job's options), checked against the
//! record; the job's options are held to mpi.conf's ceilings (`super::options`), and a step that asks more is
//! refused before any task exists: the stepd joins srun only to say why, so that srun's user reads it. A stepd with children in the tree listens on an ephemeral port of its own node's address (as
//! slurm.conf gives it), and its HELLO to srun carries the port. It joins srun ([`super::uplink`]); a stepd
//! whose parent is another stepd then waits for srun to say where that parent listens (PARENT) and joins it
//! with the same handshake, at the parent's address as slurm.conf gives it (only the port comes from srun,
//! which is the user's). Both joins block in prefork, before any task exists, so they hold nobody's PMI
//! answers, and the progress loop needs no timers for connecting and retrying; a node's launch waits for
//! its parent's prefork (one handshake per level of the tree). If the parent finished before its child
//! reached it (its tasks did not use PMI, say), srun says so (PARENT_DONE) and the child goes on without
//! it. Then the node runs on the [`crate::node`] runtime: one socketpair per local task and one progress
//! thread, whose epoll loop serves the task connections and, through `SlurmHost`'s own fds, every
//! connection of the tree (non-blocking, each with a queue: a slow peer never holds the tasks' answers),
//! the admission of its children ([`super::admit`]) and the fork notice described below.
//!
//! **Failures.** A lost child is reported to srun by the collective (LOST), and srun ends the step naming
//! it. A lost parent, like a lost srun, ends the step from this node (and srun hears why, if it can).
//!
//! **Trust.** slurmstepd runs as root; the job's environment is the user's (a user's srun can put anything
//! in it). So the ids the plugin acts on (above all the step it asks slurmctld to end) come only from Slurm's
//! step record; an id in the environment that disagrees is ignored and logged. What the environment gives
//! (the task map, the node names, the root's port, the parent's port, the width, the bounds) only shapes the
//! user's own step.
//!
//! `mpi_p_slurmstepd_task` runs in each forked task child, a child of this multi-threaded process: it takes
//! no lock our threads may take, and allocates only inside Slurm's own environment setter (as Slurm itself
//! does in the child; glibc's malloc is usable after fork). It hands the task its end of the socketpair
//! (`PMI_FD`, close-on-exec cleared), closes every other task's end, and writes a notice into a pipe, even
//! when it fails. Slurm forks every task of the node before it lets any of them run, so the first notice
//! means every child holds its own end: the progress thread then closes the stepd's copies of all of them, and
//! a task that dies, even one that never reached the hook, is seen at once (EOF on the server end).

mod plan;

use super::admit::{Acceptor, Admission, Gate};
use super::auth::{self, Secret};
use super::layout::with_node_names;
use super::link::{Link, Read, Watch, CONTROL_QUEUED_MAX};
use super::options::{Settings, ENV_MAP, ENV_OPTIONS, ENV_PORT, ENV_SECRET, ENV_SPAWN};
use super::protocol::{Direction, Down, Malformed, NameOp, Up, CONTROL_MAX, MESSAGE_MAX, NAME_MAX, SPAWN_MAX};
use super::records::{self, stepd_step_rec_t, RecordFromEnv};
use super::spawn::SPAWN_PROCS_MAX;
use super::sys::{self, getenvp, Slurm};
use super::trace::{escape_text, Trace};
use super::uplink::{self, Hello};
use super::version::TaskInfo;
use crate::collective::{self, frame, Bounds, Bytes, Output, Parts, Peer, Tree};
use crate::driver::{HostFds, Watcher};
use crate::node::{ChildEnds, EnvVar, JobVars, Looping, NodeHost, NodeRuntime};
use crate::os;
use crate::server::{
    check_preput, GroupExchange, Host, HostReply, HostRequest, JobError, Limits, Shell, Speaker, TaskId,
};
use plan::{Place, Record, LOGGED_TEXT_MAX};
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{c_char, c_int, CString};
use std::io::{self, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::ops::Range;
use std::os::fd::{AsRawFd, IntoRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a stepd keeps trying to join srun, or its parent, before the step fails.
const JOIN_PATIENCE: Duration = Duration::from_secs(30);
/// How long `fini` lets the progress thread say BYE before it cuts the connection.
const FINI_GRACE: Duration = Duration::from_secs(2);
/// The most lines one step logs into slurmd's log.
const LOGGED_LINES_MAX: usize = 200;

/// The fork notice a task child writes: every task is forked, and whether its task info confirmed the ids.
const NOTICE_FORKED: u8 = 0;
const NOTICE_IDS_CONFIRMED: u8 = 1;

/// The step this process serves; set at prefork, read without a lock in the task children.
static STEPD: AtomicPtr<Stepd> = AtomicPtr::new(std::ptr::null_mut());

/// What the task children and `fini` need.
struct Stepd {
    /// The step's ids, from Slurm's step record.
    job: u32,
    step: u32,
    /// The rank of each local task, ascending; a task's index here is its [`crate::server::TaskId`].
    local_ranks: Vec<u32>,
    /// The node's tasks, their connections and the progress thread.
    node: NodeRuntime<SlurmHost>,
    /// Each task's PMI variables, prepared before the fork: the child only sets them.
    task_env: Vec<Vec<EnvVar>>,
    env_overwrite: sys::EnvOverwriteFmt,
    /// The write end of the fork-notice pipe (inherited by each child, close-on-exec).
    notify_w: RawFd,
    notify_r: RawFd,
    /// `fini` is running: the connections closing now is the normal end.
    stopping: Arc<AtomicBool>,
    /// A copy of the connection to srun, to cut it if the progress thread cannot say BYE in time.
    uplink: TcpStream,
}

/// Asks slurmctld to end the step this stepd serves, once a task has confirmed its ids.
fn kill_own_step(slurm: &Slurm, ids_confirmed: bool, place: &Place) -> Result<(), String> {
    if !ids_confirmed {
        return Err(format!(
            "not ending step {}.{} from here: no task has confirmed that Slurm runs it under these ids",
            place.job, place.step
        ));
    }
    slurm.kill_step(&place.id, libc::SIGKILL)
}

/// The epoll tokens of the stepd's own fds in the progress loop.
const UPLINK: u64 = 0;
const NOTICE: u64 = 1;
const TIMER: u64 = 2;
const PARENT: u64 = 3;
/// Child `first + i`'s connection has `CHILDREN + i`.
const CHILDREN: u64 = 16;
/// The acceptor's tokens (children in the handshake) start here.
const ACCEPTOR: u64 = 1 << 40;

/// A child's place in the tree, as this node serves it.
enum Child {
    /// Not admitted yet: what the collective sends it waits here (a FAIL, END or BYE, at most a few).
    Awaited(Vec<Bytes>),
    Linked(Link),
    /// Its connection closed.
    Gone,
}

/// How reading a connection ended, when it did.
enum End {
    /// The peer closed it, or it failed.
    Closed(String),
    /// The peer sent what it may not.
    Broke(String),
}

/// The engine's host on a slurmstepd. It runs on the progress thread and serves, beside the tasks, every
/// connection of the tree, the admission of the node's children and the fork-notice pipe in the same loop:
/// nothing it does blocks the tasks' answers.
struct SlurmHost {
    place: Place,
    /// Every node's name, for messages.
    names: Vec<String>,
    tree: Tree,
    /// The node's side of the collective.
    machine: collective::Node,
    /// What the collective completed for the shell (every part, or why it failed), until the shell takes it.
    completion: Option<Result<Parts, String>>,
    watch: Option<Arc<dyn Watch>>,
    /// The connection to srun; `None` once it closed or srun is not trusted any more.
    uplink: Option<Link>,
    /// The connection to the parent in the tree; `None` if the parent is srun, or is done or gone.
    parent: Option<Link>,
    /// The children in the tree, from `tree`'s first child of this node.
    children: Vec<Child>,
    /// Admits the children (a node with none has none).
    acceptor: Option<Acceptor>,
    /// Wakes the loop at the acceptor's deadlines and at `end_by`.
    timer: OwnedFd,
    /// When srun was told the step must end: if the step still runs then, this node ends it (srun is the
    /// user's, and may not act).
    end_by: Option<Instant>,
    slurm: &'static Slurm,
    /// The wire trace (`PMI_DEBUG`); its writer stops when the progress thread drops its host.
    trace: Option<Trace>,
    /// The read end of the fork-notice pipe, and the node's copies of the tasks' ends it closes.
    notify: OwnedFd,
    child_ends: Option<ChildEnds>,
    /// A task child found Slurm's task info naming the step read from the step record: only then does the
    /// stepd ask slurmctld to end that step.
    ids_confirmed: bool,
    /// Every local task has closed its connection: the connections closing now is the normal end.
    finished: bool,
    /// Set by `fini`.
    stopping: Arc<AtomicBool>,
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
    /// The group exchanges sent to srun that it has not ended.
    groups_asked: BTreeSet<Vec<u8>>,
    /// Group exchanges srun ended, until the shell takes them.
    groups_done: Vec<(Vec<u8>, Vec<Vec<u8>>)>,
    /// The largest result of a group exchange srun may send.
    group_result_max: usize,
    /// The most output a link may hold that its peer has not taken.
    queued_max: usize,
    /// In a spawned step, until each has sent its first PMI line: the local ranks that have not. STARTED goes
    /// to srun when none is left (srun's root then answers the spawn); one that exits before is a program
    /// that did not start, and fails the step.
    unspoken: Option<BTreeSet<u32>>,
    buf: Vec<u8>,
}

impl SlurmHost {
    /// The host of node `place.node` of `tree`, over the connections it made in prefork.
    #[allow(clippy::too_many_arguments)]
    fn new(
        place: Place,
        names: Vec<String>,
        tree: Tree,
        bounds: Bounds,
        limits: Limits,
        links: TreeLinks,
        slurm: &'static Slurm,
        trace: Option<Trace>,
        notify: OwnedFd,
        stopping: Arc<AtomicBool>,
        unspoken: Option<BTreeSet<u32>>,
    ) -> Result<SlurmHost, String> {
        let socket = |e: io::Error| format!("socket: {e}");
        let all_max = frame::parts_len(names.len(), limits.kvs_bytes_max);
        let group_result_max = collective::groups::done_max(names.len() as u32, &bounds);
        // What a link may hold unsent: an exchange's frame, the group exchanges' parts (held to the store's
        // bound) and the control frames the tasks' requests make.
        let queued_max = all_max.saturating_add(limits.kvs_bytes_max).saturating_add(CONTROL_QUEUED_MAX);
        let mut machine = collective::Node::new(tree, place.node, bounds, all_max).map_err(|e| e.to_string())?;
        let parent = match links.parent {
            Some((_, Some(s))) => Some(Link::new(s, PARENT, Default::default(), queued_max).map_err(socket)?),
            Some((p, None)) => {
                // srun said the parent finished before this node reached it: as if it had said goodbye and left.
                machine.receive(Peer::Node(p), frame::bye());
                machine.lost(Peer::Node(p));
                None
            }
            None => None,
        };
        Ok(SlurmHost {
            children: tree.children(Peer::Node(place.node)).map(|_| Child::Awaited(Vec::new())).collect(),
            place,
            names,
            tree,
            machine,
            completion: None,
            watch: None,
            uplink: Some(Link::new(links.srun, UPLINK, Default::default(), queued_max).map_err(socket)?),
            queued_max,
            parent,
            timer: timer()?,
            end_by: None,
            acceptor: links.acceptor,
            slurm,
            trace,
            notify,
            child_ends: None,
            ids_confirmed: false,
            finished: false,
            stopping,
            srun_done: false,
            ending: false,
            ended: false,
            ended_here: false,
            parent_lost: false,
            logged: 0,
            asked: BTreeMap::new(),
            limits,
            answers: Vec::new(),
            groups_asked: BTreeSet::new(),
            groups_done: Vec::new(),
            group_result_max,
            unspoken,
            buf: vec![0; 64 * 1024],
        })
    }

    fn me(&self) -> u32 {
        self.place.node
    }

    /// This node's first child in the tree (its children are `first..first + children.len()`).
    fn first_child(&self) -> u32 {
        self.tree.children(Peer::Node(self.me())).start
    }

    /// The parent's node index, if the parent is a stepd.
    fn parent_node(&self) -> Option<u32> {
        match self.tree.parent(self.me()) {
            Peer::Node(p) => Some(p),
            Peer::Root => None,
        }
    }

    /// A message of the collective's machines as the user reads it: nodes by name.
    fn named(&self, text: &str) -> String {
        with_node_names(text, &self.names)
    }

    /// Sends a control frame to srun; false if the connection is gone.
    fn report(&mut self, message: &Up) -> bool {
        match (&mut self.uplink, message.encode()) {
            (Some(l), Ok(frame)) => {
                l.send(frame);
                !l.is_broken()
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
            self.end_by = Some(Instant::now() + END_PATIENCE);
            self.arm_timer();
            self.log(log::Level::Info, text);
            return;
        }
        self.end_from_here(&format!("{text}; srun (the collective root) is gone"));
    }

    /// Asks slurmctld to end the step from this node (once), unless the step is ending normally.
    fn end_from_here(&mut self, why: &str) {
        let normal = self.finished || self.stopping.load(SeqCst) || self.srun_done;
        if normal || std::mem::replace(&mut self.ended_here, true) {
            self.log(log::Level::Info, why);
            return;
        }
        self.ending = true;
        let Place { job, step, node_name, .. } = &self.place;
        self.slurm.error(&format!("step {job}.{step} on {node_name}: {why}; ending the step"));
        if let Err(e) = kill_own_step(self.slurm, self.ids_confirmed, &self.place) {
            self.slurm.info(&e);
        }
    }

    fn job_error_text(&mut self, message: &str) {
        let m = Up::Error { rank: u32::MAX, failed: false, message: message.to_string() };
        self.end_step(m, message);
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
            if let Some(w) = &self.watch {
                let _ = w.remove(self.notify.as_raw_fd());
            }
        }
        if notices[..n.max(0) as usize].contains(&NOTICE_IDS_CONFIRMED) {
            self.ids_confirmed = true;
        }
    }

    /// What srun sent.
    fn hear_srun(&mut self, events: u32) {
        let max = CONTROL_MAX.max(self.machine.frame_max(Peer::Root) + 1).max(self.group_result_max + 1);
        let Some(link) = &mut self.uplink else { return };
        if events & libc::EPOLLOUT as u32 != 0 {
            link.flush();
        }
        let (frames, mut end) = hear(link, &mut self.buf, max, Down::decode);
        for m in frames {
            match m {
                Down::Collective(frame) => self.machine.receive(Peer::Root, frame),
                Down::End => self.srun_done = true,
                Down::Answer { task, ok, text } => match self.asked.remove(&(task as TaskId)) {
                    Some(asked) => self.answers.push((task as TaskId, asked.reply(ok, text))),
                    None => {
                        end = Some(End::Broke(format!("answered a request task {task} did not make")));
                        break;
                    }
                },
                Down::Group { id, parts } => match self.groups_asked.remove(&id) {
                    true => self.groups_done.push((id, parts)),
                    false => {
                        end = Some(End::Broke("ended a group exchange this node did not start".into()));
                        break;
                    }
                },
                // Taken at prefork; the parent's own connection says the rest.
                Down::Parent { .. } | Down::ParentDone => {}
                Down::Challenge { .. } | Down::Welcome { .. } => {
                    end = Some(End::Broke("sent a handshake frame after the handshake".into()));
                    break;
                }
            }
            self.pump();
        }
        if let Some(why) = self.uplink.as_ref().filter(|l| end.is_none() && l.is_broken()).map(Link::broke_why) {
            end = Some(End::Closed(why));
        }
        match end {
            Some(End::Closed(why)) => {
                self.lost_srun(&format!("lost the connection to srun (the collective root): {why}"))
            }
            Some(End::Broke(why)) => self.lost_srun(&format!("srun {why}")),
            None => {}
        }
    }

    /// The connection to srun is gone, or srun broke the protocol: no exchange can complete any more, and
    /// unless the step is ending anyway, this node ends it.
    fn lost_srun(&mut self, why: &str) {
        self.uplink = None;
        self.end_from_here(why);
        self.machine.lost(Peer::Root);
        self.pump();
    }

    /// What the parent sent.
    fn hear_parent(&mut self, events: u32) {
        let Some(p) = self.parent_node() else { return };
        let max = self.machine.frame_max(Peer::Node(p)) + 1;
        let Some(link) = &mut self.parent else { return };
        if events & libc::EPOLLOUT as u32 != 0 {
            link.flush();
        }
        let (frames, mut end) = hear(link, &mut self.buf, max, Down::decode);
        for m in frames {
            match m {
                Down::Collective(frame) => self.machine.receive(Peer::Node(p), frame),
                other => {
                    end = Some(End::Broke(format!("sent {}, which only srun sends", other.name())));
                    break;
                }
            }
            self.pump();
        }
        if let Some(why) = self.parent.as_ref().filter(|l| end.is_none() && l.is_broken()).map(Link::broke_why) {
            end = Some(End::Closed(why));
        }
        if let Some(end) = end {
            self.parent = None;
            if let End::Broke(why) = end {
                let what = format!("the slurmstepd of {} {why} to {}", self.names[p as usize], self.place.node_name);
                self.job_error(Some(p), what);
            }
            self.parent_lost = true;
            self.machine.lost(Peer::Node(p));
            self.pump();
            self.parent_lost = false;
        }
    }

    /// What child `first + i` sent.
    fn hear_child(&mut self, i: usize, events: u32) {
        let c = self.first_child() + i as u32;
        let max = self.machine.frame_max(Peer::Node(c)) + 1;
        let Some(Child::Linked(link)) = self.children.get_mut(i) else { return };
        if events & libc::EPOLLOUT as u32 != 0 {
            link.flush();
        }
        let (frames, mut end) = hear(link, &mut self.buf, max, Up::decode);
        for m in frames {
            match m {
                Up::Collective(frame) => self.machine.receive(Peer::Node(c), frame),
                other => {
                    end = Some(End::Broke(format!("sent {}, which only srun takes", other.name())));
                    break;
                }
            }
            self.pump();
        }
        if let Some(Child::Linked(l)) = self.children.get(i).filter(|_| end.is_none()) {
            if l.is_broken() {
                end = Some(End::Closed(l.broke_why()));
            }
        }
        if let Some(end) = end {
            self.children[i] = Child::Gone;
            if let End::Broke(why) = end {
                let what = format!("the slurmstepd of {} {why} to {}", self.names[c as usize], self.place.node_name);
                self.job_error(Some(c), what);
            }
            self.machine.lost(Peer::Node(c));
            self.pump();
        }
    }

    /// Takes what the acceptor has: admitted children, and lines about refusals.
    fn admissions(&mut self) {
        while let Some(event) = self.acceptor.as_mut().and_then(Acceptor::poll) {
            match event {
                Admission::Debug(line) => self.log(log::Level::Debug, &line),
                Admission::Joined(j) => {
                    let i = (j.node - self.first_child()) as usize;
                    let link = Link::new(j.stream, CHILDREN + i as u64, j.input, self.queued_max).and_then(|mut l| {
                        if let Some(w) = &self.watch {
                            l.watch(w.clone())?;
                        }
                        Ok(l)
                    });
                    let mut link = match link {
                        Ok(l) => l,
                        Err(e) => {
                            let what = format!("cannot serve the connection of {}: {e}", self.names[j.node as usize]);
                            self.job_error_text(&what);
                            continue;
                        }
                    };
                    if let Some(Child::Awaited(waiting)) = self.children.get(i) {
                        for frame in waiting {
                            let _ = link.send_collective(Direction::Down, frame);
                        }
                    }
                    if let Some(slot) = self.children.get_mut(i) {
                        *slot = Child::Linked(link);
                    }
                    // What it sent right after its proof.
                    self.hear_child(i, 0);
                }
            }
        }
    }

    /// Does what the collective asks.
    fn pump(&mut self) {
        while let Some(output) = self.machine.poll() {
            match output {
                Output::Send { to, frame } => self.send(to, &frame),
                Output::Done { parts, .. } => self.completion = Some(Ok(parts)),
                Output::Failed { message, .. } => {
                    self.completion = Some(Err(escape_text(&self.named(&message), MESSAGE_MAX)));
                }
                Output::JobError { node, message } => {
                    let text = self.named(&message);
                    self.job_error(node, text);
                }
                Output::Report { .. } => {}
            }
        }
    }

    /// A frame of the collective for `to`.
    fn send(&mut self, to: Peer, frame: &Bytes) {
        let parent = self.parent_node();
        let first = self.first_child();
        let link = match to {
            Peer::Root => self.uplink.as_mut().map(|l| (l, Direction::Up)),
            Peer::Node(n) if Some(n) == parent => self.parent.as_mut().map(|l| (l, Direction::Up)),
            Peer::Node(c) => match child_slot(&mut self.children, first, c) {
                Some(Child::Linked(l)) => Some((l, Direction::Down)),
                Some(Child::Awaited(waiting)) => {
                    waiting.push(frame.clone());
                    None
                }
                Some(Child::Gone) | None => None,
            },
        };
        if let Some((l, direction)) = link {
            let _ = l.send_collective(direction, frame);
        }
    }

    /// The collective cannot go on; `node` is at fault (`None`: srun). srun ends the step when this node
    /// tells it why; when srun itself is at fault, or the parent's connection closed while it mattered (as
    /// when srun's does), this node ends it itself.
    fn job_error(&mut self, node: Option<u32>, text: String) {
        match node {
            None => {
                // srun broke the protocol (or is gone): it is not trusted any more.
                self.uplink = None;
                self.end_from_here(&text);
            }
            Some(p) if Some(p) == self.parent_node() && self.parent_lost => {
                self.end_step(Up::Error { rank: u32::MAX, failed: true, message: text.clone() }, &text);
                self.end_from_here(&text);
            }
            Some(n) => {
                let failed = n != self.me();
                self.end_step(Up::Error { rank: u32::MAX, failed, message: text.clone() }, &text);
            }
        }
    }

    /// Arms the timer for the next deadline (the acceptor's, or `end_by`), or disarms it.
    fn arm_timer(&self) {
        let next = self.acceptor.as_ref().and_then(Acceptor::deadline).into_iter().chain(self.end_by).min();
        let after = next.map(|at| at.saturating_duration_since(Instant::now()));
        // Setting a live timerfd to a valid time does not fail.
        let _ = os::set_timer(&self.timer, after);
    }

    /// Hands the shell what the collective completed for it.
    fn complete(&mut self, shell: &mut Shell) {
        match self.completion.take() {
            Some(Ok(parts)) => {
                let parts: Vec<&[u8]> = parts.iter().map(|(_, bytes)| bytes).collect();
                shell.collective_complete(self, Ok(&parts));
            }
            Some(Err(why)) => {
                // The node that found why the exchange failed has told srun, which tells the user (or, without
                // srun, has ended the step itself): the barrier failing here follows from it, and what the
                // shell says of it is no new fault for the job's stderr. Over a chain, a node hears its
                // parent's failure before srun's end reaches it.
                self.ending = true;
                shell.collective_complete(self, Err(&why));
            }
            None => {}
        }
    }

    /// Handles the links that broke while this node sent on them (a peer that stopped reading leaves the
    /// link broken at once, not its output growing): as the peer's close would be.
    fn check_links(&mut self) {
        if self.uplink.as_ref().is_some_and(Link::is_broken) {
            self.hear_srun(0);
        }
        if self.parent.as_ref().is_some_and(Link::is_broken) {
            self.hear_parent(0);
        }
        for i in 0..self.children.len() {
            if matches!(&self.children[i], Child::Linked(l) if l.is_broken()) {
                self.hear_child(i, 0);
            }
        }
    }

    /// Every connection of the tree this node still has.
    fn links(&mut self) -> Vec<&mut Link> {
        let children = self.children.iter_mut().filter_map(|c| match c {
            Child::Linked(l) => Some(l),
            _ => None,
        });
        self.uplink.iter_mut().chain(self.parent.iter_mut()).chain(children).collect()
    }
}

/// Child `c`'s slot, when `c` is one of the children from `first`.
fn child_slot(children: &mut [Child], first: u32, c: u32) -> Option<&mut Child> {
    children.get_mut(c.checked_sub(first)? as usize)
}

/// Reads once from `link` (at most `buf`'s length), and decodes every whole frame of at most `max` bytes now
/// in its input; with why the connection is done, if it is. Frames that came before a close are handed back
/// before it. One read per wake-up: a peer that writes without pause (srun is the user's) is served a
/// buffer at a time, epoll (level-triggered) calls again for the rest, and what the node holds of it stays
/// within one buffer's frames; the rest waits in the socket, and TCP holds the writer back.
fn hear<M>(
    link: &mut Link,
    buf: &mut [u8],
    max: usize,
    decode: impl Fn(&[u8]) -> Result<M, Malformed>,
) -> (Vec<M>, Option<End>) {
    let mut got = Vec::new();
    let closed = match link.read(buf) {
        Read::Data(_) | Read::Blocked => None,
        Read::Closed(why) => Some(End::Closed(why)),
    };
    loop {
        match link.next(max) {
            Ok(None) => break,
            Ok(Some(payload)) => match decode(payload) {
                Ok(m) => got.push(m),
                Err(e) => return (got, Some(End::Broke(format!("sent a {e}")))),
            },
            Err(e) => return (got, Some(End::Broke(format!("sent {e}")))),
        }
    }
    // A frame's bytes were copied out: an exchange need not stay in the buffer beside its parts.
    link.release();
    (got, closed)
}

impl HostFds for SlurmHost {
    fn watch(&mut self, watcher: Watcher) {
        let watch: Arc<dyn Watch> = Arc::new(watcher);
        let events = libc::EPOLLIN as u32;
        let mut failed = Vec::new();
        for link in self.links() {
            if let Err(e) = link.watch(watch.clone()) {
                failed.push(e);
            }
        }
        if let Some(a) = &mut self.acceptor {
            if let Err(e) = a.watch(watch.clone()) {
                failed.push(e);
            }
        }
        if let Err(e) = watch.add(self.timer.as_raw_fd(), events, TIMER) {
            failed.push(e);
        }
        if let Err(e) = watch.add(self.notify.as_raw_fd(), events, NOTICE) {
            self.slurm.error(&format!("cannot watch the tasks' notices: {e}"));
        }
        self.watch = Some(watch);
        if let Some(e) = failed.first() {
            self.job_error_text(&format!("cannot watch the connections of the PMI tree: {e}"));
        }
    }

    fn ready(&mut self, token: u64, events: u32, shell: &mut Shell) {
        match token {
            NOTICE => self.take_notices(),
            TIMER => {
                os::drain_counter(&self.timer);
                if let Some(a) = &mut self.acceptor {
                    a.tick();
                }
                self.admissions();
                if self.end_by.is_some_and(|at| at <= Instant::now()) {
                    self.end_by = None;
                    let why = format!("srun did not end the step within {END_PATIENCE:?} of being told to");
                    self.end_from_here(&why);
                }
            }
            UPLINK => self.hear_srun(events),
            PARENT => self.hear_parent(events),
            t if self.acceptor.as_ref().is_some_and(|a| a.owns(t)) => {
                if let Some(a) = &mut self.acceptor {
                    a.ready(t);
                }
                self.admissions();
            }
            t if t >= CHILDREN => self.hear_child((t - CHILDREN) as usize, events),
            _ => {}
        }
        self.check_links();
        self.arm_timer();
        self.complete(shell);
        for (task, reply) in std::mem::take(&mut self.answers) {
            shell.host_reply(self, task, reply);
        }
        for (id, parts) in std::mem::take(&mut self.groups_done) {
            let parts: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
            shell.group_complete(self, &id, Ok(&parts));
        }
    }
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

impl Host for SlurmHost {
    fn collective(&mut self, contribution: &[u8]) -> Result<(), String> {
        // srun's checks of who can still join an exchange rest on this; once the collective failed, no one
        // can, and a task's every later barrier must not cost srun's link a frame.
        if !self.machine.failed() {
            self.report(&Up::Joined { epoch: self.machine.epoch() });
        }
        self.machine.contribute(contribution.to_vec()).map_err(|e| e.to_string())?;
        self.pump();
        match self.completion.take() {
            Some(Err(why)) => Err(why),
            other => {
                self.completion = other;
                Ok(())
            }
        }
    }

    fn serves_groups(&self) -> bool {
        true
    }

    /// A star through srun ([`crate::collective::groups`]), which checks the parts' bounds.
    fn group_collective(&mut self, exchange: &GroupExchange<'_>, contribution: &[u8]) -> Result<(), String> {
        let up = Up::Group { id: exchange.id.to_vec(), shells: exchange.shells.to_vec(), part: contribution.to_vec() };
        if !self.report(&up) {
            return Err("srun (the collective root) is gone".into());
        }
        self.groups_asked.insert(exchange.id.to_vec());
        Ok(())
    }

    fn abort(&mut self, rank: u32, exit_code: i32, message: &str) {
        // The message reaches srun's stderr (the user's) whole, and slurmd's log escaped and cut.
        let logged = format!(
            "rank {rank} called PMI_Abort with exit code {exit_code}{}{}",
            if message.is_empty() { "" } else { ": " },
            escape_text(message, LOGGED_TEXT_MAX)
        );
        self.end_step(Up::Abort { rank, code: exit_code, message: message.to_string() }, &logged);
    }

    fn job_error(&mut self, error: &JobError) {
        // A spawned task lost before its first line: that it never spoke says more than the barrier it left.
        let unspoken = match error {
            JobError::TaskLost { rank, .. } => self.left_unspoken(*rank),
            JobError::Protocol { .. } => None,
        };
        let message = unspoken.unwrap_or_else(|| error.to_string());
        let failed = matches!(error, JobError::TaskLost { .. });
        self.end_step(Up::Error { rank: error.rank(), failed, message: message.clone() }, &message);
    }

    fn log(&mut self, level: log::Level, message: &str) {
        // What reaches slurmd's log may carry what tasks or srun sent: it is escaped and cut, and a step
        // logs at most LOGGED_LINES_MAX lines (tasks can make the engine say something per request).
        self.logged += 1;
        if self.logged > LOGGED_LINES_MAX {
            if self.logged == LOGGED_LINES_MAX + 1 {
                self.slurm.info("this step's further PMI messages are not logged");
            }
            return;
        }
        // A stepd's errors also reach the job's stderr: once the user has been told why the step ends, the
        // consequences (every barrier failing) go to the slurmd log only.
        let level = if level <= log::Level::Warn && self.ending { log::Level::Info } else { level };
        self.slurm.log(level, &escape_text(message, MESSAGE_MAX));
    }

    fn trace(&mut self, rank: u32, speaker: Speaker, line: &[u8]) {
        if let Some(t) = &self.trace {
            t.line(&format!("rpmi: rank {rank} {speaker}: {}", String::from_utf8_lossy(line)));
        }
    }

    fn task_started(&mut self, rank: u32) {
        if let Some(unspoken) = &mut self.unspoken {
            unspoken.remove(&rank);
            if unspoken.is_empty() {
                self.unspoken = None;
                self.report(&Up::Started);
            }
        }
    }

    fn task_closed(&mut self, rank: u32, finalized: bool) {
        if let Some(message) = self.left_unspoken(rank) {
            self.end_step(Up::Error { rank, failed: true, message: message.clone() }, &message);
        }
        // srun fails a barrier of another node that waits for it: a plain one if it left without finalize,
        // a group barrier whichever way it left.
        self.report(&Up::Gone { rank, finalized });
    }

    /// Names go to srun's table for the step, spawns to srun, which starts each as a step of the job.
    fn request(&mut self, task: TaskId, request: HostRequest<'_>) -> Result<(), String> {
        let (op, name, port) = match request {
            HostRequest::Publish { service, port } => (NameOp::Publish, service, port),
            HostRequest::Unpublish { service } => (NameOp::Unpublish, service, ""),
            HostRequest::Lookup { service } => (NameOp::Lookup, service, ""),
            HostRequest::Spawn(spawn) => {
                // Bounded here: srun is the user's, and its answer makes an error code per process.
                if spawn.total_procs() > SPAWN_PROCS_MAX {
                    return Err(format!(
                        "a spawn of {} processes, more than the {SPAWN_PROCS_MAX} srun --mpi=rpmi starts at once",
                        spawn.total_procs()
                    ));
                }
                // Checked now, as the new step will (a spawn answered and then refused by that step would
                // end this one).
                for (key, value) in spawn.commands.iter().flat_map(|c| &c.preputs) {
                    check_preput(&self.limits, key, value)
                        .map_err(|why| format!("the preput '{}': {why}", String::from_utf8_lossy(key)))?;
                }
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
}

impl SlurmHost {
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
}

impl NodeHost for SlurmHost {
    fn served(&mut self, result: Result<(), String>) {
        match result {
            Ok(()) => {
                self.finished = true;
                // The collective's goodbyes to srun, the parent and the children, then srun's own.
                self.machine.finish();
                self.pump();
                self.report(&Up::Bye);
            }
            Err(why) => self.job_error_text(&format!("the PMI progress loop stopped: {why}")),
        }
        if let Some(a) = &mut self.acceptor {
            a.close();
        }
        self.admissions();
        // The loop no longer runs: what is queued goes now, within `fini`'s grace.
        Link::drain(&mut self.links(), Instant::now() + FINI_GRACE);
    }
}

fn cstring(s: String) -> CString {
    CString::new(s).unwrap_or_default()
}

/// The bounds of one exchange, within what this node's key-value store can take in anyway (a larger
/// exchange could not complete, and an interior node would hold it for nothing).
fn exchange_bounds(settings: &Settings) -> Bounds {
    let mut b = settings.bounds();
    let store = collective::Bound {
        bytes: settings.limits().kvs_bytes_max,
        option: "the most this slurmstepd's key-value store holds (SLURM_RPMI_KVS_BYTES_MAX, within mpi.conf's \
                 RpmiKvsBytesMax)",
    };
    for bound in [&mut b.part_max, &mut b.exchange_max] {
        if bound.bytes > store.bytes {
            *bound = store;
        }
    }
    b
}

/// The slurm.conf address of `name`, for the tree's connections; `what` says which node it is, for the
/// error.
fn address_of(slurm: &Slurm, name: &str, what: &str) -> Result<IpAddr, String> {
    slurm.node_address(name).ok_or_else(|| {
        format!(
            "slurm.conf gives no address for {name} ({what} in the PMI tree); SLURM_RPMI_TREE_WIDTH at least the \
             step's node count in srun's environment makes the tree a star, without links between nodes"
        )
    })
}

/// Gives a node's address as slurm.conf does: its index, and what it is to this node (for the error).
type Address<'a> = &'a dyn Fn(u32, &str) -> Result<IpAddr, String>;

/// This node's connections in the tree, made in prefork.
struct TreeLinks {
    srun: TcpStream,
    /// The parent, if it is a stepd, and the connection to it (`None`: it finished before this node reached
    /// it).
    parent: Option<(u32, Option<TcpStream>)>,
    /// Admits the children, if there are any.
    acceptor: Option<Acceptor>,
}

/// Listens for this node's children in the tree (if it has any) on its own address, joins srun at `srun`
/// with the port, then its parent (if that is a stepd) once srun says where it listens.
fn join_tree(
    srun: &[SocketAddr],
    tree: Tree,
    node: u32,
    secret: &Secret,
    names: &[String],
    address: Address,
) -> Result<TreeLinks, String> {
    let (mut s, acceptor, hello) = join_srun(srun, tree, node, secret, address)?;
    let parent = match tree.parent(node) {
        Peer::Root => None,
        Peer::Node(p) => Some((p, join_parent(&mut s, names, Hello { to: p, ..hello }, secret, address)?)),
    };
    Ok(TreeLinks { srun: s, parent, acceptor })
}

/// Listens for this node's children in the tree (if it has any) and joins srun with the port: the
/// connection, the acceptor and the HELLO it sent.
fn join_srun(
    srun: &[SocketAddr],
    tree: Tree,
    node: u32,
    secret: &Secret,
    address: Address,
) -> Result<(TcpStream, Option<Acceptor>, Hello), String> {
    let children = tree.children(Peer::Node(node));
    let acceptor = match children.is_empty() {
        true => None,
        false => Some(children_acceptor(node, children, secret, tree.width(), address)?),
    };
    let hello = Hello { node, to: auth::ROOT, port: acceptor.as_ref().map_or(0, Acceptor::port), width: tree.width() };
    let s = uplink::join(srun, &hello, secret, JOIN_PATIENCE, "srun's collective root", uplink::sleep)
        .map_err(|e| e.to_string())?;
    Ok((s, acceptor, hello))
}

/// Tells srun why this node refuses the step, so that srun's user reads it (a stepd's log is the site's): it
/// joins srun as for the step, says it as an error, and leaves. srun ends the step; no task starts here
/// either way.
fn refuse(srun: &[SocketAddr], tree: Tree, node: u32, secret: &Secret, address: Address, why: &str) {
    let Ok((mut s, _acceptor, _)) = join_srun(srun, tree, node, secret, address) else { return };
    if let Ok(frame) = (Up::Error { rank: u32::MAX, failed: false, message: why.to_string() }).encode() {
        let _ = s.write_all(&frame);
    }
}

/// Joins this node's parent (`hello.to`) once srun says where it listens; `None` if srun says it finished
/// first.
fn join_parent(
    srun: &mut TcpStream,
    names: &[String],
    hello: Hello,
    secret: &Secret,
    address: Address,
) -> Result<Option<TcpStream>, String> {
    let p = hello.to;
    let parent = &names[p as usize];
    let deadline = Instant::now() + JOIN_PATIENCE;
    let port = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!(
                "srun did not say within {JOIN_PATIENCE:?} where {parent} (this node's parent in the PMI tree) listens"
            ));
        }
        match uplink::notice(srun, left)? {
            None => {}
            Some(Down::Parent { port }) => break port,
            Some(Down::ParentDone) => return Ok(None),
            Some(other) => {
                return Err(format!("srun sent {} before it said where this node's parent listens", other.name()))
            }
        }
    };
    let addr = SocketAddr::new(address(p, "this node's parent")?, port);
    let whom = format!("{parent} (this node's parent in the PMI tree)");
    let mut done = false;
    let joined =
        uplink::join(&[addr], &hello, secret, JOIN_PATIENCE, &whom, |wait| match uplink::notice(srun, wait)? {
            None => Ok(()),
            Some(Down::ParentDone) => {
                done = true;
                Err(format!("{parent} finished"))
            }
            Some(other) => Err(format!("srun sent {} while this node joined its parent", other.name())),
        });
    match joined {
        Ok(s) => Ok(Some(s)),
        Err(_) if done => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

/// How long srun, told that the step must end (an abort, a job error), has to end it before the stepd that
/// told it ends it itself: srun is the user's own process, and a stopped one must not keep a failed step.
const END_PATIENCE: Duration = Duration::from_secs(5);

/// A timerfd for the acceptor's and the step's deadlines.
fn timer() -> Result<OwnedFd, String> {
    os::timerfd().map_err(|e| format!("timerfd: {e}"))
}

/// The listener for this node's children in the tree, on its own address as slurm.conf gives it, and the
/// acceptor that admits them (from their addresses, where slurm.conf gives them all).
fn children_acceptor(
    node: u32,
    children: Range<u32>,
    secret: &Secret,
    width: u32,
    address: Address,
) -> Result<Acceptor, String> {
    let own = address(node, "a node with children")?;
    let listener = TcpListener::bind((own, 0)).map_err(|e| format!("cannot listen on {own} for the PMI tree: {e}"))?;
    let addresses = children.clone().map(|c| address(c, "a child").ok()).collect();
    let gate = Gate { secret: secret.clone(), to: node, members: children, addresses, width: Some(width) };
    Acceptor::new(listener, gate, ACCEPTOR).map_err(|e| format!("cannot listen for the PMI tree: {e}"))
}

/// `mpi_p_slurmstepd_prefork`.
///
/// # Safety
/// `job` is slurmstepd's step record and `env` the `char ***` Slurm passes: the step's environment, which
/// the tasks inherit.
pub unsafe fn prefork(job: *const stepd_step_rec_t, env: *mut *mut *mut c_char) -> Result<(), String> {
    let slurm = sys::slurm();
    if env.is_null() {
        return Err("no environment".into());
    }
    // SAFETY: Slurm's environment array, as the caller promises.
    let envp = unsafe { *env } as *const *const c_char;
    if !STEPD.load(SeqCst).is_null() {
        return Err("prefork called twice in one slurmstepd".into());
    }
    let record = job;
    // SAFETY: Slurm's step record, as the caller promises; only its leading fields are read.
    let r = unsafe { job.as_ref() }.ok_or("no step record")?;
    let rec = Record {
        job: r.step_id.job_id,
        step: r.step_id.step_id,
        id: r.step_id,
        nodes: r.nnodes,
        tasks: r.ntasks,
        node: r.nodeid,
        node_tasks: r.node_tasks,
    };
    // SAFETY: Slurm's environment array, as the caller promises.
    let read = |name: &str| unsafe { getenvp(envp, name) };
    let expand = |list: &str, max: usize| slurm.expand_nodelist(list, max);
    let Some(mut plan) = plan::plan(rec, &read, &expand, &super::site())? else {
        slurm.info(&format!("{ENV_PORT} is not set: this step was not started by `srun --mpi=rpmi`; no PMI"));
        return Ok(());
    };
    let env_overwrite = slurm.env_overwrite_fmt.ok_or("slurm_env_array_overwrite_fmt is not in this process")?;
    for note in &plan.notes {
        slurm.info(note);
    }
    let (tree, node, width) = (plan.tree, plan.place.node, plan.tree.width());
    let addrs: Vec<_> = (plan.host.as_str(), plan.port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve srun's address {}: {e}", plan.host))?
        .collect();
    let address = |n: u32, what: &str| address_of(slurm, &plan.names[n as usize], what);
    let settings = match &plan.settings {
        Ok(s) => s.clone(),
        Err(why) => {
            let why = format!("the slurmstepd of {} refuses the step: {why}", plan.place.node_name);
            refuse(&addrs, tree, node, &plan.secret, &address, &why);
            return Err(why);
        }
    };
    let bounds = exchange_bounds(&settings);
    let trace = match settings.trace() {
        true => Some(Trace::start(libc::STDERR_FILENO).map_err(|e| format!("cannot start the trace: {e}"))?),
        false => None,
    };
    let links = join_tree(&addrs, tree, node, &plan.secret, &plan.names, &address)?;
    let srun_copy = links.srun.try_clone().map_err(|e| format!("socket: {e}"))?;
    // SAFETY: `job` and `env` as Slurm passes them (the caller's contract).
    let info = plan::job_info(&mut plan, &read, || unsafe { multi_prog_config(record, env) })?;
    let spawned = info.spawned;
    let (place, names, local_ranks) = (plan.place, plan.names, plan.local_ranks);
    let limits = settings.limits();
    let mut shell = Shell::new(info, limits.clone()).map_err(|e| format!("cannot serve this step: {e}"))?;
    shell.set_trace(trace.is_some());

    let (notify_r, notify_w) = os::pipe().map_err(|e| format!("pipe: {e}"))?;

    let stopping = Arc::new(AtomicBool::new(false));
    let notify_r_raw = notify_r.as_raw_fd();
    let unspoken = spawned.then(|| local_ranks.iter().copied().collect());
    let host_side = SlurmHost::new(
        place.clone(),
        names,
        tree,
        bounds,
        limits,
        links,
        slurm,
        trace,
        notify_r,
        stopping.clone(),
        unspoken,
    )?;
    let job = JobVars { job_id: format!("{}.{}", rec.job, rec.step) };
    let mut node_rt =
        NodeRuntime::new(shell, host_side, job).map_err(|e| format!("cannot set up the progress loop: {e}"))?;
    let child_ends = node_rt.child_ends();
    if let Some(h) = node_rt.host_mut() {
        h.child_ends = Some(child_ends);
    }
    let task_env = (0..local_ranks.len())
        .map(|t| node_rt.connect_task(t).map(|c| c.vars).map_err(|e| format!("cannot serve local task {t}: {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    node_rt.start(Looping::OwnThread).map_err(|e| e.to_string())?;

    let stepd = Box::into_raw(Box::new(Stepd {
        job: rec.job,
        step: rec.step,
        local_ranks,
        node: node_rt,
        task_env,
        env_overwrite,
        notify_w: notify_w.into_raw_fd(),
        notify_r: notify_r_raw,
        stopping,
        uplink: srun_copy,
    }));
    // SAFETY: just made; freed only in `fini`.
    let shared: &'static Stepd = unsafe { &*stepd };
    STEPD.store(stepd, SeqCst);
    // What srun passed for the stepds only; the tasks get their PMI_* variables.
    for name in [ENV_SECRET, ENV_MAP, ENV_OPTIONS, ENV_SPAWN] {
        // SAFETY: Slurm's environment array, as the caller promises.
        unsafe { slurm.unsetenv(*env, &cstring(name.into())) };
    }
    slurm.log(
        log::Level::Debug,
        &format!(
            "serving {} local tasks of step {}.{} on {} (node {node}, PMI tree width {width})",
            shared.local_ranks.len(),
            rec.job,
            rec.step,
            place.node_name
        ),
    );
    Ok(())
}

/// The text of the step's `srun --multi-prog` configuration, if it is such a step: the record's `argv[1]`
/// when its launch flags say so. Slurm passes the address of the record's `env` field as `env`; the fields
/// after it ([`RecordFromEnv`]) are read only if that address lies within the record's first KiB and
/// the record's `jmgr_pid` there is this process's pid, as Slurm sets it before prefork.
///
/// # Safety
/// `job` is NULL or Slurm's step record, and `env` the address Slurm passes with it.
unsafe fn multi_prog_config(job: *const stepd_step_rec_t, env: *mut *mut *mut c_char) -> Option<String> {
    let (start, at) = (job as usize, env as usize);
    if job.is_null() || at <= start || at - start > 1024 || at % std::mem::align_of::<RecordFromEnv>() != 0 {
        return None;
    }
    let rec = env as *const RecordFromEnv;
    // SAFETY: within Slurm's step record (larger than these fields in every supported line), read field by
    // field as plain integers and pointers; `jmgr_pid` confirms the layout before anything else is used.
    unsafe {
        if std::ptr::addr_of!((*rec).jmgr_pid).read() != libc::getpid() {
            return None;
        }
        let argv = std::ptr::addr_of!((*rec).argv).read();
        if std::ptr::addr_of!((*rec).flags).read() & records::LAUNCH_MULTI_PROG == 0
            || argv.is_null()
            || (*argv).is_null()
        {
            return None;
        }
        let text = *argv.add(1);
        (!text.is_null()).then(|| std::ffi::CStr::from_ptr(text).to_string_lossy().into_owned())
    }
}

/// Stops the progress thread and frees the step: the thread gets [`FINI_GRACE`] to say BYE, then the
/// connection is cut (so that a root that reads slowly cannot hold it) and it is joined.
fn free(mut stepd: Box<Stepd>) {
    stepd.stopping.store(true, SeqCst);
    let uplink = &stepd.uplink;
    stepd.node.stop(Some(FINI_GRACE), || {
        let _ = uplink.shutdown(std::net::Shutdown::Both);
    });
    let _ = stepd.uplink.shutdown(std::net::Shutdown::Both);
    // SAFETY: our fd, closed once.
    unsafe { libc::close(stepd.notify_w) };
}

/// `fini` in a slurmstepd: stops the threads (the progress thread says BYE to the root) and frees the step.
pub fn fini() {
    let p = STEPD.swap(std::ptr::null_mut(), SeqCst);
    if !p.is_null() {
        // SAFETY: the pointer prefork made, taken out of STEPD, so freed once; the reader that shares it is
        // joined before the box is dropped.
        free(unsafe { Box::from_raw(p) });
    }
}

/// `mpi_p_slurmstepd_task`, in the forked task child: no lock our threads take; Slurm's environment setter
/// is the only thing that allocates.
///
/// # Safety
/// Pointers as Slurm passes them.
pub unsafe fn task(info: *const TaskInfo, env: *mut *mut *mut c_char) -> c_int {
    let p = STEPD.load(SeqCst);
    if p.is_null() {
        // Not an rpmi step (see prefork): nothing to set.
        return records::SLURM_SUCCESS;
    }
    // SAFETY: set at prefork and freed only at fini, which this forked child never runs.
    let Some(stepd) = (unsafe { p.as_ref() }) else { return records::SLURM_ERROR };
    // SAFETY: Slurm's task info, as the caller promises.
    let info = unsafe { info.as_ref() };
    // Slurm fills the task info from the same step record prefork read: ids that differ mean the record was
    // not read as it is laid out, and nothing read from it can be trusted.
    let confirmed = info.is_some_and(|i| i.step_id.job_id == stepd.job && i.step_id.step_id == stepd.step);
    let rc = match info {
        // SAFETY: as above.
        Some(info) if confirmed => unsafe { set_up_task(stepd, info, env) },
        _ => records::SLURM_ERROR,
    };
    // Whatever happened, tell the stepd: every task is forked now (see the module's documentation), and
    // whether the ids are Slurm's.
    let notice = [if confirmed { NOTICE_IDS_CONFIRMED } else { NOTICE_FORKED }];
    // SAFETY: a one-byte write from a live buffer, and closes of fds this child inherited.
    unsafe {
        libc::write(stepd.notify_w, notice.as_ptr().cast(), 1);
        libc::close(stepd.notify_w);
        libc::close(stepd.notify_r);
    }
    rc
}

/// Hands the task its `PMI_FD` (closing the other tasks' ends) and its PMI variables.
///
/// # Safety
/// `env` as Slurm passes it to the task hook.
unsafe fn set_up_task(stepd: &Stepd, info: &TaskInfo, env: *mut *mut *mut c_char) -> c_int {
    let Ok(task) = stepd.local_ranks.binary_search(&info.gtaskid) else { return records::SLURM_ERROR };
    if stepd.node.exec_hook(task).is_err() {
        return records::SLURM_ERROR;
    }
    let set = |v: &EnvVar| {
        // SAFETY: Slurm's setter with a "%s" format and one NUL-terminated string.
        unsafe { (stepd.env_overwrite)(env, v.name.as_ptr(), c"%s".as_ptr(), v.value.as_ptr()) == 1 }
    };
    if stepd.task_env[task].iter().all(set) {
        records::SLURM_SUCCESS
    } else {
        records::SLURM_ERROR
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::os::Epoll;
    use crate::server::{JobInfo, Limits, TaskMap};
    use crate::slurm::client::bounds;
    use crate::slurm::records::slurm_step_id_t;
    use crate::slurm::root::{Outcome, RootThread, Step};
    use std::io::{BufRead, BufReader, Write};
    use std::net::Ipv4Addr;
    use std::os::fd::FromRawFd;
    use std::os::unix::net::UnixStream;

    const KVSNAME: &str = "rpmi_1.0";

    use crate::slurm::root::tests::Record;

    fn names(nodes: u32) -> Vec<String> {
        (1..=nodes).map(|n| format!("n{n}")).collect()
    }

    /// srun's root for a step of `nodes` nodes with one rank each, the width left to the stepds.
    fn srun(nodes: u32, secret: &Secret) -> (RootThread, Record) {
        srun_of((0..nodes).collect(), nodes, secret, None)
    }

    /// srun's root for a step whose rank `r` runs on node `node_of[r]`; `spawned_by`: the pipe to a spawning
    /// srun.
    fn srun_of(node_of: Vec<u32>, nodes: u32, secret: &Secret, spawned_by: Option<RawFd>) -> (RootThread, Record) {
        let record = Record::default();
        let step = Step {
            node_names: names(nodes),
            node_of,
            secret: secret.clone(),
            addresses: None,
            bounds: bounds(1 << 20, 4 << 20),
            width: None,
            spawn: None,
            spawned_by,
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
    fn stepd(port: u16, nodes: u32, width: u32, node: u32, secret: &Secret) -> (NodeRuntime<SlurmHost>, Task) {
        let (rt, mut tasks) = stepd_of(port, (0..nodes).collect(), nodes, width, node, secret, false);
        (rt, tasks.remove(0))
    }

    /// As [`stepd`], for a step whose rank `r` runs on node `node_of[r]`, a spawned one if `spawned`: node
    /// `node`'s tasks' connections, in rank order.
    fn stepd_of(
        port: u16,
        node_of: Vec<u32>,
        nodes: u32,
        width: u32,
        node: u32,
        secret: &Secret,
        spawned: bool,
    ) -> (NodeRuntime<SlurmHost>, Vec<Task>) {
        let tree = Tree::new(nodes, width).unwrap();
        let names = names(nodes);
        let srun = [SocketAddr::from((Ipv4Addr::LOCALHOST, port))];
        let links = join_tree(&srun, tree, node, secret, &names, &loopback).unwrap();
        // SAFETY: slurm_step_id_t is plain integers: all zeroes is a valid value.
        let mut id: slurm_step_id_t = unsafe { std::mem::zeroed() };
        (id.job_id, id.step_id) = (1, 0);
        let place = Place { job: 1, step: 0, id, node, node_name: names[node as usize].clone() };
        let (notify, _) = os::pipe().unwrap();
        let stopping = Arc::new(AtomicBool::new(false));
        let bounds = bounds(1 << 20, 4 << 20);
        let limits = Limits::default();
        let local: Vec<u32> = (0..node_of.len() as u32).filter(|&r| node_of[r as usize] == node).collect();
        let unspoken = spawned.then(|| local.iter().copied().collect());
        let host = SlurmHost::new(
            place,
            names.clone(),
            tree,
            bounds,
            limits,
            links,
            sys::slurm(),
            None,
            notify,
            stopping,
            unspoken,
        )
        .unwrap();
        let mut info = JobInfo::new(KVSNAME, TaskMap::new(node_of), local.clone(), names);
        info.spawned = spawned;
        let shell = Shell::new(info, Limits::default()).unwrap();
        let mut rt = NodeRuntime::new(shell, host, JobVars { job_id: "1.0".into() }).unwrap();
        let ends: Vec<RawFd> = (0..local.len()).map(|t| rt.connect_task(t).unwrap().child_fd).collect();
        // SAFETY: copies of the tasks' ends, which the node closes once the tasks are "forked".
        let tasks: Vec<UnixStream> =
            ends.iter().map(|&end| unsafe { UnixStream::from_raw_fd(libc::dup(end)) }).collect();
        rt.forked_all();
        rt.start(Looping::OwnThread).unwrap();
        let tasks = tasks
            .into_iter()
            .map(|t| {
                t.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
                Task(BufReader::new(t))
            })
            .collect();
        (rt, tasks)
    }

    /// Every node's stepd of a step of `nodes` nodes over a tree of `width`, each set up on a thread of its
    /// own (a child's prefork waits for its parent's progress loop, as on a cluster).
    fn stepds(port: u16, nodes: u32, width: u32, secret: &Secret) -> Vec<(NodeRuntime<SlurmHost>, Task)> {
        let threads: Vec<_> = (0..nodes)
            .rev()
            .map(|n| {
                let secret = secret.clone();
                std::thread::spawn(move || stepd(port, nodes, width, n, &secret))
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
        for (nodes, width) in [(3, 1), (7, 2), (5, 8)] {
            let secret = Secret::generate().unwrap();
            let (root, record) = srun(nodes, &secret);
            let (nodes_rt, mut tasks): (Vec<_>, Vec<_>) =
                stepds(root.port(), nodes, width, &secret).into_iter().unzip();
            exchange_every_put(&mut tasks);
            // srun sent the exchange's result to its children in the tree only.
            let line = record.wait_for("PMI exchange 0: srun sent");
            assert!(line.contains(&format!("to its {} children", width.min(nodes))), "{line}");
            drop(tasks);
            // Every task gone: each stepd says goodbye as its loop ends.
            drop(nodes_rt);
            assert_eq!(root.stop(), Outcome::default(), "{nodes} nodes, width {width}");
            let lines = record.lines();
            assert!(!lines.iter().any(|l| l.starts_with("error")), "{nodes} nodes, width {width}: {lines:?}");
        }
    }

    #[test]
    fn a_node_whose_parent_finished_before_it_came_goes_on_without_it() {
        let secret = Secret::generate().unwrap();
        let (root, record) = srun(2, &secret);
        // A chain: n1, then n2 below it. n1's task leaves without PMI before n2's stepd starts.
        let (first, task) = stepd(root.port(), 2, 1, 0, &secret);
        drop(task);
        // Its loop ends (its one task is gone) and it says goodbye to srun.
        let until = Instant::now() + Duration::from_secs(10);
        while first.handle().post(crate::driver::Event::Stop).is_ok() {
            assert!(Instant::now() < until, "n1's progress loop did not end");
            std::thread::sleep(Duration::from_millis(10));
        }
        std::thread::sleep(Duration::from_millis(100));
        let (second, mut task) = stepd(root.port(), 2, 1, 1, &secret);
        // n2 joined without a parent; its barrier cannot complete, and srun says why, naming n1's rank.
        assert!(task.ask("cmd=init pmi_version=1 pmi_subversion=1").contains("rc=0"));
        let answer = task.ask("cmd=barrier_in");
        assert!(answer.starts_with("cmd=barrier_out rc=-1"), "{answer}");
        record.wait_for("error: rank 0 on n1 closed its PMI connection (exited or crashed) without PMI_Finalize");
        drop((first, second));
        assert!(root.stop().ended);
    }

    /// A spawned step's stepd says STARTED once each of its tasks has sent a line, and srun's root passes
    /// it on to the spawning srun; a task that leaves before its first line fails the step, saying so even
    /// when another task waits in a barrier (which names it as lost first).
    #[test]
    fn a_spawned_steps_tasks_start_at_their_first_line_or_fail_it() {
        let read_all = |r: OwnedFd| {
            let mut said = String::new();
            std::io::Read::read_to_string(&mut std::fs::File::from(r), &mut said).unwrap();
            said
        };
        for leave in [false, true] {
            let secret = Secret::generate().unwrap();
            let (r, w) = os::pipe().unwrap();
            let (root, record) = srun_of(vec![0, 0], 1, &secret, Some(w.as_raw_fd()));
            let (rt, mut tasks) = stepd_of(root.port(), vec![0, 0], 1, 2, 0, &secret, true);
            assert!(tasks[0].ask("cmd=init pmi_version=1 pmi_subversion=1").contains("rc=0"));
            match leave {
                false => {
                    assert!(tasks[1].ask("cmd=get_maxes").contains("rc=0"));
                    std::thread::sleep(Duration::from_millis(100));
                    assert!(!record.lines().iter().any(|l| l.starts_with("error:")), "{:?}", record.lines());
                }
                true => {
                    let mut waiting = tasks.remove(0);
                    waiting.0.get_mut().write_all(b"cmd=barrier_in\n").unwrap();
                    std::thread::sleep(Duration::from_millis(100));
                    drop(tasks);
                    let line = record.wait_for("error:");
                    assert!(
                        line.contains("rank 1 of spawned step 1.0 closed its PMI connection before its first PMI line"),
                        "{line}"
                    );
                    let mut answer = String::new();
                    waiting.0.read_line(&mut answer).unwrap();
                    assert!(answer.starts_with("cmd=barrier_out rc=-1"), "{answer}");
                }
            }
            drop(rt);
            root.stop();
            drop(w);
            let said = read_all(r);
            match leave {
                false => assert_eq!(said, "started\n"),
                true => assert!(said.starts_with("failed ") && !said.contains("started"), "{said:?}"),
            }
        }
    }

    /// An acceptor for node `me`'s children, served on a thread of its own; what it admits comes back.
    fn parent(me: u32, children: Range<u32>, width: u32, secret: &Secret) -> (u16, std::sync::mpsc::Receiver<u32>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let gate =
            Gate { secret: secret.clone(), to: me, members: children.clone(), addresses: None, width: Some(width) };
        let mut acceptor = Acceptor::new(listener, gate, 1).unwrap();
        let port = acceptor.port();
        let (tx, rx) = std::sync::mpsc::channel();
        let expected = children.len();
        std::thread::spawn(move || {
            let epoll = Arc::new(Epoll::new().unwrap());
            acceptor.watch(epoll.clone()).unwrap();
            let mut kept = Vec::new();
            let mut events = [libc::epoll_event { events: 0, u64: 0 }; 16];
            while kept.len() < expected {
                let n = epoll.wait(&mut events, 100).unwrap();
                for ev in &events[..n] {
                    acceptor.ready(ev.u64);
                }
                while let Some(e) = acceptor.poll() {
                    if let Admission::Joined(j) = e {
                        let _ = tx.send(j.node);
                        kept.push(j.stream);
                    }
                }
            }
            // Every child is in.
            let _ = tx.send(u32::MAX);
            std::thread::sleep(Duration::from_secs(1));
        });
        (port, rx)
    }

    fn join_parent_at(port: u16, hello: Hello, secret: &Secret, patience: Duration) -> Result<TcpStream, String> {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        uplink::join(&[addr], &hello, secret, patience, "the parent", uplink::sleep).map_err(|e| e.to_string())
    }

    #[test]
    fn a_parent_admits_its_own_children_once_each_and_no_one_else() {
        let secret = Secret::generate().unwrap();
        // Width 3: node 0's children are 3, 4 and 5.
        let (port, admitted) = parent(0, 3..6, 3, &secret);
        let hello = |node| Hello { node, to: 0, port: 0, width: 3 };
        let short = Duration::from_millis(300);
        let _c3 = join_parent_at(port, hello(3), &secret, short).unwrap();
        assert_eq!(admitted.recv().unwrap(), 3);
        // Node 3 again, a node that is not a child, a tree of another width, a proof made for srun, a
        // wrong secret: none is admitted.
        assert!(join_parent_at(port, hello(3), &secret, short).is_err());
        assert!(join_parent_at(port, hello(2), &secret, short).is_err());
        assert!(join_parent_at(port, Hello { width: 2, ..hello(4) }, &secret, short).is_err());
        assert!(join_parent_at(port, Hello { to: auth::ROOT, ..hello(4) }, &secret, short).is_err());
        assert!(join_parent_at(port, hello(4), &Secret::generate().unwrap(), short).is_err());
        let _c4 = join_parent_at(port, hello(4), &secret, short).unwrap();
        let _c5 = join_parent_at(port, hello(5), &secret, short).unwrap();
        assert_eq!((admitted.recv().unwrap(), admitted.recv().unwrap()), (4, 5));
        assert_eq!(admitted.recv().unwrap(), u32::MAX);
        assert!(TcpStream::connect(("127.0.0.1", port)).is_err(), "the listener is still open");
    }

    #[test]
    fn a_child_waits_for_srun_to_say_where_its_parent_listens() {
        let secret = Secret::generate().unwrap();
        let (port, admitted) = parent(0, 1..2, 1, &secret);
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut srun = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut fake, _) = l.accept().unwrap();
        let child = std::thread::spawn(move || {
            let hello = Hello { node: 1, to: 0, port: 0, width: 1 };
            join_parent(&mut srun, &names(2), hello, &secret, &loopback)
        });
        std::thread::sleep(Duration::from_millis(100));
        fake.write_all(&Down::Parent { port }.encode().unwrap()).unwrap();
        assert!(child.join().unwrap().unwrap().is_some());
        assert_eq!(admitted.recv().unwrap(), 1);

        // Told that the parent finished, the child stops trying to reach it (here: nobody listens).
        let nobody = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut srun = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut fake, _) = l.accept().unwrap();
        let secret = Secret::generate().unwrap();
        let child = std::thread::spawn(move || {
            let hello = Hello { node: 1, to: 0, port: 0, width: 1 };
            join_parent(&mut srun, &names(2), hello, &secret, &loopback)
        });
        fake.write_all(&Down::Parent { port: nobody }.encode().unwrap()).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let started = Instant::now();
        fake.write_all(&Down::ParentDone.encode().unwrap()).unwrap();
        assert!(matches!(child.join().unwrap(), Ok(None)));
        assert!(started.elapsed() < Duration::from_secs(5));

        // srun ending the step first is an error.
        let mut srun = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut fake, _) = l.accept().unwrap();
        fake.write_all(&Down::End.encode().unwrap()).unwrap();
        let hello = Hello { node: 1, to: 0, port: 0, width: 1 };
        let err = join_parent(&mut srun, &names(2), hello, &Secret::generate().unwrap(), &loopback).unwrap_err();
        assert!(err.contains("srun sent END before it said where this node's parent listens"), "{err}");
    }
}

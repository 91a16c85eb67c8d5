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
mod watch;

use super::admit::{Acceptor, Admission, Gate};
use super::auth::{self, Secret};
use super::link::{Link, Read, Watch, CONTROL_QUEUED_MAX};
use super::options::{Settings, ENV_MAP, ENV_OPTIONS, ENV_PORT, ENV_SECRET, ENV_SPAWN};
use super::protocol::{Down, Up};
use super::records::{self, stepd_step_rec_t, RecordFromEnv};
use super::sys::{self, getenvp, Slurm};
use super::trace::Trace;
use super::uplink::{self, Hello};
use super::version::TaskInfo;
use crate::collective::{self, frame, Bounds, Peer, Tree};
use crate::driver::{HostFds, Watcher};
use crate::node::{ChildEnds, EnvVar, JobVars, Looping, NodeHost, NodeRuntime};
use crate::os;
use crate::server::{GroupExchange, Host, HostRequest, JobError, Shell, Speaker, TaskId};
use plan::{Place, Record};
use std::ffi::{c_char, c_int, CString};
use std::io::{self, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::ops::Range;
use std::os::fd::{AsRawFd, IntoRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};
use watch::{NodeAction, NodeShape, NodeWatch, END_PATIENCE};

/// How long a stepd keeps trying to join srun, or its parent, before the step fails.
const JOIN_PATIENCE: Duration = Duration::from_secs(30);
/// How long `fini` lets the progress thread say BYE before it cuts the connection.
const FINI_GRACE: Duration = Duration::from_secs(2);

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

/// The engine's host on a slurmstepd: the I/O around the node's [`NodeWatch`]. It runs on the progress
/// thread and serves, beside the tasks, every connection of the tree, the admission of the node's children
/// and the fork-notice pipe in the same loop: nothing it does blocks the tasks' answers.
struct SlurmHost {
    place: Place,
    /// Every node's name, for messages.
    names: Vec<String>,
    /// Decides; this host carries out what it asks.
    watch: NodeWatch,
    epoll: Option<Arc<dyn Watch>>,
    /// The connection to srun, while the watch serves it.
    uplink: Option<Link>,
    /// The connection to the parent in the tree, while the watch serves it; `None` if the parent is srun.
    parent: Option<Link>,
    /// The admitted children's connections, from the tree's first child of this node.
    children: Vec<Option<Link>>,
    first_child: u32,
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
    /// Set by `fini`: the step ending now is the normal end.
    stopping: Arc<AtomicBool>,
    /// The most output a link may hold that its peer has not taken.
    queued_max: usize,
    buf: Vec<u8>,
}

impl SlurmHost {
    /// The host of node `place.node` of `tree`, over the connections it made in prefork.
    fn new(
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
        let mut watch = NodeWatch::new(shape)?;
        let parent = match links.parent {
            Some((_, Some(s))) => Some(Link::new(s, PARENT, Default::default(), queued_max).map_err(socket)?),
            Some((_, None)) => {
                watch.parent_done();
                None
            }
            None => None,
        };
        Ok(SlurmHost {
            children: watch.children().map(|_| None).collect(),
            first_child: watch.children().start,
            place,
            names,
            watch,
            epoll: None,
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
            stopping,
            buf: vec![0; 64 * 1024],
        })
    }

    /// Where the connection to `peer` is kept while it is served.
    fn slot(&mut self, peer: Peer) -> Option<&mut Option<Link>> {
        match peer {
            Peer::Root => Some(&mut self.uplink),
            Peer::Node(p) if Some(p) == self.watch.parent_node() => Some(&mut self.parent),
            Peer::Node(c) => self.children.get_mut(c.checked_sub(self.first_child)? as usize),
        }
    }

    /// Does what the watch asks, then tells it of the links that broke while this node sent on them (a peer
    /// that stopped reading leaves the link broken at once, not its output growing), as the peer's close
    /// would, until nothing is left to do.
    fn carry_out(&mut self) {
        loop {
            while let Some(action) = self.watch.poll() {
                self.act(action);
            }
            let first = self.first_child;
            let children =
                self.children.iter().enumerate().filter_map(|(i, l)| Some((Peer::Node(first + i as u32), l.as_ref()?)));
            let parent = self.watch.parent_node().map(Peer::Node).zip(self.parent.as_ref());
            let mut links = self.uplink.as_ref().map(|l| (Peer::Root, l)).into_iter().chain(parent).chain(children);
            match links.find(|(_, l)| l.is_broken()).map(|(peer, l)| (peer, l.broke_why())) {
                Some((peer, why)) => self.watch.closed(peer, &why),
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
            NodeAction::EndHere { why } if self.stopping.load(SeqCst) => self.watch.log(log::Level::Info, &why),
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

    /// Reads once from `peer`'s connection (at most the buffer's length) and hands the watch every whole
    /// frame now in its input, then why the connection is done, if it is. Frames that came before a close
    /// are handed over before it. One read per wake-up: a peer that writes without pause (srun is the
    /// user's) is served a buffer at a time, epoll (level-triggered) calls again for the rest, and what the
    /// node holds of it stays within one buffer's frames; the rest waits in the socket, and TCP holds the
    /// writer back.
    fn hear(&mut self, peer: Peer, events: u32) {
        let max = self.watch.frame_max(peer);
        // Out of its slot while the watch hears it (the watch's actions are carried out after).
        if let Some(mut link) = self.slot(peer).and_then(Option::take) {
            if events & libc::EPOLLOUT as u32 != 0 {
                link.flush();
            }
            let closed = match link.read(&mut self.buf) {
                Read::Data(_) | Read::Blocked => None,
                Read::Closed(why) => Some(why),
            };
            loop {
                match link.next(max) {
                    Ok(None) => break,
                    Ok(Some(payload)) => self.watch.heard(peer, payload),
                    Err(e) => {
                        self.watch.broke(peer, &format!("sent {e}"));
                        break;
                    }
                }
            }
            // A frame's bytes were copied out: an exchange need not stay in the buffer beside its parts.
            link.release();
            if let Some(slot) = self.slot(peer) {
                *slot = Some(link);
            }
            if let Some(why) = closed {
                self.watch.closed(peer, &why);
            }
        }
        self.carry_out();
    }

    /// Takes what the acceptor has: admitted children, and lines about refusals.
    fn admissions(&mut self) {
        while let Some(event) = self.acceptor.as_mut().and_then(Acceptor::poll) {
            match event {
                Admission::Debug(line) => self.watch.log(log::Level::Debug, &line),
                Admission::Joined(j) => {
                    let i = (j.node - self.first_child) as usize;
                    let link = Link::new(j.stream, CHILDREN + i as u64, j.input, self.queued_max).and_then(|mut l| {
                        if let Some(w) = &self.epoll {
                            l.watch(w.clone())?;
                        }
                        Ok(l)
                    });
                    match link {
                        Ok(l) => {
                            self.children[i] = Some(l);
                            self.watch.child_joined(j.node);
                            // What it sent right after its proof.
                            self.hear(Peer::Node(j.node), 0);
                        }
                        Err(e) => {
                            let what = format!("cannot serve the connection of {}: {e}", self.names[j.node as usize]);
                            self.watch.fault(&what);
                        }
                    }
                }
            }
        }
        self.carry_out();
    }

    /// Arms the timer for the next deadline (the acceptor's, or `end_by`), or disarms it.
    fn arm_timer(&self) {
        let next = self.acceptor.as_ref().and_then(Acceptor::deadline).into_iter().chain(self.end_by).min();
        let after = next.map(|at| at.saturating_duration_since(Instant::now()));
        // Setting a live timerfd to a valid time does not fail.
        let _ = os::set_timer(&self.timer, after);
    }

    /// Hands the shell what the collective completed for it, and srun's answers.
    fn complete(&mut self, shell: &mut Shell) {
        match self.watch.take_completion() {
            Some(Ok(parts)) => {
                let parts: Vec<&[u8]> = parts.iter().map(|(_, bytes)| bytes).collect();
                shell.collective_complete(self, Ok(&parts));
            }
            Some(Err(why)) => shell.collective_complete(self, Err(&why)),
            None => {}
        }
        for (task, reply) in self.watch.take_answers() {
            shell.host_reply(self, task, reply);
        }
        for (id, parts) in self.watch.take_groups_done() {
            let parts: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
            shell.group_complete(self, &id, Ok(&parts));
        }
    }

    /// Every connection of the tree this node still has.
    fn links(&mut self) -> Vec<&mut Link> {
        let children = self.children.iter_mut().flatten();
        self.uplink.iter_mut().chain(self.parent.iter_mut()).chain(children).collect()
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
            self.watch.fault(&format!("cannot watch the connections of the PMI tree: {e}"));
            self.carry_out();
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
                    self.watch.srun_too_slow();
                    self.carry_out();
                }
            }
            UPLINK => self.hear(Peer::Root, events),
            PARENT => {
                if let Some(p) = self.watch.parent_node() {
                    self.hear(Peer::Node(p), events);
                }
            }
            t if self.acceptor.as_ref().is_some_and(|a| a.owns(t)) => {
                if let Some(a) = &mut self.acceptor {
                    a.ready(t);
                }
                self.admissions();
            }
            t if t >= CHILDREN => self.hear(Peer::Node(self.first_child + (t - CHILDREN) as u32), events),
            _ => {}
        }
        self.arm_timer();
        self.complete(shell);
    }
}

impl Host for SlurmHost {
    fn collective(&mut self, contribution: &[u8]) -> Result<(), String> {
        let joined = self.watch.contribute(contribution);
        self.carry_out();
        joined
    }

    fn serves_groups(&self) -> bool {
        true
    }

    fn group_collective(&mut self, exchange: &GroupExchange<'_>, contribution: &[u8]) -> Result<(), String> {
        let asked = self.watch.group(exchange, contribution);
        self.carry_out();
        asked
    }

    fn abort(&mut self, rank: u32, exit_code: i32, message: &str) {
        self.watch.abort(rank, exit_code, message);
        self.carry_out();
    }

    fn job_error(&mut self, error: &JobError) {
        self.watch.job_error(error);
        self.carry_out();
    }

    fn log(&mut self, level: log::Level, message: &str) {
        self.watch.log(level, message);
        self.carry_out();
    }

    fn trace(&mut self, rank: u32, speaker: Speaker, line: &[u8]) {
        if let Some(t) = &self.trace {
            t.line(&format!("rpmi: rank {rank} {speaker}: {}", String::from_utf8_lossy(line)));
        }
    }

    fn task_started(&mut self, rank: u32) {
        self.watch.task_started(rank);
        self.carry_out();
    }

    fn task_closed(&mut self, rank: u32, finalized: bool) {
        self.watch.task_closed(rank, finalized);
        self.carry_out();
    }

    fn request(&mut self, task: TaskId, request: HostRequest<'_>) -> Result<(), String> {
        let asked = self.watch.request(task, request);
        self.carry_out();
        asked
    }
}

impl NodeHost for SlurmHost {
    fn served(&mut self, result: Result<(), String>) {
        self.watch.served(result);
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
    let spawned_ranks = spawned.then(|| local_ranks.iter().copied().collect());
    let shape = NodeShape { place: place.clone(), names, tree, bounds, limits, spawned_ranks };
    let host_side = SlurmHost::new(shape, links, slurm, trace, notify_r, stopping.clone())?;
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
        let record = Record::default();
        let step = Step {
            node_names: names(nodes),
            node_of: (0..nodes).collect(),
            secret: secret.clone(),
            addresses: None,
            bounds: bounds(1 << 20, 4 << 20),
            width: None,
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
    fn stepd(port: u16, nodes: u32, width: u32, node: u32, secret: &Secret) -> (NodeRuntime<SlurmHost>, Task) {
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
        let shape =
            NodeShape { place, names: names.clone(), tree, bounds, limits: Limits::default(), spawned_ranks: None };
        let host = SlurmHost::new(shape, links, sys::slurm(), None, notify, stopping).unwrap();
        let info = JobInfo::new(KVSNAME, TaskMap::new((0..nodes).collect()), vec![node], names);
        let shell = Shell::new(info, Limits::default()).unwrap();
        let mut rt = NodeRuntime::new(shell, host, JobVars { job_id: "1.0".into() }).unwrap();
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

//! The slurmstepd side: one [`Shell`] per node serving the node's tasks, its collective going to the root in
//! srun over one TCP connection.
//!
//! `mpi_p_slurmstepd_prefork` (before the tasks are forked, as root) takes the step's ids, this node's index
//! and the step's shape from Slurm's step record, and from the environment what srun's side of the plugin
//! put there (the root's port, the secret, the task map), checked against the record. It joins the root
//! ([`super::uplink`]) and runs the node on the [`crate::node`] runtime: one socketpair per local task and one
//! progress thread, whose epoll loop serves the task connections and, through `SlurmHost`'s own fds, the
//! connection to srun (non-blocking: a slow srun never holds the tasks' answers) and the fork notice
//! described below.
//!
//! **Trust.** slurmstepd runs as root; the job's environment is the user's (a user's srun can put anything
//! in it). So the ids the plugin acts on (above all the step it asks slurmctld to end) come only from Slurm's
//! step record; an id in the environment that disagrees is ignored and logged. What the environment gives
//! (the task map, the node names, the root's port) only shapes the user's own step.
//!
//! `mpi_p_slurmstepd_task` runs in each forked task child, a child of this multi-threaded process: it takes
//! no lock our threads may take, and allocates only inside Slurm's own environment setter (as Slurm itself
//! does in the child; glibc's malloc is usable after fork). It hands the task its end of the socketpair
//! (`PMI_FD`, close-on-exec cleared), closes every other task's end, and writes a notice into a pipe, even
//! when it fails. Slurm forks every task of the node before it lets any of them run, so the first notice
//! means every child holds its own end: the progress thread then closes the stepd's copies of all of them, and
//! a task that dies, even one that never reached the hook, is seen at once (EOF on the server end).

use super::auth::Secret;
use super::layout;
use super::sys::{self, getenvp, Slurm};
use super::trace::{escape_text, Trace};
use super::uplink;
use super::wire::{self, FrameBuf, FromRoot, ToRoot, MESSAGE_MAX};
use crate::driver::{HostFds, Watcher};
use crate::node::{ChildEnds, EnvVar, JobVars, Looping, Node, NodeHost};
use crate::server::{Direction, Host, JobError, JobInfo, Limits, Shell, TaskMap};
use std::collections::VecDeque;
use std::ffi::{c_char, c_int, CString};
use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Environment srun's prelaunch adds for the stepds (see `super::client`).
pub const ENV_PORT: &str = "RPMI_SLURM_PORT";
pub const ENV_SECRET: &str = "RPMI_SLURM_SECRET";
pub const ENV_MAP: &str = "RPMI_SLURM_MAP";

/// How long a stepd keeps trying to join the root before the step fails.
const JOIN_PATIENCE: Duration = Duration::from_secs(30);
/// How long `fini` lets the progress thread say BYE before it cuts the connection.
const FINI_GRACE: Duration = Duration::from_secs(2);
/// The longest text from a task (an abort message, an environment value) that reaches slurmd's log.
const LOGGED_TEXT_MAX: usize = 256;
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
    node: Node<SlurmHost>,
    /// Each task's PMI variables, prepared before the fork: the child only sets them.
    task_env: Vec<Vec<EnvVar>>,
    env_overwrite: sys::EnvOverwriteFmt,
    /// The write end of the fork-notice pipe (inherited by each child, close-on-exec).
    notify_w: RawFd,
    notify_r: RawFd,
    /// `fini` is running: the uplink closing now is the normal end.
    stopping: Arc<AtomicBool>,
    /// A copy of the uplink, to cut it if the progress thread cannot say BYE in time.
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
    slurm.kill_step(place.job, place.step, libc::SIGKILL)
}

/// The step ids and this node's place, for messages and for ending the step.
#[derive(Clone)]
struct Place {
    job: u32,
    step: u32,
    node: u32,
    node_name: String,
}

/// The epoll tokens of the stepd's own fds in the progress loop.
const UPLINK: u64 = 0;
const NOTICE: u64 = 1;

/// The engine's host on a slurmstepd. It runs on the progress thread and serves, beside the tasks, the
/// uplink to srun and the fork-notice pipe in the same loop: nothing it does blocks the tasks' answers.
struct SlurmHost {
    uplink: Uplink,
    place: Place,
    /// The step's node count: every ALL frame has one part per node.
    nodes: usize,
    /// The largest ALL payload this node takes in: every node's part, together within its store's bound.
    all_max: usize,
    /// The next collective's epoch, and the one whose result this node waits for.
    epoch: u32,
    pending: Option<u32>,
    slurm: &'static Slurm,
    /// The wire trace (`PMI_DEBUG`); its writer stops when the progress thread drops its host.
    trace: Option<Trace>,
    /// The read end of the fork-notice pipe, and the node's copies of the tasks' ends it closes.
    notify: OwnedFd,
    child_ends: Option<ChildEnds>,
    /// A task child found Slurm's task info naming the step read from the step record: only then does the
    /// stepd ask slurmctld to end that step.
    ids_confirmed: bool,
    /// Every local task has closed its connection: the uplink closing now is the normal end.
    finished: bool,
    /// Set by `fini`.
    stopping: Arc<AtomicBool>,
    /// srun said it is done with the step (END): its close is the normal end.
    srun_done: bool,
    /// The root failed an exchange or this node reported the step's end: srun's user has been told.
    ending: bool,
    /// An abort or job error was sent: the root ends the step; say it once.
    ended: bool,
    /// Lines this step has logged.
    logged: usize,
}

/// The connection to srun's root, non-blocking in the progress loop.
struct Uplink {
    stream: TcpStream,
    watcher: Option<Watcher>,
    input: FrameBuf,
    /// Frames not yet written, the first `written` bytes of the first already gone. Bounded by what the
    /// engine asks for: one exchange's part at a time, and a few control frames.
    output: VecDeque<Vec<u8>>,
    written: usize,
    /// epoll watches it for writing too, while output waits.
    watching_out: bool,
    lost: bool,
}

impl Uplink {
    /// Queues `frame` and writes what the socket takes now; false if the connection is gone.
    fn send(&mut self, frame: Vec<u8>) -> bool {
        if self.lost {
            return false;
        }
        self.output.push_back(frame);
        self.write();
        !self.lost
    }

    /// Writes queued frames until the socket would block; then has epoll say when it can take more.
    fn write(&mut self) {
        while let Some(front) = self.output.front() {
            match self.stream.write(&front[self.written..]) {
                Ok(n) => {
                    self.written += n;
                    if self.written == front.len() {
                        self.output.pop_front();
                        self.written = 0;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => {
                    self.lost = true;
                    self.output.clear();
                    break;
                }
            }
        }
        let want_out = !self.output.is_empty();
        if want_out != self.watching_out {
            self.watching_out = want_out;
            let events = (libc::EPOLLIN | if want_out { libc::EPOLLOUT } else { 0 }) as u32;
            if let Some(w) = &self.watcher {
                let _ = w.modify(self.stream.as_raw_fd(), events, UPLINK);
            }
        }
    }

    /// Writes what is queued, waiting for the socket at most until `deadline` (the progress loop has ended:
    /// no task waits for this thread any more).
    fn drain(&mut self, deadline: Instant) {
        while !self.output.is_empty() && !self.lost {
            self.write();
            let left = deadline.saturating_duration_since(Instant::now());
            if self.output.is_empty() || left.is_zero() {
                return;
            }
            let mut pfd = libc::pollfd { fd: self.stream.as_raw_fd(), events: libc::POLLOUT, revents: 0 };
            // SAFETY: one live pollfd.
            unsafe { libc::poll(&mut pfd, 1, left.as_millis().min(i32::MAX as u128) as i32) };
        }
    }
}

impl SlurmHost {
    /// Sends a frame to the root; false if the connection is gone.
    fn send(&mut self, frame: Vec<u8>) -> bool {
        self.uplink.send(frame)
    }

    /// The step must end, with `message` for the user: the root prints it on srun's stderr and ends the step.
    /// Without a root (srun is gone), the stepd does both: its errors reach the job's stderr.
    fn end_step(&mut self, message: ToRoot, text: &str) {
        if std::mem::replace(&mut self.ended, true) {
            self.log(log::Level::Info, text);
            return;
        }
        if message.encode().is_ok_and(|frame| self.send(frame)) {
            self.ending = true;
            self.log(log::Level::Info, text);
            return;
        }
        self.log(log::Level::Error, &format!("{text}; srun (the collective root) is gone, ending the step from here"));
        self.ending = true;
        if let Err(e) = kill_own_step(self.slurm, self.ids_confirmed, &self.place) {
            self.log(log::Level::Error, &e);
        }
    }

    fn job_error_text(&mut self, message: &str) {
        let m = ToRoot::Error { rank: u32::MAX, task_failed: false, message: message.to_string() };
        self.end_step(m, message);
    }

    /// Fails the exchange this node waits for, if any.
    fn fail_collective(&mut self, shell: &mut Shell, why: &str) {
        if self.pending.take().is_some() {
            shell.collective_complete(self, Err(why));
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
            if let Some(w) = &self.uplink.watcher {
                let _ = w.remove(self.notify.as_raw_fd());
            }
        }
        if notices[..n.max(0) as usize].contains(&NOTICE_IDS_CONFIRMED) {
            self.ids_confirmed = true;
        }
    }

    /// Reads what srun sent and handles every whole frame; the reason the connection is done, if it is.
    fn hear_root(&mut self, shell: &mut Shell) -> Option<String> {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match self.uplink.stream.read(&mut buf) {
                Ok(0) => return Some("srun closed the connection".into()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return None,
                Err(e) => return Some(format!("the connection to srun failed: {e}")),
            };
            self.uplink.input.extend(&buf[..n]);
            if let Some(why) = self.frames(shell) {
                return Some(why);
            }
            if n < buf.len() {
                return None;
            }
        }
    }

    /// Handles every whole frame received from srun.
    fn frames(&mut self, shell: &mut Shell) -> Option<String> {
        loop {
            let frame = match self.uplink.input.next(self.all_max) {
                Ok(None) => break,
                Ok(Some(f)) => FromRoot::decode(f).map_err(|e| e.to_string()),
                Err(e) => Err(format!(
                    "{e}: more than this node's key-value store may hold ({} bytes)",
                    Limits::default().kvs_bytes_max
                )),
            };
            // The frame was copied out: its bytes need not stay beside the parts.
            self.uplink.input.release();
            match frame {
                Ok(FromRoot::All { epoch, parts }) => {
                    // srun is the user's: a result must answer this node's barrier and hold one part per node,
                    // in order, or nothing of it is kept.
                    let in_order =
                        parts.len() == self.nodes && parts.iter().enumerate().all(|(i, (n, _))| *n as usize == i);
                    if !in_order {
                        return Some("srun sent an exchange result that is not one part per node".into());
                    }
                    if self.pending != Some(epoch) {
                        return Some("srun sent an exchange result no barrier waits for".into());
                    }
                    self.pending = None;
                    let parts: Vec<&[u8]> = parts.iter().map(|(_, bytes)| bytes.as_slice()).collect();
                    shell.collective_complete(self, Ok(&parts));
                }
                Ok(FromRoot::End) => self.srun_done = true,
                Ok(FromRoot::Fail { message, .. }) => {
                    self.ending = true;
                    self.fail_collective(shell, &escape_text(&message, MESSAGE_MAX));
                }
                Ok(other @ (FromRoot::Challenge { .. } | FromRoot::Welcome { .. })) => {
                    return Some(format!("srun sent {other:?} after the handshake"));
                }
                Err(e) => return Some(format!("srun sent a {e}")),
            }
        }
        self.uplink.input.release();
        None
    }

    /// The connection to srun is gone: no exchange can complete any more.
    fn lost_root(&mut self, shell: &mut Shell, why: &str) {
        self.uplink.lost = true;
        self.uplink.output.clear();
        if let Some(w) = &self.uplink.watcher {
            let _ = w.remove(self.uplink.stream.as_raw_fd());
        }
        self.fail_collective(shell, &format!("lost the connection to srun (the collective root): {why}"));
        if !self.finished && !self.stopping.load(SeqCst) && !self.srun_done {
            // srun was killed, or the network failed.
            self.slurm.error(&format!(
                "step {}.{} on {}: {why}; srun is gone, ending the step",
                self.place.job, self.place.step, self.place.node_name
            ));
            // Every node tries; all but the first find the step ending already.
            if let Err(e) = kill_own_step(self.slurm, self.ids_confirmed, &self.place) {
                self.slurm.info(&e);
            }
        }
    }
}

impl HostFds for SlurmHost {
    fn watch(&mut self, watcher: Watcher) {
        let events = libc::EPOLLIN as u32;
        if let Err(e) = watcher.add(self.uplink.stream.as_raw_fd(), events, UPLINK) {
            self.uplink.lost = true;
            self.slurm.error(&format!("cannot watch the connection to srun: {e}"));
        }
        if let Err(e) = watcher.add(self.notify.as_raw_fd(), events, NOTICE) {
            self.slurm.error(&format!("cannot watch the tasks' notices: {e}"));
        }
        self.uplink.watcher = Some(watcher);
    }

    fn ready(&mut self, token: u64, events: u32, shell: &mut Shell) {
        match token {
            NOTICE => self.take_notices(),
            UPLINK if !self.uplink.lost => {
                if events & libc::EPOLLOUT as u32 != 0 {
                    self.uplink.write();
                }
                let why = if events & !(libc::EPOLLOUT as u32) != 0 { self.hear_root(shell) } else { None };
                if let Some(why) = why.or_else(|| self.uplink.lost.then(|| "the connection to srun failed".into())) {
                    self.lost_root(shell, &why);
                }
            }
            _ => {}
        }
    }
}

impl Host for SlurmHost {
    fn collective(&mut self, contribution: &[u8]) -> Result<(), String> {
        let epoch = self.epoch;
        self.epoch = epoch.wrapping_add(1);
        let frame = wire::contrib(epoch, self.place.node, contribution).map_err(|e| e.to_string())?;
        if !self.send(frame) {
            return Err("lost the connection to srun (the collective root)".into());
        }
        self.pending = Some(epoch);
        Ok(())
    }

    fn abort(&mut self, rank: u32, exit_code: i32, message: &str) {
        // The message reaches srun's stderr (the user's) whole, and slurmd's log escaped and cut.
        let logged = format!(
            "rank {rank} called PMI_Abort with exit code {exit_code}{}{}",
            if message.is_empty() { "" } else { ": " },
            escape_text(message, LOGGED_TEXT_MAX)
        );
        self.end_step(ToRoot::Abort { rank, code: exit_code, message: message.to_string() }, &logged);
    }

    fn job_error(&mut self, error: &JobError) {
        let message = error.to_string();
        let task_failed = matches!(error, JobError::TaskLost { .. });
        self.end_step(ToRoot::Error { rank: error.rank(), task_failed, message: message.clone() }, &message);
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

    fn trace(&mut self, rank: u32, direction: Direction, line: &[u8]) {
        if let Some(t) = &self.trace {
            t.line(&format!("rpmi: rank {rank} {direction}: {}", String::from_utf8_lossy(line)));
        }
    }

    fn task_closed(&mut self, rank: u32, finalized: bool) {
        if !finalized {
            if let Ok(frame) = (ToRoot::Gone { rank }).encode() {
                self.send(frame);
            }
        }
    }
}

impl NodeHost for SlurmHost {
    fn served(&mut self, result: Result<(), String>) {
        match result {
            Ok(()) => {
                self.finished = true;
                if let Ok(bye) = ToRoot::Bye.encode() {
                    self.send(bye);
                }
            }
            Err(why) => self.job_error_text(&format!("the PMI progress loop stopped: {why}")),
        }
        // The loop no longer runs: what is queued goes now, within `fini`'s grace.
        self.uplink.drain(Instant::now() + FINI_GRACE);
    }
}

fn need(env: *const *const c_char, name: &str) -> Result<String, String> {
    // SAFETY: Slurm's environment array.
    unsafe { getenvp(env, name) }.ok_or_else(|| format!("{name} is not in the step's environment"))
}

fn cstring(s: String) -> CString {
    CString::new(s).unwrap_or_default()
}

/// The step as Slurm's step record gives it.
struct Record {
    job: u32,
    step: u32,
    nodes: u32,
    tasks: u32,
    node: u32,
    node_tasks: u32,
}

/// `mpi_p_slurmstepd_prefork`.
///
/// # Safety
/// `job` is slurmstepd's step record and `env` the `char ***` Slurm passes: the step's environment, which
/// the tasks inherit.
pub unsafe fn prefork(job: *const sys::stepd_step_rec_t, env: *mut *mut *mut c_char) -> Result<(), String> {
    let slurm = sys::slurm();
    if env.is_null() {
        return Err("no environment".into());
    }
    // SAFETY: Slurm's environment array, as the caller promises.
    let envp = unsafe { *env } as *const *const c_char;
    // SAFETY: as above.
    let Some(port) = (unsafe { getenvp(envp, ENV_PORT) }) else {
        slurm.info(&format!("{ENV_PORT} is not set: this step was not started by `srun --mpi=rpmi`; no PMI"));
        return Ok(());
    };
    if !STEPD.load(SeqCst).is_null() {
        return Err("prefork called twice in one slurmstepd".into());
    }
    // SAFETY: Slurm's step record, as the caller promises; only its leading fields are read.
    let r = unsafe { job.as_ref() }.ok_or("no step record")?;
    let rec = Record {
        job: r.step_id.job_id,
        step: r.step_id.step_id,
        nodes: r.nnodes,
        tasks: r.ntasks,
        node: r.nodeid,
        node_tasks: r.node_tasks,
    };
    for (name, value) in [("SLURM_JOB_ID", rec.job), ("SLURM_STEP_ID", rec.step)] {
        // SAFETY: as above.
        if let Some(v) = unsafe { getenvp(envp, name) }.filter(|v| *v != value.to_string()) {
            slurm.info(&format!(
                "ignored {name}={} in the step's environment: Slurm runs this step as {}.{}",
                escape_text(&v, LOGGED_TEXT_MAX),
                rec.job,
                rec.step
            ));
        }
    }
    let env_overwrite = slurm.env_overwrite_fmt.ok_or("slurm_env_array_overwrite_fmt is not in this process")?;
    let port: u16 = port.parse().map_err(|_| format!("{ENV_PORT}={} is not a port", escape_text(&port, 32)))?;
    let secret = Secret::from_hex(&need(envp, ENV_SECRET)?).ok_or(format!("{ENV_SECRET} is malformed"))?;
    // Set by slurmd: the address srun's launch request came from.
    let host = need(envp, "SLURM_SRUN_COMM_HOST")?;
    let nodelist = need(envp, "SLURM_STEP_NODELIST")?;
    let names = slurm.expand_nodelist(&nodelist, rec.nodes as usize)?;
    let node_of = layout::decode(&need(envp, ENV_MAP)?, names.len(), rec.tasks as usize)?;
    let node = rec.node;
    let local_ranks: Vec<u32> = (0..node_of.len() as u32).filter(|&r| node_of[r as usize] == node).collect();
    if names.len() != rec.nodes as usize || node_of.len() != rec.tasks as usize || node >= rec.nodes {
        return Err(format!(
            "the step's environment describes {} nodes and {} tasks, Slurm's step {}.{} has {} and {}",
            names.len(),
            node_of.len(),
            rec.job,
            rec.step,
            rec.nodes,
            rec.tasks
        ));
    }
    if local_ranks.len() != rec.node_tasks as usize {
        return Err(format!("{ENV_MAP} puts {} tasks on this node, Slurm {}", local_ranks.len(), rec.node_tasks));
    }
    // SAFETY: Slurm's environment array, as the caller promises.
    let debug = unsafe { getenvp(envp, "PMI_DEBUG") };
    let trace = match debug.is_some_and(|v| !v.is_empty() && v != "0") {
        true => Some(Trace::start(libc::STDERR_FILENO).map_err(|e| format!("cannot start the trace: {e}"))?),
        false => None,
    };
    let place = Place { job: rec.job, step: rec.step, node, node_name: names[node as usize].clone() };

    let info =
        JobInfo::new(format!("rpmi_{}.{}", rec.job, rec.step), TaskMap::new(node_of), local_ranks.clone(), names);
    let mut shell = Shell::new(info, Limits::default()).map_err(|e| format!("cannot serve this step: {e}"))?;
    shell.set_trace(trace.is_some());

    let mut fds = [0; 2];
    // SAFETY: fds has room for the two fds pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } < 0 {
        return Err(format!("pipe: {}", io::Error::last_os_error()));
    }
    // SAFETY: both fresh and ours.
    let (notify_r, notify_w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };

    let addrs: Vec<_> = (host.as_str(), port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve srun's address {host}: {e}"))?
        .collect();
    let uplink = uplink::join(&addrs, node, &secret, JOIN_PATIENCE).map_err(|e| e.to_string())?;
    uplink.set_nonblocking(true).map_err(|e| format!("socket: {e}"))?;
    let stopping = Arc::new(AtomicBool::new(false));
    let notify_r_raw = notify_r.as_raw_fd();
    let host_side = SlurmHost {
        uplink: Uplink {
            stream: uplink.try_clone().map_err(|e| format!("socket: {e}"))?,
            watcher: None,
            input: FrameBuf::default(),
            output: VecDeque::new(),
            written: 0,
            watching_out: false,
            lost: false,
        },
        place: place.clone(),
        nodes: rec.nodes as usize,
        all_max: wire::all_len(rec.nodes as usize, Limits::default().kvs_bytes_max) - 4,
        epoch: 0,
        pending: None,
        slurm,
        trace,
        notify: notify_r,
        child_ends: None,
        ids_confirmed: false,
        finished: false,
        stopping: stopping.clone(),
        srun_done: false,
        ending: false,
        ended: false,
        logged: 0,
    };
    let job = JobVars { job_id: format!("{}.{}", rec.job, rec.step), spawned: false };
    let mut node_rt = Node::new(shell, host_side, job).map_err(|e| format!("cannot set up the progress loop: {e}"))?;
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
        uplink,
    }));
    // SAFETY: just made; freed only in `fini`.
    let shared: &'static Stepd = unsafe { &*stepd };
    STEPD.store(stepd, SeqCst);
    // The secret and the map are for the stepds only; the tasks get their PMI_* variables.
    // SAFETY: Slurm's environment array, as the caller promises.
    unsafe {
        slurm.unsetenv(*env, &cstring(ENV_SECRET.into()));
        slurm.unsetenv(*env, &cstring(ENV_MAP.into()));
    }
    slurm.log(
        log::Level::Debug,
        &format!(
            "serving {} local tasks of step {}.{} on {} (node {node})",
            shared.local_ranks.len(),
            rec.job,
            rec.step,
            place.node_name
        ),
    );
    Ok(())
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
pub unsafe fn task(info: *const sys::mpi_plugin_task_info_t, env: *mut *mut *mut c_char) -> c_int {
    let p = STEPD.load(SeqCst);
    if p.is_null() {
        // Not an rpmi step (see prefork): nothing to set.
        return sys::SLURM_SUCCESS;
    }
    // SAFETY: set at prefork and freed only at fini, which this forked child never runs.
    let Some(stepd) = (unsafe { p.as_ref() }) else { return sys::SLURM_ERROR };
    // SAFETY: Slurm's task info, as the caller promises.
    let info = unsafe { info.as_ref() };
    // Slurm fills the task info from the same step record prefork read: ids that differ mean the record was
    // not read as it is laid out, and nothing read from it can be trusted.
    let confirmed = info.is_some_and(|i| i.step_id.job_id == stepd.job && i.step_id.step_id == stepd.step);
    let rc = match info {
        // SAFETY: as above.
        Some(info) if confirmed => unsafe { set_up_task(stepd, info, env) },
        _ => sys::SLURM_ERROR,
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
unsafe fn set_up_task(stepd: &Stepd, info: &sys::mpi_plugin_task_info_t, env: *mut *mut *mut c_char) -> c_int {
    let Ok(task) = stepd.local_ranks.binary_search(&info.gtaskid) else { return sys::SLURM_ERROR };
    if stepd.node.exec_hook(task).is_err() {
        return sys::SLURM_ERROR;
    }
    let set = |v: &EnvVar| {
        // SAFETY: Slurm's setter with a "%s" format and one NUL-terminated string.
        unsafe { (stepd.env_overwrite)(env, v.name.as_ptr(), c"%s".as_ptr(), v.value.as_ptr()) == 1 }
    };
    if stepd.task_env[task].iter().all(set) {
        sys::SLURM_SUCCESS
    } else {
        sys::SLURM_ERROR
    }
}

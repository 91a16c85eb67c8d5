//! The slurmstepd side: one [`Shell`] per node serving the node's tasks, its collective going to the root in
//! srun over one TCP connection.
//!
//! `mpi_p_slurmstepd_prefork` (before the tasks are forked, as root) takes the step's ids, this node's index
//! and the step's shape from Slurm's step record, and from the environment what srun's side of the plugin
//! put there (the root's port, the secret, the task map), checked against the record. It builds the shell and
//! its [`Driver`], makes one socketpair per local task, joins the root ([`super::uplink`]), and starts two
//! threads: the progress thread (the driver's epoll loop over the task connections) and the uplink reader
//! (frames from the root, and the fork notice described below).
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
//! means every child holds its own end: the uplink reader then closes the stepd's copies of all of them, and
//! a task that dies, even one that never reached the hook, is seen at once (EOF on the server end).

use super::auth::Secret;
use super::layout;
use super::sys::{self, getenvp, Slurm};
use super::trace::{escape_text, Trace};
use super::uplink;
use super::wire::{self, FrameBuf, FromRoot, ToRoot, MESSAGE_MAX};
use crate::driver::{DriverHandle, Event};
use crate::node::{EnvVar, JobVars, Looping, Node, NodeHost};
use crate::server::{Direction, Host, JobError, JobInfo, Limits, Shell, TaskMap};
use std::ffi::{c_char, c_int, CString};
use std::io::{self, Read};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

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
    /// The step's node count: every ALL frame has one part per node.
    nodes: usize,
    /// The largest ALL payload this node takes in: every node's part, together within its store's bound.
    all_max: usize,
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
    link: Arc<Link>,
    stop: Arc<OwnedFd>,
    uplink: TcpStream,
    reader: Mutex<Option<JoinHandle<()>>>,
}

/// The state the uplink reader and the shell's host share.
struct Link {
    /// A collective was sent and its result has not come; its epoch.
    pending: AtomicBool,
    epoch: AtomicU32,
    /// The connection to srun is gone.
    lost: AtomicBool,
    /// Every local task has closed its connection: the connection closing now is the normal end.
    finished: AtomicBool,
    /// `fini` is running.
    stopping: AtomicBool,
    /// The root failed an exchange or this node reported the step's end: srun's user has been told.
    ending: AtomicBool,
    /// srun said it is done with the step (END): its close is the normal end.
    srun_done: AtomicBool,
    /// A task child found Slurm's task info naming the step read from the step record: only then does the
    /// stepd ask slurmctld to end that step.
    ids_confirmed: AtomicBool,
}

/// Asks slurmctld to end the step this stepd serves, once a task has confirmed its ids.
fn kill_own_step(slurm: &Slurm, link: &Link, place: &Place) -> Result<(), String> {
    if !link.ids_confirmed.load(SeqCst) {
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

/// Fails the collective in flight, if any, from the uplink reader's thread. Whichever of the reader and
/// [`SlurmHost::collective`] takes `link.pending` first fails it, so it fails once.
fn fail_collective(link: &Link, handle: &DriverHandle, why: &str) {
    if link.pending.swap(false, SeqCst) {
        let _ = handle.post(Event::CollectiveDone(Err(why.to_string())));
    }
}

/// The engine's host on a slurmstepd.
struct SlurmHost {
    out: TcpStream,
    place: Place,
    epoch: u32,
    link: Arc<Link>,
    slurm: &'static Slurm,
    /// The wire trace (`PMI_DEBUG`); its writer stops when the progress thread drops its host.
    trace: Option<Trace>,
    /// An abort or job error was sent: the root ends the step; say it once.
    ended: bool,
    /// Lines this step has logged.
    logged: usize,
}

impl SlurmHost {
    /// Sends a frame to the root; false if the connection is gone.
    fn send(&mut self, frame: &[u8]) -> bool {
        if self.link.lost.load(SeqCst) {
            return false;
        }
        if uplink::send(&mut self.out, frame).is_ok() {
            return true;
        }
        self.link.lost.store(true, SeqCst);
        // A root that takes too long is as good as gone: the connection is cut so the reader hears it too.
        let _ = self.out.shutdown(std::net::Shutdown::Both);
        false
    }

    /// The step must end, with `message` for the user: the root prints it on srun's stderr and ends the step.
    /// Without a root (srun is gone), the stepd does both: its errors reach the job's stderr.
    fn end_step(&mut self, message: ToRoot, text: &str) {
        if std::mem::replace(&mut self.ended, true) {
            self.log(log::Level::Info, text);
            return;
        }
        if message.encode().is_ok_and(|frame| self.send(&frame)) {
            self.link.ending.store(true, SeqCst);
            self.log(log::Level::Info, text);
            return;
        }
        self.log(log::Level::Error, &format!("{text}; srun (the collective root) is gone, ending the step from here"));
        self.link.ending.store(true, SeqCst);
        if let Err(e) = kill_own_step(self.slurm, &self.link, &self.place) {
            self.log(log::Level::Error, &e);
        }
    }

    fn job_error_text(&mut self, message: &str) {
        let m = ToRoot::Error { rank: u32::MAX, task_failed: false, message: message.to_string() };
        self.end_step(m, message);
    }
}

impl Host for SlurmHost {
    fn collective(&mut self, contribution: &[u8]) -> Result<(), String> {
        let epoch = self.epoch;
        self.epoch = epoch.wrapping_add(1);
        let frame = wire::contrib(epoch, self.place.node, contribution).map_err(|e| e.to_string())?;
        // Pending before the frame goes: the root's answer may come before `send` returns.
        self.link.epoch.store(epoch, SeqCst);
        self.link.pending.store(true, SeqCst);
        if self.send(&frame) || !self.link.pending.swap(false, SeqCst) {
            // Sent, or the uplink reader, which hears the connection go too, failed the collective first:
            // its completion is on its way.
            return Ok(());
        }
        Err("lost the connection to srun (the collective root)".into())
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
        let level = if level <= log::Level::Warn && self.link.ending.load(SeqCst) { log::Level::Info } else { level };
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
                self.send(&frame);
            }
        }
    }
}

impl NodeHost for SlurmHost {
    fn served(&mut self, result: Result<(), String>) {
        match result {
            Ok(()) => {
                self.link.finished.store(true, SeqCst);
                if let Ok(bye) = ToRoot::Bye.encode() {
                    self.send(&bye);
                }
            }
            Err(why) => self.job_error_text(&format!("the PMI progress loop stopped: {why}")),
        }
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

    let link = Arc::new(Link {
        pending: false.into(),
        epoch: 0.into(),
        lost: false.into(),
        finished: false.into(),
        stopping: false.into(),
        ending: false.into(),
        srun_done: false.into(),
        ids_confirmed: false.into(),
    });
    let mut fds = [0; 2];
    // SAFETY: fds has room for the two fds pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(format!("pipe: {}", io::Error::last_os_error()));
    }
    // SAFETY: both fresh and ours.
    let (notify_r, notify_w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: a plain syscall, checked at once.
    let stop = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if stop < 0 {
        return Err(format!("eventfd: {}", io::Error::last_os_error()));
    }
    // SAFETY: fresh and ours.
    let stop = Arc::new(unsafe { OwnedFd::from_raw_fd(stop) });

    let addrs: Vec<_> = (host.as_str(), port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve srun's address {host}: {e}"))?
        .collect();
    let uplink = uplink::join(&addrs, node, &secret, JOIN_PATIENCE).map_err(|e| e.to_string())?;
    let host_side = SlurmHost {
        out: uplink.try_clone().map_err(|e| format!("socket: {e}"))?,
        place: place.clone(),
        epoch: 0,
        link: link.clone(),
        slurm,
        trace,
        ended: false,
        logged: 0,
    };
    let job = JobVars { job_id: format!("{}.{}", rec.job, rec.step), spawned: false };
    let mut node_rt = Node::new(shell, host_side, job).map_err(|e| format!("cannot set up the progress loop: {e}"))?;
    let handle = node_rt.handle().clone();
    let task_env = (0..local_ranks.len())
        .map(|t| node_rt.connect_task(t).map(|c| c.vars).map_err(|e| format!("cannot serve local task {t}: {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    node_rt.start(Looping::OwnThread).map_err(|e| e.to_string())?;

    let stepd = Box::into_raw(Box::new(Stepd {
        job: rec.job,
        step: rec.step,
        nodes: rec.nodes as usize,
        all_max: wire::all_len(rec.nodes as usize, Limits::default().kvs_bytes_max) - 4,
        local_ranks,
        node: node_rt,
        task_env,
        env_overwrite,
        notify_w: notify_w.into_raw_fd(),
        notify_r: notify_r.as_raw_fd(),
        link: link.clone(),
        stop: stop.clone(),
        uplink: uplink.try_clone().map_err(|e| format!("socket: {e}"))?,
        reader: Mutex::new(None),
    }));
    // From here on the reader may use the stepd's fields; it is freed only in `fini`, after joining it.
    // SAFETY: just made, and freed only after the reader is joined.
    let shared: &'static Stepd = unsafe { &*stepd };
    let reader = {
        let (link, place) = (link.clone(), place.clone());
        std::thread::Builder::new()
            .name("rpmi-uplink".into())
            .spawn(move || uplink_reader(uplink, notify_r, stop, shared, link, handle, place, slurm))
    };
    match reader {
        Ok(t) => *shared.reader.lock().unwrap_or_else(|e| e.into_inner()) = Some(t),
        Err(e) => {
            // SAFETY: no thread of ours uses it; dropping it stops the node.
            free(unsafe { Box::from_raw(stepd) });
            return Err(format!("cannot start a thread: {e}"));
        }
    }
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

/// The uplink reader: the root's results, the fork notice, and the stop signal.
#[allow(clippy::too_many_arguments)]
fn uplink_reader(
    mut uplink: TcpStream,
    notify: OwnedFd,
    stop: Arc<OwnedFd>,
    stepd: &'static Stepd,
    link: Arc<Link>,
    handle: DriverHandle,
    place: Place,
    slurm: &'static Slurm,
) {
    crate::node::block_signals();
    let mut input = FrameBuf::default();
    let mut buf = vec![0u8; 64 * 1024];
    let mut connected = true;
    loop {
        let mut fds = [
            libc::pollfd { fd: stop.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: notify.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: if connected { uplink.as_raw_fd() } else { -1 }, events: libc::POLLIN, revents: 0 },
        ];
        // SAFETY: three live pollfds.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 3, -1) };
        if n < 0 {
            if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            slurm.error(&format!("the uplink reader stopped: {}", io::Error::last_os_error()));
            return;
        }
        if fds[0].revents != 0 {
            return;
        }
        if fds[1].revents != 0 {
            // A notice: every task is forked. The pipe stays open (a child writing to a pipe nobody reads would
            // die of SIGPIPE) and is drained.
            stepd.node.forked_all();
            let mut notices = [0u8; 256];
            // SAFETY: reading into our buffer from our non-empty pipe.
            let n = unsafe { libc::read(notify.as_raw_fd(), notices.as_mut_ptr().cast(), notices.len()) };
            if notices[..n.max(0) as usize].contains(&NOTICE_IDS_CONFIRMED) {
                link.ids_confirmed.store(true, SeqCst);
            }
        }
        if connected && fds[2].revents != 0 {
            let why = match uplink.read(&mut buf) {
                Ok(0) => Some("srun closed the connection".to_string()),
                Ok(n) => {
                    input.extend(&buf[..n]);
                    let mut why = None;
                    loop {
                        let frame = match input.next(stepd.all_max) {
                            Ok(None) => break,
                            Ok(Some(f)) => FromRoot::decode(f).map_err(|e| e.to_string()),
                            Err(e) => Err(format!(
                                "{e}: more than this node's key-value store may hold ({} bytes)",
                                Limits::default().kvs_bytes_max
                            )),
                        };
                        match frame {
                            Ok(FromRoot::All { epoch, parts }) => {
                                // srun is the user's: a result must answer this node's barrier and hold
                                // one part per node, in order, or nothing of it is kept.
                                let in_order = parts.len() == stepd.nodes
                                    && parts.iter().enumerate().all(|(i, (n, _))| *n as usize == i);
                                if !in_order {
                                    why = Some("srun sent an exchange result that is not one part per node".into());
                                    break;
                                }
                                if epoch != link.epoch.load(SeqCst) || !link.pending.swap(false, SeqCst) {
                                    why = Some("srun sent an exchange result no barrier waits for".into());
                                    break;
                                }
                                let parts = parts.into_iter().map(|(_, bytes)| bytes).collect();
                                let _ = handle.post(Event::CollectiveDone(Ok(parts)));
                            }
                            Ok(FromRoot::End) => link.srun_done.store(true, SeqCst),
                            Ok(FromRoot::Fail { message, .. }) => {
                                link.ending.store(true, SeqCst);
                                fail_collective(&link, &handle, &escape_text(&message, MESSAGE_MAX))
                            }
                            Ok(other @ (FromRoot::Challenge { .. } | FromRoot::Welcome { .. })) => {
                                why = Some(format!("srun sent {other:?} after the handshake"));
                                break;
                            }
                            Err(e) => {
                                why = Some(format!("srun sent a {e}"));
                                break;
                            }
                        }
                        // The frame was copied out: its bytes need not stay beside the parts.
                        input.release();
                    }
                    input.release();
                    why
                }
                Err(e) if matches!(e.kind(), io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock) => None,
                Err(e) => Some(format!("the connection to srun failed: {e}")),
            };
            if let Some(why) = why {
                connected = false;
                link.lost.store(true, SeqCst);
                fail_collective(&link, &handle, &format!("lost the connection to srun (the collective root): {why}"));
                if !link.finished.load(SeqCst) && !link.stopping.load(SeqCst) && !link.srun_done.load(SeqCst) {
                    // srun was killed, or the network failed: no exchange can complete any more.
                    slurm.error(&format!(
                        "step {}.{} on {}: {why}; srun is gone, ending the step",
                        place.job, place.step, place.node_name
                    ));
                    // Every node tries; all but the first find the step ending already.
                    if let Err(e) = kill_own_step(slurm, &link, &place) {
                        slurm.info(&e);
                    }
                }
            }
        }
    }
}

/// Stops the step's threads and frees it: the progress thread gets [`FINI_GRACE`] to say BYE, then the
/// connection is cut (so that neither thread can be held by a root that reads slowly) and both are joined.
fn free(mut stepd: Box<Stepd>) {
    stepd.link.stopping.store(true, SeqCst);
    let uplink = &stepd.uplink;
    stepd.node.stop(Some(FINI_GRACE), || {
        let _ = uplink.shutdown(std::net::Shutdown::Both);
    });
    let _ = stepd.uplink.shutdown(std::net::Shutdown::Both);
    let one = 1u64.to_ne_bytes();
    // SAFETY: an 8-byte write to our eventfd.
    unsafe { libc::write(stepd.stop.as_raw_fd(), one.as_ptr().cast(), 8) };
    if let Some(t) = stepd.reader.lock().unwrap_or_else(|e| e.into_inner()).take() {
        let _ = t.join();
    }
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

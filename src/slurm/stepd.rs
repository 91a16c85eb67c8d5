//! The slurmstepd side: one [`Shell`] per node serving the node's tasks, its collective going to the root in
//! srun over one TCP connection.
//!
//! `mpi_p_slurmstepd_prefork` (before the tasks are forked, as root) reads what srun put in the step's
//! environment, builds the shell and its [`Driver`], makes one socketpair per local task, connects and
//! authenticates to the root, and starts two threads: the progress thread (the driver's epoll loop over the
//! task connections) and the uplink reader (frames from the root, and the fork notices described below).
//!
//! `mpi_p_slurmstepd_task` runs in each forked task child, a child of this multi-threaded process: it takes
//! no lock and allocates nothing; everything it needs was prepared at prefork. It hands the task its end of
//! the socketpair (`PMI_FD`, close-on-exec cleared), closes every other task's end, and writes its task index
//! into a pipe; the uplink reader then closes the stepd's copy of that task's end, so that a task that dies
//! is seen at once (EOF on the server end).

use super::layout;
use super::sys::{self, getenvp, Slurm};
use super::wire::{self, FrameBuf, FromRoot, Secret, ToRoot, FRAME_MAX};
use crate::driver::{channel, socketpair, Driver, DriverHandle, Event};
use crate::server::{Direction, Host, JobError, JobInfo, Limits, Shell, TaskMap};
use std::ffi::{c_char, c_int, CStr, CString};
use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicPtr, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// Environment srun's prelaunch adds for the stepds (see `super::client`).
pub const ENV_PORT: &str = "RPMI_SLURM_PORT";
pub const ENV_SECRET: &str = "RPMI_SLURM_SECRET";
pub const ENV_MAP: &str = "RPMI_SLURM_MAP";

const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);
const WRITE_TIMEOUT: Duration = Duration::from_secs(60);

/// The step this process serves; set at prefork, read without a lock in the task children.
static STEPD: AtomicPtr<Stepd> = AtomicPtr::new(std::ptr::null_mut());

/// What the task children and `fini` need.
struct Stepd {
    /// The rank of each local task, ascending; a task's index here is its [`crate::server::TaskId`].
    local_ranks: Vec<u32>,
    /// Each task's end of its socketpair, until the stepd has closed its copy (-1 then).
    child_fds: Box<[AtomicI32]>,
    /// Prepared environment values, per task and for all.
    fd_text: Vec<CString>,
    rank_text: Vec<CString>,
    size_text: CString,
    jobid_text: CString,
    env_overwrite: sys::EnvOverwriteFmt,
    /// The write end of the fork-notice pipe (inherited by each child, close-on-exec).
    notify_w: RawFd,
    notify_r: RawFd,
    handle: DriverHandle,
    link: Arc<Link>,
    stop: Arc<OwnedFd>,
    uplink: TcpStream,
    progress: Mutex<Option<JoinHandle<()>>>,
    reader: Mutex<Option<JoinHandle<()>>>,
}

/// The state the uplink reader and the shell's host share.
struct Link {
    /// A collective was sent and its result has not come.
    pending: AtomicBool,
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
}

/// The step ids and this node's place, for messages and for ending the step.
#[derive(Clone)]
struct Place {
    job: u32,
    step: u32,
    node: u32,
    node_name: String,
}

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
    handle: DriverHandle,
    slurm: &'static Slurm,
    /// An abort or job error was sent: the root ends the step; say it once.
    ended: bool,
}

impl SlurmHost {
    /// Sends a frame to the root; false if the connection is gone.
    fn send(&mut self, frame: &[u8]) -> bool {
        if self.link.lost.load(SeqCst) {
            return false;
        }
        if self.out.write_all(frame).is_ok() {
            return true;
        }
        self.link.lost.store(true, SeqCst);
        false
    }

    /// The step must end, with `message` for the user: the root prints it on srun's stderr and ends the step.
    /// Without a root (srun is gone), the stepd does both: its errors reach the job's stderr.
    fn end_step(&mut self, frame: Vec<u8>, message: &str) {
        self.link.ending.store(true, SeqCst);
        if std::mem::replace(&mut self.ended, true) {
            self.slurm.info(message);
            return;
        }
        if self.send(&frame) {
            self.slurm.info(message);
            return;
        }
        self.slurm.error(&format!("{message}; srun (the collective root) is gone, ending the step from here"));
        if let Err(e) = self.slurm.kill_step(self.place.job, self.place.step, libc::SIGKILL) {
            self.slurm.error(&e);
        }
    }
}

impl Host for SlurmHost {
    fn collective(&mut self, contribution: &[u8]) {
        self.link.pending.store(true, SeqCst);
        let frame = wire::contrib(self.epoch, self.place.node, contribution);
        self.epoch = self.epoch.wrapping_add(1);
        if !self.send(&frame) {
            fail_collective(&self.link, &self.handle, "lost the connection to srun (the collective root)");
        }
    }

    fn abort(&mut self, rank: u32, exit_code: i32, message: &str) {
        let text = format!(
            "rank {rank} called PMI_Abort with exit code {exit_code}{}{message}",
            if message.is_empty() { "" } else { ": " }
        );
        self.end_step(ToRoot::Abort { rank, code: exit_code, message: message.to_string() }.encode(), &text);
    }

    fn job_error(&mut self, error: &JobError) {
        let message = error.to_string();
        self.end_step(ToRoot::Error { rank: error.rank(), message: message.clone() }.encode(), &message);
    }

    fn log(&mut self, level: log::Level, message: &str) {
        // A stepd's errors also reach the job's stderr: once the user has been told why the step ends, the
        // consequences (every barrier failing) go to the slurmd log only.
        let level = if level <= log::Level::Warn && self.link.ending.load(SeqCst) { log::Level::Info } else { level };
        self.slurm.log(level, message);
    }

    fn trace(&mut self, rank: u32, direction: Direction, line: &[u8]) {
        self.slurm.info(&format!("rank {rank} {direction}: {}", String::from_utf8_lossy(line)));
    }

    fn task_closed(&mut self, rank: u32, finalized: bool) {
        if !finalized {
            self.send(&ToRoot::Gone { rank }.encode());
        }
    }
}

/// Blocks every signal in the calling thread: slurmstepd's and srun's signals are for their own threads.
pub(super) fn block_signals() {
    // SAFETY: a full signal set, applied to this thread only.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut set);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

fn need(env: *const *const c_char, name: &str) -> Result<String, String> {
    // SAFETY: Slurm's environment array.
    unsafe { getenvp(env, name) }.ok_or_else(|| format!("{name} is not in the step's environment"))
}

fn number(env: *const *const c_char, name: &str) -> Result<u32, String> {
    let text = need(env, name)?;
    text.parse().map_err(|_| format!("{name}={text} is not a number"))
}

fn cstring(s: String) -> CString {
    CString::new(s).expect("numbers and ids hold no NUL")
}

/// `mpi_p_slurmstepd_prefork`.
///
/// # Safety
/// `env` is the `char ***` Slurm passes: the step's environment, which the tasks inherit.
pub unsafe fn prefork(env: *mut *mut *mut c_char) -> Result<(), String> {
    let slurm = sys::slurm();
    if env.is_null() {
        return Err("no environment".into());
    }
    let envp = *env as *const *const c_char;
    let Some(port) = getenvp(envp, ENV_PORT) else {
        slurm.info(&format!("{ENV_PORT} is not set: this step was not started by `srun --mpi=rpmi`; no PMI"));
        return Ok(());
    };
    if !STEPD.load(SeqCst).is_null() {
        return Err("prefork called twice in one slurmstepd".into());
    }
    let env_overwrite = slurm.env_overwrite_fmt.ok_or("slurm_env_array_overwrite_fmt is not in this process")?;
    let port: u16 = port.parse().map_err(|_| format!("{ENV_PORT}={port} is not a port"))?;
    let secret = Secret::from_hex(&need(envp, ENV_SECRET)?).ok_or(format!("{ENV_SECRET} is malformed"))?;
    let host = need(envp, "SLURM_SRUN_COMM_HOST")?;
    let job = number(envp, "SLURM_JOB_ID")?;
    let step = number(envp, "SLURM_STEP_ID")?;
    let nodelist = need(envp, "SLURM_STEP_NODELIST")?;
    let names = slurm.expand_nodelist(&nodelist)?;
    let node_of = layout::decode(&need(envp, ENV_MAP)?, names.len())?;
    let me = std::env::var("SLURMD_NODENAME").ok().or_else(|| getenvp(envp, "SLURMD_NODENAME"));
    let node = match me.as_deref().and_then(|m| names.iter().position(|n| n == m)) {
        Some(i) => i as u32,
        None if names.len() == 1 => 0,
        None => return Err(format!("this node ({}) is not in SLURM_STEP_NODELIST={nodelist}", me.unwrap_or_default())),
    };
    let trace = getenvp(envp, "PMI_DEBUG").is_some_and(|v| !v.is_empty() && v != "0");
    let place = Place { job, step, node, node_name: names[node as usize].clone() };

    let local_ranks: Vec<u32> = (0..node_of.len() as u32).filter(|&r| node_of[r as usize] == node).collect();
    let size = node_of.len();
    let info = JobInfo::new(format!("rpmi_{job}.{step}"), TaskMap::new(node_of), local_ranks.clone(), names);
    let mut shell = Shell::new(info, Limits::default()).map_err(|e| format!("cannot serve this step: {e}"))?;
    shell.set_trace(trace);

    let (handle, inbox) = channel().map_err(|e| format!("cannot set up the progress loop: {e}"))?;
    let link = Arc::new(Link {
        pending: false.into(),
        lost: false.into(),
        finished: false.into(),
        stopping: false.into(),
        ending: false.into(),
        srun_done: false.into(),
    });

    let mut pairs = Vec::with_capacity(local_ranks.len());
    for t in 0..local_ranks.len() {
        pairs.push(socketpair().map_err(|e| format!("socketpair for local task {t}: {e}"))?);
    }
    let mut fds = [0; 2];
    if libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) < 0 {
        return Err(format!("pipe: {}", io::Error::last_os_error()));
    }
    let (notify_r, notify_w) = (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1]));
    let stop = libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK);
    if stop < 0 {
        return Err(format!("eventfd: {}", io::Error::last_os_error()));
    }
    let stop = Arc::new(OwnedFd::from_raw_fd(stop));

    let uplink = connect(&host, port, node, &secret)?;
    let host_side = SlurmHost {
        out: uplink.try_clone().map_err(|e| format!("socket: {e}"))?,
        place: place.clone(),
        epoch: 0,
        link: link.clone(),
        handle: handle.clone(),
        slurm,
        ended: false,
    };
    let mut driver =
        Driver::new(shell, host_side, inbox).map_err(|e| format!("cannot set up the progress loop: {e}"))?;
    let mut child_fds = Vec::with_capacity(pairs.len());
    for (t, (server, child)) in pairs.into_iter().enumerate() {
        driver.attach(t, server).map_err(|e| format!("cannot serve local task {t}: {e}"))?;
        child_fds.push(child.into_raw_fd());
    }
    let fd_text = child_fds.iter().map(|fd| cstring(fd.to_string())).collect();
    let child_fds: Box<[AtomicI32]> = child_fds.into_iter().map(AtomicI32::new).collect();

    let stepd = Box::into_raw(Box::new(Stepd {
        rank_text: local_ranks.iter().map(|r| cstring(r.to_string())).collect(),
        local_ranks,
        child_fds,
        fd_text,
        size_text: cstring(size.to_string()),
        jobid_text: cstring(format!("{job}.{step}")),
        env_overwrite,
        notify_w: notify_w.into_raw_fd(),
        notify_r: notify_r.as_raw_fd(),
        handle: handle.clone(),
        link: link.clone(),
        stop: stop.clone(),
        uplink: uplink.try_clone().map_err(|e| format!("socket: {e}"))?,
        progress: Mutex::new(None),
        reader: Mutex::new(None),
    }));
    // From here on the threads may use the stepd's fields; it is freed only in `fini`, after joining them.
    let shared: &'static Stepd = &*stepd;
    let reader = {
        let (link, handle, place) = (link.clone(), handle.clone(), place.clone());
        std::thread::Builder::new()
            .name("rpmi-uplink".into())
            .spawn(move || uplink_reader(uplink, notify_r, stop, shared, link, handle, place, slurm))
    };
    let reader = match reader {
        Ok(t) => t,
        Err(e) => {
            drop(Box::from_raw(stepd));
            return Err(format!("cannot start a thread: {e}"));
        }
    };
    *shared.reader.lock().unwrap_or_else(|e| e.into_inner()) = Some(reader);
    let progress = std::thread::Builder::new().name("rpmi-progress".into()).spawn(move || {
        block_signals();
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| driver.run()));
        let host = driver.host_mut();
        match result {
            Ok(Ok(())) => {
                host.link.finished.store(true, SeqCst);
                host.send(&ToRoot::Bye.encode());
            }
            Ok(Err(e)) => host.job_error_text(&format!("the PMI progress loop stopped: {e}")),
            Err(_) => host.job_error_text("the PMI progress loop stopped after an internal error"),
        }
    });
    match progress {
        Ok(t) => *shared.progress.lock().unwrap_or_else(|e| e.into_inner()) = Some(t),
        Err(e) => {
            stop_threads(shared);
            drop(Box::from_raw(stepd));
            return Err(format!("cannot start a thread: {e}"));
        }
    }
    STEPD.store(stepd, SeqCst);
    // The secret and the map are for the stepds only; the tasks get their PMI_* variables.
    slurm.unsetenv(*env, &cstring(ENV_SECRET.into()));
    slurm.unsetenv(*env, &cstring(ENV_MAP.into()));
    slurm.log(
        log::Level::Debug,
        &format!(
            "serving {} local tasks of step {job}.{step} on {} (node {node})",
            shared.local_ranks.len(),
            place.node_name
        ),
    );
    Ok(())
}

impl SlurmHost {
    fn job_error_text(&mut self, message: &str) {
        self.end_step(ToRoot::Error { rank: u32::MAX, message: message.to_string() }.encode(), message);
    }
}

/// Connects to the root and authenticates.
fn connect(host: &str, port: u16, node: u32, secret: &Secret) -> Result<TcpStream, String> {
    let addrs = (host, port).to_socket_addrs().map_err(|e| format!("cannot resolve srun's address {host}: {e}"))?;
    let mut last = None;
    for addr in addrs {
        match TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT) {
            Ok(mut s) => {
                let _ = s.set_nodelay(true);
                // A root that takes nothing for this long is gone (srun stopped or the network down): the
                // progress thread must not block for ever in a write.
                let _ = s.set_write_timeout(Some(WRITE_TIMEOUT));
                s.write_all(&ToRoot::Hello { node, secret: secret.0 }.encode())
                    .map_err(|e| format!("cannot reach srun at {addr}: {e}"))?;
                return Ok(s);
            }
            Err(e) => last = Some(format!("{addr}: {e}")),
        }
    }
    Err(format!("cannot connect to srun's collective port ({})", last.unwrap_or_else(|| host.to_string())))
}

/// Closes the stepd's copy of task `task`'s end.
fn close_child(stepd: &Stepd, task: usize) {
    if let Some(a) = stepd.child_fds.get(task) {
        let fd = a.swap(-1, SeqCst);
        if fd >= 0 {
            // SAFETY: our fd, taken out of the table first so that it is closed once.
            unsafe { libc::close(fd) };
        }
    }
}

/// The uplink reader: the root's results, the fork notices, and the stop signal.
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
    block_signals();
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
            let mut notice = [0u8; 4 * 64];
            // SAFETY: reading into our buffer; the pipe carries whole 4-byte notices (atomic writes).
            let n = unsafe { libc::read(notify.as_raw_fd(), notice.as_mut_ptr().cast(), notice.len()) };
            for chunk in notice[..n.max(0) as usize].chunks_exact(4) {
                close_child(stepd, u32::from_ne_bytes(chunk.try_into().expect("4 bytes")) as usize);
            }
        }
        if connected && fds[2].revents != 0 {
            let why = match uplink.read(&mut buf) {
                Ok(0) => Some("srun closed the connection".to_string()),
                Ok(n) => {
                    input.extend(&buf[..n]);
                    let mut why = None;
                    loop {
                        match input.next(FRAME_MAX).map(|f| f.map(FromRoot::decode)) {
                            Ok(None) => break,
                            Ok(Some(Ok(FromRoot::All { parts, .. }))) => {
                                link.pending.store(false, SeqCst);
                                let parts = parts.into_iter().map(|(_, bytes)| bytes).collect();
                                let _ = handle.post(Event::CollectiveDone(Ok(parts)));
                            }
                            Ok(Some(Ok(FromRoot::End))) => link.srun_done.store(true, SeqCst),
                            Ok(Some(Ok(FromRoot::Fail { message, .. }))) => {
                                link.ending.store(true, SeqCst);
                                fail_collective(&link, &handle, &message)
                            }
                            Ok(Some(Err(e))) | Err(e) => {
                                why = Some(format!("srun sent a {e}"));
                                break;
                            }
                        }
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
                    if let Err(e) = slurm.kill_step(place.job, place.step, libc::SIGKILL) {
                        slurm.info(&e);
                    }
                }
            }
        }
    }
}

fn stop_threads(stepd: &Stepd) {
    stepd.link.stopping.store(true, SeqCst);
    let one = 1u64.to_ne_bytes();
    // SAFETY: an 8-byte write to our eventfd.
    unsafe { libc::write(stepd.stop.as_raw_fd(), one.as_ptr().cast(), 8) };
    let _ = stepd.handle.post(Event::Stop);
    for thread in [&stepd.progress, &stepd.reader] {
        if let Some(t) = thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }
}

/// `fini` in a slurmstepd: stops the threads (the progress thread says BYE to the root) and frees the step.
pub fn fini() {
    let p = STEPD.swap(std::ptr::null_mut(), SeqCst);
    if p.is_null() {
        return;
    }
    // SAFETY: the pointer prefork made; taken out of STEPD, so freed once.
    let stepd = unsafe { Box::from_raw(p) };
    // The progress thread says BYE as it stops; then the connection closes.
    stop_threads(&stepd);
    let _ = stepd.uplink.shutdown(std::net::Shutdown::Both);
    for t in 0..stepd.child_fds.len() {
        close_child(&stepd, t);
    }
    // SAFETY: our fd, closed once.
    unsafe { libc::close(stepd.notify_w) };
}

/// `mpi_p_slurmstepd_task`, in the forked task child: no lock, no allocation.
///
/// # Safety
/// Pointers as Slurm passes them.
pub unsafe fn task(info: *const sys::mpi_plugin_task_info_t, env: *mut *mut *mut c_char) -> c_int {
    let p = STEPD.load(SeqCst);
    if p.is_null() {
        // Not an rpmi step (see prefork): nothing to set.
        return sys::SLURM_SUCCESS;
    }
    let (Some(stepd), Some(info)) = (p.as_ref(), info.as_ref()) else { return sys::SLURM_ERROR };
    let Ok(task) = stepd.local_ranks.binary_search(&info.gtaskid) else { return sys::SLURM_ERROR };
    let fd = stepd.child_fds[task].load(SeqCst);
    if fd < 0 || libc::fcntl(fd, libc::F_SETFD, 0) < 0 {
        return sys::SLURM_ERROR;
    }
    for (t, other) in stepd.child_fds.iter().enumerate() {
        let o = other.load(SeqCst);
        if t != task && o >= 0 {
            libc::close(o);
        }
    }
    let set =
        |name: &CStr, value: &CStr| (stepd.env_overwrite)(env, name.as_ptr(), c"%s".as_ptr(), value.as_ptr()) == 1;
    if !(set(c"PMI_FD", &stepd.fd_text[task])
        && set(c"PMI_RANK", &stepd.rank_text[task])
        && set(c"PMI_SIZE", &stepd.size_text)
        && set(c"PMI_JOBID", &stepd.jobid_text))
    {
        return sys::SLURM_ERROR;
    }
    // Tell the stepd it may close its copy of our end; a 4-byte write to a pipe is atomic.
    let notice = (task as u32).to_ne_bytes();
    libc::write(stepd.notify_w, notice.as_ptr().cast(), 4);
    libc::close(stepd.notify_w);
    libc::close(stepd.notify_r);
    sys::SLURM_SUCCESS
}

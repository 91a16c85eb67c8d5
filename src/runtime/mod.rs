//! The node runtime: what runs around the engine on one node (one job shell), whichever host loads it. The C
//! ABI's instance and the Slurm stepd both drive a [`NodeRuntime`]; they only translate their host's calls into it.
//!
//! A node owns, per local task, a connection (a socketpair: the node serves one end, the task inherits the
//! other as `PMI_FD`) and the environment that tells the task about it; the hook that runs in the forked child
//! before `exec`; the progress loop (a thread of its own, or the host's event loop calling [`NodeRuntime::progress`]),
//! with panics contained; and the stop, which serves what the tasks wrote before they left.
//!
//! **Life of a task.** [`NodeRuntime::connect_task`] makes the connection and the environment (before the fork). In the
//! child, [`NodeRuntime::exec_hook`] hands the task its end and closes every other task's end the child inherited, so
//! that a task that dies is seen at once by the node even while its siblings are not yet exec'd. In the parent,
//! [`NodeRuntime::forked`] (one task) or [`NodeRuntime::forked_all`] closes the node's copy of the task's end: until then the
//! node cannot see the task leave.
//!
//! **A connection the host makes** (a job shell that closes every fd but its own in the child, before any
//! hook of ours could keep one): [`NodeRuntime::env_task`] makes no socketpair, and the host hands its end over with
//! [`NodeRuntime::attach_task`]; there is no exec hook.

use crate::driver::{channel, Driver, DriverHandle, Event, HostFds};
use crate::os::socketpair;
use crate::server::{Server, TaskId};
use std::ffi::CString;
use std::fmt;
use std::io;
use std::os::fd::{IntoRawFd, OwnedFd, RawFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering::SeqCst};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// What a node's host is told beyond the engine's [`crate::server::Host`] seam.
pub trait NodeHost: HostFds + Send + 'static {
    /// The progress loop has ended: every task has closed its connection or a stop was taken (`Ok`), or it
    /// failed (`Err`, with why; every task connection is closed, so the tasks fail fast instead of hanging).
    fn served(&mut self, result: Result<(), String>) {
        if let Err(why) = result {
            self.log(log::Level::Error, &format!("the PMI progress loop stopped: {why}"));
        }
    }
}

/// Who runs the progress loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Looping {
    /// A thread of the node's own (hosts without an event loop, such as slurmstepd).
    OwnThread,
    /// The host's event loop watches [`NodeRuntime::watch_fd`] and calls [`NodeRuntime::progress`].
    HostLoop,
}

/// Why a node refused a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeError {
    /// An argument is out of range (no such task).
    Invalid(String),
    /// Not now: the task is already connected, or the node no longer serves.
    State(String),
    /// The system refused a resource (a socketpair, a thread).
    System(String),
}

impl fmt::Display for NodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NodeError::Invalid(m) | NodeError::State(m) | NodeError::System(m) => f.write_str(m),
        }
    }
}

/// The job facts every task's environment carries besides its own rank and fd, and those the shell's job
/// information holds (`PMI_SPAWNED=1` when the job was started by `PMI_Spawn`).
pub struct JobVars {
    /// `PMI_JOBID`.
    pub job_id: String,
}

/// One variable of a task's environment, in the forms hosts set it: name and value apart (a setter such as
/// Slurm's) and as one `NAME=value` entry (an `environ` array).
pub struct EnvVar {
    pub name: CString,
    pub value: CString,
    pub entry: CString,
}

impl EnvVar {
    fn new(name: &str, value: String) -> EnvVar {
        // Names are ours and values digits or a checked job id: neither holds a NUL.
        let entry = CString::new(format!("{name}={value}")).unwrap_or_default();
        EnvVar { name: CString::new(name).unwrap_or_default(), value: CString::new(value).unwrap_or_default(), entry }
    }
}

/// What a task is handed: its end of the connection (in the forked child, `PMI_FD`) and its PMI variables.
pub struct TaskEnv {
    pub child_fd: RawFd,
    pub vars: Vec<EnvVar>,
}

/// The runtime of one node: see the module's documentation.
pub struct NodeRuntime<H: NodeHost> {
    handle: DriverHandle,
    /// Each task's end of its connection while the node still holds it (-1 otherwise): read in a forked child
    /// without a lock.
    child_fds: ChildEnds,
    /// A task's connection was made, or its environment for a connection the host makes (once per task).
    connected: Box<[AtomicBool]>,
    /// A task's connection is served (or posted to be): made here, or handed over by the host.
    attached: Box<[AtomicBool]>,
    /// The rank of each local task, by [`TaskId`].
    ranks: Vec<u32>,
    size: usize,
    job: JobVars,
    spawned: bool,
    /// The highest PMI-1 subversion this node's server answers: 2 where the host serves PMI 1.2's group
    /// exchanges.
    subversion: u8,
    /// The driver's epoll fd, for a host loop to watch; it lives as long as the driver.
    watch_fd: RawFd,
    /// Locked so that [`NodeRuntime::stop`] takes the node shared: the host's callbacks it runs may call on
    /// the node too.
    progress: Mutex<LoopState<H>>,
}

enum LoopState<H: NodeHost> {
    /// Made, not yet started: the host may still reach its side ([`NodeRuntime::host_mut`]). (Locked like the
    /// others so that a node can be shared with the host's other threads from the start.)
    Ready(Mutex<Box<Driver<H>>>),
    Thread {
        thread: Option<JoinHandle<()>>,
        done: Mutex<Option<mpsc::Receiver<()>>>,
    },
    InHostLoop(Mutex<Box<Driver<H>>>),
    Stopped,
}

impl<H: NodeHost> NodeRuntime<H> {
    /// A node serving `shell`'s tasks, its requests going to `host`. It serves nothing until [`NodeRuntime::start`].
    pub fn new(server: Server, host: H, job: JobVars) -> io::Result<NodeRuntime<H>> {
        let n = server.task_count();
        let ranks = (0..n).map(|t| server.rank_of(t).unwrap_or(u32::MAX)).collect();
        let (size, spawned) = (server.job().task_map.size(), server.job().spawned);
        let subversion = if host.serves_groups() { 2 } else { 1 };
        let (handle, inbox) = channel()?;
        let driver = Driver::new(server, host, inbox)?;
        Ok(NodeRuntime {
            watch_fd: driver.watch_fd(),
            handle,
            child_fds: ChildEnds((0..n).map(|_| AtomicI32::new(-1)).collect()),
            connected: (0..n).map(|_| AtomicBool::new(false)).collect(),
            attached: (0..n).map(|_| AtomicBool::new(false)).collect(),
            ranks,
            size,
            job,
            spawned,
            subversion,
            progress: Mutex::new(LoopState::Ready(Mutex::new(Box::new(driver)))),
        })
    }

    /// The host's side, before the node starts (to give it what only exists once the node does).
    pub fn host_mut(&mut self) -> Option<&mut H> {
        match self.progress.get_mut().unwrap_or_else(|e| e.into_inner()) {
            LoopState::Ready(driver) => driver.get_mut().ok().map(|d| d.host_mut()),
            _ => None,
        }
    }

    /// Starts serving: the node's own progress thread, or the host's loop from now on.
    pub fn start(&mut self, looping: Looping) -> Result<(), NodeError> {
        let progress = self.progress.get_mut().unwrap_or_else(|e| e.into_inner());
        let LoopState::Ready(driver) = std::mem::replace(progress, LoopState::Stopped) else {
            return Err(NodeError::State("the node is already started".into()));
        };
        let driver = driver.into_inner().map_err(|_| NodeError::State("the node failed before it started".into()))?;
        *progress = match looping {
            Looping::HostLoop => LoopState::InHostLoop(Mutex::new(driver)),
            Looping::OwnThread => {
                let (done_tx, done_rx) = mpsc::channel();
                let thread = std::thread::Builder::new().name("rpmi-progress".into()).spawn(move || {
                    progress_thread(*driver);
                    let _ = done_tx.send(());
                });
                let thread = thread.map_err(|e| NodeError::System(format!("cannot start the progress thread: {e}")))?;
                LoopState::Thread { thread: Some(thread), done: Mutex::new(Some(done_rx)) }
            }
        };
        Ok(())
    }

    /// How many tasks this node serves.
    pub fn task_count(&self) -> usize {
        self.ranks.len()
    }

    /// The rank of local task `task`.
    pub fn rank_of(&self, task: TaskId) -> Option<u32> {
        self.ranks.get(task).copied()
    }

    /// Posts events to the progress loop (a collective's result from another thread, a host's answer).
    pub fn handle(&self) -> &DriverHandle {
        &self.handle
    }

    /// Makes task `task`'s connection and returns its environment: `PMI_FD`, `PMI_RANK`, `PMI_SIZE`,
    /// `PMI_JOBID` (and `PMI_SPAWNED`). The task's end stays open in the node until [`NodeRuntime::forked`].
    pub fn connect_task(&self, task: TaskId) -> Result<TaskEnv, NodeError> {
        let rank = self.mark_connected(task)?;
        let pair = socketpair().map_err(|e| NodeError::System(format!("socketpair for local task {task}: {e}")));
        let (server, child) = match pair {
            Ok(p) => p,
            Err(e) => {
                self.connected[task].store(false, SeqCst);
                return Err(e);
            }
        };
        self.handle
            .post(Event::Attach(task, server))
            .map_err(|_| NodeError::State("the node no longer serves".into()))?;
        self.attached[task].store(true, SeqCst);
        let fd = child.into_raw_fd();
        self.child_fds.0[task].store(fd, SeqCst);
        Ok(TaskEnv { child_fd: fd, vars: self.task_vars(rank, Some(fd)) })
    }

    /// Marks local task `task` connected (once); returns its rank.
    fn mark_connected(&self, task: TaskId) -> Result<u32, NodeError> {
        let (Some(connected), Some(&rank)) = (self.connected.get(task), self.ranks.get(task)) else {
            return Err(NodeError::Invalid(format!("no local task {task}")));
        };
        if connected.swap(true, SeqCst) {
            return Err(NodeError::State(format!("task {task} is already connected")));
        }
        Ok(rank)
    }

    /// A task's environment: `PMI_FD` (when the node makes the connection), `PMI_RANK`, `PMI_SIZE`, `PMI_JOBID`
    /// (and `PMI_SPAWNED`), and `RPMI_PMI_SUBVERSION`: the highest PMI-1 subversion the server answers, which
    /// a client library may ask for at `init` (a server of PMI 1.1 only, such as Hydra, ends a job whose
    /// client asks for 1.2).
    fn task_vars(&self, rank: u32, pmi_fd: Option<RawFd>) -> Vec<EnvVar> {
        let mut vars: Vec<EnvVar> = pmi_fd.map(|fd| EnvVar::new("PMI_FD", fd.to_string())).into_iter().collect();
        vars.extend([
            EnvVar::new("PMI_RANK", rank.to_string()),
            EnvVar::new("PMI_SIZE", self.size.to_string()),
            EnvVar::new("PMI_JOBID", self.job.job_id.clone()),
        ]);
        if self.spawned {
            vars.push(EnvVar::new("PMI_SPAWNED", "1".into()));
        }
        vars.push(EnvVar::new("RPMI_PMI_SUBVERSION", self.subversion.to_string()));
        vars
    }

    /// The environment of task `task`, whose connection the host makes itself and hands over later
    /// ([`NodeRuntime::attach_task`]): no socketpair is made, and the environment has no `PMI_FD`.
    pub fn env_task(&self, task: TaskId) -> Result<TaskEnv, NodeError> {
        let rank = self.mark_connected(task)?;
        Ok(TaskEnv { child_fd: -1, vars: self.task_vars(rank, None) })
    }

    /// Serves `fd`, the host's end of the connection it made for task `task` (after [`NodeRuntime::env_task`]). Posted
    /// to the progress loop, never taken under its lock: a host may call this from inside a callback.
    pub fn attach_task(&self, task: TaskId, fd: OwnedFd) -> Result<(), NodeError> {
        let Some(connected) = self.connected.get(task) else {
            return Err(NodeError::Invalid(format!("no local task {task}")));
        };
        if !connected.load(SeqCst) {
            return Err(NodeError::State(format!("task {task} has no environment made for it")));
        }
        if self.attached[task].swap(true, SeqCst) {
            return Err(NodeError::State(format!("task {task}'s connection is already served")));
        }
        self.handle.post(Event::Attach(task, fd)).map_err(|_| NodeError::State("the node no longer serves".into()))
    }

    /// Task `task`, whose connection the host was to make, has ended without one: it is served a connection
    /// already closed at the other end, so that the node sees it leave (and a barrier waiting for it fails).
    /// Nothing for any other task.
    pub fn abandon(&self, task: TaskId) -> Result<(), NodeError> {
        let made = self.connected.get(task).is_some_and(|c| c.load(SeqCst));
        if !made || self.attached[task].load(SeqCst) {
            return Ok(());
        }
        let (ours, _gone) = socketpair().map_err(|e| NodeError::System(format!("socketpair: {e}")))?;
        self.attach_task(task, ours)
    }

    /// In the forked child of task `task`, before `exec`: clears close-on-exec on the task's end and closes
    /// every other task's end this child inherited. Async-signal-safe: atomics, `fcntl` and `close` only; no
    /// allocation, no lock, no panic path. Returns the task's end (`PMI_FD`).
    pub fn exec_hook(&self, task: TaskId) -> Result<RawFd, ExecError> {
        let Some(fd) = self.child_fds.get(task).map(|f| f.load(SeqCst)) else { return Err(ExecError::NoTask) };
        if fd < 0 {
            return Err(ExecError::NoEnd);
        }
        // SAFETY: fcntl on the task's end, open in this child.
        if unsafe { libc::fcntl(fd, libc::F_SETFD, 0) } < 0 {
            return Err(ExecError::System);
        }
        for (t, other) in self.child_fds.iter().enumerate() {
            let o = other.load(SeqCst);
            if t != task && o >= 0 {
                // SAFETY: another task's end, inherited by this child, which must not keep it. The node's
                // table is this child's copy: the parent's fds are untouched.
                unsafe { libc::close(o) };
            }
        }
        Ok(fd)
    }

    /// In the parent, once task `task` is forked (or failed to fork): closes the node's copy of its end.
    pub fn forked(&self, task: TaskId) -> Result<(), NodeError> {
        let slot = self.child_fds.get(task).ok_or_else(|| NodeError::Invalid(format!("no local task {task}")))?;
        close(slot);
        Ok(())
    }

    /// In the parent, once every task is forked: closes the node's copies of all their ends.
    pub fn forked_all(&self) {
        self.child_fds.close_all();
    }

    /// The node's copies of the tasks' ends, for a host that learns on its own thread that every task is
    /// forked (Slurm's stepd, from its tasks' notices).
    pub fn child_ends(&self) -> ChildEnds {
        self.child_fds.clone()
    }

    /// The fd a host loop watches for readability ([`Looping::HostLoop`]).
    pub fn watch_fd(&self) -> RawFd {
        self.watch_fd
    }

    /// Does the work that is ready, without waiting ([`Looping::HostLoop`]).
    pub fn progress(&self) -> Result<(), NodeError> {
        let progress = self.progress.lock().unwrap_or_else(|e| e.into_inner());
        let LoopState::InHostLoop(driver) = &*progress else {
            return Err(NodeError::State("progress called, but the node runs its own progress thread".into()));
        };
        let mut driver = driver.lock().map_err(|_| NodeError::State("the node stopped after an error".into()))?;
        match catch_unwind(AssertUnwindSafe(|| driver.on_ready(0))) {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(NodeError::System(format!("progress: {e}"))),
            // The lock is poisoned by the unwind: every later call fails the same way.
            Err(_) => Err(NodeError::State("the node stopped after an internal error".into())),
        }
    }

    /// Stops serving, after serving what the tasks wrote before they left (an abort line, say). With a
    /// `grace`, a progress thread that has not ended within it gets `cut` called (to cut what holds it, such
    /// as a slow peer) before it is joined. The host's callbacks that run meanwhile may call on the node:
    /// [`NodeRuntime::progress`] then fails, as the node has stopped.
    pub fn stop(&self, grace: Option<Duration>, cut: impl FnOnce()) {
        let _ = self.handle.post(Event::Stop);
        let taken =
            std::mem::replace(&mut *self.progress.lock().unwrap_or_else(|e| e.into_inner()), LoopState::Stopped);
        match taken {
            LoopState::Thread { mut thread, done } => {
                let done = done.into_inner().unwrap_or_else(|e| e.into_inner());
                if let (Some(grace), Some(done)) = (grace, done) {
                    if done.recv_timeout(grace).is_err() {
                        cut();
                    }
                }
                if let Some(t) = thread.take() {
                    let _ = t.join();
                }
            }
            // The posted stop makes the watched fd readable, so one call without waiting takes it.
            LoopState::InHostLoop(driver) => {
                if let Ok(mut driver) = driver.into_inner() {
                    let _ = catch_unwind(AssertUnwindSafe(|| driver.on_ready(0)));
                }
            }
            LoopState::Ready(_) | LoopState::Stopped => {}
        }
        self.forked_all();
    }
}

impl<H: NodeHost> Drop for NodeRuntime<H> {
    fn drop(&mut self) {
        self.stop(None, || {});
    }
}

/// Why [`NodeRuntime::exec_hook`] failed; the child should `_exit` rather than run a task without its connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExecError {
    NoTask,
    /// The task was never connected, or the node has closed its end.
    NoEnd,
    System,
}

/// The node's copies of its tasks' ends of their connections.
#[derive(Clone)]
pub struct ChildEnds(Arc<[AtomicI32]>);

impl ChildEnds {
    /// Closes every copy still open: every task is forked.
    pub fn close_all(&self) {
        self.0.iter().for_each(close);
    }

    fn get(&self, task: TaskId) -> Option<&AtomicI32> {
        self.0.get(task)
    }

    fn iter(&self) -> impl Iterator<Item = &AtomicI32> {
        self.0.iter()
    }
}

fn close(slot: &AtomicI32) {
    let fd = slot.swap(-1, SeqCst);
    if fd >= 0 {
        // SAFETY: the node's fd, taken out of the table first so that it is closed once.
        unsafe { libc::close(fd) };
    }
}

/// The progress thread: serves until every task has gone or a stop is taken; signals are for the host's own
/// threads.
fn progress_thread<H: NodeHost>(mut driver: Driver<H>) {
    block_signals();
    let result = match catch_unwind(AssertUnwindSafe(|| driver.run())) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("an internal error".to_string()),
    };
    driver.host_mut().served(result);
    // Dropping the driver closes every task connection.
}

/// Blocks every signal in the calling thread: the host process's signals are for its own threads.
pub fn block_signals() {
    // SAFETY: a full signal set, applied to this thread only.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut set);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

#[cfg(test)]
mod tests;

//! rpmi-run as the plugin's host: the callbacks of `rpmi_host_ops` for one virtual node's instance, the
//! collective (done on the spot for a one-node job, else over the nodes' tree), and ending the job.

use crate::branch::{Act, Branch};
use crate::conn::Blame;
use crate::plugin::{call, Plugin};
use crate::services::{Ended, NodeLink, Service};
use rpmi::abi::ffi::{self, rpmi_buf, rpmi_host_ops, rpmi_instance};
use rpmi::collective::groups::DoneParts;
use rpmi::server::JOB_ERROR_EXIT_CODE;
use std::ffi::{c_int, CString};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Mutex, OnceLock};

/// Why a node's tasks are ended. The first cause decides the node's exit status, unless a task called
/// PMI_Abort: the first abort's code always does.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Cause {
    /// A task called PMI_Abort with this code.
    Abort(i32),
    /// A task failed on its own (exited non-zero, was killed, could not be started), or the job could not
    /// be set up: this is the status.
    Failed(i32),
    /// The plugin ended the job because of rank `rank`: a PMI protocol error, or (`lost`) it left while
    /// others wait for it in a barrier.
    JobError { rank: u32, lost: bool },
    /// A signal passed on to the tasks, or the coordinator's order to end them: their own statuses decide.
    Signal,
    /// This node's machine of the collective found a job error: `node` at fault (`None`: the coordinator),
    /// which (`left`) had said it was done. The tasks rpmi-run then kills did not fail on their own.
    Collective { node: Option<u32>, left: bool },
    /// Another job of the launch (the one that spawned this job, or one it spawned) ended with this status,
    /// said by that job's rpmi-run: this one ends with it too (see `services`).
    Launch(i32),
}

/// How a node's part of the job ends: the first cause, and the first abort.
#[derive(Default, Debug)]
pub struct Fate {
    cause: Option<Cause>,
    abort: Option<i32>,
    /// When the first cause was recorded (`rpmi::os::monotonic_ns`).
    began: Option<u64>,
}

impl Fate {
    /// Records `cause`; returns whether it is news: the first cause, or the first abort. Anything else
    /// follows from the ending (a task rpmi-run killed leaves a barrier, say) and is no new fault.
    pub fn record(&mut self, cause: Cause) -> bool {
        let first = self.cause.is_none();
        if first {
            self.cause = Some(cause);
            self.began = Some(rpmi::os::monotonic_ns());
        }
        match cause {
            Cause::Abort(code) if self.abort.is_none() => {
                self.abort = Some(code);
                true
            }
            _ => first,
        }
    }

    pub fn ending(&self) -> bool {
        self.cause.is_some()
    }

    /// The node's exit status, from each reaped task's rank and code (128+signal if it was killed), in the
    /// order they were reaped: the first abort's code; else what the first cause gives: a failure's code,
    /// or for a job error (the plugin's or the collective's) [`JOB_ERROR_EXIT_CODE`], since the tasks
    /// rpmi-run then kills did not fail on their own (but a lost task that failed gives its own code: the
    /// plugin may see it leave before it is reaped); else, after a signal, the first failing task's code;
    /// else 0.
    pub fn status(&self, exits: &[(u32, i32)]) -> i32 {
        let failed = |rank: Option<u32>| {
            exits.iter().find(|&&(r, code)| code != 0 && rank.is_none_or(|rank| r == rank)).map(|&(_, code)| code)
        };
        match (self.abort, self.cause) {
            (Some(code), _) => code,
            (None, Some(Cause::Failed(code) | Cause::Launch(code))) => code,
            (None, Some(Cause::JobError { rank, lost: true })) => failed(Some(rank)).unwrap_or(JOB_ERROR_EXIT_CODE),
            (None, Some(Cause::JobError { lost: false, .. } | Cause::Collective { .. })) => JOB_ERROR_EXIT_CODE,
            (None, Some(Cause::Signal | Cause::Abort(_)) | None) => failed(None).unwrap_or(0),
        }
    }
}

/// A virtual node's shell as the host of its plugin instance (the ABI's host): the plugin, the instance, its
/// tasks, and how its job ends.
pub struct ShellHost {
    pub plugin: Plugin,
    /// This node's instance (as an address, so the host can be shared between threads); set once created.
    pub instance: OnceLock<usize>,
    /// The way to the other nodes; `None` when this node is the whole job.
    pub branch: Option<Branch>,
    /// The way to the launch's name service and spawn (see `services`).
    pub link: Option<NodeLink>,
    /// Whether the instance still takes answers to its tasks' requests: not once it is being destroyed. A
    /// lock, not an atomic: it is held through `service_complete`, so that `close_services` waits for an
    /// answer in flight before destroy.
    serving: Mutex<bool>,
    fate: Mutex<Fate>,
    /// Process ids of the running tasks.
    pub pids: Mutex<Vec<libc::pid_t>>,
    /// Messages at this level or more urgent are printed (RPMI_LOG_*).
    pub verbosity: i32,
    /// The fd to watch in event-loop mode (set by `watch_fd` during create).
    pub watch: AtomicI32,
}

impl ShellHost {
    pub fn new(plugin: Plugin, branch: Option<Branch>, link: Option<NodeLink>, verbosity: i32) -> ShellHost {
        ShellHost {
            plugin,
            instance: OnceLock::new(),
            branch,
            link,
            serving: Mutex::new(true),
            fate: Mutex::new(Fate::default()),
            pids: Mutex::new(Vec::new()),
            verbosity,
            watch: AtomicI32::new(-1),
        }
    }

    pub fn instance(&self) -> *mut rpmi_instance {
        self.instance.get().copied().unwrap_or(0) as *mut rpmi_instance
    }

    /// The job is ending: no more tasks start, and a task that fails now was killed, not news.
    pub fn ending(&self) -> bool {
        self.fate.lock().map_or(true, |f| f.ending())
    }

    /// Records `cause`; returns whether it is news (see [`Fate::record`]).
    fn record(&self, cause: Cause) -> bool {
        self.fate.lock().is_ok_and(|mut f| f.record(cause))
    }

    /// How this node's part of the job ended, from its reaped tasks (see [`Fate::status`]).
    pub fn ended(&self, exits: &[(u32, i32)]) -> Ended {
        self.fate.lock().map_or(Ended { status: 1, began: None }, |f| Ended { status: f.status(exits), began: f.began })
    }

    /// Ends the job for a cause found on this node: its tasks get SIGKILL, and so, through the
    /// coordinator, do every other node's. `message` says why: if the cause is news it is said (by the
    /// coordinator, which says only what is news for the whole job), else only at debug level.
    pub fn end_job(&self, cause: Cause, message: &str) {
        if self.record(cause) {
            let told = self.branch.as_ref().is_some_and(|branch| self.tell_coordinator(branch, cause, message));
            if !told && !message.is_empty() {
                say!("{message}");
            }
        } else {
            self.debug(message);
        }
        self.signal_all(libc::SIGKILL);
    }

    /// Tells the coordinator that this node ended the job for `cause`, news on this node; it says `message`
    /// (unless empty) if it is news for the whole job too. Returns false if the coordinator is gone.
    fn tell_coordinator(&self, branch: &Branch, cause: Cause, message: &str) -> bool {
        match cause {
            Cause::Abort(code) => branch.send_abort(code, message),
            Cause::Collective { node, left } => {
                let (told, acts) = branch.send_report(&Blame { node, left, message: message.to_string() });
                self.carry_out(acts);
                told
            }
            Cause::Failed(_) | Cause::JobError { .. } | Cause::Signal | Cause::Launch(_) => branch.send_ending(message),
        }
    }

    /// Does what the node's branch of the tree asks, in order.
    pub fn carry_out(&self, acts: Vec<Act>) {
        for act in acts {
            match act {
                Act::Kill(signal) => self.end(signal),
                Act::CompleteGroup(done) => self.complete_group(&done),
                Act::Complete(parts) => self.complete(parts.iter().map(|(_, part)| part)),
                Act::Fail { message, live } => {
                    // A machine fails for good, so the job cannot go on here: the tasks are ended before
                    // their barrier fails, so that none takes the failure for a reason to call PMI_Abort,
                    // whose code would become the job's status.
                    self.end(libc::SIGKILL);
                    self.debug(&message);
                    if live {
                        self.fail_collective(&message);
                    }
                }
                Act::JobError(Blame { node, left, message }) => {
                    self.end_job(Cause::Collective { node, left }, &message)
                }
            }
        }
    }

    /// Another job of the launch ended with `status` (its rpmi-run said why): this one ends too, unless it
    /// is ending already (by a signal passed on, say, which its tasks may be handling).
    pub fn end_by_launch(&self, status: i32) {
        if !self.ending() {
            self.end_job(Cause::Launch(status), "");
        }
    }

    /// Hands the launcher's answer to task `task`'s request to the plugin, unless the instance is being
    /// destroyed (no call may follow or overlap destroy).
    pub fn answer(&self, task: u32, ok: bool, text: &[u8]) {
        let Ok(serving) = self.serving.lock() else { return };
        if !*serving {
            return;
        }
        let text: Vec<u8> = text.iter().copied().filter(|&b| b != 0).collect();
        let text = CString::new(text).unwrap_or_default();
        // Publish and unpublish succeed with no text: NULL, as the header asks.
        let result = if ok && text.is_empty() { std::ptr::null() } else { text.as_ptr() };
        let status = if ok { ffi::RPMI_OK } else { ffi::RPMI_ERR_INVALID };
        call!(self.plugin, service_complete(self.instance(), task, status, result));
    }

    /// No more answers reach the instance: it is about to be destroyed.
    pub fn close_services(&self) {
        if let Ok(mut serving) = self.serving.lock() {
            *serving = false;
        }
    }

    /// Ends this node's part of the job: every task gets `signal`, and no more are started.
    pub fn end(&self, signal: c_int) {
        self.record(Cause::Signal);
        self.signal_all(signal);
    }

    /// Says what follows from the job's ending, with `--trace` only.
    pub fn debug(&self, message: &str) {
        if self.verbosity >= ffi::RPMI_LOG_DEBUG && !message.is_empty() {
            say!("as the job ends: {message}");
        }
    }

    pub fn signal_all(&self, signal: c_int) {
        if let Ok(pids) = self.pids.lock() {
            for &pid in pids.iter() {
                // SAFETY: kill on a pid of our own child; a task already gone makes it fail harmlessly.
                unsafe { libc::kill(pid, signal) };
            }
        }
    }

    /// The host callbacks, with this shell as their host data.
    pub fn ops(&self, event_loop: bool) -> rpmi_host_ops {
        rpmi_host_ops {
            struct_size: std::mem::size_of::<rpmi_host_ops>() as u32,
            abi_version: ffi::RPMI_ABI_VERSION as u32,
            host_data: self as *const ShellHost as *mut _,
            collective: Some(collective),
            abort: Some(abort),
            log: Some(log),
            watch_fd: if event_loop { Some(watch_fd) } else { None },
            publish: self.link.as_ref().map(|_| publish as _),
            unpublish: self.link.as_ref().map(|_| unpublish as _),
            lookup: self.link.as_ref().map(|_| lookup as _),
            spawn: self.link.as_ref().map(|_| spawn as _),
            group_collective: Some(group_collective),
            // rpmi-run's shells run the exchanges among them over their own connections (see `branch`).
            shell_send: None,
            job_done: None,
            name_served: None,
        }
    }

    /// Completes the collective in progress with every node's part, in node order.
    pub fn complete<'a>(&self, parts: impl Iterator<Item = &'a [u8]>) {
        let bufs: Vec<rpmi_buf> = parts.map(|p| rpmi_buf { data: p.as_ptr(), len: p.len() }).collect();
        call!(
            self.plugin,
            collective_complete(self.instance(), ffi::RPMI_OK, bufs.as_ptr(), bufs.len(), std::ptr::null())
        );
    }

    /// Ends a group exchange: every member node's part.
    pub fn complete_group(&self, done: &DoneParts) {
        let id = done.id();
        let bufs: Vec<rpmi_buf> = done.parts().map(|p| rpmi_buf { data: p.as_ptr(), len: p.len() }).collect();
        call!(
            self.plugin,
            group_complete(
                self.instance(),
                id.as_ptr(),
                id.len(),
                ffi::RPMI_OK,
                bufs.as_ptr(),
                bufs.len(),
                std::ptr::null()
            )
        );
    }

    /// Fails the collective in progress: every task waiting in the barrier gets a failure.
    pub fn fail_collective(&self, message: &str) {
        let error = CString::new(message.replace('\0', " ")).unwrap_or_default();
        call!(
            self.plugin,
            collective_complete(self.instance(), ffi::RPMI_ERR_STATE, std::ptr::null(), 0, error.as_ptr())
        );
    }
}

/// # Safety
/// `data` is the host data of an instance: a `ShellHost` that outlives it.
unsafe fn host<'a>(data: *mut std::ffi::c_void) -> &'a ShellHost {
    // SAFETY: the caller's contract: `data` points to a live `ShellHost`.
    unsafe { &*(data as *const ShellHost) }
}

/// # Safety
/// `msg` is NULL or points to `len` readable bytes, as the plugin's messages do.
unsafe fn text<'a>(msg: *const std::ffi::c_char, len: usize) -> std::borrow::Cow<'a, str> {
    if msg.is_null() {
        return "".into();
    }
    // SAFETY: not NULL (checked above); the caller's contract: `len` readable bytes.
    String::from_utf8_lossy(unsafe { std::slice::from_raw_parts(msg.cast::<u8>(), len) })
}

unsafe extern "C" fn collective(
    data: *mut std::ffi::c_void,
    _: *mut rpmi_instance,
    bytes: *const u8,
    len: usize,
) -> c_int {
    // SAFETY: the host data given to this instance: a `ShellHost` that outlives it.
    let host = unsafe { host(data) };
    let contribution = match (len, bytes.is_null()) {
        (0, _) => &[][..],
        (_, true) => return ffi::RPMI_ERR_INVALID,
        // SAFETY: not NULL (checked above): the plugin's `len` bytes, valid during this call.
        _ => unsafe { std::slice::from_raw_parts(bytes, len) },
    };
    match &host.branch {
        // The bytes are the caller's only until we return: the node's machine copies them, and the parts
        // come back later on the event loop.
        Some(branch) => {
            let (rc, acts) = branch.contribute(contribution);
            host.carry_out(acts);
            rc
        }
        // The only node completes at once (allowed from this very thread), its part uncopied: the instance
        // copies parts before collective_complete returns.
        None => {
            host.complete(std::iter::once(contribution));
            ffi::RPMI_OK
        }
    }
}

unsafe extern "C" fn group_collective(
    data: *mut std::ffi::c_void,
    _: *mut rpmi_instance,
    id: *const u8,
    id_len: usize,
    // The coordinator tells the member nodes from the id.
    _shells: *const u32,
    _nshells: usize,
    bytes: *const u8,
    len: usize,
) -> c_int {
    // SAFETY: the host data given to this instance: a `ShellHost` that outlives it.
    let host = unsafe { host(data) };
    if id.is_null() || (bytes.is_null() && len > 0) {
        return ffi::RPMI_ERR_INVALID;
    }
    // SAFETY: not NULL (checked above): the plugin's buffer, valid during this call.
    let id = unsafe { std::slice::from_raw_parts(id, id_len) };
    // SAFETY: as above, when not empty.
    let part = if len == 0 { &[][..] } else { unsafe { std::slice::from_raw_parts(bytes, len) } };
    match &host.branch {
        Some(branch) => branch.group(id, part),
        // A one-node job has no group spanning nodes: the plugin never asks.
        None => ffi::RPMI_ERR_STATE,
    }
}

unsafe extern "C" fn abort(
    data: *mut std::ffi::c_void,
    rank: u32,
    code: i32,
    reason: i32,
    msg: *const std::ffi::c_char,
    len: usize,
) {
    // SAFETY: the host data given to this instance: a `ShellHost` that outlives it.
    let host = unsafe { host(data) };
    // SAFETY: the plugin's message: `len` bytes, valid during this call.
    let message = unsafe { text(msg, len) };
    if reason == ffi::RPMI_ABORT_CALLED {
        let sep = if message.is_empty() { "" } else { ": " };
        host.end_job(Cause::Abort(code), &format!("rank {rank} called PMI_Abort with exit code {code}{sep}{message}"));
    } else {
        let lost = reason != ffi::RPMI_ABORT_PROTOCOL;
        host.end_job(Cause::JobError { rank, lost }, &message);
    }
}

unsafe extern "C" fn log(data: *mut std::ffi::c_void, level: i32, msg: *const std::ffi::c_char, len: usize) {
    // SAFETY: the host data given to this instance: a `ShellHost` that outlives it.
    let host = unsafe { host(data) };
    if level <= ffi::RPMI_LOG_WARN && host.ending() {
        // A barrier that failed as tasks were killed, say: a consequence, not a new fault.
        // SAFETY: the plugin's message: `len` bytes, valid during this call.
        host.debug(&unsafe { text(msg, len) });
    } else if level <= host.verbosity {
        // SAFETY: as above.
        say!("{}", unsafe { text(msg, len) });
    }
}

/// Passes task `task`'s request to the launcher, which answers on the node's link; one that cannot be
/// passed on is answered at once with why (the ABI lets a callback complete its own request).
fn request(host: &ShellHost, task: u32, service: Service, text: &[u8]) -> c_int {
    let Some(link) = &host.link else { return ffi::RPMI_ERR_SYSTEM };
    if let Err(why) = link.request(task, service, text) {
        host.answer(task, false, why.as_bytes());
    }
    ffi::RPMI_OK
}

/// # Safety
/// `s` is a NUL-terminated string, as the plugin passes services and ports.
unsafe fn word<'a>(s: *const std::ffi::c_char) -> &'a [u8] {
    if s.is_null() {
        return b"";
    }
    // SAFETY: the caller's contract.
    unsafe { std::ffi::CStr::from_ptr(s) }.to_bytes()
}

unsafe extern "C" fn publish(
    data: *mut std::ffi::c_void,
    _: *mut rpmi_instance,
    task: u32,
    service: *const std::ffi::c_char,
    port: *const std::ffi::c_char,
) -> c_int {
    // SAFETY: the plugin's NUL-terminated strings, valid during this call; the host data is a `ShellHost` that
    // outlives the instance.
    let text = unsafe { [word(service), b"\0", word(port)].concat() };
    request(unsafe { host(data) }, task, Service::Publish, &text)
}

unsafe extern "C" fn unpublish(
    data: *mut std::ffi::c_void,
    _: *mut rpmi_instance,
    task: u32,
    service: *const std::ffi::c_char,
) -> c_int {
    // SAFETY: the plugin's NUL-terminated string, valid during this call; the host data as in `publish`.
    request(unsafe { host(data) }, task, Service::Unpublish, unsafe { word(service) })
}

unsafe extern "C" fn lookup(
    data: *mut std::ffi::c_void,
    _: *mut rpmi_instance,
    task: u32,
    service: *const std::ffi::c_char,
) -> c_int {
    // SAFETY: the plugin's NUL-terminated string, valid during this call; the host data as in `publish`.
    request(unsafe { host(data) }, task, Service::Lookup, unsafe { word(service) })
}

unsafe extern "C" fn spawn(
    data: *mut std::ffi::c_void,
    _: *mut rpmi_instance,
    task: u32,
    json: *const std::ffi::c_char,
    len: usize,
) -> c_int {
    if json.is_null() {
        return ffi::RPMI_ERR_INVALID;
    }
    // SAFETY: not NULL (checked above): the plugin's `len` bytes, valid during this call; the host data as
    // in `publish`.
    request(unsafe { host(data) }, task, Service::Spawn, unsafe { std::slice::from_raw_parts(json.cast::<u8>(), len) })
}

unsafe extern "C" fn watch_fd(data: *mut std::ffi::c_void, _: *mut rpmi_instance, fd: c_int) -> c_int {
    // SAFETY: the host data given to this instance: a `ShellHost` that outlives it.
    unsafe { host(data) }.watch.store(fd, Ordering::SeqCst);
    ffi::RPMI_OK
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fate(causes: &[Cause]) -> Fate {
        let mut fate = Fate::default();
        for &cause in causes {
            fate.record(cause);
        }
        fate
    }

    #[test]
    fn only_the_first_cause_and_the_first_abort_are_news() {
        let mut fate = Fate::default();
        assert!(!fate.ending());
        assert!(fate.record(Cause::JobError { rank: 1, lost: false }));
        assert!(fate.ending());
        assert!(!fate.record(Cause::JobError { rank: 2, lost: true }));
        assert!(!fate.record(Cause::Failed(137)));
        assert!(fate.record(Cause::Abort(7)), "an abort decides the status: news even while ending");
        assert!(!fate.record(Cause::Abort(9)));
        assert!(!fate.record(Cause::Signal));
    }

    #[test]
    fn tasks_killed_after_a_job_error_did_not_fail_on_their_own() {
        let killed = [(0, 137), (2, 137)];
        let protocol = Cause::JobError { rank: 1, lost: false };
        assert_eq!(fate(&[protocol]).status(&[(1, 137), (0, 137)]), JOB_ERROR_EXIT_CODE);
        let lost = Cause::JobError { rank: 1, lost: true };
        assert_eq!(fate(&[lost]).status(&[killed[0], (1, 0), killed[1]]), JOB_ERROR_EXIT_CODE);
        // The lost task failed on its own: the plugin saw it leave before it was reaped.
        assert_eq!(fate(&[lost]).status(&[killed[0], (1, 3), killed[1]]), 3);
        assert_eq!(fate(&[lost, Cause::Failed(3)]).status(&[killed[0], (1, 3)]), 3);
    }

    #[test]
    fn an_abort_wins_then_the_first_cause_decides() {
        let lost = Cause::JobError { rank: 1, lost: true };
        assert_eq!(fate(&[lost, Cause::Abort(-3)]).status(&[(1, 0), (0, 137)]), -3);
        assert_eq!(fate(&[Cause::Failed(4), lost]).status(&[(0, 4), (1, 137)]), 4);
        assert_eq!(fate(&[Cause::Failed(127)]).status(&[(0, 137)]), 127);
        // Ended by a signal passed on (or the coordinator's order): the tasks' own statuses.
        assert_eq!(fate(&[Cause::Signal, lost]).status(&[(0, 0), (1, 143), (2, 137)]), 143);
        assert_eq!(fate(&[]).status(&[(0, 0), (1, 0)]), 0);
    }
}

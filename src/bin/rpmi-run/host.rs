//! rpmi-run as the plugin's host: the callbacks of `rpmi_host_ops` for one virtual node's instance, the
//! collective (done on the spot for a one-node job, else through the coordinator), and ending the job.

use crate::link::{Ending, Link};
use crate::plugin::{call, Plugin};
use rpmi::abi::ffi::{self, rpmi_buf, rpmi_host_ops, rpmi_instance};
use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Mutex, OnceLock};

/// What one virtual node's shell holds: the plugin, its instance, its tasks, and how its job ends.
pub struct Shell {
    pub plugin: Plugin,
    /// This node's instance (as an address, so the shell can be shared between threads); set once created.
    pub instance: OnceLock<usize>,
    /// The way to the other nodes; `None` when this node is the whole job.
    pub link: Option<Link>,
    /// The job is ending: no more tasks start, every task is killed.
    pub ending: AtomicBool,
    /// The exit code a PMI_Abort asked for.
    pub abort_code: Mutex<Option<i32>>,
    /// The exit code of the first other reason the plugin ended the job for (a protocol error, a lost task),
    /// used when no task failed on its own.
    pub error_code: Mutex<Option<i32>>,
    /// Process ids of the running tasks.
    pub pids: Mutex<Vec<libc::pid_t>>,
    /// Messages at this level or more urgent are printed (RPMI_LOG_*).
    pub verbosity: i32,
    /// The fd to watch in event-loop mode (set by `watch_fd` during create).
    pub watch: AtomicI32,
}

impl Shell {
    pub fn new(plugin: Plugin, link: Option<Link>, verbosity: i32) -> Shell {
        Shell {
            plugin,
            instance: OnceLock::new(),
            link,
            ending: AtomicBool::new(false),
            abort_code: Mutex::new(None),
            error_code: Mutex::new(None),
            pids: Mutex::new(Vec::new()),
            verbosity,
            watch: AtomicI32::new(-1),
        }
    }

    pub fn instance(&self) -> *mut rpmi_instance {
        self.instance.get().copied().unwrap_or(0) as *mut rpmi_instance
    }

    /// Ends the job for a reason found on this node: its tasks get SIGKILL, and so, through the coordinator,
    /// do every other node's. The link decides which reasons the coordinator hears.
    pub fn end_job(&self, why: Ending, code: i32) {
        self.end_job_saying(why, code, "");
    }

    /// `end_job`, saying why: here on one node, else through the coordinator, which says what several nodes
    /// give alike only once.
    pub fn end_job_saying(&self, why: Ending, code: i32, message: &str) {
        self.ending.store(true, Ordering::SeqCst);
        let told = self.link.as_ref().is_some_and(|link| link.send_ending(why, code, message));
        if !told && !message.is_empty() {
            say!("{message}");
        }
        self.signal_all(libc::SIGKILL);
    }

    /// Ends this node's part of the job: every task gets `signal`, and no more are started.
    pub fn end(&self, signal: c_int) {
        self.ending.store(true, Ordering::SeqCst);
        self.signal_all(signal);
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
            host_data: self as *const Shell as *mut _,
            collective: Some(collective),
            abort: Some(abort),
            log: Some(log),
            watch_fd: if event_loop { Some(watch_fd) } else { None },
            publish: None,
            unpublish: None,
            lookup: None,
            spawn: None,
        }
    }

    /// Completes the collective in progress with every node's part, in node order.
    pub fn complete(&self, parts: &[&[u8]]) {
        let bufs: Vec<rpmi_buf> = parts.iter().map(|p| rpmi_buf { data: p.as_ptr(), len: p.len() }).collect();
        call!(
            self.plugin,
            collective_complete(self.instance(), ffi::RPMI_OK, bufs.as_ptr(), bufs.len(), std::ptr::null())
        );
    }
}

/// # Safety
/// `data` is the host data of an instance: a `Shell` that outlives it.
unsafe fn shell<'a>(data: *mut std::ffi::c_void) -> &'a Shell {
    &*(data as *const Shell)
}

/// # Safety
/// `msg` is NULL or points to `len` readable bytes, as the plugin's messages do.
unsafe fn text<'a>(msg: *const std::ffi::c_char, len: usize) -> std::borrow::Cow<'a, str> {
    if msg.is_null() {
        return "".into();
    }
    String::from_utf8_lossy(std::slice::from_raw_parts(msg.cast::<u8>(), len))
}

unsafe extern "C" fn collective(
    data: *mut std::ffi::c_void,
    _: *mut rpmi_instance,
    bytes: *const u8,
    len: usize,
) -> c_int {
    let shell = shell(data);
    let contribution = match (len, bytes.is_null()) {
        (0, _) => &[][..],
        (_, true) => return ffi::RPMI_ERR_INVALID,
        _ => std::slice::from_raw_parts(bytes, len),
    };
    match &shell.link {
        // The bytes are the caller's only until we return: the link copies them into the socket, and the
        // parts come back later on the link's own thread.
        Some(link) => match link.send_part(contribution) {
            Ok(()) => ffi::RPMI_OK,
            Err(_) => ffi::RPMI_ERR_INTERNAL,
        },
        // The only node completes at once (allowed from this very thread), its part uncopied: the instance
        // copies parts before collective_complete returns.
        None => {
            shell.complete(&[contribution]);
            ffi::RPMI_OK
        }
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
    let shell = shell(data);
    let message = text(msg, len);
    let called = reason == ffi::RPMI_ABORT_CALLED;
    let first = if called { &shell.abort_code } else { &shell.error_code };
    if let Ok(mut c) = first.lock() {
        c.get_or_insert(code);
    }
    if called {
        let sep = if message.is_empty() { "" } else { ": " };
        say!("rank {rank} called PMI_Abort with exit code {code}{sep}{message}");
    } else {
        say!("{message}");
    }
    shell.end_job(if called { Ending::Abort } else { Ending::Error }, code);
}

unsafe extern "C" fn log(data: *mut std::ffi::c_void, level: i32, msg: *const std::ffi::c_char, len: usize) {
    if level <= shell(data).verbosity {
        say!("{}", text(msg, len));
    }
}

unsafe extern "C" fn watch_fd(data: *mut std::ffi::c_void, _: *mut rpmi_instance, fd: c_int) -> c_int {
    shell(data).watch.store(fd, Ordering::SeqCst);
    ffi::RPMI_OK
}

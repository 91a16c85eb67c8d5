//! rpmi-run as the plugin's host: the callbacks of `rpmi_host_ops` for each virtual node, the in-process
//! collective across them, and ending the job.

use crate::plugin::{call, Plugin};
use rpmi::abi::ffi::{self, rpmi_buf, rpmi_host_ops, rpmi_instance};
use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Mutex, OnceLock};

/// What the whole job shares: the plugin, every node's instance, the collective in progress, the tasks.
pub struct Job {
    pub plugin: Plugin,
    /// Each virtual node's instance (as an address, so the job can be shared between threads).
    pub instances: OnceLock<Vec<usize>>,
    /// This epoch's contributions, by node; the collective completes when every node has given one.
    exchange: Mutex<Vec<Option<Vec<u8>>>>,
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
}

/// The host data of one virtual node's instance.
pub struct Node {
    pub job: &'static Job,
    pub index: usize,
    /// The fd to watch in event-loop mode (set by `watch_fd` during create).
    pub watch: AtomicI32,
}

impl Job {
    pub fn new(plugin: Plugin, nodes: usize, verbosity: i32) -> Job {
        Job {
            plugin,
            instances: OnceLock::new(),
            exchange: Mutex::new(vec![None; nodes]),
            ending: AtomicBool::new(false),
            abort_code: Mutex::new(None),
            error_code: Mutex::new(None),
            pids: Mutex::new(Vec::new()),
            verbosity,
        }
    }

    /// Ends the job: every task gets `signal`, and no more are started.
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

    /// The host callbacks for `node`.
    pub fn ops(node: &Node, event_loop: bool) -> rpmi_host_ops {
        rpmi_host_ops {
            struct_size: std::mem::size_of::<rpmi_host_ops>() as u32,
            abi_version: ffi::RPMI_ABI_VERSION as u32,
            host_data: node as *const Node as *mut _,
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
}

/// # Safety
/// `data` is the host data of an instance: a `Node` that outlives it.
unsafe fn node<'a>(data: *mut std::ffi::c_void) -> &'a Node {
    &*(data as *const Node)
}

unsafe extern "C" fn collective(
    data: *mut std::ffi::c_void,
    _: *mut rpmi_instance,
    bytes: *const u8,
    len: usize,
) -> c_int {
    let node = node(data);
    let job = node.job;
    let contribution = if len == 0 { &[][..] } else { std::slice::from_raw_parts(bytes, len) };
    let others = {
        let Ok(mut exchange) = job.exchange.lock() else { return ffi::RPMI_ERR_INTERNAL };
        if exchange.iter().enumerate().any(|(n, part)| n != node.index && part.is_none()) {
            // The bytes are the caller's only until we return.
            exchange[node.index] = Some(contribution.to_vec());
            return ffi::RPMI_OK;
        }
        exchange.iter_mut().filter_map(Option::take).collect::<Vec<_>>()
    };
    // The last node in completes the collective for every node (allowed from any thread, even this one). Its
    // own part is passed as it came, uncopied: each instance copies the parts before collective_complete
    // returns, and with one node that saves a copy of everything put since the last barrier.
    let parts: Vec<rpmi_buf> = others
        .iter()
        .map(Vec::as_slice)
        .chain([contribution])
        .map(|p| rpmi_buf { data: p.as_ptr(), len: p.len() })
        .collect();
    for &inst in job.instances.get().map(Vec::as_slice).unwrap_or(&[]) {
        call!(
            job.plugin,
            collective_complete(
                inst as *mut rpmi_instance,
                ffi::RPMI_OK,
                parts.as_ptr(),
                parts.len(),
                std::ptr::null()
            )
        );
    }
    ffi::RPMI_OK
}

unsafe extern "C" fn abort(
    data: *mut std::ffi::c_void,
    rank: u32,
    code: i32,
    reason: i32,
    msg: *const std::ffi::c_char,
    len: usize,
) {
    let job = node(data).job;
    let message = String::from_utf8_lossy(std::slice::from_raw_parts(msg.cast::<u8>(), len));
    let first = if reason == ffi::RPMI_ABORT_CALLED { &job.abort_code } else { &job.error_code };
    if let Ok(mut c) = first.lock() {
        c.get_or_insert(code);
    }
    if reason == ffi::RPMI_ABORT_CALLED {
        let sep = if message.is_empty() { "" } else { ": " };
        eprintln!("rpmi-run: rank {rank} called PMI_Abort with exit code {code}{sep}{message}");
    } else {
        eprintln!("rpmi-run: {message}");
    }
    job.end(libc::SIGKILL);
}

unsafe extern "C" fn log(data: *mut std::ffi::c_void, level: i32, msg: *const std::ffi::c_char, len: usize) {
    if level <= node(data).job.verbosity {
        let message = String::from_utf8_lossy(std::slice::from_raw_parts(msg.cast::<u8>(), len));
        eprintln!("rpmi-run: {message}");
    }
}

unsafe extern "C" fn watch_fd(data: *mut std::ffi::c_void, _: *mut rpmi_instance, fd: c_int) -> c_int {
    node(data).watch.store(fd, Ordering::SeqCst);
    ffi::RPMI_OK
}

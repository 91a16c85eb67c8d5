//! The threads rpmi-run runs beside its tasks: rank labels on output (`-l`), signal forwarding, and the
//! event loop that drives the plugin in `--event-loop` mode.

use crate::host::ShellHost;
use crate::plugin::call;
use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};
use std::process::{ChildStderr, ChildStdout};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// The most of a line without its newline that `-l` holds per pipe: once it has this much, it passes it
/// on, labelled and ended by a newline, and labels the rest of the line as a new one.
const LINE_HELD_MAX: usize = 64 * 1024;

/// Prefixes every line a task writes with `[rank] `, one thread for all tasks (poll over their pipes).
pub struct Labeler {
    /// (pipe, rank, to stderr?, the start of a line not yet ended)
    pipes: Vec<(OwnedFd, u32, bool, Vec<u8>)>,
}

impl Labeler {
    pub fn new() -> Labeler {
        Labeler { pipes: Vec::new() }
    }

    pub fn add(&mut self, rank: u32, out: Option<ChildStdout>, err: Option<ChildStderr>) {
        if let Some(o) = out {
            self.pipes.push((o.into(), rank, false, Vec::new()));
        }
        if let Some(e) = err {
            self.pipes.push((e.into(), rank, true, Vec::new()));
        }
    }

    /// Copies until every task has closed its output.
    pub fn start(mut self) -> JoinHandle<()> {
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 64 * 1024];
            while !self.pipes.is_empty() {
                let mut fds: Vec<libc::pollfd> = self
                    .pipes
                    .iter()
                    .map(|p| libc::pollfd { fd: p.0.as_raw_fd(), events: libc::POLLIN, revents: 0 })
                    .collect();
                // SAFETY: poll over our own array.
                if unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) } < 0 {
                    continue;
                }
                let mut closed = Vec::new();
                for (i, fd) in fds.iter().enumerate() {
                    if fd.revents == 0 {
                        continue;
                    }
                    // SAFETY: reading into our own buffer.
                    let n = unsafe { libc::read(fd.fd, buf.as_mut_ptr().cast(), buf.len()) };
                    let (_, rank, to_err, pending) = &mut self.pipes[i];
                    if n <= 0 {
                        if !pending.is_empty() {
                            pending.push(b'\n');
                            emit(*rank, *to_err, pending);
                        }
                        closed.push(i);
                        continue;
                    }
                    pending.extend_from_slice(&buf[..n as usize]);
                    if let Some(last) = pending.iter().rposition(|&b| b == b'\n') {
                        let rest = pending.split_off(last + 1);
                        emit(*rank, *to_err, pending);
                        *pending = rest;
                    }
                    // A task that never ends its line must not make rpmi-run hold all it writes.
                    if pending.len() >= LINE_HELD_MAX {
                        pending.push(b'\n');
                        emit(*rank, *to_err, pending);
                    }
                }
                for i in closed.into_iter().rev() {
                    self.pipes.swap_remove(i);
                }
            }
        })
    }
}

/// Writes whole lines, each with its rank, in one write so lines of different ranks do not mix.
fn emit(rank: u32, to_err: bool, lines: &mut Vec<u8>) {
    let mut labelled = Vec::with_capacity(lines.len() + 16);
    for line in lines.split_inclusive(|&b| b == b'\n') {
        labelled.extend_from_slice(format!("[{rank}] ").as_bytes());
        labelled.extend_from_slice(line);
    }
    let _ = if to_err { std::io::stderr().write_all(&labelled) } else { std::io::stdout().write_all(&labelled) };
    lines.clear();
}

/// Passes `signal` on to each process of `pids` (the rpmi-runs of spawned jobs, which pass it to their
/// tasks).
pub fn signal_each(pids: &Mutex<Vec<libc::pid_t>>, signal: i32) {
    if let Ok(pids) = pids.lock() {
        for &pid in pids.iter() {
            // SAFETY: kill on our own child; one already gone makes it fail harmlessly.
            unsafe { libc::kill(pid, signal) };
        }
    }
}

/// SIGINT and SIGTERM, which rpmi-run takes on a thread of its own and passes to every task.
fn forwarded() -> libc::sigset_t {
    // SAFETY: building a signal set in a local.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        set
    }
}

/// Blocks the forwarded signals in this thread, and so in every thread started after it (the plugin's
/// progress threads among them): call it before any other thread exists, so only `forward_signals` takes them.
pub fn block_signals() {
    let set = forwarded();
    // SAFETY: changing this thread's own mask.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
}

/// Starts the thread that takes the blocked signals and passes each to `pass_on`.
pub fn forward_signals(pass_on: impl Fn(i32) + Send + 'static) -> JoinHandle<()> {
    let set = forwarded();
    std::thread::spawn(move || loop {
        let mut sig = 0;
        // SAFETY: sigwait on a set of blocked signals.
        if unsafe { libc::sigwait(&set, &mut sig) } == 0 {
            pass_on(sig);
        }
    })
}

/// In a task, between fork and exec: give it back the signals rpmi-run blocked. Async-signal-safe.
pub fn unblock_signals() {
    let set = forwarded();
    // SAFETY: sigprocmask is async-signal-safe.
    unsafe { libc::sigprocmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut()) };
}

/// The event loop that drives the instance in `--event-loop` mode, and always on a virtual node with a branch
/// of the tree: polls the instance's watched fd, calling `progress`, and the branch's connections.
pub struct EventLoop {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

impl EventLoop {
    pub fn stop(self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.thread.join();
    }
}

pub fn spawn_event_loop(host: &'static ShellHost) -> EventLoop {
    let stop = Arc::new(AtomicBool::new(false));
    let stopping = stop.clone();
    let thread = std::thread::spawn(move || {
        let watched = libc::pollfd { fd: host.watch.load(Ordering::SeqCst), events: libc::POLLIN, revents: 0 };
        let mut fds = Vec::new();
        while !stopping.load(Ordering::SeqCst) {
            fds.clear();
            fds.push(watched);
            if let Some(branch) = &host.branch {
                branch.watch(&mut fds);
            }
            // A short timeout so that a stop is seen promptly.
            // SAFETY: poll over our own array.
            if unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 100) } <= 0 {
                continue;
            }
            if let Some(branch) = &host.branch {
                host.carry_out(branch.ready(&fds[1..]));
            }
            if fds[0].revents != 0 {
                call!(host.plugin, progress(host.instance()));
            }
        }
    });
    EventLoop { stop, thread }
}

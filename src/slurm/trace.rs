//! The wire trace a user turns on with `PMI_DEBUG` (every PMI line each way, per rank), written to the
//! job's own stderr by a thread of its own.
//!
//! slurmstepd runs as root and its log is the site's: a user's variable must not make it log every PMI line
//! there. From the moment its tasks start, slurmstepd's own stderr is the job's stderr (Slurm connects it to
//! the first task's stderr stream so that its error messages reach srun), so that is where the trace goes,
//! as the user's own output. Lines are escaped (nothing a task writes can forge a line or a terminal
//! sequence) and cut to [`LINE_MAX`] bytes; at most [`RATE`] bytes a second are written and at most
//! [`QUEUE_MAX`] bytes wait, so a chatty job cannot slow its own PMI service: what does not fit is dropped and
//! counted, and the count is said.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The longest trace line written, escapes included.
pub const LINE_MAX: usize = 1200;
/// Bytes written per second, at most (with a burst of as much again).
pub const RATE: usize = 1 << 20;
/// Bytes waiting to be written, at most.
pub const QUEUE_MAX: usize = 256 << 10;
/// How long a write may wait for the fd, and what is left queued at the stop may take.
const STOP_GRACE: Duration = Duration::from_secs(1);

#[derive(Default)]
struct Queue {
    lines: VecDeque<Vec<u8>>,
    bytes: usize,
    dropped: u64,
    stop: bool,
}

/// The trace's queue and writer thread.
pub struct Trace {
    shared: Arc<(Mutex<Queue>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl Trace {
    /// Starts the writer, writing to `fd` (the process's stderr in slurmstepd).
    pub fn start(fd: i32) -> io::Result<Trace> {
        let shared = Arc::new((Mutex::new(Queue::default()), Condvar::new()));
        let theirs = shared.clone();
        let thread = std::thread::Builder::new().name("rpmi-trace".into()).spawn(move || {
            crate::runtime::block_signals();
            write_loop(&theirs, fd);
        })?;
        Ok(Trace { shared, thread: Some(thread) })
    }

    /// Queues one line (without its newline), escaped and cut; dropped if the queue is full.
    pub fn line(&self, text: &str) {
        let line = escape(text.as_bytes(), LINE_MAX);
        let (lock, wake) = &*self.shared;
        let mut q = lock.lock().unwrap_or_else(|e| e.into_inner());
        if q.bytes + line.len() > QUEUE_MAX {
            q.dropped += 1;
            return;
        }
        q.bytes += line.len();
        q.lines.push_back(line);
        wake.notify_one();
    }

    fn shutdown(&mut self) {
        let (lock, wake) = &*self.shared;
        lock.lock().unwrap_or_else(|e| e.into_inner()).stop = true;
        wake.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Dropping the trace writes what is queued (as far as the rate allows, for a second at most) and stops the
/// writer.
impl Drop for Trace {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn write_loop(shared: &(Mutex<Queue>, Condvar), fd: i32) {
    let (lock, wake) = shared;
    // Opened at the first write, when the fd is the job's stderr (it is not yet at start).
    let mut out: Option<Sink> = None;
    // A token bucket: `budget` bytes may be written now; it refills at RATE, up to RATE.
    let mut budget = RATE as f64;
    let mut refilled = Instant::now();
    let mut stopping_since: Option<Instant> = None;
    loop {
        let (line, dropped) = {
            let mut q = lock.lock().unwrap_or_else(|e| e.into_inner());
            while q.lines.is_empty() && q.dropped == 0 && !q.stop {
                q = wake.wait(q).unwrap_or_else(|e| e.into_inner());
            }
            if q.stop && stopping_since.is_none() {
                stopping_since = Some(Instant::now());
            }
            let line = q.lines.pop_front();
            if let Some(l) = &line {
                q.bytes -= l.len();
            }
            (line, std::mem::take(&mut q.dropped))
        };
        if dropped > 0 {
            let note =
                format!("rpmi: {dropped} PMI trace lines dropped (the trace is limited to {RATE} bytes a second)\n");
            write_all(out.get_or_insert_with(|| Sink::of(fd)).fd(), note.as_bytes());
        }
        let Some(line) = line else { return };
        // Once stopped, what is queued gets a second at most.
        if stopping_since.is_some_and(|t| t.elapsed() > STOP_GRACE) {
            return;
        }
        let now = Instant::now();
        budget = (budget + now.duration_since(refilled).as_secs_f64() * RATE as f64).min(RATE as f64);
        refilled = now;
        if budget < line.len() as f64 {
            std::thread::sleep(Duration::from_secs_f64((line.len() as f64 - budget) / RATE as f64));
            budget = line.len() as f64;
        }
        budget -= line.len() as f64;
        write_all(out.get_or_insert_with(|| Sink::of(fd)).fd(), &line);
    }
}

/// Where the trace is written: for a pipe (the job's stderr stream), a non-blocking handle of its own,
/// opened anew through /proc so that the flag does not change the pipe as Slurm and the tasks use it; a
/// write then never blocks, even if a task fills the pipe between a poll and the write. Anything else
/// (a file) as it is.
enum Sink {
    Pipe(OwnedFd),
    Other(i32),
}

impl Sink {
    fn of(fd: i32) -> Sink {
        // SAFETY: an all-zero stat is a valid buffer for fstat to fill.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstat into our buffer.
        let is_pipe = unsafe { libc::fstat(fd, &mut st) } == 0 && st.st_mode & libc::S_IFMT == libc::S_IFIFO;
        let path = format!("/proc/self/fd/{fd}\0");
        if is_pipe {
            // SAFETY: a NUL-terminated path; the fd, if any, is fresh and ours.
            let own = unsafe { libc::open(path.as_ptr().cast(), libc::O_WRONLY | libc::O_NONBLOCK | libc::O_CLOEXEC) };
            if own >= 0 {
                // SAFETY: fresh and ours.
                return Sink::Pipe(unsafe { OwnedFd::from_raw_fd(own) });
            }
        }
        Sink::Other(fd)
    }

    fn fd(&self) -> i32 {
        match self {
            Sink::Pipe(own) => own.as_raw_fd(),
            Sink::Other(fd) => *fd,
        }
    }
}

/// Writes `bytes`, waiting at most a second at a time for the fd to take them: a job whose stderr is not
/// read loses trace lines, never its PMI service.
fn write_all(fd: i32, mut bytes: &[u8]) {
    while !bytes.is_empty() {
        let mut p = libc::pollfd { fd, events: libc::POLLOUT, revents: 0 };
        // SAFETY: one live pollfd.
        if unsafe { libc::poll(&mut p, 1, STOP_GRACE.as_millis() as i32) } <= 0 || p.revents & libc::POLLOUT == 0 {
            return;
        }
        // At most PIPE_BUF bytes: a pipe reported writable takes that many without blocking.
        let n = bytes.len().min(libc::PIPE_BUF);
        // SAFETY: writing from a live buffer, its length passed.
        let written = unsafe { libc::write(fd, bytes.as_ptr().cast(), n) };
        if written <= 0 {
            match io::Error::last_os_error().kind() {
                io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock if written < 0 => continue,
                _ => return,
            }
        }
        bytes = &bytes[written as usize..];
    }
}

/// `bytes` made safe for a log or a terminal: printable ASCII and spaces as they are, everything else
/// escaped (`\n`, `\x1b`, ...), cut to about `max` bytes with how long it was; ends with a newline.
pub fn escape(bytes: &[u8], max: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len().min(max) + 32);
    for &b in bytes {
        if out.len() >= max {
            out.extend_from_slice(format!("... ({} bytes)", bytes.len()).as_bytes());
            break;
        }
        if b == b' ' || b.is_ascii_graphic() && b != b'\\' {
            out.push(b);
        } else {
            out.extend(std::ascii::escape_default(b));
        }
    }
    out.push(b'\n');
    out
}

/// [`escape`] for a message that goes into a daemon's log: without the newline.
pub fn escape_text(text: &str, max: usize) -> String {
    let mut e = escape(text.as_bytes(), max);
    e.pop();
    String::from_utf8_lossy(&e).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn lines_are_escaped_and_cut() {
        assert_eq!(escape(b"cmd=put key=a value=b", 100), b"cmd=put key=a value=b\n");
        assert_eq!(escape(b"a\nfake line\x1b[2J\\", 100), b"a\\nfake line\\x1b[2J\\\\\n".to_vec());
        let long = escape(&[b'x'; 5000], 100);
        assert!(long.len() < 130, "{}", long.len());
        assert!(String::from_utf8(long).unwrap().ends_with("... (5000 bytes)\n"));
        assert_eq!(escape_text("rank 1: \u{1b}]0;pwned\u{7}", 100), "rank 1: \\x1b]0;pwned\\x07");
    }

    fn pipe() -> (OwnedFd, OwnedFd) {
        let mut fds = [0; 2];
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
    }

    #[test]
    fn a_flood_is_bounded_and_said() {
        let (r, w) = pipe();
        let trace = Trace::start(w.as_raw_fd()).unwrap();
        let reader = std::thread::spawn(move || {
            let mut all = Vec::new();
            std::fs::File::from(r).read_to_end(&mut all).unwrap();
            all
        });
        // Far more than the queue holds, faster than it is written.
        for i in 0..200_000 {
            trace.line(&format!("rank {i} C: cmd=get kvsname=k key=k{i}"));
        }
        drop(trace);
        drop(w);
        let all = String::from_utf8(reader.join().unwrap()).unwrap();
        assert!(all.contains("PMI trace lines dropped"), "no note of the dropped lines");
        assert!(all.lines().filter(|l| l.starts_with("rank ")).count() < 200_000);
        let first = all.lines().find(|l| l.starts_with("rank ")).unwrap();
        assert_eq!(first, "rank 0 C: cmd=get kvsname=k key=k0", "the queue keeps the first lines, not the last");
    }

    #[test]
    fn an_unread_stderr_does_not_hold_the_trace() {
        let (_r, w) = pipe();
        let trace = Trace::start(w.as_raw_fd()).unwrap();
        for i in 0..100_000 {
            trace.line(&format!("rank {i} S: cmd=get_result rc=0 value={}", "v".repeat(100)));
        }
        // Nobody reads the pipe: stop still returns (each write waits at most a second).
        drop(trace);
    }
}

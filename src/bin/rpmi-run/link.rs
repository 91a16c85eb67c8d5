//! Virtual nodes as processes of their own. With `--nodes M` above 1, rpmi-run forks one shell process per
//! node, each the leader of a session of its own (as a real node's job shell is, e.g. Slurm's slurmstepd),
//! so the kernel schedules each node's shell and its tasks as one group. rpmi-run itself stays as the
//! coordinator: it relays each collective's parts between the shells over a socketpair per node, as a host
//! would between machines, and passes on why and when the job ends.
//!
//! On the socket, a frame is a kind byte, a little-endian u64 length, and that many bytes.

use crate::host::Shell;
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Mutex;

/// A node's part of a collective: from a shell, and back to every shell, once per node, in node order.
const PART: u8 = 1;
/// Shell to coordinator: this node ended the job (an `Ending` byte, the exit code as i32, then what to say
/// about it, if anything, in UTF-8).
const ENDING: u8 = 2;
/// Coordinator to shell: end your tasks with this signal (an i32).
const KILL: u8 = 3;

/// Why a node ended the job; the coordinator's exit status prefers them in this order, as rpmi-run's
/// status does within one node.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Ending {
    /// A task called PMI_Abort.
    Abort = 0,
    /// A task failed: exited non-zero, was killed, or could not be started.
    Failure = 1,
    /// The plugin ended the job (a protocol error, a lost task) or could not set a task up.
    Error = 2,
}

fn write_frame(to: &mut &UnixStream, kind: u8, payload: &[u8]) -> io::Result<()> {
    let mut head = [0u8; 9];
    head[0] = kind;
    head[1..].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    to.write_all(&head)?;
    to.write_all(payload)
}

/// The next frame, or `None` at the end of the stream.
fn read_frame(from: &mut &UnixStream) -> io::Result<Option<(u8, Vec<u8>)>> {
    let mut head = [0u8; 9];
    match from.read_exact(&mut head) {
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        other => other?,
    }
    let len = u64::from_le_bytes(head[1..].try_into().unwrap_or_default());
    let len = usize::try_from(len).map_err(|_| io::Error::other("a frame too long for this machine"))?;
    let mut payload = Vec::new();
    payload.try_reserve_exact(len).map_err(|_| io::Error::other(format!("no memory for a frame of {len} bytes")))?;
    payload.resize(len, 0);
    from.read_exact(&mut payload)?;
    Ok(Some((head[0], payload)))
}

fn i32_at(payload: &[u8], at: usize) -> Option<i32> {
    Some(i32::from_le_bytes(payload.get(at..at + 4)?.try_into().ok()?))
}

/// An ENDING frame's why, exit code and message (see `Link::send_ending`).
fn ending(payload: &[u8]) -> (Ending, i32, &[u8]) {
    let why = match payload.first() {
        Some(0) => Ending::Abort,
        Some(1) => Ending::Failure,
        _ => Ending::Error,
    };
    (why, i32_at(payload, 1).unwrap_or(1), payload.get(5..).unwrap_or_default())
}

// ---------------------------------------------------------------------------------------------------------
// The shell's side.

/// A shell's connection to the coordinator. The shell's event loop hears it (`hear`), so that a
/// collective's parts are freed before the instance, at its next `progress`, merges its copy of them.
pub struct Link {
    stream: UnixStream,
    /// Held while writing a frame: the loop sends parts, other threads send endings.
    writing: Mutex<()>,
    nodes: usize,
    /// The parts of the collective in progress heard so far.
    parts: Mutex<Vec<Vec<u8>>>,
    /// Set when the shell stops hearing the link itself, so that its end is not taken for a lost coordinator.
    closing: AtomicBool,
    /// The endings told so far: the first of the node, and an abort after it (see `send_ending`).
    told: Mutex<Vec<Ending>>,
}

impl Link {
    fn new(stream: UnixStream, nodes: usize) -> Link {
        Link {
            stream,
            writing: Mutex::new(()),
            nodes,
            parts: Mutex::new(Vec::with_capacity(nodes)),
            closing: AtomicBool::new(false),
            told: Mutex::new(Vec::new()),
        }
    }

    fn send(&self, kind: u8, payload: &[u8]) -> io::Result<()> {
        let _writing = self.writing.lock().map_err(|_| io::Error::other("the link's lock is poisoned"))?;
        write_frame(&mut &self.stream, kind, payload)
    }

    pub fn send_part(&self, part: &[u8]) -> io::Result<()> {
        self.send(PART, part)
    }

    /// Tells the coordinator that this node ended the job. Only the node's first ending is told, and the
    /// first abort after it: the job's status prefers an abort, and an abort line a task wrote before it
    /// was killed may be served after the job began ending (for another reason, or another node's).
    /// The coordinator says `message` (unless empty), once for all nodes that give the same. Returns whether
    /// the ending was told: if not, the shell says the message itself.
    pub fn send_ending(&self, why: Ending, code: i32, message: &str) -> bool {
        let Ok(mut told) = self.told.lock() else { return false };
        if !told.is_empty() && (why != Ending::Abort || told.contains(&Ending::Abort)) {
            return false;
        }
        told.push(why);
        let mut payload = vec![why as u8];
        payload.extend_from_slice(&code.to_le_bytes());
        payload.extend_from_slice(message.as_bytes());
        // If the coordinator is gone, the loop hears that and ends this node's tasks anyway.
        self.send(ENDING, &payload).is_ok()
    }

    /// The fd the event loop polls.
    pub fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// Takes one frame from the coordinator: a part (the last completes the collective on this node), or
    /// the order to end the tasks. Returns false once the link has ended; a lost coordinator ends the tasks.
    pub fn hear(&self, shell: &Shell) -> bool {
        match read_frame(&mut &self.stream) {
            Ok(Some((PART, part))) => {
                let Ok(mut parts) = self.parts.lock() else { return true };
                parts.push(part);
                if parts.len() == self.nodes {
                    shell.complete(&parts.iter().map(Vec::as_slice).collect::<Vec<_>>());
                    parts.clear();
                }
                true
            }
            Ok(Some((KILL, payload))) => {
                shell.end(i32_at(&payload, 0).unwrap_or(libc::SIGKILL));
                true
            }
            Ok(Some(_)) => true,
            Ok(None) | Err(_) => {
                if !self.closing.load(Ordering::SeqCst) {
                    say!("a virtual node lost rpmi-run's coordinator; ending its tasks");
                    shell.end(libc::SIGKILL);
                }
                false
            }
        }
    }

    /// Stops hearing the coordinator: after it, no collective completes on this node. Endings can still be
    /// told (what the tasks wrote last is served after this); the link closes when the shell exits.
    pub fn stop_hearing(&self) {
        self.closing.store(true, Ordering::SeqCst);
        let _ = self.stream.shutdown(Shutdown::Read);
    }
}

// ---------------------------------------------------------------------------------------------------------
// The coordinator's side.

/// What the coordinator hears from a node's shell.
enum Heard {
    Frame(u8, Vec<u8>),
    Gone,
}

/// Forks a shell process for each of `nodes` nodes, which runs `shell(index, link)` in a session of its own
/// and exits with what it returns, then relays between them until all have exited. Returns rpmi-run's exit
/// status: the code a PMI_Abort asked for; else the first failing task's; else a plugin error's; else the
/// first non-zero status of a shell; else 0. Call it before any other thread exists (it forks).
pub fn coordinate(nodes: usize, shell: impl Fn(usize, Link) -> i32) -> Result<i32, String> {
    let mut streams: Vec<UnixStream> = Vec::with_capacity(nodes);
    let mut pids: Vec<libc::pid_t> = Vec::with_capacity(nodes);
    for index in 0..nodes {
        let (ours, theirs) = UnixStream::pair().map_err(|e| format!("cannot connect virtual node {index}: {e}"))?;
        // SAFETY: no other thread exists yet, so the child may go on running Rust code after fork.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            for &pid in &pids {
                // SAFETY: kill on our own children.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            return Err(format!("cannot start virtual node {index}: {}", io::Error::last_os_error()));
        }
        if pid == 0 {
            // Only its own end of its own link stays open, so that every link ends when its shell does.
            drop(streams);
            drop(ours);
            // SAFETY: setsid has no memory effects; it fails only for a process group leader, which a child
            // just forked is not.
            unsafe { libc::setsid() };
            let status = shell(index, Link::new(theirs, nodes));
            std::process::exit(status);
        }
        drop(theirs);
        streams.push(ours);
        pids.push(pid);
    }

    let signalled = pids.clone();
    crate::output::forward_signals(move |sig| {
        say!("got signal {sig}, passing it to every task");
        for &pid in &signalled {
            // SAFETY: kill on our own children; each shell passes the signal on to its tasks.
            unsafe { libc::kill(pid, sig) };
        }
    });

    let (heard, hearing) = mpsc::channel();
    for (index, stream) in streams.iter().enumerate() {
        let from = stream.try_clone().map_err(|e| format!("cannot listen to virtual node {index}: {e}"))?;
        let heard = heard.clone();
        std::thread::spawn(move || loop {
            match read_frame(&mut &from) {
                Ok(Some((kind, payload))) => {
                    let _ = heard.send((index, Heard::Frame(kind, payload)));
                }
                Ok(None) | Err(_) => {
                    let _ = heard.send((index, Heard::Gone));
                    return;
                }
            }
        });
    }
    drop(heard);

    let endings = relay(&streams, hearing);
    let mut first_bad_exit = None;
    for (index, &pid) in pids.iter().enumerate() {
        let mut status = 0;
        // SAFETY: waitpid on our own child into a local.
        while unsafe { libc::waitpid(pid, &mut status, 0) } < 0 {
            if io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
                break;
            }
        }
        let code = if libc::WIFEXITED(status) {
            libc::WEXITSTATUS(status)
        } else {
            say!("virtual node {index} died of signal {}", libc::WTERMSIG(status));
            128 + libc::WTERMSIG(status)
        };
        if code != 0 {
            first_bad_exit.get_or_insert(code);
        }
    }
    let first = |why: Ending| endings.iter().find(|(w, _)| *w == why).map(|&(_, code)| code);
    Ok(first(Ending::Abort).or(first(Ending::Failure)).or(first(Ending::Error)).or(first_bad_exit).unwrap_or(0))
}

/// Passes every collective's parts to every shell once all have given theirs, and an ending node's news to
/// the others, until every shell has gone. Returns the endings heard, in order.
fn relay(streams: &[UnixStream], hearing: mpsc::Receiver<(usize, Heard)>) -> Vec<(Ending, i32)> {
    let nodes = streams.len();
    let mut parts: Vec<Option<Vec<u8>>> = vec![None; nodes];
    let mut gone = vec![false; nodes];
    let mut endings = Vec::new();
    let mut said: Vec<Vec<u8>> = Vec::new();
    let mut ended = false;
    while let Ok((index, heard)) = hearing.recv() {
        match heard {
            Heard::Frame(PART, part) => {
                parts[index] = Some(part);
                if parts.iter().all(Option::is_some) {
                    let all: Vec<Vec<u8>> = parts.iter_mut().filter_map(Option::take).collect();
                    for (mut to, _) in streams.iter().zip(&gone).filter(|(_, &g)| !g) {
                        // A shell that cannot take them has ended; its going is heard on its own.
                        let _ = all.iter().try_for_each(|part| write_frame(&mut to, PART, part));
                    }
                }
            }
            Heard::Frame(ENDING, payload) => {
                let (why, code, message) = ending(&payload);
                endings.push((why, code));
                // Every node refuses a bad option, or a missing program, alike: said once.
                if !message.is_empty() && !said.iter().any(|m| m == message) {
                    say!("{}", String::from_utf8_lossy(message));
                    said.push(message.to_vec());
                }
                if !ended {
                    ended = true;
                    let kill = libc::SIGKILL.to_le_bytes();
                    for (_, mut to) in streams.iter().enumerate().filter(|&(i, _)| i != index && !gone[i]) {
                        let _ = write_frame(&mut to, KILL, &kill);
                    }
                }
            }
            Heard::Frame(..) => {}
            Heard::Gone => {
                gone[index] = true;
                if gone.iter().all(|&g| g) {
                    break;
                }
            }
        }
    }
    endings
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the coordinator is told, in order, of the endings `node` sends through a link.
    fn told(node: impl FnOnce(&Link)) -> Vec<(Ending, i32, String)> {
        let (shell, coordinator) = UnixStream::pair().unwrap();
        node(&Link::new(shell, 2));
        let mut endings = Vec::new();
        while let Some((kind, payload)) = read_frame(&mut &coordinator).unwrap() {
            assert_eq!(kind, ENDING);
            let (why, code, message) = ending(&payload);
            endings.push((why, code, String::from_utf8(message.to_vec()).unwrap()));
        }
        endings
    }

    #[test]
    fn the_first_ending_and_a_later_abort_are_told() {
        let endings = told(|link| {
            assert!(link.send_ending(Ending::Failure, 3, ""));
            assert!(!link.send_ending(Ending::Error, 1, "not told"));
            // Served after the job began ending, during the last reads, when the link is no longer heard.
            link.stop_hearing();
            assert!(link.send_ending(Ending::Abort, 7, ""));
            assert!(!link.send_ending(Ending::Abort, 9, ""));
        });
        assert_eq!(endings, [(Ending::Failure, 3, String::new()), (Ending::Abort, 7, String::new())]);
    }

    #[test]
    fn a_first_abort_is_told_once() {
        let endings = told(|link| {
            assert!(link.send_ending(Ending::Abort, 5, "why"));
            assert!(!link.send_ending(Ending::Failure, 5, ""));
            assert!(!link.send_ending(Ending::Abort, 6, ""));
        });
        assert_eq!(endings, [(Ending::Abort, 5, "why".to_string())]);
    }
}

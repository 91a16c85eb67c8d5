//! Virtual nodes as processes of their own. With `--nodes M` above 1, rpmi-run forks one shell process per
//! node, each the leader of a session of its own (as a real node's job shell is, e.g. Slurm's slurmstepd),
//! so the kernel schedules each node's shell and its tasks as one group. rpmi-run itself stays as the
//! coordinator: it relays each collective's parts between the shells over a socketpair per node, as a host
//! would between machines, and passes on why and when the job ends: it says what is news for the whole job
//! (the first reason, the first abort), and ends a job whose barrier waits for a node that has ended.
//!
//! On the socket, a frame is a kind byte, a little-endian u64 length, and that many bytes.

use crate::host::{Cause, Shell};
use rpmi::abi::ffi;
use rpmi::server::JOB_ERROR_EXIT_CODE;
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Mutex;

/// A node's part of a collective: from a shell, and back to every shell, once per node, in node order.
const PART: u8 = 1;
/// Shell to coordinator: this node ended the job; what to say about it, if anything, in UTF-8. The job's
/// status is then the node's exit status: only the node knows it, once its tasks are reaped.
const ENDING: u8 = 2;
/// Coordinator to shell: end your tasks with this signal (an i32).
const KILL: u8 = 3;
/// Shell to coordinator: a task of this node called PMI_Abort (the exit code as i32, then what to say).
const ABORT: u8 = 4;

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

/// An ABORT frame's exit code and message (see `Link::send_ending`).
fn abort(payload: &[u8]) -> (i32, &[u8]) {
    (i32_at(payload, 0).unwrap_or(1), payload.get(4..).unwrap_or_default())
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
}

impl Link {
    fn new(stream: UnixStream, nodes: usize) -> Link {
        Link {
            stream,
            writing: Mutex::new(()),
            nodes,
            parts: Mutex::new(Vec::with_capacity(nodes)),
            closing: AtomicBool::new(false),
        }
    }

    fn send(&self, kind: u8, payload: &[u8]) -> io::Result<()> {
        let _writing = self.writing.lock().map_err(|_| io::Error::other("the link's lock is poisoned"))?;
        write_frame(&mut &self.stream, kind, payload)
    }

    pub fn send_part(&self, part: &[u8]) -> io::Result<()> {
        self.send(PART, part)
    }

    /// Tells the coordinator that this node ended the job for `cause`, news on this node (the shell tells
    /// its first cause, and its first abort: an abort line a task wrote before it was killed may be served
    /// after the job began ending). The coordinator says `message` (unless empty) if it is news for the
    /// whole job too. If this fails, the coordinator is gone: the shell says the message itself, and its
    /// loop hears the link end and ends this node's tasks anyway.
    pub fn send_ending(&self, cause: Cause, message: &str) -> io::Result<()> {
        match cause {
            Cause::Abort(code) => {
                let mut payload = code.to_le_bytes().to_vec();
                payload.extend_from_slice(message.as_bytes());
                self.send(ABORT, &payload)
            }
            Cause::Failed(_) | Cause::JobError { .. } | Cause::Signal => self.send(ENDING, message.as_bytes()),
        }
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

/// Who ended the job first, as the coordinator heard it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum First {
    /// A node's shell, which then exits with the job's status (unless a task called PMI_Abort).
    Node(usize),
    /// The coordinator: a node's tasks had all exited while other nodes' tasks waited for them in a
    /// barrier, which could then never complete.
    Deserted,
}

/// What the coordinator heard of the job's ending.
#[derive(Default, Debug)]
struct Outcome {
    first: Option<First>,
    /// The first PMI_Abort's exit code, from any node.
    abort: Option<i32>,
}

/// Forks a shell process for each node (`cliques`: each node's ranks), which runs `shell(index, link)` in a
/// session of its own and exits with what it returns, then relays between them until all have exited.
/// Returns rpmi-run's exit status: the code of the first PMI_Abort; else, if a node ended the job, that
/// node's exit status (which follows the same rules, see `host::Fate::status`); if the coordinator did,
/// [`JOB_ERROR_EXIT_CODE`]; else the first non-zero status of a shell; else 0. Messages that are not news
/// for the job are said only at `verbosity` debug. Call it before any other thread exists (it forks).
pub fn coordinate(cliques: &[Vec<u32>], verbosity: i32, shell: impl Fn(usize, Link) -> i32) -> Result<i32, String> {
    let nodes = cliques.len();
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

    let outcome = relay(&streams, cliques, hearing, verbosity);
    let mut statuses = Vec::with_capacity(nodes);
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
        statuses.push(code);
    }
    Ok(match outcome {
        Outcome { abort: Some(code), .. } => code,
        Outcome { first: Some(First::Node(index)), .. } => statuses[index],
        Outcome { first: Some(First::Deserted), .. } => JOB_ERROR_EXIT_CODE,
        Outcome { first: None, .. } => statuses.iter().copied().find(|&code| code != 0).unwrap_or(0),
    })
}

/// `rank 3`, `ranks 0,2`: a node's ranks, the first few of many.
fn ranks(clique: &[u32]) -> String {
    const SHOWN: usize = 8;
    let listed: Vec<String> = clique.iter().take(SHOWN).map(u32::to_string).collect();
    let more = if clique.len() > SHOWN { format!(",... ({} ranks)", clique.len()) } else { String::new() };
    let noun = if clique.len() == 1 { "rank" } else { "ranks" };
    format!("{noun} {}{more}", listed.join(","))
}

/// The node that has ended (its link closed) without its part of a collective others have joined: every
/// task of it has exited, so the collective can never complete.
fn deserted(parts: &[Option<Vec<u8>>], gone: &[bool]) -> Option<usize> {
    if parts.iter().all(Option::is_none) {
        return None;
    }
    parts.iter().zip(gone).position(|(part, &gone)| gone && part.is_none())
}

/// Passes every collective's parts to every shell once all have given theirs, and an ending node's news to
/// the others, until every shell has gone. Says what is news for the whole job: the first reason it ends
/// for and the first abort (a reason every node gives alike, once); the rest, which follows from the
/// ending, only at `verbosity` debug.
fn relay(
    streams: &[UnixStream],
    cliques: &[Vec<u32>],
    hearing: mpsc::Receiver<(usize, Heard)>,
    verbosity: i32,
) -> Outcome {
    let nodes = streams.len();
    let mut parts: Vec<Option<Vec<u8>>> = vec![None; nodes];
    let mut gone = vec![false; nodes];
    let mut outcome = Outcome::default();
    let mut said: Vec<Vec<u8>> = Vec::new();
    let mut say_once = |message: &[u8], news: bool| {
        if message.is_empty() || said.iter().any(|m| m == message) {
            return;
        }
        if news {
            say!("{}", String::from_utf8_lossy(message));
        } else if verbosity >= ffi::RPMI_LOG_DEBUG {
            say!("as the job ends: {}", String::from_utf8_lossy(message));
        } else {
            return;
        }
        said.push(message.to_vec());
    };
    // The first ending stops every other node's tasks.
    let kill_others = |but: Option<usize>, gone: &[bool]| {
        let kill = libc::SIGKILL.to_le_bytes();
        for (_, mut to) in streams.iter().enumerate().filter(|&(i, _)| Some(i) != but && !gone[i]) {
            let _ = write_frame(&mut to, KILL, &kill);
        }
    };
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
            Heard::Frame(ENDING, message) => {
                let news = outcome.first.is_none();
                if news {
                    outcome.first = Some(First::Node(index));
                    kill_others(Some(index), &gone);
                }
                say_once(&message, news);
            }
            Heard::Frame(ABORT, payload) => {
                let (code, message) = abort(&payload);
                let news = outcome.abort.is_none();
                if news {
                    outcome.abort = Some(code);
                }
                if outcome.first.is_none() {
                    outcome.first = Some(First::Node(index));
                    kill_others(Some(index), &gone);
                }
                say_once(message, news);
            }
            Heard::Frame(..) => {}
            Heard::Gone => {
                gone[index] = true;
                if gone.iter().all(|&g| g) {
                    break;
                }
            }
        }
        if outcome.first.is_none() {
            if let Some(node) = deserted(&parts, &gone) {
                outcome.first = Some(First::Deserted);
                kill_others(None, &gone);
                let why = format!(
                    "virtual node {node} ended: {} exited while other ranks wait for {} in a barrier",
                    ranks(&cliques[node]),
                    if cliques[node].len() == 1 { "it" } else { "them" }
                );
                say_once(why.as_bytes(), true);
            }
        }
    }
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A frame's kind and payload.
    type Frame = (u8, Vec<u8>);

    /// Every frame sent to `end` until it closes.
    fn frames(end: &UnixStream) -> Vec<Frame> {
        let mut all = Vec::new();
        while let Some(frame) = read_frame(&mut &*end).unwrap() {
            all.push(frame);
        }
        all
    }

    #[test]
    fn a_node_is_named_by_its_first_few_ranks() {
        assert_eq!(ranks(&[3]), "rank 3");
        assert_eq!(ranks(&[1, 5]), "ranks 1,5");
        assert_eq!(ranks(&(0..512).collect::<Vec<_>>()), "ranks 0,1,2,3,4,5,6,7,... (512 ranks)");
    }

    #[test]
    fn an_abort_carries_its_code_and_other_endings_only_what_to_say() {
        let (shell, coordinator) = UnixStream::pair().unwrap();
        let link = Link::new(shell, 2);
        link.send_ending(Cause::JobError { rank: 1, lost: true }, "rank 1 left").unwrap();
        link.send_ending(Cause::Abort(-3), "rank 2 called PMI_Abort").unwrap();
        drop(link);
        let got = frames(&coordinator);
        assert_eq!(got[0], (ENDING, b"rank 1 left".to_vec()));
        assert_eq!(got[1].0, ABORT);
        assert_eq!(abort(&got[1].1), (-3, &b"rank 2 called PMI_Abort"[..]));
        assert_eq!(got.len(), 2);
    }

    /// Runs `relay` over `nodes` links on what the shells are heard to do; returns its outcome and the
    /// frames each shell was sent.
    fn relayed(nodes: usize, heard: Vec<(usize, Heard)>) -> (Outcome, Vec<Vec<Frame>>) {
        let (ours, theirs): (Vec<_>, Vec<_>) = (0..nodes).map(|_| UnixStream::pair().unwrap()).unzip();
        let (tx, rx) = mpsc::channel();
        for h in heard {
            tx.send(h).unwrap();
        }
        drop(tx);
        let cliques: Vec<Vec<u32>> = (0..nodes as u32).map(|n| vec![n]).collect();
        let outcome = relay(&ours, &cliques, rx, ffi::RPMI_LOG_WARN);
        drop(ours);
        (outcome, theirs.iter().map(frames).collect())
    }

    fn kinds(frames: &[Frame]) -> Vec<u8> {
        frames.iter().map(|f| f.0).collect()
    }

    #[test]
    fn a_node_that_ends_outside_a_barrier_others_wait_in_ends_the_job() {
        let (outcome, sent) = relayed(
            3,
            vec![
                (0, Heard::Frame(PART, b"a".to_vec())),
                (2, Heard::Frame(PART, b"c".to_vec())),
                (1, Heard::Gone),
                (0, Heard::Gone),
                (2, Heard::Gone),
            ],
        );
        assert_eq!(outcome.first, Some(First::Deserted));
        assert_eq!(outcome.abort, None);
        assert_eq!(kinds(&sent[0]), [KILL]);
        assert!(sent[1].is_empty());
        assert_eq!(kinds(&sent[2]), [KILL]);
    }

    #[test]
    fn a_node_that_ends_after_its_part_holds_nobody_up() {
        let (outcome, sent) = relayed(
            2,
            vec![(1, Heard::Frame(PART, b"b".to_vec())), (1, Heard::Gone), (0, Heard::Frame(PART, b"a".to_vec()))],
        );
        assert_eq!(outcome.first, None);
        assert_eq!(kinds(&sent[0]), [PART, PART], "node 0 gets both parts");
        assert!(sent[1].is_empty(), "node 1 had gone");
    }

    #[test]
    fn the_first_node_to_end_the_job_decides_and_a_later_abort_still_counts() {
        let (outcome, sent) = relayed(
            3,
            vec![
                (1, Heard::Frame(ENDING, b"rank 1 left".to_vec())),
                (0, Heard::Frame(ENDING, b"rank 0 left".to_vec())),
                (0, Heard::Frame(ABORT, [7i32.to_le_bytes().to_vec(), b"rank 0 aborts".to_vec()].concat())),
            ],
        );
        assert_eq!(outcome.first, Some(First::Node(1)));
        assert_eq!(outcome.abort, Some(7));
        assert_eq!(kinds(&sent[0]), [KILL]);
        assert!(sent[1].is_empty());
        assert_eq!(kinds(&sent[2]), [KILL]);
    }
}

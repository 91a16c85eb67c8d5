//! The host seam: everything the engine needs from the resource manager that runs it.
//!
//! The engine calls these methods from inside [`crate::server::Shell`]'s own methods, on the host's thread.
//! What a host refuses at once it says in the method's result; what completes later (the collective, name
//! service and spawn requests) is handed back through [`crate::server::Shell::collective_complete`],
//! [`crate::server::Shell::host_reply`] and [`crate::server::Shell::untyped_reply`]. A host must not call
//! into the shell from inside one of these methods.

use crate::wire::SpawnRequest;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// A task of this shell, by its local index (0 .. the shell's task count).
pub type TaskId = usize;

/// What a resource manager provides to one shell.
pub trait Host {
    /// Starts this shell's part of a barrier: an allgather of `contribution` (this shell's puts since the
    /// last barrier, possibly empty) with every shell of the job. The host copies the bytes before
    /// returning and later calls `Shell::collective_complete` with every shell's contribution, or with an
    /// error. At most one collective is outstanding per shell.
    ///
    /// `Err(why)`: the exchange could not start. The barrier fails at once, as a failed completion fails it,
    /// and the host does not complete this collective.
    fn collective(&mut self, contribution: &[u8]) -> Result<(), String>;

    /// Whether this host runs group exchanges ([`Host::group_collective`]). The shell then answers PMI 1.2
    /// to clients that ask for 1.2 or later, and they may send group barriers; otherwise it answers 1.1.
    /// Asked at each task's `init`; the default is no.
    fn serves_groups(&self) -> bool {
        false
    }

    /// Starts this shell's part of group exchange `exchange.id`: an allgather of `contribution` (the puts
    /// of this shell's members of the group, possibly empty) among the shells `exchange.shells` only. The
    /// host copies the bytes and later calls `Shell::group_complete` with the same id and every member
    /// shell's contribution, or with an error. Several group exchanges, of different ids, may be outstanding
    /// at once, beside a [`Host::collective`]. `Err(why)`: it could not start; the group
    /// barrier fails at once. Only called when [`Host::serves_groups`] says yes.
    fn group_collective(&mut self, exchange: &GroupExchange<'_>, contribution: &[u8]) -> Result<(), String> {
        let _ = (exchange, contribution);
        Err(NOT_SUPPORTED.into())
    }

    /// A task called `PMI_Abort`: end the job with `exit_code` and put `message` on the job's stderr.
    fn abort(&mut self, rank: u32, exit_code: i32, message: &str);

    /// The job cannot go on as it is: a task broke the protocol, or left while others wait for it.
    /// RFC 13 asks that the job end with this message, which is what hosts should do unless they know
    /// better.
    fn job_error(&mut self, error: &JobError);

    /// A message about this job for its log: a PMI-2 client, a barrier that failed, a host bug.
    fn log(&mut self, level: log::Level, message: &str) {
        log::log!(level, "{message}");
    }

    /// One line of the wire trace (`C:` from a task, `S:` to it), sent only when tracing is on.
    fn trace(&mut self, rank: u32, speaker: Speaker, line: &[u8]) {
        log::trace!("rank {rank} {speaker}: {}", String::from_utf8_lossy(line));
    }

    /// Task `rank` sent its first PMI line: its program was found and runs, and speaks PMI. A host that
    /// answers a spawn only once every process has started waits for this from each. The default does
    /// nothing.
    fn task_started(&mut self, rank: u32) {
        let _ = rank;
    }

    /// Task `rank`'s PMI connection closed (`finalized`: after it sent `finalize`). A host whose job spans
    /// several shells can use it to fail, on the other shells, a barrier this task can no longer join; a
    /// barrier on this shell is already handled by the shell. The default does nothing.
    fn task_closed(&mut self, rank: u32, finalized: bool) {
        let _ = (rank, finalized);
    }

    /// Starts an optional service: publish, unpublish, lookup or spawn. `Ok`: the host answers later, once,
    /// through `Shell::host_reply(task, ..)` (or `Shell::untyped_reply`). `Err(why)`: refused; the task gets
    /// an error reply saying why at once, and the host does not answer. The default offers nothing
    /// ([`NOT_SUPPORTED`]).
    fn request(&mut self, task: TaskId, request: HostRequest<'_>) -> Result<(), String> {
        let _ = (task, request);
        Err(NOT_SUPPORTED.into())
    }
}

/// One shell's part of a group exchange: which exchange, and among which shells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupExchange<'a> {
    /// The exchange's name, the same on every member shell: the group's one written form
    /// ([`crate::wire::group`]: `WORLD:<tag>` or ascending ranks `0,4,8:<tag>`), at most [`GROUP_ID_MAX`]
    /// bytes. A host may read the members from it. A shell starts an exchange of an id only once its last
    /// one of that id has completed, so the parts of one id that meet at the host are all of one barrier.
    pub id: &'a [u8],
    /// The shells that hold a member, ascending; this shell among them, and at least one other.
    pub shells: &'a [u32],
}

/// The longest [`GroupExchange::id`]: a request line's group.
pub const GROUP_ID_MAX: usize = 1024;

/// Why a host refuses a service it does not offer; the task reads it in its error reply.
pub const NOT_SUPPORTED: &str = "not supported by this resource manager";

/// Who wrote a traced line: the task (the PMI client) or the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Speaker {
    /// From the task (client) to the server.
    Client,
    /// From the server to the task.
    Server,
}

impl fmt::Display for Speaker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Speaker::Client => "C",
            Speaker::Server => "S",
        })
    }
}

/// An optional service a task asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostRequest<'a> {
    /// `PMI_Publish_name(service, port)`
    Publish { service: &'a str, port: &'a str },
    /// `PMI_Unpublish_name(service)`
    Unpublish { service: &'a str },
    /// `PMI_Lookup_name(service)`
    Lookup { service: &'a str },
    /// `PMI_Spawn_multiple(...)`: every block of the request.
    Spawn(&'a SpawnRequest),
}

impl HostRequest<'_> {
    /// Which service this is.
    pub fn service(&self) -> Service {
        match self {
            HostRequest::Publish { .. } => Service::Publish,
            HostRequest::Unpublish { .. } => Service::Unpublish,
            HostRequest::Lookup { .. } => Service::Lookup,
            HostRequest::Spawn(_) => Service::Spawn,
        }
    }
}

/// The kinds of [`HostRequest`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Service {
    Publish,
    Unpublish,
    Lookup,
    Spawn,
}

/// The host's answer to a [`HostRequest`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostReply {
    /// Publish or unpublish succeeded.
    Done,
    /// Lookup found this port.
    Port(String),
    /// Spawn started; one error code per process asked for (0 = started).
    Spawned { errcodes: Vec<i32> },
    /// The request failed; the message reaches the task (as `msg=`) and the log.
    Failed(String),
}

impl HostReply {
    /// Reads an untyped answer to `service` (a C host's `service_complete`): whether it succeeded, and its
    /// text: the port of a lookup, the comma-separated error codes of a spawn, or why it failed.
    pub(super) fn untyped(service: Service, ok: bool, text: Option<String>) -> HostReply {
        match (ok, service) {
            (false, _) => HostReply::Failed(text.unwrap_or_else(|| "the resource manager failed it".into())),
            (true, Service::Publish | Service::Unpublish) => HostReply::Done,
            (true, Service::Lookup) => match text {
                Some(port) => HostReply::Port(port),
                None => HostReply::Failed("the resource manager found no port".into()),
            },
            (true, Service::Spawn) => {
                let codes: Result<Vec<i32>, _> =
                    text.as_deref().unwrap_or("").split(',').filter(|s| !s.is_empty()).map(str::parse).collect();
                match codes {
                    Ok(errcodes) => HostReply::Spawned { errcodes },
                    Err(_) => HostReply::Failed("the resource manager gave malformed spawn error codes".into()),
                }
            }
        }
    }
}

/// Which tasks the host owes an answer to a service request, shared with the threads on which a host's
/// answers come in: a C host's `service_complete` may come on any thread and must be refused there and
/// then when no answer is owed, while what the task waits for is known only on the shell's thread.
///
/// The shell marks a task before it hands the request to the host (the host may answer before
/// [`Host::request`] returns). The thread an untyped answer comes in on claims the mark
/// ([`OwedAnswers::claim`]) before it passes the answer on; the shell claims it itself when the host
/// refuses, and clears it when a typed answer reaches it. So each request lets one answer through: an
/// answer to a refused request, or a second answer, finds nothing owed, and an answer claimed before the
/// host refused is the one the task gets, never one left over for its next request. Which service the
/// task waits for stays recorded in the shell alone.
#[derive(Debug, Clone)]
pub struct OwedAnswers(Arc<[AtomicBool]>);

impl OwedAnswers {
    pub(super) fn new(tasks: usize) -> OwedAnswers {
        OwedAnswers((0..tasks).map(|_| AtomicBool::new(false)).collect())
    }

    /// The host now owes `task` an answer.
    pub(super) fn owe(&self, task: TaskId) {
        self.set(task, true);
    }

    /// The host's answer reached the shell: it owes `task` nothing more.
    pub(super) fn settle(&self, task: TaskId) {
        self.set(task, false);
    }

    fn set(&self, task: TaskId, owed: bool) {
        if let Some(flag) = self.0.get(task) {
            flag.store(owed, Ordering::SeqCst);
        }
    }

    /// Takes the answer the host owes `task`: `false` if none is owed (none was asked for, the host
    /// refused it, or it was answered already), and then the answer must not reach the shell.
    pub fn claim(&self, task: TaskId) -> bool {
        self.0.get(task).is_some_and(|flag| flag.swap(false, Ordering::SeqCst))
    }
}

/// The exit status a host gives a job it ended because of a [`JobError`] when no task failed on its own
/// (a protocol error, say): not 128 + a signal, which users read as a task killed by that signal (137 looks
/// like the kernel's out-of-memory killer), and not a code `PMI_Abort` is commonly given.
pub const JOB_ERROR_EXIT_CODE: i32 = 125;

/// Why a job cannot go on; its `Display` is the message for the job's stderr.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobError {
    /// A task sent something that is not PMI-1 (RFC 13: a protocol error ends the job).
    Protocol { rank: u32, line: String, reason: String },
    /// A task closed its PMI connection (exited, crashed) without `finalize`, or finalized, while other
    /// tasks wait for it in a barrier.
    TaskLost { rank: u32, finalized: bool },
}

impl fmt::Display for JobError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            JobError::Protocol { rank, line, reason } => {
                write!(f, "rank {rank}: PMI protocol error: {reason}, in line '{line}'")
            }
            JobError::TaskLost { rank, finalized: false } => write!(
                f,
                "rank {rank} closed its PMI connection (exited or crashed) without PMI_Finalize \
                 while other ranks wait for it in a barrier"
            ),
            JobError::TaskLost { rank, finalized: true } => {
                write!(f, "rank {rank} called PMI_Finalize while other ranks wait for it in a barrier")
            }
        }
    }
}

impl JobError {
    /// The rank the error is about.
    pub fn rank(&self) -> u32 {
        match self {
            JobError::Protocol { rank, .. } | JobError::TaskLost { rank, .. } => *rank,
        }
    }
}

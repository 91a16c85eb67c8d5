//! The host seam: everything the engine needs from the resource manager that runs it.
//!
//! The engine calls these methods from inside [`crate::server::Shell`]'s own methods, on the host's thread.
//! What completes later (the collective, name service and spawn requests) is handed back through
//! [`crate::server::Shell::collective_complete`] and [`crate::server::Shell::host_reply`]; a host must not
//! call into the shell from inside one of these methods.

use crate::wire::SpawnRequest;
use std::fmt;

/// A task of this shell, by its local index (0 .. the shell's task count).
pub type TaskId = usize;

/// What a resource manager provides to one shell.
pub trait Host {
    /// Starts this shell's part of a barrier: an allgather of `contribution` (this shell's puts since the
    /// last barrier, possibly empty) with every shell of the job. The host copies the bytes before
    /// returning and later calls `Shell::collective_complete` with every shell's contribution, or with an
    /// error. At most one collective is outstanding per shell.
    fn collective(&mut self, contribution: &[u8]);

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
    fn trace(&mut self, rank: u32, direction: Direction, line: &[u8]) {
        log::trace!("rank {rank} {direction}: {}", String::from_utf8_lossy(line));
    }

    /// Task `rank`'s PMI connection closed (`finalized`: after it sent `finalize`). A host whose job spans
    /// several shells can use it to fail, on the other shells, a barrier this task can no longer join; a
    /// barrier on this shell is already handled by the shell. The default does nothing.
    fn task_closed(&mut self, rank: u32, finalized: bool) {
        let _ = (rank, finalized);
    }

    /// Starts an optional service: publish, unpublish, lookup or spawn. A host that offers it returns
    /// [`Offered::Yes`] and answers later through `Shell::host_reply(task, ..)`; the default offers
    /// nothing, and the task gets an error reply at once.
    fn request(&mut self, task: TaskId, request: HostRequest<'_>) -> Offered {
        let _ = (task, request);
        Offered::No
    }
}

/// Which way a traced line went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// From the task (client) to the server.
    Client,
    /// From the server to the task.
    Server,
}

impl fmt::Display for Direction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Direction::Client => "C",
            Direction::Server => "S",
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

/// Whether the host took a [`HostRequest`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Offered {
    /// The host will answer with `Shell::host_reply`.
    Yes,
    /// The host does not offer this service.
    No,
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

//! What the engine hands its host: [`Effect`]s, queued by [`crate::server::Server`]'s methods and taken out
//! by the host with [`crate::server::Server::next_effect`] once the method has returned. The engine never
//! calls out: what completes later (a collective, a service request) the host hands back through
//! [`crate::server::Server::collective_complete`], [`crate::server::Server::group_complete`] and
//! [`crate::server::Server::host_reply`], and a host that cannot start one says so the same way.

use crate::wire::SpawnRequest;
use std::fmt;

/// A task of this server, by its local index (0 .. the server's task count).
pub type TaskId = usize;

/// Something the engine asks of its host, in the order it arose.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    /// Start this server's part of a barrier: an allgather of the contribution (this server's puts since the
    /// last barrier, possibly empty) with every server of the job. The host later calls
    /// `Server::collective_complete` with every server's contribution, or with why it failed (at once, if it
    /// cannot start it). At most one is outstanding per server.
    Collective(Vec<u8>),
    /// Start this server's part of group exchange `id`: an allgather of `contribution` (the puts of this
    /// server's members of the group, possibly empty) among `shells` only (ascending; this server among them,
    /// and at least one other). `id` is the group's one written form ([`crate::wire::group`]: `WORLD:<tag>`
    /// or ascending ranks `0,4,8:<tag>`), at most [`GROUP_ID_MAX`] bytes, the same on every member server;
    /// the host may read the members from it. The host later calls `Server::group_complete` with the same id.
    /// A server starts an exchange of an id only once its last one of that id has completed; several of
    /// different ids may be outstanding beside a [`Effect::Collective`]. Only from a server told it may
    /// ([`crate::server::Server::serve_groups`]).
    GroupCollective { id: Vec<u8>, shells: Vec<u32>, contribution: Vec<u8> },
    /// A task called `PMI_Abort`: end the job with `exit_code` and put `message` on the job's stderr.
    Abort { rank: u32, exit_code: i32, message: String },
    /// The job cannot go on as it is: a task broke the protocol, or left while others wait for it. RFC 13
    /// asks that the job end with this message, which is what hosts should do unless they know better.
    JobError(JobError),
    /// A message about this job for its log: a PMI-2 client, a barrier that failed, a host bug.
    Log(log::Level, String),
    /// One line of the wire trace (`C:` from a task, `S:` to it), only while tracing is on.
    Trace { rank: u32, speaker: Speaker, line: Vec<u8> },
    /// Task `rank` sent its first PMI line: its program was found and runs, and speaks PMI.
    TaskStarted(u32),
    /// Task `rank`'s PMI connection closed (`finalized`: after it sent `finalize`). A barrier on this server
    /// that it can no longer join is already failed by the server; a host whose job spans several shells can
    /// fail it on the others.
    TaskClosed { rank: u32, finalized: bool },
    /// Task `task` asked for an optional service. The host answers once, through `Server::host_reply`
    /// (a refusal is a [`HostReply::Failed`]).
    Request { task: TaskId, request: HostRequest },
}

/// The longest group exchange id ([`Effect::GroupCollective`]): a request line's group.
pub const GROUP_ID_MAX: usize = 1024;

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
pub enum HostRequest {
    /// `PMI_Publish_name(service, port)`
    Publish { service: String, port: String },
    /// `PMI_Unpublish_name(service)`
    Unpublish { service: String },
    /// `PMI_Lookup_name(service)`
    Lookup { service: String },
    /// `PMI_Spawn_multiple(...)`: every block of the request.
    Spawn(Box<SpawnRequest>),
}

impl HostRequest {
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

//! The host seam: a [`Host`] carries out the engine's [`Effect`]s, one method each, and [`pump`] hands it
//! every effect a call into the server queued. What a host refuses at once it says in the method's result,
//! which [`pump`] hands back to the server; what completes later (the collective, name service and spawn
//! requests) the host hands back itself through [`Server::collective_complete`], [`Server::group_complete`],
//! [`Server::host_reply`] and [`Server::untyped_reply`].

use super::effect::{Effect, HostReply, HostRequest, JobError, Speaker, TaskId};
use super::Server;

/// What a resource manager provides to one server.
pub trait Host {
    /// Starts this server's part of a barrier: an allgather of `contribution` (this server's puts since the
    /// last barrier, possibly empty) with every server of the job. The host copies the bytes before
    /// returning and later calls [`Server::collective_complete`] with every server's contribution, or with an
    /// error. At most one collective is outstanding per server.
    ///
    /// `Err(why)`: the exchange could not start. The barrier fails at once, as a failed completion fails it,
    /// and the host does not complete this collective.
    fn collective(&mut self, contribution: &[u8]) -> Result<(), String>;

    /// Whether this host runs group exchanges ([`Host::group_collective`]): the driver tells its server
    /// ([`Server::serve_groups`]). The default is no.
    fn serves_groups(&self) -> bool {
        false
    }

    /// Starts this server's part of group exchange `exchange.id`: an allgather of `contribution` (the puts
    /// of this server's members of the group, possibly empty) among the shells `exchange.shells` only. The
    /// host copies the bytes and later calls `Server::group_complete` with the same id and every member
    /// server's contribution, or with an error. Several group exchanges, of different ids, may be outstanding
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
    /// barrier on this server is already handled by the server. The default does nothing.
    fn task_closed(&mut self, rank: u32, finalized: bool) {
        let _ = (rank, finalized);
    }

    /// Starts an optional service: publish, unpublish, lookup or spawn. `Ok`: the host answers later, once,
    /// through `Server::host_reply(task, ..)` (or `Server::untyped_reply`). `Err(why)`: refused; the task gets
    /// an error reply saying why at once, and the host does not answer. The default offers nothing
    /// ([`NOT_SUPPORTED`]).
    fn request(&mut self, task: TaskId, request: HostRequest) -> Result<(), String> {
        let _ = (task, request);
        Err(NOT_SUPPORTED.into())
    }
}

/// One server's part of a group exchange: which exchange, and among which shells (as
/// [`Effect::GroupCollective`] says them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupExchange<'a> {
    /// The exchange's name, the same on every member server.
    pub id: &'a [u8],
    /// The shells that hold a member, ascending; this server among them, and at least one other.
    pub shells: &'a [u32],
}

/// Why a host refuses a service it does not offer; the task reads it in its error reply.
pub const NOT_SUPPORTED: &str = "not supported by this resource manager";

/// The exit status a host gives a job it ended because of a [`JobError`] when no task failed on its own
/// (a protocol error, say): not 128 + a signal, which users read as a task killed by that signal (137 looks
/// like the kernel's out-of-memory killer), and not a code `PMI_Abort` is commonly given.
pub const JOB_ERROR_EXIT_CODE: i32 = 125;

/// Carries out on `host`, in order, every effect `server` has queued; what the host refuses at once (a
/// collective, a group exchange, a request) goes back to the server as that exchange's failure or the
/// request's failed answer, and what that queues is carried out too. Called after each call into the server.
pub fn pump<H: Host + ?Sized>(server: &mut Server, host: &mut H) {
    while let Some(effect) = server.next_effect() {
        match effect {
            Effect::Collective(contribution) => {
                if let Err(why) = host.collective(&contribution) {
                    server.collective_complete(Err(&why));
                }
            }
            Effect::GroupCollective { id, shells, contribution } => {
                if let Err(why) = host.group_collective(&GroupExchange { id: &id, shells: &shells }, &contribution) {
                    server.group_complete(&id, Err(&why));
                }
            }
            Effect::Abort { rank, exit_code, message } => host.abort(rank, exit_code, &message),
            Effect::JobError(error) => host.job_error(&error),
            Effect::Log(level, message) => host.log(level, &message),
            Effect::Trace { rank, speaker, line } => host.trace(rank, speaker, &line),
            Effect::TaskStarted(rank) => host.task_started(rank),
            Effect::TaskClosed { rank, finalized } => host.task_closed(rank, finalized),
            Effect::Request { task, request } => {
                if let Err(why) = host.request(task, request) {
                    server.host_reply(task, HostReply::Failed(why));
                }
            }
        }
    }
}

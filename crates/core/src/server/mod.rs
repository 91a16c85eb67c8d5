//! The PMI server engine: one [`Server`] per job shell, driven by a host: it feeds the server what tasks write
//! and carries out the [`Effect`]s the server hands back ([`pump`] onto a [`Host`]).

mod effect;
mod host;
pub mod kvs;
mod limits;
pub mod names;
mod serve;
pub mod taskmap;

pub use effect::{Effect, HostReply, HostRequest, JobError, Service, Speaker, TaskId, GROUP_ID_MAX};
pub use host::{pump, GroupExchange, Host, JOB_ERROR_EXIT_CODE, NOT_SUPPORTED};
pub use limits::{Limits, LimitsError, REQUEST_LINE_CEILING};
pub use names::{NameOp, Names};
pub use serve::{check_preput, Attached, NodeRelease, Server, ServerError, PROCESS_MAPPING_KEY};
pub use taskmap::TaskMap;

/// What the host knows about the job, as one server sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobInfo {
    /// The job's KVS name, the same on every server (`get_my_kvsname`). A word of at most
    /// `kvsname_max - 1` characters.
    pub kvsname: String,
    /// The node of every rank of the job.
    pub task_map: TaskMap,
    /// The rank of each local task, indexed by [`TaskId`].
    pub local_ranks: Vec<u32>,
    /// The hostname of every node, indexed like the task map's nodes (for `get_ranks2hosts`).
    pub hostnames: Vec<String>,
    /// `get_universe_size`: usually the job size.
    pub universe_size: u32,
    /// `get_appnum` of each local task, indexed by [`TaskId`]: the index of its command in an MPMD launch
    /// or a spawn of several commands, else 0.
    pub appnums: Vec<i32>,
    /// Keys in the job's key-value space before any task runs, put by no rank: the preputs of the spawn
    /// that started the job.
    pub preputs: crate::wire::Pairs,
    /// The job was started by a spawn (`PMI_SPAWNED=1`; PMI-2's `fullinit` names a spawner).
    pub spawned: bool,
}

impl JobInfo {
    /// Job information for a job of `task_map.size()` ranks, of which this server runs `local_ranks`.
    pub fn new(kvsname: impl Into<String>, task_map: TaskMap, local_ranks: Vec<u32>, hostnames: Vec<String>) -> Self {
        let universe_size = u32::try_from(task_map.size()).unwrap_or(u32::MAX);
        let appnums = vec![0; local_ranks.len()];
        let preputs = vec![];
        JobInfo {
            kvsname: kvsname.into(),
            task_map,
            local_ranks,
            hostnames,
            universe_size,
            appnums,
            preputs,
            spawned: false,
        }
    }

    fn validate(&self, limits: &Limits) -> Result<(), ServerError> {
        let bad = |m: String| Err(ServerError(m));
        if !kvs::is_key(self.kvsname.as_bytes()) || self.kvsname.len() > limits.kvsname_len_max() {
            return bad(format!(
                "kvsname '{}' must be 1 to {} visible characters without '='",
                self.kvsname,
                limits.kvsname_len_max()
            ));
        }
        let size = self.task_map.size();
        if size == 0 || size > u32::MAX as usize - 1 {
            return bad(format!("a job of {size} ranks"));
        }
        let mut seen = vec![false; size];
        for &r in &self.local_ranks {
            match seen.get_mut(r as usize) {
                None => return bad(format!("local rank {r} is not a rank of a {size}-rank job")),
                Some(true) => return bad(format!("local rank {r} is given twice")),
                Some(s) => *s = true,
            }
        }
        if self.appnums.len() != self.local_ranks.len() {
            return bad(format!("{} appnums for {} local tasks", self.appnums.len(), self.local_ranks.len()));
        }
        if self.hostnames.len() < self.task_map.node_count() {
            return bad(format!(
                "{} hostnames for {} nodes in the task map",
                self.hostnames.len(),
                self.task_map.node_count()
            ));
        }
        Ok(())
    }
}

/// A line made fit for a message: at most 120 bytes, anything unprintable escaped.
pub fn excerpt(line: &[u8]) -> String {
    const MAX: usize = 120;
    let mut s: String = line.iter().take(MAX).flat_map(|&b| std::ascii::escape_default(b)).map(char::from).collect();
    if line.len() > MAX {
        s.push_str(&format!("... ({} bytes)", line.len()));
    }
    s
}

//! What a launch of several commands gives its ranks, and what a spawn may ask for: the same for every host
//! (rpmi-run's launches and spawns, the Slurm plugin's MPMD steps and spawned steps).
//!
//! A launch of several commands (an MPMD launch `-n 2 ./a : -n 3 ./b`, `srun --multi-prog`, or the commands
//! of one `PMI_Spawn_multiple`) runs each command's processes in turn: command `i`'s ranks come after those of
//! the commands before it, and their appnum (`PMI_Get_appnum`, `MPI_APPNUM`) is `i`.

use crate::server::{check_preput, Limits};
use crate::wire::{Pairs, SpawnRequest};

/// The most processes one spawn starts: its answer carries an error code for each.
pub const SPAWN_PROCS_MAX: u64 = 65536;

/// The most preputs a job takes (a spawn's, or a host's in `rpmi_job_info`).
pub const PREPUTS_MAX: usize = 4096;

/// The error code of a process a spawn did not start (PMI's `PMI_FAIL`).
pub const PMI_FAIL: i32 = -1;

/// The processes of a launch of `counts[i]` processes of each command `i`.
pub fn size(counts: &[u32]) -> u64 {
    counts.iter().map(|&c| u64::from(c)).sum()
}

/// The appnum of each of `ranks` in a launch of `counts[i]` processes of each command `i`: the index of its
/// command (a rank past the last command's is the last command's).
pub fn appnums(counts: &[u32], ranks: &[u32]) -> Vec<i32> {
    let ends: Vec<u64> = counts
        .iter()
        .scan(0u64, |end, &c| {
            *end += u64::from(c);
            Some(*end)
        })
        .collect();
    let appnum =
        |rank: u32| ends.partition_point(|&end| end <= u64::from(rank)).min(ends.len().saturating_sub(1)) as i32;
    ranks.iter().map(|&r| appnum(r)).collect()
}

/// What a spawned job is: the processes of each command, in rank order, and the keys in its key-value space
/// before any of its tasks runs (the spawn's preputs, as text).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpawnedJob {
    pub counts: Vec<u32>,
    pub preputs: Vec<(String, String)>,
}

impl SpawnedJob {
    /// The job `request` asks for, if a host may start it: at least one command, none of no processes, at
    /// most [`SPAWN_PROCS_MAX`] in all, the commands' preputs agreeing (one value a key) and at most
    /// [`PREPUTS_MAX`] of them.
    pub fn of(request: &SpawnRequest) -> Result<SpawnedJob, String> {
        if request.commands.is_empty() || request.commands.iter().any(|c| c.nprocs == 0) {
            return Err("a spawn of no processes".into());
        }
        let size = request.total_procs();
        if size > SPAWN_PROCS_MAX {
            return Err(format!("a spawn of {size} processes, more than the {SPAWN_PROCS_MAX} one spawn starts"));
        }
        let preputs = request.preputs()?;
        if preputs.len() > PREPUTS_MAX {
            return Err(format!("{} preputs, more than the {PREPUTS_MAX} a job takes", preputs.len()));
        }
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        Ok(SpawnedJob {
            counts: request.commands.iter().map(|c| c.nprocs).collect(),
            preputs: preputs.iter().map(|(k, v)| (text(k), text(v))).collect(),
        })
    }

    /// The processes of the new job.
    pub fn size(&self) -> u64 {
        size(&self.counts)
    }

    /// The appnum of each of `ranks`.
    pub fn appnums(&self, ranks: &[u32]) -> Vec<i32> {
        appnums(&self.counts, ranks)
    }

    /// The preputs as the server takes them.
    pub fn pairs(&self) -> Pairs {
        self.preputs.iter().map(|(k, v)| (k.as_bytes().to_vec(), v.as_bytes().to_vec())).collect()
    }
}

/// Whether the server of the new job will take every one of `preputs` under `limits` ([`check_preput`]):
/// the first it would refuse, and why.
pub fn check_preputs<'a>(
    limits: &Limits,
    preputs: impl IntoIterator<Item = (&'a [u8], &'a [u8])>,
) -> Result<(), String> {
    for (key, value) in preputs {
        check_preput(limits, key, value)
            .map_err(|why| format!("the preput '{}': {why}", String::from_utf8_lossy(key)))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::SpawnCommand;

    #[test]
    fn each_rank_has_its_commands_index() {
        assert_eq!(size(&[2, 3]), 5);
        assert_eq!(appnums(&[2, 3], &[0, 1, 2, 4]), [0, 0, 1, 1]);
        assert_eq!(appnums(&[1, 1, 1], &[2, 0]), [2, 0]);
        // Past the last command: the last command's.
        assert_eq!(appnums(&[2], &[5]), [0]);
        assert_eq!(appnums(&[u32::MAX, 1], &[u32::MAX]), [1]);
    }

    fn command(nprocs: u32, preputs: &[(&str, &str)]) -> SpawnCommand {
        SpawnCommand {
            nprocs,
            execname: b"./a".to_vec(),
            preputs: preputs.iter().map(|(k, v)| (k.as_bytes().to_vec(), v.as_bytes().to_vec())).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn a_spawn_is_bounded_before_any_host_starts_it() {
        let request = SpawnRequest { commands: vec![command(2, &[("k", "v")]), command(1, &[("k", "v")])] };
        let spawned = SpawnedJob::of(&request).unwrap();
        assert_eq!((spawned.counts.as_slice(), spawned.size()), (&[2, 1][..], 3));
        assert_eq!(spawned.preputs, [("k".to_string(), "v".to_string())]);
        assert_eq!(spawned.appnums(&[2]), [1]);
        for (bad, why) in [
            (vec![], "no processes"),
            (vec![command(0, &[])], "no processes"),
            (vec![command(65536, &[]), command(1, &[])], "65537 processes"),
            (vec![command(1, &[("k", "v")]), command(1, &[("k", "w")])], "two values"),
        ] {
            let err = SpawnedJob::of(&SpawnRequest { commands: bad }).unwrap_err();
            assert!(err.contains(why), "{err}");
        }
        let many: Vec<(String, String)> = (0..=PREPUTS_MAX).map(|i| (format!("k{i}"), "v".into())).collect();
        let many: Vec<(&str, &str)> = many.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let err = SpawnedJob::of(&SpawnRequest { commands: vec![command(1, &many)] }).unwrap_err();
        assert!(err.contains("4097 preputs"), "{err}");
    }

    #[test]
    fn preputs_are_checked_as_puts() {
        let limits = Limits::default();
        assert_eq!(check_preputs(&limits, [(&b"k"[..], &b"v"[..])]), Ok(()));
        let err = check_preputs(&limits, [(&b"k"[..], &b"v"[..]), (&b"a b"[..], &b"v"[..])]).unwrap_err();
        assert!(err.starts_with("the preput 'a b': "), "{err}");
    }
}

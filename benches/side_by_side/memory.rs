//! Peak memory of the process that serves the tasks' PMI connections, sampled from /proc while a job runs.
//! VmHWM is the kernel's own high-water mark of a process's resident set, so a sample only has to be taken
//! before the process exits (a zombie has no memory to show). Every 5 ms the sampler reads the status file of
//! the few serving processes, which costs the job nothing measurable; /proc is scanned for slurmstepds only
//! every 50 ms and only until every node's is found.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::Duration;

/// Which processes serve the tasks, for a job whose launcher has pid `root`.
#[derive(Clone, Copy, Debug)]
pub enum Serving {
    /// The launcher itself (rpmi-run with one node, the floor).
    Launcher,
    /// rpmi-run's shell for each of `nodes` virtual nodes: the children it forks of itself.
    Shells { nodes: usize },
    /// mpiexec.hydra and its hydra_pmi_proxy (the proxy answers the tasks; mpiexec keeps the KVS).
    HydraProxy,
    /// The step's slurmstepd on every node: those that appear after the job started.
    Stepds { nodes: usize },
    /// The job's flux-shell on every broker: those that appear after the job started.
    FluxShells { nodes: usize },
}

pub struct Sampler {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<BTreeMap<u32, u64>>,
}

impl Sampler {
    pub fn start(root: u32, serving: Serving) -> Sampler {
        let existing = match serving {
            Serving::Stepds { .. } => stepds(),
            Serving::FluxShells { .. } => named("flux-shell"),
            _ => BTreeSet::new(),
        };
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = thread::spawn(move || {
            let mut peaks = BTreeMap::new();
            let mut watched: BTreeSet<u32> = BTreeSet::new();
            let mut tick = 0u64;
            loop {
                let last = stopped.load(Ordering::Relaxed);
                match serving {
                    Serving::Launcher => {
                        watched.insert(root);
                    }
                    Serving::HydraProxy => {
                        watched.insert(root);
                        watched.extend(children(root).into_iter().filter(|&pid| comm(pid) == "hydra_pmi_proxy"));
                    }
                    // Scanning /proc is the costly part: only until every node's stepd is found.
                    Serving::Stepds { nodes } if watched.len() < nodes && tick.is_multiple_of(10) => {
                        watched.extend(stepds().difference(&existing));
                    }
                    Serving::Stepds { .. } => {}
                    Serving::FluxShells { nodes } if watched.len() < nodes && tick.is_multiple_of(10) => {
                        watched.extend(named("flux-shell").difference(&existing));
                    }
                    Serving::FluxShells { .. } => {}
                    // Only until every shell is found, like the stepds.
                    Serving::Shells { nodes } if watched.len() < nodes => {
                        watched.extend(children(root).into_iter().filter(|&pid| comm(pid) == "rpmi-run"));
                    }
                    Serving::Shells { .. } => {}
                }
                for &pid in &watched {
                    if let Some(hwm) = vm_hwm_kib(pid) {
                        let peak = peaks.entry(pid).or_insert(0);
                        *peak = hwm.max(*peak);
                    }
                }
                if last {
                    return peaks;
                }
                tick += 1;
                thread::sleep(Duration::from_millis(5));
            }
        });
        Sampler { stop, thread }
    }

    /// Call before reaping the launcher (a reaped process has no /proc entry). Peak KiB per process.
    pub fn finish(self) -> BTreeMap<u32, u64> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

fn vm_hwm_kib(pid: u32) -> Option<u64> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn comm(pid: u32) -> String {
    fs::read_to_string(format!("/proc/{pid}/comm")).map(|c| c.trim_end().to_string()).unwrap_or_default()
}

fn children(pid: u32) -> Vec<u32> {
    let list = fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    list.split_whitespace().filter_map(|p| p.parse().ok()).collect()
}

/// Every process of this machine whose command is `name`.
fn named(name: &str) -> BTreeSet<u32> {
    let Ok(dir) = fs::read_dir("/proc") else { return BTreeSet::new() };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).filter(|&pid| comm(pid) == name).collect()
}

/// Every slurmstepd of a job step (not the extern or batch step) now running on this machine.
fn stepds() -> BTreeSet<u32> {
    named("slurmstepd")
        .into_iter()
        .filter(|&pid| {
            let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline);
            !cmdline.contains("extern") && !cmdline.contains("batch")
        })
        .collect()
}

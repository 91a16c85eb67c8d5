//! Side-by-side benchmark: the same PMI-1 workloads, run by `rpmi-probe` as every task, under rpmi-run,
//! `srun --mpi=rpmi`, MPICH's `mpiexec.hydra`, `srun --mpi=pmi2`, a floor server (`floor.rs`) and, where Flux
//! is installed, Flux with rpmi's shell plugin and with its own `pmi-simple`, in one run, interleaved so that
//! the machine's drift hits every server alike. Prints a table and writes a markdown report, the raw runs
//! (JSON) and a plot (PNG, through gnuplot) to the results folder.
//!
//! `bash docker/bench.sh` sets up everything (the local Slurm cluster with the plugin) and runs it; by
//! hand: `cargo bench --features slurm --bench side_by_side -- [--runs 5] [--sizes 64,256,1024]
//! [--servers rpmi-run,rpmi-run-4,srun-rpmi,srun-rpmi-star,hydra,srun-pmi2,floor,flux-rpmi,flux-simple]
//! [--workloads a,b,c]
//! [--slurm-nodes 3] [--barriers 1000] [--out DIR]`. srun must reach a cluster (SLURM_CONF) whose slurmd have
//! `mpi_rpmi.so` in their PluginDir and at least `--slurm-nodes` nodes.
//!
//! `srun-rpmi-star` is the same plugin with a tree as wide as the step (`SLURM_RPMI_TREE_WIDTH` = nodes):
//! every stepd is srun's child, the star that the tree replaced. It is not in the default set, since on 3
//! nodes the default width already makes the star; compare it on many nodes, e.g.
//! `RPMI_SLURM_NODES=100 bash docker/bench.sh --slurm-nodes 100 --servers srun-rpmi,srun-rpmi-star,srun-pmi2
//! --workloads b,c --sizes 200,400 --barriers 100 --out benches/results/slurm-100`.
//!
//! The Flux servers start a 3-broker instance per job (`flux start --test-size=3`, its resources faked to
//! 1024 cores per broker so that any size fits on 3 nodes) and `flux run -N3` in it; `flux-rpmi` needs the
//! plugin installed (`bash docker/flux.sh install`). The figures are rank 0's, from inside the job, so the
//! instance's start is not in them.

mod floor;
mod memory;
mod report;

use memory::{Sampler, Serving};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::PathBuf;
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

const PROBE: &str = env!("CARGO_BIN_EXE_rpmi-probe");
const RPMI_RUN: &str = env!("CARGO_BIN_EXE_rpmi-run");
/// Barriers of workload (c), from `--barriers`.
static BARRIERS: AtomicUsize = AtomicUsize::new(1000);

fn barriers() -> usize {
    BARRIERS.load(Ordering::Relaxed)
}

/// Longest a single job may take before it is killed and recorded as failed.
const JOB_TIMEOUT: Duration = Duration::from_secs(900);

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Server {
    RpmiRun,
    RpmiRun4,
    SrunRpmi,
    SrunRpmiStar,
    Hydra,
    SrunPmi2,
    Floor,
    FluxRpmi,
    FluxSimple,
}

pub const SERVERS: [Server; 9] = [
    Server::RpmiRun,
    Server::RpmiRun4,
    Server::SrunRpmi,
    Server::SrunRpmiStar,
    Server::Hydra,
    Server::SrunPmi2,
    Server::Floor,
    Server::FluxRpmi,
    Server::FluxSimple,
];

/// What runs without `--servers`: all but the star, which on 3 nodes is what `srun-rpmi` runs anyway, and
/// the Flux servers where `flux` is installed.
fn default_servers() -> Vec<Server> {
    let mut servers =
        vec![Server::RpmiRun, Server::RpmiRun4, Server::SrunRpmi, Server::Hydra, Server::SrunPmi2, Server::Floor];
    if Command::new("flux").arg("version").output().is_ok_and(|o| o.status.success()) {
        servers.extend([Server::FluxRpmi, Server::FluxSimple]);
    }
    servers
}

/// Brokers (nodes) of the Flux instance the Flux servers start.
const FLUX_NODES: usize = 3;

/// Nodes of the Slurm cluster the srun servers spread a job over (`-N`), from `--slurm-nodes`.
static SLURM_NODES: AtomicUsize = AtomicUsize::new(3);

pub fn slurm_nodes() -> usize {
    SLURM_NODES.load(Ordering::Relaxed)
}

impl Server {
    pub fn key(self) -> &'static str {
        match self {
            Server::RpmiRun => "rpmi-run",
            Server::RpmiRun4 => "rpmi-run-4",
            Server::SrunRpmi => "srun-rpmi",
            Server::SrunRpmiStar => "srun-rpmi-star",
            Server::Hydra => "hydra",
            Server::SrunPmi2 => "srun-pmi2",
            Server::Floor => "floor",
            Server::FluxRpmi => "flux-rpmi",
            Server::FluxSimple => "flux-simple",
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Server::RpmiRun => "rpmi-run",
            Server::RpmiRun4 => "rpmi-run --nodes 4",
            Server::SrunRpmi => "srun --mpi=rpmi",
            Server::SrunRpmiStar => "srun --mpi=rpmi, star",
            Server::Hydra => "mpiexec.hydra",
            Server::SrunPmi2 => "srun --mpi=pmi2",
            Server::Floor => "floor",
            Server::FluxRpmi => "flux run -o pmi=rpmi",
            Server::FluxSimple => "flux run, pmi-simple",
        }
    }

    /// The server this one is compared with in the tables: each resource manager's own PMI with rpmi's
    /// plugin in it, the rest with rpmi-run.
    pub fn reference(self) -> Option<Server> {
        match self {
            Server::RpmiRun | Server::SrunRpmi | Server::FluxRpmi => None,
            Server::SrunPmi2 | Server::SrunRpmiStar => Some(Server::SrunRpmi),
            Server::FluxSimple => Some(Server::FluxRpmi),
            _ => Some(Server::RpmiRun),
        }
    }

    /// Nodes a job is spread over.
    pub fn nodes(self) -> usize {
        match self {
            Server::RpmiRun4 => 4,
            Server::SrunRpmi | Server::SrunRpmiStar | Server::SrunPmi2 => slurm_nodes(),
            Server::FluxRpmi | Server::FluxSimple => FLUX_NODES,
            _ => 1,
        }
    }

    fn serving(self) -> Serving {
        match self {
            Server::RpmiRun | Server::Floor => Serving::Launcher,
            Server::RpmiRun4 => Serving::Shells { nodes: self.nodes() },
            Server::Hydra => Serving::HydraProxy,
            Server::SrunRpmi | Server::SrunRpmiStar | Server::SrunPmi2 => Serving::Stepds { nodes: slurm_nodes() },
            Server::FluxRpmi | Server::FluxSimple => Serving::FluxShells { nodes: FLUX_NODES },
        }
    }

    /// Whether the serving processes are rpmi's, each holding one complete key-value store, and so held to
    /// rpmi's memory bound.
    pub fn is_rpmi(self) -> bool {
        matches!(self, Server::RpmiRun | Server::RpmiRun4 | Server::SrunRpmi | Server::SrunRpmiStar | Server::FluxRpmi)
    }

    /// Tasks served by the busiest serving process.
    pub fn local_tasks(self, size: usize) -> usize {
        match self.serving() {
            Serving::Stepds { nodes } | Serving::Shells { nodes } | Serving::FluxShells { nodes } => {
                size.div_ceil(nodes)
            }
            _ => size,
        }
    }

    fn command(self, size: usize, probe_args: &[impl AsRef<std::ffi::OsStr>]) -> Command {
        let n = size.to_string();
        let mut command = match self {
            Server::RpmiRun | Server::RpmiRun4 => {
                let mut c = Command::new(RPMI_RUN);
                c.args(["-n", &n, "--nodes", &self.nodes().to_string()]);
                c
            }
            Server::SrunRpmi | Server::SrunRpmiStar | Server::SrunPmi2 => {
                let mpi = if self == Server::SrunPmi2 { "--mpi=pmi2" } else { "--mpi=rpmi" };
                let mut c = Command::new("srun");
                c.args(["-Q", mpi, "-O", &format!("-N{}", slurm_nodes()), &format!("-n{n}")]);
                // The site's and the user's width would make the default server something else.
                c.env_remove("SLURM_RPMI_TREE_WIDTH");
                if self == Server::SrunRpmiStar {
                    c.env("SLURM_RPMI_TREE_WIDTH", slurm_nodes().to_string());
                }
                c
            }
            Server::Hydra => {
                let mut c = Command::new("mpiexec.hydra");
                c.args(["-n", &n]);
                c
            }
            Server::Floor => {
                let mut c = Command::new(std::env::current_exe().expect("the benchmark's own path"));
                c.args(["floor", &n]);
                c
            }
            Server::FluxRpmi | Server::FluxSimple => {
                let pmi = if self == Server::FluxRpmi { "pmi=rpmi" } else { "pmi=simple" };
                let mut c = Command::new("flux");
                c.args(["start", &format!("--test-size={FLUX_NODES}"), "--config-path"]).arg(flux_config());
                c.args(["flux", "run", &format!("-N{FLUX_NODES}"), &format!("-n{n}"), "-o", "cpu-affinity=off"]);
                c.args(["-o", pmi]);
                c
            }
        };
        command.arg(PROBE).args(probe_args);
        command
    }
}

/// The configuration of the Flux instances: resources faked to 1024 cores on each of the brokers, all on this
/// machine (`flux R encode`; `noverify`, since the machine has fewer), written once into the temp dir.
fn flux_config() -> &'static std::path::Path {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("side_by_side-flux-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("the Flux config dir");
        let host =
            String::from_utf8_lossy(&Command::new("hostname").output().expect("hostname").stdout).trim().to_string();
        let hosts = vec![host; FLUX_NODES].join(",");
        let ranks = format!("0-{}", FLUX_NODES - 1);
        let r = Command::new("flux").args(["R", "encode", "-r", &ranks, "-c", "0-1023", "-H", &hosts]).output();
        let r = r.ok().filter(|o| o.status.success()).expect("flux R encode");
        let r_path = dir.join("R.json");
        std::fs::write(&r_path, r.stdout).expect("R.json");
        let toml = format!("[resource]\npath = \"{}\"\nnoverify = true\n", r_path.display());
        std::fs::write(dir.join("resource.toml"), toml).expect("resource.toml");
        dir
    })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Workload {
    /// (a) every rank puts one value of 96 characters, barrier, gets one key of every rank.
    AllToAll,
    /// (b) 8 puts of 800 characters, barrier, 64 gets.
    BusinessCards,
    /// (c) empty barriers (`--barriers`, 1000 unless told).
    Barriers,
}

pub const WORKLOADS: [Workload; 3] = [Workload::AllToAll, Workload::BusinessCards, Workload::Barriers];

impl Workload {
    pub fn key(self) -> &'static str {
        match self {
            Workload::AllToAll => "a",
            Workload::BusinessCards => "b",
            Workload::Barriers => "c",
        }
    }

    pub fn title(self) -> String {
        match self {
            Workload::AllToAll => {
                "(a) all-to-all: 1 put of 96 chars, barrier, a get of every rank's key, barrier".into()
            }
            Workload::BusinessCards => "(b) business cards: 8 puts of 800 chars, barrier, 64 gets, barrier".into(),
            Workload::Barriers => format!("(c) {} empty barriers", barriers()),
        }
    }

    /// Puts per rank, characters per value and gets per rank (`None`: one of every rank) of an exchange
    /// workload; `None` for (c).
    fn exchange(self) -> Option<(usize, usize, Option<usize>)> {
        match self {
            Workload::AllToAll => Some((1, 96, None)),
            Workload::BusinessCards => Some((8, 800, Some(64))),
            Workload::Barriers => None,
        }
    }

    /// Every rank prints a line (`--times`), not rank 0 alone.
    pub fn prints_per_rank(self) -> bool {
        self.exchange().is_some()
    }

    fn probe_args(self) -> Vec<String> {
        let Some((puts, len, gets)) = self.exchange() else {
            return vec!["barrier".into(), "--count".into(), barriers().to_string()];
        };
        let mut args = ["exchange", "--puts", &puts.to_string(), "--size", &len.to_string()].map(String::from).to_vec();
        if let Some(gets) = gets {
            args.extend(["--count".to_string(), gets.to_string()]);
        }
        // Values are not verified while timing, so every server (the floor too) costs the client the same.
        args.push("--no-verify".to_string());
        args.push("--times".to_string());
        args
    }

    /// Bytes of keys and values one complete key-value store holds after the workload's puts.
    pub fn kvs_bytes(self, size: usize) -> u64 {
        let Some((puts, len, _)) = self.exchange() else { return 0 };
        (0..size).flat_map(|r| (0..puts).map(move |i| format!("probe-{r}-{i}").len() + len)).sum::<usize>() as u64
    }
}

/// One job's outcome.
#[derive(Clone, Debug)]
pub struct Run {
    pub server: Server,
    pub workload: Workload,
    pub size: usize,
    /// (a), (b): put+barrier and gets+barrier seconds; (c): mean barrier in seconds (in `put_s`).
    pub put_s: f64,
    pub gets_s: f64,
    /// (a), (b): from the first rank's puts to the last rank out of that barrier, when every rank said.
    pub put_all_s: Option<f64>,
    /// Peak resident set of the busiest serving process (Hydra: mpiexec and its proxy together), KiB.
    pub peak_kib: Option<u64>,
    pub wall_s: f64,
}

impl Run {
    /// The figure the tables rank servers by: the whole exchange, or one barrier.
    pub fn time_s(&self) -> f64 {
        match self.workload {
            Workload::Barriers => self.put_s,
            _ => self.put_s + self.gets_s,
        }
    }
}

struct Job {
    status: i32,
    stdout: String,
    stderr: String,
    peaks: BTreeMap<u32, u64>,
    wall_s: f64,
}

/// Runs one job to its end (or kills it at JOB_TIMEOUT), sampling its serving processes' memory.
fn run_job(server: Server, size: usize, probe_args: &[impl AsRef<std::ffi::OsStr>]) -> Result<Job, String> {
    run(server.command(size, probe_args), server.serving(), server.label())
}

fn run(mut command: Command, serving: Serving, label: &str) -> Result<Job, String> {
    command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let start = Instant::now();
    let mut child = command.spawn().map_err(|e| format!("cannot start {label}: {e}"))?;
    let sampler = Sampler::start(child.id(), serving);
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    let timed_out = !wait_unreaped(&child, JOB_TIMEOUT);
    if timed_out {
        signal(&child, libc::SIGTERM);
        if !wait_unreaped(&child, Duration::from_secs(10)) {
            signal(&child, libc::SIGKILL);
        }
    }
    let peaks = sampler.finish();
    let status = child.wait().map_err(|e| format!("wait: {e}"))?;
    let wall_s = start.elapsed().as_secs_f64();
    let mut job = Job {
        status: status.code().unwrap_or(128),
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
        peaks,
        wall_s,
    };
    if timed_out {
        job.stderr.push_str(&format!("\nkilled after {} s", JOB_TIMEOUT.as_secs()));
        job.status = job.status.max(1);
    }
    Ok(job)
}

fn drain(pipe: Option<impl Read + Send + 'static>) -> thread::JoinHandle<String> {
    thread::spawn(move || {
        let mut text = String::new();
        if let Some(mut pipe) = pipe {
            let _ = pipe.read_to_string(&mut text);
        }
        text
    })
}

/// Waits up to `limit` for the child to exit without reaping it, so that /proc still shows its memory.
fn wait_unreaped(child: &Child, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        // SAFETY: waitid fills a zeroed siginfo_t that lives across the call.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        let flags = libc::WEXITED | libc::WNOWAIT | libc::WNOHANG;
        let rc = unsafe { libc::waitid(libc::P_PID, child.id(), &mut info, flags) };
        // SAFETY: si_pid is set by waitid when a child changed state, and zero otherwise.
        if rc == 0 && unsafe { info.si_pid() } != 0 {
            return true;
        }
        if rc != 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return true; // nothing to wait for: wait() below reports it
        }
        if Instant::now() >= deadline {
            return false;
        }
        thread::sleep(Duration::from_millis(5));
    }
}

fn signal(child: &Child, signal: i32) {
    // SAFETY: kill on our own unreaped child's pid.
    unsafe { libc::kill(child.id() as i32, signal) };
}

/// Reads rank 0's result line.
fn parse_result(workload: Workload, stdout: &str) -> Option<(f64, f64)> {
    let field = |line: &str, name: &str| -> Option<f64> {
        line.split_whitespace().find_map(|t| t.strip_prefix(name)?.strip_prefix('=')?.parse().ok())
    };
    match workload {
        Workload::Barriers => {
            let line = stdout.lines().find(|l| l.starts_with("barrier: "))?;
            Some((field(line, "mean_us")? * 1e-6, 0.0))
        }
        _ => {
            let line = stdout.lines().find(|l| l.starts_with("exchange: "))?;
            Some((field(line, "put+barrier_s")?, field(line, "gets+barrier_s")?))
        }
    }
}

/// From the first rank's puts to the last rank out of the barrier after them, from every rank's
/// `exchange-times:` line (`rpmi-probe exchange --times`); `None` unless each of the `size` ranks gave one.
/// Every server here runs all its tasks on this one machine, so their monotonic clocks are one clock.
fn exchange_span(stdout: &str, size: usize) -> Option<f64> {
    let field = |line: &str, name: &str| -> Option<u64> {
        line.split_whitespace().find_map(|t| t.strip_prefix(name)?.strip_prefix('=')?.parse().ok())
    };
    let mut said = vec![false; size];
    let (mut first, mut last) = (u64::MAX, 0);
    for line in stdout.lines().filter_map(|l| l.strip_prefix("exchange-times: ")) {
        let rank = usize::try_from(field(line, "rank")?).ok()?;
        if std::mem::replace(said.get_mut(rank)?, true) {
            return None;
        }
        first = first.min(field(line, "put_began_ns")?);
        last = last.max(field(line, "put_ended_ns")?);
    }
    (said.iter().all(|&s| s) && last >= first).then(|| (last - first) as f64 * 1e-9)
}

/// A resource manager whose own processes serve some servers' tasks: Slurm's stepds, Flux's shells. What they
/// grow by per task without any PMI is taken out of those servers' memory per task.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Manager {
    Slurm,
    Flux,
}

/// A task of the manager's own baseline that prints a line as long as the probe's `exchange-times:` line, as
/// every rank of the exchange workloads does (`--times`), then lives a second.
const TASK_PRINTING: [&str; 3] =
    ["sh", "-c", "echo exchange-times: rank=0 put_began_ns=0000000000000 put_ended_ns=0000000000000; sleep 1"];
/// One that prints nothing, as all but rank 0 of the barrier workload.
const TASK_SILENT: [&str; 2] = ["sleep", "1"];

impl Manager {
    fn of(server: Server) -> Option<Manager> {
        match server.serving() {
            Serving::Stepds { .. } => Some(Manager::Slurm),
            Serving::FluxShells { .. } => Some(Manager::Flux),
            _ => None,
        }
    }

    /// What the report calls the job without PMI.
    pub fn label(self) -> &'static str {
        match self {
            Manager::Slurm => "Busiest slurmstepd of an `srun --mpi=none` step",
            Manager::Flux => "Busiest flux-shell of a `flux run -o pmi=none` job",
        }
    }

    fn nodes(self) -> usize {
        match self {
            Manager::Slurm => slurm_nodes(),
            Manager::Flux => FLUX_NODES,
        }
    }

    /// The peak of its busiest serving process for a job of `size` tasks without PMI, which live long enough
    /// for the sampler to find every one and, where `printing`, print a line each as the probe's ranks do:
    /// the manager's buffers for a task's output are its own memory (Flux's grow to 4 MiB of address space
    /// as a task writes, a few pages of it resident). The median over `runs` jobs: like the idle
    /// baseline's, one job's figure moves by a few hundred KiB.
    fn own_peak(self, size: usize, printing: bool, runs: usize) -> Result<Option<u64>, String> {
        median_peak(runs, || self.one_own_peak(size, printing))
    }

    fn one_own_peak(self, size: usize, printing: bool) -> Result<Option<u64>, String> {
        let n = format!("-n{size}");
        let task: &[&str] = if printing { &TASK_PRINTING } else { &TASK_SILENT };
        let (command, serving) = match self {
            Manager::Slurm => {
                let mut c = Command::new("srun");
                c.args(["-Q", "--mpi=none", "-O", &format!("-N{}", slurm_nodes()), &n]).args(task);
                (c, Serving::Stepds { nodes: slurm_nodes() })
            }
            Manager::Flux => {
                let mut c = Command::new("flux");
                c.args(["start", &format!("--test-size={FLUX_NODES}"), "--config-path"]).arg(flux_config());
                c.args(["flux", "run", &format!("-N{FLUX_NODES}"), &n, "-o", "cpu-affinity=off", "-o", "pmi=none"]);
                c.args(task);
                (c, Serving::FluxShells { nodes: FLUX_NODES })
            }
        };
        let job = run(command, serving, self.label())?;
        if job.status != 0 {
            return Err(format!("{} at N={size} failed (exit {}): {}", self.label(), job.status, job.stderr));
        }
        Ok(job.peaks.values().copied().max())
    }
}

/// What a serving process holds before the workload's own memory: the same server with one task per
/// node, and for the servers run by Slurm's or Flux's own processes their own memory per task.
pub struct Baseline {
    idle: BTreeMap<Server, Option<u64>>,
    /// Peak of the busiest serving process of a job without PMI of this many tasks, each printing a line or
    /// not, KiB.
    own: BTreeMap<(Manager, usize, bool), Option<u64>>,
}

impl Baseline {
    /// The peaks without PMI by manager, size and whether every task printed, for the report.
    pub fn own(&self) -> impl Iterator<Item = (Manager, usize, bool, Option<u64>)> + '_ {
        self.own.iter().map(|(&(m, n, printing), &peak)| (m, n, printing, peak))
    }

    /// KiB the serving process grew by for `workload` at `size`, beyond what its resource manager itself
    /// grows by.
    pub fn growth_kib(&self, server: Server, workload: Workload, size: usize, peak_kib: u64) -> Option<u64> {
        let idle = (*self.idle.get(&server)?)?;
        let own = match Manager::of(server) {
            Some(m) => {
                let own = |n| self.own.get(&(m, n, workload.prints_per_rank())).copied().flatten();
                own(size)?.saturating_sub(own(m.nodes())?)
            }
            None => 0,
        };
        Some(peak_kib.saturating_sub(idle).saturating_sub(own))
    }
}

/// The median of `runs` jobs' memory figures (KiB), each from `one`; jobs without a figure are left out.
fn median_peak(runs: usize, mut one: impl FnMut() -> Result<Option<u64>, String>) -> Result<Option<u64>, String> {
    let mut peaks = Vec::with_capacity(runs);
    for _ in 0..runs {
        peaks.extend(one()?.map(|kib| kib as f64));
    }
    Ok(report::median(peaks).map(|kib| kib as u64))
}

/// The memory figure of a job: the busiest serving process, or Hydra's two together.
fn peak_of(server: Server, peaks: &BTreeMap<u32, u64>) -> Option<u64> {
    match server {
        Server::Hydra => (peaks.len() >= 2).then(|| peaks.values().sum()),
        _ => peaks.values().copied().max(),
    }
}

fn fail(server: Server, size: usize, what: &str, job: &Job) -> String {
    let lines: Vec<&str> = job.stderr.lines().collect();
    let tail = lines[lines.len().saturating_sub(8)..].join("\n");
    format!(
        "{} -n {size} ({what}) failed with status {}:\n{tail}\n{}",
        server.label(),
        job.status,
        job.stdout.trim_end()
    )
}

pub struct Config {
    pub runs: usize,
    pub sizes: Vec<usize>,
    pub servers: Vec<Server>,
    pub workloads: Vec<Workload>,
    pub out: PathBuf,
}

fn parse_list<T: Copy>(text: &str, all: &[T], key: impl Fn(T) -> String) -> Result<Vec<T>, String> {
    text.split(',')
        .map(|k| all.iter().copied().find(|&x| key(x) == k).ok_or_else(|| format!("unknown `{k}`")))
        .collect()
}

fn count(option: &str, text: &str) -> Result<usize, String> {
    text.parse().ok().filter(|&n| n > 0).ok_or_else(|| format!("{option} wants a number of 1 or more"))
}

fn parse_args(args: &[String]) -> Result<Config, String> {
    let mut config = Config {
        runs: 5,
        sizes: vec![64, 256, 1024],
        servers: default_servers(),
        workloads: WORKLOADS.to_vec(),
        out: PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/benches/results")),
    };
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        // cargo bench passes --bench to every benchmark program.
        if arg == "--bench" {
            continue;
        }
        let mut value = || args.next().ok_or_else(|| format!("{arg} needs a value"));
        match arg.as_str() {
            "--runs" => config.runs = value()?.parse().map_err(|_| "--runs wants a number".to_string())?,
            "--sizes" => {
                config.sizes = value()?
                    .split(',')
                    .map(|n| n.parse().map_err(|_| format!("bad size `{n}`")))
                    .collect::<Result<_, _>>()?
            }
            "--servers" => config.servers = parse_list(value()?, &SERVERS, |s| s.key().to_string())?,
            "--workloads" => config.workloads = parse_list(value()?, &WORKLOADS, |w| w.key().to_string())?,
            "--out" => config.out = PathBuf::from(value()?),
            "--slurm-nodes" => SLURM_NODES.store(count(arg, value()?)?, Ordering::Relaxed),
            "--barriers" => BARRIERS.store(count(arg, value()?)?, Ordering::Relaxed),
            _ => return Err(format!("unknown argument `{arg}`")),
        }
    }
    if config.runs == 0 || config.sizes.iter().any(|&n| n < slurm_nodes()) {
        return Err(format!("--runs must be at least 1 and every size at least --slurm-nodes ({})", slurm_nodes()));
    }
    Ok(config)
}

/// Allows as many open files as the hard limit: 1024 tasks need more than the usual 1024 descriptors in
/// the serving process, and every launcher inherits this.
fn raise_open_files() {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: get/setrlimit on a live struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}

fn benchmark(config: &Config) -> Result<(), String> {
    raise_open_files();
    let mut idle = BTreeMap::new();
    eprintln!("checking every server: a verified exchange at 64 tasks, and its memory with one task per node");
    for &server in &config.servers {
        // The floor has no store: what it answers cannot be verified.
        let verify = if server == Server::Floor { &["--no-verify"][..] } else { &[] };
        let job = run_job(server, 64, &[&["exchange", "--size", "96"], verify].concat())?;
        if job.status != 0 || parse_result(Workload::AllToAll, &job.stdout).is_none() {
            return Err(fail(server, 64, "verified exchange", &job));
        }
        // Long enough (about half a second, with the default --barriers) for the sampler to see the serving
        // process settled. A process's
        // resident set at rest varies by a few hundred KiB from run to run (rpmi-run's shells inherit the
        // launcher's at fork), so the baseline is a median over as many runs as each cell has.
        let peak = median_peak(config.runs, || {
            let idle = (2 * barriers()).to_string();
            let job = run_job(server, server.nodes(), &["barrier", "--count", &idle])?;
            if job.status != 0 {
                return Err(fail(server, server.nodes(), "idle", &job));
            }
            Ok(peak_of(server, &job.peaks))
        })?;
        idle.insert(server, peak);
    }
    let mut own = BTreeMap::new();
    for manager in [Manager::Slurm, Manager::Flux] {
        if config.servers.iter().any(|&s| Manager::of(s) == Some(manager)) {
            eprintln!("{manager:?}'s own memory: a job without PMI of each size");
            let mut printing: Vec<bool> = config.workloads.iter().map(|w| w.prints_per_rank()).collect();
            printing.sort();
            printing.dedup();
            for &size in config.sizes.iter().chain(&[manager.nodes()]) {
                for &p in &printing {
                    own.insert((manager, size, p), manager.own_peak(size, p, config.runs)?);
                }
            }
        }
    }
    let baseline = Baseline { idle, own };
    let mut runs = Vec::new();
    for &workload in &config.workloads {
        for &size in &config.sizes {
            for rep in 1..=config.runs {
                for &server in &config.servers {
                    let job = run_job(server, size, &workload.probe_args())?;
                    let Some((put_s, gets_s)) = parse_result(workload, &job.stdout).filter(|_| job.status == 0) else {
                        return Err(fail(server, size, workload.key(), &job));
                    };
                    let run = Run {
                        server,
                        workload,
                        size,
                        put_s,
                        gets_s,
                        put_all_s: exchange_span(&job.stdout, size),
                        peak_kib: peak_of(server, &job.peaks),
                        wall_s: job.wall_s,
                    };
                    eprintln!(
                        "({}) n={size:<5} run {rep}/{}  {:<20} {:>10.4} s  peak {:>8} KiB  (job {:.1} s)",
                        workload.key(),
                        config.runs,
                        server.label(),
                        run.time_s(),
                        run.peak_kib.map_or("?".to_string(), |k| k.to_string()),
                        run.wall_s
                    );
                    runs.push(run);
                }
            }
        }
    }
    report::write(config, &runs, &baseline)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // The floor server, started by the benchmark itself: `floor N PROGRAM ARGS...`.
    if args.first().map(String::as_str) == Some("floor") {
        let (Some(size), Some(program)) = (args.get(1).and_then(|n| n.parse().ok()), args.get(2)) else {
            eprintln!("usage: side_by_side floor N PROGRAM [ARGS]...");
            return ExitCode::from(2);
        };
        return match floor::serve(size, program, &args[3..]) {
            Ok(status) => ExitCode::from(status.clamp(0, 255) as u8),
            Err(e) => {
                eprintln!("floor: {e}");
                ExitCode::FAILURE
            }
        };
    }
    match parse_args(&args).and_then(|config| benchmark(&config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("side_by_side: {e}");
            ExitCode::FAILURE
        }
    }
}

//! The client libraries against clients written on the wire: `benches/libpmi/pmi_bench.c` built six ways
//! (rpmi's `libpmi.so.0` and `libpmi2.so.0`, the anchors' libraries: Flux's `libpmi.so.0` where flux-core is
//! installed and Slurm's `libpmi2.so.0`, and PMI-1 lines and PMI-2 frames written by hand, which send what
//! the libraries send) runs the same work under rpmi-run, `srun --mpi=rpmi`
//! and Slurm's `srun --mpi=pmi2`: a start-up (init, a put, a fence, a get of every rank's key) and a loop of
//! gets after the fence; the same for a job of one task under rpmi-run, with many more gets (the steadiest
//! figure of what a call costs), and that job's start-up alone, many times (the steadiest figure of what a
//! start-up costs); and, with no launcher, what starting a process linked against each library costs (the
//! program returns at once). Runs are interleaved (each round runs every cell once) so that the machine's drift
//! hits every client alike. Prints a table of medians, each library over the hand-written client of its version
//! under the same server, with the 95% interval of that ratio (and rpmi's start-up over the anchors' library),
//! then each library's ratio across the cells (their geometric mean, with its interval), and writes it to
//! `--out` (markdown) with every run beside it (JSON).
//!
//! `bash docker/bench-libpmi.sh` sets up everything (the libraries, the local Slurm cluster with the
//! plugin) and runs it; by hand, after `cargo build --release` (the libraries):
//! `cargo bench --features slurm --bench libpmi -- [--sizes 2,16] [--runs 21] [--gets 2000]
//! [--steady-gets 30000] [--startups 10] [--servers rpmi-run,srun-rpmi,srun-pmi2] [--out benches/results/libpmi.md]`.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

const RPMI_RUN: &str = env!("CARGO_BIN_EXE_rpmi-run");
/// Longest one job may take before it is killed and recorded as failed.
const JOB_TIMEOUT: Duration = Duration::from_secs(120);
/// Where Debian's `libpmi2-0` (Slurm's PMI-2 client library) keeps it.
const SLURM_LIBPMI2: &str = "/usr/lib/x86_64-linux-gnu/libpmi2.so.0";
/// The most rpmi's libraries may cost over the hand-written client of their version, per get and for the
/// start-up: the median CPU time's ratio alone, the geometric mean of the cells' across them (see [`Pooled`]).
const TARGET: f64 = 1.10;
/// Processes started, one after another, to time one start of a program (each round).
const STARTS: usize = 100;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Server {
    RpmiRun,
    SrunRpmi,
    SrunPmi2,
}

impl Server {
    fn name(self) -> &'static str {
        match self {
            Server::RpmiRun => "rpmi-run",
            Server::SrunRpmi => "srun-rpmi",
            Server::SrunPmi2 => "srun-pmi2",
        }
    }
}

/// Who speaks for the task: a library, or the hand-written wire client it is measured against.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Client {
    Raw1,
    Libpmi,
    Raw2,
    Libpmi2,
    SlurmLibpmi2,
    FluxLibpmi,
}

/// Every client, in the order of the tables; Flux's library only where flux-core is installed ([`flux_libpmi`]).
const CLIENTS: [Client; 6] =
    [Client::Raw1, Client::Libpmi, Client::FluxLibpmi, Client::Raw2, Client::Libpmi2, Client::SlurmLibpmi2];

/// Flux's `libpmi.so.0` (its PMI-1 client, a C library: the anchor beside rpmi's `libpmi`), where flux-core is
/// installed: its `flux-pmi.pc` puts it in `<libdir>/flux`.
fn flux_libpmi() -> Option<PathBuf> {
    let out = Command::new("pkg-config").args(["--variable=libdir", "flux-pmi"]).output().ok()?;
    let lib = Path::new(String::from_utf8(out.stdout).ok()?.trim()).join("flux/libpmi.so.0");
    (out.status.success() && lib.exists()).then_some(lib)
}

impl Client {
    fn name(self) -> &'static str {
        match self {
            Client::Raw1 => "PMI-1 by hand",
            Client::Libpmi => "rpmi libpmi",
            Client::Raw2 => "PMI-2 by hand",
            Client::Libpmi2 => "rpmi libpmi2",
            Client::SlurmLibpmi2 => "Slurm libpmi2",
            Client::FluxLibpmi => "Flux libpmi",
        }
    }

    /// `pmi_bench.c`'s `CLIENT`.
    fn build_as(self) -> u32 {
        match self {
            Client::Raw1 => 11,
            Client::Libpmi | Client::FluxLibpmi => 1,
            Client::Raw2 => 12,
            Client::Libpmi2 | Client::SlurmLibpmi2 => 2,
        }
    }

    /// The library the anchors ship for the same PMI version, shown beside rpmi's for the start-up: a
    /// start-up's first calls run a library's code for the first time, which costs any library some µs over a
    /// client written inline (the anchors' libraries' own "× hand" shows it).
    fn anchor(self) -> Option<Client> {
        match self {
            Client::Libpmi => Some(Client::FluxLibpmi),
            Client::Libpmi2 => Some(Client::SlurmLibpmi2),
            _ => None,
        }
    }

    /// The hand-written client this one is measured against (itself for those).
    fn raw(self) -> Client {
        match self {
            Client::Raw1 | Client::Libpmi | Client::FluxLibpmi => Client::Raw1,
            _ => Client::Raw2,
        }
    }
}

struct Args {
    sizes: Vec<usize>,
    runs: usize,
    gets: usize,
    /// Gets of the steady measure: one task alone under rpmi-run (0: none).
    steady_gets: usize,
    /// Start-ups alone (a job of one task under rpmi-run, no gets) of each client in each round.
    startups: usize,
    servers: Vec<Server>,
    out: PathBuf,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        sizes: vec![2, 16],
        runs: 21,
        gets: 2000,
        steady_gets: 30_000,
        startups: 10,
        servers: vec![Server::RpmiRun, Server::SrunRpmi, Server::SrunPmi2],
        out: PathBuf::from("benches/results/libpmi.md"),
    };
    let mut it = std::env::args().skip(1).filter(|a| a != "--bench");
    while let Some(a) = it.next() {
        let mut value = || it.next().ok_or(format!("{a} needs a value"));
        let number = |v: &str| v.parse::<usize>().map_err(|_| format!("{a}: {v} is not a number"));
        match a.as_str() {
            "--sizes" => args.sizes = value()?.split(',').map(number).collect::<Result<_, _>>()?,
            "--runs" => args.runs = number(&value()?)?,
            "--gets" => args.gets = number(&value()?)?,
            "--steady-gets" => args.steady_gets = number(&value()?)?,
            "--startups" => args.startups = number(&value()?)?,
            "--servers" => {
                args.servers = value()?
                    .split(',')
                    .map(|s| {
                        [Server::RpmiRun, Server::SrunRpmi, Server::SrunPmi2]
                            .into_iter()
                            .find(|x| x.name() == s)
                            .ok_or(format!("--servers: no server {s}"))
                    })
                    .collect::<Result<_, _>>()?
            }
            "--out" => args.out = PathBuf::from(value()?),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if args.runs == 0 || args.sizes.contains(&0) {
        return Err("--runs and --sizes must be positive".into());
    }
    Ok(args)
}

/// The programs, one per client, in a directory of their own: each library client finds its library by its
/// soname through a directory on its run path that holds only a copy of that library.
struct Programs {
    dir: PathBuf,
    /// The clients built: every one of [`CLIENTS`] but Flux's library where flux-core is not installed.
    clients: Vec<Client>,
    /// Each library client's library, as the program names the file it loaded (its real path).
    libraries: Vec<(Client, PathBuf)>,
}

impl Programs {
    fn build(dir: &Path) -> Result<Programs, String> {
        let mut libraries = Vec::new();
        let profile = std::env::current_exe().map_err(|e| e.to_string())?;
        let profile = profile.parent().and_then(Path::parent).ok_or("no profile directory")?;
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let flux = flux_libpmi();
        if flux.is_none() {
            eprintln!("libpmi bench: no flux-core (pkg-config flux-pmi): Flux's libpmi is left out");
        }
        let clients: Vec<Client> = CLIENTS.into_iter().filter(|&c| c != Client::FluxLibpmi || flux.is_some()).collect();
        for &client in &clients {
            let libs = dir.join(format!("{client:?}-lib"));
            std::fs::create_dir_all(&libs).map_err(|e| e.to_string())?;
            let mut cc = Command::new("cc");
            cc.args(["-O2", "-Wall", "-Wextra", "-Werror"])
                .arg(format!("-DCLIENT={}", client.build_as()))
                .arg("-o")
                .arg(dir.join(format!("{client:?}")))
                .arg(root.join("benches/libpmi/pmi_bench.c"));
            let (crate_dir, built) = match client {
                Client::Raw1 | Client::Raw2 => (None, None),
                Client::Libpmi => (Some("crates/libpmi"), Some(profile.join("libpmi.so"))),
                Client::Libpmi2 => (Some("crates/libpmi2"), Some(profile.join("libpmi2.so"))),
                Client::SlurmLibpmi2 => (Some("crates/libpmi2"), Some(PathBuf::from(SLURM_LIBPMI2))),
                Client::FluxLibpmi => (Some("crates/libpmi"), flux.clone()),
            };
            if let (Some(crate_dir), Some(built)) = (crate_dir, built) {
                if !built.exists() {
                    return Err(format!(
                        "{} is missing (`cargo build --release`; Debian's libpmi2-0)",
                        built.display()
                    ));
                }
                let soname = if client.build_as() == 1 { "libpmi.so.0" } else { "libpmi2.so.0" };
                // A copy, as a package lays a file down: the file a linker wrote sits in the page cache as it
                // was written, and a process's start-up through it costs some µs more here than through the
                // same bytes copied (the anchors' libraries are installed files).
                let copy = libs.join(soname);
                std::fs::copy(&built, &copy).map_err(|e| format!("copying {}: {e}", built.display()))?;
                libraries.push((client, std::fs::canonicalize(&copy).map_err(|e| e.to_string())?));
                cc.arg(format!("-I{}", root.join(crate_dir).join("include").display()))
                    .arg(format!("-L{}", libs.display()))
                    .arg(format!("-l:{soname}"))
                    .arg("-ldl")
                    .arg(format!("-Wl,-rpath,{}", libs.display()));
            }
            let out = cc.output().map_err(|e| format!("cc: {e}"))?;
            if !out.status.success() {
                return Err(format!("cc -DCLIENT={}: {}", client.build_as(), String::from_utf8_lossy(&out.stderr)));
            }
        }
        Ok(Programs { dir: dir.to_path_buf(), clients, libraries })
    }

    fn path(&self, client: Client) -> PathBuf {
        self.dir.join(format!("{client:?}"))
    }

    /// What the program must say it loaded: its library, or none.
    fn library(&self, client: Client) -> String {
        self.libraries.iter().find(|(c, _)| *c == client).map_or("none".into(), |(_, p)| p.display().to_string())
    }
}

/// The command that runs `program` as `size` tasks under `server` (srun over 3 nodes, or as many as tasks).
/// A job that outlives [`JOB_TIMEOUT`] is killed (by timeout(1)) and counts as failed.
fn command(server: Server, size: usize, program: &Path, gets: usize) -> Command {
    let mut c = Command::new("timeout");
    c.args(["--kill-after=5", &JOB_TIMEOUT.as_secs().to_string()]);
    match server {
        Server::RpmiRun => c.args([RPMI_RUN, "-n", &size.to_string()]),
        Server::SrunRpmi | Server::SrunPmi2 => {
            let mpi = if server == Server::SrunRpmi { "rpmi" } else { "pmi2" };
            c.args(["srun", "-Q", &format!("--mpi={mpi}"), &format!("-N{}", size.min(3)), &format!("-n{size}")])
        }
    };
    c.arg(program).arg(gets.to_string());
    c
}

/// Rank 0's figures and the library that spoke, from its line.
#[derive(Clone, Debug)]
struct Figures {
    /// When it ran: its round, and its turn in the round for a series run several times a round. The runs of
    /// two clients in one slot are paired (see [`interval`]).
    slot: usize,
    startup_us: f64,
    gets_us: f64,
    startup_cpu_us: f64,
    gets_cpu_us: f64,
    library: String,
}

fn run_once(mut c: Command) -> Result<Figures, String> {
    let child = c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().map_err(|e| e.to_string())?;
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!("{}: {}{}", out.status, stdout, String::from_utf8_lossy(&out.stderr)));
    }
    let line = stdout.lines().find(|l| l.starts_with("startup_us=")).ok_or(format!("no figures: {stdout}"))?;
    let field = |k: &str| line.split(' ').find_map(|w| w.strip_prefix(k)).ok_or(format!("no {k} in {line}"));
    let number = |k: &str| field(k)?.parse::<f64>().map_err(|_| format!("{k} in {line}"));
    Ok(Figures {
        slot: 0,
        startup_us: number("startup_us=")?,
        gets_us: number("gets_us=")?,
        startup_cpu_us: number("startup_cpu_us=")?,
        gets_cpu_us: number("gets_cpu_us=")?,
        library: field("lib=")?.into(),
    })
}

/// Microseconds to start and end the program once, with no launcher and no PMI: the mean of [`STARTS`].
fn time_starts(program: &Path) -> Result<f64, String> {
    let t = Instant::now();
    for _ in 0..STARTS {
        let status = Command::new(program).arg("load").status().map_err(|e| e.to_string())?;
        if !status.success() {
            return Err(format!("{} load: {status}", program.display()));
        }
    }
    Ok(t.elapsed().as_secs_f64() * 1e6 / STARTS as f64)
}

/// `0..n` in an order of round `round`'s own, the same in every run of the benchmark (a Fisher-Yates shuffle
/// by a linear congruential generator): no client always runs right after another.
fn shuffled(n: usize, round: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut x = 0x9e37_79b9_7f4a_7c15_u64 ^ round as u64;
    for i in (1..n).rev() {
        order.swap(i, next_below(&mut x, i + 1));
    }
    order
}

/// The next number below `n` from the linear congruential generator whose state is `x` (the same sequence in
/// every run of the benchmark).
fn next_below(x: &mut u64, n: usize) -> usize {
    *x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
    (*x >> 33) as usize % n
}

fn median(mut xs: Vec<f64>) -> Option<f64> {
    xs.sort_by(f64::total_cmp);
    (!xs.is_empty()).then(|| xs[xs.len() / 2])
}

/// Resamples drawn for an [`interval`].
const RESAMPLES: usize = 2000;

/// The 95% interval of the ratio of the median of `pairs`' first figures to that of their second, by the
/// bootstrap: each of [`RESAMPLES`] draws as many pairs, with replacement (by [`next_below`]), and takes that
/// ratio; the middle 95% of those. A pair
/// is two clients' runs in one slot, so that what the machine did then weighs on both sides of the ratio.
/// How far the runs' spread leaves the median ratio uncertain: a target within it is not told apart from the
/// median by this many runs.
fn interval(pairs: &[(f64, f64)]) -> Option<(f64, f64)> {
    if pairs.is_empty() {
        return None;
    }
    let mut x = 0x2545_f491_4f6c_dd1d_u64;
    let ratios: Vec<f64> = (0..RESAMPLES)
        .map(|_| {
            let (a, b): (Vec<f64>, Vec<f64>) = (0..pairs.len()).map(|_| pairs[next_below(&mut x, pairs.len())]).unzip();
            median(a).unwrap_or(f64::NAN) / median(b).unwrap_or(f64::NAN)
        })
        .collect();
    Some(middle_95(ratios))
}

/// The bounds of the middle 95% of `draws` (not empty), a bootstrap's interval.
fn middle_95(mut draws: Vec<f64>) -> (f64, f64) {
    draws.sort_by(f64::total_cmp);
    let tail = draws.len() * 25 / 1000;
    (draws[tail], draws[draws.len() - 1 - tail])
}

/// One client's median CPU time over that of the hand-written client it is held to, and the ratio's 95%
/// interval over the slots both ran in.
struct Over {
    cpu: Option<f64>,
    raw_cpu: Option<f64>,
    within: Option<(f64, f64)>,
}

impl Over {
    fn shown(&self) -> String {
        match self.within {
            Some((lo, hi)) => format!("{} ({lo:.2}–{hi:.2})", ratio(self.cpu, self.raw_cpu)),
            None => ratio(self.cpu, self.raw_cpu),
        }
    }

    /// Where rpmi's library `client` misses its target for `what`: the line that says so, with the ratio's
    /// interval, which tells a miss the runs show from one their spread may have made.
    fn missed(&self, client: Client, what: &str, where_: &str) -> Option<String> {
        if !matches!(client, Client::Libpmi | Client::Libpmi2) {
            return None;
        }
        let within = match self.within {
            Some((lo, _)) if lo > TARGET => format!("; 95% interval above {TARGET:.2}, from {lo:.2}"),
            Some((lo, hi)) => format!("; 95% interval {lo:.2}–{hi:.2}"),
            None => String::new(),
        };
        match (self.cpu, self.raw_cpu) {
            (Some(c), Some(r)) if c / r <= TARGET => None,
            _ => Some(format!(
                "{} {where_}: {what} CPU {} of {}'s ({} against {} µs{within})",
                client.name(),
                ratio(self.cpu, self.raw_cpu),
                client.raw().name(),
                shown(self.cpu, 1),
                shown(self.raw_cpu, 1)
            )),
        }
    }
}

/// One client's CPU time over the hand-written client's across every cell (server and size): the geometric mean
/// of the cells' median ratios, and its 95% interval by the bootstrap. A draw takes rounds, with replacement, and
/// the same draw serves every cell (a round ran every cell). Each cell's interval is wide on this machine (where
/// the scheduler put whom spreads a cell's runs): across the cells, what a library costs in these conditions
/// is told apart from the target by many more runs.
struct Pooled {
    ratio: f64,
    within: (f64, f64),
}

impl Pooled {
    fn of(cells: &[Cell], client: Client, figure: Figure, gets: usize) -> Option<Pooled> {
        let per_cell: Vec<Vec<(usize, f64, f64)>> = cells
            .iter()
            .filter(|c| c.client == client)
            .map(|c| {
                let raw = cells.iter().find(|r| r.server == c.server && r.size == c.size && r.client == client.raw());
                raw.map_or_else(Vec::new, |raw| c.pairs(raw, figure, gets))
            })
            .collect();
        if per_cell.is_empty() || per_cell.iter().any(Vec::is_empty) {
            return None;
        }
        let mut slots: Vec<usize> = per_cell.iter().flatten().map(|&(slot, _, _)| slot).collect();
        slots.sort_unstable();
        slots.dedup();
        // The geometric mean of the cells' median ratios, each cell's runs taken as often as `times` says of
        // their slot.
        let mean = |times: &dyn Fn(usize) -> usize| -> f64 {
            let logs: f64 = per_cell
                .iter()
                .map(|pairs| {
                    let drawn = || pairs.iter().flat_map(|&(slot, a, b)| std::iter::repeat_n((a, b), times(slot)));
                    let mine = median(drawn().map(|(a, _)| a).collect()).unwrap_or(f64::NAN);
                    let raw = median(drawn().map(|(_, b)| b).collect()).unwrap_or(f64::NAN);
                    (mine / raw).ln()
                })
                .sum();
            (logs / per_cell.len() as f64).exp()
        };
        let mut x = 0x2545_f491_4f6c_dd1d_u64;
        // A draw that leaves a cell none of its runs (one whose runs failed in most rounds) is drawn again.
        let mut draw = || {
            let mut times = vec![0; slots.len()];
            for _ in 0..slots.len() {
                times[next_below(&mut x, slots.len())] += 1;
            }
            mean(&|slot| slots.binary_search(&slot).map_or(0, |i| times[i]))
        };
        let means: Vec<f64> = (0..RESAMPLES).filter_map(|_| (0..100).map(|_| draw()).find(|m| m.is_finite())).collect();
        if means.len() < RESAMPLES / 2 {
            return None;
        }
        Some(Pooled { ratio: mean(&|_| 1), within: middle_95(means) })
    }

    fn shown(&self) -> String {
        format!("{:.2} ({:.2}–{:.2})", self.ratio, self.within.0, self.within.1)
    }

    /// Where rpmi's library `client` misses its target for `what` across the cells: the line that says so.
    fn missed(&self, client: Client, what: &str) -> Option<String> {
        let (lo, hi) = self.within;
        (self.ratio > TARGET).then(|| {
            format!(
                "{} across the cells: {what} CPU {:.2} of {}'s (geometric mean; 95% interval {lo:.2}–{hi:.2})",
                client.name(),
                self.ratio,
                client.raw().name()
            )
        })
    }
}

/// Every run of one cell.
struct Cell {
    server: Server,
    size: usize,
    client: Client,
    runs: Vec<Figures>,
    failures: Vec<String>,
}

/// One figure of a run: (wall-clock, CPU) of the start-up in µs, or of one get.
type Figure = fn(&Figures, usize) -> (f64, f64);

const STARTUP: Figure = |f, _| (f.startup_us, f.startup_cpu_us);
const GET: Figure = |f, gets| (f.gets_us / gets as f64, f.gets_cpu_us / gets as f64);

impl Cell {
    /// Runs it once more, with `gets` gets, in `slot`.
    fn run(&mut self, programs: &Programs, gets: usize, slot: usize) {
        let c = command(self.server, self.size, &programs.path(self.client), gets);
        let want = programs.library(self.client);
        match run_once(c) {
            Ok(f) if f.library == want => self.runs.push(Figures { slot, ..f }),
            Ok(f) => self.failures.push(format!("spoke through {}, not {want}", f.library)),
            Err(e) => self.failures.push(e),
        }
    }

    /// A figure over the runs: the medians of the wall-clock and of the CPU time. The CPU time is what the
    /// client itself costs, undrowned by where the scheduler put whom; its median, not its least, because on a
    /// virtual machine a few runs in twenty come out at half the others (the same client, the same calls:
    /// where the vCPUs happened to be), and which client drew them would decide a least's ratio.
    fn summary(&self, figure: Figure, gets: usize) -> (Option<f64>, Option<f64>) {
        let (wall, cpu): (Vec<f64>, Vec<f64>) = self.runs.iter().map(|f| figure(f, gets)).unzip();
        (median(wall), median(cpu))
    }

    /// Its CPU time and `raw`'s, run by run, in the slots both ran in: (slot, its, raw's).
    fn pairs(&self, raw: &Cell, figure: Figure, gets: usize) -> Vec<(usize, f64, f64)> {
        self.runs
            .iter()
            .filter_map(|f| {
                let r = raw.runs.iter().find(|r| r.slot == f.slot)?;
                Some((f.slot, figure(f, gets).1, figure(r, gets).1))
            })
            .collect()
    }

    /// Its median CPU time over `raw`'s.
    fn over(&self, raw: &Cell, figure: Figure, gets: usize) -> Over {
        let pairs: Vec<(f64, f64)> = self.pairs(raw, figure, gets).into_iter().map(|(_, a, b)| (a, b)).collect();
        Over { cpu: self.summary(figure, gets).1, raw_cpu: raw.summary(figure, gets).1, within: interval(&pairs) }
    }

    /// The lowest and highest wall-clock figure of the runs.
    fn range(&self, figure: Figure, gets: usize, digits: usize, scale: f64) -> String {
        let wall: Vec<f64> = self.runs.iter().map(|f| figure(f, gets).0 / scale).collect();
        let lo = wall.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = wall.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if wall.is_empty() {
            "-".into()
        } else {
            format!("{lo:.digits$}–{hi:.digits$}")
        }
    }
}

/// Every client under every server at every size.
fn cells(args: &Args, clients: &[Client]) -> Vec<Cell> {
    let mut cells = Vec::new();
    for &server in &args.servers {
        for &size in &args.sizes {
            for &client in clients {
                cells.push(Cell { server, size, client, runs: Vec::new(), failures: Vec::new() });
            }
        }
    }
    cells
}

fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
        _ => "-".into(),
    }
}

fn shown(x: Option<f64>, digits: usize) -> String {
    x.map_or("failed".into(), |x| format!("{x:.digits$}"))
}

fn report(
    args: &Args,
    cells: &[Cell],
    steady: &[Cell],
    alone: &[Cell],
    starts: &[(Client, Vec<f64>)],
) -> (String, Vec<String>) {
    let mut md = String::new();
    let mut misses = Vec::new();
    md.push_str("# The client libraries against clients written on the wire\n\n");
    md.push_str(&format!(
        "Written by `bash docker/bench-libpmi.sh` (`cargo bench --features slurm --bench libpmi -- --sizes {} \
         --runs {} --gets {} --steady-gets {} --startups {}`): {} runs per cell, each round in an order of its own. **Start-up**: \
         init, one put, a fence, a get of every rank's key and a fence, from rank 0's clock: its wall-clock \
         median (ms) and range over the runs, and the median CPU time rank 0's process spent in it over the runs \
         (µs: its own work and its system calls, not its waits). **Get**: one `get` of another rank's key \
         after the fence, from a loop of {} gets on every rank at once, closed by a fence, in µs per get, the \
         same ways. \"× hand\": over the same figure of the hand-written client of the same PMI version under \
         the same server, and for the CPU time in brackets the 95% interval of that ratio (by the bootstrap over the runs paired by \
         round: what the runs' spread leaves uncertain; a target inside it is not told apart by this many runs); \"× library\": the start-up's CPU time over that of the library the anchors ship for \
         the same version under the same server (Flux's `libpmi`, Slurm's `libpmi2`). The wall-clock figures of \
         this 2-core machine are spread by where the scheduler puts tasks and servers (their ranges), which \
         only adds: the CPU time is what the client itself costs. rpmi's libraries target at most \
         {TARGET:.2}× the hand-written client's CPU time, per get and for the start-up (whose first calls run a \
         library's code for the first time, and call it through the program's lazily bound PLT: that costs any \
         library some µs over a client written inline, the anchors' own included: their \"× hand\"). The \
         target is held across the cells (the table after this one) and alone (the table after that); a \
         single cell misses it where its whole interval lies above it.\n\n",
        args.sizes.iter().map(usize::to_string).collect::<Vec<_>>().join(","),
        args.runs,
        args.gets,
        args.steady_gets,
        args.startups,
        args.runs,
        args.gets
    ));
    md.push_str(
        "| server | tasks | client | start-up (ms) | range | × hand | CPU (µs) | × hand | × library | get (µs) \
         | range | × hand | CPU (µs) | × hand | failed runs |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for cell in cells {
        let find = |client: Client| {
            cells.iter().find(|c| c.server == cell.server && c.size == cell.size && c.client == client)
        };
        let raw = find(cell.client.raw()).expect("every cell has its hand-written client");
        let where_ = format!("under {} at {} tasks", cell.server.name(), cell.size);
        let mut row = format!("| {} | {} | {} |", cell.server.name(), cell.size, cell.client.name());
        for (what, figure, scale, digits) in [("start-up", STARTUP, 1000.0, 2), ("get", GET, 1.0, 1)] {
            let (wall, cpu) = cell.summary(figure, args.gets);
            let raw_wall = raw.summary(figure, args.gets).0;
            let hand = cell.client == cell.client.raw();
            let over = cell.over(raw, figure, args.gets);
            row.push_str(&format!(
                " {} | {} | {} | {} | {} |",
                shown(wall.map(|w| w / scale), digits),
                cell.range(figure, args.gets, digits, scale),
                if hand { String::new() } else { ratio(wall, raw_wall) },
                shown(cpu, 1),
                if hand { String::new() } else { over.shown() }
            ));
            if what == "start-up" {
                let anchor = cell.client.anchor().map(|a| find(a).and_then(|c| c.summary(figure, args.gets).1));
                row.push_str(&format!(" {} |", anchor.map_or(String::new(), |a| ratio(cpu, a))));
            }
            // One cell's median is judged across the cells (below); a cell on its own misses where its runs
            // show it (its whole interval above the target), or where it has no figure (every run failed).
            if over.within.is_none_or(|(lo, _)| lo > TARGET) {
                misses.extend(over.missed(cell.client, what, &where_));
            }
        }
        md.push_str(&format!("{row} {} |\n", cell.failures.len()));
    }
    if !cells.is_empty() {
        md.push_str(
            "\nAcross the cells: each client's CPU time over the hand-written client's, the geometric mean of the \
             cells' ratios above, and in brackets its 95% interval (by the bootstrap over the rounds, one draw of \
             rounds for every cell). A cell's own interval is wide here; across the cells, many more runs tell a \
             library's cost in these conditions from the target.\n\n\
             | client | start-up CPU × hand | get CPU × hand |\n|---|---|---|\n",
        );
        let held = CLIENTS.into_iter().filter(|&c| c != c.raw() && cells.iter().any(|x| x.client == c));
        for client in held {
            let mut row = format!("| {} |", client.name());
            for (what, figure) in [("start-up", STARTUP), ("get", GET)] {
                let pooled = Pooled::of(cells, client, figure, args.gets);
                row.push_str(&format!(" {} |", pooled.as_ref().map_or("-".into(), Pooled::shown)));
                if matches!(client, Client::Libpmi | Client::Libpmi2) {
                    misses.extend(match pooled {
                        Some(p) => p.missed(client, what),
                        None => Some(format!(
                            "{} across the cells: no {what} figure (a cell has no runs, or too few)",
                            client.name()
                        )),
                    });
                }
            }
            md.push_str(&format!("{row}\n"));
        }
    }
    // The start-up alone where it was run (`--startups`), else the start-up of the jobs measuring gets.
    let (startups, startup_gets, startup_runs) =
        if alone.is_empty() { (steady, args.steady_gets, args.runs) } else { (alone, 0, args.startups * args.runs) };
    if !startups.is_empty() {
        let gets = if steady.is_empty() {
            String::new()
        } else {
            format!("; **get**: the start-up and then {} gets, {} runs", args.steady_gets, args.runs)
        };
        let alone_said = if alone.is_empty() {
            format!("the start-up of the jobs measuring gets, {startup_runs} runs")
        } else {
            format!(
                "{startup_runs} runs of the start-up alone (no gets) per client, {} in each round one after \
                 another in an order of the round's own",
                args.startups
            )
        };
        md.push_str(&format!(
            "\nSteadier: jobs of one task under rpmi-run (no other task shares the cores with it and its server). \
             **Start-up**: {alone_said}{gets}. The median CPU time of each (µs), and in brackets the 95% interval \
             of its ratio (by the bootstrap over the runs paired by round: what the runs' spread leaves \
             uncertain).\n\n\
             | client | start-up CPU (µs) | × hand | × library | get CPU (µs) | × hand | failed runs |\n\
             |---|---|---|---|---|---|---|\n"
        ));
        for cell in startups {
            let client = cell.client;
            let hand = client == client.raw();
            let mut row = format!("| {} |", client.name());
            // As in the cells: blank where the client has no anchor, "-" where the anchor has no figure.
            for (what, series, figure, gets, digits) in
                [("start-up", startups, STARTUP, startup_gets, 1), ("get", steady, GET, args.steady_gets, 2)]
            {
                let find = |c: Client| series.iter().find(|x| x.client == c);
                let (Some(mine), Some(raw)) = (find(client), find(client.raw())) else {
                    row.push_str(" - | |");
                    continue;
                };
                let over = mine.over(raw, figure, gets);
                row.push_str(&format!(
                    " {} | {} |",
                    shown(over.cpu, digits),
                    if hand { String::new() } else { over.shown() }
                ));
                if what == "start-up" {
                    let anchor = client.anchor().map(|a| find(a).and_then(|c| c.summary(figure, gets).1));
                    row.push_str(&format!(" {} |", anchor.map_or(String::new(), |a| ratio(over.cpu, a))));
                }
                misses.extend(over.missed(client, what, "alone under rpmi-run"));
            }
            let failures: usize = [alone, steady]
                .iter()
                .flat_map(|series| series.iter().filter(|c| c.client == client))
                .map(|c| c.failures.len())
                .sum();
            md.push_str(&format!("{row} {failures} |\n"));
        }
    }
    md.push_str(&format!(
        "\nStarting a process linked against each (no launcher, no PMI: the program returns at once), the mean of \
         {STARTS} starts one after another, median of the rounds. A library's start is paid once per process, \
         before `main`: it is outside the start-up above, but for the CPU it takes from other tasks where there \
         are more tasks than cores.\n\n| client | start (µs) | over the hand-written client's |\n|---|---|---|\n"
    ));
    let start_of = |c: Client| starts.iter().find(|(x, _)| *x == c).and_then(|(_, t)| median(t.clone()));
    for &(client, _) in starts {
        let (t, raw) = (start_of(client), start_of(client.raw()));
        let over = match (t, raw) {
            (Some(t), Some(r)) if client != client.raw() => format!("{:+.0} µs", t - r),
            _ => String::new(),
        };
        md.push_str(&format!("| {} | {} | {over} |\n", client.name(), shown(t, 0)));
    }
    md.push('\n');
    if misses.is_empty() {
        md.push_str(&format!(
            "Target met: the CPU time of rpmi's libraries is within {TARGET:.2}× the hand-written client's, per \
             get and for the start-up, across the cells and alone, and no cell's interval lies wholly above it.\n"
        ));
    } else {
        md.push_str("Target missed:\n\n");
        for m in &misses {
            md.push_str(&format!("- {m}\n"));
        }
    }
    let series = [("", cells), (" (the gets alone)", steady), (" (the start-up alone)", alone)];
    let failures: Vec<String> = series
        .iter()
        .flat_map(|&(what, cells)| cells.iter().map(move |c| (what, c)))
        .flat_map(|(what, c)| {
            c.failures.iter().map(move |f| format!("{} {} {}{what}: {f}", c.server.name(), c.size, c.client.name()))
        })
        .collect();
    if !failures.is_empty() {
        md.push_str("\nFailed runs:\n\n");
        for f in failures {
            md.push_str(&format!("- {}\n", f.lines().next().unwrap_or_default()));
        }
    }
    (md, misses)
}

fn json(
    args: &Args,
    cells: &[Cell],
    steady: &[Cell],
    alone: &[Cell],
    starts: &[(Client, Vec<f64>)],
) -> serde_json::Value {
    serde_json::json!({
        "gets": args.gets,
        "steady_gets": args.steady_gets,
        "startups": args.startups,
        "alone": alone.iter().map(|c| serde_json::json!({
            "client": c.client.name(),
            "slots": c.runs.iter().map(|f| f.slot).collect::<Vec<_>>(),
            "startup_us": c.runs.iter().map(|f| f.startup_us).collect::<Vec<_>>(),
            "startup_cpu_us": c.runs.iter().map(|f| f.startup_cpu_us).collect::<Vec<_>>(),
            "failures": c.failures,
        })).collect::<Vec<_>>(),
        "steady": steady.iter().map(|c| serde_json::json!({
            "client": c.client.name(),
            "slots": c.runs.iter().map(|f| f.slot).collect::<Vec<_>>(),
            "startup_cpu_us": c.runs.iter().map(|f| f.startup_cpu_us).collect::<Vec<_>>(),
            "gets_cpu_us": c.runs.iter().map(|f| f.gets_cpu_us).collect::<Vec<_>>(),
            "failures": c.failures,
        })).collect::<Vec<_>>(),
        "starts_us": starts.iter().map(|(c, t)| serde_json::json!({"client": c.name(), "runs": t})).collect::<Vec<_>>(),
        "cells": cells.iter().map(|c| serde_json::json!({
            "server": c.server.name(),
            "tasks": c.size,
            "client": c.client.name(),
            "slots": c.runs.iter().map(|f| f.slot).collect::<Vec<_>>(),
            "startup_us": c.runs.iter().map(|f| f.startup_us).collect::<Vec<_>>(),
            "gets_us": c.runs.iter().map(|f| f.gets_us).collect::<Vec<_>>(),
            "startup_cpu_us": c.runs.iter().map(|f| f.startup_cpu_us).collect::<Vec<_>>(),
            "gets_cpu_us": c.runs.iter().map(|f| f.gets_cpu_us).collect::<Vec<_>>(),
            "failures": c.failures,
        })).collect::<Vec<_>>(),
    })
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("libpmi bench: {e}");
            return ExitCode::from(2);
        }
    };
    let dir = std::env::temp_dir().join(format!("rpmi-bench-libpmi-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let programs = match std::fs::create_dir_all(&dir).map_err(|e| e.to_string()).and_then(|_| Programs::build(&dir)) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("libpmi bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut cells = cells(&args, &programs.clients);
    let alone_cells = |wanted: bool| -> Vec<Cell> {
        let one = |&client| Cell { server: Server::RpmiRun, size: 1, client, runs: Vec::new(), failures: Vec::new() };
        programs.clients.iter().filter(|_| wanted).map(one).collect()
    };
    let mut steady = alone_cells(args.steady_gets > 0);
    let mut alone = alone_cells(args.startups > 0);
    let mut starts: Vec<(Client, Vec<f64>)> = programs.clients.iter().map(|&c| (c, Vec::new())).collect();
    for round in 0..args.runs {
        eprintln!("libpmi bench: round {} of {}", round + 1, args.runs);
        for (client, times) in starts.iter_mut() {
            match time_starts(&programs.path(*client)) {
                Ok(t) => times.push(t),
                Err(e) => eprintln!("libpmi bench: {e}"),
            }
        }
        for i in shuffled(cells.len(), round) {
            cells[i].run(&programs, args.gets, round);
        }
        for i in shuffled(steady.len(), round) {
            steady[i].run(&programs, args.steady_gets, round);
        }
        for k in 0..args.startups {
            let slot = round * args.startups + k;
            for i in shuffled(alone.len(), slot) {
                alone[i].run(&programs, 0, slot);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    let (md, misses) = report(&args, &cells, &steady, &alone, &starts);
    println!("{md}");
    let written = std::fs::write(&args.out, &md).and_then(|_| {
        std::fs::write(
            args.out.with_extension("json"),
            format!("{:#}\n", json(&args, &cells, &steady, &alone, &starts)),
        )
    });
    if let Err(e) = written {
        eprintln!("libpmi bench: writing {}: {e}", args.out.display());
        return ExitCode::FAILURE;
    }
    if misses.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

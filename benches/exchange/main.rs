//! The start-up exchange beside Slurm's PMIx: `benches/libpmi/pmi_bench.c`'s exchange workload (every rank:
//! PUTS puts of BYTES bytes and a fence that collects them, GETS gets of other ranks' keys and a fence, then
//! empty fences) as the tasks of one step on one node of the local Slurm cluster, through three clients:
//!
//! - `rpmi libpmi`: rpmi's `libpmi.so.0` under `srun --mpi=rpmi` (its puts go with the fence, its fences after
//!   the first through the node barrier's page);
//! - `rpmi libpmi, lines`: the same with every fence by lines (`RPMI_NODE_BARRIER=0`), as before the page;
//! - `rpmi libpmi, bruck` (over several nodes): the same with the exchanges by Bruck's allgather between the
//!   slurmstepds (`SLURM_RPMI_ALLGATHER=bruck`) rather than up the tree and back;
//! - `wire`: PMI-1 lines written by hand, each answered before the next, as MPICH's own client speaks, under
//!   `srun --mpi=rpmi`;
//! - `PMIx`: OpenPMIx's `libpmix` (Debian's `libpmix-dev`) under `srun --mpi=pmix`, Slurm's PMIx plugin.
//!
//! Runs are interleaved, a round running every cell once in an order of its own, so that the machine's drift
//! hits every client alike. Prints a table of medians and ranges (µs, from rank 0's clock after each phase's
//! closing fence) with each figure's ratio to PMIx's, and writes it to `--out` (markdown) with every run
//! beside it (JSON).
//!
//! `bash docker/bench-exchange.sh` sets everything up (the libraries, the local cluster with the plugin) and
//! runs it; by hand, with the cluster up (`SLURM_CONF`) and `cargo build --release` done:
//! `cargo bench --bench exchange -- [--sizes 64,256] [--nodes 1] [--runs 11] [--puts 8] [--bytes 800]
//! [--gets 64] [--fences 100] [--out benches/results/exchange.md]`. Over several nodes, each a network
//! namespace with a /tmp of its own (`RPMI_SLURM_NETNS=1 bash docker/bench-exchange.sh --nodes 3 ...`): Slurm's
//! PMIx keeps per-step directories in /tmp, which collide where nodes share one.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

/// Longest one step may take before it is killed and recorded as failed.
const STEP_TIMEOUT_S: u64 = 120;

#[derive(Clone, Copy, PartialEq, Eq, Debug, PartialOrd, Ord)]
enum Client {
    RpmiLibpmi,
    RpmiLibpmiLines,
    RpmiLibpmiBruck,
    Wire,
    Pmix,
}

/// The clients run over `nodes` nodes (Bruck's allgather is the tree's on one).
fn clients(nodes: usize) -> Vec<Client> {
    let all = [Client::RpmiLibpmi, Client::RpmiLibpmiLines, Client::RpmiLibpmiBruck, Client::Wire, Client::Pmix];
    all.into_iter().filter(|&c| nodes > 1 || c != Client::RpmiLibpmiBruck).collect()
}

impl Client {
    fn name(self) -> &'static str {
        match self {
            Client::RpmiLibpmi => "rpmi libpmi",
            Client::RpmiLibpmiLines => "rpmi libpmi, lines",
            Client::RpmiLibpmiBruck => "rpmi libpmi, bruck",
            Client::Wire => "wire",
            Client::Pmix => "PMIx",
        }
    }

    /// Its `srun --mpi=`.
    fn mpi(self) -> &'static str {
        match self {
            Client::Pmix => "pmix",
            _ => "rpmi",
        }
    }

    /// pmi_bench.c's `CLIENT`.
    fn build_as(self) -> u32 {
        match self {
            Client::RpmiLibpmi | Client::RpmiLibpmiLines | Client::RpmiLibpmiBruck => 1,
            Client::Pmix => 3,
            Client::Wire => 11,
        }
    }
}

struct Args {
    sizes: Vec<usize>,
    /// Nodes the tasks are spread over (srun's block layout).
    nodes: usize,
    runs: usize,
    puts: usize,
    bytes: usize,
    gets: usize,
    fences: usize,
    out: PathBuf,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        sizes: vec![64, 256],
        nodes: 1,
        runs: 11,
        puts: 8,
        bytes: 800,
        gets: 64,
        fences: 100,
        out: PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/benches/results/exchange.md")),
    };
    let mut it = std::env::args().skip(1).filter(|a| a != "--bench");
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        let number = |v: String| v.parse::<usize>().map_err(|_| format!("{flag}: '{v}' is not a number"));
        match flag.as_str() {
            "--sizes" => {
                a.sizes = value()?
                    .split(',')
                    .map(|s| s.parse().map_err(|_| format!("--sizes: '{s}'")))
                    .collect::<Result<_, _>>()?
            }
            "--runs" => a.runs = number(value()?)?,
            "--nodes" => a.nodes = number(value()?)?,
            "--puts" => a.puts = number(value()?)?,
            "--bytes" => a.bytes = number(value()?)?,
            "--gets" => a.gets = number(value()?)?,
            "--fences" => a.fences = number(value()?)?,
            "--out" => a.out = PathBuf::from(value()?),
            other => return Err(format!("unknown option {other}")),
        }
    }
    if a.sizes.is_empty() || a.runs == 0 || a.puts == 0 || a.fences == 0 || a.nodes == 0 {
        return Err("--sizes, --nodes, --runs, --puts and --fences must be more than nothing".into());
    }
    Ok(a)
}

/// Builds pmi_bench.c as `client` into `dir`; its path.
fn build(client: Client, dir: &Path) -> Result<PathBuf, String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = dir.join(format!("{client:?}"));
    let mut cc = Command::new("cc");
    cc.args(["-O2", "-Wall", "-Wextra", "-Werror", &format!("-DCLIENT={}", client.build_as()), "-o"])
        .arg(&out)
        .arg(root.join("benches/libpmi/pmi_bench.c"));
    match client {
        Client::RpmiLibpmi | Client::RpmiLibpmiLines | Client::RpmiLibpmiBruck => {
            let profile = std::env::current_exe().map_err(|e| e.to_string())?;
            let profile = profile.parent().and_then(Path::parent).ok_or("no profile directory")?;
            let built = profile.join("libpmi.so");
            let libs = dir.join("lib");
            std::fs::create_dir_all(&libs).map_err(|e| e.to_string())?;
            std::fs::copy(&built, libs.join("libpmi.so.0"))
                .map_err(|e| format!("{}: {e} (`cargo build --release` first)", built.display()))?;
            cc.arg(format!("-I{}", root.join("crates/libpmi/include").display()))
                .arg(format!("-L{}", libs.display()))
                .arg("-l:libpmi.so.0")
                .arg(format!("-Wl,-rpath,{}", libs.display()));
        }
        Client::Pmix => {
            let flags = Command::new("pkg-config").args(["--cflags", "--libs", "pmix"]).output();
            let flags = flags.map_err(|e| format!("pkg-config: {e}"))?;
            if !flags.status.success() {
                return Err("pkg-config finds no pmix (Debian's libpmix-dev)".into());
            }
            cc.args(String::from_utf8_lossy(&flags.stdout).split_whitespace());
        }
        Client::Wire => {}
    }
    let done = cc.arg("-ldl").output().map_err(|e| format!("cc: {e}"))?;
    if !done.status.success() {
        return Err(format!("cc -DCLIENT={}: {}", client.build_as(), String::from_utf8_lossy(&done.stderr)));
    }
    Ok(out)
}

/// Rank 0's figures of one step (µs).
#[derive(Clone, Debug)]
struct Figures {
    put: f64,
    get: f64,
    exchange: f64,
    fence: f64,
}

fn run(args: &Args, client: Client, program: &Path, size: usize) -> Result<Figures, String> {
    let out = Command::new("timeout")
        .args(["--kill-after=5", &STEP_TIMEOUT_S.to_string(), "srun", "-Q", &format!("--mpi={}", client.mpi())])
        .args([&format!("-N{}", args.nodes), "--overcommit", &format!("-n{size}")])
        .arg(program)
        .arg("exchange")
        .args([args.puts, args.bytes, args.gets, args.fences].map(|n| n.to_string()))
        .env("SLURM_RPMI_ALLGATHER", if client == Client::RpmiLibpmiBruck { "bruck" } else { "tree" })
        .env("RPMI_NODE_BARRIER", if client == Client::RpmiLibpmiLines { "0" } else { "1" })
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("srun: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        return Err(format!("{}: {stdout}{}", out.status, stderr.lines().take(5).collect::<Vec<_>>().join("\n")));
    }
    let line = stdout.lines().find(|l| l.starts_with("put_us=")).ok_or(format!("no figures in '{stdout}'"))?;
    let number = |k: &str| {
        line.split(' ')
            .find_map(|w| w.strip_prefix(k))
            .and_then(|v| v.parse::<f64>().ok())
            .ok_or(format!("no {k} in {line}"))
    };
    Ok(Figures {
        put: number("put_us=")?,
        get: number("get_us=")?,
        exchange: number("exchange_us=")?,
        fence: number("fence_us=")?,
    })
}

fn median(mut xs: Vec<f64>) -> Option<f64> {
    xs.sort_by(f64::total_cmp);
    (!xs.is_empty()).then(|| xs[xs.len() / 2])
}

/// The runs of one size and client, and their failures.
#[derive(Default)]
struct Cell {
    runs: Vec<Figures>,
    failed: Vec<String>,
}

impl Cell {
    fn median(&self, figure: Figure) -> Option<f64> {
        median(self.runs.iter().map(figure).collect())
    }

    fn range(&self, figure: Figure) -> String {
        let xs: Vec<f64> = self.runs.iter().map(figure).collect();
        match (xs.iter().copied().reduce(f64::min), xs.iter().copied().reduce(f64::max)) {
            (Some(lo), Some(hi)) => format!("{lo:.0}–{hi:.0}"),
            _ => "-".into(),
        }
    }
}

fn shown(x: Option<f64>) -> String {
    x.map_or("-".into(), |x| if x < 100.0 { format!("{x:.1}") } else { format!("{x:.0}") })
}

/// PMIx's figure over `x`'s: how many times faster `x` is.
fn over_pmix(pmix: Option<f64>, x: Option<f64>) -> String {
    match (pmix, x) {
        (Some(p), Some(x)) if x > 0.0 => format!("{:.2}×", p / x),
        _ => "-".into(),
    }
}

/// One of rank 0's figures, read from a run.
type Figure = fn(&Figures) -> f64;

const FIGURES: [(&str, Figure); 4] =
    [("put phase", |f| f.put), ("get phase", |f| f.get), ("exchange", |f| f.exchange), ("empty fence", |f| f.fence)];

fn report(args: &Args, cells: &BTreeMap<(usize, Client), Cell>, slurm: &str) -> String {
    let mut out = String::new();
    out += "# The start-up exchange beside Slurm's PMIx\n\n";
    out += &format!(
        "Written by `bash docker/bench-exchange.sh` (`cargo bench --bench exchange -- --sizes {} --nodes {} --runs {} \
         --puts {} --bytes {} --gets {} --fences {}`), {slurm}, {}, {} cores. Every \
         rank: {} puts of {} bytes and a fence that collects them (**put phase**), {} gets of other ranks' keys \
         and a fence (**get phase**), both (**exchange**), and one fence with nothing put (**empty fence**, the \
         mean of {}), in µs from rank 0's clock after each phase's closing fence: the median of {} runs and \
         their range, and PMIx's median over the client's (× PMIx: how many times faster). `rpmi libpmi`: rpmi's \
         `libpmi.so.0` under `srun --mpi=rpmi`, its fences after the first through the node barrier's page \
         (`lines`: every fence by lines, `RPMI_NODE_BARRIER=0`; `bruck`: the exchanges by Bruck's allgather, \
         `SLURM_RPMI_ALLGATHER=bruck`); `wire`: PMI-1 lines by hand, each answered before the next (as \
         MPICH's own client speaks), under `srun --mpi=rpmi`; `PMIx`: OpenPMIx's `libpmix` under `srun \
         --mpi=pmix`.\n\n",
        args.sizes.iter().map(usize::to_string).collect::<Vec<_>>().join(","),
        args.nodes,
        args.runs,
        args.puts,
        args.bytes,
        args.gets,
        args.fences,
        match args.nodes {
            1 => "one node of the local cluster".to_string(),
            n => format!(
                "{n} nodes of the local cluster, each a network namespace with a /tmp of its own (the tasks in blocks)"
            ),
        },
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        args.puts,
        args.bytes,
        args.gets,
        args.fences,
        args.runs,
    );
    out += "| ranks | client |";
    for (name, _) in FIGURES {
        out += &format!(" {name} | range | × PMIx |");
    }
    out += " failed runs |\n|---|---|";
    out += &"---|---|---|".repeat(FIGURES.len());
    out += "---|\n";
    for &size in &args.sizes {
        let pmix = &cells[&(size, Client::Pmix)];
        for client in clients(args.nodes) {
            let cell = &cells[&(size, client)];
            out += &format!("| {size} | {} |", client.name());
            for (_, figure) in FIGURES {
                let m = cell.median(figure);
                let ratio = if client == Client::Pmix { String::new() } else { over_pmix(pmix.median(figure), m) };
                out += &format!(" {} | {} | {ratio} |", shown(m), cell.range(figure));
            }
            out += &format!(" {} |\n", cell.failed.len());
        }
    }
    for ((size, client), cell) in cells {
        for why in &cell.failed {
            out += &format!("\nFailed: {size} ranks, {}: {}\n", client.name(), why.replace('\n', " "));
        }
    }
    out
}

fn json(args: &Args, cells: &BTreeMap<(usize, Client), Cell>) -> String {
    let runs: Vec<serde_json::Value> = cells
        .iter()
        .flat_map(|((size, client), cell)| {
            cell.runs.iter().map(move |f| {
                serde_json::json!({"ranks": size, "client": client.name(), "put_us": f.put, "get_us": f.get,
                    "exchange_us": f.exchange, "fence_us": f.fence})
            })
        })
        .collect();
    let meta = serde_json::json!({"sizes": args.sizes, "nodes": args.nodes, "runs": args.runs, "puts": args.puts, "bytes": args.bytes,
        "gets": args.gets, "fences": args.fences});
    serde_json::to_string_pretty(&serde_json::json!({"meta": meta, "runs": runs})).unwrap_or_default()
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("exchange bench: {e}");
            return ExitCode::from(2);
        }
    };
    let Some(conf) = std::env::var_os("SLURM_CONF") else {
        eprintln!("exchange bench: no SLURM_CONF: run it through docker/bench-exchange.sh, or start the local cluster");
        return ExitCode::from(2);
    };
    // Nodes that share one address share one /tmp too, where Slurm's PMIx keeps per-step directories.
    let conf = std::fs::read_to_string(conf).unwrap_or_default();
    let addresses: std::collections::BTreeSet<&str> =
        conf.split_whitespace().filter_map(|w| w.strip_prefix("NodeAddr=")).collect();
    if args.nodes > 1 && addresses.len() < args.nodes {
        eprintln!("exchange bench: --nodes {} needs nodes of their own (RPMI_SLURM_NETNS=1)", args.nodes);
        return ExitCode::from(2);
    }
    // Beside the build, not in /tmp: a node of a cluster started with --netns has a /tmp of its own.
    let Some(profile) = std::env::current_exe().ok().and_then(|e| Some(e.parent()?.parent()?.to_path_buf())) else {
        eprintln!("exchange bench: no profile directory");
        return ExitCode::from(1);
    };
    let dir = profile.join(format!("exchange-bench-{}", std::process::id()));
    let programs: Result<Vec<(Client, PathBuf)>, String> = std::fs::create_dir_all(&dir)
        .map_err(|e| e.to_string())
        .and_then(|()| clients(args.nodes).into_iter().map(|c| Ok((c, build(c, &dir)?))).collect());
    let programs = match programs {
        Ok(p) => p,
        Err(e) => {
            eprintln!("exchange bench: {e}");
            return ExitCode::from(1);
        }
    };
    let slurm = Command::new("srun").arg("--version").output();
    let slurm = slurm.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()).unwrap_or_default();
    let mut cells: BTreeMap<(usize, Client), Cell> = BTreeMap::new();
    for round in 0..args.runs {
        // Each round in an order of its own: rotated by the round.
        let mut order: Vec<(usize, Client, &Path)> =
            args.sizes.iter().flat_map(|&s| programs.iter().map(move |(c, p)| (s, *c, p.as_path()))).collect();
        let n = order.len();
        order.rotate_left(round % n);
        for (size, client, program) in order {
            let cell = cells.entry((size, client)).or_default();
            match run(&args, client, program, size) {
                Ok(f) => cell.runs.push(f),
                Err(e) => cell.failed.push(e),
            }
        }
        eprintln!("exchange bench: round {}/{} done", round + 1, args.runs);
    }
    let _ = std::fs::remove_dir_all(&dir);
    let text = report(&args, &cells, &slurm);
    print!("{text}");
    let written = std::fs::write(&args.out, &text)
        .and_then(|()| std::fs::write(args.out.with_extension("json"), json(&args, &cells)));
    if let Err(e) = written {
        eprintln!("exchange bench: writing {}: {e}", args.out.display());
        return ExitCode::from(1);
    }
    ExitCode::SUCCESS
}

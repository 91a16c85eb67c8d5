//! MPI start-up side by side: `MPI_Init` + `MPI_Finalize` of `mpi_init.c` under rpmi-run and MPICH's own
//! `mpiexec.hydra`, each over the same number of virtual nodes (rpmi-run `--nodes M`; Hydra `-launcher fork`
//! with M host names, one proxy each) and Hydra on one node (its single proxy: its best case here), for each
//! PMI the MPI library speaks: PMI-1 (MPICH's default; MPICH 5 is answered 1.2 by both servers) and PMI-2 (`MPIR_CVAR_PMI_VERSION=2`). A server whose
//! job fails or hangs (killed after 120 s) twice in a cell is not run again in it. Runs are interleaved (each round runs every server once) so that the
//! machine's drift hits both alike. Prints a table of medians (and ranges) with Hydra's time over rpmi's,
//! and PMI messages per rank (counted from MPICH's own client trace, `PMI_DEBUG=1`, in one more run each),
//! and writes it to `--out` (markdown).
//!
//! It needs an MPICH whose `mpicc` and `mpiexec.hydra` are on the PATH and which speaks PMI-2 (4.1 and
//! later): `bash docker/bench-init.sh` runs it in the Debian unstable chroot (MPICH 5.0.2). By hand:
//! `cargo bench --bench init -- [--ranks 64,256] [--nodes 4] [--runs 5] [--out benches/results/init.md]`.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

const RPMI_RUN: &str = env!("CARGO_BIN_EXE_rpmi-run");
/// Longest one job may take before it is killed and recorded as failed.
const JOB_TIMEOUT: Duration = Duration::from_secs(120);
/// Failures after which a server is not run again in a cell.
const GIVE_UP: usize = 2;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Server {
    RpmiRun,
    Hydra,
    HydraOneNode,
}

const SERVERS: [Server; 3] = [Server::RpmiRun, Server::Hydra, Server::HydraOneNode];

#[derive(Clone, Copy, PartialEq, Eq)]
enum Pmi {
    One,
    Two,
}

impl Pmi {
    fn name(self) -> &'static str {
        match self {
            Pmi::One => "PMI 1.2",
            Pmi::Two => "PMI-2",
        }
    }
}

struct Args {
    ranks: Vec<usize>,
    nodes: usize,
    runs: usize,
    out: PathBuf,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args { ranks: vec![64, 256], nodes: 4, runs: 5, out: PathBuf::from("benches/results/init.md") };
    let mut it = std::env::args().skip(1).filter(|a| a != "--bench");
    while let Some(a) = it.next() {
        let mut value = || it.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--ranks" => {
                args.ranks = value()?
                    .split(',')
                    .map(|n| n.parse().map_err(|_| format!("--ranks: {n}")))
                    .collect::<Result<_, _>>()?
            }
            "--nodes" => args.nodes = value()?.parse().map_err(|_| "--nodes wants a number".to_string())?,
            "--runs" => args.runs = value()?.parse().map_err(|_| "--runs wants a number".to_string())?,
            "--out" => args.out = PathBuf::from(value()?),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(args)
}

/// The command that runs `program` as `ranks` tasks over `nodes` virtual nodes under `server`.
fn command(server: Server, pmi: Pmi, ranks: usize, nodes: usize, program: &Path) -> Command {
    let mut c = match server {
        Server::RpmiRun => {
            let mut c = Command::new(RPMI_RUN);
            c.args(["-n", &ranks.to_string(), "--nodes", &nodes.to_string()]);
            c
        }
        Server::Hydra => {
            let hosts: Vec<String> = (0..nodes).map(|n| format!("node{n}")).collect();
            let mut c = Command::new("mpiexec.hydra");
            c.args(["-launcher", "fork", "-hosts", &hosts.join(","), "-n", &ranks.to_string()]);
            c
        }
        Server::HydraOneNode => {
            let mut c = Command::new("mpiexec.hydra");
            c.args(["-n", &ranks.to_string()]);
            c
        }
    };
    c.arg(program);
    if pmi == Pmi::Two {
        c.env("MPIR_CVAR_PMI_VERSION", "2");
    }
    c
}

/// Runs `c` to its end: its wall time, or why it failed.
fn run(mut c: Command, output: Stdio) -> Result<(Duration, Vec<u8>), String> {
    let start = Instant::now();
    // In a process group of its own, so that a job that hangs is killed whole (Hydra ignores SIGTERM then).
    let mut child = c
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(output)
        .spawn()
        .map_err(|e| e.to_string())?;
    let mut err = child.stderr.take();
    let reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(e) = err.as_mut() {
            let _ = std::io::Read::read_to_end(e, &mut buf);
        }
        buf
    });
    loop {
        if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
            let elapsed = start.elapsed();
            let text = reader.join().unwrap_or_default();
            return match status.success() {
                true => Ok((elapsed, text)),
                false => Err(format!("{status}: {}", String::from_utf8_lossy(&text).lines().last().unwrap_or(""))),
            };
        }
        if start.elapsed() > JOB_TIMEOUT {
            // SAFETY: signals the job's own process group.
            unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
            let _ = child.wait();
            return Err(format!("killed after {JOB_TIMEOUT:?}"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn median(mut xs: Vec<f64>) -> Option<f64> {
    xs.sort_by(f64::total_cmp);
    (!xs.is_empty()).then(|| xs[xs.len() / 2])
}

fn build(dir: &Path) -> Result<PathBuf, String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/init/mpi_init.c");
    let out = dir.join("mpi_init");
    let status =
        Command::new("mpicc").arg("-O2").arg("-o").arg(&out).arg(&src).status().map_err(|e| format!("mpicc: {e}"))?;
    status.success().then_some(out).ok_or_else(|| "mpicc failed".to_string())
}

fn version() -> String {
    let out = Command::new("mpichversion").output().map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
    let out = out.unwrap_or_default();
    out.lines()
        .find(|l| l.starts_with("MPICH Version"))
        .map_or("MPICH ?".into(), |l| format!("MPICH {}", l.split(':').nth(1).unwrap_or("?").trim()))
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("init: {e}");
            return ExitCode::from(2);
        }
    };
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let program = match build(&dir) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("init: {e} (an MPICH with mpicc on the PATH is needed: bash docker/bench-init.sh)");
            return ExitCode::FAILURE;
        }
    };
    let mut rows = Vec::new();
    for pmi in [Pmi::One, Pmi::Two] {
        for &ranks in &args.ranks {
            let mut times: [Vec<f64>; 3] = Default::default();
            let mut failures = [0usize; 3];
            for round in 0..args.runs {
                for (i, &server) in SERVERS.iter().enumerate() {
                    if failures[i] >= GIVE_UP {
                        continue;
                    }
                    match run(command(server, pmi, ranks, args.nodes, &program), Stdio::null()) {
                        Ok((t, _)) => times[i].push(t.as_secs_f64()),
                        Err(e) => {
                            failures[i] += 1;
                            eprintln!("init: {} {ranks} run {round}: {e}", name(server));
                        }
                    }
                }
            }
            // One more run each, with MPICH's client trace: one `send to fd` line per PMI message it sends.
            let messages: Vec<Option<f64>> = SERVERS
                .iter()
                .enumerate()
                .map(|(i, &server)| {
                    if failures[i] >= GIVE_UP {
                        return None;
                    }
                    let mut c = command(server, pmi, ranks, args.nodes, &program);
                    c.env("PMI_DEBUG", "1");
                    run(c, Stdio::piped()).ok().map(|(_, text)| {
                        let sent = String::from_utf8_lossy(&text).lines().filter(|l| l.contains("send to fd")).count();
                        sent as f64 / ranks as f64
                    })
                })
                .collect();
            let row = Row { pmi, ranks, times, failures, messages };
            println!("{}", row.line());
            rows.push(row);
        }
    }
    let report = report(&args, &version(), &rows);
    if let Some(parent) = args.out.parent() {
        let _ = std::fs::create_dir_all(parent);
    }
    if let Err(e) = std::fs::write(&args.out, &report) {
        eprintln!("init: cannot write {}: {e}", args.out.display());
        return ExitCode::FAILURE;
    }
    println!("wrote {}", args.out.display());
    ExitCode::SUCCESS
}

fn name(server: Server) -> &'static str {
    match server {
        Server::RpmiRun => "rpmi-run",
        Server::Hydra => "hydra",
        Server::HydraOneNode => "hydra-1",
    }
}

struct Row {
    pmi: Pmi,
    ranks: usize,
    /// Seconds of each run, by server ([`SERVERS`]).
    times: [Vec<f64>; 3],
    failures: [usize; 3],
    /// PMI messages a rank sent, on average.
    messages: Vec<Option<f64>>,
}

impl Row {
    fn cell(&self, i: usize) -> String {
        let t = &self.times[i];
        let range = |f: fn(f64, f64) -> f64| t.iter().copied().reduce(f).unwrap_or(f64::NAN);
        let failed = match self.failures[i] {
            0 => String::new(),
            n => format!(", {n} failed"),
        };
        match median(t.clone()) {
            Some(m) => format!("{m:.3} s ({:.3}-{:.3}{failed})", range(f64::min), range(f64::max)),
            None => format!("no run{failed}"),
        }
    }

    /// Server `i`'s median time over rpmi-run's.
    fn ratio(&self, i: usize) -> String {
        match (median(self.times[0].clone()), median(self.times[i].clone())) {
            (Some(r), Some(h)) => format!("{:.2}x", h / r),
            _ => "-".into(),
        }
    }

    fn messages(&self, i: usize) -> String {
        self.messages[i].map_or("-".into(), |m| format!("{m:.1}"))
    }

    fn line(&self) -> String {
        format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} / {} / {} |",
            self.pmi.name(),
            self.ranks,
            self.cell(0),
            self.cell(1),
            self.ratio(1),
            self.cell(2),
            self.ratio(2),
            self.messages(0),
            self.messages(1),
            self.messages(2)
        )
    }
}

fn report(args: &Args, mpich: &str, rows: &[Row]) -> String {
    let mut s = String::new();
    s.push_str("# MPI start-up: rpmi-run against Hydra\n\n");
    s.push_str(&format!(
        "`cargo bench --bench init` (`bash docker/bench-init.sh`): `MPI_Init` + `MPI_Finalize` ({}), {} runs each, \
         interleaved, over {} virtual nodes (rpmi-run `--nodes {}`; `mpiexec.hydra -launcher fork` with {} host \
         names), and Hydra on one node. Whole command wall time: median (range); a job that fails or hangs is \
         killed after {} s, and a server that failed {} times in a cell is not run again in it. Hydra/rpmi above \
         1 means rpmi is faster. Messages: PMI messages one rank sends, from MPICH's client trace \
         (`PMI_DEBUG=1`), rpmi / Hydra / Hydra on one node. PMI 1.2: MPICH asks for 1.1; rpmi answers 1.1, Hydra 1.2, \
         which turns on its threaded PMI mode; MPICH 5.0's own builds send no group barrier (see docs/protocol.md).\n\n",
        mpich,
        args.runs,
        args.nodes,
        args.nodes,
        args.nodes,
        JOB_TIMEOUT.as_secs(),
        GIVE_UP
    ));
    s.push_str(
        "| PMI | ranks | rpmi-run | Hydra | Hydra/rpmi | Hydra, one node | its /rpmi | messages per rank |\n\
         |---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        s.push_str(&r.line());
        s.push('\n');
    }
    s
}

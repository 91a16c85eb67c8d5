//! MPI start-up side by side: `MPI_Init` + `MPI_Finalize` of `mpi_init.c` under rpmi-run and MPICH's own
//! `mpiexec.hydra`, each over the same number of virtual nodes (rpmi-run `--nodes M`; Hydra `-launcher fork`
//! with M host names, one proxy each) and Hydra on one node (its single proxy: its best case here), for each
//! PMI the MPI library speaks: PMI-1 (MPICH's default; MPICH 5 is answered 1.2 by both servers) and PMI-2 (`MPIR_CVAR_PMI_VERSION=2`). A server whose
//! job fails or hangs (killed after 120 s) twice in a cell is not run again in it. Runs are interleaved (each round runs every server once) so that the
//! machine's drift hits both alike. Prints a table of medians (and ranges) with Hydra's time over rpmi's,
//! and PMI messages per rank (counted from MPICH's own client trace, `PMI_DEBUG=1`, in one more run each),
//! and writes it to `--out` (markdown).
//!
//! With `--flux`: rpmi (`-o pmi=rpmi`) against Flux's own `pmi-simple` (`-o pmi=simple`) in 3-broker Flux
//! instances (`flux start --test-size=3`, 1024 cores faked on each), PMI-1 only (`pmi-simple` serves no
//! other). Each process also says how long its `MPI_Init` took (`mpi_init.c`), and a preloaded shim
//! (`pmi_time.c`) counts the lines it writes on its PMI connection and the time it spends reading and
//! writing there: the table gives, per server, the whole command, `MPI_Init`, the time in PMI and its share
//! of `MPI_Init`, and the lines a rank sends. It needs Flux on the PATH with rpmi's plugin installed
//! (`bash docker/flux.sh install`) and MPICH's `mpicc` first on the PATH.
//!
//! It needs an MPICH whose `mpicc` and `mpiexec.hydra` are on the PATH and which speaks PMI-2 (4.1 and
//! later): `bash docker/bench-init.sh` runs it in the Debian unstable chroot (MPICH 5.0.2). By hand:
//! `cargo bench --bench init -- [--ranks 64,256] [--nodes 4] [--runs 5] [--out benches/results/init.md]`;
//! `cargo bench --bench init -- --flux [--ranks 48,192] [--runs 5] [--out benches/results/flux/init.md]`.

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
    FluxRpmi,
    FluxSimple,
}

/// The servers of a run, the first the one the others are compared with.
fn servers(flux: bool) -> &'static [Server] {
    match flux {
        false => &[Server::RpmiRun, Server::Hydra, Server::HydraOneNode],
        true => &[Server::FluxRpmi, Server::FluxSimple],
    }
}

/// Brokers of each Flux instance.
const FLUX_BROKERS: usize = 3;

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
    flux: bool,
}

fn parse_args() -> Result<Args, String> {
    let flux = std::env::args().any(|a| a == "--flux");
    let (ranks, out) = match flux {
        false => (vec![64, 256], "benches/results/init.md"),
        true => (vec![48, 192], "benches/results/flux/init.md"),
    };
    let nodes = if flux { FLUX_BROKERS } else { 4 };
    let mut args = Args { ranks, nodes, runs: 5, out: PathBuf::from(out), flux };
    let mut it = std::env::args().skip(1).filter(|a| a != "--bench" && a != "--flux");
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

/// The command that runs `program` as `ranks` tasks over `nodes` virtual nodes under `server` (`shim`: what
/// a Flux job preloads).
fn command(server: Server, pmi: Pmi, ranks: usize, nodes: usize, program: &Path, shim: &Path) -> Command {
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
        Server::FluxRpmi | Server::FluxSimple => {
            let pmi = if server == Server::FluxRpmi { "pmi=rpmi" } else { "pmi=simple" };
            let mut c = Command::new("flux");
            c.args(["start", &format!("--test-size={FLUX_BROKERS}"), "--config-path"]).arg(flux_config());
            c.args(["flux", "run", &format!("-N{FLUX_BROKERS}"), &format!("-n{ranks}"), "-o", "cpu-affinity=off"]);
            c.args(["-o", pmi, "--env=MPI_INIT_TIMES=1"]).arg(format!("--env=LD_PRELOAD={}", shim.display()));
            c
        }
    };
    c.arg(program);
    if pmi == Pmi::Two {
        c.env("MPIR_CVAR_PMI_VERSION", "2");
    }
    c
}

/// The instances' configuration: resources faked to 1024 cores on each broker, all on this machine, so that
/// a job of any size here fits.
fn flux_config() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("init-flux-{}", std::process::id()));
    if dir.join("resource.toml").exists() {
        return dir;
    }
    std::fs::create_dir_all(&dir).expect("the Flux config directory");
    let host = String::from_utf8_lossy(&Command::new("hostname").output().expect("hostname").stdout).trim().to_string();
    let ranks = format!("0-{}", FLUX_BROKERS - 1);
    let hosts = vec![host; FLUX_BROKERS].join(",");
    let r = Command::new("flux").args(["R", "encode", "-r", &ranks, "-c", "0-1023", "-H", &hosts]).output();
    let r = r.ok().filter(|o| o.status.success()).expect("flux R encode (is Flux on the PATH?)");
    std::fs::write(dir.join("R.json"), r.stdout).expect("R.json");
    let toml = format!("[resource]\npath = \"{}\"\nnoverify = true\n", dir.join("R.json").display());
    std::fs::write(dir.join("resource.toml"), toml).expect("resource.toml");
    dir
}

/// What a job's processes said of themselves (`--flux`): the seconds of each one's `MPI_Init`, and of each
/// its seconds in PMI during `MPI_Init`, how they were spent, and the lines it wrote there.
#[derive(Default)]
struct Inside {
    init: Vec<f64>,
    pmi: Vec<f64>,
    /// Each process's seconds in PMI ready to run but waiting for a CPU.
    cpu_wait: Vec<f64>,
    /// Each process's seconds in barriers before the last process came in: the slowest one's own work.
    last_in: Vec<f64>,
    /// The rest of each process's seconds in PMI: waiting for the server's answers.
    answers: Vec<f64>,
    lines: Vec<f64>,
}

/// One process's `pmi-time:` line: its seconds in PMI, of them waiting for a CPU, and when it entered and
/// left each barrier (ns on the machine's monotonic clock).
struct Said {
    seconds: f64,
    cpu_wait: f64,
    barriers: Vec<(i64, i64)>,
}

impl Inside {
    fn read(stderr: &[u8]) -> Inside {
        let mut inside = Inside::default();
        let field = |l: &str, k: &str| -> Option<f64> {
            l.split_whitespace().find_map(|w| w.strip_prefix(k)).and_then(|v| v.parse().ok())
        };
        let mut processes: Vec<Said> = Vec::new();
        for l in String::from_utf8_lossy(stderr).lines() {
            if l.starts_with("mpi-init:") {
                inside.init.extend(field(l, "seconds="));
            } else if l.starts_with("pmi-time:") {
                let barriers = l.split_whitespace().find_map(|w| w.strip_prefix("barriers=")).unwrap_or("");
                let barriers = barriers.split(',').filter_map(|b| {
                    let (i, o) = b.split_once(':')?;
                    Some((i.parse().ok()?, o.parse().ok()?))
                });
                if let (Some(seconds), Some(cpu_wait)) = (field(l, "seconds="), field(l, "cpu_wait=")) {
                    processes.push(Said { seconds, cpu_wait, barriers: barriers.collect() });
                }
                inside.lines.extend(field(l, "lines="));
            }
        }
        // The last process into each barrier (by its place in each process's sequence).
        let mut last_in: Vec<i64> = Vec::new();
        for said in &processes {
            for (k, &(entered, _)) in said.barriers.iter().enumerate() {
                match last_in.get_mut(k) {
                    Some(last) => *last = (*last).max(entered),
                    None => last_in.push(entered),
                }
            }
        }
        for Said { seconds, cpu_wait, barriers } in processes {
            let waited: i64 = barriers.iter().zip(&last_in).map(|(&(entered, _), &last)| last - entered).sum();
            let waited = waited as f64 / 1e9;
            inside.pmi.push(seconds);
            inside.cpu_wait.push(cpu_wait);
            inside.last_in.push(waited);
            inside.answers.push((seconds - cpu_wait - waited).max(0.0));
        }
        inside
    }
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

/// The program, and the shim a Flux job preloads.
fn build(dir: &Path) -> Result<(PathBuf, PathBuf), String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/init");
    let (program, shim) = (dir.join("mpi_init"), dir.join("pmi_time.so"));
    let mpicc =
        Command::new("mpicc").arg("-O2").arg("-o").arg(&program).arg(src.join("mpi_init.c")).arg("-ldl").status();
    if !mpicc.map_err(|e| format!("mpicc: {e}"))?.success() {
        return Err("mpicc failed".into());
    }
    let mut cc = Command::new("cc");
    cc.args(["-O2", "-shared", "-fPIC", "-o"]).arg(&shim).arg(src.join("pmi_time.c")).arg("-ldl");
    match cc.status().map_err(|e| format!("cc: {e}"))?.success() {
        true => Ok((program, shim)),
        false => Err("cc failed on pmi_time.c".into()),
    }
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
    let (program, shim) = match build(&dir) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("init: {e} (an MPICH with mpicc on the PATH is needed: bash docker/bench-init.sh)");
            return ExitCode::FAILURE;
        }
    };
    let servers = servers(args.flux);
    let pmis: &[Pmi] = if args.flux { &[Pmi::One] } else { &[Pmi::One, Pmi::Two] };
    let mut rows = Vec::new();
    for &pmi in pmis {
        for &ranks in &args.ranks {
            let mut row = Row::new(pmi, ranks, servers.len());
            let piped = || if args.flux { Stdio::piped() } else { Stdio::null() };
            for round in 0..args.runs {
                for (i, &server) in servers.iter().enumerate() {
                    if row.failures[i] >= GIVE_UP {
                        continue;
                    }
                    match run(command(server, pmi, ranks, args.nodes, &program, &shim), piped()) {
                        Ok((t, stderr)) => {
                            row.times[i].push(t.as_secs_f64());
                            row.inside[i].push(Inside::read(&stderr));
                        }
                        Err(e) => {
                            row.failures[i] += 1;
                            eprintln!("init: {} {ranks} run {round}: {e}", name(server));
                        }
                    }
                }
            }
            // Without the shim, one more run each, with MPICH's client trace: one `send to fd` line per PMI
            // message it sends.
            for (i, &server) in servers.iter().enumerate() {
                if args.flux || row.failures[i] >= GIVE_UP {
                    continue;
                }
                let mut c = command(server, pmi, ranks, args.nodes, &program, &shim);
                c.env("PMI_DEBUG", "1");
                row.messages[i] = run(c, Stdio::piped()).ok().map(|(_, text)| {
                    let sent = String::from_utf8_lossy(&text).lines().filter(|l| l.contains("send to fd")).count();
                    sent as f64 / ranks as f64
                });
            }
            println!("{}", row.line(args.flux));
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
        Server::FluxRpmi => "flux, rpmi",
        Server::FluxSimple => "flux, pmi-simple",
    }
}

struct Row {
    pmi: Pmi,
    ranks: usize,
    /// Seconds of each run, by server ([`servers`]).
    times: Vec<Vec<f64>>,
    failures: Vec<usize>,
    /// PMI messages a rank sent, on average (from MPICH's trace).
    messages: Vec<Option<f64>>,
    /// What the processes said of each run, by server (`--flux`).
    inside: Vec<Vec<Inside>>,
}

impl Row {
    fn new(pmi: Pmi, ranks: usize, servers: usize) -> Row {
        let (times, inside) = ((0..servers).map(|_| Vec::new()).collect(), (0..servers).map(|_| Vec::new()).collect());
        Row { pmi, ranks, times, failures: vec![0; servers], messages: vec![None; servers], inside }
    }

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

    /// Server `i`'s median time over the first server's.
    fn ratio(&self, i: usize) -> String {
        match (median(self.times[0].clone()), median(self.times[i].clone())) {
            (Some(r), Some(h)) => format!("{:.2}x", h / r),
            _ => "-".into(),
        }
    }

    fn messages(&self, i: usize) -> String {
        self.messages[i].map_or("-".into(), |m| format!("{m:.1}"))
    }

    /// Over server `i`'s runs, the median of `f` of each run's processes.
    fn inside(&self, i: usize, f: impl Fn(&Inside) -> Option<f64>) -> Option<f64> {
        median(self.inside[i].iter().filter_map(f).collect())
    }

    /// Server `i`'s `MPI_Init`: the slowest process's, and the median process's (seconds, medians of runs).
    fn init(&self, i: usize) -> (Option<f64>, Option<f64>) {
        let max = |v: &Inside| v.init.iter().copied().reduce(f64::max);
        (self.inside(i, max), self.inside(i, |v| median(v.init.clone())))
    }

    /// Server `i`'s median process's seconds of `f` (medians of runs).
    fn median_process(&self, i: usize, f: fn(&Inside) -> &Vec<f64>) -> Option<f64> {
        self.inside(i, |v| median(f(v).clone()))
    }

    fn line(&self, flux: bool) -> String {
        if !flux {
            return format!(
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
            );
        }
        let ms = |x: Option<f64>| x.map_or("-".into(), |x| format!("{:.1} ms", x * 1e3));
        let mut out = Vec::new();
        for (i, &server) in servers(true).iter().enumerate() {
            let (slowest, typical) = self.init(i);
            let fields: [fn(&Inside) -> &Vec<f64>; 5] =
                [|v| &v.pmi, |v| &v.cpu_wait, |v| &v.last_in, |v| &v.answers, |v| &v.lines];
            let [pmi, cpu_wait, last_in, answers, lines] = fields.map(|f| self.median_process(i, f));
            let share = |part: Option<f64>| match (part, typical) {
                (Some(p), Some(t)) if t > 0.0 => format!("{:.1}%", 100.0 * p / t),
                _ => "-".into(),
            };
            out.push(format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                self.ranks,
                name(server),
                self.cell(i),
                ms(slowest),
                ms(typical),
                ms(pmi),
                share(pmi),
                ms(cpu_wait),
                ms(last_in),
                ms(answers),
                share(answers),
                lines.map_or("-".into(), |l| format!("{l:.0}"))
            ));
        }
        out.join("\n")
    }
}

fn report(args: &Args, mpich: &str, rows: &[Row]) -> String {
    let mut s = String::new();
    if args.flux {
        s.push_str("# MPI start-up under Flux: rpmi against pmi-simple\n\n");
        s.push_str(&format!(
            "`cargo bench --bench init -- --flux`: `MPI_Init` + `MPI_Finalize` ({mpich}), {} runs each, \
             interleaved, in 3-broker Flux instances (`flux start --test-size=3`, `flux run -N3`), `-o pmi=rpmi` \
             against Flux's `-o pmi=simple`, PMI-1 (MPICH asks for 1.1). Whole command: the instance's start \
             and end included, median (range). `MPI_Init`: each process times its own; the slowest's and the \
             median process's, medians of the runs. PMI: the time the median process spent reading and writing its \
             PMI connection during `MPI_Init` (waits for the server included) and the lines it wrote there, \
             counted by a preloaded shim (`benches/init/pmi_time.c`); share: over `MPI_Init`'s time, the median \
             process's. Of that time in PMI: **waiting for a CPU**, ready to run but not running (the kernel's \
             run delay, `/proc/thread-self/schedstat`, over the process's PMI calls); **for the last one in**, in \
             barriers before the last process entered them (from the shim's times on the machine's one clock): \
             the slowest process's own work; **for the server**, the rest, what the server's answers cost the \
             process, and its share of `MPI_Init`. Each column is its own median over the processes, so they \
             need not add up.\n\n",
            args.runs
        ));
        s.push_str(
            "| ranks | server | whole command | MPI_Init, slowest | MPI_Init, median | PMI, median | PMI's share \
             | waiting for a CPU | for the last one in | for the server | the server's share | PMI lines |\n\
             |---|---|---|---|---|---|---|---|---|---|---|---|\n",
        );
        for r in rows {
            s.push_str(&r.line(true));
            s.push('\n');
        }
        return s;
    }
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
        s.push_str(&r.line(false));
        s.push('\n');
    }
    s
}

//! `srun --mpi=rpmi` end to end, against a live Slurm cluster: real srun, real slurmstepds, real MPICH.
//!
//! Run with `cargo test --features slurm --test slurm` while the local 3-node cluster runs with the plugin:
//!
//! ```text
//! bash docker/install-slurm-plugin.sh --plugin-dir /tmp/rpmi-plugin     # builds and installs mpi_rpmi.so
//! bash docker/slurm-cluster.sh start --plugin-dir /tmp/rpmi-plugin
//! eval "$(bash docker/slurm-cluster.sh env)"
//! cargo test --features slurm --test slurm
//! bash docker/slurm-cluster.sh stop
//! ```
//!
//! Without `SLURM_CONF` every test fails, saying so: a missing cluster is never a silent pass. Tests run one
//! at a time (the cluster is shared); every srun has a hang guard, and every task carries a marker in its
//! environment so that the tests find (and clean up) their own processes and no one else's.

#![cfg(feature = "slurm")]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

#[path = "support/impi.rs"]
mod impi;
#[path = "support/libpmi.rs"]
mod libpmi;

/// Longest any one srun may take before the test calls it hung.
const GUARD: Duration = Duration::from_secs(60);

/// A step that rpmi ends (an abort, a task or node lost, a protocol error, a bound) is gone within this of
/// the cause, start-up included where a test times from srun's start. Not a performance target: it tells
/// a step rpmi ended from one left to Slurm's own time-outs (30 s and more), as when slurmctld does not find
/// the step it is asked to end.
const ENDED_WITHIN: Duration = Duration::from_secs(10);

/// Asserts that `run`, which rpmi was to end, ended within [`ENDED_WITHIN`] of its start.
fn assert_ended_soon(run: &Run, what: &str) {
    assert!(run.elapsed < ENDED_WITHIN, "{what}: the step was not ended within {ENDED_WITHIN:?}: {run}");
}

fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn cluster() {
    if std::env::var_os("SLURM_CONF").is_none() {
        panic!(
            "SLURM_CONF is not set, so there is no Slurm cluster to test against. Start the local one with the \
             plugin, then run the tests again:\n  bash docker/install-slurm-plugin.sh --plugin-dir /tmp/rpmi-plugin\n  \
             bash docker/slurm-cluster.sh start --plugin-dir /tmp/rpmi-plugin\n  \
             eval \"$(bash docker/slurm-cluster.sh env)\"\n  cargo test --features slurm --test slurm"
        );
    }
}

fn probe() -> &'static str {
    env!("CARGO_BIN_EXE_rpmi-probe")
}

/// tests/programs/mpi_pairs.c built with MPICH's mpicc, once.
fn mpi_pairs() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| build("mpi_pairs"))
}

/// tests/programs/NAME.c built with MPICH's mpicc.
fn build(name: &str) -> PathBuf {
    build_with("mpicc", name)
}

/// tests/programs/NAME.c built with `mpicc` (MPICH's, or another MPI's by its name).
fn build_with(mpicc: &str, name: &str) -> PathBuf {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("slurm-{mpicc}-{name}"));
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/programs/{name}.c"));
    let status = Command::new(mpicc)
        .args(["-O1", "-o"])
        .arg(&out)
        .arg(&src)
        .status()
        .unwrap_or_else(|e| panic!("{mpicc} not found ({e}); run docker/install-deps.sh"));
    assert!(status.success(), "{mpicc} failed on {}", src.display());
    out
}

/// A marker unique to one srun, in every task's environment (and the job name).
fn marker(name: &str) -> String {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    format!("rpmi-test-{}-{}-{name}", std::process::id(), N.fetch_add(1, std::sync::atomic::Ordering::SeqCst))
}

struct Run {
    status: ExitStatus,
    stdout: String,
    stderr: String,
    elapsed: Duration,
}

impl std::fmt::Display for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} after {:.2?}\n--- stdout\n{}--- stderr\n{}", self.status, self.elapsed, self.stdout, self.stderr)
    }
}

/// A running srun whose output is collected by two threads.
struct Srun {
    child: Child,
    mark: String,
    start: Instant,
    stdout_lines: mpsc::Receiver<String>,
    stdout: Option<std::thread::JoinHandle<String>>,
    stderr: Option<std::thread::JoinHandle<String>>,
}

fn collect(pipe: impl Read + Send + 'static, lines: Option<mpsc::Sender<String>>) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(pipe).lines() {
            let Ok(line) = line else { break };
            if let Some(tx) = &lines {
                let _ = tx.send(line.clone());
            }
            all.push_str(&line);
            all.push('\n');
        }
        all
    })
}

impl Srun {
    /// `srun -Q --mpi=rpmi ARGS...`, each task marked with `mark`.
    fn start(mark: &str, args: &[&str]) -> Srun {
        Srun::start_with(mark, "rpmi", args, &[])
    }

    /// `srun -Q --mpi=MPI ARGS...` with `env` added to srun's environment (without `-Q` when ARGS has `-v`:
    /// srun takes only one of them).
    fn start_with(mark: &str, mpi: &str, args: &[&str], env: &[(&str, &str)]) -> Srun {
        Srun::launch(mark, Command::new("srun"), mpi, args, env)
    }

    /// `salloc -Q ALLOC srun -Q --mpi=rpmi --exact ARGS...`: a step that leaves the rest of its allocation to
    /// the steps it spawns.
    fn start_in(mark: &str, alloc: &[&str], args: &[&str]) -> Srun {
        Srun::start_in_with(mark, alloc, args, &[])
    }

    /// The same, with `env` added to srun's environment.
    fn start_in_with(mark: &str, alloc: &[&str], args: &[&str], env: &[(&str, &str)]) -> Srun {
        let mut salloc = Command::new("salloc");
        salloc.args(["-Q", &format!("--job-name={mark}")]).args(alloc).arg("srun");
        let args: Vec<&str> = std::iter::once("--exact").chain(args.iter().copied()).collect();
        Srun::launch(mark, salloc, "rpmi", &args, env)
    }

    /// `command` (srun, or what runs it), then srun's arguments.
    fn launch(mark: &str, mut command: Command, mpi: &str, args: &[&str], env: &[(&str, &str)]) -> Srun {
        cluster();
        let quiet = (!args.contains(&"-v")).then_some("-Q");
        let mut child = command
            .args(quiet)
            .args([&format!("--mpi={mpi}"), &format!("--job-name={mark}")])
            .args(args)
            .envs(env.iter().copied())
            .env("RPMI_TEST_MARK", mark)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("srun not found ({e}); run docker/install-deps.sh"));
        let (tx, rx) = mpsc::channel();
        let stdout = collect(child.stdout.take().unwrap(), Some(tx));
        let stderr = collect(child.stderr.take().unwrap(), None);
        Srun {
            child,
            mark: mark.to_string(),
            start: Instant::now(),
            stdout_lines: rx,
            stdout: Some(stdout),
            stderr: Some(stderr),
        }
    }

    /// Waits for srun to exit; past the guard it is killed, its job cancelled, and the test fails.
    fn wait(mut self) -> Run {
        loop {
            if let Some(status) = self.child.try_wait().expect("waiting for srun") {
                let run = Run {
                    status,
                    elapsed: self.start.elapsed(),
                    stdout: self.stdout.take().unwrap().join().unwrap(),
                    stderr: self.stderr.take().unwrap().join().unwrap(),
                };
                no_leftovers(&self.mark);
                return run;
            }
            if self.start.elapsed() > GUARD {
                let _ = self.child.kill();
                let _ = self.child.wait();
                cleanup(&self.mark);
                let stderr = self.stderr.take().unwrap().join().unwrap();
                panic!("srun hung for {GUARD:?} (killed, job cancelled); stderr:\n{stderr}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The next stdout line satisfying `want`, within the guard.
    fn line(&self, want: impl Fn(&str) -> bool) -> String {
        let until = self.start + GUARD;
        loop {
            let left = until.saturating_duration_since(Instant::now());
            match self.stdout_lines.recv_timeout(left) {
                Ok(l) if want(&l) => return l,
                Ok(_) => {}
                Err(_) => panic!("srun printed no expected line within {GUARD:?}"),
            }
        }
    }
}

impl Drop for Srun {
    fn drop(&mut self) {
        if self.stdout.is_some() {
            // A test failed with srun still running: leave nothing behind.
            let _ = self.child.kill();
            let _ = self.child.wait();
            cleanup(&self.mark);
        }
    }
}

fn srun(mark: &str, args: &[&str]) -> Run {
    Srun::start(mark, args).wait()
}

/// Pids of live tasks (processes with `PMI_RANK` set: not srun) whose environment holds
/// `RPMI_TEST_MARK=mark` (and `extra`, if given).
fn marked(mark: &str, extra: Option<&str>) -> Vec<u32> {
    let want = format!("RPMI_TEST_MARK={mark}");
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else { continue };
        let vars: Vec<&[u8]> = env.split(|&b| b == 0).collect();
        if !vars.contains(&want.as_bytes())
            || !vars.iter().any(|v| v.starts_with(b"PMI_RANK="))
            || extra.is_some_and(|x| !vars.contains(&x.as_bytes()))
        {
            continue;
        }
        // Zombies are gone already.
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next());
        if matches!(state, Some(s) if s != 'Z' && s != 'X') && pid != std::process::id() {
            pids.push(pid);
        }
    }
    pids
}

/// The value of `name` in process `pid`'s environment.
fn env_var(pid: u32, name: &str) -> Option<String> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let prefix = format!("{name}=");
    env.split(|&b| b == 0)
        .find_map(|v| v.strip_prefix(prefix.as_bytes()).map(|x| String::from_utf8_lossy(x).into_owned()))
}

/// Cancels the marked job and kills what is left of its tasks.
fn cleanup(mark: &str) {
    let _ = Command::new("scancel").args(["--quiet", &format!("--name={mark}")]).status();
    for pid in marked(mark, None) {
        // SAFETY: a plain kill of a process this test started (it carries the test's marker).
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
}

/// After srun has exited, no task of its step may be left (waits a little for Slurm to reap them).
fn no_leftovers(mark: &str) {
    let until = Instant::now() + Duration::from_secs(15);
    loop {
        let left = marked(mark, None);
        if left.is_empty() {
            return;
        }
        if Instant::now() > until {
            cleanup(mark);
            panic!("tasks of {mark} still running 15 s after srun exited: {left:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn assert_success(run: &Run) {
    assert!(run.status.success(), "srun failed: {run}");
}

#[test]
fn mpi_list_shows_rpmi() {
    let _s = serial();
    cluster();
    let out = Command::new("srun").arg("--mpi=list").output().expect("srun");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(text.lines().any(|l| l.trim() == "rpmi"), "srun --mpi=list does not list rpmi:\n{text}");
}

/// The environment that makes the PMI tree a chain over the local cluster's 3 nodes: srun, n1, n2, n3.
const CHAIN: &[(&str, &str)] = &[("SLURM_RPMI_TREE_WIDTH", "1")];
/// The same chain with the exchanges by Bruck's allgather: n3 also joins n1 (its peer in round 1), beside n2.
const BRUCK: &[(&str, &str)] = &[("SLURM_RPMI_TREE_WIDTH", "1"), ("SLURM_RPMI_ALLGATHER", "bruck")];

fn pairs(name: &str, layout: &[&str], ranks: usize) {
    pairs_with(name, layout, ranks, &[]);
}

fn pairs_with(name: &str, layout: &[&str], ranks: usize, env: &[(&str, &str)]) -> Run {
    let _s = serial();
    let program = mpi_pairs().to_str().unwrap();
    let mut args = layout.to_vec();
    args.push(program);
    let run = Srun::start_with(&marker(name), "rpmi", &args, env).wait();
    assert_success(&run);
    let want = format!("mpi_pairs: {ranks} ranks, allreduce {}, all pairs exchanged", ranks * (ranks + 1) / 2);
    assert!(run.stdout.contains(&want), "no `{want}`: {run}");
    eprintln!("{name}: {:.2?}", run.elapsed);
    run
}

/// MPICH's own PMI-2 client (MPICH 4.1 and later with `MPIR_CVAR_PMI_VERSION=2`: Debian 13's 4.2.1 and
/// unstable's 5.0). Only the chroots of the 24.11 and 26.05 lines have one (this machine's 4.0.2 ignores the
/// variable and speaks PMI-1), so these tests are run by name there (docker/slurm-plugin.sh). The wire trace
/// (`PMI_DEBUG=1`) shows that every rank spoke PMI-2.
const PMI2: &[(&str, &str)] = &[("MPIR_CVAR_PMI_VERSION", "2"), ("PMI_DEBUG", "1")];

fn assert_spoke_pmi2(run: &Run, ranks: usize) {
    for rank in 0..ranks {
        let want = format!("rank {rank} C: cmd=fullinit;");
        assert!(run.stderr.contains(&want), "rank {rank} did not speak PMI-2 (no `{want}`): {run}");
    }
}

#[test]
#[ignore = "needs an MPICH that speaks PMI-2 (4.1 or later): run by name in the 24.11 and 26.05 chroots"]
fn pmi2_mpich_pairs() {
    for (name, layout) in
        [("pmi2-block", ["-N3", "-n6", "-m", "block"]), ("pmi2-cyclic", ["-N3", "-n6", "-m", "cyclic"])]
    {
        let run = pairs_with(name, &layout, 6, PMI2);
        assert_spoke_pmi2(&run, 6);
    }
}

#[test]
#[ignore = "needs an MPICH that speaks PMI-2 (4.1 or later): run by name in the 24.11 and 26.05 chroots"]
fn pmi2_mpich_names() {
    let run = names_with("pmi2-names", &["-N3", "-n4", "-m", "cyclic"], PMI2);
    assert_spoke_pmi2(&run, 4);
}

/// The same MPICH under rpmi-run (here: only the chroots have it), 8 ranks over 3 virtual nodes.
#[test]
#[ignore = "needs an MPICH that speaks PMI-2 (4.1 or later): run by name in the 24.11 and 26.05 chroots"]
fn pmi2_mpich_pairs_under_rpmi_run() {
    let _s = serial();
    let out = Command::new(env!("CARGO_BIN_EXE_rpmi-run"))
        .args(["-n", "8", "--nodes", "3", "--trace"])
        .arg(mpi_pairs())
        .env("MPIR_CVAR_PMI_VERSION", "2")
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success() && stdout.contains("mpi_pairs: 8 ranks, allreduce 36, all pairs exchanged"),
        "{stdout}{stderr}"
    );
    for rank in 0..8 {
        assert!(stderr.contains(&format!("rank {rank} C: cmd=fullinit;")), "rank {rank} did not speak PMI-2: {stderr}");
    }
}

/// MPI_Publish_name, MPI_Lookup_name and MPI_Unpublish_name through srun's table for the step: 4 ranks, rank 0
/// publishing, the others looking its port up; a second publish, a lookup of a name never published and one
/// of the name once unpublished fail. (MPICH over UCX cannot open a port: the program then publishes a
/// stand-in of the same shape.)
fn names(name: &str, layout: &[&str]) -> Run {
    names_with(name, layout, &[])
}

fn names_with(name: &str, layout: &[&str], env: &[(&str, &str)]) -> Run {
    let mut args = layout.to_vec();
    args.push(mpi_names().to_str().unwrap());
    names_of(name, &args, env)
}

/// tests/programs/mpi_names.c built with MPICH's mpicc, once.
fn mpi_names() -> &'static Path {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| build("mpi_names"))
}

/// srun ARGS, a step of mpi_names over 4 ranks.
fn names_of(name: &str, args: &[&str], env: &[(&str, &str)]) -> Run {
    let _s = serial();
    let run = Srun::start_with(&marker(name), "rpmi", args, env).wait();
    assert_success(&run);
    let want = "mpi_names: 3 ranks looked up the port; duplicate publish, unknown and unpublished lookups failed";
    assert!(run.stdout.contains(want), "no `{want}`: {run}");
    run
}

#[test]
fn names_on_one_node() {
    names("names-one", &["-N1", "-n4"]);
}

#[test]
fn names_on_three_nodes() {
    names("names-three", &["-N3", "-n4", "-m", "cyclic"]);
}

/// `srun LAYOUT --multi-prog CONF`, CONF a file of the test's own holding `lines`; it must succeed.
fn multi_prog(name: &str, layout: &[&str], lines: &str) -> Run {
    let _s = serial();
    let conf = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("slurm-{name}.conf"));
    std::fs::write(&conf, lines).unwrap();
    let mut args = layout.to_vec();
    args.extend(["--multi-prog", conf.to_str().unwrap()]);
    let run = Srun::start_with(&marker(name), "rpmi", &args, &[]).wait();
    assert_success(&run);
    run
}

/// MPMD with `srun --multi-prog`: each rank's appnum is the index of the line that runs it.
#[test]
fn a_multi_prog_steps_ranks_read_their_lines_appnums() {
    let p = probe();
    let run = multi_prog("mpmd", &["-N2", "-n5"], &format!("# MPMD\n0,2 {p} info\n1 {p} info\n3-4 {p} info\n"));
    let mut appnums: Vec<(u32, String)> = run
        .stdout
        .lines()
        .filter(|l| l.starts_with("rank=") && l.contains(" appnum="))
        .map(|l| (words(l)["rank"].parse().unwrap(), words(l)["appnum"].to_string()))
        .collect();
    appnums.sort();
    let want: Vec<(u32, String)> = [0, 1, 0, 2, 2].iter().enumerate().map(|(r, a)| (r as u32, a.to_string())).collect();
    assert_eq!(appnums, want, "{run}");
}

/// The same with real MPICH: one MPI_COMM_WORLD over both programs, each rank's MPI_APPNUM its line's.
#[test]
fn mpmd_with_mpich_under_multi_prog() {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    let program = BUILT.get_or_init(|| build("mpi_mpmd")).to_str().unwrap();
    let run = multi_prog("mpmd-mpich", &["-N3", "-n5"], &format!("0-1 {program} a\n2-4 {program} b\n"));
    for line in
        ["rank 0 appnum 0 label a", "rank 1 appnum 0 label a", "rank 2 appnum 1 label b", "rank 4 appnum 1 label b"]
    {
        assert!(run.stdout.contains(line), "no `{line}`: {run}");
    }
    assert!(run.stdout.contains("mpi_mpmd: 5 ranks in one MPI_COMM_WORLD"), "{run}");
}

// Heterogeneous steps (`srun A : B`): one job over every component's tasks, ranked component after component,
// each component's tasks with its index as their appnum. srun makes a hetjob of one component per `:`-separated
// part (allocated by the backfill scheduler: the cluster runs it every second).

/// `srun -N1 -n2 PROGRAM ARGS : -N2 -n3 PROGRAM ARGS`: ranks 0-1 on n1 (component 0), 2-3 on n2 and 4 on n3
/// (component 1).
fn het_args<'a>(program: &'a str, args: &[&'a str]) -> Vec<&'a str> {
    let component = |layout: [&'a str; 2]| layout.into_iter().chain([program]).chain(args.iter().copied());
    component(["-N1", "-n2"]).chain([":"]).chain(component(["-N2", "-n3"])).collect()
}

/// What each rank's `rpmi-probe info` says in `stdout`, by rank.
fn infos(stdout: &str) -> BTreeMap<u32, BTreeMap<&str, &str>> {
    let lines = stdout.lines().filter(|l| l.starts_with("rank=") && l.contains(" appnum="));
    lines.map(words).map(|w| (w["rank"].parse().unwrap(), w)).collect()
}

#[test]
fn a_heterogeneous_step_is_one_job_each_components_tasks_with_its_appnum() {
    let _s = serial();
    let run = srun(&marker("het-info"), &het_args(probe(), &["info"]));
    assert_success(&run);
    let infos = infos(&run.stdout);
    assert_eq!(infos.keys().copied().collect::<Vec<_>>(), [0, 1, 2, 3, 4], "{run}");
    let appnums: Vec<&str> = infos.values().map(|w| w["appnum"]).collect();
    assert_eq!(appnums, ["0", "0", "1", "1", "1"], "{run}");
    for w in infos.values() {
        assert_eq!((w["size"], w["universe"]), ("5", "5"), "{run}");
        assert_eq!(w["kvsname"], infos[&0]["kvsname"], "one job, one key-value space: {run}");
        // n1: ranks 0-1, n2: 2-3, n3: 4; each rank's clique is its node's ranks.
        assert_eq!(w["mapping"], "(vector,(0,2,2),(2,1,1))", "{run}");
    }
    let cliques: Vec<&str> = infos.values().map(|w| w["clique"]).collect();
    assert_eq!(cliques, ["0,1", "0,1", "2,3", "2,3", "4"], "{run}");
}

/// A rank of every component sends to and hears from every other (mpi_pairs), and MPICH's MPI_APPNUM is the
/// component's (mpi_mpmd).
fn mpich_het(name: &str, env: &[(&str, &str)]) -> (Run, Run) {
    let _s = serial();
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    let mpmd = BUILT.get_or_init(|| build("mpi_mpmd")).to_str().unwrap();
    // Each component's label.
    let args = ["-N1", "-n2", mpmd, "a", ":", "-N2", "-n3", mpmd, "b"];
    let run = Srun::start_with(&marker(name), "rpmi", &args, env).wait();
    assert_success(&run);
    for rank in 0..5 {
        let line = format!("rank {rank} appnum {} label {}", (rank >= 2) as u32, if rank < 2 { "a" } else { "b" });
        assert!(run.stdout.contains(&line), "no `{line}`: {run}");
    }
    assert!(run.stdout.contains("mpi_mpmd: 5 ranks in one MPI_COMM_WORLD"), "{run}");
    let pairs = Srun::start_with(&marker(name), "rpmi", &het_args(mpi_pairs().to_str().unwrap(), &[]), env).wait();
    assert_success(&pairs);
    assert!(pairs.stdout.contains("mpi_pairs: 5 ranks, allreduce 15, all pairs exchanged"), "{pairs}");
    eprintln!("{name}: mpi_mpmd {:.2?}, mpi_pairs {:.2?}", run.elapsed, pairs.elapsed);
    (run, pairs)
}

#[test]
fn mpich_runs_one_world_over_the_components_of_a_heterogeneous_step() {
    mpich_het("het-mpich", &[]);
}

#[test]
#[ignore = "needs an MPICH that speaks PMI-2 (4.1 or later): run by name in the 24.11 and 26.05 chroots"]
fn pmi2_mpich_runs_one_world_over_the_components_of_a_heterogeneous_step() {
    let (mpmd, pairs) = mpich_het("het-pmi2", PMI2);
    assert_spoke_pmi2(&mpmd, 5);
    assert_spoke_pmi2(&pairs, 5);
}

/// Over a chain of stepds (srun, n1, n2, n3): the second component's stepds join the first's in the tree.
#[test]
fn mpich_over_a_chain_across_the_components_of_a_heterogeneous_step() {
    let _s = serial();
    let run = Srun::start_with(&marker("het-chain"), "rpmi", &het_args(mpi_pairs().to_str().unwrap(), &[]), CHAIN);
    let run = run.wait();
    assert_success(&run);
    assert!(run.stdout.contains("mpi_pairs: 5 ranks, allreduce 15, all pairs exchanged"), "{run}");
}

/// PMI 1.2's group barriers across components: the node roots of both exchange cards over a group barrier,
/// each node meets in a NODE barrier, every rank waits in WORLD's and its parity's at once.
#[test]
fn group_barriers_across_the_components_of_a_heterogeneous_step() {
    let _s = serial();
    let run = srun(&marker("het-groups"), &het_args(probe(), &["groups"]));
    assert_success(&run);
    assert!(run.stdout.contains("groups: 5 ranks, 3 node roots exchanged cards"), "{run}");
}

/// sbatch of a hetjob (`#SBATCH hetjob`) of two components, -N1 -n2 and -N2 -n3, whose script runs `body`,
/// waited for until squeue no longer lists it (`sbatch --wait` looks every 2 s, then every 4, 8...); what
/// the script wrote. The status is sbatch's: the script's output says how its steps went.
fn hetjob_script(name: &str, body: &str) -> Run {
    cluster();
    let mark = marker(name);
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let (script, out) = (dir.join(format!("{mark}.sh")), dir.join(format!("{mark}.out")));
    std::fs::write(&script, format!("#!/bin/bash\n#SBATCH -N1 -n2\n#SBATCH hetjob\n#SBATCH -N2 -n3\n{body}")).unwrap();
    let _ = std::fs::remove_file(&out);
    let start = Instant::now();
    let sbatch = Command::new("sbatch")
        .args(["--parsable", &format!("--job-name={mark}"), "-o"])
        .arg(&out)
        .arg(&script)
        .env("RPMI_TEST_MARK", &mark)
        .output()
        .expect("sbatch");
    assert!(sbatch.status.success(), "sbatch: {}", String::from_utf8_lossy(&sbatch.stderr));
    let job = String::from_utf8_lossy(&sbatch.stdout).trim().to_string();
    // squeue lists a job, each component of a hetjob, while it is pending, running or completing.
    loop {
        let listed = Command::new("squeue").args(["-h", "-j", &job, "-o", "%T"]).output().expect("squeue");
        if listed.status.success() && listed.stdout.is_empty() {
            break;
        }
        if start.elapsed() > GUARD {
            cleanup(&mark);
            panic!("the hetjob did not end within {GUARD:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let text = std::fs::read_to_string(&out).unwrap_or_default();
    Run { status: sbatch.status, stdout: text, stderr: String::new(), elapsed: start.elapsed() }
}

/// A batch script's hetjob: a step over both components (`--het-group=0,1`) is one job, and a step of the
/// second alone is a job of its own (appnum 0).
#[test]
fn a_hetjob_scripts_step_over_both_components_is_one_job() {
    let _s = serial();
    let p = probe();
    let run = hetjob_script(
        "het-sbatch",
        &format!(
            "srun -Q --mpi=rpmi --het-group=0,1 {p} info\necho \"both: $?\"\n\
             srun -Q --mpi=rpmi --het-group=1 {p} info | sed 's/^/alone: /'\necho \"alone: $?\"\n"
        ),
    );
    assert!(run.stdout.contains("both: 0\n") && run.stdout.contains("alone: 0\n"), "{run}");
    let both = infos(&run.stdout);
    let appnums: Vec<&str> = both.values().map(|w| w["appnum"]).collect();
    assert_eq!(appnums, ["0", "0", "1", "1", "1"], "{run}");
    assert!(both.values().all(|w| w["size"] == "5"), "{run}");
    let alone: Vec<&str> = run.stdout.lines().filter_map(|l| l.strip_prefix("alone: rank=")).collect();
    assert_eq!(alone.len(), 3, "{run}");
    assert!(alone.iter().all(|l| l.contains(" size=3 ") && l.contains(" appnum=0 ")), "{run}");
    eprintln!("hetjob batch script: {:.2?}", run.elapsed);
}

/// Ending a step of a hetjob ends that step, not the job: an abort in a heterogeneous step, then one in a step
/// of the leader's component alone, and the script's next step still runs (from 25.11 on, slurmctld ends the
/// whole hetjob when asked to SIGKILL a step of its leader's job).
#[test]
fn aborts_in_a_hetjob_end_their_steps_not_the_job() {
    let _s = serial();
    let (pairs, p) = (mpi_pairs().to_str().unwrap(), probe());
    let run = hetjob_script(
        "het-sbatch-abort",
        &format!(
            "srun -Q --mpi=rpmi --het-group=0 {pairs} : --het-group=1 {pairs} abort=3:7\necho \"het: $?\"\n\
             srun -Q --mpi=rpmi --het-group=0 {pairs} abort=0:5\necho \"lone: $?\"\n\
             srun -Q --mpi=rpmi --het-group=0,1 {p} info | grep -c '^rank=' | sed 's/^/after: /'\n"
        ),
    );
    for line in ["het: 7", "lone: 5", "after: 5"] {
        assert!(run.stdout.lines().any(|l| l == line), "no `{line}`: {run}");
    }
}

#[test]
fn an_abort_in_the_second_component_ends_the_heterogeneous_step_with_its_code() {
    let _s = serial();
    let p = mpi_pairs().to_str().unwrap();
    let run = srun(&marker("het-abort"), &["-N1", "-n2", p, ":", "-N2", "-n3", p, "abort=3:7"]);
    assert_eq!(run.status.code(), Some(7), "srun should exit with the abort code: {run}");
    assert!(run.stderr.contains("rpmi: rank 3 on n2 called PMI_Abort with exit code 7"), "{run}");
    eprintln!("het-abort: srun exited 7 after {:.2?}", run.elapsed);
    assert_ended_soon(&run, "an abort in a heterogeneous step");
}

/// Rank 4, alone on n3 in the second component, is killed while every other rank waits for it.
#[test]
fn a_sigkilled_task_of_one_component_ends_the_heterogeneous_step_naming_it() {
    let args = het_args(mpi_pairs().to_str().unwrap(), &["hang_before_init=4"]);
    let run = killed_task_ends_step_of("het-kill", &args, 4, 5, false, &[]);
    let error = run.stderr.lines().find(|l| l.starts_with("srun: error: rpmi:")).unwrap_or_else(|| panic!("{run}"));
    assert!(error.contains("rank 4") && error.contains("n3"), "the first error does not name rank 4 on n3: {run}");
}

/// The name service from a heterogeneous step: rank 0 publishes, the ranks of both components look it up.
#[test]
fn names_across_the_components_of_a_heterogeneous_step() {
    let p = mpi_names().to_str().unwrap();
    names_of("het-names", &["-N1", "-n2", p, ":", "-N2", "-n2", p], &[]);
}

/// `pmi_spawn.sh` as the first component of a heterogeneous step in a hetjob allocation, `rpmi-probe info`
/// as the second: its spawns are steps of the hetjob's first component, as from any step.
#[test]
fn spawns_from_a_heterogeneous_step_start_steps_of_its_job() {
    let _s = serial();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/programs/pmi_spawn.sh");
    let (script, p) = (script.to_str().unwrap(), probe());
    let first = ["--het-group=0", "-n1", script, p, "n1"];
    let args: Vec<&str> = first.into_iter().chain([":", "--het-group=1", "--exact", "-N1", "-n1", p, "info"]).collect();
    let run = Srun::start_in(&marker("het-spawn"), &["-N1", "-n8", ":", "-N2", "-n2"], &args).wait();
    assert_success(&run);
    let answers = spawn_answers(&run);
    assert_eq!(answers.len(), 3, "{run}");
    assert!(answers.iter().all(|a| a.contains(" rc=0 ")), "{run}");
    assert!(run.stdout.lines().any(|l| l == "rank=0 greeting=hello world"), "{run}");
    // The heterogeneous step's second rank, and the first spawn's three (appnums 0, 1, 1).
    let infos: Vec<BTreeMap<&str, &str>> =
        run.stdout.lines().filter(|l| l.starts_with("rank=") && l.contains(" appnum=")).map(words).collect();
    let mut seen: Vec<(&str, &str, &str)> = infos.iter().map(|w| (w["size"], w["rank"], w["appnum"])).collect();
    seen.sort();
    assert_eq!(seen, [("2", "1", "1"), ("3", "0", "0"), ("3", "1", "1"), ("3", "2", "1")], "{run}");
}

#[test]
#[ignore = "needs MPICH 5: run by name"]
fn mpich5_spawn_from_a_heterogeneous_step() {
    let _s = serial();
    let program = mpich5("mpi_spawn");
    let program = program.to_str().unwrap();
    let args = ["--het-group=0", "-n1", program, "3", ":", "--het-group=1", "--exact", "-N1", "-n1", program, "3"];
    let alloc = ["-N1", "-n5", ":", "-N2", "-n2"];
    // Both components' ranks check their appnum: 0 and 1.
    let run = Srun::start_in_with(&marker("het-spawn-mpich5"), &alloc, &args, &[("MPI_SPAWN_COMMANDS", "2")]).wait();
    assert_success(&run);
    assert!(run.stdout.contains("mpi_spawn: 2 parents, 3 children, depth 1"), "{run}");
}

/// `pmi_spawn.sh` as one task of a step in `salloc ALLOC`, its spawns asking for `host`; it must succeed.
fn pmi_spawn_sh(mark: &str, alloc: &[&str], host: &str) -> Run {
    let _s = serial();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/programs/pmi_spawn.sh");
    let run = Srun::start_in(&marker(mark), alloc, &["-n1", script.to_str().unwrap(), probe(), host]).wait();
    assert_success(&run);
    run
}

/// The spawner's answers, in order.
fn spawn_answers(run: &Run) -> Vec<&str> {
    run.stdout.lines().filter(|l| l.starts_with("spawner: ")).collect()
}

/// Each spawn is a new step of the job: two commands with their appnums, the info keys `host`, `path` and
/// `wdir`, the preputs, and `PMI_SPAWNED=1`.
#[test]
fn spawn_on_the_wire_starts_steps_with_preputs_and_appnums() {
    let run = pmi_spawn_sh("spawn", &["-N2", "-n8"], "n2");
    let answers = spawn_answers(&run);
    let started = [
        "spawner: cmd=spawn_result rc=0 errcodes=0,0,0",
        "spawner: cmd=spawn_result rc=0 errcodes=0,0",
        "spawner: cmd=spawn_result rc=0 errcodes=0",
    ];
    assert_eq!(answers, started, "{run}");
    let infos: Vec<BTreeMap<&str, &str>> =
        run.stdout.lines().filter(|l| l.starts_with("rank=") && l.contains(" appnum=")).map(words).collect();
    let mut appnums: Vec<(&str, &str)> = infos.iter().map(|w| (w["rank"], w["appnum"])).collect();
    appnums.sort();
    assert_eq!(appnums, [("0", "0"), ("1", "1"), ("2", "1")], "{run}");
    assert!(infos.iter().all(|w| w["size"] == "3" && w["kvsname"].starts_with("rpmi_")), "{run}");
    for line in ["rank=0 greeting=hello world", "rank=1 greeting=hello world", "1"] {
        assert!(run.stdout.lines().any(|l| l == line), "no `{line}`: {run}");
    }
}

/// A spawn the allocation cannot hold now fails with a message the task reads; the step goes on.
#[test]
fn a_spawn_the_allocation_cannot_hold_fails_with_a_message() {
    let run = pmi_spawn_sh("spawn-full", &["-N1", "-n2"], "n1");
    let answers = spawn_answers(&run);
    assert_eq!(answers.len(), 3, "{run}");
    // 3 and 2 processes do not fit in the 1 CPU left; 1 does.
    for refused in &answers[..2] {
        assert!(refused.contains("rc=-1 msg=srun_for_the_spawned_step_exited_with_status_1_before_its_step_was_made"));
    }
    assert_eq!(answers[2], "spawner: cmd=spawn_result rc=0 errcodes=0", "{run}");
}

/// A spawn whose preput the new step would refuse (a key over `keylen_max`) is refused before any step
/// starts, with a message the task reads; the step goes on.
#[test]
fn a_spawn_with_a_preput_the_new_step_would_refuse_fails_at_once() {
    let _s = serial();
    let key = "k".repeat(100);
    let script = format!(
        "printf 'cmd=init pmi_version=1 pmi_subversion=1\\n' >&$PMI_FD; read -r l <&$PMI_FD; \
         printf 'mcmd=spawn\\nnprocs=1\\nexecname=true\\ntotspawns=1\\nspawnssofar=1\\nargcnt=0\\n\
         preput_num=1\\npreput_key_0={key}\\npreput_val_0=v\\ninfo_num=0\\nendcmd\\n' >&$PMI_FD; \
         read -r l <&$PMI_FD; echo \"spawner: $l\"; printf 'cmd=finalize\\n' >&$PMI_FD; read -r l <&$PMI_FD"
    );
    let run = Srun::start_in(&marker("spawn-preput"), &["-N1", "-n2"], &["-n1", "bash", "-c", &script]).wait();
    assert_success(&run);
    let answer = run.stdout.lines().find(|l| l.starts_with("spawner: ")).unwrap_or_default();
    assert!(answer.starts_with("spawner: cmd=spawn_result rc=-1 msg=the_preput_'k"), "{run}");
    assert!(!run.stderr.contains("Unable to create step"), "{run}");
}

/// A spawn whose arguments hold a bare `:` is refused before any step starts: srun would read it as the
/// separator of a heterogeneous step, and what follows as its own options (here `--mpi=none`, then a program
/// that would print). The step goes on.
#[test]
fn a_spawn_with_a_bare_colon_argument_is_refused() {
    let _s = serial();
    let script = "printf 'cmd=init pmi_version=1 pmi_subversion=1\\n' >&$PMI_FD; read -r l <&$PMI_FD; \
         printf 'mcmd=spawn\\nnprocs=1\\nexecname=true\\ntotspawns=1\\nspawnssofar=1\\nargcnt=4\\narg1=:\\n\
         arg2=--mpi=none\\narg3=echo\\narg4=colon-ran\\npreput_num=0\\ninfo_num=0\\nendcmd\\n' >&$PMI_FD; \
         read -r l <&$PMI_FD; echo \"spawner: $l\"; printf 'cmd=finalize\\n' >&$PMI_FD; read -r l <&$PMI_FD";
    let run = Srun::start_in(&marker("spawn-colon"), &["-N1", "-n2"], &["-n1", "bash", "-c", script]).wait();
    assert_success(&run);
    let answer = run.stdout.lines().find(|l| l.starts_with("spawner: ")).unwrap_or_default();
    assert!(answer.starts_with("spawner: cmd=spawn_result rc=-1 msg=an_argument_':'_in_a_spawn"), "{run}");
    assert!(!run.stdout.contains("colon-ran"), "srun took the task's options: {run}");
}

/// A spawn one of whose programs is missing: the new step fails before all of its tasks ran, and the spawn is
/// answered with error code -1 for every process; the tasks that did start (waiting in a barrier for the
/// missing ones) are ended, and the spawning step goes on.
#[test]
fn a_spawn_of_a_missing_program_answers_error_codes_and_ends_the_new_step() {
    let _s = serial();
    let script = format!(
        "printf 'cmd=init pmi_version=1 pmi_subversion=1\\n' >&$PMI_FD; read -r l <&$PMI_FD; \
         printf 'mcmd=spawn\\nnprocs=2\\nexecname={probe}\\ntotspawns=2\\nspawnssofar=1\\nargcnt=1\\narg1=barrier\\n\
         preput_num=0\\ninfo_num=0\\nendcmd\\n' >&$PMI_FD; \
         printf 'mcmd=spawn\\nnprocs=1\\nexecname=/nonexistent/rpmi-no-such-program\\ntotspawns=2\\nspawnssofar=2\\n\
         argcnt=0\\npreput_num=0\\ninfo_num=0\\nendcmd\\n' >&$PMI_FD; \
         read -r l <&$PMI_FD; echo \"spawner: $l\"; printf 'cmd=finalize\\n' >&$PMI_FD; read -r l <&$PMI_FD",
        probe = probe()
    );
    let run = Srun::start_in(&marker("spawn-missing"), &["-N2", "-n6"], &["-n1", "bash", "-c", &script]).wait();
    assert_success(&run);
    assert_eq!(spawn_answers(&run), ["spawner: cmd=spawn_result rc=0 errcodes=-1,-1,-1"], "{run}");
    assert!(run.stderr.contains("before its first PMI line"), "{run}");
    assert!(run.stderr.lines().any(|l| l.contains("rank 2 of spawned step ")), "{run}");
    assert!(run.stderr.contains("/nonexistent/rpmi-no-such-program"), "Slurm's own reason: {run}");
    // The spawned tasks that did start wait in a barrier for ever: only the new step's end stops them.
    assert_ended_soon(&run, "a spawned step with a missing program");
}

/// The MPICH 5 programs of `tests/programs`, built with the MPICH 5 that `docker/install-deps.sh` installs in
/// `/opt/rpmi-mpich5` (Debian 12's MPICH cannot spawn): only the run on this machine's Slurm has it, so these
/// tests are run by name (`docker/test.sh`: `-- --ignored mpich5_`).
fn mpich5(name: &str) -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("slurm-mpich5");
        std::fs::create_dir_all(&dir).unwrap();
        dir
    });
    let mpicc = Path::new("/opt/rpmi-mpich5/bin/mpicc");
    assert!(mpicc.exists(), "no MPICH 5 at {}: run docker/install-deps.sh", mpicc.display());
    let out = dir.join(name);
    if !out.exists() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/programs/{name}.c"));
        let status = Command::new(mpicc).args(["-O1", "-o"]).arg(&out).arg(&src).status().unwrap();
        assert!(status.success(), "{} failed on {}", mpicc.display(), src.display());
    }
    out
}

fn mpich5_spawn(mark: &str, alloc: &[&str], args: &[&str]) -> Run {
    let _s = serial();
    let program = mpich5(args[0]);
    let mut all = vec!["-n2", program.to_str().unwrap()];
    all.extend(&args[1..]);
    Srun::start_in(&marker(mark), alloc, &all).wait()
}

#[test]
#[ignore = "needs MPICH 5: run by name"]
fn mpich5_spawn_of_3_from_2_merged_and_checked() {
    let run = mpich5_spawn("spawn-3", &["-N2", "-n5"], &["mpi_spawn", "3"]);
    assert_success(&run);
    assert!(run.stdout.contains("mpi_spawn: 2 parents, 3 children, depth 1"), "{run}");
}

#[test]
#[ignore = "needs MPICH 5: run by name"]
fn mpich5_nested_spawn_two_levels() {
    let run = mpich5_spawn("spawn-nested", &["-N3", "-n8"], &["mpi_spawn", "3", "2"]);
    assert_success(&run);
    assert!(run.stdout.contains("mpi_spawn: 2 parents, 3 children, depth 2 (6 processes below"), "{run}");
}

#[test]
#[ignore = "needs MPICH 5: run by name"]
fn mpich5_spawn_multiple_with_appnums_and_argvs() {
    let run = mpich5_spawn("spawn-multiple", &["-N2", "-n5"], &["mpi_spawn_multiple"]);
    assert_success(&run);
    assert!(run.stdout.contains("appnums, argvs and merge checked"), "{run}");
    assert!(!run.stderr.contains("error"), "{run}");
}

/// A program missing on the nodes: MPI_Comm_spawn returns error codes, the spawning step goes on and ends
/// well, and nothing of the new step is left.
#[test]
#[ignore = "needs MPICH 5: run by name"]
fn mpich5_spawn_of_a_missing_program_returns_error_codes() {
    let run = mpich5_spawn("spawn-missing", &["-N2", "-n5"], &["mpi_spawn_missing"]);
    assert_success(&run);
    assert!(run.stdout.contains("mpi_spawn_missing: spawn failed as expected"), "{run}");
    assert!(run.stderr.contains("before its first PMI line"), "{run}");
}

/// An abort in a spawned step ends the step that spawned it, with the abort's exit code (the spawning ranks'
/// own aborts, which follow from it, may reach srun first).
#[test]
#[ignore = "needs MPICH 5: run by name"]
fn mpich5_an_abort_in_a_spawned_step_ends_both_with_its_code() {
    let _s = serial();
    let program = mpich5("mpi_spawn");
    let args = ["--exact", "-n2", program.to_str().unwrap(), "3"];
    let mut salloc = Command::new("salloc");
    salloc.args(["-Q", "-N2", "-n5", "srun"]);
    let run = Srun::launch(&marker("spawn-abort"), salloc, "rpmi", &args, &[("MPI_SPAWN_ABORT_LEVEL", "1")]).wait();
    assert_eq!(run.status.code(), Some(42), "{run}");
    assert!(run.stderr.contains("which rank 0 spawned, failed"), "{run}");
    assert_ended_soon(&run, "an abort in a spawned step");
}

#[test]
fn mpi_pairs_block() {
    pairs("block", &["-N3", "-n6"], 6);
}

#[test]
fn mpi_pairs_cyclic() {
    pairs("cyclic", &["-N3", "-n12", "-m", "cyclic"], 12);
}

#[test]
fn mpi_pairs_plane() {
    pairs("plane", &["-N3", "-n12", "-m", "plane=2"], 12);
}

/// How many nodes the cluster has.
fn node_count() -> usize {
    cluster();
    let out = Command::new("sinfo").args(["-h", "-N", "-o", "%N"]).output().expect("sinfo");
    let names: std::collections::BTreeSet<String> =
        String::from_utf8_lossy(&out.stdout).lines().map(String::from).collect();
    names.len()
}

/// Over a cluster of 100 nodes or more (`docker/slurm-cluster.sh start --nodes 100`), so not part of the usual
/// run on 3 (`cargo test --features slurm --test slurm -- --ignored`): an MPICH job over 100 nodes in a tree
/// of width 2 (height 6), and the put+barrier of 200 ranks at several widths.
#[test]
#[ignore]
fn a_hundred_nodes_in_a_tree_of_width_2() {
    let nodes = node_count();
    assert!(nodes >= 100, "the cluster has {nodes} nodes; start one of 100: docker/slurm-cluster.sh start --nodes 100");
    pairs_with("hundred", &["-N100", "-n100"], 100, &[("SLURM_RPMI_TREE_WIDTH", "2")]);
    let _s = serial();
    for width in ["1", "2", "4", "16", "100"] {
        let args = ["-N100", "-n200", probe(), "exchange", "--puts", "1", "--size", "300"];
        let env = [("SLURM_RPMI_TREE_WIDTH", width)];
        let run = Srun::start_with(&marker("hundred-exchange"), "rpmi", &args, &env).wait();
        assert_success(&run);
        let line = run.stdout.lines().find(|l| l.starts_with("exchange: size=200")).unwrap_or_else(|| panic!("{run}"));
        eprintln!("width {width}: {line} (srun {:.2?})", run.elapsed);
    }
}

#[test]
fn mpi_pairs_over_a_chain_of_stepds() {
    pairs_with("chain", &["-N3", "-n12", "-m", "cyclic"], 12, CHAIN);
}

#[test]
fn mpi_pairs_by_bruck_allgather() {
    pairs_with("bruck", &["-N3", "-n12", "-m", "cyclic"], 12, BRUCK);
}

/// No exchange passes through srun: node 0, the tree's top, sends each exchange's result to its k children
/// only, once: at most k·S bytes (S: what the exchange gathered) and the frames' own (8 bytes a node, 14 a
/// frame), as it says in the job's trace (`PMI_DEBUG`).
#[test]
fn the_top_sends_each_result_to_its_children_in_the_tree_only() {
    let _s = serial();
    for (width, k) in [("1", 1), ("2", 2), ("3", 2)] {
        let args = ["-N3", "-n6", probe(), "exchange", "--puts", "4", "--size", "500"];
        let env = [("SLURM_RPMI_TREE_WIDTH", width), ("PMI_DEBUG", "1")];
        let run = Srun::start_with(&marker("fence-bytes"), "rpmi", &args, &env).wait();
        assert_success(&run);
        let fences: Vec<(u64, u64)> = run
            .stderr
            .lines()
            .filter_map(|l| {
                let rest = l.split(": node 0 sent ").nth(1)?;
                let sent = rest.split(' ').next()?.parse().ok()?;
                let gathered = rest.split("gathered ").nth(1)?.split(' ').next()?.parse().ok()?;
                assert!(rest.contains(&format!("to its {k} children in the PMI tree")), "{l}");
                Some((sent, gathered))
            })
            .collect();
        assert!(!fences.is_empty(), "the trace said nothing of the exchanges: {run}");
        for (sent, gathered) in &fences {
            assert!(
                *sent <= k * (gathered + 8 * 3 + 14),
                "width {width}: node 0 sent {sent} bytes for {gathered}: {run}"
            );
        }
        let (sent, gathered) = fences.iter().max_by_key(|f| f.1).unwrap();
        eprintln!("width {width}: the largest exchange gathered {gathered} bytes; node 0 sent {sent}");
    }
}

/// The node of every rank from a `PMI_process_mapping` value, blocks repeated as MPICH reads them.
fn mapping_nodes(mapping: &str, size: usize) -> Vec<u32> {
    let inner = mapping.strip_prefix("(vector,").and_then(|m| m.strip_suffix(')')).expect("a vector mapping");
    let blocks: Vec<(u32, u32, u32)> = inner
        .split("),(")
        .map(|b| {
            let v: Vec<u32> = b.trim_matches(|c| c == '(' || c == ')').split(',').map(|x| x.parse().unwrap()).collect();
            (v[0], v[1], v[2])
        })
        .collect();
    let mut nodes = Vec::new();
    while nodes.len() < size {
        for &(first, count, ppn) in &blocks {
            for node in first..first + count {
                for _ in 0..ppn {
                    nodes.push(node);
                }
            }
        }
    }
    nodes.truncate(size);
    nodes
}

/// Reads `key=value` words of a line.
fn words(line: &str) -> BTreeMap<&str, &str> {
    line.split_whitespace().filter_map(|w| w.split_once('=')).collect()
}

fn mapping_agrees(name: &str, layout: &[&str], size: usize) {
    let _s = serial();
    let script = format!(
        "echo \"env rank=$PMI_RANK procid=$SLURM_PROCID nodeid=$SLURM_NODEID secret=${{RPMI_SLURM_SECRET:-unset}}\"; \
         exec {} info",
        probe()
    );
    let mut args = layout.to_vec();
    args.extend(["bash", "-c", &script]);
    let run = srun(&marker(name), &args);
    assert_success(&run);
    let mut nodeid = BTreeMap::new();
    for line in run.stdout.lines().filter(|l| l.starts_with("env ")) {
        let w = words(line);
        assert_eq!(w["rank"], w["procid"], "PMI_RANK differs from SLURM_PROCID: {line}");
        assert_eq!(w["secret"], "unset", "the step's secret reached a task: {line}");
        nodeid.insert(w["rank"].parse::<u32>().unwrap(), w["nodeid"].parse::<u32>().unwrap());
    }
    assert_eq!(nodeid.len(), size, "{run}");
    let mut seen = 0;
    for line in run.stdout.lines().filter(|l| l.starts_with("rank=")) {
        let w = words(line);
        let rank: u32 = w["rank"].parse().unwrap();
        assert_eq!(w["size"], size.to_string());
        let nodes = mapping_nodes(w["mapping"], size);
        for (r, &n) in nodes.iter().enumerate() {
            assert_eq!(n, nodeid[&(r as u32)], "rank {rank}'s mapping {} puts rank {r} on node {n}", w["mapping"]);
        }
        let clique: Vec<u32> = w["clique"].split(',').map(|x| x.parse().unwrap()).collect();
        let want: Vec<u32> = nodeid.iter().filter(|(_, &n)| n == nodeid[&rank]).map(|(&r, _)| r).collect();
        assert_eq!(clique, want, "rank {rank}'s clique");
        seen += 1;
    }
    assert_eq!(seen, size, "{run}");
}

#[test]
fn process_mapping_agrees_with_slurm_block() {
    mapping_agrees("map-block", &["-N3", "-n7"], 7);
}

#[test]
fn process_mapping_agrees_with_slurm_cyclic() {
    mapping_agrees("map-cyclic", &["-N3", "-n24", "-m", "cyclic"], 24);
}

#[test]
fn process_mapping_agrees_with_slurm_plane() {
    mapping_agrees("map-plane", &["-N3", "-n24", "-m", "plane=2"], 24);
}

#[test]
fn exchange_at_256_ranks() {
    let _s = serial();
    let run = srun(&marker("exchange"), &["-O", "-N3", "-n256", probe(), "exchange"]);
    assert_success(&run);
    let line = run.stdout.lines().find(|l| l.starts_with("exchange: size=256")).unwrap_or_else(|| panic!("{run}"));
    eprintln!("{line} (srun {:.2?})", run.elapsed);
}

#[test]
fn mpi_abort_exit_code_and_message_reach_srun() {
    abort_reaches_srun("abort", &[]);
}

#[test]
fn mpi_abort_exit_code_and_message_reach_srun_over_a_chain() {
    abort_reaches_srun("abort-chain", CHAIN);
}

fn abort_reaches_srun(name: &str, env: &[(&str, &str)]) {
    let _s = serial();
    let args = ["-N3", "-n6", mpi_pairs().to_str().unwrap(), "abort=2:7"];
    let run = Srun::start_with(&marker(name), "rpmi", &args, env).wait();
    assert_eq!(run.status.code(), Some(7), "srun should exit with the abort code: {run}");
    assert!(
        run.stderr.contains("rpmi: rank 2 on n") && run.stderr.contains("called PMI_Abort with exit code 7"),
        "no abort message on srun's stderr: {run}"
    );
    // The ranks the step's end kills leave their barriers: that follows from the abort and is no new fault.
    assert!(!run.stderr.contains("closed its PMI connection"), "consequences reported as faults: {run}");
    eprintln!("{name}: srun exited 7 after {:.2?}", run.elapsed);
    // The other ranks wait in MPI_Allreduce for ever: only the step's end stops them.
    assert_ended_soon(&run, name);
}

/// SIGKILLs rank `victim` of mpi_pairs over `layout` while the others wait in MPI_Init's PMI barrier; the step
/// must end, naming it.
fn killed_task_ends_the_step(
    name: &str,
    layout: &[&str],
    victim: u32,
    ranks: usize,
    shares_node: bool,
    env: &[(&str, &str)],
) -> Run {
    let hang = format!("hang_before_init={victim}");
    let mut args = layout.to_vec();
    args.extend([mpi_pairs().to_str().unwrap(), &hang]);
    killed_task_ends_step_of(name, &args, victim, ranks, shares_node, env)
}

/// srun ARGS, whose rank `victim` waits before MPI_Init while the others wait in its PMI barrier: SIGKILLs it,
/// and the step must end, naming it.
fn killed_task_ends_step_of(
    name: &str,
    args: &[&str],
    victim: u32,
    ranks: usize,
    shares_node: bool,
    env: &[(&str, &str)],
) -> Run {
    let _s = serial();
    let mark = marker(name);
    let run = Srun::start_with(&mark, "rpmi", args, env);
    let until = Instant::now() + GUARD;
    while marked(&mark, None).len() < ranks {
        assert!(Instant::now() < until, "the {ranks} tasks never all started");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Give the others time to reach the barrier (not needed for correctness: a task that comes later finds
    // the victim gone).
    std::thread::sleep(Duration::from_millis(500));
    let pids = marked(&mark, Some(&format!("PMI_RANK={victim}")));
    assert_eq!(pids.len(), 1, "rank {victim}'s process: {pids:?}");
    // Whether the victim shares its node, as the test means it to.
    let node = |pid: u32| env_var(pid, "SLURM_NODEID");
    let peers = marked(&mark, None).into_iter().filter(|&p| p != pids[0] && node(p) == node(pids[0])).count();
    assert_eq!(peers > 0, shares_node, "rank {victim} has {peers} peers on its node");
    let killed = Instant::now();
    // SAFETY: a plain kill of one of this test's own tasks.
    unsafe { libc::kill(pids[0] as i32, libc::SIGKILL) };
    let run = run.wait();
    let took = killed.elapsed();
    eprintln!("{name}: the step ended {took:.2?} after rank {victim} was SIGKILLed");
    assert!(!run.status.success(), "{run}");
    assert!(took < ENDED_WITHIN, "the step was not ended within {ENDED_WITHIN:?} of the kill: {run}");
    assert!(run.stderr.contains(&format!("rank {victim}")), "no message naming rank {victim}: {run}");
    run
}

#[test]
fn a_sigkilled_task_ends_the_step_same_node() {
    // -N3 -n6 puts ranks 0-3 on n1: they wait for rank 1 in their own shell's barrier.
    killed_task_ends_the_step("kill-local", &["-N3", "-n6"], 1, 6, true, &[]);
}

#[test]
fn a_sigkilled_task_ends_the_step_other_node() {
    // -N3 -n3: rank 1 is alone on n2; the others wait for it in the exchange through srun.
    killed_task_ends_the_step("kill-remote", &["-N3", "-n3"], 1, 3, false, &[]);
}

#[test]
fn a_sigkilled_task_on_the_deepest_node_of_a_chain_ends_the_step() {
    // -N3 -n3 over the chain srun, n1, n2, n3: rank 2 is alone on n3, two stepds below srun.
    killed_task_ends_the_step("kill-deep", &["-N3", "-n3"], 2, 3, false, CHAIN);
    // The same with Bruck's allgather, where n3's parts go to n2 and n1 directly.
    killed_task_ends_the_step("kill-bruck", &["-N3", "-n3"], 2, 3, false, BRUCK);
}

/// The live slurmstepd of step `job.step` on node `node` of the local cluster: of the step's stepds, the one
/// that holds a file of that node open (its slurmd's log, its spool directory).
fn stepd_of_node(job: &str, step: &str, node: &str) -> Option<u32> {
    let dir = cluster_dir();
    let files = [dir.join("log").join(format!("slurmd-{node}.log")), dir.join("spool").join(node)];
    step_stepds(job, step).into_iter().find(|pid| {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|fd| std::fs::read_link(fd.path()).ok())
            .any(|l| files.iter().any(|f| l.starts_with(f)))
    })
}

/// SIGKILLs the slurmstepd on n2 of srun `mark`'s step and rank 1, its task there, as a node's failure takes
/// both (with proctrack/pgid nothing else would end the task); returns when.
fn kill_stepd_of_rank_1_on_n2(mark: &str) -> Instant {
    let task = marked(mark, Some("PMI_RANK=1"))[0];
    let var = |name| env_var(task, name).unwrap_or_else(|| panic!("no {name} in a task's environment"));
    let (job, step) = (var("SLURM_JOB_ID"), var("SLURM_STEP_ID"));
    let stepd = stepd_of_node(&job, &step, "n2").unwrap_or_else(|| panic!("no slurmstepd of {job}.{step} on n2"));
    let killed = Instant::now();
    for pid in [stepd, task] {
        // SAFETY: plain kills of this step's slurmstepd on n2 and of its task.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
    killed
}

/// A slurmstepd killed (with its task) after its tasks finalized: no barrier waits for it, but srun would wait
/// for its tasks' ends for ever (as Slurm's own does for a killed slurmstepd): the step ends, naming the node.
#[test]
fn a_slurmstepd_killed_after_finalize_ends_the_step() {
    let _s = serial();
    let mark = marker("kill-stepd-finalized");
    let script = "printf 'cmd=init pmi_version=1 pmi_subversion=1\\n' >&$PMI_FD; read -r l <&$PMI_FD; \
                  printf 'cmd=finalize\\n' >&$PMI_FD; read -r l <&$PMI_FD; echo \"finalized $PMI_RANK\"; \
                  if [ \"$PMI_RANK\" = 1 ]; then exec sleep 60; fi";
    let run = Srun::start(&mark, &["-N2", "-n2", "bash", "-c", script]);
    let lines: Vec<String> = (0..2).map(|_| run.line(|l| l.starts_with("finalized "))).collect();
    assert_eq!(lines.len(), 2);
    let killed = kill_stepd_of_rank_1_on_n2(&mark);
    let run = run.wait();
    eprintln!("slurmstepd killed after finalize: srun gone {:.2?} after", killed.elapsed());
    // srun's status is then Slurm's: after "Timed out waiting for job step to complete" it exits without
    // asking the plugin (0 on 22.05).
    assert!(killed.elapsed() < ENDED_WITHIN, "the step was not ended within {ENDED_WITHIN:?} of the kill: {run}");
    assert!(run.stderr.contains("lost the connection to the slurmstepd of n2"), "{run}");
}

/// What strikes a step whose ranks are past their barrier.
enum Strike {
    /// SIGKILL of rank 1.
    KillRank1,
    /// scancel of the job, as its time limit would end it: SIGTERM, then SIGKILL after KillWait.
    Scancel,
}

/// What rank 0 does past the barrier (rank 1 sleeps).
#[derive(PartialEq)]
enum Rank0 {
    Sleeps,
    /// Finalizes and exits.
    Leaves,
    /// Sleeps, taking SIGTERM to say `term 0` (as a program that writes a checkpoint then).
    TrapsTerm,
}

/// Each rank inits PMI and passes its barrier (as MPI_Finalize's does), then does as `rank_0` says. Strikes
/// once both are past the barrier (and rank 0 gone, when it leaves): what srun then did, and how long after
/// the strike.
fn strike_past_the_barrier(name: &str, rank_0: Rank0, strike: Strike) -> (Run, Duration) {
    let _s = serial();
    let mark = marker(name);
    let rank_0_does = match rank_0 {
        Rank0::Sleeps => "exec sleep 60",
        Rank0::Leaves => "printf 'cmd=finalize\\n' >&$PMI_FD; read -r l <&$PMI_FD; exit 0",
        Rank0::TrapsTerm => "trap 'echo \"term 0\"' TERM; sleep 60 & wait; sleep 60 & wait",
    };
    let script = format!(
        "printf 'cmd=init pmi_version=1 pmi_subversion=1\\n' >&$PMI_FD; read -r l <&$PMI_FD; \
         printf 'cmd=barrier_in\\n' >&$PMI_FD; read -r l <&$PMI_FD; echo \"past $PMI_RANK\"; \
         if [ \"$PMI_RANK\" = 0 ]; then {rank_0_does}; fi; exec sleep 60"
    );
    let run = Srun::start(&mark, &["-N2", "-n2", "bash", "-c", &script]);
    for _ in 0..2 {
        run.line(|l| l.starts_with("past "));
    }
    let until = Instant::now() + GUARD;
    while rank_0 == Rank0::Leaves && !marked(&mark, Some("PMI_RANK=0")).is_empty() {
        assert!(Instant::now() < until, "rank 0 never left");
        std::thread::sleep(Duration::from_millis(20));
    }
    let struck = Instant::now();
    match strike {
        Strike::KillRank1 => {
            let pids = marked(&mark, Some("PMI_RANK=1"));
            assert_eq!(pids.len(), 1, "rank 1's process: {pids:?}");
            // SAFETY: a plain kill of one of this test's own tasks.
            unsafe { libc::kill(pids[0] as i32, libc::SIGKILL) };
        }
        Strike::Scancel => {
            let status = Command::new("scancel").arg(format!("--name={mark}")).status().expect("scancel");
            assert!(status.success(), "scancel: {status}");
        }
    }
    let run = run.wait();
    (run, struck.elapsed())
}

/// A rank killed past the last barrier without finalize (in MPI_Finalize's own shutdown, after its PMI
/// barrier), while rank 0 runs on outside PMI: no barrier waits, and Slurm alone would wait for rank 0's end.
/// The step ends, naming rank 1.
#[test]
fn a_rank_killed_past_the_barrier_without_finalize_ends_the_step() {
    let (run, took) = strike_past_the_barrier("kill-past-barrier", Rank0::Sleeps, Strike::KillRank1);
    eprintln!("rank 1 killed past the barrier: srun gone {took:.2?} after");
    assert!(took < ENDED_WITHIN, "the step was not ended within {ENDED_WITHIN:?} of the kill: {run}");
    assert!(!run.status.success(), "{run}");
    // Rank 1 is on the step's second node, whichever Slurm chose.
    let said = "closed its PMI connection (exited or crashed) without PMI_Finalize while other ranks run";
    assert!(run.stderr.lines().any(|l| l.contains("rank 1 on n") && l.contains(said)), "{run}");
}

/// The same once rank 0 has finalized and left: nothing is left to end, and srun's status is Slurm's for the
/// killed task, without rpmi's line.
#[test]
fn a_rank_killed_without_finalize_after_the_others_left_is_slurms_to_report() {
    let (run, took) = strike_past_the_barrier("kill-after-others", Rank0::Leaves, Strike::KillRank1);
    eprintln!("rank 1 killed after rank 0 left: srun gone {took:.2?} after");
    assert!(took < ENDED_WITHIN, "srun did not end within {ENDED_WITHIN:?} of the kill: {run}");
    assert!(!run.status.success(), "{run}");
    assert!(!run.stderr.contains("without PMI_Finalize"), "{run}");
}

/// A job Slurm ends (scancel, the time limit) loses its ranks to SIGTERM: no rank is blamed for leaving without
/// finalize, and a rank that takes SIGTERM (to write a checkpoint) keeps its KillWait (5 s on the test
/// cluster) instead of being ended with the others a second later.
#[test]
fn a_cancelled_job_blames_no_rank_and_keeps_its_kill_wait() {
    let (run, took) = strike_past_the_barrier("cancel-past-barrier", Rank0::Sleeps, Strike::Scancel);
    eprintln!("job cancelled past the barrier: srun gone {took:.2?} after");
    assert!(took < ENDED_WITHIN, "srun did not end within {ENDED_WITHIN:?} of scancel: {run}");
    assert!(!run.stderr.contains("without PMI_Finalize"), "{run}");

    let (run, took) = strike_past_the_barrier("cancel-trapped", Rank0::TrapsTerm, Strike::Scancel);
    eprintln!("job cancelled, rank 0 taking SIGTERM: srun gone {took:.2?} after");
    assert!(run.stdout.contains("term 0"), "rank 0 never had its SIGTERM: {run}");
    assert!(!run.stderr.contains("without PMI_Finalize"), "{run}");
    assert!(took >= Duration::from_secs(3), "rank 0 did not keep its KillWait: {run}");
}

/// The slurmstepd in the middle of a chain (n2: srun, n1, n2, n3) is killed with its tasks, as when its node
/// fails, while the other ranks wait in MPI_Init's barrier: the step must end, naming n2; and the same when
/// the exchanges go by Bruck's allgather.
#[test]
fn a_killed_interior_slurmstepd_ends_the_step_naming_its_node() {
    killed_stepd_ends_the_step("kill-stepd", CHAIN);
    killed_stepd_ends_the_step("kill-stepd-bruck", BRUCK);
}

fn killed_stepd_ends_the_step(name: &str, env: &[(&str, &str)]) {
    let _s = serial();
    let mark = marker(name);
    // Rank 0 (on n1) holds every other rank in the barrier.
    let args = ["-N3", "-n3", mpi_pairs().to_str().unwrap(), "hang_before_init=0"];
    let run = Srun::start_with(&mark, "rpmi", &args, env);
    let until = Instant::now() + GUARD;
    while marked(&mark, None).len() < 3 {
        assert!(Instant::now() < until, "the tasks never all started");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(500));
    let killed = kill_stepd_of_rank_1_on_n2(&mark);
    let run = run.wait();
    eprintln!("{name}: killed interior slurmstepd: the step ended {:.2?} after", killed.elapsed());
    assert!(!run.status.success(), "{run}");
    assert!(killed.elapsed() < ENDED_WITHIN, "the step was not ended within {ENDED_WITHIN:?} of the kill: {run}");
    let error = run.stderr.lines().find(|l| l.starts_with("srun: error: rpmi:")).unwrap_or_else(|| panic!("{run}"));
    assert!(error.contains("the slurmstepd of n2"), "the first error does not name n2: {run}");
}

/// The local cluster's state directory (where slurm.conf, the logs and the launch hold live).
fn cluster_dir() -> PathBuf {
    cluster();
    Path::new(&std::env::var_os("SLURM_CONF").unwrap()).parent().unwrap().to_path_buf()
}

/// Everything the cluster's slurmds have logged so far.
fn slurmd_logs() -> String {
    let mut all = String::new();
    for entry in std::fs::read_dir(cluster_dir().join("log")).unwrap().flatten() {
        if entry.file_name().to_string_lossy().starts_with("slurmd-") {
            all.push_str(&std::fs::read_to_string(entry.path()).unwrap_or_default());
        }
    }
    all
}

/// While it lives, every new job's launch waits in the cluster's prolog (docker/slurm-cluster.sh), so a test
/// can act on srun's collective port before any slurmstepd has started.
struct LaunchHold(PathBuf);

impl LaunchHold {
    fn new() -> LaunchHold {
        let path = cluster_dir().join("hold-launch");
        std::fs::write(&path, b"").unwrap();
        LaunchHold(path)
    }
}

impl Drop for LaunchHold {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The port of the collective root in srun `pid`: its one IPv6 listening socket (srun's own ports are IPv4).
fn root_port(pid: u32) -> Option<u16> {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .ok()?
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .filter_map(|l| l.to_str()?.strip_prefix("socket:[")?.strip_suffix(']').map(String::from))
        .collect();
    let table = std::fs::read_to_string("/proc/net/tcp6").ok()?;
    table.lines().skip(1).find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        (f.get(3) == Some(&"0A") && f.get(9).is_some_and(|i| inodes.iter().any(|x| x == i)))
            .then(|| u16::from_str_radix(f[1].rsplit(':').next()?, 16).ok())
            .flatten()
    })
}

/// A file, not there yet, whose creation tells srun `mark`'s tasks to go on.
fn go_flag(mark: &str) -> PathBuf {
    let flag = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{mark}.go"));
    let _ = std::fs::remove_file(&flag);
    flag
}

#[test]
fn the_collective_port_closes_once_every_node_is_in() {
    let _s = serial();
    let mark = marker("port-closed");
    let flag = go_flag(&mark);
    // Rank 0 prints where the root listened, every rank that it runs; each waits for the flag before its
    // exchange.
    let script = format!(
        "if [ \"$PMI_RANK\" = 0 ]; then echo \"root $SLURM_SRUN_COMM_HOST $RPMI_SLURM_PORT\"; fi; \
         echo \"up $PMI_RANK\"; for i in $(seq 600); do [ -e {flag} ] && break; sleep 0.1; done; exec {} exchange",
        probe(),
        flag = flag.display()
    );
    let run = Srun::start(&mark, &["-N3", "-n3", "bash", "-c", &script]);
    let lines: Vec<String> = (0..4).map(|_| run.line(|l| l.starts_with("root ") || l.starts_with("up "))).collect();
    let line = lines.iter().find(|l| l.starts_with("root ")).unwrap();
    let w: Vec<&str> = line.split_whitespace().collect();
    // A stepd joins before it starts its tasks, so with a task running on each node every stepd is in:
    // nobody, with or without the secret, can connect any more.
    let refused = TcpStream::connect(format!("{}:{}", w[1], w[2]));
    assert!(refused.is_err(), "the collective port still takes connections after every node joined");
    std::fs::write(&flag, b"").unwrap();
    let run = run.wait();
    let _ = std::fs::remove_file(&flag);
    assert_success(&run);
    assert!(run.stdout.contains("exchange: size=3"), "the job did not complete its exchange: {run}");
}

#[test]
fn idle_connections_to_the_collective_port_do_not_stop_the_step() {
    let _s = serial();
    let mark = marker("idle-conns");
    let hold = LaunchHold::new();
    let run = Srun::start(&mark, &["-N3", "-n3", probe(), "exchange"]);
    let until = Instant::now() + Duration::from_secs(15);
    let port = loop {
        if let Some(p) = root_port(run.child.id()) {
            break p;
        }
        assert!(Instant::now() < until, "srun never opened its collective port");
        std::thread::sleep(Duration::from_millis(20));
    };
    // What anyone on the network can do: hold connections open to the port before the stepds come.
    let idle: Vec<TcpStream> = (0..100).map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap()).collect();
    drop(hold);
    let run = run.wait();
    drop(idle);
    assert_success(&run);
    assert!(run.stdout.contains("exchange: size=3"), "{run}");
    assert!(!run.stderr.contains("refused"), "refusals reached the job's stderr: {run}");
}

/// The job id of the job named `mark`, once slurmctld knows it.
fn job_id(mark: &str) -> String {
    let until = Instant::now() + GUARD;
    loop {
        let out = Command::new("squeue").args(["-h", "-o", "%i", &format!("--name={mark}")]).output().unwrap();
        let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if !id.is_empty() {
            return id;
        }
        assert!(Instant::now() < until, "no job named {mark}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `tests/slurm/NAME.c`, a shim a hostile user preloads into their own srun, built as a preload library
/// (once per test run).
fn shim(name: &str) -> PathBuf {
    static BUILT: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}.so"));
    if !built.iter().any(|b| b == name) {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/slurm/{name}.c"));
        let status = Command::new("cc")
            .args(["-shared", "-fPIC", "-o"])
            .arg(&out)
            .arg(&src)
            .args(["-ldl", "-lpthread"])
            .status();
        assert!(status.is_ok_and(|s| s.success()), "cc failed on {}", src.display());
        built.push(name.to_string());
    }
    out
}

#[test]
fn ids_spoofed_in_the_environment_do_not_end_another_jobs_step() {
    let _s = serial();
    // The victim: another job's step, not an MPI one.
    let victim_mark = marker("victim");
    let victim = Srun::start_with(&victim_mark, "none", &["-N1", "-n1", "sleep", "120"], &[]);
    let victim_job = job_id(&victim_mark);
    // The attacker's srun puts the victim's ids in its step's environment, then dies while its step runs: each
    // stepd (root) then ends the step it serves, which must be its own.
    let mark = marker("spoofer");
    let preload = shim("spoof_env");
    let preload = preload.to_str().unwrap();
    let env = [("LD_PRELOAD", preload), ("RPMI_SPOOF_JOB_ID", victim_job.as_str()), ("RPMI_SPOOF_STEP_ID", "0")];
    let mut run =
        Srun::start_with(&mark, "rpmi", &["-N3", "-n3", mpi_pairs().to_str().unwrap(), "hang_before_init=1"], &env);
    let until = Instant::now() + GUARD;
    while marked(&mark, None).len() < 3 {
        assert!(Instant::now() < until, "the attacker's tasks never all started");
        std::thread::sleep(Duration::from_millis(50));
    }
    let spoofed = marked(&mark, None).into_iter().any(|p| env_var(p, "SLURM_JOB_ID").as_deref() == Some(&victim_job));
    run.child.kill().expect("SIGKILL srun");
    let _ = run.child.wait();
    while !marked(&mark, None).is_empty() {
        assert!(Instant::now() < until, "the attacker's step was not ended when its srun died");
        std::thread::sleep(Duration::from_millis(50));
    }
    cleanup(&mark);
    run.stdout.take();
    // The kill, had it gone to the victim, would have landed by now.
    std::thread::sleep(Duration::from_secs(2));
    let out = Command::new("squeue").args(["-h", "-o", "%T", "-j", &victim_job]).output().unwrap();
    let state = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let logs = slurmd_logs();
    cleanup(&victim_mark);
    drop(victim);
    assert_eq!(state, "RUNNING", "the victim job {victim_job} was ended by another user's step");
    assert!(
        logs.contains(&format!("ignored SLURM_JOB_ID={victim_job} in the step's environment")),
        "the stepd did not say it ignored the spoofed id (spoofed into the tasks' environment: {spoofed})"
    );
}

#[test]
fn the_wire_trace_goes_to_the_jobs_stderr_not_the_daemons_log() {
    let _s = serial();
    let mark = marker("trace");
    let run = Srun::start_with(&mark, "rpmi", &["-N3", "-n3", probe(), "exchange"], &[("PMI_DEBUG", "1")]).wait();
    assert_success(&run);
    for rank in 0..3 {
        let want = format!("rpmi: rank {rank} C: cmd=init");
        assert!(run.stderr.contains(&want), "no `{want}` on the job's stderr: {run}");
    }
    let kvsname = run.stderr.lines().find_map(|l| l.split("kvsname=").nth(1)).map(|k| k.split(' ').next().unwrap());
    let kvsname = kvsname.unwrap_or_else(|| panic!("no kvsname in the trace: {run}"));
    assert!(!slurmd_logs().contains(kvsname), "the trace of {kvsname} reached slurmd's log");
}

/// The test cluster runs with `DebugFlags=MPI` and `SlurmdDebug=verbose` (docker/slurm-cluster.sh), under which
/// Slurm (23.02 and later) logs a slurmstepd's whole environment before the plugin's prefork: the step's secret
/// must not be in it.
#[test]
fn debugging_mpi_does_not_put_the_steps_secret_in_the_daemons_log() {
    let _s = serial();
    let run = srun(&marker("debug-mpi"), &["-N2", "-n2", probe(), "exchange"]);
    assert_success(&run);
    let logs = slurmd_logs();
    let leaked: Vec<&str> = logs.lines().filter(|l| l.contains("RPMI_SLURM_SECRET=")).collect();
    assert!(leaked.is_empty(), "the step's secret is in slurmd's log: {leaked:?}");
    assert!(logs.contains("DebugFlags=MPI is off in this slurmstepd"), "the stepds did not say they turned it off");
}

#[test]
fn a_task_cannot_flood_the_daemons_log() {
    let _s = serial();
    let said = |logs: &str| logs.lines().filter(|l| l.contains("asked for PMI version 3.0")).count();
    let before = said(&slurmd_logs());
    // Each init of an unknown version is answered with an error and makes the engine say why: 5000 of them,
    // read as they come.
    // The background reader's output goes nowhere: srun would wait for it to close its stderr.
    let script = "(timeout 10 cat <&$PMI_FD >/dev/null 2>&1 &); \
                  yes 'cmd=init pmi_version=3 pmi_subversion=0' | head -n 5000 >&$PMI_FD; sleep 1";
    let run = srun(&marker("log-flood"), &["-N1", "-n1", "bash", "-c", script]);
    assert_success(&run);
    let logs = slurmd_logs();
    let lines = said(&logs) - before;
    assert!(lines > 0 && lines <= 200, "{lines} lines of one step in slurmd's log");
    assert!(logs.contains("this step's further PMI messages are not logged"));
}

#[test]
fn a_protocol_error_ends_the_step_with_status_125() {
    let _s = serial();
    let script = format!(
        "if [ \"$PMI_RANK\" = 1 ]; then printf 'cmd=nonsense \\033[2J\\n' >&$PMI_FD; exec sleep 60; fi; exec {} barrier",
        probe()
    );
    let run = srun(&marker("protocol"), &["-N3", "-n3", "bash", "-c", &script]);
    assert_eq!(run.status.code(), Some(125), "srun should exit 125 when rpmi ends the step: {run}");
    // Rank 1 sleeps a minute: only the step's end stops it.
    assert_ended_soon(&run, "protocol error");
    assert!(run.stderr.contains("rank 1: PMI protocol error"), "{run}");
    assert!(run.stderr.contains("cmd=nonsense \\x1b[2J"), "the line is not quoted escaped: {run}");
}

#[test]
fn an_exchange_over_the_node_bound_ends_the_step_naming_node_size_and_option() {
    let _s = serial();
    let args = ["-N3", "-n6", probe(), "exchange", "--puts", "8", "--size", "800"];
    let run = Srun::start_with(&marker("bound"), "rpmi", &args, &[("SLURM_RPMI_NODE_BYTES_MAX", "4096")]).wait();
    // 125 (rpmi ended the step) or the probe's own status: a probe whose barrier failed exits at once, and
    // Slurm may count that exit before the step's end.
    assert!(!run.status.success(), "{run}");
    // srun's own line; the probe's failed barrier may quote the same message first (spaces made `_`).
    let said = |l: &&str| l.starts_with("srun: error: rpmi: ") && l.contains("SLURM_RPMI_NODE_BYTES_MAX");
    let line = run.stderr.lines().find(said).unwrap_or_else(|| panic!("{run}"));
    assert!(line.contains("the slurmstepd of n") && line.contains("4096"), "{line}");
    assert_ended_soon(&run, "node bound");
}

#[test]
fn a_killed_srun_leaves_no_step_waiting() {
    let _s = serial();
    let mark = marker("srun-killed");
    let run = Srun::start(&mark, &["-N3", "-n3", mpi_pairs().to_str().unwrap(), "hang_before_init=1"]);
    let until = Instant::now() + GUARD;
    while marked(&mark, None).len() < 3 {
        assert!(Instant::now() < until, "the tasks never all started");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(500));
    let killed = Instant::now();
    let mut run = run;
    run.child.kill().expect("SIGKILL srun");
    let _ = run.child.wait();
    // Every task, the sleeping one too, must go: the stepds end the step when srun's root is gone.
    loop {
        let left = marked(&mark, None);
        if left.is_empty() {
            break;
        }
        if killed.elapsed() > GUARD {
            cleanup(&mark);
            panic!("tasks still running {GUARD:?} after srun was killed: {left:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!("srun killed: every task gone after {:.2?}", killed.elapsed());
    // srun's allocation outlives it (slurmctld does not know it died): release it.
    cleanup(&mark);
    run.stdout.take();
}

/// The live slurmstepds of step `job.step` on this cluster, found as docker/slurm-cluster.sh finds its stepds
/// (named slurmstepd, holding a file under the cluster's directory open) and by their title,
/// `slurmstepd: [JOB.STEP]`.
fn step_stepds(job: &str, step: &str) -> Vec<u32> {
    let dir = cluster_dir();
    let title = format!("[{job}.{step}]");
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        if std::fs::read_to_string(format!("/proc/{pid}/comm")).map_or(true, |c| c.trim() != "slurmstepd") {
            continue;
        }
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if !String::from_utf8_lossy(&cmdline).contains(&title) {
            continue;
        }
        let ours = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .into_iter()
            .flatten()
            .flatten()
            .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|l| l.starts_with(&dir)));
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next());
        if ours && matches!(state, Some(s) if s != 'Z' && s != 'X') {
            pids.push(pid);
        }
    }
    pids
}

/// The bytes waiting in the send queue of every established TCP connection on this host to port `port` (the
/// stepds' connections to srun's root, when `port` is the root's).
fn send_queues_to(port: u16) -> Vec<u64> {
    let mut queues = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        for line in std::fs::read_to_string(table).unwrap_or_default().lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            let remote = f.get(2).and_then(|a| u16::from_str_radix(a.rsplit(':').next()?, 16).ok());
            if remote == Some(port) && f.get(3) == Some(&"01") {
                if let Some(tx) = f.get(4).and_then(|q| u64::from_str_radix(q.split(':').next()?, 16).ok()) {
                    queues.push(tx);
                }
            }
        }
    }
    queues
}

/// The most the kernel lets a socket's send buffer grow to (`net.ipv4.tcp_wmem`'s maximum).
fn send_buffer_max() -> u64 {
    let wmem = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_wmem").unwrap_or_default();
    wmem.split_whitespace().nth(2).and_then(|m| m.parse().ok()).unwrap_or(4 << 20)
}

/// A user's srun may read its collective connections as slowly as it likes and never close them
/// (tests/slurm/slow_root.c): once the step is cancelled, every slurmstepd of it must go all the same.
#[test]
fn a_slow_srun_does_not_hold_a_slurmstepd_past_its_step() {
    let _s = serial();
    let mark = marker("slow-srun");
    // Ranks 0 and 1 (one a node) put more than a stepd's send buffer and srun's receive buffer hold together
    // and enter a PMI 1.2 barrier of the two: a group exchange, whose parts go to srun (a star through it), so
    // each stepd is still sending its part when srun, slowed by the shim, has stopped taking it. Rank 2 waits.
    const SIZE: u64 = 800;
    let puts = (send_buffer_max() + (2 << 20)) / SIZE;
    let script = format!(
        "ask() {{ printf '%s\\n' \"$1\" >&$PMI_FD; read -r -u $PMI_FD answer; }}
         ask 'cmd=init pmi_version=1 pmi_subversion=2'
         [ \"$PMI_RANK\" = 2 ] && exec sleep 600
         ask cmd=get_my_kvsname; kvs=${{answer##*kvsname=}}; v=$(printf '%0{SIZE}d' 0)
         for ((i = 0; i < {puts}; i++)); do ask \"cmd=put kvsname=$kvs key=k$PMI_RANK-$i value=$v\"; done
         ask 'cmd=barrier_in group=0,1:7'"
    );
    let args = ["-N3", "-n3", "bash", "-c", &script];
    let preload = shim("slow_root");
    let preload = preload.to_str().unwrap();
    let mut run = Srun::start_with(&mark, "rpmi", &args, &[("LD_PRELOAD", preload)]);
    let until = Instant::now() + GUARD;
    let task = loop {
        if let Some(&pid) = marked(&mark, None).first() {
            break pid;
        }
        assert!(Instant::now() < until, "the tasks never started");
        std::thread::sleep(Duration::from_millis(50));
    };
    let var = |name| env_var(task, name).unwrap_or_else(|| panic!("no {name} in a task's environment"));
    let (job, step, port) = (var("SLURM_JOB_ID"), var("SLURM_STEP_ID"), var("RPMI_SLURM_PORT"));
    let port: u16 = port.parse().unwrap();
    // Ranks 0 and 1 are in the barrier once their stepds are sending their parts; srun takes a KiB now and
    // then.
    loop {
        let queues = send_queues_to(port);
        if queues.iter().filter(|&&q| q >= 512 << 10).count() == 2 {
            break;
        }
        assert!(Instant::now() < until, "the stepds never sent their parts to srun's root: send queues {queues:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let stepds = step_stepds(&job, &step);
    assert_eq!(stepds.len(), 3, "the slurmstepds of step {job}.{step}: {stepds:?}");
    let cancelled = Instant::now();
    let status = Command::new("scancel").arg(&job).status().expect("scancel");
    assert!(status.success(), "scancel {job}: {status}");
    // srun keeps the connections and goes on reading slowly; each stepd must go all the same.
    let bound = Duration::from_secs(45);
    loop {
        let left = step_stepds(&job, &step);
        if left.is_empty() {
            break;
        }
        assert!(
            cancelled.elapsed() < bound,
            "slurmstepd {left:?} of step {job}.{step} still running {bound:?} after the job was cancelled"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("slow srun: every slurmstepd of the cancelled step gone after {:.2?}", cancelled.elapsed());
    // The shim's srun does not exit while it holds a connection: end it.
    run.child.kill().expect("SIGKILL srun");
    let _ = run.child.wait();
    cleanup(&mark);
    run.stdout.take();
}

/// A figure of `/proc/PID/status` (`VmRSS`, `VmHWM`), in bytes; 0 once the process is gone.
fn vm(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let line = status.lines().find(|l| l.starts_with(&format!("{field}:"))).unwrap_or_default();
    line.split_whitespace().nth(1).and_then(|kb| kb.parse::<u64>().ok()).map_or(0, |kb| kb << 10)
}

/// The one task of srun `mark`'s step once it runs, and the step's one slurmstepd.
fn task_and_stepd(mark: &str) -> (u32, u32) {
    let until = Instant::now() + GUARD;
    loop {
        if let Some(&task) = marked(mark, None).first() {
            let var = |name| env_var(task, name).unwrap_or_else(|| panic!("no {name} in a task's environment"));
            if let [stepd] = step_stepds(&var("SLURM_JOB_ID"), &var("SLURM_STEP_ID"))[..] {
                return (task, stepd);
            }
        }
        assert!(Instant::now() < until, "the step's task and slurmstepd never showed");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// What a root slurmstepd may grow by, whatever its user's srun and tasks do.
const STEPD_GROWTH_MAX: u64 = 64 << 20;

/// A user's srun may write valid frames to its stepds without pause (tests/slurm/flood_root.c writes
/// PARENT_DONE after the handshake): a stepd takes them a buffer at a time and keeps none, so its memory
/// stays flat while srun writes. (It once decoded all a socket held before handling any: +1.5 GiB in 4 s.)
#[test]
fn a_flooding_srun_does_not_grow_a_slurmstepd() {
    let _s = serial();
    let mark = marker("flood");
    let preload = shim("flood_root");
    let env = [("LD_PRELOAD", preload.to_str().unwrap())];
    let mut run = Srun::start_with(&mark, "rpmi", &["-N1", "-n1", "sleep", "60"], &env);
    let (_, stepd) = task_and_stepd(&mark);
    let base = vm(stepd, "VmRSS");
    // Long enough: the bug this guards against grew the stepd by 64 MiB in a tenth of that.
    std::thread::sleep(Duration::from_secs(2));
    let (peak, alive) = (vm(stepd, "VmHWM"), vm(stepd, "VmRSS") > 0);
    cleanup(&mark);
    run.child.kill().expect("SIGKILL srun");
    let _ = run.child.wait();
    run.stdout.take();
    eprintln!("flooding srun: the slurmstepd grew from {} to a peak of {} KiB in 2 s", base >> 10, peak >> 10);
    assert!(alive, "the slurmstepd did not live through the flood");
    assert!(peak.saturating_sub(base) < STEPD_GROWTH_MAX, "the slurmstepd grew {} KiB", (peak - base) >> 10);
}

/// srun stopped (`kill -STOP`, the user's right) while its job's collective has failed for good (a node bound
/// of 1 byte) and a task asks for a barrier as fast as each fails: the stepd sends srun nothing for a failed
/// collective, holds no more for it than a link's bound, and ends the step itself when srun does not. (It
/// once queued a JOINED for srun per failed barrier: +980 MiB in 15 s from one task.)
#[test]
fn a_stopped_srun_does_not_grow_a_slurmstepd_and_a_failed_step_ends() {
    let _s = serial();
    let mark = marker("stopped-srun");
    let flag = go_flag(&mark);
    let program = build("pmi_barrier_loop");
    let args = ["-N1", "-n1", program.to_str().unwrap(), flag.to_str().unwrap()];
    let want = "srun did not end the step within 5s";
    let logged = slurmd_logs().matches(want).count();
    let run = Srun::start_with(&mark, "rpmi", &args, &[("SLURM_RPMI_NODE_BYTES_MAX", "1")]);
    let (_, stepd) = task_and_stepd(&mark);
    // SAFETY: a plain signal to this test's own srun.
    unsafe { libc::kill(run.child.id() as i32, libc::SIGSTOP) };
    let base = vm(stepd, "VmRSS");
    std::fs::write(&flag, b"").unwrap();
    let started = Instant::now();
    let mut peak = base;
    // Until the task is gone: the step has ended (the stepd itself then waits on for the stopped srun, to
    // tell it the tasks' ends, as Slurm's own stepds do).
    while !marked(&mark, None).is_empty() && started.elapsed() < ENDED_WITHIN + Duration::from_secs(5) {
        peak = peak.max(vm(stepd, "VmHWM"));
        std::thread::sleep(Duration::from_millis(100));
    }
    let (took, left) = (started.elapsed(), marked(&mark, None));
    // SAFETY: as above.
    unsafe { libc::kill(run.child.id() as i32, libc::SIGCONT) };
    let _ = std::fs::remove_file(&flag);
    let run = run.wait();
    eprintln!(
        "stopped srun: the slurmstepd grew from {} to a peak of {} KiB; the task was gone {took:.2?} after the \
         barriers began",
        base >> 10,
        peak >> 10
    );
    assert!(peak.saturating_sub(base) < STEPD_GROWTH_MAX, "the slurmstepd grew {} KiB", (peak - base) >> 10);
    assert!(took < ENDED_WITHIN, "the failed step's task still ran {took:.2?} after its collective failed: {run}");
    assert!(left.is_empty(), "tasks left: {left:?}");
    // The stepd's line reaches srun's stderr only if srun, continued, reads it before its own end of the
    // failed exchange makes it exit; slurmd's log has it either way.
    assert!(run.stderr.contains(want) || slurmd_logs().matches(want).count() > logged, "{run}");
}

/// A user's srun may send a result of an exchange, which srun never does (tests/slurm/forged_all.c sends one
/// to every node below node 0): the slurmstepd (root) must refuse it, not keep it, and end the step, since its
/// srun is not to be trusted any more.
#[test]
fn an_exchange_result_from_srun_ends_the_step() {
    let _s = serial();
    let mark = marker("forged-all");
    let want = "srun sent the result of PMI exchange";
    let logged = slurmd_logs().matches(want).count();
    let preload = shim("forged_all");
    let preload = preload.to_str().unwrap();
    let run = Srun::start_with(&mark, "rpmi", &["-N3", "-n3", probe(), "exchange"], &[("LD_PRELOAD", preload)]);
    let run = run.wait();
    cleanup(&mark);
    assert!(!run.status.success(), "the step went on past a result from srun: {run}");
    assert_ended_soon(&run, "an exchange result from srun");
    assert!(
        run.stderr.contains(want) || slurmd_logs().matches(want).count() > logged,
        "neither the job's stderr nor slurmd's log says `{want}`: {run}"
    );
}

/// What every task of a step that must be refused would print, had it started.
const TASK_RAN: &str = "rpmi-test: a task ran";

/// `srun -N3 -n3` of tasks that print [`TASK_RAN`], with `env` in srun's environment: it must fail, and no
/// task may have started.
fn refused(name: &str, env: &[(&str, &str)]) -> Run {
    let script = format!("echo '{TASK_RAN}'");
    let run = Srun::start_with(&marker(name), "rpmi", &["-N3", "-n3", "bash", "-c", &script], env).wait();
    assert!(!run.status.success(), "{run}");
    assert!(!run.stdout.contains(TASK_RAN), "a task started: {run}");
    run
}

#[test]
fn an_unknown_option_is_refused_by_srun_before_any_task_starts() {
    let _s = serial();
    // Side by side: after a failed launch srun waits out KillWait + 2 s for tasks that never started (Slurm's).
    let old_name = std::thread::spawn(|| refused("old-option-name", &[("RPMI_SLURM_NODE_BYTES_MAX", "4096")]));
    let run = refused("unknown-option", &[("SLURM_RPMI_NO_SUCH_OPTION", "1")]);
    let want = "srun: error: rpmi: SLURM_RPMI_NO_SUCH_OPTION is not an option of mpi/rpmi (its options are \
                SLURM_RPMI_KVSNAME_MAX, ";
    assert!(run.stderr.contains(want), "no `{want}`: {run}");
    let run = old_name.join().expect("the second srun's check");
    let want = "srun: error: rpmi: RPMI_SLURM_NODE_BYTES_MAX is now named SLURM_RPMI_NODE_BYTES_MAX";
    assert!(run.stderr.contains(want), "no `{want}`: {run}");
}

#[test]
fn a_malformed_value_is_refused_by_srun_before_any_task_starts() {
    let _s = serial();
    let run = refused("malformed-option", &[("SLURM_RPMI_KVS_BYTES_MAX", "64M")]);
    let want = "srun: error: rpmi: SLURM_RPMI_KVS_BYTES_MAX=64M is not a number of bytes from 1 to 4293918719";
    assert!(run.stderr.contains(want), "no `{want}`: {run}");
}

/// The test cluster's mpi.conf says `line` (docker/with-slurm.sh gives it tests/slurm/mpi.conf).
fn site_says(line: &str) {
    let conf = std::fs::read_to_string(cluster_dir().join("mpi.conf")).unwrap_or_default();
    assert!(
        conf.lines().any(|l| l.trim() == line),
        "the cluster's mpi.conf does not say `{line}`; docker/with-slurm.sh starts the cluster with tests/slurm/mpi.conf"
    );
}

/// A task that writes one PMI request line of `len` bytes, newline included, and waits.
fn long_line(len: usize) -> String {
    format!("head -c {} /dev/zero | tr '\\0' x >&$PMI_FD; echo >&$PMI_FD; exec sleep 30", len - 1)
}

#[test]
fn the_sites_ceiling_bounds_every_job_and_a_job_that_asks_more_is_refused() {
    let _s = serial();
    site_says("RpmiRequestLineMax=2048");
    // Below the built-in 4096: a line of 3000 bytes is over the site's ceiling.
    let run = srun(&marker("site-line"), &["-N1", "-n1", "bash", "-c", &long_line(3000)]);
    assert_eq!(run.status.code(), Some(125), "srun should exit 125 when rpmi ends the step: {run}");
    assert!(run.stderr.contains("rank 0: PMI protocol error: a line longer than 2048 bytes"), "{run}");
    // The built-in default is more than this site allows: each stepd refuses the step, and srun says why.
    let run = refused("site-ceiling", &[("SLURM_RPMI_REQUEST_LINE_MAX", "4096")]);
    let want = "refuses the step: SLURM_RPMI_REQUEST_LINE_MAX=4096 asks more than this site allows: at most 2048 \
                (the site's ceiling, mpi.conf's RpmiRequestLineMax)";
    let line = run.stderr.lines().find(|l| l.contains(want)).unwrap_or_else(|| panic!("no `{want}`: {run}"));
    assert!(line.starts_with("srun: error: rpmi: the slurmstepd of n"), "{line}");
}

#[test]
fn a_job_lowers_a_ceiling_and_sets_the_maxes() {
    let _s = serial();
    let env = [("SLURM_RPMI_REQUEST_LINE_MAX", "1500")];
    let run = Srun::start_with(&marker("job-line"), "rpmi", &["-N1", "-n1", "bash", "-c", &long_line(1800)], &env);
    let run = run.wait();
    assert_eq!(run.status.code(), Some(125), "srun should exit 125 when rpmi ends the step: {run}");
    assert!(run.stderr.contains("rank 0: PMI protocol error: a line longer than 1500 bytes"), "{run}");
    let env = [("SLURM_RPMI_KEYLEN_MAX", "32"), ("SLURM_RPMI_VALLEN_MAX", "512")];
    let run = Srun::start_with(&marker("job-maxes"), "rpmi", &["-N3", "-n3", probe(), "info"], &env).wait();
    assert_success(&run);
    let maxes: Vec<String> =
        run.stdout.lines().filter(|l| l.starts_with("rank=")).map(|l| words(l)["maxes"].to_string()).collect();
    assert_eq!(maxes, ["64/32/512"; 3], "{run}");
}

/// What srun's side sets for the stepds is srun's own: a user's copy in srun's environment changes nothing.
#[test]
fn the_plugins_own_variables_in_sruns_environment_are_not_options() {
    let _s = serial();
    let args = ["-N3", "-n3", probe(), "exchange"];
    let secret = "0".repeat(64);
    let env =
        [("RPMI_SLURM_OPTIONS", "SLURM_RPMI_TREE_WIDTH=1"), ("RPMI_SLURM_SECRET", secret.as_str()), ("PMI_DEBUG", "1")];
    let run = Srun::start_with(&marker("internal-vars"), "rpmi", &args, &env).wait();
    assert_success(&run);
    // The default width makes 3 nodes a star about node 0 (a chain, width 1, would give it one child).
    assert!(run.stderr.contains("to its 2 children in the PMI tree"), "{run}");
}

#[test]
fn scontrol_show_config_shows_the_plugins_settings() {
    let _s = serial();
    site_says("RpmiRequestLineMax=2048");
    let out = Command::new("scontrol").args(["show", "config"]).output().expect("scontrol");
    let text = String::from_utf8_lossy(&out.stdout);
    let section = text
        .split("MPI Plugins Configuration:")
        .nth(1)
        .unwrap_or_else(|| panic!("scontrol show config has no MPI plugins' section:\n{text}"));
    let setting = |key: &str| {
        section.lines().find_map(|l| l.split_once('=').filter(|(k, _)| k.trim() == key).map(|(_, v)| v.trim()))
    };
    for (key, want) in [
        ("RpmiRequestLineMax", "2048 (ceiling; default 2048)"),
        ("RpmiTreeWidth", "4 (default, built in)"),
        ("RpmiAllgather", "tree (default, built in)"),
        ("RpmiTrace", "no (default, built in)"),
    ] {
        assert_eq!(setting(key), Some(want), "{key} in scontrol show config:{section}");
    }
    site_says("RpmiKvsByteMax=1024");
    let misnamed =
        setting("RpmiKvsByteMax").unwrap_or_else(|| panic!("no RpmiKvsByteMax in scontrol show config:{section}"));
    assert!(
        misnamed.starts_with("not an option of mpi/rpmi, so Slurm skips it (its keys are RpmiKvsnameMax"),
        "{misnamed}"
    );
    // Not the misspelled key's 1024.
    let store = setting("RpmiKvsBytesMax");
    assert_eq!(store, Some("536870912 (ceiling, built in; default 536870912)"), "{section}");
}

// ---------------------------------------------------------------------------------------------------------
// PMI 1.2: group barriers, a star through srun among the member nodes only.

/// `rpmi-probe groups` across the nodes: the node roots alone exchange cards over a group barrier, each node
/// meets in a NODE barrier, and every rank waits in two group barriers at once (WORLD and its parity's),
/// answered in any order, while it asks something else.
#[test]
fn group_barriers_across_nodes() {
    let _s = serial();
    for (name, layout) in [
        ("groups-block", &["-N3", "-n6"][..]),
        ("groups-cyclic", &["-N3", "-n12", "-m", "cyclic"]),
        ("groups-96", &["-N3", "-n96"]),
    ] {
        let mark = marker(name);
        let args: Vec<&str> = layout.iter().copied().chain([probe(), "groups"]).collect();
        let run = srun(&mark, &args);
        assert_success(&run);
        let ranks = layout[layout.iter().position(|a| a.starts_with("-n")).unwrap()].trim_start_matches("-n");
        let want = format!("groups: {ranks} ranks, 3 node roots exchanged cards");
        assert!(run.stdout.contains(&want), "no `{want}`: {run}");
        eprintln!("{name}: {:.2?}", run.elapsed);
    }
}

/// A group barrier that a member on another node can no longer join ends the step, saying which barrier
/// and why, and leaves no task: the member's node is done (rank 1 finalized and left), or rank 1 finalized,
/// or left without finalize, while a task of its node runs on.
#[test]
fn a_group_barrier_a_member_cannot_join_ends_the_step() {
    let _s = serial();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/programs/pmi_group_left.sh");
    let script = script.to_str().unwrap();
    for (name, layout, how, about) in [
        // Its node is done, or its rank's finalize is heard of first: either way the line names both (rank 1's
        // node is the step's second, whichever Slurm gave it).
        ("group-done", &["-N2", "-n2"][..], "finalize", &["group barrier 0,1:5", " on n"][..]),
        (
            "group-finalized",
            &["-N2", "-n4", "-m", "cyclic"],
            "finalize",
            &["rank 1 on n", " called PMI_Finalize while other ranks wait for it in group barrier 0,1:5"],
        ),
        (
            "group-gone",
            &["-N2", "-n4", "-m", "cyclic"],
            "exit",
            // Whether rank 0's group barrier reached srun before rank 1 left or after: `... while other ranks
            // wait for it in group barrier 0,1:5`, or `... while other ranks run`.
            &["rank 1 on n", " closed its PMI connection (exited or crashed) without PMI_Finalize while other ranks "],
        ),
    ] {
        let mark = marker(name);
        let args: Vec<&str> = layout.iter().copied().chain(["bash", script, how]).collect();
        let run = srun(&mark, &args);
        assert!(!run.status.success(), "{name}: {run}");
        assert!(about.iter().all(|a| run.stderr.contains(a)), "{name}: not all of {about:?}: {run}");
        // The other ranks of the member's node sleep a minute: only the step's end stops them.
        assert_ended_soon(&run, name);
        no_leftovers(&mark);
    }
}

/// MPICH 5's sessions program makes communicators from the session's WORLD process set and from a subgroup
/// that only the even ranks take part in. MPICH 5.0 asks for PMI 1.1 and is answered 1.1 (never above what
/// it asked for), so its barriers are untagged. (Its own builds send no group barrier either way: configure
/// defines HAVE_PMI_BARRIER_GROUP only for a third-party libpmi, so `PMI_Barrier_group` is reported
/// unsupported and MPICH exchanges its business cards over plain barriers.)
#[test]
#[ignore = "needs MPICH 5: run by name"]
fn mpich5_sessions() {
    let _s = serial();
    let program = mpich5("mpi_sessions");
    for (name, layout) in
        [("sessions-block", ["-N3", "-n6", "-m", "block"]), ("sessions-cyclic", ["-N3", "-n6", "-m", "cyclic"])]
    {
        let mark = marker(name);
        let args: Vec<&str> = layout.iter().copied().chain([program.to_str().unwrap()]).collect();
        let run = Srun::start_with(&mark, "rpmi", &args, &[("PMI_DEBUG", "1")]).wait();
        assert_success(&run);
        assert!(run.stdout.contains("mpi_sessions: 6 ranks, world and 3 even ranks checked"), "{name}: {run}");
        assert!(run.stderr.contains("S: cmd=response_to_init rc=0 pmi_version=1 pmi_subversion=1"), "{run}");
        assert!(!run.stderr.contains("tag="), "{name}: a 1.1 client got a tagged barrier: {run}");
    }
}

// ---------------------------------------------------------------------------------------------------------
// Runtimes that load a PMI library, and Flux started by srun: each run by name where what it needs is
// installed (docker/test.sh), never in the other lines' chroots, which have neither.

/// Intel MPI's environment for `library` (`I_MPI_PMI=mode`), as srun's.
fn intel_env(intel: &impi::IntelMpi, library: &Path, mode: &str) -> Vec<(&'static str, String)> {
    let env = intel.env(Some((library, mode)));
    env.into_iter().map(|(k, v)| (k, v.into_string().expect("UTF-8 paths"))).collect()
}

/// Intel MPI through Slurm's own PMI-2 library (Debian's `libpmi2-0`), as Slurm's guide tells its users,
/// under `--mpi=rpmi` and, beside it, Slurm's own `--mpi=pmi2`: one node, since Intel MPI's shared-memory
/// fabric cannot cross this machine's virtual nodes whatever the PMI.
#[test]
#[ignore = "needs Intel MPI: run by name"]
fn impi_through_slurms_libpmi2() {
    let _s = serial();
    let intel = impi::intel_mpi();
    let env = intel_env(&intel, Path::new(impi::SLURM_LIBPMI2), "pmi2");
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let imb = intel.imb(4);
    for mpi in ["rpmi", "pmi2"] {
        let args: Vec<&str> = ["-N1", "-n4"].into_iter().chain(imb.iter().map(String::as_str)).collect();
        let run = Srun::start_with(&marker(&format!("impi-libpmi2-{mpi}")), mpi, &args, &env).wait();
        assert_success(&run);
        assert!(impi::imb_ran(&run.stdout, 4), "--mpi={mpi}: {run}");
        eprintln!("IMB-MPI1 through Slurm's libpmi2, --mpi={mpi}: {:.2?}", run.elapsed);
    }
}

/// rpmi's `libpmi.so.0` and `libpmi2.so.0` under srun: every call of each API over `--mpi=rpmi` on three
/// nodes (rpmi's server answers PMI 1.2, so the group barrier is served), and over Slurm's own `--mpi=pmi2`,
/// whose PMI-1 on `PMI_FD` is 1.1 only and answers names in MPICH's older way (`info=ok`); under `--mpi=rpmi`,
/// group barriers from several threads at once and gets from several threads while the next barrier's image
/// comes through `libpmi.so.0`, a node attribute waited for and put by two threads of each task through
/// `libpmi2.so.0` (under both), and a spawn through each.
#[test]
fn libpmi_every_call_under_srun() {
    let _s = serial();
    for (api, tail_rpmi, tail_pmi2) in [(libpmi::Api::Pmi1, "groups=1", "groups=0"), (libpmi::Api::Pmi2, "ok", "ok")] {
        let program = libpmi::program(api);
        let path = program.path.to_str().unwrap();
        for (mpi, nodes, tail) in [("rpmi", "-N3", tail_rpmi), ("pmi2", "-N2", tail_pmi2)] {
            let mark = marker(&format!("libpmi-{mpi}"));
            let run = Srun::start_with(&mark, mpi, &[nodes, "-n6", path], &[]).wait();
            assert_success(&run);
            let ok: Vec<&str> = run.stdout.lines().filter(|l| l.contains(" of 6: ok")).collect();
            assert_eq!(ok.len(), 6, "{api:?} --mpi={mpi}: {run}");
            assert!(ok.iter().all(|l| l.ends_with(tail)), "{api:?} --mpi={mpi}: {run}");
        }
        // Group barriers from several threads at once, entered in opposite orders on even and odd ranks; a
        // node attribute waited for by one thread and put by another (Slurm's server answers it without the
        // waiter's `thrid`: the library tells it by its command); through `libpmi.so.0`, gets from several
        // threads while their rank enters the next barrier, whose image of the store replaces the one they read.
        let runs: &[(&str, &str)] = match api {
            libpmi::Api::Pmi1 => &[("groups", "rpmi"), ("overlap", "rpmi")],
            libpmi::Api::Pmi2 => &[("nodewait", "rpmi"), ("nodewait", "pmi2")],
        };
        for &(mode, mpi) in runs {
            let mark = marker(&format!("libpmi-{mode}-{mpi}"));
            let run = Srun::start_with(&mark, mpi, &["-N3", "-n6", path, mode], &[]).wait();
            assert_success(&run);
            let want = format!(" of 6: ok {mode}");
            assert_eq!(run.stdout.lines().filter(|l| l.ends_with(&want)).count(), 6, "--mpi={mpi}: {run}");
        }
        // A spawn through the library: a new step of the job, whose tasks read the preput.
        let run = Srun::start_in(&marker("libpmi-spawn"), &["-N2", "-n4"], &["-n2", path, "spawn"]).wait();
        assert_success(&run);
        assert!(libpmi::spawned_and_read(&run.stdout, 2), "{api:?}: {run}");
    }
}

/// The image of the key-value space under srun: each slurmstepd sends its node's tasks the one sealed memory
/// file of the fence (tests/programs/kvs_image.c, a client written on the wire that keeps it): read-only
/// whichever way the task tries, out of reach of another user's process, through the task's /proc or its
/// slurmstepd's, and one per node and fence.
#[test]
fn the_image_under_srun_is_read_only_and_out_of_other_users_reach() {
    let _s = serial();
    let program = build_with("cc", "kvs_image");
    let run = srun(&marker("kvs-image"), &["-N3", "-n6", program.to_str().unwrap()]);
    assert_success(&run);
    let files: Vec<&str> =
        run.stdout.lines().filter_map(|l| l.split_once(": ok image files=")).map(|(_, f)| f).collect();
    assert_eq!(files.len(), 6, "{run}");
    // One pair of files (the two fences') a node, which its two tasks share.
    let distinct: std::collections::BTreeSet<&str> = files.into_iter().collect();
    assert_eq!(distinct.len(), 3, "{run}");
}

/// Intel MPI through rpmi's `libpmi.so.0` (`I_MPI_PMI=pmi1`) and `libpmi2.so.0` (`pmi2`) under
/// `--mpi=rpmi`, on one node, as [`impi_through_slurms_libpmi2`] runs it through Slurm's.
#[test]
#[ignore = "needs Intel MPI: run by name"]
fn impi_through_rpmis_libpmi() {
    let _s = serial();
    let intel = impi::intel_mpi();
    let dir = libpmi::library_dir();
    for (api, mode) in [(libpmi::Api::Pmi1, "pmi1"), (libpmi::Api::Pmi2, "pmi2")] {
        let env = intel_env(&intel, &dir.path().join(api.soname()), mode);
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let imb = intel.imb(4);
        let args: Vec<&str> = ["-N1", "-n4"].into_iter().chain(imb.iter().map(String::as_str)).collect();
        let run = Srun::start_with(&marker("impi-libpmi"), "rpmi", &args, &env).wait();
        assert_success(&run);
        assert!(impi::imb_ran(&run.stdout, 4), "{api:?}: {run}");
    }
}

/// Open MPI 4.1 (Debian's) through rpmi's `libpmi.so.0`, which its flux component loads where `FLUX_JOB_ID` is
/// set (tests/libpmi.rs runs it under rpmi-run): under `--mpi=rpmi` on one node, and on three over TCP (the
/// test cluster's nodes share one host, where its shared-memory files of two nodes would take one name).
#[test]
#[ignore = "needs Open MPI (Debian's openmpi-bin; the chroots lack it): run by name"]
fn ompi_through_rpmis_libpmi() {
    let _s = serial();
    let pairs = build_with("mpicc.openmpi", "mpi_pairs");
    let dir = libpmi::library_dir();
    let lib = dir.path().join(libpmi::Api::Pmi1.soname());
    for (i, (layout, size)) in [(["-N1", "-n4"], 4), (["-N3", "-n6"], 6)].into_iter().enumerate() {
        // A number below 32768 (Open MPI loses the top bit from there on), one of its own per run.
        let job = (std::process::id() % 16000 * 2 + i as u32 + 1).to_string();
        let mut env = vec![("FLUX_JOB_ID", job.as_str()), ("FLUX_PMI_LIBRARY_PATH", lib.to_str().unwrap())];
        env.push(("OMPI_MCA_pmix", "flux"));
        if size == 6 {
            env.push(("OMPI_MCA_btl", "self,tcp"));
        }
        let args: Vec<&str> = layout.into_iter().chain([pairs.to_str().unwrap()]).collect();
        let run = Srun::start_with(&marker("ompi-libpmi"), "rpmi", &args, &env).wait();
        assert_success(&run);
        let want = format!("mpi_pairs: {size} ranks, allreduce {}, all pairs exchanged", size * (size + 1) / 2);
        assert!(run.stdout.contains(&want), "{run}");
    }
}

/// Flux's PMI library `name`, where the installed Flux keeps its own.
fn flux_library(name: &str) -> PathBuf {
    let out = Command::new("flux").args(["config", "builtin", "pmi_library_path"]).output().expect("flux config");
    let own = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    own.parent().expect("Flux's library directory").join(name)
}

/// A Flux instance started by srun, as Flux's documentation starts one in a Slurm allocation: one broker
/// per node, bootstrapped through rpmi's PMI-1 (Flux's client accepts exactly 1.1); it then runs jobs of
/// its own across the three brokers.
#[test]
#[ignore = "needs Flux: run by name where it is installed"]
fn flux_started_by_srun() {
    let _s = serial();
    let run = srun(&marker("flux-size"), &["-N3", "flux", "start", "flux", "getattr", "size"]);
    assert_success(&run);
    assert_eq!(run.stdout.trim(), "3", "{run}");
    let run = srun(&marker("flux-run"), &["-N3", "flux", "start", "flux", "run", "-N3", "-n3", "hostname"]);
    assert_success(&run);
    assert_eq!(run.stdout.lines().count(), 3, "three tasks of Flux's own job: {run}");
}

/// Intel MPI through Flux's `libpmi.so.0` and `libpmi2.so.0` under `srun --mpi=rpmi` (one node).
#[test]
#[ignore = "needs Flux and Intel MPI: run by name where Flux is installed"]
fn flux_libraries_under_srun_with_intel_mpi() {
    let _s = serial();
    let intel = impi::intel_mpi();
    let imb = intel.imb(4);
    for (name, mode) in [("libpmi.so.0", "pmi1"), ("libpmi2.so.0", "pmi2")] {
        let env = intel_env(&intel, &flux_library(name), mode);
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let args: Vec<&str> = ["-N1", "-n4"].into_iter().chain(imb.iter().map(String::as_str)).collect();
        let run = Srun::start_with(&marker(&format!("flux-{mode}")), "rpmi", &args, &env).wait();
        assert_success(&run);
        assert!(impi::imb_ran(&run.stdout, 4), "Flux's {name}: {run}");
        eprintln!("IMB-MPI1 through Flux's {name} under srun: {:.2?}", run.elapsed);
    }
}

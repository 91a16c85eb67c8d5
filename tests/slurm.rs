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
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// Longest any one srun may take before the test calls it hung.
const GUARD: Duration = Duration::from_secs(60);

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
    BUILT.get_or_init(|| {
        let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("slurm-mpi_pairs");
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/programs/mpi_pairs.c");
        let status = Command::new("mpicc")
            .args(["-O1", "-o"])
            .arg(&out)
            .arg(&src)
            .status()
            .unwrap_or_else(|e| panic!("mpicc (MPICH) not found ({e}); run docker/install-deps.sh"));
        assert!(status.success(), "mpicc failed on {}", src.display());
        out
    })
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
        cluster();
        let mut child = Command::new("srun")
            .args(["-Q", "--mpi=rpmi", &format!("--job-name={mark}")])
            .args(args)
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

fn pairs(name: &str, layout: &[&str], ranks: usize) {
    let _s = serial();
    let program = mpi_pairs().to_str().unwrap();
    let mut args = layout.to_vec();
    args.push(program);
    let run = srun(&marker(name), &args);
    assert_success(&run);
    let want = format!("mpi_pairs: {ranks} ranks, allreduce {}, all pairs exchanged", ranks * (ranks + 1) / 2);
    assert!(run.stdout.contains(&want), "no `{want}`: {run}");
    eprintln!("{name}: {:.2?}", run.elapsed);
}

#[test]
fn mpi_pairs_block() {
    pairs("block", &["-N3", "-n6"], 6);
}

#[test]
fn mpi_pairs_cyclic() {
    pairs("cyclic", &["-N3", "-n24", "-m", "cyclic"], 24);
}

#[test]
fn mpi_pairs_plane() {
    pairs("plane", &["-N3", "-n24", "-m", "plane=2"], 24);
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
    let _s = serial();
    let run = srun(&marker("abort"), &["-N3", "-n6", mpi_pairs().to_str().unwrap(), "abort=2:7"]);
    assert_eq!(run.status.code(), Some(7), "srun should exit with the abort code: {run}");
    assert!(
        run.stderr.contains("rpmi: rank 2 on n") && run.stderr.contains("called PMI_Abort with exit code 7"),
        "no abort message on srun's stderr: {run}"
    );
    eprintln!("abort: srun exited 7 after {:.2?}", run.elapsed);
}

/// SIGKILLs rank `victim` while the others wait in MPI_Init's PMI barrier; the step must end, naming it.
fn killed_task_ends_the_step(name: &str, layout: &[&str], victim: u32, ranks: usize, shares_node: bool) {
    let _s = serial();
    let mark = marker(name);
    let mut args = layout.to_vec();
    let hang = format!("hang_before_init={victim}");
    args.extend([mpi_pairs().to_str().unwrap(), &hang]);
    let run = Srun::start(&mark, &args);
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
    assert!(took < GUARD);
    assert!(run.stderr.contains(&format!("rank {victim}")), "no message naming rank {victim}: {run}");
}

#[test]
fn a_sigkilled_task_ends_the_step_same_node() {
    // -N3 -n6 puts ranks 0-3 on n1: they wait for rank 1 in their own shell's barrier.
    killed_task_ends_the_step("kill-local", &["-N3", "-n6"], 1, 6, true);
}

#[test]
fn a_sigkilled_task_ends_the_step_other_node() {
    // -N3 -n3: rank 1 is alone on n2; the others wait for it in the exchange through srun.
    killed_task_ends_the_step("kill-remote", &["-N3", "-n3"], 1, 3, false);
}

fn hello_with(secret: [u8; 32]) -> Vec<u8> {
    let mut f = vec![0, 0, 0, 43, 1];
    f.extend_from_slice(b"RPMI");
    f.extend_from_slice(&1u16.to_be_bytes());
    f.extend_from_slice(&0u32.to_be_bytes());
    f.extend_from_slice(&secret);
    f
}

/// True if the root closes `s` (EOF or reset) within 15 s.
fn closed_by_peer(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    let mut b = [0u8; 64];
    match s.read(&mut b) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    }
}

#[test]
fn a_connection_without_the_secret_is_refused_and_the_job_goes_on() {
    let _s = serial();
    let mark = marker("secret");
    let flag = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{mark}.go"));
    let _ = std::fs::remove_file(&flag);
    // Rank 0 prints where the root listens; every rank waits for the flag before its exchange.
    let script = format!(
        "if [ \"$PMI_RANK\" = 0 ]; then echo \"root $SLURM_SRUN_COMM_HOST $RPMI_SLURM_PORT\"; fi; \
         for i in $(seq 600); do [ -e {flag} ] && break; sleep 0.1; done; exec {} exchange",
        probe(),
        flag = flag.display()
    );
    let run = Srun::start(&mark, &["-N3", "-n3", "bash", "-c", &script]);
    let line = run.line(|l| l.starts_with("root "));
    let w: Vec<&str> = line.split_whitespace().collect();
    let addr = format!("{}:{}", w[1], w[2]);

    let mut wrong = TcpStream::connect(&addr).expect("the collective port takes connections");
    wrong.write_all(&hello_with([0x5a; 32])).unwrap();
    assert!(closed_by_peer(&mut wrong), "a HELLO with a wrong secret was not refused");
    let mut garbage = TcpStream::connect(&addr).unwrap();
    garbage.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    assert!(closed_by_peer(&mut garbage), "garbage was not refused");
    // One that says nothing at all stays open while the job goes on, and holds nothing up.
    let _silent = TcpStream::connect(&addr).unwrap();

    std::fs::write(&flag, b"").unwrap();
    let run = run.wait();
    let _ = std::fs::remove_file(&flag);
    assert_success(&run);
    assert!(run.stdout.contains("exchange: size=3"), "the job did not complete its exchange: {run}");
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

//! rpmi under a real Flux: the job-shell plugin (`src/flux/rpmi_shell.c`) in 3-broker Flux instances
//! (`flux start --test-size=3`: three brokers on this machine, each with its own job shell), serving
//! `rpmi-probe`, Debian's MPICH and a PMI-2 client in bash across the three shells.
//!
//! Needs Flux installed (`flux` on the PATH; the project builds none); without it every test fails, saying so.
//! The plugin is compiled here against this build's `librpmi.so` (`docker/flux.sh plugin`) and loaded the
//! way a user does, with `-o userrc=`; one test runs the copy `docker/flux.sh install` put where the site's
//! shells load it. The instances run one at a time: each has three brokers on a 2-core machine.
//!
//! Run with `bash docker/flux.sh test` (or `cargo test --features flux --test flux` once the plugin is installed).

#![cfg(feature = "flux")]

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Instant;
use support::*;

/// The plugin, its userrc and the test programs, built once per test binary.
struct Setup {
    userrc: PathBuf,
    mpi_pairs: PathBuf,
    /// A copy of rpmi-probe that only the test that kills a task runs, so that the task is found by its exe.
    probe_killed: PathBuf,
}

fn setup() -> &'static Setup {
    static SETUP: OnceLock<Setup> = OnceLock::new();
    SETUP.get_or_init(|| {
        let flux = Command::new("flux").arg("version").output();
        assert!(
            flux.is_ok_and(|o| o.status.success()),
            "no `flux` on the PATH: these tests need an installed Flux (flux-core)"
        );
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("flux-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("the test's directory");
        let library = library();
        let plugin = dir.join("rpmi.so");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("docker/flux.sh");
        let out = Command::new("bash").arg(script).arg("plugin").arg(&plugin).arg(&library).output().expect("bash");
        assert!(out.status.success(), "the plugin does not compile:\n{}", String::from_utf8_lossy(&out.stderr));
        let userrc = dir.join("rpmi.lua");
        std::fs::write(&userrc, format!("plugin.load {{ file = \"{}\" }}\n", plugin.display())).expect("userrc");
        let probe_killed = dir.join("probe_killed");
        std::fs::copy(PROBE, &probe_killed).expect("copy rpmi-probe");
        Setup { userrc, mpi_pairs: compile("mpicc", "mpi_pairs", &dir), probe_killed }
    })
}

/// This build's librpmi.so, beside the test executable's directory.
fn library() -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    let library = exe.parent().and_then(Path::parent).expect("target/<profile>/deps").join("librpmi.so");
    assert!(library.is_file(), "{} is missing: build first (`cargo build`)", library.display());
    library
}

/// One Flux instance at a time, with no MPICH shared memory left by a job that was killed.
fn instance() -> MutexGuard<'static, ()> {
    static ONE: Mutex<()> = Mutex::new(());
    let one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    remove_stale_mpich_segments();
    one
}

/// MPICH names a node's shared memory after its world (a hash of the KVS name, here the Flux job id) and
/// leaves it behind when its processes are killed (the abort tests). Job ids repeat from one new test
/// instance to the next, so a later job of the same id would attach to the dead one's memory and fail in
/// `MPI_Init` ("Out of memory") or wait in it: what no process maps any more is removed first.
fn remove_stale_mpich_segments() {
    let Ok(shm) = std::fs::read_dir("/dev/shm") else { return };
    let mut maps = String::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        maps.push_str(&std::fs::read_to_string(entry.path().join("maps")).unwrap_or_default());
    }
    for segment in shm.flatten().map(|e| e.path()) {
        let name = segment.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        if name.starts_with("mpich_") && !maps.contains(&format!("/dev/shm/{name}")) {
            let _ = std::fs::remove_file(&segment);
        }
    }
}

/// `flux start --test-size=3 flux run -N3 ARGS...` with the plugin loaded through `-o userrc=`.
fn flux_run_args(args: &[&str]) -> Vec<String> {
    let rc = format!("userrc={}", setup().userrc.display());
    let mut all: Vec<String> = ["start", "--test-size=3", "flux", "run", "-N3", "-o", &rc].map(String::from).to_vec();
    all.extend(args.iter().map(|a| a.to_string()));
    all
}

/// `flux start --test-size=BROKERS bash -c SCRIPT`: the script runs as the instance's initial program; what it
/// took, from before the instance started.
fn flux_script(brokers: usize, script: &str) -> (Done, std::time::Duration) {
    let _one = instance();
    let started = Instant::now();
    let args = ["start".to_string(), format!("--test-size={brokers}"), "bash".into(), "-c".into(), script.into()];
    let done = start("flux", &args).wait(GUARD);
    (done, started.elapsed())
}

fn flux_run(args: &[&str]) -> Done {
    let _one = instance();
    let done = start("flux", &flux_run_args(args)).wait(GUARD);
    eprintln!("flux run {args:?}: {} in {:.2?}", done.status, done.elapsed);
    done
}

const RPMI: [&str; 2] = ["-o", "pmi=rpmi"];

/// `rpmi-probe info` lines by rank: `key=value` words.
fn info_by_rank(stdout: &str) -> std::collections::BTreeMap<u32, String> {
    stdout
        .lines()
        .filter_map(|l| {
            let rank = l.strip_prefix("rank=")?.split(' ').next()?.parse().ok()?;
            Some((rank, l.to_string()))
        })
        .collect()
}

#[test]
fn probe_info_and_exchange_across_three_shells() {
    // Blocks of 2 (-n6) and of 32 (96 ranks: --tasks-per-node runs more tasks than the instance has cores).
    for (tasks, per_node) in [(["-n6"], 2), (["--tasks-per-node=32"], 32)] {
        let size = 3 * per_node;
        let r = flux_run(&[&RPMI[..], &tasks[..], &[PROBE, "info"]].concat());
        r.assert_success("rpmi-probe info");
        let info = info_by_rank(&r.stdout);
        assert_eq!(info.len(), size as usize, "not every rank answered:\n{}", r.dump());
        for (rank, line) in &info {
            let node = rank / per_node;
            let clique: Vec<String> = (node * per_node..(node + 1) * per_node).map(|r| r.to_string()).collect();
            assert!(line.contains(&format!("size={size} ")), "rank {rank}: {line}");
            assert!(line.contains(&format!("mapping=(vector,(0,3,{per_node}))")), "rank {rank}: {line}");
            assert!(line.ends_with(&format!("clique={}", clique.join(","))), "rank {rank}: {line}");
        }
        let r = flux_run(&[&RPMI[..], &tasks[..], &[PROBE, "exchange", "--puts", "8", "--size", "800"]].concat());
        r.assert_success("rpmi-probe exchange");
        let line = format!("exchange: size={size} puts=8 value_len=800 gets={size} ");
        assert!(r.stdout.contains(&line), "no summary line:\n{}", r.dump());
    }
}

/// A chain of shells (`-o rpmi.tree_width=1`: shell 2 under shell 1 under shell 0) carries the exchange too;
/// an option rpmi does not know fails the job, naming it.
#[test]
fn options_reach_the_plugin_and_rpmi() {
    let r = flux_run(
        &[&RPMI[..], &["-o", "rpmi.tree_width=1", "-o", "rpmi.vallen_max=500", "-n6"], &[PROBE, "info"]].concat(),
    );
    r.assert_success("rpmi-probe info over a chain");
    assert_eq!(info_by_rank(&r.stdout).values().filter(|l| l.contains("maxes=64/64/500")).count(), 6, "{}", r.dump());
    // The shells end with their tasks: none waits to say goodbye to one that is ending too (which held such a
    // job's end 10 s; the instance's own start and end take about 1.5 s of the bound).
    assert!(
        r.elapsed < std::time::Duration::from_secs(8),
        "the job ended {:?} after it started\n{}",
        r.elapsed,
        r.dump()
    );
    let r = flux_run(&[&RPMI[..], &["-o", "rpmi.tree_width=1", "-n6", PROBE, "exchange"]].concat());
    r.assert_success("rpmi-probe exchange over a chain");
    let r = flux_run(&[&RPMI[..], &["-o", "rpmi.bogus=1", "-n3", PROBE, "info"]].concat());
    assert_ne!(r.code(), Some(0), "an unknown option was accepted:\n{}", r.dump());
    assert!(r.stderr.contains("unknown option 'bogus'"), "the option is not named:\n{}", r.dump());
}

#[test]
fn mpich_programs_run_across_three_shells() {
    let p = setup().mpi_pairs.to_str().expect("UTF-8").to_string();
    let r = flux_run(&[&RPMI[..], &["-n6", &p]].concat());
    r.assert_success("mpi_pairs");
    assert!(r.stdout.contains("mpi_pairs: 6 ranks, allreduce 21, all pairs exchanged"), "{}", r.dump());
    let r = flux_run(&[&RPMI[..], &["--tasks-per-node=8", &p]].concat());
    r.assert_success("mpi_pairs at 24 ranks");
    assert!(r.stdout.contains("mpi_pairs: 24 ranks, allreduce 300, all pairs exchanged"), "{}", r.dump());
}

/// rpmi's client libraries under the Flux plugin: `pmi_api.c exec` through `libpmi.so.0` across three shells
/// (a put, the barrier, 20 gets, which its shell's image of the store answers once mapped, then an exec that
/// finds neither the file nor the mapping); `pmi_api.c overlap` (gets from several threads while the next
/// barrier's image comes); group barriers over PMI 1.2 from several threads; and a
/// client by hand that keeps the image's memory file
/// (tests/programs/kvs_image.c): read-only whichever way it tries, out of another user's reach, one file per
/// shell and fence; and one that takes the node barrier's page and runs barriers on it.
#[test]
fn the_libraries_read_each_shells_image_of_the_store() {
    let p = support::libpmi::program(support::libpmi::Api::Pmi1);
    let r = flux_run(&[&RPMI[..], &["-n6", p.path.to_str().expect("UTF-8"), "exec"]].concat());
    r.assert_success("pmi_api exec");
    assert_eq!(r.stdout.lines().filter(|l| l.ends_with(": ok exec")).count(), 6, "{}", r.dump());
    let r = flux_run(&[&RPMI[..], &["-n6", p.path.to_str().expect("UTF-8"), "overlap"]].concat());
    r.assert_success("pmi_api overlap");
    assert_eq!(r.stdout.lines().filter(|l| l.ends_with(": ok overlap")).count(), 6, "{}", r.dump());
    // `libpmi.so.0` asks for PMI 1.2 where rpmi serves it (RPMI_PMI_SUBVERSION), as it now does under Flux:
    // group barriers from several threads at once.
    let r = flux_run(&[&RPMI[..], &["-n6", p.path.to_str().expect("UTF-8"), "groups"]].concat());
    r.assert_success("pmi_api groups");
    assert_eq!(r.stdout.lines().filter(|l| l.ends_with(": ok groups")).count(), 6, "{}", r.dump());
    let dir = support::libpmi::library_dir();
    let image = compile("cc", "kvs_image", dir.path());
    let r = flux_run(&[&RPMI[..], &["-n6", image.to_str().expect("UTF-8")]].concat());
    r.assert_success("kvs_image");
    let files: std::collections::BTreeSet<&str> =
        r.stdout.lines().filter_map(|l| l.split_once(": ok image files=")).map(|(_, f)| f).collect();
    assert_eq!(files.len(), 3, "not one pair of files a shell: {}", r.dump());
    // The node barrier's page, one a shell (2 ranks each), sealed in length, carrying 20 barriers
    // (tests/programs/node_barrier.c).
    let node_barrier = compile("cc", "node_barrier", dir.path());
    let r = flux_run(&[&RPMI[..], &["-n6", node_barrier.to_str().expect("UTF-8"), "20"]].concat());
    r.assert_success("node_barrier");
    assert_eq!(r.stdout.lines().filter(|l| l.ends_with(": ok members=2")).count(), 6, "{}", r.dump());
}

/// PMI-2's frames are not lines: the channel passes every byte on as it comes.
#[test]
fn pmi2_frames_across_three_shells() {
    let frames = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/programs/pmi2_frames.sh");
    let r = flux_run(&[&RPMI[..], &["-n6", "bash", frames.to_str().expect("UTF-8")]].concat());
    r.assert_success("the PMI-2 client");
    for rank in 0..6 {
        let answer = format!("rank {rank}: cmd=kvs-get-response;rc=0;value=v{};found=TRUE;", (rank + 1) % 6);
        assert!(r.stdout.lines().any(|l| l == answer), "rank {rank} did not read its neighbour's key:\n{}", r.dump());
    }
}

/// Rank 4 calls MPI_Abort(7): the job's exit status is 7, and the job's one exception names the rank.
#[test]
fn mpi_abort_code_is_the_jobs_exit_status() {
    let p = setup().mpi_pairs.to_str().expect("UTF-8").to_string();
    let r = flux_run(&[&RPMI[..], &["-n6", &p, "abort=4:7"]].concat());
    assert_eq!(r.code(), Some(7), "not the abort's code:\n{}", r.dump());
    let exceptions: Vec<&str> = r.stderr.lines().filter(|l| l.contains("job.exception")).collect();
    assert_eq!(exceptions.len(), 1, "one exception expected:\n{}", r.dump());
    assert!(exceptions[0].contains("rank 4 called PMI_Abort(7)"), "{}", r.dump());
    assert!(!r.stdout.contains("mpi_pairs:"), "the job ran to its end:\n{}", r.dump());
}

/// Rank 3 is killed while the others wait for it in a barrier: the job ends at once (not at Flux's own
/// timeout for a failed task), and its one exception names rank 3; no task is left.
#[test]
fn a_task_killed_while_others_wait_ends_the_job_naming_its_rank() {
    let probe = &setup().probe_killed;
    let _one = instance();
    let args = flux_run_args(
        &[&RPMI[..], &["-n6", probe.to_str().expect("UTF-8"), "barrier", "--count", "100000000"]].concat(),
    );
    let mut job = start("flux", &args);
    let want = "PMI_RANK=3".to_string();
    let victim = job.wait_until(GUARD, "rank 3's process", |_| {
        running_exe(probe).into_iter().find(|&p| environ(p).is_some_and(|e| e.contains(&want)))
    });
    // Stopped first, so that the others wait in the barrier it will never enter.
    signal(victim, libc::SIGSTOP);
    std::thread::sleep(std::time::Duration::from_millis(300));
    let killed = Instant::now();
    signal(victim, libc::SIGKILL);
    let done = job.wait_ending(END_GUARD);
    eprintln!("rank 3 killed: the job ended {:.2?} later with {}", done.ended - killed, done.status);
    assert_ne!(done.code(), Some(0), "{}", done.dump());
    let exceptions: Vec<&str> = done.stderr.lines().filter(|l| l.contains("job.exception")).collect();
    assert_eq!(exceptions.len(), 1, "one exception expected:\n{}", done.dump());
    assert!(exceptions[0].contains("rank 3 closed its PMI connection"), "{}", done.dump());
    assert!(running_exe(probe).is_empty(), "tasks left: {:?}\n{}", running_exe(probe), done.dump());
}

/// PMI 1.2 under Flux: rpmi answers 1.2 to a client that asks for it and runs its group barriers (the node
/// roots' exchange, NODE, WORLD, rank lists) among the shells; Flux's broker, a 1.1 client, still starts a
/// nested instance; MPICH 5 runs over PMI-1 (asking 1.1 here) and PMI-2.
#[test]
fn pmi_1_2_group_barriers_across_three_shells() {
    let r = flux_run(&[&RPMI[..], &["-n6", PROBE, "groups"]].concat());
    r.assert_success("rpmi-probe groups");
    assert!(r.stdout.contains("groups: 6 ranks, 3 node roots exchanged cards"), "{}", r.dump());
    let pairs = &mpich5_program("mpi_pairs");
    let r = flux_run(&[&RPMI[..], &["-n6", pairs]].concat());
    r.assert_success("MPICH 5 over PMI-1");
    assert!(r.stdout.contains("mpi_pairs: 6 ranks, allreduce 21, all pairs exchanged"), "{}", r.dump());
    // A 1.1 client is still answered 1.1: Flux's own broker, a nested instance bootstrapped through rpmi.
    let r = flux_run(&[&RPMI[..], &["-n3", "flux", "start", "flux", "getattr", "size"]].concat());
    r.assert_success("a Flux instance started under rpmi");
    assert_eq!(r.stdout.trim(), "3", "{}", r.dump());
    let env = ["--env=PMI_VERSION=2"];
    let r = flux_run(&[&RPMI[..], &env[..], &["-n6", pairs]].concat());
    r.assert_success("MPICH 5 over PMI-2");
    assert!(r.stdout.contains("mpi_pairs: 6 ranks, allreduce 21, all pairs exchanged"), "{}", r.dump());
}

/// `name` (tests/programs) built with MPICH 5 (`RPMI_MPICH5`, else /opt/rpmi-mpich5) into a directory of this
/// test binary's, once (tests that run the same program may run at once).
fn mpich5_program(name: &str) -> String {
    static BUILDING: Mutex<()> = Mutex::new(());
    let _one = BUILDING.lock().unwrap_or_else(|e| e.into_inner());
    let mpich5 = std::env::var_os("RPMI_MPICH5").map_or_else(|| PathBuf::from("/opt/rpmi-mpich5"), PathBuf::from);
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("flux-mpich5-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("the test's directory");
    let program = dir.join(name);
    if !program.exists() {
        compile(mpich5.join("bin/mpicc").to_str().expect("UTF-8"), name, &dir);
    }
    program.to_str().expect("UTF-8").to_string()
}

/// Spawn under Flux: MPI_Comm_spawn (MPICH 5) of 2 workers from 2 ranks on 2 shells starts a Flux job of the
/// same instance, which gets the spawner's preputs and connects back; spawned jobs spawn in turn (depth 2).
#[test]
fn spawn_starts_a_flux_job_that_connects_back() {
    let spawn = mpich5_program("mpi_spawn");
    let rc = format!("userrc={}", setup().userrc.display());
    let run = |args: &[&str]| {
        let _one = instance();
        let mut all = vec!["start", "--test-size=3", "flux", "run", "-N2", "-n2", "-o", &rc, "-o", "pmi=rpmi"];
        all.extend(args);
        let done = start("flux", &all.iter().map(|a| a.to_string()).collect::<Vec<_>>()).wait(GUARD);
        eprintln!("flux run {args:?}: {} in {:.2?}", done.status, done.elapsed);
        done
    };
    let r = run(&[&spawn, "2"]);
    r.assert_success("mpi_spawn 2");
    assert!(r.stdout.contains("mpi_spawn: 2 parents, 2 children, depth 1"), "{}", r.dump());
    let r = run(&[&spawn, "2", "2"]);
    r.assert_success("mpi_spawn 2 2");
    assert!(r.stdout.contains("mpi_spawn: 2 parents, 2 children, depth 2 (4 processes below"), "{}", r.dump());
}

/// Names across a spawn (ABI revision 6): the spawned job's tasks use the first job's names, held by its shell
/// 0: the children find what the spawner published, and the spawner what the children did.
#[test]
fn a_spawned_job_shares_the_spawners_names() {
    let names = mpich5_program("mpi_spawn_names");
    let r = flux_run(&[&RPMI[..], &["-n3", &names]].concat());
    r.assert_success("mpi_spawn_names");
    let line = "mpi_spawn_names: the children found the spawner's name, the spawner found the children's";
    assert!(r.stdout.contains(line), "{}", r.dump());
}

/// A job's shell 0 outlives the jobs its other shells spawned, so the names last as long as the launch: rank 1
/// (shell 1) publishes, spawns a job and ends, as rank 0 did; the spawned job waits for that, then 2 s more
/// (twice the instance's exec.shell-exit-timeout, after which Flux would fail a job whose shell 0 had left
/// while another shell stays open for its spawned job), and looks the name up. Shell 1 named the job to shell
/// 0, which follows it until it is clean.
#[test]
fn shell_0_outlives_the_jobs_the_other_shells_spawned_and_the_names_with_it() {
    let rc = format!("userrc={}", setup().userrc.display());
    let dir = setup().userrc.with_file_name("names-late");
    let _ = std::fs::remove_dir_all(&dir);
    let config = dir.join("config");
    std::fs::create_dir_all(&config).expect("the test's directory");
    std::fs::write(config.join("exec.toml"), "[exec]\nshell-exit-timeout = \"1s\"\n").expect("the config");
    let (looked_up, spawner_done) = (dir.join("looked-up"), dir.join("spawner-done"));
    let child = format!(
        "until [ -e {} ]; do sleep 0.1; done; sleep 2; \
         echo cmd=init pmi_version=1 pmi_subversion=1 >&$PMI_FD; read -r l <&$PMI_FD; \
         echo cmd=lookup_name service=late >&$PMI_FD; read -r l <&$PMI_FD; echo \"$l\" >{}; \
         echo cmd=finalize >&$PMI_FD; read -r l <&$PMI_FD",
        spawner_done.display(),
        looked_up.display()
    );
    let spawner = dir.join("spawner.sh");
    std::fs::write(
        &spawner,
        r#"say() { printf '%s\n' "$1" >&$PMI_FD; }; hear() { read -r line <&$PMI_FD; echo "rank $PMI_RANK: $line"; }
           say 'cmd=init pmi_version=1 pmi_subversion=1'; hear
           [ "$PMI_RANK" = 1 ] && { say 'cmd=publish_name service=late port=p1'; hear; }
           say cmd=barrier_in; hear
           [ "$PMI_RANK" = 1 ] && {
               printf 'mcmd=spawn\nnprocs=1\nexecname=bash\ntotspawns=1\nspawnssofar=1\nargcnt=2\narg1=-c\narg2=%s\npreput_num=0\ninfo_num=0\nendcmd\n' "$1" >&$PMI_FD
               hear; }
           say cmd=finalize; hear
           [ "$PMI_RANK" = 1 ] && touch "$2"; exit 0"#,
    )
    .expect("the spawner's script");
    let script =
        format!("flux run -N2 -n2 -o {rc} -o pmi=rpmi bash {} '{child}' {}", spawner.display(), spawner_done.display());
    let _one = instance();
    let args = ["start", "--test-size=3", &format!("--config-path={}", config.display()), "bash", "-c", &script];
    let r = start("flux", &args.map(String::from)).wait(GUARD);
    r.assert_success("a spawn whose child looks a name up after the spawners ended");
    assert!(r.stdout.contains("rank 1: cmd=spawn_result rc=0"), "{}", r.dump());
    let answer = std::fs::read_to_string(&looked_up).unwrap_or_default();
    assert!(answer.contains("cmd=lookup_result rc=0") && answer.contains("port=p1"), "{answer:?}\n{}", r.dump());
}

/// Tied ends: rank 0 of the spawned job calls MPI_Abort(42); the spawner's shell, which follows that job, ends
/// its own job naming it, with its exit status, at once (not at the program's own 100 s limit).
#[test]
fn an_abort_in_a_spawned_job_ends_the_spawner() {
    let spawn = mpich5_program("mpi_spawn");
    let r = flux_run(&[&RPMI[..], &["--env=MPI_SPAWN_ABORT_LEVEL=1", "-n3", &spawn, "2"]].concat());
    // The instance's own time, not the wait for the tests before it to end theirs.
    let took = r.elapsed;
    assert_eq!(r.code(), Some(42), "the spawned job's abort code:\n{}", r.dump());
    assert!(r.stderr.contains("the spawned job") && r.stderr.contains("PMI_Abort(42)"), "{}", r.dump());
    assert!(took < std::time::Duration::from_secs(30), "{took:?}\n{}", r.dump());
}

/// Tied ends the other way: shell 0 of a spawned job follows its spawner (named by `-o rpmi-spawned`, as the
/// spawning shell sets it) and ends its job, naming the spawner, as soon as the spawner is cancelled.
#[test]
fn a_spawned_job_ends_when_its_spawner_fails() {
    let rc = format!("userrc={}", setup().userrc.display());
    let script = format!(
        r#"P=$(flux submit -n1 sleep 60)
           C=$(flux submit -N2 -n2 -o {rc} -o pmi=rpmi \
               -o rpmi-spawned='{{"parent": '$(flux job id --to=dec $P)', "preputs": [["k", "v"]],
                                "names": {{"topic": "none.rpmi-name", "rank": 0}}}}' sleep 60)
           flux job wait-event -t 20 $C start && flux cancel $P && flux job wait-event -t 10 $C clean &&
           flux job eventlog $C"#
    );
    let (r, took) = flux_script(3, &script);
    r.assert_success("a spawned job and its cancelled spawner");
    assert!(r.stdout.contains("the job that spawned this one") && r.stdout.contains("failed: cancel"), "{}", r.dump());
    // The 60 s sleeps would hold it far longer.
    assert!(took < std::time::Duration::from_secs(30), "{}", r.dump());
}

/// A program that cannot be executed: the spawned job fails before its shells start every task, the spawn
/// fails (MPICH returns the error to the spawner), and the spawner's job goes on and ends well.
#[test]
fn a_spawn_of_a_missing_program_fails_and_the_spawner_goes_on() {
    let missing = mpich5_program("mpi_spawn_missing");
    let r = flux_run(&[&RPMI[..], &["-n3", &missing]].concat());
    r.assert_success("mpi_spawn_missing");
    assert!(r.stdout.contains("mpi_spawn_missing: spawn failed as expected"), "{}", r.dump());
    assert!(r.stderr.contains("rank 0's spawn failed") && r.stderr.contains("No such file"), "{}", r.dump());
}

/// A spawn beyond rpmi's bound (65536 processes) is refused by the spawner's own shell with the reason, before
/// Flux is asked for anything: the instance holds the spawner's job alone.
#[test]
fn a_spawn_beyond_the_bound_is_refused_before_flux_sees_it() {
    let rc = format!("userrc={}", setup().userrc.display());
    let spawner = setup().userrc.with_file_name("spawn_70000.sh");
    std::fs::write(
        &spawner,
        r#"say() { printf '%s\n' "$1" >&$PMI_FD; }; hear() { read -r line <&$PMI_FD; echo "$line"; }
           say 'cmd=init pmi_version=1 pmi_subversion=1'; hear >/dev/null
           printf 'mcmd=spawn\nnprocs=70000\nexecname=true\ntotspawns=1\nspawnssofar=1\nargcnt=0\npreput_num=0\ninfo_num=0\nendcmd\n' >&$PMI_FD
           echo "spawner: $(hear)"; say cmd=finalize; hear >/dev/null"#,
    )
    .expect("the spawner's script");
    let script =
        format!("flux run -n1 -o {rc} -o pmi=rpmi bash {} && flux jobs -a -n -o '{{id}}' | wc -l", spawner.display());
    let (r, _) = flux_script(1, &script);
    r.assert_success("a spawn of 70000 processes");
    let answer = r.stdout.lines().find(|l| l.starts_with("spawner: ")).unwrap_or_default();
    assert!(answer.contains("cmd=spawn_result rc=-1") && answer.contains("65536"), "{}", r.dump());
    assert_eq!(r.stdout.lines().last(), Some("1"), "one job only, the spawner's:\n{}", r.dump());
}

/// A spawn of two commands with the same 2500 preputs each (the usual shape: every command of
/// `MPI_Comm_spawn_multiple` carries the job's preputs) starts: the new job gets each key once, not the 5000
/// copies, which are more than the 4096 a job takes.
#[test]
fn a_spawn_of_several_commands_gives_the_new_job_each_preput_once() {
    let spawner = setup().userrc.with_file_name("spawn_preputs.sh");
    std::fs::write(
        &spawner,
        r#"say() { printf '%s\n' "$1" >&$PMI_FD; }; hear() { read -r line <&$PMI_FD; echo "$line"; }
           say 'cmd=init pmi_version=1 pmi_subversion=1'; hear >/dev/null
           for n in 1 2; do
               { printf 'mcmd=spawn\nnprocs=1\nexecname=true\ntotspawns=2\nspawnssofar=%d\nargcnt=0\npreput_num=2500\n' $n
                 for i in $(seq 0 2499); do printf 'preput_key_%d=k%d\npreput_val_%d=v\n' $i $i $i; done
                 printf 'info_num=0\nendcmd\n'; } >&$PMI_FD
           done
           echo "spawner: $(hear)"; say cmd=finalize; hear >/dev/null"#,
    )
    .expect("the spawner's script");
    let args = ["-N1", "-n1", "-o", "rpmi.spawn_bytes_max=2097152", "bash", spawner.to_str().expect("UTF-8")];
    let r = flux_run(&[&RPMI[..], &args].concat());
    r.assert_success("a spawn of two commands with 2500 preputs each");
    assert!(r.stdout.contains("spawner: cmd=spawn_result rc=0"), "{}", r.dump());
}

/// A spawn Flux cannot place yet (the spawner holds the one broker's cores) waits in the queue, as a `flux
/// submit` would; once the spawning task is gone, nobody waits for it: it is cancelled, and the spawner's job,
/// which its shell held open for the spawned job's end, ends with its task.
#[test]
fn a_queued_spawn_is_cancelled_when_its_spawner_ends() {
    let spawn = mpich5_program("mpi_spawn");
    let rc = format!("userrc={}", setup().userrc.display());
    let script = format!(
        r#"J=$(flux submit -n2 -o {rc} -o pmi=rpmi {spawn} 2)
           for i in $(seq 200); do [ $(flux jobs -a -n -o '{{id}}' | wc -l) -ge 2 ] && break; sleep 0.1; done
           flux job kill $J && flux job wait-event -t 20 $J clean >/dev/null &&
           flux jobs -a -n -o '{{id}} {{state}} {{result}}'"#
    );
    let (r, took) = flux_script(1, &script);
    r.assert_success("a queued spawn and its spawner's end");
    let states: Vec<&str> = r.stdout.lines().collect();
    assert_eq!(states.len(), 2, "{}", r.dump());
    assert!(states.iter().all(|l| l.contains("INACTIVE")) && r.stdout.contains("CANCELED"), "{}", r.dump());
    assert!(took < std::time::Duration::from_secs(30), "{}", r.dump());
}

/// A spawn of several commands (MPI_Comm_spawn_multiple) is one Flux job whose shells give each rank its own
/// command's argv and its command's index as its appnum.
#[test]
fn a_spawn_of_several_commands_gives_each_rank_its_argv_and_appnum() {
    let multiple = mpich5_program("mpi_spawn_multiple");
    let r = flux_run(&[&RPMI[..], &["-n3", &multiple]].concat());
    r.assert_success("mpi_spawn_multiple");
    let line =
        "mpi_spawn_multiple: 3 parents, 1 child of command 0 and 2 of command 1: appnums, argvs and merge checked";
    assert!(r.stdout.contains(line), "{}", r.dump());
}

/// The name service under Flux: the job's names, held by shell 0's instance. MPICH 5 (over OFI, which opens
/// a real port) publishes on rank 0 and looks up on the others, on other shells; a second publish, an unknown
/// name and an unpublished one fail.
#[test]
fn the_name_service_across_three_shells() {
    let names = mpich5_program("mpi_names");
    let env = ["--env=MPIR_CVAR_CH4_NETMOD=ofi"];
    // One rank a shell: MPICH 5.0.2 over OFI sometimes hangs in MPI_Init on a loaded machine where a node has
    // two ranks, under Hydra as under rpmi (docs/testing.md).
    let r = flux_run(&[&RPMI[..], &env[..], &["-n3", &names]].concat());
    r.assert_success("mpi_names");
    let line = "mpi_names: 2 ranks looked up the port; duplicate publish, unknown and unpublished lookups failed";
    assert!(r.stdout.contains(line), "{}", r.dump());
}

/// The only rank of shell 2 leaves without PMI_Finalize while the others wait in a barrier: every shell hears
/// it at once and the job ends naming the rank, not at Flux's exit-timeout (30 s).
#[test]
fn a_shell_whose_tasks_left_while_others_wait_ends_the_job_at_once_naming_the_rank() {
    let script = "echo 'cmd=init pmi_version=1 pmi_subversion=1' >&$PMI_FD; read -r line <&$PMI_FD; \
                  [ \"$PMI_RANK\" = 2 ] && exit 0; echo cmd=barrier_in >&$PMI_FD; read -r line <&$PMI_FD; echo \"$line\"";
    let r = flux_run(&[&RPMI[..], &["-n3", "bash", "-c", script]].concat());
    // The instance's own time, not the wait for the tests before it to end theirs.
    let took = r.elapsed;
    eprintln!("the job ended {took:.2?} after it was started");
    assert_ne!(r.code(), Some(0), "{}", r.dump());
    let exceptions: Vec<&str> = r.stderr.lines().filter(|l| l.contains("job.exception")).collect();
    assert_eq!(exceptions.len(), 1, "one exception expected:\n{}", r.dump());
    assert!(exceptions[0].contains("rank 2 on shell 2 closed its PMI connection"), "{}", r.dump());
    // Far under exit-timeout: the instance's own start and end take about 1.5 s of it.
    assert!(took < std::time::Duration::from_secs(10), "{took:?}\n{}", r.dump());
}

/// With `-o pmi=rpmi` Flux's own PMI server is off: each task has one PMI_FD (the channel rpmi serves) and none
/// of Flux's PMI variables; both servers at once is refused. Without the option, rpmi stays out of the way.
#[test]
fn flux_own_pmi_is_off_and_rpmi_only_on_request() {
    let env = "env | grep -c '^PMI_FD='; env | grep -c '^FLUX_PMI_LIBRARY_PATH=' || true";
    let r = flux_run(&[&RPMI[..], &["-n3", "sh", "-c", env]].concat());
    r.assert_success("env under rpmi");
    assert_eq!(r.stdout.lines().filter(|l| *l == "1").count(), 3, "one PMI_FD per task:\n{}", r.dump());
    assert_eq!(r.stdout.lines().filter(|l| *l == "0").count(), 3, "no Flux PMI variable:\n{}", r.dump());
    let r = flux_run(&["-o", "pmi=rpmi,simple", "-n3", "true"]);
    assert_ne!(r.code(), Some(0), "two PMI servers were accepted:\n{}", r.dump());
    assert!(r.stderr.contains("cannot serve one job"), "{}", r.dump());
    // The plugin is loaded but not asked for: Flux's own PMI serves, and the job runs as ever.
    let p = setup().mpi_pairs.to_str().expect("UTF-8").to_string();
    let r = flux_run(&["-n6", &p]);
    r.assert_success("mpi_pairs under Flux's own PMI");
    assert!(r.stdout.contains("mpi_pairs: 6 ranks"), "{}", r.dump());
}

/// The copy `docker/flux.sh install` put in Flux's shell plugin path serves a job that only asks for it.
#[test]
fn the_plugin_the_site_installed_serves_jobs() {
    let path = Command::new("flux").args(["config", "builtin", "shell_pluginpath"]).output().expect("flux config");
    let dir = String::from_utf8_lossy(&path.stdout).trim().split(':').next().unwrap_or_default().to_string();
    assert!(Path::new(&dir).join("rpmi.so").is_file(), "no rpmi.so in {dir}: run `bash docker/flux.sh install`");
    let _one = instance();
    let done =
        start("flux", &["start", "--test-size=3", "flux", "run", "-N3", "-n6", "-o", "pmi=rpmi", PROBE, "exchange"])
            .wait(GUARD);
    done.assert_success("rpmi-probe exchange through the installed plugin");
    assert!(done.stdout.contains("exchange: size=6 "), "{}", done.dump());
}

/// Each task connects itself to its shell, through a socket in a directory only the job's user may enter;
/// a connection from any other process (here a child of the task) is refused and logged, and the task's own
/// connection is served as ever.
#[test]
fn only_the_tasks_own_connection_is_taken() {
    let intruder = "import glob, os, socket, stat\n\
        d = glob.glob(os.environ['FLUX_JOB_TMPDIR'] + '/rpmi-*')[0]\n\
        st = os.stat(d)\n\
        print('dir mode', oct(stat.S_IMODE(st.st_mode)), 'owner', st.st_uid == os.getuid())\n\
        s = socket.socket(socket.AF_UNIX)\n\
        s.connect(d + '/pmi')\n\
        print('intruder closed', s.recv(1) == b'')\n";
    let script = format!("python3 -c \"{intruder}\" && exec {PROBE} info");
    let r = flux_run(&[&RPMI[..], &["-n3", "sh", "-c", &script]].concat());
    r.assert_success("rpmi-probe info after an intruder");
    assert_eq!(r.stdout.lines().filter(|l| *l == "dir mode 0o700 owner True").count(), 3, "{}", r.dump());
    assert_eq!(r.stdout.lines().filter(|l| *l == "intruder closed True").count(), 3, "{}", r.dump());
    assert_eq!(info_by_rank(&r.stdout).len(), 3, "{}", r.dump());
    assert!(r.stderr.contains("refused a PMI connection from pid"), "{}", r.dump());
}

/// The plugin's end while a name request from another job waits for rpmi (`tests/programs/flux_shell_end.c`:
/// the plugin's own code with this build's librpmi.so and a Flux handle of its own, under AddressSanitizer;
/// the flux-shell executable's API is a mock): the instance is destroyed first, on the whole plugin, and
/// answers the request. Before, the plugin freed the waiting request first, and rpmi's answer, inside
/// `destroy`, then used it.
#[test]
fn a_name_request_waiting_as_the_shell_ends_is_answered_and_nothing_freed_is_used() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("flux-end-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("the test's directory");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let flux = |args: &[&str]| {
        let o = Command::new("pkg-config").args(args).output().expect("pkg-config");
        assert!(o.status.success(), "pkg-config {args:?}: is Flux installed (docker/flux.sh)?");
        String::from_utf8_lossy(&o.stdout).split_whitespace().map(String::from).collect::<Vec<_>>()
    };
    let packages = ["flux-core", "flux-taskmap", "flux-idset", "jansson"];
    let program = dir.join("flux_shell_end");
    let out = Command::new("cc")
        .args(["-std=gnu99", "-g", "-O1", "-Wall", "-Wextra", "-Werror", "-fsanitize=address", "-I"])
        .arg(root.join("src/flux"))
        .arg("-I")
        .arg(root.join("plugin-spec"))
        .args(flux(&[&["--cflags"][..], &packages].concat()))
        .arg(format!("-DRPMI_LIBRARY=\"{}\"", library().display()))
        .arg("-o")
        .arg(&program)
        .arg(root.join("tests/programs/flux_shell_end.c"))
        .args(flux(&[&["--libs"][..], &packages].concat()))
        .arg("-ldl")
        .arg(format!("-Wl,-rpath,{}", flux(&["--variable=libdir", "flux-core"]).concat()))
        .output()
        .expect("cc");
    assert!(out.status.success(), "flux_shell_end.c does not compile:\n{}", String::from_utf8_lossy(&out.stderr));
    // Leaks are not this test's concern (the library stays loaded, as in a shell).
    let run = Command::new(&program).env("ASAN_OPTIONS", "detect_leaks=0").output().expect("flux_shell_end");
    let (stdout, stderr) = (String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
    assert!(run.status.success() && !stderr.contains("AddressSanitizer"), "{}\n{stdout}\n{stderr}", run.status);
    assert!(stdout.contains("requests waiting for rpmi: 1"), "{stdout}\n{stderr}");
    assert!(stdout.contains("the request was answered: published"), "{stdout}\n{stderr}");
}

/// A process of the job's user (here a task on shell 1, through `FLUX_URI`) forges, as shell 1, a message for
/// rpmi (shell 1's goodbye) and an abort, sent to shell 0's service: both are refused and logged, neither ends the
/// job, and shell 1's own messages are taken, so the exchange completes. A join with a nonce of its own is
/// refused too, and a hello to shell 1 with that nonce is refused or goes no further.
#[test]
fn forged_parts_and_aborts_are_refused_and_the_job_runs_on() {
    let forge = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/programs/flux_forge.py");
    let script =
        format!("if [ \"$FLUX_TASK_RANK\" = 2 ]; then flux python {}; fi; exec {PROBE} exchange", forge.display());
    let r = flux_run(&[&RPMI[..], &["-n6", "sh", "-c", &script]].concat());
    r.assert_success("rpmi-probe exchange after forged messages");
    assert!(r.stdout.contains("exchange: size=6 "), "no summary line:\n{}", r.dump());
    assert!(r.stdout.lines().any(|l| l.starts_with("forged message: refused")), "{}", r.dump());
    assert!(r.stdout.lines().any(|l| l.starts_with("forged abort: refused")), "{}", r.dump());
    assert!(r.stderr.contains("refused a message claiming to be from shell 1"), "not logged:\n{}", r.dump());
    assert!(r.stderr.contains("refused an abort claiming to be from shell 1"), "not logged:\n{}", r.dump());
    assert!(r.stdout.lines().any(|l| l.starts_with("forged join: refused")), "{}", r.dump());
    assert!(r.stderr.contains("refused a join claiming to be from shell 1"), "not logged:\n{}", r.dump());
    assert!(!r.stderr.contains("job.exception"), "{}", r.dump());
}

/// Seven shells under a tree of width 2 (shell 0 over 1 and 2, those over 3-6): parts climb two levels and
/// the answers come back down, and by Bruck's allgather; a leaf's abort raises the job's one exception.
#[test]
fn a_deeper_tree_of_seven_shells() {
    let rc = format!("userrc={}", setup().userrc.display());
    let p = setup().mpi_pairs.to_str().expect("UTF-8").to_string();
    let _one = instance();
    for program in [&[PROBE, "exchange", "--puts", "4", "--size", "500"][..], &[p.as_str()][..]] {
        let mut args = vec!["start", "--test-size=7", "flux", "run", "-N7", "-n14", "-o", &rc];
        args.extend(["-o", "pmi=rpmi", "-o", "rpmi.tree_width=2"]);
        args.extend(program);
        let done = start("flux", &args).wait(GUARD);
        done.assert_success("a job over 7 shells");
        let said = done.stdout.contains("exchange: size=14 puts=4 value_len=500 gets=14 ")
            || done.stdout.contains("mpi_pairs: 14 ranks, allreduce 105, all pairs exchanged");
        assert!(said, "no summary line:\n{}", done.dump());
    }
    let args = ["start", "--test-size=7", "flux", "run", "-N7", "-n14", "-o", &rc, "-o", "pmi=rpmi"];
    let done = start("flux", &[&args[..], &["-o", "rpmi.allgather=bruck", &p]].concat()).wait(GUARD);
    done.assert_success("a job over 7 shells by Bruck's allgather");
    assert!(done.stdout.contains("mpi_pairs: 14 ranks, allreduce 105, all pairs exchanged"), "{}", done.dump());
    // An abort on a leaf (rank 13 on shell 6, under shell 2) raises the one exception.
    let args = ["start", "--test-size=7", "flux", "run", "-N7", "-n14", "-o", &rc, "-o", "pmi=rpmi"];
    let done = start("flux", &[&args[..], &["-o", "rpmi.tree_width=2", &p, "abort=13:7"]].concat()).wait(GUARD);
    assert_eq!(done.code(), Some(7), "not the abort's code:\n{}", done.dump());
    let exceptions: Vec<&str> = done.stderr.lines().filter(|l| l.contains("job.exception")).collect();
    assert_eq!(exceptions.len(), 1, "one exception expected:\n{}", done.dump());
    assert!(exceptions[0].contains("rank 13 called PMI_Abort(7)"), "{}", done.dump());
}

// ---------------------------------------------------------------------------------------------------------
// Flux's own PMI clients under rpmi: Flux started by rpmi (as `srun --mpi=rpmi flux start` does on a
// cluster), and runtimes that load Flux's PMI libraries.

/// Flux's PMI library `name` (`libpmi.so.0`, `libpmi2.so.0`), beside the one Flux names as its own.
fn flux_library(name: &str) -> PathBuf {
    let out = Command::new("flux").args(["config", "builtin", "pmi_library_path"]).output().expect("flux config");
    let own = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    let library = own.parent().expect("Flux's library directory").join(name);
    assert!(library.exists(), "{} is missing", library.display());
    library
}

/// A Flux instance bootstraps through rpmi: each broker is a task of an rpmi-run job over two virtual nodes,
/// and its PMI-1 client (which accepts exactly PMI 1.1) wires them up.
#[test]
fn flux_start_under_rpmi_run() {
    let _one = instance();
    let done = start(RUN, &["-n", "2", "--nodes", "2", "flux", "start", "flux", "getattr", "size"]).wait(GUARD);
    done.assert_success("rpmi-run -n 2 --nodes 2 flux start flux getattr size");
    assert_eq!(done.stdout.trim(), "2", "{}", done.dump());
}

/// Intel MPI through Flux's `libpmi.so.0` (PMI-1) and `libpmi2.so.0` (the PMI-2 API over PMI-1 lines, its
/// node attributes as `local::` keys) under rpmi-run. Without the `local::` keys served, each rank but one
/// waits in `PMI2_Info_GetNodeAttr` polling once a second for about 15 s; with them the job takes about a
/// second here, so the bound tells the two apart.
#[test]
fn intel_mpi_through_fluxs_pmi_libraries() {
    let intel = impi::intel_mpi();
    for (name, mode) in [("libpmi.so.0", "pmi1"), ("libpmi2.so.0", "pmi2")] {
        let library = flux_library(name);
        let mut args = vec!["-n".to_string(), "4".into(), "--trace".into()];
        args.extend(intel.imb(4));
        let env = intel.env(Some((&library, mode)));
        let env: Vec<(&str, &std::ffi::OsStr)> = env.iter().map(|(k, v)| (*k, v.as_os_str())).collect();
        let done = start_with_env(RUN, &args, &env).wait(GUARD);
        done.assert_success(&format!("IMB-MPI1 through Flux's {name}"));
        assert!(impi::imb_ran(&done.stdout, 4), "{name}:\n{}", done.dump());
        assert!(done.stderr.contains("S: cmd=response_to_init rc=0 pmi_version=1 pmi_subversion=1"), "{name}");
        if mode == "pmi2" {
            assert!(done.stderr.contains(" key=local::"), "{name}: no node attribute as a local:: key");
            let bound = std::time::Duration::from_secs(10);
            assert!(
                done.elapsed < bound,
                "{name}: took {:.2?}: node attributes polled:\n{}",
                done.elapsed,
                done.dump()
            );
        }
        eprintln!("IMB-MPI1 through Flux's {name}: {:.2?}", done.elapsed);
    }
}

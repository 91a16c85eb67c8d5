//! rpmi-run end to end: real processes, real MPICH (Debian's `mpich`/`libmpich-dev`), real signals.
//!
//! Each test starts `rpmi-run` (which loads `librpmi.so` from next to itself) on an MPI program built with
//! `mpicc` from `tests/programs/`, on a PMI-1 client written on the wire in C (`pmi_barrier_break.c`), or
//! on `rpmi-probe`, and checks exit codes, output and that no task is left running. `rpmi-probe` is also run
//! under `mpiexec.hydra` to compare rpmi's answers with MPICH's own process manager.
//!
//! Every run has a hang guard: a run that has not ended in time is killed (its whole process group and
//! every descendant) and the test fails. There are no timed assertions: the machine is small and shared, so
//! the tests that are about ending promptly only print the elapsed time (visible with `--nocapture`).

use rpmi::server::TaskMap;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::OsStr;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::thread;
use std::time::{Duration, Instant};

mod support;

use support::*;

// ---------------------------------------------------------------------------------------------------------
// The programs, built once per test binary.

/// The C test programs, and private copies of programs for the tests that check that no task is left: each
/// such test runs its own copy, so a scan of `/proc` for that executable cannot see another test's tasks.
struct Programs {
    mpi_pairs: PathBuf,
    barrier_break: PathBuf,
    dir: PathBuf,
}

/// The private copies, by name in the temp dir: of mpi_pairs, of rpmi-probe, of sleep(1), and of rpmi-run
/// (with no librpmi.so beside it).
const PRIVATE_MPI: &[&str] = &["mpi_abort_pos", "mpi_abort_neg", "mpi_killed", "mpi_abort_tree", "mpi_killed_tree"];
const PRIVATE_PROBE: &str = "probe_killed";
const PRIVATE_SLEEP: &str = "sleep_sigterm";
const PRIVATE_RUN: &str = "rpmi-run";

impl Programs {
    /// The private copy `name` (one of the PRIVATE_* names).
    fn private(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

fn programs() -> &'static Programs {
    static PROGRAMS: OnceLock<Programs> = OnceLock::new();
    PROGRAMS.get_or_init(build_programs)
}

fn build_programs() -> Programs {
    let base = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    remove_stale_dirs(&base);
    let dir = base.join(format!("rpmi_run-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
    let dir = dir.canonicalize().expect("canonical temp dir");
    let mpi_pairs = compile("mpicc", "mpi_pairs", &dir);
    let barrier_break = compile("cc", "pmi_barrier_break", &dir);
    // The copies are made here, once, and executed only later: a child that another test thread forks while a
    // copy is open for writing closes it at its exec, long before the copy is run (no ETXTBSY).
    for name in PRIVATE_MPI {
        std::fs::copy(&mpi_pairs, dir.join(name)).expect("copy mpi_pairs");
    }
    std::fs::copy(PROBE, dir.join(PRIVATE_PROBE)).expect("copy rpmi-probe");
    let sleep = ["/usr/bin/sleep", "/bin/sleep"].into_iter().find(|p| Path::new(p).exists()).expect("sleep(1)");
    std::fs::copy(sleep, dir.join(PRIVATE_SLEEP)).expect("copy sleep");
    std::fs::copy(RUN, dir.join(PRIVATE_RUN)).expect("copy rpmi-run");
    Programs { mpi_pairs, barrier_break, dir }
}

/// Removes the temp dirs of earlier test runs whose process is gone.
fn remove_stale_dirs(base: &Path) {
    let Ok(entries) = std::fs::read_dir(base) else { return };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(pid) = name.strip_prefix("rpmi_run-").and_then(|p| p.parse::<u32>().ok()) {
            if !Path::new(&format!("/proc/{pid}")).exists() {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
}

fn have_hydra() {
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join("mpiexec.hydra").exists()))
        .unwrap_or(false);
    assert!(found, "mpiexec.hydra is not on PATH: {INSTALL_HINT}");
}

// ---------------------------------------------------------------------------------------------------------
// Output parsing.

/// `rpmi-probe info` output: rank -> its `key=value` fields.
fn parse_info(stdout: &str) -> BTreeMap<u32, HashMap<String, String>> {
    let mut ranks = BTreeMap::new();
    for line in stdout.lines().filter(|l| l.starts_with("rank=")) {
        let fields: HashMap<String, String> = line
            .split_whitespace()
            .map(|t| {
                let (k, v) = t.split_once('=').unwrap_or_else(|| panic!("`{t}` is not key=value in: {line}"));
                (k.to_string(), v.to_string())
            })
            .collect();
        let rank = fields["rank"].parse().unwrap_or_else(|_| panic!("bad rank in: {line}"));
        assert!(ranks.insert(rank, fields).is_none(), "rank {rank} printed twice:\n{stdout}");
    }
    ranks
}

fn field<'a>(info: &'a HashMap<String, String>, key: &str) -> &'a str {
    info.get(key).unwrap_or_else(|| panic!("no {key}= in {info:?}"))
}

fn clique_text(ranks: &[u32]) -> String {
    ranks.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

/// The line rank 0 of mpi_pairs prints when every check passed.
fn mpi_ok_line(n: u64) -> String {
    format!("mpi_pairs: {n} ranks, allreduce {}, all pairs exchanged", n * (n + 1) / 2)
}

/// rpmi-run's own messages, without the per-line PMI trace.
fn own_messages(stderr: &str) -> Vec<&str> {
    stderr.lines().filter(|l| l.starts_with("rpmi-run: ") && !l.contains(" C: ") && !l.contains(" S: ")).collect()
}

// ---------------------------------------------------------------------------------------------------------
// MPI programs under rpmi-run.

/// Runs mpi_pairs with `rpmi-run <opts> -n N`, expects success and rank 0's line.
fn mpi_job(n: u64, opts: &[&str]) {
    let p = programs();
    let n_text = n.to_string();
    let mut args: Vec<&OsStr> = vec![OsStr::new("-n"), OsStr::new(&n_text)];
    args.extend(opts.iter().map(OsStr::new));
    args.push(p.mpi_pairs.as_os_str());
    let done = rpmi_run(&args);
    let how =
        std::iter::once(format!("-n {n}")).chain(opts.iter().map(|o| o.to_string())).collect::<Vec<_>>().join(" ");
    eprintln!("rpmi-run {how} mpi_pairs: {:.2?}", done.elapsed);
    done.assert_success(&format!("rpmi-run {how} mpi_pairs"));
    assert!(done.stdout.contains(&mpi_ok_line(n)), "no `{}` line:\n{}", mpi_ok_line(n), done.dump());
}

/// Without a librpmi.so beside it (where the `rpmi` package installs it), rpmi-run loads the one the dynamic
/// linker finds: here the build's, through LD_LIBRARY_PATH.
#[test]
fn without_a_plugin_beside_it_rpmi_run_loads_the_systems() {
    let build_dir = Path::new(RUN).parent().expect("rpmi-run's directory");
    let run = programs().private(PRIVATE_RUN);
    let env = [("LD_LIBRARY_PATH", build_dir.as_os_str())];
    let done = start_with_env(&run, &["--trace", "-n", "2", PROBE, "info"], &env).wait(GUARD);
    done.assert_success("rpmi-run with the plugin found by the dynamic linker");
    assert!(done.stderr.contains(" from librpmi.so\n"), "the plugin was not loaded by its bare name:\n{}", done.dump());
    assert_eq!(parse_info(&done.stdout).len(), 2, "not every rank answered:\n{}", done.dump());
}

#[test]
fn mpi_one_rank() {
    mpi_job(1, &[]);
}

#[test]
fn mpi_two_ranks() {
    mpi_job(2, &[]);
}

#[test]
fn mpi_eight_ranks() {
    mpi_job(8, &[]);
}

#[test]
fn mpi_sixty_four_ranks() {
    mpi_job(64, &[]);
}

#[test]
fn mpi_four_nodes_block() {
    mpi_job(8, &["--nodes", "4", "--map", "block"]);
}

#[test]
fn mpi_four_nodes_cyclic() {
    mpi_job(8, &["--nodes", "4", "--map", "cyclic"]);
}

#[test]
fn mpi_event_loop() {
    mpi_job(8, &["--event-loop", "--nodes", "2"]);
}

/// 64 virtual nodes exchanging over a binary tree (depth 6): one rank each.
#[test]
fn mpi_sixty_four_nodes_binary_tree() {
    mpi_job(64, &["--nodes", "64", "--tree-width", "2"]);
}

/// 64 virtual nodes exchanging by Bruck's allgather (6 rounds), and 7 (3 rounds, the last a short one).
#[test]
fn mpi_nodes_by_bruck_allgather() {
    mpi_job(64, &["--nodes", "64", "--allgather", "bruck"]);
    mpi_job(14, &["--nodes", "7", "--allgather", "bruck", "--map", "cyclic"]);
}

/// Eight virtual nodes in a chain: each exchange passes through every node, up and down.
#[test]
fn mpi_eight_nodes_chain() {
    mpi_job(8, &["--nodes", "8", "--tree-width", "1"]);
}

/// Enough tasks on one node for the driver to answer them in turns of groups: a real MPI job in
/// event-loop mode, where `progress` serves one group per call and leaves its fd readable.
#[test]
fn mpi_event_loop_several_groups() {
    mpi_job(rpmi::driver::GROUPED_ABOVE as u64 + 4, &["--event-loop"]);
}

// ---------------------------------------------------------------------------------------------------------
// PMI_process_mapping and cliques.

/// `rpmi-run -n N --nodes M --map MAP rpmi-probe info`, checked against TaskMap for the same split.
fn check_mapping(ppn: &[u32], cyclic: bool) {
    let n: u32 = ppn.iter().sum();
    let map = if cyclic { TaskMap::cyclic(ppn) } else { TaskMap::block(ppn) };
    let mapping = map.process_mapping();
    let (n_text, nodes_text) = (n.to_string(), ppn.len().to_string());
    let map_name = if cyclic { "cyclic" } else { "block" };
    let done = rpmi_run(&["-n", &n_text, "--nodes", &nodes_text, "--map", map_name, PROBE, "info"]);
    done.assert_success("rpmi-probe info");
    let info = parse_info(&done.stdout);
    assert_eq!(info.keys().copied().collect::<Vec<_>>(), (0..n).collect::<Vec<_>>(), "{}", done.dump());
    for (&rank, fields) in &info {
        let node = map.node_of(rank).expect("rank in map");
        assert_eq!(field(fields, "size"), n_text, "rank {rank}");
        assert_eq!(field(fields, "mapping"), mapping, "rank {rank} ({map_name} {ppn:?})");
        assert_eq!(field(fields, "clique"), clique_text(&map.clique(node)), "rank {rank} ({map_name} {ppn:?})");
    }
}

#[test]
fn mapping_block_even() {
    check_mapping(&[2, 2, 2, 2], false);
}

#[test]
fn mapping_cyclic_even() {
    check_mapping(&[2, 2, 2, 2], true);
}

#[test]
fn mapping_block_uneven() {
    check_mapping(&[3, 3, 2, 2], false);
}

#[test]
fn mapping_cyclic_uneven() {
    check_mapping(&[3, 3, 2, 2], true);
}

// ---------------------------------------------------------------------------------------------------------
// Ending the job: MPI_Abort, a killed task, signals.

/// Rank `rank` of `n` calls MPI_Abort(MPI_COMM_WORLD, code), with rpmi-run's `opts`: rpmi-run exits with the
/// code's low byte, says so, and no task is left. On one node, or with one rank per node: a rank whose
/// MPI_Init fails when the aborting rank dies may abort too, and which abort reaches rpmi-run first is a
/// race (`failing_rank` covers a job ending across nodes that share ranks).
fn abort_job(private: &str, opts: &[&str], n: u32, rank: u32, code: i32, status: i32) {
    let exe = programs().private(private);
    let arg = format!("abort={rank}:{code}");
    let n_text = n.to_string();
    let mut args: Vec<&OsStr> = vec![OsStr::new("-n"), OsStr::new(&n_text)];
    args.extend(opts.iter().map(OsStr::new));
    args.extend([exe.as_os_str(), OsStr::new(&arg)]);
    let done = start(RUN, &args).wait(END_GUARD);
    eprintln!(
        "MPI_Abort({code}) on rank {rank} of {n} {opts:?}: rpmi-run ended after {:.2?} with {}",
        done.elapsed, done.status
    );
    assert_none_left(&exe, &done, "after MPI_Abort");
    assert_eq!(done.code(), Some(status), "MPI_Abort({code}):\n{}", done.dump());
    let said = own_messages(&done.stderr);
    assert!(
        said.iter().any(|l| l.contains("PMI_Abort")
            && l.contains(&format!("exit code {code}"))
            && l.contains(&format!("rank {rank} "))),
        "no message naming rank {rank}, PMI_Abort and exit code {code}:\n{}",
        done.dump()
    );
    assert!(!done.stdout.contains("mpi_pairs:"), "the job finished despite the abort:\n{}", done.dump());
}

#[test]
fn mpi_abort_exit_code() {
    abort_job(PRIVATE_MPI[0], &[], 4, 2, 7, 7);
}

#[test]
fn mpi_abort_negative_exit_code() {
    abort_job(PRIVATE_MPI[1], &[], 4, 2, -3, 253);
}

/// Width 2 over 7 nodes, one rank each: node 6 is a leaf at depth 3, under nodes 2 and 0.
const TREE_OF_SEVEN: &[&str] = &["--nodes", "7", "--tree-width", "2"];
/// The same 7 nodes exchanging by Bruck's allgather: node 6 sends its rounds to nodes 5, 4 and 2.
const BRUCK_OF_SEVEN: &[&str] = &["--nodes", "7", "--tree-width", "2", "--allgather", "bruck"];

/// An abort on a leaf of a depth-3 tree: its code is the job's status.
#[test]
fn mpi_abort_on_a_leaf_of_a_tree() {
    abort_job(PRIVATE_MPI[3], TREE_OF_SEVEN, 7, 6, 7, 7);
}

/// Checks what rpmi-run did after the test killed `rank` with SIGKILL.
fn check_killed_task(done: &Done, exe: &Path, rank: u32, since_kill: Duration) {
    eprintln!(
        "SIGKILL to rank {rank} ({}): rpmi-run ended {since_kill:.2?} after the kill, with {}",
        exe.display(),
        done.status
    );
    assert_none_left(exe, done, "after a task was killed");
    // The task failed on its own, even when the plugin saw it leave before rpmi-run reaped it.
    assert_eq!(done.code(), Some(128 + libc::SIGKILL), "the killed task's own status:\n{}", done.dump());
    let said = own_messages(&done.stderr);
    assert!(
        said.iter().any(|l| l.contains(&format!("rank {rank} "))),
        "no message naming rank {rank}:\n{}",
        done.dump()
    );
}

/// `rpmi-run -n N OPTS... --trace EXE hang_before_init=VICTIM`: rank VICTIM sleeps before MPI_Init, the others
/// reach the PMI barrier inside MPI_Init and wait there; then the test kills the victim. rpmi-run learns of
/// the death several ways, racing: from waitpid, from the plugin (the task's PMI connection closed during a
/// barrier) when the victim shares its node, and from the collective (its node left the exchange). Three
/// rounds, so that different orders are likely to be seen.
fn kill_in_init_barrier(private: &str, n: u32, opts: &[&str], victim: u32) {
    let exe = programs().private(private);
    let n_text = n.to_string();
    let hang = format!("hang_before_init={victim}");
    let mut args: Vec<&OsStr> = vec![OsStr::new("-n"), OsStr::new(&n_text), OsStr::new("--trace")];
    args.extend(opts.iter().map(OsStr::new));
    args.extend([exe.as_os_str(), OsStr::new(&hang)]);
    for round in 1..=3 {
        eprintln!("round {round}:");
        let mut job = start(RUN, &args);
        job.wait_for_stderr(GUARD, "barrier_in from every other rank", |err| {
            (0..n).filter(|&r| r != victim).all(|r| err.contains(&format!("rank {r} C: cmd=barrier_in")))
        });
        let rpmi = job.pid();
        // With several nodes, the tasks are the children of the nodes' shells.
        let task = job.wait_until(GUARD, &format!("rank {victim}'s process"), |_| {
            std::iter::once(rpmi).chain(descendants(rpmi)).find_map(|p| task_pid(p, victim))
        });
        assert!(
            !job.stderr_now().contains(&format!("rank {victim} C:")),
            "rank {victim} spoke PMI although it sleeps before MPI_Init:\n{}",
            job.stderr_now()
        );
        let killed = Instant::now();
        signal(task, libc::SIGKILL);
        let done = job.wait_ending(END_GUARD);
        check_killed_task(&done, &exe, victim, done.ended - killed);
    }
}

#[test]
fn mpi_task_killed_while_others_wait_in_init_barrier() {
    kill_in_init_barrier(PRIVATE_MPI[2], 4, &[], 3);
}

/// Over a tree, a task killed on an interior node (node 2: under node 0, over node 6) and on a leaf (node
/// 6), while the others wait in the barrier inside MPI_Init; and on node 6 with Bruck's allgather.
#[test]
fn mpi_task_killed_in_a_tree_while_others_wait() {
    for victim in [2, 6] {
        kill_in_init_barrier(PRIVATE_MPI[4], 7, TREE_OF_SEVEN, victim);
    }
    kill_in_init_barrier(PRIVATE_MPI[4], 7, BRUCK_OF_SEVEN, 6);
}

#[test]
fn probe_task_killed_mid_barrier() {
    let exe = programs().private(PRIVATE_PROBE);
    let mut job = start(
        RUN,
        &[
            OsStr::new("-n"),
            OsStr::new("4"),
            exe.as_os_str(),
            "barrier".as_ref(),
            "--count".as_ref(),
            "1000000".as_ref(),
        ],
    );
    let rpmi = job.pid();
    let tasks: Vec<i32> =
        (0..4).map(|r| job.wait_until(GUARD, &format!("rank {r}'s process"), |_| task_pid(rpmi, r))).collect();
    // Stop rank 3 wherever it is; the others then block in the next barrier (a sleeping single-threaded
    // probe is waiting for the server's reply).
    signal(tasks[3], libc::SIGSTOP);
    job.wait_until(GUARD, "ranks 0-2 blocked in a barrier", |_| {
        let sleeping = || tasks[..3].iter().all(|&p| stat(p).is_some_and(|s| s.state == 'S'));
        // Seen sleeping on two looks in a row, not just between two barriers.
        (sleeping() && {
            thread::sleep(Duration::from_millis(100));
            sleeping()
        })
        .then_some(())
    });
    let killed = Instant::now();
    signal(tasks[3], libc::SIGKILL);
    let done = job.wait_ending(END_GUARD);
    check_killed_task(&done, &exe, 3, done.ended - killed);
    assert!(!done.stdout.contains("barrier: size=4"), "the barriers finished despite the kill:\n{}", done.dump());
}

/// How the tests run a job: on one virtual node in both of the ABI's modes, and across nodes (where each
/// node's shell runs an event loop and the coordinator relays between them), over the tree and by Bruck's
/// allgather. With 4 ranks dealt in blocks, rank 1 shares node 0 with rank 0 on 2 nodes, and is alone on
/// node 1 on 4.
const MODES: &[&[&str]] =
    &[&[], &["--event-loop"], &["--nodes", "2"], &["--nodes", "4"], &["--nodes", "4", "--allgather", "bruck"]];

/// `rpmi-run -n 4 MODE... pmi_barrier_break DIR 1 ACTION`: ranks 0, 2 and 3 wait in a barrier, then rank 1
/// does ACTION. Every rank is ended: none is left in the job's process group.
fn break_barrier(mode: &[&str], action: &str) -> Done {
    break_barrier_at(4, mode, 1, action)
}

/// `rpmi-run -n N MODE... pmi_barrier_break DIR RANK ACTION`: every other rank waits in a barrier, then
/// RANK does ACTION.
fn break_barrier_at(n: u32, mode: &[&str], rank: u32, action: &str) -> Done {
    static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let run = RUNS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let dir = programs().dir.join(format!("barrier-{run}"));
    std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
    let (n_text, rank_text) = (n.to_string(), rank.to_string());
    let mut args: Vec<&OsStr> = vec!["-n".as_ref(), n_text.as_ref()];
    args.extend(mode.iter().map(OsStr::new));
    args.extend([programs().barrier_break.as_os_str(), dir.as_os_str(), rank_text.as_ref(), action.as_ref()]);
    let done = start(RUN, &args).wait(END_GUARD);
    eprintln!("-n {n} {mode:?}, rank {rank} {action}: rpmi-run ended after {:.2?} with {}", done.elapsed, done.status);
    assert!(done.stragglers.is_empty(), "tasks outlived rpmi-run ({mode:?} {action}):\n{}", done.dump());
    let _ = std::fs::remove_dir_all(&dir);
    done
}

/// A job error, and no task failed on its own: rank 1 breaks the protocol, or leaves the barrier the others
/// wait in (exiting 0, without PMI_Finalize). The status is 125 (JOB_ERROR_EXIT_CODE), not the 137 of the
/// tasks rpmi-run killed; the one line said names rank 1, and the killed tasks are not reported.
#[test]
fn a_job_error_gives_status_125() {
    for mode in MODES {
        for (action, about) in [("garbage", "PMI protocol error"), ("exit:0", "rank 1 ")] {
            let done = break_barrier(mode, action);
            assert_eq!(done.code(), Some(125), "{mode:?} {action}:\n{}", done.dump());
            let said = own_messages(&done.stderr);
            assert!(
                said.len() == 1 && said[0].contains("rank 1") && said[0].contains(about),
                "{mode:?} {action}: not one line, about rank 1 ({about}):\n{}",
                done.dump()
            );
        }
    }
}

/// Rank 1 exits with code 3, without PMI_Finalize, while the others wait in a barrier: a task that failed
/// on its own gives its own status, whichever rpmi-run hears of first (its exit or the plugin's report).
#[test]
fn a_task_that_failed_first_gives_its_own_status() {
    for mode in MODES {
        let done = break_barrier(mode, "exit:3");
        assert_eq!(done.code(), Some(3), "{mode:?}:\n{}", done.dump());
        let said = own_messages(&done.stderr);
        assert!(
            said.len() == 1 && said[0].contains("rank 1 "),
            "{mode:?}: not one line about rank 1:\n{}",
            done.dump()
        );
    }
}

/// Rank 1 calls PMI_Abort while the others wait in a barrier, on its node and on others: the abort line
/// is the one line said; the tasks rpmi-run then kills, which leave the barrier, are not reported.
#[test]
fn an_abort_is_the_one_line_said() {
    for mode in MODES {
        let done = break_barrier(mode, "abort:7");
        assert_eq!(done.code(), Some(7), "{mode:?}:\n{}", done.dump());
        assert!(
            !done.stderr.contains("closed its PMI connection"),
            "{mode:?}: the killed tasks reported:\n{}",
            done.dump()
        );
        assert_eq!(
            own_messages(&done.stderr),
            ["rpmi-run: rank 1 called PMI_Abort with exit code 7"],
            "{mode:?}:\n{}",
            done.dump()
        );
    }
}

/// Over a tree, rank 2 (on interior node 2) or rank 6 (on leaf node 6) leaves the barrier the others wait in,
/// alone on its node. Exiting 0 without PMI_Finalize, the job error is its node's leaving (status 125); the
/// one line said names the node and the rank. Exiting 3, it failed on its own: its status, and its line.
#[test]
fn leaving_a_barrier_in_a_tree_ends_the_job() {
    for (rank, shape) in [(2, TREE_OF_SEVEN), (6, TREE_OF_SEVEN), (2, BRUCK_OF_SEVEN), (6, BRUCK_OF_SEVEN)] {
        let done = break_barrier_at(7, shape, rank, "exit:0");
        assert_eq!(done.code(), Some(125), "rank {rank} exit:0:\n{}", done.dump());
        let want = format!("virtual node {rank} ended: rank {rank} exited while other ranks wait for it in a barrier");
        assert_eq!(own_messages(&done.stderr), [format!("rpmi-run: {want}")], "rank {rank} exit:0:\n{}", done.dump());
        let done = break_barrier_at(7, shape, rank, "exit:3");
        assert_eq!(done.code(), Some(3), "rank {rank} exit:3:\n{}", done.dump());
        let want = format!("rpmi-run: rank {rank} exited with code 3; ending the job");
        assert_eq!(own_messages(&done.stderr), [want], "rank {rank} exit:3:\n{}", done.dump());
    }
}

#[test]
fn sigterm_is_forwarded_to_the_tasks() {
    let exe = programs().private(PRIVATE_SLEEP);
    let mut job = start(RUN, &[OsStr::new("-n"), OsStr::new("2"), exe.as_os_str(), "1000".as_ref()]);
    let rpmi = job.pid();
    for r in 0..2 {
        job.wait_until(GUARD, &format!("rank {r}'s process"), |_| task_pid(rpmi, r));
    }
    let sent = Instant::now();
    signal(rpmi, libc::SIGTERM);
    let done = job.wait_ending(END_GUARD);
    eprintln!("SIGTERM to rpmi-run: it ended {:.2?} later with {}", done.ended - sent, done.status);
    assert!(
        done.status.signal().is_none(),
        "rpmi-run itself died of signal {:?} instead of passing it to the tasks:\n{}",
        done.status.signal(),
        done.dump()
    );
    assert_none_left(&exe, &done, "after SIGTERM to rpmi-run");
    assert_eq!(done.code(), Some(128 + libc::SIGTERM), "tasks ended by SIGTERM:\n{}", done.dump());
}

// ---------------------------------------------------------------------------------------------------------
// rpmi-probe under rpmi-run and under MPICH's Hydra.

#[test]
fn probe_info_matches_hydra() {
    have_hydra();
    let ours = rpmi_run(&["-n", "4", PROBE, "info"]);
    ours.assert_success("rpmi-run -n 4 rpmi-probe info");
    let hydra = run("mpiexec.hydra", &["-n", "4", PROBE, "info"]);
    hydra.assert_success("mpiexec.hydra -n 4 rpmi-probe info");
    let (a, b) = (parse_info(&ours.stdout), parse_info(&hydra.stdout));
    let ranks = |m: &BTreeMap<u32, _>| m.keys().copied().collect::<BTreeSet<u32>>();
    assert_eq!(ranks(&a), (0..4).collect(), "rpmi-run's ranks:\n{}", ours.dump());
    assert_eq!(ranks(&a), ranks(&b), "rank sets differ:\n{}\n{}", ours.dump(), hydra.dump());
    for r in 0..4 {
        // universe (Hydra: -1), kvsname and maxes are the server's own; the mapping strings differ in form.
        for key in ["size", "appnum", "clique"] {
            assert_eq!(field(&a[&r], key), field(&b[&r], key), "rank {r}: {key} differs from Hydra's");
        }
    }
    assert_eq!(field(&a[&0], "universe"), "4", "rpmi answers the job size as the universe size");
}

/// Every task of every group is served, in both of the ABI's modes, and the values every task gets are
/// checked (rpmi-probe verifies them unless told not to).
#[test]
fn probe_exchange_over_several_groups() {
    let n = (rpmi::driver::GROUPED_ABOVE + 8).to_string();
    for mode in [&[][..], &["--event-loop"]] {
        let done = rpmi_run(&[mode, &["-n", &n, PROBE, "exchange", "--puts", "3"]].concat());
        done.assert_success(&format!("exchange over several groups {mode:?}"));
        assert!(done.stdout.contains(&format!("exchange: size={n} ")), "no exchange line:\n{}", done.dump());
    }
}

#[test]
fn probe_exchange_under_rpmi_run_and_hydra() {
    have_hydra();
    for (program, args) in [
        (RUN, &["-n", "4", PROBE, "exchange"][..]),
        (RUN, &["-n", "4", "--nodes", "2", PROBE, "exchange"]),
        ("mpiexec.hydra", &["-n", "4", PROBE, "exchange"]),
    ] {
        let done = run(program, args);
        done.assert_success(&format!("{program} {args:?}"));
        assert!(done.stdout.contains("exchange: size=4 "), "{program}: no exchange line:\n{}", done.dump());
    }
}

// ---------------------------------------------------------------------------------------------------------
// rpmi-run's options and errors.

#[test]
fn trace_shows_both_directions_with_ranks() {
    let done = rpmi_run(&["-n", "2", "--trace", PROBE, "barrier", "--count", "1"]);
    done.assert_success("--trace");
    for r in 0..2 {
        for want in [format!("rank {r} C: cmd=init"), format!("rank {r} S: cmd=response_to_init")] {
            assert!(done.stderr.lines().any(|l| l.contains(&want)), "no `{want}` line:\n{}", done.dump());
        }
    }
}

#[test]
fn label_prefixes_lines_with_the_rank() {
    let done = rpmi_run(&["-n", "2", "-l", "sh", "-c", "echo out-$PMI_RANK; echo err-$PMI_RANK >&2"]);
    done.assert_success("-l");
    for r in 0..2 {
        assert!(done.stdout.lines().any(|l| l == format!("[{r}] out-{r}")), "stdout of rank {r}:\n{}", done.dump());
        assert!(done.stderr.lines().any(|l| l == format!("[{r}] err-{r}")), "stderr of rank {r}:\n{}", done.dump());
    }
    let mpi = programs().mpi_pairs.to_str().expect("UTF-8 temp path").to_string();
    let done = rpmi_run(&["-n", "2", "-l", &mpi]);
    done.assert_success("-l mpi_pairs");
    assert!(done.stdout.lines().any(|l| l == format!("[0] {}", mpi_ok_line(2))), "{}", done.dump());
}

/// rpmi-run's peak resident memory so far, in KiB (VmHWM: of its own address space, since its exec).
fn peak_kib(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc/PID/status of rpmi-run");
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).expect("a VmHWM line");
    line.split_whitespace().nth(1).and_then(|kib| kib.parse().ok()).expect("VmHWM in kB")
}

/// Under `-l`, a task that writes far more than 64 KiB without a newline: rpmi-run passes it on in labelled
/// pieces instead of holding it all, so its peak memory stays that of the same output in short lines, and
/// every byte arrives, each piece labelled with its rank.
#[test]
fn label_passes_on_a_line_without_newline_in_pieces() {
    const BYTES: usize = 16 << 20;
    // Each rank writes its output, says so, and stays until told to go: rpmi-run's peak is read while it
    // runs, once it has read all but what the pipe holds.
    let measure = |name: &str, output: &str| {
        let dir = programs().dir.join(format!("label-{name}"));
        std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
        let d = dir.to_str().expect("UTF-8 temp path");
        let script = format!("{output}; touch {d}/written.$PMI_RANK; while [ ! -e {d}/go ]; do sleep 0.01; done");
        let mut job = start(RUN, &["-n", "2", "-l", "sh", "-c", &script]);
        job.wait_until(GUARD, "both ranks' output written", |_| {
            (0..2).all(|r| dir.join(format!("written.{r}")).exists()).then_some(())
        });
        let peak = peak_kib(job.pid());
        std::fs::write(dir.join("go"), "").expect("the go file");
        let done = job.wait(GUARD);
        done.assert_success(&format!("-l sh -c '{script}'"));
        let _ = std::fs::remove_dir_all(&dir);
        (peak, done.stdout)
    };
    let flood = format!("head -c {BYTES} /dev/zero | tr '\\0' x");
    let (lines_peak, _) = measure("lines", &format!("{flood} | fold -w 100"));
    let (flood_peak, stdout) = measure("flood", &flood);
    eprintln!(
        "-l, 2 ranks x {BYTES} bytes: rpmi-run's peak {flood_peak} KiB without newlines, {lines_peak} KiB in lines"
    );
    assert!(
        flood_peak < lines_peak + 8 * 1024,
        "rpmi-run held the line: peak {flood_peak} KiB, against {lines_peak} KiB for the same bytes in lines"
    );
    let mut got = [0usize; 2];
    for line in stdout.lines() {
        let (rank, rest) = match line.split_at_checked(4) {
            Some(("[0] ", rest)) => (0, rest),
            Some(("[1] ", rest)) => (1, rest),
            _ => panic!("a piece without its label: {:?}", line.chars().take(40).collect::<String>()),
        };
        assert!(rest.bytes().all(|b| b == b'x'), "rank {rank}: a piece holds more than the task's bytes");
        got[rank] += rest.len();
    }
    assert_eq!(got, [BYTES, BYTES], "bytes of each rank that arrived");
}

#[test]
fn option_vallen_max_reaches_the_clients() {
    let done = rpmi_run(&["-n", "2", "-o", "vallen_max=512", PROBE, "info"]);
    done.assert_success("-o vallen_max=512");
    let info = parse_info(&done.stdout);
    assert_eq!(info.len(), 2, "{}", done.dump());
    for (r, fields) in &info {
        assert_eq!(field(fields, "maxes"), "64/64/512", "rank {r}");
    }
}

/// Every virtual node refuses a bad option alike: rpmi-run says so once, on one node or across three.
#[test]
fn unknown_option_is_refused() {
    for nodes in ["1", "3"] {
        let done = rpmi_run(&["-n", "3", "--nodes", nodes, "-o", "bogus=1", PROBE, "info"]);
        assert!(done.code().is_some_and(|c| c != 0), "-o bogus=1 accepted:\n{}", done.dump());
        let said = own_messages(&done.stderr);
        let naming = said.iter().filter(|l| l.contains("'bogus'")).count();
        assert_eq!(naming, 1, "not one error naming 'bogus' on {nodes} node(s):\n{}", done.dump());
        assert!(!done.stdout.contains("rank="), "tasks ran despite the bad option:\n{}", done.dump());
    }
}

/// A program that cannot be started: status 127 and one message naming it, on one node or across three.
#[test]
fn missing_program_exits_127() {
    let missing = "/nonexistent/rpmi-test-no-such-program";
    for nodes in ["1", "3"] {
        let done = rpmi_run(&["-n", "3", "--nodes", nodes, missing]);
        assert_eq!(done.code(), Some(127), "{}", done.dump());
        let said = own_messages(&done.stderr);
        let naming = said.iter().filter(|l| l.contains(missing) && l.contains("No such file")).count();
        assert_eq!(naming, 1, "not one clear message naming the program on {nodes} node(s):\n{}", done.dump());
    }
}

/// Rank 1 of 3 exits with code 3 while the others would sleep: rpmi-run ends them, exits with 3 and names
/// rank 1, on one virtual node or across three.
fn failing_rank(nodes: &str) {
    let script = "if [ \"$PMI_RANK\" = 1 ]; then exit 3; fi; exec sleep 1000";
    let done = start(RUN, &["-n", "3", "--nodes", nodes, "sh", "-c", script]).wait(END_GUARD);
    assert_eq!(done.code(), Some(3), "{}", done.dump());
    assert!(
        own_messages(&done.stderr).iter().any(|l| l.contains("rank 1 ") && l.contains("code 3")),
        "no message naming rank 1 and code 3:\n{}",
        done.dump()
    );
}

#[test]
fn failing_rank_sets_the_exit_code() {
    failing_rank("1");
}

#[test]
fn failing_rank_on_one_virtual_node_ends_the_others() {
    failing_rank("3");
}

/// Each virtual node's shell leads a session of its own holding its tasks, as a real node's job shell does.
#[test]
fn virtual_nodes_are_sessions_of_their_own() {
    // Field 6 of /proc/PID/stat is the session (sh's command name holds no space).
    let done = rpmi_run(&["-n", "4", "--nodes", "2", "sh", "-c", "set -- $(cat /proc/$$/stat); echo \"$PMI_RANK $6\""]);
    done.assert_success("rpmi-run -n 4 --nodes 2 (print each task's session)");
    let session: BTreeMap<u32, i32> = done
        .stdout
        .lines()
        .filter_map(|l| l.split_once(' ').and_then(|(r, s)| Some((r.parse().ok()?, s.trim().parse().ok()?))))
        .collect();
    assert_eq!(session.len(), 4, "every rank's session:\n{}", done.dump());
    assert_eq!(session[&0], session[&1], "ranks 0 and 1 share node 0's session:\n{}", done.dump());
    assert_eq!(session[&2], session[&3], "ranks 2 and 3 share node 1's session:\n{}", done.dump());
    assert_ne!(session[&0], session[&2], "each node has its own session:\n{}", done.dump());
    // SAFETY: getsid(0) asks for this process's own session.
    let ours = unsafe { libc::getsid(0) };
    assert!(!session.values().any(|&s| s == ours), "a task is in the test's session:\n{}", done.dump());
}

// ---------------------------------------------------------------------------------------------------------
// PMI 1.2: group barriers.

/// `rpmi-probe groups` over virtual nodes: the node roots alone exchange cards over a group barrier, each
/// node meets in a NODE barrier, and every rank waits in two group barriers at once (WORLD and its parity's),
/// answered in any order, while it asks something else.
#[test]
fn group_barriers_over_virtual_nodes() {
    for (n, opts) in [("6", &["--nodes", "3"][..]), ("96", &["--nodes", "3"]), ("8", &["--nodes", "4", "--event-loop"])]
    {
        let mut args = vec!["-n", n];
        args.extend(opts);
        args.extend([PROBE, "groups"]);
        let done = rpmi_run(&args);
        done.assert_success(&format!("groups {args:?}"));
        let nodes = opts[1];
        let want =
            format!("groups: {n} ranks, {nodes} node roots exchanged cards, node, world and parity barriers checked");
        assert!(done.stdout.contains(&want), "{args:?}:\n{}", done.dump());
    }
}

/// A group barrier that a member can no longer join ends the job, saying which barrier and why: the member's
/// node is done (rank 1 finalized and left), rank 1 exited while a task of its node runs on, or (on the
/// waiting rank's own node) rank 1 left without finalize.
#[test]
fn a_group_barrier_a_member_cannot_join_ends_the_job() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/programs/pmi_group_left.sh");
    let script = script.to_str().unwrap();
    for (n, map, how, about) in [
        // Its node is done, or its exit is heard of first: either way the line names both.
        ("2", "block", "finalize", &["group barrier 0,1:5", "virtual node 1"][..]),
        ("4", "cyclic", "finalize", &["rank 1 exited while other ranks wait for it in group barrier 0,1:5"]),
        ("3", "block", "exit", &["rank 1 closed its PMI connection (exited or crashed) without PMI_Finalize"]),
    ] {
        let done = start(RUN, &["-n", n, "--nodes", "2", "--map", map, "bash", script, how]).wait(END_GUARD);
        assert_eq!(done.code(), Some(125), "{how}:\n{}", done.dump());
        assert!(about.iter().all(|a| done.stderr.contains(a)), "{how}:\n{}", done.dump());
        assert!(done.stragglers.is_empty(), "tasks outlived rpmi-run ({how}):\n{}", done.dump());
    }
}

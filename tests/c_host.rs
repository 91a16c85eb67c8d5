//! The proof that a C resource manager can use `plugin-spec/rpmi_plugin.h` as written: `tests/c_host/host.c`,
//! a job-shell host in plain C99 that knows nothing but the header, is compiled with the system `cc`
//! (warnings are errors) and runs real MPI programs over `librpmi.so` in both of the ABI's modes, and feeds
//! the plugin bad input to check the documented error codes and the threads its callbacks run on
//! (`host --check-errors`).
//!
//! `cc` and `mpicc` (MPICH) are required: without them the tests fail, saying to run docker/install-deps.sh.
//! The spawn tests (the host's `spawn` callback, ABI revision 2) need MPICH 5, which that script installs in
//! `/opt/rpmi-mpich5` (or `RPMI_MPICH5`, a directory with `bin/mpicc`): Debian's MPICH 4.0.2 cannot spawn.
//! Every run of a program has a hang guard: it is killed, with its whole process group, after [`HANG_GUARD`];
//! a host and every host it starts for a spawned job share that group, so no process of a run may outlive it.

use std::io::Read;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// How long any one run may take before the test kills it and fails. Generous: the machine may be loaded.
const HANG_GUARD: Duration = Duration::from_secs(120);

/// The source tree.
fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `librpmi.so` of this build: the test executable lives in `target/<profile>/deps/`, the cdylib one up.
fn plugin() -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    let profile_dir = exe.parent().and_then(Path::parent).expect("the test executable is in target/<profile>/deps");
    let so = profile_dir.join("librpmi.so");
    assert!(so.is_file(), "{} is missing: cargo builds the cdylib before integration tests", so.display());
    so
}

/// A directory of this test's own, removed when the test ends.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("c_host-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
        TempDir(dir)
    }

    fn path(&self, file: &str) -> PathBuf {
        self.0.join(file)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What a finished run left.
struct Run {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

impl Run {
    /// The exit code; a run killed by a signal fails the test.
    fn code(&self) -> i32 {
        self.status.code().unwrap_or_else(|| panic!("killed by signal {:?}\n{self}", self.status.signal()))
    }
}

impl std::fmt::Display for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "status: {}\n--- stdout:\n{}--- stderr:\n{}", self.status, self.stdout, self.stderr)
    }
}

fn drain(mut pipe: impl Read + Send + 'static) -> JoinHandle<String> {
    thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = pipe.read_to_end(&mut bytes);
        String::from_utf8_lossy(&bytes).into_owned()
    })
}

/// Runs `cmd` in a process group of its own, so that the hang guard can kill it together with every task.
fn run(mut cmd: Command) -> Run {
    let what = format!("{cmd:?}");
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0);
    let mut child: Child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            panic!("{what}: not found ({e}); run docker/install-deps.sh to install the C and MPI toolchains")
        }
        Err(e) => panic!("cannot start {what}: {e}"),
    };
    let stdout = drain(child.stdout.take().expect("piped stdout"));
    let stderr = drain(child.stderr.take().expect("piped stderr"));
    let deadline = Instant::now() + HANG_GUARD;
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for the child") {
            break status;
        }
        if Instant::now() >= deadline {
            // SAFETY: kill on the process group of our own child (its pid is the group id).
            unsafe { libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL) };
            let _ = child.wait();
            let (out, err) = (stdout.join().unwrap_or_default(), stderr.join().unwrap_or_default());
            panic!("{what} hung for {HANG_GUARD:?}; killed it\n--- stdout:\n{out}--- stderr:\n{err}");
        }
        thread::sleep(Duration::from_millis(50));
    };
    // Tasks left behind would hold the pipes open; the host must have reaped them all.
    let run =
        Run { status, stdout: stdout.join().expect("stdout reader"), stderr: stderr.join().expect("stderr reader") };
    // Nothing of the group may outlive the host (ESRCH: the group is empty).
    // SAFETY: signal 0 only checks whether the group still has members.
    let alive = unsafe { libc::kill(-(child.id() as libc::pid_t), 0) } == 0;
    assert!(!alive, "processes of {what} outlived it\n{run}");
    run
}

/// Compiles with `compiler`, failing the test (with the compiler's messages) if it does not succeed.
fn compile(compiler: &str, args: &[&str], source: &Path, out: &Path, libs: &[&str]) {
    let mut cmd = Command::new(compiler);
    cmd.args(args).arg(source).arg("-o").arg(out).args(libs);
    let r = run(cmd);
    assert_eq!(r.code(), 0, "{compiler} could not build {}\n{r}", source.display());
    assert!(r.stderr.trim().is_empty(), "{compiler} warned about {}\n{r}", source.display());
}

/// Builds `tests/c_host/host.c` into `dir` with the flags the header promises suffice.
fn build_host(dir: &TempDir) -> PathBuf {
    build_host_with(dir, "plugin-spec")
}

/// Builds `tests/c_host/host.c` against the header in `include` (relative to the repository).
fn build_host_with(dir: &TempDir, include: &str) -> PathBuf {
    let root = manifest_dir();
    let include = root.join(include);
    let out = dir.path("host");
    compile(
        "cc",
        &["-std=c99", "-Wall", "-Wextra", "-Werror", "-O2", "-D_GNU_SOURCE", "-I", include.to_str().expect("UTF-8")],
        &root.join("tests/c_host/host.c"),
        &out,
        &["-ldl", "-lpthread"],
    );
    out
}

/// Builds `tests/programs/mpi_pairs.c` into `dir` with `mpicc`.
fn build_mpi_pairs(dir: &TempDir) -> PathBuf {
    let out = dir.path("mpi_pairs");
    compile("mpicc", &["-O1"], &manifest_dir().join("tests/programs/mpi_pairs.c"), &out, &[]);
    out
}

/// Builds `tests/programs/NAME.c` into `dir` with MPICH 5's `mpicc`.
fn build_mpich5(dir: &TempDir, name: &str) -> PathBuf {
    let mpich5 = std::env::var_os("RPMI_MPICH5").map_or_else(|| PathBuf::from("/opt/rpmi-mpich5"), PathBuf::from);
    let mpicc = mpich5.join("bin/mpicc");
    assert!(mpicc.exists(), "no MPICH 5 at {}: run docker/install-deps.sh to install it", mpicc.display());
    let out = dir.path(name);
    let source = manifest_dir().join(format!("tests/programs/{name}.c"));
    compile(mpicc.to_str().expect("UTF-8"), &["-O1"], &source, &out, &[]);
    out
}

/// Runs `host [mode...] PLUGIN PROGRAM [ARGS...]`.
fn host_run(host: &Path, mode: &[&str], program: &Path, args: &[&str]) -> Run {
    host_run_env(host, mode, program, args, &[])
}

/// Runs `host [mode...] PLUGIN PROGRAM [ARGS...]` with `env` added to its environment.
fn host_run_env(host: &Path, mode: &[&str], program: &Path, args: &[&str], env: &[(&str, &str)]) -> Run {
    let mut cmd = Command::new(host);
    cmd.args(mode).arg(plugin()).arg(program).args(args).envs(env.iter().copied());
    run(cmd)
}

/// The callbacks (collective, abort, log) ran where section 4 of the specification says: in thread mode on
/// the plugin's progress threads, never on the host's main thread, which reaps the tasks and destroys the
/// instances; in event-loop mode on the main thread, which calls progress and destroy.
fn assert_callback_threads(r: &Run, mode: &[&str]) {
    let counts: Vec<u64> = r
        .stderr
        .lines()
        .find_map(|l| l.strip_prefix("host: callbacks on the main thread: "))
        .map(|rest| rest.split(", on other threads: ").filter_map(|n| n.trim().parse().ok()).collect())
        .unwrap_or_default();
    let (on_main, elsewhere) = match counts[..] {
        [on_main, elsewhere] => (on_main, elsewhere),
        _ => panic!("the host did not count its callbacks' threads\n{r}"),
    };
    if mode.contains(&"--event-loop") {
        assert!(on_main > 0 && elsewhere == 0, "event-loop mode: a callback off the host's loop thread\n{r}");
    } else {
        assert!(on_main == 0 && elsewhere > 0, "thread mode: a callback on the host's main thread\n{r}");
    }
}

/// MPI_Init, Allreduce, a message between every pair, Finalize: 4 ranks on 2 nodes must all get through.
fn mpi_pairs_succeed(name: &str, mode: &[&str]) {
    let dir = TempDir::new(name);
    let (host, program) = (build_host(&dir), build_mpi_pairs(&dir));
    let r = host_run(&host, &[mode, &["-n", "4", "--nodes", "2"]].concat(), &program, &[]);
    assert_eq!(r.code(), 0, "the MPI job failed\n{r}");
    assert!(r.stdout.contains("mpi_pairs: 4 ranks, allreduce 10, all pairs exchanged"), "no summary line\n{r}");
    assert_callback_threads(&r, mode);
}

/// Rank 1 calls MPI_Abort(7): the host's abort callback must end the job with exit status 7.
fn mpi_abort_ends_the_job(name: &str, mode: &[&str]) {
    let dir = TempDir::new(name);
    let (host, program) = (build_host(&dir), build_mpi_pairs(&dir));
    let r = host_run(&host, &[mode, &["-n", "4", "--nodes", "2"]].concat(), &program, &["abort=1:7"]);
    assert_eq!(r.code(), 7, "the job did not exit with the abort's code\n{r}");
    assert!(r.stderr.contains("host: rank 1 called PMI_Abort with exit code 7"), "the abort was not reported\n{r}");
    assert!(!r.stdout.contains("mpi_pairs: 4 ranks"), "the job ran to its end despite the abort\n{r}");
    assert_callback_threads(&r, mode);
}

/// A host built against revision 1 of the header (before dynamic processes) keeps working unchanged with
/// this plugin: its shorter `rpmi_job_info`, and a table it checks for version 1 only.
#[test]
fn a_host_of_abi_revision_1_runs_mpi_jobs() {
    let dir = TempDir::new("revision-1");
    let (host, program) = (build_host_with(&dir, "tests/c_host/abi-revision-1"), build_mpi_pairs(&dir));
    for mode in [&[][..], &["--event-loop"][..]] {
        let r = host_run(&host, &[mode, &["-n", "4", "--nodes", "2"]].concat(), &program, &[]);
        assert_eq!(r.code(), 0, "the MPI job failed\n{r}");
        assert!(r.stdout.contains("mpi_pairs: 4 ranks, allreduce 10, all pairs exchanged"), "no summary line\n{r}");
    }
    let r = host_run(&host, &["-n", "2"], &program, &["abort=1:7"]);
    assert_eq!(r.code(), 7, "the job did not exit with the abort's code\n{r}");
}

#[test]
fn mpi_pairs_in_thread_mode() {
    mpi_pairs_succeed("thread", &[]);
}

#[test]
fn mpi_pairs_in_event_loop_mode() {
    mpi_pairs_succeed("event-loop", &["--event-loop"]);
}

/// The host makes every task's connection and hands its end over (ABI revision 4), in both modes.
#[test]
fn mpi_pairs_over_connections_the_host_makes() {
    mpi_pairs_succeed("attach", &["--attach"]);
    mpi_pairs_succeed("attach-event-loop", &["--event-loop", "--attach"]);
}

#[test]
fn mpi_abort_over_connections_the_host_makes() {
    mpi_abort_ends_the_job("abort-attach", &["--event-loop", "--attach"]);
}

/// A larger exchange, and PMI-2's frames, over connections the host makes, on three nodes.
#[test]
fn exchange_and_pmi2_over_connections_the_host_makes() {
    let dir = TempDir::new("attach-exchange");
    let host = build_host(&dir);
    let probe = Path::new(env!("CARGO_BIN_EXE_rpmi-probe"));
    for mode in [&["--attach"][..], &["--event-loop", "--attach"][..]] {
        let mode = [mode, &["-n", "12", "--nodes", "3"]].concat();
        let r = host_run(&host, &mode, probe, &["exchange", "--puts", "8", "--size", "800"]);
        assert_eq!(r.code(), 0, "the exchange failed\n{r}");
        assert!(r.stdout.contains("exchange: size=12 puts=8 value_len=800 gets=12"), "no summary line\n{r}");
        let frames = manifest_dir().join("tests/programs/pmi2_frames.sh");
        let r = host_run(&host, &mode, Path::new("/bin/bash"), &[frames.to_str().expect("UTF-8")]);
        assert_eq!(r.code(), 0, "the PMI-2 job failed\n{r}");
        for rank in 0..12 {
            let next = (rank + 1) % 12;
            let answer = format!("rank {rank}: cmd=kvs-get-response;rc=0;value=v{next};found=TRUE;");
            assert!(r.stdout.lines().any(|l| l == answer), "rank {rank} did not read its neighbour's key\n{r}");
        }
    }
}

#[test]
fn mpi_abort_in_thread_mode() {
    mpi_abort_ends_the_job("abort-thread", &[]);
}

#[test]
fn mpi_abort_in_event_loop_mode() {
    mpi_abort_ends_the_job("abort-event-loop", &["--event-loop"]);
}

/// A task that leaves while another waits in a barrier: the plugin ends the job through the abort callback
/// with RPMI_ABORT_TASK_LOST and exit code 1, and the host exits 1. The tasks speak PMI-1 from a shell script
/// (bash builtins only, so that killing a task leaves no process behind).
#[test]
fn lost_task_ends_the_job_with_code_1() {
    let dir = TempDir::new("lost");
    let host = build_host(&dir);
    let script = dir.path("lost.sh");
    std::fs::write(
        &script,
        "#!/bin/bash\n\
         [ \"$PMI_RANK\" = 0 ] && exit 0\n\
         echo 'cmd=init pmi_version=1 pmi_subversion=1' >&$PMI_FD\n\
         read -r line <&$PMI_FD\n\
         echo 'cmd=barrier_in' >&$PMI_FD\n\
         read -r line <&$PMI_FD\n",
    )
    .expect("writing the script");
    for mode in [&[][..], &["--event-loop"][..], &["--attach"][..], &["--event-loop", "--attach"][..]] {
        let r = host_run(&host, &[mode, &["-n", "2"]].concat(), Path::new("/bin/bash"), &[script.to_str().unwrap()]);
        assert_eq!(r.code(), 1, "the job did not end with the lost task's code ({mode:?})\n{r}");
        assert!(
            r.stderr.contains("host: rank 0 ended the job (a lost task), exit code 1"),
            "the lost task was not reported ({mode:?})\n{r}"
        );
    }
}

/// A host built against revision 4 of the header (before the plugin ran the exchanges among the shells)
/// keeps working unchanged, with the connections it makes itself.
#[test]
fn a_host_of_abi_revision_4_runs_mpi_jobs() {
    let dir = TempDir::new("revision-4");
    let (host, program) = (build_host_with(&dir, "tests/c_host/abi-revision-4"), build_mpi_pairs(&dir));
    for mode in [&["--attach"][..], &["--event-loop", "--attach"][..]] {
        let r = host_run(&host, &[mode, &["-n", "4", "--nodes", "2"]].concat(), &program, &[]);
        assert_eq!(r.code(), 0, "the MPI job failed\n{r}");
        assert!(r.stdout.contains("mpi_pairs: 4 ranks, allreduce 10, all pairs exchanged"), "no summary line\n{r}");
    }
}

const SHELLS: [&[&str]; 2] = [&["--shells"], &["--event-loop", "--shells"]];

/// A host built against revision 5 of the header (before the names served other jobs) still has the plugin
/// run the exchanges among its nodes.
#[test]
fn a_host_of_abi_revision_5_runs_mpi_jobs_over_its_shells() {
    let dir = TempDir::new("revision-5");
    let (host, program) = (build_host_with(&dir, "tests/c_host/abi-revision-5"), build_mpi_pairs(&dir));
    for mode in SHELLS {
        let r = host_run(&host, &[mode, &["-n", "6", "--nodes", "3"]].concat(), &program, &[]);
        assert_eq!(r.code(), 0, "the MPI job failed ({mode:?})\n{r}");
        assert!(r.stdout.contains("mpi_pairs: 6 ranks, allreduce 21, all pairs exchanged"), "no summary line\n{r}");
    }
}

/// ABI revision 5: the plugin runs the exchanges among the nodes by the tree and by Bruck's allgather, and
/// PMI 1.2's group barriers, the host only carrying its messages.
#[test]
fn the_plugin_runs_the_exchanges_among_the_nodes_when_the_host_carries_its_messages() {
    let dir = TempDir::new("shells");
    let (host, program) = (build_host(&dir), build_mpi_pairs(&dir));
    let probe = Path::new(env!("CARGO_BIN_EXE_rpmi-probe"));
    for mode in SHELLS {
        let r = host_run(&host, &[mode, &["-n", "7", "--nodes", "5"]].concat(), &program, &[]);
        assert_eq!(r.code(), 0, "the MPI job failed ({mode:?})\n{r}");
        assert!(r.stdout.contains("mpi_pairs: 7 ranks, allreduce 28, all pairs exchanged"), "no summary line\n{r}");
        assert_callback_threads(&r, mode);
        let r = host_run(&host, &[mode, &["-n", "6", "--nodes", "3"]].concat(), probe, &["groups"]);
        assert_eq!(r.code(), 0, "PMI 1.2's group barriers failed ({mode:?})\n{r}");
        assert!(r.stdout.contains("groups: 6 ranks, 3 node roots exchanged cards"), "no groups line\n{r}");
        for allgather in ["tree", "bruck"] {
            let options = format!("{{\"allgather\": \"{allgather}\", \"tree_width\": 2}}");
            let args = ["exchange", "--puts", "4", "--size", "300"];
            let env = [("RPMI_HOST_OPTIONS", options.as_str())];
            let r = host_run_env(&host, &[mode, &["-n", "9", "--nodes", "6"]].concat(), probe, &args, &env);
            assert_eq!(r.code(), 0, "the exchange failed ({mode:?}, {allgather})\n{r}");
        }
    }
    // Without --shells the host serves no group barrier: the client is answered 1.1 and says so.
    let r = host_run(&host, &["-n", "4", "--nodes", "2"], probe, &["groups"]);
    assert_ne!(r.code(), 0, "groups passed without a host that serves them\n{r}");
}

/// With the plugin running the exchanges and the host offering no name service, the job's names are served
/// by node 0's instance: MPICH 5 (over OFI, which opens a real port) publishes on rank 0 and looks up on the
/// others, across nodes.
#[test]
fn with_the_plugin_running_the_exchanges_the_job_has_a_name_service() {
    let dir = TempDir::new("shells-names");
    let (host, program) = (build_host(&dir), build_mpich5(&dir, "mpi_names"));
    for mode in SHELLS {
        // One rank a node: MPICH 5.0.2 over OFI sometimes hangs in MPI_Init on a loaded machine where a node
        // has two ranks, under Hydra as under rpmi (docs/testing.md).
        let env = [("MPIR_CVAR_CH4_NETMOD", "ofi")];
        let r = host_run_env(&host, &[mode, &["-n", "4", "--nodes", "4"]].concat(), &program, &[], &env);
        assert_eq!(r.code(), 0, "the MPI job failed ({mode:?})\n{r}");
        let line = "mpi_names: 3 ranks looked up the port; duplicate publish, unknown and unpublished lookups failed";
        assert!(r.stdout.contains(line), "no summary line ({mode:?})\n{r}");
    }
}

/// A node whose only rank leaves while the others wait in a barrier: the job ends at once, naming the rank,
/// whether it left without PMI_Finalize (a lost task) or after it (the node can join no barrier).
#[test]
fn with_the_plugin_running_the_exchanges_a_rank_that_leaves_a_barrier_ends_the_job_naming_it() {
    let dir = TempDir::new("shells-left");
    let host = build_host(&dir);
    let script = dir.path("left.sh");
    std::fs::write(
        &script,
        "#!/bin/bash\n\
         echo 'cmd=init pmi_version=1 pmi_subversion=1' >&$PMI_FD\n\
         read -r line <&$PMI_FD\n\
         if [ \"$PMI_RANK\" = 2 ]; then\n\
           [ \"$1\" = finalize ] && { echo 'cmd=finalize' >&$PMI_FD; read -r line <&$PMI_FD; }\n\
           exit 0\n\
         fi\n\
         echo 'cmd=barrier_in' >&$PMI_FD\n\
         read -r line <&$PMI_FD\n\
         echo \"rank $PMI_RANK: $line\"\n",
    )
    .expect("writing the script");
    let bash = Path::new("/bin/bash");
    for mode in SHELLS {
        for (how, says) in [("exit", "a lost task"), ("finalize", "another node")] {
            let started = std::time::Instant::now();
            let args = [script.to_str().unwrap(), how];
            let r = host_run(&host, &[mode, &["-n", "4", "--nodes", "4"]].concat(), bash, &args);
            assert_eq!(r.code(), 1, "the job did not end with code 1 ({mode:?}, {how})\n{r}");
            assert!(
                r.stderr.contains(&format!("host: rank 2 ended the job ({says}), exit code 1")),
                "the rank was not named ({mode:?}, {how})\n{r}"
            );
            // A bound only to tell a hang from an end: the ranks would otherwise wait for ever.
            assert!(started.elapsed() < std::time::Duration::from_secs(10), "{mode:?} {how}: {:?}", started.elapsed());
        }
    }
}

/// A rank that leaves while another waits for it in a group barrier ends the job, naming it.
#[test]
fn with_the_plugin_running_the_exchanges_a_group_barrier_left_ends_the_job_naming_the_rank() {
    let dir = TempDir::new("shells-group-left");
    let host = build_host(&dir);
    let script = manifest_dir().join("tests/programs/pmi_group_left.sh");
    for mode in SHELLS {
        for how in ["exit", "finalize"] {
            let args = [script.to_str().unwrap(), how];
            let r = host_run(&host, &[mode, &["-n", "3", "--nodes", "3"]].concat(), Path::new("/bin/bash"), &args);
            assert_eq!(r.code(), 1, "the job did not end with code 1 ({mode:?}, {how})\n{r}");
            assert!(
                r.stderr.contains("host: rank 1 ended the job (a lost task)")
                    && r.stderr.contains("group barrier 0,1:5"),
                "the rank and its group were not named ({mode:?}, {how})\n{r}"
            );
        }
    }
}

/// Bad input to create and the task hooks comes back as the header's error codes, with the error text filled;
/// a failing call's reason reaches log on the calling thread; destroy serves a task's last words (an abort)
/// on the thread section 4 of the specification names for each mode.
#[test]
fn check_errors() {
    let dir = TempDir::new("check");
    let host = build_host(&dir);
    let mut cmd = Command::new(&host);
    cmd.arg("--check-errors").arg(plugin());
    let r = run(cmd);
    assert_eq!(r.code(), 0, "some checks failed\n{r}");
    assert!(!r.stdout.contains("FAIL"), "some checks failed\n{r}");
    for check in [
        "ok: create with a NULL job -> RPMI_ERR_INVALID",
        "ok: create with ops.abi_version 999 -> RPMI_ERR_VERSION",
        "ok: create with the unknown option 'nope' -> RPMI_ERR_OPTION",
        "ok:   ... and the error text is filled and names 'nope'",
        "ok: create with task_map naming shell 5 of 1 -> RPMI_ERR_INVALID",
        "ok: create with local rank 1, which task_map puts on shell 1, on shell 0 -> RPMI_ERR_INVALID",
        "ok: task_init of task 1 twice -> RPMI_ERR_STATE",
        "ok: progress in thread mode -> RPMI_ERR_STATE",
        "ok: service_complete with no request pending -> RPMI_ERR_STATE",
        "ok:   ... and its reason reached the log callback",
        "ok: service_complete for local task 7 of 2 -> RPMI_ERR_INVALID",
        "ok: create with ops.struct_size 8 -> RPMI_ERR_VERSION",
        "ok: create with local_count 0 -> RPMI_ERR_INVALID",
        "ok: progress(NULL instance) -> RPMI_ERR_INVALID",
        "ok: service_complete with no request pending, on a host thread of its own -> RPMI_ERR_STATE",
        "ok:   ... and its reason reached log on that thread, before the call returned",
        "ok:   ... destroy served it: abort(exit code 5) on the progress thread (thread mode)",
        "ok:   ... destroy served it: abort(exit code 5) on the thread calling destroy (event-loop mode)",
        "ok: 0 checks failed",
    ] {
        assert!(r.stdout.contains(check), "missing check line '{check}'\n{r}");
    }
}

/// The host's own errors are clear: bad usage exits 2, a plugin that cannot be loaded or a program that
/// cannot be found exits 1, each with a message.
#[test]
fn host_reports_its_own_errors() {
    let dir = TempDir::new("usage");
    let host = build_host(&dir);
    let r = run(Command::new(&host));
    assert_eq!(r.code(), 2, "{r}");
    assert!(r.stderr.contains("usage: host"), "{r}");

    let mut cmd = Command::new(&host);
    cmd.args(["-n", "2", "--nodes", "3"]).arg(plugin()).arg("true");
    let r = run(cmd);
    assert_eq!(r.code(), 2, "{r}");
    assert!(r.stderr.contains("2 tasks cannot fill 3 nodes"), "{r}");

    let mut cmd = Command::new(&host);
    cmd.args(["-n", "1"]).arg(dir.path("missing.so")).arg("true");
    let r = run(cmd);
    assert_eq!(r.code(), 1, "{r}");
    assert!(r.stderr.contains("cannot load the plugin"), "{r}");

    let r = host_run(&host, &["-n", "1"], Path::new("no-such-program-anywhere"), &[]);
    assert_eq!(r.code(), 1, "{r}");
    assert!(r.stderr.contains("no-such-program-anywhere: not found"), "{r}");
}

// ---------------------------------------------------------------------------------------------------------
// Spawn: the host serves PMI_Spawn_multiple through the ABI's spawn callback (revision 2) by starting itself
// again as the host of the spawned job (tests/c_host/host.c, header comment).

/// `host [mode] -n 2 PLUGIN mpi_spawn ARGS`: MPI_Comm_spawn of copies of the program, merged and checked.
fn mpi_spawn_succeeds(name: &str, mode: &[&str], args: &[&str], line: &str) {
    let dir = TempDir::new(name);
    let (host, program) = (build_host(&dir), build_mpich5(&dir, "mpi_spawn"));
    let r = host_run(&host, &[mode, &["-n", "2"]].concat(), &program, args);
    assert_eq!(r.code(), 0, "the spawning job failed\n{r}");
    assert!(r.stdout.contains(line), "no `{line}`\n{r}");
    assert_callback_threads(&r, mode);
}

const SPAWN_OF_3: &str =
    "mpi_spawn: 2 parents, 3 children, depth 1 (3 processes below the parents): merged and checked";

#[test]
fn mpi_spawn_in_thread_mode() {
    mpi_spawn_succeeds("spawn-thread", &[], &["3"], SPAWN_OF_3);
}

#[test]
fn mpi_spawn_in_event_loop_mode() {
    mpi_spawn_succeeds("spawn-event-loop", &["--event-loop"], &["3"], SPAWN_OF_3);
}

/// The spawned job spawns in turn: three hosts, each waiting for the one it started. The parents are on two
/// nodes, and so are the children (a spawned job gets at most as many nodes as its spawner).
#[test]
fn mpi_spawn_nested_two_levels() {
    let line = "mpi_spawn: 2 parents, 3 children, depth 2 (6 processes below the parents): merged and checked";
    mpi_spawn_succeeds("spawn-nested", &["--nodes", "2"], &["3", "2"], line);
}

/// MPI_Comm_spawn_multiple of two commands: each child's MPI_APPNUM is its command's index, and each command
/// runs with its own arguments.
#[test]
fn mpi_spawn_multiple_gives_each_command_its_appnum() {
    let dir = TempDir::new("spawn-multiple");
    let (host, program) = (build_host(&dir), build_mpich5(&dir, "mpi_spawn_multiple"));
    let r = host_run(&host, &["--event-loop", "-n", "2"], &program, &[]);
    assert_eq!(r.code(), 0, "the spawning job failed\n{r}");
    let line =
        "mpi_spawn_multiple: 2 parents, 1 child of command 0 and 2 of command 1: appnums, argvs and merge checked";
    assert!(r.stdout.contains(line), "no `{line}`\n{r}");
}

/// A spawn of a program that does not exist starts nothing and answers -1 for every process (MPICH's spawner
/// waits for its children unless every code is an error): MPI_Comm_spawn returns, and nothing hangs.
#[test]
fn mpi_spawn_of_a_missing_program_fails_with_error_codes() {
    let dir = TempDir::new("spawn-missing");
    let (host, program) = (build_host(&dir), build_mpich5(&dir, "mpi_spawn_missing"));
    for mode in [&[][..], &["--event-loop"][..]] {
        let r = host_run(&host, &[mode, &["-n", "2"]].concat(), &program, &[]);
        assert_eq!(r.code(), 0, "the spawning job failed ({mode:?})\n{r}");
        assert!(r.stdout.contains("mpi_spawn_missing: spawn failed as expected"), "({mode:?})\n{r}");
        assert!(r.stdout.contains("errcodes -1 -1"), "every process's code is -1 ({mode:?})\n{r}");
        let why = "cannot start ./no-such-program-rpmi: not found, or not executable; the spawn fails";
        assert!(r.stderr.contains(why), "the host did not say why ({mode:?})\n{r}");
    }
}

/// Rank 0 of the spawned job calls MPI_Abort(42): the spawned job's host exits 42, which ends the spawning
/// job with that status (its tasks killed), however the parents' MPI reacts to losing their children; no
/// process of either job is left (run checks the process group). Nested: the abort at depth 2 goes up two
/// hosts.
#[test]
fn an_abort_in_a_spawned_job_ends_the_spawning_job_with_its_code() {
    let dir = TempDir::new("spawn-abort");
    let (host, program) = (build_host(&dir), build_mpich5(&dir, "mpi_spawn"));
    for (mode, args, level) in [
        (&[][..], &["3"][..], "1"),
        (&["--event-loop"][..], &["3"][..], "1"),
        (&["--nodes", "2"][..], &["2", "2"][..], "2"),
    ] {
        let r =
            host_run_env(&host, &[mode, &["-n", "2"]].concat(), &program, args, &[("MPI_SPAWN_ABORT_LEVEL", level)]);
        assert_eq!(r.code(), 42, "the spawning job did not end with the abort's code ({mode:?}, level {level})\n{r}");
        assert!(r.stderr.contains("host: rank 0 called PMI_Abort with exit code 42"), "({mode:?})\n{r}");
        assert!(
            r.stderr.contains("host: a spawned job failed: its host exited with status 42; ending this job"),
            "the spawning host did not see its spawned job fail ({mode:?}, level {level})\n{r}"
        );
        assert!(!r.stdout.contains("merged and checked"), "the job ran to its end despite the abort\n{r}");
    }
}

/// `rpmi-probe info` lines: rank -> its `key=value` fields.
fn probe_info(stdout: &str) -> std::collections::BTreeMap<u32, std::collections::BTreeMap<String, String>> {
    let mut ranks = std::collections::BTreeMap::new();
    for line in stdout.lines().filter(|l| l.starts_with("rank=") && l.contains(" appnum=")) {
        let fields: std::collections::BTreeMap<String, String> =
            line.split_whitespace().filter_map(|t| t.split_once('=')).map(|(k, v)| (k.into(), v.into())).collect();
        ranks.insert(fields["rank"].parse().expect("a rank number"), fields);
    }
    ranks
}

/// A PMI-1 spawner on the wire (tests/programs/pmi_spawn.sh): two commands with their appnums, the preputs
/// in the new job's KVS, a program found in the `path` info and run in the `wdir` info, PMI_SPAWNED=1 and
/// the spawner's universe; a `host` info naming another machine is refused with the host's own message.
#[test]
fn pmi_spawn_on_the_wire_gives_the_new_job_what_pmi_promises() {
    let dir = TempDir::new("spawn-wire");
    let host = build_host(&dir);
    let script = manifest_dir().join("tests/programs/pmi_spawn.sh");
    let probe = env!("CARGO_BIN_EXE_rpmi-probe");
    for mode in [&[][..], &["--event-loop"][..]] {
        let r = host_run(&host, &[mode, &["-n", "1"]].concat(), &script, &[probe]);
        assert_eq!(r.code(), 0, "pmi_spawn.sh failed ({mode:?})\n{r}");
        let answers: Vec<&str> = r.stdout.lines().filter(|l| l.starts_with("spawner: ")).collect();
        assert_eq!(
            answers,
            [
                "spawner: cmd=spawn_result rc=0 errcodes=0,0,0",
                "spawner: cmd=spawn_result rc=0 errcodes=0,0",
                "spawner: cmd=spawn_result rc=0 errcodes=0"
            ],
            "({mode:?})\n{r}"
        );
        let ranks = probe_info(&r.stdout);
        assert_eq!(ranks.keys().copied().collect::<Vec<_>>(), [0, 1, 2], "({mode:?})\n{r}");
        for (rank, fields) in &ranks {
            assert_eq!(fields["appnum"], if *rank == 0 { "0" } else { "1" }, "rank {rank} ({mode:?})\n{r}");
            assert_eq!(fields["size"], "3", "({mode:?})\n{r}");
            assert_eq!(fields["universe"], "1", "the spawner's universe ({mode:?})\n{r}");
            assert_eq!(fields["kvsname"], ranks[&0]["kvsname"], "one job, one KVS ({mode:?})\n{r}");
        }
        for line in ["rank=0 greeting=hello world", "rank=1 greeting=hello world", "1"] {
            assert!(r.stdout.lines().any(|l| l == line), "no `{line}` ({mode:?})\n{r}");
        }
    }

    let r = host_run(&host, &["-n", "1"], &script, &[probe, "elsewhere.example"]);
    assert_eq!(r.code(), 0, "pmi_spawn.sh elsewhere.example failed\n{r}");
    let refused = r.stdout.lines().find(|l| l.starts_with("spawner: cmd=spawn_result rc=-1 msg="));
    assert!(refused.is_some_and(|l| l.contains("not_on_'elsewhere.example'")), "the spawn was not refused\n{r}");
    assert!(r.stderr.contains("a spawn is refused: this host runs every task on this machine"), "{r}");
}

/// In thread mode the spawn callback runs on the plugin's progress thread, which blocks every signal, and a
/// signal mask survives exec: the spawned job's tasks must still get the host's own mask (MPI programs rely on
/// signals: mpi_spawn's `alarm` guard, a launcher's SIGTERM). The spawner prints its mask, then spawns `grep`
/// to print the spawned task's.
#[test]
fn a_spawned_job_gets_the_hosts_signal_mask() {
    let dir = TempDir::new("spawn-sigmask");
    let host = build_host(&dir);
    let script = dir.path("sigmask.sh");
    std::fs::write(
        &script,
        "#!/bin/bash\n\
         set -eu\n\
         echo 'cmd=init pmi_version=1 pmi_subversion=1' >&$PMI_FD\n\
         read -r line <&$PMI_FD\n\
         grep SigBlk /proc/self/status | sed 's/^/spawner /'\n\
         printf 'mcmd=spawn\\nnprocs=1\\nexecname=grep\\ntotspawns=1\\nspawnssofar=1\\nargcnt=2\\narg1=SigBlk\\n\
         arg2=/proc/self/status\\npreput_num=0\\ninfo_num=0\\nendcmd\\n' >&$PMI_FD\n\
         read -r line <&$PMI_FD\n\
         echo \"spawner: $line\"\n\
         echo 'cmd=finalize' >&$PMI_FD\n\
         read -r line <&$PMI_FD\n",
    )
    .expect("writing the script");
    for mode in [&[][..], &["--event-loop"][..]] {
        let r = host_run(&host, &[mode, &["-n", "1"]].concat(), Path::new("/bin/bash"), &[script.to_str().unwrap()]);
        assert_eq!(r.code(), 0, "({mode:?})\n{r}");
        assert!(r.stdout.contains("spawner: cmd=spawn_result rc=0 errcodes=0"), "({mode:?})\n{r}");
        let mask = |prefix: &str| r.stdout.lines().find_map(|l| l.strip_prefix(prefix)).map(str::trim);
        let (spawner, spawned) = (mask("spawner SigBlk:"), mask("SigBlk:"));
        assert!(spawner.is_some() && spawner == spawned, "the spawned task's signal mask differs ({mode:?})\n{r}");
    }
}

//! The proof that a C resource manager can use `plugin-spec/rpmi_plugin.h` as written: `tests/c_host/host.c`,
//! a job-shell host in plain C99 that knows nothing but the header, is compiled with the system `cc`
//! (warnings are errors) and runs real MPI programs over `librpmi.so` in both of the ABI's modes, and feeds
//! the plugin bad input to check the documented error codes and the threads its callbacks run on
//! (`host --check-errors`).
//!
//! `cc` and `mpicc` (MPICH) are required: without them the tests fail, saying to run docker/install-deps.sh.
//! Every run of a program has a hang guard: it is killed, with its whole process group, after [`HANG_GUARD`].

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

/// Runs `host [mode...] PLUGIN PROGRAM [ARGS...]`.
fn host_run(host: &Path, mode: &[&str], program: &Path, args: &[&str]) -> Run {
    let mut cmd = Command::new(host);
    cmd.args(mode).arg(plugin()).arg(program).args(args);
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
    for mode in [&[][..], &["--event-loop"][..]] {
        let r = host_run(&host, &[mode, &["-n", "2"]].concat(), Path::new("/bin/bash"), &[script.to_str().unwrap()]);
        assert_eq!(r.code(), 1, "the job did not end with the lost task's code ({mode:?})\n{r}");
        assert!(
            r.stderr.contains("host: rank 0 ended the job (a lost task), exit code 1"),
            "the lost task was not reported ({mode:?})\n{r}"
        );
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

//! What the end-to-end tests of rpmi-run share: running a command under a hang guard (its own process
//! group, killed with every descendant if it overruns), reading /proc, and building the C test programs.
//! Each test binary uses some of it.

#![allow(dead_code)]

pub mod impi;
pub mod libpmi;

use std::ffi::OsStr;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

pub const RUN: &str = env!("CARGO_BIN_EXE_rpmi-run");
pub const PROBE: &str = env!("CARGO_BIN_EXE_rpmi-probe");

/// How long an ordinary run may take (64 MPI ranks on 2 loaded cores can take a minute).
pub const GUARD: Duration = Duration::from_secs(180);
/// How long a job that is being ended (abort, killed task, signal) may take to end.
pub const END_GUARD: Duration = Duration::from_secs(60);

pub const INSTALL_HINT: &str = "install MPICH with `docker/install-deps.sh` (as root) and run the tests again";

// ---------------------------------------------------------------------------------------------------------
// Building the test programs.

/// Builds `tests/programs/NAME.c` into `dir` with `compiler`.
pub fn compile(compiler: &str, name: &str, dir: &Path) -> PathBuf {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/programs/{name}.c"));
    let out_path = dir.join(name);
    let out = Command::new(compiler)
        .args(["-O1", "-Wall", "-Wextra", "-o"])
        .arg(&out_path)
        .arg(&source)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {compiler} ({e}): {INSTALL_HINT}"));
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "{compiler} {} failed or warned ({}):\n{}{}",
        source.display(),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out_path
}

// ---------------------------------------------------------------------------------------------------------
// Running a job under a hang guard.

/// A started command: its own process group, output collected by two threads.
pub struct Running {
    pub child: Child,
    pub what: String,
    pub stdout: Arc<Mutex<Vec<u8>>>,
    pub stderr: Arc<Mutex<Vec<u8>>>,
    pub readers: Vec<JoinHandle<()>>,
    pub started: Instant,
    /// Once the command is reaped: the processes of its group that outlived it. Its pid may then be reused,
    /// so from then on only these are killed, by pid.
    pub reaped: Option<Vec<i32>>,
}

/// A finished command.
pub struct Done {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
    /// When the launcher was seen to have exited.
    pub ended: Instant,
    /// Processes of the job's process group still alive when the launcher had exited.
    pub stragglers: Vec<i32>,
}

impl Done {
    pub fn code(&self) -> Option<i32> {
        self.status.code()
    }

    /// Everything about the run, for assertion messages.
    pub fn dump(&self) -> String {
        format!(
            "status {}, processes left in its group: {:?}\n--- stdout ---\n{}--- stderr ---\n{}",
            self.status, self.stragglers, self.stdout, self.stderr
        )
    }

    pub fn assert_success(&self, what: &str) {
        assert_eq!(self.code(), Some(0), "{what} failed:\n{}", self.dump());
    }
}

pub fn collect(mut from: impl Read + Send + 'static, into: Arc<Mutex<Vec<u8>>>) -> JoinHandle<()> {
    thread::spawn(move || {
        let mut buf = [0u8; 8192];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => into.lock().unwrap().extend_from_slice(&buf[..n]),
            }
        }
    })
}

pub fn start<S: AsRef<OsStr>>(program: impl AsRef<OsStr>, args: &[S]) -> Running {
    start_with_env(program, args, &[])
}

/// `start` with `env` added to the program's environment.
pub fn start_with_env<S: AsRef<OsStr>>(program: impl AsRef<OsStr>, args: &[S], env: &[(&str, &OsStr)]) -> Running {
    start_in(Command::new(program.as_ref()), args, env)
}

/// What a program gets on stdin: nothing, and end of file at once. MPICH's Hydra gets a pipe that stays open
/// and empty until it is reaped instead: its mpiexec (4.0.2) forwards stdin to rank 0, and on end of file
/// writes that to rank 0's proxy, which on a loaded machine may have exited already with its tasks, and
/// mpiexec dies of SIGPIPE ("error writing to control socket") whatever its PMI clients did.
fn stdin_for(program: &OsStr) -> Stdio {
    if Path::new(program).file_name() == Some(OsStr::new("mpiexec.hydra")) {
        Stdio::piped()
    } else {
        Stdio::null()
    }
}

/// `start_with_env` of `cmd` as the caller set it up (its directory, say).
pub fn start_in<S: AsRef<OsStr>>(mut cmd: Command, args: &[S], env: &[(&str, &OsStr)]) -> Running {
    let stdin = stdin_for(cmd.get_program());
    cmd.args(args).envs(env.iter().copied()).stdin(stdin).stdout(Stdio::piped()).stderr(Stdio::piped());
    // Its own process group, so that the guard can kill every task along with it.
    cmd.process_group(0);
    let what = std::iter::once(cmd.get_program())
        .chain(args.iter().map(AsRef::as_ref))
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ");
    let started = Instant::now();
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("cannot start `{what}`: {e}"));
    let stdout = Arc::new(Mutex::new(Vec::new()));
    let stderr = Arc::new(Mutex::new(Vec::new()));
    let readers = vec![
        collect(child.stdout.take().expect("piped stdout"), stdout.clone()),
        collect(child.stderr.take().expect("piped stderr"), stderr.clone()),
    ];
    Running { child, what, stdout, stderr, readers, started, reaped: None }
}

impl Running {
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn stderr_now(&self) -> String {
        String::from_utf8_lossy(&self.stderr.lock().unwrap()).into_owned()
    }

    /// Kills the whole job: the process group and every descendant (some launchers start their own groups);
    /// once the command is reaped, the processes that outlived it.
    pub fn kill_all(&mut self) {
        if let Some(left) = &self.reaped {
            for &p in left {
                // SAFETY: SIGKILL to a process of this job that outlived the launcher.
                unsafe { libc::kill(p, libc::SIGKILL) };
            }
            return;
        }
        let pid = self.pid();
        let tree = descendants(pid);
        // SAFETY: signals to our own child's process group and its descendants.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
            for p in tree {
                libc::kill(p, libc::SIGKILL);
            }
        }
        let _ = self.child.kill();
    }

    /// Called once the command has been reaped: notes (and returns) the live processes left in its group.
    pub fn note_reaped(&mut self) -> Vec<i32> {
        let pgid = self.pid();
        let left: Vec<i32> =
            all_pids().into_iter().filter(|&p| stat(p).is_some_and(|s| s.pgrp == pgid && s.state != 'Z')).collect();
        self.reaped = Some(left.clone());
        left
    }

    /// Polls `ready` on stderr until it holds; fails the test (killing the job) after `limit` or if the job
    /// ends first.
    pub fn wait_for_stderr(&mut self, limit: Duration, what: &str, ready: impl Fn(&str) -> bool) {
        let deadline = Instant::now() + limit;
        loop {
            if ready(&self.stderr_now()) {
                return;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                self.note_reaped();
                let err = self.stderr_now();
                panic!("`{}` ended ({status}) before {what}:\n{err}", self.what);
            }
            if Instant::now() > deadline {
                self.kill_all();
                panic!("`{}`: no {what} after {limit:?}; killed. stderr:\n{}", self.what, self.stderr_now());
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Polls `find` until it gives a value; fails the test (killing the job) after `limit` or if the job
    /// ends first.
    pub fn wait_until<T>(&mut self, limit: Duration, what: &str, find: impl Fn(&Running) -> Option<T>) -> T {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(v) = find(self) {
                return v;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                self.note_reaped();
                panic!("`{}` ended ({status}) before {what}:\n{}", self.what, self.stderr_now());
            }
            if Instant::now() > deadline {
                self.kill_all();
                panic!("`{}`: no {what} after {limit:?}; killed. stderr:\n{}", self.what, self.stderr_now());
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for the command to end; `limit` after it started, it is killed with all its tasks and the test
    /// fails.
    pub fn wait(self, limit: Duration) -> Done {
        let deadline = self.started + limit;
        self.wait_deadline(deadline, limit)
    }

    /// Like `wait`, with `limit` counted from now: for a job the test has just told to end.
    pub fn wait_ending(self, limit: Duration) -> Done {
        self.wait_deadline(Instant::now() + limit, limit)
    }

    pub fn wait_deadline(mut self, deadline: Instant, limit: Duration) -> Done {
        let status = loop {
            match self.child.try_wait() {
                Ok(Some(status)) => break status,
                Ok(None) if Instant::now() > deadline => {
                    self.kill_all();
                    let _ = self.child.wait();
                    self.note_reaped();
                    let out = String::from_utf8_lossy(&self.stdout.lock().unwrap()).into_owned();
                    panic!(
                        "`{}` hung: still running after {limit:?}; killed.\n--- stdout ---\n{out}--- stderr ---\n{}",
                        self.what,
                        self.stderr_now()
                    );
                }
                Ok(None) => thread::sleep(Duration::from_millis(5)),
                Err(e) => panic!("waiting for `{}`: {e}", self.what),
            }
        };
        let ended = Instant::now();
        let elapsed = ended - self.started;
        // A well-behaved launcher reaps every task before it exits, so its process group is empty now.
        // Anything still in it outlived the launcher: note it (the tests assert there is none), and kill it
        // if it keeps the output pipes open.
        let stragglers = self.note_reaped();
        let pipes_open_until = Instant::now() + Duration::from_secs(5);
        for r in std::mem::take(&mut self.readers) {
            while !r.is_finished() {
                if Instant::now() > pipes_open_until {
                    self.kill_all();
                }
                thread::sleep(Duration::from_millis(10));
            }
            let _ = r.join();
        }
        let stdout = String::from_utf8_lossy(&self.stdout.lock().unwrap()).into_owned();
        let stderr = self.stderr_now();
        Done { status, stdout, stderr, elapsed, ended, stragglers }
    }
}

impl Drop for Running {
    /// Whatever happened (a failed assertion included), nothing of the job outlives the test.
    fn drop(&mut self) {
        self.kill_all();
        if self.reaped.is_none() {
            let _ = self.child.wait();
        }
    }
}

/// Runs a command to its end under the ordinary guard.
pub fn run<S: AsRef<OsStr>>(program: impl AsRef<OsStr>, args: &[S]) -> Done {
    start(program, args).wait(GUARD)
}

/// `rpmi-run ARGS...`
pub fn rpmi_run<S: AsRef<OsStr>>(args: &[S]) -> Done {
    run(RUN, args)
}

// ---------------------------------------------------------------------------------------------------------
// /proc.

/// Every pid on the machine.
pub fn all_pids() -> Vec<i32> {
    std::fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok()))
        .collect()
}

/// What /proc/PID/stat says of a process.
pub struct Stat {
    pub state: char,
    pub ppid: i32,
    pub pgrp: i32,
}

pub fn stat(pid: i32) -> Option<Stat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold anything; the fields after it are plain.
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    let pgrp = fields.next()?.parse().ok()?;
    Some(Stat { state, ppid, pgrp })
}

/// Every descendant of `pid`.
pub fn descendants(pid: i32) -> Vec<i32> {
    let parents: Vec<(i32, i32)> = all_pids().into_iter().filter_map(|p| stat(p).map(|s| (p, s.ppid))).collect();
    let mut found = vec![pid];
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        found.extend(parents.iter().filter(|&&(_, pp)| pp == parent).map(|&(p, _)| p));
        i += 1;
    }
    found.remove(0);
    found
}

/// Live processes running the executable `exe`.
pub fn running_exe(exe: &Path) -> Vec<i32> {
    all_pids()
        .into_iter()
        .filter(|p| std::fs::read_link(format!("/proc/{p}/exe")).is_ok_and(|l| l == exe))
        .filter(|&p| stat(p).is_some_and(|s| s.state != 'Z'))
        .collect()
}

/// The environment of `pid`, if readable.
pub fn environ(pid: i32) -> Option<Vec<String>> {
    let raw = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    Some(raw.split(|&b| b == 0).map(|v| String::from_utf8_lossy(v).into_owned()).collect())
}

/// The task of `rank` among the children of `parent`, once it has exec'd (its environment then holds
/// PMI_RANK).
pub fn task_pid(parent: i32, rank: u32) -> Option<i32> {
    let want = format!("PMI_RANK={rank}");
    all_pids()
        .into_iter()
        .filter(|&p| stat(p).is_some_and(|s| s.ppid == parent))
        .find(|&p| environ(p).is_some_and(|env| env.contains(&want)))
}

/// Fails the test if any process still runs `exe` or outlived the launcher in its process group (those are
/// killed first, so none outlives the test).
pub fn assert_none_left(exe: &Path, done: &Done, after: &str) {
    let left = running_exe(exe);
    for &p in &left {
        // SAFETY: SIGKILL to a leftover task of this test (its private executable).
        unsafe { libc::kill(p, libc::SIGKILL) };
    }
    assert!(
        left.is_empty() && done.stragglers.is_empty(),
        "{after}: tasks still running {} (pids {left:?}, left in the job's group {:?}); killed them\n{}",
        exe.display(),
        done.stragglers,
        done.dump()
    );
}

pub fn signal(pid: i32, sig: i32) {
    // SAFETY: a signal to a process of this test.
    let rc = unsafe { libc::kill(pid, sig) };
    assert_eq!(rc, 0, "kill({pid}, {sig}): {}", std::io::Error::last_os_error());
}

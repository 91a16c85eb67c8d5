//! `PMI_Spawn_multiple` under srun: the new processes are a new step of the job, started by the spawning
//! step's srun.
//!
//! A task's spawn goes up to srun's root (SPAWN: the request as the plugin ABI's JSON). The root starts
//! `srun --jobid=J --mpi=rpmi --ntasks=N --nodes=1-N --immediate --exact [--chdir=W] [--nodelist=H] program
//! args`, or, for several commands, one step with `--multi-prog` (a file of the user's, removed when that
//! srun exits), in srun's own
//! environment plus [`ENV_SPAWN`]: what the new step's tasks get beyond a step's own (the preputs and each
//! command's process count, from which each rank's appnum follows) and the fd of a pipe. The new srun's
//! prelaunch passes that on to its stepds and writes its step id into the pipe. Its root writes `started`
//! once every task of the step has sent its first PMI line (STARTED from every stepd): then the task's spawn
//! is answered, every process started (error codes 0). Waiting for less would answer before Slurm finds a
//! program missing on a node (in each task's `execve`, after the step exists); waiting for more would
//! deadlock, since MPI's children connect to their parents inside `MPI_Init`, before any PMI barrier. A new
//! step that begins to fail before then (a task whose program is missing exits without a line) is ended,
//! and the spawn is answered with error code -1 for every process: MPI returns the error to the spawner.
//! A new srun that ends before its step exists (a step the allocation cannot hold now: `--immediate` does
//! not wait for busy resources) fails the spawn with its exit status; its own error is on the job's
//! stderr. With `--exact` a spawned step takes only the CPUs its tasks need, leaving the rest to later
//! spawns; the spawning step must leave some too (`srun --exact`, or `-c`).
//!
//! **Tied ends.** Once started, a spawned step that fails ends the step that spawned it, as the failure of
//! one of its own tasks would: the spawning tasks may be waiting for processes that are gone. A spawned
//! srun writes `failed NS` on its pipe when its root decides its step fails, else its non-zero exit says so.
//! The spawning step ending for an error ends the steps it spawned. srun waits at the end of its step for
//! every srun it started, and its exit code is that of the step that began to fail first (by the machine's
//! monotonic clock: both sruns run on it).
//!
//! **Trust.** All of this runs as the user, in the user's srun, inside the user's allocation: it shapes the
//! user's own steps only. The request is a task's, so it is bounded and checked before anything starts.

pub use super::options::ENV_SPAWN;
use crate::launch::{SpawnedJob, PMI_FAIL};
use crate::os::{Epoll, Start};
use crate::wire::SpawnRequest;
use std::ffi::{CStr, CString, OsStr};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::Arc;

/// The longest [`ENV_SPAWN`] value: an environment string must stay under Linux's 128 KiB.
pub const SPAWN_ENV_MAX: usize = 96 * 1024;
/// The most spawned sruns one step has running at once.
pub const SPAWNED_STEPS_MAX: usize = 128;
/// The fd a spawned srun finds its pipe on.
const PIPE_FD: RawFd = 3;
/// What srun's `--multi-prog` takes: arguments of a command (127 words with the program), bytes of a line
/// (under), bytes of the file.
const MULTI_PROG_ARGS_MAX: usize = 126;
const MULTI_PROG_LINE_MAX: usize = 16 * 1024;
const MULTI_PROG_BYTES_MAX: usize = 60000;

/// What a spawned step's tasks get beyond a step's own.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Spawn {
    /// The processes of each command and the preputs.
    pub job: SpawnedJob,
    /// In the spawned srun only: where it tells the spawning srun that its step exists.
    pub fd: Option<RawFd>,
}

impl Spawn {
    /// [`ENV_SPAWN`]'s value.
    pub fn encode(&self) -> String {
        let mut v = serde_json::json!({ "counts": self.job.counts, "preputs": self.job.preputs });
        if let Some(fd) = self.fd {
            v["fd"] = fd.into();
        }
        v.to_string()
    }

    /// Reads [`ENV_SPAWN`]'s value (the user's environment: checked as anything else).
    pub fn decode(text: &str) -> Result<Spawn, String> {
        if text.len() > SPAWN_ENV_MAX {
            return Err(format!("{ENV_SPAWN} has {} bytes, more than {SPAWN_ENV_MAX}", text.len()));
        }
        let bad = |what: &str| format!("{ENV_SPAWN} has no valid '{what}'");
        let v: serde_json::Value = serde_json::from_str(text).map_err(|_| bad("JSON"))?;
        let counts = v["counts"].as_array().ok_or_else(|| bad("counts"))?;
        let counts = counts
            .iter()
            .map(|c| c.as_u64().and_then(|c| u32::try_from(c).ok()).filter(|&c| c > 0).ok_or_else(|| bad("counts")))
            .collect::<Result<Vec<u32>, _>>()?;
        let pair = |p: &serde_json::Value| -> Option<(String, String)> {
            Some((p.get(0)?.as_str()?.to_string(), p.get(1)?.as_str()?.to_string()))
        };
        let preputs = v["preputs"].as_array().ok_or_else(|| bad("preputs"))?;
        let preputs = preputs.iter().map(|p| pair(p).ok_or_else(|| bad("preputs"))).collect::<Result<_, _>>()?;
        let fd = match &v["fd"] {
            serde_json::Value::Null => None,
            fd => Some(fd.as_u64().and_then(|f| RawFd::try_from(f).ok()).ok_or_else(|| bad("fd"))?),
        };
        if counts.is_empty() {
            return Err(bad("counts"));
        }
        Ok(Spawn { job: SpawnedJob { counts, preputs }, fd })
    }
}

/// In a spawned srun's root: tells the spawning srun, on `fd`, that this step began to fail now.
pub fn tell_failing(fd: RawFd) {
    tell(fd, &format!("failed {}\n", crate::os::monotonic_ns()));
}

/// In a spawned srun's root: tells the spawning srun, on `fd`, that every task of this step runs.
pub fn tell_started(fd: RawFd) {
    tell(fd, "started\n");
}

fn tell(fd: RawFd, line: &str) {
    // SAFETY: writes our buffer (a few bytes: atomic on a pipe) to the spawning srun's pipe; a failure only
    // means it is gone.
    unsafe { libc::write(fd, line.as_ptr().cast(), line.len()) };
}

/// In a spawned srun's prelaunch: tells the spawning srun that step `step` exists, and keeps the pipe open
/// (close-on-exec) until srun exits, which the spawning srun sees as its end.
pub fn tell_step(fd: RawFd, step: u32) -> Result<(), String> {
    // SAFETY: fstat into our buffer; a bad fd only fails.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if fd < PIPE_FD || unsafe { libc::fstat(fd, &mut st) } != 0 || st.st_mode & libc::S_IFMT != libc::S_IFIFO {
        return Err(format!("{ENV_SPAWN} names fd {fd}, which is no pipe of a spawning srun"));
    }
    // SAFETY: sets a flag on a pipe of ours.
    unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    let line = format!("{step}\n");
    // SAFETY: writes our buffer (a few bytes: atomic on a pipe).
    let n = unsafe { libc::write(fd, line.as_ptr().cast(), line.len()) };
    if n != line.len() as isize {
        return Err(format!("cannot tell the spawning srun that the step exists: {}", io::Error::last_os_error()));
    }
    Ok(())
}

/// The spawning task: where the answer goes, and the rank that names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Asker {
    pub node: u32,
    pub task: u32,
    pub rank: u32,
}

/// What a spawned srun did.
#[derive(Debug, PartialEq, Eq)]
pub enum SrunEvent {
    /// The spawn of `asker` is answered: the error code of every process (0: its step's tasks run, -1: its
    /// step failed before they did), or why no step was made.
    Answer { asker: Asker, result: Result<i32, String> },
    /// The step of a spawned srun began to fail (its srun says so as it ends it).
    Failing { rank: u32, step: u32 },
    /// A spawned srun whose step was made exited with `status` before all of its tasks ran, without saying
    /// why: the spawn was answered with error codes.
    Unstarted { rank: u32, step: u32, status: i32 },
    /// A spawned srun whose step had started exited with `status` (a shell's: 128 + signal); `failing_at`
    /// when its step began to fail, if it said so ([`now`]).
    Ended { rank: u32, step: u32, status: i32, failing_at: Option<u64> },
}

/// A spawned srun.
struct SpawnedSrun {
    pid: libc::pid_t,
    /// The read end of its pipe, until it closes.
    pipe: Option<OwnedFd>,
    /// Where it is, as its lines say.
    state: Started,
    /// The rank that spawned it.
    rank: u32,
    /// The `--multi-prog` file, kept until srun has exited (it reads the file again after its step starts).
    _conf: Option<ConfFile>,
    got: Vec<u8>,
    /// When its step began to fail ([`now`]), as it said.
    failing_at: Option<u64>,
}

/// How far a spawned srun got. The spawn is answered when it leaves `Asked` or `Made`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Started {
    /// Its step id has not come yet.
    Asked(Asker),
    /// Its step was made (this id); its tasks have not all run.
    Made(Asker, u32),
    /// Every task of its step ran (the spawn was answered with code 0): its step and the spawning one are
    /// tied from now on.
    Ran(u32),
    /// Its step failed before all of its tasks ran (answered with code -1): it ends on its own, untied.
    Unstarted(u32),
}

/// What srun needs to start spawned steps.
pub struct Setup {
    /// srun's own executable.
    pub srun: CString,
    /// The job the steps belong to.
    pub job: u32,
    /// srun's environment when the step started (`NAME=value` entries).
    pub env: Vec<CString>,
}

impl SpawnedSrun {
    /// Takes what its srun wrote (its step id, then `started` once its tasks run, `failed NS` when its step begins to fail); true once
    /// the pipe closed.
    fn take_lines(&mut self, events: &mut Vec<SrunEvent>) -> bool {
        let mut buf = [0u8; 64];
        loop {
            let Some(pipe) = &self.pipe else { return false };
            // SAFETY: reads into our buffer from our non-blocking pipe.
            let n = unsafe { libc::read(pipe.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            match n {
                0 => return true,
                n if n < 0 => return io::Error::last_os_error().kind() != io::ErrorKind::WouldBlock,
                n => self.got.extend_from_slice(&buf[..n as usize]),
            }
            while let Some(end) = self.got.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.got.drain(..=end).collect();
                self.line(std::str::from_utf8(&line[..end]).unwrap_or(""), events);
            }
            // Only short lines come from a spawned srun.
            if self.got.len() > 64 {
                self.got.clear();
            }
        }
    }

    /// One line of its srun: its step id first, then `started` once its tasks run, and `failed NS` when its
    /// step begins to fail; anything else (which its own srun would not write) is ignored.
    fn line(&mut self, line: &str, events: &mut Vec<SrunEvent>) {
        let failed = line.strip_prefix("failed ");
        match (self.state, line, failed) {
            (Started::Asked(asker), _, _) => {
                if let Ok(step) = line.parse() {
                    self.state = Started::Made(asker, step);
                }
            }
            (Started::Made(asker, step), "started", _) => {
                self.state = Started::Ran(step);
                events.push(SrunEvent::Answer { asker, result: Ok(0) });
            }
            // Its step is ended before all of its tasks ran: none of the processes counts as started.
            (Started::Made(asker, step), _, Some(_)) => {
                self.state = Started::Unstarted(step);
                events.push(SrunEvent::Answer { asker, result: Ok(PMI_FAIL) });
            }
            (Started::Ran(step), _, Some(at)) if self.failing_at.is_none() => {
                self.failing_at = Some(at.parse().unwrap_or_else(|_| crate::os::monotonic_ns()));
                events.push(SrunEvent::Failing { rank: self.rank, step });
            }
            _ => {}
        }
    }
}

/// The sruns a step's srun started, watched in the root's epoll set.
pub struct Launcher {
    setup: Setup,
    epoll: Arc<Epoll>,
    /// Tokens from here: `base + slot`.
    base: u64,
    children: Vec<Option<SpawnedSrun>>,
    started: u64,
}

impl Launcher {
    pub fn new(setup: Setup, epoll: Arc<Epoll>, base: u64) -> Launcher {
        Launcher { setup, epoll, base, children: Vec::new(), started: 0 }
    }

    pub fn job(&self) -> u32 {
        self.setup.job
    }

    /// Whether a spawned srun has exited but is not reaped yet (the root then looks again soon).
    pub fn reaping(&self) -> bool {
        self.children.iter().flatten().any(|c| c.pipe.is_none())
    }

    fn running(&self) -> usize {
        self.children.iter().flatten().count()
    }

    /// Starts the srun of `request`, which `asker` made; `Err` says why not (nothing was started).
    pub fn start(&mut self, asker: Asker, request: &str) -> Result<(), String> {
        if self.running() >= SPAWNED_STEPS_MAX {
            return Err(format!("{SPAWNED_STEPS_MAX} spawned steps run already, the most one step starts at once"));
        }
        let request = crate::abi::spawn_request(request.as_bytes()).map_err(|e| format!("a spawn request {e}"))?;
        let launch = Launch::of(&request)?;
        let (r, w) = crate::os::pipe().map_err(|e| format!("pipe: {e}"))?;
        let spawn = Spawn { fd: Some(PIPE_FD), ..launch.spawn.clone() };
        let conf = match &launch.multi_prog {
            Some(text) => Some(ConfFile::write(text)?),
            None => None,
        };
        let mut argv = vec![
            self.setup.srun.clone(),
            cstring(format!("--jobid={}", self.setup.job)),
            cstring("--mpi=rpmi".into()),
            cstring(format!("--ntasks={}", spawn.job.size())),
            // As few nodes as hold it: srun's default is every node of the allocation, some of which the
            // spawning step may fill.
            cstring(format!("--nodes=1-{}", spawn.job.size())),
            cstring("--immediate".into()),
            cstring("--exact".into()),
        ];
        argv.extend(launch.options.iter().map(|o| cstring(o.clone())));
        match &conf {
            Some(conf) => argv.extend([cstring("--multi-prog".into()), path_cstring(&conf.0)]),
            None => argv.extend(launch.program.iter().cloned()),
        }
        let mut env: Vec<CString> = self
            .setup
            .env
            .iter()
            .filter(|e| !launch.replaces(e) && !e.as_bytes().starts_with(ENV_SPAWN.as_bytes()))
            .cloned()
            .collect();
        env.push(cstring(format!("{ENV_SPAWN}={}", spawn.encode())));
        env.extend(launch.path.iter().map(|p| cstring(format!("PATH={p}"))));
        // Stdin from /dev/null (the spawning srun's tasks read its stdin), in srun's process group (a terminal's
        // signals reach both).
        let how = Start { own_group: false, default_signals: true };
        let pid = crate::os::start_linked(&self.setup.srun, &argv, Some(&env), &w, how)
            .map_err(|e| format!("cannot start srun for the spawned step: {e}"))?;
        drop(w);
        let slot = match self.children.iter().position(Option::is_none) {
            Some(s) => s,
            None => {
                self.children.push(None);
                self.children.len() - 1
            }
        };
        if let Err(e) = self.epoll.add(r.as_raw_fd(), libc::EPOLLIN as u32, self.base + slot as u64) {
            // SAFETY: ends and reaps our own child, which nobody else waits for.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, std::ptr::null_mut(), 0);
            }
            return Err(format!("cannot watch the srun of the spawned step: {e}"));
        }
        self.started += 1;
        self.children[slot] = Some(SpawnedSrun {
            pid,
            pipe: Some(r),
            state: Started::Asked(asker),
            rank: asker.rank,
            _conf: conf,
            got: Vec::new(),
            failing_at: None,
        });
        Ok(())
    }

    /// What the srun of `token` did: its lines ([`SpawnedSrun::take_lines`]), and the pipe's close when it exits.
    pub fn ready(&mut self, token: u64) -> Vec<SrunEvent> {
        let slot = (token - self.base) as usize;
        let Some(child) = self.children.get_mut(slot).and_then(Option::as_mut) else { return Vec::new() };
        let mut events = Vec::new();
        let closed = child.take_lines(&mut events);
        if closed {
            if let Some(pipe) = child.pipe.take() {
                let _ = self.epoll.remove(pipe.as_raw_fd());
            }
        }
        events.extend(self.reap(false));
        events
    }

    /// Reaps the sruns whose pipe closed (all of them, waiting, when `wait`).
    pub fn reap(&mut self, wait: bool) -> Vec<SrunEvent> {
        let mut events = Vec::new();
        for slot in self.children.iter_mut() {
            let Some(child) = slot else { continue };
            if child.pipe.is_some() && !wait {
                continue;
            }
            let mut status = 0;
            // SAFETY: waits for our own child.
            let pid = unsafe { libc::waitpid(child.pid, &mut status, if wait { 0 } else { libc::WNOHANG }) };
            let status = match pid {
                0 => continue,
                p if p == child.pid => shell_status(status),
                // Reaped by someone else (an srun that ignores SIGCHLD): its status is lost.
                _ => 0,
            };
            let Some(mut child) = slot.take() else { continue };
            // What it wrote before it exited is still in the pipe.
            child.take_lines(&mut events);
            if let Some(pipe) = &child.pipe {
                let _ = self.epoll.remove(pipe.as_raw_fd());
            }
            let (rank, failing_at) = (child.rank, child.failing_at);
            match child.state {
                Started::Asked(asker) => events.push(SrunEvent::Answer {
                    asker,
                    result: Err(format!(
                        "srun for the spawned step exited with status {status} before its step was made (srun's \
                         error is on the job's stderr)"
                    )),
                }),
                // Its step was made and is over before all of its tasks ran: none counts as started.
                Started::Made(asker, step) => {
                    events.push(SrunEvent::Answer { asker, result: Ok(PMI_FAIL) });
                    events.push(SrunEvent::Unstarted { rank, step, status });
                }
                Started::Ran(step) => events.push(SrunEvent::Ended { rank, step, status, failing_at }),
                Started::Unstarted(_) => {}
            }
        }
        events
    }

    /// Ends every spawned step: through `end_step` where its id is known, else by signalling its srun.
    pub fn end_all(&mut self, mut end_step: impl FnMut(u32)) {
        // One whose pipe closed is exiting already.
        for child in self.children.iter().flatten().filter(|c| c.pipe.is_some()) {
            match child.state {
                Started::Made(_, step) | Started::Ran(step) => end_step(step),
                // SAFETY: signals our own child, not reaped yet.
                Started::Asked(_) => unsafe {
                    libc::kill(child.pid, libc::SIGTERM);
                },
                // A step that failed before its tasks ran is ending already.
                Started::Unstarted(_) => {}
            }
        }
    }
}

/// A `--multi-prog` file of srun's user, only they can read, under a random name (another user cannot take
/// it first in a shared temporary directory); removed when dropped.
struct ConfFile(PathBuf);

impl ConfFile {
    fn write(text: &str) -> Result<ConfFile, String> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let random = crate::slurm::random::random().map_err(|e| format!("no random bytes for a file name: {e}"))?;
        let name: String = random[..8].iter().map(|b| format!("{b:02x}")).collect();
        let path = std::env::temp_dir().join(format!("rpmi-spawn-{name}.conf"));
        let cannot = |path: &PathBuf, e: io::Error| {
            format!("cannot write the spawned step's --multi-prog file {}: {e}", path.display())
        };
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| cannot(&path, e))?;
        let conf = ConfFile(path);
        f.write_all(text.as_bytes()).map_err(|e| cannot(&conf.0, e))?;
        Ok(conf)
    }
}

impl Drop for ConfFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// How srun is to start one spawn.
#[derive(Debug)]
struct Launch {
    spawn: Spawn,
    /// `--chdir`, `--nodelist`.
    options: Vec<String>,
    /// The program and its arguments, of a spawn of one command.
    program: Vec<CString>,
    /// The `--multi-prog` file's text, of several commands.
    multi_prog: Option<String>,
    /// The tasks' PATH (info `path`).
    path: Option<String>,
}

impl Launch {
    /// How srun starts `request`. Info keys: `wdir` (srun's `--chdir`), `path` (the tasks' PATH), `host` and
    /// `hosts` (`--nodelist`); a spawn of several commands is one step, which takes one of each. Others are
    /// ignored, as MPI lets a process manager do.
    fn of(request: &SpawnRequest) -> Result<Launch, String> {
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        let spawn = Spawn { job: SpawnedJob::of(request)?, fd: Some(PIPE_FD) };
        if spawn.encode().len() > SPAWN_ENV_MAX {
            return Err(format!("preputs of more than {SPAWN_ENV_MAX} bytes, the most srun --mpi=rpmi passes on"));
        }
        let mut infos: Vec<(&str, String)> = Vec::new();
        for (key, value) in request.commands.iter().flat_map(|c| &c.infos) {
            let key = match key.as_slice() {
                b"wdir" => "--chdir",
                b"path" => "PATH",
                b"host" | b"hosts" => "--nodelist",
                _ => continue,
            };
            let value = text(value);
            match infos.iter().find(|(k, _)| *k == key) {
                Some((_, v)) if *v != value => {
                    return Err(format!(
                        "the commands of one spawn ask for two values of {key}: srun --mpi=rpmi starts them as one step"
                    ))
                }
                Some(_) => {}
                None => infos.push((key, value)),
            }
        }
        if infos.iter().any(|(_, v)| v.is_empty() || v.contains('\0')) {
            return Err("an empty spawn info value".into());
        }
        let path = infos.iter().find(|(k, _)| *k == "PATH").map(|(_, v)| v.clone());
        let options = infos.iter().filter(|(k, _)| *k != "PATH").map(|(k, v)| format!("{k}={v}")).collect();
        for c in &request.commands {
            if c.execname.is_empty() || c.execname[0] == b'-' || c.execname.contains(&0) {
                return Err(format!("'{}' is no program srun can start", text(&c.execname)));
            }
            if c.args.iter().any(|a| a.contains(&0)) {
                return Err("an argument with a NUL byte".into());
            }
        }
        if let [one] = request.commands.as_slice() {
            // srun splits its arguments at a bare `:` wherever it stands (a heterogeneous step's separator): what
            // follows would be srun's options, chosen by the task, not its program's arguments.
            if one.execname == b":" || one.args.iter().any(|a| a == b":") {
                return Err("an argument ':' in a spawn: srun --mpi=rpmi starts it with srun, which reads a bare ':' \
                            as the separator of a heterogeneous step"
                    .into());
            }
            let program = std::iter::once(&one.execname).chain(&one.args).map(|a| cstring(text(a))).collect();
            return Ok(Launch { spawn, options, program, multi_prog: None, path });
        }
        // One line per command: `first-last program args...`. srun's parser splits a line at white space
        // outside single quotes, keeps what is inside them as it is, and takes `\'` for a quote; a word that
        // needs none goes as it is (srun looks the program word up as it stands when a site asks it to check
        // programs). srun takes at most 127 words a line (it drops the rest), lines under 16 KiB and a file
        // of 60000 bytes; a line break cannot go through, nor, here, an empty word.
        let mut conf = String::new();
        let mut first = 0u64;
        for c in &request.commands {
            if c.args.len() > MULTI_PROG_ARGS_MAX {
                return Err(format!(
                    "a command of {} arguments in a spawn of several commands: srun's --multi-prog passes at most \
                     {MULTI_PROG_ARGS_MAX}",
                    c.args.len()
                ));
            }
            let last = first + u64::from(c.nprocs) - 1;
            let mut line = format!("{first}-{last}");
            for word in std::iter::once(&c.execname).chain(&c.args) {
                if word.is_empty() || word.iter().any(|b| b"\n\r".contains(b)) {
                    return Err(format!(
                        "an empty argument, or one with a line break, in a spawn of several commands: srun \
                         --mpi=rpmi starts them with srun's --multi-prog, which cannot pass it ('{}')",
                        text(word).escape_debug()
                    ));
                }
                let word = text(word);
                match word.bytes().any(|b| b.is_ascii_whitespace() || b"'\"\\%#".contains(&b)) {
                    true => line.push_str(&format!(" '{}'", word.replace('\'', "'\\''"))),
                    false => line.push_str(&format!(" {word}")),
                }
            }
            if line.len() >= MULTI_PROG_LINE_MAX {
                return Err(format!(
                    "a command of {} bytes in a spawn of several commands: srun's --multi-prog \
                     takes lines under {MULTI_PROG_LINE_MAX}",
                    line.len()
                ));
            }
            conf.push_str(&line);
            conf.push('\n');
            first = last + 1;
        }
        if conf.len() > MULTI_PROG_BYTES_MAX {
            return Err(format!(
                "a spawn of several commands of {} bytes: srun's --multi-prog takes at most {MULTI_PROG_BYTES_MAX}",
                conf.len()
            ));
        }
        Ok(Launch { spawn, options, program: Vec::new(), multi_prog: Some(conf), path })
    }

    /// Whether srun's environment entry `entry` is one this launch sets anew: the PATH of an info `path`.
    fn replaces(&self, entry: &CStr) -> bool {
        self.path.is_some() && entry.to_bytes().starts_with(b"PATH=")
    }
}

fn cstring(s: String) -> CString {
    CString::new(s).unwrap_or_default()
}

fn path_cstring(p: &std::path::Path) -> CString {
    CString::new(OsStr::as_bytes(p.as_os_str())).unwrap_or_default()
}

/// A wait status as a shell shows it.
fn shell_status(status: libc::c_int) -> i32 {
    if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else if libc::WIFSIGNALED(status) {
        128 + libc::WTERMSIG(status)
    } else {
        1
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::SpawnCommand;

    fn command(n: u32, program: &str, args: &[&str]) -> SpawnCommand {
        SpawnCommand {
            nprocs: n,
            execname: program.into(),
            args: args.iter().map(|a| a.as_bytes().to_vec()).collect(),
            preputs: vec![(b"PARENT_ROOT_PORT_NAME".to_vec(), b"tag#0$x$".to_vec())],
            infos: vec![],
        }
    }

    #[test]
    fn spawn_round_trips() {
        let job = SpawnedJob { counts: vec![2, 3], preputs: vec![("k".into(), "v w".into())] };
        let s = Spawn { job, fd: Some(3) };
        assert_eq!(Spawn::decode(&s.encode()), Ok(s.clone()));
        let without = Spawn { fd: None, ..s.clone() };
        assert_eq!(Spawn::decode(&without.encode()), Ok(without));
        for bad in [
            "",
            "{}",
            r#"{"counts":[0],"preputs":[]}"#,
            r#"{"counts":[],"preputs":[]}"#,
            r#"{"counts":[1],"preputs":[["k"]]}"#,
            r#"{"counts":[1],"preputs":[],"fd":-1}"#,
        ] {
            assert!(Spawn::decode(bad).is_err(), "{bad}");
        }
        assert!(Spawn::decode(&" ".repeat(SPAWN_ENV_MAX + 1)).unwrap_err().contains("more than"));
    }

    /// srun reads a bare `:` as a separator even after the program: a task cannot hand srun options so.
    #[test]
    fn a_bare_colon_is_refused() {
        for c in [command(1, "./child", &[":", "--mpi=none", "./other"]), command(1, ":", &["--mpi=none"])] {
            let e = Launch::of(&SpawnRequest { commands: vec![c] }).unwrap_err();
            assert!(e.contains("an argument ':'"), "{e}");
        }
        // Inside an argument, or in a spawn of several commands (a --multi-prog file), it is plain text.
        assert!(Launch::of(&SpawnRequest { commands: vec![command(1, "./child", &["a:b", "::"])] }).is_ok());
        let two = vec![command(1, "./a", &[":"]), command(1, "./b", &[])];
        assert!(Launch::of(&SpawnRequest { commands: two }).is_ok());
    }

    #[test]
    fn one_command_is_srun_with_its_program() {
        let mut c = command(3, "./child", &["-v", "a b"]);
        c.infos = vec![(b"wdir".to_vec(), b"/tmp".to_vec()), (b"path".to_vec(), b"/opt/bin".to_vec())];
        let l = Launch::of(&SpawnRequest { commands: vec![c] }).unwrap();
        assert_eq!(l.options, ["--chdir=/tmp"]);
        assert_eq!(l.path.as_deref(), Some("/opt/bin"));
        assert_eq!(l.program, [c"./child".to_owned(), c"-v".to_owned(), c"a b".to_owned()]);
        assert_eq!(l.spawn.job.counts, [3]);
        assert_eq!(l.spawn.job.preputs, [("PARENT_ROOT_PORT_NAME".to_string(), "tag#0$x$".to_string())]);
    }

    #[test]
    fn several_commands_are_one_multi_prog_step() {
        let l =
            Launch::of(&SpawnRequest { commands: vec![command(2, "./a", &["x"]), command(1, "./b", &[])] }).unwrap();
        assert_eq!(l.multi_prog.as_deref(), Some("0-1 ./a x\n2-2 ./b\n"));
        assert_eq!(l.spawn.job.counts, [2, 1]);
        let words =
            SpawnRequest { commands: vec![command(1, "./a", &["two words", "it's", "%t"]), command(1, "./b", &[])] };
        assert_eq!(
            Launch::of(&words).unwrap().multi_prog.as_deref(),
            Some("0-0 ./a 'two words' 'it'\\''s' '%t'\n1-1 ./b\n")
        );
        let many = vec!["x"; MULTI_PROG_ARGS_MAX + 1];
        let r = SpawnRequest { commands: vec![command(1, "./a", &many), command(1, "./b", &[])] };
        assert!(Launch::of(&r).unwrap_err().contains("at most 126"));
        let long = "x".repeat(MULTI_PROG_LINE_MAX);
        let r = SpawnRequest { commands: vec![command(1, "./a", &[&long]), command(1, "./b", &[])] };
        assert!(Launch::of(&r).unwrap_err().contains("lines under"));
        for word in ["a\nb", ""] {
            let r = SpawnRequest { commands: vec![command(1, "./a", &[word]), command(1, "./b", &[])] };
            assert!(Launch::of(&r).unwrap_err().contains("--multi-prog"), "{word:?}");
        }
    }

    #[test]
    fn spawns_srun_cannot_start_are_refused() {
        let refused = |commands| Launch::of(&SpawnRequest { commands }).unwrap_err();
        assert!(refused(vec![]).contains("no processes"));
        assert!(refused(vec![command(0, "./a", &[])]).contains("no processes"));
        assert!(refused(vec![command(65537, "./a", &[])]).contains("more than"));
        assert!(refused(vec![command(1, "--uid=0", &[])]).contains("no program"));
        let mut a = command(1, "./a", &[]);
        let mut b = command(1, "./b", &[]);
        a.infos = vec![(b"wdir".to_vec(), b"/x".to_vec())];
        b.infos = vec![(b"wdir".to_vec(), b"/y".to_vec())];
        assert!(refused(vec![a.clone(), b.clone()]).contains("two values"));
        b.preputs = vec![(b"PARENT_ROOT_PORT_NAME".to_vec(), b"other".to_vec())];
        b.infos.clear();
        assert!(refused(vec![a.clone(), b]).contains("two values"));
        a.preputs = vec![(b"k".to_vec(), "v".repeat(SPAWN_ENV_MAX).into_bytes())];
        assert!(refused(vec![a]).contains("bytes"));
    }

    /// What a spawned srun's lines `lines` make of a spawn of rank 4.
    fn lines(lines: &[&str]) -> (Vec<SrunEvent>, SpawnedSrun) {
        let asker = Asker { node: 1, task: 0, rank: 4 };
        let mut child = SpawnedSrun {
            pid: 0,
            pipe: None,
            state: Started::Asked(asker),
            rank: 4,
            _conf: None,
            got: Vec::new(),
            failing_at: None,
        };
        let mut events = Vec::new();
        for line in lines {
            child.line(line, &mut events);
        }
        (events, child)
    }

    #[test]
    fn a_spawn_is_answered_once_and_tied_only_after_its_tasks_ran() {
        let asker = Asker { node: 1, task: 0, rank: 4 };
        let (ran, unstarted) =
            (SrunEvent::Answer { asker, result: Ok(0) }, SrunEvent::Answer { asker, result: Ok(PMI_FAIL) });
        let (events, child) = lines(&["7", "started", "failed 12", "failed 13", "started"]);
        assert_eq!(events, [ran, SrunEvent::Failing { rank: 4, step: 7 }]);
        assert_eq!((child.state, child.failing_at), (Started::Ran(7), Some(12)));
        // Failing before its tasks ran: -1 codes, and no tie then or later.
        let (events, child) = lines(&["7", "failed 1", "failed 2", "started"]);
        assert_eq!(events, [unstarted]);
        assert_eq!(child.state, Started::Unstarted(7));
        // A first line that is no step id is ignored; a failure time that is no number still ties, once.
        let (events, child) = lines(&["junk", "8", "started", "failed x", "failed 3"]);
        assert_eq!(events, [SrunEvent::Answer { asker, result: Ok(0) }, SrunEvent::Failing { rank: 4, step: 8 }]);
        assert!(child.failing_at.is_some_and(|t| t > 3));
        // Nothing answers a spawn whose step id has not come.
        assert_eq!(lines(&["started", "failed 1"]).0, []);
    }
}

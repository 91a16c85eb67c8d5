//! Name service and spawn for a launch of rpmi-run: the first job and every job spawned from it (at any
//! depth) form one launch, as under mpiexec.
//!
//! Every rpmi-run of a launch runs a *launcher* thread, with a socketpair to each of its job's virtual nodes
//! (whose shell forwards its tasks' publish, unpublish, lookup and spawn requests on it, see [`NodeLink`])
//! and one to its own main thread. The first rpmi-run's launcher serves every request of the launch: it
//! holds the name table, and starts each spawned job as an rpmi-run of its own (`rpmi-run --spawned-job FD`)
//! with a socketpair to it, on which it sends the job ([`JOB`]) and hears the spawn's answer ([`STARTED`]),
//! the requests of that job's nodes, and its status ([`EXIT`]). A spawned rpmi-run's launcher only relays:
//! its nodes' requests up, the answers and the order to end down.
//!
//! The jobs' ends are tied as Hydra ties them: a job that ends with a non-zero status (a task's PMI_Abort,
//! a task that failed, a job error) ends every other job of the launch ([`END`]), whose tasks are then
//! killed; the launch's status is that of the failed job that began to end first (a parent whose child
//! aborts often fails in turn), else 0, and the first rpmi-run exits only once every job of the launch has
//! ended.

use crate::conn::{self, Conn, Heard};
use crate::job::{App, Job};
use rpmi::launch::SpawnedJob;
use rpmi::os::Start;
use rpmi::server::{NameOp, Names};
use rpmi::wire::SpawnRequest;
use rpmi_core::codec::{FrameReader, FrameWriter};
use std::ffi::OsString;
use std::ffi::{CStr, CString};
use std::io;
use std::os::unix::ffi::OsStringExt;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// Node (or spawned rpmi-run) to launcher: a task's request: node (u32 LE), task (u32 LE), [`Service`] (one
/// byte), then the service's text (for publish `service NUL port`; for spawn the plugin's JSON).
pub const REQUEST: u8 = 10;
/// Launcher to node (or to a spawned rpmi-run): the answer: node, task, ok (one byte), then the port of a
/// lookup, the error codes of a spawn, or why it failed.
pub const REPLY: u8 = 11;
/// Launcher to node, and first rpmi-run to spawned: the launch ends with this status (i32 LE): end the job.
pub const END: u8 = 12;
/// First rpmi-run to spawned: the job to run ([`Job`] as JSON), the first frame it sends.
pub const JOB: u8 = 13;
/// Spawned rpmi-run to first: the spawn's answer: ok (one byte), then the error codes or why it failed.
pub const STARTED: u8 = 14;
/// Main thread to its launcher, and spawned rpmi-run to first: the job has ended: its status (i32 LE) and
/// when it began to end (u64 LE, `rpmi::os::monotonic_ns`; all ones if nothing ended it), see [`exit_payload`].
pub const EXIT: u8 = 15;
/// Launcher to its main thread: every job of the launch has ended; the launch's status (i32 LE).
pub const FINAL: u8 = 16;

/// The longest frame between rpmi-run's own processes: a spawn's request or job, bounded by the plugin's
/// `spawn_bytes_max` (256 KiB by default), JSON-escaped.
pub const FRAME_MAX: usize = 16 << 20;
/// At most this many spawned jobs run at once in a launch: a program that spawns itself without end is
/// stopped.
const SPAWNED_JOBS_MAX: usize = 1024;

/// The service a task asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Service {
    Publish = 0,
    Unpublish = 1,
    Lookup = 2,
    Spawn = 3,
}

impl Service {
    /// What it asks of the name table, unless it is a spawn.
    fn name_op(self) -> Option<NameOp> {
        match self {
            Service::Publish => Some(NameOp::Publish),
            Service::Unpublish => Some(NameOp::Unpublish),
            Service::Lookup => Some(NameOp::Lookup),
            Service::Spawn => None,
        }
    }

    fn from_byte(b: u8) -> Option<Service> {
        [Service::Publish, Service::Unpublish, Service::Lookup, Service::Spawn].into_iter().find(|&s| s as u8 == b)
    }
}

/// A request's or a reply's head: node, task, one byte; then the text.
fn addressed(node: u32, task: u32, byte: u8, text: &[u8]) -> Vec<u8> {
    let mut payload = FrameWriter::with_capacity(9 + text.len());
    payload.u32_le(node).u32_le(task).u8(byte).bytes(text);
    payload.into_vec()
}

/// Reads what [`addressed`] made: node, task, the byte, the text.
fn read_addressed(payload: &[u8]) -> Option<(u32, u32, u8, &[u8])> {
    let mut r = FrameReader::new(payload);
    Some((r.u32_le().ok()?, r.u32_le().ok()?, r.u8().ok()?, r.rest()))
}

/// How a job (or a node's part of it) ended: its status, and when it began to end, if it was ended (of the
/// jobs of a launch that fail, the one that began to end first gives the status).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ended {
    pub status: i32,
    pub began: Option<u64>,
}

/// An EXIT's payload.
pub fn exit_payload(ended: Ended) -> Vec<u8> {
    let mut payload = FrameWriter::with_capacity(12);
    payload.i32_le(ended.status).u64_le(ended.began.unwrap_or(u64::MAX));
    payload.into_vec()
}

fn read_exit(payload: &[u8]) -> Ended {
    let mut r = FrameReader::new(payload);
    let status = r.i32_le().unwrap_or(1);
    Ended { status, began: r.u64_le().ok().filter(|&b| b != u64::MAX) }
}

fn status_frame(status: i32) -> Arc<Vec<u8>> {
    Arc::new(status.to_le_bytes().to_vec())
}

/// A status (1 if it is missing).
fn read_status(payload: &[u8]) -> i32 {
    FrameReader::new(payload).i32_le().unwrap_or(1)
}

// ---------------------------------------------------------------------------------------------------------
// The node's side.

/// A virtual node's way to its launcher: its shell sends its tasks' requests on it, and a thread of its own
/// hands the answers to the plugin (`service_complete` may be called from any thread) and ends the job when
/// the launch ends.
pub struct NodeLink {
    node: u32,
    writer: Mutex<UnixStream>,
    reader: Mutex<Option<UnixStream>>,
}

impl NodeLink {
    fn new(node: u32, stream: UnixStream) -> io::Result<NodeLink> {
        let reader = stream.try_clone()?;
        Ok(NodeLink { node, writer: Mutex::new(stream), reader: Mutex::new(Some(reader)) })
    }

    /// Sends task `task`'s request. `Err` says why it was not: a request too large to pass on (the link
    /// stays usable), or the launcher has gone.
    pub fn request(&self, task: u32, service: Service, text: &[u8]) -> Result<(), String> {
        // The spawned job's description carries the request again, JSON-escaped: half the frame is the most.
        if text.len() > FRAME_MAX / 2 {
            return Err(format!("a request of {} bytes, more than rpmi-run passes on ({})", text.len(), FRAME_MAX / 2));
        }
        let payload = addressed(self.node, task, service as u8, text);
        let sent = self.writer.lock().is_ok_and(|mut s| conn::write_frame(&mut *s, REQUEST, &payload).is_ok());
        sent.then_some(()).ok_or_else(|| "rpmi-run's launcher has gone".into())
    }

    /// Reads what the launcher sends until it goes: each answer to `answer(task, ok, text)`, an order to
    /// end to `end(status)`. Runs once, on a thread of its own.
    pub fn serve(&self, answer: impl Fn(u32, bool, &[u8]), end: impl Fn(i32)) {
        let Some(mut reader) = self.reader.lock().ok().and_then(|mut r| r.take()) else { return };
        while let Ok(Some((kind, payload))) = conn::read_frame(&mut reader, FRAME_MAX) {
            match kind {
                REPLY => {
                    if let Some((_, task, ok, text)) = read_addressed(&payload) {
                        answer(task, ok != 0, text);
                    }
                }
                END => end(read_status(&payload)),
                _ => {}
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// Setting up, from the main thread.

/// The launcher's sockets, made before the job's virtual nodes are forked, and the main thread's way to it.
pub struct Launch {
    /// Each node's end, until it is taken by its node's shell.
    node_ends: Mutex<Vec<Option<UnixStream>>>,
    /// What the launcher thread runs on, until it starts.
    launcher: Mutex<Option<Launcher>>,
    /// The main thread's end of its socketpair to the launcher.
    control: Mutex<Option<UnixStream>>,
    /// The rpmi-runs of spawned jobs, for passing signals on.
    spawned_runs: Arc<Mutex<Vec<libc::pid_t>>>,
}

impl Launch {
    /// The launch of `job` over `nodes` virtual nodes; `up`: the link to the first rpmi-run, for a spawned
    /// job. Call it before any thread exists (the nodes are forked after it).
    pub fn new(job: &Job, nodes: usize, up: Option<UnixStream>) -> io::Result<Launch> {
        let mut node_ends = Vec::with_capacity(nodes);
        let mut conns: Vec<Option<Conn>> = Vec::with_capacity(nodes + 2);
        let mut sources = Vec::with_capacity(nodes + 2);
        for _ in 0..nodes {
            let (ours, theirs) = UnixStream::pair()?;
            conns.push(Some(Conn::new(ours)?));
            sources.push(Source::Node);
            node_ends.push(Some(theirs));
        }
        let (ours, control) = UnixStream::pair()?;
        conns.push(Some(Conn::new(ours)?));
        sources.push(Source::Control);
        let spawned_runs = Arc::new(Mutex::new(Vec::new()));
        let role = match up {
            Some(up) => {
                conns.push(Some(Conn::new(up)?));
                sources.push(Source::Up);
                Role::Relay
            }
            None => Role::First(Box::new(First {
                names: Names::new(),
                template: job.clone(),
                exe: CString::new(std::env::current_exe()?.into_os_string().into_vec())
                    .map_err(|_| io::Error::other("rpmi-run's path holds a NUL"))?,
                jobs: 0,
                spawned_runs: spawned_runs.clone(),
            })),
        };
        let launcher = Launcher { conns, sources, role, nodes, job: None, failure: None, ending: None };
        Ok(Launch {
            node_ends: Mutex::new(node_ends),
            launcher: Mutex::new(Some(launcher)),
            control: Mutex::new(Some(control)),
            spawned_runs,
        })
    }

    /// Node `index`'s end. In a node's own process (`forked`), everything else of the launch is closed there,
    /// so that each connection ends when the process at either end does.
    pub fn node_link(&self, index: usize, forked: bool) -> Option<NodeLink> {
        let mut ends = self.node_ends.lock().ok()?;
        let mine = ends.get_mut(index)?.take();
        if forked {
            ends.clear();
            drop(self.launcher.lock().ok()?.take());
            drop(self.control.lock().ok()?.take());
        }
        mine.and_then(|stream| NodeLink::new(index as u32, stream).ok())
    }

    /// Starts the launcher thread, once the nodes that are processes of their own have been forked (and
    /// have taken their ends: the copies here are closed).
    pub fn start(&self, nodes_forked: bool) {
        if nodes_forked {
            if let Ok(mut ends) = self.node_ends.lock() {
                ends.clear();
            }
        }
        if let Some(launcher) = self.launcher.lock().ok().and_then(|mut l| l.take()) {
            std::thread::spawn(move || launcher.run());
        }
    }

    /// The rpmi-runs of the spawned jobs running now.
    pub fn spawned_runs(&self) -> Arc<Mutex<Vec<libc::pid_t>>> {
        self.spawned_runs.clone()
    }

    /// The job has ended: waits until every job of the launch has, and returns the launch's status (a
    /// spawned rpmi-run's own, once it has told the first).
    pub fn finish(&self, ended: Ended) -> i32 {
        let status = ended.status;
        let Some(mut control) = self.control.lock().ok().and_then(|mut c| c.take()) else { return status };
        if conn::write_frame(&mut control, EXIT, &exit_payload(ended)).is_err() {
            return status;
        }
        loop {
            match conn::read_frame(&mut control, 64) {
                Ok(Some((FINAL, payload))) => return read_status(&payload),
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => return status,
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// The launcher thread.

/// Who is at the other end of one of the launcher's connections.
#[derive(Debug)]
enum Source {
    /// A virtual node of this rpmi-run's job (its index is its connection's).
    Node,
    /// This rpmi-run's main thread.
    Control,
    /// The first rpmi-run (in a spawned one).
    Up,
    /// The rpmi-run of spawned job `job` (in the first).
    Spawned(Spawned),
}

#[derive(Debug)]
struct Spawned {
    job: u32,
    pid: libc::pid_t,
    /// Who waits for the spawn's answer, until it comes.
    waiting: Option<Requester>,
    /// How it ended, once it said it.
    exit: Option<Ended>,
}

/// A task waiting for an answer: on which connection, and its node and local index there.
#[derive(Debug, Clone, Copy)]
struct Requester {
    source: usize,
    node: u32,
    task: u32,
}

/// What the first rpmi-run's launcher holds for the whole launch.
struct First {
    /// Published names.
    names: Names,
    /// The first job: what a spawned job inherits (nodes, options, plugin...).
    template: Job,
    /// rpmi-run itself, which runs each spawned job.
    exe: CString,
    /// Jobs spawned so far.
    jobs: u32,
    /// The rpmi-runs of the spawned jobs running now (shared with the signal forwarding).
    spawned_runs: Arc<Mutex<Vec<libc::pid_t>>>,
}

enum Role {
    First(Box<First>),
    /// A spawned rpmi-run's: requests go up, answers come down.
    Relay,
}

struct Launcher {
    /// One per source; `None` once a spawned job's has ended (closed, so that spawns in turn do not use up
    /// the fds).
    conns: Vec<Option<Conn>>,
    sources: Vec<Source>,
    role: Role,
    /// Connections `0..nodes` are this job's nodes.
    nodes: usize,
    /// How this job ended, once the main thread has said it.
    job: Option<Ended>,
    /// The job of the launch that failed and began to end first, of those heard of: its status gives the
    /// launch's (a job that fails makes the others fail too, and their news may come first).
    failure: Option<Ended>,
    /// The launch is ending with this status: no more spawns.
    ending: Option<i32>,
}

impl Launcher {
    fn run(mut self) {
        loop {
            // Only the open connections: poll refuses more fds than the process may open (EINVAL), and a
            // launch that spawns in turn leaves many closed.
            let open: Vec<(usize, libc::pollfd)> =
                self.conns.iter().enumerate().filter_map(|(i, c)| Some((i, c.as_ref()?.pollfd()))).collect();
            let mut fds: Vec<libc::pollfd> = open.iter().map(|&(_, fd)| fd).collect();
            // SAFETY: poll over our own array.
            if unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) } < 0 {
                continue;
            }
            for (&(i, _), fd) in open.iter().zip(&fds) {
                if let Some(conn) = self.conns[i].as_mut().filter(|_| fd.revents != 0) {
                    conn.flush();
                    self.hear(i);
                }
            }
            if self.done() {
                return;
            }
        }
    }

    /// Whether the launch is over for this launcher: it has told its main thread the launch's status.
    fn done(&mut self) -> bool {
        let Some(job) = self.job else { return false };
        if self.spawned_running() > 0 {
            return false;
        }
        let launch = match self.role {
            Role::First(_) => self.failure.map_or(0, |f| f.status),
            Role::Relay => job.status,
        };
        let control = self.source(|s| matches!(s, Source::Control));
        let up = self.source(|s| matches!(s, Source::Up));
        if let Some(up) = up {
            self.send(up, EXIT, Arc::new(exit_payload(job)));
        }
        if let Some(control) = control {
            self.send(control, FINAL, status_frame(launch));
        }
        // What is queued still goes out before the thread ends.
        for conn in self.conns.iter_mut().flatten().filter(|c| c.sending() && c.open()) {
            let mut fd = [conn.pollfd()];
            // SAFETY: poll over our own array, for at most a second per connection.
            while conn.sending() && conn.open() && unsafe { libc::poll(fd.as_mut_ptr(), 1, 1000) } > 0 {
                conn.flush();
            }
        }
        true
    }

    /// Spawned jobs whose connection has not ended (it is closed when it does).
    fn spawned_running(&self) -> usize {
        self.sources.iter().zip(&self.conns).filter(|(s, c)| matches!(s, Source::Spawned(_)) && c.is_some()).count()
    }

    fn source(&self, which: impl Fn(&Source) -> bool) -> Option<usize> {
        self.sources.iter().position(which)
    }

    /// Queues a frame on connection `i`; false if it is closed or gone.
    fn send(&mut self, i: usize, kind: u8, payload: Arc<Vec<u8>>) -> bool {
        self.conns.get_mut(i).and_then(Option::as_mut).is_some_and(|c| c.send(kind, payload))
    }

    fn hear(&mut self, i: usize) {
        loop {
            let Some(conn) = self.conns[i].as_mut() else { return };
            match conn.receive(|_| FRAME_MAX) {
                Heard::Frame(kind, payload) => self.frame(i, kind, &payload),
                Heard::Pending => return,
                Heard::Ended | Heard::TooLong { .. } => return self.ended(i),
            }
        }
    }

    fn frame(&mut self, i: usize, kind: u8, payload: &[u8]) {
        match (&self.sources[i], kind) {
            (Source::Node | Source::Spawned(_), REQUEST) => match read_addressed(payload) {
                Some((node, task, service, text)) => {
                    let from = Requester { source: i, node, task };
                    match Service::from_byte(service) {
                        Some(service) => self.request(from, service, text),
                        None => self.reply(from, Err("an unknown service".into())),
                    }
                }
                None => say!("a malformed request between rpmi-run's own processes"),
            },
            (Source::Up, REPLY) => {
                if let Some((node, ..)) = read_addressed(payload) {
                    if (node as usize) < self.nodes {
                        self.send(node as usize, REPLY, Arc::new(payload.to_vec()));
                    }
                }
            }
            (Source::Up, END) => self.end_launch(read_status(payload)),
            (Source::Control, EXIT) => {
                let job = read_exit(payload);
                self.job = Some(job);
                self.failed(job);
            }
            (Source::Spawned(_), STARTED) => {
                if let Source::Spawned(s) = &mut self.sources[i] {
                    if let Some(from) = s.waiting.take() {
                        let mut r = FrameReader::new(payload);
                        let ok = r.u8() == Ok(1);
                        let text = String::from_utf8_lossy(r.rest()).into_owned();
                        self.reply(from, if ok { Ok(text) } else { Err(text) });
                    }
                }
            }
            (Source::Spawned(_), EXIT) => {
                let job = read_exit(payload);
                if let Source::Spawned(s) = &mut self.sources[i] {
                    s.exit = Some(job);
                }
                self.failed(job);
            }
            _ => {}
        }
    }

    /// Connection `i` has ended.
    fn ended(&mut self, i: usize) {
        match &mut self.sources[i] {
            Source::Up => {
                if self.ending.is_none() {
                    say!("the rpmi-run that spawned this job has gone; ending it");
                    self.end_launch(1);
                }
            }
            Source::Spawned(s) => {
                let (job, pid, waiting) = (s.job, s.pid, s.waiting.take());
                let died = s.exit.is_none();
                if died {
                    // Its own tasks (of a one-node job) are in its process group; a node's shell ends its
                    // own when it loses its coordinator.
                    // SAFETY: SIGKILL to the process group of our own child.
                    unsafe { libc::kill(-pid, libc::SIGKILL) };
                }
                // SAFETY: waitpid on our own child into a local; a parent that reaps every child (a one-node
                // shell waiting for its tasks) may have reaped it already.
                unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
                if let Role::First(first) = &self.role {
                    if let Ok(mut pids) = first.spawned_runs.lock() {
                        pids.retain(|&p| p != pid);
                    }
                }
                if let Some(from) = waiting {
                    self.reply(from, Err(format!("the rpmi-run of spawned job {job} ended before it started")));
                }
                self.conns[i] = None;
                if died {
                    say!("the rpmi-run of spawned job {job} died");
                    self.failed(Ended { status: 1, began: Some(rpmi::os::monotonic_ns()) });
                }
            }
            Source::Node | Source::Control => {}
        }
    }

    /// A job of the launch ended as `job` says: if it failed, the launch ends.
    fn failed(&mut self, job: Ended) {
        if job.status == 0 {
            return;
        }
        let began = |e: &Ended| e.began.unwrap_or(u64::MAX);
        if self.failure.is_none_or(|f| began(&job) < began(&f)) {
            self.failure = Some(job);
        }
        self.end_launch(job.status);
    }

    /// Every job of the launch ends: each node of this job and each spawned rpmi-run is told so.
    fn end_launch(&mut self, status: i32) {
        if self.ending.is_some() {
            return;
        }
        self.ending = Some(status);
        for (source, conn) in self.sources.iter().zip(self.conns.iter_mut()) {
            if let Some(conn) = conn.as_mut().filter(|_| matches!(source, Source::Node | Source::Spawned(_))) {
                conn.send(END, status_frame(status));
            }
        }
    }

    fn reply(&mut self, to: Requester, answer: Result<String, String>) {
        let (ok, text) = match answer {
            Ok(text) => (1, text),
            Err(why) => (0, why),
        };
        let payload = addressed(to.node, to.task, ok, text.as_bytes());
        self.send(to.source, REPLY, Arc::new(payload));
    }

    fn request(&mut self, from: Requester, service: Service, text: &[u8]) {
        if let Role::Relay = self.role {
            let up = self.source(|s| matches!(s, Source::Up));
            let payload = addressed(from.node, from.task, service as u8, text);
            if !up.is_some_and(|up| self.send(up, REQUEST, Arc::new(payload))) {
                self.reply(from, Err("the rpmi-run that spawned this job has gone".into()));
            }
            return;
        }
        if let Some(status) = self.ending {
            return self.reply(from, Err(format!("the launch is ending (status {status})")));
        }
        let text = String::from_utf8_lossy(text);
        let answer = match service.name_op() {
            Some(op) => {
                // A publish's text is `name NUL port`.
                let (name, port) = text.split_once('\0').unwrap_or((&text, ""));
                self.names().serve(op, name, port)
            }
            None => match self.spawn(from, text.as_bytes()) {
                // Answered when the spawned rpmi-run says it has started.
                Ok(()) => return,
                Err(why) => Err(why),
            },
        };
        self.reply(from, answer);
    }

    fn first(&mut self) -> &mut First {
        match &mut self.role {
            Role::First(first) => first,
            Role::Relay => unreachable!("only the first rpmi-run's launcher serves requests"),
        }
    }

    fn names(&mut self) -> &mut Names {
        &mut self.first().names
    }

    /// Starts the rpmi-run of the job `request` (the plugin's JSON) asks for.
    fn spawn(&mut self, from: Requester, request: &[u8]) -> Result<(), String> {
        if self.spawned_running() >= SPAWNED_JOBS_MAX {
            return Err(format!("{SPAWNED_JOBS_MAX} spawned jobs run already, the most rpmi-run runs at once"));
        }
        let first = self.first();
        let request: SpawnRequest = rpmi::abi::spawn_request(request).map_err(|e| format!("a spawn request {e}"))?;
        let mut job = job_of_spawn(&first.template, &request)?;
        let number = first.jobs + 1;
        job.job_id = format!("{}.{number}", first.template.job_id);
        let connect = |e: io::Error| format!("cannot connect a spawned job: {e}");
        let (ours, theirs) = UnixStream::pair().map_err(connect)?;
        let mut conn = Conn::new(ours).map_err(connect)?;
        let pid = start_rpmi_run(&first.exe, &theirs)
            .map_err(|e| format!("cannot start rpmi-run for the spawned job: {e}"))?;
        drop(theirs);
        first.jobs = number;
        if let Ok(mut pids) = first.spawned_runs.lock() {
            pids.push(pid);
        }
        conn.send(JOB, Arc::new(job.to_json()));
        self.conns.push(Some(conn));
        let spawned = Spawned { job: number, pid, waiting: Some(from), exit: None };
        self.sources.push(Source::Spawned(spawned));
        Ok(())
    }
}

/// Starts `exe --spawned-job 3`, `link` its fd 3, in a process group of its own (so that its tasks can be
/// ended with it if it dies) and with stdin from /dev/null (only the first job's tasks read rpmi-run's). With
/// posix_spawn, not std's Command: an exec that fails is reported by its result, and the child it leaves is
/// reaped by whoever waits first (a one-node shell reaps every child), where Command's own wait would fail.
/// It inherits the blocked SIGINT and SIGTERM, which it takes on a thread of its own.
fn start_rpmi_run(exe: &CStr, link: &UnixStream) -> io::Result<libc::pid_t> {
    let argv = [exe.to_owned(), c"--spawned-job".to_owned(), c"3".to_owned()];
    rpmi::os::start_linked(exe, &argv, None, link, Start { own_group: true, default_signals: false })
}

/// The job a spawn asks for, run as `template` (the first job) was: its commands are its applications,
/// the preputs of all of them its preputs. Info keys: `wdir` and `path` as Hydra takes them, `host` and
/// `hosts` only if they name this machine; others are ignored, as MPI lets a process manager do.
fn job_of_spawn(template: &Job, request: &SpawnRequest) -> Result<Job, String> {
    let spawned = SpawnedJob::of(request)?;
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    let mut apps = Vec::with_capacity(request.commands.len());
    for c in &request.commands {
        let mut app =
            App::new(c.nprocs, std::iter::once(&c.execname).chain(&c.args).map(|a| OsString::from(text(a))).collect());
        for (key, value) in &c.infos {
            match (key.as_slice(), text(value)) {
                (b"wdir", dir) => app.wdir = Some(PathBuf::from(dir)),
                (b"path", path) => app.path = Some(OsString::from(path)),
                (b"host" | b"hosts", hosts) => {
                    let here = crate::hostname();
                    let mut named = hosts.split(',').map(str::trim).filter(|h| !h.is_empty());
                    if let Some(other) = named.find(|h| !["localhost", "127.0.0.1", &here].contains(h)) {
                        return Err(format!("rpmi-run runs every task on this machine ({here}), not on '{other}'"));
                    }
                }
                _ => {}
            }
        }
        if app.program[0].is_empty() {
            return Err("a spawn of no program".into());
        }
        apps.push(app);
    }
    // At most SPAWN_PROCS_MAX processes: the size fits.
    let size = spawned.size() as u32;
    let preputs = spawned.preputs;
    Ok(Job { apps, preputs, spawned: true, nodes: template.nodes.min(size).max(1), ..template.clone() })
}

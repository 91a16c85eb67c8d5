//! PMI-1 conformance, over the wire: RFC 13 (the normative text), Intel's `get_ranks2hosts` extension, and
//! every trap of docs/clients.md, spoken over real socketpairs to a [`Driver`] that runs on its own thread exactly
//! as a host's progress thread would run it.
//!
//! The test plays the tasks: each holds the task end of its socketpair and writes request lines and reads
//! response lines with a read timeout, so a bug fails a test instead of hanging it. The driver's host is
//! [`LoopbackHost`], a test double for a resource manager with one shell whose collective completes
//! in-process, with other shells' contributions the test makes up.
//!
//! Every response line a client reads (except the abort reply and the ranks2hosts answer, which are not
//! `cmd=` lines) is checked against docs/clients.md's rules: it begins with `cmd=`, fits in 1024 bytes with its
//! newline, and carries no empty `key=` token.

use rpmi::driver::{channel, socketpair, Driver, DriverHandle, Event, HostFds};
use rpmi::server::{
    kvs, GroupExchange, Host, HostReply, HostRequest, JobError, JobInfo, Limits, Server, TaskId, TaskMap,
    NOT_SUPPORTED, PROCESS_MAPPING_KEY,
};
use rpmi::wire::{SpawnCommand, SpawnRequest};
use std::collections::VecDeque;
use std::io::{self, BufRead, BufReader, ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard};
use std::thread;
use std::time::Duration;

/// How long any single wait may take before the test fails.
const TIMEOUT: Duration = Duration::from_secs(10);
/// The job's KVS name.
const KVS: &str = "kvs_13";
/// The longest response line any client reads, newline included (docs/clients.md).
const MAX_RESPONSE_LINE: usize = 1024;

// ---------------------------------------------------------------------------------------------------------
// The test double for a resource manager.

/// Everything the host was asked to do, for the test to inspect.
#[derive(Default)]
struct Record {
    /// This shell's contribution to each collective, in order.
    collectives: Vec<Vec<u8>>,
    aborts: Vec<(u32, i32, String)>,
    errors: Vec<JobError>,
    logs: Vec<(log::Level, String)>,
    /// Publish, unpublish and lookup requests, as `(task, Debug of the request)`.
    requests: Vec<(TaskId, String)>,
    spawns: Vec<(TaskId, SpawnRequest)>,
    /// Group exchanges, as `(id, shells, this shell's contribution)`; the test completes them.
    groups: Vec<(String, Vec<u32>, Vec<u8>)>,
}

/// The record, shared between the host (on the driver thread) and the test, with a condition variable so
/// the test can wait for something to be recorded without sleeping.
#[derive(Default)]
struct Shared {
    record: Mutex<Record>,
    changed: Condvar,
}

impl Shared {
    fn update(&self, f: impl FnOnce(&mut Record)) {
        f(&mut self.record.lock().unwrap());
        self.changed.notify_all();
    }

    fn get(&self) -> MutexGuard<'_, Record> {
        self.record.lock().unwrap()
    }

    /// Waits (at most [`TIMEOUT`]) until `done` holds of the record, and returns it locked.
    fn wait_for(&self, what: &str, done: impl Fn(&Record) -> bool) -> MutexGuard<'_, Record> {
        let guard = self.record.lock().unwrap();
        let (guard, timeout) = self.changed.wait_timeout_while(guard, TIMEOUT, |r| !done(r)).unwrap();
        assert!(!timeout.timed_out(), "timed out waiting for the host to see {what}");
        guard
    }
}

/// How the host finishes one collective.
enum Collective {
    /// Successfully, bringing these contributions of other shells along with this shell's own.
    Gather(Vec<Vec<u8>>),
    /// With an error.
    Fail(&'static str),
    /// Not at all: the exchange cannot start, and `Host::collective` says why.
    Refuse(&'static str),
}

/// A test double for a resource manager: one shell whose collective completes in-process, at once, with its
/// own contribution plus whatever other shells' contributions the test planned (or fails as planned).
/// Aborts, job errors, logs and service requests are recorded for the test.
struct LoopbackHost {
    /// Posts the collective's completion to the driver, as a resource manager's thread would.
    handle: DriverHandle,
    shared: Arc<Shared>,
    /// How the next collectives finish; once it runs out, with this shell's contribution alone.
    plan: VecDeque<Collective>,
    /// Offer publish, unpublish, lookup and spawn (the test answers them through the driver handle).
    offer_services: bool,
    /// Run group exchanges (and so serve PMI 1.2).
    serve_groups: bool,
}

impl HostFds for LoopbackHost {}

impl Host for LoopbackHost {
    fn collective(&mut self, contribution: &[u8]) -> Result<(), String> {
        self.shared.update(|r| r.collectives.push(contribution.to_vec()));
        let result = match self.plan.pop_front() {
            None => Ok(vec![contribution.to_vec()]),
            Some(Collective::Gather(others)) => Ok([vec![contribution.to_vec()], others].concat()),
            Some(Collective::Fail(why)) => Err(why.to_string()),
            Some(Collective::Refuse(why)) => return Err(why.to_string()),
        };
        assert!(self.handle.post(Event::CollectiveDone(result)).is_ok(), "the driver is gone");
        Ok(())
    }

    fn serves_groups(&self) -> bool {
        self.serve_groups
    }

    fn group_collective(&mut self, exchange: &GroupExchange<'_>, contribution: &[u8]) -> Result<(), String> {
        let id = String::from_utf8(exchange.id.to_vec()).expect("a group exchange's id is text");
        self.shared.update(|r| r.groups.push((id, exchange.shells.to_vec(), contribution.to_vec())));
        Ok(())
    }

    fn abort(&mut self, rank: u32, exit_code: i32, message: &str) {
        self.shared.update(|r| r.aborts.push((rank, exit_code, message.to_string())));
    }

    fn job_error(&mut self, error: &JobError) {
        self.shared.update(|r| r.errors.push(error.clone()));
    }

    fn log(&mut self, level: log::Level, message: &str) {
        self.shared.update(|r| r.logs.push((level, message.to_string())));
    }

    fn request(&mut self, task: TaskId, request: HostRequest) -> Result<(), String> {
        if !self.offer_services {
            return Err(NOT_SUPPORTED.into());
        }
        match request {
            HostRequest::Spawn(spawn) => self.shared.update(|r| r.spawns.push((task, (*spawn).clone()))),
            other => self.shared.update(|r| r.requests.push((task, format!("{other:?}")))),
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------------------
// A job: one shell served by a driver on its own thread, and the task ends of its connections.

struct Setup {
    job: JobInfo,
    limits: Limits,
    plan: Vec<Collective>,
    offer_services: bool,
    serve_groups: bool,
    /// Hand the connections over with `Event::Attach` from the test thread, once the driver runs, instead of
    /// `Driver::attach` before.
    attach_by_event: bool,
}

impl Setup {
    /// The shell of node `node` of a block-mapped job with `ppn[n]` ranks on node `n`.
    fn block(ppn: &[u32], node: u32) -> Setup {
        let map = TaskMap::block(ppn);
        let local = map.clique(node);
        Setup::new(JobInfo::new(KVS, map, local, hostnames(ppn.len())))
    }

    fn new(job: JobInfo) -> Setup {
        let (plan, limits) = (Vec::new(), Limits::default());
        Setup { job, limits, plan, offer_services: false, serve_groups: false, attach_by_event: false }
    }

    fn plan(mut self, plan: Vec<Collective>) -> Setup {
        self.plan = plan;
        self
    }

    fn limits(mut self, limits: Limits) -> Setup {
        self.limits = limits;
        self
    }

    fn offer_services(mut self) -> Setup {
        self.offer_services = true;
        self
    }

    fn serve_groups(mut self) -> Setup {
        self.serve_groups = true;
        self
    }

    fn attach_by_event(mut self) -> Setup {
        self.attach_by_event = true;
        self
    }

    /// Starts the driver on its own thread; returns the job and one client per local task, in task order.
    fn start(self) -> (Job, Vec<Client>) {
        let ranks = self.job.local_ranks.clone();
        let server = Server::new(self.job, self.limits).expect("consistent job information");
        let shared = Arc::new(Shared::default());
        let (handle, inbox) = channel().expect("a driver channel");
        let host = LoopbackHost {
            handle: handle.clone(),
            shared: shared.clone(),
            plan: self.plan.into(),
            offer_services: self.offer_services,
            serve_groups: self.serve_groups,
        };
        let mut driver = Driver::new(server, host, inbox).expect("a driver");
        let mut clients = Vec::new();
        let mut later = Vec::new();
        for (task, &rank) in ranks.iter().enumerate() {
            let (server, task_end) = socketpair().expect("a socketpair");
            if self.attach_by_event {
                later.push((task, server));
            } else {
                driver.attach(task, server).expect("attach");
            }
            clients.push(Client::new(rank, UnixStream::from(task_end)));
        }
        let (tx, done) = mpsc::channel();
        let thread = thread::Builder::new()
            .name("rpmi-progress".into())
            .spawn(move || {
                let result = driver.run();
                let _ = tx.send(result);
            })
            .expect("the progress thread");
        for (task, server) in later {
            assert!(handle.post(Event::Attach(task, server)).is_ok(), "the driver is gone");
        }
        (Job { shared, handle, done, thread: Some(thread) }, clients)
    }
}

fn hostnames(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("node{i:03}")).collect()
}

struct Job {
    shared: Arc<Shared>,
    handle: DriverHandle,
    done: mpsc::Receiver<io::Result<()>>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Job {
    /// Posts an event to the driver, as a host's other threads do.
    fn post(&self, event: Event) {
        assert!(self.handle.post(event).is_ok(), "the driver is gone");
    }

    /// Checks that `Driver::run` returned `Ok` (within [`TIMEOUT`]); call it once every client is dropped.
    fn finished(mut self) {
        match self.done.recv_timeout(TIMEOUT) {
            Ok(result) => result.expect("Driver::run failed"),
            Err(e) => panic!("Driver::run did not return after every task closed its connection: {e}"),
        }
        self.thread.take().unwrap().join().expect("the progress thread panicked");
    }

    /// Whether `Driver::run` is still running.
    fn running(&self) -> bool {
        matches!(self.done.try_recv(), Err(mpsc::TryRecvError::Empty))
    }
}

impl Drop for Job {
    /// A test that failed half-way must not leave a progress thread behind.
    fn drop(&mut self) {
        if self.thread.is_some() {
            let _ = self.handle.post(Event::Stop);
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// The task side of a connection.

struct Client {
    rank: u32,
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Client {
    fn new(rank: u32, stream: UnixStream) -> Client {
        stream.set_read_timeout(Some(TIMEOUT)).unwrap();
        stream.set_write_timeout(Some(TIMEOUT)).unwrap();
        let writer = stream.try_clone().unwrap();
        Client { rank, reader: BufReader::new(stream), writer }
    }

    /// Writes `bytes` as they are.
    fn send(&mut self, bytes: impl AsRef<[u8]>) {
        self.writer.write_all(bytes.as_ref()).unwrap_or_else(|e| panic!("rank {}: write failed: {e}", self.rank));
    }

    /// Reads one line, newline included, without checking it.
    fn raw_line(&mut self) -> Vec<u8> {
        let mut line = Vec::new();
        match self.reader.read_until(b'\n', &mut line) {
            Ok(0) => panic!("rank {}: the server closed the connection instead of answering", self.rank),
            Ok(_) if line.ends_with(b"\n") => line,
            Ok(_) => panic!("rank {}: the connection closed in the middle of {:?}", self.rank, lossy(&line)),
            Err(e) => panic!("rank {}: no answer within {TIMEOUT:?} ({e}); read so far {:?}", self.rank, lossy(&line)),
        }
    }

    /// Reads one response line and checks it against docs/clients.md's rules; returns it without its newline.
    fn recv(&mut self) -> String {
        let line = self.raw_line();
        check_response(&line);
        String::from_utf8(line).unwrap().trim_end_matches('\n').to_string()
    }

    /// Sends one request line (the newline is added) and reads its response.
    fn ask(&mut self, request: &str) -> String {
        self.send(format!("{request}\n"));
        self.recv()
    }

    /// `cmd=init pmi_version=1 pmi_subversion=1`, which must succeed.
    fn init(&mut self) {
        assert_eq!(
            self.ask("cmd=init pmi_version=1 pmi_subversion=1"),
            "cmd=response_to_init rc=0 pmi_version=1 pmi_subversion=1"
        );
    }

    fn put(&mut self, key: &str, value: &str) -> String {
        self.ask(&format!("cmd=put kvsname={KVS} key={key} value={value}"))
    }

    fn get(&mut self, key: &str) -> String {
        self.ask(&format!("cmd=get kvsname={KVS} key={key}"))
    }

    /// Asserts that this task was cut off (RFC 13: the connection of a task that broke the protocol is
    /// closed): nothing was sent to it, and its connection is closed.
    fn assert_cut_off(&mut self) {
        assert!(self.reader.buffer().is_empty(), "rank {}: unexpected {:?}", self.rank, lossy(self.reader.buffer()));
        let mut byte = [0u8; 1];
        match self.reader.get_mut().read(&mut byte) {
            Ok(0) => {}
            Err(e) if e.kind() == ErrorKind::ConnectionReset => {}
            other => panic!("rank {}: expected the connection closed, got {other:?} ({:?})", self.rank, lossy(&byte)),
        }
    }
}

fn lossy(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// docs/clients.md: a response line begins with `cmd=`, fits in 1024 bytes with its newline, and has no token
/// `key=` with an empty value (and so no stray token without `=`); `value=` runs to the end of the line.
fn check_response(line: &[u8]) {
    if let Err(why) = response_rules(line) {
        panic!("{why}: {:?}", lossy(line));
    }
}

fn response_rules(line: &[u8]) -> Result<(), &'static str> {
    if line.len() > MAX_RESPONSE_LINE {
        return Err("a response over 1024 bytes");
    }
    let body = line.strip_suffix(b"\n").ok_or("a response without newline")?;
    if !body.starts_with(b"cmd=") {
        return Err("a response that does not begin with cmd=");
    }
    let mut rest = std::str::from_utf8(body).map_err(|_| "a response that is not text")?;
    while !rest.is_empty() {
        let (token, next) = rest.split_once(' ').unwrap_or((rest, ""));
        let (key, value) = token.split_once('=').ok_or("a token without '='")?;
        if key.is_empty() {
            return Err("a token with an empty key");
        }
        if key == "value" {
            return if rest == "value=" { Err("an empty value=") } else { Ok(()) };
        }
        if value.is_empty() {
            return Err("an empty key= token");
        }
        if next.starts_with(' ') {
            return Err("a double space");
        }
        rest = next;
    }
    Ok(())
}

/// The checks above catch what real clients choke on (a check that passes everything would prove nothing).
#[test]
fn the_response_rules_reject_what_real_clients_reject() {
    for good in [&b"cmd=barrier_out rc=0\n"[..], b"cmd=get_result rc=0 value=a b=c  d\n"] {
        assert_eq!(response_rules(good), Ok(()), "{}", lossy(good));
    }
    let long = format!("cmd=get_result rc=0 value={}\n", "v".repeat(1000));
    for bad in [
        long.as_bytes(),
        b"cmd=barrier_out rc=0",
        b"rc=0 cmd=barrier_out\n",
        b"cmd=my_kvsname rc=0 kvsname=\n",
        b"cmd=get_result rc=-1 msg=key not found\n",
        b"cmd=get_result rc=0 value=\n",
        b"cmd=maxes rc=0  kvsname_max=64\n",
        b"000023cmd=init;\n",
    ] {
        assert!(response_rules(bad).is_err(), "{}", lossy(bad));
    }
}

/// The value of `key` in a response line (`value=` runs to the end of the line).
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let mut rest = line;
    while !rest.is_empty() {
        let (token, next) = rest.split_once(' ').unwrap_or((rest, ""));
        if let Some((k, v)) = token.split_once('=') {
            if k == "value" {
                return (key == "value").then(|| &rest["value=".len()..]);
            }
            if k == key {
                return Some(v);
            }
        }
        rest = next;
    }
    None
}

fn rc(line: &str) -> i32 {
    field(line, "rc").unwrap_or_else(|| panic!("no rc= in {line:?}")).parse().unwrap()
}

/// One put of another shell, as it travels in that shell's contribution.
fn contribution(puts: &[(u32, &str, &str)]) -> Vec<u8> {
    let mut out = Vec::new();
    for &(rank, key, value) in puts {
        kvs::encode(&mut out, rank, key.as_bytes(), value.as_bytes());
    }
    out
}

/// Sends `barrier_in` from every client, then reads every `barrier_out`.
fn barrier(clients: &mut [Client]) -> Vec<String> {
    for c in clients.iter_mut() {
        c.send("cmd=barrier_in\n");
    }
    clients.iter_mut().map(Client::recv).collect()
}

// ---------------------------------------------------------------------------------------------------------
// Initialization and process group information.

/// RFC 13: the client sends the highest version it supports and the server answers with the version used,
/// never above what the client asked for. rpmi serves PMI 1.1, 1.2 (when the host runs group exchanges) and
/// PMI-2: a 1.0 or 1.1 client gets 1.1 (Flux's client accepts exactly that); one asking for 1.2 or a later 1.x
/// gets 1.2 from a host with group exchanges, else 1.1; a client asking for 2 gets 2.0 (and speaks PMI-2
/// from then on); anything else is refused. Every answer carries both `pmi_version` and `pmi_subversion`
/// (newer MPICH needs both).
#[test]
fn init_answers_the_lower_of_what_the_client_asked_and_what_is_served() {
    let without_groups: &[(&str, Option<&str>)] = &[
        ("1 0", Some("1 1")),
        ("1 1", Some("1 1")),
        ("1 2", Some("1 1")),
        ("1 3", Some("1 1")),
        ("2 0", Some("2 0")),
        ("2 1", Some("2 0")),
        ("0 0", None),
        ("3 0", None),
        ("1 -1", None),
        ("-1 1", None),
    ];
    let with_groups: &[(&str, Option<&str>)] =
        &[("1 0", Some("1 1")), ("1 1", Some("1 1")), ("1 2", Some("1 2")), ("1 3", Some("1 2")), ("2 0", Some("2 0"))];
    for (setup, cases) in
        [(Setup::block(&[10], 0), without_groups), (Setup::block(&[5], 0).serve_groups(), with_groups)]
    {
        init_cases(setup, cases);
    }
}

fn init_cases(setup: Setup, cases: &[(&str, Option<&str>)]) {
    let (job, mut clients) = setup.start();
    for ((versions, answered), c) in cases.iter().zip(clients.iter_mut()) {
        let (v, s) = versions.split_once(' ').unwrap();
        let answer = c.ask(&format!("cmd=init pmi_version={v} pmi_subversion={s}"));
        assert!(answer.starts_with("cmd=response_to_init "), "{answer}");
        let (av, asub) = answered.unwrap_or("1 1").split_once(' ').unwrap();
        assert_eq!(field(&answer, "pmi_version"), Some(av), "{versions}: {answer}");
        assert_eq!(field(&answer, "pmi_subversion"), Some(asub), "{versions}: {answer}");
        if answered.is_some() {
            assert_eq!(rc(&answer), 0, "{versions}: {answer}");
        } else {
            assert_ne!(rc(&answer), 0, "{versions}: {answer}");
            assert!(field(&answer, "msg").is_some(), "{versions}: a refusal says why: {answer}");
        }
    }
    let record = job.shared.get();
    assert!(record.errors.is_empty(), "a refused init is not a protocol error: {:?}", record.errors);
    // Each refusal is logged, naming the rank and the version asked for.
    let refused = cases.iter().enumerate().filter(|(_, (_, answered))| answered.is_none());
    for (rank, (asked, _)) in refused {
        let asked = asked.replace(' ', ".");
        let said = format!("rank {rank} asked for PMI version {asked}; rpmi serves 1.1, 1.2 and 2.0");
        assert!(record.logs.iter().any(|(l, m)| *l == log::Level::Error && *m == said), "{said}: {:?}", record.logs);
    }
    drop(record);
    drop(clients);
    job.finished();
}

/// RFC 13 (Back Compatibility): clients from before PMI 1.1 send no init at all; they are served.
#[test]
fn a_client_that_never_sends_init_is_served() {
    let (job, mut clients) = Setup::block(&[2, 2], 1).start();
    let c = &mut clients[0];
    assert_eq!(c.ask("cmd=get_maxes"), "cmd=maxes rc=0 kvsname_max=64 keylen_max=64 vallen_max=866");
    assert_eq!(c.ask("cmd=get_universe_size"), "cmd=universe_size rc=0 size=4");
    assert_eq!(c.ask("cmd=get_appnum"), "cmd=appnum rc=0 appnum=0");
    assert_eq!(c.ask("cmd=get_my_kvsname"), format!("cmd=my_kvsname rc=0 kvsname={KVS}"));
    assert_eq!(c.put("card-2", "abc"), "cmd=put_result rc=0");
    assert_eq!(c.get("card-2"), "cmd=get_result rc=0 value=abc");
    assert!(barrier(&mut clients).iter().all(|l| l == "cmd=barrier_out rc=0"));
    for c in &mut clients {
        assert_eq!(c.ask("cmd=finalize"), "cmd=finalize_ack rc=0");
    }
    assert!(job.shared.get().errors.is_empty());
    drop(clients);
    job.finished();
}

/// `get_maxes` advertises 64/64/866: no more than the longest value accepted (866, what MPICH 4.0.2 makes of
/// 1024 too, docs/clients.md) so that clients that trust the number (MPICH 5) put no longer ones, and even (see
/// `Limits::vallen_advertised`); and the process group information commands answer with the job's.
#[test]
fn maxes_universe_size_appnum_and_kvsname() {
    let (job, mut clients) = Setup::block(&[3, 5], 1).start();
    for c in &mut clients {
        c.init();
        assert_eq!(c.ask("cmd=get_maxes"), "cmd=maxes rc=0 kvsname_max=64 keylen_max=64 vallen_max=866");
        assert_eq!(c.ask("cmd=get_universe_size"), "cmd=universe_size rc=0 size=8");
        assert_eq!(c.ask("cmd=get_appnum"), "cmd=appnum rc=0 appnum=0");
        assert_eq!(c.ask("cmd=get_my_kvsname"), format!("cmd=my_kvsname rc=0 kvsname={KVS}"));
    }
    drop(clients);
    job.finished();
}

/// A host may advertise smaller maxes; what it advertises is what it enforces (the NUL counted, as PMI
/// counts).
#[test]
fn configured_maxes_are_advertised_and_enforced() {
    let limits = Limits { kvsname_max: 32, keylen_max: 16, vallen_max: 512, ..Limits::default() };
    let (job, mut clients) = Setup::block(&[1], 0).limits(limits).start();
    let c = &mut clients[0];
    assert_eq!(c.ask("cmd=get_maxes"), "cmd=maxes rc=0 kvsname_max=32 keylen_max=16 vallen_max=512");
    assert_eq!(c.put(&"k".repeat(15), &"v".repeat(511)), "cmd=put_result rc=0");
    assert_eq!(rc(&c.put(&"k".repeat(16), "v")), 5);
    assert_eq!(rc(&c.put("k", &"v".repeat(512))), 7);
    drop(clients);
    job.finished();
}

// ---------------------------------------------------------------------------------------------------------
// The key-value store and the barrier.

/// RFC 13: what one process puts can be read by every other once all have been through the barrier; the
/// barrier exchanges the puts with the other shells through the host's collective, and is usable as a plain
/// synchronization without any put.
#[test]
fn puts_are_visible_after_the_barrier_across_tasks_and_shells() {
    // This shell runs ranks 2 and 3 of a 3-node job; ranks 0, 1, 4 and 5 live on the other shells.
    let others = vec![contribution(&[(0, "card-0", "from node 0"), (1, "card-1", "x=1")]), contribution(&[])];
    let later = vec![contribution(&[(4, "late-4", "after the second barrier")])];
    let (job, mut clients) =
        Setup::block(&[2, 2, 2], 1).plan(vec![Collective::Gather(others), Collective::Gather(later)]).start();
    for c in &mut clients {
        c.init();
    }
    assert_eq!(clients[0].put("card-2", "two"), "cmd=put_result rc=0");
    assert_eq!(clients[1].put("card-3", "three"), "cmd=put_result rc=0");
    assert_ne!(rc(&clients[0].get("card-0")), 0, "another server's put is not visible before the barrier");
    assert!(job.shared.get().collectives.is_empty(), "no collective before every local task is in the barrier");
    assert_eq!(barrier(&mut clients), ["cmd=barrier_out rc=0", "cmd=barrier_out rc=0"]);
    assert_eq!(job.shared.get().collectives, [contribution(&[(2, "card-2", "two"), (3, "card-3", "three")])]);
    for c in &mut clients {
        assert_eq!(c.get("card-0"), "cmd=get_result rc=0 value=from node 0");
        assert_eq!(c.get("card-1"), "cmd=get_result rc=0 value=x=1");
        assert_eq!(c.get("card-2"), "cmd=get_result rc=0 value=two");
        assert_eq!(c.get("card-3"), "cmd=get_result rc=0 value=three");
        assert_ne!(rc(&c.get("late-4")), 0);
    }
    // A barrier with nothing put still goes through the collective (with an empty contribution).
    assert_eq!(barrier(&mut clients), ["cmd=barrier_out rc=0", "cmd=barrier_out rc=0"]);
    assert_eq!(job.shared.get().collectives.len(), 2);
    assert!(job.shared.get().collectives[1].is_empty());
    assert_eq!(clients[1].get("late-4"), "cmd=get_result rc=0 value=after the second barrier");
    drop(clients);
    job.finished();
}

/// RFC 13: a value may be as long as `vallen_max` allows; rpmi's bound is `Limits::value_max()` (866 at the
/// default maxes: what MPICH 4.0.2 can read back, docs/clients.md). One character more is refused with
/// `PMI_ERR_INVALID_VAL_LENGTH` (7).
#[test]
fn a_value_of_the_longest_allowed_length_round_trips_and_one_more_is_rc_7() {
    let value_max = Limits::default().value_max();
    assert_eq!(value_max, 866);
    let (job, mut clients) = Setup::block(&[2], 0).start();
    let longest: String = (0..value_max).map(|i| (b'A' + (i % 26) as u8) as char).collect();
    assert_eq!(clients[0].put("big", &longest), "cmd=put_result rc=0");
    assert_eq!(barrier(&mut clients), ["cmd=barrier_out rc=0", "cmd=barrier_out rc=0"]);
    assert_eq!(clients[1].get("big"), format!("cmd=get_result rc=0 value={longest}"));
    let answer = clients[0].put("big2", &format!("{longest}Z"));
    assert_eq!(rc(&answer), 7, "{answer}");
    assert_ne!(rc(&clients[1].get("big2")), 0, "a refused put stores nothing");
    drop(clients);
    job.finished();
}

/// RFC 13: a key may be `keylen_max - 1` characters long; one more is `PMI_ERR_INVALID_KEY_LENGTH` (5), for
/// put and get alike.
#[test]
fn a_key_longer_than_keylen_max_is_rc_5() {
    let (job, mut clients) = Setup::block(&[1], 0).start();
    let c = &mut clients[0];
    let key63 = "k".repeat(63);
    let key64 = "k".repeat(64);
    assert_eq!(c.put(&key63, "v"), "cmd=put_result rc=0");
    assert_eq!(c.get(&key63), "cmd=get_result rc=0 value=v");
    assert_eq!(rc(&c.put(&key64, "v")), 5);
    assert_eq!(rc(&c.get(&key64)), 5);
    drop(clients);
    job.finished();
}

/// RFC 13: a get of a key nobody put fails; docs/clients.md: the failure carries no `value=` token at all.
#[test]
fn a_get_of_a_missing_key_fails_without_a_value() {
    let (job, mut clients) = Setup::block(&[1], 0).start();
    let answer = clients[0].get("nobody-put-this");
    assert!(answer.starts_with("cmd=get_result "), "{answer}");
    assert_ne!(rc(&answer), 0, "{answer}");
    assert!(!answer.contains("value="), "{answer}");
    // Newer MPICH asks for these; "not found" is fine (docs/clients.md).
    for key in ["PMI_hwloc_xmlfile", "PMI_mpi_memory_alloc_kinds"] {
        let answer = clients[0].get(key);
        assert_ne!(rc(&answer), 0, "{answer}");
        assert_eq!(field(&answer, "value"), None, "{answer}");
    }
    drop(clients);
    job.finished();
}

/// docs/clients.md: `value=` runs to the end of the line, so a value may hold spaces and `=`; it comes back as put.
#[test]
fn a_value_with_spaces_and_equals_signs_round_trips() {
    let (job, mut clients) = Setup::block(&[2], 0).start();
    let value = "a b=c  d==e\tf key=x cmd=get";
    assert_eq!(clients[0].put("spaced", value), "cmd=put_result rc=0");
    barrier(&mut clients);
    assert_eq!(clients[1].get("spaced"), format!("cmd=get_result rc=0 value={value}"));
    assert_eq!(job.shared.get().collectives[0], contribution(&[(0, "spaced", value)]));
    drop(clients);
    job.finished();
}

/// The duplicate-key rule (kvs.rs): a key belongs to the rank that first put it, which may put it again;
/// another rank may put the same value, but a different one is refused with `PMI_ERR_INVALID_KEY` (4).
#[test]
fn a_key_may_be_put_again_by_its_owner_but_not_changed_by_another_rank() {
    let (job, mut clients) = Setup::block(&[2, 2], 1).start();
    assert_eq!(clients[0].put("k", "one"), "cmd=put_result rc=0");
    assert_eq!(clients[0].put("k", "two"), "cmd=put_result rc=0", "the owner may put its key again");
    assert_eq!(clients[1].put("k", "two"), "cmd=put_result rc=0", "the same value from another rank is harmless");
    let answer = clients[1].put("k", "three");
    assert_eq!(rc(&answer), 4, "{answer}");
    assert!(field(&answer, "msg").is_some_and(|m| m.contains("rank_2")), "names the owner: {answer}");
    assert_eq!(rc(&clients[1].put(PROCESS_MAPPING_KEY, "(vector,(0,1,1))")), 4, "the server's key");
    assert_eq!(barrier(&mut clients), ["cmd=barrier_out rc=0", "cmd=barrier_out rc=0"]);
    assert_eq!(job.shared.get().collectives[0], contribution(&[(2, "k", "one"), (2, "k", "two")]));
    assert_eq!(clients[1].get("k"), "cmd=get_result rc=0 value=two");
    drop(clients);
    job.finished();
}

/// The duplicate-key rule across shells: two ranks on different shells putting different values under one
/// key in the same epoch fail the barrier on every shell, with a message naming the key and both ranks.
#[test]
fn conflicting_puts_on_two_shells_fail_the_barrier_naming_key_and_ranks() {
    let theirs = vec![contribution(&[(0, "k", "theirs")])];
    let (job, mut clients) = Setup::block(&[1, 1], 1).plan(vec![Collective::Gather(theirs)]).start();
    assert_eq!(clients[0].put("k", "mine"), "cmd=put_result rc=0");
    let outs = barrier(&mut clients);
    let [out] = &outs[..] else { unreachable!() };
    assert_ne!(rc(out), 0, "{out}");
    let msg = field(out, "msg").unwrap_or_else(|| panic!("no msg in {out}"));
    assert!(msg.contains("ranks_1_and_0") && msg.contains("'k'"), "{out}");
    drop(clients);
    job.finished();
}

/// RFC 13: the barrier fails when the collective fails, later or at once (the host's exchange cannot
/// start): every task waiting in it gets `barrier_out` with a non-zero rc; the next barrier works again.
#[test]
fn a_failed_collective_fails_the_barrier_of_every_waiting_task() {
    for failure in [Collective::Fail("node 1 unreachable"), Collective::Refuse("node 1 unreachable")] {
        let (job, mut clients) = Setup::block(&[3, 1], 0).plan(vec![failure]).start();
        for out in barrier(&mut clients) {
            assert_ne!(rc(&out), 0, "{out}");
            assert_eq!(field(&out, "msg"), Some("node_1_unreachable"), "{out}");
        }
        assert!(job.shared.get().logs.iter().any(|(_, m)| m.contains("node 1 unreachable")));
        assert!(barrier(&mut clients).iter().all(|out| out == "cmd=barrier_out rc=0"));
        drop(clients);
        job.finished();
    }
}

/// RFC 13: PMI-1 is lock-step; a request sent while the barrier still waits breaks the protocol.
#[test]
fn a_request_while_the_barrier_waits_is_a_protocol_error() {
    let (job, mut clients) = Setup::block(&[2], 0).start();
    clients[0].send("cmd=barrier_in\ncmd=get_maxes\n");
    let record = job.shared.wait_for("a protocol error", |r| !r.errors.is_empty());
    assert!(
        matches!(&record.errors[..], [JobError::Protocol { rank: 0, reason, .. }] if reason.contains("still waits")),
        "{:?}",
        record.errors
    );
    drop(record);
    // Rank 0 left the barrier by breaking the protocol: rank 1's barrier cannot complete.
    let out = clients[1].ask("cmd=barrier_in");
    assert_ne!(rc(&out), 0, "{out}");
    clients[0].assert_cut_off();
    drop(clients);
    job.finished();
}

// ---------------------------------------------------------------------------------------------------------
// PMI_process_mapping (RFC 13's table) and Intel's get_ranks2hosts.

/// `get` of `PMI_process_mapping` from a task of node 0's shell.
fn process_mapping_via_get(map: TaskMap) -> String {
    let hosts = hostnames(map.node_count());
    let (job, mut clients) = Setup::new(JobInfo::new(KVS, map, vec![0], hosts)).start();
    let answer = clients[0].get(PROCESS_MAPPING_KEY);
    drop(clients);
    job.finished();
    answer
}

/// RFC 13's table of `PMI_process_mapping` examples, block and cyclic, read with `get` as MPICH does.
/// Cyclic 4096x256 does not fit in a value: RFC 13 says to return an empty value, but real clients die on
/// that (docs/clients.md), so the key is absent and the get fails: a documented deviation.
#[test]
fn pmi_process_mapping_follows_the_rfc_13_table() {
    let table: &[(&[u32], &str, &str)] = &[
        (&[2; 2], "(vector,(0,2,2))", "(vector,(0,2,1),(0,2,1))"),
        (&[4; 2], "(vector,(0,2,4))", "(vector,(0,2,1),(0,2,1),(0,2,1),(0,2,1))"),
        (&[2, 2, 4, 4], "(vector,(0,2,2),(2,2,4))", "(vector,(0,4,1),(0,4,1),(2,2,1),(2,2,1))"),
    ];
    for &(ppn, block, cyclic) in table {
        assert_eq!(process_mapping_via_get(TaskMap::block(ppn)), format!("cmd=get_result rc=0 value={block}"));
        assert_eq!(process_mapping_via_get(TaskMap::cyclic(ppn)), format!("cmd=get_result rc=0 value={cyclic}"));
    }
    assert_eq!(
        process_mapping_via_get(TaskMap::block(&[256; 4096])),
        "cmd=get_result rc=0 value=(vector,(0,4096,256))"
    );
    let absent = process_mapping_via_get(TaskMap::cyclic(&[256; 4096]));
    assert!(absent.starts_with("cmd=get_result "), "{absent}");
    assert_ne!(rc(&absent), 0, "{absent}");
    assert_eq!(field(&absent, "value"), None, "absent, never empty: {absent}");
}

/// A map that is neither block nor cyclic: consecutive ranks on one node make a run, runs of equal length on
/// consecutive nodes one block.
#[test]
fn pmi_process_mapping_of_an_irregular_map() {
    assert_eq!(
        process_mapping_via_get(TaskMap::new(vec![1, 1, 0, 2, 2])),
        "cmd=get_result rc=0 value=(vector,(1,1,2),(0,1,1),(2,1,2))"
    );
    assert_eq!(
        process_mapping_via_get(TaskMap::new(vec![0, 0, 1, 1, 2, 0, 3, 3, 3])),
        "cmd=get_result rc=0 value=(vector,(0,2,2),(2,1,1),(0,1,1),(3,1,3))"
    );
    assert_eq!(process_mapping_via_get(TaskMap::block(&[1])), "cmd=get_result rc=0 value=(vector,(0,1,1))");
}

/// Intel's extension, byte for byte: the worked example of its specification (8 ranks, node001 holding the
/// odd ones): two lines without `cmd=`, `<msglen>` counting the second line with its newline, plus one.
#[test]
fn get_ranks2hosts_answers_the_intel_example_byte_for_byte() {
    const WANT: &[u8] = b"put_ranks2hosts 40 2\n7 node001 1,3,5,7, 7 node002 0,2,4,6, \n";
    let second = &WANT[WANT.iter().position(|&b| b == b'\n').unwrap() + 1..];
    assert_eq!(second.len() + 1, 40, "the spec's msglen");
    let map = TaskMap::new(vec![1, 0, 1, 0, 1, 0, 1, 0]);
    let hosts = vec!["node001".to_string(), "node002".to_string()];
    for node in [0, 1] {
        let local = map.clique(node);
        let (job, mut clients) = Setup::new(JobInfo::new(KVS, map.clone(), local, hosts.clone())).start();
        for c in &mut clients {
            c.init();
            c.send("cmd=get_ranks2hosts\n");
            let mut got = c.raw_line();
            got.extend(c.raw_line());
            assert_eq!(lossy(&got), lossy(WANT), "rank {}", c.rank);
            // Nothing follows the two lines: the next answer is the next request's.
            assert_eq!(c.ask("cmd=get_appnum"), "cmd=appnum rc=0 appnum=0");
        }
        drop(clients);
        job.finished();
    }
}

// ---------------------------------------------------------------------------------------------------------
// The parser's tolerance (RFC 13: any order, extra white space, extra keys) and its strictness.

#[test]
fn tuples_in_any_order_with_extra_white_space_and_unknown_keys_are_accepted() {
    let (job, mut clients) = Setup::block(&[1], 0).start();
    let c = &mut clients[0];
    assert_eq!(
        c.ask("  pmi_subversion=1\tcmd=init   pmi_version=1  client=legacy "),
        "cmd=response_to_init rc=0 pmi_version=1 pmi_subversion=1"
    );
    assert_eq!(c.ask("cmd=get_maxes\t extra=1"), "cmd=maxes rc=0 kvsname_max=64 keylen_max=64 vallen_max=866");
    assert_eq!(c.ask(&format!("key=k1  kvsname={KVS}\tcmd=put hint=x value=v 1")), "cmd=put_result rc=0");
    assert_eq!(c.ask(&format!("key=k1 foo=bar   kvsname={KVS} cmd=get")), "cmd=get_result rc=0 value=v 1");
    assert_eq!(c.ask("cmd=get_appnum\r"), "cmd=appnum rc=0 appnum=0", "a CR before the newline");
    assert!(job.shared.get().errors.is_empty());
    drop(clients);
    job.finished();
}

/// Commands are matched exactly (design.md: flux-core's prefix matching is the flaw to avoid):
/// `cmd=get_maxes` is never `get`, and `cmd=initack` is an unknown command, a protocol error.
#[test]
fn get_maxes_is_not_get_and_initack_is_an_unknown_command() {
    let (job, mut clients) = Setup::block(&[2, 2], 1).start();
    assert_eq!(
        clients[0].ask(&format!("cmd=get_maxes kvsname={KVS} key=k")),
        "cmd=maxes rc=0 kvsname_max=64 keylen_max=64 vallen_max=866"
    );
    clients[1].send("cmd=initack\ncmd=get_maxes\n");
    let record = job.shared.wait_for("a protocol error", |r| !r.errors.is_empty());
    assert_eq!(
        record.errors,
        [JobError::Protocol { rank: 3, line: "cmd=initack".into(), reason: "unknown command 'initack'".into() }]
    );
    drop(record);
    // The connection is dead: not even the get_maxes after it is answered; others are served.
    assert_eq!(clients[0].ask("cmd=get_appnum"), "cmd=appnum rc=0 appnum=0");
    clients[1].assert_cut_off();
    drop(clients);
    job.finished();
}

/// RFC 13: a protocol error ends the task's connection; the job error names the rank and the line.
#[test]
fn a_malformed_line_is_a_protocol_error_naming_rank_and_line() {
    for (line, reason) in [
        ("hello world", "a token is not of the form key=value"),
        ("cmd=put kvsname=kvs_13 key=k", "'put' request without its 'value=' field"),
        ("cmd=init pmi_version=one pmi_subversion=1", "'pmi_version=' is not an integer"),
        ("mcmd=respawn", "unknown command 'mcmd=respawn'"),
        ("=x cmd=get_maxes", "a token is not of the form key=value"),
    ] {
        let (job, mut clients) = Setup::block(&[4, 3], 1).start();
        clients[1].send(format!("{line}\ncmd=get_maxes\n"));
        let record = job.shared.wait_for("a protocol error", |r| !r.errors.is_empty());
        assert_eq!(record.errors, [JobError::Protocol { rank: 5, line: line.into(), reason: reason.into() }]);
        let message = record.errors[0].to_string();
        assert!(message.starts_with("rank 5: PMI protocol error: "), "{message}");
        assert!(message.contains(line), "{message}");
        drop(record);
        assert_eq!(clients[0].ask("cmd=get_appnum"), "cmd=appnum rc=0 appnum=0");
        clients[1].assert_cut_off();
        drop(clients);
        job.finished();
    }
}

/// Request lines are bounded by `Limits::request_line_max` (4096 bytes with the newline, room for the
/// longest put): a line of exactly that length is served, one byte more is a protocol error.
#[test]
fn a_request_line_of_request_line_max_is_served_and_one_byte_more_is_a_protocol_error() {
    let max = Limits::default().request_line_max;
    let line = |len: usize| {
        let head = "cmd=get_appnum padding=";
        format!("{head}{}\n", "p".repeat(len - head.len() - 1))
    };
    let (job, mut clients) = Setup::block(&[2], 0).start();
    clients[0].send(line(max));
    assert_eq!(clients[0].recv(), "cmd=appnum rc=0 appnum=0");
    clients[1].send(line(max + 1));
    let record = job.shared.wait_for("a protocol error", |r| !r.errors.is_empty());
    assert!(
        matches!(&record.errors[..], [JobError::Protocol { rank: 1, reason, .. }] if reason.contains("longer than 4096")),
        "{:?}",
        record.errors
    );
    drop(record);
    assert_eq!(clients[0].ask("cmd=get_appnum"), "cmd=appnum rc=0 appnum=0");
    clients[1].assert_cut_off();
    drop(clients);
    job.finished();
}

/// Untrusted input is bounded: a task writing 1 MiB without a newline is cut off (a job error naming the
/// rank, with an excerpt of the line, not the line), the server keeps reading and discarding (the writer
/// is not left blocked), and every other task keeps being served.
#[test]
fn a_mebibyte_line_without_newline_cuts_off_only_its_task() {
    let (job, mut clients) = Setup::block(&[2, 2], 1).start();
    for c in &mut clients {
        c.init();
    }
    let mut flooder = clients.remove(0);
    let writer = thread::spawn(move || {
        let result = flooder.writer.write_all(&vec![b'x'; 1 << 20]);
        (flooder, result)
    });
    let record = job.shared.wait_for("the flooder cut off", |r| !r.errors.is_empty());
    let [JobError::Protocol { rank: 2, line, reason }] = &record.errors[..] else {
        panic!("{:?}", record.errors);
    };
    assert_eq!(reason, "a line longer than 4096 bytes");
    assert!(line.starts_with("xxxxxxxx") && line.len() < 200, "an excerpt, not the line: {line}");
    assert!(record.errors[0].to_string().starts_with("rank 2: "), "{}", record.errors[0]);
    drop(record);
    // The other task is served while (or after) the flood goes on.
    assert_eq!(clients[0].put("still", "served"), "cmd=put_result rc=0");
    assert_eq!(clients[0].get("still"), "cmd=get_result rc=0 value=served");
    let (mut flooder, result) = writer.join().unwrap();
    match result {
        Ok(()) => {}
        Err(e) if matches!(e.kind(), ErrorKind::BrokenPipe | ErrorKind::ConnectionReset) => {}
        Err(e) => panic!("the flood was neither taken nor refused: {e}"),
    }
    // Cut off for good: a newline and a request now change nothing.
    let _ = flooder.writer.write_all(b"\ncmd=get_maxes\n");
    assert_eq!(clients[0].ask("cmd=get_appnum"), "cmd=appnum rc=0 appnum=0");
    flooder.assert_cut_off();
    assert_eq!(job.shared.get().errors.len(), 1);
    drop(flooder);
    // The cut-off task cannot hold up the others' barrier forever: it fails at once.
    let out = clients[0].ask("cmd=barrier_in");
    assert_ne!(rc(&out), 0, "{out}");
    drop(clients);
    job.finished();
}

// ---------------------------------------------------------------------------------------------------------
// Tasks that leave: disconnect, abort, finalize.

/// A task that closes its connection (exits or crashes) while others wait for it in the barrier: the others
/// get `barrier_out` with a non-zero rc at once, and the job error names the rank (the host ends the job).
#[test]
fn a_task_disconnecting_mid_barrier_fails_the_barrier_of_the_others_promptly() {
    let (job, mut clients) = Setup::block(&[3, 3], 1).start();
    for c in &mut clients {
        c.init();
    }
    clients[0].send("cmd=barrier_in\n");
    clients[2].send("cmd=barrier_in\n");
    drop(clients.remove(1));
    for c in &mut clients {
        let out = c.recv();
        assert!(out.starts_with("cmd=barrier_out "), "{out}");
        assert_ne!(rc(&out), 0, "{out}");
        assert!(field(&out, "msg").is_some_and(|m| m.contains("rank_4")), "{out}");
    }
    let record = job.shared.wait_for("the lost task", |r| !r.errors.is_empty());
    assert_eq!(record.errors, [JobError::TaskLost { rank: 4, finalized: false }]);
    assert!(record.errors[0].to_string().starts_with("rank 4 closed its PMI connection"));
    assert!(record.collectives.is_empty(), "the collective never started");
    drop(record);
    drop(clients);
    job.finished();
}

/// RFC 13: `PMI_Abort` ends the job; the host gets the exit code (negative codes included, docs/clients.md) and
/// the message (spaces and `=` included), and the task gets RFC 13's `S:abort`, an empty line (MPICH 4.0.2
/// waits for it). An abort is not reported again as a lost task.
#[test]
fn abort_reaches_the_host_with_its_code_and_message_and_gets_an_empty_line() {
    let (job, mut clients) = Setup::block(&[2, 2], 1).start();
    for c in &mut clients {
        c.init();
    }
    clients[1].send("cmd=abort exitcode=-7 message=rank 3: out of memory = bad\n");
    assert_eq!(clients[1].raw_line(), b"\n");
    assert_eq!(job.shared.get().aborts, [(3, -7, "rank 3: out of memory = bad".to_string())]);
    // MPICH 4.0.2's form, without a message.
    clients[0].send("cmd=abort exitcode=-1\n");
    assert_eq!(clients[0].raw_line(), b"\n");
    let shared = job.shared.clone();
    assert_eq!(shared.get().aborts[1], (2, -1, String::new()));
    drop(clients);
    job.finished();
    assert!(shared.get().errors.is_empty(), "an abort is not reported again: {:?}", shared.get().errors);
}

/// RFC 13: `finalize` is acknowledged; closing the connection after it is how every task ends, quietly.
#[test]
fn finalize_is_acknowledged_and_leaving_after_it_is_quiet() {
    let (job, mut clients) = Setup::block(&[3], 0).start();
    for c in &mut clients {
        c.init();
    }
    assert!(barrier(&mut clients).iter().all(|out| out == "cmd=barrier_out rc=0"));
    for c in &mut clients {
        assert_eq!(c.ask("cmd=finalize"), "cmd=finalize_ack rc=0");
    }
    let shared = job.shared.clone();
    drop(clients);
    job.finished();
    assert!(shared.get().errors.is_empty(), "{:?}", shared.get().errors);
}

/// The progress thread ends by itself: `Driver::run` returns once every task has closed its connection, and
/// not before.
#[test]
fn the_driver_returns_once_every_task_has_closed_its_connection() {
    let (job, mut clients) = Setup::block(&[3], 0).start();
    for c in &mut clients {
        c.init();
    }
    let mut last = clients.pop().unwrap();
    drop(clients);
    // The two closes reach the driver before this answer does, or in the same round: it still runs.
    assert_eq!(last.ask("cmd=get_appnum"), "cmd=appnum rc=0 appnum=0");
    assert!(job.running(), "Driver::run returned with a task still connected");
    assert_eq!(last.ask("cmd=finalize"), "cmd=finalize_ack rc=0");
    drop(last);
    job.finished();
}

/// A host's other thread can hand over connections (`Event::Attach`) once the driver runs, and stop it
/// (`Event::Stop`) with tasks still connected.
#[test]
fn connections_attached_through_the_handle_are_served_and_a_stop_ends_the_driver() {
    let (job, mut clients) = Setup::block(&[2], 0).attach_by_event().start();
    for c in &mut clients {
        c.init();
    }
    assert!(barrier(&mut clients).iter().all(|out| out == "cmd=barrier_out rc=0"));
    job.post(Event::Stop);
    job.finished();
    drop(clients);
}

// ---------------------------------------------------------------------------------------------------------
// The optional services: name publishing and spawn.

/// RFC 13: publish, unpublish and lookup are OPTIONAL; a host that offers none makes them fail at once with
/// a non-zero rc and a message.
#[test]
fn publish_unpublish_and_lookup_without_host_support_fail_with_a_message() {
    let (job, mut clients) = Setup::block(&[1], 0).start();
    let c = &mut clients[0];
    for (request, cmd) in [
        ("cmd=publish_name service=ocean port=tcp://h:1", "cmd=publish_result"),
        ("cmd=unpublish_name service=ocean", "cmd=unpublish_result"),
        ("cmd=lookup_name service=ocean", "cmd=lookup_result"),
    ] {
        let answer = c.ask(request);
        assert!(answer.starts_with(&format!("{cmd} ")), "{answer}");
        assert_ne!(rc(&answer), 0, "{answer}");
        assert!(field(&answer, "msg").is_some(), "{answer}");
        assert_eq!(field(&answer, "port"), None, "{answer}");
    }
    // The task goes on.
    assert_eq!(c.ask("cmd=get_appnum"), "cmd=appnum rc=0 appnum=0");
    drop(clients);
    job.finished();
}

/// A host that offers the name service answers later, from another thread, through the driver handle.
#[test]
fn publish_and_lookup_through_a_host_that_offers_them() {
    let (job, mut clients) = Setup::block(&[1], 0).offer_services().start();
    let c = &mut clients[0];
    let steps: [(&str, HostReply, &str); 4] = [
        ("cmd=publish_name service=ocean port=tcp://h:1", HostReply::Done, "cmd=publish_result rc=0"),
        ("cmd=lookup_name service=ocean", HostReply::Port("tcp://h:1".into()), "cmd=lookup_result rc=0 port=tcp://h:1"),
        (
            "cmd=lookup_name service=sea",
            HostReply::Failed("no such service".into()),
            "cmd=lookup_result rc=-1 msg=no_such_service",
        ),
        ("cmd=unpublish_name service=ocean", HostReply::Done, "cmd=unpublish_result rc=0"),
    ];
    for (n, (request, reply, want)) in steps.into_iter().enumerate() {
        c.send(format!("{request}\n"));
        drop(job.shared.wait_for("the request", |r| r.requests.len() == n + 1));
        job.post(Event::HostReply(0, reply));
        assert_eq!(c.recv(), want);
    }
    let requests: Vec<String> = job.shared.get().requests.iter().map(|(_, r)| r.clone()).collect();
    assert_eq!(
        requests,
        [
            r#"Publish { service: "ocean", port: "tcp://h:1" }"#,
            r#"Lookup { service: "ocean" }"#,
            r#"Lookup { service: "sea" }"#,
            r#"Unpublish { service: "ocean" }"#,
        ]
    );
    drop(clients);
    job.finished();
}

/// An untyped answer posted from another thread (as the C ABI's `service_complete` posts it) is read by the
/// service the task asked for.
#[test]
fn untyped_answers_from_another_thread_are_read_by_the_service_asked_for() {
    let (job, mut clients) = Setup::block(&[1], 0).offer_services().start();
    let c = &mut clients[0];
    c.send("cmd=lookup_name service=ocean\n");
    drop(job.shared.wait_for("the request", |r| r.requests.len() == 1));
    job.post(Event::UntypedReply { task: 0, ok: true, text: Some("tcp://h:1".into()) });
    assert_eq!(c.recv(), "cmd=lookup_result rc=0 port=tcp://h:1");
    drop(clients);
    job.finished();
}

/// RFC 13's `C:spawn` as MPICH sends it, `argN` after `argcnt`.
const SPAWN_ARGS_AFTER: &str = "mcmd=spawn\nnprocs=2\nexecname=./child\ntotspawns=1\nspawnssofar=1\n\
    argcnt=2\narg1=-v\narg2=a b\npreput_num=1\npreput_key_0=PARENT_ROOT_PORT_NAME\npreput_val_0=tag#0$\n\
    info_num=1\ninfo_key_0=wdir\ninfo_val_0=/tmp x\nendcmd\n";
/// The same request with the fields in RFC 13's ABNF order, `argN` before `argcnt` (and a preput's value
/// before its key).
const SPAWN_ARGS_BEFORE: &str = "mcmd=spawn\nnprocs=2\nexecname=./child\ntotspawns=1\nspawnssofar=1\n\
    arg1=-v\narg2=a b\nargcnt=2\npreput_num=1\npreput_val_0=tag#0$\npreput_key_0=PARENT_ROOT_PORT_NAME\n\
    info_num=1\ninfo_key_0=wdir\ninfo_val_0=/tmp x\nendcmd\n";

/// RFC 13: spawn is optional; a host that does not offer it makes the whole multi-line request fail with
/// `cmd=spawn_result rc=-1`, and the task goes on.
#[test]
fn spawn_without_host_support_answers_spawn_result_rc_minus_1() {
    let (job, mut clients) = Setup::block(&[1], 0).start();
    let c = &mut clients[0];
    c.init();
    c.send(SPAWN_ARGS_AFTER);
    let answer = c.recv();
    assert!(answer.starts_with("cmd=spawn_result rc=-1"), "{answer}");
    assert!(field(&answer, "msg").is_some(), "{answer}");
    assert_eq!(c.ask("cmd=get_appnum"), "cmd=appnum rc=0 appnum=0");
    assert!(job.shared.get().errors.is_empty());
    drop(clients);
    job.finished();
}

/// docs/clients.md: spawn's field order varies between client versions (`argN` before or after `argcnt`); both
/// reach the host as the same request, and the host's answer comes back as `errcodes=`.
#[test]
fn spawn_fields_in_either_order_reach_the_host_as_the_same_request() {
    let (job, mut clients) = Setup::block(&[2], 0).offer_services().start();
    for (task, (c, lines)) in clients.iter_mut().zip([SPAWN_ARGS_AFTER, SPAWN_ARGS_BEFORE]).enumerate() {
        c.init();
        c.send(lines);
        drop(job.shared.wait_for("the spawn request", |r| r.spawns.len() == task + 1));
        job.post(Event::HostReply(task, HostReply::Spawned { errcodes: vec![0, 0] }));
        assert_eq!(c.recv(), "cmd=spawn_result rc=0 errcodes=0,0");
    }
    let want = SpawnRequest {
        commands: vec![SpawnCommand {
            nprocs: 2,
            execname: b"./child".to_vec(),
            args: vec![b"-v".to_vec(), b"a b".to_vec()],
            preputs: vec![(b"PARENT_ROOT_PORT_NAME".to_vec(), b"tag#0$".to_vec())],
            infos: vec![(b"wdir".to_vec(), b"/tmp x".to_vec())],
        }],
    };
    let record = job.shared.get();
    assert_eq!(record.spawns, [(0, want.clone()), (1, want)]);
    drop(record);
    drop(clients);
    job.finished();
}

// ---------------------------------------------------------------------------------------------------------
// Load.

/// 64 tasks of one shell (and 64 more on another shell, through the collective) run MPICH's wire-up sequence
/// concurrently, each from its own thread: init, maxes, kvsname, process mapping, put, barrier, get every
/// rank's card, barrier, finalize, close. A small load test, not a timed one.
#[test]
fn sixty_four_tasks_wire_up_concurrently() {
    const LOCAL: u32 = 64;
    const SIZE: u32 = 2 * LOCAL;
    let card = |rank: u32| format!("card-{rank}-{}", "0123456789abcdef=".repeat(1 + rank as usize % 8));
    let others: Vec<(u32, String, String)> = (LOCAL..SIZE).map(|r| (r, format!("card-{r}"), card(r))).collect();
    let others: Vec<(u32, &str, &str)> = others.iter().map(|(r, k, v)| (*r, k.as_str(), v.as_str())).collect();
    let plan = vec![Collective::Gather(vec![contribution(&others)]), Collective::Gather(vec![])];
    let (job, clients) = Setup::block(&[LOCAL, LOCAL], 0).plan(plan).start();
    let threads: Vec<_> = clients
        .into_iter()
        .map(|mut c| {
            thread::spawn(move || {
                let rank = c.rank;
                c.init();
                assert_eq!(c.ask("cmd=get_maxes"), "cmd=maxes rc=0 kvsname_max=64 keylen_max=64 vallen_max=866");
                assert_eq!(c.ask("cmd=get_my_kvsname"), format!("cmd=my_kvsname rc=0 kvsname={KVS}"));
                assert_eq!(c.get(PROCESS_MAPPING_KEY), "cmd=get_result rc=0 value=(vector,(0,2,64))");
                assert_eq!(c.put(&format!("card-{rank}"), &card(rank)), "cmd=put_result rc=0");
                assert_eq!(c.ask("cmd=barrier_in"), "cmd=barrier_out rc=0");
                for r in (0..SIZE).map(|i| (i + rank) % SIZE) {
                    assert_eq!(c.get(&format!("card-{r}")), format!("cmd=get_result rc=0 value={}", card(r)));
                }
                assert_eq!(c.ask("cmd=barrier_in"), "cmd=barrier_out rc=0");
                assert_eq!(c.ask("cmd=finalize"), "cmd=finalize_ack rc=0");
            })
        })
        .collect();
    for t in threads {
        t.join().expect("a task thread failed");
    }
    let record = job.shared.get();
    assert!(record.errors.is_empty(), "{:?}", record.errors);
    assert_eq!(record.collectives.len(), 2);
    assert_eq!(record.collectives[0].split(|&b| b == b'\n').filter(|l| !l.is_empty()).count(), LOCAL as usize);
    assert!(record.collectives[1].is_empty());
    drop(record);
    job.finished();
}

/// A task that pipelines requests and never reads the answers must not make the server buffer answers
/// without bound ("untrusted input is bounded"): once the task's connection is full, the server stops
/// reading from it, so the task's own writes stall. Then, reading, the task gets every answer, in order.
#[test]
fn a_task_that_does_not_read_its_answers_is_held_back() {
    /// The task stops writing after this many bytes of requests if the server keeps taking them: at
    /// ~30 bytes a request for ~900 bytes of answer, the server would be holding ~120 MiB of answers.
    const CAP: usize = 4 << 20;
    let (job, mut clients) = Setup::block(&[2], 0).start();
    let big = "b".repeat(Limits::default().value_max());
    assert_eq!(clients[0].put("big", &big), "cmd=put_result rc=0");
    let request = format!("cmd=get kvsname={KVS} key=big\n");
    let stream = clients[1].writer.try_clone().unwrap();
    stream.set_nonblocking(true).unwrap();
    let mut written = 0usize;
    let mut pending = request.as_bytes().repeat(1024);
    'flood: while written < CAP {
        match (&stream).write(&pending) {
            Ok(n) => {
                written += n;
                pending.rotate_left(n % request.len());
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                // Stalled: wait (bounded) for the server to take more. If it never does, it holds back.
                let mut fd = libc::pollfd { fd: stream.as_raw_fd(), events: libc::POLLOUT, revents: 0 };
                // SAFETY: one live pollfd.
                if unsafe { libc::poll(&mut fd, 1, 2000) } == 0 {
                    break 'flood;
                }
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(written < CAP, "the server took {written} bytes of requests without their answers being read");
    // Finish the last request, if it was cut, while reading every answer.
    let rest = (request.len() - written % request.len()) % request.len();
    let tail = request.as_bytes()[request.len() - rest..].to_vec();
    stream.set_nonblocking(false).unwrap();
    let finisher = thread::spawn(move || (&stream).write_all(&tail));
    let answers = (written + rest) / request.len();
    let want = format!("cmd=get_result rc=0 value={big}");
    for _ in 0..answers {
        assert_eq!(clients[1].recv(), want);
    }
    finisher.join().unwrap().unwrap();
    assert_eq!(clients[1].ask("cmd=get_appnum"), "cmd=appnum rc=0 appnum=0");
    drop(clients);
    job.finished();
}

// ---------------------------------------------------------------------------------------------------------
// PMI-2, on a connection whose client asked for version 2 at `cmd=init` (MPICH 4.1 and later with
// `MPIR_CVAR_PMI_VERSION=2`, Slurm's and Cray's libpmi2): frames of a 6-byte length and `key=value;` pairs.

impl Client {
    /// `cmd=init pmi_version=2 pmi_subversion=0`, answered on a PMI-1 line; PMI-2 frames follow.
    fn init2(&mut self) {
        let answer = self.ask("cmd=init pmi_version=2 pmi_subversion=0");
        assert_eq!(answer, "cmd=response_to_init rc=0 pmi_version=2 pmi_subversion=0");
    }

    /// Writes one PMI-2 frame with `body`, its length prefix as MPICH writes it.
    fn send2(&mut self, body: &str) {
        self.send(frame2(body));
    }

    /// Reads one PMI-2 frame and checks it: a 6-byte decimal length, then exactly that many bytes that begin
    /// with `cmd=` and end with `;`. Returns its body.
    fn recv2(&mut self) -> String {
        let mut header = [0u8; 6];
        self.reader.read_exact(&mut header).unwrap_or_else(|e| panic!("rank {}: no PMI-2 answer: {e}", self.rank));
        let len: usize = lossy(&header).trim().parse().unwrap_or_else(|_| panic!("a bad prefix {:?}", lossy(&header)));
        let mut body = vec![0u8; len];
        self.reader.read_exact(&mut body).unwrap();
        let body = String::from_utf8(body).unwrap();
        assert!(body.starts_with("cmd=") && body.ends_with(';'), "a malformed PMI-2 answer {body:?}");
        if let Err(why) = slurm_libpmi2_reads(&body) {
            panic!("Slurm's libpmi2 would refuse {body:?}: {why}");
        }
        body
    }

    fn ask2(&mut self, body: &str) -> String {
        self.send2(body);
        self.recv2()
    }
}

fn frame2(body: &str) -> String {
    format!("{:>6}{body}", body.len())
}

/// Reads a PMI-2 answer as the strictest real client does, Slurm's libpmi2 (`contribs/pmi2/pmi2_api.c`):
/// every pair ends with `;` (a `;` in a value doubled), keys of at most 64 bytes and values of at most 1024,
/// an integer `rc`; `found`, `pmiverbose`, `debugged` and `kvscopy` exactly `TRUE` or `FALSE`; and a
/// successful `fullinit-response` carries `pmi-version`, `pmi-subversion`, `rank`, `size` and `appnum`.
fn slurm_libpmi2_reads(body: &str) -> Result<(), String> {
    let mut pairs = Vec::new();
    let mut rest = body;
    while !rest.is_empty() {
        let (key, after) = rest.split_once('=').ok_or("a pair without '='")?;
        let (mut value, mut i) = (String::new(), 0);
        let bytes = after.as_bytes();
        loop {
            match bytes.get(i) {
                None => return Err(format!("'{key}' does not end with ';'")),
                Some(b';') if bytes.get(i + 1) == Some(&b';') => {
                    value.push(';');
                    i += 2;
                }
                Some(b';') => break,
                Some(&b) => {
                    value.push(b as char);
                    i += 1;
                }
            }
        }
        if key.len() > 64 || value.len() > 1024 {
            return Err(format!("'{key}' is longer than the library's bounds"));
        }
        pairs.push((key.to_string(), value));
        rest = &after[i + 1..];
    }
    let get = |k: &str| pairs.iter().find(|(key, _)| key == k).map(|(_, v)| v.as_str());
    let int = |k: &str| get(k).ok_or(format!("no '{k}'"))?.parse::<i64>().map_err(|_| format!("'{k}' is no integer"));
    let rc = int("rc")?;
    for k in ["found", "pmiverbose", "debugged", "kvscopy"] {
        if get(k).is_some_and(|v| v != "TRUE" && v != "FALSE") {
            return Err(format!("'{k}' is not TRUE or FALSE"));
        }
    }
    if get("cmd") == Some("fullinit-response") && rc == 0 {
        for k in ["pmi-version", "pmi-subversion", "rank", "size", "appnum"] {
            int(k)?;
        }
    }
    Ok(())
}

/// The checker above refuses what Slurm's libpmi2 refuses (rpmi sent each of these once).
#[test]
fn slurm_libpmi2_rules() {
    assert_eq!(
        slurm_libpmi2_reads(
            "cmd=fullinit-response;rc=0;pmi-version=2;pmi-subversion=0;rank=1;size=2;appnum=0;pmiverbose=FALSE;"
        ),
        Ok(())
    );
    let refused = [
        "cmd=fullinit-response;rc=0;rank=1;size=2;appnum=0;pmiverbose=FALSE;",
        "cmd=fullinit-response;rc=0;pmi-version=2;pmi-subversion=0;rank=1;size=2;appnum=0;pmiverbose=0;",
        "cmd=kvs-get-response;rc=0;found=1;",
        "cmd=kvs-get-response;rc=0;found=TRUE;value=a;;",
        "cmd=kvs-get-response;found=FALSE;",
    ];
    for body in refused {
        assert!(slurm_libpmi2_reads(body).is_err(), "{body}");
    }
}

#[test]
fn pmi2_fullinit_job_attributes_and_finalize() {
    let mut setup = Setup::block(&[2, 2], 1);
    setup.job.universe_size = 8;
    setup.job.spawned = true;
    let (job, mut clients) = setup.start();
    let c = &mut clients[0];
    c.init2();
    assert_eq!(
        c.ask2("cmd=fullinit;pmirank=2;"),
        "cmd=fullinit-response;rc=0;pmi-version=2;pmi-subversion=0;rank=2;size=4;appnum=0;spawner-jobid=spawner;\
         pmiverbose=FALSE;"
    );
    // Without PMI_RANK MPICH sends -1; Slurm's clients add a jobid. A rank not the connection's fails.
    assert!(c
        .ask2("cmd=fullinit;pmijobid=7.0;pmirank=-1;threaded=FALSE;")
        .contains(";rc=0;pmi-version=2;pmi-subversion=0;rank=2;"));
    let wrong = c.ask2("cmd=fullinit;pmirank=3;");
    assert!(wrong.starts_with("cmd=fullinit-response;rc=-1;errmsg=fullinit names rank 3"), "{wrong}");
    assert_eq!(c.ask2("cmd=job-getid;"), format!("cmd=job-getid-response;rc=0;jobid={KVS};"));
    assert_eq!(
        c.ask2("cmd=info-getjobattr;key=PMI_process_mapping;"),
        "cmd=info-getjobattr-response;rc=0;value=(vector,(0,2,2));found=TRUE;"
    );
    assert_eq!(
        c.ask2("cmd=info-getjobattr;key=universeSize;"),
        "cmd=info-getjobattr-response;rc=0;value=8;found=TRUE;"
    );
    assert_eq!(c.ask2("cmd=info-getjobattr;key=PMI_hwloc_xmlfile;"), "cmd=info-getjobattr-response;rc=0;found=FALSE;");
    // A threaded client's thrid comes back, before rc.
    assert_eq!(c.ask2("cmd=job-getid;thrid=0x55d0;"), format!("cmd=job-getid-response;thrid=0x55d0;rc=0;jobid={KVS};"));
    for cmd in ["job-connect", "job-disconnect"] {
        let refused = c.ask2(&format!("cmd={cmd};jobid=other;"));
        assert!(refused.starts_with(&format!("cmd={cmd}-response;rc=-1;errmsg={cmd} is not served")), "{refused}");
    }
    assert_eq!(c.ask2("cmd=finalize;"), "cmd=finalize-response;rc=0;");
    clients[1].init2();
    assert_eq!(clients[1].ask2("cmd=finalize;"), "cmd=finalize-response;rc=0;");
    assert!(job.shared.get().errors.is_empty());
    drop(clients);
    job.finished();
}

/// kvs-put, kvs-fence and kvs-get, with another shell's puts brought by the collective; a PMI-1 task of the
/// same shell meets the PMI-2 ones in the same barrier and reads their puts.
#[test]
fn pmi2_put_fence_get_beside_a_pmi1_task() {
    let mut other = Vec::new();
    kvs::encode(&mut other, 0, b"card-0", b"from node 0");
    let (job, mut clients) = Setup::block(&[1, 2], 1).plan(vec![Collective::Gather(vec![other])]).start();
    let (v2, v1) = clients.split_at_mut(1);
    let (a, b) = (&mut v2[0], &mut v1[0]);
    a.init2();
    b.init();
    assert_eq!(a.ask2("cmd=kvs-put;key=card-1;value=a;;b c=d;"), "cmd=kvs-put-response;rc=0;");
    assert_eq!(b.put("card-2", "plain"), "cmd=put_result rc=0");
    // Before the fence, another node's key is not there yet.
    let missing = a.ask2(&format!("cmd=kvs-get;jobid={KVS};srcid=0;key=card-0;"));
    assert_eq!(missing, "cmd=kvs-get-response;rc=0;found=FALSE;");
    a.send2("cmd=kvs-fence;");
    b.send("cmd=barrier_in\n");
    assert_eq!(a.recv2(), "cmd=kvs-fence-response;rc=0;");
    assert_eq!(b.recv(), "cmd=barrier_out rc=0");
    for (key, value) in [("card-0", "from node 0"), ("card-1", "a;;b c=d"), ("card-2", "plain")] {
        let got = a.ask2(&format!("cmd=kvs-get;jobid={KVS};srcid=-1;key={key};"));
        assert_eq!(got, format!("cmd=kvs-get-response;rc=0;value={value};found=TRUE;"));
    }
    assert_eq!(b.get("card-1"), "cmd=get_result rc=0 value=a;b c=d");
    // An empty jobid is this job's: Slurm's libpmi2 sends one for a NULL id.
    assert_eq!(a.ask2("cmd=kvs-get;jobid=;srcid=0;key=card-2;"), "cmd=kvs-get-response;rc=0;value=plain;found=TRUE;");
    // Another job's key-value space is not this task's to read.
    let other_job = a.ask2("cmd=kvs-get;jobid=kvs_99;srcid=0;key=card-0;");
    assert!(other_job.starts_with("cmd=kvs-get-response;rc=-1;errmsg=no job of that jobid"), "{other_job}");
    // A PMI-2 value may be longer than a PMI-1 line holds; the PMI-1 task is told, not sent a long line.
    let long = "v".repeat(1000);
    assert_eq!(a.ask2(&format!("cmd=kvs-put;key=long;value={long};")), "cmd=kvs-put-response;rc=0;");
    let too_long = a.ask2(&format!("cmd=kvs-put;key=longer;value={};", "v".repeat(1024)));
    assert!(too_long.starts_with("cmd=kvs-put-response;rc=-1;errmsg=value longer than 1023"), "{too_long}");
    a.send2("cmd=kvs-fence;");
    b.send("cmd=barrier_in\n");
    assert_eq!(a.recv2(), "cmd=kvs-fence-response;rc=0;");
    assert_eq!(b.recv(), "cmd=barrier_out rc=0");
    assert!(b.get("long").starts_with("cmd=get_result rc=7 msg=value_longer_than_a_PMI-1_line"));
    assert_eq!(a.ask2("cmd=kvs-get;key=long;"), format!("cmd=kvs-get-response;rc=0;value={long};found=TRUE;"));
    assert!(job.shared.get().errors.is_empty());
    drop(clients);
    job.finished();
}

/// Node attributes are the shell's: a get finds what a task of the node put; with `wait`, it is answered
/// when the attribute comes, or as not found once no task of the node could put it any more.
#[test]
fn pmi2_node_attributes_wait_and_never_hang() {
    let (job, mut clients) = Setup::block(&[3], 0).start();
    for c in clients.iter_mut() {
        c.init2();
    }
    let got = |c: &mut Client, key: &str, wait: &str| c.ask2(&format!("cmd=info-getnodeattr;key={key};wait={wait};"));
    assert_eq!(got(&mut clients[1], "-bcast-1-0", "FALSE"), "cmd=info-getnodeattr-response;rc=0;found=FALSE;");
    // Tasks 1 and 2 wait; task 0's put answers both.
    for c in &mut clients[1..] {
        c.send2("cmd=info-getnodeattr;key=-bcast-1-0;wait=TRUE;");
    }
    thread::sleep(Duration::from_millis(50));
    assert_eq!(
        clients[0].ask2("cmd=info-putnodeattr;key=-bcast-1-0;value=2F6465;"),
        "cmd=info-putnodeattr-response;rc=0;"
    );
    for c in &mut clients[1..] {
        assert_eq!(c.recv2(), "cmd=info-getnodeattr-response;rc=0;value=2F6465;found=TRUE;");
    }
    assert_eq!(
        got(&mut clients[2], "-bcast-1-0", "TRUE"),
        "cmd=info-getnodeattr-response;rc=0;value=2F6465;found=TRUE;"
    );
    // Task 1 waits for an attribute nobody puts; once the others are in the fence, nobody can: not found.
    clients[1].send2("cmd=info-getnodeattr;key=never;wait=TRUE;");
    clients[0].send2("cmd=kvs-fence;");
    clients[2].send2("cmd=kvs-fence;");
    assert_eq!(clients[1].recv2(), "cmd=info-getnodeattr-response;rc=0;found=FALSE;");
    assert_eq!(clients[1].ask2("cmd=kvs-fence;"), "cmd=kvs-fence-response;rc=0;");
    assert_eq!(clients[0].recv2(), "cmd=kvs-fence-response;rc=0;");
    assert_eq!(clients[2].recv2(), "cmd=kvs-fence-response;rc=0;");
    // The same when the others leave instead.
    clients[1].send2("cmd=info-getnodeattr;key=never;wait=TRUE;");
    assert_eq!(clients[0].ask2("cmd=finalize;"), "cmd=finalize-response;rc=0;");
    assert_eq!(clients[2].ask2("cmd=finalize;"), "cmd=finalize-response;rc=0;");
    assert_eq!(clients[1].recv2(), "cmd=info-getnodeattr-response;rc=0;found=FALSE;");
    assert!(job.shared.get().errors.is_empty());
    drop(clients);
    job.finished();
}

/// A threaded client (`fullinit` with `threaded=TRUE`) may ask while one of its threads waits for a node
/// attribute, a fence included: each answer carries its request's `thrid`, its own put answers its wait, and
/// its wait is never taken for one nobody could answer (another of its threads may put it). Not a second wait.
#[test]
fn pmi2_threaded_clients_ask_while_a_thread_waits_for_a_node_attribute() {
    let (job, mut clients) = Setup::block(&[3], 0).start();
    for (rank, c) in clients.iter_mut().enumerate() {
        c.init2();
        let threaded = if rank == 1 { "TRUE" } else { "FALSE" };
        let answer = c.ask2(&format!("cmd=fullinit;pmirank={rank};threaded={threaded};"));
        assert!(answer.starts_with("cmd=fullinit-response;rc=0;"), "{answer}");
    }
    let c = &mut clients[1];
    c.send2("cmd=info-getnodeattr;thrid=0x1;key=shm;wait=TRUE;");
    assert_eq!(c.ask2("cmd=kvs-put;thrid=0x2;key=k1;value=v1;"), "cmd=kvs-put-response;thrid=0x2;rc=0;");
    assert_eq!(
        c.ask2("cmd=info-getnodeattr;thrid=0x3;key=shm;wait=FALSE;"),
        "cmd=info-getnodeattr-response;thrid=0x3;rc=0;found=FALSE;"
    );
    // Every other task in the fence: the wait stays (a non-threaded task's would be answered not found).
    clients[0].send2("cmd=kvs-fence;");
    clients[2].send2("cmd=kvs-fence;");
    thread::sleep(Duration::from_millis(50));
    let c = &mut clients[1];
    assert_eq!(c.ask2("cmd=job-getid;thrid=0x4;"), format!("cmd=job-getid-response;thrid=0x4;rc=0;jobid={KVS};"));
    c.send2("cmd=info-putnodeattr;thrid=0x5;key=shm;value=2F6465;");
    assert_eq!(c.recv2(), "cmd=info-getnodeattr-response;thrid=0x1;rc=0;value=2F6465;found=TRUE;");
    assert_eq!(c.recv2(), "cmd=info-putnodeattr-response;thrid=0x5;rc=0;");
    assert_eq!(c.ask2("cmd=kvs-fence;"), "cmd=kvs-fence-response;rc=0;");
    assert_eq!(clients[0].recv2(), "cmd=kvs-fence-response;rc=0;");
    assert_eq!(clients[2].recv2(), "cmd=kvs-fence-response;rc=0;");
    // A fence while it waits, for an attribute another task puts after the fence.
    let c = &mut clients[1];
    c.send2("cmd=info-getnodeattr;thrid=0x6;key=late;wait=TRUE;");
    c.send2("cmd=kvs-fence;thrid=0x7;");
    clients[0].send2("cmd=kvs-fence;");
    clients[2].send2("cmd=kvs-fence;");
    assert_eq!(clients[1].recv2(), "cmd=kvs-fence-response;thrid=0x7;rc=0;");
    assert_eq!(clients[0].recv2(), "cmd=kvs-fence-response;rc=0;");
    assert_eq!(clients[2].recv2(), "cmd=kvs-fence-response;rc=0;");
    assert_eq!(clients[0].ask2("cmd=info-putnodeattr;key=late;value=1;"), "cmd=info-putnodeattr-response;rc=0;");
    assert_eq!(clients[1].recv2(), "cmd=info-getnodeattr-response;thrid=0x6;rc=0;value=1;found=TRUE;");
    assert!(job.shared.get().errors.is_empty());
    // A second wait while one waits is a protocol error.
    let c = &mut clients[1];
    c.send2("cmd=info-getnodeattr;thrid=0x8;key=never;wait=TRUE;");
    c.send2("cmd=info-getnodeattr;thrid=0x9;key=never2;wait=TRUE;");
    let record = job.shared.wait_for("the protocol error", |r| !r.errors.is_empty());
    let said = record.errors[0].to_string();
    assert!(said.contains("rank 1") && said.contains("a second wait"), "{said}");
    drop(record);
    c.assert_cut_off();
    drop(clients);
    job.finished();
}

/// Flux's libpmi2 writes node attributes as PMI-1 puts and gets of `local::NAME`, which its own server keeps
/// per node and shows the node's tasks at once: served the same way, as PMI-2's node attributes. A get before
/// the put answers `PMI_ERR_INVALID_KEY` (4), the one code on which Flux's client polls again.
#[test]
fn local_keys_are_the_nodes_attributes_seen_without_a_barrier() {
    let (job, mut clients) = Setup::block(&[3], 0).start();
    clients[0].init();
    clients[1].init();
    clients[2].init2();
    assert_eq!(clients[1].get("local::shm"), "cmd=get_result rc=4 msg=not_put_yet_on_this_node");
    // A PMI-2 task waits for the attribute; a PMI-1 task's put answers it, and PMI-1 tasks see it at once.
    clients[2].send2("cmd=info-getnodeattr;key=shm;wait=TRUE;");
    thread::sleep(Duration::from_millis(50));
    assert_eq!(clients[0].put("local::shm", "2F6465"), "cmd=put_result rc=0");
    assert_eq!(clients[2].recv2(), "cmd=info-getnodeattr-response;rc=0;value=2F6465;found=TRUE;");
    assert_eq!(clients[1].get("local::shm"), "cmd=get_result rc=0 value=2F6465");
    // The other way round, and a new value replaces the old.
    assert_eq!(clients[2].ask2("cmd=info-putnodeattr;key=shm;value=beef;"), "cmd=info-putnodeattr-response;rc=0;");
    assert_eq!(clients[0].get("local::shm"), "cmd=get_result rc=0 value=beef");
    // It is the node's, not the job's: the barrier carries nothing of it, and the store has no such key.
    for c in &mut clients[..2] {
        c.send("cmd=barrier_in\n");
    }
    clients[2].send2("cmd=kvs-fence;");
    assert_eq!(clients[2].recv2(), "cmd=kvs-fence-response;rc=0;");
    for c in &mut clients[..2] {
        assert_eq!(c.recv(), "cmd=barrier_out rc=0");
    }
    let collectives = job.shared.get().collectives.clone();
    assert!(collectives.iter().all(|part| !lossy(part).contains("shm")), "{collectives:?}");
    assert_eq!(clients[1].get("shm"), "cmd=get_result rc=-1 msg=key_not_found");
    assert!(job.shared.get().errors.is_empty());
    drop(clients);
    job.finished();
}

/// abort ends the job with its code and message (the client exits without an answer); names and spawn go
/// to the host as PMI-1's do, and come back as PMI-2 answers (a spawn with any process not started fails:
/// PMI-2 has no error codes).
#[test]
fn pmi2_abort_names_and_spawn_through_the_host() {
    let (job, mut clients) = Setup::block(&[2], 0).offer_services().start();
    let c = &mut clients[0];
    c.init2();
    let steps: [(&str, HostReply, &str); 4] = [
        ("cmd=name-publish;name=ocean;port=tcp://h:1;", HostReply::Done, "cmd=name-publish-response;rc=0;"),
        (
            "cmd=name-lookup;name=ocean;",
            HostReply::Port("tcp://h:1".into()),
            "cmd=name-lookup-response;rc=0;port=tcp://h:1;value=tcp://h:1;",
        ),
        (
            "cmd=name-lookup;name=sea;",
            HostReply::Failed("no such service".into()),
            "cmd=name-lookup-response;rc=-1;errmsg=no such service;",
        ),
        ("cmd=name-unpublish;name=ocean;", HostReply::Done, "cmd=name-unpublish-response;rc=0;"),
    ];
    for (n, (request, reply, want)) in steps.into_iter().enumerate() {
        c.send2(request);
        drop(job.shared.wait_for("the request", |r| r.requests.len() == n + 1));
        job.post(Event::HostReply(0, reply));
        assert_eq!(c.recv2(), want);
    }
    let spawn = "cmd=spawn;thrid=0x1;ncmds=2;preputcount=1;ppkey0=PARENT_ROOT_PORT_NAME;ppval0=tag#0$;\
                 subcmd=./child;maxprocs=2;argc=2;argv0=-v;argv1=a b;infokeycount=1;infokey0=wdir;infoval0=/tmp x;\
                 subcmd=./other;maxprocs=1;argc=0;infokeycount=0;";
    for (n, (codes, want)) in [
        (vec![0, 0, 0], "cmd=spawn-response;thrid=0x1;rc=0;errcodes=0,0,0;"),
        (
            vec![0, -1, 0],
            "cmd=spawn-response;thrid=0x1;rc=-1;errmsg=1 of the 3 processes failed to start;errcodes=0,-1,0;",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        c.send2(spawn);
        drop(job.shared.wait_for("the spawn", |r| r.spawns.len() == n + 1));
        job.post(Event::HostReply(0, HostReply::Spawned { errcodes: codes }));
        assert_eq!(c.recv2(), want);
    }
    let preputs = vec![(b"PARENT_ROOT_PORT_NAME".to_vec(), b"tag#0$".to_vec())];
    let want = SpawnRequest {
        commands: vec![
            SpawnCommand {
                nprocs: 2,
                execname: b"./child".to_vec(),
                args: vec![b"-v".to_vec(), b"a b".to_vec()],
                preputs,
                infos: vec![(b"wdir".to_vec(), b"/tmp x".to_vec())],
            },
            // The preputs go with the first command: the new job gets every command's.
            SpawnCommand { nprocs: 1, execname: b"./other".to_vec(), args: vec![], preputs: vec![], infos: vec![] },
        ],
    };
    assert_eq!(job.shared.get().spawns[0], (0, want));
    let d = &mut clients[1];
    d.init2();
    // Older clients double a `;` in a value.
    d.send2("cmd=abort;exitcode=42;message=lost;; my way;");
    let record = job.shared.wait_for("the abort", |r| !r.aborts.is_empty());
    assert_eq!(record.aborts, [(1, 42, "lost; my way".to_string())]);
    drop(record);
    drop(clients);
    job.finished();
}

/// Frames come split anywhere and several in one write; a bad length prefix, an unknown command and a
/// request while another waits are protocol errors that cut the task off, naming its rank.
#[test]
fn pmi2_frames_split_anywhere_and_protocol_errors_cut_the_task_off() {
    let (job, mut clients) = Setup::block(&[4], 0).start();
    let c = &mut clients[0];
    c.init2();
    let all = [frame2("cmd=job-getid;"), frame2("cmd=kvs-put;key=k;value=v;"), frame2("cmd=kvs-get;key=k;")].concat();
    for piece in all.as_bytes().chunks(1) {
        c.send(piece);
    }
    assert_eq!(c.recv2(), format!("cmd=job-getid-response;rc=0;jobid={KVS};"));
    assert_eq!(c.recv2(), "cmd=kvs-put-response;rc=0;");
    assert_eq!(c.recv2(), "cmd=kvs-get-response;rc=0;value=v;found=TRUE;");
    c.send(all.clone());
    assert!(c.recv2().starts_with("cmd=job-getid-response"));
    assert!(c.recv2().starts_with("cmd=kvs-put-response"));
    assert!(c.recv2().starts_with("cmd=kvs-get-response"));
    let bad: [(&str, &str); 3] = [
        ("cmd=job-getid;", "no PMI-2 length prefix"),
        (&frame2("cmd=no-such-thing;"), "unknown command 'no-such-thing'"),
        (&format!("{}{}", frame2("cmd=info-getnodeattr;key=k;wait=TRUE;"), frame2("cmd=job-getid;")), "still waits"),
    ];
    for (i, (bytes, why)) in bad.iter().enumerate() {
        let c = &mut clients[i + 1];
        c.init2();
        c.send(bytes);
        let record = job.shared.wait_for("the protocol error", |r| r.errors.len() > i);
        let said = record.errors[i].to_string();
        assert!(said.contains(&format!("rank {}", i + 1)) && said.contains(why), "{said}");
        drop(record);
        c.assert_cut_off();
    }
    drop(clients);
    job.finished();
}

/// Only a spawn may be longer than a request line (`request_line_max`): any other frame that announces more
/// is refused, naming the rank, as soon as its first bytes say it is no spawn, before the shell holds more
/// of it than a line; a spawn of that length is read whole and goes to the host.
#[test]
fn pmi2_a_frame_over_the_line_limit_is_refused_unless_a_spawn() {
    let limits = Limits { request_line_max: 1024, ..Limits::default() };
    let (job, mut clients) = Setup::block(&[3], 0).limits(limits).offer_services().start();
    // Announced 200,000 bytes; only its start is ever sent.
    for (i, head) in ["cmd=kvs-get;key=", "c"].into_iter().enumerate() {
        let c = &mut clients[i];
        c.init2();
        c.send(format!("{:>6}{head}", 200_000));
        if head.len() < 10 {
            // Not yet known to be no spawn: its next byte says.
            thread::sleep(Duration::from_millis(50));
            assert!(job.shared.get().errors.len() == i, "refused before it could tell");
            c.send("md=kvs-put;key=");
        }
        let record = job.shared.wait_for("the refusal", |r| r.errors.len() > i);
        let said = record.errors[i].to_string();
        assert!(said.contains(&format!("rank {i}")) && said.contains("only a spawn may be longer"), "{said}");
        drop(record);
        c.assert_cut_off();
    }
    // A spawn of 3,000 bytes (its arguments), over the line limit, is served.
    let c = &mut clients[2];
    c.init2();
    let arg = "a".repeat(3000);
    c.send2(&format!("cmd=spawn;ncmds=1;preputcount=0;subcmd=./child;maxprocs=1;argc=1;argv0={arg};infokeycount=0;"));
    let record = job.shared.wait_for("the spawn", |r| !r.spawns.is_empty());
    assert_eq!(record.spawns[0].1.commands[0].args, [arg.into_bytes()]);
    assert_eq!(record.errors.len(), 2);
    drop(record);
    drop(clients);
    job.finished();
}

/// Node attributes count in the shell's one bound with its key-value store: a put that fits alone is refused
/// beside them.
#[test]
fn pmi2_node_attributes_and_the_store_share_one_bound() {
    let big = "v".repeat(1000);
    for attributes in [0, 2] {
        let limits = Limits { kvs_bytes_max: 4096, ..Limits::default() };
        let (job, mut clients) = Setup::block(&[1], 0).limits(limits).start();
        let c = &mut clients[0];
        c.init2();
        for i in 0..attributes {
            let answer = c.ask2(&format!("cmd=info-putnodeattr;key=a{i};value={big};"));
            assert_eq!(answer, "cmd=info-putnodeattr-response;rc=0;", "attribute {i}");
        }
        let put = c.ask2(&format!("cmd=kvs-put;key=k;value={big};"));
        match attributes {
            0 => assert_eq!(put, "cmd=kvs-put-response;rc=0;"),
            _ => {
                assert!(put.starts_with("cmd=kvs-put-response;rc=-1;errmsg=the job's key-value store is full"), "{put}")
            }
        }
        drop(clients);
        job.finished();
    }
}

// ---------------------------------------------------------------------------------------------------------
// PMI 1.2: group barriers.

impl Client {
    /// `init` asking for 1.2, answered 1.2 by a host that runs group exchanges.
    fn init12(&mut self) {
        assert_eq!(
            self.ask("cmd=init pmi_version=1 pmi_subversion=2"),
            "cmd=response_to_init rc=0 pmi_version=1 pmi_subversion=2"
        );
    }
}

impl Job {
    /// Waits for the `n`th group exchange (from 0) and returns its id, shells and contribution.
    fn group(&self, n: usize) -> (String, Vec<u32>, Vec<u8>) {
        self.shared.wait_for("a group exchange", |r| r.groups.len() > n).groups[n].clone()
    }

    /// Completes group exchange `id` with this shell's part and `others`.
    fn complete_group(&self, id: &str, parts: Vec<Vec<u8>>) {
        self.post(Event::GroupDone { id: id.as_bytes().to_vec(), result: Ok(parts) });
    }
}

/// 1.2 is answered only by a host that runs group exchanges: without one a client asking for 1.2 gets 1.1,
/// and a `group=` it sends all the same is a plain barrier, answered as a 1.1 client knows it. With one, a
/// client that asked for 1.1 in a job whose other tasks speak 1.2 still gets untagged barriers.
#[test]
fn pmi12_only_with_group_exchanges_and_1_1_clients_unchanged() {
    let (job, mut clients) = Setup::block(&[1], 0).start();
    let c = &mut clients[0];
    assert_eq!(
        c.ask("cmd=init pmi_version=1 pmi_subversion=2"),
        "cmd=response_to_init rc=0 pmi_version=1 pmi_subversion=1"
    );
    assert_eq!(c.ask("cmd=barrier_in group=WORLD:3"), "cmd=barrier_out rc=0");
    drop(clients);
    job.finished();

    let (job, mut clients) = Setup::block(&[3], 0).serve_groups().start();
    clients[0].init12();
    clients[1].init();
    assert_eq!(
        clients[2].ask("cmd=init pmi_version=1 pmi_subversion=0"),
        "cmd=response_to_init rc=0 pmi_version=1 pmi_subversion=1"
    );
    // A plain barrier of a 1.2 client carries tag 0 (MPICH 5 reads the tag of every barrier_out); a 1.1
    // client's carries none (Flux's and older clients read nothing else on it).
    for c in &mut clients {
        c.send("cmd=barrier_in\n");
    }
    assert_eq!(clients[0].recv(), "cmd=barrier_out rc=0 tag=0");
    for c in &mut clients[1..] {
        assert_eq!(c.recv(), "cmd=barrier_out rc=0");
    }
    drop(clients);
    job.finished();
}

/// `NODE:<tag>`, and a group whose members all run on this shell, end here: no exchange, and only the
/// members take part.
#[test]
fn pmi12_node_and_local_groups_end_on_the_shell() {
    let (job, mut clients) = Setup::block(&[3, 2], 0).serve_groups().start();
    for c in &mut clients {
        c.init12();
    }
    clients[0].send("cmd=barrier_in group=1,0:5\n");
    clients[2].send("cmd=barrier_in group=NODE:9\n");
    assert_eq!(clients[1].ask("cmd=barrier_in group=0,1:5"), "cmd=barrier_out rc=0 tag=5");
    assert_eq!(clients[0].recv(), "cmd=barrier_out rc=0 tag=5");
    clients[0].send("cmd=barrier_in group=NODE:9\n");
    assert_eq!(clients[1].ask("cmd=barrier_in group=NODE:9"), "cmd=barrier_out rc=0 tag=9");
    assert_eq!(clients[0].recv(), "cmd=barrier_out rc=0 tag=9");
    assert_eq!(clients[2].recv(), "cmd=barrier_out rc=0 tag=9");
    assert!(job.shared.get().groups.is_empty() && job.shared.get().collectives.is_empty());
    drop(clients);
    job.finished();
}

/// A task may have several group barriers outstanding (one per thread) and ask other things meanwhile; each
/// is a group exchange of its own among the member shells, and they end in whatever order those do.
#[test]
fn pmi12_group_barriers_outstanding_at_once_end_out_of_order() {
    let (job, mut clients) = Setup::block(&[3, 2], 0).serve_groups().start();
    let c = &mut clients[0];
    c.init12();
    c.send("cmd=barrier_in group=3,0:1\n");
    c.send("cmd=barrier_in group=WORLD:2\n");
    assert_eq!(c.get("PMI_process_mapping"), "cmd=get_result rc=0 value=(vector,(0,1,3),(1,1,2))");
    let (id1, shells1, _) = job.group(0);
    assert_eq!((id1.as_str(), shells1), ("0,3:1", vec![0, 1]));
    // WORLD waits for every local task.
    for other in &mut clients[1..] {
        other.init12();
        other.send("cmd=barrier_in group=WORLD:2\n");
    }
    let (id2, shells2, _) = job.group(1);
    assert_eq!((id2.as_str(), shells2), ("WORLD:2", vec![0, 1]));
    job.complete_group("WORLD:2", vec![]);
    for c in &mut clients {
        assert_eq!(c.recv(), "cmd=barrier_out rc=0 tag=2");
    }
    job.complete_group("0,3:1", vec![]);
    assert_eq!(clients[0].recv(), "cmd=barrier_out rc=0 tag=1");
    drop(clients);
    job.finished();
}

/// A member that enters a group barrier again before it ended joins the next generation: generations end
/// first in, first out, each its own exchange.
#[test]
fn pmi12_generations_end_first_in_first_out() {
    let (job, mut clients) = Setup::block(&[2, 1], 0).serve_groups().start();
    for c in &mut clients {
        c.init12();
    }
    clients[0].send("cmd=barrier_in group=0,1,2:7\n");
    clients[0].send("cmd=barrier_in group=0,1,2:7\n");
    clients[1].send("cmd=barrier_in group=0,1,2:7\n");
    let (id, shells, _) = job.group(0);
    assert_eq!((id.as_str(), shells), ("0,1,2:7", vec![0, 1]));
    // The second generation is not exchanged before the first ends, nor before rank 1 is in it.
    job.complete_group("0,1,2:7", vec![]);
    assert_eq!(clients[0].recv(), "cmd=barrier_out rc=0 tag=7");
    assert_eq!(clients[1].recv(), "cmd=barrier_out rc=0 tag=7");
    assert_eq!(job.shared.get().groups.len(), 1);
    // An answer to an exchange nobody waits for is a host bug, logged and dropped.
    job.complete_group("0,1,2:7", vec![]);
    drop(job.shared.wait_for("the host bug logged", |r| r.logs.iter().any(|(_, m)| m.contains("'0,1,2:7' completed"))));
    clients[1].send("cmd=barrier_in group=0,1,2:7\n");
    assert_eq!(job.group(1).0, "0,1,2:7");
    job.complete_group("0,1,2:7", vec![]);
    assert_eq!(clients[0].recv(), "cmd=barrier_out rc=0 tag=7");
    assert_eq!(clients[1].recv(), "cmd=barrier_out rc=0 tag=7");
    drop(clients);
    job.finished();
}

/// A group exchange carries the puts of this shell's members only, and what it brings back can be read; the
/// next plain barrier offers every put since the last world exchange to every shell.
#[test]
fn pmi12_a_group_exchange_moves_its_members_puts_only() {
    let (job, mut clients) = Setup::block(&[2, 1], 0).serve_groups().start();
    for c in &mut clients {
        c.init12();
    }
    assert_eq!(clients[0].put("k0", "v0"), "cmd=put_result rc=0");
    assert_eq!(clients[1].put("k1", "v1"), "cmd=put_result rc=0");
    clients[0].send("cmd=barrier_in group=0,2:4\n");
    let (id, _, part) = job.group(0);
    assert_eq!(lossy(&part), "0 k0=v0\n");
    job.complete_group(&id, vec![part, b"2 k2=v2\n".to_vec()]);
    assert_eq!(clients[0].recv(), "cmd=barrier_out rc=0 tag=4");
    assert_eq!(clients[0].get("k2"), "cmd=get_result rc=0 value=v2");
    clients[0].send("cmd=barrier_in\n");
    clients[1].send("cmd=barrier_in\n");
    let record = job.shared.wait_for("the plain barrier's collective", |r| !r.collectives.is_empty());
    assert_eq!(lossy(&record.collectives[0]), "0 k0=v0\n1 k1=v1\n");
    drop(record);
    for c in &mut clients {
        assert_eq!(c.recv(), "cmd=barrier_out rc=0 tag=0");
    }
    // Delivered everywhere: the next group exchange has nothing to carry.
    clients[0].send("cmd=barrier_in group=0,2:4\n");
    assert_eq!(job.group(1).2, b"");
    job.complete_group("0,2:4", vec![]);
    assert_eq!(clients[0].recv(), "cmd=barrier_out rc=0 tag=4");
    drop(clients);
    job.finished();
}

/// A group barrier that cannot end fails for the members waiting in it, never hangs: a member on this shell
/// that left without entering fails it and the job, naming its rank; a failed exchange fails it.
#[test]
fn pmi12_a_group_barrier_that_cannot_end_fails() {
    let (job, mut clients) = Setup::block(&[3, 1], 0).serve_groups().start();
    for c in &mut clients {
        c.init12();
    }
    clients[0].send("cmd=barrier_in group=0,1:3\n");
    clients[2].send("cmd=barrier_in group=2,3:8\n");
    job.group(0);
    let gone = clients.remove(1);
    drop(gone);
    let answer = clients[0].recv();
    assert!(answer.starts_with("cmd=barrier_out rc=-1 tag=3 msg=rank_1_closed"), "{answer}");
    let record = job.shared.wait_for("the job error", |r| !r.errors.is_empty());
    assert_eq!(record.errors[0], JobError::TaskLost { rank: 1, finalized: false });
    drop(record);
    job.post(Event::GroupDone { id: b"2,3:8".to_vec(), result: Err("node 1 was lost".into()) });
    assert_eq!(clients[1].recv(), "cmd=barrier_out rc=-1 tag=8 msg=node_1_was_lost");
    drop(clients);
    job.finished();
}

/// A group two tasks could not agree on, one without the caller, or too many outstanding: a protocol error
/// that names the rank and the line, and the task is cut off.
#[test]
fn pmi12_groups_no_task_could_be_answered_are_protocol_errors() {
    let (job, mut clients) = Setup::block(&[6], 0).serve_groups().start();
    let bad = [
        ("cmd=barrier_in group=0,9:1", "names rank 9, not in this job of 6 ranks"),
        ("cmd=barrier_in group=0,1:1", "a group barrier over a group without the rank"),
        ("cmd=barrier_in group=1,1:1", "names rank 1 twice"),
        ("cmd=barrier_in group=SELF:1", "not WORLD, NODE or a comma-separated list"),
    ];
    for (i, (line, why)) in bad.iter().enumerate() {
        let c = &mut clients[i + 1];
        c.init12();
        c.send(format!("{line}\n"));
        let record = job.shared.wait_for("the protocol error", |r| r.errors.len() > i);
        let said = record.errors[i].to_string();
        assert!(said.contains(&format!("rank {}", i + 1)) && said.contains(why) && said.contains(line), "{said}");
        drop(record);
        c.assert_cut_off();
    }
    let c = &mut clients[0];
    c.init12();
    for tag in 0..=64 {
        c.send(format!("cmd=barrier_in group=0,5:{tag}\n"));
    }
    let record = job.shared.wait_for("the protocol error", |r| r.errors.len() > bad.len());
    assert!(record.errors[bad.len()].to_string().contains("more than 64 group barriers outstanding"));
    drop(record);
    drop(clients);
    job.finished();
}

/// A 1.2 client's threads send group barriers without waiting for the connection: one may come while a
/// plain request waits, and a member may put again while its group exchange is out, whose part, coming
/// back, does not undo the newer value.
#[test]
fn pmi12_group_barriers_interleave_and_never_undo_a_newer_put() {
    let (job, mut clients) = Setup::block(&[2, 2], 0).serve_groups().start();
    for c in &mut clients {
        c.init12();
    }
    let c = &mut clients[0];
    c.send("cmd=barrier_in\n");
    c.send("cmd=barrier_in group=0,2:1\n");
    let (id, _, own) = job.group(0);
    assert!(job.shared.get().errors.is_empty(), "{:?}", job.shared.get().errors);
    assert_eq!(clients[1].ask("cmd=barrier_in"), "cmd=barrier_out rc=0 tag=0");
    assert_eq!(clients[0].recv(), "cmd=barrier_out rc=0 tag=0");
    let c = &mut clients[0];
    assert_eq!(c.put("k", "v1"), "cmd=put_result rc=0");
    c.send("cmd=barrier_in group=0,2:2\n");
    let (id2, _, own2) = job.group(1);
    assert_eq!(lossy(&own2), "0 k=v1\n");
    assert_eq!(c.put("k", "v2"), "cmd=put_result rc=0");
    job.complete_group(&id2, vec![own2, b"2 j=w\n".to_vec()]);
    job.complete_group(&id, vec![own]);
    let mut tags: Vec<String> = (0..2).map(|_| c.recv()).collect();
    tags.sort();
    assert_eq!(tags, ["cmd=barrier_out rc=0 tag=1", "cmd=barrier_out rc=0 tag=2"]);
    assert_eq!(c.get("k"), "cmd=get_result rc=0 value=v2");
    assert_eq!(c.get("j"), "cmd=get_result rc=0 value=w");
    drop(clients);
    job.finished();
}

/// What a group exchange carries is held by the host until it ends, and counts against the store's bound:
/// a task with many group barriers out cannot make the host hold its puts once for each.
#[test]
fn pmi12_group_exchanges_out_count_against_the_store_bound() {
    let limits = Limits { kvs_bytes_max: 8192, ..Limits::default() };
    let (job, mut clients) = Setup::block(&[1, 1], 0).serve_groups().limits(limits).start();
    let c = &mut clients[0];
    c.init12();
    assert_eq!(c.put("k", &"v".repeat(800)), "cmd=put_result rc=0");
    for tag in 1..=8 {
        c.send(format!("cmd=barrier_in group=0,1:{tag}\n"));
    }
    // The put is charged with its store entry and twice in each buffer that holds it on its way: 4.2 KB,
    // and each exchange out holds its 806 bytes more; the fifth would go over 8192.
    let refused = c.recv();
    let started = job.shared.get().groups.len();
    assert!((1..8).contains(&started), "{started} of 8 group exchanges started");
    assert!(refused.starts_with(&format!("cmd=barrier_out rc=2 tag={}", started + 1)), "{refused}");
    assert!(refused.contains("over_what_the_job's_key-value_store_bound_of_8192_bytes"), "{refused}");
    drop(clients);
    job.finished();
}

/// A task may not have two group barriers with one tag outstanding (their answers name only the tag), nor
/// a group whose written form is longer than a group exchange's id.
#[test]
fn pmi12_answers_a_task_could_not_tell_apart_are_refused() {
    let map = TaskMap::block(&[2, 398]);
    let (job, mut clients) =
        Setup::new(JobInfo::new(KVS, map.clone(), map.clique(0), hostnames(2))).serve_groups().start();
    let c = &mut clients[0];
    c.init12();
    c.send("cmd=barrier_in group=0,3:4\n");
    c.send("cmd=barrier_in group=0,5:4\n");
    let record = job.shared.wait_for("the protocol error", |r| !r.errors.is_empty());
    assert!(
        record.errors[0].to_string().contains("with the tag of 0,3:4, which the rank is still in"),
        "{:?}",
        record.errors
    );
    drop(record);
    let c = &mut clients[1];
    c.init12();
    let all: Vec<String> = (0..400).map(|r| r.to_string()).collect();
    c.send(format!("cmd=barrier_in group={}:1\n", all.join(",")));
    let record = job.shared.wait_for("the protocol error", |r| r.errors.len() > 1);
    assert!(record.errors[1].to_string().contains("longer than 1024 bytes"), "{:?}", record.errors);
    drop(record);
    drop(clients);
    job.finished();
}

/// A task that asks for PMI-2 while its group barriers are out could not read their answers: a protocol
/// error.
#[test]
fn pmi12_init_while_group_barriers_are_out_is_a_protocol_error() {
    let (job, mut clients) = Setup::block(&[1, 1], 0).serve_groups().start();
    let c = &mut clients[0];
    c.init12();
    c.send("cmd=barrier_in group=0,1:3\n");
    c.send("cmd=init pmi_version=2 pmi_subversion=0\n");
    let record = job.shared.wait_for("the protocol error", |r| !r.errors.is_empty());
    assert!(record.errors[0].to_string().contains("init while group barriers are outstanding"), "{:?}", record.errors);
    drop(record);
    c.assert_cut_off();
    drop(clients);
    job.finished();
}

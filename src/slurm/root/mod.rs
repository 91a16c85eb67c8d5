//! The collective root, run by srun in one thread for the life of the step: every node's slurmstepd joins
//! it ([`super::admit`]: it proves it serves the step, [`super::auth`]) and keeps that connection for the
//! step's control frames (aborts, errors, ranks gone, goodbyes, and which exchange its shell joined). The
//! exchange itself runs over a k-ary tree of the stepds ([`crate::collective`]): srun's root is the tree's
//! root, its children are nodes 0..k, and it tells every other node where its parent listens (PARENT). It is
//! also where aborts, job errors and lost nodes are reported: the root prints the message on srun's stderr
//! and ends the step.
//!
//! One thread, one epoll set over the listener and every connection, non-blocking I/O, so a slow or hostile
//! peer holds up nobody. Each exchange's result is one frame, shared by its k children's send queues.
//!
//! **The tree's width** is srun's environment's (`SLURM_RPMI_TREE_WIDTH`), else what the stepds build the tree
//! with (their mpi.conf, or the default): every stepd's HELLO says it, and all must agree.
//!
//! What the root decides (who waits, who is at fault, what srun exits with) is [`watch::StepMonitor`], a
//! machine without I/O; this module is the thread and the epoll loop that move its bytes.

mod monitor;

use super::admit::{Acceptor, Admission, Gate, Joined, Members};
use super::auth::{self, Secret};
use super::link::{Link, Read};
use super::protocol::{Direction, FrameError, Up};
use super::spawn::{self, Launcher, SrunEvent};
use crate::collective::{Allgather, Bounds};
use crate::os::{self, Epoll};
use monitor::{Action, Shape, StepMonitor};
use std::io;
use std::net::{IpAddr, TcpListener};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

/// Where the root's verdicts go: srun's stderr and Slurm in srun, a recorder in tests.
pub trait Reporter: Send + 'static {
    /// The first fatal event of the step: printed as an error.
    fn error(&mut self, message: &str);
    /// What only someone debugging wants (refused connections, what follows from the step's end, the bytes
    /// of each exchange): not on the job's stderr by default.
    fn debug(&mut self, message: &str);
    /// Ends the step (srun: `slurm_kill_job_step(.., SIGKILL)`).
    fn end_step(&mut self);
    /// Ends step `step` of the job, one this step spawned.
    fn end_spawned(&mut self, step: u32);
    /// Whether Slurm is ending the step's job (cancelled, timed out): its tasks then go because of it. The
    /// default says no.
    fn job_ending(&mut self) -> bool {
        false
    }
}

/// What the step's root saw, for srun's exit code.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outcome {
    /// A rank called `PMI_Abort` with this exit code (the first one, if several did).
    pub abort_code: Option<i32>,
    /// The step was ended because of an error (abort, job error, lost node).
    pub ended: bool,
    /// It was ended for a job error that no failure of its own explains (a protocol error, a bound): srun's
    /// status must then say so itself, since the tasks' show only the SIGKILL that ended the step.
    pub job_error: bool,
    /// A step it spawned began to fail first: the exit status of that step's srun (srun's own, over an
    /// abort's code that followed from it).
    pub spawned_status: Option<i32>,
}

/// The step as the root sees it.
pub struct Step {
    /// The name of every node, by node index.
    pub node_names: Vec<String>,
    /// The node of every rank.
    pub node_of: Vec<u32>,
    pub secret: Secret,
    /// The addresses the nodes' stepds connect from, where Slurm knows them; `None` admits any address.
    pub addresses: Option<Vec<IpAddr>>,
    /// What one exchange may gather, and the options that set it.
    pub bounds: Bounds,
    /// The tree's width, where srun's environment sets it; `None` takes the stepds'.
    pub width: Option<u32>,
    /// How the exchanges go, where srun's environment sets it; `None` takes the stepds'.
    pub allgather: Option<Allgather>,
    /// How to start spawned steps; `None`: the step's spawns are refused.
    pub spawn: Option<spawn::Setup>,
    /// The pipe to the srun that spawned this step, if one did: told when every task runs, and when this step
    /// begins to fail.
    pub spawned_by: Option<std::os::fd::RawFd>,
}

/// srun's root, running on a thread of its own; [`RootThread::stop`] ends it.
pub struct RootThread {
    port: u16,
    stop: Arc<OwnedFd>,
    thread: Option<JoinHandle<Outcome>>,
}

impl RootThread {
    /// Serves `listener` for `step` on a new thread.
    pub fn start(listener: TcpListener, step: Step, reporter: Box<dyn Reporter>) -> io::Result<RootThread> {
        let port = listener.local_addr()?.port();
        let stop = Arc::new(os::eventfd()?);
        let mut state = State::new(listener, step, reporter, stop.clone())?;
        let thread = std::thread::Builder::new().name("rpmi-root".into()).spawn(move || {
            crate::runtime::block_signals();
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| state.run())) {
                Ok(outcome) => outcome,
                Err(_) => Outcome { ended: true, ..Outcome::default() },
            }
        })?;
        Ok(RootThread { port, stop, thread: Some(thread) })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Stops the root after it has taken in whatever the stepds already sent, and says what it saw.
    pub fn stop(mut self) -> Outcome {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Outcome {
        os::wake(&self.stop);
        self.thread.take().and_then(|t| t.join().ok()).unwrap_or_default()
    }
}

impl Drop for RootThread {
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.shutdown();
        }
    }
}

const STOP: u64 = u64::MAX - 1;
/// The acceptor's tokens start here; a node's connection's token is its node index.
const ACCEPTOR: u64 = 1 << 32;
/// The spawned sruns' tokens start here.
const SPAWNED: u64 = 1 << 48;

/// The I/O around the monitor: one epoll set over the listener, every node's connection and the spawned
/// sruns' pipes.
struct State {
    monitor: StepMonitor,
    reporter: Box<dyn Reporter>,
    /// The pipe to the srun that spawned this step, if one did.
    spawned_by: Option<RawFd>,
    /// Kept open while the thread watches it (the [`RootThread`] holds the other reference).
    _stop: Arc<OwnedFd>,
    epoll: Arc<Epoll>,
    acceptor: Acceptor,
    /// Each node's connection, by node index (its token).
    links: Vec<Option<Link>>,
    /// The sruns of the steps this step spawned.
    launcher: Option<Launcher>,
    buf: Vec<u8>,
}

impl State {
    fn new(listener: TcpListener, step: Step, reporter: Box<dyn Reporter>, stop: Arc<OwnedFd>) -> io::Result<State> {
        let epoll = Arc::new(Epoll::new()?);
        epoll.add(stop.as_raw_fd(), libc::EPOLLIN as u32, STOP)?;
        let n = step.node_names.len();
        let gate = Gate {
            secret: step.secret.clone(),
            to: auth::ROOT,
            members: Members::Range(0..n as u32),
            addresses: step.addresses.clone(),
            width: step.width,
            allgather: step.allgather,
        };
        let mut acceptor = Acceptor::new(listener, gate, ACCEPTOR)?;
        acceptor.watch(epoll.clone())?;
        let launcher = step.spawn.map(|setup| Launcher::new(setup, epoll.clone(), SPAWNED));
        let shape = Shape {
            node_names: step.node_names,
            node_of: step.node_of,
            bounds: step.bounds,
            width: step.width,
            allgather: step.allgather,
            spawned: step.spawned_by.is_some(),
            can_spawn: launcher.is_some(),
        };
        Ok(State {
            monitor: StepMonitor::new(shape).map_err(io::Error::other)?,
            reporter,
            spawned_by: step.spawned_by,
            _stop: stop,
            epoll,
            acceptor,
            links: (0..n).map(|_| None).collect(),
            launcher,
            buf: vec![0; 256 * 1024],
        })
    }

    fn run(&mut self) -> Outcome {
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 64];
        loop {
            let deadline = [self.acceptor.deadline(), self.monitor.deadline()].into_iter().flatten().min();
            let timeout = match deadline {
                Some(t) => t.saturating_duration_since(Instant::now()).as_millis().clamp(1, 1000) as i32,
                None => 1000,
            };
            // A spawned srun that closed its pipe is exiting: it is reaped as soon as it has.
            let timeout = if self.launcher.as_ref().is_some_and(Launcher::reaping) { timeout.min(10) } else { timeout };
            let n = match self.epoll.wait(&mut events, timeout) {
                Ok(n) => n,
                Err(e) => {
                    self.reporter.error(&format!("the collective root stopped: {e}"));
                    return self.monitor.outcome().clone();
                }
            };
            let mut stopping = false;
            for ev in &events[..n] {
                let (token, flags) = (ev.u64, ev.events);
                match token {
                    STOP => stopping = true,
                    t if self.acceptor.owns(t) => {
                        self.acceptor.ready(t);
                        self.admissions();
                    }
                    t if t >= SPAWNED => {
                        let events = self.launcher.as_mut().map(|l| l.ready(t)).unwrap_or_default();
                        self.spawned(events);
                    }
                    t => {
                        let node = t as u32;
                        if flags & libc::EPOLLOUT as u32 != 0 {
                            if let Some(l) = self.link(node) {
                                l.flush();
                            }
                        }
                        if flags & !(libc::EPOLLOUT as u32) != 0 {
                            self.read(node);
                        }
                    }
                }
            }
            // A stepd that left more unread than a link holds is lost, as one whose connection closed.
            for n in 0..self.links.len() as u32 {
                if self.link(n).is_some_and(|l| l.is_broken()) {
                    self.closed(n);
                }
            }
            if let Some(events) = self.launcher.as_mut().filter(|l| l.reaping()).map(|l| l.reap(false)) {
                self.spawned(events);
            }
            if self.acceptor.deadline().is_some_and(|t| t <= Instant::now()) {
                self.acceptor.tick();
                self.admissions();
            }
            // Once srun is done with the step its drain takes in what is left: no grace ends it then.
            if stopping {
                return self.stop();
            }
            if self.monitor.deadline().is_some_and(|t| t <= Instant::now()) {
                let reporter = &mut self.reporter;
                self.monitor.tick(Instant::now(), || reporter.job_ending());
                self.act();
            }
        }
    }

    /// srun is done with the step: takes in what the stepds sent before it ended (an abort from the last
    /// task), and tells the stepds still connected that the close which follows is the normal end.
    fn stop(&mut self) -> Outcome {
        self.monitor.draining();
        for n in 0..self.links.len() as u32 {
            self.read(n);
        }
        self.monitor.stop();
        self.act();
        self.acceptor.close();
        self.admissions();
        // srun's step is over; the steps it spawned may run on: srun ends with them.
        if let Some(events) = self.launcher.as_mut().map(|l| l.reap(true)) {
            self.spawned(events);
        }
        self.monitor.outcome().clone()
    }

    /// What the sruns of spawned steps did.
    fn spawned(&mut self, events: Vec<SrunEvent>) {
        let job = self.launcher.as_ref().map_or(0, Launcher::job);
        self.monitor.spawned(job, events);
        self.act();
    }

    /// Carries out what the monitor asks, in order.
    fn act(&mut self) {
        while let Some(action) = self.monitor.poll() {
            match action {
                Action::Send { node, frame } => {
                    if let Some(l) = self.link(node) {
                        l.send(frame);
                    }
                }
                Action::SendShared { node, frame } => {
                    if let Some(l) = self.link(node) {
                        l.send_shared(&frame);
                    }
                }
                Action::SendCollective { node, frame } => {
                    if let Some(l) = self.link(node) {
                        let _ = l.send_collective(Direction::Down, &frame);
                    }
                }
                Action::Error(what) => self.reporter.error(&what),
                Action::Debug(what) => self.reporter.debug(&what),
                Action::EndStep => self.reporter.end_step(),
                Action::EndSpawned => {
                    if let Some(l) = &mut self.launcher {
                        let reporter = &mut self.reporter;
                        l.end_all(|step| reporter.end_spawned(step));
                    }
                }
                Action::StartSpawn { asker, request } => {
                    let started = match &mut self.launcher {
                        Some(l) => l.start(asker, &request),
                        None => Err("this srun cannot start steps".to_string()),
                    };
                    if let Err(why) = started {
                        self.monitor.answer(asker, Err(why));
                    }
                }
                Action::TellStarted => {
                    if let Some(fd) = self.spawned_by {
                        spawn::tell_started(fd);
                    }
                }
                Action::TellFailing => {
                    if let Some(fd) = self.spawned_by {
                        spawn::tell_failing(fd);
                    }
                }
            }
        }
    }

    fn link(&mut self, node: u32) -> Option<&mut Link> {
        self.links.get_mut(node as usize).and_then(Option::as_mut)
    }

    /// Takes what the acceptor has: admitted nodes, and lines about refusals.
    fn admissions(&mut self) {
        while let Some(event) = self.acceptor.poll() {
            match event {
                Admission::Debug(line) => self.reporter.debug(&line),
                Admission::Joined(joined) => self.admit(joined),
            }
        }
    }

    /// Node `j.node` is admitted: its connection is served from now on, if the monitor takes it.
    fn admit(&mut self, j: Joined) {
        let n = j.node;
        let Some(queued_max) = self.monitor.admit(n, j.width, j.allgather, j.port) else { return self.act() };
        let name = self.monitor.node_name(n);
        let mut link = match Link::new(j.stream, u64::from(n), j.input, queued_max) {
            Ok(l) => l,
            Err(e) => return self.broken(format!("cannot serve the connection of the slurmstepd of {name}: {e}")),
        };
        if let Err(e) = link.watch(self.epoll.clone()) {
            return self.broken(format!("cannot watch the connection of the slurmstepd of {name}: {e}"));
        }
        self.links[n as usize] = Some(link);
        self.monitor.connected(n, j.port);
        self.act();
        // What it sent right after its proof.
        if self.frames(n) {
            self.read(n);
        }
    }

    fn broken(&mut self, what: String) {
        self.monitor.broken(what);
        self.act();
    }

    /// Reads whatever node `node` has sent and handles every whole frame.
    fn read(&mut self, node: u32) {
        loop {
            let Some(link) = self.links.get_mut(node as usize).and_then(Option::as_mut) else { return };
            match link.read(&mut self.buf) {
                Read::Data(n) => {
                    if !self.frames(node) || n < self.buf.len() {
                        return;
                    }
                }
                Read::Blocked => return,
                Read::Closed(_) => return self.closed(node),
            }
        }
    }

    /// Handles every whole frame in node `node`'s input; false if its connection was dropped.
    fn frames(&mut self, node: u32) -> bool {
        loop {
            let max = self.monitor.frame_max();
            let Some(link) = self.link(node) else { return false };
            let kept = match link.next(max) {
                Ok(None) => {
                    link.release();
                    return true;
                }
                Ok(Some(payload)) => match Up::decode(payload) {
                    Ok(message) => self.monitor.message(node, message),
                    Err(e) => {
                        self.monitor.malformed(node, &e.to_string());
                        false
                    }
                },
                Err(FrameError::TooLarge { len, .. }) => {
                    self.monitor.too_large(node, len);
                    false
                }
            };
            self.act();
            if !kept {
                self.links[node as usize] = None;
                return false;
            }
        }
    }

    /// Node `node`'s connection ended, or broke.
    fn closed(&mut self, node: u32) {
        self.links[node as usize] = None;
        self.monitor.closed(node);
        self.act();
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::collective::frame::{self, Frame};
    use crate::collective::Bound;
    use crate::slurm::client;
    use crate::slurm::protocol::Down;
    use crate::slurm::protocol::NameOp;
    use crate::slurm::uplink::{self, Hello};
    use std::io::{Read as _, Write};
    use std::net::{SocketAddr, TcpStream};
    use std::os::fd::FromRawFd;
    use std::sync::{Arc as StdArc, Mutex};
    use std::time::Duration;

    /// What a root reported, for tests here and in `super::stepd`.
    #[derive(Clone, Default)]
    pub(in crate::slurm) struct Record(StdArc<Mutex<Vec<String>>>);

    impl Reporter for Record {
        fn error(&mut self, m: &str) {
            self.0.lock().unwrap().push(format!("error: {m}"));
        }
        fn debug(&mut self, m: &str) {
            self.0.lock().unwrap().push(format!("debug: {m}"));
        }
        fn end_step(&mut self) {
            self.0.lock().unwrap().push("end".into());
        }
        fn end_spawned(&mut self, step: u32) {
            self.0.lock().unwrap().push(format!("end spawned step {step}"));
        }
    }

    impl Record {
        pub(in crate::slurm) fn lines(&self) -> Vec<String> {
            self.0.lock().unwrap().clone()
        }
        pub(in crate::slurm) fn wait_for(&self, what: &str) -> String {
            let until = Instant::now() + Duration::from_secs(20);
            loop {
                if let Some(l) = self.lines().into_iter().find(|l| l.contains(what)) {
                    return l;
                }
                assert!(Instant::now() < until, "no `{what}` in {:?}", self.lines());
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }

    const PART_MAX: Bound = Bound { bytes: 1 << 20, option: "RPMI_TEST_PART_MAX" };
    const EXCHANGE_MAX: Bound = Bound { bytes: 3 << 20, option: "RPMI_TEST_EXCHANGE_MAX" };
    /// A width that makes every step of these tests a star.
    const STAR: u32 = 1000;

    pub(in crate::slurm) fn step(nodes: usize, secret: &Secret) -> Step {
        Step {
            node_names: (1..=nodes).map(|n| format!("n{n}")).collect(),
            node_of: (0..nodes as u32).collect(),
            secret: secret.clone(),
            addresses: None,
            bounds: Bounds { part_max: PART_MAX, exchange_max: EXCHANGE_MAX },
            width: Some(STAR),
            allgather: Some(Allgather::Tree),
            spawn: None,
            spawned_by: None,
        }
    }

    pub(in crate::slurm) fn start(step: Step) -> (RootThread, Record) {
        let record = Record::default();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        (RootThread::start(listener, step, Box::new(record.clone())).unwrap(), record)
    }

    fn root(nodes: usize, secret: &Secret) -> (RootThread, Record) {
        start(step(nodes, secret))
    }

    /// A root for `nodes` nodes with every node's stepd connected and authenticated.
    fn connected(nodes: usize) -> (RootThread, Record, Vec<TcpStream>) {
        let secret = crate::slurm::random::secret().unwrap();
        let (root, record) = root(nodes, &secret);
        let stepds = (0..nodes as u32).map(|n| stepd(root.port(), n, &secret)).collect();
        (root, record, stepds)
    }

    /// What node `node`'s stepd says in its HELLO in a star about node 0, which listens for the others.
    fn hello(node: u32) -> Hello {
        let port = if node == 0 { 20000 } else { 0 };
        Hello { node, to: auth::ROOT, port, width: STAR, allgather: Allgather::Tree }
    }

    /// A stepd admitted as `hello` says, through the stepd's own handshake.
    fn join(port: u16, hello: Hello, secret: &Secret) -> TcpStream {
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let s = uplink::join(&[addr], &hello, secret, Duration::from_secs(20), "srun", uplink::sleep).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s
    }

    fn stepd(port: u16, node: u32, secret: &Secret) -> TcpStream {
        join(port, hello(node), secret)
    }

    fn frame(m: Up) -> Vec<u8> {
        m.encode().unwrap()
    }

    /// The node's shell has waited in exchange `epoch` (JOINED): its parts go to node 0, not to srun.
    fn join_exchange(s: &mut TcpStream, epoch: u32) {
        s.write_all(&frame(Up::Joined { epoch })).unwrap();
    }

    /// The next frame srun sends on `s`, past where the node's lower peers listen (PEER).
    fn receive(s: &mut TcpStream) -> Down {
        loop {
            let mut len = [0u8; 4];
            s.read_exact(&mut len).unwrap();
            let mut p = vec![0; u32::from_be_bytes(len) as usize];
            s.read_exact(&mut p).unwrap();
            match Down::decode(&p).unwrap() {
                Down::Peer { .. } => {}
                down => return down,
            }
        }
    }

    /// srun serves node `s` (for its local task `task`, a name lookup is answered): the step goes on.
    fn served(s: &mut TcpStream, task: u32) {
        let lookup = Up::Name { task, op: NameOp::Lookup, name: "service".into(), port: String::new() };
        s.write_all(&frame(lookup)).unwrap();
        assert!(matches!(receive(s), Down::Answer { task: t, .. } if t == task));
    }

    /// The next collective frame srun sends on `s`.
    fn collective(s: &mut TcpStream) -> Frame {
        match receive(s) {
            Down::Collective(f) => Frame::decode(&f, usize::MAX).unwrap(),
            other => panic!("not a collective frame: {other:?}"),
        }
    }

    fn closed(s: &mut TcpStream) -> bool {
        let mut b = [0u8; 1];
        matches!(s.read(&mut b), Ok(0) | Err(_))
    }

    #[test]
    fn srun_serves_every_node_and_ends_the_step_normally() {
        let (root, record, mut s) = connected(3);
        for (n, c) in s.iter_mut().enumerate() {
            served(c, n as u32);
        }
        s[1].write_all(&frame(Up::Bye)).unwrap();
        s[2].write_all(&frame(Up::Bye)).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(root.stop(), Outcome::default());
        // Node 0, the tree's top and srun's one child in it, still connected when srun is done, hears so before
        // the close: the collective's END (for the whole tree), then srun's own.
        assert_eq!(collective(&mut s[0]), Frame::End);
        assert_eq!(receive(&mut s[0]), Down::End);
        assert!(closed(&mut s[0]));
        assert!(record.lines().iter().all(|l| !l.starts_with("error")), "{:?}", record.lines());
    }

    #[test]
    fn a_wrong_secret_or_garbage_is_refused_and_the_step_goes_on() {
        let secret = crate::slurm::random::secret().unwrap();
        let (root, record) = root(2, &secret);
        let addr = SocketAddr::from(([127, 0, 0, 1], root.port()));
        let other = crate::slurm::random::secret().unwrap();
        let wrong = uplink::join(&[addr], &hello(0), &other, Duration::from_millis(200), "srun", uplink::sleep);
        assert!(matches!(wrong, Err(uplink::JoinError::GaveUp { .. })), "{wrong:?}");
        let mut http = TcpStream::connect(addr).unwrap();
        http.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        http.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        assert!(closed(&mut http));
        let mut s: Vec<TcpStream> = (0..2).map(|n| stepd(root.port(), n, &secret)).collect();
        // Every node is in: the port is closed to everyone, the right secret too.
        assert!(TcpStream::connect(addr).is_err(), "the collective port still takes connections");
        for (n, c) in s.iter_mut().enumerate() {
            served(c, n as u32);
        }
        assert_eq!(root.stop(), Outcome::default());
        let lines = record.lines();
        assert!(lines.iter().any(|l| l.starts_with("debug: ") && l.contains("wrong proof")), "{lines:?}");
        // Refusals are for whoever debugs, not the job's stderr.
        assert!(lines.iter().all(|l| l.starts_with("debug: ")), "{lines:?}");
    }

    #[test]
    fn the_secret_never_crosses_the_network() {
        let secret = crate::slurm::random::secret().unwrap();
        let (root, _record) = root(1, &secret);
        // A relay between the stepd and the root keeps every byte that passes, both ways.
        let relay = TcpListener::bind("127.0.0.1:0").unwrap();
        let relay_addr = relay.local_addr().unwrap();
        let port = root.port();
        let seen = std::thread::spawn(move || {
            let (mut a, _) = relay.accept().unwrap();
            let mut b = TcpStream::connect(("127.0.0.1", port)).unwrap();
            let (mut a2, mut b2) = (a.try_clone().unwrap(), b.try_clone().unwrap());
            let up = std::thread::spawn(move || {
                let mut bytes = Vec::new();
                let mut buf = [0u8; 4096];
                while let Ok(n @ 1..) = a2.read(&mut buf) {
                    bytes.extend_from_slice(&buf[..n]);
                    if b.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                bytes
            });
            let mut down = Vec::new();
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = b2.read(&mut buf) {
                down.extend_from_slice(&buf[..n]);
                if a.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            let _ = a.shutdown(std::net::Shutdown::Both);
            [up.join().unwrap(), down].concat()
        });
        let joined = uplink::join(&[relay_addr], &hello(0), &secret, Duration::from_secs(20), "srun", uplink::sleep);
        let mut s = joined.unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        served(&mut s, 0);
        s.write_all(&frame(Up::Bye)).unwrap();
        drop(s);
        assert_eq!(root.stop(), Outcome::default());
        let bytes = seen.join().unwrap();
        let hex = secret.to_hex();
        let raw: Vec<u8> = (0..32).map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap()).collect();
        assert!(bytes.len() > 100, "the relay saw the handshake");
        assert!(!bytes.windows(8).any(|w| raw.windows(8).any(|r| r == w)), "the secret crossed the network");
        assert!(!bytes.windows(16).any(|w| w == &hex.as_bytes()[..16]), "the secret crossed the network in hex");
    }

    #[test]
    fn a_whole_large_step_connecting_at_once_is_admitted() {
        let nodes = 500;
        let secret = crate::slurm::random::secret().unwrap();
        let (root, record) = root(nodes, &secret);
        let port = root.port();
        let stepds: Vec<_> = (0..nodes as u32)
            .map(|n| {
                let secret = secret.clone();
                std::thread::spawn(move || {
                    let addr = SocketAddr::from(([127, 0, 0, 1], port));
                    uplink::join(&[addr], &hello(n), &secret, Duration::from_secs(30), "srun", uplink::sleep)
                })
            })
            .collect();
        let mut conns: Vec<TcpStream> = stepds.into_iter().map(|t| t.join().unwrap().unwrap()).collect();
        for (n, c) in conns.iter_mut().enumerate() {
            c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            served(c, n as u32);
        }
        for c in conns.iter_mut() {
            c.write_all(&frame(Up::Bye)).unwrap();
        }
        assert_eq!(root.stop(), Outcome::default());
        assert!(!record.lines().iter().any(|l| l.starts_with("error")), "{:?}", record.lines());
    }

    #[test]
    fn idle_connections_do_not_keep_the_stepds_out() {
        let nodes = 3;
        let secret = crate::slurm::random::secret().unwrap();
        let (root, record) = root(nodes, &secret);
        // More idle connections than the handshake table holds, opened before any stepd comes.
        let idle: Vec<TcpStream> = (0..nodes + crate::slurm::admit::HANDSHAKE_SPARE + 16)
            .map(|_| TcpStream::connect(("127.0.0.1", root.port())).unwrap())
            .collect();
        let mut s: Vec<TcpStream> = (0..nodes as u32).map(|n| stepd(root.port(), n, &secret)).collect();
        for (n, c) in s.iter_mut().enumerate() {
            served(c, n as u32);
        }
        assert_eq!(root.stop(), Outcome::default());
        drop(idle);
        let lines = record.lines();
        assert!(lines.iter().any(|l| l.contains("the oldest of too many connections")), "{lines:?}");
        assert!(lines.iter().all(|l| l.starts_with("debug: ")), "{lines:?}");
    }

    #[test]
    fn connections_from_other_addresses_are_refused() {
        let secret = crate::slurm::random::secret().unwrap();
        let mut s = step(1, &secret);
        s.addresses = Some(vec![IpAddr::from([192, 0, 2, 7])]);
        let (root, record) = start(s);
        let addr = SocketAddr::from(([127, 0, 0, 1], root.port()));
        let refused = uplink::join(&[addr], &hello(0), &secret, Duration::from_millis(200), "srun", uplink::sleep);
        assert!(refused.is_err(), "a connection from 127.0.0.1 was admitted");
        root.stop();
        assert!(record.lines().iter().any(|l| l.contains("not the address of any node that may join here")));

        let mut s = step(1, &secret);
        s.addresses = Some(vec![IpAddr::from([127, 0, 0, 1])]);
        let (root, _) = start(s);
        stepd(root.port(), 0, &secret);
        root.stop();
    }

    /// srun takes no exchange's parts: every exchange turns at node 0, which checks their bounds.
    #[test]
    fn an_exchanges_parts_sent_to_srun_end_the_step() {
        let (root, record, mut s) = connected(2);
        let part = frame::contrib(0, std::iter::once((0, &b"card"[..]))).unwrap();
        s[0].write_all(&frame(Up::Collective(part))).unwrap();
        let error = record.wait_for("error: ");
        assert!(
            error.contains("the slurmstepd of n1 sent parts of PMI exchange 0 to srun, which takes no parts"),
            "{error}"
        );
        assert!(root.stop().ended);
        // A frame over what srun takes is refused by its length, unread.
        let (root, record, mut s) = connected(2);
        let large = frame::contrib(0, std::iter::once((1, &vec![b'x'; 1 << 20][..]))).unwrap();
        let _ = s[1].write_all(&frame(Up::Collective(large)));
        let error = record.wait_for("error: ");
        assert!(error.contains("the slurmstepd of n2 sent srun a frame of") && error.contains("more than it takes"));
        assert!(root.stop().ended);
    }

    #[test]
    fn an_abort_ends_the_step_with_its_code() {
        let secret = crate::slurm::random::secret().unwrap();
        let (root, record) = root(2, &secret);
        let mut a = stepd(root.port(), 0, &secret);
        let mut b = stepd(root.port(), 1, &secret);
        join_exchange(&mut b, 0);
        b.write_all(&frame(Up::Abort { rank: 1, code: 7, message: "oops".into() })).unwrap();
        // The tree's top hears the failure, to pass it down to every node waiting in the exchange.
        assert!(matches!(collective(&mut a), Frame::Fail { .. }));
        a.write_all(&frame(Up::Error { rank: 0, failed: false, message: "later".into() })).unwrap();
        record.wait_for("debug: later (on n1)");
        let outcome = root.stop();
        assert_eq!(outcome, Outcome { abort_code: Some(7), ended: true, ..Outcome::default() });
        let lines = record.lines();
        assert_eq!(lines.iter().filter(|l| l.starts_with("error")).count(), 1, "{lines:?}");
        assert!(lines[0].contains("rank 1 on n2 called PMI_Abort with exit code 7: oops"), "{lines:?}");
        assert_eq!(lines.iter().filter(|l| *l == "end").count(), 1);
    }

    #[test]
    fn an_abort_sent_just_before_the_stop_is_seen() {
        let secret = crate::slurm::random::secret().unwrap();
        let (root, _record) = root(1, &secret);
        let mut a = stepd(root.port(), 0, &secret);
        a.write_all(&frame(Up::Abort { rank: 0, code: 3, message: String::new() })).unwrap();
        drop(a);
        assert_eq!(root.stop().abort_code, Some(3));
    }

    #[test]
    fn a_lost_node_mid_exchange_ends_the_step() {
        let (root, record, mut s) = connected(3);
        join_exchange(&mut s[0], 0);
        drop(s.remove(2));
        assert!(matches!(collective(&mut s[0]), Frame::Fail { .. }));
        // Whether the root saw the close before the contribution or after, the exchange fails and says why.
        record.wait_for("lost the connection to the slurmstepd of n3");
        assert!(root.stop().ended);
    }

    #[test]
    fn a_silent_connection_does_not_hold_up_the_step() {
        let secret = crate::slurm::random::secret().unwrap();
        let (root, _record) = root(1, &secret);
        let _silent = TcpStream::connect(("127.0.0.1", root.port())).unwrap();
        let mut half = TcpStream::connect(("127.0.0.1", root.port())).unwrap();
        half.write_all(&[0, 0, 0, 43, 1, b'R']).unwrap();
        let mut a = stepd(root.port(), 0, &secret);
        served(&mut a, 0);
        assert_eq!(root.stop(), Outcome::default());
    }

    /// A step of `nodes` nodes in a tree of `width`, its width from the stepds (not srun's environment).
    fn tree_step(nodes: usize, secret: &Secret) -> (RootThread, Record) {
        let mut s = step(nodes, secret);
        s.width = None;
        start(s)
    }

    /// Node `node` of a tree of `width`, which listens for its children on a port of its own.
    fn tree_stepd(port: u16, node: u32, width: u32, secret: &Secret) -> TcpStream {
        join(port, Hello { node, to: auth::ROOT, port: 20000 + node as u16, width, allgather: Allgather::Tree }, secret)
    }

    #[test]
    fn stepds_that_build_the_tree_with_different_widths_end_the_step() {
        let secret = crate::slurm::random::secret().unwrap();
        let (root, record) = tree_step(3, &secret);
        let _a = tree_stepd(root.port(), 0, 2, &secret);
        let _b = tree_stepd(root.port(), 1, 3, &secret);
        let error = record.wait_for("error: ");
        assert!(error.contains("the slurmstepd of n1 builds the PMI tree with width 2, the slurmstepd of n2 with 3"));
        assert!(error.contains("RpmiTreeWidth"), "{error}");
        assert!(root.stop().ended);
        // When srun's environment sets the width, a stepd with another one is not admitted at all.
        let (fixed, _) = self::root(1, &secret);
        let addr = SocketAddr::from(([127, 0, 0, 1], fixed.port()));
        let other = Hello { width: 7, ..hello(0) };
        assert!(uplink::join(&[addr], &other, &secret, Duration::from_millis(200), "srun", uplink::sleep).is_err());
        fixed.stop();
    }

    /// Makes [`an_accept_failing_for_want_of_fds_does_not_make_the_root_spin`] run as the child that serves (the
    /// value is the step's secret, in hex).
    const OUT_OF_FDS_CHILD: &str = "RPMI_ROOT_OUT_OF_FDS_CHILD";

    /// The CPU time this process has used, user and system.
    fn cpu_time() -> Duration {
        // SAFETY: getrusage fills the struct it is given.
        let mut u: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: as above; a valid pointer to a live struct.
        assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) }, 0);
        let tv = |t: libc::timeval| Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64);
        tv(u.ru_utime) + tv(u.ru_stime)
    }

    /// Leaves this process no fd to open: the limit just above the highest open fd, every free one below
    /// taken. Dropping what is returned gives the fds back and restores the limit: the fds taken are only the
    /// holes below the highest, which may be fewer than the connections waiting to be accepted.
    fn exhaust_fds() -> Exhausted {
        let highest = std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u64>().ok())
            .max()
            .unwrap();
        // SAFETY: getrlimit and setrlimit with a pointer to a live struct.
        let limit = unsafe {
            let mut limit: libc::rlimit = std::mem::zeroed();
            assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit), 0);
            let lowered = libc::rlimit { rlim_cur: highest + 1, ..limit };
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lowered), 0, "{}", io::Error::last_os_error());
            limit
        };
        let mut taken = Vec::new();
        loop {
            // SAFETY: dup of our own stderr; a new fd is ours, owned at once.
            let fd = unsafe { libc::dup(2) };
            if fd < 0 {
                assert_eq!(io::Error::last_os_error().raw_os_error(), Some(libc::EMFILE));
                return Exhausted { taken, limit };
            }
            // SAFETY: just made, owned by nobody else.
            taken.push(unsafe { OwnedFd::from_raw_fd(fd) });
        }
    }

    struct Exhausted {
        taken: Vec<OwnedFd>,
        limit: libc::rlimit,
    }

    impl Drop for Exhausted {
        fn drop(&mut self) {
            // SAFETY: setrlimit with a pointer to a live struct.
            assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &self.limit) }, 0);
            self.taken.clear();
        }
    }

    /// The child: a root that cannot accept, its CPU time measured while connections wait for it.
    fn out_of_fds_child(secret_hex: &str) {
        let secret = Secret::from_hex(secret_hex).unwrap();
        let (root, _record) = root(1, &secret);
        let taken = exhaust_fds();
        println!("port={}", root.port());
        let mut line = String::new();
        // The parent's connections wait in the listen queue: every accept fails with EMFILE.
        std::io::stdin().read_line(&mut line).unwrap();
        let (cpu, wall) = (cpu_time(), Instant::now());
        std::thread::sleep(Duration::from_secs(2));
        println!("cpu_fraction={}", (cpu_time() - cpu).as_secs_f64() / wall.elapsed().as_secs_f64());
        drop(taken);
        println!("fds_free");
        // The parent joins as the step's node, then says it is done.
        line.clear();
        std::io::stdin().read_line(&mut line).unwrap();
        root.stop();
    }

    /// With no fd left, every accept fails at once while connections wait: a root that only tried again when
    /// next woken would spin, a whole CPU, for as long as the process lacks fds. Its listener rests instead, and
    /// takes the waiting connections once fds are free again.
    #[test]
    fn an_accept_failing_for_want_of_fds_does_not_make_the_root_spin() {
        if let Ok(hex) = std::env::var(OUT_OF_FDS_CHILD) {
            return out_of_fds_child(&hex);
        }
        let secret = crate::slurm::random::secret().unwrap();
        let module = module_path!().split_once("::").map_or("", |(_, m)| m);
        let name = format!("{module}::an_accept_failing_for_want_of_fds_does_not_make_the_root_spin");
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", &name, "--nocapture", "--test-threads=1"])
            .env(OUT_OF_FDS_CHILD, secret.to_hex())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut to_child = child.stdin.take().unwrap();
        let mut from_child = std::io::BufReader::new(child.stdout.take().unwrap());
        // The harness may have begun the line the child prints on.
        let mut wait_for = |key: &str| -> String {
            let mut line = String::new();
            loop {
                line.clear();
                let n = std::io::BufRead::read_line(&mut from_child, &mut line).unwrap();
                assert!(n > 0, "the child ended before saying {key}");
                if let Some(at) = line.find(key) {
                    return line[at + key.len()..].trim().to_string();
                }
            }
        };
        let port: u16 = wait_for("port=").parse().unwrap();
        let waiting: Vec<TcpStream> = (0..3).map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap()).collect();
        to_child.write_all(b"go\n").unwrap();
        let fraction: f64 = wait_for("cpu_fraction=").parse().unwrap();
        eprintln!("a root out of fds used {:.1}% of a CPU", fraction * 100.0);
        wait_for("fds_free");
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let joined = uplink::join(&[addr], &hello(0), &secret, Duration::from_secs(20), "srun", uplink::sleep);
        to_child.write_all(b"done\n").unwrap();
        drop(waiting);
        let status = child.wait().unwrap();
        assert!(fraction < 0.5, "a root that cannot accept used {:.0}% of a CPU", fraction * 100.0);
        assert!(joined.is_ok(), "once fds were free again the node could not join: {:?}", joined.err());
        assert!(status.success(), "the child failed: {status}");
    }

    /// A stand-in for srun (a shell script named so): it records its arguments and RPMI_SLURM_SPAWN in `dir`,
    /// then runs `body` (which may write a step id to fd 3, as a spawned srun's prelaunch does).
    fn fake_srun(name: &str, body: &str) -> (spawn::Setup, std::path::PathBuf) {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("rpmi-root-spawn-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let script = dir.join("srun");
        let text = format!(
            "#!/bin/sh\nprintf '%s\\n' \"$@\" > {d}/argv\nprintf '%s' \"$RPMI_SLURM_SPAWN\" > {d}/spawn\n{body}\n",
            d = dir.display()
        );
        std::fs::write(&script, text).unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let srun = std::ffi::CString::new(script.to_str().unwrap()).unwrap();
        let env = vec![std::ffi::CString::new("PATH=/usr/bin:/bin").unwrap()];
        (spawn::Setup { srun, job: 42, env }, dir)
    }

    const REQUEST: &str =
        r#"{"commands":[{"nprocs":3,"execname":"./child","args":["x"],"preputs":[["k","v"]],"infos":[]}]}"#;

    /// A root of 2 nodes with one rank each, whose spawns start `body`'s fake srun.
    fn spawning(name: &str, body: &str) -> (RootThread, Record, Vec<TcpStream>, std::path::PathBuf) {
        let secret = crate::slurm::random::secret().unwrap();
        let (setup, dir) = fake_srun(name, body);
        let (root, record) = start(Step { spawn: Some(setup), ..step(2, &secret) });
        let stepds = (0..2).map(|n| stepd(root.port(), n, &secret)).collect();
        (root, record, stepds, dir)
    }

    /// Task 0 of the stepd on `s` spawns REQUEST, and its spawn is answered with `code` for every process.
    fn spawn_answered_with(s: &mut TcpStream, code: i32) {
        s.write_all(&frame(Up::Spawn { task: 0, request: REQUEST.into() })).unwrap();
        assert_eq!(receive(s), Down::Answer { task: 0, ok: true, text: code.to_string() });
    }

    /// As [`spawn_answered_with`], every process started.
    fn spawn_answered(s: &mut TcpStream) {
        spawn_answered_with(s, 0)
    }

    #[test]
    fn a_spawn_is_answered_once_its_tasks_run_and_its_failure_ends_the_step() {
        // The shell reads its own mask (a child would see the mask the shell holds while it forks and waits).
        let body = "while read -r k v; do [ \"$k\" = SigBlk: ] && echo \"$k $v\" > \"${0%/*}/sigblk\"; done < /proc/$$/status\n\
                    echo 7 >&3\necho started >&3\nsleep 0.3\nexit 3";
        let (root, record, mut s, dir) = spawning("started", body);
        spawn_answered(&mut s[1]);
        let argv = std::fs::read_to_string(dir.join("argv")).unwrap();
        assert_eq!(argv, "--jobid=42\n--mpi=rpmi\n--ntasks=3\n--nodes=1-3\n--immediate\n--exact\n./child\nx\n");
        // srun starts with no signal blocked (the root's thread blocks them all).
        assert_eq!(
            std::fs::read_to_string(dir.join("sigblk")).unwrap().split_whitespace().nth(1),
            Some("0000000000000000")
        );
        let spawn = spawn::Spawn::decode(&std::fs::read_to_string(dir.join("spawn")).unwrap()).unwrap();
        assert_eq!((spawn.job.counts, spawn.job.preputs, spawn.fd), (vec![3], vec![("k".into(), "v".into())], Some(3)));
        // Its srun fails: the spawning step ends, naming the step and the rank that spawned it.
        let line = record.wait_for("error:");
        assert!(line.contains("step 42.7, which rank 1 spawned, failed: its srun exited with status 3"), "{line}");
        record.wait_for("end");
        assert_eq!(root.stop().spawned_status, Some(3));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_spawn_whose_srun_ends_before_its_step_exists_fails_with_its_status() {
        let (root, record, mut s, dir) = spawning("failed", "exit 1");
        s[0].write_all(&frame(Up::Spawn { task: 0, request: REQUEST.into() })).unwrap();
        let Down::Answer { task: 0, ok: false, text } = receive(&mut s[0]) else { panic!("no failed answer") };
        assert!(text.contains("exited with status 1 before its step was made"), "{text}");
        // A malformed request, or one srun cannot start, is refused at once.
        s[0].write_all(&frame(Up::Spawn { task: 0, request: "{".into() })).unwrap();
        let Down::Answer { ok: false, text, .. } = receive(&mut s[0]) else { panic!("no failed answer") };
        assert!(text.contains("not JSON"), "{text}");
        // A task the node does not have is the stepd's fault.
        s[0].write_all(&frame(Up::Spawn { task: 1, request: REQUEST.into() })).unwrap();
        assert!(record.wait_for("error:").contains("not one of its own"));
        let outcome = root.stop();
        assert_eq!(outcome.spawned_status, None);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn the_spawning_steps_failure_ends_the_spawned_step_and_srun_waits_for_its_srun() {
        let (root, record, mut s, dir) = spawning("parent-fails", "echo 9 >&3\necho started >&3\nsleep 0.5\nexit 137");
        spawn_answered(&mut s[0]);
        s[0].write_all(&frame(Up::Abort { rank: 0, code: 5, message: "bye".into() })).unwrap();
        record.wait_for("end spawned step 9");
        let started = Instant::now();
        let outcome = root.stop();
        // srun's end waited for the spawned srun; its status follows from the end, the abort's code is srun's.
        assert!(started.elapsed() >= Duration::from_millis(200), "{:?}", started.elapsed());
        assert_eq!((outcome.abort_code, outcome.spawned_status), (Some(5), None));
        assert_eq!(record.lines().iter().filter(|l| l.starts_with("error:")).count(), 1, "{:?}", record.lines());
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A spawned step that says it began to fail ends the spawning step at once; its srun's status is srun's
    /// even when an abort of this step (which follows from it) reached srun first.
    #[test]
    fn the_step_that_began_to_fail_first_gives_srun_its_status() {
        let (root, record, mut s, dir) =
            spawning("failing", "echo 7 >&3\necho started >&3\necho failed 1 >&3\nsleep 0.3\nexit 42");
        spawn_answered(&mut s[0]);
        let line = record.wait_for("error:");
        assert!(line.ends_with("step 42.7, which rank 0 spawned, failed"), "{line}");
        record.wait_for("end");
        // This step's ranks abort in turn: a consequence, logged only.
        s[1].write_all(&frame(Up::Abort { rank: 1, code: 5, message: "lost my children".into() })).unwrap();
        let outcome = root.stop();
        assert_eq!((outcome.spawned_status, client::exit_code(&outcome)), (Some(42), 42));
        assert_eq!(record.lines().iter().filter(|l| l.starts_with("error:")).count(), 1, "{:?}", record.lines());
        let _ = std::fs::remove_dir_all(dir);

        // The same when the spawning step's abort comes before the spawned srun says it began to fail.
        let (root, record, mut s, dir) =
            spawning("failing-late", "echo 8 >&3\necho started >&3\nsleep 0.3\necho failed 1 >&3\nexit 42");
        spawn_answered(&mut s[0]);
        s[1].write_all(&frame(Up::Abort { rank: 1, code: 5, message: "lost my children".into() })).unwrap();
        record.wait_for("end spawned step 8");
        let outcome = root.stop();
        assert_eq!((outcome.abort_code, client::exit_code(&outcome)), (Some(5), 42));
        // The abort was said first; the spawned step's failure, which srun's status comes from, is said too.
        let errors: Vec<_> = record.lines().into_iter().filter(|l| l.starts_with("error:")).collect();
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(errors[1].contains("step 42.8, which rank 0 spawned, failed: its srun exited with status 42"));
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A spawned step that begins to fail before all of its tasks ran (a program missing on a node) answers
    /// the spawn with -1 for every process; the spawning step goes on, and its srun's status is its own.
    #[test]
    fn a_spawned_step_failing_before_its_tasks_ran_answers_error_codes() {
        // It says so, or its srun exits first (it was done with its step: every task had exited).
        for (name, body) in [
            ("unstarted", "echo 6 >&3\necho failed 1 >&3\nsleep 0.2\nexit 2"),
            ("unstarted-exit", "echo 6 >&3\nexit 2"),
        ] {
            let (root, record, mut s, dir) = spawning(name, body);
            spawn_answered_with(&mut s[0], -1);
            // Its srun's exit, well after, ends nothing; an exit it did not explain is said.
            std::thread::sleep(Duration::from_millis(500));
            let outcome = root.stop();
            let errors: Vec<_> = record.lines().into_iter().filter(|l| l.starts_with("error:")).collect();
            match name {
                "unstarted" => assert!(errors.is_empty(), "{errors:?}"),
                _ => assert!(
                    errors.iter().all(|l| l.contains("ended with status 2 before all of its tasks ran")),
                    "{errors:?}"
                ),
            }
            assert!(!record.lines().iter().any(|l| l == "end"), "{:?}", record.lines());
            assert_eq!((outcome.ended, outcome.spawned_status, client::exit_code(&outcome)), (false, None, 0));
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

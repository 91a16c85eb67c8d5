//! The collective root, run by srun in one thread for the life of the step: every node's slurmstepd
//! connects to it, proves it serves the step ([`super::auth`]), and sends its part of each collective; when
//! every node's part of an epoch is in, the root sends all of them to every node. It is also where aborts,
//! job errors and lost nodes are reported: the root prints the message on srun's stderr and ends the step.
//!
//! One thread, one epoll set over the listener and every connection, non-blocking I/O, so a slow or hostile
//! peer holds up nobody. The gathered frame is built once per epoch and shared by every node's send queue.
//!
//! **Admission.** A connection's first bytes are read as soon as it is accepted and whenever it is readable,
//! so a real stepd is admitted within two round trips. Connections still in the handshake are held in a
//! table of at least as many as the step has nodes (plus [`HANDSHAKE_SPARE`]); when it is full the oldest is
//! dropped, never the newest, and a stepd whose connection is dropped before it was admitted tries again
//! ([`super::uplink`]), so idle or slow connections from elsewhere can delay real stepds but not keep them
//! out. Where srun knows the nodes' addresses, connections from other addresses are refused. Once every node
//! is admitted the listener is closed: nobody else can connect at all. Refusals are counted and logged at
//! debug level, at most once per `REFUSAL_LOG_EVERY`: never on the job's stderr.
//!
//! **Bounds.** A node's part of one exchange is at most [`Step::part_max`] bytes and all parts together at
//! most [`Step::exchange_max`]; over either, the step ends with a message naming the node, the size and the
//! option that sets the bound.

use super::auth::{self, Role, Secret, Transcript};
use super::wire::{self, FrameBuf, FrameError, ToRoot, CONTROL_MAX, HELLO_LEN, PROOF_LEN_ON_WIRE};
use crate::driver::{epoll_create, epoll_ctl};
use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a new connection may take to complete the handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Room for connections in the handshake beyond one per node.
pub const HANDSHAKE_SPARE: usize = 64;
/// Refusals are logged at most this often (with how many there were).
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(10);
/// After an accept fails for want of resources (no fds left), the listener rests this long at first, doubling
/// up to a second, instead of failing again at once on every pass.
const ACCEPT_REST_FIRST: Duration = Duration::from_millis(10);
const ACCEPT_REST_MAX: Duration = Duration::from_secs(1);

/// Where the root's verdicts go: srun's stderr and Slurm in srun, a recorder in tests.
pub trait Reporter: Send + 'static {
    /// The first fatal event of the step: printed as an error.
    fn error(&mut self, message: &str);
    /// What only someone debugging wants (refused connections, what follows from the step's end): not on
    /// the job's stderr by default.
    fn debug(&mut self, message: &str);
    /// Ends the step (srun: `slurm_kill_job_step(.., SIGKILL)`).
    fn end_step(&mut self);
}

/// What the step's root saw, for srun's exit code.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outcome {
    /// A rank called `PMI_Abort` with this exit code (the first one, if several did).
    pub abort_code: Option<i32>,
    /// The step was ended because of an error (abort, job error, lost node).
    pub ended: bool,
    /// It was ended for a job error that no task's own failure explains (a protocol error): srun's status
    /// must then say so itself, since the tasks' show only the SIGKILL that ended the step.
    pub job_error: bool,
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
    /// Bytes one node may contribute to one exchange, and the option that sets it.
    pub part_max: Bound,
    /// Bytes all nodes together may contribute to one exchange, and the option that sets it.
    pub exchange_max: Bound,
}

/// A size bound and the name of the option that sets it (for messages).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bound {
    pub bytes: usize,
    pub option: &'static str,
}

/// A running root; [`Root::stop`] ends it.
pub struct Root {
    port: u16,
    stop: Arc<OwnedFd>,
    thread: Option<JoinHandle<Outcome>>,
}

impl Root {
    /// Serves `listener` for `step` on a new thread.
    pub fn start(listener: TcpListener, step: Step, reporter: Box<dyn Reporter>) -> io::Result<Root> {
        let port = listener.local_addr()?.port();
        listener.set_nonblocking(true)?;
        // SAFETY: a plain syscall, checked at once.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fresh and ours.
        let stop = Arc::new(unsafe { OwnedFd::from_raw_fd(fd) });
        let mut state = State::new(listener, step, reporter, stop.clone())?;
        let thread = std::thread::Builder::new().name("rpmi-root".into()).spawn(move || {
            crate::node::block_signals();
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| state.run())) {
                Ok(outcome) => outcome,
                Err(_) => Outcome { ended: true, ..Outcome::default() },
            }
        })?;
        Ok(Root { port, stop, thread: Some(thread) })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Stops the root after it has taken in whatever the stepds already sent, and says what it saw.
    pub fn stop(mut self) -> Outcome {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Outcome {
        let one = 1u64.to_ne_bytes();
        // SAFETY: an 8-byte write to our eventfd.
        unsafe { libc::write(self.stop.as_raw_fd(), one.as_ptr().cast(), 8) };
        self.thread.take().and_then(|t| t.join().ok()).unwrap_or_default()
    }
}

impl Drop for Root {
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.shutdown();
        }
    }
}

const LISTENER: u64 = u64::MAX;
const STOP: u64 = u64::MAX - 1;

/// How far a connection has come.
#[derive(Clone, Copy)]
enum Stage {
    /// Accepted; its HELLO has not come.
    Hello,
    /// CHALLENGE sent; its PROOF has not come.
    Proof(Transcript),
    /// Admitted as this node.
    Node(u32),
}

struct Conn {
    stream: TcpStream,
    peer: SocketAddr,
    stage: Stage,
    since: Instant,
    input: FrameBuf,
    output: VecDeque<(Arc<Vec<u8>>, usize)>,
    /// EPOLLOUT is being watched.
    want_write: bool,
}

impl Conn {
    fn node(&self) -> Option<u32> {
        match self.stage {
            Stage::Node(n) => Some(n),
            _ => None,
        }
    }
}

#[derive(Default, Clone, Copy, PartialEq, Eq)]
enum NodeState {
    #[default]
    Unconnected,
    Connected(u64),
    /// Said BYE: every task of the node has closed its PMI connection.
    Finished,
    /// Closed without BYE.
    Lost,
}

/// The listener's rest after an accept failed for want of resources.
#[derive(Clone, Copy)]
struct Rest {
    /// While out of the epoll set: when it goes back.
    until: Option<Instant>,
    /// How long this rest is; the next failure rests twice as long.
    length: Duration,
}

/// Refused connections since the last line about them.
struct Refusals {
    count: u64,
    last: String,
    logged: Option<Instant>,
}

struct State {
    step: Step,
    reporter: Box<dyn Reporter>,
    /// Closed once every node is admitted.
    listener: Option<TcpListener>,
    /// Set after an accept failed for want of resources, until one succeeds.
    resting: Option<Rest>,
    /// Kept open while the thread watches it (the [`Root`] holds the other reference).
    _stop: Arc<OwnedFd>,
    epoll: OwnedFd,
    conns: Vec<Option<Conn>>,
    /// Connections in the handshake, and how many may be.
    in_handshake: usize,
    handshake_max: usize,
    nodes: Vec<NodeState>,
    admitted: usize,
    /// The collective being gathered, and its bytes so far.
    epoch: u32,
    parts: Vec<Option<Vec<u8>>>,
    have: usize,
    gathered: usize,
    /// Ranks that closed their connection without finalize, with their node.
    gone: Vec<(u32, u32)>,
    gone_seen: Vec<bool>,
    refusals: Refusals,
    outcome: Outcome,
    /// srun is done with the step: the root takes in what is left and stops.
    stopping: bool,
    last_expiry: Instant,
    buf: Vec<u8>,
}

impl State {
    fn new(listener: TcpListener, step: Step, reporter: Box<dyn Reporter>, stop: Arc<OwnedFd>) -> io::Result<State> {
        let epoll = epoll_create()?;
        epoll_ctl(&epoll, libc::EPOLL_CTL_ADD, listener.as_raw_fd(), libc::EPOLLIN as u32, LISTENER)?;
        epoll_ctl(&epoll, libc::EPOLL_CTL_ADD, stop.as_raw_fd(), libc::EPOLLIN as u32, STOP)?;
        let n = step.node_names.len();
        let size = step.node_of.len();
        Ok(State {
            step,
            reporter,
            listener: Some(listener),
            resting: None,
            _stop: stop,
            epoll,
            conns: Vec::new(),
            in_handshake: 0,
            handshake_max: n + HANDSHAKE_SPARE,
            nodes: vec![NodeState::default(); n],
            admitted: 0,
            epoch: 0,
            parts: vec![None; n],
            have: 0,
            gathered: 0,
            gone: Vec::new(),
            gone_seen: vec![false; size],
            refusals: Refusals { count: 0, last: String::new(), logged: None },
            outcome: Outcome::default(),
            stopping: false,
            last_expiry: Instant::now(),
            buf: vec![0; 256 * 1024],
        })
    }

    fn node_name(&self, node: u32) -> String {
        self.step.node_names.get(node as usize).cloned().unwrap_or_else(|| format!("node {node}"))
    }

    fn run(&mut self) -> Outcome {
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 64];
        loop {
            let timeout = match self.resting.and_then(|r| r.until) {
                Some(until) => until.saturating_duration_since(Instant::now()).as_millis().clamp(1, 1000) as i32,
                None => 1000,
            };
            // SAFETY: the buffer outlives the call and its length is passed.
            let n = unsafe { libc::epoll_wait(self.epoll.as_raw_fd(), events.as_mut_ptr(), 64, timeout) };
            if n < 0 {
                if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                self.reporter.error(&format!("the collective root stopped: {}", io::Error::last_os_error()));
                return self.outcome.clone();
            }
            let mut stopping = false;
            for ev in &events[..n as usize] {
                let (token, flags) = (ev.u64, ev.events);
                match token {
                    LISTENER => self.accept(),
                    STOP => stopping = true,
                    t => {
                        if flags & libc::EPOLLOUT as u32 != 0 {
                            self.write(t);
                        }
                        if flags & !(libc::EPOLLOUT as u32) != 0 {
                            self.read(t);
                        }
                    }
                }
            }
            self.wake_listener();
            if self.last_expiry.elapsed() >= Duration::from_secs(1) {
                self.last_expiry = Instant::now();
                self.expire_handshakes();
            }
            if stopping {
                // Take in what the stepds sent before srun's step ended (an abort from the last task).
                self.stopping = true;
                for t in 0..self.conns.len() as u64 {
                    self.read(t);
                }
                // Tell the stepds still connected that the close which follows is the normal end.
                let end = Arc::new(control(&wire::FromRoot::End));
                for n in 0..self.nodes.len() as u32 {
                    self.send(n, end.clone());
                }
                self.log_refusals(true);
                return self.outcome.clone();
            }
        }
    }

    fn accept(&mut self) {
        loop {
            let Some(listener) = &self.listener else { return };
            let (stream, mut peer) = match listener.accept() {
                Ok(x) => x,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return self.rest_listener(e),
            };
            self.resting = None;
            // The dual-stack socket sees IPv4 peers as ::ffff:a.b.c.d: show them as users know them.
            if let SocketAddr::V6(v6) = peer {
                if let Some(v4) = v6.ip().to_ipv4_mapped() {
                    peer = SocketAddr::new(v4.into(), v6.port());
                }
            }
            if let Some(allowed) = &self.step.addresses {
                if !allowed.contains(&peer.ip()) {
                    self.refuse(peer, "not the address of any of the step's nodes");
                    continue;
                }
            }
            if stream.set_nonblocking(true).is_err() {
                continue;
            }
            let _ = stream.set_nodelay(true);
            if self.in_handshake >= self.handshake_max {
                self.drop_oldest_handshake();
            }
            let token = match self.conns.iter().position(Option::is_none) {
                Some(t) => t,
                None => {
                    self.conns.push(None);
                    self.conns.len() - 1
                }
            };
            if epoll_ctl(&self.epoll, libc::EPOLL_CTL_ADD, stream.as_raw_fd(), libc::EPOLLIN as u32, token as u64)
                .is_err()
            {
                continue;
            }
            self.in_handshake += 1;
            self.conns[token] = Some(Conn {
                stream,
                peer,
                stage: Stage::Hello,
                since: Instant::now(),
                input: FrameBuf::default(),
                output: VecDeque::new(),
                want_write: false,
            });
            // A stepd sends HELLO as soon as it is connected: it is usually here already.
            self.read(token as u64);
        }
    }

    /// An accept failed: for want of resources (out of fds, memory) the listener rests a while, out of the
    /// epoll set, instead of being reported ready (and failing) on every pass.
    fn rest_listener(&mut self, e: io::Error) {
        let starved = matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM));
        if !starved {
            // The connection went away before it was taken (ECONNABORTED and the like): nothing to rest for.
            return;
        }
        let length = self.resting.map_or(ACCEPT_REST_FIRST, |r| (r.length * 2).min(ACCEPT_REST_MAX));
        self.resting = Some(Rest { until: Some(Instant::now() + length), length });
        if let Some(l) = &self.listener {
            let _ = epoll_ctl(&self.epoll, libc::EPOLL_CTL_DEL, l.as_raw_fd(), 0, LISTENER);
        }
        self.refuse(None::<SocketAddr>, &format!("cannot accept connections: {e}"));
    }

    /// Puts a resting listener back in the epoll set once its rest is over.
    fn wake_listener(&mut self) {
        let Some(rest) = self.resting.as_mut() else { return };
        if rest.until.is_none_or(|t| Instant::now() < t) {
            return;
        }
        // The length stays until an accept succeeds, so that the next failure rests longer.
        rest.until = None;
        if let Some(l) = &self.listener {
            let _ = epoll_ctl(&self.epoll, libc::EPOLL_CTL_ADD, l.as_raw_fd(), libc::EPOLLIN as u32, LISTENER);
        }
    }

    /// Counts a refused connection; says so at debug level, at most once per [`REFUSAL_LOG_EVERY`].
    fn refuse(&mut self, peer: impl Into<Option<SocketAddr>>, why: &str) {
        let r = &mut self.refusals;
        r.count += 1;
        r.last = match peer.into() {
            Some(p) => format!("from {p}: {why}"),
            None => why.to_string(),
        };
        self.log_refusals(false);
    }

    fn log_refusals(&mut self, last: bool) {
        let r = &mut self.refusals;
        if r.count == 0 || (!last && r.logged.is_some_and(|t| t.elapsed() < REFUSAL_LOG_EVERY)) {
            return;
        }
        let line = format!(
            "refused {} connection{} to the collective port; the last {}",
            r.count,
            if r.count == 1 { "" } else { "s" },
            r.last
        );
        r.count = 0;
        r.logged = Some(Instant::now());
        self.reporter.debug(&line);
    }

    fn drop_oldest_handshake(&mut self) {
        let oldest = self
            .conns
            .iter()
            .enumerate()
            .filter_map(|(t, c)| c.as_ref().filter(|c| c.node().is_none()).map(|c| (c.since, t)))
            .min();
        if let Some((_, t)) = oldest {
            let peer = self.conns[t].as_ref().map(|c| c.peer);
            self.refuse(peer, "the oldest of too many connections in the handshake");
            self.drop_conn(t as u64);
        }
    }

    fn expire_handshakes(&mut self) {
        let now = Instant::now();
        for t in 0..self.conns.len() {
            let Some(c) = &self.conns[t] else { continue };
            if c.node().is_none() && now.duration_since(c.since) > HANDSHAKE_TIMEOUT {
                let peer = c.peer;
                self.refuse(peer, "no handshake in time");
                self.drop_conn(t as u64);
            }
        }
    }

    /// Reads whatever `token`'s peer has sent and handles every whole frame.
    fn read(&mut self, token: u64) {
        loop {
            let Some(c) = self.conns.get_mut(token as usize).and_then(Option::as_mut) else { return };
            match c.stream.read(&mut self.buf) {
                Ok(0) => return self.closed(token),
                Ok(n) => {
                    c.input.extend(&self.buf[..n]);
                    if !self.frames(token) {
                        return;
                    }
                    if n < self.buf.len() {
                        return;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return self.closed(token),
            }
        }
    }

    /// The largest frame a connection at `stage` may send.
    fn frame_max(&self, stage: Stage) -> usize {
        match stage {
            Stage::Hello => HELLO_LEN,
            Stage::Proof(_) => PROOF_LEN_ON_WIRE,
            Stage::Node(_) => CONTROL_MAX.max(wire::all_len(1, self.step.part_max.bytes) - 4),
        }
    }

    /// Handles every whole frame in `token`'s input; false if the connection was dropped.
    fn frames(&mut self, token: u64) -> bool {
        loop {
            let Some(c) = self.conns.get(token as usize).and_then(Option::as_ref) else { return false };
            let (stage, peer) = (c.stage, c.peer);
            let max = self.frame_max(stage);
            let Some(c) = self.conns.get_mut(token as usize).and_then(Option::as_mut) else { return false };
            let msg = match c.input.next(max) {
                Ok(None) => return true,
                Ok(Some(payload)) => ToRoot::decode(payload).map_err(|e| e.to_string()),
                Err(FrameError::TooLarge { len, .. }) if matches!(stage, Stage::Node(_)) => {
                    let Stage::Node(n) = stage else { return false };
                    let what = self.part_too_large(n, len);
                    self.fatal(what, None);
                    self.drop_conn(token);
                    return false;
                }
                Err(e) => Err(e.to_string()),
            };
            let msg = match msg {
                Ok(m) => m,
                Err(e) => {
                    match stage {
                        Stage::Node(n) => {
                            let what = format!("the slurmstepd of {} sent a {e}", self.node_name(n));
                            self.fatal(what, None);
                        }
                        _ => self.refuse(peer, &e),
                    }
                    self.drop_conn(token);
                    return false;
                }
            };
            let keep = match (stage, msg) {
                (Stage::Hello, ToRoot::Hello { node, nonce }) => self.hello(token, node, nonce),
                (Stage::Proof(t), ToRoot::Proof { proof }) => self.proof(token, t, proof),
                (Stage::Hello | Stage::Proof(_), _) => {
                    self.refuse(peer, "no handshake");
                    false
                }
                (Stage::Node(n), msg) => self.message(token, n, msg),
            };
            if !keep {
                self.drop_conn(token);
                return false;
            }
        }
    }

    fn hello(&mut self, token: u64, node: u32, stepd_nonce: auth::Nonce) -> bool {
        let peer = self.conns[token as usize].as_ref().map(|c| c.peer);
        if self.nodes.get(node as usize) != Some(&NodeState::Unconnected) {
            self.refuse(peer, &format!("node index {node} is unknown or already connected"));
            return false;
        }
        let Ok(root_nonce) = auth::nonce() else {
            self.refuse(peer, "no random bytes for a challenge");
            return false;
        };
        if let Some(c) = self.conns[token as usize].as_mut() {
            c.stage = Stage::Proof(Transcript { node, stepd_nonce, root_nonce });
        }
        self.queue(token, Arc::new(control(&wire::FromRoot::Challenge { nonce: root_nonce })));
        true
    }

    fn proof(&mut self, token: u64, t: Transcript, proof: auth::Proof) -> bool {
        let peer = self.conns[token as usize].as_ref().map(|c| c.peer);
        if !self.step.secret.verify(Role::Stepd, &t, &proof) {
            self.refuse(peer, "wrong proof of the step's secret");
            return false;
        }
        if self.nodes[t.node as usize] != NodeState::Unconnected {
            self.refuse(peer, &format!("node index {} is already connected", t.node));
            return false;
        }
        self.nodes[t.node as usize] = NodeState::Connected(token);
        if let Some(c) = self.conns[token as usize].as_mut() {
            c.stage = Stage::Node(t.node);
        }
        self.in_handshake -= 1;
        self.admitted += 1;
        if self.admitted == self.nodes.len() {
            // Every node is in: nobody else has anything to connect for.
            self.listener = None;
            self.resting = None;
        }
        let welcome = wire::FromRoot::Welcome { proof: self.step.secret.prove(Role::Root, &t) };
        self.queue(token, Arc::new(control(&welcome)));
        true
    }

    /// A message from admitted node `n`; false if its connection is to be dropped.
    fn message(&mut self, token: u64, n: u32, msg: ToRoot) -> bool {
        match msg {
            ToRoot::Hello { .. } | ToRoot::Proof { .. } => {
                self.fatal(format!("the slurmstepd of {} authenticated twice", self.node_name(n)), None);
                false
            }
            ToRoot::Contrib { epoch, parts } => {
                self.contribution(n, epoch, parts);
                true
            }
            ToRoot::Abort { rank, code, message } => {
                let what = format!(
                    "rank {rank} on {} called PMI_Abort with exit code {code}{}{}",
                    self.node_name(n),
                    if message.is_empty() { "" } else { ": " },
                    message
                );
                self.fatal(what, Some(code));
                true
            }
            ToRoot::Error { rank: _, task_failed, message } => {
                let what = format!("{message} (on {})", self.node_name(n));
                if !self.outcome.ended && !task_failed {
                    self.outcome.job_error = true;
                }
                self.fatal(what, None);
                true
            }
            ToRoot::Gone { rank } => {
                if self.step.node_of.get(rank as usize) != Some(&n) {
                    let what =
                        format!("the slurmstepd of {} reported rank {rank}, not one of its own", self.node_name(n));
                    self.fatal(what, None);
                    return false;
                }
                if !std::mem::replace(&mut self.gone_seen[rank as usize], true) {
                    self.gone.push((rank, n));
                }
                self.check_gone();
                true
            }
            ToRoot::Bye => {
                // Not a loss: the connection is dropped as the stepd asked.
                self.nodes[n as usize] = NodeState::Finished;
                self.drop_conn(token);
                self.check_finished();
                false
            }
        }
    }

    fn contribution(&mut self, node: u32, epoch: u32, parts: Vec<(u32, Vec<u8>)>) {
        if self.outcome.ended {
            // The step is being ended: nobody waits for a result that cannot come.
            self.send(node, Arc::new(fail(epoch, "the job step is ending")));
            return;
        }
        if let Err(what) = self.gather(node, epoch, parts) {
            // The node that brought it waits in this exchange too, whether or not its part was kept.
            let waits = self.parts.get(node as usize).is_some_and(Option::is_none);
            self.fatal(what.clone(), None);
            if waits {
                self.send(node, Arc::new(fail(epoch, &what)));
            }
            return;
        }
        if self.have == self.parts.len() {
            let frame = wire::all(
                self.epoch,
                self.parts.iter().enumerate().map(|(n, p)| (n as u32, p.as_deref().unwrap_or(&[]))),
            );
            let frame = match frame {
                Ok(f) => Arc::new(f),
                Err(e) => return self.fatal(format!("PMI exchange {}: {e}", self.epoch), None),
            };
            self.parts.iter_mut().for_each(|p| *p = None);
            self.have = 0;
            self.gathered = 0;
            self.epoch = self.epoch.wrapping_add(1);
            for n in 0..self.nodes.len() as u32 {
                self.send(n, frame.clone());
            }
            return;
        }
        self.check_finished();
        self.check_gone();
    }

    /// Takes node `node`'s parts of the exchange in progress, or says why they cannot be.
    fn gather(&mut self, node: u32, epoch: u32, parts: Vec<(u32, Vec<u8>)>) -> Result<(), String> {
        if epoch != self.epoch {
            return Err(format!(
                "the slurmstepd of {} is at exchange {epoch}, the others at {}",
                self.node_name(node),
                self.epoch
            ));
        }
        for (from, bytes) in parts {
            // A frame may be as large as a control frame even when the bound on a part is smaller.
            if bytes.len() > self.step.part_max.bytes {
                return Err(self.part_too_large(node, bytes.len()));
            }
            // Only a node's own part today (a tree would forward its subtree's).
            if from != node || self.parts.get(from as usize).is_none_or(Option::is_some) {
                return Err(format!(
                    "the slurmstepd of {} sent a part for node {from} twice or out of turn",
                    self.node_name(node)
                ));
            }
            self.gathered = self.gathered.saturating_add(bytes.len());
            if self.gathered > self.step.exchange_max.bytes {
                return Err(format!(
                    "PMI exchange {} would gather more than {} bytes from the step's nodes (the slurmstepd of {} \
                     brought {} bytes, {} in all so far), over the limit ({}: raise it in srun's environment if \
                     the job needs more)",
                    self.epoch,
                    self.step.exchange_max.bytes,
                    self.node_name(node),
                    bytes.len(),
                    self.gathered,
                    self.step.exchange_max.option
                ));
            }
            self.parts[from as usize] = Some(bytes);
            self.have += 1;
        }
        Ok(())
    }

    /// Why node `node`'s `len` bytes for one exchange are refused: over the bound on one node's part.
    fn part_too_large(&self, node: u32, len: usize) -> String {
        format!(
            "the slurmstepd of {} sent {len} bytes for one PMI exchange, over the limit of {} bytes per node \
             ({}: raise it in srun's environment if the job needs more)",
            self.node_name(node),
            self.step.part_max.bytes,
            self.step.part_max.option
        )
    }

    /// An exchange cannot complete if a node that has not contributed is gone.
    fn check_finished(&mut self) {
        if self.have == 0 || self.outcome.ended {
            return;
        }
        for n in 0..self.nodes.len() {
            if self.parts[n].is_some() {
                continue;
            }
            let why = match self.nodes[n] {
                NodeState::Finished => "every rank on it has closed its PMI connection",
                NodeState::Lost => "its slurmstepd closed the connection (it was killed or failed)",
                _ => continue,
            };
            let what = format!("ranks wait in a PMI barrier that {} cannot join: {why}", self.node_name(n as u32));
            return self.fatal(what, None);
        }
    }

    /// An exchange cannot complete if a rank left, without finalize, from a node that has not contributed.
    fn check_gone(&mut self) {
        if self.have == 0 || self.outcome.ended {
            return;
        }
        if let Some(&(rank, node)) =
            self.gone.iter().find(|(_, n)| self.parts.get(*n as usize).is_some_and(Option::is_none))
        {
            let what = format!(
                "rank {rank} on {} closed its PMI connection (exited or crashed) without PMI_Finalize while other ranks wait for it in a barrier",
                self.node_name(node)
            );
            self.fatal(what, None);
        }
    }

    /// A connection ended. A stepd says BYE before it closes, even when its step is cancelled: one that
    /// closes without it was killed or failed, and the step cannot go on.
    fn closed(&mut self, token: u64) {
        let node = self.conns.get(token as usize).and_then(Option::as_ref).and_then(Conn::node);
        self.drop_conn(token);
        let Some(n) = node else { return };
        let what = format!(
            "lost the connection to the slurmstepd of {}{}: it was killed or failed",
            self.node_name(n),
            if self.have > 0 { " during a PMI exchange" } else { "" }
        );
        self.fatal(what, None);
    }

    /// The first fatal event ends the step; later ones follow from the ending (the tasks it kills leave
    /// their barriers) and are logged at debug level only, not on the job's stderr as new faults. Once srun
    /// is done with the step (the final drain) a lost connection means nothing, and there is no step left
    /// to end.
    fn fatal(&mut self, what: String, abort_code: Option<i32>) {
        if self.outcome.ended || (self.stopping && abort_code.is_none()) {
            self.reporter.debug(&what);
            return;
        }
        self.outcome.ended = true;
        self.outcome.abort_code = abort_code;
        self.reporter.error(&what);
        // Nobody waits for the exchange in progress any more.
        if self.have > 0 {
            let frame = Arc::new(fail(self.epoch, &what));
            for n in 0..self.nodes.len() as u32 {
                if self.parts[n as usize].is_some() {
                    self.send(n, frame.clone());
                }
            }
            // Its parts are of no use now.
            self.parts.iter_mut().for_each(|p| *p = None);
            self.have = 0;
            self.gathered = 0;
        }
        if !self.stopping {
            self.reporter.end_step();
        }
    }

    /// Queues `frame` for node `node`, if it is connected.
    fn send(&mut self, node: u32, frame: Arc<Vec<u8>>) {
        if let Some(NodeState::Connected(t)) = self.nodes.get(node as usize).copied() {
            self.queue(t, frame);
        }
    }

    fn queue(&mut self, token: u64, frame: Arc<Vec<u8>>) {
        if let Some(c) = self.conns.get_mut(token as usize).and_then(Option::as_mut) {
            c.output.push_back((frame, 0));
            self.write(token);
        }
    }

    fn write(&mut self, token: u64) {
        let Some(c) = self.conns.get_mut(token as usize).and_then(Option::as_mut) else { return };
        while let Some((frame, at)) = c.output.front_mut() {
            match c.stream.write(&frame[*at..]) {
                Ok(n) => {
                    *at += n;
                    if *at == frame.len() {
                        c.output.pop_front();
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if !c.want_write {
                        c.want_write = true;
                        let ev = (libc::EPOLLIN | libc::EPOLLOUT) as u32;
                        let _ = epoll_ctl(&self.epoll, libc::EPOLL_CTL_MOD, c.stream.as_raw_fd(), ev, token);
                    }
                    return;
                }
                // The reading side sees the close and reports it.
                Err(_) => {
                    c.output.clear();
                    return;
                }
            }
        }
        if c.want_write {
            c.want_write = false;
            let _ = epoll_ctl(&self.epoll, libc::EPOLL_CTL_MOD, c.stream.as_raw_fd(), libc::EPOLLIN as u32, token);
        }
    }

    fn drop_conn(&mut self, token: u64) {
        if let Some(c) = self.conns.get_mut(token as usize).and_then(Option::take) {
            // Closing the socket removes it from the epoll set.
            match c.node() {
                Some(n) if self.nodes[n as usize] == NodeState::Connected(token) => {
                    self.nodes[n as usize] = NodeState::Lost
                }
                Some(_) => {}
                None => self.in_handshake -= 1,
            }
        }
    }
}

fn fail(epoch: u32, message: &str) -> Vec<u8> {
    control(&wire::FromRoot::Fail { epoch, message: message.to_string() })
}

/// A control frame (bounded in size, so it always encodes).
fn control(m: &wire::FromRoot) -> Vec<u8> {
    m.encode().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::slurm::uplink;
    use crate::slurm::wire::FromRoot;
    use std::sync::{Arc as StdArc, Mutex};

    #[derive(Clone, Default)]
    struct Record(StdArc<Mutex<Vec<String>>>);

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
    }

    impl Record {
        fn lines(&self) -> Vec<String> {
            self.0.lock().unwrap().clone()
        }
        fn wait_for(&self, what: &str) {
            let until = Instant::now() + Duration::from_secs(10);
            while !self.lines().iter().any(|l| l.contains(what)) {
                assert!(Instant::now() < until, "no `{what}` in {:?}", self.lines());
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }

    const PART_MAX: Bound = Bound { bytes: 1 << 20, option: "RPMI_TEST_PART_MAX" };
    const EXCHANGE_MAX: Bound = Bound { bytes: 3 << 20, option: "RPMI_TEST_EXCHANGE_MAX" };

    fn step(nodes: usize, secret: &Secret) -> Step {
        Step {
            node_names: (1..=nodes).map(|n| format!("n{n}")).collect(),
            node_of: (0..nodes as u32).collect(),
            secret: secret.clone(),
            addresses: None,
            part_max: PART_MAX,
            exchange_max: EXCHANGE_MAX,
        }
    }

    fn start(step: Step) -> (Root, Record) {
        let record = Record::default();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        (Root::start(listener, step, Box::new(record.clone())).unwrap(), record)
    }

    fn root(nodes: usize, secret: &Secret) -> (Root, Record) {
        start(step(nodes, secret))
    }

    /// A root for `nodes` nodes with every node's stepd connected and authenticated.
    fn connected(nodes: usize) -> (Root, Record, Vec<TcpStream>) {
        let secret = Secret::generate().unwrap();
        let (root, record) = root(nodes, &secret);
        let stepds = (0..nodes as u32).map(|n| stepd(root.port(), n, &secret)).collect();
        (root, record, stepds)
    }

    /// A stepd admitted as `node`, through the stepd's own handshake.
    fn stepd(port: u16, node: u32, secret: &Secret) -> TcpStream {
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let s = uplink::join(&[addr], node, secret, Duration::from_secs(20)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s
    }

    fn contrib(epoch: u32, node: u32, bytes: &[u8]) -> Vec<u8> {
        wire::contrib(epoch, node, bytes).unwrap()
    }

    fn frame(m: ToRoot) -> Vec<u8> {
        m.encode().unwrap()
    }

    fn receive(s: &mut TcpStream) -> FromRoot {
        let mut len = [0u8; 4];
        s.read_exact(&mut len).unwrap();
        let mut p = vec![0; u32::from_be_bytes(len) as usize];
        s.read_exact(&mut p).unwrap();
        FromRoot::decode(&p).unwrap()
    }

    fn closed(s: &mut TcpStream) -> bool {
        let mut b = [0u8; 1];
        matches!(s.read(&mut b), Ok(0) | Err(_))
    }

    #[test]
    fn every_node_gets_every_part_each_epoch() {
        let (root, record, mut s) = connected(3);
        for epoch in 0..3u32 {
            for (n, c) in s.iter_mut().enumerate().rev() {
                c.write_all(&contrib(epoch, n as u32, format!("e{epoch}n{n}").as_bytes())).unwrap();
            }
            for c in s.iter_mut() {
                let FromRoot::All { epoch: e, parts } = receive(c) else { panic!("not ALL") };
                assert_eq!(e, epoch);
                let want: Vec<(u32, Vec<u8>)> = (0..3).map(|n| (n, format!("e{epoch}n{n}").into_bytes())).collect();
                assert_eq!(parts, want);
            }
        }
        s[0].write_all(&frame(ToRoot::Bye)).unwrap();
        s[1].write_all(&frame(ToRoot::Bye)).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(root.stop(), Outcome::default());
        // A node still connected when srun is done hears so before the close.
        assert_eq!(receive(&mut s[2]), FromRoot::End);
        assert!(closed(&mut s[2]));
        assert!(record.lines().iter().all(|l| !l.starts_with("error")), "{:?}", record.lines());
    }

    #[test]
    fn a_wrong_secret_or_garbage_is_refused_and_the_step_goes_on() {
        let secret = Secret::generate().unwrap();
        let (root, record) = root(2, &secret);
        let addr = SocketAddr::from(([127, 0, 0, 1], root.port()));
        let wrong = uplink::join(&[addr], 0, &Secret::generate().unwrap(), Duration::from_millis(200));
        assert!(matches!(wrong, Err(uplink::JoinError::GaveUp { .. })), "{wrong:?}");
        let mut http = TcpStream::connect(addr).unwrap();
        http.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        http.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        assert!(closed(&mut http));
        let mut s: Vec<TcpStream> = (0..2).map(|n| stepd(root.port(), n, &secret)).collect();
        // Every node is in: the port is closed to everyone, the right secret too.
        assert!(TcpStream::connect(addr).is_err(), "the collective port still takes connections");
        for (n, c) in s.iter_mut().enumerate() {
            c.write_all(&contrib(0, n as u32, b"x")).unwrap();
        }
        for c in s.iter_mut() {
            assert!(matches!(receive(c), FromRoot::All { epoch: 0, .. }));
        }
        assert_eq!(root.stop(), Outcome::default());
        let lines = record.lines();
        assert!(lines.iter().any(|l| l.starts_with("debug: ") && l.contains("wrong proof")), "{lines:?}");
        // Refusals are for whoever debugs, not the job's stderr.
        assert!(lines.iter().all(|l| l.starts_with("debug: ")), "{lines:?}");
    }

    #[test]
    fn the_secret_never_crosses_the_network() {
        let secret = Secret::generate().unwrap();
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
        let mut s = uplink::join(&[relay_addr], 0, &secret, Duration::from_secs(20)).unwrap();
        s.write_all(&contrib(0, 0, b"a")).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        assert!(matches!(receive(&mut s), FromRoot::All { .. }));
        s.write_all(&frame(ToRoot::Bye)).unwrap();
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
        let secret = Secret::generate().unwrap();
        let (root, record) = root(nodes, &secret);
        let port = root.port();
        let stepds: Vec<_> = (0..nodes as u32)
            .map(|n| {
                let secret = secret.clone();
                std::thread::spawn(move || {
                    let addr = SocketAddr::from(([127, 0, 0, 1], port));
                    uplink::join(&[addr], n, &secret, Duration::from_secs(30))
                })
            })
            .collect();
        let mut conns: Vec<TcpStream> = stepds.into_iter().map(|t| t.join().unwrap().unwrap()).collect();
        for (n, c) in conns.iter_mut().enumerate() {
            c.write_all(&contrib(0, n as u32, b"p")).unwrap();
        }
        for c in conns.iter_mut() {
            c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            let FromRoot::All { parts, .. } = receive(c) else { panic!("not ALL") };
            assert_eq!(parts.len(), nodes);
        }
        for c in conns.iter_mut() {
            c.write_all(&frame(ToRoot::Bye)).unwrap();
        }
        assert_eq!(root.stop(), Outcome::default());
        assert!(!record.lines().iter().any(|l| l.starts_with("error")), "{:?}", record.lines());
    }

    #[test]
    fn idle_connections_do_not_keep_the_stepds_out() {
        let nodes = 3;
        let secret = Secret::generate().unwrap();
        let (root, record) = root(nodes, &secret);
        // More idle connections than the handshake table holds, opened before any stepd comes.
        let idle: Vec<TcpStream> = (0..nodes + HANDSHAKE_SPARE + 16)
            .map(|_| TcpStream::connect(("127.0.0.1", root.port())).unwrap())
            .collect();
        let mut s: Vec<TcpStream> = (0..nodes as u32).map(|n| stepd(root.port(), n, &secret)).collect();
        for (n, c) in s.iter_mut().enumerate() {
            c.write_all(&contrib(0, n as u32, b"x")).unwrap();
        }
        for c in s.iter_mut() {
            assert!(matches!(receive(c), FromRoot::All { .. }));
        }
        assert_eq!(root.stop(), Outcome::default());
        drop(idle);
        let lines = record.lines();
        assert!(lines.iter().any(|l| l.contains("the oldest of too many connections")), "{lines:?}");
        assert!(lines.iter().all(|l| l.starts_with("debug: ")), "{lines:?}");
    }

    #[test]
    fn connections_from_other_addresses_are_refused() {
        let secret = Secret::generate().unwrap();
        let mut s = step(1, &secret);
        s.addresses = Some(vec![IpAddr::from([192, 0, 2, 7])]);
        let (root, record) = start(s);
        let addr = SocketAddr::from(([127, 0, 0, 1], root.port()));
        let refused = uplink::join(&[addr], 0, &secret, Duration::from_millis(200));
        assert!(refused.is_err(), "a connection from 127.0.0.1 was admitted");
        root.stop();
        assert!(record.lines().iter().any(|l| l.contains("not the address of any of the step's nodes")));

        let mut s = step(1, &secret);
        s.addresses = Some(vec![IpAddr::from([127, 0, 0, 1])]);
        let (root, _) = start(s);
        stepd(root.port(), 0, &secret);
        root.stop();
    }

    #[test]
    fn a_part_over_its_bound_ends_the_step_naming_node_size_and_option() {
        let (root, record, mut s) = connected(2);
        s[1].write_all(&contrib(0, 1, &vec![b'x'; PART_MAX.bytes + 1])).unwrap();
        record.wait_for("RPMI_TEST_PART_MAX");
        let lines = record.lines();
        let error = lines.iter().find(|l| l.starts_with("error")).unwrap();
        assert!(error.contains("n2") && error.contains(&(PART_MAX.bytes + 1 + 17).to_string()), "{error}");
        assert!(root.stop().ended);
    }

    #[test]
    fn a_part_over_a_bound_smaller_than_a_control_frame_ends_the_step() {
        let secret = Secret::generate().unwrap();
        let mut small = step(2, &secret);
        small.part_max = Bound { bytes: 100, option: "RPMI_TEST_PART_MAX" };
        let (root, record) = start(small);
        let mut s: Vec<TcpStream> = (0..2).map(|n| stepd(root.port(), n, &secret)).collect();
        s[0].write_all(&contrib(0, 0, &[b'x'; 200])).unwrap();
        record.wait_for("sent 200 bytes for one PMI exchange, over the limit of 100 bytes per node");
        assert!(root.stop().ended);
    }

    #[test]
    fn the_node_whose_part_is_refused_hears_why() {
        let secret = Secret::generate().unwrap();
        let mut small = step(2, &secret);
        small.exchange_max = Bound { bytes: 100, option: "RPMI_TEST_EXCHANGE_MAX" };
        let (root, _record) = start(small);
        let mut s: Vec<TcpStream> = (0..2).map(|n| stepd(root.port(), n, &secret)).collect();
        s[0].write_all(&contrib(0, 0, &[b'x'; 200])).unwrap();
        let FromRoot::Fail { message, .. } = receive(&mut s[0]) else { panic!("no FAIL") };
        assert!(message.contains("RPMI_TEST_EXCHANGE_MAX"), "{message}");
        assert!(root.stop().ended);
    }

    #[test]
    fn an_exchange_over_its_bound_ends_the_step() {
        let (root, record, mut s) = connected(4);
        for (n, c) in s.iter_mut().enumerate() {
            c.write_all(&contrib(0, n as u32, &vec![b'x'; PART_MAX.bytes])).unwrap();
        }
        record.wait_for("RPMI_TEST_EXCHANGE_MAX");
        assert!(matches!(receive(&mut s[0]), FromRoot::Fail { .. }));
        assert!(root.stop().ended);
    }

    #[test]
    fn an_abort_ends_the_step_with_its_code() {
        let secret = Secret::generate().unwrap();
        let (root, record) = root(2, &secret);
        let mut a = stepd(root.port(), 0, &secret);
        let mut b = stepd(root.port(), 1, &secret);
        b.write_all(&contrib(0, 1, b"")).unwrap();
        a.write_all(&frame(ToRoot::Abort { rank: 0, code: 7, message: "oops".into() })).unwrap();
        // The node waiting in the exchange is released with a failure.
        assert!(matches!(receive(&mut b), FromRoot::Fail { epoch: 0, .. }));
        a.write_all(&frame(ToRoot::Error { rank: 1, task_failed: false, message: "later".into() })).unwrap();
        record.wait_for("debug: later (on n1)");
        let outcome = root.stop();
        assert_eq!(outcome, Outcome { abort_code: Some(7), ended: true, job_error: false });
        let lines = record.lines();
        assert_eq!(lines.iter().filter(|l| l.starts_with("error")).count(), 1, "{lines:?}");
        assert!(lines[0].contains("rank 0 on n1 called PMI_Abort with exit code 7: oops"), "{lines:?}");
        assert_eq!(lines.iter().filter(|l| *l == "end").count(), 1);
    }

    #[test]
    fn an_abort_sent_just_before_the_stop_is_seen() {
        let secret = Secret::generate().unwrap();
        let (root, _record) = root(1, &secret);
        let mut a = stepd(root.port(), 0, &secret);
        a.write_all(&frame(ToRoot::Abort { rank: 0, code: 3, message: String::new() })).unwrap();
        drop(a);
        assert_eq!(root.stop().abort_code, Some(3));
    }

    #[test]
    fn a_lost_node_mid_exchange_ends_the_step() {
        let (root, record, mut s) = connected(3);
        s[0].write_all(&contrib(0, 0, b"a")).unwrap();
        drop(s.remove(2));
        assert!(matches!(receive(&mut s[0]), FromRoot::Fail { .. }));
        // Whether the root saw the close before the contribution or after, the exchange fails and says why.
        record.wait_for("lost the connection to the slurmstepd of n3");
        assert!(root.stop().ended);
    }

    #[test]
    fn an_exchange_a_finished_node_cannot_join_fails() {
        let (root, record, mut s) = connected(2);
        s[1].write_all(&frame(ToRoot::Bye)).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        s[0].write_all(&contrib(0, 0, b"a")).unwrap();
        assert!(matches!(receive(&mut s[0]), FromRoot::Fail { .. }));
        record.wait_for("n2 cannot join: every rank on it has closed");
        assert!(root.stop().ended);
    }

    #[test]
    fn a_rank_gone_from_a_node_that_has_not_contributed_fails_the_exchange() {
        let (root, record, mut s) = connected(2);
        s[1].write_all(&frame(ToRoot::Gone { rank: 1 })).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert!(!record.lines().iter().any(|l| l == "end"), "no exchange yet: {:?}", record.lines());
        s[0].write_all(&contrib(0, 0, b"a")).unwrap();
        assert!(matches!(receive(&mut s[0]), FromRoot::Fail { .. }));
        record.wait_for("rank 1 on n2 closed its PMI connection");
        assert!(root.stop().ended);
    }

    #[test]
    fn a_silent_connection_does_not_hold_up_the_step() {
        let secret = Secret::generate().unwrap();
        let (root, _record) = root(1, &secret);
        let _silent = TcpStream::connect(("127.0.0.1", root.port())).unwrap();
        let mut half = TcpStream::connect(("127.0.0.1", root.port())).unwrap();
        half.write_all(&[0, 0, 0, 43, 1, b'R']).unwrap();
        let mut a = stepd(root.port(), 0, &secret);
        a.write_all(&contrib(0, 0, b"a")).unwrap();
        assert!(matches!(receive(&mut a), FromRoot::All { .. }));
        assert_eq!(root.stop(), Outcome::default());
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
        let secret = Secret::generate().unwrap();
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
        let joined = uplink::join(&[SocketAddr::from(([127, 0, 0, 1], port))], 0, &secret, Duration::from_secs(20));
        to_child.write_all(b"done\n").unwrap();
        drop(waiting);
        let status = child.wait().unwrap();
        assert!(fraction < 0.5, "a root that cannot accept used {:.0}% of a CPU", fraction * 100.0);
        assert!(joined.is_ok(), "once fds were free again the node could not join: {:?}", joined.err());
        assert!(status.success(), "the child failed: {status}");
    }
}

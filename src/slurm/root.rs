//! The collective root, run by srun in one thread for the life of the step: every node's slurmstepd
//! connects to it, authenticates with the step's secret, and sends its part of each collective; when every
//! node's part of an epoch is in, the root sends all of them to every node. It is also where aborts, job
//! errors and lost nodes are reported: the root prints the message on srun's stderr and ends the step.
//!
//! One thread, one epoll set over the listener and every connection, non-blocking I/O, so a slow or hostile
//! peer holds up nobody. The gathered frame is built once per epoch and shared by every node's send queue.

use super::wire::{self, FrameBuf, Secret, ToRoot, FRAME_MAX, HELLO_LEN};
use crate::driver::{epoll_create, epoll_ctl};
use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a new connection may take to authenticate.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections not yet authenticated, at most (more are refused at once).
const UNAUTHENTICATED_MAX: usize = 64;

/// Where the root's verdicts go: srun's stderr and Slurm in srun, a recorder in tests.
pub trait Reporter: Send + 'static {
    /// The first fatal event of the step: printed as an error.
    fn error(&mut self, message: &str);
    /// Everything else worth a line.
    fn info(&mut self, message: &str);
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
}

/// The step as the root sees it.
pub struct Step {
    /// The name of every node, by node index.
    pub node_names: Vec<String>,
    /// The node of every rank.
    pub node_of: Vec<u32>,
    pub secret: Secret,
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
            super::stepd::block_signals();
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| state.run())) {
                Ok(outcome) => outcome,
                Err(_) => Outcome { abort_code: None, ended: true },
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

struct Conn {
    stream: TcpStream,
    peer: SocketAddr,
    /// The node, once authenticated.
    node: Option<u32>,
    since: Instant,
    input: FrameBuf,
    output: VecDeque<(Arc<Vec<u8>>, usize)>,
    /// EPOLLOUT is being watched.
    want_write: bool,
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

struct State {
    step: Step,
    reporter: Box<dyn Reporter>,
    listener: TcpListener,
    /// Kept open while the thread watches it (the [`Root`] holds the other reference).
    _stop: Arc<OwnedFd>,
    epoll: OwnedFd,
    conns: Vec<Option<Conn>>,
    nodes: Vec<NodeState>,
    /// The collective being gathered.
    epoch: u32,
    parts: Vec<Option<Vec<u8>>>,
    have: usize,
    /// Ranks that closed their connection without finalize: (rank, node).
    gone: Vec<(u32, u32)>,
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
        Ok(State {
            step,
            reporter,
            listener,
            _stop: stop,
            epoll,
            conns: Vec::new(),
            nodes: vec![NodeState::default(); n],
            epoch: 0,
            parts: vec![None; n],
            have: 0,
            gone: Vec::new(),
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
            // SAFETY: the buffer outlives the call and its length is passed.
            let n = unsafe { libc::epoll_wait(self.epoll.as_raw_fd(), events.as_mut_ptr(), 64, 1000) };
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
            if self.last_expiry.elapsed() >= Duration::from_secs(1) {
                self.last_expiry = Instant::now();
                self.expire_unauthenticated();
            }
            if stopping {
                // Take in what the stepds sent before srun's step ended (an abort from the last task).
                self.stopping = true;
                for t in 0..self.conns.len() as u64 {
                    self.read(t);
                }
                // Tell the stepds still connected that the close which follows is the normal end.
                let end = Arc::new(wire::FromRoot::End.encode());
                for n in 0..self.nodes.len() as u32 {
                    self.send(n, end.clone());
                }
                return self.outcome.clone();
            }
        }
    }

    fn accept(&mut self) {
        loop {
            let (stream, mut peer) = match self.listener.accept() {
                Ok(x) => x,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    self.reporter.info(&format!("accept on the collective port failed: {e}"));
                    return;
                }
            };
            // The dual-stack socket sees IPv4 peers as ::ffff:a.b.c.d: show them as users know them.
            if let SocketAddr::V6(v6) = peer {
                if let Some(v4) = v6.ip().to_ipv4_mapped() {
                    peer = SocketAddr::new(v4.into(), v6.port());
                }
            }
            let unauthenticated = self.conns.iter().flatten().filter(|c| c.node.is_none()).count();
            if unauthenticated >= UNAUTHENTICATED_MAX {
                self.reporter.info(&format!("refused a connection from {peer}: too many unauthenticated ones"));
                continue;
            }
            if stream.set_nonblocking(true).is_err() {
                continue;
            }
            let _ = stream.set_nodelay(true);
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
            self.conns[token] = Some(Conn {
                stream,
                peer,
                node: None,
                since: Instant::now(),
                input: FrameBuf::default(),
                output: VecDeque::new(),
                want_write: false,
            });
        }
    }

    fn expire_unauthenticated(&mut self) {
        let now = Instant::now();
        for t in 0..self.conns.len() {
            if let Some(c) = &self.conns[t] {
                if c.node.is_none() && now.duration_since(c.since) > HELLO_TIMEOUT {
                    let peer = c.peer;
                    self.reporter.info(&format!("closed a connection from {peer}: no authentication in time"));
                    self.drop_conn(t as u64);
                }
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

    /// Handles every whole frame in `token`'s input; false if the connection was dropped.
    fn frames(&mut self, token: u64) -> bool {
        loop {
            let Some(c) = self.conns.get_mut(token as usize).and_then(Option::as_mut) else { return false };
            let (node, peer) = (c.node, c.peer);
            let max = if node.is_some() { FRAME_MAX } else { HELLO_LEN };
            let msg = match c.input.next(max) {
                Ok(None) => return true,
                Ok(Some(payload)) => ToRoot::decode(payload),
                Err(e) => Err(e),
            };
            let msg = match msg {
                Ok(m) => m,
                Err(e) => {
                    match node {
                        None => self.reporter.info(&format!("refused a connection from {peer}: {e}")),
                        Some(n) => {
                            let what = format!("the slurmstepd of {} sent a {e}", self.node_name(n));
                            self.fatal(what, None);
                        }
                    }
                    self.drop_conn(token);
                    return false;
                }
            };
            match (node, msg) {
                (None, ToRoot::Hello { node, secret }) => {
                    if !self.step.secret.matches(&secret) {
                        self.reporter.info(&format!("refused a connection from {peer}: wrong secret"));
                        self.drop_conn(token);
                        return false;
                    }
                    match self.nodes.get(node as usize) {
                        Some(NodeState::Unconnected) => {
                            self.nodes[node as usize] = NodeState::Connected(token);
                            if let Some(c) = self.conns[token as usize].as_mut() {
                                c.node = Some(node);
                            }
                        }
                        _ => {
                            self.reporter.info(&format!(
                                "refused a connection from {peer}: node index {node} is unknown or already connected"
                            ));
                            self.drop_conn(token);
                            return false;
                        }
                    }
                }
                (None, _) => {
                    self.reporter.info(&format!("refused a connection from {peer}: no authentication"));
                    self.drop_conn(token);
                    return false;
                }
                (Some(_), ToRoot::Hello { .. }) => {
                    self.fatal(format!("{peer} authenticated twice"), None);
                    self.drop_conn(token);
                    return false;
                }
                (Some(n), ToRoot::Contrib { epoch, parts }) => self.contribution(n, epoch, parts),
                (Some(n), ToRoot::Abort { rank, code, message }) => {
                    let what = format!(
                        "rank {rank} on {} called PMI_Abort with exit code {code}{}{}",
                        self.node_name(n),
                        if message.is_empty() { "" } else { ": " },
                        message
                    );
                    self.fatal(what, Some(code));
                }
                (Some(n), ToRoot::Error { rank: _, message }) => {
                    let what = format!("{message} (on {})", self.node_name(n));
                    self.fatal(what, None);
                }
                (Some(n), ToRoot::Gone { rank }) => {
                    self.gone.push((rank, n));
                    self.check_gone();
                }
                (Some(n), ToRoot::Bye) => {
                    self.nodes[n as usize] = NodeState::Finished;
                    if let Some(c) = self.conns[token as usize].as_mut() {
                        c.node = None;
                    }
                    self.drop_conn(token);
                    self.check_finished();
                    return false;
                }
            }
        }
    }

    fn contribution(&mut self, node: u32, epoch: u32, parts: Vec<(u32, Vec<u8>)>) {
        if self.outcome.ended {
            // The step is being ended: nobody waits for a result that cannot come.
            self.send(node, Arc::new(fail(epoch, "the job step is ending")));
            return;
        }
        if epoch != self.epoch {
            let what = format!(
                "the slurmstepd of {} is at exchange {epoch}, the others at {}",
                self.node_name(node),
                self.epoch
            );
            return self.fatal(what, None);
        }
        for (from, bytes) in parts {
            // Only a node's own part today (a tree would forward its subtree's).
            if from != node || self.parts.get(from as usize).is_none_or(Option::is_some) {
                let what = format!(
                    "the slurmstepd of {} sent a part for node {from} twice or out of turn",
                    self.node_name(node)
                );
                return self.fatal(what, None);
            }
            self.parts[from as usize] = Some(bytes);
            self.have += 1;
        }
        if self.have == self.parts.len() {
            let frame = wire::all(
                self.epoch,
                self.parts.iter().enumerate().map(|(n, p)| (n as u32, p.as_deref().unwrap_or(&[]))),
            );
            let frame = Arc::new(frame);
            self.parts.iter_mut().for_each(|p| *p = None);
            self.have = 0;
            self.epoch = self.epoch.wrapping_add(1);
            for n in 0..self.nodes.len() as u32 {
                self.send(n, frame.clone());
            }
            return;
        }
        self.check_finished();
        self.check_gone();
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
        let node = self.conns.get(token as usize).and_then(Option::as_ref).and_then(|c| c.node);
        self.drop_conn(token);
        let Some(n) = node else { return };
        self.nodes[n as usize] = NodeState::Lost;
        let what = format!(
            "lost the connection to the slurmstepd of {}{}: it was killed or failed",
            self.node_name(n),
            if self.have > 0 { " during a PMI exchange" } else { "" }
        );
        self.fatal(what, None);
    }

    /// The first fatal event ends the step; later ones are only logged. Once srun is done with the step
    /// (the final drain) a lost connection means nothing, and there is no step left to end.
    fn fatal(&mut self, what: String, abort_code: Option<i32>) {
        if self.outcome.ended || (self.stopping && abort_code.is_none()) {
            self.reporter.info(&what);
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
        }
        if !self.stopping {
            self.reporter.end_step();
        }
    }

    fn send(&mut self, node: u32, frame: Arc<Vec<u8>>) {
        if let Some(NodeState::Connected(t)) = self.nodes.get(node as usize).copied() {
            if let Some(c) = self.conns[t as usize].as_mut() {
                c.output.push_back((frame, 0));
                self.write(t);
            }
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
            if let Some(n) = c.node {
                if self.nodes[n as usize] == NodeState::Connected(token) {
                    self.nodes[n as usize] = NodeState::Lost;
                }
            }
        }
    }
}

fn fail(epoch: u32, message: &str) -> Vec<u8> {
    wire::FromRoot::Fail { epoch, message: message.to_string() }.encode()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::slurm::wire::{FromRoot, SECRET_LEN};
    use std::sync::{Arc as StdArc, Mutex};

    #[derive(Clone, Default)]
    struct Record(StdArc<Mutex<Vec<String>>>);

    impl Reporter for Record {
        fn error(&mut self, m: &str) {
            self.0.lock().unwrap().push(format!("error: {m}"));
        }
        fn info(&mut self, m: &str) {
            self.0.lock().unwrap().push(format!("info: {m}"));
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

    fn root(nodes: usize, secret: Secret) -> (Root, Record) {
        let record = Record::default();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let step = Step {
            node_names: (1..=nodes).map(|n| format!("n{n}")).collect(),
            node_of: (0..nodes as u32).collect(),
            secret,
        };
        (Root::start(listener, step, Box::new(record.clone())).unwrap(), record)
    }

    /// A root for `nodes` nodes with every node's stepd connected and authenticated.
    fn connected(nodes: usize) -> (Root, Record, Vec<TcpStream>) {
        let secret = Secret::generate().unwrap();
        let (root, record) = root(nodes, secret);
        let stepds = (0..nodes as u32).map(|n| stepd(root.port(), n, &secret)).collect();
        (root, record, stepds)
    }

    fn stepd(port: u16, node: u32, secret: &Secret) -> TcpStream {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.write_all(&ToRoot::Hello { node, secret: secret.0 }.encode()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s
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
                c.write_all(&wire::contrib(epoch, n as u32, format!("e{epoch}n{n}").as_bytes())).unwrap();
            }
            for c in s.iter_mut() {
                let FromRoot::All { epoch: e, parts } = receive(c) else { panic!("not ALL") };
                assert_eq!(e, epoch);
                let want: Vec<(u32, Vec<u8>)> = (0..3).map(|n| (n, format!("e{epoch}n{n}").into_bytes())).collect();
                assert_eq!(parts, want);
            }
        }
        s[0].write_all(&ToRoot::Bye.encode()).unwrap();
        s[1].write_all(&ToRoot::Bye.encode()).unwrap();
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
        let (root, record) = root(2, secret);
        let mut wrong = stepd(root.port(), 0, &Secret([0; SECRET_LEN]));
        assert!(closed(&mut wrong));
        let mut http = TcpStream::connect(("127.0.0.1", root.port())).unwrap();
        http.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        http.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        assert!(closed(&mut http));
        let mut s: Vec<TcpStream> = (0..2).map(|n| stepd(root.port(), n, &secret)).collect();
        // A second connection for a node that is connected already is refused too.
        let mut dup = stepd(root.port(), 1, &secret);
        assert!(closed(&mut dup));
        for (n, c) in s.iter_mut().enumerate() {
            c.write_all(&wire::contrib(0, n as u32, b"x")).unwrap();
        }
        for c in s.iter_mut() {
            assert!(matches!(receive(c), FromRoot::All { epoch: 0, .. }));
        }
        record.wait_for("wrong secret");
        assert_eq!(root.stop(), Outcome::default());
        assert!(!record.lines().iter().any(|l| l == "end"));
    }

    #[test]
    fn an_abort_ends_the_step_with_its_code() {
        let secret = Secret::generate().unwrap();
        let (root, record) = root(2, secret);
        let mut a = stepd(root.port(), 0, &secret);
        let mut b = stepd(root.port(), 1, &secret);
        b.write_all(&wire::contrib(0, 1, b"")).unwrap();
        a.write_all(&ToRoot::Abort { rank: 0, code: 7, message: "oops".into() }.encode()).unwrap();
        // The node waiting in the exchange is released with a failure.
        assert!(matches!(receive(&mut b), FromRoot::Fail { epoch: 0, .. }));
        a.write_all(&ToRoot::Error { rank: 1, message: "later".into() }.encode()).unwrap();
        record.wait_for("later");
        let outcome = root.stop();
        assert_eq!(outcome, Outcome { abort_code: Some(7), ended: true });
        let lines = record.lines();
        assert_eq!(lines.iter().filter(|l| l.starts_with("error")).count(), 1, "{lines:?}");
        assert!(lines[0].contains("rank 0 on n1 called PMI_Abort with exit code 7: oops"), "{lines:?}");
        assert_eq!(lines.iter().filter(|l| *l == "end").count(), 1);
    }

    #[test]
    fn an_abort_sent_just_before_the_stop_is_seen() {
        let secret = Secret::generate().unwrap();
        let (root, _record) = root(1, secret);
        let mut a = stepd(root.port(), 0, &secret);
        a.write_all(&ToRoot::Abort { rank: 0, code: 3, message: String::new() }.encode()).unwrap();
        drop(a);
        assert_eq!(root.stop().abort_code, Some(3));
    }

    #[test]
    fn a_lost_node_mid_exchange_ends_the_step() {
        let (root, record, mut s) = connected(3);
        s[0].write_all(&wire::contrib(0, 0, b"a")).unwrap();
        drop(s.remove(2));
        assert!(matches!(receive(&mut s[0]), FromRoot::Fail { .. }));
        record.wait_for("lost the connection to the slurmstepd of n3 during a PMI exchange");
        assert!(root.stop().ended);
    }

    #[test]
    fn an_exchange_a_finished_node_cannot_join_fails() {
        let (root, record, mut s) = connected(2);
        s[1].write_all(&ToRoot::Bye.encode()).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        s[0].write_all(&wire::contrib(0, 0, b"a")).unwrap();
        assert!(matches!(receive(&mut s[0]), FromRoot::Fail { .. }));
        record.wait_for("n2 cannot join: every rank on it has closed");
        assert!(root.stop().ended);
    }

    #[test]
    fn a_rank_gone_from_a_node_that_has_not_contributed_fails_the_exchange() {
        let (root, record, mut s) = connected(2);
        s[1].write_all(&ToRoot::Gone { rank: 1 }.encode()).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert!(!record.lines().iter().any(|l| l == "end"), "no exchange yet: {:?}", record.lines());
        s[0].write_all(&wire::contrib(0, 0, b"a")).unwrap();
        assert!(matches!(receive(&mut s[0]), FromRoot::Fail { .. }));
        record.wait_for("rank 1 on n2 closed its PMI connection");
        assert!(root.stop().ended);
    }

    #[test]
    fn a_silent_connection_does_not_hold_up_the_step() {
        let secret = Secret::generate().unwrap();
        let (root, _record) = root(1, secret);
        let _silent = TcpStream::connect(("127.0.0.1", root.port())).unwrap();
        let mut half = TcpStream::connect(("127.0.0.1", root.port())).unwrap();
        half.write_all(&[0, 0, 0, 43, 1, b'R']).unwrap();
        let mut a = stepd(root.port(), 0, &secret);
        a.write_all(&wire::contrib(0, 0, b"a")).unwrap();
        assert!(matches!(receive(&mut a), FromRoot::All { .. }));
        assert_eq!(root.stop(), Outcome::default());
    }
}

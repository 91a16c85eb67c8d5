//! Admission: the accepting side of the collective's handshake ([`super::auth`]), shared by srun's root,
//! which every node's slurmstepd joins, and a stepd with children in the tree, which its children join.
//! The [`Acceptor`] owns the listener and the connections still in the handshake, in its host's epoll set;
//! it hands each admitted connection over to the host ([`Admission::Joined`]).
//!
//! A connection's first bytes are read as soon as it is accepted and whenever it is readable, so a real
//! stepd is admitted within two round trips. Connections still in the handshake are held in a table of
//! [`HANDSHAKE_SPARE`] more than may join. When it is full, a connection of the address that holds the most
//! beyond its own nodes makes room: one that has not sent its HELLO before one that has, the oldest first,
//! never the newest. A stepd whose connection is dropped before it was admitted tries again
//! ([`super::uplink`]). So a stepd that has sent its HELLO is pushed out only if its address holds the most
//! and newer connections, none of them silent, come before its PROOF: where slurm.conf gives the addresses,
//! connections that send HELLOs (which take no secret) from its own node's address; where it does not (no
//! address then has nodes of its own), the same from as many addresses, or other stepds behind its address.
//! Silent connections, and where slurm.conf gives the addresses those from other nodes' addresses, can delay
//! real stepds but not keep them out. A connection has
//! [`HANDSHAKE_TIMEOUT`] to complete the handshake. Where slurm.conf gives the joiners' addresses,
//! connections from other addresses are refused. Each node that may join is admitted once; once every one is
//! in, the listener is closed: nobody else can connect at all. Refusals are counted and handed to the host
//! as debug lines ([`Admission::Debug`]), at most once per `REFUSAL_LOG_EVERY`: never on the job's stderr.

use super::auth::{self, Prover, Secret, Transcript};
use super::link::Watch;
use super::protocol::{Down, FrameBuf, Up, HELLO_LEN, PROOF_LEN_ON_WIRE};
use crate::collective::Allgather;
use std::cmp::Reverse;
use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a new connection may take to complete the handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Room for connections in the handshake beyond one per node that may join.
pub const HANDSHAKE_SPARE: usize = 64;
/// Refusals are logged at most this often (with how many there were).
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(10);
/// After an accept fails for want of resources (no fds left), the listener rests this long at first, doubling
/// up to a second, instead of failing again at once on every pass.
const ACCEPT_REST_FIRST: Duration = Duration::from_millis(10);
const ACCEPT_REST_MAX: Duration = Duration::from_secs(1);

/// The nodes that may join an acceptor, each once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Members {
    /// Every node of a range: srun's, every node of the step.
    Range(Range<u32>),
    /// These nodes, in ascending order: a stepd's higher peers (its children, and its peers in Bruck's rounds
    /// above it).
    Listed(Vec<u32>),
}

impl Members {
    fn len(&self) -> usize {
        match self {
            Members::Range(r) => r.len(),
            Members::Listed(l) => l.len(),
        }
    }

    /// Where `node` is among them, if it is.
    fn index(&self, node: u32) -> Option<usize> {
        match self {
            Members::Range(r) => r.contains(&node).then(|| (node - r.start) as usize),
            Members::Listed(l) => l.binary_search(&node).ok(),
        }
    }
}

/// Who may join, and what they must prove.
pub struct Gate {
    pub secret: Secret,
    /// Who admits, for the handshake's transcript: [`auth::ROOT`], or this stepd's node index.
    pub to: u32,
    /// The nodes that may join, each once: every node for srun, a stepd's higher peers for a stepd.
    pub members: Members,
    /// The addresses they connect from, where slurm.conf gives them all; `None` admits any address.
    pub addresses: Option<Vec<IpAddr>>,
    /// The tree's width a joiner must build the tree with; `None` takes any (srun, which learns it from the
    /// stepds).
    pub width: Option<u32>,
    /// How a joiner's exchanges must go; `None` takes any (srun, as the width).
    pub allgather: Option<Allgather>,
}

/// An admitted connection, handed over to the host.
pub struct Joined {
    pub node: u32,
    /// Where it listens for its own children (0: it has none).
    pub port: u16,
    /// The tree's width it builds the tree with.
    pub width: u32,
    /// How its exchanges go.
    pub allgather: Allgather,
    pub stream: TcpStream,
    /// What it sent after its proof.
    pub input: FrameBuf,
}

/// What the acceptor has for its host.
pub enum Admission {
    Joined(Joined),
    /// A line about refused connections, for whoever debugs (not the job's stderr).
    Debug(String),
}

/// How far a connection has come.
#[derive(Clone, Copy)]
enum Stage {
    /// Accepted; its HELLO has not come.
    Hello,
    /// CHALLENGE sent; its PROOF has not come. The port, width and allgather from its HELLO.
    Proof(Transcript, u16, u32, Allgather),
}

struct Joining {
    stream: TcpStream,
    peer: SocketAddr,
    /// The address it counts against when the table is full (see [`Acceptor::source`]).
    source: IpAddr,
    stage: Stage,
    since: Instant,
    input: FrameBuf,
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

/// The listener and the handshakes in progress; see the module's documentation.
pub struct Acceptor {
    gate: Gate,
    /// How many of the nodes that may join each address has, where slurm.conf gives them all; `None` admits
    /// any address.
    shares: Option<HashMap<IpAddr, usize>>,
    /// Closed once every member is admitted.
    listener: Option<TcpListener>,
    port: u16,
    /// The listener's token; connection `i` in the handshake has `base + 1 + i`.
    base: u64,
    watch: Option<Arc<dyn Watch>>,
    resting: Option<Rest>,
    pending: Vec<Option<Joining>>,
    in_handshake: usize,
    handshake_max: usize,
    admitted: Vec<bool>,
    /// Members not yet admitted.
    left: usize,
    refusals: Refusals,
    events: VecDeque<Admission>,
    buf: Vec<u8>,
}

impl Acceptor {
    /// Admits `gate`'s members on `listener`, under tokens from `base` (see [`Acceptor::owns`]).
    pub fn new(listener: TcpListener, mut gate: Gate, base: u64) -> io::Result<Acceptor> {
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        let members = gate.members.len();
        let shares = gate.addresses.take().map(|addresses| {
            let mut shares = HashMap::new();
            for a in addresses {
                *shares.entry(a).or_default() += 1;
            }
            shares
        });
        Ok(Acceptor {
            gate,
            shares,
            listener: Some(listener),
            port,
            base,
            watch: None,
            resting: None,
            pending: Vec::new(),
            in_handshake: 0,
            handshake_max: members + HANDSHAKE_SPARE,
            admitted: vec![false; members],
            left: members,
            refusals: Refusals { count: 0, last: String::new(), logged: None },
            events: VecDeque::new(),
            buf: vec![0; 4096],
        })
    }

    /// Adds the listener and the connections in the handshake to `watch`'s epoll set; connections join it as
    /// they come. Called again with another set, it moves to that one (the caller drops the earlier set).
    pub fn watch(&mut self, watch: Arc<dyn Watch>) -> io::Result<()> {
        let listening = self.resting.is_none_or(|r| r.until.is_none());
        if let Some(l) = self.listener.as_ref().filter(|_| listening) {
            watch.add(l.as_raw_fd(), libc::EPOLLIN as u32, self.base)?;
        }
        for (slot, p) in self.pending.iter().enumerate() {
            if let Some(p) = p {
                watch.add(p.stream.as_raw_fd(), libc::EPOLLIN as u32, self.base + 1 + slot as u64)?;
            }
        }
        self.watch = Some(watch);
        Ok(())
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Whether `token` is one of the acceptor's.
    pub fn owns(&self, token: u64) -> bool {
        token >= self.base && token - self.base <= self.handshake_max as u64
    }

    /// The next thing for the host.
    pub fn poll(&mut self) -> Option<Admission> {
        self.events.pop_front()
    }

    /// Its fd under `token` is ready.
    pub fn ready(&mut self, token: u64) {
        match (token - self.base).checked_sub(1) {
            None => self.accept(),
            Some(slot) => self.read(slot as usize),
        }
    }

    /// When [`Acceptor::tick`] has something to do: a handshake times out, or the listener's rest ends.
    pub fn deadline(&self) -> Option<Instant> {
        let handshakes = self.pending.iter().flatten().map(|p| p.since + HANDSHAKE_TIMEOUT);
        handshakes.chain(self.resting.and_then(|r| r.until)).min()
    }

    /// Drops connections whose handshake took too long, and puts a resting listener back.
    pub fn tick(&mut self) {
        let now = Instant::now();
        for slot in 0..self.pending.len() {
            let Some(p) = &self.pending[slot] else { continue };
            if now.duration_since(p.since) > HANDSHAKE_TIMEOUT {
                let peer = p.peer;
                self.refuse(peer, "no handshake in time");
                self.drop_pending(slot);
            }
        }
        self.wake_listener();
    }

    /// Stops admitting: the listener and the connections in the handshake are closed, and what is left to
    /// say about refusals is said.
    pub fn close(&mut self) {
        self.close_listener();
        for slot in 0..self.pending.len() {
            self.drop_pending(slot);
        }
        self.log_refusals(true);
    }

    fn close_listener(&mut self) {
        if let (Some(l), Some(w)) = (&self.listener, &self.watch) {
            let _ = w.remove(l.as_raw_fd());
        }
        self.listener = None;
        self.resting = None;
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
            // A dual-stack socket sees IPv4 peers as ::ffff:a.b.c.d: show them as users know them.
            if let SocketAddr::V6(v6) = peer {
                if let Some(v4) = v6.ip().to_ipv4_mapped() {
                    peer = SocketAddr::new(v4.into(), v6.port());
                }
            }
            if self.shares.as_ref().is_some_and(|s| !s.contains_key(&peer.ip())) {
                self.refuse(peer, "not the address of any node that may join here");
                continue;
            }
            if stream.set_nonblocking(true).is_err() {
                continue;
            }
            let _ = stream.set_nodelay(true);
            if self.in_handshake >= self.handshake_max {
                self.make_room();
            }
            let slot = match self.pending.iter().position(Option::is_none) {
                Some(s) => s,
                None => {
                    self.pending.push(None);
                    self.pending.len() - 1
                }
            };
            let token = self.base + 1 + slot as u64;
            if let Some(w) = &self.watch {
                if w.add(stream.as_raw_fd(), libc::EPOLLIN as u32, token).is_err() {
                    continue;
                }
            }
            self.in_handshake += 1;
            let since = Instant::now();
            let (source, input) = (self.source(peer.ip()), FrameBuf::default());
            self.pending[slot] = Some(Joining { stream, peer, source, stage: Stage::Hello, since, input });
            // A stepd sends HELLO as soon as it is connected: it is usually here already.
            self.read(slot);
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
        if let (Some(l), Some(w)) = (&self.listener, &self.watch) {
            let _ = w.remove(l.as_raw_fd());
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
        if let (Some(l), Some(w)) = (&self.listener, &self.watch) {
            let _ = w.add(l.as_raw_fd(), libc::EPOLLIN as u32, self.base);
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
            "refused {} connection{} to the collective port {}; the last {}",
            r.count,
            if r.count == 1 { "" } else { "s" },
            self.port,
            r.last
        );
        r.count = 0;
        r.logged = Some(Instant::now());
        self.events.push_back(Admission::Debug(line));
    }

    /// The address a connection from `ip` counts against: its own, but where any address may join, an IPv6
    /// address's /64, which one host may hold whole.
    fn source(&self, ip: IpAddr) -> IpAddr {
        match ip {
            IpAddr::V6(v6) if self.shares.is_none() => Ipv6Addr::from(u128::from(v6) & (u128::MAX << 64)).into(),
            _ => ip,
        }
    }

    /// Drops a connection in the handshake to make room for a new one: one of the address that holds the
    /// most connections beyond its nodes that may join, so that an address's stepds are pushed out only by
    /// connections from where they are; of those, one that has not sent its HELLO, so that silent connections
    /// queued behind a stepd cannot push it out before its PROOF comes; then the oldest, so that stale ones
    /// go first and a stepd that retries gets in.
    fn make_room(&mut self) {
        let mut held: HashMap<IpAddr, usize> = HashMap::new();
        for p in self.pending.iter().flatten() {
            *held.entry(p.source).or_default() += 1;
        }
        let share = |a: &IpAddr| self.shares.as_ref().and_then(|s| s.get(a)).copied().unwrap_or(0);
        let beyond = |a: &IpAddr| held[a] as i64 - share(a) as i64;
        let victim = self.pending.iter().enumerate().filter_map(|(slot, p)| {
            let p = p.as_ref()?;
            Some((Reverse(beyond(&p.source)), matches!(p.stage, Stage::Proof(..)), p.since, slot))
        });
        if let Some((.., slot)) = victim.min() {
            let peer = self.pending[slot].as_ref().map(|p| p.peer);
            self.refuse(peer, "the oldest of too many connections in the handshake from its address");
            self.drop_pending(slot);
        }
    }

    /// Takes connection `slot` out of the handshake (and out of the epoll set: the host may keep it).
    fn take_pending(&mut self, slot: usize) -> Option<Joining> {
        let p = self.pending.get_mut(slot).and_then(Option::take)?;
        if let Some(w) = &self.watch {
            let _ = w.remove(p.stream.as_raw_fd());
        }
        self.in_handshake -= 1;
        Some(p)
    }

    fn drop_pending(&mut self, slot: usize) {
        self.take_pending(slot);
    }

    /// Reads what connection `slot` has sent and takes every whole handshake frame.
    fn read(&mut self, slot: usize) {
        loop {
            let Some(p) = self.pending.get_mut(slot).and_then(Option::as_mut) else { return };
            match p.stream.read(&mut self.buf) {
                Ok(0) => return self.drop_pending(slot),
                Ok(n) => {
                    p.input.extend(&self.buf[..n]);
                    if !self.frames(slot) || n < self.buf.len() {
                        return;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return self.drop_pending(slot),
            }
        }
    }

    /// Takes the handshake frames in connection `slot`'s input; false once it is admitted or dropped.
    fn frames(&mut self, slot: usize) -> bool {
        loop {
            let Some(p) = self.pending.get_mut(slot).and_then(Option::as_mut) else { return false };
            let (stage, peer) = (p.stage, p.peer);
            let max = match stage {
                Stage::Hello => HELLO_LEN,
                Stage::Proof(..) => PROOF_LEN_ON_WIRE,
            };
            let message = match p.input.next(max) {
                Ok(None) => return true,
                Ok(Some(payload)) => Up::decode(payload).map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            let kept = match (stage, message) {
                (Stage::Hello, Ok(Up::Hello { node, nonce, port, width, allgather })) => {
                    self.hello(slot, node, nonce, port, width, allgather)
                }
                (Stage::Proof(t, port, width, allgather), Ok(Up::Proof { proof })) => {
                    self.proof(slot, t, port, width, allgather, proof);
                    return false;
                }
                (_, Err(e)) => Err(e),
                (_, Ok(_)) => Err("no handshake".into()),
            };
            if let Err(why) = kept {
                self.refuse(peer, &why);
                self.drop_pending(slot);
                return false;
            }
        }
    }

    fn member(&self, node: u32) -> Option<usize> {
        self.gate.members.index(node)
    }

    fn hello(
        &mut self,
        slot: usize,
        node: u32,
        joiner_nonce: auth::Nonce,
        port: u16,
        width: u32,
        allgather: Allgather,
    ) -> Result<(), String> {
        if self.member(node).is_none_or(|m| self.admitted[m]) {
            return Err(format!("node index {node} may not join here, or has joined already"));
        }
        if let Some(w) = self.gate.width.filter(|&w| w != width) {
            return Err(format!("node {node} builds the PMI tree with width {width}, this side with {w}"));
        }
        if let Some(a) = self.gate.allgather.filter(|&a| a != allgather) {
            let (theirs, ours) = (allgather.name(), a.name());
            return Err(format!("node {node} exchanges by allgather {theirs}, this side by {ours}"));
        }
        let acceptor_nonce =
            crate::slurm::random::nonce().map_err(|e| format!("no random bytes for a challenge: {e}"))?;
        let t = Transcript { node, to: self.gate.to, joiner_nonce, acceptor_nonce };
        let p = self.pending[slot].as_mut().ok_or("gone")?;
        p.stage = Stage::Proof(t, port, width, allgather);
        write_whole(&mut p.stream, &Down::Challenge { nonce: acceptor_nonce })
    }

    /// Admits connection `slot` if its proof is right, else drops it.
    fn proof(&mut self, slot: usize, t: Transcript, port: u16, width: u32, allgather: Allgather, proof: auth::Proof) {
        let Some(mut p) = self.take_pending(slot) else { return };
        let member = self.member(t.node).filter(|&m| !self.admitted[m]);
        let Some(m) = member.filter(|_| self.gate.secret.verify(Prover::Joiner, &t, &proof)) else {
            let why = match member {
                None => format!("node index {} has joined already", t.node),
                Some(_) => "wrong proof of the step's secret".into(),
            };
            return self.refuse(p.peer, &why);
        };
        self.admitted[m] = true;
        self.left -= 1;
        if self.left == 0 {
            // Every member is in: nobody else has anything to connect for (closed before the joiner hears it is
            // in, so that it cannot find the port still open).
            self.close_listener();
        }
        // A connection that cannot take the answer is broken: its host sees it close, as any admitted one's.
        let welcome = Down::Welcome { proof: self.gate.secret.prove(Prover::Acceptor, &t) };
        let _ = write_whole(&mut p.stream, &welcome);
        let joined = Joined { node: t.node, port, width, allgather, stream: p.stream, input: p.input };
        self.events.push_back(Admission::Joined(joined));
    }
}

/// Writes a handshake frame whole. It is a few dozen bytes on a connection that has sent nothing else, so
/// the socket always takes it at once: a short write is a broken connection.
fn write_whole(stream: &mut TcpStream, message: &Down) -> Result<(), String> {
    let frame = message.encode().map_err(|e| e.to_string())?;
    match stream.write(&frame) {
        Ok(n) if n == frame.len() => Ok(()),
        Ok(_) => Err("the connection took only part of a handshake frame".into()),
        Err(e) => Err(format!("cannot answer: {e}")),
    }
}

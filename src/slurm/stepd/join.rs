//! How a slurmstepd joins the PMI tree in prefork, before any task exists. Each pair of peers (a parent and
//! its child; with Bruck's allgather, two nodes that exchange rounds) has one connection, which the higher
//! node makes: a stepd listens for its higher peers (if it has any) on its own node's address as slurm.conf
//! gives it, joins srun with that port ([`super::super::uplink`]), and then joins each of its lower peers with
//! the same handshake, as srun says where each listens (PEER), at that peer's address as slurm.conf gives it
//! (only the port comes from srun, which is the user's). A lower peer that finished before this node reached
//! it is reported by srun (PEER_DONE), and the node goes on without it.
//!
//! While it joins its lower peers, a thread of its own admits its higher ones: a node waits only until its
//! lower peers have joined srun, not until they are through their own prefork, so the joins do not make a
//! chain through the step (with Bruck's allgather, node i joins node i − 1, which joins node i − 2, ...).
//! The acceptor and what it admitted meanwhile go to the progress loop, which admits the rest.

use crate::collective::{Allgather, Tree};
use crate::os::Epoll;
use crate::slurm::admit::{Acceptor, Admission, Gate, Joined, Members};
use crate::slurm::auth::{self, Secret};
use crate::slurm::protocol::{Down, Up};
use crate::slurm::sys::Slurm;
use crate::slurm::uplink::{self, Hello};
use std::io::Write;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a stepd keeps trying to join srun, or a lower peer, before the step fails.
const JOIN_PATIENCE: Duration = Duration::from_secs(30);
/// The epoll tokens of the acceptor (higher peers in the handshake) start here, above the progress loop's own.
pub const ACCEPTOR: u64 = 1 << 40;
/// The token of the admitting thread's stop signal.
const STOP: u64 = 1;

/// The slurm.conf address of `name`, for the tree's connections; `what` says which node it is, for the
/// error.
pub fn address_of(slurm: &Slurm, name: &str, what: &str) -> Result<IpAddr, String> {
    slurm.node_address(name).ok_or_else(|| {
        format!(
            "slurm.conf gives no address for {name} ({what} in the PMI tree); SLURM_RPMI_TREE_WIDTH at least the \
             step's node count in srun's environment makes the tree a star, without links between nodes"
        )
    })
}

/// Gives a node's address as slurm.conf does: its index, and what it is to this node (for the error).
pub type Address<'a> = &'a dyn Fn(u32, &str) -> Result<IpAddr, String>;

/// This node's connections in the tree, made in prefork.
pub struct TreeLinks {
    pub srun: TcpStream,
    /// Each lower peer and the connection to it (`None`: it finished before this node reached it).
    pub below: Vec<(u32, Option<TcpStream>)>,
    /// The higher peers admitted while this node joined its lower ones.
    pub above: Vec<Joined>,
    /// Admits the higher peers still to come, if there are any.
    pub acceptor: Option<Acceptor>,
    /// Lines about refused connections, for slurmd's log.
    pub debug: Vec<String>,
}

/// How node `node` takes part in the collective: its tree and allgather.
#[derive(Clone, Copy)]
pub struct Wiring {
    pub tree: Tree,
    pub allgather: Allgather,
    pub node: u32,
}

impl Wiring {
    /// Its peers below it (which it joins) or above it (which join it), in node order.
    fn peers(&self, below: bool) -> Vec<u32> {
        let node = self.node;
        self.allgather.peers(&self.tree, node).into_iter().filter(|&p| (p < node) == below).collect()
    }

    fn hello(&self, to: u32, port: u16) -> Hello {
        Hello { node: self.node, to, port, width: self.tree.width(), allgather: self.allgather }
    }
}

/// Listens for this node's higher peers (if it has any) on its own address, joins srun at `srun` with the
/// port, then each of its lower peers as srun says where it listens, admitting higher peers meanwhile.
pub fn join_tree(
    srun: &[SocketAddr],
    wiring: Wiring,
    secret: &Secret,
    names: &[String],
    address: Address,
) -> Result<TreeLinks, String> {
    let (mut s, acceptor) = join_srun(srun, wiring, secret, address)?;
    let port = acceptor.as_ref().map_or(0, Acceptor::port);
    let below = wiring.peers(true);
    let (joined, admitted) =
        admitting(acceptor, || join_below(&mut s, &below, names, wiring.hello(0, port), secret, address))?;
    let Admitted { acceptor, above, debug } = admitted;
    Ok(TreeLinks { srun: s, below: joined?, above, acceptor, debug })
}

/// Listens for this node's higher peers (if it has any) and joins srun with the port: the connection and the
/// acceptor.
fn join_srun(
    srun: &[SocketAddr],
    wiring: Wiring,
    secret: &Secret,
    address: Address,
) -> Result<(TcpStream, Option<Acceptor>), String> {
    let above = wiring.peers(false);
    let acceptor = match above.is_empty() {
        true => None,
        false => Some(peers_acceptor(wiring, above, secret, address)?),
    };
    let hello = wiring.hello(auth::ROOT, acceptor.as_ref().map_or(0, Acceptor::port));
    let s = uplink::join(srun, &hello, secret, JOIN_PATIENCE, "srun's collective root", uplink::sleep)
        .map_err(|e| e.to_string())?;
    Ok((s, acceptor))
}

/// Tells srun why this node refuses the step, so that srun's user reads it (a stepd's log is the site's): it
/// joins srun as for the step, says it as an error, and leaves. srun ends the step; no task starts here
/// either way.
pub fn refuse(srun: &[SocketAddr], wiring: Wiring, secret: &Secret, address: Address, why: &str) {
    let Ok((mut s, _acceptor)) = join_srun(srun, wiring, secret, address) else { return };
    if let Ok(frame) = (Up::Error { rank: u32::MAX, failed: false, message: why.to_string() }).encode() {
        let _ = s.write_all(&frame);
    }
}

/// What the admitting thread hands back: the acceptor (its listener and the connections still in the
/// handshake, for the progress loop to watch), who it admitted, and the lines about refusals.
struct Admitted {
    acceptor: Option<Acceptor>,
    above: Vec<Joined>,
    debug: Vec<String>,
}

/// Runs `work` while a thread admits the higher peers on `acceptor`; then hands back what `work` returned
/// and what the thread did.
fn admitting<T>(acceptor: Option<Acceptor>, work: impl FnOnce() -> T) -> Result<(T, Admitted), String> {
    let Some(mut acceptor) = acceptor else {
        return Ok((work(), Admitted { acceptor: None, above: Vec::new(), debug: Vec::new() }));
    };
    let epoll = Arc::new(Epoll::new().map_err(|e| format!("epoll: {e}"))?);
    let (stop_r, stop_w) = crate::os::pipe().map_err(|e| format!("pipe: {e}"))?;
    let stop_w = std::fs::File::from(stop_w);
    epoll.add(stop_r.as_raw_fd(), libc::EPOLLIN as u32, STOP).map_err(|e| format!("epoll: {e}"))?;
    acceptor.watch(epoll.clone()).map_err(|e| format!("cannot listen for the PMI tree: {e}"))?;
    std::thread::scope(|scope| {
        let admitter = std::thread::Builder::new().name("rpmi-admit".into()).spawn_scoped(scope, move || {
            let (mut joined, mut debug) = (Vec::new(), Vec::new());
            let mut events = [libc::epoll_event { events: 0, u64: 0 }; 64];
            'serve: loop {
                let wait = acceptor
                    .deadline()
                    .map_or(1000, |at| at.saturating_duration_since(Instant::now()).as_millis().min(1000) as i32);
                let n = match epoll.wait(&mut events, wait) {
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => 0,
                    // The progress loop admits the rest.
                    Err(_) => break 'serve,
                };
                for ev in &events[..n] {
                    match ev.u64 {
                        STOP => break 'serve,
                        token => acceptor.ready(token),
                    }
                }
                acceptor.tick();
                while let Some(a) = acceptor.poll() {
                    match a {
                        Admission::Joined(j) => joined.push(j),
                        Admission::Debug(line) => debug.push(line),
                    }
                }
            }
            (acceptor, joined, debug)
        });
        let admitter =
            admitter.map_err(|e| format!("cannot start the thread that admits the PMI tree's peers: {e}"))?;
        // The stop signal, a byte on the pipe, also if `work` panics: else the scope would wait for ever.
        struct Stop(std::fs::File);
        impl Drop for Stop {
            fn drop(&mut self) {
                let _ = self.0.write_all(&[1]);
            }
        }
        let stop = Stop(stop_w);
        let result = work();
        drop(stop);
        let (acceptor, above, debug) = admitter.join().map_err(|_| "the admitting thread panicked".to_string())?;
        Ok((result, Admitted { acceptor: Some(acceptor), above, debug }))
    })
}

/// What this node knows of one lower peer while it joins them.
enum Lower {
    /// srun has said nothing of it yet.
    Unknown,
    /// It listens on this port (PEER).
    Listens(u16),
    /// It finished before this node joined it (PEER_DONE), or it is joined: nothing more to do.
    Done(Option<TcpStream>),
}

/// This node's lower peers and what srun says of them while it joins them: where each listens (PEER) at most
/// once, and that one finished (PEER_DONE); anything else from srun is refused. srun is the user's: what it
/// sends costs this node no memory beyond one entry a peer, and no attempt it would not make anyway.
struct LowerPeers<'a> {
    srun: &'a mut TcpStream,
    peers: Vec<(u32, Lower)>,
    /// When this node stops waiting for srun and its lower peers, all of them together.
    deadline: Instant,
}

impl LowerPeers<'_> {
    fn of(&mut self, node: u32) -> Option<&mut Lower> {
        self.peers.iter_mut().find(|(p, _)| *p == node).map(|(_, l)| l)
    }

    /// Waits up to `wait` for srun's next notice, and takes it.
    fn hear(&mut self, wait: Duration) -> Result<(), String> {
        let Some(notice) = uplink::notice(self.srun, wait)? else { return Ok(()) };
        match notice {
            Down::Peer { node, port } => match self.of(node) {
                Some(l @ Lower::Unknown) => *l = Lower::Listens(port),
                _ => {
                    return Err(format!("srun sent where node {node} listens, which is no peer this node still joins"))
                }
            },
            Down::PeerDone { node } => match self.of(node) {
                Some(l @ (Lower::Unknown | Lower::Listens(_))) => *l = Lower::Done(None),
                // srun tells every higher peer, joined or not, when a node finishes.
                Some(Lower::Done(_)) => {}
                None => return Err(format!("srun said node {node} finished, which is no peer of this node")),
            },
            other => {
                return Err(format!("srun sent {} before it said where this node's lower peers listen", other.name()))
            }
        }
        Ok(())
    }
}

/// Joins each of `below`, this node's lower peers, as srun says where it listens; `None` for one that srun says
/// finished first.
fn join_below(
    srun: &mut TcpStream,
    below: &[u32],
    names: &[String],
    hello: Hello,
    secret: &Secret,
    address: Address,
) -> Result<Vec<(u32, Option<TcpStream>)>, String> {
    let peers = below.iter().map(|&p| (p, Lower::Unknown)).collect();
    let mut lower = LowerPeers { srun, peers, deadline: Instant::now() + JOIN_PATIENCE };
    loop {
        let listening = lower.peers.iter().find_map(|(p, l)| match l {
            Lower::Listens(port) => Some((*p, *port)),
            _ => None,
        });
        if let Some((p, port)) = listening {
            let joined = join_peer(&mut lower, names, Hello { to: p, ..hello }, port, secret, address)?;
            if let Some(l) = lower.of(p) {
                *l = Lower::Done(joined);
            }
            continue;
        }
        let Some(&(waited, _)) = lower.peers.iter().find(|(_, l)| matches!(l, Lower::Unknown)) else { break };
        let left = lower.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let waited = &names[waited as usize];
            return Err(format!(
                "srun did not say within {JOIN_PATIENCE:?} where {waited} (a lower peer of this node in the PMI \
                 tree) listens"
            ));
        }
        lower.hear(left)?;
    }
    let joined = lower.peers.into_iter().map(|(p, l)| match l {
        Lower::Done(s) => (p, s),
        Lower::Unknown | Lower::Listens(_) => (p, None),
    });
    Ok(joined.collect())
}

/// Joins lower peer `hello.to` on `port`, within what is left of the joins' time; `None` if srun says
/// meanwhile that it finished. Between attempts it takes what srun says of the other lower peers.
fn join_peer(
    lower: &mut LowerPeers,
    names: &[String],
    hello: Hello,
    port: u16,
    secret: &Secret,
    address: Address,
) -> Result<Option<TcpStream>, String> {
    let p = hello.to;
    let peer = &names[p as usize];
    let addr = SocketAddr::new(address(p, "a lower peer of this node")?, port);
    let whom = format!("{peer} (a lower peer of this node in the PMI tree)");
    let patience = lower.deadline.saturating_duration_since(Instant::now());
    let mut done = false;
    // Each pause is waited out whole, whatever srun sends meanwhile.
    let joined = uplink::join(&[addr], &hello, secret, patience, &whom, |wait| {
        let until = Instant::now() + wait;
        loop {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(());
            }
            lower.hear(left)?;
            if matches!(lower.of(p), Some(Lower::Done(None))) {
                done = true;
                return Err(format!("{peer} finished"));
            }
        }
    });
    match joined {
        Ok(s) => Ok(Some(s)),
        Err(_) if done => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

/// The listener for this node's higher peers, on its own address as slurm.conf gives it, and the acceptor
/// that admits them (from their addresses, where slurm.conf gives them all).
fn peers_acceptor(wiring: Wiring, above: Vec<u32>, secret: &Secret, address: Address) -> Result<Acceptor, String> {
    let own = address(wiring.node, "a node with peers above it")?;
    let listener = TcpListener::bind((own, 0)).map_err(|e| format!("cannot listen on {own} for the PMI tree: {e}"))?;
    let addresses = above.iter().map(|&c| address(c, "a higher peer").ok()).collect();
    let gate = Gate {
        secret: secret.clone(),
        to: wiring.node,
        members: Members::Listed(above),
        addresses,
        width: Some(wiring.tree.width()),
        allgather: Some(wiring.allgather),
    };
    Acceptor::new(listener, gate, ACCEPTOR).map_err(|e| format!("cannot listen for the PMI tree: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::os::Epoll;
    use crate::slurm::admit::Admission;
    use std::net::Ipv4Addr;
    use std::ops::Range;
    use std::sync::Arc;

    fn names(nodes: u32) -> Vec<String> {
        (1..=nodes).map(|n| format!("n{n}")).collect()
    }

    /// Every node on this machine, as a local cluster's slurm.conf has them.
    fn loopback(_: u32, _: &str) -> Result<IpAddr, String> {
        Ok(Ipv4Addr::LOCALHOST.into())
    }

    /// An acceptor for node `me`'s children, served on a thread of its own; what it admits comes back.
    fn parent(me: u32, children: Range<u32>, width: u32, secret: &Secret) -> (u16, std::sync::mpsc::Receiver<u32>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let gate = Gate {
            secret: secret.clone(),
            to: me,
            members: Members::Listed(children.clone().collect()),
            addresses: None,
            width: Some(width),
            allgather: Some(Allgather::Tree),
        };
        let mut acceptor = Acceptor::new(listener, gate, 1).unwrap();
        let port = acceptor.port();
        let (tx, rx) = std::sync::mpsc::channel();
        let expected = children.len();
        std::thread::spawn(move || {
            let epoll = Arc::new(Epoll::new().unwrap());
            acceptor.watch(epoll.clone()).unwrap();
            let mut kept = Vec::new();
            let mut events = [libc::epoll_event { events: 0, u64: 0 }; 16];
            while kept.len() < expected {
                let n = epoll.wait(&mut events, 100).unwrap();
                for ev in &events[..n] {
                    acceptor.ready(ev.u64);
                }
                while let Some(e) = acceptor.poll() {
                    if let Admission::Joined(j) = e {
                        let _ = tx.send(j.node);
                        kept.push(j.stream);
                    }
                }
            }
            // Every child is in.
            let _ = tx.send(u32::MAX);
            std::thread::sleep(Duration::from_secs(1));
        });
        (port, rx)
    }

    fn join_parent_at(port: u16, hello: Hello, secret: &Secret, patience: Duration) -> Result<TcpStream, String> {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        uplink::join(&[addr], &hello, secret, patience, "the parent", uplink::sleep).map_err(|e| e.to_string())
    }

    #[test]
    fn a_parent_admits_its_own_children_once_each_and_no_one_else() {
        let secret = crate::slurm::random::secret().unwrap();
        // Width 3: node 0's children are 3, 4 and 5.
        let (port, admitted) = parent(0, 3..6, 3, &secret);
        let hello = |node| Hello { node, to: 0, port: 0, width: 3, allgather: Allgather::Tree };
        let short = Duration::from_millis(300);
        let _c3 = join_parent_at(port, hello(3), &secret, short).unwrap();
        assert_eq!(admitted.recv().unwrap(), 3);
        // Node 3 again, a node that is not a child, a tree of another width, a proof made for srun, a
        // wrong secret: none is admitted.
        assert!(join_parent_at(port, hello(3), &secret, short).is_err());
        assert!(join_parent_at(port, hello(2), &secret, short).is_err());
        assert!(join_parent_at(port, Hello { width: 2, ..hello(4) }, &secret, short).is_err());
        assert!(join_parent_at(port, Hello { allgather: Allgather::Bruck, ..hello(4) }, &secret, short).is_err());
        assert!(join_parent_at(port, Hello { to: auth::ROOT, ..hello(4) }, &secret, short).is_err());
        assert!(join_parent_at(port, hello(4), &crate::slurm::random::secret().unwrap(), short).is_err());
        let _c4 = join_parent_at(port, hello(4), &secret, short).unwrap();
        let _c5 = join_parent_at(port, hello(5), &secret, short).unwrap();
        assert_eq!((admitted.recv().unwrap(), admitted.recv().unwrap()), (4, 5));
        assert_eq!(admitted.recv().unwrap(), u32::MAX);
        assert!(TcpStream::connect(("127.0.0.1", port)).is_err(), "the listener is still open");
    }

    /// A connection to 127.0.0.1:`port` from `source`, any address of 127/8 (Linux answers all of them on
    /// loopback): a neighbour with addresses of its own.
    fn connect_from(source: Ipv4Addr, port: u16) -> TcpStream {
        use std::os::fd::FromRawFd;
        let sockaddr = |ip: Ipv4Addr, port: u16| libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: port.to_be(),
            sin_addr: libc::in_addr { s_addr: u32::from(ip).to_be() },
            sin_zero: [0; 8],
        };
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        // SAFETY: a new socket, owned by the stream at once; each address is a sockaddr_in of `len` bytes.
        unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            assert!(fd >= 0, "{}", std::io::Error::last_os_error());
            let stream = TcpStream::from_raw_fd(fd);
            let from = sockaddr(source, 0);
            assert_eq!(libc::bind(fd, (&from as *const libc::sockaddr_in).cast(), len), 0);
            let to = sockaddr(Ipv4Addr::LOCALHOST, port);
            assert_eq!(libc::connect(fd, (&to as *const libc::sockaddr_in).cast(), len), 0);
            stream
        }
    }

    /// Node 0 admits its children, one for each of `addresses` (one if slurm.conf gives none), in a loop
    /// like its stepd's, while node 1 joins from 127.0.0.1 and a neighbour, whenever a connection waits to be
    /// accepted (node 1's: nobody else connects), queues more connections (`open` makes the i-th) behind it
    /// than the handshake table has room for, and closes them once the acceptor has taken them: whether node
    /// 1 is admitted.
    fn admitted_with_a_neighbour(addresses: Option<Vec<IpAddr>>, open: impl Fn(u32, u16) -> TcpStream) -> bool {
        let secret = crate::slurm::random::secret().unwrap();
        let members = 1..1 + addresses.as_ref().map_or(1, |a| a.len() as u32);
        let queued = members.len() + crate::slurm::admit::HANDSHAKE_SPARE;
        let members = members.into_iter();
        let members = Members::Listed(members.collect());
        let gate = Gate { secret: secret.clone(), to: 0, members, addresses, width: Some(1), allgather: None };
        let mut acceptor = Acceptor::new(TcpListener::bind("127.0.0.1:0").unwrap(), gate, 1).unwrap();
        let port = acceptor.port();
        let epoll = Arc::new(Epoll::new().unwrap());
        acceptor.watch(epoll.clone()).unwrap();
        let hello = Hello { node: 1, to: 0, port: 0, width: 1, allgather: Allgather::Tree };
        let child = std::thread::spawn(move || join_parent_at(port, hello, &secret, Duration::from_secs(3)));
        let mut admitted = false;
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 256];
        while !child.is_finished() {
            let n = epoll.wait(&mut events, 50).unwrap();
            let (listener, connections): (Vec<u64>, Vec<u64>) =
                events[..n].iter().map(|e| e.u64).partition(|&t| t == 1);
            // The neighbour's closes first: the child finds the table empty when it tries again.
            for token in connections {
                acceptor.ready(token);
            }
            if !listener.is_empty() {
                let neighbour: Vec<TcpStream> = (0..queued as u32).map(|i| open(i, port)).collect();
                acceptor.ready(1);
                drop(neighbour);
            }
            while let Some(a) = acceptor.poll() {
                admitted |= matches!(a, Admission::Joined(j) if j.node == 1);
            }
        }
        admitted && child.join().unwrap().is_ok()
    }

    #[test]
    fn idle_connections_queued_behind_a_child_from_its_own_address_do_not_keep_it_out() {
        let neighbour = |_, port| TcpStream::connect(("127.0.0.1", port)).unwrap();
        assert!(admitted_with_a_neighbour(Some(vec![Ipv4Addr::LOCALHOST.into()]), neighbour), "slurm.conf's addresses");
        assert!(admitted_with_a_neighbour(None, neighbour), "any address");
    }

    #[test]
    fn connections_queued_behind_a_child_from_other_addresses_do_not_keep_it_out() {
        let other = Ipv4Addr::new(127, 0, 0, 2);
        // Where slurm.conf gives the addresses, a neighbour on the other child's node, saying HELLO as it.
        let as_node = |node: u32| {
            move |_, port| {
                let mut s = connect_from(other, port);
                let hello =
                    Up::Hello { node, nonce: [0; auth::NONCE_LEN], port: 0, width: 1, allgather: Allgather::Tree };
                s.write_all(&hello.encode().unwrap()).unwrap();
                s
            }
        };
        let both = vec![Ipv4Addr::LOCALHOST.into(), other.into()];
        assert!(admitted_with_a_neighbour(Some(both), as_node(2)), "from another node's address");
        // Where any address may join: a host saying HELLO as node 1, then silent ones from an address each.
        assert!(admitted_with_a_neighbour(None, as_node(1)), "from another host");
        let each = |i: u32, port| connect_from(Ipv4Addr::new(127, 0, 1, i as u8), port);
        assert!(admitted_with_a_neighbour(None, each), "from an address each");
    }

    /// Node 2 of a chain over 3 nodes... here, node 2 with lower peers 0 and 1 (Bruck's allgather over 3
    /// nodes), joining them as a fake srun says where each listens, in any order.
    fn join_below_of(srun: TcpStream, below: Vec<u32>, secret: &Secret) -> std::thread::JoinHandle<JoinedBelow> {
        let secret = secret.clone();
        let mut srun = srun;
        std::thread::spawn(move || {
            let hello = Hello { node: 2, to: 0, port: 0, width: 1, allgather: Allgather::Tree };
            join_below(&mut srun, &below, &names(3), hello, &secret, &loopback)
        })
    }

    type JoinedBelow = Result<Vec<(u32, Option<TcpStream>)>, String>;

    #[test]
    fn a_node_joins_each_lower_peer_as_srun_says_where_it_listens() {
        let secret = crate::slurm::random::secret().unwrap();
        let (port0, admitted0) = parent(0, 2..3, 1, &secret);
        let (port1, admitted1) = parent(1, 2..3, 1, &secret);
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let fake_srun = || {
            let srun = TcpStream::connect(l.local_addr().unwrap()).unwrap();
            (srun, l.accept().unwrap().0)
        };
        let (srun, mut fake) = fake_srun();
        let node = join_below_of(srun, vec![0, 1], &secret);
        std::thread::sleep(Duration::from_millis(100));
        // Node 1's port first, then node 0's.
        fake.write_all(&Down::Peer { node: 1, port: port1 }.encode().unwrap()).unwrap();
        fake.write_all(&Down::Peer { node: 0, port: port0 }.encode().unwrap()).unwrap();
        let joined = node.join().unwrap().unwrap();
        assert_eq!(joined.iter().map(|(p, s)| (*p, s.is_some())).collect::<Vec<_>>(), [(0, true), (1, true)]);
        assert_eq!((admitted0.recv().unwrap(), admitted1.recv().unwrap()), (2, 2));

        // Told that a peer finished, the node stops trying to reach it (here: nobody listens).
        let nobody = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let (srun, mut fake) = fake_srun();
        let node = join_below_of(srun, vec![1], &secret);
        fake.write_all(&Down::Peer { node: 1, port: nobody }.encode().unwrap()).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let started = Instant::now();
        fake.write_all(&Down::PeerDone { node: 1 }.encode().unwrap()).unwrap();
        assert!(matches!(node.join().unwrap().as_deref(), Ok([(1, None)])));
        assert!(started.elapsed() < Duration::from_secs(5));

        // srun ending the step first, naming a node that is no lower peer, or sending anything else while the
        // node joins a peer (here: one nobody answers for), is an error: what srun sends is not kept.
        let answer = Down::Answer { task: 0, ok: true, text: "x".repeat(4000) };
        for (first, said, error) in [
            (None, Down::End, "srun sent END before it said where this node's lower peers listen"),
            (None, Down::Peer { node: 5, port: 1 }, "srun sent where node 5 listens, which is no peer"),
            (Some(nobody), answer, "srun sent ANSWER before it said where this node's lower peers listen"),
            (Some(nobody), Down::Peer { node: 1, port: 2 }, "srun sent where node 1 listens, which is no peer"),
        ] {
            let (srun, mut fake) = fake_srun();
            let node = join_below_of(srun, vec![1], &secret);
            if let Some(port) = first {
                fake.write_all(&Down::Peer { node: 1, port }.encode().unwrap()).unwrap();
                std::thread::sleep(Duration::from_millis(100));
            }
            fake.write_all(&said.encode().unwrap()).unwrap();
            let err = node.join().unwrap().unwrap_err();
            assert!(err.contains(error), "{err}");
        }
    }

    /// A panic while the node joins its lower peers stops the admitting thread too: prefork returns (the
    /// plugin's entry points turn the panic into an error) rather than wait for ever.
    #[test]
    fn a_panic_while_joining_does_not_hold_the_prefork() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let gate = Gate {
            secret: crate::slurm::random::secret().unwrap(),
            to: 1,
            members: Members::Listed(vec![2]),
            addresses: None,
            width: Some(1),
            allgather: Some(Allgather::Bruck),
        };
        let acceptor = Acceptor::new(listener, gate, ACCEPTOR).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let _ = admitting(Some(acceptor), || panic!("a test's panic"));
            }));
            let _ = tx.send(panicked.is_err());
        });
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(true));
    }

    /// While a node joins its lower peers, a thread admits its higher ones: a higher peer waits for no more
    /// than the node's listening (the joins make no chain through the step).
    #[test]
    fn higher_peers_are_admitted_while_the_node_joins_its_lower_ones() {
        let secret = crate::slurm::random::secret().unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let gate = Gate {
            secret: secret.clone(),
            to: 1,
            members: Members::Listed(vec![2, 3]),
            addresses: None,
            width: Some(1),
            allgather: Some(Allgather::Bruck),
        };
        let acceptor = Acceptor::new(listener, gate, ACCEPTOR).unwrap();
        let port = acceptor.port();
        let hello = |node| Hello { node, to: 1, port: 0, width: 1, allgather: Allgather::Bruck };
        let (work, Admitted { acceptor, above: joined, .. }) = admitting(Some(acceptor), || {
            // Node 2 joins meanwhile; this node's own joins would take as long.
            join_parent_at(port, hello(2), &secret, Duration::from_secs(5)).is_ok()
        })
        .unwrap();
        assert!(work);
        assert_eq!(joined.iter().map(|j| j.node).collect::<Vec<_>>(), [2]);
        // The rest is admitted by whoever watches the acceptor next.
        let mut acceptor = acceptor.unwrap();
        let epoll = Arc::new(Epoll::new().unwrap());
        acceptor.watch(epoll.clone()).unwrap();
        let late = std::thread::spawn(move || join_parent_at(port, hello(3), &secret, Duration::from_secs(5)));
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 8];
        let mut admitted = None;
        while admitted.is_none() {
            let n = epoll.wait(&mut events, 5000).unwrap();
            assert!(n > 0, "node 3 was not admitted");
            for ev in &events[..n] {
                acceptor.ready(ev.u64);
            }
            while let Some(a) = acceptor.poll() {
                if let Admission::Joined(j) = a {
                    admitted = Some(j.node);
                }
            }
        }
        assert_eq!(admitted, Some(3));
        assert!(late.join().unwrap().is_ok());
    }
}

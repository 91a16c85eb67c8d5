//! How a slurmstepd joins the PMI tree in prefork, before any task exists: it listens for its children (if
//! it has any) on its own node's address as slurm.conf gives it, joins srun with that port
//! ([`super::super::uplink`]), and, if its parent is another stepd, waits for srun to say where that parent
//! listens (PARENT) and joins it with the same handshake, at the parent's address as slurm.conf gives it (only
//! the port comes from srun, which is the user's). If the parent finished before this node reached it, srun
//! says so (PARENT_DONE) and the node goes on without it.

use crate::collective::{Peer, Tree};
use crate::slurm::admit::{Acceptor, Gate};
use crate::slurm::auth::{self, Secret};
use crate::slurm::protocol::{Down, Up};
use crate::slurm::sys::Slurm;
use crate::slurm::uplink::{self, Hello};
use std::io::Write;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::time::{Duration, Instant};

/// How long a stepd keeps trying to join srun, or its parent, before the step fails.
const JOIN_PATIENCE: Duration = Duration::from_secs(30);
/// The epoll tokens of the acceptor (children in the handshake) start here, above the progress loop's own.
pub const ACCEPTOR: u64 = 1 << 40;

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
    /// The parent, if it is a stepd, and the connection to it (`None`: it finished before this node reached
    /// it).
    pub parent: Option<(u32, Option<TcpStream>)>,
    /// Admits the children, if there are any.
    pub acceptor: Option<Acceptor>,
}

/// Listens for this node's children in the tree (if it has any) on its own address, joins srun at `srun`
/// with the port, then its parent (if that is a stepd) once srun says where it listens.
pub fn join_tree(
    srun: &[SocketAddr],
    tree: Tree,
    node: u32,
    secret: &Secret,
    names: &[String],
    address: Address,
) -> Result<TreeLinks, String> {
    let (mut s, acceptor, hello) = join_srun(srun, tree, node, secret, address)?;
    let parent = match tree.parent(node) {
        Peer::Root => None,
        Peer::Node(p) => Some((p, join_parent(&mut s, names, Hello { to: p, ..hello }, secret, address)?)),
    };
    Ok(TreeLinks { srun: s, parent, acceptor })
}

/// Listens for this node's children in the tree (if it has any) and joins srun with the port: the
/// connection, the acceptor and the HELLO it sent.
fn join_srun(
    srun: &[SocketAddr],
    tree: Tree,
    node: u32,
    secret: &Secret,
    address: Address,
) -> Result<(TcpStream, Option<Acceptor>, Hello), String> {
    let children = tree.children(Peer::Node(node));
    let acceptor = match children.is_empty() {
        true => None,
        false => Some(children_acceptor(node, children, secret, tree.width(), address)?),
    };
    let hello = Hello { node, to: auth::ROOT, port: acceptor.as_ref().map_or(0, Acceptor::port), width: tree.width() };
    let s = uplink::join(srun, &hello, secret, JOIN_PATIENCE, "srun's collective root", uplink::sleep)
        .map_err(|e| e.to_string())?;
    Ok((s, acceptor, hello))
}

/// Tells srun why this node refuses the step, so that srun's user reads it (a stepd's log is the site's): it
/// joins srun as for the step, says it as an error, and leaves. srun ends the step; no task starts here
/// either way.
pub fn refuse(srun: &[SocketAddr], tree: Tree, node: u32, secret: &Secret, address: Address, why: &str) {
    let Ok((mut s, _acceptor, _)) = join_srun(srun, tree, node, secret, address) else { return };
    if let Ok(frame) = (Up::Error { rank: u32::MAX, failed: false, message: why.to_string() }).encode() {
        let _ = s.write_all(&frame);
    }
}

/// Joins this node's parent (`hello.to`) once srun says where it listens; `None` if srun says it finished
/// first.
fn join_parent(
    srun: &mut TcpStream,
    names: &[String],
    hello: Hello,
    secret: &Secret,
    address: Address,
) -> Result<Option<TcpStream>, String> {
    let p = hello.to;
    let parent = &names[p as usize];
    let deadline = Instant::now() + JOIN_PATIENCE;
    let port = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!(
                "srun did not say within {JOIN_PATIENCE:?} where {parent} (this node's parent in the PMI tree) listens"
            ));
        }
        match uplink::notice(srun, left)? {
            None => {}
            Some(Down::Parent { port }) => break port,
            Some(Down::ParentDone) => return Ok(None),
            Some(other) => {
                return Err(format!("srun sent {} before it said where this node's parent listens", other.name()))
            }
        }
    };
    let addr = SocketAddr::new(address(p, "this node's parent")?, port);
    let whom = format!("{parent} (this node's parent in the PMI tree)");
    let mut done = false;
    let joined =
        uplink::join(&[addr], &hello, secret, JOIN_PATIENCE, &whom, |wait| match uplink::notice(srun, wait)? {
            None => Ok(()),
            Some(Down::ParentDone) => {
                done = true;
                Err(format!("{parent} finished"))
            }
            Some(other) => Err(format!("srun sent {} while this node joined its parent", other.name())),
        });
    match joined {
        Ok(s) => Ok(Some(s)),
        Err(_) if done => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

/// The listener for this node's children in the tree, on its own address as slurm.conf gives it, and the
/// acceptor that admits them (from their addresses, where slurm.conf gives them all).
fn children_acceptor(
    node: u32,
    children: Range<u32>,
    secret: &Secret,
    width: u32,
    address: Address,
) -> Result<Acceptor, String> {
    let own = address(node, "a node with children")?;
    let listener = TcpListener::bind((own, 0)).map_err(|e| format!("cannot listen on {own} for the PMI tree: {e}"))?;
    let addresses = children.clone().map(|c| address(c, "a child").ok()).collect();
    let gate = Gate { secret: secret.clone(), to: node, members: children, addresses, width: Some(width) };
    Acceptor::new(listener, gate, ACCEPTOR).map_err(|e| format!("cannot listen for the PMI tree: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::os::Epoll;
    use crate::slurm::admit::Admission;
    use std::net::Ipv4Addr;
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
        let gate =
            Gate { secret: secret.clone(), to: me, members: children.clone(), addresses: None, width: Some(width) };
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
        let hello = |node| Hello { node, to: 0, port: 0, width: 3 };
        let short = Duration::from_millis(300);
        let _c3 = join_parent_at(port, hello(3), &secret, short).unwrap();
        assert_eq!(admitted.recv().unwrap(), 3);
        // Node 3 again, a node that is not a child, a tree of another width, a proof made for srun, a
        // wrong secret: none is admitted.
        assert!(join_parent_at(port, hello(3), &secret, short).is_err());
        assert!(join_parent_at(port, hello(2), &secret, short).is_err());
        assert!(join_parent_at(port, Hello { width: 2, ..hello(4) }, &secret, short).is_err());
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
        let gate = Gate { secret: secret.clone(), to: 0, members, addresses, width: Some(1) };
        let mut acceptor = Acceptor::new(TcpListener::bind("127.0.0.1:0").unwrap(), gate, 1).unwrap();
        let port = acceptor.port();
        let epoll = Arc::new(Epoll::new().unwrap());
        acceptor.watch(epoll.clone()).unwrap();
        let hello = Hello { node: 1, to: 0, port: 0, width: 1 };
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
                s.write_all(&Up::Hello { node, nonce: [0; auth::NONCE_LEN], port: 0, width: 1 }.encode().unwrap())
                    .unwrap();
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

    #[test]
    fn a_child_waits_for_srun_to_say_where_its_parent_listens() {
        let secret = crate::slurm::random::secret().unwrap();
        let (port, admitted) = parent(0, 1..2, 1, &secret);
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut srun = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut fake, _) = l.accept().unwrap();
        let child = std::thread::spawn(move || {
            let hello = Hello { node: 1, to: 0, port: 0, width: 1 };
            join_parent(&mut srun, &names(2), hello, &secret, &loopback)
        });
        std::thread::sleep(Duration::from_millis(100));
        fake.write_all(&Down::Parent { port }.encode().unwrap()).unwrap();
        assert!(child.join().unwrap().unwrap().is_some());
        assert_eq!(admitted.recv().unwrap(), 1);

        // Told that the parent finished, the child stops trying to reach it (here: nobody listens).
        let nobody = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut srun = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut fake, _) = l.accept().unwrap();
        let secret = crate::slurm::random::secret().unwrap();
        let child = std::thread::spawn(move || {
            let hello = Hello { node: 1, to: 0, port: 0, width: 1 };
            join_parent(&mut srun, &names(2), hello, &secret, &loopback)
        });
        fake.write_all(&Down::Parent { port: nobody }.encode().unwrap()).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let started = Instant::now();
        fake.write_all(&Down::ParentDone.encode().unwrap()).unwrap();
        assert!(matches!(child.join().unwrap(), Ok(None)));
        assert!(started.elapsed() < Duration::from_secs(5));

        // srun ending the step first is an error.
        let mut srun = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut fake, _) = l.accept().unwrap();
        fake.write_all(&Down::End.encode().unwrap()).unwrap();
        let hello = Hello { node: 1, to: 0, port: 0, width: 1 };
        let err =
            join_parent(&mut srun, &names(2), hello, &crate::slurm::random::secret().unwrap(), &loopback).unwrap_err();
        assert!(err.contains("srun sent END before it said where this node's parent listens"), "{err}");
    }
}

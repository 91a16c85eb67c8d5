//! Fuzz target `collective`: one of the collective's machines (`rpmi_core::collective`, srun's root or a node
//! stepd) driven by arbitrary events, as peers on the network would drive it: frames from any peer (raw
//! bytes, or well-formed CONTRIB/ALL/FAIL/LOST/BYE/END frames with chosen epochs and nodes), lost
//! connections, and the host's own calls (a contribution, finish, a report, the root's fail and end).
//!
//! Input format: byte 0 is the node count less one (1 to 64 nodes), byte 1 the tree's width (0 means the
//! star), byte 2 picks the machine (0xFF: the root, else a node, modulo the count), byte 3 bit 0 small
//! bounds (64 bytes a part, 256 an exchange) instead of 1 MiB and 4 MiB. Then events: an op byte, its
//! arguments, until the input ends (a missing byte reads as 0).
//!
//! Checks: no panic; a machine reports at most one job error; it sends only to its tree neighbours (and a
//! node to the root); every completed exchange holds one part per node, in node order, each within the
//! part bound, and completes only after the node contributed to it.

#![no_main]

use libfuzzer_sys::fuzz_target;
use rpmi_core::collective::{frame, Allgather, Bound, Bounds, Bytes, Node, Output, Peer, Root, Tree};
use std::sync::Arc;

struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> u8 {
        let (first, rest) = self.0.split_first().map_or((0, &[][..]), |(f, r)| (*f, r));
        self.0 = rest;
        first
    }

    fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.byte(), self.byte(), self.byte(), self.byte()])
    }

    /// A length byte, then that many bytes.
    fn counted(&mut self) -> Vec<u8> {
        let n = usize::from(self.byte());
        self.bytes(n)
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        let n = n.min(self.0.len());
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        head.to_vec()
    }

    fn done(&self) -> bool {
        self.0.is_empty()
    }
}

enum Machine {
    Root(Root),
    Node(Node, u32),
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input(data);
    let nodes = u32::from(input.byte() % 64) + 1;
    let width = match input.byte() {
        0 => nodes,
        w => u32::from(w),
    };
    let which = input.byte();
    let small = input.byte() & 1 == 1;
    let (part, exchange) = if small { (64, 256) } else { (1 << 20, 4 << 20) };
    let bounds = Bounds {
        part_max: Bound { bytes: part, option: "PART" },
        exchange_max: Bound { bytes: exchange, option: "EXCHANGE" },
    };
    let tree = Tree::new(nodes, width).expect("a valid tree");
    // The tree with its top at the root, at node 0, or at node 0 with Bruck's allgather.
    let shape = input.byte() % 3;
    let tree = if shape > 0 { tree.top_at_first_node() } else { tree };
    let allgather = if shape == 2 { Allgather::Bruck } else { Allgather::Tree };
    let mut machine = if which == 0xFF {
        Machine::Root(Root::new(tree, bounds))
    } else {
        let me = u32::from(which) % nodes;
        let node = Node::new(tree, me, bounds, frame::parts_len(nodes as usize, exchange)).unwrap();
        Machine::Node(node.with_allgather(allgather), me)
    };
    let mut job_errors = 0;
    let mut contributed: Option<u32> = None;
    while !input.done() {
        let op = input.byte();
        let peer = match input.byte() {
            0xFF => Peer::Root,
            n => Peer::Node(u32::from(n) % nodes),
        };
        let frame: Option<Bytes> = match op % 12 {
            0 => Some(Arc::new(input.counted())),
            1 => {
                let (epoch, count) = (input.u32() % 3, usize::from(input.byte() % 4));
                let parts: Vec<(u32, Vec<u8>)> = (0..count)
                    .map(|_| {
                        let n = u32::from(input.byte()) % nodes;
                        (n, input.counted())
                    })
                    .collect();
                frame::contrib(epoch, parts.iter().map(|(n, b)| (*n, b.as_slice()))).ok()
            }
            2 => {
                let epoch = input.u32() % 3;
                let size = usize::from(input.byte() % 8);
                let parts: Vec<(u32, Vec<u8>)> = (0..nodes).map(|n| (n, vec![n as u8; size])).collect();
                frame::all(epoch, parts.iter().map(|(n, b)| (*n, b.as_slice()))).ok()
            }
            3 => Some(frame::fail(input.u32() % 3, "failed")),
            4 => Some(frame::lost(u32::from(input.byte()) % (nodes + 1))),
            5 => Some(frame::bye()),
            6 => Some(frame::end()),
            // A round: from the peer, of a few parts numbered on from it (or not).
            10 if input.byte() & 1 == 1 => {
                let (epoch, round, count) = (input.u32() % 3, input.byte() % 8, u32::from(input.byte() % 5));
                let from = match peer {
                    Peer::Node(n) => n,
                    Peer::Root => 0,
                };
                let skew = u32::from(input.byte() % 2);
                let parts: Vec<(u32, Vec<u8>)> =
                    (0..count).map(|t| ((from + t + skew) % nodes, input.counted())).collect();
                frame::round(epoch, round, parts.iter().map(|(n, b)| (*n, b.as_slice()))).ok()
            }
            _ => None,
        };
        match (&mut machine, frame) {
            (Machine::Root(root), Some(f)) => {
                if let Peer::Node(n) = peer {
                    root.receive(n, f);
                }
            }
            (Machine::Node(node, _), Some(f)) => node.receive(peer, f),
            (Machine::Root(root), None) => match op % 12 {
                7 | 8 => {
                    if let Peer::Node(n) = peer {
                        root.lost(n);
                    }
                }
                9 => root.fail("the host failed the job"),
                _ => root.end(),
            },
            (Machine::Node(node, _), None) => match op % 12 {
                7 => node.lost(peer),
                8 => {
                    let epoch = node.epoch();
                    if node.contribute(input.counted()).is_ok() {
                        contributed = Some(epoch);
                    }
                }
                9 => node.finish(),
                _ => {
                    let _ = node.report(&input.counted());
                }
            },
        }
        loop {
            let output = match &mut machine {
                Machine::Root(root) => root.poll(),
                Machine::Node(node, _) => node.poll(),
            };
            let Some(output) = output else { break };
            match output {
                Output::Send { to, .. } => match &machine {
                    Machine::Root(_) => {
                        assert!(matches!(to, Peer::Node(c) if tree.is_child(Peer::Root, c)), "root sent to {to:?}")
                    }
                    Machine::Node(node, me) => {
                        let neighbour = to == Peer::Root || matches!(to, Peer::Node(p) if node.peers().contains(&p));
                        assert!(neighbour, "node {me} sent to {to:?}");
                    }
                },
                Output::Done { epoch, parts } => {
                    assert_eq!(contributed.take(), Some(epoch), "an exchange completed that the node did not join");
                    assert_eq!(parts.len(), nodes as usize);
                    for (i, (n, bytes)) in parts.iter().enumerate() {
                        assert_eq!(n as usize, i);
                        assert!(bytes.len() <= part);
                    }
                }
                Output::Failed { epoch, .. } => {
                    assert_eq!(contributed.take(), Some(epoch), "an exchange failed that the node did not join");
                }
                Output::JobError { .. } => {
                    job_errors += 1;
                    assert_eq!(job_errors, 1, "a second job error");
                }
                Output::Report { .. } => assert!(matches!(machine, Machine::Root(_))),
            }
        }
    }
});

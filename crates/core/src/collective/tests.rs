//! The machines one frame at a time: what each does with a well-behaved exchange, and how each refuses
//! what a peer may not send. The tree of most tests is 7 nodes of width 2:
//!
//! ```text
//!            root
//!          /      \
//!         0        1
//!        / \      / \
//!       2   3    4   5
//!       |
//!       6
//! ```

use super::frame::{self, Bytes, Frame, CONTROL_MAX, REPORT_MAX};
use super::sim::XorShift;
use super::*;
use std::sync::Arc;

const PART_MAX: usize = 100;
const EXCHANGE_MAX: usize = 400;
const ALL_MAX: usize = 2000;

fn bounds() -> Bounds {
    Bounds {
        part_max: Bound { bytes: PART_MAX, option: "TEST_PART_MAX" },
        exchange_max: Bound { bytes: EXCHANGE_MAX, option: "TEST_EXCHANGE_MAX" },
    }
}

fn tree() -> Tree {
    Tree::new(7, 2).unwrap()
}

fn node(me: u32) -> Node {
    Node::new(tree(), me, bounds(), ALL_MAX).unwrap()
}

fn root() -> Root {
    Root::new(tree(), bounds())
}

/// Everything a machine hands back, frames decoded.
#[derive(Debug, Default)]
struct Out {
    sent: Vec<(Peer, Frame)>,
    raw: Vec<(Peer, Bytes)>,
    done: Vec<(u32, Parts)>,
    failed: Vec<(u32, String)>,
    errors: Vec<(Option<u32>, String)>,
    reports: Vec<(u32, Vec<u8>)>,
}

impl Out {
    fn error(&self) -> &(Option<u32>, String) {
        assert_eq!(self.errors.len(), 1, "{self:?}");
        &self.errors[0]
    }

    fn kinds_to(&self, to: Peer) -> Vec<String> {
        self.sent.iter().filter(|(p, _)| *p == to).map(|(_, f)| f.to_string()).collect()
    }
}

fn drain(mut poll: impl FnMut() -> Option<Output>) -> Out {
    let mut out = Out::default();
    while let Some(o) = poll() {
        match o {
            Output::Send { to, frame } => {
                out.sent.push((to, Frame::decode(&frame, usize::MAX).unwrap()));
                out.raw.push((to, frame));
            }
            Output::Done { epoch, parts } => out.done.push((epoch, parts)),
            Output::Failed { epoch, message } => out.failed.push((epoch, message)),
            Output::JobError { node, message } => out.errors.push((node, message)),
            Output::Report { from, bytes } => out.reports.push((from, bytes)),
        }
    }
    out
}

fn out(n: &mut Node) -> Out {
    drain(|| n.poll())
}

fn root_out(r: &mut Root) -> Out {
    drain(|| r.poll())
}

fn p(node: u32) -> Vec<u8> {
    format!("part of {node}").into_bytes()
}

/// A CONTRIB of `nodes`' parts (each `p(node)`).
fn contrib(epoch: u32, nodes: &[u32]) -> Bytes {
    let parts: Vec<(u32, Vec<u8>)> = nodes.iter().map(|&n| (n, p(n))).collect();
    frame::contrib(epoch, parts.iter().map(|(n, b)| (*n, b.as_slice()))).unwrap()
}

/// An ALL of every node's part.
fn all(epoch: u32) -> Bytes {
    let parts: Vec<(u32, Vec<u8>)> = (0..7).map(|n| (n, p(n))).collect();
    frame::all(epoch, parts.iter().map(|(n, b)| (*n, b.as_slice()))).unwrap()
}

fn parts(f: &Frame) -> Vec<(u32, Vec<u8>)> {
    match f {
        Frame::Contrib { parts, .. } | Frame::All { parts, .. } => parts.iter().map(|(n, b)| (n, b.to_vec())).collect(),
        _ => panic!("no parts in {f}"),
    }
}

fn want(nodes: &[u32]) -> Vec<(u32, Vec<u8>)> {
    nodes.iter().map(|&n| (n, p(n))).collect()
}

/// Node 0 with its own part in and its CONTRIB sent up: it waits for the root's ALL.
fn node0_waiting() -> Node {
    let mut n = node(0);
    n.contribute(p(0)).unwrap();
    n.receive(Peer::Node(2), contrib(0, &[2, 6]));
    n.receive(Peer::Node(3), contrib(0, &[3]));
    assert_eq!(out(&mut n).kinds_to(Peer::Root), ["parts of PMI exchange 0"]);
    n
}

/// Asserts that `o` is the failure of a node waiting in exchange `epoch` with children `children`:
/// one job error naming `at_fault`, a FAIL to every child, the shell's exchange failed. Returns the message.
fn assert_failed(o: &Out, at_fault: Option<u32>, epoch: u32, children: &[u32]) -> String {
    let (node, message) = o.error().clone();
    assert_eq!(node, at_fault, "{message}");
    for &c in children {
        assert_eq!(o.kinds_to(Peer::Node(c)), [format!("a failure of PMI exchange {epoch}")], "{o:?}");
    }
    assert_eq!(o.failed, [(epoch, message.clone())]);
    message
}

#[test]
fn a_leaf_sends_its_part_up_and_completes_with_the_result() {
    let mut n = node(3);
    n.contribute(p(3)).unwrap();
    let o = out(&mut n);
    assert_eq!(o.sent.len(), 1);
    assert_eq!(o.sent[0].0, Peer::Node(0));
    assert_eq!(parts(&o.sent[0].1), want(&[3]));
    n.receive(Peer::Node(0), all(0));
    let o = out(&mut n);
    assert!(o.sent.is_empty());
    let (epoch, parts) = &o.done[0];
    assert_eq!(*epoch, 0);
    assert_eq!(parts.iter().map(|(n, b)| (n, b.to_vec())).collect::<Vec<_>>(), want(&[0, 1, 2, 3, 4, 5, 6]));
    assert_eq!(n.epoch(), 1);
}

#[test]
fn an_interior_node_sends_its_subtree_up_in_node_order_once_all_is_in() {
    let mut n = node(0);
    // Its children may come before its own part.
    n.receive(Peer::Node(3), contrib(0, &[3]));
    n.receive(Peer::Node(2), contrib(0, &[2, 6]));
    assert!(out(&mut n).sent.is_empty());
    n.contribute(p(0)).unwrap();
    let o = out(&mut n);
    assert_eq!(o.sent.len(), 1);
    assert_eq!(o.sent[0].0, Peer::Root);
    assert!(matches!(o.sent[0].1, Frame::Contrib { epoch: 0, .. }));
    assert_eq!(parts(&o.sent[0].1), want(&[0, 2, 3, 6]));
    assert_eq!(n.held(), 0, "the gathered parts are freed once sent");
}

#[test]
fn an_interior_node_passes_the_same_all_on_before_it_is_done() {
    let mut n = node0_waiting();
    let result = all(0);
    n.receive(Peer::Root, result.clone());
    assert_eq!(n.held(), result.len(), "the frame passed on twice and done is held once");
    let o = out(&mut n);
    assert_eq!(o.raw.iter().map(|(to, _)| *to).collect::<Vec<_>>(), [Peer::Node(2), Peer::Node(3)]);
    assert!(o.raw.iter().all(|(_, f)| Arc::ptr_eq(f, &result)), "passed on unchanged, not copied");
    assert_eq!(o.done.len(), 1);
    assert!(Arc::ptr_eq(o.done[0].1.frame(), &result));
    assert_eq!(n.held(), 0);
    // The next exchange goes the same way.
    n.contribute(p(0)).unwrap();
    n.receive(Peer::Node(2), contrib(1, &[2, 6]));
    n.receive(Peer::Node(3), contrib(1, &[3]));
    assert_eq!(out(&mut n).kinds_to(Peer::Root), ["parts of PMI exchange 1"]);
}

#[test]
fn the_root_sends_one_all_to_its_children_once_every_part_is_in() {
    let mut r = root();
    r.receive(1, contrib(0, &[1, 4, 5]));
    assert!(root_out(&mut r).sent.is_empty());
    r.receive(0, contrib(0, &[0, 2, 3, 6]));
    let o = root_out(&mut r);
    assert_eq!(o.raw.iter().map(|(to, _)| *to).collect::<Vec<_>>(), [Peer::Node(0), Peer::Node(1)]);
    assert!(Arc::ptr_eq(&o.raw[0].1, &o.raw[1].1), "one frame for every child");
    assert!(matches!(o.sent[0].1, Frame::All { epoch: 0, .. }));
    assert_eq!(parts(&o.sent[0].1), want(&[0, 1, 2, 3, 4, 5, 6]));
    assert_eq!(r.epoch(), 1);
    assert!(r.peak_held() >= 2 * o.raw[0].1.len() - 64, "the parts and the ALL, while it is built");
}

#[test]
fn a_second_contribution_before_the_result_is_the_hosts_mistake() {
    let mut n = node(3);
    n.contribute(p(3)).unwrap();
    assert_eq!(n.contribute(p(3)), Err(ContributeError::Outstanding { epoch: 0 }));
    n.finish();
    n.receive(Peer::Node(0), all(0));
    assert_eq!(n.contribute(p(3)), Err(ContributeError::Finished));
}

#[test]
fn a_child_that_sends_twice_is_refused() {
    let mut n = node(0);
    n.receive(Peer::Node(3), contrib(0, &[3]));
    n.receive(Peer::Node(3), contrib(0, &[3]));
    let o = out(&mut n);
    let (node, message) = o.error();
    assert_eq!(*node, Some(3));
    assert!(message.contains("node 3 sent its parts of PMI exchange 0 twice"), "{message}");
    // Nobody waits at node 0 itself, but its children hear that the exchange failed.
    assert_eq!(o.kinds_to(Peer::Node(2)), ["a failure of PMI exchange 0"]);
    // After the node's CONTRIB went up, a third one is as much a duplicate.
    let mut n = node0_waiting();
    n.receive(Peer::Node(3), contrib(0, &[3]));
    assert!(assert_failed(&out(&mut n), Some(3), 0, &[2, 3]).contains("twice"));
    let mut r = root();
    r.receive(1, contrib(0, &[1, 4, 5]));
    r.receive(1, contrib(0, &[1, 4, 5]));
    assert_eq!(root_out(&mut r).error().0, Some(1));
}

#[test]
fn parts_of_another_exchange_are_refused() {
    for epoch in [1, u32::MAX] {
        let mut n = node(0);
        n.contribute(p(0)).unwrap();
        n.receive(Peer::Node(3), contrib(epoch, &[3]));
        let message = assert_failed(&out(&mut n), Some(3), 0, &[2, 3]);
        assert!(message.contains(&format!("node 3 sent parts of PMI exchange {epoch} during exchange 0")));
    }
    let mut r = root();
    r.receive(0, contrib(0, &[0, 2, 3, 6]));
    r.receive(1, contrib(0, &[1, 4, 5]));
    root_out(&mut r);
    // Late: exchange 0 is over.
    r.receive(1, contrib(0, &[1, 4, 5]));
    let o = root_out(&mut r);
    assert_eq!(o.error().0, Some(1));
    assert_eq!(o.kinds_to(Peer::Node(0)), ["a failure of PMI exchange 1"]);
}

#[test]
fn parts_outside_the_senders_subtree_or_out_of_order_are_refused() {
    for (nodes, says) in [
        (&[2, 5][..], "a part for node 5, which is not in its subtree"),
        (&[2, 6, 3][..], "a part for node 3, which is not in its subtree"),
        (&[6, 2][..], "the part of node 6 twice or out of order"),
        (&[2, 2, 6][..], "the part of node 2 twice or out of order"),
        (&[2][..], "1 parts of PMI exchange 0 for the 2 nodes of its subtree"),
        (&[][..], "0 parts of PMI exchange 0 for the 2 nodes of its subtree"),
    ] {
        let mut n = node(0);
        n.contribute(p(0)).unwrap();
        n.receive(Peer::Node(2), contrib(0, nodes));
        let message = assert_failed(&out(&mut n), Some(2), 0, &[2, 3]);
        assert!(message.contains(says), "{nodes:?}: {message}");
    }
    let mut r = root();
    r.receive(1, contrib(0, &[1, 4, 5, 6]));
    let (node, message) = root_out(&mut r).error().clone();
    assert_eq!(node, Some(1));
    assert!(message.contains("node 6, which is not in its subtree"), "{message}");
}

#[test]
fn frames_from_peers_that_may_not_send_them_are_refused() {
    let cases: Vec<(Peer, Bytes, &str)> = vec![
        (Peer::Root, contrib(0, &[0]), "the root sent parts of PMI exchange 0 to node 0, which is not its parent"),
        (Peer::Node(4), contrib(0, &[4]), "node 4 sent parts of PMI exchange 0 to node 0, which is not its parent"),
        (Peer::Node(2), all(0), "node 2 sent the result of PMI exchange 0 to node 0, whose parent is the root"),
        (Peer::Node(2), frame::fail(0, "x"), "node 2 sent a failure of PMI exchange 0 to node 0, whose parent"),
        (Peer::Node(3), frame::end(), "node 3 sent the end of the job to node 0, whose parent is the root"),
        (Peer::Node(3), frame::lost(6), "node 3 sent a report that node 6 was lost to node 0, which only the root"),
        (Peer::Root, frame::report(b"r").unwrap(), "the root sent a report to node 0, which only the root takes"),
        (Peer::Node(5), frame::bye(), "node 5 sent a goodbye to node 0, whose parent is the root"),
        (Peer::Root, frame::bye(), "the root sent a goodbye to node 0, which the root never sends"),
    ];
    for (from, f, says) in cases {
        let mut n = node(0);
        n.contribute(p(0)).unwrap();
        n.receive(from, f);
        let at_fault = match from {
            Peer::Root => None,
            Peer::Node(x) => Some(x),
        };
        let message = assert_failed(&out(&mut n), at_fault, 0, &[2, 3]);
        assert!(message.contains(says), "{message}");
    }
    // A node whose parent is a node takes nothing from the root.
    let mut n = node(2);
    n.receive(Peer::Root, all(0));
    assert_eq!(
        out(&mut n).error(),
        &(None, "the root sent the result of PMI exchange 0 to node 2, whose parent is node 0".into())
    );
    for (from, f, says) in [
        (2, contrib(0, &[2, 6]), "node 2 sent parts of PMI exchange 0 to the root, but its parent is node 0"),
        (0, all(0), "node 0 sent the result of PMI exchange 0 to the root, which only the root sends"),
        (1, frame::fail(0, "x"), "node 1 sent a failure of PMI exchange 0 to the root"),
        (1, frame::end(), "node 1 sent the end of the job to the root"),
        (3, frame::lost(4), "node 3 reported node 4 lost, which is not its child"),
        (0, frame::lost(0), "node 0 reported node 0 lost, which is not its child"),
        (2, vec![0x42].into(), "node 2 sent the root a malformed frame (unknown kind 66)"),
    ] {
        let mut r = root();
        r.receive(from, f);
        let o = root_out(&mut r);
        assert_eq!(o.error(), &(Some(from), o.error().1.clone()));
        assert!(o.error().1.contains(says), "{}", o.error().1);
        assert_eq!(o.kinds_to(Peer::Node(0)), ["a failure of PMI exchange 0"]);
    }
    let mut r = root();
    r.receive(7, frame::bye());
    assert_eq!(root_out(&mut r).error().0, None);
}

#[test]
fn a_result_nobody_waits_for_or_not_one_part_per_node_in_order_is_refused() {
    let mut n = node(3);
    n.receive(Peer::Node(0), all(0));
    let (node, message) = out(&mut n).error().clone();
    assert_eq!(node, Some(0));
    assert_eq!(message, "node 0 sent the result of PMI exchange 0, which nobody at node 3 waits for");

    let wrong = |nodes: &[u32]| {
        let parts: Vec<(u32, Vec<u8>)> = nodes.iter().map(|&n| (n, p(n))).collect();
        frame::all(0, parts.iter().map(|(n, b)| (*n, b.as_slice()))).unwrap()
    };
    for (f, says) in [
        (all(1), "while node 0 waits for exchange 0"),
        (wrong(&[0, 1, 2, 3, 4, 5]), "6 parts for 7 nodes"),
        (wrong(&[0, 1, 2, 3, 4, 5, 6, 7]), "8 parts for 7 nodes"),
        (wrong(&[0, 1, 2, 4, 3, 5, 6]), "its part 3 for node 4"),
        (wrong(&[0, 1, 1, 3, 4, 5, 6]), "its part 2 for node 1"),
    ] {
        let mut n = node0_waiting();
        n.receive(Peer::Root, f);
        let message = assert_failed(&out(&mut n), None, 0, &[2, 3]);
        assert!(message.contains(says), "{message}");
    }
    // A result over what the node takes.
    let mut n = Node::new(tree(), 3, bounds(), 50).unwrap();
    n.contribute(p(3)).unwrap();
    n.receive(Peer::Node(0), all(0));
    let message = assert_failed(&out(&mut n), Some(0), 0, &[]);
    assert!(message.contains(&format!("{} bytes, more than the 50 node 3 takes", all(0).len())), "{message}");
}

#[test]
fn a_failure_of_another_exchange_is_refused_and_of_this_one_passed_on() {
    let mut n = node0_waiting();
    n.receive(Peer::Root, frame::fail(3, "x"));
    let message = assert_failed(&out(&mut n), None, 0, &[2, 3]);
    assert!(message.contains("the root sent a failure of PMI exchange 3 to node 0, during PMI exchange 0"));

    let mut n = node0_waiting();
    let fail = frame::fail(0, "node 4 was lost");
    n.receive(Peer::Root, fail.clone());
    let o = out(&mut n);
    assert!(o.errors.is_empty(), "the root reported the error");
    assert!(o.raw.iter().all(|(_, f)| Arc::ptr_eq(f, &fail)), "passed on unchanged");
    assert_eq!(o.raw.len(), 2);
    assert_eq!(o.failed, [(0, "node 4 was lost".to_string())]);
    // Failed for good: the next exchange fails at once, and nothing is taken any more.
    n.receive(Peer::Root, all(0));
    assert!(out(&mut n).sent.is_empty());
    n.contribute(p(0)).unwrap();
    assert_eq!(out(&mut n).failed, [(0, "node 4 was lost".to_string())]);
}

#[test]
fn a_part_over_its_bound_names_the_node_and_both_numbers() {
    let mut n = node(0);
    n.contribute(vec![b'x'; PART_MAX + 1]).unwrap();
    let message = assert_failed(&out(&mut n), Some(0), 0, &[2, 3]);
    assert_eq!(
        message,
        "node 0 brought 101 bytes to PMI exchange 0, over the limit of 100 bytes per node (TEST_PART_MAX)"
    );
    let mut n = node(0);
    n.contribute(p(0)).unwrap();
    let big = frame::contrib(0, [(2, &[0u8; 10][..]), (6, &[0u8; PART_MAX + 5][..])].into_iter()).unwrap();
    n.receive(Peer::Node(2), big.clone());
    let message = assert_failed(&out(&mut n), Some(2), 0, &[2, 3]);
    assert_eq!(
        message,
        "node 2 sent node 0 a part of 105 bytes for node 6, over the limit of 100 bytes per node (TEST_PART_MAX)"
    );
    let mut r = Root::new(Tree::new(7, 7).unwrap(), bounds());
    r.receive(6, frame::contrib(0, std::iter::once((6, &[0u8; 200][..]))).unwrap());
    let (node, message) = root_out(&mut r).error().clone();
    assert_eq!(node, Some(6));
    assert!(message.contains("a part of 200 bytes for node 6, over the limit of 100 bytes"), "{message}");
}

#[test]
fn an_exchange_over_its_bound_names_the_node_and_both_numbers() {
    let bounds = Bounds { exchange_max: Bound { bytes: 250, option: "TEST_EXCHANGE_MAX" }, ..bounds() };
    let node0 = || Node::new(tree(), 0, bounds, ALL_MAX).unwrap();
    let bytes = |nodes: &[u32], len: usize| {
        let part = vec![b'x'; len];
        frame::contrib(0, nodes.iter().map(|&n| (n, part.as_slice()))).unwrap()
    };
    let mut n = node0();
    n.receive(Peer::Node(2), bytes(&[2, 6], 100));
    n.contribute(vec![b'x'; 40]).unwrap();
    n.receive(Peer::Node(3), bytes(&[3], 10));
    assert!(out(&mut n).errors.is_empty(), "250 bytes are allowed");
    let mut n = node0();
    n.receive(Peer::Node(2), bytes(&[2, 6], 100));
    n.contribute(vec![b'x'; 45]).unwrap();
    n.receive(Peer::Node(3), bytes(&[3], 10));
    let message = assert_failed(&out(&mut n), Some(3), 0, &[2, 3]);
    assert_eq!(
        message,
        "PMI exchange 0 would gather more than 250 bytes (TEST_EXCHANGE_MAX): node 3 brought 10 bytes for its \
         subtree, 255 in all so far"
    );
    let mut n = node0();
    n.receive(Peer::Node(2), bytes(&[2, 6], 100));
    n.receive(Peer::Node(3), bytes(&[3], 10));
    n.contribute(vec![b'x'; 41]).unwrap();
    let message = assert_failed(&out(&mut n), Some(0), 0, &[2, 3]);
    assert!(message.ends_with("node 0 brought 41 bytes of its own, 251 in all so far"), "{message}");
    // The root checks what all its children bring together.
    let mut r = root();
    r.receive(0, bytes(&[0, 2, 3, 6], 100));
    r.receive(1, bytes(&[1, 4, 5], 100));
    let (node, message) = root_out(&mut r).error().clone();
    assert_eq!(node, Some(1));
    assert!(message.contains("more than 400 bytes (TEST_EXCHANGE_MAX): node 1 brought 300 bytes"), "{message}");
    assert!(message.ends_with("700 in all so far"), "{message}");
}

#[test]
fn frames_over_what_a_peer_may_send_are_refused_before_decoding() {
    let n = node(0);
    assert_eq!(n.frame_max(Peer::Root), ALL_MAX.max(CONTROL_MAX));
    // Node 3's subtree is itself: one part, at most PART_MAX bytes (less than a control frame).
    assert_eq!(n.frame_max(Peer::Node(3)), CONTROL_MAX);
    // Node 2's subtree is 2 nodes: 2 parts of at most part_max, at most exchange_max in all.
    for (part_max, exchange_max, bytes) in [(1 << 20, 3 << 20, 2 << 20), (1 << 20, 1 << 20, 1 << 20)] {
        let b = Bounds {
            part_max: Bound { bytes: part_max, option: "" },
            exchange_max: Bound { bytes: exchange_max, option: "" },
        };
        let n = Node::new(tree(), 0, b, ALL_MAX).unwrap();
        assert_eq!(n.frame_max(Peer::Node(2)), frame::parts_len(2, bytes));
        // Node 0's is 4.
        assert_eq!(Root::new(tree(), b).frame_max(0), frame::parts_len(4, (4 * part_max).min(exchange_max)));
    }
    let mut n = node(0);
    n.receive(Peer::Node(3), vec![0; CONTROL_MAX + 1].into());
    let (node, message) = out(&mut n).error().clone();
    assert_eq!(node, Some(3));
    assert!(message.contains("node 3 sent a frame of 16386 bytes to node 0, which takes at most 16385"));
    let mut r = root();
    r.receive(4, vec![0; CONTROL_MAX + 1].into());
    assert_eq!(root_out(&mut r).error().0, Some(4));
}

#[test]
fn a_lost_child_is_reported_to_the_root_which_fails_the_job() {
    let mut n = node(0);
    n.contribute(p(0)).unwrap();
    n.lost(Peer::Node(3));
    let o = out(&mut n);
    assert!(o.errors.is_empty() && o.failed.is_empty(), "{o:?}");
    assert_eq!(o.sent.len(), 1);
    assert_eq!(o.sent[0], (Peer::Root, Frame::Lost { node: 3 }));

    let mut r = root();
    r.receive(1, contrib(0, &[1, 4, 5]));
    r.receive(0, frame::lost(3));
    let o = root_out(&mut r);
    let (node, message) = o.error();
    assert_eq!(*node, Some(3));
    assert!(message.starts_with("node 3 was lost: its connection to node 0 closed before it said it was done"));
    assert_eq!(o.kinds_to(Peer::Node(0)), ["a failure of PMI exchange 0"]);
    assert_eq!(o.kinds_to(Peer::Node(1)), ["a failure of PMI exchange 0"]);
    // What follows from the ending is not news.
    r.lost(5);
    r.receive(2, frame::lost(6));
    assert!(root_out(&mut r).errors.is_empty());

    let mut r = root();
    r.lost(4);
    assert_eq!(root_out(&mut r).error(), &(Some(4), "lost the connection to node 4: it was killed or failed".into()));
}

#[test]
fn a_lost_peer_after_its_goodbye_or_the_end_is_normal() {
    let mut n = node(0);
    n.receive(Peer::Node(3), frame::bye());
    n.lost(Peer::Node(3));
    assert!(out(&mut n).sent.is_empty());

    let mut r = root();
    r.receive(4, frame::bye());
    r.lost(4);
    r.receive(1, frame::lost(4));
    assert!(root_out(&mut r).errors.is_empty());

    let mut n = node(2);
    n.contribute(p(2)).unwrap();
    out(&mut n);
    let end = frame::end();
    n.receive(Peer::Node(0), end.clone());
    let o = out(&mut n);
    assert!(o.errors.is_empty());
    assert!(o.raw.len() == 1 && o.raw[0].0 == Peer::Node(6) && Arc::ptr_eq(&o.raw[0].1, &end), "passed on");
    assert_eq!(o.failed, [(0, "the root ended the job".to_string())]);
    n.lost(Peer::Node(0));
    n.lost(Peer::Root);
    assert!(out(&mut n).errors.is_empty());

    let mut r = root();
    r.end();
    assert_eq!(root_out(&mut r).kinds_to(Peer::Node(1)), ["the end of the job"]);
    r.lost(0);
    assert!(root_out(&mut r).errors.is_empty());
}

#[test]
fn a_node_that_loses_its_parent_or_the_root_fails_by_itself() {
    let mut n = node0_waiting();
    n.lost(Peer::Root);
    let message = assert_failed(&out(&mut n), None, 0, &[2, 3]);
    assert_eq!(message, "node 0 lost its connection to the root during PMI exchange 0");

    let mut n = node(2);
    n.receive(Peer::Node(6), contrib(0, &[6]));
    n.lost(Peer::Node(0));
    let o = out(&mut n);
    assert_eq!(o.error(), &(Some(0), "node 2 lost its connection to node 0 during PMI exchange 0".into()));
    assert_eq!(o.kinds_to(Peer::Node(6)), ["a failure of PMI exchange 0"]);
    assert!(o.failed.is_empty(), "its shell does not wait");

    // Between exchanges too: the job cannot go on without them.
    let mut n = node(2);
    n.lost(Peer::Root);
    assert_eq!(out(&mut n).error(), &(None, "node 2 lost its connection to the root".into()));
}

#[test]
fn a_parent_gone_after_its_goodbye_fails_only_an_exchange_that_needs_it() {
    let mut n = node(2);
    n.receive(Peer::Node(0), frame::bye());
    n.lost(Peer::Node(0));
    assert!(out(&mut n).errors.is_empty());
    n.contribute(p(2)).unwrap();
    let message = assert_failed(&out(&mut n), Some(0), 0, &[6]);
    assert_eq!(message, "PMI exchange 0 cannot complete: node 0 has closed its connection to node 2");
    // A node that said it is done has nothing to lose.
    let mut n = node(0);
    n.finish();
    out(&mut n);
    n.lost(Peer::Root);
    assert!(out(&mut n).errors.is_empty());
}

#[test]
fn an_exchange_that_a_finished_node_cannot_join_fails() {
    // A child that is done, and a part of someone else's in.
    let mut n = node(0);
    n.receive(Peer::Node(3), frame::bye());
    assert!(out(&mut n).errors.is_empty(), "nobody waits yet");
    n.contribute(p(0)).unwrap();
    let message = assert_failed(&out(&mut n), Some(3), 0, &[2, 3]);
    assert_eq!(
        message,
        "ranks wait in PMI exchange 0 that node 3 cannot join: every rank on it has closed its PMI connection"
    );
    // The node itself done, its child's parts in.
    let mut n = node(0);
    n.finish();
    let o = out(&mut n);
    assert_eq!(o.kinds_to(Peer::Root), ["a goodbye"]);
    assert_eq!(o.kinds_to(Peer::Node(2)), ["a goodbye"]);
    n.receive(Peer::Node(2), contrib(0, &[2, 6]));
    assert_eq!(out(&mut n).error().0, Some(0));
    // At the root.
    let mut r = root();
    r.receive(0, contrib(0, &[0, 2, 3, 6]));
    r.receive(1, frame::bye());
    assert_eq!(root_out(&mut r).error().0, Some(1));
    // A child done after its parts are in holds nobody up; it is absent from the next exchange.
    let mut n = node(0);
    n.receive(Peer::Node(3), contrib(0, &[3]));
    n.receive(Peer::Node(3), frame::bye());
    n.receive(Peer::Node(2), contrib(0, &[2, 6]));
    n.contribute(p(0)).unwrap();
    let o = out(&mut n);
    assert!(o.errors.is_empty());
    assert_eq!(o.kinds_to(Peer::Root), ["parts of PMI exchange 0"]);
}

#[test]
fn reports_go_straight_to_the_root_even_once_the_job_ends() {
    let mut n = node(6);
    n.report(b"rank 12 called PMI_Abort").unwrap();
    let o = out(&mut n);
    assert_eq!(o.sent, [(Peer::Root, Frame::Report(b"rank 12 called PMI_Abort".to_vec()))]);
    assert!(n.report(&[0; REPORT_MAX + 1]).is_err());
    let mut r = root();
    r.lost(3);
    r.receive(6, frame::report(b"rank 12 called PMI_Abort").unwrap());
    let o = root_out(&mut r);
    assert_eq!(o.reports, [(6, b"rank 12 called PMI_Abort".to_vec())]);
    // The host ends the job: the nodes that wait are released.
    let mut r = root();
    r.receive(0, contrib(0, &[0, 2, 3, 6]));
    r.fail("rank 12 called PMI_Abort");
    let o = root_out(&mut r);
    assert!(o.errors.is_empty());
    assert_eq!(o.sent[0], (Peer::Node(0), Frame::Fail { epoch: 0, message: "rank 12 called PMI_Abort".into() }));
}

#[test]
fn a_node_needs_a_place_in_the_tree() {
    assert_eq!(Node::new(tree(), 7, bounds(), ALL_MAX).err(), Some(TreeError::NoSuchNode { node: 7, nodes: 7 }));
}

#[test]
fn garbage_from_any_peer_never_panics() {
    let mut rng = XorShift::new(7);
    let frames = [contrib(0, &[2, 6]), contrib(0, &[3]), all(0), frame::fail(0, "f"), frame::end(), frame::bye()];
    for round in 0..3000 {
        let mut n = node(0);
        let mut r = root();
        for _ in 0..8 {
            let mut f = frames[rng.below(frames.len() as u64) as usize].to_vec();
            for _ in 0..rng.below(4) {
                if !f.is_empty() {
                    let at = rng.below(f.len() as u64) as usize;
                    f[at] = rng.next_u64() as u8;
                }
            }
            f.truncate(f.len().saturating_sub(rng.below(3) as usize));
            let from = match rng.below(9) {
                8 => Peer::Root,
                x => Peer::Node(x as u32),
            };
            n.receive(from, f.clone().into());
            r.receive(rng.below(8) as u32, f.into());
            if round % 3 == 0 {
                let _ = n.contribute(p(0));
            }
            if rng.below(10) == 0 {
                n.lost(from);
                r.lost(rng.below(8) as u32);
            }
            out(&mut n);
            root_out(&mut r);
        }
    }
}

/// Node `me` of 7 nodes (width 2, top at node 0) whose parts go by Bruck's allgather: 3 rounds, node 3
/// sends to 2, 1 and 6 and takes from 4, 5 and 0.
fn bruck(me: u32) -> Node {
    Node::new(tree().top_at_first_node(), me, bounds(), ALL_MAX).unwrap().with_allgather(Allgather::Bruck)
}

/// Round `round` of exchange `epoch` carrying `nodes`' parts.
fn round(epoch: u32, round: u8, nodes: &[u32]) -> Bytes {
    let parts: Vec<(u32, Vec<u8>)> = nodes.iter().map(|&n| (n, p(n))).collect();
    frame::round(epoch, round, parts.iter().map(|(n, b)| (*n, b.as_slice()))).unwrap()
}

#[test]
fn bruck_rounds_carry_what_a_node_holds_and_make_the_result_in_node_order() {
    let mut n = bruck(3);
    assert_eq!(n.peers(), [0, 1, 2, 4, 5, 6]);
    // A round that comes before the node's own part waits for it.
    n.receive(Peer::Node(4), round(0, 0, &[4]));
    assert!(out(&mut n).sent.is_empty());
    n.contribute(p(3)).unwrap();
    let o = out(&mut n);
    assert_eq!(o.raw, [(Peer::Node(2), round(0, 0, &[3])), (Peer::Node(1), round(0, 1, &[3, 4]))]);
    n.receive(Peer::Node(5), round(0, 1, &[5, 6]));
    let o = out(&mut n);
    // The last round carries only what node 6 lacks: 7 − 4 = 3 parts.
    assert_eq!(o.raw, [(Peer::Node(6), round(0, 2, &[3, 4, 5]))]);
    assert!(o.done.is_empty());
    n.receive(Peer::Node(0), round(0, 2, &[0, 1, 2]));
    let o = out(&mut n);
    assert_eq!(o.done.len(), 1);
    let (epoch, result) = &o.done[0];
    assert_eq!(*epoch, 0);
    assert_eq!(result.iter().map(|(n, b)| (n, b.to_vec())).collect::<Vec<_>>(), want(&[0, 1, 2, 3, 4, 5, 6]));
    // Nothing goes down the tree: every node makes the result itself.
    assert!(o.sent.is_empty(), "{:?}", o.sent);
    assert_eq!(n.epoch(), 1);
}

/// Node 3 completes exchange 0, node 4 being done with it and already in exchange 1 (its round 0 of it came
/// early; `bye`: node 4 then said goodbye, before node 3 took that round).
fn exchange_0_with_a_round_of_1(bye: bool) -> (Node, Out) {
    let mut n = bruck(3);
    n.contribute(p(3)).unwrap();
    n.receive(Peer::Node(4), round(0, 0, &[4]));
    n.receive(Peer::Node(4), round(1, 0, &[4]));
    if bye {
        n.receive(Peer::Node(4), frame::bye());
    }
    n.receive(Peer::Node(5), round(0, 1, &[5, 6]));
    n.receive(Peer::Node(0), round(0, 2, &[0, 1, 2]));
    let o = out(&mut n);
    (n, o)
}

#[test]
fn a_bruck_round_of_the_next_exchange_waits_for_this_one() {
    let (mut n, o) = exchange_0_with_a_round_of_1(false);
    assert_eq!(o.done.len(), 1);
    assert!(o.errors.is_empty(), "{o:?}");
    n.contribute(p(3)).unwrap();
    // Exchange 1's round 0 from node 4 is in: round 1 goes at once.
    let o = out(&mut n);
    assert_eq!(o.raw, [(Peer::Node(2), round(1, 0, &[3])), (Peer::Node(1), round(1, 1, &[3, 4]))]);
}

#[test]
fn bruck_rounds_a_node_may_not_send_end_the_job_naming_it() {
    let cases: [(u32, Bytes, &str); 7] = [
        (5, round(0, 0, &[5]), "node 5 sent round 0 of PMI exchange 0 to node 3, which takes it from node 4"),
        (4, round(0, 7, &[4]), "which takes it from no node: an exchange has 3 rounds"),
        (4, round(0, 0, &[4, 5]), "node 4 sent 2 parts in round 0 of PMI exchange 0, not 1"),
        (5, round(0, 1, &[6, 5]), "node 5 sent a part for node 6 where node 5's belongs"),
        (4, round(2, 0, &[4]), "node 4 sent round 0 of PMI exchange 2 during exchange 0"),
        (4, contrib(0, &[4]), "whose exchanges go by Bruck's allgather"),
        (6, round(0, 0, &[6]), "node 6 sent round 0 of PMI exchange 0 to node 3, which takes it from node 4"),
    ];
    for (from, frame, message) in cases {
        let mut n = bruck(3);
        n.contribute(p(3)).unwrap();
        out(&mut n);
        n.receive(Peer::Node(from), frame);
        let o = out(&mut n);
        let (node, m) = o.error();
        assert_eq!((*node, m.contains(message)), (Some(from), true), "{m}");
        // The shell's exchange failed, and every peer hears it.
        assert_eq!(o.failed.len(), 1);
        assert_eq!(o.kinds_to(Peer::Node(6)), ["a failure of PMI exchange 0"]);
    }
    // A node whose parts go up the tree takes no rounds.
    let mut n = node(3);
    n.receive(Peer::Node(4), round(0, 0, &[4]));
    assert!(out(&mut n)
        .error()
        .1
        .contains("node 4 sent round 0 of PMI exchange 0 to node 3, which exchanges no rounds"));
    // The same round twice.
    let mut n = bruck(3);
    n.receive(Peer::Node(4), round(0, 0, &[4]));
    n.receive(Peer::Node(4), round(0, 0, &[4]));
    assert!(out(&mut n).error().1.contains("node 4 sent round 0 of PMI exchange 0 twice"));
}

#[test]
fn a_bruck_exchange_over_its_bounds_ends_the_job_naming_the_node_that_brought_it() {
    let mut n = bruck(3);
    n.contribute(p(3)).unwrap();
    // 4 parts of 99 bytes from node 5's round, over the 400 bytes of an exchange with node 3's and 4's.
    n.receive(Peer::Node(4), round(0, 0, &[4]));
    let big = [(5u32, vec![1u8; 99]), (6, vec![2; 99])];
    n.receive(Peer::Node(5), frame::round(0, 1, big.iter().map(|(n, b)| (*n, b.as_slice()))).unwrap());
    n.receive(Peer::Node(0), round(0, 2, &[0, 1, 2]));
    let o = out(&mut n);
    assert!(o.errors.is_empty(), "{o:?}");
    let mut n = bruck(3);
    n.contribute(vec![0; 100]).unwrap();
    let big = [(5u32, vec![1u8; 100]), (6, vec![2; 100])];
    n.receive(Peer::Node(5), frame::round(0, 1, big.iter().map(|(n, b)| (*n, b.as_slice()))).unwrap());
    let over = [(0u32, vec![1u8; 100]), (1, vec![1]), (2, vec![])];
    n.receive(Peer::Node(0), frame::round(0, 2, over.iter().map(|(n, b)| (*n, b.as_slice()))).unwrap());
    let (node, m) = out(&mut n).error().clone();
    assert_eq!(node, Some(0), "{m}");
    assert!(
        m.contains("would gather more than 400 bytes (TEST_EXCHANGE_MAX): node 0 brought 101 bytes in round 2"),
        "{m}"
    );
    // A part over the bound on one node's is refused unread.
    let mut n = bruck(3);
    n.receive(Peer::Node(4), frame::round(0, 0, std::iter::once((4, &[0u8; PART_MAX + 1][..]))).unwrap());
    assert!(out(&mut n).error().1.contains("over the limit of 100 bytes per node (TEST_PART_MAX)"));
    // The largest round a peer may send: its parts at their bound.
    let wide = Node::new(Tree::new(5000, 2).unwrap().top_at_first_node(), 3, bounds(), usize::MAX).unwrap();
    let wide = wide.with_allgather(Allgather::Bruck);
    assert_eq!(wide.frame_max(Peer::Node(3 + 2048)), frame::round_len(2048, EXCHANGE_MAX));
    assert_eq!(wide.frame_max(Peer::Node(4)), CONTROL_MAX);
}

#[test]
fn a_bruck_peer_that_is_done_or_lost_fails_the_exchange_that_needs_it() {
    // Node 4 said it is done before its round 0 came: node 3's exchange cannot complete.
    let mut n = bruck(3);
    n.receive(Peer::Node(4), frame::bye());
    n.contribute(p(3)).unwrap();
    let (node, m) = out(&mut n).error().clone();
    assert_eq!(node, Some(4));
    assert!(m.contains("ranks wait in PMI exchange 0 that node 4 cannot join"), "{m}");
    // Node 3's own shell is done while node 4's round is in: it says goodbye to every peer, and leaves the
    // report to them (each has node 3 as the source of a round).
    let mut n = bruck(3);
    n.receive(Peer::Node(4), round(0, 0, &[4]));
    n.finish();
    let o = out(&mut n);
    assert!(o.errors.is_empty(), "{o:?}");
    assert_eq!(o.kinds_to(Peer::Node(6)), ["a goodbye"]);
    // Node 6 (a peer, not in node 3's branch of the tree) leaves without a goodbye.
    let mut n = bruck(3);
    n.lost(Peer::Node(6));
    let (node, m) = out(&mut n).error().clone();
    assert_eq!(node, Some(6));
    assert!(m.contains("node 6 was lost: its connection to node 3 closed"), "{m}");
    // After its goodbye, leaving is normal, and a peer's round of this exchange already in is enough.
    let mut n = bruck(3);
    n.contribute(p(3)).unwrap();
    n.receive(Peer::Node(4), round(0, 0, &[4]));
    n.receive(Peer::Node(4), frame::bye());
    n.lost(Peer::Node(4));
    n.receive(Peer::Node(5), round(0, 1, &[5, 6]));
    n.receive(Peer::Node(0), round(0, 2, &[0, 1, 2]));
    let o = out(&mut n);
    assert!(o.errors.is_empty(), "{o:?}");
    assert_eq!(o.done.len(), 1);
}

/// Node `me` of 3 nodes whose tree is the star about node 0: node 0 is every node's parent and a source of a
/// round too.
fn bruck_of_three(me: u32) -> Node {
    Node::new(Tree::new(3, 4).unwrap().top_at_first_node(), me, bounds(), ALL_MAX)
        .unwrap()
        .with_allgather(Allgather::Bruck)
}

#[test]
fn a_parent_that_is_a_source_and_says_goodbye_without_its_round_fails_the_exchange() {
    let mut n = bruck_of_three(2);
    n.contribute(p(2)).unwrap();
    out(&mut n);
    n.receive(Peer::Node(0), frame::bye());
    let o = out(&mut n);
    let (node, m) = o.error();
    assert_eq!(*node, Some(0), "{m}");
    assert!(m.contains("ranks wait in PMI exchange 0 that node 0 cannot join"), "{m}");
}

#[test]
fn a_bruck_failure_reaches_the_parent_where_it_is_a_peer_in_the_rounds() {
    let mut n = bruck_of_three(2);
    n.contribute(p(2)).unwrap();
    out(&mut n);
    n.receive(Peer::Node(1), round(0, 7, &[1]));
    let o = out(&mut n);
    assert_eq!(o.kinds_to(Peer::Node(0)), ["a failure of PMI exchange 0"]);
    assert_eq!(o.kinds_to(Peer::Node(1)), ["a failure of PMI exchange 0"]);
}

#[test]
fn a_round_that_came_early_is_taken_after_its_senders_goodbye() {
    let (_, o) = exchange_0_with_a_round_of_1(true);
    assert!(o.errors.is_empty(), "{o:?}");
    assert_eq!(o.done.len(), 1);
    // Rounds of the next exchange that came early count against its bound once it is in progress.
    let mut n = bruck(3);
    n.contribute(p(3)).unwrap();
    n.receive(Peer::Node(4), round(0, 0, &[4]));
    n.receive(Peer::Node(5), round(0, 1, &[5, 6]));
    let big = [(5u32, vec![1u8; 100]), (6, vec![2; 100])];
    n.receive(Peer::Node(4), frame::round(1, 0, std::iter::once((4, &[0u8; 100][..]))).unwrap());
    n.receive(Peer::Node(5), frame::round(1, 1, big.iter().map(|(n, b)| (*n, b.as_slice()))).unwrap());
    assert!(out(&mut n).errors.is_empty());
    let over = [(0u32, vec![1u8; 100]), (1, vec![1]), (2, vec![])];
    n.receive(Peer::Node(0), frame::round(0, 2, over.iter().map(|(n, b)| (*n, b.as_slice()))).unwrap());
    // Exchange 0 completes; node 0 is already in exchange 1 with a round over what exchange 1 may gather.
    n.receive(Peer::Node(0), frame::round(1, 2, over.iter().map(|(n, b)| (*n, b.as_slice()))).unwrap());
    let (node, m) = out(&mut n).error().clone();
    assert_eq!(node, Some(0), "{m}");
    assert!(m.contains("PMI exchange 1 would gather more than 400 bytes"), "{m}");
}

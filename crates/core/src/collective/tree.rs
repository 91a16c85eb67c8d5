//! The k-ary tree over a job's nodes: who is whose parent, child and subtree.
//!
//! Nodes are numbered 0..N under a root that is not a node itself (srun, or rpmi-run's coordinator). Every
//! exchange turns at the tree's **top**: the place that gathers every part and sends the result down.
//!
//! - **Top at the root** ([`Tree::new`]): with width k the root's children are nodes 0..k, node i's parent
//!   is node (i − k)/k for i ≥ k, and node i's children are k(i+1) .. k(i+1)+k−1, clipped to N. In other
//!   words, node i sits at place i+1 of a k-ary heap whose place 0 is the root: place p's children are
//!   places kp+1 ..= kp+k. A width of N or more is the star (every node a child of the root), a width of 1
//!   a chain.
//! - **Top at node 0** ([`Tree::top_at_first_node`]): the heap's place 0 is node 0 itself, whose parent is
//!   the root: node i's children are ki+1 ..= ki+k and its parent (i − 1)/k. The root is the top's parent
//!   only to hear the nodes' control frames (reports, lost nodes, goodbyes): no exchange passes through it,
//!   so a fence takes one process fewer and, across nodes, the root's host (srun) is woken by none.
//!
//! A node's subtree holds, at each level below it, one run of consecutive places, so a subtree is a short
//! list of ranges of nodes (one per level, at most ⌈log₂ N⌉ + 1 of them; a chain's is one range).

use std::fmt;
use std::ops::Range;

/// The width every host uses where the job and the site choose none. In `benches/tree`'s model of a fence
/// (MPICH's start-up, 32 ranks a node, at 10 and 100 Gb/s) 3 is the fastest at every size, and 4 within 13 %
/// of it (4 % at 4096 nodes) with fewer hops, each a node's wake-up the model leaves out; timed with rpmi-run
/// on 2 CPUs, 4 was the best width or within 5 % of it. Jobs of up to 4 nodes get the star.
pub const DEFAULT_WIDTH: u32 = 4;

/// One end of a connection in the tree: the root or a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Peer {
    Root,
    Node(u32),
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Peer::Root => f.write_str("the root"),
            Peer::Node(n) => write!(f, "node {n}"),
        }
    }
}

/// Why a tree cannot be built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TreeError {
    NoNodes,
    NoWidth,
    /// A node's machine for a node the tree does not have.
    NoSuchNode {
        node: u32,
        nodes: u32,
    },
}

impl fmt::Display for TreeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TreeError::NoNodes => f.write_str("a collective tree needs at least one node"),
            TreeError::NoWidth => f.write_str("a collective tree needs a width of at least 1"),
            TreeError::NoSuchNode { node, nodes } => write!(f, "no node {node} in a collective tree of {nodes} nodes"),
        }
    }
}

impl std::error::Error for TreeError {}

/// N nodes under one root, each with at most `width` children.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tree {
    nodes: u32,
    width: u32,
    /// The heap's place of node 0: 1 with the top at the root (place 0), 0 with the top at node 0.
    first_place: u64,
}

impl Tree {
    pub fn new(nodes: u32, width: u32) -> Result<Tree, TreeError> {
        match (nodes, width) {
            (0, _) => Err(TreeError::NoNodes),
            (_, 0) => Err(TreeError::NoWidth),
            _ => Ok(Tree { nodes, width, first_place: 1 }),
        }
    }

    /// The same nodes and width with the top at node 0 (see the module's documentation).
    pub fn top_at_first_node(self) -> Tree {
        Tree { first_place: 0, ..self }
    }

    /// Where every exchange turns: the root, or node 0.
    pub fn top(&self) -> Peer {
        match self.first_place {
            0 => Peer::Node(0),
            _ => Peer::Root,
        }
    }

    /// N: how many nodes (the root not counted).
    pub fn nodes(&self) -> u32 {
        self.nodes
    }

    pub fn width(&self) -> u32 {
        self.width
    }

    /// Node `node`'s parent (`node` < N).
    pub fn parent(&self, node: u32) -> Peer {
        let place = self.place(node);
        if place == 0 {
            return Peer::Root;
        }
        match (place - 1) / u64::from(self.width) {
            0 if self.first_place == 1 => Peer::Root,
            // Below the place of a node, so a node below `node`: it fits a u32.
            parent => Peer::Node((parent - self.first_place) as u32),
        }
    }

    /// The children of `peer`: a range of nodes, empty for a leaf.
    pub fn children(&self, peer: Peer) -> Range<u32> {
        let k = u64::from(self.width);
        let first = match peer {
            Peer::Root if self.first_place == 0 => return self.clip(0..1),
            Peer::Root => 1,
            Peer::Node(n) => k * self.place(n) + 1,
        };
        self.clip(first - self.first_place..first - self.first_place + k)
    }

    /// Node `node`'s place in the heap.
    fn place(&self, node: u32) -> u64 {
        u64::from(node) + self.first_place
    }

    /// Whether `child` is one of `peer`'s children.
    pub fn is_child(&self, peer: Peer, child: u32) -> bool {
        child < self.nodes && self.parent(child) == peer
    }

    /// The nodes of `node`'s subtree: itself and everything below it.
    pub fn subtree(&self, node: u32) -> Subtree {
        Subtree { tree: *self, place: self.place(node) }
    }

    /// How many hops node `node` is from the root (the root's children are at depth 1).
    pub fn depth(&self, node: u32) -> u32 {
        if self.width == 1 {
            return node.saturating_add(1);
        }
        let mut place = self.place(node);
        // With the top at node 0, the root is one hop above the heap's place 0.
        let mut depth = 1 - self.first_place as u32;
        while place > 0 {
            place = (place - 1) / u64::from(self.width);
            depth += 1;
        }
        depth
    }

    /// The depth of the deepest node: the hops from the root down to the farthest leaf.
    pub fn height(&self) -> u32 {
        // Places grow level by level, so the last node is on the deepest level.
        self.depth(self.nodes - 1)
    }

    /// Places `places` as a range of nodes, clipped to the tree.
    fn clip(&self, places: Range<u64>) -> Range<u32> {
        let end = u64::from(self.nodes);
        // Both ends are at most N after clipping, so they fit a u32.
        (places.start.min(end) as u32)..(places.end.min(end) as u32)
    }
}

/// A node's subtree: ranges of nodes, one per level, in ascending order.
#[derive(Debug, Clone, Copy)]
pub struct Subtree {
    tree: Tree,
    /// The top node's place in the heap.
    place: u64,
}

impl Subtree {
    /// The subtree's nodes as ascending, disjoint ranges.
    pub fn ranges(&self) -> Levels {
        Levels { tree: self.tree, first: self.place, last: self.place }
    }

    /// Every node of the subtree, in ascending order.
    pub fn nodes(&self) -> impl Iterator<Item = u32> + Clone {
        self.ranges().flatten()
    }

    /// How many nodes it holds.
    pub fn size(&self) -> u32 {
        self.ranges().map(|r| r.end - r.start).sum()
    }

    pub fn contains(&self, node: u32) -> bool {
        self.ranges().take_while(|r| r.start <= node).any(|r| r.contains(&node))
    }
}

/// The ranges of a [`Subtree`], level by level.
#[derive(Debug, Clone)]
pub struct Levels {
    tree: Tree,
    /// The places of the next level's first and last node (before clipping to the tree).
    first: u64,
    last: u64,
}

impl Iterator for Levels {
    type Item = Range<u32>;

    fn next(&mut self) -> Option<Range<u32>> {
        let end = u64::from(self.tree.nodes);
        if self.first - self.tree.first_place >= end {
            return None;
        }
        // Places first..=last are nodes first-f..=last-f, f the first node's place.
        let f = self.tree.first_place;
        let range = self.tree.clip(self.first - f..self.last - f + 1);
        if self.tree.width == 1 {
            // A chain: every level is the next node, so the rest of the chain is one range.
            self.first = end + 1;
            return Some(range.start..self.tree.nodes);
        }
        let k = u64::from(self.tree.width);
        self.first = self.first.saturating_mul(k).saturating_add(1);
        self.last = self.last.saturating_mul(k).saturating_add(k);
        Some(range)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(n: u32, k: u32) -> Tree {
        Tree::new(n, k).unwrap()
    }

    /// The subtree of `node` by walking every node's ancestors.
    fn brute_subtree(t: &Tree, node: u32) -> Vec<u32> {
        (0..t.nodes())
            .filter(|&m| {
                let mut p = Peer::Node(m);
                while let Peer::Node(x) = p {
                    if x == node {
                        return true;
                    }
                    p = t.parent(x);
                }
                false
            })
            .collect()
    }

    #[test]
    fn a_ternary_tree_of_13_nodes() {
        let t = tree(13, 3);
        assert_eq!(t.children(Peer::Root), 0..3);
        assert_eq!(t.children(Peer::Node(0)), 3..6);
        assert_eq!(t.children(Peer::Node(2)), 9..12);
        assert_eq!(t.children(Peer::Node(3)), 12..13);
        assert_eq!(t.children(Peer::Node(4)), 13..13);
        assert_eq!(t.parent(2), Peer::Root);
        assert_eq!(t.parent(5), Peer::Node(0));
        assert_eq!(t.parent(12), Peer::Node(3));
        assert_eq!(t.subtree(0).ranges().collect::<Vec<_>>(), [0..1, 3..6, 12..13]);
        assert_eq!(t.subtree(1).nodes().collect::<Vec<_>>(), [1, 6, 7, 8]);
        assert_eq!(t.subtree(1).size(), 4);
        assert!(t.subtree(0).contains(12) && !t.subtree(1).contains(12) && !t.subtree(0).contains(13));
        assert_eq!((t.depth(0), t.depth(3), t.depth(12), t.height()), (1, 2, 3, 3));
    }

    #[test]
    fn the_star_and_the_chain() {
        let star = tree(5, 5);
        assert!((0..5).all(|n| star.parent(n) == Peer::Root && star.children(Peer::Node(n)).is_empty()));
        assert_eq!(star.height(), 1);
        let wider = tree(5, u32::MAX);
        assert_eq!(wider.children(Peer::Root), 0..5);
        assert_eq!(wider.subtree(4).nodes().collect::<Vec<_>>(), [4]);
        let chain = tree(6, 1);
        assert_eq!(chain.parent(0), Peer::Root);
        assert_eq!(chain.parent(4), Peer::Node(3));
        assert_eq!(chain.children(Peer::Node(4)), 5..6);
        assert_eq!(chain.subtree(2).ranges().next(), Some(2..6));
        assert_eq!(chain.subtree(2).ranges().count(), 1);
        assert_eq!((chain.depth(5), chain.height()), (6, 6));
    }

    #[test]
    fn a_ternary_tree_of_13_nodes_with_its_top_at_node_0() {
        let t = tree(13, 3).top_at_first_node();
        assert_eq!((t.top(), tree(13, 3).top()), (Peer::Node(0), Peer::Root));
        assert_eq!(t.children(Peer::Root), 0..1);
        assert_eq!(t.children(Peer::Node(0)), 1..4);
        assert_eq!(t.children(Peer::Node(3)), 10..13);
        assert_eq!(t.children(Peer::Node(4)), 13..13);
        assert_eq!(
            (t.parent(0), t.parent(3), t.parent(4), t.parent(12)),
            (Peer::Root, Peer::Node(0), Peer::Node(1), Peer::Node(3))
        );
        assert_eq!(t.subtree(0).ranges().collect::<Vec<_>>(), [0..1, 1..4, 4..13]);
        assert_eq!(t.subtree(1).nodes().collect::<Vec<_>>(), [1, 4, 5, 6]);
        assert_eq!((t.depth(0), t.depth(3), t.depth(12), t.height()), (1, 2, 3, 3));
        let star = tree(5, 4).top_at_first_node();
        assert_eq!((star.children(Peer::Node(0)), star.height()), (1..5, 2));
    }

    #[test]
    fn parents_children_and_subtrees_agree() {
        let shapes = |n, k| [tree(n, k), tree(n, k).top_at_first_node()];
        for n in [1, 2, 3, 7, 16, 40, 121] {
            for t in [1, 2, 3, 4, 8, n, n + 1].into_iter().flat_map(|k| shapes(n, k)) {
                let k = t.width();
                let mut seen = vec![0; n as usize];
                for peer in std::iter::once(Peer::Root).chain((0..n).map(Peer::Node)) {
                    for c in t.children(peer) {
                        assert_eq!(t.parent(c), peer, "n={n} k={k}");
                        assert!(t.is_child(peer, c));
                        seen[c as usize] += 1;
                    }
                }
                assert!(seen.iter().all(|&s| s == 1), "n={n} k={k}: every node has one parent");
                for node in 0..n {
                    let sub = t.subtree(node);
                    let want = brute_subtree(&t, node);
                    assert_eq!(sub.nodes().collect::<Vec<_>>(), want, "n={n} k={k} node={node}");
                    assert_eq!(sub.size() as usize, want.len());
                    assert!((0..n + 2).all(|m| sub.contains(m) == want.contains(&m)));
                    let depth = match t.parent(node) {
                        Peer::Root => 1,
                        Peer::Node(p) => t.depth(p) + 1,
                    };
                    assert_eq!(t.depth(node), depth);
                }
            }
        }
    }

    #[test]
    fn large_trees_do_not_overflow() {
        for (n, k) in [(1 << 20, 2), (1 << 20, 32), (u32::MAX, 2), (u32::MAX, u32::MAX), (u32::MAX, 1 << 16)] {
            let topped = tree(n, k).top_at_first_node();
            let last = n - 1;
            assert!(topped.is_child(topped.parent(last), last) && topped.children(Peer::Node(last)).is_empty());
            assert!(topped.subtree(0).contains(last) && topped.subtree(0).size() == n, "n={n} k={k}");
            let t = tree(n, k);
            let last = n - 1;
            assert!(t.is_child(t.parent(last), last));
            assert!(t.children(Peer::Node(last)).is_empty());
            let mut top = last;
            while let Peer::Node(p) = t.parent(top) {
                top = p;
            }
            assert!(t.subtree(top).contains(last) && t.depth(top) == 1);
            // The height is the least d with k + k² + ... + k^d ≥ N.
            let height = t.height();
            let reach = |d: u32| (1..=d).map(|j| (k as f64).powi(j as i32)).sum::<f64>();
            assert!(reach(height) >= n as f64 && (height == 1 || reach(height - 1) < n as f64), "n={n} k={k}");
        }
        assert_eq!(tree(u32::MAX, 1).depth(u32::MAX - 1), u32::MAX);
        let binary = tree(1 << 20, 2);
        assert_eq!(binary.subtree(0).size() + binary.subtree(1).size(), 1 << 20);
    }

    #[test]
    fn a_tree_needs_nodes_and_a_width() {
        assert_eq!(Tree::new(0, 2), Err(TreeError::NoNodes));
        assert_eq!(Tree::new(3, 0), Err(TreeError::NoWidth));
    }
}

//! The collective behind every PMI barrier, over a k-ary tree of nodes, as sans-I/O state machines: no
//! sockets, threads or clocks. A host (srun's root thread and the slurmstepds, rpmi-run's coordinator and
//! its node shells) feeds each machine the frames it reads, its shell's contributions and the connections
//! that close, and sends what the machine hands back.
//!
//! **The exchange.** Every node's shell contributes its part (the puts since the last barrier). A node
//! waits for its own part and its children's (each child sends its whole subtree's parts, in node order),
//! then sends them up in one CONTRIB. The root, once every node's part is in, sends one ALL, every part in
//! node order, to its children; every node passes the same bytes on to its children and then completes
//! the exchange locally. Exchanges are numbered from 0 (the epoch); a node's shell has at most one
//! outstanding. The root sends k frames of S bytes per exchange instead of the star's N, and the
//! exchange crosses [`Tree::height`] hops each way.
//!
//! **Bruck's allgather.** With [`Allgather::Bruck`] the parts do not climb the tree: the nodes exchange
//! them in ⌈log₂ N⌉ rounds of Bruck's allgather (ROUND frames, each node with its ⌈log₂ N⌉ peers on either
//! side), and every node makes the same result, in node order, itself. Every node then sends and receives
//! (N − 1) parts, the least an exchange can move, and none sends more than another; the tree stays for
//! everything else (goodbyes, failures, reports, the root's end), and its top must be node 0.
//!
//! **Bounds.** A node's part is at most [`Bounds::part_max`] bytes and one exchange's parts at most
//! [`Bounds::exchange_max`]: the root and every interior node check what they gather. A node takes an ALL
//! of at most the size its host gives.
//!
//! **Failures.** Any frame that breaks the protocol (from a peer that may not send it, of the wrong
//! exchange, twice, with parts outside the sender's subtree, over a bound) fails the machine that got
//! it, with an [`Output::JobError`] naming the node at fault. A failed machine sends FAIL to its children
//! (who pass it on, and fail the shell's pending exchange with [`Output::Failed`]) and takes nothing more.
//! A child that closes its connection without BYE is reported straight to the root (LOST), which fails
//! the job, and with it the exchange, down the whole tree. A node that loses its parent or the root fails
//! by itself (its subtree too). After BYE, or after the root's END, a closing connection is normal.
//!
//! **The host's part.** Send every frame handed back, in order, before closing a connection. A node's host
//! takes a job error by reporting it to the root (e.g. with [`Node::report`]) and ending its node's part
//! of the job; the root's host takes a report or a job error by ending the job ([`Root::fail`] releases
//! the nodes that wait), and calls [`Root::end`] when the job ends normally.

mod bruck;
pub mod frame;
mod gather;
pub mod groups;
mod node;
mod output;
mod root;
pub mod sim;
#[cfg(test)]
mod tests;
mod tree;

pub use frame::{Bytes, Frame, Parts};
pub use groups::{Blocked, GroupDone, GroupRoot};
pub use node::{ContributeError, Node};
pub use output::Output;
pub use root::Root;
pub use tree::{Levels, Peer, Subtree, Tree, TreeError, DEFAULT_WIDTH};

/// The frame `from` sent `to`, or why it is refused unread: over `max` bytes, not a frame, or carrying a part
/// over `part_max`.
fn read(from: Peer, to: Peer, frame: &Bytes, max: usize, part_max: Bound) -> Result<Frame, String> {
    if frame.len() > max {
        return Err(format!("{from} sent a frame of {} bytes to {to}, which takes at most {max}", frame.len()));
    }
    Frame::decode(frame, part_max.bytes).map_err(|e| match e {
        frame::DecodeError::PartTooLarge { .. } => {
            format!("{from} sent {to} {e}, over the limit of {} bytes per node ({})", part_max.bytes, part_max.option)
        }
        frame::DecodeError::Malformed(_) => format!("{from} sent {to} {e}"),
    })
}

/// Why node `node`'s part of `exchange` ("PMI exchange 3", "group exchange 0,4:1") is refused: `len` bytes,
/// over `max`.
fn over_part_max(node: u32, exchange: &str, len: usize, max: Bound) -> String {
    format!(
        "node {node} brought {len} bytes to {exchange}, over the limit of {} bytes per node ({})",
        max.bytes, max.option
    )
}

/// Why exchange `epoch` ("PMI exchange 3") is refused: node `node` brought `brought` bytes (`how`: "for its
/// subtree", "in round 2"), `total` in all so far, over `max`.
fn over_exchange_max(epoch: u32, node: u32, how: &str, brought: usize, total: usize, max: Bound) -> gather::Refusal {
    let message = format!(
        "PMI exchange {epoch} would gather more than {} bytes ({}): node {node} brought {brought} bytes {how}, \
         {total} in all so far",
        max.bytes, max.option
    );
    gather::Refusal { node, message }
}

/// Why node `node` is lost: its connection to node `to` closed before it said BYE.
fn lost_node(node: u32, to: u32) -> String {
    format!(
        "node {node} was lost: its connection to node {to} closed before it said it was done (it was killed or \
         failed)"
    )
}

/// How an exchange's parts reach every node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Allgather {
    /// Up the tree to its top, whose result comes down: an exchange crosses the tree's height twice, and
    /// each node with children sends the result to each of them.
    #[default]
    Tree = 0,
    /// Bruck's allgather between the nodes: ⌈log₂ N⌉ rounds, and no node sends more than another.
    Bruck = 1,
}

impl Allgather {
    /// Its name in options: `tree` or `bruck`.
    pub fn name(self) -> &'static str {
        match self {
            Allgather::Tree => "tree",
            Allgather::Bruck => "bruck",
        }
    }

    /// The allgather an option names.
    pub fn from_name(name: &str) -> Option<Allgather> {
        [Allgather::Tree, Allgather::Bruck].into_iter().find(|a| a.name() == name)
    }

    /// The nodes that node `me` of `tree` has a connection with: its parent and children and, for Bruck's,
    /// its peers in the rounds; in node order, each once.
    pub fn peers(self, tree: &Tree, me: u32) -> Vec<u32> {
        let mut peers: Vec<u32> = tree.children(Peer::Node(me)).collect();
        if let Peer::Node(p) = tree.parent(me) {
            peers.push(p);
        }
        if self == Allgather::Bruck {
            peers.extend(bruck::peers(tree.nodes(), me));
        }
        peers.sort_unstable();
        peers.dedup();
        peers
    }
}

/// A size bound and the option that sets it, for messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bound {
    pub bytes: usize,
    pub option: &'static str,
}

/// What one exchange may gather.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// Bytes one node may contribute to one exchange.
    pub part_max: Bound,
    /// Bytes all nodes together may contribute to one exchange.
    pub exchange_max: Bound,
}

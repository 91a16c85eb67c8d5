//! Bruck's allgather of one exchange between the nodes, as one node runs it: ⌈log₂ N⌉ rounds, in round r
//! node i sends node i − 2^r (mod N) the parts it holds, its own and those of the nodes after it, and takes
//! from node i + 2^r theirs. After round r a node holds the parts of nodes i to i + 2^(r+1) − 1; the last
//! round carries only what the receiver still lacks. Every node sends and takes (N − 1) parts in all, and
//! no node sends more than another: where the tree's top sends k times the result, here nobody does.
//!
//! A node sends round r once its own part and rounds 0 to r − 1 are in, so a peer can be one exchange
//! ahead (it has everything of this one) but never two (the next needs this node's part): a round of the
//! next exchange is held until this one completes.

use super::frame::{self, Bytes, Parts, TooLarge, CONTROL_MAX};
use super::gather::Refusal;
use super::Bounds;

/// Bruck's rounds for `nodes` nodes: ⌈log₂ N⌉.
pub fn rounds(nodes: u32) -> u32 {
    u32::BITS - (nodes.max(1) - 1).leading_zeros()
}

/// How many parts round `round` carries among `nodes` nodes.
fn count(nodes: u32, round: u32) -> u32 {
    let step = 1u32 << round;
    step.min(nodes - step)
}

/// The node that node `me` sends round `round` to.
pub fn target(nodes: u32, me: u32, round: u32) -> u32 {
    ((me as u64 + nodes as u64 - (1u64 << round)) % nodes as u64) as u32
}

/// The node that sends node `me` its round `round`.
pub fn source(nodes: u32, me: u32, round: u32) -> u32 {
    ((me as u64 + (1u64 << round)) % nodes as u64) as u32
}

/// Every node that node `me` exchanges rounds with, in node order, each once.
pub fn peers(nodes: u32, me: u32) -> Vec<u32> {
    let mut p: Vec<u32> =
        (0..rounds(nodes)).flat_map(|r| [target(nodes, me, r), source(nodes, me, r)]).filter(|&p| p != me).collect();
    p.sort_unstable();
    p.dedup();
    p
}

#[derive(Debug)]
pub(super) struct Bruck {
    nodes: u32,
    me: u32,
    rounds: u32,
    bounds: Bounds,
    /// The largest result this node takes, as the frame it would come in.
    all_max: usize,
    own: Option<Vec<u8>>,
    /// The node's shell is done: it brings no part any more.
    own_done: bool,
    /// Each round of the exchange in progress, once it is in.
    got: Vec<Option<Parts>>,
    /// Each round of the next exchange, from a source already in it.
    early: Vec<Option<Parts>>,
    /// The nodes it exchanges rounds with ([`peers`]), and whether each said it is done.
    peers: Vec<u32>,
    peer_done: Vec<bool>,
    /// Rounds sent of the exchange in progress.
    sent: u32,
    /// The parts' bytes in, own and received.
    bytes: usize,
    /// Bytes held: the own part and the rounds' frames, this exchange's and the next's.
    held: usize,
    /// The parts' bytes of the next exchange's rounds that came early.
    early_bytes: usize,
}

impl Bruck {
    pub(super) fn new(nodes: u32, me: u32, bounds: Bounds, all_max: usize) -> Bruck {
        let rounds = rounds(nodes);
        let none = |_| None;
        let peers = peers(nodes, me);
        Bruck {
            nodes,
            me,
            rounds,
            bounds,
            all_max,
            own: None,
            own_done: false,
            got: (0..rounds).map(none).collect(),
            early: (0..rounds).map(none).collect(),
            peer_done: vec![false; peers.len()],
            peers,
            sent: 0,
            bytes: 0,
            held: 0,
            early_bytes: 0,
        }
    }

    /// Whether this node exchanges rounds with `peer`.
    pub(super) fn is_peer(&self, peer: u32) -> bool {
        self.peers.binary_search(&peer).is_ok()
    }

    /// Whether peer `peer` said it is done.
    pub(super) fn is_done(&self, peer: u32) -> bool {
        self.peers.binary_search(&peer).is_ok_and(|i| self.peer_done[i])
    }

    /// The round `peer` sends this node.
    fn round_from(&self, peer: u32) -> Option<u32> {
        (0..self.rounds).find(|&r| source(self.nodes, self.me, r) == peer)
    }

    /// The largest ROUND `peer` may send: its round's parts, each at most `part_max`, at most `exchange_max`
    /// in all.
    pub(super) fn frame_max(&self, peer: u32) -> usize {
        let Some(round) = self.round_from(peer) else { return CONTROL_MAX };
        let parts = count(self.nodes, round) as usize;
        let bytes = parts.saturating_mul(self.bounds.part_max.bytes).min(self.bounds.exchange_max.bytes);
        frame::round_len(parts, bytes).max(CONTROL_MAX)
    }

    /// Takes the node's own part of exchange `epoch`.
    pub(super) fn own(&mut self, epoch: u32, part: Vec<u8>) -> Result<(), Refusal> {
        if part.len() > self.bounds.part_max.bytes {
            let message =
                super::over_part_max(self.me, &format!("PMI exchange {epoch}"), part.len(), self.bounds.part_max);
            return Err(Refusal { node: self.me, message });
        }
        self.add(epoch, self.me, "of its own", part.len())?;
        self.held += part.len();
        self.own = Some(part);
        Ok(())
    }

    /// Round `round` of exchange `sent` from `from` during exchange `epoch`; `replayed`: a round that came
    /// early, taken now that its exchange is in progress.
    pub(super) fn round(
        &mut self,
        epoch: u32,
        from: u32,
        sent: u32,
        round: u8,
        parts: Parts,
        replayed: bool,
    ) -> Result<(), Refusal> {
        let refuse = |message: String| Err(Refusal { node: from, message });
        let Some(r) = self.round_from(from).filter(|&r| r == u32::from(round)) else {
            return refuse(format!(
                "node {from} sent round {round} of PMI exchange {sent} to node {}, which takes it from {}",
                self.me,
                self.source_of(round)
            ));
        };
        let expected = count(self.nodes, r);
        if parts.len() != expected as usize {
            return refuse(format!(
                "node {from} sent {} parts in round {round} of PMI exchange {sent}, not {expected}",
                parts.len()
            ));
        }
        for (t, node) in parts.nodes().enumerate() {
            let want = ((from as u64 + t as u64) % self.nodes as u64) as u32;
            if node != want {
                return refuse(format!(
                    "node {from} sent a part for node {node} where node {want}'s belongs, in round {round} of PMI exchange {sent}"
                ));
            }
        }
        let slot = r as usize;
        if self.is_done(from) && !replayed {
            return refuse(format!("node {from} sent round {round} of PMI exchange {sent} after it said it was done"));
        }
        if sent == epoch.wrapping_add(1) && self.early[slot].is_none() && self.got[slot].is_some() {
            // Held to the exchange's bound beside the others that came early: counted again when taken.
            let early = self.early_bytes.saturating_add(parts.bytes());
            let max = self.bounds.exchange_max;
            if early > max.bytes {
                let how = format!("in round {round}");
                return Err(super::over_exchange_max(sent, from, &how, parts.bytes(), early, max));
            }
            self.early_bytes = early;
            self.held += parts.frame().len();
            self.early[slot] = Some(parts);
            return Ok(());
        }
        if sent != epoch {
            return refuse(format!("node {from} sent round {round} of PMI exchange {sent} during exchange {epoch}"));
        }
        if self.got[slot].is_some() {
            return refuse(format!("node {from} sent round {round} of PMI exchange {epoch} twice"));
        }
        self.add(epoch, from, &format!("in round {round}"), parts.bytes())?;
        self.held += parts.frame().len();
        self.got[slot] = Some(parts);
        Ok(())
    }

    /// Who sends round `round`, for messages (any number a peer may claim).
    fn source_of(&self, round: u8) -> String {
        match u32::from(round) < self.rounds {
            true => format!("node {}", source(self.nodes, self.me, u32::from(round))),
            false => format!("no node: an exchange has {} rounds", self.rounds),
        }
    }

    /// Counts `len` more bytes that `node` brought to exchange `epoch`, against both bounds.
    fn add(&mut self, epoch: u32, node: u32, how: &str, len: usize) -> Result<(), Refusal> {
        let total = self.bytes.saturating_add(len);
        let max = self.bounds.exchange_max;
        if total > max.bytes {
            return Err(super::over_exchange_max(epoch, node, how, len, total, max));
        }
        let result = frame::parts_len(self.nodes as usize, total);
        if result > self.all_max {
            let message = format!(
                "PMI exchange {epoch} would make a result of {result} bytes, more than the {} node {} takes: node \
                 {node} brought {len} bytes {how}",
                self.all_max, self.me
            );
            return Err(Refusal { node, message });
        }
        self.bytes = total;
        Ok(())
    }

    /// This node's shell is done.
    pub(super) fn own_done(&mut self) {
        self.own_done = true;
    }

    /// `peer` said it is done.
    pub(super) fn peer_done(&mut self, peer: u32) {
        if let Ok(i) = self.peers.binary_search(&peer) {
            self.peer_done[i] = true;
        }
    }

    /// Whether anyone's part of the exchange in progress is in.
    pub(super) fn started(&self) -> bool {
        self.own.is_some() || self.got.iter().any(Option::is_some)
    }

    /// Exchange `epoch` cannot complete: a node whose part it needs is done, and others' are in.
    pub(super) fn blocked(&self, epoch: u32) -> Option<Refusal> {
        if !self.started() {
            return None;
        }
        let absent = match self.own_done && self.own.is_none() {
            true => self.me,
            false => {
                let missing = |r: &u32| self.got[*r as usize].is_none();
                let r = (0..self.rounds).filter(missing).find(|&r| self.is_done(source(self.nodes, self.me, r)))?;
                source(self.nodes, self.me, r)
            }
        };
        Some(Refusal {
            node: absent,
            message: format!(
                "ranks wait in PMI exchange {epoch} that node {absent} cannot join: every rank on it has closed its \
                 PMI connection"
            ),
        })
    }

    /// The rounds due now, (node, frame) each: round r once the own part and rounds 0 to r − 1 are in.
    pub(super) fn sends(&mut self, epoch: u32) -> Result<Vec<(u32, Bytes)>, TooLarge> {
        let mut due = Vec::new();
        while self.sent < self.rounds
            && self.own.is_some()
            && self.got[..self.sent as usize].iter().all(Option::is_some)
        {
            let r = self.sent;
            let parts: Vec<(u32, &[u8])> = self.held_parts().take(count(self.nodes, r) as usize).collect();
            due.push((target(self.nodes, self.me, r), frame::round(epoch, r as u8, parts.iter().copied())?));
            self.sent += 1;
        }
        Ok(due)
    }

    /// The parts in, in the order this node holds them: its own, then each round's.
    fn held_parts(&self) -> impl Iterator<Item = (u32, &[u8])> {
        let own = self.own.as_deref().map(|p| (self.me, p));
        own.into_iter().chain(self.got.iter().flatten().flat_map(Parts::iter))
    }

    /// Whether the exchange is complete here: every round sent and in.
    pub(super) fn complete(&self) -> bool {
        self.own.is_some() && self.sent == self.rounds && self.got.iter().all(Option::is_some)
    }

    /// The complete exchange `epoch`'s result, as an ALL, every part in node order.
    pub(super) fn result(&self, epoch: u32) -> Result<Bytes, TooLarge> {
        let mut parts: Vec<(u32, &[u8])> = self.held_parts().collect();
        // Held from this node on; node 0's part is N − me places in.
        let first = (self.nodes - self.me) as usize % parts.len().max(1);
        parts.rotate_left(first);
        frame::all(epoch, parts.iter().copied())
    }

    /// Drops the exchange's parts for the next one, and returns that one's rounds already in, by round.
    pub(super) fn clear(&mut self) -> Vec<(u8, Parts)> {
        self.own = None;
        self.got.iter_mut().for_each(|g| *g = None);
        self.sent = 0;
        self.bytes = 0;
        let early: Vec<(u8, Parts)> =
            self.early.iter_mut().enumerate().filter_map(|(r, e)| Some((r as u8, e.take()?))).collect();
        self.held = 0;
        self.early_bytes = 0;
        early
    }

    /// Bytes held: the own part and the rounds' frames.
    pub(super) fn held(&self) -> usize {
        self.held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_sources_and_targets() {
        assert_eq!([1, 2, 3, 4, 5, 8, 9, 100_000].map(rounds), [0, 1, 2, 2, 3, 3, 4, 17]);
        // 5 nodes: node 1 sends to 0, 4, 2 and takes from 2, 3, 0; the last round carries one part.
        assert_eq!((0..3).map(|r| target(5, 1, r)).collect::<Vec<_>>(), [0, 4, 2]);
        assert_eq!((0..3).map(|r| source(5, 1, r)).collect::<Vec<_>>(), [2, 3, 0]);
        assert_eq!((0..3).map(|r| count(5, r)).collect::<Vec<_>>(), [1, 2, 1]);
        assert_eq!(peers(5, 1), [0, 2, 3, 4]);
        assert_eq!(peers(1, 0), Vec::<u32>::new());
        // Every node's parts reach every node once: each round's count adds up to N − 1.
        for n in 1..200u32 {
            assert_eq!((0..rounds(n)).map(|r| count(n, r)).sum::<u32>(), n - 1, "{n} nodes");
            for me in [0, n / 2, n - 1] {
                for r in 0..rounds(n) {
                    assert_eq!(source(n, target(n, me, r), r), me);
                }
            }
        }
        assert_eq!(target(u32::MAX, 0, 31), u32::MAX - (1 << 31));
        assert_eq!(rounds(u32::MAX), 32);
    }
}

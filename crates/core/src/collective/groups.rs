//! PMI 1.2's group exchanges as the root gathers them: an allgather among only the nodes that hold members of
//! one group barrier ([`crate::server::Host::group_collective`]), the others taking no part.
//!
//! **A star through the root.** Each member node sends its part straight to the root, which sends every part
//! back to each member once all are in. Groups are what MPICH makes of them: its node roots (one member per
//! node, with a few bytes each), or the ranks of one communicator. The tree stays for the barrier every node
//! joins; a group's members are few, and a star reaches them in one hop each way. Exchanges of different ids
//! may be pending at once; each id has at most one (a node starts the next exchange of an id only once the
//! last one ended for it).
//!
//! **Bounds.** A node's part is at most `part_max` bytes, and the parts held at once, over every pending
//! exchange, at most `exchange_max`: the same bounds as one exchange of the tree. Gathering exchanges are at
//! most [`PENDING_MAX`].
//!
//! **Never hangs.** A node that can bring nothing more (every task on it closed its connection, or it was
//! lost) blocks each pending exchange it is a member of and has not brought its part to; so does a rank
//! that left without `PMI_Finalize`, for the exchanges of groups it is a member of. The host asks
//! ([`GroupRoot::blocked`]) and ends the job.

use super::Bounds;
use super::Bytes;
use crate::codec::{FrameReader, FrameWriter, Malformed};
use crate::server::{TaskMap, GROUP_ID_MAX};
use crate::wire::group::{Group, Members};
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

/// At most this many group exchanges pending at once in a job (a task has at most 64 group barriers
/// outstanding; this is for a whole job).
pub const PENDING_MAX: usize = 1 << 16;

/// The largest end of a group exchange a root sends a member of a job of `nodes` nodes under `bounds`, for a
/// transport's bound on its frame.
pub fn done_max(nodes: u32, bounds: &Bounds) -> usize {
    GROUP_ID_MAX + 8 * nodes as usize + bounds.exchange_max.bytes + 64
}

/// A node's part of a group exchange, as a message carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    pub id: Vec<u8>,
    pub part: Vec<u8>,
}

/// A group exchange every member's part came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupDone {
    pub id: Vec<u8>,
    /// The member nodes, ascending: each gets every part.
    pub shells: Arc<[u32]>,
    /// Each member's part, in the order of `shells`.
    pub parts: Vec<Vec<u8>>,
}

/// A pending group exchange that can never end, and whom it waits for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Blocked {
    /// Rank `rank`, on node `node`, left (`finalized`: after `PMI_Finalize`) and its node has not brought its
    /// part.
    Rank { id: String, rank: u32, node: u32, finalized: bool },
    /// Node `node` can bring nothing more.
    Node { id: String, node: u32 },
}

/// What a pending exchange holds for each member node beside its part's bytes, charged against the exchange
/// bound: its place in the member list (4 bytes), its slot (24) and its part's heap block (32 at least).
const MEMBER_CHARGE: usize = 64;
/// What a pending exchange holds beside its id and its member nodes: its entry in the map.
const EXCHANGE_CHARGE: usize = 128;

#[derive(Debug)]
struct Gathering {
    shells: Arc<[u32]>,
    parts: Vec<Option<Vec<u8>>>,
    have: usize,
}

/// The group exchanges of one job, at its root.
#[derive(Debug)]
pub struct GroupRoot {
    /// The node of each rank: the root tells a group's member nodes from its id, not from what a node says.
    task_map: TaskMap,
    /// Every node of the job, as the engine's `WORLD` has them: shared by every WORLD exchange.
    world: Arc<[u32]>,
    bounds: Bounds,
    pending: BTreeMap<Vec<u8>, Gathering>,
    /// The parts held and what the pending exchanges cost beside them ([`MEMBER_CHARGE`]).
    held: usize,
}

impl GroupRoot {
    /// The root of a job of the ranks and nodes `task_map` says.
    pub fn new(task_map: TaskMap, bounds: Bounds) -> GroupRoot {
        let world = (0..task_map.node_count() as u32).collect();
        GroupRoot { task_map, world, bounds, pending: BTreeMap::new(), held: 0 }
    }

    /// The largest part of one node, its id included, for a transport's bound on its frame.
    pub fn contribution_max(&self) -> usize {
        GROUP_ID_MAX + self.bounds.part_max.bytes + 64
    }

    /// Whether no group exchange is pending.
    pub fn is_idle(&self) -> bool {
        self.pending.is_empty()
    }

    /// Bytes of parts held, with what the pending exchanges cost beside them.
    pub fn held(&self) -> usize {
        self.held
    }

    /// The nodes that hold members of group `id`, ascending: two or more, or it is not a group exchange.
    fn members(&self, id: &[u8]) -> Option<Arc<[u32]>> {
        let group = Group::parse(id, self.task_map.size() as u32).ok()?;
        let shells: Arc<[u32]> = match group.members {
            Members::World => self.world.clone(),
            // A node's own group never leaves it.
            Members::Node => return None,
            Members::Ranks(ranks) => {
                let mut nodes: Vec<u32> = ranks.iter().filter_map(|&r| self.task_map.node_of(r)).collect();
                nodes.sort_unstable();
                nodes.dedup();
                nodes.into()
            }
        };
        (shells.len() >= 2).then_some(shells)
    }

    /// Node `from`'s part of exchange `id`. `Ok(Some)` once every member node's part is in. `Err`: what the
    /// node sent breaks the protocol or a bound, naming the node; the job cannot go on.
    pub fn contribute(&mut self, from: u32, id: &[u8], part: Vec<u8>) -> Result<Option<GroupDone>, String> {
        let name = String::from_utf8_lossy(id);
        if part.len() > self.bounds.part_max.bytes {
            return Err(super::over_part_max(
                from,
                &format!("group exchange {name}"),
                part.len(),
                self.bounds.part_max,
            ));
        }
        let (shells, cost) = match self.pending.get(id) {
            Some(p) => (p.shells.clone(), part.len()),
            None => {
                if id.len() > GROUP_ID_MAX {
                    return Err(format!(
                        "node {from} sent a malformed group exchange '{}'",
                        crate::server::excerpt(id)
                    ));
                }
                let Some(shells) = self.members(id) else {
                    return Err(format!(
                        "node {from} sent a malformed group exchange '{}'",
                        crate::server::excerpt(id)
                    ));
                };
                if self.pending.len() >= PENDING_MAX {
                    return Err(format!(
                        "node {from} started group exchange {name} beside {PENDING_MAX} others pending"
                    ));
                }
                let cost = part.len().saturating_add(exchange_charge(id, &shells));
                (shells, cost)
            }
        };
        let Ok(place) = shells.binary_search(&from) else {
            return Err(format!("node {from} sent a part of group exchange {name}, whose members it does not hold"));
        };
        let held = self.held.saturating_add(cost);
        if held > self.bounds.exchange_max.bytes {
            let max = self.bounds.exchange_max;
            return Err(format!(
                "the group exchanges pending would hold more than {} bytes ({}): node {from} brought {} bytes to \
                 group exchange {name}",
                max.bytes,
                max.option,
                part.len()
            ));
        }
        let pending = self.pending.entry(id.to_vec()).or_insert_with(|| Gathering {
            parts: vec![None; shells.len()],
            shells,
            have: 0,
        });
        if pending.parts[place].is_some() {
            return Err(format!("node {from} sent its part of group exchange {name} twice"));
        }
        pending.parts[place] = Some(part);
        pending.have += 1;
        self.held = held;
        if pending.have < pending.shells.len() {
            return Ok(None);
        }
        let Some(done) = self.pending.remove(id) else { return Ok(None) };
        let parts: Vec<Vec<u8>> = done.parts.into_iter().flatten().collect();
        let bytes = parts.iter().map(Vec::len).sum::<usize>();
        self.held -= bytes + exchange_charge(id, &done.shells);
        Ok(Some(GroupDone { id: id.to_vec(), shells: done.shells, parts }))
    }

    /// The first pending exchange that waits for a rank of `left` (rank, its node, whether it finalized
    /// first) or for one of the `nodes` that `done` says can bring nothing more; ranks first, which say more
    /// of the cause.
    pub fn blocked(
        &self,
        left: impl IntoIterator<Item = (u32, u32, bool)>,
        nodes: u32,
        done: impl Fn(u32) -> bool,
    ) -> Option<Blocked> {
        if self.is_idle() {
            return None;
        }
        let by_rank = left.into_iter().find_map(|(rank, node, finalized)| {
            Some(Blocked::Rank { id: self.blocked_by_rank(rank, node)?, rank, node, finalized })
        });
        by_rank.or_else(|| {
            (0..nodes)
                .filter(|&n| done(n))
                .find_map(|node| Some(Blocked::Node { id: self.blocked_by_node(node)?, node }))
        })
    }

    /// Node `node` can bring nothing more: a pending exchange it is a member of and has not brought its part
    /// to, by id, if any.
    fn blocked_by_node(&self, node: u32) -> Option<String> {
        self.pending
            .iter()
            .find(|(_, p)| p.shells.binary_search(&node).is_ok_and(|i| p.parts[i].is_none()))
            .map(|(id, _)| String::from_utf8_lossy(id).into_owned())
    }

    /// Rank `rank`, on node `node`, left without `PMI_Finalize`: a pending exchange of a group it is a
    /// member of, whose part its node has not brought (so it was not in the barrier), by id, if any.
    fn blocked_by_rank(&self, rank: u32, node: u32) -> Option<String> {
        self.pending
            .iter()
            .filter(|(_, p)| p.shells.binary_search(&node).is_ok_and(|i| p.parts[i].is_none()))
            .find(|(id, _)| Group::parse(id, self.task_map.size() as u32).is_ok_and(|g| g.contains(rank)))
            .map(|(id, _)| String::from_utf8_lossy(id).into_owned())
    }
}

/// What pending exchange `id` among `shells` is charged beside its parts' bytes.
fn exchange_charge(id: &[u8], shells: &[u32]) -> usize {
    EXCHANGE_CHARGE + id.len() + MEMBER_CHARGE * shells.len()
}

/// A node's part of a group exchange as one message (integers big-endian): `id_len:u16 id part`. The member
/// nodes are not in it: the root tells them from the id. `None` if the id is too long for it.
pub fn encode_part(id: &[u8], part: &[u8]) -> Option<Vec<u8>> {
    let mut m = FrameWriter::with_capacity(2 + id.len() + part.len());
    m.prefixed16(id)?.bytes(part);
    Some(m.into_vec())
}

/// Reads [`encode_part`]'s message: the id and the part.
pub fn decode_part(m: &[u8]) -> Result<Part, Malformed> {
    let mut r = FrameReader::new(m);
    let id = r.prefixed16(GROUP_ID_MAX, "a group exchange id")?.to_vec();
    Ok(Part { id, part: r.rest().to_vec() })
}

/// The parts of an exchange every member's part came to, as one message: `id_len:u16 id count:u32
/// count*(len:u32 bytes)`, the parts in member order. (A root sends no failure: a group exchange that cannot
/// end ends the job.) `None` if a length does not fit its field.
pub fn encode_done(id: &[u8], parts: &[Vec<u8>]) -> Option<Vec<u8>> {
    let mut m = FrameWriter::with_capacity(6 + id.len() + parts.iter().map(|p| 4 + p.len()).sum::<usize>());
    m.prefixed16(id)?.len32(parts.len())?;
    for p in parts {
        m.prefixed32(p)?;
    }
    Some(m.into_vec())
}

/// The end of a group exchange as a member node takes it: [`encode_done`]'s message, kept as it came and read
/// in place. A message of many tiny parts costs its bytes, not an allocation per part.
#[derive(Clone, PartialEq, Eq)]
pub struct DoneParts {
    message: Bytes,
    /// Where the id is in the message.
    id: std::ops::Range<usize>,
    /// Where the first part's length is.
    parts_at: usize,
    count: u32,
}

impl DoneParts {
    /// The end of exchange `id` with `parts`, in member order (what a root sends).
    pub fn new(id: &[u8], parts: &[Vec<u8>]) -> Option<DoneParts> {
        DoneParts::decode(Arc::new(encode_done(id, parts)?)).ok()
    }

    /// Reads [`encode_done`]'s message, checking every length against the bytes present; nothing is
    /// allocated: the parts stay in `message`.
    pub fn decode(message: Bytes) -> Result<DoneParts, Malformed> {
        let m = &message[..];
        let (id, count, mut r) = done_head(m)?;
        let id = 2..2 + id.len();
        let parts_at = m.len() - r.len();
        for _ in 0..count {
            let len = r.u32()? as usize;
            r.take(len)?;
        }
        if !r.is_empty() {
            return Err(Malformed(format!("{} bytes after the parts", r.len())));
        }
        Ok(DoneParts { message, id, parts_at, count })
    }

    pub fn id(&self) -> &[u8] {
        &self.message[self.id.clone()]
    }

    /// How many parts: one per member node.
    pub fn len(&self) -> usize {
        self.count as usize
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Every part, in member order.
    pub fn parts(&self) -> impl Iterator<Item = &[u8]> {
        let mut r = FrameReader::new(&self.message[self.parts_at..]);
        // Checked when decoded: a length cannot fall short here.
        (0..self.count).map_while(move |_| {
            let len = r.u32().ok()? as usize;
            r.take(len).ok()
        })
    }

    /// The message, as [`encode_done`] wrote it.
    pub fn message(&self) -> &[u8] {
        &self.message
    }
}

impl fmt::Debug for DoneParts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DoneParts({}, {} parts)", String::from_utf8_lossy(self.id()), self.count)
    }
}

/// The id and part count at the head of [`encode_done`]'s message, read before anything else of it, so that
/// a member refuses the end of an exchange it did not start, or with other than one part per member node,
/// before it keeps or walks the rest; and a reader at the parts.
pub fn done_head(m: &[u8]) -> Result<(&[u8], u32, FrameReader<'_>), Malformed> {
    let mut r = FrameReader::new(m);
    let id = r.prefixed16(GROUP_ID_MAX, "a group exchange id")?;
    // Each part takes at least its 4-byte length.
    let count = r.count(4, "parts")?;
    Ok((id, count, r))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::Bound;

    /// 8 ranks on 4 nodes, two each.
    fn root() -> GroupRoot {
        let b = |bytes| Bound { bytes, option: "OPT" };
        GroupRoot::new(TaskMap::new(vec![0, 0, 1, 1, 2, 2, 3, 3]), Bounds { part_max: b(100), exchange_max: b(1000) })
    }

    #[test]
    fn parts_meet_and_go_back_to_every_member_in_member_order() {
        let mut r = root();
        assert_eq!(r.contribute(3, b"0,6:1", b"c".to_vec()), Ok(None));
        assert_eq!(r.contribute(1, b"WORLD:2", b"w1".to_vec()), Ok(None));
        let done = r.contribute(0, b"0,6:1", b"a".to_vec()).unwrap().unwrap();
        let want =
            GroupDone { id: b"0,6:1".to_vec(), shells: vec![0, 3].into(), parts: vec![b"a".to_vec(), b"c".to_vec()] };
        assert_eq!(done, want);
        // WORLD's part, and what the pending exchange costs beside it.
        assert_eq!(r.held(), 2 + exchange_charge(b"WORLD:2", &[0, 1, 2, 3]));
        // The same id again is the next barrier over that group.
        assert_eq!(r.contribute(0, b"0,6:1", vec![]), Ok(None));
    }

    #[test]
    fn what_a_node_cannot_send_names_it() {
        let mut r = root();
        let e = |r: &mut GroupRoot, from, id: &[u8], n| r.contribute(from, id, vec![0; n]).unwrap_err();
        assert!(e(&mut r, 1, b"0,6:1", 1).contains("node 1 sent a part of group exchange 0,6:1, whose members"));
        // Within one node, the node's own group, a rank outside the job, an id over the bound.
        for id in [&b"0,1:1"[..], b"NODE:1", b"0,9:1", &[b'1'; GROUP_ID_MAX + 1]] {
            assert!(e(&mut r, 0, id, 1).contains("malformed"), "{}", String::from_utf8_lossy(id));
        }
        assert!(e(&mut r, 0, b"0,6:1", 101).contains("over the limit of 100 bytes per node (OPT)"));
        r.contribute(0, b"0,6:1", vec![0; 100]).unwrap();
        assert!(e(&mut r, 0, b"0,6:1", 1).contains("twice"));
        // Each pending exchange is charged its parts, its id and its member nodes: a third goes over.
        r.contribute(1, b"3,4:0", vec![0; 100]).unwrap();
        assert!(e(&mut r, 2, b"WORLD:1", 1).contains("more than 1000 bytes (OPT)"));
    }

    #[test]
    fn pending_exchanges_are_charged_their_member_nodes() {
        let b = |bytes| Bound { bytes, option: "OPT" };
        let nodes: Vec<u32> = (0..1000).collect();
        let mut r = GroupRoot::new(TaskMap::new(nodes.clone()), Bounds { part_max: b(100), exchange_max: b(200_000) });
        // Each WORLD exchange of 1000 nodes started with an empty part holds a slot for every member node.
        let started = (0..10).take_while(|tag| r.contribute(0, format!("WORLD:{tag}").as_bytes(), vec![]).is_ok());
        assert_eq!(started.count(), 3);
        assert_eq!(r.held(), 3 * exchange_charge(b"WORLD:0", &nodes));
    }

    #[test]
    fn messages_read_back_and_lengths_are_checked() {
        let m = encode_part(b"0,4:17", b"0 k=v\n").unwrap();
        assert_eq!(decode_part(&m), Ok(Part { id: b"0,4:17".to_vec(), part: b"0 k=v\n".to_vec() }));
        let parts = vec![b"a".to_vec(), vec![]];
        let m = encode_done(b"WORLD:3", &parts).unwrap();
        let done = DoneParts::decode(Arc::new(m.clone())).unwrap();
        assert_eq!((done.id(), done.len()), (&b"WORLD:3"[..], 2));
        assert!(done.parts().eq(parts.iter().map(Vec::as_slice)));
        assert_eq!(done.message(), m);
        let decode_done = |m: &[u8]| DoneParts::decode(Arc::new(m.to_vec())).map(|d| d.len());
        assert!(decode_part(&[0x04, 0x01]).unwrap_err().0.contains("id of 1025 bytes"));
        assert!(decode_part(&[0, 3, b'x']).is_err());
        assert!(decode_done(&[0, 0, 0x10, 0, 0, 0]).unwrap_err().0.contains("parts in"));
        assert!(decode_done(&[0, 0, 0, 0, 0, 1, 0, 0, 0, 9, 1]).is_err());
        assert!(decode_done(&[0, 0, 0, 0, 0, 0, 7]).unwrap_err().0.contains("after the parts"));
    }

    #[test]
    fn a_member_that_can_bring_nothing_more_blocks_what_waits_for_it() {
        let mut r = root();
        r.contribute(0, b"0,6:1", vec![]).unwrap();
        assert_eq!(r.blocked_by_node(0), None);
        assert_eq!(r.blocked_by_node(3).as_deref(), Some("0,6:1"));
        assert_eq!(r.blocked_by_node(1), None);
        // Rank 7 is on node 3 too, but no member: it leaving blocks nothing; rank 6 leaving does.
        assert_eq!(r.blocked_by_rank(7, 3), None);
        assert_eq!(r.blocked_by_rank(6, 3).as_deref(), Some("0,6:1"));
        assert_eq!(r.blocked_by_rank(0, 0), None);
        r.contribute(0, b"WORLD:5", vec![]).unwrap();
        assert_eq!(r.blocked_by_rank(3, 1).as_deref(), Some("WORLD:5"));
    }
}

//! Gathering one exchange at one place of the tree: a node's own part and its children's subtrees' parts,
//! or at the root its children's. The root and every interior node share it; what each does with the
//! gathered parts (a CONTRIB up, an ALL down) is theirs.

use super::frame::{self, Bytes, Parts, PartsIter, TooLarge, CONTROL_MAX};
use super::tree::{Peer, Tree};
use super::Bounds;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::ops::Range;

/// A node's parts refused, and the node at fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Refusal {
    pub node: u32,
    pub message: String,
}

/// A contributor to one place's exchange: the node itself or one child.
#[derive(Debug)]
struct Member<T> {
    part: Option<T>,
    /// It said it is done: it brings nothing any more.
    done: bool,
}

impl<T> Default for Member<T> {
    fn default() -> Self {
        Member { part: None, done: false }
    }
}

#[derive(Debug)]
pub(super) struct Gather {
    tree: Tree,
    bounds: Bounds,
    /// The node's own part; `None` at the root, which has none.
    own: Option<(u32, Member<Vec<u8>>)>,
    children: Range<u32>,
    /// Each child's parts, as the frame they came in.
    from: Vec<Member<Parts>>,
    /// Members whose parts are in.
    have: usize,
    /// The parts' bytes gathered, and the bytes of what holds them (the children's frames).
    bytes: usize,
    held: usize,
    /// Members that are done and have nothing in: once anyone's part is in, the exchange cannot complete.
    absent: usize,
    /// This place is the tree's top: what it gathers is the result.
    top: bool,
}

impl Gather {
    /// The gathering at `at`: a node's or the root's.
    pub(super) fn new(tree: Tree, at: Peer, bounds: Bounds) -> Gather {
        let children = tree.children(at);
        let own = match at {
            Peer::Root => None,
            Peer::Node(n) => Some((n, Member::default())),
        };
        let from = children.clone().map(|_| Member::default()).collect();
        Gather { tree, bounds, own, children, from, have: 0, bytes: 0, held: 0, absent: 0, top: tree.top() == at }
    }

    /// Takes the node's own part of exchange `epoch`.
    pub(super) fn own(&mut self, epoch: u32, part: Vec<u8>) -> Result<(), Refusal> {
        let Some((me, _)) = self.own else { return Ok(()) };
        if part.len() > self.bounds.part_max.bytes {
            let message = super::over_part_max(me, &format!("PMI exchange {epoch}"), part.len(), self.bounds.part_max);
            return Err(Refusal { node: me, message });
        }
        let total = self.bytes.saturating_add(part.len());
        if total > self.bounds.exchange_max.bytes {
            return Err(self.over_exchange_max(epoch, me, "of its own", part.len(), total));
        }
        self.bytes = total;
        self.held += part.len();
        self.have += 1;
        if let Some((_, own)) = &mut self.own {
            own.part = Some(part);
        }
        Ok(())
    }

    /// Takes child `child`'s parts of exchange `sent` during exchange `epoch`: exactly its subtree's nodes,
    /// in node order.
    pub(super) fn child(&mut self, epoch: u32, child: u32, sent: u32, parts: Parts) -> Result<(), Refusal> {
        let refuse = |message: String| Err(Refusal { node: child, message });
        if sent != epoch {
            return refuse(format!("node {child} sent parts of PMI exchange {sent} during exchange {epoch}"));
        }
        let Some(member) = child.checked_sub(self.children.start).and_then(|i| self.from.get(i as usize)) else {
            return refuse(format!("node {child} sent parts of PMI exchange {epoch} to a node that is not its parent"));
        };
        if member.done {
            return refuse(format!("node {child} sent parts of PMI exchange {epoch} after it said it was done"));
        }
        if member.part.is_some() {
            return refuse(format!("node {child} sent its parts of PMI exchange {epoch} twice"));
        }
        let subtree = self.tree.subtree(child);
        let mut expected = subtree.nodes();
        for node in parts.nodes() {
            if expected.next() != Some(node) {
                return refuse(if subtree.contains(node) {
                    format!("node {child} sent the part of node {node} twice or out of order in PMI exchange {epoch}")
                } else {
                    format!("node {child} sent a part for node {node}, which is not in its subtree, in PMI exchange {epoch}")
                });
            }
        }
        if expected.next().is_some() {
            return refuse(format!(
                "node {child} sent {} parts of PMI exchange {epoch} for the {} nodes of its subtree",
                parts.len(),
                subtree.size()
            ));
        }
        let total = self.bytes.saturating_add(parts.bytes());
        if total > self.bounds.exchange_max.bytes {
            return Err(self.over_exchange_max(epoch, child, "for its subtree", parts.bytes(), total));
        }
        self.bytes = total;
        self.held += parts.frame().len();
        if let Some(member) = self.member(child) {
            member.part = Some(parts);
        }
        self.have += 1;
        Ok(())
    }

    fn over_exchange_max(&self, epoch: u32, node: u32, whose: &str, brought: usize, total: usize) -> Refusal {
        super::over_exchange_max(epoch, node, whose, brought, total, self.bounds.exchange_max)
    }

    fn member(&mut self, child: u32) -> Option<&mut Member<Parts>> {
        let i = child.checked_sub(self.children.start)?;
        self.from.get_mut(i as usize)
    }

    /// Member `node` (this node or a child) said it is done.
    pub(super) fn done(&mut self, node: u32) {
        let own = matches!(self.own, Some((me, _)) if me == node);
        let member = if own {
            self.own.as_mut().map(|(_, m)| (&mut m.done, m.part.is_none()))
        } else {
            self.member(node).map(|m| (&mut m.done, m.part.is_none()))
        };
        let Some((done, missing)) = member else { return };
        if !std::mem::replace(done, true) && missing {
            self.absent += 1;
        }
    }

    /// Whether child `child` said it is done.
    pub(super) fn is_done(&self, child: u32) -> bool {
        let i = child.checked_sub(self.children.start);
        i.and_then(|i| self.from.get(i as usize)).is_some_and(|m| m.done)
    }

    /// Exchange `epoch` cannot complete if a member is done and its parts are not in while others' are.
    pub(super) fn blocked(&self, epoch: u32) -> Option<Refusal> {
        if self.have == 0 || self.absent == 0 {
            return None;
        }
        let own = self.own.as_ref().filter(|(_, own)| own.done && own.part.is_none()).map(|(me, _)| *me);
        let absent = own.or_else(|| {
            self.children.clone().zip(&self.from).find(|(_, m)| m.done && m.part.is_none()).map(|(c, _)| c)
        })?;
        Some(Refusal {
            node: absent,
            message: format!(
                "ranks wait in PMI exchange {epoch} that node {absent} cannot join: every rank on it has closed its \
                 PMI connection"
            ),
        })
    }

    /// Whether anyone's parts are in.
    pub(super) fn started(&self) -> bool {
        self.have > 0
    }

    /// Whether everyone's parts are in.
    pub(super) fn complete(&self) -> bool {
        self.have == self.from.len() + usize::from(self.own.is_some())
    }

    /// Bytes held: the own part and the children's frames.
    pub(super) fn held(&self) -> usize {
        self.held
    }

    /// Every part gathered, in node order, as a CONTRIB up or, at the tree's top, the ALL of exchange `epoch`.
    pub(super) fn frame(&self, epoch: u32) -> Result<Bytes, TooLarge> {
        let own = self.own.as_ref().and_then(|(me, m)| Some((*me, m.part.as_deref()?)));
        let mut cursors: Vec<PartsIter<'_>> = self.from.iter().filter_map(|m| Some(m.part.as_ref()?.iter())).collect();
        let heads = cursors.iter_mut().enumerate().filter_map(|(i, c)| c.next().map(|(n, b)| Reverse((n, i, b))));
        let left = self.from.iter().filter_map(|m| m.part.as_ref()).map(Parts::len).sum::<usize>();
        let merge = Merge { own, heads: heads.collect(), cursors, left: left + usize::from(own.is_some()) };
        match self.top {
            true => frame::all(epoch, merge),
            false => frame::contrib(epoch, merge),
        }
    }

    /// Drops the exchange's parts, for the next one.
    pub(super) fn clear(&mut self) {
        if let Some((_, own)) = &mut self.own {
            own.part = None;
        }
        self.from.iter_mut().for_each(|m| m.part = None);
        self.have = 0;
        self.bytes = 0;
        self.held = 0;
        self.absent =
            self.from.iter().filter(|m| m.done).count() + self.own.as_ref().map_or(0, |(_, own)| usize::from(own.done));
    }
}

/// The largest CONTRIB child `child` may send: its subtree's nodes, each at most `part_max`, at most
/// `exchange_max` in all.
pub(super) fn contrib_max(tree: &Tree, bounds: &Bounds, child: u32) -> usize {
    let nodes = tree.subtree(child).size() as usize;
    let bytes = nodes.saturating_mul(bounds.part_max.bytes).min(bounds.exchange_max.bytes);
    frame::parts_len(nodes, bytes).max(CONTROL_MAX)
}

/// The gathered parts in node order: the node's own first (it is numbered below its whole subtree), then
/// the children's, merged (each child's are in node order, and the children's subtrees interleave).
#[derive(Clone)]
struct Merge<'a> {
    own: Option<(u32, &'a [u8])>,
    /// The next part of each child, by node.
    heads: BinaryHeap<Reverse<(u32, usize, &'a [u8])>>,
    cursors: Vec<PartsIter<'a>>,
    left: usize,
}

impl<'a> Iterator for Merge<'a> {
    type Item = (u32, &'a [u8]);

    fn next(&mut self) -> Option<(u32, &'a [u8])> {
        let next = match self.own.take() {
            Some(own) => own,
            None => {
                let Reverse((node, i, bytes)) = self.heads.pop()?;
                if let Some((n, b)) = self.cursors.get_mut(i).and_then(Iterator::next) {
                    self.heads.push(Reverse((n, i, b)));
                }
                (node, bytes)
            }
        };
        self.left = self.left.saturating_sub(1);
        Some(next)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

impl ExactSizeIterator for Merge<'_> {}

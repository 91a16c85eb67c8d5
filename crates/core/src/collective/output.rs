//! What a machine hands back to its host, and the queue that holds it until the host asks.

use super::frame::{Bytes, Parts};
use super::tree::Peer;
use std::collections::VecDeque;
use std::sync::Arc;

/// Something for the host to do, from [`super::Node::poll`] or [`super::Root::poll`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// Send `frame` (a payload: the transport puts its length before it) to `to`.
    Send { to: Peer, frame: Bytes },
    /// Node: exchange `epoch` completed; `parts` holds every node's part, in node order.
    Done { epoch: u32, parts: Parts },
    /// Node: exchange `epoch`, to which this node's shell contributed, failed.
    Failed { epoch: u32, message: String },
    /// Root: node `from` sent a report.
    Report { from: u32, bytes: Vec<u8> },
    /// The job cannot go on: the host ends it (a node's host, e.g. by reporting `message` to the root's
    /// and ending its step). `node` is the node at fault, `None` for the root. A machine reports at most
    /// one; after it, it is failed for good.
    JobError { node: Option<u32>, message: String },
}

impl Output {
    /// The frame this output holds, if any.
    fn buffer(&self) -> Option<&Bytes> {
        match self {
            Output::Send { frame, .. } => Some(frame),
            Output::Done { parts, .. } => Some(parts.frame()),
            _ => None,
        }
    }
}

/// Outputs not yet taken, and the bytes of the frames they hold (a frame queued for several children, or
/// passed on and done, counted once).
#[derive(Debug, Default)]
pub(super) struct Outbox {
    queue: VecDeque<Output>,
    held: usize,
}

/// Whether `a` and `b` hold the same frame. The same frame is always queued in a row.
fn same(a: Option<&Output>, b: &Bytes) -> bool {
    a.and_then(Output::buffer).is_some_and(|a| Arc::ptr_eq(a, b))
}

impl Outbox {
    pub(super) fn push(&mut self, output: Output) {
        if let Some(b) = output.buffer() {
            if !same(self.queue.back(), b) {
                self.held += b.len();
            }
        }
        self.queue.push_back(output);
    }

    pub(super) fn send(&mut self, to: Peer, frame: Bytes) {
        self.push(Output::Send { to, frame });
    }

    pub(super) fn pop(&mut self) -> Option<Output> {
        let output = self.queue.pop_front()?;
        if let Some(b) = output.buffer() {
            if !same(self.queue.front(), b) {
                self.held = self.held.saturating_sub(b.len());
            }
        }
        Some(output)
    }

    pub(super) fn held(&self) -> usize {
        self.held
    }
}

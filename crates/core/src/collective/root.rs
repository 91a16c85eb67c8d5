//! The root's side of the collective: its children's CONTRIBs in, one ALL down; and where lost nodes,
//! goodbyes and reports from every node arrive.

use super::frame::{self, Bytes, Frame, Parts, CONTROL_MAX};
use super::gather::{self, Gather};
use super::output::{Outbox, Output};
use super::tree::{Peer, Tree};
use super::Bounds;

/// The collective as the root runs it (srun, or rpmi-run's coordinator). Every node has a connection to
/// it; its children's carry the exchanges. Feed it frames ([`Root::receive`]) and closed connections
/// ([`Root::lost`]); take what to do from [`Root::poll`].
#[derive(Debug)]
pub struct Root {
    tree: Tree,
    bounds: Bounds,
    gather: Gather,
    /// The exchange in progress: how many have completed.
    epoch: u32,
    /// Every node that said BYE: its connections closing is normal.
    said_bye: Vec<bool>,
    /// Failed for good, or ended ([`Root::end`]): nothing but reports is taken any more.
    stopped: bool,
    outbox: Outbox,
    peak: usize,
}

impl Root {
    pub fn new(tree: Tree, bounds: Bounds) -> Root {
        Root {
            tree,
            bounds,
            gather: Gather::new(tree, Peer::Root, bounds),
            epoch: 0,
            said_bye: vec![false; tree.nodes() as usize],
            stopped: false,
            outbox: Outbox::default(),
            peak: 0,
        }
    }

    /// The next thing for the host to do.
    pub fn poll(&mut self) -> Option<Output> {
        self.outbox.pop()
    }

    /// The exchange in progress (or next): how many have completed.
    pub fn epoch(&self) -> u32 {
        self.epoch
    }

    /// The largest frame the root takes from node `from`, for the transport to check a length before
    /// reading.
    pub fn frame_max(&self, from: u32) -> usize {
        if self.gathers_from(from) {
            gather::contrib_max(&self.tree, &self.bounds, from)
        } else {
            CONTROL_MAX
        }
    }

    /// Bytes the root holds: parts gathered and frames not yet taken by [`Root::poll`].
    pub fn held(&self) -> usize {
        self.gather.held() + self.outbox.held()
    }

    /// The most bytes the root has held at once.
    pub fn peak_held(&self) -> usize {
        self.peak
    }

    /// A frame from node `from`.
    pub fn receive(&mut self, from: u32, frame: Bytes) {
        if from >= self.tree.nodes() {
            return self.job_error(None, format!("a frame came from node {from}, which is not in the job"));
        }
        let max = self.frame_max(from);
        let decoded = match super::read(Peer::Node(from), Peer::Root, &frame, max, self.bounds.part_max) {
            Ok(f) => f,
            Err(what) => return self.fail_from(from, what),
        };
        match decoded {
            Frame::Report(bytes) => self.outbox.push(Output::Report { from, bytes }),
            _ if self.stopped => {}
            Frame::Contrib { epoch, parts } if self.gathers_from(from) => self.contribution(from, epoch, parts),
            Frame::Lost { node } if self.tree.is_child(Peer::Node(from), node) => self.lost_child(from, node),
            Frame::Lost { node } => {
                self.fail_from(from, format!("node {from} reported node {node} lost, which is not its child"))
            }
            Frame::Bye => {
                if let Some(b) = self.said_bye.get_mut(from as usize) {
                    *b = true;
                }
                if self.tree.is_child(Peer::Root, from) {
                    self.gather.done(from);
                    self.advance();
                }
            }
            f @ Frame::Contrib { .. } if self.tree.top() == Peer::Root => {
                let parent = self.tree.parent(from);
                self.fail_from(from, format!("node {from} sent {f} to the root, but its parent is {parent}"))
            }
            f @ Frame::Contrib { .. } => self.fail_from(
                from,
                format!("node {from} sent {f} to the root, which takes no parts: every exchange turns at node 0"),
            ),
            f @ (Frame::All { .. } | Frame::Fail { .. } | Frame::End) => {
                self.fail_from(from, format!("node {from} sent {f} to the root, which only the root sends"))
            }
            f @ Frame::Round { .. } => {
                self.fail_from(from, format!("node {from} sent {f} to the root, which only nodes exchange"))
            }
        }
        self.peak = self.peak.max(self.held());
    }

    /// Whether node `node`'s parts come to the root: it is a child of a root that is the tree's top.
    fn gathers_from(&self, node: u32) -> bool {
        self.tree.top() == Peer::Root && self.tree.is_child(Peer::Root, node)
    }

    /// Whether node `node` said it is done.
    pub fn said_bye(&self, node: u32) -> bool {
        self.said_bye.get(node as usize) == Some(&true)
    }

    /// Node `node`'s connection to the root closed.
    pub fn lost(&mut self, node: u32) {
        if self.stopped || self.said_bye.get(node as usize) != Some(&false) {
            return;
        }
        let during = if self.gather.started() { format!(" during PMI exchange {}", self.epoch) } else { String::new() };
        let what = format!("lost the connection to node {node}{during}: it was killed or failed");
        self.fail_from(node, what);
    }

    /// The host is ending the job for a reason of its own (a report it took as an abort or an error):
    /// every node waiting in an exchange hears it failed.
    pub fn fail(&mut self, message: &str) {
        if !self.stopped {
            self.stop(frame::fail(self.epoch, message), None);
        }
    }

    /// The job is over: the nodes are told that the connections closing now is the normal end.
    pub fn end(&mut self) {
        if !self.stopped {
            self.stop(frame::end(), None);
        }
    }

    fn lost_child(&mut self, parent: u32, node: u32) {
        if self.said_bye.get(node as usize) != Some(&false) {
            return;
        }
        self.fail_from(node, super::lost_node(node, parent));
    }

    fn contribution(&mut self, child: u32, epoch: u32, parts: Parts) {
        match self.gather.child(self.epoch, child, epoch, parts) {
            Ok(()) => self.advance(),
            Err(r) => self.fail_from(r.node, r.message),
        }
    }

    /// Sends the ALL down once every node's part is in, or fails the exchange if it cannot complete.
    fn advance(&mut self) {
        if let Some(r) = self.gather.blocked(self.epoch) {
            return self.fail_from(r.node, r.message);
        }
        if !self.gather.complete() {
            return;
        }
        match self.gather.frame(self.epoch) {
            Ok(all) => {
                self.peak = self.peak.max(self.held() + all.len());
                self.gather.clear();
                for c in self.tree.children(Peer::Root) {
                    self.outbox.send(Peer::Node(c), all.clone());
                }
                self.epoch = self.epoch.wrapping_add(1);
            }
            Err(e) => self.job_error(None, format!("PMI exchange {} cannot be sent: {e}", self.epoch)),
        }
    }

    /// Fails for good with a job error that node `node` caused.
    fn fail_from(&mut self, node: u32, message: String) {
        self.job_error(Some(node), message);
    }

    /// Fails for good with a job error (`node` at fault, or `None` for the root).
    fn job_error(&mut self, node: Option<u32>, message: String) {
        if self.stopped {
            return;
        }
        let down = frame::fail(self.epoch, &message);
        self.stop(down, Some(Output::JobError { node, message }));
    }

    /// Stops for good: reports `error` if any and sends `down` (a FAIL or END) to the children.
    fn stop(&mut self, down: Bytes, error: Option<Output>) {
        if let Some(error) = error {
            self.outbox.push(error);
        }
        for c in self.tree.children(Peer::Root) {
            self.outbox.send(Peer::Node(c), down.clone());
        }
        self.gather.clear();
        self.stopped = true;
    }
}

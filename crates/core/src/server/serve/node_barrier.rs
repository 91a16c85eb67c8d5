//! The node barrier (revision 3 of rpmi's additions to the wire; the page's layout is
//! `rpmi_wire::node_barrier`'s): where every local task is a client of rpmi's libraries that said `rpmi=3`
//! at `init`, full barriers' arrivals and releases go through a page of memory the node's tasks share with
//! their host, not a line each way.
//!
//! **Decided once, at the first full barrier's release**, which goes by lines: on if it succeeded, the host
//! made a page, and every local task speaks it; then each task's `barrier_out` says `node_barrier=N` (the
//! node's tasks) and brings the page's memory file. Off otherwise, for good.
//!
//! **A break.** A local task that finalizes or goes, or enters a full barrier by a line, while the node
//! barrier is on, breaks it for good: the page's count would wait for it in vain. So does a
//! `node_barrier_in` that finds a task busy with something else (a service, a spawn block, held input). Tasks waiting on the page
//! are woken, find it broken, and ask by a line, which the server answers as any barrier: failed, naming a
//! task that can no longer join it, where one went; else done.

use super::{Server, TaskStatus, Waiting};
use crate::server::effect::TaskId;

/// Whether the node's full barriers go through the page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) enum Decision {
    /// The host serves no page (the default, until it says it does).
    #[default]
    NotServed,
    /// Until the first full barrier's release.
    Undecided,
    On,
    Off,
}

#[derive(Default)]
pub(super) struct NodeBarrier {
    decision: Decision,
    /// No barrier can complete on the page again.
    broken: bool,
    /// What the host is to write on the page, once it takes it.
    due: NodeRelease,
}

/// What the host writes on the node barrier's page, and wakes the node's tasks for ([`Server::node_release`]).
/// A release moves the page's generation by 2, a break alone by 1, so that a task woken late still tells its
/// barrier's release (its code kept, as a break writes none) from a break that came while it waited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NodeRelease {
    /// The barrier the page's tasks came in on ended with this code (0, or a failure's).
    pub code: Option<i32>,
    /// The page is broken (`rpmi_wire::node_barrier::BROKEN`).
    pub broken: bool,
}

impl Server {
    /// Whether the host serves the node barrier's page (it made one): only then can the node barrier be on.
    pub fn serve_node_barrier(&mut self, on: bool) {
        self.node_barrier.decision = if on { Decision::Undecided } else { Decision::NotServed };
    }

    /// What the host is to write on the node barrier's page, and wake the node's tasks for: taken.
    pub fn node_release(&mut self) -> Option<NodeRelease> {
        Some(std::mem::take(&mut self.node_barrier.due)).filter(|due| *due != NodeRelease::default())
    }

    /// `node_barrier_in`: every local task has counted itself in on the page. Each active task not in a
    /// barrier enters it, to be released on the page rather than by a line. Passed over once the page is
    /// broken (its tasks find it so and ask by lines), and breaks it where a task is busy with something
    /// else; before the node barrier is on, or from a task that did not say `rpmi=3`, a protocol error.
    pub(super) fn node_barrier_in(&mut self, task: TaskId, line: &[u8]) {
        if self.node_barrier.decision != Decision::On || !self.clients[task].speaks_node_barrier {
            return self.protocol_error(task, line, "the node barrier is not on for this task");
        }
        if self.node_barrier.broken {
            return;
        }
        // A task that is busy with something else cannot be counted in (a thread of it waits for a service, it
        // is half-way through a spawn block, or its input is held, puts maybe among it): by lines, all of them.
        let busy = |c: &super::Client| c.waiting != Waiting::Nothing || c.spawn.is_some() || !c.held.is_empty();
        if self.clients.iter().any(|c| c.status == TaskStatus::Active && busy(c)) {
            return self.break_node_barrier();
        }
        for c in self.clients.iter_mut() {
            if c.status == TaskStatus::Active && c.waiting == Waiting::Nothing {
                c.waiting = Waiting::Barrier;
                c.by_page = true;
                self.entered += 1;
            }
        }
        self.check_barrier();
    }

    /// A full barrier is released with `code`: tasks that came in on the page are released there; the
    /// first release decides. `Some(members)` where this one turned the node barrier on: each task's
    /// `barrier_out` says so, and brings the page ([`super::Attached::NodeBarrier`]).
    pub(super) fn node_barrier_released(&mut self, code: i32, by_page: bool) -> Option<i64> {
        let nb = &mut self.node_barrier;
        if by_page {
            nb.due.code = Some(code);
            nb.due.broken |= nb.broken;
        }
        if nb.decision != Decision::Undecided {
            return None;
        }
        let all = self.clients.iter().all(|c| c.speaks_node_barrier && c.status == TaskStatus::Active);
        let on = code == 0 && all;
        nb.decision = if on { Decision::On } else { Decision::Off };
        on.then_some(self.clients.len() as i64)
    }

    /// With the node barrier on, a local task finalized, went, or entered a full barrier by a line: no barrier
    /// can complete on the page again, and tasks waiting there are woken to ask by lines. While a barrier the
    /// page's tasks came in on is under way, its release (which follows) carries the break.
    pub(super) fn break_node_barrier(&mut self) {
        if self.node_barrier.decision != Decision::On || self.node_barrier.broken {
            return;
        }
        let under_way = self.clients.iter().any(|c| c.by_page && c.waiting == Waiting::Barrier);
        self.node_barrier.broken = true;
        self.node_barrier.due.broken = !under_way;
    }
}

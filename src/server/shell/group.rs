//! PMI 1.2's group barriers: `cmd=barrier_in group=G` ([`crate::wire::group`]), answered
//! `cmd=barrier_out tag=T`.
//!
//! Served only to clients the shell answered 1.2 at `init`: those that asked for 1.2 or later, when the host
//! runs group exchanges ([`Host::serves_groups`]). Such a client (MPICH's, answered 1.2, turns on its
//! threaded mode) may then have several group barriers outstanding (one per thread), answered in any order,
//! and send other requests meanwhile: a group barrier does not hold the connection's lock-step.
//!
//! - **Generations.** A barrier is named by its group's one written form (members and tag). A member that
//!   enters it again before it ended joins the next generation; generations end first in, first out, and
//!   only the oldest is ever exchanged.
//! - **Where it runs.** `NODE:<tag>`, and any group whose members are all on this shell, ends here once every
//!   local member is in. Any other goes to the host as a group exchange among only the shells that hold
//!   members ([`Host::group_collective`]), once every local member is in; the others never hear of it.
//! - **What it moves.** The puts of this shell's members since the job's last world exchange (a plain
//!   barrier, or a `WORLD` group): only theirs, and only to the member shells. They are offered again at the
//!   next world exchange, which every shell takes part in; a shell that has them already keeps them as they
//!   are.
//! - **Never hangs.** A member on this shell that left, or finalized, before it entered fails the barrier at
//!   once for every member waiting here, and the job with it, naming the rank. A member on another shell is
//!   that shell's to report; its host ends the job.

use super::{Client, Shell, Status};
use crate::server::host::{GroupExchange, Host, JobError, TaskId, GROUP_ID_MAX};
use crate::wire::group::{Group, Members};
use crate::wire::response::{rc, Line};
use std::collections::{BTreeMap, VecDeque};

/// A task may have this many group barriers outstanding at once (MPICH has one per thread); one more is a
/// protocol error. It bounds what a task can make the shell hold.
pub(super) const OUTSTANDING_MAX: usize = 64;

/// One group barrier of this shell, by its group's written form.
pub(super) struct Barrier {
    tag: i64,
    /// Its members on this shell.
    local: Vec<TaskId>,
    /// The shells that hold members, ascending (this one among them).
    shells: Vec<u32>,
    /// The tasks in each generation not yet ended, oldest first.
    generations: VecDeque<Vec<TaskId>>,
    /// The oldest generation went to the host, whose answer is due.
    exchanging: bool,
    /// The bytes of the part that went to the host, which holds them until it answers.
    in_flight: usize,
}

/// Every group barrier some member on this shell has entered.
#[derive(Default)]
pub(super) struct Groups {
    barriers: BTreeMap<String, Barrier>,
}

impl Groups {
    /// Whether any group barrier is still to end: a task leaving now may leave others waiting.
    pub(super) fn any(&self) -> bool {
        !self.barriers.is_empty()
    }
}

impl Shell {
    /// `barrier_in group=G` from a task that negotiated 1.2.
    pub(super) fn enter_group(&mut self, host: &mut dyn Host, task: TaskId, text: &[u8]) {
        let line = &[&b"cmd=barrier_in group="[..], text].concat();
        let size = self.bounds.size;
        let rank = self.clients[task].rank;
        let group = match Group::parse(text, size) {
            Ok(g) if g.contains(rank) => g,
            Ok(_) => return self.protocol_error(host, task, line, "a group barrier over a group without the rank"),
            Err(why) => return self.protocol_error(host, task, line, &format!("a group barrier whose group {why}")),
        };
        let name = group.to_string();
        if name.len() > GROUP_ID_MAX {
            let why = format!("a group barrier whose group is longer than {GROUP_ID_MAX} bytes");
            return self.protocol_error(host, task, line, &why);
        }
        if self.clients[task].groups_entered >= OUTSTANDING_MAX {
            let why = format!("more than {OUTSTANDING_MAX} group barriers outstanding at once");
            return self.protocol_error(host, task, line, &why);
        }
        // The answer names the tag alone: two of the task's barriers with one tag could not be told apart.
        let clash = self
            .groups
            .barriers
            .iter()
            .find(|(n, b)| b.tag == group.tag && **n != name && b.generations.iter().any(|g| g.contains(&task)));
        if let Some((other, _)) = clash {
            let why = format!("a group barrier with the tag of {other}, which the rank is still in");
            return self.protocol_error(host, task, line, &why);
        }
        self.clients[task].groups_entered += 1;
        let me = self.node();
        let Shell { groups, clients, job, .. } = self;
        let barrier = groups.barriers.entry(name.clone()).or_insert_with(|| {
            let local = clients.iter().filter(|c| group.contains(c.rank)).map(|c| c.task).collect();
            let mut shells: Vec<u32> = match &group.members {
                Members::World => (0..job.task_map.node_count() as u32).collect(),
                Members::Node => vec![me],
                Members::Ranks(ranks) => ranks.iter().filter_map(|&r| job.task_map.node_of(r)).collect(),
            };
            shells.sort_unstable();
            shells.dedup();
            Barrier { tag: group.tag, local, shells, generations: VecDeque::new(), exchanging: false, in_flight: 0 }
        });
        match barrier.generations.iter_mut().find(|g| !g.contains(&task)) {
            Some(generation) => generation.push(task),
            None => barrier.generations.push_back(vec![task]),
        }
        self.advance_group(host, &name);
    }

    /// The host's group exchange `id` finished: `Ok` with every member shell's contribution, or `Err` with
    /// why it failed. Every member waiting in that generation of the barrier is answered.
    pub fn group_complete(&mut self, host: &mut dyn Host, id: &[u8], result: Result<&[&[u8]], &str>) {
        let known =
            std::str::from_utf8(id).ok().filter(|name| self.groups.barriers.get(*name).is_some_and(|b| b.exchanging));
        let Some(name) = known.map(str::to_string) else {
            let id = String::from_utf8_lossy(id);
            host.log(log::Level::Error, &format!("host bug: group exchange '{id}' completed, which none waits for"));
            return;
        };
        // The host has let go of the part.
        if let Some(b) = self.groups.barriers.get_mut(&name) {
            b.exchanging = false;
            self.group_in_flight -= std::mem::take(&mut b.in_flight);
        }
        let outcome = match result {
            Ok(parts) => self.merge(parts),
            Err(why) => Err(why.to_string()),
        };
        if let Err(why) = &outcome {
            host.log(log::Level::Error, &format!("group barrier {name} failed: {why}"));
        }
        let (code, why) = match &outcome {
            Ok(()) => (rc::SUCCESS, ""),
            Err(why) => (rc::FAIL, why.as_str()),
        };
        self.end_generation(host, &name, code, why);
        self.advance_group(host, &name);
    }

    /// A task left or finalized: every group barrier it is a member of and has not entered can no longer
    /// end, and fails for those waiting in it.
    pub(super) fn check_groups(&mut self, host: &mut dyn Host) {
        let names: Vec<String> = self.groups.barriers.keys().cloned().collect();
        for name in names {
            self.advance_group(host, &name);
        }
    }

    /// Ends (here, or by handing it to the host) the oldest generation of barrier `name` once every local
    /// member is in; fails it when a member that is not in never can be.
    fn advance_group(&mut self, host: &mut dyn Host, name: &str) {
        loop {
            let Some(b) = self.groups.barriers.get(name) else { return };
            let Some(head) = b.generations.front() else {
                self.groups.barriers.remove(name);
                return;
            };
            if b.exchanging {
                return;
            }
            let absent =
                b.local.iter().copied().find(|t| !head.contains(t) && self.clients[*t].status != Status::Active);
            if let Some(task) = absent {
                let c = &self.clients[task];
                let error = JobError::TaskLost { rank: c.rank, finalized: c.status == Status::Finalized };
                let why = error.to_string();
                self.report(host, task, error);
                self.end_generation(host, name, rc::FAIL, &why);
                continue;
            }
            if head.len() < b.local.len() {
                return;
            }
            let (world, alone) = (name.starts_with("WORLD:"), b.shells.len() == 1);
            let shells = b.shells.clone();
            let contribution = match world {
                // Every shell takes part: this shell's puts are all delivered, as by a plain barrier.
                true => {
                    self.clients.iter_mut().for_each(|c| c.group_puts = Vec::new());
                    self.group_pending = 0;
                    std::mem::take(&mut self.contribution)
                }
                false if alone => Vec::new(),
                false => b.local.iter().flat_map(|&t| self.clients[t].group_puts.iter().copied()).collect(),
            };
            if alone {
                self.end_generation(host, name, rc::SUCCESS, "");
                continue;
            }
            // The host holds the part until it answers: it counts against the store's bound, so that a task
            // cannot make a host hold its puts once for every group barrier it has outstanding.
            let held = self.kvs_bytes().saturating_add(contribution.len());
            if held > self.limits.kvs_bytes_max {
                let why = format!(
                    "group barrier {name} would carry {} bytes of puts, over what the job's key-value store bound \
                     of {} bytes leaves beside what this node holds",
                    contribution.len(),
                    self.limits.kvs_bytes_max
                );
                host.log(log::Level::Error, &why);
                self.end_generation(host, name, rc::ERR_NOMEM, &why);
                continue;
            }
            let started = host.group_collective(&GroupExchange { id: name.as_bytes(), shells: &shells }, &contribution);
            match started {
                Ok(()) => {
                    if let Some(b) = self.groups.barriers.get_mut(name) {
                        b.exchanging = true;
                        b.in_flight = contribution.len();
                    }
                    self.group_in_flight += contribution.len();
                    return;
                }
                Err(why) => {
                    host.log(log::Level::Error, &format!("group barrier {name} failed: {why}"));
                    self.end_generation(host, name, rc::FAIL, &why);
                }
            }
        }
    }

    /// Answers every task in the oldest generation of barrier `name`, and drops that generation.
    fn end_generation(&mut self, host: &mut dyn Host, name: &str, code: i32, why: &str) {
        let Some(b) = self.groups.barriers.get_mut(name) else { return };
        let Some(tasks) = b.generations.pop_front() else { return };
        let tag = b.tag;
        for task in tasks {
            let Shell { clients, ready, trace, .. } = self;
            let c: &mut Client = &mut clients[task];
            c.groups_entered = c.groups_entered.saturating_sub(1);
            if c.status == Status::Gone {
                continue;
            }
            super::respond(c, ready, *trace, host, |out| {
                Line::new(out, "barrier_out", code).int("tag", tag).msg(why).finish()
            });
        }
    }
}

//! PMI 1.2's group barriers: `cmd=barrier_in group=G` ([`crate::wire::group`]), answered
//! `cmd=barrier_out tag=T`.
//!
//! Served only to clients the server answered 1.2 at `init`: those that asked for 1.2 or later, when the host
//! runs group exchanges ([`Server::serve_groups`]). Such a client (MPICH's, answered 1.2, turns on its
//! threaded mode) may then have several group barriers outstanding (one per thread), answered in any order,
//! and send other requests meanwhile: a group barrier does not hold the connection's lock-step.
//!
//! - **Generations.** A barrier is named by its group's one written form (members and tag). A member that
//!   enters it again before it ended joins the next generation; generations end first in, first out, and
//!   only the oldest is ever exchanged.
//! - **Where it runs.** `NODE:<tag>`, and any group whose members are all on this server, ends here once every
//!   local member is in. Any other goes to the host as a group exchange among only the shells that hold
//!   members ([`Host::group_collective`]), once every local member is in; the others never hear of it.
//! - **What it moves.** The puts of this server's members since the job's last world exchange (a plain
//!   barrier, or a `WORLD` group): only theirs, and only to the member shells. They are offered again at the
//!   next world exchange, which every server takes part in; a server that has them already keeps them as they
//!   are.
//! - **What it holds.** Each barrier is charged to the store's bound (`kvs_bytes_max`, in
//!   [`Server::kvs_bytes`]) what it holds ([`Barrier::cost`]): its map entry (twice: a B-tree's nodes may be
//!   half empty), its name, its members on this server (a bit each; none for `WORLD` and `NODE`, which have
//!   them all), its list of member shells (none for `WORLD`, whose barriers share the server's one list of the
//!   job's shells, nor for a group on this server alone) and its generations (a bit per local task each, at
//!   their buffer's capacity), with a heap block's overhead for each. A `WORLD:1234` barrier of a server of
//!   128 tasks is charged 346 bytes, whatever the job's size. A task's barrier that would take the store
//!   over its bound is answered `barrier_out rc=2` (`PMI_ERR_NOMEM`) and not entered, as a put over it is
//!   refused; its other barriers, and the other tasks, go on. Measured (tests/bounds.rs,
//!   `outstanding_group_barriers_are_bounded_by_the_store`): 128 tasks of an 8192-node job, 64 `WORLD`
//!   barriers each of tags their own, under a 1 MiB bound, grew the process by 267 MiB when each barrier
//!   kept its list of every node and of the local tasks, uncharged; now 3033 barriers are held (charged
//!   1,048,308 bytes; each takes 256, measured), 5159 are refused, and the process grows by 850 to 910
//!   KiB. With groups of 121 ranks on as many shells (names of about 1 KB), 14 MiB before; now 603 held
//!   (about 1.7 KB each, as charged), and 1.2 MiB.
//! - **Never hangs.** A member on this server that left, or finalized, before it entered fails the barrier at
//!   once for every member waiting here, and the job with it, naming the rank. A member on another server is
//!   that server's to report; its host ends the job.

use super::{Client, Server, TaskStatus};
use crate::server::effect::{Effect, JobError, TaskId, GROUP_ID_MAX};
use crate::wire::group::{Group, Members};
use crate::wire::response::{rc, Line};
use std::collections::BTreeMap;
use std::ops::Bound::{Excluded, Unbounded};

/// A task may have this many group barriers outstanding at once (MPICH has one per thread); one more is a
/// protocol error. It bounds what a task can make the server hold.
pub(super) const OUTSTANDING_MAX: usize = 64;

/// What one heap block costs beyond the bytes asked for, at most (glibc's malloc: an 8-byte header, a
/// multiple of 16, at least 32 bytes).
const BLOCK_OVERHEAD: usize = 32;

/// What a barrier is charged beyond its heap blocks: its entry in the map, key and value, twice (a B-tree's
/// nodes may be half empty), and a heap block's overhead for its share of the tree's nodes (256 bytes on
/// 64-bit Linux).
const ENTRY_OVERHEAD: usize = 2 * std::mem::size_of::<(Box<str>, Barrier)>() + BLOCK_OVERHEAD;

/// What a heap block of `n` bytes is charged (none when nothing is allocated).
fn block(n: usize) -> usize {
    match n {
        0 => 0,
        n => n + BLOCK_OVERHEAD,
    }
}

/// One group barrier of this server, by its group's written form.
pub(super) struct Barrier {
    tag: i64,
    /// Its members on this server, one bit per task; `None`: every task (`WORLD` and `NODE`).
    local: Option<Box<[u64]>>,
    /// The shells that hold members.
    shells: Shells,
    /// The tasks in each generation not yet ended, oldest first: a set of tasks each, one bit per task,
    /// one after another.
    generations: Vec<u64>,
    /// The oldest generation went to the host, whose answer is due.
    exchanging: bool,
    /// The bytes of the part that went to the host, which holds them until it answers.
    in_flight: usize,
    /// What it is charged now ([`Barrier::cost`]), in [`Groups::bytes`].
    charged: usize,
}

/// The shells that hold a barrier's members.
enum Shells {
    /// Every server of the job: [`Groups::world`], the one list every `WORLD` barrier shares.
    World,
    /// This server alone: the barrier ends here.
    Alone,
    /// Ascending, this one among them, at least two.
    List(Box<[u32]>),
}

impl Barrier {
    /// What it holds, as charged against the store's bound: its entry, its name, its lists of members (local
    /// tasks and shells; none for `WORLD` and `NODE`) and its generations, at their capacity.
    fn cost(&self, name_len: usize) -> usize {
        let local = self.local.as_ref().map_or(0, |set| block(8 * set.len()));
        let shells = match &self.shells {
            Shells::List(list) => block(4 * list.len()),
            Shells::World | Shells::Alone => 0,
        };
        ENTRY_OVERHEAD + block(name_len) + local + shells + block(8 * self.generations.capacity())
    }

    /// Whether local task `task` is a member.
    fn has_member(&self, task: TaskId) -> bool {
        self.local.as_deref().is_none_or(|set| has(set, task))
    }

    /// Its members on this server, of `tasks`.
    fn member_count(&self, tasks: usize) -> usize {
        self.local.as_deref().map_or(tasks, count)
    }

    /// Whether `task` is in a generation not yet ended (sets of `words` words).
    fn is_in(&self, task: TaskId, words: usize) -> bool {
        self.generations.chunks_exact(words).any(|g| has(g, task))
    }
}

/// Whether the set of tasks `set` holds `task`.
fn has(set: &[u64], task: TaskId) -> bool {
    set.get(task / 64).is_some_and(|w| w >> (task % 64) & 1 == 1)
}

fn add(set: &mut [u64], task: TaskId) {
    set[task / 64] |= 1 << (task % 64);
}

/// How many tasks the set `set` holds.
fn count(set: &[u64]) -> usize {
    set.iter().map(|w| w.count_ones() as usize).sum()
}

/// The tasks in the set `set`, ascending.
fn tasks(set: &[u64]) -> impl Iterator<Item = TaskId> + '_ {
    set.iter().enumerate().flat_map(|(i, &w)| (0..64).filter(move |b| w >> b & 1 == 1).map(move |b| i * 64 + b))
}

/// Every group barrier some member on this server has entered.
#[derive(Default)]
pub(super) struct Groups {
    barriers: BTreeMap<Box<str>, Barrier>,
    /// Every server of the job, ascending: made for the first `WORLD` barrier, and shared by all of them.
    world: Option<Box<[u32]>>,
    /// What the barriers are charged together ([`Barrier::cost`]).
    bytes: usize,
}

impl Groups {
    /// Whether any group barrier is still to end: a task leaving now may leave others waiting.
    pub(super) fn any(&self) -> bool {
        !self.barriers.is_empty()
    }

    /// What the group barriers hold, charged against the store's bound beside its entries.
    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Charges barrier `name` what it holds now.
    fn recharge(&mut self, name: &str) {
        if let Some(b) = self.barriers.get_mut(name) {
            let cost = b.cost(name.len());
            self.bytes = self.bytes - b.charged + cost;
            b.charged = cost;
        }
    }

    fn remove(&mut self, name: &str) {
        if let Some(b) = self.barriers.remove(name) {
            self.bytes -= b.charged;
        }
    }
}

impl Server {
    /// How many words a set of this server's tasks takes, one bit per task.
    fn set_words(&self) -> usize {
        self.clients.len().div_ceil(64).max(1)
    }

    /// `barrier_in group=G` from a task that negotiated 1.2.
    pub(super) fn enter_group(&mut self, task: TaskId, text: &[u8]) {
        let line = &[&b"cmd=barrier_in group="[..], text].concat();
        let size = self.bounds.size;
        let rank = self.clients[task].rank;
        let group = match Group::parse(text, size) {
            Ok(g) if g.contains(rank) => g,
            Ok(_) => return self.protocol_error(task, line, "a group barrier over a group without the rank"),
            Err(why) => return self.protocol_error(task, line, &format!("a group barrier whose group {why}")),
        };
        let name = group.to_string();
        if name.len() > GROUP_ID_MAX {
            let why = format!("a group barrier whose group is longer than {GROUP_ID_MAX} bytes");
            return self.protocol_error(task, line, &why);
        }
        if self.clients[task].groups_entered >= OUTSTANDING_MAX {
            let why = format!("more than {OUTSTANDING_MAX} group barriers outstanding at once");
            return self.protocol_error(task, line, &why);
        }
        let words = self.set_words();
        // The answer names the tag alone: two of the task's barriers with one tag could not be told apart.
        let clash =
            self.groups.barriers.iter().find(|(n, b)| b.tag == group.tag && ***n != *name && b.is_in(task, words));
        if let Some((other, _)) = clash {
            let why = format!("a group barrier with the tag of {other}, which the rank is still in");
            return self.protocol_error(task, line, &why);
        }
        // What the barrier comes to hold more is charged to the store's bound, before it is taken.
        let joined = match self.groups.barriers.get(name.as_str()) {
            Some(b) => match b.generations.chunks_exact(words).position(|g| !has(g, task)) {
                Some(generation) => Join::Generation(generation),
                None => {
                    let (len, capacity) = (b.generations.len(), b.generations.capacity());
                    let grown = if len + words <= capacity { capacity } else { (2 * capacity).max(len + words) };
                    Join::Next { grown, more: block(8 * grown) - block(8 * capacity) }
                }
            },
            None => {
                let barrier = self.new_barrier(&group, task);
                let more = barrier.cost(name.len());
                Join::New(barrier, more)
            }
        };
        let more = match &joined {
            Join::Generation(_) => 0,
            Join::Next { more, .. } | Join::New(_, more) => *more,
        };
        if more > 0 && self.kvs_bytes().saturating_add(more) > self.limits.kvs_bytes_max {
            let why = format!(
                "group barrier {name} would hold {more} bytes more, over what the job's key-value store bound of {} \
                 bytes leaves beside what this node holds",
                self.limits.kvs_bytes_max
            );
            self.log(log::Level::Error, why.clone());
            let Server { clients, ready, trace, effects, .. } = self;
            return super::respond(&mut clients[task], ready, trace.then_some(effects), |out| {
                Line::new(out, "barrier_out", rc::ERR_NOMEM).int("tag", group.tag).msg(&why).finish()
            });
        }
        self.clients[task].groups_entered += 1;
        let name = name.into_boxed_str();
        match joined {
            Join::Generation(generation) => {
                let b = self.groups.barriers.get_mut(&name).expect("the barrier joined");
                add(&mut b.generations[generation * words..][..words], task);
            }
            Join::Next { grown, .. } => {
                let b = self.groups.barriers.get_mut(&name).expect("the barrier joined");
                b.generations.reserve_exact(grown - b.generations.len());
                let at = b.generations.len();
                b.generations.resize(at + words, 0);
                add(&mut b.generations[at..], task);
                self.groups.recharge(&name);
            }
            Join::New(barrier, _) => {
                self.groups.barriers.insert(name.clone(), barrier);
                self.groups.recharge(&name);
            }
        }
        self.advance_group(&name);
    }

    /// A barrier of `group`, which `task` is the first to enter.
    fn new_barrier(&mut self, group: &Group, task: TaskId) -> Barrier {
        let words = self.set_words();
        let Server { groups, clients, job, .. } = self;
        let (local, shells) = match &group.members {
            Members::World => {
                let world = groups.world.get_or_insert_with(|| (0..job.task_map.node_count() as u32).collect());
                (None, if world.len() > 1 { Shells::World } else { Shells::Alone })
            }
            Members::Node => (None, Shells::Alone),
            Members::Ranks(ranks) => {
                let mut set = vec![0; words].into_boxed_slice();
                clients.iter().filter(|c| group.contains(c.rank)).for_each(|c| add(&mut set, c.task));
                let mut shells: Vec<u32> = ranks.iter().filter_map(|&r| job.task_map.node_of(r)).collect();
                shells.sort_unstable();
                shells.dedup();
                let shells = match shells.len() {
                    0 | 1 => Shells::Alone,
                    _ => Shells::List(shells.into_boxed_slice()),
                };
                (Some(set), shells)
            }
        };
        let mut generations = vec![0; words];
        add(&mut generations, task);
        Barrier { tag: group.tag, local, shells, generations, exchanging: false, in_flight: 0, charged: 0 }
    }

    /// The host's group exchange `id` finished: `Ok` with every member server's contribution, or `Err` with
    /// why it failed. Every member waiting in that generation of the barrier is answered.
    pub fn group_complete(&mut self, id: &[u8], result: Result<&[&[u8]], &str>) {
        let known =
            std::str::from_utf8(id).ok().filter(|name| self.groups.barriers.get(*name).is_some_and(|b| b.exchanging));
        let Some(name) = known.map(str::to_string) else {
            let id = String::from_utf8_lossy(id);
            self.log(log::Level::Error, format!("host bug: group exchange '{id}' completed, which none waits for"));
            return;
        };
        // The host has let go of the part.
        if let Some(b) = self.groups.barriers.get_mut(name.as_str()) {
            b.exchanging = false;
            self.group_in_flight -= std::mem::take(&mut b.in_flight);
        }
        let outcome = match result {
            Ok(parts) => self.merge(parts),
            Err(why) => Err(why.to_string()),
        };
        if let Err(why) = &outcome {
            self.log(log::Level::Error, format!("group barrier {name} failed: {why}"));
        }
        let (code, why) = match &outcome {
            Ok(()) => (rc::SUCCESS, ""),
            Err(why) => (rc::FAIL, why.as_str()),
        };
        self.end_generation(&name, code, why);
        self.advance_group(&name);
    }

    /// A task left or finalized: every group barrier it is a member of and has not entered can no longer
    /// end, and fails for those waiting in it.
    pub(super) fn check_groups(&mut self) {
        // One name at a time: a copy of every name would be as large again as what the barriers hold.
        let mut next = self.groups.barriers.keys().next().cloned();
        while let Some(name) = next {
            self.advance_group(&name);
            next = self.groups.barriers.range::<str, _>((Excluded(&*name), Unbounded)).next().map(|(n, _)| n.clone());
        }
    }

    /// Ends (here, or by handing it to the host) the oldest generation of barrier `name` once every local
    /// member is in; fails it when a member that is not in never can be.
    fn advance_group(&mut self, name: &str) {
        let words = self.set_words();
        loop {
            let Some(b) = self.groups.barriers.get(name) else { return };
            let Some(head) = b.generations.get(..words) else {
                self.groups.remove(name);
                return;
            };
            if b.exchanging {
                return;
            }
            let absent = (0..self.clients.len())
                .find(|&t| b.has_member(t) && !has(head, t) && self.clients[t].status != TaskStatus::Active);
            if let Some(task) = absent {
                let c = &self.clients[task];
                let error = JobError::TaskLost { rank: c.rank, finalized: c.status == TaskStatus::Finalized };
                let why = error.to_string();
                self.report(task, error);
                self.end_generation(name, rc::FAIL, &why);
                continue;
            }
            if count(head) < b.member_count(self.clients.len()) {
                return;
            }
            let (world, alone) = (name.starts_with("WORLD:"), matches!(b.shells, Shells::Alone));
            let contribution = match world {
                // Every server takes part: this server's puts are all delivered, as by a plain barrier.
                true => {
                    self.clients.iter_mut().for_each(|c| c.group_puts = Vec::new());
                    self.group_pending = 0;
                    std::mem::take(&mut self.contribution)
                }
                false if alone => Vec::new(),
                false => (0..self.clients.len())
                    .filter(|&t| b.has_member(t))
                    .flat_map(|t| self.clients[t].group_puts.iter().copied())
                    .collect(),
            };
            if alone {
                self.end_generation(name, rc::SUCCESS, "");
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
                self.log(log::Level::Error, why.clone());
                self.end_generation(name, rc::ERR_NOMEM, &why);
                continue;
            }
            let Groups { barriers, world, .. } = &self.groups;
            let shells = match barriers.get(name).map(|b| &b.shells) {
                Some(Shells::List(list)) => &list[..],
                _ => world.as_deref().unwrap_or_default(),
            };
            let shells = shells.to_vec();
            if let Some(b) = self.groups.barriers.get_mut(name) {
                b.exchanging = true;
                b.in_flight = contribution.len();
            }
            self.group_in_flight += contribution.len();
            self.emit(Effect::GroupCollective { id: name.as_bytes().to_vec(), shells, contribution });
            return;
        }
    }

    /// Answers every task in the oldest generation of barrier `name`, and drops that generation.
    fn end_generation(&mut self, name: &str, code: i32, why: &str) {
        let words = self.set_words();
        let Some(b) = self.groups.barriers.get_mut(name) else { return };
        if b.generations.len() < words {
            return;
        }
        let ended: Vec<u64> = b.generations.drain(..words).collect();
        let tag = b.tag;
        self.groups.recharge(name);
        for task in tasks(&ended) {
            let Server { clients, ready, trace, effects, .. } = self;
            let c: &mut Client = &mut clients[task];
            c.groups_entered = c.groups_entered.saturating_sub(1);
            if c.status == TaskStatus::Gone {
                continue;
            }
            super::respond(c, ready, trace.then_some(&mut *effects), |out| {
                Line::new(out, "barrier_out", code).int("tag", tag).msg(why).finish()
            });
        }
    }
}

/// How a task's entry joins a barrier.
enum Join {
    /// The generation of this index, which it is not in.
    Generation(usize),
    /// A generation of its own, after the others, which grows them to `grown` words (charged `more`).
    Next { grown: usize, more: usize },
    /// A barrier it is the first to enter, charged the second.
    New(Barrier, usize),
}

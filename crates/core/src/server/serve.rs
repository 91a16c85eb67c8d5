//! [`Server`]: the PMI server (PMI-1, 1.2 and 2) of one job shell (node), serving all of its local tasks.
//!
//! Sans-I/O: the host feeds the bytes each task wrote ([`Server::receive`]), says when a task's connection
//! closed ([`Server::disconnected`]), hands back what it finished ([`Server::collective_complete`],
//! [`Server::host_reply`], [`Server::untyped_reply`]), and writes out what the server queued for each task
//! ([`Server::next_ready`], [`Server::output`], [`Server::consume`]). Everything the server needs from outside
//! it queues as an [`Effect`], which the host takes out ([`Server::next_effect`]) once the call returns.
//!
//! **Back-pressure.** A task's input is not parsed while more than [`HELD_ABOVE`] bytes of its answers are
//! unsent: the rest of what the host passed is held ([`Server::holds_input`]), the host reads nothing more
//! from the task meanwhile, and calls [`Server::resume`] once it has written the task's output. So what a
//! task that pipelines requests without reading the answers costs is bounded by one read of input and
//! about [`HELD_ABOVE`] bytes of answers, however many requests it sends.

use super::effect::{Effect, HostReply, HostRequest, JobError, Service, Speaker, TaskId};
use super::kvs::{self, EntryBounds, Kvs, PutError, Stored};
use super::{excerpt, JobInfo, Limits};
use crate::wire::pmi2::Writer;
use crate::wire::response::{rc, Line, MAX_LINE};
use crate::wire::spawn::Progress;
use crate::wire::{parse, Request, SpawnBuilder};
use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;

/// The key under which the server provides the task map (RFC 13).
pub const PROCESS_MAPPING_KEY: &str = "PMI_process_mapping";

/// A PMI-1 key under this prefix names a node attribute (PMI-2's, without the prefix): Flux's libpmi2 writes
/// `PMI2_Info_PutNodeAttr` and `GetNodeAttr` as PMI-1 puts and gets of `local::NAME`, which its own server
/// keeps per node and shows the node's tasks at once, without a barrier.
const LOCAL_KEY_PREFIX: &[u8] = b"local::";

/// The revision of rpmi's own additions to the wire that this server answers, to a client that says at `init`
/// that it speaks them (`rpmi=R`, which rpmi's client libraries send; docs/libpmi.md): 1, a client may write
/// its puts ahead of its barrier in one write, and read their answers after (any server that reads requests
/// as a stream takes that, but not every one does).
/// 2, a client may ask for the image of the node's key-value space after the last fence (`get_kvs_image`,
/// PMI-2's `kvs-image`), which comes as a sealed memory file with the answer ([`Server::attached`]).
/// 3, the node barrier: the first full barrier's answer may bring the node's page, through which the later ones
/// go (`node_barrier_in`, PMI-2's `node-barrier-in`: `node_barrier.rs`).
pub const RPMI_REVISION: i64 = 3;

/// A task's input is held, not parsed, while more than this many bytes of its answers are unsent. PMI-1 is
/// lock-step: a client waits for each answer before it asks again, so it has at most one answer queued
/// (a line of at most 1 KiB, or the `get_ranks2hosts` answer, which is shared and held apart). Only a task
/// that pipelines requests without reading its answers gets here. 64 KiB is one read of the driver: past
/// it, answering more only moves the task's requests into the server's memory as answers.
const HELD_ABOVE: usize = 64 * 1024;

/// The most capacity a task's partial-frame (or partial-line) buffer keeps once what it gathered is whole:
/// any request but a spawn or a long put fits, and a longer one gets a buffer of its own size again.
const PARTIAL_KEPT: usize = 1024;

/// Why a server could not be made from the host's job information.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerError(pub String);

impl fmt::Display for ServerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ServerError {}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TaskStatus {
    Active,
    /// Sent `finalize`; may still be connected.
    Finalized,
    /// Closed, aborted, or cut off after a protocol error: its input is ignored.
    Gone,
}

/// What a task's last request still waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Waiting {
    Nothing,
    /// `barrier_in`, or PMI-2's `kvs-fence`.
    Barrier,
    Host(Service),
}

/// The PMI-2 node attribute a task waits for (`info-getnodeattr` with `wait`), and the `thrid` of that
/// request. Apart from [`Waiting`]: a threaded client's other threads go on meanwhile.
struct NodeWait {
    key: Vec<u8>,
    thrid: Option<Vec<u8>>,
}

/// The protocol a task's connection speaks: PMI-1 lines until its client asks for version 2 at `init`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    Pmi1,
    Pmi2,
}

impl Service {
    /// The response command that answers this service.
    fn response(self) -> &'static str {
        match self {
            Service::Publish => "publish_result",
            Service::Unpublish => "unpublish_result",
            Service::Lookup => "lookup_result",
            Service::Spawn => "spawn_result",
        }
    }
}

struct Client {
    task: TaskId,
    rank: u32,
    status: TaskStatus,
    waiting: Waiting,
    /// The start of a line whose newline has not come yet, or of a PMI-2 frame: never more capacity than
    /// the line's bound or the frame's length, and at most [`PARTIAL_KEPT`] kept once it is whole.
    partial: Vec<u8>,
    /// Response bytes not yet written to the task.
    out: Vec<u8>,
    /// The job's `get_ranks2hosts` answer, the server's one copy, owed after `out`, and how much of it has
    /// been written. While it is owed the task's input is held.
    shared: Option<(Arc<[u8]>, usize)>,
    /// Answers queued while a shared answer is owed, which go after it: the ends of barriers the task waits
    /// in (its input is held meanwhile, so no more), a few short lines.
    after: Vec<u8>,
    /// Input taken in but not parsed, because the task's answers were not being read: the rest of one read,
    /// since the host reads nothing more from the task meanwhile.
    held: Vec<u8>,
    /// In `Server::ready`.
    queued: bool,
    /// A job error naming this task has been reported; do not report it twice.
    reported: bool,
    /// It has sent a line (the host heard of its start).
    spoke: bool,
    protocol: Protocol,
    /// The `thrid` of the PMI-2 request it waits for, echoed in the answer.
    thrid: Option<Vec<u8>>,
    /// The node attribute it waits for, if any.
    node_wait: Option<NodeWait>,
    /// Its PMI-2 `fullinit` said `threaded=TRUE`: while one of its threads waits for a node attribute, the
    /// others may send requests (one of them may put the attribute).
    threaded: bool,
    /// The PMI-1 spawn request coming in, within `spawn_bytes_max` as charged (its items and commands too).
    spawn: Option<SpawnBuilder>,
    /// It was answered PMI 1.2: its `barrier_in` may name a group.
    groups: bool,
    /// Group barriers it is in that have not ended.
    groups_entered: usize,
    /// Its puts since the last world exchange, for the group exchanges of groups it is a member of.
    group_puts: Vec<u8>,
    /// The memory file that goes with the first byte of `out`: the key-value image of a fence (its answer to
    /// `get_kvs_image`), or the node barrier's page (to `get_node_barrier`), each queued when nothing else was.
    attached: Option<Attached>,
    /// It said `rpmi=3` or later at `init`: it can take part in the node barrier.
    speaks_node_barrier: bool,
    /// It is in the barrier by the node barrier's page: released there, not by a line.
    by_page: bool,
}

/// A memory file the host sends with the first byte of a task's output ([`Server::attached`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attached {
    /// The key-value image made after this fence.
    KvsImage(u64),
    /// The node barrier's page.
    NodeBarrier,
}

impl Client {
    /// Whether its answers are backed up: its input is then held, not parsed.
    fn backed_up(&self) -> bool {
        self.out.len() > HELD_ABOVE || self.shared.is_some()
    }

    /// The buffer an answer queued now goes to: after a shared answer still owed, or `out`. A shared answer
    /// is not copied for what comes after it: a task that leaves it unread would hold a copy of its own.
    fn queue_to(&mut self) -> &mut Vec<u8> {
        match self.shared {
            Some(_) => &mut self.after,
            None => &mut self.out,
        }
    }
}

/// The PMI server of one job shell: PMI-1, PMI 1.2 and PMI-2, whichever each task speaks.
pub struct Server {
    job: JobInfo,
    limits: Limits,
    bounds: EntryBounds,
    kvs: Kvs,
    clients: Vec<Client>,
    /// Tasks with output queued, in the order it was queued.
    ready: Vec<TaskId>,
    /// Puts since the last barrier, encoded for the collective.
    contribution: Vec<u8>,
    /// Tasks now waiting in `barrier_in`.
    entered: usize,
    /// Tasks no longer active (finalized or gone): only when there are some can a barrier be unable to
    /// complete, so only then are the clients scanned for one.
    departed: usize,
    collective_pending: bool,
    /// What the host is to carry out, oldest first.
    effects: VecDeque<Effect>,
    trace: bool,
    /// The host runs group exchanges: 1.2 clients are answered 1.2.
    groups_served: bool,
    /// The `get_ranks2hosts` answer, made at the first request: it depends only on the job.
    ranks2hosts: Option<Arc<[u8]>>,
    /// PMI-2's node attributes: this server's own (`info-putnodeattr`), and the bytes they hold, charged to
    /// the same limit as the key-value store.
    node_attrs: std::collections::BTreeMap<Vec<u8>, Vec<u8>>,
    node_attr_bytes: usize,
    /// PMI 1.2's group barriers.
    groups: group::Groups,
    /// The bytes of every task's `group_puts`.
    group_pending: usize,
    /// The bytes of the group exchanges' parts the host holds.
    group_in_flight: usize,
    /// The images of the key-value space made at each fence, for rpmi's client libraries.
    images: image::Images,
    node_barrier: node_barrier::NodeBarrier,
}

impl Server {
    /// A server for `job`'s local tasks. Fails if the job information is inconsistent.
    pub fn new(job: JobInfo, limits: Limits) -> Result<Server, ServerError> {
        limits.validate().map_err(|e| ServerError(e.to_string()))?;
        job.validate(&limits)?;
        let size = u32::try_from(job.task_map.size()).map_err(|_| ServerError("too many ranks".into()))?;
        let bounds = EntryBounds { size, key_max: limits.key_max(), value_max: limits.pmi2_value_max() };
        let mut kvs = Kvs::new(limits.kvs_bytes_max);
        // RFC 13 says an empty value when the mapping does not fit; real clients die on that, and fall back
        // to exchanging hostnames when the key is absent (docs/clients.md). So it is left out instead.
        let mapping = job.task_map.process_mapping();
        if mapping.len() <= limits.value_max() {
            kvs.put(kvs::SERVER, PROCESS_MAPPING_KEY.as_bytes(), mapping.as_bytes())
                .map_err(|e| ServerError(format!("cannot store {PROCESS_MAPPING_KEY}: {e}")))?;
        }
        for (key, value) in &job.preputs {
            let stored = check_preput(&limits, key, value)
                .and_then(|()| kvs.put(kvs::SERVER, key, value).map(|_| ()).map_err(|e| e.to_string()));
            if let Err(why) = stored {
                return Err(ServerError(format!("preput '{}': {why}", super::excerpt(key))));
            }
        }
        let clients = job
            .local_ranks
            .iter()
            .enumerate()
            .map(|(task, &rank)| Client {
                task,
                rank,
                status: TaskStatus::Active,
                waiting: Waiting::Nothing,
                partial: Vec::new(),
                out: Vec::new(),
                shared: None,
                after: Vec::new(),
                held: Vec::new(),
                queued: false,
                reported: false,
                spoke: false,
                protocol: Protocol::Pmi1,
                thrid: None,
                node_wait: None,
                threaded: false,
                spawn: None,
                groups: false,
                groups_entered: 0,
                group_puts: Vec::new(),
                attached: None,
                speaks_node_barrier: false,
                by_page: false,
            })
            .collect();
        Ok(Server {
            job,
            limits,
            bounds,
            kvs,
            clients,
            ready: Vec::new(),
            contribution: Vec::new(),
            entered: 0,
            departed: 0,
            collective_pending: false,
            effects: VecDeque::new(),
            trace: false,
            groups_served: false,
            ranks2hosts: None,
            node_attrs: Default::default(),
            node_attr_bytes: 0,
            groups: Default::default(),
            group_pending: 0,
            group_in_flight: 0,
            images: Default::default(),
            node_barrier: Default::default(),
        })
    }

    /// Hands every line each way to the host as an [`Effect::Trace`] (the wire trace users debug with).
    pub fn set_trace(&mut self, on: bool) {
        self.trace = on;
    }

    /// Whether the host runs group exchanges ([`Effect::GroupCollective`]). The server then answers PMI 1.2
    /// to clients that ask for 1.2 or later, and they may send group barriers; otherwise it answers 1.1. Set
    /// before the tasks' `init`; off by default.
    pub fn serve_groups(&mut self, on: bool) {
        self.groups_served = on;
    }

    /// The oldest effect the host has not taken yet. A host takes them all after each call into the server,
    /// and carries them out in order.
    pub fn next_effect(&mut self) -> Option<Effect> {
        self.effects.pop_front()
    }

    /// Whether effects wait for the host.
    pub fn has_effects(&self) -> bool {
        !self.effects.is_empty()
    }

    fn emit(&mut self, effect: Effect) {
        self.effects.push_back(effect);
    }

    fn log(&mut self, level: log::Level, message: String) {
        self.emit(Effect::Log(level, message));
    }

    /// The job this server serves.
    pub fn job(&self) -> &JobInfo {
        &self.job
    }

    /// The limits this server applies.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Number of local tasks.
    pub fn task_count(&self) -> usize {
        self.clients.len()
    }

    /// The rank of local task `task`.
    pub fn rank_of(&self, task: TaskId) -> Option<u32> {
        self.clients.get(task).map(|c| c.rank)
    }

    /// Whether the server has cut `task` off (protocol error, abort, or closed): the host closes its
    /// connection once the output still queued for it is written.
    pub fn is_cut_off(&self, task: TaskId) -> bool {
        self.clients.get(task).is_none_or(|c| c.status == TaskStatus::Gone)
    }

    /// Bytes this server holds for the job's key-value store, as charged against `kvs_bytes_max`: every
    /// entry (key, value and [`kvs::ENTRY_OVERHEAD`]), the puts since the last barrier, on their way to
    /// the other shells (twice their length: a buffer that grows by doubling), the group exchanges'
    /// parts the host holds, and what the group barriers hold (`group.rs`).
    pub fn kvs_bytes(&self) -> usize {
        self.kvs.bytes() + self.pending_charge(0) + self.node_attr_bytes
    }

    /// Takes in bytes task `task` wrote on its PMI connection, and answers every whole line, unless the
    /// task's answers are backed up: then the rest is held until [`Server::resume`].
    pub fn receive(&mut self, task: TaskId, bytes: &[u8]) {
        let Some(c) = self.clients.get_mut(task) else {
            self.log(log::Level::Error, format!("host bug: bytes for unknown task {task}"));
            return;
        };
        if c.status == TaskStatus::Gone {
            return;
        }
        if !c.held.is_empty() {
            // The host read on although input was held (the driver does not): it goes behind.
            c.held.extend_from_slice(bytes);
            return self.resume(task);
        }
        let taken = self.parse(task, bytes);
        let c = &mut self.clients[task];
        if c.status != TaskStatus::Gone {
            c.held.extend_from_slice(&bytes[taken..]);
        }
    }

    /// Whether the server holds input of `task` that it has not parsed, because the task's answers are backed
    /// up. The host reads nothing more from the task until it has written the task's output and called
    /// [`Server::resume`].
    pub fn holds_input(&self, task: TaskId) -> bool {
        self.clients.get(task).is_some_and(|c| !c.held.is_empty())
    }

    /// Parses the input held for `task`, as far as its answers allow (all of it, when they have all been
    /// written). The host calls it when it has written the task's output, whether or not the task wrote
    /// anything since.
    pub fn resume(&mut self, task: TaskId) {
        let Some(c) = self.clients.get_mut(task) else {
            return;
        };
        if c.held.is_empty() || c.backed_up() {
            return;
        }
        let mut held = std::mem::take(&mut c.held);
        let taken = self.parse(task, &held);
        let c = &mut self.clients[task];
        if c.status != TaskStatus::Gone && taken < held.len() {
            held.drain(..taken);
            c.held = held;
        }
    }

    /// Answers the whole requests of `bytes` in the task's protocol, until the task's answers are backed up;
    /// returns how many bytes it took in (all of them unless it stopped).
    fn parse(&mut self, task: TaskId, bytes: &[u8]) -> usize {
        match self.clients[task].protocol {
            Protocol::Pmi1 => self.parse_lines(task, bytes),
            Protocol::Pmi2 => self.parse_frames(task, bytes),
        }
    }

    /// [`Server::parse`] for PMI-1: whole lines, the first one finishing the line carried over. A line that
    /// switches the task to PMI-2 (`init` asking for version 2) hands the rest to [`Server::parse_frames`].
    fn parse_lines(&mut self, task: TaskId, bytes: &[u8]) -> usize {
        let max = self.limits.request_line_max - 1;
        let mut rest = bytes;
        let c = &mut self.clients[task];
        // Finish the line carried over from the last read; it is the only one ever copied.
        if !c.partial.is_empty() {
            let Some(nl) = memchr::memchr(b'\n', rest) else {
                if c.partial.len() + rest.len() > max {
                    let line = std::mem::take(&mut c.partial);
                    self.line_too_long(task, &line);
                    return bytes.len();
                }
                gather(&mut c.partial, rest, max);
                return bytes.len();
            };
            if c.backed_up() {
                return 0;
            }
            if c.partial.len() + nl > max {
                let line = std::mem::take(&mut c.partial);
                self.line_too_long(task, &line);
                return bytes.len();
            }
            gather(&mut c.partial, &rest[..nl], max);
            let line = std::mem::take(&mut c.partial);
            self.line(task, &line);
            self.clients[task].partial = emptied(line);
            rest = &rest[nl + 1..];
            if self.clients[task].protocol == Protocol::Pmi2 {
                return bytes.len() - rest.len() + self.parse_frames(task, rest);
            }
        }
        while let Some(nl) = memchr::memchr(b'\n', rest) {
            let c = &self.clients[task];
            if c.status == TaskStatus::Gone {
                return bytes.len();
            }
            if c.backed_up() {
                return bytes.len() - rest.len();
            }
            if nl > max {
                self.line_too_long(task, &rest[..nl]);
                return bytes.len();
            }
            self.line(task, &rest[..nl]);
            rest = &rest[nl + 1..];
            if self.clients[task].protocol == Protocol::Pmi2 {
                return bytes.len() - rest.len() + self.parse_frames(task, rest);
            }
        }
        if rest.is_empty() || self.clients[task].status == TaskStatus::Gone {
            return bytes.len();
        }
        if rest.len() > max {
            self.line_too_long(task, rest);
            return bytes.len();
        }
        gather(&mut self.clients[task].partial, rest, max);
        bytes.len()
    }

    /// Task `task`'s PMI connection closed (the task exited, crashed, or closed `PMI_FD`).
    pub fn disconnected(&mut self, task: TaskId) {
        let Some(c) = self.clients.get_mut(task) else {
            return;
        };
        if c.status == TaskStatus::Gone {
            return;
        }
        let finalized = c.status == TaskStatus::Finalized;
        c.partial = Vec::new();
        c.held = Vec::new();
        self.set_status(task, TaskStatus::Gone);
        let c = &mut self.clients[task];
        if c.waiting == Waiting::Barrier {
            c.waiting = Waiting::Nothing;
            c.by_page = false;
            self.entered -= 1;
        }
        // Leaving after finalize, with nobody waiting, is how every task ends.
        if !finalized && (self.entered > 0 || self.collective_pending) {
            self.report(task, JobError::TaskLost { rank: self.clients[task].rank, finalized: false });
        }
        self.emit(Effect::TaskClosed { rank: self.clients[task].rank, finalized });
        self.check_barrier();
    }

    /// The host's collective finished: `Ok` with every server's contribution (this server's included, in any
    /// order), or `Err` with why it failed. Every task waiting in the barrier gets `barrier_out`, with a
    /// non-zero rc if the collective or the data it brought failed.
    pub fn collective_complete(&mut self, result: Result<&[&[u8]], &str>) {
        if !self.collective_pending {
            self.log(log::Level::Error, "host bug: a collective completed while none was started; ignored".into());
            return;
        }
        self.collective_pending = false;
        let outcome = match result {
            Ok(parts) => self.merge(parts),
            Err(why) => Err(why.to_string()),
        };
        match outcome {
            Ok(()) => {
                self.fence_done();
                self.release_barrier(rc::SUCCESS, "")
            }
            Err(why) => self.fail_barrier(&why),
        }
        // A task may have left while the collective ran; the next barrier cannot complete without it.
        self.check_barrier();
    }

    /// Stores every put of an exchange's parts, but this server's own ranks': the store has them already,
    /// and maybe newer (a group exchange's parts may come back after a member put a key again).
    fn merge(&mut self, parts: &[&[u8]]) -> Result<(), String> {
        if parts.iter().any(|p| !p.is_empty()) {
            self.store_changed();
        }
        let beside = self.node_attr_bytes.saturating_add(self.pending_charge(0));
        let (map, me) = (&self.job.task_map, self.node());
        let foreign = |rank: u32| map.node_of(rank) != Some(me);
        parts.iter().try_for_each(|p| self.kvs.merge(p, &self.bounds, beside, foreign)).map_err(|e| e.to_string())
    }

    /// The host's answer to the [`HostRequest`] it took from task `task`.
    pub fn host_reply(&mut self, task: TaskId, reply: HostReply) {
        self.answer(task, |_| reply);
    }

    /// A host's untyped answer (a C host's `service_complete`) to the [`HostRequest`] it took from task
    /// `task`, read by the service the task asked for: `ok` and, for a lookup, the port in `text`; for a
    /// spawn, the comma-separated error codes; on failure, why (`None`: a generic message). An answer for
    /// a task that waits for none is a host bug, logged; a host that takes answers in on other threads
    /// refuses those there.
    pub fn untyped_reply(&mut self, task: TaskId, ok: bool, text: Option<String>) {
        self.answer(task, |service| HostReply::untyped(service, ok, text));
    }

    /// Answers the service request task `task` waits for with what `reply` makes of it.
    fn answer(&mut self, task: TaskId, reply: impl FnOnce(Service) -> HostReply) {
        let Some(c) = self.clients.get_mut(task) else {
            self.log(log::Level::Error, format!("host bug: a reply for unknown task {task}"));
            return;
        };
        let Waiting::Host(service) = c.waiting else {
            let rank = c.rank;
            self.log(log::Level::Error, format!("host bug: a reply for rank {rank}, which asked for nothing"));
            return;
        };
        c.waiting = Waiting::Nothing;
        if c.status == TaskStatus::Gone {
            return;
        }
        let reply = reply(service);
        if c.protocol == Protocol::Pmi2 {
            return self.answer_v2(task, service, reply);
        }
        let cmd = service.response();
        self.respond(task, |out| match (service, reply) {
            (Service::Publish | Service::Unpublish, HostReply::Done) => Line::new(out, cmd, rc::SUCCESS).finish(),
            // A port is one word and, like everything sent, must fit on a 1024-byte line.
            (Service::Lookup, HostReply::Port(port)) if kvs::is_key(port.as_bytes()) && port.len() + 64 <= MAX_LINE => {
                Line::new(out, cmd, rc::SUCCESS).word("port", port.as_bytes()).finish()
            }
            (Service::Spawn, HostReply::Spawned { errcodes }) => {
                let list = errcodes.iter().map(i32::to_string).collect::<Vec<_>>().join(",");
                // A response line holds at most 1024 bytes: a list too long for it is left out when every
                // process started (no errcodes means no errors), and is a failure otherwise.
                if list.len() + 64 <= MAX_LINE {
                    Line::new(out, cmd, rc::SUCCESS).word("errcodes", list.as_bytes()).finish()
                } else if errcodes.iter().all(|&c| c == 0) {
                    Line::new(out, cmd, rc::SUCCESS).finish()
                } else {
                    Line::new(out, cmd, rc::FAIL).msg("some processes failed to start; too many to list").finish()
                }
            }
            (_, HostReply::Failed(why)) => Line::new(out, cmd, rc::FAIL).msg(&why).finish(),
            (_, _) => Line::new(out, cmd, rc::FAIL).msg("the resource manager gave an unusable answer").finish(),
        });
    }

    /// The next task with output queued, if any. The host writes [`Server::output`] and reports what it
    /// wrote with [`Server::consume`]; a task whose output was not all written is queued again by the host
    /// when it can write more.
    pub fn next_ready(&mut self) -> Option<TaskId> {
        let task = self.ready.pop()?;
        self.clients[task].queued = false;
        Some(task)
    }

    /// Output queued for `task`, or its first part: once it is consumed, the rest follows.
    pub fn output(&self, task: TaskId) -> &[u8] {
        match self.clients.get(task) {
            None => &[],
            Some(Client { out, shared: Some((answer, sent)), .. }) if out.is_empty() => {
                answer.get(*sent..).unwrap_or_default()
            }
            Some(c) => &c.out,
        }
    }

    /// The memory file that goes with the first byte of [`Server::output`] of `task`: the host sends it with
    /// that byte (`SCM_RIGHTS`), or, where it cannot, the task reads the answer without one (and reads its keys
    /// on the wire, or its barriers by lines).
    pub fn attached(&self, task: TaskId) -> Option<Attached> {
        self.clients.get(task).and_then(|c| c.attached)
    }

    /// `n` bytes of `task`'s output were written.
    pub fn consume(&mut self, task: TaskId, n: usize) {
        let Some(c) = self.clients.get_mut(task) else {
            return;
        };
        if let (true, Some((answer, sent))) = (c.out.is_empty(), &mut c.shared) {
            *sent = sent.saturating_add(n).min(answer.len());
            if *sent == answer.len() {
                c.shared = None;
                c.out = std::mem::take(&mut c.after);
            }
            return;
        }
        let n = n.min(c.out.len());
        if n > 0 {
            // Its first byte, which the memory file went with, is written.
            c.attached = None;
        }
        c.out.drain(..n);
        // What a backed-up task made the buffer grow to is not kept once written.
        if c.out.is_empty() && c.out.capacity() > HELD_ABOVE {
            c.out = Vec::new();
        }
    }

    /// This server's index among the job's (its node in the task map).
    fn node(&self) -> u32 {
        self.job.local_ranks.first().and_then(|&r| self.job.task_map.node_of(r)).unwrap_or(0)
    }

    /// The host hears of a task's start at its first request.
    fn spoke(&mut self, task: TaskId) {
        if !std::mem::replace(&mut self.clients[task].spoke, true) {
            self.emit(Effect::TaskStarted(self.clients[task].rank));
        }
    }

    fn line(&mut self, task: TaskId, line: &[u8]) {
        let rank = self.clients[task].rank;
        self.spoke(task);
        if self.trace {
            self.emit(Effect::Trace { rank, speaker: Speaker::Client, line: line.to_vec() });
        }
        if let Some(spawn) = self.clients[task].spawn.as_mut() {
            match spawn.line(line) {
                Ok(Progress::More) => {}
                Ok(Progress::Done(request)) => {
                    self.clients[task].spawn = None;
                    self.start_service(task, HostRequest::Spawn(Box::new(request)));
                }
                Err(e) => self.protocol_error(task, line, &e.to_string()),
            }
            return;
        }
        match parse(line) {
            Err(e) => self.protocol_error(task, line, &e.to_string()),
            // PMI-1 is lock-step (RFC 13); only abort may come while a request waits (another thread of the
            // task may call PMI_Abort), and, from a 1.2 client, a group barrier (its threads send them
            // without holding the connection: MPICH's client waits for their answers apart).
            Ok(request) if self.clients[task].waiting != Waiting::Nothing && !self.interleaves(task, &request) => {
                let why = format!("'{}' sent while an earlier request still waits for its answer", request.name());
                self.protocol_error(task, line, &why)
            }
            Ok(request) => self.dispatch(task, request),
        }
    }

    /// Whether `request` may come while the task waits for another answer.
    fn interleaves(&self, task: TaskId, request: &Request<'_>) -> bool {
        match request {
            Request::Abort { .. } => true,
            Request::BarrierIn { group: Some(_) } => self.clients[task].groups,
            _ => false,
        }
    }

    fn dispatch(&mut self, task: TaskId, request: Request<'_>) {
        let rank = self.clients[task].rank;
        match request {
            Request::Init { version, subversion, .. } if self.clients[task].groups_entered > 0 => {
                // Its group barriers would be answered in a protocol it no longer speaks.
                let line = format!("cmd=init pmi_version={version} pmi_subversion={subversion}");
                self.protocol_error(task, line.as_bytes(), "init while group barriers are outstanding");
            }
            Request::Init { version, subversion, rpmi } => {
                // RFC 13: the client names the highest version it speaks, and the answer is never above
                // it. 1.2 (group barriers) only to a client that asked for 1.2 or later, and only when the
                // host runs group exchanges; 1.1 to any other 1.x client (Flux's client accepts exactly
                // 1.1). A client that asks for 2 speaks PMI-2 from its next message on.
                let groups = version == 1 && subversion >= 2 && self.groups_served;
                let (ok, answered) = match (version, subversion) {
                    (1, 0..) if groups => (true, (1, 2)),
                    (1, 0..) => (true, (1, 1)),
                    (2, 0..) => (true, (2, 0)),
                    _ => (false, (1, 1)),
                };
                if !ok {
                    let why = format!(
                        "rank {rank} asked for PMI version {version}.{subversion}; rpmi serves 1.1, 1.2 and 2.0"
                    );
                    self.log(log::Level::Error, why);
                }
                let code = if ok { rc::SUCCESS } else { rc::FAIL };
                self.respond(task, |out| {
                    let l = Line::new(out, "response_to_init", code)
                        .int("pmi_version", answered.0)
                        .int("pmi_subversion", answered.1);
                    match ok {
                        // Only to a client that asked: every other client's answer stays RFC 13's, to the byte.
                        true if rpmi > 0 => l.int("rpmi", RPMI_REVISION.min(rpmi)).finish(),
                        true => l.finish(),
                        false => l.msg("unsupported PMI version").finish(),
                    }
                });
                if answered.0 == 2 {
                    self.clients[task].protocol = Protocol::Pmi2;
                }
                self.clients[task].groups = groups;
                self.clients[task].speaks_node_barrier = ok && rpmi >= 3;
            }
            Request::GetMaxes => {
                let l = &self.limits;
                let (n, k, v) = (l.kvsname_max, l.keylen_max, l.vallen_advertised());
                self.respond(task, |out| {
                    Line::new(out, "maxes", rc::SUCCESS)
                        .int("kvsname_max", n.into())
                        .int("keylen_max", k.into())
                        .int("vallen_max", v.into())
                        .finish()
                });
            }
            Request::GetUniverseSize => {
                let size = self.job.universe_size;
                self.respond(task, |out| {
                    Line::new(out, "universe_size", rc::SUCCESS).int("size", size.into()).finish()
                });
            }
            Request::GetAppnum => {
                let appnum = self.job.appnums[task];
                self.respond(task, |out| Line::new(out, "appnum", rc::SUCCESS).int("appnum", appnum.into()).finish());
            }
            Request::GetMyKvsname => {
                let Server { job, clients, ready, trace, effects, .. } = self;
                respond(&mut clients[task], ready, trace.then_some(effects), |out| {
                    Line::new(out, "my_kvsname", rc::SUCCESS).word("kvsname", job.kvsname.as_bytes()).finish()
                });
            }
            Request::Put { kvsname, key, value } if key.starts_with(LOCAL_KEY_PREFIX) => {
                let code = self.put_local(kvsname, key, value);
                self.respond(task, |out| match code {
                    Ok(()) => Line::new(out, "put_result", rc::SUCCESS).finish(),
                    Err((code, why)) => Line::new(out, "put_result", code).msg(&why).finish(),
                });
            }
            Request::Put { kvsname, key, value } => {
                let code = self.put(task, kvsname, key, value, self.limits.value_max());
                self.respond(task, |out| match code {
                    Ok(()) => Line::new(out, "put_result", rc::SUCCESS).finish(),
                    Err((code, why)) => Line::new(out, "put_result", code).msg(&why).finish(),
                });
            }
            Request::Get { kvsname, key } => {
                let Server { job, clients, kvs, limits, ready, trace, node_attrs, effects, .. } = self;
                let stored = |key: &[u8]| match key.strip_prefix(LOCAL_KEY_PREFIX) {
                    // Flux's client polls while a node's key is not there yet, on this code only.
                    Some(name) => {
                        node_attrs.get(name).map(Vec::as_slice).ok_or((rc::ERR_INVALID_KEY, "not put yet on this node"))
                    }
                    None => kvs.get(key).ok_or((rc::FAIL, "key not found")),
                };
                // A PMI-2 task of the job may have put a value longer than a PMI-1 line holds.
                let found = check_name(job, kvsname)
                    .and_then(|()| check_key(limits, key))
                    .and_then(|()| stored(key).map_err(|(code, why)| (code, why.to_string())))
                    .and_then(|v| match v.len() <= limits.value_max() {
                        true => Ok(v),
                        false => Err((rc::ERR_INVALID_VAL_LENGTH, "value longer than a PMI-1 line holds".into())),
                    });
                respond(&mut clients[task], ready, trace.then_some(effects), |out| match found {
                    Ok(value) => Line::new(out, "get_result", rc::SUCCESS).value(value),
                    Err((code, why)) => Line::new(out, "get_result", code).msg(&why).finish(),
                });
            }
            Request::BarrierIn { group: Some(group) } if self.clients[task].groups => {
                self.enter_group(task, group);
            }
            Request::BarrierIn { .. } => self.enter_barrier(task),
            Request::Finalize => {
                let departs = self.set_status(task, TaskStatus::Finalized);
                self.respond(task, |out| Line::new(out, "finalize_ack", rc::SUCCESS).finish());
                // A finalize again changes nothing: the barriers are not gone over for it.
                if departs {
                    self.check_barrier();
                }
            }
            Request::Abort { exit_code, message } => {
                // Codes beyond i32 are clamped; a missing code is a plain failure.
                let code = exit_code.map_or(1, |c| c.clamp(i64::from(i32::MIN), i64::from(i32::MAX)) as i32);
                let message = message.map(String::from_utf8_lossy).unwrap_or_default();
                self.clients[task].reported = true;
                self.emit(Effect::Abort { rank, exit_code: code, message: message.into_owned() });
                // RFC 13's S:abort is an empty line; MPICH 4.0.2 waits for it.
                self.respond(task, |out| out.push(b'\n'));
                self.leave(task);
            }
            Request::PublishName { service, port } => match (utf8_word(service), utf8_word(port)) {
                (Some(service), Some(port)) => self.start_service(task, HostRequest::Publish { service, port }),
                _ => self.refuse_service(task, Service::Publish, "service and port must be words"),
            },
            Request::UnpublishName { service } => match utf8_word(service) {
                Some(service) => self.start_service(task, HostRequest::Unpublish { service }),
                None => self.refuse_service(task, Service::Unpublish, "service must be a word"),
            },
            Request::LookupName { service } => match utf8_word(service) {
                Some(service) => self.start_service(task, HostRequest::Lookup { service }),
                None => self.refuse_service(task, Service::Lookup, "service must be a word"),
            },
            Request::GetRanks2Hosts => {
                let Server { job, clients, ready, trace, ranks2hosts, effects, .. } = self;
                let answer = ranks2hosts
                    .get_or_insert_with(|| job.task_map.ranks2hosts(&job.hostnames).into_bytes().into())
                    .clone();
                let c = &mut clients[task];
                if *trace {
                    trace_lines(effects, c.rank, &answer);
                }
                // Sent from the server's one copy, however many tasks ask; the task's input is held meanwhile,
                // so it asks for no second one before this one is written (were it to, that one is copied).
                match c.shared {
                    None => c.shared = Some((answer, 0)),
                    Some(_) => c.after.extend_from_slice(&answer),
                }
                queue(c, ready);
            }
            Request::GetKvsImage => self.send_kvs_image(task),
            Request::NodeBarrierIn => self.node_barrier_in(task, b"cmd=node_barrier_in"),
            Request::SpawnBlock => {
                self.clients[task].spawn = Some(SpawnBuilder::new(self.limits.spawn_bytes_max));
            }
        }
    }

    /// Checks and stores a put of a value of at most `value_max` bytes; `Err` holds the rc and message for
    /// the task.
    fn put(
        &mut self,
        task: TaskId,
        kvsname: &[u8],
        key: &[u8],
        value: &[u8],
        value_max: usize,
    ) -> Result<(), (i32, String)> {
        check_name(&self.job, kvsname)?;
        check_key(&self.limits, key)?;
        check_value(value, value_max)?;
        let rank = self.clients[task].rank;
        // Rewrites by the key's owner are all sent at the barrier: the puts on their way are bounded with
        // the store, not by it; so are PMI-2's node attributes.
        // A 1.2 client's put waits in two buffers: the one for every server and its own for group exchanges.
        let copies = 1 + usize::from(self.clients[task].groups);
        let more = kvs::encoded_len(rank, key, value) * copies;
        let pending = self.pending_charge(more).saturating_add(self.node_attr_bytes);
        match self.kvs.put_beside(rank, key, value, pending) {
            Ok(Stored::Changed) => {
                self.store_changed();
                kvs::encode(&mut self.contribution, rank, key, value);
                let c = &mut self.clients[task];
                if c.groups {
                    kvs::encode(&mut c.group_puts, rank, key, value);
                    self.group_pending += kvs::encoded_len(rank, key, value);
                }
                Ok(())
            }
            Ok(Stored::Unchanged) => Ok(()),
            Err(e @ PutError::Taken { .. }) => Err((rc::ERR_INVALID_KEY, e.to_string())),
            Err(e @ PutError::Full { .. }) => Err((rc::ERR_NOMEM, e.to_string())),
        }
    }

    /// What the puts since the last barrier are charged, with `more` bytes of them added: twice their
    /// length, since the buffer that holds them grows by doubling; the parts of group exchanges that
    /// the host holds; and what the group barriers hold.
    fn pending_charge(&self, more: usize) -> usize {
        let buffered = self.contribution.len().saturating_add(self.group_pending).saturating_add(more);
        buffered.saturating_mul(2).saturating_add(self.group_in_flight).saturating_add(self.groups.bytes())
    }

    /// `task` enters the full barrier by its own line (PMI-1's `barrier_in`, PMI-2's `kvs-fence`).
    fn enter_barrier(&mut self, task: TaskId) {
        self.clients[task].waiting = Waiting::Barrier;
        self.entered += 1;
        // The node barrier's count would wait for this task in vain.
        self.break_node_barrier();
        self.check_barrier();
    }

    /// Starts the collective when every local task is in the barrier; fails the barrier when a task that
    /// is not in it never can be.
    fn check_barrier(&mut self) {
        self.check_node_waiters();
        if self.groups.any() {
            self.check_groups();
        }
        if self.collective_pending || self.entered == 0 {
            return;
        }
        let lost = if self.departed == 0 {
            None
        } else {
            self.clients.iter().position(|c| c.waiting != Waiting::Barrier && c.status != TaskStatus::Active)
        };
        if let Some(task) = lost {
            let c = &self.clients[task];
            let error = JobError::TaskLost { rank: c.rank, finalized: c.status == TaskStatus::Finalized };
            let why = error.to_string();
            self.report(task, error);
            self.release_barrier(rc::FAIL, &why);
            return;
        }
        if self.entered == self.clients.len() {
            // Taken, not copied: the store holds the same puts now, and its capacity is not kept either.
            // Puts of a failed barrier are not offered again.
            let contribution = std::mem::take(&mut self.contribution);
            self.clients.iter_mut().for_each(|c| c.group_puts = Vec::new());
            self.group_pending = 0;
            self.collective_pending = true;
            self.emit(Effect::Collective(contribution));
        }
    }

    /// The barrier failed: logged, and every task waiting in it gets a failed `barrier_out` saying why.
    fn fail_barrier(&mut self, why: &str) {
        self.log(log::Level::Error, format!("barrier failed: {why}"));
        self.release_barrier(rc::FAIL, why);
    }

    /// Answers every task waiting in the barrier: by a line, or on the node barrier's page.
    fn release_barrier(&mut self, code: i32, why: &str) {
        self.entered = 0;
        let by_page = self.clients.iter().any(|c| c.waiting == Waiting::Barrier && c.by_page);
        let node_barrier = self.node_barrier_released(code, by_page);
        let Server { clients, ready, trace, effects, .. } = self;
        for c in clients.iter_mut().filter(|c| c.waiting == Waiting::Barrier) {
            c.waiting = Waiting::Nothing;
            if std::mem::take(&mut c.by_page) {
                continue;
            }
            let (protocol, thrid, groups) = (c.protocol, c.thrid.take(), c.groups);
            let node_barrier = node_barrier.filter(|_| c.speaks_node_barrier);
            respond(c, ready, trace.then_some(&mut *effects), |out| match protocol {
                Protocol::Pmi1 => {
                    // A 1.2 client reads the tag of every barrier_out (MPICH 5 has no default for it); a 1.1
                    // client gets the line it knows; rpmi's libraries hear here that the node barrier is on.
                    let line = Line::new(out, "barrier_out", code);
                    let line = if groups { line.int("tag", 0) } else { line };
                    let line = match node_barrier {
                        Some(members) => line.int("node_barrier", members),
                        None => line,
                    };
                    line.msg(why).finish()
                }
                Protocol::Pmi2 => {
                    let frame = Writer::answer(out, "kvs-fence-response", thrid.as_deref(), code);
                    let frame = match node_barrier {
                        Some(members) => frame.str("node_barrier", members.to_string().as_bytes()),
                        None => frame,
                    };
                    frame.errmsg(why).finish()
                }
            });
            if node_barrier.is_some() {
                // With the line's first byte, or that of answers queued before it, which the library reads
                // in the same call.
                c.attached = Some(Attached::NodeBarrier);
            }
        }
    }

    fn start_service(&mut self, task: TaskId, request: HostRequest) {
        self.clients[task].waiting = Waiting::Host(request.service());
        self.emit(Effect::Request { task, request });
    }

    fn refuse_service(&mut self, task: TaskId, service: Service, why: &str) {
        match self.clients[task].protocol {
            Protocol::Pmi1 => self.respond(task, |out| Line::new(out, service.response(), rc::FAIL).msg(why).finish()),
            Protocol::Pmi2 => self.answer_v2(task, service, HostReply::Failed(why.into())),
        }
    }

    fn line_too_long(&mut self, task: TaskId, start: &[u8]) {
        let why = format!("a line longer than {} bytes", self.limits.request_line_max);
        self.protocol_error(task, start, &why);
    }

    /// RFC 13: a protocol error ends the task's connection; the host is told and, by default, ends the job.
    fn protocol_error(&mut self, task: TaskId, line: &[u8], reason: &str) {
        let rank = self.clients[task].rank;
        self.report(task, JobError::Protocol { rank, line: excerpt(line), reason: reason.to_string() });
        self.leave(task);
    }

    /// The task is cut off: its input is ignored from now on; a barrier waiting for it fails.
    fn leave(&mut self, task: TaskId) {
        self.set_status(task, TaskStatus::Gone);
        let c = &mut self.clients[task];
        c.spawn = None;
        c.held = Vec::new();
        // A host request still pending stays so: its answer, when it comes, is dropped quietly.
        if c.waiting == Waiting::Barrier {
            self.entered -= 1;
            c.waiting = Waiting::Nothing;
            c.by_page = false;
        }
        self.check_barrier();
    }

    /// Sets `task`'s status: whether it departed by it (was active, is no more).
    fn set_status(&mut self, task: TaskId, status: TaskStatus) -> bool {
        let c = &mut self.clients[task];
        let departs = c.status == TaskStatus::Active && status != TaskStatus::Active;
        c.status = status;
        if departs {
            self.departed += 1;
            self.break_node_barrier();
        }
        departs
    }

    fn report(&mut self, task: TaskId, error: JobError) {
        if !std::mem::replace(&mut self.clients[task].reported, true) {
            self.emit(Effect::JobError(error));
        }
    }

    fn respond(&mut self, task: TaskId, write: impl FnOnce(&mut Vec<u8>)) {
        let trace = self.trace.then_some(&mut self.effects);
        respond(&mut self.clients[task], &mut self.ready, trace, write);
    }
}

/// Queues a response for one client (a free function so callers can borrow other parts of the server), and
/// its lines on `trace` when tracing.
fn respond(
    c: &mut Client,
    ready: &mut Vec<TaskId>,
    trace: Option<&mut VecDeque<Effect>>,
    write: impl FnOnce(&mut Vec<u8>),
) {
    let rank = c.rank;
    let out = c.queue_to();
    let start = out.len();
    write(out);
    if let Some(effects) = trace {
        trace_lines(effects, rank, &out[start..]);
    }
    queue(c, ready);
}

fn trace_lines(effects: &mut VecDeque<Effect>, rank: u32, answer: &[u8]) {
    for line in answer.split_inclusive(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\n").unwrap_or(line).to_vec();
        effects.push_back(Effect::Trace { rank, speaker: Speaker::Server, line });
    }
}

/// Puts the client in the ready queue, if it is not there yet.
fn queue(c: &mut Client, ready: &mut Vec<TaskId>) {
    if !c.queued {
        c.queued = true;
        // Tasks are few per server and each has one response at a time: a stack is enough.
        ready.push(c.task);
    }
}

fn check_name(job: &JobInfo, kvsname: &[u8]) -> Result<(), (i32, String)> {
    if kvsname == job.kvsname.as_bytes() {
        Ok(())
    } else {
        Err((rc::ERR_INVALID_ARG, "unknown kvsname".into()))
    }
}

fn check_key(limits: &Limits, key: &[u8]) -> Result<(), (i32, String)> {
    if !kvs::is_key(key) {
        Err((rc::ERR_INVALID_KEY, "invalid key".into()))
    } else if key.len() > limits.key_max() {
        Err((rc::ERR_INVALID_KEY_LENGTH, format!("key longer than {}", limits.key_max())))
    } else {
        Ok(())
    }
}

/// A value a get can return: not empty (an empty `value=` token is rejected by clients), on one line, and
/// at most `max` bytes.
fn check_value(value: &[u8], max: usize) -> Result<(), (i32, String)> {
    if value.is_empty() {
        Err((rc::ERR_INVALID_VAL, "empty value".into()))
    } else if value.len() > max {
        Err((rc::ERR_INVALID_VAL_LENGTH, format!("value longer than {max}")))
    } else if value.contains(&b'\n') {
        Err((rc::ERR_INVALID_VAL, "a line break in the value".into()))
    } else {
        Ok(())
    }
}

/// Whether a host may give `key=value` as a preput ([`JobInfo::preputs`]) under `limits`: the rules of a
/// task's put, and on one line (a task's value is one already: it came on one). `Err` says why not.
pub fn check_preput(limits: &Limits, key: &[u8], value: &[u8]) -> Result<(), String> {
    check_key(limits, key).and_then(|()| check_value(value, limits.value_max())).map_err(|(_, why)| why)
}

/// Appends `bytes` to a partial frame (or line) that will be `whole` bytes long: grown by doubling, as a
/// `Vec` is, but never past that length, so that what a task's unfinished frame holds is at most its bytes.
fn gather(partial: &mut Vec<u8>, bytes: &[u8], whole: usize) {
    let need = partial.len() + bytes.len();
    if need > partial.capacity() {
        let grown = (2 * partial.capacity()).clamp(need, whole.max(need));
        partial.reserve_exact(grown - partial.len());
    }
    partial.extend_from_slice(bytes);
}

/// A partial buffer whose frame (or line) has been read, emptied for the next one: its capacity is kept
/// only up to [`PARTIAL_KEPT`].
fn emptied(mut partial: Vec<u8>) -> Vec<u8> {
    if partial.capacity() > PARTIAL_KEPT {
        return Vec::new();
    }
    partial.clear();
    partial
}

fn utf8_word(s: &[u8]) -> Option<String> {
    std::str::from_utf8(s).ok().filter(|w| kvs::is_key(w.as_bytes())).map(String::from)
}

mod group;
mod image;
mod node_barrier;
pub use node_barrier::NodeRelease;
mod pmi2;
#[cfg(test)]
mod tests;

//! The PMI-2 side of the server: frames in ([`crate::wire::pmi2`]), the same job, key-value store, barrier
//! (`kvs-fence`) and host services as PMI-1, and PMI-2's node attributes.
//!
//! A connection speaks PMI-2 once its client asked for version 2 at `cmd=init` (MPICH 4.1 and later with
//! `MPIR_CVAR_PMI_VERSION=2`, Slurm's and Cray's libpmi2). It stays lock-step as PMI-1 is: a request while
//! another waits is a protocol error, but for `abort`, and but for a client whose `fullinit` said
//! `threaded=TRUE`, whose other threads go on while one waits for a node attribute. What differs:
//!
//! - `kvs-get` names a job (`jobid`): only the task's own is known, another fails the request.
//! - `info-getjobattr` answers `PMI_process_mapping` and `universeSize`; every other attribute is not found
//!   (MPICH then goes without it).
//! - Node attributes (`info-putnodeattr`, `info-getnodeattr`) are this server's: the tasks of one node. A get
//!   with `wait=TRUE` of an attribute not put yet is answered when a task puts it, or as not found once no
//!   task of the node could put it any more (every one left or waits too, and none is threaded, whose other
//!   threads could): a job of clients that are not threaded never hangs there for ever. One wait per task.
//! - A spawn's answer carries the error codes of its processes, and fails if any one failed. Its frame is
//!   the one message that may be longer than a request line; it is bounded as PMI-1's lines of a spawn are,
//!   decoded ([`crate::wire::spawn`]: each item and command charged beside the frame's bytes).
//! - `job-connect` and `job-disconnect` are refused with a message.
//!
//! A frame that comes in pieces is gathered in the task's `partial` buffer, which grows no larger than the
//! frame and, once the frame is whole, keeps at most [`super::PARTIAL_KEPT`] bytes of capacity: a connection
//! that once sent a long spawn does not hold its length for the rest of the job.

use super::{
    check_key, check_name, check_value, emptied, gather, kvs, NodeWait, Server, TaskStatus, Waiting, LOCAL_KEY_PREFIX,
    MAX_LINE,
};
use crate::server::effect::{Effect, HostReply, HostRequest, Service, Speaker, TaskId};
use crate::server::PROCESS_MAPPING_KEY;
use crate::wire::pmi2::{body_len, Message, Request2, Writer, HEADER_LEN};
use crate::wire::response::rc;
use crate::wire::spawn::SpawnError;
use crate::wire::ParseError;

/// How a spawn's frame begins, as every client writes it (`cmd` first).
const SPAWN_HEAD: &[u8] = b"cmd=spawn;";

impl Service {
    /// The PMI-2 answer's command.
    fn response_v2(self) -> &'static str {
        match self {
            Service::Publish => "name-publish-response",
            Service::Unpublish => "name-unpublish-response",
            Service::Lookup => "name-lookup-response",
            Service::Spawn => "spawn-response",
        }
    }
}

impl Server {
    /// [`Server::parse`] for PMI-2: whole frames, the first one finishing the frame carried over.
    pub(super) fn parse_frames(&mut self, task: TaskId, bytes: &[u8]) -> usize {
        let mut rest = bytes;
        loop {
            let c = &mut self.clients[task];
            if c.status == TaskStatus::Gone {
                return bytes.len();
            }
            if !c.partial.is_empty() {
                // The frame carried over: its prefix first, then the rest of it.
                let take = HEADER_LEN.saturating_sub(c.partial.len()).min(rest.len());
                gather(&mut c.partial, &rest[..take], HEADER_LEN);
                rest = &rest[take..];
                if c.partial.len() < HEADER_LEN {
                    return bytes.len();
                }
                let header = self.clients[task].partial[..HEADER_LEN].to_vec();
                let total = match self.frame_len(&header) {
                    Ok(total) => total,
                    Err(why) => return self.frame_error(task, &header, &why, bytes.len()),
                };
                if let Some(why) = self.over_line(total, &self.clients[task].partial[HEADER_LEN..], rest) {
                    return self.frame_error(task, &header, &why, bytes.len());
                }
                let c = &mut self.clients[task];
                let want = total - c.partial.len();
                if rest.len() < want {
                    gather(&mut c.partial, rest, total);
                    return bytes.len();
                }
                if c.backed_up() {
                    return bytes.len() - rest.len();
                }
                gather(&mut c.partial, &rest[..want], total);
                rest = &rest[want..];
                let frame = std::mem::take(&mut c.partial);
                self.frame(task, &frame[HEADER_LEN..]);
                self.clients[task].partial = emptied(frame);
                continue;
            }
            if rest.len() < HEADER_LEN {
                gather(&mut c.partial, rest, HEADER_LEN);
                return bytes.len();
            }
            let total = match self.frame_len(&rest[..HEADER_LEN]) {
                Ok(total) => total,
                Err(why) => return self.frame_error(task, &rest[..HEADER_LEN], &why, bytes.len()),
            };
            if let Some(why) = self.over_line(total, &rest[HEADER_LEN..], &[]) {
                return self.frame_error(task, &rest[..HEADER_LEN], &why, bytes.len());
            }
            let c = &mut self.clients[task];
            if rest.len() < total {
                gather(&mut c.partial, rest, total);
                return bytes.len();
            }
            if c.backed_up() {
                return bytes.len() - rest.len();
            }
            self.frame(task, &rest[HEADER_LEN..total]);
            rest = &rest[total..];
        }
    }

    /// Why a frame of `total` bytes whose body begins with `held` then `more` is refused before it is read:
    /// only a spawn may be longer than a request line, and what the server holds of any other frame stays
    /// within that. `None` while what came may still be the start of a spawn.
    fn over_line(&self, total: usize, held: &[u8], more: &[u8]) -> Option<String> {
        let (len, max) = (total - HEADER_LEN, self.limits.request_line_max);
        if len <= max || held.iter().chain(more).zip(SPAWN_HEAD).all(|(a, b)| a == b) {
            return None;
        }
        Some(format!("a PMI-2 message of {len} bytes, over the limit of {max} (only a spawn may be longer)"))
    }

    /// The whole length of the frame whose prefix is `header`, within the limits: a spawn is the longest
    /// request (any other over a line's limit is refused as soon as its first bytes say it is no spawn).
    fn frame_len(&self, header: &[u8]) -> Result<usize, String> {
        let max = self.limits.request_line_max.max(self.limits.spawn_bytes_max);
        match body_len(header) {
            Some(len) if len <= max => Ok(HEADER_LEN + len),
            Some(len) => Err(format!("a PMI-2 message of {len} bytes, over the limit of {max}")),
            None => Err("no PMI-2 length prefix (6 decimal digits, padded with spaces)".into()),
        }
    }

    fn frame_error(&mut self, task: TaskId, header: &[u8], why: &str, all: usize) -> usize {
        self.clients[task].partial = Vec::new();
        self.protocol_error(task, header, why);
        all
    }

    /// One PMI-2 message of task `task`.
    fn frame(&mut self, task: TaskId, body: &[u8]) {
        let rank = self.clients[task].rank;
        self.spoke(task);
        if self.trace {
            // A frame's values may hold line breaks; a traced line does not.
            let mut line = Vec::with_capacity(body.len());
            for &b in body {
                match b {
                    b'\n' => line.extend_from_slice(b"\\n"),
                    b => line.push(b),
                }
            }
            self.emit(Effect::Trace { rank, speaker: Speaker::Client, line });
        }
        let message = match Message::parse(body) {
            Ok(m) => m,
            Err(e) => return self.protocol_error(task, body, &e.to_string()),
        };
        let request = match message.request() {
            Ok(r) => r,
            Err(e) => return self.protocol_error(task, body, &e.to_string()),
        };
        let c = &self.clients[task];
        let busy = c.waiting != Waiting::Nothing || (c.node_wait.is_some() && !c.threaded);
        if busy && !matches!(request, Request2::Abort { .. }) {
            let why = "a request sent while an earlier one still waits for its answer";
            return self.protocol_error(task, body, why);
        }
        if c.node_wait.is_some() && matches!(request, Request2::GetNodeAttr { wait: true, .. }) {
            let why = "a second wait for a node attribute while one waits (one at a time per task)";
            return self.protocol_error(task, body, why);
        }
        match &request {
            Request2::Spawn(spawn) => {
                // Bounded as its PMI-1 lines would be: what it holds decoded, not only its bytes.
                let max = self.limits.spawn_bytes_max;
                if body.len().saturating_add(spawn.overhead()) > max {
                    let why = ParseError::Spawn(SpawnError::over_limit(max).0).to_string();
                    return self.protocol_error(task, body, &why);
                }
            }
            _ if body.len() > self.limits.request_line_max => {
                let why = format!("a PMI-2 message longer than {} bytes", self.limits.request_line_max);
                return self.protocol_error(task, body, &why);
            }
            _ => {}
        }
        self.clients[task].thrid = message.get("thrid").map(<[u8]>::to_vec);
        self.dispatch_v2(task, request);
    }

    fn dispatch_v2(&mut self, task: TaskId, request: Request2<'_>) {
        let rank = self.clients[task].rank;
        match request {
            Request2::FullInit { pmirank, threaded } => match pmirank {
                Some(r) if r >= 0 && r != i64::from(rank) => {
                    let why = format!("fullinit names rank {r}; this connection is rank {rank}'s");
                    self.answer_fail(task, "fullinit-response", &why);
                }
                _ => {
                    self.clients[task].threaded = threaded;
                    let (size, appnum) = (self.job.task_map.size() as i64, self.job.appnums[task]);
                    // MPICH reads any spawner-jobid as "spawned"; this job's spawner is not named to the server.
                    let spawner = self.job.spawned.then_some(&b"spawner"[..]);
                    // Slurm's libpmi2 requires the version fields and reads `pmiverbose` as a boolean;
                    // MPICH's client reads it as an integer (atoi: FALSE is 0).
                    self.answer_v2_with(task, "fullinit-response", rc::SUCCESS, |f| {
                        let f = f.int("pmi-version", 2).int("pmi-subversion", 0);
                        let f = f.int("rank", rank.into()).int("size", size).int("appnum", appnum.into());
                        let f = match spawner {
                            Some(s) => f.str("spawner-jobid", s),
                            None => f,
                        };
                        f.bool("pmiverbose", false)
                    });
                }
            },
            Request2::JobGetId => {
                let id = self.job.kvsname.clone();
                self.answer_v2_with(task, "job-getid-response", rc::SUCCESS, |f| f.str("jobid", id.as_bytes()));
            }
            Request2::JobConnect | Request2::JobDisconnect => {
                let cmd = if matches!(request, Request2::JobConnect) { "job-connect" } else { "job-disconnect" };
                let why = format!("{cmd} is not served by rpmi: a job's key-value space is its own");
                self.answer_fail(task, &format!("{cmd}-response"), &why);
            }
            Request2::KvsPut { key, value } => {
                let kvsname = self.job.kvsname.clone();
                match self.put(task, kvsname.as_bytes(), key, value, self.limits.pmi2_value_max()) {
                    Ok(()) => self.answer_v2_with(task, "kvs-put-response", rc::SUCCESS, |f| f),
                    Err((_, why)) => self.answer_fail(task, "kvs-put-response", &why),
                }
            }
            Request2::KvsImage => self.send_kvs_image(task),
            Request2::NodeBarrierIn => self.node_barrier_in(task, b"cmd=node-barrier-in;"),
            Request2::KvsFence => self.enter_barrier(task),
            Request2::KvsGet { jobid, key } => {
                // No jobid, or an empty one (Slurm's libpmi2 sends `jobid=;` for a NULL id), is this job's.
                let jobid = jobid.filter(|j| !j.is_empty()).unwrap_or(self.job.kvsname.as_bytes());
                let found = check_name(&self.job, jobid)
                    .map_err(|_| "no job of that jobid: a task reads its own job's key-value space".to_string())
                    .and_then(|()| check_key(&self.limits, key).map_err(|(_, why)| why))
                    .map(|()| self.kvs.get(key).map(<[u8]>::to_vec));
                match found {
                    Ok(value) => self.answer_found(task, "kvs-get-response", value.as_deref()),
                    Err(why) => self.answer_fail(task, "kvs-get-response", &why),
                }
            }
            Request2::GetJobAttr { key } => {
                let value = match key {
                    b"universeSize" => Some(self.job.universe_size.to_string().into_bytes()),
                    k if k == PROCESS_MAPPING_KEY.as_bytes() => self.kvs.get(k).map(<[u8]>::to_vec),
                    _ => None,
                };
                self.answer_found(task, "info-getjobattr-response", value.as_deref());
            }
            Request2::PutNodeAttr { key, value } => match self.put_node_attr(key, value) {
                Ok(()) => self.answer_v2_with(task, "info-putnodeattr-response", rc::SUCCESS, |f| f),
                Err((_, why)) => self.answer_fail(task, "info-putnodeattr-response", &why),
            },
            Request2::GetNodeAttr { key, wait } => {
                if let Err((_, why)) = check_key(&self.limits, key) {
                    return self.answer_fail(task, "info-getnodeattr-response", &why);
                }
                match self.node_attrs.get(key).cloned() {
                    None if wait => {
                        let c = &mut self.clients[task];
                        c.node_wait = Some(NodeWait { key: key.to_vec(), thrid: c.thrid.take() });
                        self.check_node_waiters();
                    }
                    value => self.answer_found(task, "info-getnodeattr-response", value.as_deref()),
                }
            }
            Request2::Abort { exit_code, message } => {
                // Codes beyond i32 are clamped; a missing code is a plain failure. No answer: the client exits.
                let code = exit_code.map_or(1, |c| c.clamp(i64::from(i32::MIN), i64::from(i32::MAX)) as i32);
                let message = message.map(String::from_utf8_lossy).unwrap_or_default();
                self.clients[task].reported = true;
                self.emit(Effect::Abort { rank, exit_code: code, message: message.into_owned() });
                self.leave(task);
            }
            Request2::Finalize => {
                let departs = self.set_status(task, TaskStatus::Finalized);
                self.answer_v2_with(task, "finalize-response", rc::SUCCESS, |f| f);
                if departs {
                    self.check_barrier();
                }
            }
            Request2::Publish { name, port } => match (super::utf8_word(name), super::utf8_word(port)) {
                (Some(service), Some(port)) => self.start_service(task, HostRequest::Publish { service, port }),
                _ => self.refuse_service(task, Service::Publish, "name and port must be words"),
            },
            Request2::Unpublish { name } => match super::utf8_word(name) {
                Some(service) => self.start_service(task, HostRequest::Unpublish { service }),
                None => self.refuse_service(task, Service::Unpublish, "name must be a word"),
            },
            Request2::Lookup { name } => match super::utf8_word(name) {
                Some(service) => self.start_service(task, HostRequest::Lookup { service }),
                None => self.refuse_service(task, Service::Lookup, "name must be a word"),
            },
            Request2::Spawn(spawn) => self.start_service(task, HostRequest::Spawn(Box::new(spawn))),
        }
    }

    /// The answer to the host service task `task` waited for, as PMI-2 has it.
    pub(super) fn answer_v2(&mut self, task: TaskId, service: Service, reply: HostReply) {
        let cmd = service.response_v2();
        match (service, reply) {
            (Service::Publish | Service::Unpublish, HostReply::Done) => {
                self.answer_v2_with(task, cmd, rc::SUCCESS, |f| f)
            }
            // A port is one word, as PMI-1's (an empty one could not be read back).
            // MPICH's client reads the port as `port`, Slurm's libpmi2 as `value`.
            (Service::Lookup, HostReply::Port(port)) if kvs::is_key(port.as_bytes()) && port.len() + 80 <= MAX_LINE => {
                let port = port.as_bytes();
                self.answer_v2_with(task, cmd, rc::SUCCESS, |f| f.str("port", port).str("value", port))
            }
            // A spawn of no process has no codes (and an empty value is none to MPICH's reader).
            (Service::Spawn, HostReply::Spawned { errcodes }) if errcodes.is_empty() => {
                self.answer_v2_with(task, cmd, rc::SUCCESS, |f| f)
            }
            // Slurm's libpmi2 reads a spawn's outcome from `errcodes` alone (not from `rc`).
            (Service::Spawn, HostReply::Spawned { errcodes }) => {
                let codes = errcodes.iter().map(i32::to_string).collect::<Vec<_>>().join(",");
                match errcodes.iter().filter(|&&c| c != 0).count() {
                    0 => self.answer_v2_with(task, cmd, rc::SUCCESS, |f| f.str("errcodes", codes.as_bytes())),
                    n => {
                        let why = format!("{n} of the {} processes failed to start", errcodes.len());
                        self.answer_v2_with(task, cmd, rc::FAIL, |f| f.errmsg(&why).str("errcodes", codes.as_bytes()))
                    }
                }
            }
            (_, HostReply::Failed(why)) => self.answer_fail(task, cmd, &why),
            (_, _) => self.answer_fail(task, cmd, "the resource manager gave an unusable answer"),
        }
    }

    /// Queues `cmd`'s answer to task `task`: `rc`, then what `fields` adds.
    pub(super) fn answer_v2_with(
        &mut self,
        task: TaskId,
        cmd: &str,
        rc: i32,
        fields: impl FnOnce(Writer<'_>) -> Writer<'_>,
    ) {
        let thrid = self.clients[task].thrid.take();
        self.answer_v2_to(task, thrid, cmd, rc, fields);
    }

    /// As [`Server::answer_v2_with`], to the request of `thrid`.
    fn answer_v2_to(
        &mut self,
        task: TaskId,
        thrid: Option<Vec<u8>>,
        cmd: &str,
        rc: i32,
        fields: impl FnOnce(Writer<'_>) -> Writer<'_>,
    ) {
        self.respond(task, |out| fields(Writer::answer(out, cmd, thrid.as_deref(), rc)).finish());
    }

    pub(super) fn answer_fail(&mut self, task: TaskId, cmd: &str, why: &str) {
        self.answer_v2_with(task, cmd, rc::FAIL, |f| f.errmsg(why));
    }

    /// `found=TRUE;value=V;` or `found=FALSE;`.
    fn answer_found(&mut self, task: TaskId, cmd: &str, value: Option<&[u8]>) {
        self.answer_v2_with(task, cmd, rc::SUCCESS, |f| found(f, value));
    }

    /// Answers the node attribute task `task` waits for, to the request that waits: another thread's
    /// request may be the one being answered now.
    fn answer_node_waiter(&mut self, task: TaskId, value: Option<&[u8]>) {
        let thrid = self.clients[task].node_wait.take().and_then(|w| w.thrid);
        self.answer_v2_to(task, thrid, "info-getnodeattr-response", rc::SUCCESS, |f| found(f, value));
    }

    /// A PMI-1 put of `local::NAME` ([`LOCAL_KEY_PREFIX`]): node attribute NAME, which PMI-2 tasks of the
    /// node read too.
    pub(super) fn put_local(&mut self, kvsname: &[u8], key: &[u8], value: &[u8]) -> Result<(), (i32, String)> {
        check_name(&self.job, kvsname)?;
        check_key(&self.limits, key)?;
        self.put_node_attr(&key[LOCAL_KEY_PREFIX.len()..], value)
    }

    /// Stores a node attribute, within the store's limit (charged as a store entry), and answers the tasks
    /// that wait for it; a new value replaces the old.
    fn put_node_attr(&mut self, key: &[u8], value: &[u8]) -> Result<(), (i32, String)> {
        check_key(&self.limits, key)?;
        check_value(value, self.limits.pmi2_value_max())?;
        // Charged as a store entry is, heap blocks and all: a task putting many tiny attributes must not get
        // past the bound through what each costs beyond its bytes.
        let cost = |value: &[u8]| kvs::ENTRY_OVERHEAD + key.len() + value.len();
        let old = self.node_attrs.get(key).map_or(0, |v| cost(v));
        let new = cost(value);
        if self.kvs_bytes() - old + new > self.limits.kvs_bytes_max {
            return Err((
                rc::ERR_NOMEM,
                format!("the node's attributes and key-value store are full ({} bytes)", self.limits.kvs_bytes_max),
            ));
        }
        self.node_attr_bytes = self.node_attr_bytes - old + new;
        self.node_attrs.insert(key.to_vec(), value.to_vec());
        self.wake_node_waiters(key);
        Ok(())
    }

    /// Answers every task waiting for node attribute `key`, just put.
    fn wake_node_waiters(&mut self, key: &[u8]) {
        let value = self.node_attrs.get(key).cloned();
        let waiters: Vec<TaskId> = (0..self.clients.len())
            .filter(|&t| self.clients[t].node_wait.as_ref().is_some_and(|w| w.key == key))
            .collect();
        for t in waiters {
            self.answer_node_waiter(t, value.as_deref());
        }
    }

    /// Tasks waiting for node attributes that no task of the node could put any more (each one has left or
    /// waits itself) get "not found", so that no cycle of waits hangs the job. A threaded task could always
    /// put one from another thread, whatever its threads wait for.
    pub(super) fn check_node_waiters(&mut self) {
        let stuck = self
            .clients
            .iter()
            .filter(|c| c.status == TaskStatus::Active)
            .all(|c| !c.threaded && (c.waiting == Waiting::Barrier || c.node_wait.is_some()));
        if !stuck {
            return;
        }
        for t in 0..self.clients.len() {
            if self.clients[t].node_wait.is_some() {
                self.answer_node_waiter(t, None);
            }
        }
    }
}

/// `found=TRUE;value=V;` or `found=FALSE;`.
fn found<'a>(f: Writer<'a>, value: Option<&[u8]>) -> Writer<'a> {
    match value {
        Some(v) => f.str("value", v).bool("found", true),
        None => f.bool("found", false),
    }
}

//! [`CHost`]: the engine's effects carried out ([`Host`]) by calling a C host's `rpmi_host_ops`.

use super::ffi::{self, rpmi_host_ops, rpmi_instance};
use super::owed::OwedAnswers;
use super::shells::{Action, Fault, Shells};
use crate::launch::SpawnedJob;
use crate::server::{GroupExchange, Host, HostRequest, JobError, NameOp, Server, Speaker, TaskId, NOT_SUPPORTED};
use crate::wire::SpawnRequest;
use std::collections::{HashMap, VecDeque};
use std::ffi::CString;
use std::sync::{Arc, Mutex};

/// A C host, as the engine sees it.
pub struct CHost {
    pub ops: rpmi_host_ops,
    /// The instance handed back to every callback (set once the instance is boxed).
    pub instance: *mut rpmi_instance,
    /// The answers the C host owes, shared with `service_complete`'s callers.
    pub owed: OwedAnswers,
    /// Where the plugin runs the exchanges among the shells (the host's `shell_send`).
    pub shells: Option<(Shells, ShellInbox)>,
}

/// What the host hands the instance from other shells, on any thread, for the progress loop to take.
#[derive(Debug)]
pub enum FromShell {
    Message {
        from: u32,
        kind: u8,
        message: Vec<u8>,
    },
    Lost(u32),
    /// Shell 0: a request of the job's names from outside the job (`serve_name`), answered with the host's
    /// `request` through `name_served`.
    Name {
        request: u64,
        op: NameOp,
        name: String,
        port: String,
    },
    /// The messages unread went over what the instance holds (`max` bytes), shell `from` holding the most:
    /// the message that came then was dropped.
    Overflow {
        from: u32,
        max: usize,
    },
}

/// The messages from other shells not yet taken, held to a bound of bytes.
#[derive(Clone)]
pub struct ShellInbox {
    queue: Arc<Mutex<Inbox>>,
    max: usize,
}

#[derive(Default)]
struct Inbox {
    items: VecDeque<FromShell>,
    bytes: usize,
    /// The bytes each shell has queued, to blame the one that holds the most when the bound is reached.
    by_sender: HashMap<u32, usize>,
    /// Requests of the names from outside the job queued.
    names: usize,
}

/// The most requests of the job's names from outside it that wait for the progress loop at once.
const NAME_REQUESTS_MAX: usize = 1024;

impl ShellInbox {
    /// An inbox that holds at most `max` bytes of messages unread.
    pub fn new(max: usize) -> ShellInbox {
        ShellInbox { queue: Arc::default(), max }
    }

    /// Queues `item`. A message over the bound is dropped, and the shell with the most bytes queued is
    /// blamed (once: the job then ends). `false` if it was dropped.
    pub fn push(&self, item: FromShell) -> bool {
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        if let FromShell::Message { from, message, .. } = &item {
            if q.bytes.saturating_add(message.len()) > self.max {
                let most = q.by_sender.iter().max_by_key(|(_, b)| **b).map_or(*from, |(s, _)| *s);
                if !q.items.iter().any(|i| matches!(i, FromShell::Overflow { .. })) {
                    q.items.push_back(FromShell::Overflow { from: most, max: self.max });
                }
                return false;
            }
            q.bytes += message.len();
            *q.by_sender.entry(*from).or_default() += message.len();
        }
        if let FromShell::Name { .. } = &item {
            if q.names >= NAME_REQUESTS_MAX {
                return false;
            }
            q.names += 1;
        }
        q.items.push_back(item);
        true
    }

    fn take(&self) -> VecDeque<FromShell> {
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        q.bytes = 0;
        q.names = 0;
        q.by_sender.clear();
        std::mem::take(&mut q.items)
    }
}

// SAFETY: the ABI obliges the host's callbacks (and host_data) to be usable from the plugin's progress thread
// (plugin-spec/README.md, "Threads"); the instance pointer is only passed back to them.
unsafe impl Send for CHost {}

impl CHost {
    /// Has the C host's table got `field` (it may be an older, shorter table)?
    fn has(&self, end_of_field: usize) -> bool {
        self.ops.struct_size as usize >= end_of_field
    }
}

macro_rules! end_of {
    ($field:ident) => {
        std::mem::offset_of!(rpmi_host_ops, $field) + std::mem::size_of::<usize>()
    };
}

/// `message` followed by a NUL, so that a C host that treats it as a string (even an empty one) stays in
/// bounds; the length passed excludes the NUL.
fn nul_terminated(message: &str) -> Vec<u8> {
    let mut text = Vec::with_capacity(message.len() + 1);
    text.extend_from_slice(message.as_bytes());
    text.push(0);
    text
}

fn c_string(s: &str) -> CString {
    // Services and ports are RFC 13 words, which hold no NUL; a NUL would only cut the text short.
    CString::new(s.replace('\0', "")).unwrap_or_default()
}

impl Host for CHost {
    fn collective(&mut self, contribution: &[u8]) -> Result<(), String> {
        if let Some((shells, _)) = &mut self.shells {
            return shells.contribute(contribution.to_vec());
        }
        let rc = match self.ops.collective {
            // SAFETY: a C callback with the host's own data and a buffer that lives through the call.
            Some(f) => unsafe { f(self.ops.host_data, self.instance, contribution.as_ptr(), contribution.len()) },
            None => ffi::RPMI_ERR_INVALID,
        };
        match rc {
            ffi::RPMI_OK => Ok(()),
            rc => Err(format!("the resource manager could not start the exchange ({rc})")),
        }
    }

    fn serves_groups(&self) -> bool {
        self.shells.is_some() || (self.ops.group_collective.is_some() && self.has(end_of!(group_collective)))
    }

    fn group_collective(&mut self, exchange: &GroupExchange<'_>, contribution: &[u8]) -> Result<(), String> {
        if let Some((shells, _)) = &mut self.shells {
            return shells.group_part(exchange.id, contribution);
        }
        let Some(f) = self.ops.group_collective.filter(|_| self.has(end_of!(group_collective))) else {
            return Err(NOT_SUPPORTED.into());
        };
        let (id, shells) = (exchange.id, exchange.shells);
        // SAFETY: a C callback with the host's own data and buffers that live through the call.
        let rc = unsafe {
            f(
                self.ops.host_data,
                self.instance,
                id.as_ptr(),
                id.len(),
                shells.as_ptr(),
                shells.len(),
                contribution.as_ptr(),
                contribution.len(),
            )
        };
        match rc {
            ffi::RPMI_OK => Ok(()),
            rc => Err(format!("the resource manager could not start the group exchange ({rc})")),
        }
    }

    fn abort(&mut self, rank: u32, exit_code: i32, message: &str) {
        self.end_job(rank, exit_code, ffi::RPMI_ABORT_CALLED, message);
    }

    fn job_error(&mut self, error: &JobError) {
        let reason = match error {
            JobError::Protocol { .. } => ffi::RPMI_ABORT_PROTOCOL,
            JobError::TaskLost { .. } => ffi::RPMI_ABORT_TASK_LOST,
        };
        self.end_job(error.rank(), 1, reason, &error.to_string());
    }

    fn log(&mut self, level: log::Level, message: &str) {
        match self.ops.log {
            // SAFETY: a C callback with the host's own data and a buffer that lives through the call.
            Some(f) if self.has(end_of!(log)) => {
                let text = nul_terminated(message);
                unsafe { f(self.ops.host_data, level as i32, text.as_ptr().cast(), message.len()) }
            }
            // The header's promise: without a log callback, messages go to stderr.
            _ => eprintln!("rpmi: {message}"),
        }
    }

    fn task_closed(&mut self, rank: u32, finalized: bool) {
        if let Some((shells, _)) = &mut self.shells {
            shells.task_closed(rank, finalized);
        }
    }

    fn trace(&mut self, rank: u32, speaker: Speaker, line: &[u8]) {
        let text = format!("rank {rank} {speaker}: {}", String::from_utf8_lossy(line));
        self.log(log::Level::Trace, &text);
    }

    fn request(&mut self, task: TaskId, request: HostRequest) -> Result<(), String> {
        let (data, inst, t) = (self.ops.host_data, self.instance, task as u32);
        // A host that leaves the exchanges to the plugin and has no name service of its own gets the job's,
        // held at shell 0.
        if let (Some((shells, _)), Some((op, name, port))) = (&mut self.shells, name_request(&request)) {
            let own = match op {
                NameOp::Publish => self.ops.publish.is_some(),
                NameOp::Unpublish => self.ops.unpublish.is_some(),
                NameOp::Lookup => self.ops.lookup.is_some(),
            };
            if !own {
                return shells.name(t, op, name, port);
            }
        }
        // What a spawn may ask for is rpmi's to check, as for every other host: the C host gets only a
        // request it could start (plugin-spec section 8).
        if let HostRequest::Spawn(spawn) = &request {
            SpawnedJob::of(spawn)?;
        }
        // Owed before the C host has the request: it may answer before its callback returns.
        self.owed.owe(task);
        // The callback's return code; `None` when the host's table lacks it.
        // SAFETY (all four): C callbacks with the host's own data and NUL-terminated strings that live
        // through the call.
        let rc = match request {
            HostRequest::Publish { service, port } => self
                .ops
                .publish
                .filter(|_| self.has(end_of!(publish)))
                .map(|f| unsafe { f(data, inst, t, c_string(&service).as_ptr(), c_string(&port).as_ptr()) }),
            HostRequest::Unpublish { service } => self
                .ops
                .unpublish
                .filter(|_| self.has(end_of!(unpublish)))
                .map(|f| unsafe { f(data, inst, t, c_string(&service).as_ptr()) }),
            HostRequest::Lookup { service } => self
                .ops
                .lookup
                .filter(|_| self.has(end_of!(lookup)))
                .map(|f| unsafe { f(data, inst, t, c_string(&service).as_ptr()) }),
            HostRequest::Spawn(spawn) => self.ops.spawn.filter(|_| self.has(end_of!(spawn))).map(|f| {
                let json = spawn_json(&spawn);
                unsafe { f(data, inst, t, json.as_ptr().cast(), json.len()) }
            }),
        };
        let why = match rc {
            Some(ffi::RPMI_OK) => return Ok(()),
            None => NOT_SUPPORTED.to_string(),
            Some(rc) => format!("the resource manager refused it ({rc})"),
        };
        // Claimed here, so that an answer coming all the same finds nothing owed.
        if self.owed.claim(task) {
            return Err(why);
        }
        // The C host answered before it refused: that answer, on its way, is the one the task gets, so that
        // it is not left over for the task's next request.
        self.log(log::Level::Error, &format!("host bug: task {task}'s request was answered, then refused: {why}"));
        Ok(())
    }
}

/// A request of the name service: what it asks, the service's name and (a publish) its port.
fn name_request(request: &HostRequest) -> Option<(NameOp, &str, &str)> {
    match request {
        HostRequest::Publish { service, port } => Some((NameOp::Publish, service, port)),
        HostRequest::Unpublish { service } => Some((NameOp::Unpublish, service, "")),
        HostRequest::Lookup { service } => Some((NameOp::Lookup, service, "")),
        HostRequest::Spawn(_) => None,
    }
}

impl crate::driver::HostFds for CHost {
    /// Takes what other shells sent, and carries out what the exchanges among the shells ask.
    fn complete(&mut self, server: &mut Server) {
        let name_served = self.ops.name_served.filter(|_| self.has(end_of!(name_served)));
        let Some((shells, inbox)) = &mut self.shells else { return };
        for item in inbox.take() {
            match item {
                FromShell::Message { from, kind, message } => shells.message(from, kind, message),
                FromShell::Lost(shell) => shells.lost(shell),
                FromShell::Overflow { from, max } => shells.overflowed(from, max),
                FromShell::Name { request, op, name, port } => {
                    let (ok, text) = shells.serve_name_outside(op, &name, &port);
                    if let Some(f) = name_served {
                        let status = if ok { ffi::RPMI_OK } else { ffi::RPMI_ERR_STATE };
                        // SAFETY: a C callback with the host's own data and a string that lives through the call.
                        unsafe { f(self.ops.host_data, self.instance, request, status, c_string(&text).as_ptr()) };
                    }
                }
            }
        }
        while let Some(action) = self.shells.as_mut().and_then(|(s, _)| s.poll()) {
            match action {
                Action::Send { to, frame, kind } => {
                    let rc = match self.ops.shell_send {
                        // SAFETY: a C callback with the host's own data and a buffer that lives through the call.
                        Some(f) => unsafe {
                            f(self.ops.host_data, self.instance, to, kind, frame.as_ptr(), frame.len())
                        },
                        None => ffi::RPMI_ERR_INVALID,
                    };
                    if rc != ffi::RPMI_OK {
                        self.log(log::Level::Error, &format!("the host could not send shell {to} a message ({rc})"));
                        if let Some((shells, _)) = &mut self.shells {
                            shells.lost(to);
                        }
                    }
                }
                Action::Complete(Ok(parts)) => {
                    let parts: Vec<&[u8]> = parts.iter().map(|(_, bytes)| bytes).collect();
                    server.collective_complete(Ok(&parts));
                }
                Action::Complete(Err(why)) => server.collective_complete(Err(&why)),
                Action::Answer { task, ok, text } => server.untyped_reply(task as TaskId, ok, Some(text)),
                Action::GroupComplete(done) => {
                    let parts: Vec<&[u8]> = done.parts().collect();
                    server.group_complete(done.id(), Ok(&parts));
                }
                Action::JobDone => {
                    if let Some(f) = self.ops.job_done {
                        // SAFETY: the host's own callback and data.
                        unsafe { f(self.ops.host_data, self.instance) };
                    }
                }
                Action::EndJob { rank, fault, message } => {
                    let reason = match fault {
                        Fault::TaskLost => ffi::RPMI_ABORT_TASK_LOST,
                        Fault::Shell => ffi::RPMI_ABORT_SHELL,
                    };
                    self.end_job(rank, 1, reason, &message);
                }
            }
        }
    }

    fn serves_after_tasks(&self) -> bool {
        self.shells.is_some()
    }
}

impl crate::runtime::NodeHost for CHost {}

impl CHost {
    fn end_job(&mut self, rank: u32, exit_code: i32, reason: i32, message: &str) {
        if let Some(f) = self.ops.abort {
            let text = nul_terminated(message);
            // SAFETY: a C callback with the host's own data and a buffer that lives through the call.
            unsafe { f(self.ops.host_data, rank, exit_code, reason, text.as_ptr().cast(), message.len()) };
        } else {
            log::error!("{message} (the host gave no abort callback)");
        }
    }
}

/// The spawn request as the JSON object `rpmi_host_ops.spawn` documents.
pub fn spawn_json(spawn: &SpawnRequest) -> String {
    use serde_json::{json, Value};
    let text = |b: &[u8]| Value::String(String::from_utf8_lossy(b).into_owned());
    let pairs = |p: &[(Vec<u8>, Vec<u8>)]| Value::Array(p.iter().map(|(k, v)| json!([text(k), text(v)])).collect());
    let commands: Vec<Value> = spawn
        .commands
        .iter()
        .map(|c| {
            json!({
                "nprocs": c.nprocs,
                "execname": text(&c.execname),
                "args": c.args.iter().map(|a| text(a)).collect::<Vec<_>>(),
                "preputs": pairs(&c.preputs),
                "infos": pairs(&c.infos),
            })
        })
        .collect();
    json!({ "commands": commands }).to_string()
}

/// Reads a spawn request back from the JSON of `rpmi_host_ops.spawn` (for a host that passes it on before
/// acting on it, as rpmi-run does between its processes). `Err` says what is wrong with it.
pub fn spawn_request(json: &[u8]) -> Result<SpawnRequest, String> {
    use crate::wire::SpawnCommand;
    use serde_json::Value;
    let v: Value = serde_json::from_slice(json).map_err(|e| format!("that is not JSON: {e}"))?;
    let bad = |what: &str| format!("without a valid '{what}'");
    let bytes = |v: &Value, what: &str| v.as_str().map(|s| s.as_bytes().to_vec()).ok_or_else(|| bad(what));
    let pairs = |v: &Value, what: &str| -> Result<crate::wire::Pairs, String> {
        let list = v.as_array().ok_or_else(|| bad(what))?;
        list.iter().map(|pair| Ok((bytes(&pair[0], what)?, bytes(&pair[1], what)?))).collect()
    };
    let mut commands = Vec::new();
    for c in v["commands"].as_array().ok_or_else(|| bad("commands"))? {
        let args = c["args"].as_array().ok_or_else(|| bad("args"))?;
        commands.push(SpawnCommand {
            nprocs: c["nprocs"].as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| bad("nprocs"))?,
            execname: bytes(&c["execname"], "execname")?,
            args: args.iter().map(|a| bytes(a, "args")).collect::<Result<_, _>>()?,
            preputs: pairs(&c["preputs"], "preputs")?,
            infos: pairs(&c["infos"], "infos")?,
        });
    }
    Ok(SpawnRequest { commands })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::SpawnCommand;

    #[test]
    fn a_spawn_request_reads_back_from_its_json() {
        let req = SpawnRequest {
            commands: vec![
                SpawnCommand {
                    nprocs: 3,
                    execname: b"/bin/x y".to_vec(),
                    args: vec![b"a b".to_vec(), b"\"q\"".to_vec()],
                    preputs: vec![(b"PARENT_ROOT_PORT_NAME".to_vec(), b"tag#0$x$".to_vec())],
                    infos: vec![(b"wdir".to_vec(), b"/tmp".to_vec())],
                },
                SpawnCommand { nprocs: 1, execname: b"b".to_vec(), ..Default::default() },
            ],
        };
        assert_eq!(spawn_request(spawn_json(&req).as_bytes()), Ok(req));
        assert!(spawn_request(br#"{"commands":[{"args":[],"nprocs":-1}]}"#).unwrap_err().contains("nprocs"));
        assert!(spawn_request(b"[").is_err());
    }

    #[test]
    fn spawn_request_as_json() {
        let req = SpawnRequest {
            commands: vec![SpawnCommand {
                nprocs: 2,
                execname: b"./a".to_vec(),
                args: vec![b"-x".to_vec()],
                preputs: vec![(b"k".to_vec(), b"v".to_vec())],
                infos: vec![],
            }],
        };
        assert_eq!(
            spawn_json(&req),
            r#"{"commands":[{"args":["-x"],"execname":"./a","infos":[],"nprocs":2,"preputs":[["k","v"]]}]}"#
        );
    }

    /// The C host's answers to one lookup, as its `lookup` callback makes them: it claims the answer (as
    /// `service_complete` does, on this thread or another) when `ANSWER` is set, then returns `RC`.
    mod answering {
        use super::super::*;
        use std::ffi::{c_char, c_int, c_void};
        use std::sync::atomic::{AtomicBool, AtomicI32, Ordering::SeqCst};

        pub static ANSWER: AtomicBool = AtomicBool::new(false);
        pub static RC: AtomicI32 = AtomicI32::new(ffi::RPMI_OK);

        pub unsafe extern "C" fn lookup(
            data: *mut c_void,
            _: *mut rpmi_instance,
            task: u32,
            _: *const c_char,
        ) -> c_int {
            // SAFETY: the test's OwedAnswers, handed as host data.
            let owed = unsafe { &*(data as *const OwedAnswers) };
            if ANSWER.load(SeqCst) {
                assert!(owed.claim(task as usize), "owed before the callback");
            }
            RC.load(SeqCst)
        }
    }

    #[test]
    fn a_request_answered_before_its_callback_returns_gets_that_answer() {
        use answering::{ANSWER, RC};
        use std::sync::atomic::Ordering::SeqCst;
        let owed = OwedAnswers::new(1);
        // SAFETY: a table of optional callbacks and sizes, all zero: none offered.
        let mut ops: rpmi_host_ops = unsafe { std::mem::zeroed() };
        ops.struct_size = std::mem::size_of::<rpmi_host_ops>() as _;
        ops.host_data = (&owed as *const OwedAnswers).cast_mut().cast();
        ops.lookup = Some(answering::lookup);
        let mut host = CHost { ops, instance: std::ptr::null_mut(), owed: owed.clone(), shells: None };
        let lookup = || HostRequest::Lookup { service: "svc".into() };
        // Taken, to be answered later: owed until then.
        assert_eq!(host.request(0, lookup()), Ok(()));
        assert!(owed.claim(0));
        // Refused: nothing is owed, and the shell answers the task with why.
        RC.store(ffi::RPMI_ERR_INVALID, SeqCst);
        assert!(host.request(0, lookup()).unwrap_err().contains("refused"));
        assert!(!owed.claim(0));
        // Answered, then refused (a host bug): the answer on its way is the one the task gets.
        ANSWER.store(true, SeqCst);
        assert_eq!(host.request(0, lookup()), Ok(()));
        assert!(!owed.claim(0));
    }

    static SPAWNS_SEEN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

    /// Counts the spawns the host is asked to start (no panic may cross the C boundary).
    unsafe extern "C" fn spawn_counted(
        _: *mut std::ffi::c_void,
        _: *mut rpmi_instance,
        _: u32,
        _: *const std::ffi::c_char,
        _: usize,
    ) -> std::ffi::c_int {
        SPAWNS_SEEN.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        ffi::RPMI_ERR_INVALID
    }

    #[test]
    fn a_spawn_beyond_rpmis_bounds_never_reaches_the_host() {
        let owed = OwedAnswers::new(1);
        // SAFETY: a table of optional callbacks and sizes, all zero: none offered.
        let mut ops: rpmi_host_ops = unsafe { std::mem::zeroed() };
        ops.struct_size = std::mem::size_of::<rpmi_host_ops>() as _;
        ops.spawn = Some(spawn_counted);
        let mut host = CHost { ops, instance: std::ptr::null_mut(), owed: owed.clone(), shells: None };
        let command = |nprocs, preput: &str| SpawnCommand {
            nprocs,
            execname: b"./a".to_vec(),
            preputs: vec![(b"k".to_vec(), preput.as_bytes().to_vec())],
            ..Default::default()
        };
        let too_many = SpawnRequest { commands: vec![command(u32::MAX, "v"), command(u32::MAX, "v")] };
        let why = host.request(0, HostRequest::Spawn(Box::new(too_many))).unwrap_err();
        assert!(why.contains("8589934590 processes"), "{why}");
        let disagreeing = SpawnRequest { commands: vec![command(1, "v"), command(1, "w")] };
        assert!(host.request(0, HostRequest::Spawn(Box::new(disagreeing))).is_err());
        assert!(!owed.claim(0), "nothing is owed for a refused spawn");
        assert_eq!(SPAWNS_SEEN.load(std::sync::atomic::Ordering::SeqCst), 0, "the host was asked to start one");
    }
}

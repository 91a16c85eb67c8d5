//! One process's PMI-2 session: a connection to its launcher's server (`PMI_FD`, or `PMI_PORT`) that speaks
//! PMI-2 frames after a PMI-1 `init` line, or, without a launcher, a job of one whose key-value space and node
//! attributes live here. The C API ([`super`]) checks its arguments and turns what this returns into codes.

use rpmi_client::batch::PutBatch;
use rpmi_client::conn::Conn;
use rpmi_client::image::Images;
use rpmi_client::mailbox::{Expected, Mail, Mailbox, Plain};
use rpmi_client::node_barrier::{NodeBarrier, Page, Woken};
use rpmi_client::{env, Failed};
use rpmi_wire::pmi2::{body_len, Message, Writer, FRAME_MAX, HEADER_LEN};
use rpmi_wire::reply::Reply;
use rpmi_wire::request::parse_int;
use rpmi_wire::response::push_int;
use rpmi_wire::spawn::SpawnRequest;
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

/// The `thrid` of a node attribute waited for: one such wait is outstanding at a time per process (the
/// mailbox queues the next behind it; rpmi's server holds one wait per task). Other requests carry none, but
/// start-up's `job-getid` (0), which learns whether the server echoes them.
const NODE_WAIT: i64 = 1;

/// The answer to a node attribute's request, waited for or not: the two are told apart by `thrid` alone.
const NODE_ANSWER: &str = "info-getnodeattr-response";

/// The attributes a lookup reads.
#[derive(Clone, Copy)]
pub enum Attrs {
    /// The node's, which its tasks put.
    Node,
    /// The job's, which the server holds.
    Job,
}

/// An attribute looked up as it is now ([`Session::attr`]).
pub enum Looked {
    /// Its value; `None` if there is none.
    Value(Option<Vec<u8>>),
    /// Not asked for yet: a node attribute, while another thread's wait for one is outstanding and the server
    /// has never echoed a `thrid`, so that it would answer both alike, in whichever order it likes. Asked for
    /// again once the wait is answered ([`wait_turn`]).
    Behind(Arc<Mailbox<Answer>>),
}

/// What a request sends besides its command: `key=value` pairs, in order.
pub type Fields<'a> = &'a [(&'a str, &'a [u8])];

/// An answer: the frame's body, and where in it its command and fields are (a get allocates no field of its
/// own: the library's cost per call is what it allocates, beside the system calls).
pub struct Answer {
    body: Vec<u8>,
    cmd: Range<usize>,
    /// Each field's key, and its value.
    fields: Vec<(Range<usize>, Value)>,
}

/// A field's value: a range of the body, or, where a doubled `;` was undone, bytes of its own.
type Value = Result<Range<usize>, Vec<u8>>;

impl Mail for Answer {
    fn read(conn: &mut Conn) -> Result<Answer, Failed> {
        read_answer(conn)
    }

    fn cmd(&self) -> &str {
        // Checked to be UTF-8 when read.
        rpmi_client::utf8(&self.body[self.cmd.clone()]).unwrap_or_default()
    }

    /// The `thrid` it echoes, which is one of this library's only where it is an integer.
    fn tag(&self) -> Option<i64> {
        parse_int(self.get("thrid")?)
    }

    fn shown(&self) -> String {
        format!("an answer of cmd={}", self.cmd())
    }
}

impl Answer {
    /// The first value of `key`.
    pub fn get(&self, key: &str) -> Option<&[u8]> {
        let (_, value) = self.fields.iter().find(|(k, _)| &self.body[k.clone()] == key.as_bytes())?;
        Some(match value {
            Ok(at) => &self.body[at.clone()],
            Err(own) => own,
        })
    }

    /// A `TRUE`/`FALSE` field; absent is false.
    pub fn flag(&self, key: &str) -> bool {
        self.get(key).is_some_and(|v| v.eq_ignore_ascii_case(b"TRUE"))
    }

    fn int(&self, key: &str) -> Result<i64, Failed> {
        let v = self.get(key).ok_or_else(|| Failed::said(format!("the PMI server's answer has no {key}=")))?;
        rpmi_client::utf8(v)
            .and_then(|v| v.trim_ascii().parse().ok())
            .ok_or_else(|| Failed::said(format!("the PMI server's {key}= is not an integer")))
    }
}

/// What the launcher serves the process through.
enum Server {
    /// Requests are written to the connection (each made in the one buffer kept here: a request allocates
    /// nothing), answers read through the mailbox.
    Wire(Conn, Arc<Mailbox<Answer>>, Vec<u8>),
    /// No launcher: a job of one.
    Alone { kvs: BTreeMap<String, Vec<u8>>, node: BTreeMap<String, Vec<u8>> },
}

pub struct Session {
    pub rank: u32,
    pub size: u32,
    pub appnum: i32,
    pub spawned: bool,
    pub jobid: String,
    server: Server,
    /// The server is rpmi's (it answered `rpmi=` at `init`): puts are kept in `batch` until the fence.
    rpmi: bool,
    batch: PutBatch,
    /// The image of the node's key-value space after the last fence, where the server serves one (`rpmi=2`):
    /// gets of this job's keys are answered from it.
    images: Images,
    /// The node barrier, where the server serves it (`rpmi=3`).
    node: NodeBarrier,
}

impl Session {
    /// `PMI2_Init`: `init` for version 2 on the launcher's connection, then `fullinit`; or a job of one.
    pub fn start() -> Result<Box<Session>, Failed> {
        let Some(mut conn) = Conn::from_env()? else { return Ok(Box::new(Session::alone())) };
        // `rpmi=`: this library speaks rpmi's additions to the wire (other servers pass over it).
        let revision = NodeBarrier::revision_asked();
        conn.write(format!("cmd=init pmi_version=2 pmi_subversion=0 rpmi={revision}\n").as_bytes())?;
        let line = conn.line()?;
        let mail = Arc::new(Mailbox::new(conn.reader()?));
        let reply = Reply::parse(&line).map_err(|e| Failed::said(format!("the PMI server sent a {e}")))?;
        if reply.cmd() != "response_to_init" || reply.rc() != 0 || reply.get("pmi_version") != Some("2") {
            return Err(Failed::said(format!("the PMI server does not serve PMI-2: it answered {}", reply.quoted())));
        }
        // Hydra's port start-up (`PMI_PORT`) says the rank as `PMI_ID` instead.
        let id = || conn.is_port().then(|| env(c"PMI_ID")).flatten();
        let (jobid, rank) = (env(c"PMI_JOBID"), env(c"PMI_RANK").or_else(id));
        let mut fields: Vec<(&str, &[u8])> = Vec::new();
        // As Slurm's and MPICH's clients send them: Slurm's server needs the job id, rpmi's checks the rank.
        if let Some(j) = &jobid {
            fields.push(("pmijobid", j.as_bytes()));
        }
        if let Some(r) = &rank {
            fields.push(("pmirank", r.as_bytes()));
        }
        // Threads may call while one waits for a node attribute (and they say which by `thrid`).
        fields.push(("threaded", b"TRUE"));
        let rpmi = reply.get("rpmi").and_then(|r| r.parse::<u32>().ok()).unwrap_or(0);
        let server = Server::Wire(conn, mail.clone(), Vec::new());
        let mut session = Box::new(Session {
            rank: 0,
            size: 0,
            appnum: 0,
            spawned: false,
            jobid: String::new(),
            server,
            rpmi: rpmi >= 1,
            batch: PutBatch::default(),
            images: Images::new(false, 0),
            node: NodeBarrier::answered(rpmi),
        });
        let init = session.ask("fullinit", &fields)?;
        let (rank, size) = (init.int("rank")?, init.int("size")?);
        if size <= 0 || !(0..size).contains(&rank) || size > 1 << 24 {
            return Err(Failed::said(format!("the PMI server gave rank {rank} of a job of {size}")));
        }
        (session.rank, session.size) = (rank as u32, size as u32);
        session.images = Images::new(rpmi >= 2, session.size);
        session.appnum = init.int("appnum").ok().and_then(|a| i32::try_from(a).ok()).unwrap_or(0);
        session.spawned = init.get("spawner-jobid").is_some_and(|s| !s.is_empty());
        // With a `thrid` (any: no thread waits for it): rpmi's and Hydra's servers echo it (Slurm's does not),
        // and a node attribute asked for as it is now is then never held back behind another thread's wait.
        let id = session.ask("job-getid", &[("thrid", b"0")])?;
        if id.tag().is_some() {
            mail.tag_echoed();
        }
        let id = id.get("jobid").ok_or_else(|| Failed::said("the PMI server's job-getid has no jobid=".into()))?;
        session.jobid = rpmi_client::lossy(id);
        Ok(session)
    }

    fn alone() -> Session {
        Session {
            rank: 0,
            size: 1,
            appnum: 0,
            spawned: false,
            jobid: format!("singleton_kvs_{}", std::process::id()),
            server: Server::Alone { kvs: BTreeMap::new(), node: BTreeMap::new() },
            rpmi: false,
            batch: PutBatch::default(),
            images: Images::new(false, 0),
            node: NodeBarrier::Off,
        }
    }

    pub fn alone_now(&self) -> bool {
        matches!(self.server, Server::Alone { .. })
    }

    /// Sends request `cmd` with `fields` and reads its answer, which must be `cmd-response` with `rc=0`.
    pub fn ask(&mut self, cmd: &str, fields: Fields) -> Result<Answer, Failed> {
        let answer = self.exchange(cmd, fields)?;
        succeeded(&answer, cmd)?;
        Ok(answer)
    }

    /// As [`Session::ask`], but a refusal is an answer the caller expects: `Failed::quiet`.
    pub fn ask_quietly(&mut self, cmd: &str, fields: Fields) -> Result<Answer, Failed> {
        quietly(self.exchange(cmd, fields)?)
    }

    /// Any request but a get sends the puts kept first.
    fn exchange(&mut self, cmd: &str, fields: Fields) -> Result<Answer, Failed> {
        if cmd != "kvs-get" {
            self.flush_puts()?;
        }
        let Server::Wire(conn, mail, out) = &mut self.server else { return Err(Failed::quiet()) };
        frame(out, cmd, fields)?;
        let plain = mail.expect_plain(&[cmd, "-response"]);
        sent(conn, mail, out, plain, cmd)
    }

    /// Sends request `cmd` and reads no answer (abort: the server ends the job).
    pub fn tell(&mut self, cmd: &str, fields: Fields) {
        if let Server::Wire(conn, _, out) = &mut self.server {
            if frame(out, cmd, fields).is_ok() {
                let _ = conn.write(out);
            }
        }
    }

    /// Where a node attribute waited for is answered, without the session's lock; `None` in a job of one.
    pub fn mailbox(&self) -> Option<Arc<Mailbox<Answer>>> {
        match &self.server {
            Server::Wire(_, mail, _) => Some(mail.clone()),
            Server::Alone { .. } => None,
        }
    }

    /// Asks for node attribute `name`, waiting until a task of the node puts it. Its answer, which may come
    /// after other threads' requests are answered, is for the caller to take from the [`Session::mailbox`],
    /// where it has said it expects it ([`expect_node_attr`]).
    pub fn send_node_wait(&mut self, name: &str) -> Result<(), Failed> {
        let Server::Wire(conn, _, out) = &mut self.server else { return Ok(()) };
        let thrid = NODE_WAIT.to_string();
        let fields: Fields = &[("thrid", thrid.as_bytes()), ("key", name.as_bytes()), ("wait", b"TRUE")];
        frame(out, "info-getnodeattr", fields)?;
        conn.write(out)
    }

    /// A put: kept until the fence under rpmi's server (sent at once when the batch is full), else sent now.
    pub fn put(&mut self, key: &str, value: &[u8]) -> Result<(), Failed> {
        match &mut self.server {
            Server::Alone { kvs, .. } => {
                kvs.insert(key.into(), value.into());
                Ok(())
            }
            Server::Wire(..) if self.rpmi => match self.batch.put(key, value) {
                true => self.flush_puts(),
                false => Ok(()),
            },
            Server::Wire(..) => self.ask("kvs-put", &[("key", key.as_bytes()), ("value", value)]).map(drop),
        }
    }

    /// The fence: on the node's page where the node barrier is on, else by a frame with the puts kept ahead of
    /// it in the same write. A put the server refused fails the fence, once it is over.
    pub fn fence(&mut self) -> Result<(), Failed> {
        if let Server::Alone { .. } = self.server {
            return Ok(());
        }
        match std::mem::replace(&mut self.node, NodeBarrier::Off) {
            NodeBarrier::On(page) if !page.broken() => {
                let ended = self.fence_on_page(&page);
                self.node = NodeBarrier::On(page);
                ended
            }
            node => {
                self.node = node;
                self.fence_by_frame()
            }
        }
    }

    /// The fence by a frame, and the puts kept ahead of it in the same write. The first one's answer says
    /// whether the node barrier is on, and brings its page where it is.
    fn fence_by_frame(&mut self) -> Result<(), Failed> {
        // The page comes with the first fence's answer, to whichever thread reads it: taken only where no other
        // thread waits for an answer (else this task stays on frames, and the server's page breaks for all).
        let deciding = self.node.deciding();
        let mail = self.mailbox().filter(|mail| deciding && mail.alone());
        if let Some(mail) = &mail {
            mail.expect_fd();
        }
        let (sent, refused) = self.send_puts(Some("kvs-fence"))?;
        let answer = match &mut self.server {
            Server::Wire(_, mail, _) if sent => {
                let plain = mail.expect_plain(&["kvs-fence", "-response"]);
                answering(mail.take_plain(plain)?, "kvs-fence-response")
                    .and_then(|a| succeeded(&a, "kvs-fence").map(|()| a))
            }
            _ => self.ask("kvs-fence", &[]),
        };
        if deciding {
            let file = mail.and_then(|m| m.take_fd());
            let members = answer.as_ref().ok().and_then(|a| a.int("node_barrier").ok());
            self.node.decide("libpmi2", members, file);
        }
        answer?;
        self.images.fence_ended();
        refused.map_or(Ok(()), Err)
    }

    /// The fence on the node's page: the puts kept go first, each answered (the server holds them before the
    /// last task's frame can come), then this task counts itself in and waits for the release. Where the page
    /// breaks meanwhile (a local task went), by a frame after all: its answer says what went wrong.
    fn fence_on_page(&mut self, page: &Page) -> Result<(), Failed> {
        let (_, refused) = self.send_puts(None)?;
        let entry = page.enter();
        if entry.last {
            self.tell("node-barrier-in", &[]);
        }
        let Server::Wire(conn, ..) = &self.server else { return Ok(()) };
        match page.wait(&entry, || conn.hung_up()).map_err(Failed::said)? {
            Woken::Released(0) => {}
            Woken::Released(code) => {
                return Err(Failed::said(format!("the PMI server failed the node's fence (rc={code})")));
            }
            Woken::Broken => return self.fence_by_frame().and(refused.map_or(Ok(()), Err)),
        }
        self.images.fence_ended();
        refused.map_or(Ok(()), Err)
    }

    /// Sends the puts kept ([`PutBatch`]) and reads their answers. Where no other thread waits for an answer,
    /// they go in one write, with request `then` (no fields) after them if one is given (`true`: it went; its
    /// answer is the caller's to read); else each goes on its own, answered before the next (a node attribute's
    /// waiter could take a put's answer for its own). `Err` where the connection failed; the first put the
    /// server refused, named, once every answer is read.
    fn send_puts(&mut self, then: Option<&str>) -> Result<(bool, Option<Failed>), Failed> {
        let Server::Wire(conn, mail, out) = &mut self.server else { return Ok((false, None)) };
        if self.batch.is_empty() {
            return Ok((false, None));
        }
        let puts = self.batch.take();
        let refusal = |key: &str, answer: &Answer| {
            succeeded(answer, "kvs-put")
                .err()
                .map(|f| Failed::said(format!("{} (the put of key '{key}')", f.message.unwrap_or_default())))
        };
        let mut refused = None;
        if !mail.alone() {
            for (key, value) in &puts {
                frame(out, "kvs-put", &[("key", key.as_bytes()), ("value", value)])?;
                let answer = sent(conn, mail, out, mail.expect_plain(&["kvs-put", "-response"]), "kvs-put")?;
                refused = refused.or_else(|| refusal(key, &answer));
            }
            return Ok((false, refused));
        }
        let mut all = Vec::new();
        for (key, value) in &puts {
            frame(out, "kvs-put", &[("key", key.as_bytes()), ("value", value)])?;
            all.extend_from_slice(out);
        }
        if let Some(cmd) = then {
            frame(out, cmd, &[])?;
            all.extend_from_slice(out);
        }
        let mut plain = Some(mail.expect_plain(&["kvs-put", "-response"]));
        conn.write(&all)?;
        for (key, _) in &puts {
            let plain = plain.take().unwrap_or_else(|| mail.expect_plain(&["kvs-put", "-response"]));
            let answer = answering(mail.take_plain(plain)?, "kvs-put-response")?;
            refused = refused.or_else(|| refusal(key, &answer));
        }
        Ok((then.is_some(), refused))
    }

    /// The value of `key` in the image of the key-value space, asked for first where it is due and no other
    /// thread waits for an answer (its memory file comes with the answer, to whichever thread reads it).
    fn imaged(&mut self, key: &str) -> Option<&[u8]> {
        if let (true, Server::Wire(_, mail, _)) = (self.images.ask_now(), &self.server) {
            if mail.alone() {
                mail.expect_fd();
                let answer = self.ask_quietly("kvs-image", &[]).map(|a| a.int("bytes").ok());
                let file = self.mailbox().and_then(|m| m.take_fd());
                let answer = match answer {
                    Err(f) if f.message.is_none() => Ok(None),
                    other => other,
                };
                self.images.arrived("libpmi2", answer, file);
            }
        }
        self.images.get(key.as_bytes())
    }

    /// Sends the puts kept, alone: `Err` if the server refused one.
    fn flush_puts(&mut self) -> Result<(), Failed> {
        let (_, refused) = self.send_puts(None)?;
        refused.map_or(Ok(()), Err)
    }

    /// What `read` makes of the value of `key` in job `jobid`'s key-value space (read where it lies, copied
    /// nowhere first); `Failed::quiet` if it has none.
    pub fn get<T>(
        &mut self,
        jobid: &str,
        src: i32,
        key: &str,
        read: impl FnOnce(&[u8]) -> Result<T, Failed>,
    ) -> Result<T, Failed> {
        match &mut self.server {
            Server::Alone { kvs, .. } if jobid == self.jobid => read(kvs.get(key).ok_or_else(Failed::quiet)?),
            Server::Alone { .. } => Err(Failed::quiet()),
            // Put by this process since the last fence.
            Server::Wire(..) if jobid == self.jobid && self.batch.get(key).is_some() => {
                read(self.batch.get(key).unwrap_or_default())
            }
            Server::Wire(..) => {
                if jobid == self.jobid {
                    if let Some(value) = self.imaged(key) {
                        return read(value);
                    }
                }
                let mut srcid = Vec::new();
                push_int(&mut srcid, src.into());
                let fields: Fields = &[("jobid", jobid.as_bytes()), ("srcid", &srcid), ("key", key.as_bytes())];
                let answer = self.ask_quietly("kvs-get", fields)?;
                if !answer.flag("found") {
                    return Err(Failed::quiet());
                }
                read(answer.get("value").unwrap_or_default())
            }
        }
    }

    pub fn put_node_attr(&mut self, name: &str, value: &[u8]) -> Result<(), Failed> {
        match &mut self.server {
            Server::Alone { node, .. } => {
                node.insert(name.into(), value.into());
                Ok(())
            }
            Server::Wire(..) => self.ask("info-putnodeattr", &[("key", name.as_bytes()), ("value", value)]).map(drop),
        }
    }

    /// Attribute `name` of `attrs`, as it is now.
    pub fn attr(&mut self, attrs: Attrs, name: &str) -> Result<Looked, Failed> {
        let value = match (&mut self.server, attrs) {
            (Server::Alone { node, .. }, Attrs::Node) => node.get(name).cloned(),
            (Server::Alone { .. }, Attrs::Job) => match name {
                "PMI_process_mapping" => Some(b"(vector,(0,1,1))".to_vec()),
                "universeSize" => Some(b"1".to_vec()),
                _ => None,
            },
            (Server::Wire(conn, mail, out), Attrs::Node) => {
                frame(out, "info-getnodeattr", &[("key", name.as_bytes()), ("wait", b"FALSE")])?;
                let Some(plain) = mail.expect_plain_in_turn(&[NODE_ANSWER]) else {
                    return Ok(Looked::Behind(mail.clone()));
                };
                optional(sent(conn, mail, out, plain, "info-getnodeattr").and_then(quietly))?
            }
            (Server::Wire(..), Attrs::Job) => {
                optional(self.ask_quietly("info-getjobattr", &[("key", name.as_bytes())]))?
            }
        };
        Ok(Looked::Value(value))
    }

    /// A name service request: the port of a lookup.
    pub fn name(&mut self, cmd: &str, fields: Fields) -> Result<Vec<u8>, Failed> {
        let answer = self.ask_quietly(cmd, fields)?;
        if cmd != "name-lookup" {
            return Ok(Vec::new());
        }
        // rpmi answers the port as both; Slurm's server as value=.
        match answer.get("value").or(answer.get("port")) {
            Some(port) if !port.is_empty() => Ok(port.to_vec()),
            _ => Err(Failed::quiet()),
        }
    }

    /// A spawn: the new job's id and each process's error code.
    pub fn spawn(&mut self, request: &SpawnRequest) -> Result<(Vec<u8>, Vec<i32>), Failed> {
        let mut owned: Vec<(String, Vec<u8>)> = vec![("ncmds".into(), request.commands.len().to_string().into())];
        let preputs = request.commands.first().map(|c| c.preputs.as_slice()).unwrap_or_default();
        owned.push(("preputcount".into(), preputs.len().to_string().into()));
        for (i, (k, v)) in preputs.iter().enumerate() {
            owned.push((format!("ppkey{i}"), k.clone()));
            owned.push((format!("ppval{i}"), v.clone()));
        }
        for c in &request.commands {
            owned.push(("subcmd".into(), c.execname.clone()));
            owned.push(("maxprocs".into(), c.nprocs.to_string().into()));
            owned.push(("argc".into(), c.args.len().to_string().into()));
            for (i, a) in c.args.iter().enumerate() {
                owned.push((format!("argv{i}"), a.clone()));
            }
            owned.push(("infokeycount".into(), c.infos.len().to_string().into()));
            for (i, (k, v)) in c.infos.iter().enumerate() {
                owned.push((format!("infokey{i}"), k.clone()));
                owned.push((format!("infoval{i}"), v.clone()));
            }
        }
        let fields: Vec<(&str, &[u8])> = owned.iter().map(|(k, v)| (k.as_str(), v.as_slice())).collect();
        // A request no frame can hold is the caller's fault, with or without a launcher.
        frame(&mut Vec::new(), "spawn", &fields)?;
        if self.alone_now() {
            return Err(Failed::quiet());
        }
        let answer = self.ask_quietly("spawn", &fields)?;
        let jobid = answer.get("jobid").unwrap_or_default().to_vec();
        let codes = match answer.get("errcodes") {
            None | Some(b"") => Vec::new(),
            Some(codes) => String::from_utf8_lossy(codes)
                .split(',')
                .map(|c| c.trim().parse::<i32>())
                .collect::<Result<_, _>>()
                .map_err(|_| {
                    Failed::said("the PMI server answered a spawn with errcodes that are not integers".into())
                })?,
        };
        Ok((jobid, codes))
    }
}

/// Request `cmd` with `fields` as one frame, made in `out`; `Err` if it is longer than a frame's length prefix
/// can say.
fn frame(out: &mut Vec<u8>, cmd: &str, fields: Fields) -> Result<(), Failed> {
    // `cmd=<cmd>;`, then `key=value;` each, a `;` in a value doubled.
    let doubled = |v: &[u8]| v.len() + v.iter().filter(|&&b| b == b';').count();
    let len: usize = cmd.len() + 5 + fields.iter().map(|(k, v)| k.len() + 2 + doubled(v)).sum::<usize>();
    if len > FRAME_MAX {
        return Err(Failed::arg_said(
            rpmi_client::ERR_INVALID_ARG,
            format!("a {cmd} request of {len} bytes, more than a PMI-2 frame holds ({FRAME_MAX})"),
        ));
    }
    out.clear();
    out.reserve(HEADER_LEN + len);
    let mut w = Writer::request(out, cmd);
    for (key, value) in fields {
        w = w.str(key, value);
    }
    w.finish();
    Ok(())
}

/// Sends the request made in `out`, whose answer is expected as `plain`, and reads that answer, which must be
/// `cmd-response`.
fn sent(conn: &mut Conn, mail: &Mailbox<Answer>, out: &[u8], plain: Plain, cmd: &str) -> Result<Answer, Failed> {
    conn.write(out)?;
    let answer = mail.take_plain(plain)?;
    match answer.cmd().strip_prefix(cmd) {
        Some("-response") => Ok(answer),
        _ => Err(unanswered(&answer, &[cmd, "-response"].concat())),
    }
}

/// `answer` to request `cmd`, where it says `rc=0`; else why the server failed it.
fn succeeded(answer: &Answer, cmd: &str) -> Result<(), Failed> {
    match answer.int("rc")? {
        0 => Ok(()),
        rc => {
            let why = answer.get("errmsg").map(String::from_utf8_lossy).unwrap_or_default().into_owned();
            Err(Failed::said(format!(
                "the PMI server failed {cmd} (rc={rc}){}{why}",
                if why.is_empty() { "" } else { ": " }
            )))
        }
    }
}

/// `answer`, where it says `rc=0`; else a refusal the caller expects, `Failed::quiet`.
fn quietly(answer: Answer) -> Result<Answer, Failed> {
    match answer.int("rc")? {
        0 => Ok(answer),
        _ => Err(Failed::quiet()),
    }
}

/// A `found=`/`value=` answer (or a refusal) as an optional value.
fn optional(answer: Result<Answer, Failed>) -> Result<Option<Vec<u8>>, Failed> {
    match answer {
        Ok(a) if a.flag("found") => Ok(Some(a.get("value").unwrap_or_default().to_vec())),
        Ok(_) => Ok(None),
        Err(f) if f.message.is_none() => Ok(None),
        Err(f) => Err(f),
    }
}

/// Says that a node attribute waited for is about to be asked for ([`Session::send_node_wait`]), waiting
/// while another thread's wait is outstanding; called without the session's lock. Its answer is taken with
/// [`node_waited`].
pub fn expect_node_attr(mail: &Mailbox<Answer>) -> Expected<'_, Answer> {
    mail.expect_tagged(NODE_WAIT, NODE_ANSWER)
}

/// Waits, without the session's lock, until a node attribute held back behind another thread's wait
/// ([`Looked::Behind`]) may be asked for.
pub fn wait_turn(mail: &Mailbox<Answer>) {
    mail.wait_turn(&[NODE_ANSWER]);
}

/// The answer to a node attribute waited for, from the mailbox.
pub fn node_waited(expected: Expected<'_, Answer>) -> Result<Option<Vec<u8>>, Failed> {
    let answer = answering(expected.take()?, NODE_ANSWER)?;
    match answer.int("rc")? {
        0 => optional(Ok(answer)),
        _ => Ok(None),
    }
}

/// `answer`, which must be of command `cmd`.
fn answering(answer: Answer, cmd: &str) -> Result<Answer, Failed> {
    if answer.cmd() != cmd {
        return Err(unanswered(&answer, cmd));
    }
    Ok(answer)
}

/// The server answered with `answer` where command `cmd` was due.
fn unanswered(answer: &Answer, cmd: &str) -> Failed {
    Failed::said(format!("the PMI server answered with cmd={} where cmd={cmd} was due", answer.cmd()))
}

/// Reads one frame.
fn read_answer(conn: &mut Conn) -> Result<Answer, Failed> {
    let header = conn.array::<HEADER_LEN>()?;
    let len = body_len(&header).ok_or_else(|| {
        Failed::said(format!("the PMI server sent a frame whose length is '{}'", String::from_utf8_lossy(&header)))
    })?;
    let body = conn.exact(len)?;
    let message =
        Message::parse(&body).map_err(|e| Failed::said(format!("the PMI server sent a malformed frame: {e}")))?;
    if rpmi_client::utf8(message.cmd).is_none() {
        return Err(Failed::said("the PMI server sent a command that is not UTF-8".into()));
    }
    // Where a piece of the body is in it; `None` for bytes of their own (a value whose `;;` were undone).
    let base = body.as_ptr() as usize;
    let within = |piece: &[u8]| {
        let start = (piece.as_ptr() as usize).checked_sub(base)?;
        (start + piece.len() <= body.len()).then_some(start..start + piece.len())
    };
    let cmd = within(message.cmd).unwrap_or_default();
    let mut fields = Vec::with_capacity(message.pairs().len());
    for (key, value) in message.pairs() {
        // A key is always a piece of the body.
        let Some(key) = within(key) else { continue };
        fields.push((key, within(value).ok_or_else(|| value.to_vec())));
    }
    drop(message);
    Ok(Answer { body, cmd, fields })
}

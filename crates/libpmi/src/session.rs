//! One process's PMI-1 session: either a connection to its launcher's server (`PMI_FD`, or `PMI_PORT`) that
//! speaks RFC 13's lines, or, without a launcher, a job of one whose key-value space lives here. The C API
//! ([`super`]) checks its arguments and turns what this returns into PMI's codes.

use rpmi_client::batch::PutBatch;
use rpmi_client::conn::{Conn, READ_MAX};
use rpmi_client::image::Images;
use rpmi_client::mailbox::{Mailbox, Plain};
use rpmi_client::node_barrier::{NodeBarrier, Page, Woken};
use rpmi_client::{env_int, Failed};
use rpmi_wire::mapping::Mapping;
use rpmi_wire::reply::{quote, Reply};
use rpmi_wire::spawn::SpawnRequest;
use std::collections::BTreeMap;
use std::sync::Arc;

/// The limits of a job of one (those of MPICH's own singleton).
const SINGLETON_MAXES: Maxes = Maxes { kvsname: 256, key: 256, value: 1024 };
/// The largest job taken (rpmi's own bound): a larger size is a launcher's or a server's error, and the
/// clique's walk over the ranks stays bounded.
const SIZE_MAX: i64 = 1 << 24;
/// The room first made for a request and for a reply: a start-up's fit, and grow no further.
const REQUEST: usize = 512;
/// The longest port a lookup hands back, NUL included: MPICH's `MPI_MAX_PORT_NAME`.
pub const PORT_MAX: usize = 256;

/// The server's limits (`cmd=maxes`), each with the terminating NUL.
#[derive(Debug, Clone, Copy)]
pub struct Maxes {
    pub kvsname: usize,
    pub key: usize,
    pub value: usize,
}

/// What the launcher serves the process through.
enum Server {
    Wire(Wire),
    /// No launcher: a job of one. Puts are visible to gets at once.
    Alone(BTreeMap<String, String>),
}

pub struct Session {
    pub rank: u32,
    pub size: u32,
    pub spawned: bool,
    /// Asked for when first wanted, as MPICH's and Flux's clients ask (a program that never asks sends
    /// nothing): [`Session::appnum`], [`Session::universe`].
    appnum: Option<i32>,
    universe: Option<i32>,
    pub kvsname: String,
    pub maxes: Maxes,
    /// The server answered PMI 1.2 at `init`: group barriers are served.
    pub groups: bool,
    /// The ranks on this node, once asked for.
    clique: Option<Vec<u32>>,
    server: Server,
}

/// The connection to the server: requests are written here, replies read through the mailbox.
struct Wire {
    conn: Conn,
    mail: Arc<Mailbox<String>>,
    /// The request being written, and the reply read: one buffer each from request to request, so that a
    /// request allocates nothing.
    out: Vec<u8>,
    line: String,
    /// The server is rpmi's (it answered `rpmi=` at `init`): puts are kept in `batch` until the barrier.
    rpmi: bool,
    batch: PutBatch,
    /// The image of the node's key-value space after the last barrier, where the server serves one
    /// (`rpmi=2`): gets are answered from it.
    images: Images,
    /// The node barrier, where the server serves it (`rpmi=3`).
    node: NodeBarrier,
}

impl Session {
    /// `PMI_Init`: connects to the launcher's server and says `init`, or, without one, makes a job of one.
    pub fn start() -> Result<Box<Session>, Failed> {
        let Some(mut conn) = Conn::from_env()? else { return Ok(Box::new(Session::alone())) };
        let mail = Arc::new(Mailbox::new(conn.reader()?));
        let mut wire = Wire {
            conn,
            mail,
            out: Vec::with_capacity(REQUEST),
            line: String::with_capacity(REQUEST),
            rpmi: false,
            batch: PutBatch::default(),
            images: Images::new(false, 0),
            node: NodeBarrier::Off,
        };
        let (mut rank, mut size) = (env_int(c"PMI_RANK")?, env_int(c"PMI_SIZE")?);
        // A launcher that gives a port and an id (Hydra's) says the rank and size in answer to the id.
        if wire.conn.is_port() {
            if let Some(id) = env_int(c"PMI_ID")? {
                (rank, size) = wire.initack(id)?;
            }
        }
        let (rank, size) = match (rank, size) {
            (Some(r), Some(s)) if s > 0 && (0..s).contains(&r) && s <= SIZE_MAX => (r as u32, s as u32),
            _ => return Err(Failed::said("the launcher gave no valid PMI_RANK and PMI_SIZE".into())),
        };
        let groups = wire.init(size)?;
        let maxes = wire.maxes()?;
        let kvsname = wire.call_ok(&["cmd=get_my_kvsname"], "my_kvsname", |r| field(&r, "kvsname"))?;
        let spawned = env_int(c"PMI_SPAWNED")?.unwrap_or(0) != 0;
        Ok(Box::new(Session {
            rank,
            size,
            spawned,
            appnum: None,
            universe: None,
            kvsname,
            maxes,
            groups,
            clique: None,
            server: Server::Wire(wire),
        }))
    }

    fn alone() -> Session {
        Session {
            rank: 0,
            size: 1,
            spawned: false,
            appnum: Some(0),
            universe: Some(1),
            kvsname: format!("singleton_kvs_{}", std::process::id()),
            maxes: SINGLETON_MAXES,
            groups: true,
            clique: Some(vec![0]),
            server: Server::Alone(BTreeMap::new()),
        }
    }

    /// The application number (MPMD): which of the launcher's programs this process runs.
    pub fn appnum(&mut self) -> Result<i32, Failed> {
        if let (None, Server::Wire(w)) = (self.appnum, &mut self.server) {
            let n = w.call_ok(&["cmd=get_appnum"], "appnum", |r| int_field(&r, "appnum"))?;
            self.appnum = Some(small(n, "the appnum")?);
        }
        Ok(self.appnum.unwrap_or_default())
    }

    /// The universe size: how many processes the job may have, spawned ones included.
    pub fn universe(&mut self) -> Result<i32, Failed> {
        if let (None, Server::Wire(w)) = (self.universe, &mut self.server) {
            let n = w.call_ok(&["cmd=get_universe_size"], "universe_size", |r| int_field(&r, "size"))?;
            self.universe = Some(small(n, "the universe size")?);
        }
        Ok(self.universe.unwrap_or(1))
    }

    pub fn finalize(&mut self) -> Result<(), Failed> {
        match &mut self.server {
            Server::Wire(w) => {
                w.flush_puts(&self.kvsname)?;
                w.call_ok(&["cmd=finalize"], "finalize_ack", |_| Ok(()))
            }
            Server::Alone(_) => Ok(()),
        }
    }

    /// Tells the server the job must end with `code` (it ends this process too, by ending the job; the
    /// caller exits anyway).
    pub fn abort(&mut self, code: i32, message: &str) {
        if let Server::Wire(w) = &mut self.server {
            // One line: what follows a newline in the message would be read as another request.
            let message: String = message.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
            let _ = w.send(&["cmd=abort exitcode=", &code.to_string(), " message=", &message]);
        }
    }

    /// A put: kept until the barrier under rpmi's server (sent at once when the batch is full), else sent now.
    pub fn put(&mut self, key: &str, value: &str) -> Result<(), Failed> {
        match &mut self.server {
            Server::Wire(w) if w.rpmi => match w.batch.put(key, value.as_bytes()) {
                true => w.flush_puts(&self.kvsname),
                false => Ok(()),
            },
            Server::Wire(w) => w.call_ok(
                &["cmd=put kvsname=", &self.kvsname, " key=", key, " value=", value],
                "put_result",
                |_| Ok(()),
            ),
            Server::Alone(kvs) => {
                kvs.insert(key.into(), value.into());
                Ok(())
            }
        }
    }

    /// What `read` makes of the value of `key` (read where it lies, copied nowhere first); `Failed::quiet` if
    /// there is none.
    pub fn get<T>(&mut self, key: &str, read: impl FnOnce(&str) -> Result<T, Failed>) -> Result<T, Failed> {
        match &mut self.server {
            // Put by this process since the last barrier: a `&str` when it was put.
            Server::Wire(w) if w.batch.get(key).is_some() => {
                read(rpmi_client::utf8(w.batch.get(key).unwrap_or_default()).unwrap_or_default())
            }
            Server::Wire(w) => {
                if let Some(value) = w.imaged(key, self.maxes.value) {
                    return read(value);
                }
                let reply = w.ask(&["cmd=get kvsname=", &self.kvsname, " key=", key], "get_result", false)?;
                if reply.rc() != 0 {
                    return Err(Failed::quiet());
                }
                read(reply.field("value").map_err(Failed::said)?)
            }
            Server::Alone(kvs) => read(kvs.get(key).ok_or_else(Failed::quiet)?),
        }
    }

    /// The barrier: on the node's page where the node barrier is on, else by a line with the puts kept ahead
    /// of it in the same write. A put the server refused fails the barrier, once it is over.
    pub fn barrier(&mut self) -> Result<(), Failed> {
        match &mut self.server {
            Server::Wire(w) => match std::mem::replace(&mut w.node, NodeBarrier::Off) {
                NodeBarrier::On(page) if !page.broken() => {
                    let ended = w.barrier_on_page(&self.kvsname, &page);
                    w.node = NodeBarrier::On(page);
                    ended
                }
                node => {
                    w.node = node;
                    w.barrier_by_line(&self.kvsname)
                }
            },
            Server::Alone(_) => Ok(()),
        }
    }

    /// Where a PMI 1.2 group barrier waits for its answer, without the session's lock; `None` in a job of
    /// one, whose barriers end at once. `Failed::quiet` where the server does not serve group barriers.
    pub fn group_mailbox(&self) -> Result<Option<Arc<Mailbox<String>>>, Failed> {
        match &self.server {
            Server::Wire(_) if !self.groups => Err(Failed::quiet()),
            Server::Wire(w) => Ok(Some(w.mail.clone())),
            Server::Alone(_) => Ok(None),
        }
    }

    /// Sends PMI 1.2's barrier over `ranks` (ascending, this rank among them), told apart by `tag`; its
    /// answer is for the caller to wait for in the [`Session::group_mailbox`].
    pub fn send_group(&mut self, ranks: &[u32], tag: i64) -> Result<(), Failed> {
        let Server::Wire(w) = &mut self.server else { return Ok(()) };
        // The group's members read what this rank put: its puts go first (each on its own: this barrier's
        // answer is waited for in the mailbox). What the group exchanges is newer than the image.
        w.flush_puts(&self.kvsname)?;
        w.images.stale();
        let list: Vec<String> = ranks.iter().map(u32::to_string).collect();
        w.send(&["cmd=barrier_in group=", &list.join(","), ":", &tag.to_string()])
    }

    /// The ranks on this node, from the server's `PMI_process_mapping`. Where the mapping is unknown (the
    /// server has none, or sends it empty, as RFC 13 says it may), this rank alone, as MPICH takes it.
    pub fn clique(&mut self) -> Result<&[u32], Failed> {
        if self.clique.is_none() {
            let ranks = match self.get("PMI_process_mapping", |m| Ok(m.to_string())) {
                Ok(mapping) if !mapping.trim().is_empty() => {
                    let mapping = Mapping::parse(&mapping)
                        .map_err(|e| Failed::said(format!("the server's PMI_process_mapping is malformed: {e}")))?;
                    let ranks = mapping.clique(self.size as usize, self.rank as usize).map_err(Failed::said)?;
                    ranks.into_iter().map(|r| r as u32).collect()
                }
                Ok(_) => vec![self.rank],
                Err(f) if f.message.is_none() => vec![self.rank],
                Err(f) => return Err(f),
            };
            self.clique = Some(ranks);
        }
        Ok(self.clique.as_deref().unwrap_or_default())
    }

    /// A name service request (`publish_name`, `unpublish_name`, `lookup_name`): the `port=` of a lookup.
    /// Servers say a name failed with `rc`, or with MPICH's older `info=fail` and no `rc` (Slurm's
    /// `--mpi=pmi2`), and a lookup that found nothing with no port at all.
    pub fn name(&mut self, request: &str, answer: &str) -> Result<String, Failed> {
        match &mut self.server {
            Server::Wire(w) => {
                let reply = w.ask(&[request], answer, false)?;
                if reply.rc() != 0 || reply.get("info").is_some_and(|i| i != "ok") {
                    return Err(Failed::quiet());
                }
                let port = reply.get("port").unwrap_or_default();
                if answer == "lookup_result" && port.is_empty() {
                    return Err(Failed::quiet());
                }
                Ok(port.to_string())
            }
            // A job of one publishes for nobody.
            Server::Alone(_) => Err(Failed::quiet()),
        }
    }

    /// A spawn: the error code of each process asked for.
    pub fn spawn(&mut self, request: &SpawnRequest) -> Result<Vec<i32>, Failed> {
        let bytes = request.encode().map_err(|e| Failed::arg_said(rpmi_client::ERR_INVALID_ARG, e.to_string()))?;
        let Server::Wire(w) = &mut self.server else { return Err(Failed::quiet()) };
        let plain = w.mail.expect_plain(&["spawn_result"]);
        w.conn.write(&bytes)?;
        w.reply(plain, "spawn_result", |reply| {
            if reply.rc() != 0 {
                return Err(Failed::quiet());
            }
            match reply.get("errcodes") {
                None | Some("") => Ok(vec![0; request.total_procs() as usize]),
                Some(codes) => codes
                    .split(',')
                    .map(|c| c.trim().parse::<i32>())
                    .collect::<Result<_, _>>()
                    .map_err(|_| Failed::said(format!("the server answered a spawn with {}", reply.quoted()))),
            }
        })
    }
}

impl Wire {
    /// The barrier by a line, and the puts kept ahead of it in the same write. The first one's answer says
    /// whether the node barrier is on, and brings its page where it is.
    fn barrier_by_line(&mut self, kvsname: &str) -> Result<(), Failed> {
        // The page comes with the first barrier's answer, to whichever thread reads it: taken only where no
        // other thread waits for an answer (else this task stays on lines, and the server's page breaks for all).
        let deciding = self.node.deciding();
        let expecting = deciding && self.mail.alone();
        if expecting {
            self.mail.expect_fd();
        }
        let (sent, refused) = self.send_puts(kvsname, Some("cmd=barrier_in"))?;
        let plain = self.mail.expect_plain(&["barrier_out"]);
        if !sent {
            self.send(&["cmd=barrier_in"])?;
        }
        let members = self.reply(plain, "barrier_out", |r| match r.rc() {
            0 => Ok(r.int("node_barrier").ok()),
            _ => Err(Failed::said(format!("the PMI server failed 'barrier_in': {}", r.quoted()))),
        });
        if deciding {
            let file = if expecting { self.mail.take_fd() } else { None };
            self.node.decide("libpmi", members.as_ref().ok().copied().flatten(), file);
        }
        members?;
        self.images.fence_ended();
        refused.map_or(Ok(()), Err)
    }

    /// The barrier on the node's page: the puts kept go first, each answered (the server holds them before
    /// the last task's line can come), then this task counts itself in and waits for the release. Where the
    /// page breaks meanwhile (a local task went), by a line after all: its answer says what went wrong.
    fn barrier_on_page(&mut self, kvsname: &str, page: &Page) -> Result<(), Failed> {
        let (_, refused) = self.send_puts(kvsname, None)?;
        let entry = page.enter();
        if entry.last {
            self.send(&["cmd=node_barrier_in"])?;
        }
        let conn = &self.conn;
        match page.wait(&entry, || conn.hung_up()).map_err(Failed::said)? {
            Woken::Released(0) => {}
            Woken::Released(code) => {
                return Err(Failed::said(format!("the PMI server failed the node's barrier (rc={code})")));
            }
            Woken::Broken => return self.barrier_by_line(kvsname).and(refused.map_or(Ok(()), Err)),
        }
        self.images.fence_ended();
        refused.map_or(Ok(()), Err)
    }

    /// Sends the puts kept ([`PutBatch`]) and reads their answers. Where no other thread waits for an answer,
    /// they go in one write, with `request` after them if one is given (`true`: it went; its answer is the
    /// caller's to read); else each goes on its own, answered before the next (a group barrier's waiter could
    /// take a put's answer for its own). `Err` where the connection failed; the first put the server refused,
    /// named, once every answer is read.
    fn send_puts(&mut self, kvsname: &str, request: Option<&str>) -> Result<(bool, Option<Failed>), Failed> {
        if self.batch.is_empty() {
            return Ok((false, None));
        }
        let puts = self.batch.take();
        let refusal = |key: &str, reply: &Reply| {
            Failed::said(format!("the PMI server refused the put of key '{key}': {}", reply.quoted()))
        };
        let mut refused = None;
        if !self.mail.alone() {
            for (key, value) in &puts {
                let value = rpmi_client::utf8(value).unwrap_or_default();
                let reply =
                    self.ask(&["cmd=put kvsname=", kvsname, " key=", key, " value=", value], "put_result", false)?;
                if reply.rc() != 0 && refused.is_none() {
                    refused = Some(refusal(key, &reply));
                }
            }
            return Ok((false, refused));
        }
        self.out.clear();
        for (key, value) in &puts {
            for piece in [b"cmd=put kvsname=", kvsname.as_bytes(), b" key=", key.as_bytes(), b" value=", value, b"\n"] {
                self.out.extend_from_slice(piece);
            }
        }
        if let Some(request) = request {
            self.out.extend_from_slice(request.as_bytes());
            self.out.push(b'\n');
        }
        let mut plain = Some(self.mail.expect_plain(&["put_result"]));
        self.conn.write(&self.out)?;
        for (key, _) in &puts {
            let plain = plain.take().unwrap_or_else(|| self.mail.expect_plain(&["put_result"]));
            let reply = self.answer(plain, "put_result")?;
            if reply.rc() != 0 && refused.is_none() {
                refused = Some(refusal(key, &reply));
            }
        }
        Ok((request.is_some(), refused))
    }

    /// The value of `key` in the image of the key-value space, asked for first where it is due and no other
    /// thread waits for an answer (its memory file comes with the answer, to whichever thread reads it). A
    /// value that is not UTF-8, or longer than a PMI-1 line holds, is the server's to answer.
    fn imaged(&mut self, key: &str, value_max: usize) -> Option<&str> {
        if self.images.ask_now() && self.mail.alone() {
            self.mail.expect_fd();
            let answer = self.ask(&["cmd=get_kvs_image"], "kvs_image", false).map(|r| match r.rc() {
                0 => r.int("bytes").ok(),
                _ => None,
            });
            let file = self.mail.take_fd();
            self.images.arrived("libpmi", answer, file);
        }
        self.images.get(key.as_bytes()).and_then(rpmi_client::utf8).filter(|v| v.len() < value_max)
    }

    /// Sends the puts kept, alone: `Err` if the server refused one.
    fn flush_puts(&mut self, kvsname: &str) -> Result<(), Failed> {
        let (_, refused) = self.send_puts(kvsname, None)?;
        refused.map_or(Ok(()), Err)
    }

    /// Writes the request made of `pieces`, and its newline, in one write.
    fn send(&mut self, pieces: &[&str]) -> Result<(), Failed> {
        self.out.clear();
        self.out.reserve(pieces.iter().map(|p| p.len()).sum::<usize>() + 1);
        for piece in pieces {
            self.out.extend_from_slice(piece.as_bytes());
        }
        self.out.push(b'\n');
        self.conn.write(&self.out)
    }

    /// The next reply line, which must answer with `cmd=<answer>`, read by `read`.
    fn reply<T>(
        &mut self,
        plain: Plain,
        answer: &str,
        read: impl FnOnce(Reply) -> Result<T, Failed>,
    ) -> Result<T, Failed> {
        read(self.answer(plain, answer)?)
    }

    /// The next reply line, which must answer with `cmd=<answer>` (parsed once here; while a group barrier is
    /// outstanding, the mailbox reads a `barrier_out`'s tag before, to tell whose it is).
    fn answer(&mut self, plain: Plain, answer: &str) -> Result<Reply<'_>, Failed> {
        self.mail.take_plain_into(plain, &mut self.line)?;
        let reply = parsed(&self.line)?;
        if reply.cmd() != answer {
            return Err(Failed::said(format!(
                "the PMI server answered with {} where cmd={answer} was due",
                quote(&self.line)
            )));
        }
        Ok(reply)
    }

    /// Sends the request made of `pieces`, which must succeed (`rc=0`), and reads its reply, `cmd=<answer>`,
    /// with `read`.
    fn call_ok<T>(
        &mut self,
        pieces: &[&str],
        answer: &str,
        read: impl FnOnce(Reply) -> Result<T, Failed>,
    ) -> Result<T, Failed> {
        read(self.ask(pieces, answer, true)?)
    }

    /// Sends the request made of `pieces` and reads its reply, which must answer with `cmd=<answer>`, and
    /// succeed (`rc=0`) where `must_succeed`. Not generic, and not inlined: every request of a process runs
    /// this one copy, which its first request brings into the cache for the others.
    #[inline(never)]
    fn ask(&mut self, pieces: &[&str], answer: &str, must_succeed: bool) -> Result<Reply<'_>, Failed> {
        let plain = self.mail.expect_plain(&[answer]);
        self.send(pieces)?;
        let reply = self.answer(plain, answer)?;
        if must_succeed && reply.rc() != 0 {
            let request = pieces.first().map_or("", |p| p.split(' ').next().unwrap_or(p));
            return Err(Failed::said(format!("the PMI server failed '{request}': {}", reply.quoted())));
        }
        Ok(reply)
    }

    /// `init`, asking for PMI 1.2 where the launcher says its server answers it (rpmi's hosts set
    /// `RPMI_PMI_SUBVERSION`), else 1.1, which every server takes (Hydra ends a job whose client asks for
    /// more, Slurm's `--mpi=pmi2` refuses it), and saying that this library speaks rpmi's additions to the
    /// wire (`rpmi=1`, which other servers pass over): whether group barriers are served. A server that answers
    /// `rpmi=` is rpmi's: puts are kept until the barrier ([`Wire::send_puts`]).
    fn init(&mut self, size: u32) -> Result<bool, Failed> {
        let sub = if env_int(c"RPMI_PMI_SUBVERSION")?.is_some_and(|s| s >= 2) { "2" } else { "1" };
        let request = ["cmd=init pmi_version=1 pmi_subversion=", sub, " rpmi=", NodeBarrier::revision_asked()];
        let (groups, rpmi) = self.call_ok(&request, "response_to_init", |reply| {
            let rpmi = reply.get("rpmi").and_then(|r| r.parse::<u32>().ok()).unwrap_or(0);
            match (reply.get("pmi_version"), reply.get("pmi_subversion")) {
                (Some("1"), Some(sub)) => Ok((sub.parse::<u32>().is_ok_and(|s| s >= 2), rpmi)),
                (None, None) => Ok((false, rpmi)),
                _ => Err(Failed::said(format!("the PMI server answered init with {}", reply.quoted()))),
            }
        })?;
        self.rpmi = rpmi >= 1;
        self.images = Images::new(rpmi >= 2, size);
        self.node = NodeBarrier::answered(rpmi);
        Ok(groups)
    }

    fn maxes(&mut self) -> Result<Maxes, Failed> {
        self.call_ok(&["cmd=get_maxes"], "maxes", |reply| {
            let max = |key: &str| -> Result<usize, Failed> {
                let n = int_field(&reply, key)?;
                usize::try_from(n)
                    .ok()
                    .filter(|&n| n > 1 && n <= READ_MAX / 2)
                    .ok_or_else(|| Failed::said(format!("the PMI server advertises {key}={n}")))
            };
            Ok(Maxes { kvsname: max("kvsname_max")?, key: max("keylen_max")?, value: max("vallen_max")? })
        })
    }

    /// Hydra's port start-up: the id the launcher gave, answered with the rank and the size.
    fn initack(&mut self, id: i64) -> Result<(Option<i64>, Option<i64>), Failed> {
        self.call_ok(&["cmd=initack pmiid=", &id.to_string()], "initack", |_| Ok(()))?;
        let (mut rank, mut size) = (None, None);
        for _ in 0..3 {
            let plain = self.mail.expect_plain(&["set"]);
            self.reply(plain, "set", |reply| {
                if let Some(n) = reply.get("size") {
                    size = n.parse().ok();
                }
                if let Some(n) = reply.get("rank") {
                    rank = n.parse().ok();
                }
                Ok(())
            })?;
        }
        Ok((rank, size))
    }
}

/// A line the server sent, read.
fn parsed(line: &str) -> Result<Reply<'_>, Failed> {
    Reply::parse(line).map_err(|e| Failed::said(format!("the PMI server sent a {e}")))
}

/// A field the reply must carry.
fn field(reply: &Reply, key: &str) -> Result<String, Failed> {
    reply.field(key).map(str::to_string).map_err(Failed::said)
}

/// A number the server answered, as the C API's int.
fn small(n: i64, what: &str) -> Result<i32, Failed> {
    i32::try_from(n).map_err(|_| Failed::said(format!("the PMI server answered {what} with {n}")))
}

/// An integer field the reply must carry.
fn int_field(reply: &Reply, key: &str) -> Result<i64, Failed> {
    reply.int(key).map_err(Failed::said)
}

/// A group barrier's answer: `Err` saying why where the server failed it.
pub fn group_ended(line: &str) -> Result<(), Failed> {
    let reply = parsed(line)?;
    if reply.rc() != 0 {
        return Err(Failed::said(format!("the PMI server failed a group barrier: {}", reply.quoted())));
    }
    Ok(())
}

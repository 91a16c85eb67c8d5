//! The server's answers, for calls that wait without the session's lock: PMI 1.2 group barriers (threaded
//! MPICH enters one per thread, in any order on each rank) and PMI-2 node attributes waited for (another
//! thread of the process may be the one to put it), beside the plain requests of other threads.
//!
//! A plain request is sent and answered under the session's lock, so at most one is outstanding; a tagged
//! request is sent under the lock and waited for without it. Whichever waiting thread finds nobody reading
//! reads the next message and hands it out: one that names an outstanding tagged request's tag (PMI-1's
//! `barrier_out tag=`, PMI-2's `thrid=`) goes to it, any other to the plain request. One tag is outstanding at
//! a time per process (a second request of the same tag waits for the first to end). A server that does not
//! echo tags (Slurm's PMI-2 ignores `thrid`) is answered by command instead, and where a plain request is
//! answered by the command of an outstanding tagged request, only by order: such a request is sent in its turn,
//! once that tagged request is answered ([`Mailbox::expect_plain_in_turn`]). Until a thread first expects a
//! tagged request, nothing is waited for without the lock, and a plain request reads its answer straight from
//! the connection ([`Plain`]).

use crate::conn::Conn;
use crate::Failed;
use rpmi_wire::reply::{quote, Reply};
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};

/// A message from the server, as the mailbox hands it out.
pub trait Mail: Sized {
    /// Reads the next message.
    fn read(conn: &mut Conn) -> Result<Self, Failed>;
    /// Reads the next message into `into`, reusing what it holds where it can.
    fn read_into(conn: &mut Conn, into: &mut Self) -> Result<(), Failed> {
        *into = Self::read(conn)?;
        Ok(())
    }
    /// Its command (`cmd=`).
    fn cmd(&self) -> &str;
    /// The tag of the request it answers, where it says one.
    fn tag(&self) -> Option<i64>;
    /// It, for a message.
    fn shown(&self) -> String;
}

/// A PMI-1 line: only `barrier_out` is tagged (0 for a plain barrier, which no group barrier has).
impl Mail for String {
    fn read(conn: &mut Conn) -> Result<String, Failed> {
        conn.line()
    }

    fn read_into(conn: &mut Conn, into: &mut String) -> Result<(), Failed> {
        conn.line_into(into)
    }

    fn cmd(&self) -> &str {
        let rest = self.strip_prefix("cmd=").unwrap_or_default();
        // By bytes, not `split(' ')`, whose search lies far from the rest of a call's path (see `crate::utf8`).
        &rest[..rest.bytes().position(|b| b == b' ').unwrap_or(rest.len())]
    }

    fn tag(&self) -> Option<i64> {
        if !self.starts_with("cmd=barrier_out ") {
            return None;
        }
        Reply::parse(self).ok()?.get("tag")?.parse().ok()
    }

    fn shown(&self) -> String {
        quote(self)
    }
}

pub struct Mailbox<M> {
    /// The reading side of the connection, used by one thread at a time (the one that set `reading`).
    reader: Mutex<Conn>,
    state: Mutex<State<M>>,
    /// A message was handed out, the connection broke, a reader stopped, or a tagged request ended.
    changed: Condvar,
    /// No tagged request was ever expected, and the connection has not broken: see [`Plain`].
    direct: AtomicBool,
}

/// A plain request expected ([`Mailbox::expect_plain`]), whose answer is taken through it. Until a thread first
/// expects a tagged request, the thread of a plain request (which holds the session, as from its send to its
/// answer every plain request does) is the only one that reads: it reads its answer straight from the
/// connection, past the state that tells answers apart. A tagged request expected meanwhile cannot be sent
/// before that answer is read (its send needs the session), so the answer is still the next message.
#[must_use]
pub struct Plain {
    direct: bool,
}

struct State<M> {
    /// A thread is reading the connection.
    reading: bool,
    /// Threads waiting on `changed`: with none, nobody is woken (a wake is a system call, on every call).
    sleepers: usize,
    /// The command that answers the plain request outstanding, where its caller said it; empty where not
    /// (one buffer from call to call: nothing is allocated per call).
    plain_cmd: String,
    /// The answer to the plain request outstanding, once read.
    plain: Option<M>,
    /// The tagged requests outstanding, by tag: the command that answers each, and its answer once read.
    tagged: BTreeMap<i64, (String, Option<M>)>,
    /// Why the connection can no longer be read: every waiter fails with it.
    broken: Option<String>,
    /// The server echoed a tag: tagged requests' answers are told by their tags, and no plain request waits for
    /// its turn.
    echoed: bool,
}

/// What a waiter waits for.
#[derive(Clone, Copy)]
enum Awaited {
    Plain,
    Tagged(i64),
}

/// A tagged request expected ([`Mailbox::expect_tagged`]): its answer is taken through it, and a request that
/// is dropped untaken (never sent, or its caller gave up) is forgotten, so that the next of its tag can go.
pub struct Expected<'a, M: Mail> {
    mail: &'a Mailbox<M>,
    tag: i64,
    taken: bool,
}

impl<M: Mail> Expected<'_, M> {
    /// Its answer, reading the connection when no other thread is.
    pub fn take(mut self) -> Result<M, Failed> {
        self.taken = true;
        self.mail.take(Awaited::Tagged(self.tag))
    }
}

impl<M: Mail> Drop for Expected<'_, M> {
    fn drop(&mut self) {
        if !self.taken {
            let mut state = self.mail.state();
            state.tagged.remove(&self.tag);
            self.mail.wake(&state);
        }
    }
}

impl<M: Mail> Mailbox<M> {
    pub fn new(reader: Conn) -> Mailbox<M> {
        Mailbox {
            reader: Mutex::new(reader),
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            direct: AtomicBool::new(true),
        }
    }

    fn state(&self) -> MutexGuard<'_, State<M>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait_on<'a>(&self, mut state: MutexGuard<'a, State<M>>) -> MutexGuard<'a, State<M>> {
        state.sleepers += 1;
        let mut state = self.changed.wait(state).unwrap_or_else(|e| e.into_inner());
        state.sleepers -= 1;
        state
    }

    /// Wakes the threads waiting on `changed`, if any; called with the state locked.
    fn wake(&self, state: &State<M>) {
        if state.sleepers > 0 {
            self.changed.notify_all();
        }
    }

    /// The plain request about to be sent (under the session's lock) is answered by the command `pieces` make
    /// (PMI-2's `<request>-response`, without a string of its own for each request). Its caller holds the
    /// session's lock from here until it has taken the answer: the direct reading ([`Plain`]) rests on it.
    pub fn expect_plain(&self, pieces: &[&str]) -> Plain {
        if self.direct.load(Ordering::SeqCst) {
            return Plain { direct: true };
        }
        self.state().expect_plain(pieces);
        Plain { direct: false }
    }

    /// As [`Mailbox::expect_plain`], for a request whose answer a tagged request's may be taken for: a server
    /// that has never echoed a tag (Slurm's PMI-2 ignores `thrid`) answers both alike, and in whichever order it
    /// likes. `None`, with nothing expected, while a tagged request answered by the same command is outstanding
    /// unanswered there: the caller lets the session go, waits in [`Mailbox::wait_turn`], and asks again. A
    /// tagged request expected once this has let it go cannot be sent before its answer is taken (its send needs
    /// the session), so that answer is the first of its command.
    pub fn expect_plain_in_turn(&self, pieces: &[&str]) -> Option<Plain> {
        if self.direct.load(Ordering::SeqCst) {
            return Some(Plain { direct: true });
        }
        let mut state = self.state();
        if state.behind_tagged(pieces) {
            return None;
        }
        state.expect_plain(pieces);
        Some(Plain { direct: false })
    }

    /// Waits, without the session's lock, until a plain request answered by the command `pieces` make is in its
    /// turn ([`Mailbox::expect_plain_in_turn`]), or the connection broke.
    pub fn wait_turn(&self, pieces: &[&str]) {
        let mut state = self.state();
        while state.behind_tagged(pieces) {
            state = self.wait_on(state);
        }
    }

    /// No other thread waits for an answer, nor can until the session's lock, which the caller holds, is let go
    /// (a tagged request is sent under it): the answers to several plain requests written at once are then the
    /// next messages, in order, each taken in turn ([`Mailbox::expect_plain`] before each).
    pub fn alone(&self) -> bool {
        self.direct.load(Ordering::SeqCst) || self.state().tagged.is_empty()
    }

    /// The answer to the plain request about to be sent comes with an fd ([`Conn::expect_fd`]).
    pub fn expect_fd(&self) {
        self.reader.lock().unwrap_or_else(|e| e.into_inner()).expect_fd();
    }

    /// The fd that came with the answer since [`Mailbox::expect_fd`], once the answer is taken.
    pub fn take_fd(&self) -> Option<std::os::fd::OwnedFd> {
        self.reader.lock().unwrap_or_else(|e| e.into_inner()).take_fd()
    }

    /// The server echoed a tag where the mailbox did not see it (libpmi2's start-up asks `job-getid` with a
    /// `thrid`): its answers are told by their tags, and no plain request waits for its turn.
    pub fn tag_echoed(&self) {
        self.state().echoed = true;
    }

    /// A request of `tag`, answered by `cmd`, is about to be sent: its answer is kept for it, until
    /// [`Expected::take`] takes it (or the request is forgotten, when what is returned is dropped untaken).
    /// Waits while another thread's request of the same tag is outstanding, unless the connection broke; call it
    /// without the session's lock, before the request is sent (under the lock): the direct reading of plain
    /// requests ([`Plain`]) rests on it.
    pub fn expect_tagged(&self, tag: i64, cmd: &str) -> Expected<'_, M> {
        let mut state = self.state();
        self.direct.store(false, Ordering::SeqCst);
        while state.tagged.contains_key(&tag) && state.broken.is_none() {
            state = self.wait_on(state);
        }
        if state.broken.is_none() {
            state.tagged.insert(tag, (cmd.to_owned(), None));
        }
        Expected { mail: self, tag, taken: false }
    }

    /// The answer to the plain request `plain`, reading the connection when no other thread is.
    pub fn take_plain(&self, plain: Plain) -> Result<M, Failed> {
        if plain.direct {
            return self.read_direct(M::read);
        }
        self.take(Awaited::Plain)
    }

    /// The answer to the plain request `plain`, into `into` (reusing what it holds, where the answer is read
    /// here).
    pub fn take_plain_into(&self, plain: Plain, into: &mut M) -> Result<(), Failed> {
        if plain.direct {
            return self.read_direct(|conn| M::read_into(conn, into));
        }
        *into = self.take(Awaited::Plain)?;
        Ok(())
    }

    /// Reads the connection with `read`. A panic in it is a failure: it may have left a message half taken.
    fn read_guarded<T>(&self, read: impl FnOnce(&mut Conn) -> Result<T, Failed>) -> Result<T, Failed> {
        catch_unwind(AssertUnwindSafe(|| read(&mut self.reader.lock().unwrap_or_else(|e| e.into_inner()))))
            .unwrap_or_else(|_| Err(Failed::said("reading the PMI server's answer failed".into())))
    }

    /// Reads the connection for a plain request taken directly (see [`Plain`]).
    fn read_direct<T>(&self, read: impl FnOnce(&mut Conn) -> Result<T, Failed>) -> Result<T, Failed> {
        let got = self.read_guarded(read);
        if let Err(failed) = &got {
            // From now on every request goes through the state, which says why to each.
            self.direct.store(false, Ordering::SeqCst);
            let mut state = self.state();
            state.broken = Some(failed.message.clone().unwrap_or_default());
            self.wake(&state);
        }
        got
    }

    /// The next message for `awaited`, reading the connection when no other thread is.
    fn take(&self, awaited: Awaited) -> Result<M, Failed> {
        let mut state = self.state();
        loop {
            let mine = match awaited {
                Awaited::Plain => state.plain.take().inspect(|_| state.plain_cmd.clear()),
                Awaited::Tagged(tag) => match state.tagged.get_mut(&tag) {
                    Some((_, answer @ Some(_))) => {
                        let answer = answer.take();
                        state.tagged.remove(&tag);
                        self.wake(&state);
                        answer
                    }
                    _ => None,
                },
            };
            if let Some(message) = mine {
                return Ok(message);
            }
            if let Some(why) = state.broken.clone() {
                match awaited {
                    Awaited::Tagged(tag) => drop(state.tagged.remove(&tag)),
                    Awaited::Plain => state.plain_cmd.clear(),
                }
                // A thread may wait in `expect_tagged` for this tag to end.
                self.wake(&state);
                return Err(Failed::said(why));
            }
            if state.reading {
                state = self.wait_on(state);
                continue;
            }
            state.reading = true;
            drop(state);
            // Guarded: a panic in the read must not leave `reading` set, or every other waiter would wait for ever.
            let read = self.read_guarded(M::read);
            state = self.state();
            state.reading = false;
            match read {
                Ok(message) => state.hand_out(message),
                Err(failed) => state.broken = Some(failed.message.unwrap_or_default()),
            }
            self.wake(&state);
        }
    }
}

// Not derived: that would ask `M: Default`.
impl<M> Default for State<M> {
    fn default() -> State<M> {
        State {
            reading: false,
            sleepers: 0,
            plain_cmd: String::new(),
            plain: None,
            tagged: BTreeMap::new(),
            broken: None,
            echoed: false,
        }
    }
}

impl<M: Mail> State<M> {
    /// The plain request about to be sent is answered by the command `pieces` make.
    fn expect_plain(&mut self, pieces: &[&str]) {
        self.plain_cmd.clear();
        for piece in pieces {
            self.plain_cmd.push_str(piece);
        }
    }

    /// A plain request answered by the command `pieces` make must wait for its turn: see
    /// [`Mailbox::expect_plain_in_turn`].
    fn behind_tagged(&self, pieces: &[&str]) -> bool {
        !self.echoed
            && self.broken.is_none()
            && self.tagged.values().any(|(cmd, answer)| answer.is_none() && made_of(cmd, pieces))
    }

    fn hand_out(&mut self, message: M) {
        // With no tagged request outstanding, every message is the plain request's: its tag is not read (a
        // barrier's answer, read right after the longest wait of a start-up, would be parsed twice).
        if self.tagged.is_empty() {
            return self.hand_to_plain(message);
        }
        let tag = message.tag();
        if let Some((_, answer @ None)) = tag.and_then(|t| self.tagged.get_mut(&t)) {
            *answer = Some(message);
            self.echoed = true;
            return;
        }
        // A server that does not echo tags (Slurm's PMI-2 ignores `thrid`): an untagged answer of the
        // command a tagged request waits for, and not the plain request's, is the tagged request's.
        if tag.is_none() && self.plain_cmd != message.cmd() {
            let waiter = self.tagged.values_mut().find(|(cmd, answer)| answer.is_none() && cmd == message.cmd());
            if let Some((_, answer)) = waiter {
                *answer = Some(message);
                return;
            }
        }
        self.hand_to_plain(message);
    }

    fn hand_to_plain(&mut self, message: M) {
        if self.plain.is_none() {
            self.plain = Some(message);
        } else {
            self.broken = Some(format!("the PMI server sent {} where no answer was due", message.shown()));
        }
    }
}

/// `cmd` is the command `pieces` make (compared piece by piece: nothing is allocated to join them).
fn made_of(cmd: &str, pieces: &[&str]) -> bool {
    let mut rest = cmd;
    for piece in pieces {
        match rest.strip_prefix(piece) {
            Some(r) => rest = r,
            None => return false,
        }
    }
    rest.is_empty()
}

#[cfg(test)]
mod tests {
    use super::{Mail, Mailbox, State};
    use crate::conn::Conn;
    use crate::Failed;
    use std::io::Write;
    use std::os::unix::net::UnixStream;
    use std::sync::{mpsc, Arc};
    use std::time::Duration;

    /// A mailbox reading PMI-1 lines from a socket, and the server's end of it.
    fn mailbox() -> (Arc<Mailbox<String>>, UnixStream) {
        let (ours, server) = UnixStream::pair().unwrap();
        (Arc::new(Mailbox::new(Conn::of_stream(ours))), server)
    }

    /// What a thread that asks `mail` for the answer to a request of tag 7 gets, if it gets it within 10 s (a
    /// thread that would wait for ever is left behind, and the test fails instead of hanging).
    fn second_request(mail: &Arc<Mailbox<String>>) -> mpsc::Receiver<Result<String, Failed>> {
        let (tx, rx) = mpsc::channel();
        let mail = mail.clone();
        std::thread::spawn(move || tx.send(mail.expect_tagged(7, "barrier_out").take()));
        rx
    }

    #[test]
    fn a_tagged_request_never_taken_is_forgotten_and_the_next_of_its_tag_goes() {
        let (mail, mut server) = mailbox();
        drop(mail.expect_tagged(7, "barrier_out"));
        server.write_all(b"cmd=barrier_out rc=0 tag=7\n").unwrap();
        // Were the first not forgotten, the second would wait for ever for it to end.
        let answer = second_request(&mail).recv_timeout(Duration::from_secs(10)).expect("the second never went");
        assert_eq!(answer.unwrap(), "cmd=barrier_out rc=0 tag=7");
    }

    #[test]
    fn a_broken_connection_fails_the_waiter_and_frees_the_thread_queued_behind_its_tag() {
        let (mail, server) = mailbox();
        let expected = mail.expect_tagged(7, "barrier_out");
        let second = second_request(&mail);
        // The second thread queues behind the tag; then the server goes away.
        std::thread::sleep(Duration::from_millis(50));
        drop(server);
        assert!(expected.take().is_err());
        let answer = second.recv_timeout(Duration::from_secs(10)).expect("the queued thread was never woken");
        assert!(answer.is_err());
    }

    #[test]
    fn a_plain_request_reads_its_answer_directly_until_a_tagged_one_is_expected() {
        let (mail, mut server) = mailbox();
        let plain = mail.expect_plain(&["put_result"]);
        assert!(plain.direct);
        // Another thread expects a group barrier while the plain request waits: its send would need the session,
        // so the next line is still the plain request's, even a `barrier_out` without a tag.
        let expected = mail.expect_tagged(7, "barrier_out");
        server.write_all(b"cmd=barrier_out rc=0\ncmd=barrier_out rc=0 tag=7\n").unwrap();
        let mut line = String::new();
        mail.take_plain_into(plain, &mut line).unwrap();
        assert_eq!(line, "cmd=barrier_out rc=0");
        let plain = mail.expect_plain(&["barrier_out"]);
        assert!(!plain.direct, "a tagged request was expected: answers go through the state");
        assert_eq!(expected.take().unwrap(), "cmd=barrier_out rc=0 tag=7");
        server.write_all(b"cmd=barrier_out rc=0 tag=0\n").unwrap();
        assert_eq!(mail.take_plain(plain).unwrap(), "cmd=barrier_out rc=0 tag=0");
    }

    #[test]
    fn a_connection_broken_under_a_direct_read_fails_every_later_request_with_why() {
        let (mail, server) = mailbox();
        drop(server);
        let plain = mail.expect_plain(&["put_result"]);
        let why = mail.take_plain(plain).unwrap_err().message.unwrap();
        assert!(why.contains("closed the connection"), "{why}");
        let plain = mail.expect_plain(&["put_result"]);
        assert!(!plain.direct);
        assert_eq!(mail.take_plain(plain).unwrap_err().message.unwrap(), why);
        assert_eq!(mail.expect_tagged(7, "barrier_out").take().unwrap_err().message.unwrap(), why);
    }

    #[test]
    fn a_group_barriers_answer_goes_to_it_and_any_other_line_to_the_plain_request() {
        let mut state = State::<String>::default();
        state.tagged.insert(7, ("barrier_out".into(), None));
        state.hand_out("cmd=barrier_out rc=0 tag=7".into());
        assert_eq!(state.tagged[&7].1.as_deref(), Some("cmd=barrier_out rc=0 tag=7"));
        // A plain barrier's answer (tag 0), and a second answer of a barrier whose first is not yet taken.
        state.hand_out("cmd=barrier_out rc=0 tag=0".into());
        assert_eq!(state.plain.as_deref(), Some("cmd=barrier_out rc=0 tag=0"));
        assert!(state.broken.is_none());
        state.hand_out("cmd=barrier_out rc=0 tag=7".into());
        assert!(state.broken.as_deref().unwrap().contains("where no answer was due"), "{:?}", state.broken);
    }

    /// A PMI-2 answer as the test writes it: its command and its `thrid`, if any.
    struct Frame(&'static str, Option<i64>);

    impl Mail for Frame {
        fn read(_: &mut Conn) -> Result<Frame, Failed> {
            unreachable!("the tests hand out what they make")
        }
        fn cmd(&self) -> &str {
            self.0
        }
        fn tag(&self) -> Option<i64> {
            self.1
        }
        fn shown(&self) -> String {
            self.0.into()
        }
    }

    #[test]
    fn an_answer_without_its_thrid_goes_to_the_waiter_of_its_command_unless_the_plain_request_awaits_it() {
        let mut state = State::<Frame>::default();
        state.tagged.insert(1, (NODE.into(), None));
        // A server that echoes thrid: by the tag, whatever the plain request awaits.
        state.plain_cmd = NODE.into();
        state.hand_out(Frame(NODE, Some(1)));
        assert!(state.tagged[&1].1.is_some() && state.plain.is_none());
        // One that does not: by the command, the plain request's first.
        state.tagged.insert(1, (NODE.into(), None));
        state.plain_cmd = "kvs-get-response".into();
        state.hand_out(Frame("kvs-get-response", None));
        assert!(state.tagged[&1].1.is_none() && state.plain.take().is_some());
        state.hand_out(Frame(NODE, None));
        assert!(state.tagged[&1].1.is_some());
        state.tagged.insert(1, (NODE.into(), None));
        state.plain_cmd = NODE.into();
        state.hand_out(Frame(NODE, None));
        assert!(state.tagged[&1].1.is_none() && state.plain.is_some());
    }

    /// A PMI-2 answer, written as a line in these tests: `cmd=info-getnodeattr-response thrid=1 value=x`.
    struct Pmi2(String);

    impl Mail for Pmi2 {
        fn read(conn: &mut Conn) -> Result<Pmi2, Failed> {
            conn.line().map(Pmi2)
        }
        fn cmd(&self) -> &str {
            self.0.cmd()
        }
        fn tag(&self) -> Option<i64> {
            rpmi_wire::reply::Reply::parse(&self.0).ok()?.get("thrid")?.parse().ok()
        }
        fn shown(&self) -> String {
            self.0.clone()
        }
    }

    const NODE: &str = "info-getnodeattr-response";

    /// Asks, as libpmi2 asks for a node attribute as it is now: once in its turn, `send` (the server reads the
    /// request), then its answer.
    fn ask_in_turn(mail: &Mailbox<Pmi2>, send: impl FnOnce()) -> Result<String, Failed> {
        let plain = loop {
            match mail.expect_plain_in_turn(&[NODE]) {
                Some(plain) => break plain,
                None => mail.wait_turn(&[NODE]),
            }
        };
        send();
        mail.take_plain(plain).map(|answer| answer.0)
    }

    /// Slurm's PMI-2 server says no `thrid`: one thread's wait for node attribute x and another's get of y as it
    /// is now are answered alike, and in whichever order it likes. Here another task puts x just before the
    /// server reads the get: x's answer comes first. Sent only once the wait is answered, the get takes its own.
    #[test]
    fn a_get_as_it_is_now_waits_behind_a_wait_the_server_answers_without_its_thrid() {
        let (ours, mut server) = UnixStream::pair().unwrap();
        let mail = Mailbox::<Pmi2>::new(Conn::of_stream(ours));
        let (sent, get_sent) = mpsc::channel();
        std::thread::scope(|s| {
            let wait = mail.expect_tagged(1, NODE);
            let waiter = s.spawn(move || wait.take().map(|answer| answer.0));
            let getter = s.spawn(|| ask_in_turn(&mail, move || sent.send(()).unwrap()));
            let early = get_sent.recv_timeout(Duration::from_millis(200)).is_ok();
            server.write_all(b"cmd=info-getnodeattr-response rc=0 found=TRUE value=x\n").unwrap();
            if !early {
                get_sent.recv_timeout(Duration::from_secs(10)).expect("the get was never sent");
            }
            server.write_all(b"cmd=info-getnodeattr-response rc=0 found=TRUE value=y\n").unwrap();
            let got = (getter.join().unwrap(), waiter.join().unwrap());
            assert!(
                !early,
                "the get was sent while the wait was outstanding: it got {:?}, the wait {:?}",
                got.0, got.1
            );
            assert_eq!(got.0.unwrap(), "cmd=info-getnodeattr-response rc=0 found=TRUE value=y");
            assert_eq!(got.1.unwrap(), "cmd=info-getnodeattr-response rc=0 found=TRUE value=x");
        });
    }

    #[test]
    fn a_plain_request_waits_its_turn_only_behind_an_unanswered_wait_of_its_command_from_a_server_without_tags() {
        let (ours, _server) = UnixStream::pair().unwrap();
        let mail = Mailbox::<Pmi2>::new(Conn::of_stream(ours));
        // Nothing tagged was ever expected: the request reads its answer directly, as every plain one does.
        assert!(mail.expect_plain_in_turn(&[NODE]).is_some_and(|plain| plain.direct));
        let wait = mail.expect_tagged(1, NODE);
        assert!(mail.expect_plain_in_turn(&["info-getnodeattr", "-response"]).is_none());
        assert!(mail.expect_plain_in_turn(&["kvs-get", "-response"]).is_some());
        // A server seen to echo a tag (rpmi's, Hydra's: libpmi2's start-up asks) tells the answers apart.
        mail.tag_echoed();
        assert!(mail.expect_plain_in_turn(&[NODE]).is_some());
        drop(wait);

        let mut state = State::<Frame>::default();
        state.tagged.insert(1, (NODE.into(), None));
        assert!(state.behind_tagged(&[NODE]));
        // Answered, if not yet taken: the next answer of its command is the plain request's.
        state.hand_out(Frame(NODE, None));
        assert!(!state.behind_tagged(&[NODE]));
        // An answer told by its tag: the server echoes them.
        state.tagged.insert(2, (NODE.into(), None));
        state.hand_out(Frame(NODE, Some(2)));
        state.tagged.insert(3, (NODE.into(), None));
        assert!(!state.behind_tagged(&[NODE]));
    }
}

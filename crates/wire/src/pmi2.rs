//! PMI-2's wire format, spoken on a connection whose client asked for version 2 at `cmd=init`.
//!
//! A message is a frame: 6 bytes of decimal length (padded with spaces on either side: MPICH writes
//! `%6u`, Slurm's clients `%-6d`), then that many bytes: `cmd=NAME;` and `key=value;` pairs, each ended by
//! `;`. Older clients (MPICH 3's and Slurm's libpmi2) write a `;` inside a value as `;;`; newer MPICH writes
//! none. Both are read, and a `;` in a value this server sends is doubled. Values run to their `;`, so they
//! may hold spaces and `=`. Answers are `cmd=NAME-response;`, then the request's `thrid` if it had one (a
//! threaded client matches answers to requests by it), `rc=`, fields, and on failure `errmsg=`.
//!
//! Everything is bounded: the length (at most the caller's limit, checked before the body is read) and the
//! pairs of one message ([`MAX_PAIRS`]).

use super::request::{parse_int, ParseError};
use super::response::push_int;
use super::spawn::{SpawnCommand, SpawnRequest, MAX_COMMANDS, MAX_ITEMS};
use std::borrow::Cow;

/// The length prefix of a frame.
pub const HEADER_LEN: usize = 6;
/// The largest length the prefix can say.
pub const FRAME_MAX: usize = 999_999;
/// At most this many pairs in one message: a spawn of [`MAX_COMMANDS`] commands with their items fits.
pub const MAX_PAIRS: usize = 16 * 1024;

/// The body length a frame's prefix says; `None` if it is not a decimal number padded with spaces.
pub fn body_len(header: &[u8]) -> Option<usize> {
    let header = header.get(..HEADER_LEN)?;
    let start = header.iter().position(|&b| b != b' ')?;
    let end = header.iter().rposition(|&b| b != b' ')? + 1;
    // At most six digits: no overflow.
    header[start..end].iter().try_fold(0, |n, &d| d.is_ascii_digit().then(|| n * 10 + usize::from(d - b'0')))
}

/// One message: its command and its pairs, in the order sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message<'a> {
    pub cmd: &'a [u8],
    pairs: Vec<(&'a [u8], Cow<'a, [u8]>)>,
}

impl<'a> Message<'a> {
    /// Splits a frame's body into its command and pairs.
    pub fn parse(body: &'a [u8]) -> Result<Message<'a>, ParseError> {
        // A pair has an `=`: sized once for what a request or answer holds, not grown pair by pair (a spawn
        // grows past it; a value full of `=` reserves no more).
        let mut pairs: Vec<(&[u8], Cow<[u8]>)> =
            Vec::with_capacity(body.iter().filter(|&&b| b == b'=').count().min(16));
        let mut rest = body;
        while !rest.is_empty() {
            if pairs.len() == MAX_PAIRS {
                return Err(ParseError::TooManyTuples);
            }
            let eq = rest.iter().position(|&b| b == b'=').ok_or(ParseError::BadToken)?;
            let key = trim(&rest[..eq]);
            if key.is_empty() || key.contains(&b';') {
                return Err(ParseError::BadToken);
            }
            let (value, used) = value(&rest[eq + 1..]);
            pairs.push((key, value));
            rest = &rest[eq + 1 + used..];
        }
        match pairs.first() {
            Some((key, Cow::Borrowed(cmd))) if *key == b"cmd" && !cmd.is_empty() => {
                let cmd = *cmd;
                pairs.remove(0);
                Ok(Message { cmd, pairs })
            }
            _ => Err(ParseError::NoCommand),
        }
    }

    /// Every pair but the command, in the order sent.
    pub fn pairs(&self) -> impl ExactSizeIterator<Item = (&[u8], &[u8])> {
        self.pairs.iter().map(|(k, v)| (*k, v.as_ref()))
    }

    /// The first value of `key`.
    pub fn get(&self, key: &str) -> Option<&[u8]> {
        self.pairs.iter().find(|(k, _)| *k == key.as_bytes()).map(|(_, v)| v.as_ref())
    }

    /// The request this message is; `Err` for a malformed one (a protocol error) or an unknown command.
    pub fn request(&self) -> Result<Request2<'_>, ParseError> {
        let command = self.name();
        let need = |field: &'static str| self.get(field).ok_or(ParseError::MissingField { command, field });
        let int = |field: &'static str| -> Result<Option<i64>, ParseError> {
            self.get(field).map(|v| parse_int(v).ok_or(ParseError::BadInteger { field })).transpose()
        };
        Ok(match self.cmd {
            b"fullinit" => Request2::FullInit { pmirank: int("pmirank")?, threaded: self.flag("threaded")? },
            b"job-getid" => Request2::JobGetId,
            b"job-connect" => Request2::JobConnect,
            b"job-disconnect" => Request2::JobDisconnect,
            b"kvs-put" => Request2::KvsPut { key: need("key")?, value: self.get("value").unwrap_or_default() },
            b"kvs-fence" => Request2::KvsFence,
            b"kvs-image" => Request2::KvsImage,
            b"node-barrier-in" => Request2::NodeBarrierIn,
            b"kvs-get" => Request2::KvsGet { jobid: self.get("jobid"), key: need("key")? },
            b"info-getjobattr" => Request2::GetJobAttr { key: need("key")? },
            b"info-putnodeattr" => {
                Request2::PutNodeAttr { key: need("key")?, value: self.get("value").unwrap_or_default() }
            }
            b"info-getnodeattr" => Request2::GetNodeAttr { key: need("key")?, wait: self.flag("wait")? },
            b"abort" => Request2::Abort { exit_code: int("exitcode")?, message: self.get("message") },
            b"finalize" => Request2::Finalize,
            b"name-publish" => Request2::Publish { name: need("name")?, port: need("port")? },
            b"name-unpublish" => Request2::Unpublish { name: need("name")? },
            b"name-lookup" => Request2::Lookup { name: need("name")? },
            b"spawn" => Request2::Spawn(self.spawn().map_err(|e| ParseError::Spawn(e.0))?),
            other => return Err(ParseError::UnknownCommand(String::from_utf8_lossy(other).into_owned())),
        })
    }

    /// The command's name, for messages.
    fn name(&self) -> &'static str {
        match self.cmd {
            b"kvs-put" => "kvs-put",
            b"kvs-get" => "kvs-get",
            b"info-getjobattr" => "info-getjobattr",
            b"info-putnodeattr" => "info-putnodeattr",
            b"info-getnodeattr" => "info-getnodeattr",
            b"name-publish" => "name-publish",
            b"name-unpublish" => "name-unpublish",
            b"name-lookup" => "name-lookup",
            _ => "PMI-2",
        }
    }

    /// A boolean field: `TRUE` or `FALSE` (any case); absent is false.
    fn flag(&self, field: &'static str) -> Result<bool, ParseError> {
        match self.get(field) {
            None => Ok(false),
            Some(v) if v.eq_ignore_ascii_case(b"TRUE") => Ok(true),
            Some(v) if v.eq_ignore_ascii_case(b"FALSE") => Ok(false),
            Some(_) => Err(ParseError::BadBoolean { field }),
        }
    }

    /// `cmd=spawn;ncmds=N;preputcount=P;ppkey0=..;ppval0=..;` then per command `subcmd=EXE;maxprocs=N;argc=A;
    /// argv0=..;infokeycount=I;infokey0=..;infoval0=..;`. Items come in order (each index the next one), so
    /// what is kept is what was sent: a count alone allocates nothing. The preputs go with the first command
    /// (the new job gets every command's: [`SpawnRequest::preputs`]).
    fn spawn(&self) -> Result<SpawnRequest, super::spawn::SpawnError> {
        use super::spawn::SpawnError;
        let bad = |what: String| Err(SpawnError(what));
        let count = |v: &[u8], what: &str, max: u32| match parse_int(v) {
            Some(n) if (0..=i64::from(max)).contains(&n) => Ok(n as usize),
            _ => Err(SpawnError(format!("{what} is not a count from 0 to {max}"))),
        };
        let mut preputs: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        let mut commands: Vec<SpawnCommand> = Vec::new();
        // What each command declared: argc and infokeycount.
        let mut declared: Vec<(usize, usize)> = Vec::new();
        let (mut ncmds, mut preputcount) = (None, 0);
        for (key, value) in &self.pairs {
            let key = *key;
            let indexed = |prefix: &str| key.strip_prefix(prefix.as_bytes()).and_then(parse_int);
            let shown = || String::from_utf8_lossy(key).into_owned();
            match (commands.last_mut(), declared.last_mut()) {
                _ if key == b"subcmd" => {
                    if commands.len() as u32 == MAX_COMMANDS {
                        return bad(format!("more than {MAX_COMMANDS} commands"));
                    }
                    commands.push(SpawnCommand { execname: value.to_vec(), ..SpawnCommand::default() });
                    declared.push((0, 0));
                }
                (None, _) if key == b"ncmds" => ncmds = Some(count(value, "ncmds", MAX_COMMANDS)?),
                (None, _) if key == b"preputcount" => preputcount = count(value, "preputcount", MAX_ITEMS)?,
                (None, _) => {
                    if let Some(i) = indexed("ppkey") {
                        if i != preputs.len() as i64 || preputs.len() == preputcount {
                            return bad(format!("{} out of order or beyond preputcount", shown()));
                        }
                        preputs.push((value.to_vec(), Vec::new()));
                    } else if let Some(i) = indexed("ppval") {
                        let len = preputs.len() as i64;
                        match preputs.last_mut().filter(|_| i == len - 1) {
                            Some(p) => p.1 = value.to_vec(),
                            None => return bad(format!("{} without its ppkey", shown())),
                        }
                    }
                }
                (Some(c), _) if key == b"maxprocs" => c.nprocs = count(value, "maxprocs", u32::MAX)? as u32,
                (Some(_), Some(d)) if key == b"argc" => d.0 = count(value, "argc", MAX_ITEMS)?,
                (Some(_), Some(d)) if key == b"infokeycount" => d.1 = count(value, "infokeycount", MAX_ITEMS)?,
                (Some(c), Some(d)) => {
                    if let Some(i) = indexed("argv") {
                        if i != c.args.len() as i64 || c.args.len() == d.0 {
                            return bad(format!("{} out of order or beyond argc", shown()));
                        }
                        c.args.push(value.to_vec());
                    } else if let Some(i) = indexed("infokey") {
                        if i != c.infos.len() as i64 || c.infos.len() == d.1 {
                            return bad(format!("{} out of order or beyond infokeycount", shown()));
                        }
                        c.infos.push((value.to_vec(), Vec::new()));
                    } else if let Some(i) = indexed("infoval") {
                        let len = c.infos.len() as i64;
                        match c.infos.last_mut().filter(|_| i == len - 1) {
                            Some(info) => info.1 = value.to_vec(),
                            None => return bad(format!("{} without its infokey", shown())),
                        }
                    }
                }
                (Some(_), None) => {}
            }
        }
        if commands.is_empty() || ncmds != Some(commands.len()) {
            return bad(format!("ncmds says {}, the request has {} commands", ncmds.unwrap_or(0), commands.len()));
        }
        if preputs.len() != preputcount {
            return bad(format!("preputcount says {preputcount}, the request has {}", preputs.len()));
        }
        for (c, &(argc, infos)) in commands.iter().zip(&declared) {
            if c.execname.is_empty() {
                return bad("a command without a program".into());
            }
            if c.args.len() != argc || c.infos.len() != infos {
                let program = String::from_utf8_lossy(&c.execname);
                return bad(format!("the argc or infokeycount of {program} does not match its items"));
            }
        }
        commands[0].preputs = preputs;
        Ok(SpawnRequest { commands })
    }
}

/// A value up to its `;` (a `;;` is one `;` of the value), and how many bytes it took with its end.
fn value(rest: &[u8]) -> (Cow<'_, [u8]>, usize) {
    let mut i = 0;
    let mut owned: Option<Vec<u8>> = None;
    while i < rest.len() {
        if rest[i] == b';' {
            if rest.get(i + 1) == Some(&b';') {
                owned.get_or_insert_with(|| rest[..i].to_vec()).push(b';');
                i += 2;
                continue;
            }
            let v = owned.map_or(Cow::Borrowed(&rest[..i]), Cow::Owned);
            return (v, i + 1);
        }
        if let Some(o) = &mut owned {
            o.push(rest[i]);
        }
        i += 1;
    }
    (owned.map_or(Cow::Borrowed(rest), Cow::Owned), rest.len())
}

fn trim(s: &[u8]) -> &[u8] {
    let start = s.iter().position(|&b| b != b' ').unwrap_or(s.len());
    &s[start..]
}

/// One PMI-2 request from a task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request2<'a> {
    /// `fullinit;pmirank=R;threaded=T` (MPICH sends -1 without `PMI_RANK`; Slurm's clients add `pmijobid`,
    /// ignored). `threaded`: the client's threads may send requests while another waits for its answer.
    FullInit {
        pmirank: Option<i64>,
        threaded: bool,
    },
    JobGetId,
    JobConnect,
    JobDisconnect,
    KvsPut {
        key: &'a [u8],
        value: &'a [u8],
    },
    KvsFence,
    /// `kvs-image`: rpmi's own (revision 2), as PMI-1's `get_kvs_image`.
    KvsImage,
    /// `node-barrier-in`: rpmi's own (revision 3), as PMI-1's `node_barrier_in`.
    NodeBarrierIn,
    /// `kvs-get;jobid=J;srcid=S;key=K`: `srcid` is a hint, ignored.
    KvsGet {
        jobid: Option<&'a [u8]>,
        key: &'a [u8],
    },
    GetJobAttr {
        key: &'a [u8],
    },
    PutNodeAttr {
        key: &'a [u8],
        value: &'a [u8],
    },
    /// `info-getnodeattr;key=K;wait=TRUE`: with `wait`, answered once a task of the node puts `K`.
    GetNodeAttr {
        key: &'a [u8],
        wait: bool,
    },
    Abort {
        exit_code: Option<i64>,
        message: Option<&'a [u8]>,
    },
    Finalize,
    Publish {
        name: &'a [u8],
        port: &'a [u8],
    },
    Unpublish {
        name: &'a [u8],
    },
    Lookup {
        name: &'a [u8],
    },
    Spawn(SpawnRequest),
}

/// Builds one frame in an output buffer: [`Writer::answer`] (the server's) or [`Writer::request`] (a
/// client's), fields, then `finish`.
pub struct Writer<'a> {
    out: &'a mut Vec<u8>,
    start: usize,
}

impl<'a> Writer<'a> {
    /// Starts a client's request, `cmd=<cmd>;`.
    pub fn request(out: &'a mut Vec<u8>, cmd: &str) -> Self {
        let start = out.len();
        out.extend_from_slice(&[b' '; HEADER_LEN]);
        let mut f = Writer { out, start };
        f.field("cmd", cmd.as_bytes());
        f
    }

    /// Starts an answer, `cmd=<cmd>;[thrid=<thrid>;]rc=<rc>;`.
    pub fn answer(out: &'a mut Vec<u8>, cmd: &str, thrid: Option<&[u8]>, rc: i32) -> Self {
        let mut f = Writer::request(out, cmd);
        if let Some(t) = thrid {
            f.field("thrid", t);
        }
        let mut n = Vec::new();
        push_int(&mut n, i64::from(rc));
        f.field("rc", &n);
        f
    }

    /// Appends `key=<integer>;`.
    pub fn int(mut self, key: &str, n: i64) -> Self {
        let mut v = Vec::new();
        push_int(&mut v, n);
        self.field(key, &v);
        self
    }

    /// Appends `key=TRUE;` or `key=FALSE;`: the only spellings Slurm's libpmi2 reads as booleans (anything
    /// else fails the call).
    pub fn bool(self, key: &str, b: bool) -> Self {
        self.str(key, if b { b"TRUE" } else { b"FALSE" })
    }

    /// Appends `key=<value>;`, a `;` in the value doubled.
    pub fn str(mut self, key: &str, value: &[u8]) -> Self {
        self.field(key, value);
        self
    }

    /// Appends `errmsg=<text>;` unless the text is empty.
    pub fn errmsg(self, text: &str) -> Self {
        match text.trim() {
            "" => self,
            t => self.str("errmsg", t.as_bytes()),
        }
    }

    /// Writes the length prefix: the frame is whole. A frame longer than the prefix can say (an answer that
    /// echoes a long `thrid` beside a long value) becomes `cmd=<cmd>;rc=-1;errmsg=...;`: the peer reads a
    /// failure, not a stream cut at the wrong place.
    pub fn finish(self) {
        let mut len = self.out.len() - self.start - HEADER_LEN;
        if len > FRAME_MAX {
            let body = &self.out[self.start + HEADER_LEN..];
            // `cmd=<cmd>;` opens every frame written here, and a command has no `;`.
            let cmd = body.iter().position(|&b| b == b';').map_or(Vec::new(), |end| body[4..end].to_vec());
            self.out.truncate(self.start + HEADER_LEN);
            let mut f = Writer { out: &mut *self.out, start: self.start };
            f.field("cmd", &cmd);
            f.field("rc", b"-1");
            f.field("errmsg", b"the answer is longer than a PMI-2 frame holds");
            len = self.out.len() - self.start - HEADER_LEN;
        }
        // Right-aligned, as `%6u` writes it; by hand, since this runs for every frame either side sends.
        let header = &mut self.out[self.start..self.start + HEADER_LEN];
        for d in header.iter_mut().rev() {
            *d = b'0' + (len % 10) as u8;
            len /= 10;
            if len == 0 {
                break;
            }
        }
    }

    fn field(&mut self, key: &str, value: &[u8]) {
        self.out.reserve(key.len() + value.len() + 2);
        self.out.extend_from_slice(key.as_bytes());
        self.out.push(b'=');
        let mut rest = value;
        while let Some(at) = rest.iter().position(|&b| b == b';') {
            self.out.extend_from_slice(&rest[..=at]);
            self.out.push(b';');
            rest = &rest[at + 1..];
        }
        self.out.extend_from_slice(rest);
        self.out.push(b';');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(f: impl FnOnce(&mut Vec<u8>)) -> String {
        let mut out = Vec::new();
        f(&mut out);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn lengths_are_read_padded_either_side() {
        assert_eq!(body_len(b"    23cmd="), Some(23));
        assert_eq!(body_len(b"23    "), Some(23));
        assert_eq!(body_len(b"000100"), Some(100));
        for bad in [&b"      "[..], b" 2 3  ", b"-1    ", b"12ab  ", b"12"] {
            assert_eq!(body_len(bad), None, "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn messages_split_into_command_and_pairs() {
        let m = Message::parse(b"cmd=kvs-put;key=-bcast-1-0;value=a b=c;").unwrap();
        assert_eq!(m.request(), Ok(Request2::KvsPut { key: b"-bcast-1-0", value: b"a b=c" }));
        // The last `;` may be missing; `;;` is a `;` of the value; a thrid is kept.
        let m = Message::parse(b"cmd=kvs-get;thrid=0x1;jobid=kvs_1;srcid=-1;key=x;;y").unwrap();
        assert_eq!(m.get("thrid"), Some(&b"0x1"[..]));
        assert_eq!(m.request(), Ok(Request2::KvsGet { jobid: Some(b"kvs_1"), key: b"x;y" }));
        let m = Message::parse(b"cmd=fullinit;pmirank=-1;").unwrap();
        assert_eq!(m.request(), Ok(Request2::FullInit { pmirank: Some(-1), threaded: false }));
        let m = Message::parse(b"cmd=fullinit;pmirank=2;threaded=TRUE;").unwrap();
        assert_eq!(m.request(), Ok(Request2::FullInit { pmirank: Some(2), threaded: true }));
        let m = Message::parse(b"cmd=info-getnodeattr;key=k;wait=TRUE;").unwrap();
        assert_eq!(m.request(), Ok(Request2::GetNodeAttr { key: b"k", wait: true }));
    }

    #[test]
    fn malformed_messages_are_refused() {
        for bad in [&b"key=v;"[..], b"cmd=;", b"cmd", b"cmd=finalize;junk;", b"cmd=kvs-put;=v;", b"cmd=finalize;a;b=c;"]
        {
            assert!(Message::parse(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        let unknown = Message::parse(b"cmd=no-such;").unwrap();
        assert!(matches!(unknown.request(), Err(ParseError::UnknownCommand(_))));
        let missing = Message::parse(b"cmd=kvs-get;jobid=j;").unwrap();
        assert!(matches!(missing.request(), Err(ParseError::MissingField { field: "key", .. })));
        let flag = Message::parse(b"cmd=info-getnodeattr;key=k;wait=maybe;").unwrap();
        assert!(matches!(flag.request(), Err(ParseError::BadBoolean { field: "wait" })));
        let many = "a=b;".repeat(MAX_PAIRS + 1);
        assert_eq!(Message::parse(format!("cmd=x;{many}").as_bytes()), Err(ParseError::TooManyTuples));
    }

    #[test]
    fn a_spawn_carries_its_commands_and_preputs() {
        let body = b"cmd=spawn;thrid=1;ncmds=2;preputcount=1;ppkey0=PARENT_ROOT_PORT_NAME;ppval0=tag#0$port$;\
            subcmd=./a;maxprocs=2;argc=2;argv0=x;argv1=two words;infokeycount=1;infokey0=wdir;infoval0=/tmp;\
            subcmd=./b;maxprocs=1;argc=0;infokeycount=0;";
        let Ok(Request2::Spawn(s)) = Message::parse(body).unwrap().request() else { panic!() };
        assert_eq!(s.commands.len(), 2);
        let pp = vec![(b"PARENT_ROOT_PORT_NAME".to_vec(), b"tag#0$port$".to_vec())];
        assert_eq!(s.commands[0].execname, b"./a");
        assert_eq!((s.commands[0].nprocs, s.commands[1].nprocs), (2, 1));
        assert_eq!(s.commands[0].args, [b"x".to_vec(), b"two words".to_vec()]);
        assert_eq!(s.commands[0].infos, [(b"wdir".to_vec(), b"/tmp".to_vec())]);
        assert_eq!((&s.commands[0].preputs, &s.commands[1].preputs), (&pp, &vec![]));
        assert_eq!(s.preputs(), Ok(pp));
        for bad in [
            &b"cmd=spawn;ncmds=2;preputcount=0;subcmd=./a;maxprocs=1;argc=0;"[..],
            b"cmd=spawn;ncmds=1;preputcount=0;subcmd=./a;maxprocs=1;argc=1;argv1=x;",
            b"cmd=spawn;ncmds=1;preputcount=1;subcmd=./a;maxprocs=1;argc=0;",
            b"cmd=spawn;ncmds=1;preputcount=0;subcmd=./a;maxprocs=-1;argc=0;",
            b"cmd=spawn;ncmds=1;preputcount=0;subcmd=./a;maxprocs=1;infokeycount=1;infokey3=k;",
            b"cmd=spawn;ncmds=1;preputcount=0;subcmd=./a;maxprocs=1;argc=2;argv1=b;argv0=a;",
            b"cmd=spawn;ncmds=1;preputcount=0;subcmd=./a;maxprocs=1;argc=2;argv0=a;",
            b"cmd=spawn;ncmds=0;preputcount=0;",
            b"cmd=spawn;ncmds=1;preputcount=1;ppval0=v;ppkey0=k;subcmd=./a;maxprocs=1;argc=0;",
        ] {
            let m = Message::parse(bad).unwrap();
            assert!(matches!(m.request(), Err(ParseError::Spawn(_))), "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn answers_carry_their_length_thrid_and_rc() {
        let s = frame(|o| Writer::answer(o, "kvs-get-response", Some(b"0x7f"), 0).str("value", b"a;b").finish());
        assert_eq!(s, "    48cmd=kvs-get-response;thrid=0x7f;rc=0;value=a;;b;");
        assert_eq!(body_len(s.as_bytes()), Some(s.len() - HEADER_LEN));
        let s = frame(|o| Writer::answer(o, "kvs-fence-response", None, -1).errmsg("rank 3 left").finish());
        assert_eq!(s, "    48cmd=kvs-fence-response;rc=-1;errmsg=rank 3 left;");
        let s = frame(|o| Writer::answer(o, "fullinit-response", None, 0).int("rank", 1).errmsg(" ").finish());
        assert!(s.ends_with("cmd=fullinit-response;rc=0;rank=1;"), "{s}");
    }

    #[test]
    fn the_length_prefix_is_right_aligned_from_one_digit_to_six() {
        for value_len in [0, 3, 95, 999_983] {
            let value = vec![b'v'; value_len];
            let s = frame(|o| Writer::request(o, "x").str("k", &value).finish());
            let body = s.len() - HEADER_LEN;
            assert_eq!(&s[..HEADER_LEN], format!("{body:>6}"));
            assert_eq!(body_len(s.as_bytes()), Some(body));
        }
        let s = frame(|o| Writer::request(o, "kvs-put").str("value", b";a;;b;").finish());
        assert_eq!(s, "    29cmd=kvs-put;value=;;a;;;;b;;;");
        assert_eq!(Message::parse(&s.as_bytes()[HEADER_LEN..]).unwrap().get("value"), Some(&b";a;;b;"[..]));
    }

    #[test]
    fn an_answer_longer_than_a_frame_becomes_a_failure_that_fits() {
        let (thrid, value) = (vec![b't'; 500_000], vec![b';'; 300_000]);
        let mut out = b"before".to_vec();
        Writer::answer(&mut out, "kvs-get-response", Some(&thrid), 0).str("value", &value).finish();
        let s = String::from_utf8(out).unwrap();
        let frame = s.strip_prefix("before").unwrap();
        assert_eq!(body_len(frame.as_bytes()), Some(frame.len() - HEADER_LEN));
        let m = Message::parse(&frame.as_bytes()[HEADER_LEN..]).unwrap();
        assert_eq!(m.cmd, b"kvs-get-response");
        assert_eq!(m.get("rc"), Some(&b"-1"[..]));
        assert!(m.get("errmsg").is_some_and(|e| e.starts_with(b"the answer is longer")), "{frame}");
    }
}

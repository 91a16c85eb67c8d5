//! Fuzz target `pmi2`: arbitrary bytes as PMI-2 frames for `rpmi_core::wire::pmi2` (`body_len`, `Message::parse`,
//! `Message::request`), as `parse` is for PMI-1's lines.
//!
//! The input is read three ways: its first 6 bytes (and every 6-byte window of its first 64 bytes) as a
//! length prefix; the whole input as a frame's body; and, if its prefix parses, the body the prefix says
//! (as much of it as there is). Checks, besides "no panic":
//!
//! - `body_len` takes exactly 6 bytes of digits and spaces whose digits are one run (a model says which),
//!   and says at most `FRAME_MAX`;
//! - `Message::parse` agrees with a model of the grammar (`key=value;` pairs, keys trimmed of leading
//!   spaces, a `;;` in a value is one `;`, the first pair `cmd=` with a non-empty value): the same error, or
//!   the same command and the same first value for every key;
//! - a message that parses, re-encoded with `Answer` (as the server encodes its answers: `rc=` added after
//!   `cmd=`, every `;` of a value doubled), has a prefix that says its length and parses back to the same
//!   command, the same value of every key and the same request (or error);
//! - `Message::request` agrees with the message: an unknown command is refused iff it is none of PMI-2's, a
//!   missing field is missing, a bad integer or boolean is one, and the fields of a request are the message's;
//! - a spawn has 1 to `MAX_COMMANDS` commands, `ncmds` of them, one per `subcmd`, each with its program,
//!   its `argc` args (the `argvN` values, in order) and `infokeycount` infos (the `infokeyN` keys, in order),
//!   at most `MAX_ITEMS` of each; the first command holds the `preputcount` preputs (the `ppkeyN` keys, in
//!   order), the others none;
//! - parsing and `request` each allocate at most 64 bytes per byte of the body (and a little more): never in
//!   proportion to a count inside the message (a counting global allocator).
//!
//! `RPMI_FUZZ_DEBUG=1` prints what each reading gives.

#![no_main]

use libfuzzer_sys::fuzz_target;
use rpmi_core::wire::pmi2::{body_len, Message, Request2, Writer, FRAME_MAX, HEADER_LEN, MAX_PAIRS};
use rpmi_core::wire::request::parse_int;
use rpmi_core::wire::spawn::{MAX_COMMANDS, MAX_ITEMS};
use rpmi_core::wire::ParseError;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::OnceLock;

/// Counts the bytes allocated (a growing `realloc` counts its new size).
struct Counting;

static ALLOCATED: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATED.fetch_add(layout.size(), Relaxed);
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATED.fetch_add(layout.size(), Relaxed);
        System.alloc_zeroed(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATED.fetch_add(new_size, Relaxed);
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Bytes allocated while `f` runs, and what it returned.
fn allocated<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let before = ALLOCATED.load(Relaxed);
    let r = f();
    (r, ALLOCATED.load(Relaxed) - before)
}

fn env(name: &str, cell: &'static OnceLock<bool>) -> bool {
    *cell.get_or_init(|| std::env::var_os(name).is_some_and(|v| v != "0"))
}

/// `RPMI_FUZZ_DEBUG=1`: print what each reading of the input gives.
fn debug() -> bool {
    static DEBUG: OnceLock<bool> = OnceLock::new();
    env("RPMI_FUZZ_DEBUG", &DEBUG)
}

fn show(b: &[u8]) -> String {
    match b.len() > 200 {
        true => format!("{}... ({} bytes)", String::from_utf8_lossy(&b[..200]), b.len()),
        false => String::from_utf8_lossy(b).into_owned(),
    }
}

/// What a length prefix says, by the definition: 6 bytes, each a digit or a space, the digits one run.
fn model_len(h: &[u8]) -> Option<usize> {
    let h = h.get(..HEADER_LEN)?;
    if !h.iter().all(|&b| b == b' ' || b.is_ascii_digit()) {
        return None;
    }
    let first = h.iter().position(u8::is_ascii_digit)?;
    let last = h.iter().rposition(u8::is_ascii_digit)?;
    let digits = &h[first..=last];
    if !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(digits.iter().fold(0, |n, &d| n * 10 + usize::from(d - b'0')))
}

/// A pair of the model: the key, the value, and whether the value held a `;;`.
type Pair<'a> = (&'a [u8], Vec<u8>, bool);

/// The body's pairs by the grammar, read byte by byte: a key up to the first `=` (leading spaces dropped,
/// not empty, no `;`), then a value up to a `;` that is not followed by another (`;;` is a `;` of the
/// value) or to the end. At most `MAX_PAIRS` pairs; the first must be `cmd=` with a value, without `;;`.
fn model_parse(body: &[u8]) -> Result<Vec<Pair<'_>>, ParseError> {
    let mut pairs: Vec<Pair> = Vec::new();
    let mut at = 0;
    while at < body.len() {
        if pairs.len() == MAX_PAIRS {
            return Err(ParseError::TooManyTuples);
        }
        let mut start = at;
        while body.get(start) == Some(&b' ') {
            start += 1;
        }
        let mut eq = start;
        loop {
            match body.get(eq) {
                None => return Err(ParseError::BadToken),
                Some(b'=') => break,
                Some(b';') => {
                    // A `;` in the key: refused, unless an `=` never comes (refused all the same).
                    return Err(ParseError::BadToken);
                }
                Some(_) => eq += 1,
            }
        }
        if eq == start {
            return Err(ParseError::BadToken);
        }
        let key = &body[start..eq];
        let mut value = Vec::new();
        let mut escaped = false;
        let mut i = eq + 1;
        loop {
            match (body.get(i), body.get(i + 1)) {
                (None, _) => break,
                (Some(b';'), Some(b';')) => {
                    value.push(b';');
                    escaped = true;
                    i += 2;
                }
                (Some(b';'), _) => {
                    i += 1;
                    break;
                }
                (Some(&b), _) => {
                    value.push(b);
                    i += 1;
                }
            }
        }
        pairs.push((key, value, escaped));
        at = i;
    }
    match pairs.first() {
        Some((b"cmd", v, false)) if !v.is_empty() => Ok(pairs),
        _ => Err(ParseError::NoCommand),
    }
}

/// The model's first value of `key`.
fn first<'p>(pairs: &'p [Pair<'_>], key: &[u8]) -> Option<&'p [u8]> {
    pairs.iter().find(|(k, _, _)| *k == key).map(|(_, v, _)| v.as_slice())
}

/// PMI-2's 16 commands, and rpmi's own two (revisions 2 and 3).
const COMMANDS: [&[u8]; 18] = [
    b"fullinit",
    b"job-getid",
    b"job-connect",
    b"job-disconnect",
    b"kvs-put",
    b"kvs-fence",
    b"kvs-get",
    b"info-getjobattr",
    b"info-putnodeattr",
    b"info-getnodeattr",
    b"abort",
    b"finalize",
    b"name-publish",
    b"name-unpublish",
    b"name-lookup",
    b"spawn",
    b"kvs-image",
    b"node-barrier-in",
];

/// The model's value of a count (`ncmds`, `argc`, ...), if it is one.
fn count(v: Option<&[u8]>) -> Option<i64> {
    v.and_then(parse_int)
}

/// The values of the keys `<prefix>N` (N an integer, as `parse_int` reads it) among `pairs`, in order.
fn indexed<'p>(pairs: &'p [Pair<'_>], prefix: &[u8]) -> Vec<&'p [u8]> {
    pairs
        .iter()
        .filter(|(k, _, _)| k.strip_prefix(prefix).and_then(parse_int).is_some())
        .map(|(_, v, _)| v.as_slice())
        .collect()
}

/// Checks a spawn request against the message's pairs (`pairs` without `cmd`).
fn check_spawn(pairs: &[Pair<'_>], s: &rpmi_core::wire::SpawnRequest) {
    let n = s.commands.len();
    assert!((1..=MAX_COMMANDS as usize).contains(&n), "a spawn of {n} commands");
    // The pairs before the first subcmd are the spawn's; each subcmd starts a command's.
    let starts: Vec<usize> =
        pairs.iter().enumerate().filter(|(_, (k, _, _))| *k == b"subcmd").map(|(i, _)| i).collect();
    assert_eq!(starts.len(), n, "{n} commands from {} subcmd pairs", starts.len());
    let head = &pairs[..starts[0]];
    // The last of a count before its items counts.
    let last = |ps: &[Pair<'_>], key: &[u8]| ps.iter().rev().find(|(k, _, _)| *k == key).map(|(_, v, _)| v.clone());
    assert_eq!(count(last(head, b"ncmds").as_deref()), Some(n as i64), "ncmds is not the number of commands");
    let preputcount = count(last(head, b"preputcount").as_deref()).unwrap_or(0);
    let first = &s.commands[0].preputs;
    assert_eq!(first.len() as i64, preputcount, "the preputs are not preputcount");
    let keys: Vec<&[u8]> = first.iter().map(|(k, _)| k.as_slice()).collect();
    assert_eq!(keys, indexed(head, b"ppkey"), "the preputs are not the ppkeys sent");
    for (i, c) in s.commands.iter().enumerate() {
        let end = starts.get(i + 1).copied().unwrap_or(pairs.len());
        let own = &pairs[starts[i]..end];
        assert_eq!(c.execname, own[0].1, "command {i}'s program is not its subcmd");
        assert!(!c.execname.is_empty(), "command {i} has no program");
        assert_eq!(c.nprocs as i64, count(last(own, b"maxprocs").as_deref()).unwrap_or(0), "command {i}'s maxprocs");
        assert_eq!(c.args.len() as i64, count(last(own, b"argc").as_deref()).unwrap_or(0), "command {i}'s argc");
        assert_eq!(c.args, indexed(own, b"argv"), "command {i}'s args are not its argvs");
        let infos = count(last(own, b"infokeycount").as_deref()).unwrap_or(0);
        assert_eq!(c.infos.len() as i64, infos, "command {i}'s infokeycount");
        let keys: Vec<&[u8]> = c.infos.iter().map(|(k, _)| k.as_slice()).collect();
        assert_eq!(keys, indexed(own, b"infokey"), "command {i}'s infos are not its infokeys");
        assert!(i == 0 || c.preputs.is_empty(), "command {i} holds preputs");
        for (what, len) in [("args", c.args.len()), ("infos", c.infos.len()), ("preputs", c.preputs.len())] {
            assert!(len <= MAX_ITEMS as usize, "command {i} has {len} {what}");
        }
    }
    let total: u64 = s.commands.iter().map(|c| u64::from(c.nprocs)).sum();
    assert_eq!(s.total_procs(), total);
    // The new job's preputs: the first command's, unless a key is given two values.
    if let Ok(p) = s.preputs() {
        assert!(p.len() <= first.len());
    }
}

/// Checks what `Message::request` made of a message against the model's pairs.
fn check_request(m: &Message<'_>, pairs: &[Pair<'_>], r: &Result<Request2<'_>, ParseError>) {
    let cmd = m.cmd;
    let get = |k: &str| first(&pairs[1..], k.as_bytes());
    let known = COMMANDS.contains(&cmd);
    assert_eq!(known, !matches!(r, Err(ParseError::UnknownCommand(_))), "{}: known {known}, {r:?}", show(cmd));
    let int = |k: &str| get(k).map(|v| parse_int(v).expect("an integer field that is none"));
    match r {
        Err(ParseError::UnknownCommand(c)) => assert_eq!(*c, String::from_utf8_lossy(cmd)),
        Err(ParseError::MissingField { field, .. }) => assert!(get(field).is_none(), "{field}= is there"),
        Err(ParseError::BadInteger { field }) => {
            assert!(get(field).is_some_and(|v| parse_int(v).is_none()), "{field}= is an integer")
        }
        Err(ParseError::BadBoolean { field }) => {
            let v = get(field).expect("a bad boolean that is missing");
            assert!(!v.eq_ignore_ascii_case(b"TRUE") && !v.eq_ignore_ascii_case(b"FALSE"));
        }
        Err(ParseError::Spawn(why)) => {
            assert_eq!(cmd, b"spawn");
            assert!(!why.is_empty());
        }
        Err(e) => panic!("request() of a parsed message: {e:?}"),
        Ok(Request2::FullInit { pmirank, threaded }) => {
            assert_eq!(*pmirank, int("pmirank"));
            assert_eq!(*threaded, get("threaded").is_some_and(|v| v.eq_ignore_ascii_case(b"TRUE")));
        }
        Ok(Request2::KvsPut { key, value }) | Ok(Request2::PutNodeAttr { key, value }) => {
            assert_eq!(Some(*key), get("key"));
            assert_eq!(*value, get("value").unwrap_or_default());
        }
        Ok(Request2::KvsGet { jobid, key }) => {
            assert_eq!(*jobid, get("jobid"));
            assert_eq!(Some(*key), get("key"));
        }
        Ok(Request2::GetJobAttr { key }) => assert_eq!(Some(*key), get("key")),
        Ok(Request2::GetNodeAttr { key, wait }) => {
            assert_eq!(Some(*key), get("key"));
            assert_eq!(*wait, get("wait").is_some_and(|v| v.eq_ignore_ascii_case(b"TRUE")));
        }
        Ok(Request2::Abort { exit_code, message }) => {
            assert_eq!(*exit_code, int("exitcode"));
            assert_eq!(*message, get("message"));
        }
        Ok(Request2::Publish { name, port }) => {
            assert_eq!((Some(*name), Some(*port)), (get("name"), get("port")));
        }
        Ok(Request2::Unpublish { name }) | Ok(Request2::Lookup { name }) => assert_eq!(Some(*name), get("name")),
        Ok(Request2::Spawn(s)) => check_spawn(&pairs[1..], s),
        Ok(
            Request2::JobGetId
            | Request2::JobConnect
            | Request2::JobDisconnect
            | Request2::KvsFence
            | Request2::KvsImage
            | Request2::NodeBarrierIn
            | Request2::Finalize,
        ) => {}
    }
    if let Ok(r) = r {
        let expected: &[u8] = match r {
            Request2::FullInit { .. } => b"fullinit",
            Request2::JobGetId => b"job-getid",
            Request2::JobConnect => b"job-connect",
            Request2::JobDisconnect => b"job-disconnect",
            Request2::KvsPut { .. } => b"kvs-put",
            Request2::KvsFence => b"kvs-fence",
            Request2::KvsImage => b"kvs-image",
            Request2::NodeBarrierIn => b"node-barrier-in",
            Request2::KvsGet { .. } => b"kvs-get",
            Request2::GetJobAttr { .. } => b"info-getjobattr",
            Request2::PutNodeAttr { .. } => b"info-putnodeattr",
            Request2::GetNodeAttr { .. } => b"info-getnodeattr",
            Request2::Abort { .. } => b"abort",
            Request2::Finalize => b"finalize",
            Request2::Publish { .. } => b"name-publish",
            Request2::Unpublish { .. } => b"name-unpublish",
            Request2::Lookup { .. } => b"name-lookup",
            Request2::Spawn(_) => b"spawn",
        };
        assert_eq!(cmd, expected, "the request is not its command's");
    }
}

/// Re-encodes a parsed message with `Answer` (the answer encoder) and parses it back.
fn round_trip(m: &Message<'_>, pairs: &[Pair<'_>], request: &Result<Request2<'_>, ParseError>) {
    let Ok(cmd) = std::str::from_utf8(m.cmd) else { return };
    let Some(keys) = pairs[1..].iter().map(|(k, _, _)| std::str::from_utf8(k).ok()).collect::<Option<Vec<_>>>() else {
        return;
    };
    let mut out = Vec::new();
    let mut f = Writer::answer(&mut out, cmd, None, 0);
    for (key, (_, value, _)) in keys.iter().zip(&pairs[1..]) {
        f = f.str(key, value);
    }
    f.finish();
    assert_eq!(body_len(&out), Some(out.len() - HEADER_LEN), "the prefix of {}", show(&out));
    let back = Message::parse(&out[HEADER_LEN..]).unwrap_or_else(|e| panic!("{} does not parse: {e:?}", show(&out)));
    assert_eq!(back.cmd, m.cmd);
    assert_eq!(back.get("rc"), Some(&b"0"[..]));
    for (k, _, _) in &pairs[1..] {
        let k = std::str::from_utf8(k).unwrap();
        if k != "rc" {
            assert_eq!(back.get(k), m.get(k), "{k}= after a round trip through {}", show(&out));
        }
    }
    assert_eq!(&back.request(), request, "the request after a round trip through {}", show(&out));
}

/// One body: parsed, checked against the model, its request checked, re-encoded.
fn check_body(body: &[u8]) {
    let model = model_parse(body);
    let (parsed, bytes) = allocated(|| Message::parse(body));
    if debug() {
        eprintln!("body {:?}: {:?}", show(body), parsed.as_ref().map(|m| show(m.cmd)));
    }
    assert!(bytes <= 64 * body.len() + 256, "parsing {} bytes allocated {bytes}", body.len());
    let (m, pairs) = match (parsed, model) {
        (Ok(m), Ok(pairs)) => (m, pairs),
        (Err(e), Err(f)) => {
            assert_eq!(e, f, "{}", show(body));
            let _ = e.to_string();
            return;
        }
        (p, model) => panic!("parse {p:?}, the model {model:?}: {}", show(body)),
    };
    assert_eq!(m.cmd, pairs[0].1.as_slice());
    // The command is borrowed from the body.
    let range = body.as_ptr_range();
    assert!(range.contains(&m.cmd.as_ptr()) || m.cmd.is_empty());
    // `get` reads the pairs after the command (a second `cmd=` too).
    for (k, _, _) in &pairs {
        if let Ok(k) = std::str::from_utf8(k) {
            assert_eq!(m.get(k), first(&pairs[1..], k.as_bytes()), "{k}= in {}", show(body));
        }
    }
    let (request, bytes) = allocated(|| m.request());
    if debug() {
        eprintln!("  request ({bytes} bytes allocated): {}", show(format!("{request:?}").as_bytes()));
    }
    assert!(bytes <= 64 * body.len() + 1024, "request() of {} bytes allocated {bytes}", body.len());
    check_request(&m, &pairs, &request);
    if let Err(e) = &request {
        let _ = e.to_string();
    }
    round_trip(&m, &pairs, &request);
}

fn run(data: &[u8]) {
    for at in 0..data.len().min(64) {
        let said = body_len(&data[at..]);
        assert_eq!(said, model_len(&data[at..]), "the prefix {:?}", show(&data[at..(at + HEADER_LEN).min(data.len())]));
        if let Some(n) = said {
            assert!(n <= FRAME_MAX);
        }
    }
    check_body(data);
    if let Some(n) = body_len(data) {
        let body = &data[HEADER_LEN..];
        check_body(&body[..n.min(body.len())]);
    }
}

fuzz_target!(|data: &[u8]| run(data));

//! Parsing one request line (RFC 13's `C:` messages) into a [`Request`].
//!
//! The parser borrows from the line and never allocates. It is as tolerant as RFC 13 asks: tuples in any
//! order, runs of spaces or tabs between them, unknown extra keys. `value=` (put) and `message=` (abort) run
//! to the end of the line, so they may hold spaces and `=`. Commands are matched exactly: `cmd=get_maxes`
//! is never `get`.

use std::fmt;

/// At most this many `key=value` tuples are looked at in one line; a longer line is malformed.
/// Real requests carry at most five.
const MAX_TUPLES: usize = 16;

/// One request from a task, borrowing its fields from the line it was parsed from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request<'a> {
    /// `cmd=init pmi_version=V pmi_subversion=S`, and `rpmi=R` from rpmi's client libraries: the revision of
    /// rpmi's own additions to the wire they speak (0 without it: any other client).
    Init { version: i64, subversion: i64, rpmi: i64 },
    /// `cmd=get_maxes`
    GetMaxes,
    /// `cmd=get_universe_size`
    GetUniverseSize,
    /// `cmd=get_appnum`
    GetAppnum,
    /// `cmd=get_my_kvsname`
    GetMyKvsname,
    /// `cmd=put kvsname=K key=KEY value=V`
    Put { kvsname: &'a [u8], key: &'a [u8], value: &'a [u8] },
    /// `cmd=get kvsname=K key=KEY`
    Get { kvsname: &'a [u8], key: &'a [u8] },
    /// `cmd=barrier_in [group=G]` (`group=` is PMI 1.2's, see [`crate::group`])
    BarrierIn { group: Option<&'a [u8]> },
    /// `cmd=finalize`
    Finalize,
    /// `cmd=abort [exitcode=N] [message=TEXT]`
    Abort { exit_code: Option<i64>, message: Option<&'a [u8]> },
    /// `cmd=publish_name service=S port=P`
    PublishName { service: &'a [u8], port: &'a [u8] },
    /// `cmd=unpublish_name service=S`
    UnpublishName { service: &'a [u8] },
    /// `cmd=lookup_name service=S`
    LookupName { service: &'a [u8] },
    /// Intel MPI's `cmd=get_ranks2hosts`
    GetRanks2Hosts,
    /// `cmd=get_kvs_image`: rpmi's own (revision 2), from its client libraries only: the image of the node's
    /// key-value space after the last fence ([`crate::image`]), answered with its memory file.
    GetKvsImage,
    /// `cmd=node_barrier_in`: rpmi's own (revision 3), from its client libraries only: every local task has
    /// counted itself in on the node barrier's page ([`crate::node_barrier`]); sent by the last one in, and
    /// answered by the page's release, not by a line.
    NodeBarrierIn,
    /// `mcmd=spawn`: the first line of a multi-line spawn block (see [`crate::spawn`]).
    SpawnBlock,
}

impl Request<'_> {
    /// The command's name as it appears on the wire, for messages.
    pub fn name(&self) -> &'static str {
        match self {
            Request::Init { .. } => "init",
            Request::GetMaxes => "get_maxes",
            Request::GetUniverseSize => "get_universe_size",
            Request::GetAppnum => "get_appnum",
            Request::GetMyKvsname => "get_my_kvsname",
            Request::Put { .. } => "put",
            Request::Get { .. } => "get",
            Request::BarrierIn { .. } => "barrier_in",
            Request::Finalize => "finalize",
            Request::Abort { .. } => "abort",
            Request::PublishName { .. } => "publish_name",
            Request::UnpublishName { .. } => "unpublish_name",
            Request::LookupName { .. } => "lookup_name",
            Request::GetRanks2Hosts => "get_ranks2hosts",
            Request::GetKvsImage => "get_kvs_image",
            Request::NodeBarrierIn => "node_barrier_in",
            Request::SpawnBlock => "spawn",
        }
    }
}

/// Why a line is not a request. Every variant is a protocol error (RFC 13: the connection is dead).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParseError {
    /// Neither `cmd=` nor `mcmd=` is present.
    NoCommand,
    /// `cmd=` names no command this server knows.
    UnknownCommand(String),
    /// A required field is absent.
    MissingField { command: &'static str, field: &'static str },
    /// A field that must be an integer is not one.
    BadInteger { field: &'static str },
    /// A token has no `=`, or an empty key.
    BadToken,
    /// More tuples than any request has.
    TooManyTuples,
    /// A PMI-2 field that must be `TRUE` or `FALSE` is neither.
    BadBoolean { field: &'static str },
    /// A PMI-2 spawn request that does not hold together.
    Spawn(String),
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParseError::NoCommand => write!(f, "no cmd= or mcmd= in the request"),
            ParseError::UnknownCommand(c) => write!(f, "unknown command '{c}'"),
            ParseError::MissingField { command, field } => {
                write!(f, "'{command}' request without its '{field}=' field")
            }
            ParseError::BadInteger { field } => write!(f, "'{field}=' is not an integer"),
            ParseError::BadToken => write!(f, "a token is not of the form key=value"),
            ParseError::TooManyTuples => write!(f, "more key=value tuples than any request has"),
            ParseError::BadBoolean { field } => write!(f, "'{field}=' is neither TRUE nor FALSE"),
            ParseError::Spawn(why) => write!(f, "malformed spawn request: {why}"),
        }
    }
}

impl std::error::Error for ParseError {}

/// The tuples of one line, in the order they came.
struct Tuples<'a> {
    items: [(&'a [u8], &'a [u8]); MAX_TUPLES],
    len: usize,
}

impl<'a> Tuples<'a> {
    /// Splits `line` (without its newline) into tuples. Keys whose value runs to the end of the line end
    /// the scan.
    fn split(line: &'a [u8]) -> Result<Self, ParseError> {
        let mut tuples = Tuples { items: [(&[][..], &[][..]); MAX_TUPLES], len: 0 };
        let mut rest = line;
        loop {
            rest = trim_start(rest);
            if rest.is_empty() {
                return Ok(tuples);
            }
            let eq = rest.iter().position(|&b| b == b'=');
            let sp = rest.iter().position(|&b| is_space(b)).unwrap_or(rest.len());
            let eq = match eq {
                Some(eq) if eq < sp && eq > 0 => eq,
                _ => return Err(ParseError::BadToken),
            };
            let key = &rest[..eq];
            let (value, next) = if runs_to_end_of_line(key) {
                (trim_end(&rest[eq + 1..]), &[][..])
            } else {
                (&rest[eq + 1..sp], &rest[sp..])
            };
            if tuples.len == MAX_TUPLES {
                return Err(ParseError::TooManyTuples);
            }
            tuples.items[tuples.len] = (key, value);
            tuples.len += 1;
            rest = next;
        }
    }

    /// The value of the first tuple named `key`.
    fn get(&self, key: &str) -> Option<&'a [u8]> {
        self.items[..self.len].iter().find(|(k, _)| *k == key.as_bytes()).map(|&(_, v)| v)
    }

    fn require(&self, command: &'static str, field: &'static str) -> Result<&'a [u8], ParseError> {
        self.get(field).ok_or(ParseError::MissingField { command, field })
    }

    fn integer(&self, command: &'static str, field: &'static str) -> Result<i64, ParseError> {
        parse_int(self.require(command, field)?).ok_or(ParseError::BadInteger { field })
    }
}

/// `value=` and `message=` hold RFC 13 `string`s (spaces allowed), so they take the rest of the line.
fn runs_to_end_of_line(key: &[u8]) -> bool {
    key == b"value" || key == b"message"
}

fn is_space(b: u8) -> bool {
    b == b' ' || b == b'\t' || b == b'\r'
}

fn trim_start(s: &[u8]) -> &[u8] {
    let n = s.iter().take_while(|&&b| is_space(b)).count();
    &s[n..]
}

fn trim_end(s: &[u8]) -> &[u8] {
    let n = s.iter().rev().take_while(|&&b| is_space(b)).count();
    &s[..s.len() - n]
}

/// RFC 13's `int`: an optional sign and at least one digit. Out of range is not an integer.
pub fn parse_int(s: &[u8]) -> Option<i64> {
    let (negative, digits) = match s.first()? {
        b'-' => (true, &s[1..]),
        b'+' => (false, &s[1..]),
        _ => (false, s),
    };
    if digits.is_empty() {
        return None;
    }
    let mut n: i64 = 0;
    for &d in digits {
        if !d.is_ascii_digit() {
            return None;
        }
        n = n.checked_mul(10)?.checked_sub(i64::from(d - b'0'))?;
    }
    // Accumulated negatively so that i64::MIN parses.
    if negative {
        Some(n)
    } else {
        n.checked_neg()
    }
}

/// Parses one request line. `line` excludes the newline.
pub fn parse(line: &[u8]) -> Result<Request<'_>, ParseError> {
    let t = Tuples::split(line)?;
    if let Some(mcmd) = t.get("mcmd") {
        return match mcmd {
            b"spawn" => Ok(Request::SpawnBlock),
            other => Err(ParseError::UnknownCommand(format!("mcmd={}", String::from_utf8_lossy(other)))),
        };
    }
    let cmd = t.get("cmd").ok_or(ParseError::NoCommand)?;
    Ok(match cmd {
        b"init" => Request::Init {
            version: t.integer("init", "pmi_version")?,
            subversion: t.integer("init", "pmi_subversion")?,
            rpmi: match t.get("rpmi") {
                Some(v) => parse_int(v).ok_or(ParseError::BadInteger { field: "rpmi" })?,
                None => 0,
            },
        },
        b"get_maxes" => Request::GetMaxes,
        b"get_universe_size" => Request::GetUniverseSize,
        b"get_appnum" => Request::GetAppnum,
        b"get_my_kvsname" => Request::GetMyKvsname,
        b"put" => Request::Put {
            kvsname: t.require("put", "kvsname")?,
            key: t.require("put", "key")?,
            value: t.require("put", "value")?,
        },
        b"get" => Request::Get { kvsname: t.require("get", "kvsname")?, key: t.require("get", "key")? },
        b"barrier_in" => Request::BarrierIn { group: t.get("group") },
        b"finalize" => Request::Finalize,
        b"abort" => Request::Abort {
            exit_code: match t.get("exitcode") {
                Some(v) => Some(parse_int(v).ok_or(ParseError::BadInteger { field: "exitcode" })?),
                None => None,
            },
            message: t.get("message"),
        },
        b"publish_name" => Request::PublishName {
            service: t.require("publish_name", "service")?,
            port: t.require("publish_name", "port")?,
        },
        b"unpublish_name" => Request::UnpublishName { service: t.require("unpublish_name", "service")? },
        b"lookup_name" => Request::LookupName { service: t.require("lookup_name", "service")? },
        b"get_ranks2hosts" => Request::GetRanks2Hosts,
        b"get_kvs_image" => Request::GetKvsImage,
        b"node_barrier_in" => Request::NodeBarrierIn,
        other => return Err(ParseError::UnknownCommand(String::from_utf8_lossy(other).into_owned())),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_with_tuples_in_any_order_and_extra_space() {
        let want = Request::Init { version: 1, subversion: 1, rpmi: 0 };
        assert_eq!(parse(b"cmd=init pmi_version=1 pmi_subversion=1"), Ok(want.clone()));
        assert_eq!(parse(b"  pmi_subversion=1\tcmd=init   pmi_version=1  "), Ok(want.clone()));
        assert_eq!(parse(b"cmd=init pmi_version=+1 pmi_subversion=1 extra=yes\r"), Ok(want));
    }

    #[test]
    fn rpmis_clients_say_the_revision_of_its_additions_they_speak() {
        let want = Request::Init { version: 1, subversion: 2, rpmi: 1 };
        assert_eq!(parse(b"cmd=init pmi_version=1 pmi_subversion=2 rpmi=1"), Ok(want));
        assert_eq!(
            parse(b"cmd=init pmi_version=1 pmi_subversion=2 rpmi=x"),
            Err(ParseError::BadInteger { field: "rpmi" })
        );
    }

    #[test]
    fn longer_command_names_are_not_their_prefixes() {
        assert_eq!(parse(b"cmd=get_maxes"), Ok(Request::GetMaxes));
        assert_eq!(parse(b"cmd=getx kvsname=a key=b"), Err(ParseError::UnknownCommand("getx".into())));
        assert_eq!(parse(b"cmd=initack"), Err(ParseError::UnknownCommand("initack".into())));
        assert_eq!(parse(b"cmd=barrier_inx"), Err(ParseError::UnknownCommand("barrier_inx".into())));
    }

    #[test]
    fn value_runs_to_end_of_line_with_spaces_and_equals() {
        let r = parse(b"cmd=put kvsname=kvs_1 key=k-seg-1/2 value=a b=c  d ").unwrap();
        assert_eq!(r, Request::Put { kvsname: b"kvs_1", key: b"k-seg-1/2", value: b"a b=c  d" });
    }

    #[test]
    fn abort_carries_signed_code_and_message() {
        let r = parse(b"cmd=abort exitcode=-7 message=rank 3: out of memory").unwrap();
        assert_eq!(r, Request::Abort { exit_code: Some(-7), message: Some(&b"rank 3: out of memory"[..]) });
        assert_eq!(parse(b"cmd=abort"), Ok(Request::Abort { exit_code: None, message: None }));
        assert_eq!(parse(b"cmd=abort exitcode=x"), Err(ParseError::BadInteger { field: "exitcode" }));
    }

    #[test]
    fn malformed_lines() {
        assert_eq!(parse(b""), Err(ParseError::NoCommand));
        assert_eq!(parse(b"key=value"), Err(ParseError::NoCommand));
        assert_eq!(parse(b"cmd=get_maxes junk"), Err(ParseError::BadToken));
        assert_eq!(parse(b"=x cmd=get_maxes"), Err(ParseError::BadToken));
        assert_eq!(parse(b"cmd=put kvsname=a value=1"), Err(ParseError::MissingField { command: "put", field: "key" }));
        assert_eq!(
            parse(b"cmd=init pmi_version=1"),
            Err(ParseError::MissingField { command: "init", field: "pmi_subversion" })
        );
        assert_eq!(parse(b"mcmd=respawn"), Err(ParseError::UnknownCommand("mcmd=respawn".into())));
        let many = b"cmd=get_maxes a=1 a=1 a=1 a=1 a=1 a=1 a=1 a=1 a=1 a=1 a=1 a=1 a=1 a=1 a=1 a=1";
        assert_eq!(parse(many), Err(ParseError::TooManyTuples));
    }

    #[test]
    fn integers() {
        assert_eq!(parse_int(b"0"), Some(0));
        assert_eq!(parse_int(b"-1"), Some(-1));
        assert_eq!(parse_int(b"+12"), Some(12));
        assert_eq!(parse_int(b"-9223372036854775808"), Some(i64::MIN));
        assert_eq!(parse_int(b"9223372036854775808"), None);
        assert_eq!(parse_int(b"-"), None);
        assert_eq!(parse_int(b"1x"), None);
        assert_eq!(parse_int(b""), None);
    }

    #[test]
    fn every_command_parses() {
        for (line, name) in [
            (&b"cmd=get_universe_size"[..], "get_universe_size"),
            (b"cmd=get_appnum", "get_appnum"),
            (b"cmd=get_my_kvsname", "get_my_kvsname"),
            (b"cmd=get kvsname=a key=b", "get"),
            (b"cmd=barrier_in group=WORLD", "barrier_in"),
            (b"cmd=finalize", "finalize"),
            (b"cmd=publish_name service=s port=p", "publish_name"),
            (b"cmd=unpublish_name service=s", "unpublish_name"),
            (b"cmd=lookup_name service=s", "lookup_name"),
            (b"cmd=get_ranks2hosts", "get_ranks2hosts"),
            (b"mcmd=spawn", "spawn"),
        ] {
            assert_eq!(parse(line).map(|r| r.name()), Ok(name), "{}", String::from_utf8_lossy(line));
        }
    }
}

//! The multi-line `mcmd=spawn` request (RFC 13's `C:spawn`).
//!
//! A spawn is one or more blocks, each `mcmd=spawn`, then one `key=value` per line, then `endcmd`. Field
//! order varies between client versions (`argN` before or after `argcnt`), so fields are collected by name
//! and checked when the block ends. With `totspawns=N` the client sends N blocks and expects one answer after
//! the last. Everything is bounded: number of blocks, items per list, and what the request holds, decoded.
//!
//! **What a request is charged.** Each item a request keeps (a program, an argument, a preput's or an info's
//! key or value) is a heap block of its own and an entry in a list, which cost more than its bytes on the
//! wire: a one-byte argument (`arg12=x`, 8 bytes) is kept in up to 96. So a request is charged its bytes as
//! sent (PMI-1's lines, newlines included, or a PMI-2 frame's body), [`ITEM_OVERHEAD`] more for each item and
//! [`COMMAND_OVERHEAD`] more for each command ([`SpawnRequest::overhead`]), and the charge is what the
//! server's bound (`spawn_bytes_max`) limits: what an unfinished request holds is at most its charge.

use super::request::parse_int;
use std::fmt;

/// At most this many blocks (commands) in one spawn.
pub const MAX_COMMANDS: u32 = 256;
/// At most this many args, preputs or infos in one block.
pub const MAX_ITEMS: u32 = 4096;

/// What each item of a request (a program, an argument, a preput's or an info's key or value) is charged
/// beyond its bytes on the wire: while a PMI-1 request comes in, its entry in a list of `(index, value)`
/// (32 bytes) that grows by doubling, so up to 64, and its value's heap block, which an allocator rounds up
/// with its header (glibc's smallest is 32 bytes, for a value of up to 24): together at most 95 bytes more
/// than the value, whose line (`argN=`, a newline) brings at least 6 bytes of its own. Decoded into a
/// [`SpawnRequest`], an item costs less (a 24-byte entry, a 48-byte one for a pair of two items).
pub const ITEM_OVERHEAD: usize = 96;
/// What each command of a request is charged beyond its items: its [`SpawnCommand`] (104 bytes) in a list
/// that grows by doubling, and what a PMI-2 frame's reader keeps beside it while it reads (16 bytes, also
/// doubling).
pub const COMMAND_OVERHEAD: usize = 256;

/// One command of a spawn: what `PMI_Spawn_multiple` passes for one `cmds[i]`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpawnCommand {
    pub nprocs: u32,
    pub execname: Vec<u8>,
    pub args: Vec<Vec<u8>>,
    /// Key-value pairs to put in the new job's KVS before it starts.
    pub preputs: Pairs,
    /// Implementation-specific hints (`info_key_N` / `info_val_N`).
    pub infos: Pairs,
}

/// A whole spawn request: every block, in the order sent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpawnRequest {
    pub commands: Vec<SpawnCommand>,
}

impl SpawnRequest {
    /// Total processes asked for, over all commands.
    pub fn total_procs(&self) -> u64 {
        self.commands.iter().map(|c| u64::from(c.nprocs)).sum()
    }

    /// What the request is charged beyond its bytes on the wire: [`ITEM_OVERHEAD`] for each item (each
    /// program, argument, and preput's and info's key and value), [`COMMAND_OVERHEAD`] for each command.
    pub fn overhead(&self) -> usize {
        let items = |c: &SpawnCommand| 1 + c.args.len() + 2 * (c.preputs.len() + c.infos.len());
        self.commands.iter().map(|c| COMMAND_OVERHEAD + ITEM_OVERHEAD * items(c)).sum()
    }

    /// The new job's preputs: every command's, each key once (MPICH gives each command the same ones).
    /// `Err` names a key given two values.
    pub fn preputs(&self) -> Result<Pairs, String> {
        let mut preputs: Pairs = Vec::new();
        for (key, value) in self.commands.iter().flat_map(|c| &c.preputs) {
            match preputs.iter().find(|(k, _)| k == key) {
                Some((_, v)) if v != value => {
                    return Err(format!("the preput '{}' is given two values", String::from_utf8_lossy(key)))
                }
                Some(_) => {}
                None => preputs.push((key.clone(), value.clone())),
            }
        }
        Ok(preputs)
    }
}

impl SpawnRequest {
    /// The request as a client sends it: one block per command, fields in the order MPICH's client writes
    /// them (arguments numbered from 1, preputs and infos from 0), each block ending with `endcmd`. `Err`
    /// names an item that cannot travel as one line's value: a line break in it would make it lines of their
    /// own (another command, another count), and the reader trims the spaces around it.
    pub fn encode(&self) -> Result<Vec<u8>, SpawnError> {
        let items = self.commands.iter().flat_map(|c| {
            let pairs = c.preputs.iter().chain(&c.infos).flat_map(|(k, v)| [k, v]);
            std::iter::once(&c.execname).chain(&c.args).chain(pairs)
        });
        for item in items {
            let spaced = |b: Option<&u8>| b.is_some_and(|&b| b == b' ' || b == b'\t');
            if item.iter().any(|&b| b == b'\n' || b == b'\r') || spaced(item.first()) || spaced(item.last()) {
                return err(format!("'{}' has a line break or spaces around it", String::from_utf8_lossy(item)));
            }
        }
        let mut out = Vec::new();
        let total = self.commands.len();
        for (i, c) in self.commands.iter().enumerate() {
            let mut line = |key: &[u8], value: &[u8]| {
                out.extend_from_slice(key);
                out.push(b'=');
                out.extend_from_slice(value);
                out.push(b'\n');
            };
            line(b"mcmd", b"spawn");
            line(b"nprocs", c.nprocs.to_string().as_bytes());
            line(b"execname", &c.execname);
            line(b"totspawns", total.to_string().as_bytes());
            line(b"spawnssofar", (i + 1).to_string().as_bytes());
            line(b"argcnt", c.args.len().to_string().as_bytes());
            for (n, arg) in c.args.iter().enumerate() {
                line(format!("arg{}", n + 1).as_bytes(), arg);
            }
            for (what, list) in [("preput", &c.preputs), ("info", &c.infos)] {
                line(format!("{what}_num").as_bytes(), list.len().to_string().as_bytes());
                for (n, (key, value)) in list.iter().enumerate() {
                    line(format!("{what}_key_{n}").as_bytes(), key);
                    line(format!("{what}_val_{n}").as_bytes(), value);
                }
            }
            out.extend_from_slice(b"endcmd\n");
        }
        Ok(out)
    }
}

/// Why a spawn request is malformed (a protocol error).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpawnError(pub String);

impl fmt::Display for SpawnError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "malformed spawn request: {}", self.0)
    }
}

impl std::error::Error for SpawnError {}

fn err<T>(what: impl Into<String>) -> Result<T, SpawnError> {
    Err(SpawnError(what.into()))
}

impl SpawnError {
    /// A request charged more than `max_bytes` (see the [module's documentation](self)).
    pub fn over_limit(max_bytes: usize) -> SpawnError {
        SpawnError(format!(
            "over the limit of {max_bytes} bytes (its bytes as sent, and {ITEM_OVERHEAD} more for each program, \
             argument, preput's or info's key or value, {COMMAND_OVERHEAD} for each command)"
        ))
    }
}

/// What feeding one line achieved.
#[derive(Debug, PartialEq, Eq)]
pub enum Progress {
    /// More lines are expected before the request is whole.
    More,
    /// The last block ended: the whole request.
    Done(SpawnRequest),
}

/// Items keyed by their index (`arg3`, `preput_key_0`, ...), put in order when the block ends.
type Indexed = Vec<(u32, Vec<u8>)>;
/// Key-value pairs (preputs, infos) in order.
pub type Pairs = Vec<(Vec<u8>, Vec<u8>)>;

#[derive(Default)]
struct SpawnBlock {
    nprocs: Option<u32>,
    execname: Option<Vec<u8>>,
    totspawns: Option<u32>,
    spawnssofar: Option<u32>,
    argcnt: Option<u32>,
    preput_num: Option<u32>,
    info_num: Option<u32>,
    args: Indexed,
    preput_keys: Indexed,
    preput_vals: Indexed,
    info_keys: Indexed,
    info_vals: Indexed,
}

/// Collects the lines of a spawn request after its first `mcmd=spawn` line.
pub struct SpawnBuilder {
    max_bytes: usize,
    /// What the request is charged so far: its lines, and the overhead of its items and commands.
    bytes: usize,
    /// The block being read; `None` between blocks (the next line must be `mcmd=spawn`).
    block: Option<SpawnBlock>,
    totspawns: Option<u32>,
    done: Vec<SpawnCommand>,
}

impl SpawnBuilder {
    /// Starts a request whose first `mcmd=spawn` line has just been read (charged as its 11 bytes, with
    /// its command's overhead). `max_bytes` bounds what the whole request is charged (see the
    /// [module's documentation](self)): over it, a line is refused.
    pub fn new(max_bytes: usize) -> Self {
        let bytes = FIRST_LINE.len() + COMMAND_OVERHEAD;
        SpawnBuilder { max_bytes, bytes, block: Some(SpawnBlock::default()), totspawns: None, done: Vec::new() }
    }

    /// Feeds the next line (without its newline).
    pub fn line(&mut self, line: &[u8]) -> Result<Progress, SpawnError> {
        self.charge(line.len() + 1)?;
        let line = trim(line);
        let Some(block) = self.block.as_mut() else {
            return match line {
                b"mcmd=spawn" => {
                    self.charge(COMMAND_OVERHEAD)?;
                    self.block = Some(SpawnBlock::default());
                    Ok(Progress::More)
                }
                _ => err("expected mcmd=spawn to start the next block"),
            };
        };
        if line == b"endcmd" {
            let block = self.block.take().unwrap_or_default();
            return self.end_block(block);
        }
        let eq = line.iter().position(|&b| b == b'=').ok_or_else(|| SpawnError("a line without '='".into()))?;
        let (key, value) = (&line[..eq], &line[eq + 1..]);
        let count = |v: &[u8]| -> Result<u32, SpawnError> {
            match parse_int(v).and_then(|n| u32::try_from(n).ok()) {
                Some(n) => Ok(n),
                None => err(format!("'{}=' is not a count", String::from_utf8_lossy(key))),
            }
        };
        // An item is charged before it is kept (`bytes` is not `block`'s field).
        let mut item = || charge(&mut self.bytes, self.max_bytes, ITEM_OVERHEAD);
        match key {
            b"mcmd" => return err("mcmd= inside a block"),
            b"nprocs" => block.nprocs = Some(count(value)?),
            b"execname" => {
                item()?;
                block.execname = Some(value.to_vec());
            }
            b"totspawns" => block.totspawns = Some(count(value)?),
            b"spawnssofar" => block.spawnssofar = Some(count(value)?),
            b"argcnt" => block.argcnt = Some(count(value)?),
            b"preput_num" => block.preput_num = Some(count(value)?),
            b"info_num" => block.info_num = Some(count(value)?),
            _ => {
                let lists: [(&[u8], &mut Indexed); 5] = [
                    (b"preput_key_", &mut block.preput_keys),
                    (b"preput_val_", &mut block.preput_vals),
                    (b"info_key_", &mut block.info_keys),
                    (b"info_val_", &mut block.info_vals),
                    (b"arg", &mut block.args),
                ];
                // Unknown keys are ignored, as RFC 13 asks of parsers.
                for (prefix, list) in lists {
                    if let Some(index) = key.strip_prefix(prefix) {
                        if list.len() >= MAX_ITEMS as usize {
                            return err(format!("more than {MAX_ITEMS} items of one kind"));
                        }
                        let index = count(index)?;
                        item()?;
                        list.push((index, value.to_vec()));
                        break;
                    }
                }
            }
        }
        Ok(Progress::More)
    }

    /// Adds `n` bytes to what the request is charged; `Err` once that is over the bound.
    fn charge(&mut self, n: usize) -> Result<(), SpawnError> {
        charge(&mut self.bytes, self.max_bytes, n)
    }

    fn end_block(&mut self, b: SpawnBlock) -> Result<Progress, SpawnError> {
        let totspawns = b.totspawns.unwrap_or(1).max(1);
        if totspawns > MAX_COMMANDS {
            return err(format!("totspawns={totspawns} is over {MAX_COMMANDS}"));
        }
        if *self.totspawns.get_or_insert(totspawns) != totspawns {
            return err("totspawns differs between blocks");
        }
        let sofar = b.spawnssofar.map_or(self.done.len() + 1, |s| s as usize);
        if sofar != self.done.len() + 1 {
            return err(format!("block {} says spawnssofar={sofar}", self.done.len() + 1));
        }
        let args = in_order("arg", b.args, b.argcnt.unwrap_or(0))?;
        let preput_num = b.preput_num.unwrap_or(0);
        let preputs = pairs("preput", b.preput_keys, b.preput_vals, preput_num)?;
        let infos = pairs("info", b.info_keys, b.info_vals, b.info_num.unwrap_or(0))?;
        self.done.push(SpawnCommand {
            nprocs: b.nprocs.ok_or_else(|| SpawnError("a block without nprocs=".into()))?,
            execname: b.execname.ok_or_else(|| SpawnError("a block without execname=".into()))?,
            args,
            preputs,
            infos,
        });
        if self.done.len() == totspawns as usize {
            Ok(Progress::Done(SpawnRequest { commands: std::mem::take(&mut self.done) }))
        } else {
            Ok(Progress::More)
        }
    }
}

/// The line that starts a request, as [`SpawnBuilder::new`] charges it.
const FIRST_LINE: &str = "mcmd=spawn\n";

fn charge(bytes: &mut usize, max_bytes: usize, n: usize) -> Result<(), SpawnError> {
    *bytes = bytes.saturating_add(n);
    match *bytes > max_bytes {
        true => Err(SpawnError::over_limit(max_bytes)),
        false => Ok(()),
    }
}

fn trim(s: &[u8]) -> &[u8] {
    let end = s.iter().rposition(|b| !b" \t\r".contains(b)).map_or(0, |i| i + 1);
    let start = s[..end].iter().position(|b| !b" \t".contains(b)).unwrap_or(end);
    &s[start..end]
}

/// Orders indexed items and checks that there are exactly `count` of them with distinct indices.
/// MPICH numbers args from 1 and preputs/infos from 0; either is accepted.
fn in_order(what: &str, mut items: Indexed, count: u32) -> Result<Vec<Vec<u8>>, SpawnError> {
    items.sort_by_key(|&(i, _)| i);
    if items.len() != count as usize {
        return err(format!("{} {what} lines where the count says {count}", items.len()));
    }
    if items.windows(2).any(|w| w[0].0 == w[1].0) {
        return err(format!("a {what} index given twice"));
    }
    Ok(items.into_iter().map(|(_, v)| v).collect())
}

fn pairs(what: &str, keys: Indexed, vals: Indexed, count: u32) -> Result<Pairs, SpawnError> {
    let key_indices: Vec<u32> = sorted_indices(&keys);
    if key_indices != sorted_indices(&vals) {
        return err(format!("{what} keys and values do not pair up"));
    }
    let keys = in_order(what, keys, count)?;
    let vals = in_order(what, vals, count)?;
    Ok(keys.into_iter().zip(vals).collect())
}

fn sorted_indices(items: &Indexed) -> Vec<u32> {
    let mut v: Vec<u32> = items.iter().map(|&(i, _)| i).collect();
    v.sort_unstable();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_encoded_as_a_client_sends_it_reads_back_the_same() {
        let command = |name: &str, args: &[&str]| SpawnCommand {
            nprocs: 2,
            execname: name.into(),
            args: args.iter().map(|a| a.as_bytes().to_vec()).collect(),
            preputs: vec![(b"k".to_vec(), b"v w".to_vec())],
            infos: vec![(b"wdir".to_vec(), b"/tmp".to_vec()), (b"host".to_vec(), b"n1".to_vec())],
        };
        let request = SpawnRequest { commands: vec![command("./a", &["-x", "1 2"]), command("./b", &[])] };
        let bytes = request.encode().unwrap();
        let mut lines = bytes.split(|&b| b == b'\n').filter(|l| !l.is_empty());
        assert_eq!(lines.next(), Some(&b"mcmd=spawn"[..]));
        let mut builder = SpawnBuilder::new(1 << 20);
        let mut got = None;
        for line in lines {
            if let Progress::Done(r) = builder.line(line).unwrap() {
                got = Some(r);
            }
        }
        assert_eq!(got, Some(request.clone()));
        // What would not arrive as it was sent is refused.
        for bad in ["a\nnprocs=1000", "a\r", " a", "a\t"] {
            let mut r = request.clone();
            r.commands[1].args = vec![bad.into()];
            assert!(r.encode().is_err(), "{bad:?}");
        }
    }

    fn feed(lines: &str) -> Result<Progress, SpawnError> {
        let mut b = SpawnBuilder::new(64 * 1024);
        let mut last = Ok(Progress::More);
        for l in lines.lines().skip(1) {
            last = b.line(l.as_bytes());
            if !matches!(last, Ok(Progress::More)) {
                break;
            }
        }
        last
    }

    fn one(execname: &str, args: &[&str]) -> SpawnCommand {
        SpawnCommand {
            nprocs: 2,
            execname: execname.into(),
            args: args.iter().map(|a| a.as_bytes().to_vec()).collect(),
            preputs: vec![(b"PARENT_ROOT_PORT_NAME".to_vec(), b"tag#0$".to_vec())],
            infos: vec![(b"wdir".to_vec(), b"/tmp x".to_vec())],
        }
    }

    const ARGS_AFTER: &str = "mcmd=spawn\nnprocs=2\nexecname=./child\ntotspawns=1\nspawnssofar=1\n\
        argcnt=2\narg1=-v\narg2=a b\npreput_num=1\npreput_key_0=PARENT_ROOT_PORT_NAME\npreput_val_0=tag#0$\n\
        info_num=1\ninfo_key_0=wdir\ninfo_val_0=/tmp x\nendcmd\n";
    const ARGS_BEFORE: &str = "mcmd=spawn\nnprocs=2\nexecname=./child\ntotspawns=1\nspawnssofar=1\n\
        arg1=-v\narg2=a b\nargcnt=2\npreput_num=1\npreput_val_0=tag#0$\npreput_key_0=PARENT_ROOT_PORT_NAME\n\
        info_num=1\ninfo_key_0=wdir\ninfo_val_0=/tmp x\nendcmd\n";

    #[test]
    fn both_field_orders_give_the_same_request() {
        let want = SpawnRequest { commands: vec![one("./child", &["-v", "a b"])] };
        assert_eq!(feed(ARGS_AFTER), Ok(Progress::Done(want.clone())));
        assert_eq!(feed(ARGS_BEFORE), Ok(Progress::Done(want)));
    }

    #[test]
    fn several_blocks_make_one_spawn() {
        let two = "mcmd=spawn\nnprocs=2\nexecname=a\ntotspawns=2\nspawnssofar=1\nargcnt=0\npreput_num=0\ninfo_num=0\nendcmd\n\
            mcmd=spawn\nnprocs=3\nexecname=b\ntotspawns=2\nspawnssofar=2\nargcnt=0\npreput_num=0\ninfo_num=0\nendcmd\n";
        match feed(two) {
            Ok(Progress::Done(r)) => {
                assert_eq!(r.commands.len(), 2);
                assert_eq!(r.total_procs(), 5);
                assert_eq!(r.commands[1].execname, b"b");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn malformed_blocks_are_errors() {
        let bad = [
            "mcmd=spawn\nnprocs=1\nexecname=a\nargcnt=2\narg1=x\nendcmd\n",
            "mcmd=spawn\nnprocs=1\nexecname=a\nargcnt=2\narg1=x\narg1=y\nendcmd\n",
            "mcmd=spawn\nnprocs=-1\nexecname=a\nendcmd\n",
            "mcmd=spawn\nexecname=a\nendcmd\n",
            "mcmd=spawn\nnprocs=1\nexecname=a\npreput_num=1\npreput_key_0=k\nendcmd\n",
            "mcmd=spawn\nnprocs=1\nexecname=a\ntotspawns=100000\nendcmd\n",
            "mcmd=spawn\nnprocs=1\nno equals sign\nendcmd\n",
            "mcmd=spawn\nnprocs=1\nexecname=a\ntotspawns=2\nendcmd\ncmd=get_maxes\n",
        ];
        for b in bad {
            assert!(feed(b).is_err(), "accepted: {b:?}");
        }
    }

    #[test]
    fn bounded_in_bytes() {
        let mut b = SpawnBuilder::new(1000);
        let long = vec![b'x'; 1000];
        assert_eq!(b.line(&long), Err(SpawnError::over_limit(1000)));
    }

    #[test]
    fn the_overheads_cover_what_an_item_and_a_command_are_kept_in() {
        use std::mem::size_of;
        // An entry of a list that grows by doubling, and the largest rounding and header glibc's malloc adds
        // to a block (a byte in its smallest block of 32), less the 6 bytes an item's line has beside it.
        assert!(2 * size_of::<(u32, Vec<u8>)>() + 31 <= ITEM_OVERHEAD + 6);
        assert!(2 * size_of::<Vec<u8>>() + 31 <= ITEM_OVERHEAD + 6);
        // A command in a list that grows by doubling, and PMI-2's reader's counts beside it.
        assert!(2 * (size_of::<SpawnCommand>() + size_of::<(usize, usize)>()) <= COMMAND_OVERHEAD);
    }

    /// A request's lines are charged what its frame would be: its bytes as sent and its
    /// [`SpawnRequest::overhead`]; at the bound it is whole, a byte under it is refused.
    #[test]
    fn a_request_is_charged_its_bytes_and_the_overhead_of_what_it_keeps() {
        let request = SpawnRequest { commands: vec![one("./child", &["-v", "a b"]), one("./b", &["x"; 40])] };
        let bytes = request.encode().unwrap();
        let charge = bytes.len() + request.overhead();
        assert_eq!(request.overhead(), 2 * COMMAND_OVERHEAD + (1 + 2 + 4 + 1 + 40 + 4) * ITEM_OVERHEAD);
        let lines = || bytes.split(|&b| b == b'\n').filter(|l| !l.is_empty()).skip(1);
        let mut b = SpawnBuilder::new(charge);
        let last = lines().map(|l| b.line(l)).last();
        assert_eq!(last, Some(Ok(Progress::Done(request))));
        assert_eq!(b.bytes, charge);
        let mut b = SpawnBuilder::new(charge - 1);
        assert_eq!(lines().map(|l| b.line(l)).find(Result::is_err), Some(Err(SpawnError::over_limit(charge - 1))));
    }
}

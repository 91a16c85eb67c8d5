//! rpmi-probe: a PMI-1 client run as every task of a job, to check a PMI-1 server without MPI.
//! Admins use it to check an install; tests and benchmarks use it against any server
//! (rpmi-run, `srun --mpi=pmi2`, `mpiexec.hydra`), so it relies only on the wire protocol.

#![deny(unsafe_op_in_unsafe_fn)]

mod client;
mod groups;

use client::Client;
use rpmi::wire::mapping::Mapping;
use std::env::{self, VarError};
use std::fmt::Write as _;
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::FromRawFd;
use std::process::ExitCode;
use std::time::Instant;

const USAGE: &str =
    "usage: rpmi-probe info|barrier|exchange|groups|get KEY... [--count N] [--size BYTES] [--puts N] [--no-verify]\n       [--times]";

/// What `--help` prints after [`USAGE`]: the commands, and one line per option, as
/// docs/man/rpmi-probe.1.md's OPTIONS lists them (tests/docs.rs compares the two).
const HELP: &str = "
Run as every task of a job started by a PMI-1 server (PMI_FD, PMI_RANK, PMI_SIZE set).
  info        each rank prints its rank, size, the PMI version it was answered (it asks
              for 1.1), kvsname, universe size, appnum, maxes, PMI_process_mapping and
              the ranks on its node (clique)
  barrier     times --count barriers (default 100); rank 0 prints the mean
  exchange    each rank puts --puts keys (default 1) probe-<rank>-<i> of --size chars
              (default 96), barrier, then gets --count keys (default: one of every rank),
              one of each following rank in turn, verifying each value unless --no-verify;
              then a barrier. Rank 0 prints the times of both phases, from a start barrier;
              with --times every rank also prints when its puts began and its barrier
              ended on this machine's monotonic clock (ns), so that the job's exchange can
              be timed from the first rank in to the last rank out when all ranks share a clock
  groups      PMI 1.2's group barriers (the server must answer 1.2): the node roots alone
              exchange cards over a barrier of their group, each node meets in a NODE barrier,
              then each rank waits in two barriers at once (WORLD, and the ranks of its parity)
              and asks something meanwhile; the answers may come in any order
  get KEY...  after a barrier, each rank prints the value of each KEY, or `absent`

options (--NAME VALUE or --NAME=VALUE, anywhere; `--` ends them):
  --count N         barrier: barriers to time (default 100); exchange: gets (default: one per rank)
  --size BYTES      exchange: each value's length in characters (default 96)
  --puts N          exchange: keys each rank puts (default 1)
  --no-verify       exchange: do not check the values got
  --times           exchange: every rank also prints when its puts began and its barrier ended
  --help            print this help and exit
";

#[derive(Debug, PartialEq)]
enum Command {
    Info,
    Barrier { count: usize },
    Exchange(Exchange),
    Groups,
    Get(Vec<String>),
}

/// Options are `--name value` or `--name=value`; anything else is positional, so `get` can take
/// keys starting with a single `-` (MPICH's `-bcast-1-0`). `--` ends the options.
/// `None` means `--help`.
fn parse_args(args: &[String]) -> Result<Option<Command>, String> {
    let mut positional = Vec::new();
    let mut count = None;
    let mut size = None;
    let mut puts = None;
    let mut verify = true;
    let mut times = false;
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        if arg == "--" {
            positional.extend(args.by_ref().cloned());
        } else if !arg.starts_with("--") {
            positional.push(arg.clone());
        } else if arg == "--help" {
            return Ok(None);
        } else if arg == "--no-verify" {
            verify = false;
        } else if arg == "--times" {
            times = true;
        } else {
            let (name, inline) = match arg.split_once('=') {
                Some((name, value)) => (name, Some(value)),
                None => (arg.as_str(), None),
            };
            let slot = match name {
                "--count" => &mut count,
                "--size" => &mut size,
                "--puts" => &mut puts,
                _ => return Err(format!("unknown option `{arg}`")),
            };
            let value =
                inline.or_else(|| args.next().map(String::as_str)).ok_or_else(|| format!("{name} needs a value"))?;
            let n = value.parse().map_err(|_| format!("{name} wants a non-negative integer, not `{value}`"))?;
            *slot = Some(n);
        }
    }
    let Some((name, rest)) = positional.split_first() else {
        return Err("no command given".to_string());
    };
    if name != "get" && !rest.is_empty() {
        return Err(format!("unexpected argument `{}` after {name}", rest[0]));
    }
    let command = match name.as_str() {
        "info" => Command::Info,
        "groups" => Command::Groups,
        "barrier" => Command::Barrier { count: count.unwrap_or(100) },
        "exchange" => {
            Command::Exchange(Exchange { count, len: size.unwrap_or(96), puts: puts.unwrap_or(1), verify, times })
        }
        "get" if rest.is_empty() => return Err("get needs at least one KEY".to_string()),
        "get" => {
            for key in rest {
                // A space or `=` would change the meaning of the request line.
                if key.is_empty() || key.contains(|c: char| c == '=' || c.is_whitespace()) {
                    return Err(format!("`{key}` cannot be sent as a PMI key"));
                }
            }
            Command::Get(rest.to_vec())
        }
        _ => return Err(format!("unknown command `{name}`")),
    };
    if count.is_some() && !matches!(command, Command::Barrier { .. } | Command::Exchange(_)) {
        return Err(format!("--count does not apply to {name}"));
    }
    if (size.is_some() || puts.is_some() || !verify || times) && !matches!(command, Command::Exchange(_)) {
        return Err(format!("--size, --puts, --no-verify and --times apply only to exchange, not to {name}"));
    }
    if puts == Some(0) {
        return Err("--puts must be at least 1".to_string());
    }
    if count == Some(0) && name == "barrier" {
        return Err("--count must be at least 1 for barrier".to_string());
    }
    if size == Some(0) {
        // An empty value is not a valid PMI-1 `string` and some clients reject it.
        return Err("--size must be at least 1".to_string());
    }
    Ok(Some(command))
}

fn env_var(name: &str) -> Result<String, String> {
    env::var(name).map_err(|e| match e {
        VarError::NotPresent => format!("{name} is not set; run this as a task of a PMI-1 job"),
        VarError::NotUnicode(v) => format!("{name}={v:?} is not valid text"),
    })
}

fn env_number(name: &str) -> Result<usize, String> {
    let text = env_var(name)?;
    text.parse().map_err(|_| format!("{name}={text} is not a non-negative integer"))
}

/// Wraps the fd the server pre-connected for this task (RFC 13 "Connection").
fn connect() -> Result<Client<File>, String> {
    let text = env_var("PMI_FD")?;
    let fd: i32 = text
        .parse()
        .ok()
        .filter(|fd| *fd >= 0)
        .ok_or_else(|| format!("PMI_FD={text} is not a file descriptor number"))?;
    // SAFETY: F_GETFD only reads the descriptor flags; any integer is a valid argument.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } == -1 {
        return Err(format!("PMI_FD={fd} is not an open file descriptor: {}", io::Error::last_os_error()));
    }
    // SAFETY: the descriptor is open, the server handed it to this process for PMI, and
    // nothing else in the process uses it, so the File may own (and finally close) it.
    Ok(Client::new(unsafe { File::from_raw_fd(fd) }))
}

/// The task's place in the job, from the environment the server set.
struct Task {
    rank: usize,
    size: usize,
}

impl Task {
    fn from_env() -> Result<Task, String> {
        let rank = env_number("PMI_RANK")?;
        let size = env_number("PMI_SIZE")?;
        if rank >= size {
            return Err(format!("PMI_RANK={rank} is not below PMI_SIZE={size}"));
        }
        Ok(Task { rank, size })
    }
}

fn info(c: &mut Client<File>, task: &Task, kvs: &str, subversion: i64) -> Result<String, String> {
    let maxes = c.maxes()?;
    let universe = c.universe_size()?;
    let appnum = c.appnum()?;
    let (mapping, clique) = match c.get(kvs, "PMI_process_mapping")? {
        None => ("absent".to_string(), "unknown".to_string()),
        // RFC 13: an empty mapping means "unknown", not malformed.
        Some(v) if v.trim().is_empty() => ("empty".to_string(), "unknown".to_string()),
        Some(v) => {
            let v = v.to_string();
            let ranks = Mapping::parse(&v)
                .and_then(|m| m.clique(task.size, task.rank))
                .map_err(|e| format!("malformed PMI_process_mapping `{v}`: {e}"))?;
            let ranks: Vec<String> = ranks.iter().map(usize::to_string).collect();
            (v, ranks.join(","))
        }
    };
    Ok(format!(
        "rank={} size={} pmi=1.{subversion} kvsname={kvs} universe={universe} appnum={appnum} maxes={}/{}/{} \
         mapping={mapping} clique={clique}\n",
        task.rank, task.size, maxes.kvsname, maxes.key, maxes.value
    ))
}

fn barrier(c: &mut Client<File>, task: &Task, count: usize) -> Result<String, String> {
    c.barrier()?;
    let start = Instant::now();
    for _ in 0..count {
        c.barrier()?;
    }
    let mean_us = start.elapsed().as_secs_f64() * 1e6 / count as f64;
    Ok(if task.rank == 0 {
        format!("barrier: size={} count={count} mean_us={mean_us:.1}\n", task.size)
    } else {
        String::new()
    })
}

/// Writes deterministic hex text that differs per rank into `out`, so a value delivered to the wrong
/// key, truncated or mangled cannot pass verification.
fn probe_value(rank: usize, len: usize, out: &mut String) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.clear();
    let mut word = 0u64;
    out.extend((0..len).map(|i| {
        if i % 16 == 0 {
            word = mix((rank as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (i / 16) as u64);
        }
        HEX[((word >> (4 * (i % 16))) & 15) as usize] as char
    }));
}

/// splitmix64's finaliser: spreads every input bit over the whole word.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Key `index` of `rank`, and the value it holds (different for every key of every rank), written
/// into buffers the caller reuses: the get loop allocates nothing.
fn probe_key(rank: usize, index: usize, out: &mut String) {
    out.clear();
    let _ = write!(out, "probe-{rank}-{index}");
}

fn probe_key_value(rank: usize, index: usize, len: usize, out: &mut String) {
    probe_value(rank.wrapping_mul(1 << 20) ^ index, len, out)
}

/// What `exchange` does: `puts` keys per rank of `len` characters, then `count` gets.
#[derive(Debug, PartialEq)]
struct Exchange {
    count: Option<usize>,
    len: usize,
    puts: usize,
    verify: bool,
    /// Every rank prints when its puts began and its barrier ended (`exchange-times:`).
    times: bool,
}

fn exchange(c: &mut Client<File>, task: &Task, kvs: &str, x: &Exchange) -> Result<String, String> {
    // Reading a key twice would prove nothing new, so more than all keys means all.
    let count = x.count.unwrap_or(task.size).min(task.size * x.puts);
    // Everything the timed part needs is made before the start barrier, so that it measures the server
    // rather than this client's allocations and first page faults.
    let puts: Vec<(String, String)> = (0..x.puts)
        .map(|index| {
            let (mut key, mut value) = (String::new(), String::new());
            probe_key(task.rank, index, &mut key);
            probe_key_value(task.rank, index, x.len, &mut value);
            (key, value)
        })
        .collect();
    let (mut key, mut want) = (String::with_capacity(64), String::with_capacity(x.len));
    c.barrier()?;
    let put_began_ns = monotonic_ns();
    for (key, value) in &puts {
        c.put(kvs, key, value)?;
    }
    c.barrier()?;
    let put_ended_ns = monotonic_ns();
    let put_s = put_ended_ns.saturating_sub(put_began_ns) as f64 * 1e-9;
    let start = Instant::now();
    // Start at the next rank so the reads of all tasks spread over every key; the i-th get reads key
    // i / size of its rank, so every rank is read once before any is read twice.
    for i in 0..count {
        let (peer, index) = ((task.rank + 1 + i) % task.size, i / task.size);
        probe_key(peer, index, &mut key);
        let got = c.get(kvs, &key)?.ok_or_else(|| format!("key {key} of rank {peer} is missing after the barrier"))?;
        if !x.verify {
            continue;
        }
        probe_key_value(peer, index, x.len, &mut want);
        if got != want {
            let at = got.bytes().zip(want.bytes()).take_while(|(g, w)| g == w).count();
            return Err(format!(
                "wrong value for key {key} of rank {peer}: got {} chars, expected {}, \
                 first difference at char {at}",
                got.len(),
                x.len
            ));
        }
    }
    c.barrier()?;
    let gets_s = start.elapsed().as_secs_f64();
    let mut out = String::new();
    if task.rank == 0 {
        out = format!(
            "exchange: size={} puts={} value_len={} gets={count} put+barrier_s={put_s:.6} gets+barrier_s={gets_s:.6}\n",
            task.size, x.puts, x.len
        );
    }
    if x.times {
        out += &format!("exchange-times: rank={} put_began_ns={put_began_ns} put_ended_ns={put_ended_ns}\n", task.rank);
    }
    Ok(out)
}

/// Now on CLOCK_MONOTONIC, which every process of one machine shares (unlike `Instant`, whose value is
/// opaque).
fn monotonic_ns() -> u64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `t` is a valid timespec for the call to fill; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

fn get(c: &mut Client<File>, task: &Task, kvs: &str, keys: &[String]) -> Result<String, String> {
    c.barrier()?;
    let mut out = String::new();
    for key in keys {
        out.push_str(&match c.get(kvs, key)? {
            Some(value) => format!("rank={} {key}={value}\n", task.rank),
            None => format!("rank={} {key} absent\n", task.rank),
        });
    }
    Ok(out)
}

/// One write, so lines from many ranks sharing a pipe do not interleave.
fn emit(mut out: impl Write, text: &str) -> io::Result<()> {
    out.write_all(text.as_bytes())?;
    out.flush()
}

fn run() -> Result<(), String> {
    let args = env::args_os()
        .skip(1)
        .map(|a| a.into_string().map_err(|a| format!("argument {a:?} is not valid text")))
        .collect::<Result<Vec<_>, _>>()?;
    let Some(command) = parse_args(&args).map_err(|e| format!("{e}; {USAGE}"))? else {
        return emit(io::stdout().lock(), &format!("{USAGE}\n{HELP}")).map_err(|e| format!("writing to stdout: {e}"));
    };
    let mut c = connect()?;
    let task = Task::from_env()?;
    // Only the group barriers need 1.2; every other command asks for 1.1, which every server answers.
    let subversion = c.init(if command == Command::Groups { 2 } else { 1 })?;
    if command == Command::Groups && subversion < 2 {
        return Err(format!("the server answered PMI 1.{subversion}: it serves no group barriers (1.2)"));
    }
    let kvs = c.kvsname()?;
    let output = match &command {
        Command::Info => info(&mut c, &task, &kvs, subversion)?,
        Command::Barrier { count } => barrier(&mut c, &task, *count)?,
        Command::Exchange(x) => exchange(&mut c, &task, &kvs, x)?,
        Command::Get(keys) => get(&mut c, &task, &kvs, keys)?,
        Command::Groups => groups::groups(&mut c, &task, &kvs)?,
    };
    c.finalize()?;
    // Printed only after finalize, so output means the whole session worked.
    emit(io::stdout().lock(), &output).map_err(|e| format!("writing to stdout: {e}"))
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let rank = env::var("PMI_RANK").unwrap_or_else(|_| "?".to_string());
            // Nothing useful is left to do if stderr itself fails.
            let _ = emit(io::stderr().lock(), &format!("rpmi-probe: rank {rank}: {e}\n"));
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{parse_args, probe_key_value, probe_value, Command, Exchange};

    fn parse(args: &[&str]) -> Result<Option<Command>, String> {
        parse_args(&args.iter().map(|a| a.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn commands_and_defaults() {
        assert_eq!(parse(&["info"]), Ok(Some(Command::Info)));
        assert_eq!(parse(&["barrier"]), Ok(Some(Command::Barrier { count: 100 })));
        assert_eq!(parse(&["barrier", "--count=5"]), Ok(Some(Command::Barrier { count: 5 })));
        assert_eq!(
            parse(&["--size", "10", "exchange", "--count", "3"]),
            Ok(Some(Command::Exchange(Exchange { count: Some(3), len: 10, puts: 1, verify: true, times: false })))
        );
        assert_eq!(
            parse(&["exchange"]),
            Ok(Some(Command::Exchange(Exchange { count: None, len: 96, puts: 1, verify: true, times: false })))
        );
        assert_eq!(
            parse(&["exchange", "--puts=8", "--size", "800", "--count", "64", "--no-verify", "--times"]),
            Ok(Some(Command::Exchange(Exchange { count: Some(64), len: 800, puts: 8, verify: false, times: true })))
        );
        assert_eq!(
            parse(&["get", "PMI_process_mapping", "-bcast-1-0", "--", "--odd"]),
            Ok(Some(Command::Get(vec!["PMI_process_mapping".into(), "-bcast-1-0".into(), "--odd".into()])))
        );
        assert_eq!(parse(&["info", "--help"]), Ok(None));
    }

    #[test]
    fn bad_arguments() {
        for args in [
            &[][..],
            &["frobnicate"],
            &["info", "extra"],
            &["info", "--count", "3"],
            &["barrier", "--size", "3"],
            &["barrier", "--count", "0"],
            &["barrier", "--count"],
            &["barrier", "--count", "-1"],
            &["exchange", "--size=0"],
            &["exchange", "--sizes=4"],
            &["exchange", "--puts", "0"],
            &["barrier", "--no-verify"],
            &["barrier", "--times"],
            &["info", "--puts", "2"],
            &["get"],
            &["get", "a=b"],
            &["get", "a b"],
            &["get", ""],
        ] {
            assert!(parse(args).is_err(), "accepted {args:?}");
        }
    }

    #[test]
    fn probe_values_differ_per_rank_and_are_hex() {
        let value = |rank, len| {
            let mut out = "left over".to_string();
            probe_value(rank, len, &mut out);
            out
        };
        let (a, b) = (value(0, 96), value(1, 96));
        assert_eq!(a.len(), 96);
        assert_ne!(a, b);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_eq!(value(7, 40), value(7, 96)[..40]);
        assert_eq!(value(3, 0), "");
        // Every key of every rank has its own value.
        let values: std::collections::HashSet<String> = (0..64)
            .flat_map(|r| {
                (0..8).map(move |i| {
                    let mut out = String::new();
                    probe_key_value(r, i, 32, &mut out);
                    out
                })
            })
            .collect();
        assert_eq!(values.len(), 64 * 8);
    }
}

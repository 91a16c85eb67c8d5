//! Fuzz target `engine`: drives one `Shell` (3 local tasks of a 5-rank job on 2 nodes) through a sequence
//! of host operations decoded from the input, and checks what the shell writes and asks of the host.
//!
//! Input format (see README.md): byte 0 is the configuration, then operations until the input ends; every
//! operation is one byte `op` (`op % 16` = what, `(op / 16) % 3` = which task) followed by its arguments.
//! A missing argument byte reads as 0.

#![no_main]

use libfuzzer_sys::fuzz_target;
use rpmi::server::{
    Direction, Host, HostReply, HostRequest, JobError, JobInfo, Limits, Shell, TaskId, TaskMap, NOT_SUPPORTED,
};
use rpmi::wire::response::MAX_LINE;
use std::sync::OnceLock;

const KVSNAME: &str = "kvs_fuzz_1";
const NTASKS: usize = 3;
const JOB_SIZE: usize = 5;

/// `RPMI_FUZZ_DEBUG=1`: print every response line (to check what a seed does).
fn debug() -> bool {
    static DEBUG: OnceLock<bool> = OnceLock::new();
    *DEBUG.get_or_init(|| std::env::var_os("RPMI_FUZZ_DEBUG").is_some_and(|v| v != "0"))
}

/// The input, read one byte at a time; past its end every byte is 0.
struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    fn byte(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }

    fn bytes(&mut self, n: usize) -> &'a [u8] {
        let n = n.min(self.data.len());
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        head
    }

    fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Service {
    Publish,
    Unpublish,
    Lookup,
    Spawn,
}

/// A host that records every call and checks what the shell asks of it.
struct FuzzHost {
    offer: bool,
    local_ranks: Vec<u32>,
    /// The contribution of the collective the shell started and the host has not completed yet.
    collective: Option<Vec<u8>>,
    /// The service each task asked for that the host has not answered yet.
    requests: [Option<Service>; NTASKS],
    /// Processes each task's last spawn request asked for.
    spawn_procs: [u64; NTASKS],
    aborted: [bool; JOB_SIZE],
    job_errors: [u32; JOB_SIZE],
    /// The driver is about to misuse the API on purpose: a "host bug" log is expected.
    misuse: bool,
    host_bug_logs: usize,
    kvs_bytes_max: usize,
}

impl FuzzHost {
    fn task_of(&self, rank: u32) -> usize {
        self.local_ranks.iter().position(|&r| r == rank).unwrap_or_else(|| panic!("rank {rank} is not local"))
    }
}

impl Host for FuzzHost {
    fn collective(&mut self, contribution: &[u8]) -> Result<(), String> {
        assert!(self.collective.is_none(), "a second collective started while one is outstanding");
        let mut puts = 0;
        for line in contribution.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
            let sp = line.iter().position(|&b| b == b' ').expect("contribution line without rank");
            let rank: u32 = std::str::from_utf8(&line[..sp]).unwrap().parse().expect("contribution rank");
            assert!(self.local_ranks.contains(&rank), "contribution for non-local rank {rank}");
            let rest = &line[sp + 1..];
            let eq = rest.iter().position(|&b| b == b'=').expect("contribution line without '='");
            assert!(eq > 0 && eq + 1 < rest.len(), "empty key or value in contribution");
            puts += 1;
        }
        assert!(contribution.is_empty() || contribution.ends_with(b"\n"));
        if debug() {
            eprintln!("collective: {} bytes, {puts} puts", contribution.len());
        }
        // Rewrites of a key between barriers all travel, but the whole stays within the KVS bound.
        assert!(contribution.len() <= self.kvs_bytes_max, "a contribution of {} bytes", contribution.len());
        self.collective = Some(contribution.to_vec());
        Ok(())
    }

    fn abort(&mut self, rank: u32, _exit_code: i32, message: &str) {
        let _ = self.task_of(rank);
        assert!(!self.aborted[rank as usize], "rank {rank} aborted twice");
        assert!(!message.contains('\n'));
        self.aborted[rank as usize] = true;
    }

    fn job_error(&mut self, error: &JobError) {
        if debug() {
            eprintln!("job_error: {error}");
        }
        let rank = error.rank();
        let _ = self.task_of(rank);
        assert!(!self.aborted[rank as usize], "a job error for rank {rank}, which aborted: {error}");
        assert_eq!(self.job_errors[rank as usize], 0, "a second job error for rank {rank}: {error}");
        self.job_errors[rank as usize] += 1;
        let _ = error.to_string();
    }

    fn log(&mut self, _level: log::Level, message: &str) {
        if debug() {
            eprintln!("log: {message}");
        }
        if message.contains("host bug") && !self.misuse {
            self.host_bug_logs += 1;
            panic!("'{message}' although the host kept to the API");
        }
    }

    fn trace(&mut self, rank: u32, _direction: Direction, line: &[u8]) {
        let _ = self.task_of(rank);
        assert!(!line.contains(&b'\n'), "a traced line holds a newline");
    }

    fn request(&mut self, task: TaskId, request: HostRequest<'_>) -> Result<(), String> {
        assert!(task < NTASKS, "request for unknown task {task}");
        assert!(self.requests[task].is_none(), "task {task} asked for a second service while one is outstanding");
        let word = |s: &str| !s.is_empty() && s.bytes().all(|b| (0x21..=0x7e).contains(&b) && b != b'=');
        let service = match request {
            HostRequest::Publish { service, port } => {
                assert!(word(service) && word(port));
                Service::Publish
            }
            HostRequest::Unpublish { service } => {
                assert!(word(service));
                Service::Unpublish
            }
            HostRequest::Lookup { service } => {
                assert!(word(service));
                Service::Lookup
            }
            HostRequest::Spawn(req) => {
                assert!(!req.commands.is_empty() && req.commands.len() <= 256);
                self.spawn_procs[task] = req.total_procs();
                Service::Spawn
            }
        };
        if debug() {
            eprintln!("request from task {task}: {service:?}");
        }
        if self.offer {
            self.requests[task] = Some(service);
            Ok(())
        } else {
            Err(NOT_SUPPORTED.into())
        }
    }
}

/// What the host has written to each task, checked line by line.
struct Wire {
    /// Bytes written after the last newline.
    partial: Vec<Vec<u8>>,
    /// The next line is the second line of a `get_ranks2hosts` answer.
    r2h_second: Vec<bool>,
    /// Tasks with output left after a partial write (the host's own write queue).
    backlog: Vec<TaskId>,
}

impl Wire {
    fn written(&mut self, task: TaskId, bytes: &[u8]) {
        self.partial[task].extend_from_slice(bytes);
        while let Some(nl) = self.partial[task].iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.partial[task].drain(..=nl).collect();
            self.check_line(task, &line);
        }
        if !self.r2h_second[task] && !self.partial[task].starts_with(b"put_ranks2hosts") {
            assert!(self.partial[task].len() < MAX_LINE, "an unfinished response line over {MAX_LINE} bytes");
        }
    }

    fn check_line(&mut self, task: TaskId, line: &[u8]) {
        let shown = String::from_utf8_lossy(line);
        if debug() {
            eprint!("task {task} <- {shown}");
        }
        if std::mem::replace(&mut self.r2h_second[task], false) {
            return;
        }
        if line == b"\n" {
            return; // the answer to abort
        }
        if line.starts_with(b"put_ranks2hosts ") {
            self.r2h_second[task] = true;
            return;
        }
        assert!(line.len() <= MAX_LINE, "a response line of {} bytes: {shown}", line.len());
        assert!(line.starts_with(b"cmd="), "a response line not starting with cmd=: {shown}");
        let body = &line[..line.len() - 1];
        let value_at = body.windows(7).position(|w| w == b" value=");
        let head = &body[..value_at.unwrap_or(body.len())];
        for (i, token) in head.split(|&b| b == b' ').enumerate() {
            let eq = token.iter().position(|&b| b == b'=');
            let eq = eq.unwrap_or_else(|| panic!("token {i} without '=' in {shown}"));
            assert!(eq > 0, "a token with an empty key in {shown}");
            assert!(eq + 1 < token.len(), "a key= token with an empty value in {shown}");
            if i == 1 {
                assert!(token.starts_with(b"rc="), "rc= is not second in {shown}");
            }
        }
        if let Some(at) = value_at {
            assert!(body.len() > at + 7, "an empty value= in {shown}");
            assert!(head.starts_with(b"cmd=get_result rc=0"), "value= outside a successful get_result: {shown}");
        }
    }
}

/// Writes `piece` bytes at a time of every task's output (usize::MAX: all of it, and what the input held
/// back meanwhile brings), as a host would.
fn drain(shell: &mut Shell, host: &mut FuzzHost, wire: &mut Wire, piece: usize) {
    loop {
        while let Some(t) = shell.next_ready() {
            assert!(t < NTASKS);
            if !wire.backlog.contains(&t) {
                wire.backlog.push(t);
            }
        }
        if wire.backlog.is_empty() {
            return;
        }
        for t in std::mem::take(&mut wire.backlog) {
            let out = shell.output(t);
            let n = out.len().min(piece);
            wire.written(t, &out[..n]);
            shell.consume(t, n);
            if shell.output(t).is_empty() {
                // As the driver does once a task's output is written: its held input is parsed.
                shell.resume(host, t);
            }
            if !shell.output(t).is_empty() {
                wire.backlog.push(t);
            }
        }
        if piece != usize::MAX {
            return;
        }
    }
}

const VALUE_LENGTHS: [usize; 16] = [1, 2, 7, 63, 100, 255, 298, 299, 300, 800, 865, 866, 867, 1000, 1100, 4100];

fn value(len_sel: u8, fill: u8) -> Vec<u8> {
    let len = VALUE_LENGTHS[len_sel as usize % VALUE_LENGTHS.len()];
    vec![b'a' + fill % 26; len]
}

/// A realistic request line (or spawn block), newline included.
fn canned(k: u8, a: u8, b: u8) -> Vec<u8> {
    let key = |a: u8| format!("k{}", a % 8);
    let mut line: Vec<u8> = match k % 32 {
        0 => b"cmd=init pmi_version=1 pmi_subversion=1".to_vec(),
        1 => b"cmd=init pmi_version=2 pmi_subversion=0".to_vec(),
        2 => b"cmd=get_maxes".to_vec(),
        3 => b"cmd=get_universe_size".to_vec(),
        4 => b"cmd=get_appnum".to_vec(),
        5 => b"cmd=get_my_kvsname".to_vec(),
        6 => {
            let mut l = format!("cmd=put kvsname={KVSNAME} key={} value=", key(a)).into_bytes();
            l.extend(value(b >> 4, b));
            l
        }
        7 => format!("cmd=put kvsname={KVSNAME} key={} value=v{b} x=y  z ", key(a)).into_bytes(),
        8 => format!("cmd=get kvsname={KVSNAME} key={}", key(a)).into_bytes(),
        9 => format!("cmd=get kvsname={KVSNAME} key=PMI_process_mapping").into_bytes(),
        10 => b"cmd=barrier_in".to_vec(),
        11 => b"cmd=finalize".to_vec(),
        12 => format!("cmd=abort exitcode={} message=bye {b}", a as i8).into_bytes(),
        13 => format!("cmd=publish_name service=s{} port=p{b}", a % 4).into_bytes(),
        14 => format!("cmd=unpublish_name service=s{}", a % 4).into_bytes(),
        15 => format!("cmd=lookup_name service=s{}", a % 4).into_bytes(),
        16 => b"cmd=get_ranks2hosts".to_vec(),
        17 => format!(
            "mcmd=spawn\nnprocs={}\nexecname=./a.out\ntotspawns={}\nspawnssofar={}\nargcnt=1\narg1=-x\n\
             preput_num=1\npreput_key_0=PARENT_ROOT_PORT_NAME\npreput_val_0=tag#0$\ninfo_num=0\nendcmd",
            a % 4,
            1 + (b & 1),
            1 + ((b >> 1) & 1)
        )
        .into_bytes(),
        18 => b"mcmd=spawn".to_vec(),
        19 => b"endcmd".to_vec(),
        20 => format!("cmd=put kvsname=other key={} value=x", key(a)).into_bytes(),
        21 => format!("cmd=get kvsname=other key={}", key(a)).into_bytes(),
        22 => format!("cmd=put kvsname={KVSNAME} key=PMI_process_mapping value=x{b}").into_bytes(),
        23 => b"cmd=barrier_in group=WORLD".to_vec(),
        24 => format!("cmd=put kvsname={KVSNAME} key={} value=x", "K".repeat(62 + (a % 4) as usize)).into_bytes(),
        25 => b"cmd=get_maxes extra=1 \r".to_vec(),
        26 => b"cmd=abort".to_vec(),
        27 => b"cmd=init pmi_version=1 pmi_subversion=2".to_vec(),
        28 => format!("cmd=put kvsname={KVSNAME} key={} value=   ", key(a)).into_bytes(),
        29 => format!("cmd=lookup_name service=s{}=x", a % 4).into_bytes(),
        30 => b"cmd=publish_name service=\xff\xfe port=p".to_vec(),
        _ => format!("cmd=unpublish_name service=s{} {}", a % 4, "x=1 ".repeat(usize::from(b % 20))).into_bytes(),
    };
    line.push(b'\n');
    line
}

/// The host's answer to a service request. `procs` is what the spawn asked for: a host answers one error
/// code per process.
fn reply(v: u8, procs: u64) -> HostReply {
    let codes = |n: u64| n as usize;
    match v % 10 {
        0 => HostReply::Done,
        1 => HostReply::Port("tag#0$description#node0$port#4242$ifname#10.0.0.1$".into()),
        2 => HostReply::Port(String::new()),
        3 => HostReply::Port("a b=c".into()),
        4 => HostReply::Spawned { errcodes: vec![0; codes(procs)] },
        // A host that gets the count wrong, up to a realistic 1000 processes.
        5 => HostReply::Spawned { errcodes: vec![0; codes(u64::from(v / 10) * 40)] },
        6 => HostReply::Failed("no such service".into()),
        7 => HostReply::Failed(format!("long\nmessage= {}", "x y ".repeat(200))),
        // Up to 2000 bytes: longer than any response line may be.
        8 => HostReply::Port("p".repeat(usize::from(v / 10) * 80)),
        _ => HostReply::Spawned { errcodes: vec![-1, i32::MIN, i32::MAX] },
    }
}

fn run(data: &[u8]) {
    let mut input = Input { data };
    let config = input.byte();
    let limits = if config & 4 != 0 {
        Limits {
            vallen_max: 300,
            request_line_max: 1024,
            kvs_bytes_max: 4096,
            spawn_bytes_max: 512,
            ..Limits::default()
        }
    } else {
        Limits::default()
    };
    let (task_map, local_ranks) = if config & 8 != 0 {
        (TaskMap::cyclic(&[3, 2]), vec![0, 2, 4])
    } else {
        (TaskMap::block(&[3, 2]), vec![0, 1, 2])
    };
    let hostnames = vec!["node0".to_string(), "node1".to_string()];
    let kvs_bytes_max = limits.kvs_bytes_max;
    let job = JobInfo::new(KVSNAME, task_map, local_ranks.clone(), hostnames);
    let mut shell = Shell::new(job, limits).expect("a valid job");
    shell.set_trace(config & 1 != 0);
    let mut trace = config & 1 != 0;
    let mut host = FuzzHost {
        offer: config & 2 != 0,
        local_ranks,
        collective: None,
        requests: [None; NTASKS],
        spawn_procs: [0; NTASKS],
        aborted: [false; JOB_SIZE],
        job_errors: [0; JOB_SIZE],
        misuse: false,
        host_bug_logs: 0,
        kvs_bytes_max,
    };
    let mut wire = Wire { partial: vec![Vec::new(); NTASKS], r2h_second: vec![false; NTASKS], backlog: Vec::new() };

    // How much of each task's output the host writes per step (op 14 changes it).
    let mut piece = usize::MAX;
    while !input.is_empty() {
        let op = input.byte();
        let task = (op as usize / 16) % NTASKS;
        match op % 16 {
            0..=5 => {
                let line = canned(input.byte(), input.byte(), input.byte());
                shell.receive(&mut host, task, &line);
            }
            6 => {
                let line = canned(input.byte(), input.byte(), input.byte());
                let at = usize::from(input.byte()) * line.len() / 256;
                shell.receive(&mut host, task, &line[..at]);
                shell.receive(&mut host, task, &line[at..]);
            }
            7 => {
                let len = input.byte() as usize;
                let chunk = input.byte();
                let bytes = input.bytes(len);
                if chunk & 0x80 != 0 {
                    shell.receive(&mut host, task, bytes);
                } else {
                    for c in bytes.chunks(chunk as usize % 32 + 1) {
                        shell.receive(&mut host, task, c);
                    }
                }
            }
            8 => shell.disconnected(&mut host, task),
            9 => match host.collective.take() {
                Some(own) => shell.collective_complete(&mut host, Ok(&[&own])),
                None => {
                    host.misuse = true;
                    shell.collective_complete(&mut host, Ok(&[]));
                }
            },
            10 => {
                let order = input.byte();
                let len = input.byte() as usize;
                let theirs = input.bytes(len);
                if let Some(own) = host.collective.take() {
                    let parts: [&[u8]; 2] = if order & 1 == 0 { [&own, theirs] } else { [theirs, &own] };
                    shell.collective_complete(&mut host, Ok(&parts));
                }
            }
            11 => {
                let n = input.byte() % 5;
                let mut theirs = Vec::new();
                for _ in 0..n {
                    let (r, k, v) = (input.byte(), input.byte(), input.byte());
                    theirs.extend_from_slice(format!("{} k{}=", r % JOB_SIZE as u8, k % 8).as_bytes());
                    match v {
                        255 => {}
                        254 => theirs.extend(vec![b'z'; 900]),
                        _ => theirs.extend_from_slice(format!("v{v}").as_bytes()),
                    }
                    theirs.push(b'\n');
                }
                if let Some(own) = host.collective.take() {
                    shell.collective_complete(&mut host, Ok(&[&own, &theirs]));
                }
            }
            12 => {
                if host.collective.take().is_some() {
                    shell.collective_complete(&mut host, Err("the other shell is gone"));
                }
            }
            13 => {
                let v = input.byte();
                let answer = reply(v, host.spawn_procs[task]);
                match host.requests[task].take() {
                    Some(_) => shell.host_reply(&mut host, task, answer),
                    None if v & 0x80 != 0 => {
                        host.misuse = true;
                        shell.host_reply(&mut host, task, answer);
                    }
                    None => {}
                }
            }
            14 => {
                let p = input.byte();
                piece = if p >= 192 { usize::MAX } else { p as usize % 64 + 1 };
            }
            _ => {
                trace = !trace;
                shell.set_trace(trace);
                host.misuse = true;
                shell.receive(&mut host, NTASKS + task, b"cmd=get_maxes\n");
                shell.disconnected(&mut host, NTASKS + task);
                shell.host_reply(&mut host, NTASKS + task, HostReply::Done);
            }
        }
        host.misuse = false;
        drain(&mut shell, &mut host, &mut wire, piece);
        assert!(shell.kvs_bytes() <= kvs_bytes_max, "the KVS holds {} bytes", shell.kvs_bytes());
        let queued = |shell: &Shell| (0..NTASKS).map(|t| shell.output(t).len()).sum::<usize>();
        if piece == usize::MAX {
            assert_eq!(queued(&shell), 0, "output left after a full drain");
            assert!((0..NTASKS).all(|t| !shell.holds_input(t)), "input held after every answer was written");
        } else if queued(&shell) > 8 * MAX_LINE {
            // The host's socket buffer takes up to 8 KiB before it writes everything.
            assert!(queued(&shell) <= 16 * MAX_LINE, "{} bytes of output queued", queued(&shell));
            drain(&mut shell, &mut host, &mut wire, usize::MAX);
        }
    }
    drain(&mut shell, &mut host, &mut wire, usize::MAX);
    for t in 0..NTASKS {
        assert!(shell.output(t).is_empty());
    }
}

fuzz_target!(|data: &[u8]| run(data));

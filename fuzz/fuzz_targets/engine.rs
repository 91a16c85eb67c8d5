//! Fuzz target `engine`: drives one `Server` (3 local tasks of a 5-rank job on 2 nodes) through a sequence
//! of host operations decoded from the input, and checks what the shell writes and asks of the host.
//!
//! Input format (see fuzz/README.md): byte 0 is the configuration, then operations until the input ends; every
//! operation is one byte `op` (`op % 16` = what, `(op / 16) % 3` = which task) followed by its arguments.
//! A missing argument byte reads as 0.
//!
//! A task speaks PMI-1 until the shell answers its `cmd=init pmi_version=2` with `pmi_version=2`; from then
//! on its output is checked as PMI-2 frames, and the canned requests sent to it are PMI-2 frames.

#![no_main]

use libfuzzer_sys::fuzz_target;
use rpmi_core::server::{
    pump, GroupExchange, Host, HostReply, HostRequest, JobError, JobInfo, Limits, Server, Speaker, TaskId, TaskMap,
    GROUP_ID_MAX, NOT_SUPPORTED,
};
use rpmi_core::wire::response::MAX_LINE;
use std::sync::OnceLock;

const KVSNAME: &str = "kvs_fuzz_1";
const NTASKS: usize = 3;
const JOB_SIZE: usize = 5;

/// `RPMI_FUZZ_DEBUG=1`: print every response line (to check what a seed does).
fn debug() -> bool {
    static DEBUG: OnceLock<bool> = OnceLock::new();
    *DEBUG.get_or_init(|| std::env::var_os("RPMI_FUZZ_DEBUG").is_some_and(|v| v != "0"))
}

/// No PMI-2 answer is longer than this (the longest real ones, a value or a port, are about 1 KiB).
const FRAME_BODY_MAX: usize = 64 * 1024;

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
    /// Run group exchanges (and so answer PMI 1.2).
    serve_groups: bool,
    /// The group exchanges the shell started that the host has not ended: id and this shell's part.
    groups: Vec<(Vec<u8>, Vec<u8>)>,
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

    fn group_collective(&mut self, exchange: &GroupExchange<'_>, contribution: &[u8]) -> Result<(), String> {
        let GroupExchange { id, shells } = *exchange;
        assert!(self.serve_groups, "a group exchange from a server told groups are not served");
        assert!(id.len() <= GROUP_ID_MAX, "a group exchange id of {} bytes", id.len());
        assert!(
            !self.groups.iter().any(|(i, _)| i == id),
            "a second exchange of {} while one is outstanding",
            String::from_utf8_lossy(id)
        );
        // This shell is node 0 of two.
        assert_eq!(shells, [0, 1], "group exchange {} among {shells:?}", String::from_utf8_lossy(id));
        for line in contribution.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
            let sp = line.iter().position(|&b| b == b' ').expect("contribution line without rank");
            let rank: u32 = std::str::from_utf8(&line[..sp]).unwrap().parse().expect("contribution rank");
            assert!(self.local_ranks.contains(&rank), "group contribution for non-local rank {rank}");
        }
        assert!(contribution.len() <= self.kvs_bytes_max, "a group contribution of {} bytes", contribution.len());
        if debug() {
            eprintln!("group exchange {}: {} bytes", String::from_utf8_lossy(id), contribution.len());
        }
        self.groups.push((id.to_vec(), contribution.to_vec()));
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

    fn trace(&mut self, rank: u32, _speaker: Speaker, line: &[u8]) {
        let _ = self.task_of(rank);
        // A PMI-2 request's body may hold line breaks: the shell escapes them.
        assert!(!line.contains(&b'\n'), "a traced line holds a newline: {:?}", String::from_utf8_lossy(line));
    }

    fn request(&mut self, task: TaskId, request: HostRequest) -> Result<(), String> {
        assert!(task < NTASKS, "request for unknown task {task}");
        assert!(self.requests[task].is_none(), "task {task} asked for a second service while one is outstanding");
        let word = |s: &str| !s.is_empty() && s.bytes().all(|b| (0x21..=0x7e).contains(&b) && b != b'=');
        let service = match request {
            HostRequest::Publish { service, port } => {
                assert!(word(&service) && word(&port));
                Service::Publish
            }
            HostRequest::Unpublish { service } => {
                assert!(word(&service));
                Service::Unpublish
            }
            HostRequest::Lookup { service } => {
                assert!(word(&service));
                Service::Lookup
            }
            HostRequest::Spawn(req) => {
                let n = req.commands.len();
                assert!((1..=256).contains(&n), "a spawn of {n} commands");
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

/// What the host has written to each task, checked line by line (PMI-1) or frame by frame (PMI-2).
struct Answers {
    /// Bytes written after the last newline (PMI-1) or after the last whole frame (PMI-2).
    partial: Vec<Vec<u8>>,
    /// The task's answers are PMI-2 frames: the server answered its init with version 2.
    v2: Vec<bool>,
    /// The longest value a PMI-2 answer may carry (`Limits::pmi2_value_max`).
    value_max: usize,
    /// The next line is the second line of a `get_ranks2hosts` answer.
    r2h_second: Vec<bool>,
    /// Tasks with output left after a partial write (the host's own write queue).
    backlog: Vec<TaskId>,
}

impl Answers {
    fn written(&mut self, task: TaskId, bytes: &[u8]) {
        self.partial[task].extend_from_slice(bytes);
        loop {
            if self.v2[task] {
                let p = &self.partial[task];
                if p.len() < 6 {
                    break;
                }
                let len = frame_len(&p[..6]);
                if p.len() < 6 + len {
                    break;
                }
                let frame: Vec<u8> = self.partial[task].drain(..6 + len).collect();
                self.check_frame(task, &frame);
            } else {
                let Some(nl) = self.partial[task].iter().position(|&b| b == b'\n') else { break };
                let line: Vec<u8> = self.partial[task].drain(..=nl).collect();
                self.check_line(task, &line);
            }
        }
        if !self.v2[task] && !self.r2h_second[task] && !self.partial[task].starts_with(b"put_ranks2hosts") {
            assert!(self.partial[task].len() < MAX_LINE, "an unfinished response line over {MAX_LINE} bytes");
        }
    }

    /// One PMI-2 answer: `cmd=NAME-response;[thrid=T;]rc=N;` then fields, each ended by `;` (a `;` in a value
    /// doubled); `errmsg=` only on failure; `value=` only with `found=TRUE`, in a successful get, or beside
    /// the same `port=` in a lookup's answer; booleans `TRUE` or `FALSE` (docs/clients.md).
    fn check_frame(&mut self, task: TaskId, frame: &[u8]) {
        let shown = String::from_utf8_lossy(frame);
        if debug() {
            eprintln!("task {task} <- {shown}");
        }
        let body = &frame[6..];
        assert!(body.starts_with(b"cmd="), "a frame not starting with cmd=: {shown}");
        assert!(body.ends_with(b";"), "a frame not ending with ';': {shown}");
        let pairs = split_pairs(body).unwrap_or_else(|why| panic!("{why} in the frame {shown}"));
        let cmd = pairs[0].1.as_slice();
        const ANSWERS: [&[u8]; 15] = [
            b"fullinit-response",
            b"job-getid-response",
            b"job-connect-response",
            b"job-disconnect-response",
            b"kvs-put-response",
            b"kvs-fence-response",
            b"kvs-get-response",
            b"info-getjobattr-response",
            b"info-putnodeattr-response",
            b"info-getnodeattr-response",
            b"finalize-response",
            b"name-publish-response",
            b"name-unpublish-response",
            b"name-lookup-response",
            b"spawn-response",
        ];
        assert!(ANSWERS.contains(&cmd), "an answer of an unknown command: {shown}");
        let at = if pairs.get(1).is_some_and(|(k, _)| k == b"thrid") { 2 } else { 1 };
        let (key, rc) = pairs.get(at).unwrap_or_else(|| panic!("a frame without rc=: {shown}"));
        assert_eq!(key, b"rc", "rc= is not right after cmd= (and thrid=): {shown}");
        let rc: i32 =
            std::str::from_utf8(rc).ok().and_then(|r| r.parse().ok()).unwrap_or_else(|| panic!("rc= {shown}"));
        let get = |k: &[u8]| pairs.iter().find(|(key, _)| key == k).map(|(_, v)| v.as_slice());
        for (i, (k, v)) in pairs.iter().enumerate() {
            assert!(pairs[..i].iter().all(|(key, _)| key != k), "a key twice: {shown}");
            assert!(k == b"thrid" || !v.is_empty(), "an empty {}= in {shown}", String::from_utf8_lossy(k));
            let known = [
                &b"cmd"[..],
                b"thrid",
                b"rc",
                b"errmsg",
                b"pmi-version",
                b"pmi-subversion",
                b"rank",
                b"size",
                b"appnum",
                b"spawner-jobid",
                b"pmiverbose",
                b"errcodes",
                b"jobid",
                b"value",
                b"found",
                b"port",
                b"node_barrier",
            ];
            assert!(known.contains(&k.as_slice()), "an unknown field in {shown}");
        }
        assert!(get(b"errmsg").is_none() || rc != 0, "errmsg= with rc=0: {shown}");
        let fenced = cmd == b"kvs-fence-response" && rc == 0;
        assert!(get(b"node_barrier").is_none_or(|n| fenced && n == b"3"), "node_barrier= where it is not due: {shown}");
        assert!(get(b"pmiverbose").is_none_or(|v| v == b"FALSE"), "pmiverbose= is not FALSE: {shown}");
        if cmd == b"fullinit-response" && rc == 0 {
            assert!(get(b"pmi-version") == Some(b"2") && get(b"pmi-subversion") == Some(b"0"), "{shown}");
        }
        if cmd == b"name-lookup-response" {
            assert_eq!(get(b"value"), get(b"port"), "a lookup's value= is not its port=: {shown}");
        }
        let getter = [&b"kvs-get-response"[..], b"info-getjobattr-response", b"info-getnodeattr-response"];
        match get(b"found") {
            Some(found) => {
                assert!(getter.contains(&cmd) && rc == 0, "found= outside a successful get: {shown}");
                assert!(found == b"TRUE" || found == b"FALSE", "found= is neither TRUE nor FALSE: {shown}");
                let value = get(b"value");
                assert_eq!(value.is_some(), found == b"TRUE", "value= and found= disagree: {shown}");
                if let Some(v) = value {
                    assert!(v.len() <= self.value_max, "a value of {} bytes: {shown}", v.len());
                }
            }
            None if cmd == b"name-lookup-response" => {}
            None => {
                assert!(get(b"value").is_none(), "value= without found=: {shown}");
                assert!(!getter.contains(&cmd) || rc != 0, "a successful get without found=: {shown}");
            }
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
        if line.starts_with(b"cmd=response_to_init rc=0 pmi_version=2 ") {
            // From now on the task speaks PMI-2, and so do its answers.
            // (`rpmi=3` to a task that said it: rpmi's own additions.)
            let plain = line.strip_suffix(b" rpmi=3\n").map_or(line.to_vec(), |l| [l, b"\n"].concat());
            assert_eq!(plain, b"cmd=response_to_init rc=0 pmi_version=2 pmi_subversion=0\n");
            self.v2[task] = true;
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

/// What a PMI-2 answer's length prefix says: the server writes `{:>6}` (as MPICH does), and no answer is
/// longer than [`FRAME_BODY_MAX`].
fn frame_len(prefix: &[u8]) -> usize {
    let shown = String::from_utf8_lossy(prefix);
    let len: usize = shown.trim_start_matches(' ').parse().unwrap_or_else(|_| panic!("a frame prefix '{shown}'"));
    assert_eq!(format!("{len:>6}").as_bytes(), prefix, "a frame prefix '{shown}'");
    assert!(len <= FRAME_BODY_MAX, "an answer of {len} bytes");
    len
}

/// The `key=value;` pairs of a PMI-2 body (`;;` is a `;` of the value), each ended by its `;`.
fn split_pairs(body: &[u8]) -> Result<Vec<(Vec<u8>, Vec<u8>)>, String> {
    let mut pairs = Vec::new();
    let mut rest = body;
    while !rest.is_empty() {
        let eq = rest.iter().position(|&b| b == b'=').ok_or("a field without '='")?;
        let key = &rest[..eq];
        if key.is_empty() || key.iter().any(|&b| b == b';' || b == b' ') {
            return Err(format!("a bad key '{}'", String::from_utf8_lossy(key)));
        }
        let mut value = Vec::new();
        let mut i = eq + 1;
        loop {
            match (rest.get(i), rest.get(i + 1)) {
                (None, _) => return Err("a field without its ';'".into()),
                (Some(b';'), Some(b';')) => {
                    value.push(b';');
                    i += 2;
                }
                (Some(b';'), _) => break,
                (Some(&b), _) => {
                    value.push(b);
                    i += 1;
                }
            }
        }
        pairs.push((key.to_vec(), value));
        rest = &rest[i + 1..];
    }
    match pairs.first() {
        Some((k, _)) if k == b"cmd" => Ok(pairs),
        _ => Err("no cmd= first".into()),
    }
}

/// What each task wrote that the host has not passed to the shell yet (its socket): a host reads nothing
/// from a task while the shell holds input of it (`Server::holds_input`), then one write per step.
struct Sockets {
    unread: Vec<std::collections::VecDeque<Vec<u8>>>,
}

impl Sockets {
    /// Task `task` writes `bytes`: the host reads them at once, unless the shell holds the task's input or
    /// earlier writes wait.
    fn write(&mut self, server: &mut Server, host: &mut FuzzHost, task: TaskId, bytes: &[u8]) {
        if self.unread[task].is_empty() && !server.holds_input(task) {
            server.receive(task, bytes);
            pump(server, host);
        } else if !bytes.is_empty() {
            self.unread[task].push_back(bytes.to_vec());
        }
    }

    /// Reads one waiting write of every task whose input the shell no longer holds; whether it read any.
    fn read(&mut self, server: &mut Server, host: &mut FuzzHost) -> bool {
        let mut read = false;
        for t in 0..NTASKS {
            if !server.holds_input(t) {
                if let Some(bytes) = self.unread[t].pop_front() {
                    server.receive(t, &bytes);
                    pump(server, host);
                    read = true;
                }
            }
        }
        read
    }
}

/// Writes `piece` bytes at a time of every task's output (usize::MAX: all of it, and what the input held
/// back meanwhile brings), as a host would.
fn drain(server: &mut Server, host: &mut FuzzHost, answers: &mut Answers, piece: usize) {
    loop {
        while let Some(t) = server.next_ready() {
            assert!(t < NTASKS);
            if !answers.backlog.contains(&t) {
                answers.backlog.push(t);
            }
        }
        if answers.backlog.is_empty() {
            return;
        }
        for t in std::mem::take(&mut answers.backlog) {
            let out = server.output(t);
            let n = out.len().min(piece);
            answers.written(t, &out[..n]);
            server.consume(t, n);
            if server.output(t).is_empty() {
                // As the driver does once a task's output is written: its held input is parsed.
                server.resume(t);
                pump(server, host);
            }
            if !server.output(t).is_empty() {
                answers.backlog.push(t);
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
    // One key in eight is a node attribute written as Flux's libpmi2 writes it (`local::NAME`).
    let key = |a: u8| if a % 8 == 7 { format!("local::k{}", a % 4) } else { format!("k{}", a % 8) };
    let mut line: Vec<u8> = match k % 32 {
        // Half of them speak rpmi's revision 3 (the node barrier).
        0 => format!("cmd=init pmi_version=1 pmi_subversion=1{}", if a & 1 == 1 { " rpmi=3" } else { "" }).into_bytes(),
        1 => format!("cmd=init pmi_version=2 pmi_subversion=0{}", if a & 1 == 1 { " rpmi=3" } else { "" }).into_bytes(),
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
        // One barrier in four is the node barrier's line, as the last task in on the page sends it.
        10 if b % 4 == 3 => b"cmd=node_barrier_in".to_vec(),
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
        23 => {
            let group = match a % 8 {
                0 => "WORLD".to_string(),
                1 => format!("WORLD:{b}"),
                2 => format!("NODE:{b}"),
                3 => format!("0,1,2:{}", b % 3),
                4 => format!("{},3:{}", a % 3, b % 3),
                5 => format!("{},{}:{b}", a % 6, b % 6),
                6 => format!("0,2,4:{}", b % 2),
                _ => format!("{}:{}", "1,".repeat(usize::from(b)), b),
            };
            format!("cmd=barrier_in group={group}").into_bytes()
        }
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

/// A PMI-2 frame of `body`: its length right-aligned in 6 bytes (MPICH's `%6u`), or left-aligned (Slurm's
/// `%-6d`).
fn frame(body: &[u8], left: bool) -> Vec<u8> {
    let mut f = match left {
        true => format!("{:<6}", body.len()),
        false => format!("{:>6}", body.len()),
    }
    .into_bytes();
    f.extend_from_slice(body);
    f
}

/// A realistic PMI-2 request (one frame, or a few bytes that are not one), for a task of rank `rank`. Bit 5
/// of `k` pads the length on the left.
fn canned2(k: u8, a: u8, b: u8, rank: u32) -> Vec<u8> {
    // One key in eight is a node attribute written as Flux's libpmi2 writes it (`local::NAME`).
    let key = |a: u8| if a % 8 == 7 { format!("local::k{}", a % 4) } else { format!("k{}", a % 8) };
    let node_key = |a: u8| format!("n{}", a % 4);
    let body: Vec<u8> = match k % 32 {
        0 => match a % 4 {
            0 => format!("cmd=fullinit;pmirank={rank};"),
            1 => "cmd=fullinit;pmirank=-1;".into(),
            2 => format!("cmd=fullinit;pmirank={};", (rank + 1 + u32::from(b % 4)) % JOB_SIZE as u32),
            // Slurm's libpmi2.
            _ => format!("cmd=fullinit;pmijobid=1.0;pmirank={rank};threaded=FALSE;"),
        }
        .into_bytes(),
        1 => b"cmd=job-getid;".to_vec(),
        2 => format!("cmd=job-connect;jobid={KVSNAME};").into_bytes(),
        3 => format!("cmd=job-disconnect;jobid={KVSNAME};").into_bytes(),
        4 => {
            let mut body = format!("cmd=kvs-put;key={};value=", key(a)).into_bytes();
            body.extend(value(b >> 4, b));
            body.push(b';');
            body
        }
        // A value with `;` in it, as older clients write it, and with spaces and `=`.
        5 => format!("cmd=kvs-put;key={};value=x;;y=z ;;{b};", key(a)).into_bytes(),
        6 if b % 4 == 3 => b"cmd=node-barrier-in;".to_vec(),
        6 => b"cmd=kvs-fence;".to_vec(),
        7 => format!("cmd=kvs-get;jobid={KVSNAME};srcid=-1;key={};", key(a)).into_bytes(),
        8 => match a % 3 {
            0 => format!("cmd=kvs-get;key={};", key(b)),
            1 => format!("cmd=kvs-get;jobid=other;srcid={b};key={};", key(b)),
            _ => format!("cmd=kvs-get;thrid=0x7f{b:02x};jobid={KVSNAME};srcid=3;key={};", key(b)),
        }
        .into_bytes(),
        9 => format!("cmd=kvs-get;jobid={KVSNAME};srcid=-1;key=PMI_process_mapping;").into_bytes(),
        10 => {
            let attr = ["PMI_process_mapping", "universeSize", "PMI_hwloc_xmlfile", "PMI_dead_processes"];
            format!("cmd=info-getjobattr;key={};", attr[usize::from(a % 4)]).into_bytes()
        }
        11 => match b & 0x80 {
            0 => format!("cmd=info-putnodeattr;key={};value=v{b};", node_key(a)).into_bytes(),
            _ => {
                let mut body = format!("cmd=info-putnodeattr;key={};value=", node_key(a)).into_bytes();
                body.extend(value(b >> 3, b));
                body.push(b';');
                body
            }
        },
        12 => {
            let wait = if b & 1 == 0 { "TRUE" } else { "true" };
            format!("cmd=info-getnodeattr;key={};wait={wait};", node_key(a)).into_bytes()
        }
        13 => match b & 1 {
            0 => format!("cmd=info-getnodeattr;key={};wait=FALSE;", node_key(a)),
            _ => format!("cmd=info-getnodeattr;key={};", node_key(a)),
        }
        .into_bytes(),
        14 => format!("cmd=info-getnodeattr;key={};wait=maybe;", node_key(a)).into_bytes(),
        15 => match b % 3 {
            0 => format!("cmd=abort;isworld=1;exitcode={};message=rank {rank}: bye;; {b};", a as i8),
            1 => "cmd=abort;".into(),
            _ => format!("cmd=abort;exitcode={}99999999999;", a),
        }
        .into_bytes(),
        16 => b"cmd=finalize;".to_vec(),
        17 => match a & 4 {
            0 => format!("cmd=name-publish;name=s{};port=tag#0$port#{b}$;", a % 4),
            _ => format!("cmd=name-publish;name=s{};port=p {b};;x;", a % 4),
        }
        .into_bytes(),
        18 => format!("cmd=name-unpublish;name=s{};", a % 4).into_bytes(),
        19 => match a & 4 {
            0 => format!("cmd=name-lookup;name=s{};", a % 4),
            _ => format!("cmd=name-lookup;thrid=9;name=s {};", a % 4),
        }
        .into_bytes(),
        // MPICH's spawn of one or two commands, with the parent's port as a preput.
        20 => {
            let n = 1 + usize::from(a & 1);
            let mut body = format!(
                "cmd=spawn;thrid=0x{b:x};ncmds={n};preputcount=1;ppkey0=PARENT_ROOT_PORT_NAME;ppval0=tag#0$port#{b}$;"
            );
            for c in 0..n {
                body += &format!(
                    "subcmd=./child{c};maxprocs={};argc=2;argv0=-n;argv1=two words;infokeycount=1;infokey0=wdir;                     infoval0=/tmp;",
                    (a >> 1) % 4 + 1
                );
            }
            body.into_bytes()
        }
        21 => match a % 8 {
            0 => "cmd=spawn;ncmds=2;preputcount=0;subcmd=./a;maxprocs=1;argc=0;".into(),
            1 => "cmd=spawn;ncmds=1;preputcount=0;subcmd=./a;maxprocs=1;argc=1;argv1=x;".into(),
            2 => "cmd=spawn;ncmds=1;preputcount=1;subcmd=./a;maxprocs=1;argc=0;".into(),
            3 => "cmd=spawn;ncmds=1;preputcount=0;subcmd=./a;maxprocs=-1;argc=0;".into(),
            4 => "cmd=spawn;ncmds=1;preputcount=0;subcmd=./a;maxprocs=1;infokeycount=1;infokey3=k;".into(),
            5 => "cmd=spawn;ncmds=0;preputcount=0;".into(),
            6 => "cmd=spawn;ncmds=1;preputcount=0;subcmd=;maxprocs=1;argc=0;".into(),
            _ => format!("cmd=spawn;ncmds=1;preputcount=0;subcmd=./a;maxprocs={};argc={};", b, 4096 + usize::from(b)),
        }
        .into_bytes(),
        // Not a length prefix: the connection is cut at once.
        22 => {
            return match a % 4 {
                0 => b" 1 3  cmd=finalize;".to_vec(),
                1 => b"-00013cmd=finalize;".to_vec(),
                2 => b"cmd=finalize;".to_vec(),
                _ => b"0x000dcmd=finalize;".to_vec(),
            }
        }
        23 => match a % 3 {
            0 => "cmd=no-such;",
            1 => "cmd=kvs_put;key=a;value=b;",
            _ => "cmd=init;pmi_version=2;pmi_subversion=0;",
        }
        .into(),
        24 => {
            let missing = [
                "cmd=kvs-put;value=x;",
                "cmd=kvs-get;jobid=kvs_fuzz_1;srcid=0;",
                "cmd=info-getjobattr;",
                "cmd=info-putnodeattr;value=x;",
                "cmd=info-getnodeattr;wait=TRUE;",
                "cmd=name-publish;name=s0;",
                "cmd=name-unpublish;",
                "cmd=name-lookup;",
            ];
            missing[usize::from(a % 8)].into()
        }
        25 => match a % 3 {
            0 => format!("cmd=kvs-fence;thrid=0x{b:x};"),
            1 => format!("cmd=kvs-put;thrid=a;;b{b};key={};value=v;", key(a)),
            _ => format!("cmd=job-getid;thrid={};", "t".repeat(usize::from(b) * 4)),
        }
        .into_bytes(),
        26 => {
            let bad = [
                "cmd=finalize;junk;",
                "key=v;cmd=finalize;",
                "cmd=;",
                "",
                "cmd=kvs-put;=v;",
                "cmd=kvs-fence",
                " cmd=job-getid;",
                "cmd=finalize;a;b=c;",
            ];
            bad[usize::from(a % 8)].into()
        }
        // Longer than a request may be (but a spawn), or than any limit: refused from the prefix.
        27 => match a & 1 {
            0 => {
                let mut body = format!("cmd=kvs-put;key={};value=", key(b)).into_bytes();
                body.extend(vec![b'w'; 4096 + usize::from(b)]);
                body.push(b';');
                body
            }
            _ => return b"999999cmd=kvs-put;key=a;value=".to_vec(),
        },
        28 => match a % 3 {
            0 => format!("cmd=kvs-put;key={};value=a\nb;", key(b)),
            1 => format!("cmd=info-putnodeattr;key={};value=a\rb\n;", node_key(b)),
            _ => format!("cmd=kvs-put;key=a b;value=c;"),
        }
        .into_bytes(),
        // A spawn of 1 to 257 commands.
        29 => {
            let n = usize::from(a) + 1 + usize::from(a == 255 && b & 1 != 0);
            let mut body = format!("cmd=spawn;ncmds={n};preputcount=0;");
            for c in 0..n {
                body += &format!("subcmd=./c{c};maxprocs={};argc=0;infokeycount=0;", b % 3 + 1);
            }
            body.into_bytes()
        }
        // A PMI-1 line to a PMI-2 task.
        30 => return canned(a, b, 0),
        // Two requests in one write: pipelined, the second while the first waits, abort while one waits.
        _ => {
            let (first, second) = match a % 3 {
                0 => (format!("cmd=kvs-put;key={};value=p{b};", key(b)), format!("cmd=kvs-get;key={};", key(b))),
                1 => ("cmd=kvs-fence;".into(), format!("cmd=kvs-get;key={};", key(b))),
                _ => (format!("cmd=info-getnodeattr;key={};wait=TRUE;", node_key(b)), "cmd=abort;exitcode=2;".into()),
            };
            let mut f = frame(first.as_bytes(), k & 0x20 != 0);
            f.extend(frame(second.as_bytes(), k & 0x40 != 0));
            return f;
        }
    };
    frame(&body, k & 0x20 != 0)
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

/// A canned request in the task's protocol, as far as the host has written the task's answers (a task
/// whose init answer is still queued is sent PMI-1).
fn request(answers: &Answers, host: &FuzzHost, task: TaskId, k: u8, a: u8, b: u8) -> Vec<u8> {
    match answers.v2[task] {
        true => canned2(k, a, b, host.local_ranks[task]),
        false => canned(k, a, b),
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
    let value_max = limits.pmi2_value_max();
    let job = JobInfo::new(KVSNAME, task_map, local_ranks.clone(), hostnames);
    let mut server = Server::new(job, limits).expect("a valid job");
    server.set_trace(config & 1 != 0);
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
        serve_groups: config & 16 != 0,
        groups: Vec::new(),
    };
    server.serve_groups(host.serve_groups);
    server.serve_node_barrier(config & 32 != 0);
    let mut answers = Answers {
        partial: vec![Vec::new(); NTASKS],
        v2: vec![false; NTASKS],
        value_max,
        r2h_second: vec![false; NTASKS],
        backlog: Vec::new(),
    };

    let mut sockets = Sockets { unread: vec![Default::default(); NTASKS] };
    // How much of each task's output the host writes per step (op 14 changes it).
    let mut piece = usize::MAX;
    while !input.is_empty() {
        let op = input.byte();
        let task = (op as usize / 16) % NTASKS;
        match op % 16 {
            0..=5 => {
                let line = request(&answers, &host, task, input.byte(), input.byte(), input.byte());
                sockets.write(&mut server, &mut host, task, &line);
            }
            6 => {
                let line = request(&answers, &host, task, input.byte(), input.byte(), input.byte());
                let at = usize::from(input.byte()) * line.len() / 256;
                sockets.write(&mut server, &mut host, task, &line[..at]);
                sockets.write(&mut server, &mut host, task, &line[at..]);
            }
            7 => {
                let len = input.byte() as usize;
                let chunk = input.byte();
                let bytes = input.bytes(len);
                if chunk & 0x80 != 0 {
                    sockets.write(&mut server, &mut host, task, bytes);
                } else {
                    for c in bytes.chunks(chunk as usize % 32 + 1) {
                        sockets.write(&mut server, &mut host, task, c);
                    }
                }
            }
            8 => {
                // What the task wrote and the host did not read is lost with the connection.
                sockets.unread[task].clear();
                server.disconnected(task);
                pump(&mut server, &mut host);
            }
            9 => match host.collective.take() {
                Some(own) => {
                    server.collective_complete(Ok(&[&own]));
                    pump(&mut server, &mut host)
                }
                None => {
                    host.misuse = true;
                    server.collective_complete(Ok(&[]));
                    pump(&mut server, &mut host);
                }
            },
            10 => {
                let order = input.byte();
                let len = input.byte() as usize;
                let theirs = input.bytes(len);
                if let Some(own) = host.collective.take() {
                    let parts: [&[u8]; 2] = if order & 1 == 0 { [&own, theirs] } else { [theirs, &own] };
                    server.collective_complete(Ok(&parts));
                    pump(&mut server, &mut host);
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
                    server.collective_complete(Ok(&[&own, &theirs]));
                    pump(&mut server, &mut host);
                }
            }
            12 => {
                let g = input.byte();
                if g & 1 == 0 {
                    if host.collective.take().is_some() {
                        server.collective_complete(Err("the other server is gone"));
                        pump(&mut server, &mut host);
                    }
                } else if !host.groups.is_empty() {
                    // A group exchange ends, in any order: failed, or with the other node's part.
                    let (id, own) = host.groups.remove(usize::from(g / 4) % host.groups.len());
                    let len = input.byte() as usize;
                    let theirs = input.bytes(len);
                    match g & 2 {
                        0 => {
                            server.group_complete(&id, Err("the other node is gone"));
                            pump(&mut server, &mut host)
                        }
                        _ => {
                            server.group_complete(&id, Ok(&[&own, theirs]));
                            pump(&mut server, &mut host)
                        }
                    }
                } else if g & 2 != 0 {
                    host.misuse = true;
                    server.group_complete(b"WORLD:0", Ok(&[]));
                    pump(&mut server, &mut host);
                }
            }
            13 => {
                let v = input.byte();
                let answer = reply(v, host.spawn_procs[task]);
                match host.requests[task].take() {
                    Some(_) => {
                        server.host_reply(task, answer);
                        pump(&mut server, &mut host)
                    }
                    None if v & 0x80 != 0 => {
                        host.misuse = true;
                        server.host_reply(task, answer);
                        pump(&mut server, &mut host);
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
                server.set_trace(trace);
                host.misuse = true;
                server.receive(NTASKS + task, b"cmd=get_maxes\n");
                pump(&mut server, &mut host);
                server.disconnected(NTASKS + task);
                pump(&mut server, &mut host);
                server.host_reply(NTASKS + task, HostReply::Done);
                pump(&mut server, &mut host);
            }
        }
        host.misuse = false;
        // The page's release, as the driver writes it: once, and never an empty one.
        if let Some(release) = server.node_release() {
            assert!(release.code.is_some() || release.broken, "an empty release: {release:?}");
            assert_eq!(server.node_release(), None, "a release taken twice");
        }
        drain(&mut server, &mut host, &mut answers, piece);
        while sockets.read(&mut server, &mut host) {
            drain(&mut server, &mut host, &mut answers, piece);
            if piece != usize::MAX {
                break;
            }
        }
        assert!(server.kvs_bytes() <= kvs_bytes_max, "the KVS holds {} bytes", server.kvs_bytes());
        let queued = |server: &Server| (0..NTASKS).map(|t| server.output(t).len()).sum::<usize>();
        if debug() {
            let each: Vec<usize> = (0..NTASKS).map(|t| server.output(t).len()).collect();
            eprintln!(
                "op {op:#04x}: output queued {each:?}, input held {:?}",
                (0..NTASKS).map(|t| server.holds_input(t)).collect::<Vec<_>>()
            );
        }
        if piece == usize::MAX {
            assert_eq!(queued(&server), 0, "output left after a full drain");
            assert!((0..NTASKS).all(|t| !server.holds_input(t)), "input held after every answer was written");
        } else if queued(&server) > 8 * MAX_LINE {
            // The host's socket buffer takes up to 8 KiB before it writes everything.
            assert!(queued(&server) <= 16 * MAX_LINE, "{} bytes of output queued", queued(&server));
            drain(&mut server, &mut host, &mut answers, usize::MAX);
        }
    }
    drain(&mut server, &mut host, &mut answers, usize::MAX);
    while sockets.read(&mut server, &mut host) {
        drain(&mut server, &mut host, &mut answers, usize::MAX);
    }
    for t in 0..NTASKS {
        assert!(server.output(t).is_empty());
    }
}

fuzz_target!(|data: &[u8]| run(data));

//! What a task can cost the serving process, measured: each attack runs in a child process (this test binary
//! run again with `RPMI_BOUNDS_CHILD` naming the attack), which resets its peak resident set
//! (`/proc/self/clear_refs`), runs the attack, and reports the growth of its peak (`VmHWM`) over its
//! resident set before; the parent checks the figures against the bounds stated here.

use rpmi::driver::{channel, socketpair, Driver, HostFds};
use rpmi::server::{pump, Host, JobError, JobInfo, Limits, Server, TaskMap};
use rpmi::wire::spawn::{COMMAND_OVERHEAD, ITEM_OVERHEAD};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::process::Command;
use std::thread;
use std::time::Duration;

/// The variable that makes a test run its attack (the child) instead of checking one (the parent).
const CHILD: &str = "RPMI_BOUNDS_CHILD";
/// The prefix of the lines in which a child reports its figures.
const REPORT: &str = "bounds:";

/// A host for shells whose tasks never reach a barrier; it only checks that nothing goes wrong.
struct QuietHost;

impl HostFds for QuietHost {}

impl Host for QuietHost {
    fn collective(&mut self, _contribution: &[u8]) -> Result<(), String> {
        panic!("no task of these tests enters a barrier");
    }

    fn abort(&mut self, rank: u32, _exit_code: i32, message: &str) {
        panic!("rank {rank} aborted: {message}");
    }

    fn job_error(&mut self, error: &JobError) {
        panic!("{error}");
    }
}

/// A figure of this process's `/proc/self/status`, in bytes.
fn status(field: &str) -> usize {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line =
        status.lines().find(|l| l.starts_with(field)).unwrap_or_else(|| panic!("no {field} in /proc/self/status"));
    let kib: usize = line[field.len()..].trim().trim_end_matches("kB").trim().parse().expect("a size in kB");
    kib * 1024
}

/// Resets the peak resident set to the current one (Linux 4.0 and later) and returns the current one.
fn reset_peak() -> usize {
    std::fs::write("/proc/self/clear_refs", "5").expect("resetting VmHWM through /proc/self/clear_refs");
    status("VmRSS:")
}

/// How far the peak resident set grew over `base`.
fn peak_growth(base: usize) -> usize {
    status("VmHWM:").saturating_sub(base)
}

fn report(key: &str, value: impl std::fmt::Display) {
    println!("{REPORT} {key}={value}");
}

/// Runs `test` of this binary as a child with [`CHILD`] set to `attack`, and returns the figures it reported.
fn run_child(test: &str, attack: &str) -> Vec<(String, u64)> {
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = Command::new(exe)
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(CHILD, attack)
        .output()
        .expect("running the test binary again");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the child failed: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let figures: Vec<(String, u64)> = stdout
        .lines()
        // The harness may have begun the line ("test name ... ").
        .filter_map(|l| l.find(REPORT).map(|at| &l[at + REPORT.len()..]))
        .filter_map(|l| l.trim().split_once('='))
        .map(|(k, v)| (k.to_string(), v.parse().expect("a figure")))
        .collect();
    eprintln!("{attack}: {figures:?}");
    figures
}

fn figure(figures: &[(String, u64)], key: &str) -> u64 {
    figures.iter().find(|(k, _)| k == key).map(|&(_, v)| v).unwrap_or_else(|| panic!("the child reported no {key}"))
}

// ---------------------------------------------------------------------------------------------------------
// Pipelined get_ranks2hosts.

/// Ranks of the job: 1000 nodes of 100.
const NODES: u32 = 1000;
const PER_NODE: u32 = 100;
/// `cmd=get_ranks2hosts\n` is 20 bytes: 3000 of them are 60 KB of requests, one read's worth.
const RANKS2HOSTS_REQUESTS: usize = 3000;
/// The most the serving process may grow by: the answer (built once, 601 KB here), the output the
/// shell holds for the task and the input it held back, with room for the threads' stacks and buffers.
const RANKS2HOSTS_GROWTH_MAX: u64 = 4 << 20;
/// The child stops early (and reports what it reached) once it has grown this much: the attack has then
/// succeeded, and would go on to take gigabytes.
const RANKS2HOSTS_GIVE_UP: usize = 64 << 20;

/// One task of a 100,000-rank job, served by a real driver over a real socketpair, writes 60 KB of pipelined
/// `cmd=get_ranks2hosts` and reads the answers 4 KiB at a time: the server must hold back the task's input
/// while its answers are unread, instead of answering every request of a read at once.
#[test]
fn pipelined_ranks2hosts_cost_a_bounded_amount_of_memory() {
    if std::env::var(CHILD).as_deref() == Ok("ranks2hosts") {
        return ranks2hosts_attack();
    }
    let figures = run_child("pipelined_ranks2hosts_cost_a_bounded_amount_of_memory", "ranks2hosts");
    let growth = figure(&figures, "peak_growth");
    assert!(
        growth <= RANKS2HOSTS_GROWTH_MAX,
        "the serving process grew by {} KiB (bound {} KiB)",
        growth >> 10,
        RANKS2HOSTS_GROWTH_MAX >> 10
    );
    assert_eq!(figure(&figures, "answers"), RANKS2HOSTS_REQUESTS as u64, "not every request was answered");
}

fn ranks2hosts_attack() {
    let map = TaskMap::block(&vec![PER_NODE; NODES as usize]);
    let hosts: Vec<String> = (0..NODES).map(|n| format!("node{n:04}")).collect();
    let answer = map.ranks2hosts(&hosts).into_bytes();
    let server = Server::new(JobInfo::new("kvs_bounds", map, vec![0], hosts), Limits::default()).expect("a server");
    let (_handle, inbox) = channel().expect("a driver channel");
    let mut driver = Driver::new(server, QuietHost, inbox).expect("a driver");
    let (server, task) = socketpair().expect("a socketpair");
    driver.attach(0, server).expect("attach");
    let mut reader = UnixStream::from(task);
    // A server that never answers the held requests fails the test instead of hanging it.
    reader.set_read_timeout(Some(Duration::from_secs(60))).expect("a read timeout");
    let mut writer = reader.try_clone().expect("a second handle on the task's end");
    let requests = b"cmd=get_ranks2hosts\n".repeat(RANKS2HOSTS_REQUESTS);
    let mut buf = vec![0u8; 4096];

    let base = reset_peak();
    // Stops the attack once it has plainly succeeded (the server answering every request at once).
    thread::spawn(move || loop {
        if status("VmRSS:").saturating_sub(base) > RANKS2HOSTS_GIVE_UP {
            report("peak_growth", peak_growth(base));
            report("answers", 0);
            std::process::exit(0);
        }
        thread::sleep(Duration::from_millis(10));
    });
    let progress = thread::spawn(move || driver.run());
    let pipelined = thread::spawn(move || writer.write_all(&requests));
    let total = answer.len() * RANKS2HOSTS_REQUESTS;
    let mut read = 0;
    while read < total {
        let n = reader.read(&mut buf).expect("reading the answers");
        assert!(n > 0, "the server closed the connection after {read} of {total} bytes");
        // Every answer is the same: compare what came with the answer from where it has got to.
        for (i, chunk) in buf[..n].chunks(answer.len()).enumerate() {
            let at = (read + i * answer.len()) % answer.len();
            let first = chunk.len().min(answer.len() - at);
            let (head, tail) = chunk.split_at(first);
            assert!(
                head == &answer[at..at + first] && tail == &answer[..tail.len()],
                "answers wrong after {read} bytes"
            );
        }
        read += n;
    }
    pipelined.join().expect("the writer").expect("writing the requests");
    drop(reader);
    progress.join().expect("the progress thread").expect("Driver::run");
    report("peak_growth", peak_growth(base));
    report("answers", read / answer.len());
    report("answer_bytes", answer.len());
}

// ---------------------------------------------------------------------------------------------------------
// A store filled with tiny puts.

/// The store's bound in the tiny-puts attack: about a million entries at their honest charge.
const TINY_PUTS_KVS_BYTES_MAX: usize = 224 << 20;
/// The attack gives up after this many puts: with the store's bound honest, a put is refused long before.
const TINY_PUTS_MAX: usize = 1_500_000;
/// Puts sent in one `receive`, as a task pipelining them would (their answers stay under the back-pressure
/// bound).
const TINY_PUTS_BATCH: usize = 1000;

/// One task puts tiny values (`k<i>=v`) until a put is refused: the shell's count of what it holds must
/// agree with what the process grew by, within a factor of two (the charge covers the hash table at its
/// peak, while it grows, so the count is at most twice the growth), and never understate it.
#[test]
fn tiny_puts_are_charged_what_they_cost() {
    if std::env::var(CHILD).as_deref() == Ok("tiny_puts") {
        return tiny_puts_attack();
    }
    let figures = run_child("tiny_puts_are_charged_what_they_cost", "tiny_puts");
    let (stored, counted, growth) =
        (figure(&figures, "stored"), figure(&figures, "counted"), figure(&figures, "peak_growth"));
    assert_eq!(figure(&figures, "refused"), 1, "no put was refused: {stored} puts were counted as {counted} bytes");
    assert!(counted <= TINY_PUTS_KVS_BYTES_MAX as u64, "the server holds {counted} bytes, over its bound");
    // What the shell holds besides the store (its queued answers, the partial line) is small and fixed.
    let slack = 1 << 20;
    assert!(
        growth <= counted + slack,
        "{stored} puts were counted as {counted} bytes and grew the process by {growth}"
    );
    assert!(
        counted <= 2 * growth,
        "{stored} puts were counted as {counted} bytes but grew the process by only {growth}"
    );
}

fn tiny_puts_attack() {
    let limits = Limits { kvs_bytes_max: TINY_PUTS_KVS_BYTES_MAX, ..Limits::default() };
    let job = JobInfo::new("kvs_bounds", TaskMap::block(&[1]), vec![0], vec!["node0".into()]);
    let mut server = Server::new(job, limits).expect("a server");
    let mut host = QuietHost;
    let mut requests = Vec::with_capacity(TINY_PUTS_BATCH * 40);
    let counted_before = server.kvs_bytes();
    let (mut stored, mut refused) = (0, false);

    let base = reset_peak();
    while !refused && stored < TINY_PUTS_MAX {
        requests.clear();
        for i in stored..stored + TINY_PUTS_BATCH {
            writeln!(requests, "cmd=put kvsname=kvs_bounds key=k{i} value=v").expect("a request");
        }
        server.receive(0, &requests);
        pump(&mut server, &mut host);
        let mut answers = 0;
        while answers < TINY_PUTS_BATCH {
            let out = server.output(0);
            assert!(!out.is_empty(), "{answers} of {TINY_PUTS_BATCH} puts were answered");
            for line in out.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
                match line {
                    b"cmd=put_result rc=0" if !refused => stored += 1,
                    _ if line.starts_with(b"cmd=put_result rc=2 ") => refused = true,
                    _ => panic!("answer {}: {}", stored, String::from_utf8_lossy(line)),
                }
                answers += 1;
            }
            let n = out.len();
            server.consume(0, n);
            server.resume(0);
            pump(&mut server, &mut host);
        }
    }
    report("peak_growth", peak_growth(base));
    report("counted", server.kvs_bytes() - counted_before);
    report("stored", stored);
    report("refused", u8::from(refused));
}

// ---------------------------------------------------------------------------------------------------------
// PMI 1.2 group barriers outstanding.

/// The job of the group-barriers attack: 8192 nodes of 128 ranks; the shell serves node 0's 128 tasks.
const GROUP_NODES: usize = 8192;
const GROUP_PER_NODE: u32 = 128;
/// The store's bound in the group-barriers attack.
const GROUP_KVS_BYTES_MAX: usize = 1 << 20;
/// What the shell may hold beside what it charges to the store: the one list of the job's shells that
/// every `WORLD` barrier shares (32 KiB here), the tasks' answer buffers (one answer each: they are read as
/// they come), and the allocator's rounding.
const GROUP_SLACK: u64 = 512 << 10;

/// A host that runs group exchanges and never ends one: what it is handed it holds.
#[derive(Default)]
struct GroupHost {
    exchanges: usize,
}

impl Host for GroupHost {
    fn collective(&mut self, _contribution: &[u8]) -> Result<(), String> {
        panic!("no task of these tests enters a plain barrier");
    }

    fn group_collective(
        &mut self,
        _exchange: &rpmi::server::GroupExchange<'_>,
        _contribution: &[u8],
    ) -> Result<(), String> {
        self.exchanges += 1;
        Ok(())
    }

    fn abort(&mut self, rank: u32, _exit_code: i32, message: &str) {
        panic!("rank {rank} aborted: {message}");
    }

    fn job_error(&mut self, error: &JobError) {
        panic!("{error}");
    }

    fn log(&mut self, _level: log::Level, _message: &str) {}
}

/// Every one of a shell's 128 tasks, in a job of 8192 nodes, asks for PMI 1.2 and enters 64 group barriers
/// of tags its own (as many as a task may have outstanding), which none of the other tasks enters: 8192
/// barriers. In the first attack they are `WORLD` barriers, each waiting for every node and every local
/// task; in the second, groups of the task's rank and 120 ranks on other nodes, as long a group as a
/// barrier may name (about 1 KB), each with its list of 121 shells. What they hold is charged to the store's
/// bound (a barrier that would go over fails with rc=2, as a put does): the process may grow by that bound
/// and a fixed overhead, and the shell's count of what it holds may not understate the growth.
#[test]
fn outstanding_group_barriers_are_bounded_by_the_store() {
    let test = "outstanding_group_barriers_are_bounded_by_the_store";
    if let Ok(attack @ ("group_barriers_world" | "group_barriers_ranks")) = std::env::var(CHILD).as_deref() {
        return group_barriers_attack(attack);
    }
    for attack in ["group_barriers_world", "group_barriers_ranks"] {
        let figures = run_child(test, attack);
        let (growth, counted) = (figure(&figures, "peak_growth"), figure(&figures, "counted"));
        let (held, refused) = (figure(&figures, "held"), figure(&figures, "refused"));
        assert_eq!(held + refused, u64::from(GROUP_PER_NODE) * 64, "{attack}: every barrier is held or refused");
        assert!(held > 0, "{attack}: no group barrier was held");
        assert!(counted <= GROUP_KVS_BYTES_MAX as u64, "{attack}: the server holds {counted} bytes, over its bound");
        assert!(
            growth <= GROUP_KVS_BYTES_MAX as u64 + GROUP_SLACK,
            "{attack}: {held} group barriers grew the process by {} KiB (bound {} KiB and {} KiB beside)",
            growth >> 10,
            GROUP_KVS_BYTES_MAX >> 10,
            GROUP_SLACK >> 10
        );
        assert!(
            growth <= counted + GROUP_SLACK,
            "{attack}: {held} group barriers were counted as {counted} bytes and grew the process by {growth}"
        );
    }
}

/// The group of task `task`'s `j`th barrier in `attack`.
fn group_of(attack: &str, task: usize, j: usize) -> String {
    let tag = task * 64 + j;
    if attack == "group_barriers_world" {
        return format!("WORLD:{tag}");
    }
    // The first rank of 120 other nodes, which differ from barrier to barrier.
    let others = (0..120).map(|i| (1 + (tag * 120 + i) % (GROUP_NODES - 1)) * GROUP_PER_NODE as usize);
    let ranks: Vec<String> = std::iter::once(task).chain(others).map(|r| r.to_string()).collect();
    format!("{}:{tag}", ranks.join(","))
}

/// Everything queued for `task`, written.
fn drain(server: &mut Server, task: usize) -> Vec<u8> {
    let mut out = Vec::new();
    while !server.output(task).is_empty() {
        let piece = server.output(task);
        out.extend_from_slice(piece);
        let n = piece.len();
        server.consume(task, n);
    }
    out
}

fn group_barriers_attack(attack: &str) {
    let map = TaskMap::block(&vec![GROUP_PER_NODE; GROUP_NODES]);
    let hosts: Vec<String> = (0..GROUP_NODES).map(|n| format!("node{n:04}")).collect();
    let limits = Limits { kvs_bytes_max: GROUP_KVS_BYTES_MAX, ..Limits::default() };
    let local = map.clique(0);
    let tasks = local.len();
    let mut server = Server::new(JobInfo::new("kvs_bounds", map, local, hosts), limits).expect("a server");
    server.serve_groups(true);
    let mut host = GroupHost::default();
    // Made beforehand, so that only the shell's allocations are measured.
    let lines: Vec<Vec<String>> = (0..tasks)
        .map(|task| (0..64).map(|j| format!("cmd=barrier_in group={}\n", group_of(attack, task, j))).collect())
        .collect();
    let counted_before = server.kvs_bytes();
    let mut refused = 0u64;

    let base = reset_peak();
    for (task, lines) in lines.iter().enumerate() {
        let init = b"cmd=init pmi_version=1 pmi_subversion=2\n";
        server.receive(task, init);
        pump(&mut server, &mut host);
        assert_eq!(drain(&mut server, task), b"cmd=response_to_init rc=0 pmi_version=1 pmi_subversion=2\n");
        for line in lines {
            server.receive(task, line.as_bytes());
            pump(&mut server, &mut host);
            // Answered as they come, as a client's threads read them: what a task that pipelines requests
            // without reading is bounded by the shell's back-pressure (the first test).
            let answer = drain(&mut server, task);
            match &answer[..] {
                b"" => {}
                a if a.starts_with(b"cmd=barrier_out rc=2 tag=") => refused += 1,
                a => panic!("task {task}: {}", String::from_utf8_lossy(a)),
            }
        }
        assert!(!server.is_cut_off(task), "task {task} was cut off");
    }
    let held = tasks as u64 * 64 - refused;
    report("peak_growth", peak_growth(base));
    report("counted", server.kvs_bytes() - counted_before);
    report("held", held);
    report("refused", refused);
    report("exchanges", host.exchanges);
}

// ---------------------------------------------------------------------------------------------------------
// Unfinished spawns of one-byte items.

/// Tasks of the spawn attacks, on one shell.
const SPAWN_TASKS: usize = 64;
/// What the shell may hold beside the spawns: its tasks' answer buffers and partial lines, and the
/// allocator's rounding.
const SPAWN_SLACK: u64 = 1 << 20;
/// What decoding one whole PMI-2 frame takes for the moment it is read, once per shell (one frame at a
/// time): its pairs (at most [`rpmi::wire::pmi2::MAX_PAIRS`], 40 bytes each) and the request they make, at
/// most 16384 items before its charge is checked.
const SPAWN_DECODE: u64 = 4 << 20;

/// A host for the spawn attacks: no request ever reaches it whole; the tasks cut off are counted.
#[derive(Default)]
struct SpawnHost {
    cut_off: Vec<String>,
}

impl HostFds for SpawnHost {}

impl Host for SpawnHost {
    fn collective(&mut self, _contribution: &[u8]) -> Result<(), String> {
        panic!("no task of these tests enters a barrier");
    }

    fn abort(&mut self, rank: u32, _exit_code: i32, message: &str) {
        panic!("rank {rank} aborted: {message}");
    }

    fn job_error(&mut self, error: &JobError) {
        self.cut_off.push(error.to_string());
    }

    fn log(&mut self, _level: log::Level, _message: &str) {}
}

/// A shell serving [`SPAWN_TASKS`] tasks, the whole job, at the default bounds.
fn spawn_shell() -> Server {
    let local = (0..SPAWN_TASKS as u32).collect();
    let job = JobInfo::new("kvs_bounds", TaskMap::block(&[SPAWN_TASKS as u32]), local, vec!["node0".into()]);
    Server::new(job, Limits::default()).expect("a server")
}

/// Each of 64 tasks sends a spawn of one-byte arguments (`argN=x`), as much of it as the bound on a spawn
/// request takes, and never ends it; then each sends one more argument. The bound is stated in
/// docs/security.md as the request's bytes, [`ITEM_OVERHEAD`] more for each item and [`COMMAND_OVERHEAD`]
/// for each command: every task must be let hold exactly that much, be cut off by the next argument, and the
/// process must grow by at most 64 times the bound and a fixed slack. (Charged their bytes alone, 64 such
/// spawns of 26935 items each grew it by 106 MiB for 16 MiB of lines; charged as stated, 2479 items each
/// grow it by about 10 MiB.)
///
/// In the second attack each task speaks PMI-2 and sends a spawn frame as long as a frame may be, of 16360
/// one-byte arguments, all but its last byte: held as they came, bytes for bytes; then the last byte of each,
/// whose frame is decoded and refused (over the bound, decoded), one at a time.
#[test]
fn unfinished_spawns_of_one_byte_items_are_bounded_decoded() {
    let test = "unfinished_spawns_of_one_byte_items_are_bounded_decoded";
    match std::env::var(CHILD).as_deref() {
        Ok("spawn_lines") => return spawn_lines_attack(),
        Ok("spawn_frames") => return spawn_frames_attack(),
        _ => {}
    }
    let bound = Limits::default().spawn_bytes_max as u64;
    let tasks = SPAWN_TASKS as u64;
    let figures = run_child(test, "spawn_lines");
    let growth = figure(&figures, "peak_growth");
    assert_eq!(figure(&figures, "charged"), bound - figure(&figures, "short"), "the task was let send less");
    assert!(figure(&figures, "short") < figure(&figures, "next"), "another line would still have fitted");
    assert_eq!(figure(&figures, "cut_off"), tasks, "the line beyond the bound cut off every task");
    assert!(
        growth <= tasks * bound + SPAWN_SLACK,
        "{tasks} unfinished spawns of {} one-byte items grew the process by {} KiB (bound {tasks} x {} KiB and {} \
         KiB)",
        figure(&figures, "items"),
        growth >> 10,
        bound >> 10,
        SPAWN_SLACK >> 10
    );

    let figures = run_child(test, "spawn_frames");
    let frame = bound + rpmi::wire::pmi2::HEADER_LEN as u64;
    let (held, decoded) = (figure(&figures, "peak_growth_held"), figure(&figures, "peak_growth_decoded"));
    assert_eq!(figure(&figures, "cut_off"), tasks, "every frame whole was refused");
    assert!(
        held <= tasks * frame + SPAWN_SLACK,
        "{tasks} unfinished frames of {frame} bytes grew the process by {} KiB",
        held >> 10
    );
    assert!(
        decoded <= tasks * frame + SPAWN_SLACK + SPAWN_DECODE,
        "{tasks} frames of {frame} bytes, decoded one at a time, grew the process by {} KiB",
        decoded >> 10
    );
}

fn spawn_lines_attack() {
    let bound = Limits::default().spawn_bytes_max;
    // Blocks of 4096 one-byte arguments, one after another, as the bound allows (it ends within the first).
    let lines = (1..=256).flat_map(|block| {
        let head = ["mcmd=spawn", "nprocs=1", "execname=a", "totspawns=256"].map(String::from);
        let count = [format!("spawnssofar={block}"), "argcnt=4096".into()];
        let args = (1..=4096).map(|i| format!("arg{i}=x"));
        head.into_iter().chain(count).chain(args).chain(["endcmd".into()])
    });
    // What docs/security.md says each line is charged.
    let charge = |line: &str| match line {
        "mcmd=spawn" => line.len() + 1 + COMMAND_OVERHEAD,
        _ if line.starts_with("arg") && !line.starts_with("argcnt=") => line.len() + 1 + ITEM_OVERHEAD,
        _ if line.starts_with("execname=") => line.len() + 1 + ITEM_OVERHEAD,
        _ => line.len() + 1,
    };
    let (mut input, mut charged, mut items, mut next) = (String::new(), 0, 0, String::new());
    for line in lines {
        if charged + charge(&line) > bound {
            next = line;
            break;
        }
        charged += charge(&line);
        items += usize::from(line.starts_with("arg") && !line.starts_with("argcnt="));
        input.push_str(&line);
        input.push('\n');
    }
    let mut server = spawn_shell();
    let mut host = SpawnHost::default();

    let base = reset_peak();
    for task in 0..SPAWN_TASKS {
        server.receive(task, input.as_bytes());
        pump(&mut server, &mut host);
    }
    let growth = peak_growth(base);
    assert!(host.cut_off.is_empty(), "{:?}", host.cut_off);
    assert!((0..SPAWN_TASKS).all(|t| server.output(t).is_empty() && !server.is_cut_off(t)));
    for task in 0..SPAWN_TASKS {
        server.receive(task, format!("{next}\n").as_bytes());
        pump(&mut server, &mut host);
    }
    assert!(host.cut_off.iter().all(|e| e.contains("over the limit of 262144 bytes")), "{:?}", host.cut_off);
    report("peak_growth", growth);
    report("items", items);
    report("charged", charged);
    report("short", bound - charged);
    report("next", charge(&next));
    report("cut_off", host.cut_off.len());
}

fn spawn_frames_attack() {
    use rpmi::wire::pmi2::HEADER_LEN;
    let bound = Limits::default().spawn_bytes_max;
    let mut body = "cmd=spawn;ncmds=4;preputcount=0;".to_string();
    for _ in 0..4 {
        body.push_str("subcmd=a;maxprocs=1;argc=4090;");
        body.extend((0..4090).map(|i| format!("argv{i}=x;")));
    }
    // Made as long as a frame may be with a value nothing reads.
    let pad = bound - body.len() - "pad=;".len();
    body.push_str(&format!("pad={};", "p".repeat(pad)));
    let frame = format!("{:6}{body}", body.len());
    let (most, last) = frame.as_bytes().split_at(frame.len() - 1);
    let mut server = spawn_shell();
    let mut host = SpawnHost::default();
    for task in 0..SPAWN_TASKS {
        server.receive(task, b"cmd=init pmi_version=2 pmi_subversion=0\n");
        pump(&mut server, &mut host);
        drain(&mut server, task);
    }

    let base = reset_peak();
    for task in 0..SPAWN_TASKS {
        // As a driver reads it: 64 KiB at a time.
        for piece in most.chunks(64 << 10) {
            server.receive(task, piece);
            pump(&mut server, &mut host);
        }
    }
    report("peak_growth_held", peak_growth(base));
    assert!(host.cut_off.is_empty(), "{:?}", host.cut_off);
    for task in 0..SPAWN_TASKS {
        server.receive(task, last);
        pump(&mut server, &mut host);
    }
    report("peak_growth_decoded", peak_growth(base));
    assert!(host.cut_off.iter().all(|e| e.contains("over the limit of 262144 bytes")), "{:?}", host.cut_off);
    report("cut_off", host.cut_off.len());
    report("frame", frame.len() - HEADER_LEN);
}

//! Micro-benchmark of the PMI-1 engine, in process: one `Server` serving 1024 local ranks (one node).
//!
//! Every rank sends init, get_maxes, get_my_kvsname, 8 puts of 800-byte values and barrier_in (the
//! collective is completed with the shell's own contribution, as a single-node host does); then 1,000,000
//! gets in total, spread over the ranks, each for a key of another rank; then finalize. Request lines are
//! built before the clock starts. Each request is handed over the way a host does it: one `receive` call
//! per request, then every response is drained (`next_ready` / `output` / `consume`).
//!
//! Prints, per phase and overall, the wall time, requests per second and allocations (alloc + realloc
//! calls) per request: the median and min/max of 5 repetitions. It also prints the thread's CPU time,
//! which on a busy machine shows the engine's cost without the time spent waiting for a core.
//!
//! Run: `cargo bench --bench engine` (optionally `taskset -c 1 cargo bench --bench engine`).
//! `RPMI_BENCH_GETS=N` changes the number of gets (e.g. fewer for callgrind); `RPMI_BENCH_REPS=N` the
//! number of repetitions; `RPMI_BENCH_CHECK=0` skips checking the responses of the first, untimed run.

#![deny(unsafe_op_in_unsafe_fn)]

use rpmi::server::{Effect, JobInfo, Limits, Server, TaskId, TaskMap};
use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// Counts allocation calls (alloc, alloc_zeroed through alloc, and realloc).
struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call goes to the system allocator unchanged; only a counter is added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        // SAFETY: the caller's layout, as GlobalAlloc::alloc requires.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's block, which System allocated (every call goes to it), with its layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Relaxed);
        // SAFETY: the caller's block, which System allocated, with its layout and a valid new size.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const RANKS: usize = 1024;
const PUTS_PER_RANK: usize = 8;
const VALUE_LEN: usize = 800;
const DEFAULT_GETS: usize = 1_000_000;
const KVSNAME: &str = "kvs_bench_1";

/// A single-node host: the collective's result is this shell's own contribution, taken from its effect.
/// Every other effect is a failure of the benchmark (the first line of each task is expected).
fn carry_out(server: &mut Server, contribution: &mut Option<Vec<u8>>) {
    while let Some(effect) = server.next_effect() {
        match effect {
            Effect::Collective(part) => {
                assert!(contribution.replace(part).is_none(), "two collectives at once");
            }
            Effect::TaskStarted(_) => {}
            other => panic!("{other:?}"),
        }
    }
}

/// Request lines of one phase, laid out back to back: `(task, end offset)` per request.
struct Phase {
    name: &'static str,
    bytes: Vec<u8>,
    requests: Vec<(TaskId, usize)>,
    /// Complete the collective after the last request (the barrier phase).
    collective: bool,
}

impl Phase {
    fn new(name: &'static str) -> Self {
        Phase { name, bytes: Vec::new(), requests: Vec::new(), collective: false }
    }

    fn push(&mut self, task: TaskId, line: &[u8]) {
        self.bytes.extend_from_slice(line);
        self.requests.push((task, self.bytes.len()));
    }
}

fn key(rank: usize, i: usize) -> String {
    format!("P{rank}-businesscard-{i}")
}

fn build(gets: usize) -> Vec<Phase> {
    let mut init = Phase::new("init");
    let mut put = Phase::new("put");
    let mut barrier = Phase::new("barrier");
    let mut get = Phase::new("get");
    let mut fin = Phase::new("finalize");
    barrier.collective = true;
    for r in 0..RANKS {
        init.push(r, b"cmd=init pmi_version=1 pmi_subversion=1\n");
        init.push(r, b"cmd=get_maxes\n");
        init.push(r, b"cmd=get_my_kvsname\n");
    }
    // Ranks take turns, as concurrent tasks would.
    for i in 0..PUTS_PER_RANK {
        for r in 0..RANKS {
            let fill = (b'A' + ((r + i) % 26) as u8) as char;
            let value: String = std::iter::repeat_n(fill, VALUE_LEN).collect();
            put.push(r, format!("cmd=put kvsname={KVSNAME} key={} value={value}\n", key(r, i)).as_bytes());
        }
    }
    for r in 0..RANKS {
        barrier.push(r, b"cmd=barrier_in\n");
    }
    for n in 0..gets {
        let r = n % RANKS;
        // Another rank: an offset of 1..RANKS-1, scattered.
        let other = (r + 1 + (n / RANKS * 7919 + n * 31) % (RANKS - 1)) % RANKS;
        get.push(r, format!("cmd=get kvsname={KVSNAME} key={}\n", key(other, n % PUTS_PER_RANK)).as_bytes());
    }
    for r in 0..RANKS {
        fin.push(r, b"cmd=finalize\n");
    }
    vec![init, put, barrier, get, fin]
}

fn new_shell() -> Server {
    let ranks: Vec<u32> = (0..RANKS as u32).collect();
    let job = JobInfo::new(KVSNAME, TaskMap::block(&[RANKS as u32]), ranks, vec!["node0".to_string()]);
    Server::new(job, Limits::default()).expect("a valid job")
}

/// Writes every queued response, as a host would; returns the bytes written. With `check`, every response
/// must be a successful one.
#[inline]
fn drain(server: &mut Server, check: bool) -> usize {
    let mut written = 0;
    while let Some(t) = server.next_ready() {
        let out = server.output(t);
        let n = out.len();
        if check {
            for line in out.split_inclusive(|&b| b == b'\n') {
                let rc = line.iter().position(|&b| b == b' ').map(|sp| &line[sp + 1..]);
                let ok = line.starts_with(b"cmd=") && rc.is_some_and(|rc| rc.starts_with(b"rc=0 ") || rc == b"rc=0\n");
                assert!(ok, "task {t}: {}", String::from_utf8_lossy(line));
            }
        }
        black_box(out);
        written += n;
        server.consume(t, n);
    }
    written
}

/// CPU time of this thread: on a loaded machine, wall time also counts time the thread waited for a core.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid clock id and a valid pointer to a timespec.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0);
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

struct Measured {
    time: Duration,
    cpu: Duration,
    allocs: u64,
    written: usize,
}

/// One run of every phase on a fresh shell.
fn run(phases: &[Phase], check: bool) -> Vec<Measured> {
    let mut server = new_shell();
    let mut contribution = None;
    let mut out = Vec::new();
    for phase in phases {
        let allocs = ALLOCS.load(Relaxed);
        let cpu = thread_cpu();
        let start = Instant::now();
        let mut written = 0;
        let mut from = 0;
        for &(task, end) in &phase.requests {
            server.receive(task, &phase.bytes[from..end]);
            carry_out(&mut server, &mut contribution);
            from = end;
            written += drain(&mut server, check);
        }
        if phase.collective {
            let own = contribution.take().expect("the barrier started the collective");
            server.collective_complete(Ok(&[&own]));
            carry_out(&mut server, &mut contribution);
            written += drain(&mut server, check);
        }
        let time = start.elapsed();
        let cpu = thread_cpu() - cpu;
        out.push(Measured { time, cpu, allocs: ALLOCS.load(Relaxed) - allocs, written });
    }
    black_box(&server);
    out
}

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn median_min_max<T: Copy + PartialOrd>(v: &[T]) -> (T, T, T) {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (s[s.len() / 2], s[0], s[s.len() - 1])
}

fn main() {
    // `cargo bench` passes `--bench`. Without it (`cargo test --all-targets` runs this too, unoptimized)
    // a small smoke run is enough.
    let full = std::env::args().any(|a| a == "--bench");
    let gets = env("RPMI_BENCH_GETS", if full { DEFAULT_GETS } else { 10_000 });
    let reps = env("RPMI_BENCH_REPS", if full { 5 } else { 1 }).max(1);
    let phases = build(gets);
    let total_requests: usize = phases.iter().map(|p| p.requests.len()).sum();
    let input_bytes: usize = phases.iter().map(|p| p.bytes.len()).sum();
    println!(
        "rpmi engine benchmark: {RANKS} local ranks on one node, {PUTS_PER_RANK} puts of {VALUE_LEN} bytes each, \
         {gets} gets; {total_requests} requests ({:.1} MB of request lines); {reps} repetitions",
        input_bytes as f64 / 1e6
    );

    // A checked run first: every response must succeed (not timed), and it warms up the allocator.
    // RPMI_BENCH_CHECK=0 leaves the checks out (for profiling the timed runs alone).
    let checked = run(&phases, env("RPMI_BENCH_CHECK", 1) != 0);
    let expected: Vec<usize> = checked.iter().map(|m| m.written).collect();

    let mut runs = Vec::new();
    for _ in 0..reps {
        let r = run(&phases, false);
        let written: Vec<usize> = r.iter().map(|m| m.written).collect();
        assert_eq!(written, expected, "a repetition wrote different output");
        runs.push(r);
    }

    println!();
    println!(
        "{:<9} {:>9} {:>9} {:>21} {:>8} {:>17} {:>9} {:>8} {:>10}",
        "phase", "requests", "wall ms", "(min .. max)", "Mreq/s", "(min .. max)", "cpu ms", "Mreq/s", "allocs/req"
    );
    // (phase, requests, wall seconds per run, cpu seconds per run, allocations per run)
    type Row<'a> = (&'a str, usize, Vec<f64>, Vec<f64>, Vec<u64>);
    let mut rows: Vec<Row> = Vec::new();
    for (i, p) in phases.iter().enumerate() {
        let times = runs.iter().map(|r| r[i].time.as_secs_f64()).collect();
        let cpus = runs.iter().map(|r| r[i].cpu.as_secs_f64()).collect();
        let allocs = runs.iter().map(|r| r[i].allocs).collect();
        rows.push((p.name, p.requests.len(), times, cpus, allocs));
    }
    let sum = |f: fn(&Measured) -> f64| runs.iter().map(|r| r.iter().map(f).sum()).collect::<Vec<f64>>();
    let total_times = sum(|m| m.time.as_secs_f64());
    let total_cpus = sum(|m| m.cpu.as_secs_f64());
    let total_allocs = runs.iter().map(|r| r.iter().map(|m| m.allocs).sum()).collect();
    rows.push(("total", total_requests, total_times, total_cpus, total_allocs));
    for (name, n, times, cpus, allocs) in rows {
        let (t, tmin, tmax) = median_min_max(&times);
        let (c, _, _) = median_min_max(&cpus);
        let (a, _, _) = median_min_max(&allocs);
        let rate = |t: f64| n as f64 / t / 1e6;
        println!(
            "{name:<9} {n:>9} {:>9.3} {:>21} {:>8.3} {:>17} {:>9.3} {:>8.3} {:>10.3}",
            t * 1e3,
            format!("({:.3} .. {:.3})", tmin * 1e3, tmax * 1e3),
            rate(t),
            format!("({:.3} .. {:.3})", rate(tmax), rate(tmin)),
            c * 1e3,
            rate(c),
            a as f64 / n as f64
        );
    }
    let output: usize = expected.iter().sum();
    println!();
    println!(
        "response bytes per run: {output}. wall: Instant, receive + drain, one request per receive call; \
         Mreq/s = requests / time (median, and over the slowest .. fastest repetition); \
         cpu: this thread's CPU time (median), the same work without time spent waiting for a core"
    );
}

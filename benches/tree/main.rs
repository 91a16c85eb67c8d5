//! The collective as a k-ary tree against the star, per PMI fence (barrier), at MPICH's start-up: every
//! rank puts its business card, about 300 bytes, and there are 32 ranks per node, so every node's part is
//! 9,600 bytes and the exchange S is 9,600·N bytes. For the star (every node a child of the root, as
//! srun and rpmi-run's coordinator serve today) and widths k = 2, 8, 32, and N = 16 to 16,384 nodes, it
//! runs `rpmi::collective::sim`: the real machines, in memory, one fence, and counts what they send and
//! hold. It then predicts each fence's time with a store-and-forward model, on this machine's loopback
//! (latency and bandwidth measured here, by a TCP ping-pong and a bulk transfer) and on a 100 Gb/s network
//! with 2 µs latency.
//!
//! **The model.** Each hop costs latency L plus bytes/B; a participant's link carries one transfer at a
//! time each way, so what it sends to its children, and what its children send it, is serialized. With
//! C(v) the bytes of node v's CONTRIB (its subtree's parts) and A those of the ALL:
//!
//! ```text
//! up:    g(v) = L + e(v), where e(v) is when v's link has taken its children's CONTRIBs, back to back,
//!               each from when that child has gathered: e = 0; for c in children by g(c): e = max(e, g(c)) + C(c)/B
//!               (g = 0 for a leaf; the root has every part at g(root))
//! down:  a(j-th child of v, from 1) = a(v) + L + j·A/B, with a(root) = g(root)
//! fence: the largest a(v) over the nodes
//! ```
//!
//! For the star that is 2L + N·C/B + N·A/B: the root sends N·S bytes. For a tree the root sends k·S, and
//! every level's sends go in parallel: about height·(L + k·A/B) down.
//!
//! Then it runs one fence on 100,000 nodes over the hosts' tree (width 4, its top at node 0) for two start-up
//! fences, MPICH 5's node roots' cards and every rank's card (10 ranks a node, 300 MB), and says how long the
//! simulation took, the process's peak memory (the machines share each frame they pass on) and the model's
//! fence at 100 Gb/s.
//!
//! Last, Bruck's allgather between the nodes (`Allgather::Bruck`, which the hosts run with
//! `SLURM_RPMI_ALLGATHER=bruck` / `--allgather bruck`), run by the same machines at up to 4,096 nodes for the
//! node roots' cards: what each node sends (every node about S, the root no more than another) and its rounds;
//! and the fence modelled from them (⌈log₂ N⌉·L + the most a node sends / B), which benches/fence_model runs up
//! to 10^5 nodes. (Each node builds its own rounds from what it holds, N frames of up to S each: more than one
//! process can copy at 10^5 nodes, where the tree's shared frames can be simulated whole.)
//!
//! Run: `cargo bench --bench tree [-- --out DIR]` (default `benches/results`): writes `tree.md` there, and
//! `tree.png` if `gnuplot` is on the PATH.

use rpmi::collective::sim::{self, Config};
use rpmi::collective::{frame, Allgather, Peer, Tree, DEFAULT_WIDTH};
use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

const RANKS_PER_NODE: usize = 32;
const CARD: usize = 300;
const PART: usize = RANKS_PER_NODE * CARD;
const SIZES: [u32; 6] = [16, 64, 256, 1024, 4096, 16384];
/// Tree widths; `None` is the star.
const WIDTHS: [Option<u32>; 4] = [None, Some(2), Some(8), Some(32)];
/// The largest machines' node count, and its two start-up fences: MPICH 5's (PMI 1.2: the node roots' cards
/// only) and every rank's card, 10 ranks a node; over the hosts' tree (width 4, its top at node 0).
const LARGE_NODES: u32 = 100_000;
const LARGE_FENCES: [(&str, usize); 2] =
    [("the node roots' cards only (MPICH 5)", CARD), ("every rank's card, 10 ranks a node", 10 * CARD)];
/// The node counts Bruck's allgather is simulated at, each node bringing one card (MPICH 5's fence).
const BRUCK_SIZES: [u32; 3] = [256, 1024, 4096];
/// The network the model is also run for: 100 Gb/s, 2 µs.
const FAST: Network = Network { name: "100 Gb/s, 2 µs", latency: 2e-6, bandwidth: 100e9 / 8.0 };

#[derive(Clone, Copy)]
struct Network {
    name: &'static str,
    /// Seconds.
    latency: f64,
    /// Bytes per second.
    bandwidth: f64,
}

/// One simulated fence.
struct Row {
    width: Option<u32>,
    nodes: u32,
    /// The ALL as sent, length prefix included.
    all: u64,
    root_sent: u64,
    /// The busiest interior node's bytes sent, and the node (none in the star).
    interior_sent: Option<(u64, u32)>,
    height: u32,
    peak: (usize, Peer),
    loopback: f64,
    fast: f64,
}

/// One simulated fence on [`LARGE_NODES`] nodes.
struct Large {
    what: &'static str,
    /// The ALL, length prefix included.
    all: u64,
    simulated: Duration,
    /// This process's peak resident memory during the simulation.
    resident: u64,
    /// The most any machine held.
    peak: usize,
    top_sent: u64,
    /// The most any other node sent.
    other_sent: u64,
    fast: f64,
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tree benchmark: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    let out = out_dir()?;
    let loopback = calibrate().map_err(|e| format!("cannot measure the loopback: {e}"))?;
    eprintln!("loopback: latency {}, bandwidth {}/s", time(loopback.latency), bytes(loopback.bandwidth as u64));
    let mut rows = Vec::new();
    for width in WIDTHS {
        for nodes in SIZES {
            let started = Instant::now();
            rows.push(fence(width, nodes, loopback)?);
            eprintln!("{}, N={nodes}: simulated in {:.1} s", tree_name(width), started.elapsed().as_secs_f64());
        }
    }
    let mut large = Vec::new();
    for (what, part) in LARGE_FENCES {
        large.push(large_fence(what, part)?);
        eprintln!(
            "{what}, N={LARGE_NODES}: simulated in {:.1} s",
            large.last().map_or(0.0, |l| l.simulated.as_secs_f64())
        );
    }
    let mut bruck = Vec::new();
    for nodes in BRUCK_SIZES {
        bruck.push(bruck_fence(nodes)?);
        eprintln!("Bruck's allgather, N={nodes}: simulated");
    }
    let mut report = markdown(&rows, loopback);
    report += &large_markdown(&large);
    report += &bruck_markdown(&bruck);
    print!("{report}");
    std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    let md = out.join("tree.md");
    std::fs::write(&md, &report).map_err(|e| format!("{}: {e}", md.display()))?;
    plot(&rows, &out.join("tree.png"))
}

/// `--out DIR`, or `benches/results`. (`cargo bench` adds `--bench`.)
fn out_dir() -> Result<PathBuf, String> {
    let mut out = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/results");
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--out" => out = args.next().ok_or("--out needs a directory")?.into(),
            "--bench" => {}
            other => return Err(format!("unknown argument {other}; usage: tree [--out DIR]")),
        }
    }
    Ok(out)
}

/// Simulates one fence of `nodes` nodes and predicts its time.
fn fence(width: Option<u32>, nodes: u32, loopback: Network) -> Result<Row, String> {
    let k = width.unwrap_or(nodes);
    let config =
        Config { epochs: 1, part: PART, finish: false, verify_every: (nodes / 16).max(1), ..Config::new(nodes, k) };
    let run = sim::run(&config);
    let label = format!("{}, N={nodes}", tree_name(width));
    if !run.problems.is_empty() || !run.job_errors.is_empty() || run.done.iter().any(|&d| d != 1) {
        return Err(format!("{label}: the fence did not complete: {:?} {:?}", run.problems, run.job_errors));
    }
    let tree = Tree::new(nodes, k).map_err(|e| e.to_string())?;
    let n = nodes as usize;
    let interior_sent =
        (0..nodes).filter(|&i| !tree.children(Peer::Node(i)).is_empty()).map(|i| (run.sent[i as usize], i)).max();
    let peak = (0..n)
        .map(|i| (run.peak[i], Peer::Node(i as u32)))
        .chain(std::iter::once((run.peak[n], Peer::Root)))
        .max_by_key(|&(bytes, _)| bytes)
        .unwrap_or((0, Peer::Root));
    Ok(Row {
        width,
        nodes,
        all: 4 + frame::parts_len(n, n * PART) as u64,
        root_sent: run.sent[n],
        interior_sent,
        height: tree.height(),
        peak,
        loopback: model(&tree, loopback, PART),
        fast: model(&tree, FAST, PART),
    })
}

/// Simulates one fence of [`LARGE_NODES`] nodes, each bringing `part` bytes, over the hosts' tree. The machines
/// share each frame they pass on (a node hands its children the bytes it received), so the simulation holds
/// one copy of the result, not one a node.
fn large_fence(what: &'static str, part: usize) -> Result<Large, String> {
    let nodes = LARGE_NODES;
    let config = Config {
        epochs: 1,
        part,
        finish: false,
        verify_every: nodes / 8,
        top_at_first_node: true,
        ..Config::new(nodes, DEFAULT_WIDTH)
    };
    // Resets the peak resident size to the current one.
    std::fs::write("/proc/self/clear_refs", "5").map_err(|e| format!("/proc/self/clear_refs: {e}"))?;
    let started = Instant::now();
    let run = sim::run(&config);
    let simulated = started.elapsed();
    if !run.problems.is_empty() || !run.job_errors.is_empty() || run.done.iter().any(|&d| d != 1) {
        return Err(format!("{what}, N={nodes}: the fence did not complete: {:?} {:?}", run.problems, run.job_errors));
    }
    let status = std::fs::read_to_string("/proc/self/status").map_err(|e| e.to_string())?;
    let hwm = status.lines().find_map(|l| l.strip_prefix("VmHWM:")).unwrap_or_default();
    let resident = hwm.trim().trim_end_matches("kB").trim().parse::<u64>().unwrap_or(0) << 10;
    let tree = Tree::new(nodes, DEFAULT_WIDTH).map_err(|e| e.to_string())?.top_at_first_node();
    let n = nodes as usize;
    Ok(Large {
        what,
        all: 4 + frame::parts_len(n, n * part) as u64,
        simulated,
        resident,
        peak: run.peak.iter().copied().max().unwrap_or(0),
        top_sent: run.sent[0],
        other_sent: run.sent[1..n].iter().copied().max().unwrap_or(0),
        fast: model(&tree, FAST, part),
    })
}

/// One fence by Bruck's allgather, simulated.
struct Bruck {
    nodes: u32,
    /// The result (an ALL's size, length prefix included), the least and most a node sent, node 0's.
    all: u64,
    least_sent: u64,
    most_sent: u64,
    node0_sent: u64,
    peak: usize,
}

/// One fence on `nodes` nodes by Bruck's allgather, every node bringing one card.
fn bruck_fence(nodes: u32) -> Result<Bruck, String> {
    let config = Config {
        epochs: 1,
        part: CARD,
        finish: false,
        verify_every: (nodes / 16).max(1),
        top_at_first_node: true,
        allgather: Allgather::Bruck,
        ..Config::new(nodes, DEFAULT_WIDTH)
    };
    let run = sim::run(&config);
    if !run.problems.is_empty() || !run.job_errors.is_empty() || run.done.iter().any(|&d| d != 1) {
        return Err(format!("Bruck, N={nodes}: the fence did not complete: {:?} {:?}", run.problems, run.job_errors));
    }
    let n = nodes as usize;
    let sent = &run.sent[..n];
    Ok(Bruck {
        nodes,
        all: 4 + frame::parts_len(n, n * CARD) as u64,
        least_sent: sent.iter().copied().min().unwrap_or(0),
        most_sent: sent.iter().copied().max().unwrap_or(0),
        node0_sent: sent[0],
        peak: run.peak[..n].iter().copied().max().unwrap_or(0),
    })
}

fn bruck_markdown(bruck: &[Bruck]) -> String {
    let mut md = format!(
        "\n## Bruck's allgather, the real machines\n\nOne fence by Bruck's allgather between the nodes \
         (`Allgather::Bruck`), every node bringing one card of {CARD} bytes (MPICH 5's fence), run by the same \
         machines in memory (the tree, width {DEFAULT_WIDTH} with its top at node 0, only for goodbyes and \
         failures). What each node sent, length prefixes included, against S (the result); the fence at \
         100 Gb/s from the rounds and the most a node sends, ⌈log₂ N⌉·L + sent/B, as \
         [fence_model.md](fence_model.md) models it.\n\n         | nodes | rounds | S (the ALL) | least a node sends | most a node sends | node 0 sends | most one machine \
         held | fence, 100 Gb/s | × S/B |\n|---|---|---|---|---|---|---|---|---|\n"
    );
    for b in bruck {
        let rounds = b.nodes.next_power_of_two().trailing_zeros();
        let fast = f64::from(rounds) * FAST.latency + b.most_sent as f64 / FAST.bandwidth;
        let _ = writeln!(
            md,
            "| {} | {rounds} | {} | {} | {} | {} | {} | {} | {:.2} |",
            b.nodes,
            bytes(b.all),
            bytes(b.least_sent),
            bytes(b.most_sent),
            bytes(b.node0_sent),
            bytes(b.peak as u64),
            time(fast),
            fast / (b.all as f64 / FAST.bandwidth)
        );
    }
    md
}

/// The fence's time on `net` under the store-and-forward model of the module's documentation, every node
/// bringing `part` bytes; with the tree's top at node 0, node 0 sends nothing up and the ALL starts from it.
fn model(tree: &Tree, net: Network, part: usize) -> f64 {
    let n = tree.nodes() as usize;
    let send = |bytes: usize| (bytes + 4) as f64 / net.bandwidth;
    let contrib = |v: u32| {
        let size = tree.subtree(v).size() as usize;
        send(frame::parts_len(size, size * part))
    };
    // Up: children are numbered above their parent, so every child is done before its parent.
    let mut gathered = vec![0.0; n];
    let gather = |children: std::ops::Range<u32>, gathered: &[f64]| {
        let mut ready: Vec<(f64, u32)> = children.map(|c| (gathered[c as usize], c)).collect();
        if ready.is_empty() {
            return 0.0;
        }
        ready.sort_by(|a, b| a.0.total_cmp(&b.0));
        let end = ready.iter().fold(0.0f64, |e, &(g, c)| e.max(g) + contrib(c));
        net.latency + end
    };
    for v in (0..tree.nodes()).rev() {
        gathered[v as usize] = gather(tree.children(Peer::Node(v)), &gathered);
    }
    let top_at_root = tree.top() == Peer::Root;
    let start = if top_at_root { gather(tree.children(Peer::Root), &gathered) } else { gathered[0] };
    // Down: every parent is numbered below its children.
    let all = send(frame::parts_len(n, n * part));
    let mut arrived = vec![0.0; n];
    let mut last = 0.0f64;
    for v in 0..tree.nodes() {
        let (from, siblings) = match tree.parent(v) {
            Peer::Root if !top_at_root => {
                // Node 0, the top, has the result when its gathering ends.
                arrived[0] = start;
                continue;
            }
            Peer::Root => (start, tree.children(Peer::Root)),
            p @ Peer::Node(u) => (arrived[u as usize], tree.children(p)),
        };
        let place = (v - siblings.start + 1) as f64;
        arrived[v as usize] = from + net.latency + place * all;
        last = last.max(arrived[v as usize]);
    }
    last
}

/// Measures the loopback's latency (half a round trip of one byte) and bandwidth (a bulk transfer).
fn calibrate() -> std::io::Result<Network> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let server = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut echo, _) = listener.accept()?;
        echo.set_nodelay(true)?;
        let mut b = [0u8; 1];
        while echo.read(&mut b)? == 1 {
            echo.write_all(&b)?;
        }
        let (mut sink, _) = listener.accept()?;
        let mut buf = vec![0u8; 1 << 20];
        while sink.read(&mut buf)? > 0 {}
        Ok(())
    });
    let mut ping = TcpStream::connect(addr)?;
    ping.set_nodelay(true)?;
    let mut rtts = Vec::with_capacity(4000);
    let mut b = [7u8; 1];
    for i in 0..4200 {
        let t = Instant::now();
        ping.write_all(&b)?;
        ping.read_exact(&mut b)?;
        if i >= 200 {
            rtts.push(t.elapsed());
        }
    }
    drop(ping);
    rtts.sort();
    let latency = rtts[rtts.len() / 2].as_secs_f64() / 2.0;
    let mut bulk = TcpStream::connect(addr)?;
    let chunk = vec![1u8; 1 << 20];
    let total = 1u64 << 30;
    let t = Instant::now();
    for _ in 0..total >> 20 {
        bulk.write_all(&chunk)?;
    }
    bulk.shutdown(std::net::Shutdown::Write)?;
    server.join().map_err(|_| std::io::Error::other("the loopback server failed"))??;
    let bandwidth = total as f64 / t.elapsed().max(Duration::from_micros(1)).as_secs_f64();
    Ok(Network { name: "this machine's loopback", latency, bandwidth })
}

fn tree_name(width: Option<u32>) -> String {
    match width {
        None => "star".into(),
        Some(k) => format!("k = {k}"),
    }
}

/// Decimal units, as a network's are counted.
fn bytes(b: u64) -> String {
    let b = b as f64;
    match b {
        _ if b >= 1e12 => format!("{:.1} TB", b / 1e12),
        _ if b >= 1e9 => format!("{:.1} GB", b / 1e9),
        _ if b >= 1e6 => format!("{:.1} MB", b / 1e6),
        _ if b >= 1e3 => format!("{:.1} KB", b / 1e3),
        _ => format!("{b} B"),
    }
}

fn time(s: f64) -> String {
    match s {
        _ if s >= 1.0 => format!("{s:.2} s"),
        _ if s >= 1e-3 => format!("{:.2} ms", s * 1e3),
        _ => format!("{:.1} µs", s * 1e6),
    }
}

/// The section on [`LARGE_NODES`] nodes.
fn large_markdown(large: &[Large]) -> String {
    let mut md = format!(
        "\n## The real machines on {LARGE_NODES} nodes\n\nOne fence over the hosts' tree (width {DEFAULT_WIDTH}, its \
         top at node 0), every node bringing the part below, run by the same machines in memory. A node passes \
         on the bytes it received, shared, not copied, so the simulation holds one copy of each frame in flight \
         and of the result: its peak resident size is a few times the result's (the result and the frames still \
         going up), not N copies. S/B: the time the result's bytes take to reach one node at 100 Gb/s; the fence's time from the \
         store-and-forward model above. Faster candidates (a pipelined tree, Bruck's allgather between the node \
         servers) are modelled in [fence_model.md](fence_model.md); the hosts run Bruck's (below), not the \
         pipelined tree.\n\n\
         | fence | S (the ALL) | simulated in | peak resident | most one machine held | node 0 sends | most \
         another node sends | fence, 100 Gb/s | × S/B |\n|---|---|---|---|---|---|---|---|---|\n"
    );
    for l in large {
        let s_over_b = l.all as f64 / FAST.bandwidth;
        let _ = writeln!(
            md,
            "| {} | {} | {:.1} s | {} | {} | {} | {} | {} | {:.1} |",
            l.what,
            bytes(l.all),
            l.simulated.as_secs_f64(),
            bytes(l.resident),
            bytes(l.peak as u64),
            bytes(l.top_sent),
            bytes(l.other_sent),
            time(l.fast),
            l.fast / s_over_b
        );
    }
    md
}

fn markdown(rows: &[Row], loopback: Network) -> String {
    let mut md = String::from("# The collective: a k-ary tree against the star, per PMI fence\n\n");
    let _ = writeln!(
        md,
        "MPICH's start-up fence: {RANKS_PER_NODE} ranks per node, {CARD} bytes per rank, so each node's part is \
         {PART} bytes and S, the ALL every node gets, is {PART}·N bytes (and 8 bytes per node of framing). Counted by running the \
         collective's machines (`rpmi::collective::sim`) for one fence; `cargo bench --bench tree`.\n"
    );
    let _ = writeln!(
        md,
        "Model (store and forward): each hop costs L + bytes/B; a participant's link carries one transfer at a \
         time each way, so its sends to its children, and its children's CONTRIBs to it, are serialized. Up: a \
         node has gathered at g(v) = L + e(v), where e = 0 and, for its children c by g(c), e = max(e, g(c)) + \
         C(c)/B (C(c): the bytes of c's CONTRIB; g = 0 for a leaf). Down: the j-th child of v (from 1) has the \
         ALL (A bytes) at a(v) + L + j·A/B, with a(root) = g(root). The fence takes the largest a(v).\n"
    );
    let _ = writeln!(
        md,
        "Networks: this machine's loopback, measured here (L = {}, half a 1-byte TCP round trip; B = {}/s, a 1 GiB \
         transfer; {} CPUs), and {} (L = 2 µs, B = 12.5 GB/s).\n",
        time(loopback.latency),
        bytes(loopback.bandwidth as u64),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        FAST.name
    );
    md.push_str(
        "| tree | N | S (the ALL) | root sends | busiest interior node sends | hops each way (per fence) | \
         peak held (busiest) | fence, loopback | fence, 100 Gb/s |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let interior = match r.interior_sent {
            Some((b, node)) => format!("{} (node {node})", bytes(b)),
            None => "– (none)".into(),
        };
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} ({}) | {} ({}) | {} | {} |",
            tree_name(r.width),
            r.nodes,
            bytes(r.all),
            bytes(r.root_sent),
            interior,
            r.height,
            2 * r.height,
            bytes(r.peak.0 as u64),
            r.peak.1,
            time(r.loopback),
            time(r.fast)
        );
    }
    md.push_str("\n## Targets\n\n| target | figure | |\n|---|---|---|\n");
    let trees = || rows.iter().filter(|r| r.width.is_some());
    let worst = trees()
        .map(|r| (r.root_sent as f64 / (r.width.unwrap_or(1) as f64 * r.all as f64), r))
        .max_by(|a, b| a.0.total_cmp(&b.0));
    if let Some((ratio, r)) = worst {
        let _ = writeln!(
            md,
            "| bytes the root sends per fence ≤ k·S | highest: {}, N={}: {} = {:.2}·k·S | {} |",
            tree_name(r.width),
            r.nodes,
            bytes(r.root_sent),
            ratio,
            met(ratio <= 1.0)
        );
    }
    for r in trees().filter(|r| r.nodes == 4096) {
        let k = r.width.unwrap_or(1);
        let bound = (f64::from(r.nodes).ln() / f64::from(k).ln() - 1e-9).ceil() as u32 + 1;
        let _ = writeln!(
            md,
            "| {}, N=4096: hops each way ≤ ⌈log_k N⌉ + 1 | {} hops (bound {bound}; {} per fence, up and down) | {} |",
            tree_name(r.width),
            r.height,
            2 * r.height,
            met(r.height <= bound)
        );
    }
    let star = rows.iter().find(|r| r.width.is_none() && r.nodes == 4096);
    for r in trees().filter(|r| r.nodes == 4096) {
        let _ = writeln!(
            md,
            "| {}, N=4096 × {RANKS_PER_NODE} ranks: MPICH's start-up fence under 1 s on {} | {} (the star: {}) | {} |",
            tree_name(r.width),
            FAST.name,
            time(r.fast),
            star.map_or("?".into(), |s| time(s.fast)),
            met(r.fast < 1.0)
        );
    }
    md
}

fn met(ok: bool) -> &'static str {
    if ok {
        "met"
    } else {
        "**not met**"
    }
}

/// Predicted fence time against N, one line per tree, a panel per network: through gnuplot, if it is here.
fn plot(rows: &[Row], png: &std::path::Path) -> Result<(), String> {
    let mut script = format!(
        "set terminal pngcairo size 1000,420 font ',9'\nset output '{}'\nset multiplot layout 1,2\n\
         set logscale xy\nset grid\nset key top left\nset xrange [12:20000]\nset xlabel 'N (nodes, 32 ranks each)'\n\
         set ylabel 'predicted fence time (s)'\nset xtics ({})\n",
        png.display(),
        SIZES.map(|n| n.to_string()).join(", ")
    );
    for width in WIDTHS {
        let _ = writeln!(script, "${} << EOD", block(width));
        for r in rows.iter().filter(|r| r.width == width) {
            let _ = writeln!(script, "{} {} {}", r.nodes, r.loopback, r.fast);
        }
        script.push_str("EOD\n");
    }
    for (column, title) in [(2, "loopback, measured here"), (3, FAST.name)] {
        let lines: Vec<String> = WIDTHS
            .iter()
            .map(|&w| format!("${} using 1:{column} with linespoints title '{}'", block(w), tree_name(w)))
            .collect();
        let _ = writeln!(script, "set title 'MPICH start-up fence, {title}'\nplot {}", lines.join(", "));
    }
    script.push_str("unset multiplot\n");
    let child = Command::new("gnuplot").stdin(Stdio::piped()).spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            eprintln!("note: no plot, gnuplot cannot be run ({e}); apt-get install gnuplot-nox for one");
            return Ok(());
        }
    };
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(script.as_bytes()).map_err(|e| format!("gnuplot: {e}"))?;
    }
    let status = child.wait().map_err(|e| format!("gnuplot: {e}"))?;
    if !status.success() {
        return Err(format!("gnuplot failed ({status}) on:\n{script}"));
    }
    Ok(())
}

/// The name of a tree's data block in the gnuplot script.
fn block(width: Option<u32>) -> String {
    match width {
        None => "star".into(),
        Some(k) => format!("k{k}"),
    }
}

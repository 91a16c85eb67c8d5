//! How a fence's data could cross a large machine: the candidates for moving an exchange's result to every node,
//! in a model of a 100 Gb/s network (2 µs a hop, 12.5 GB/s each way per node, a non-blocking switch), at
//! 10^3 to 10^5 nodes, for an empty barrier and two start-up exchanges. It computes; it runs nothing.
//!
//! The candidates, with N nodes, each bringing a part of p bytes, S = N·p:
//!
//! - **tree, store and forward** (rpmi's collective today, the shape of `rpmi::collective::Tree`): a node sends
//!   its parent its subtree's parts once it has them all, and a result once it has it whole. Up, with g(v) when
//!   v has gathered: g(leaf) = 0, and v's link takes its children's parts back to back, each from when that
//!   child has gathered, then one hop; down, the j-th child of v has the result at a(v) + L + j·S/B. The fence
//!   ends at the last node's a(v). It is `benches/tree`'s model, run on the tree itself rather than on the
//!   in-memory machines (which `benches/tree` runs up to 16,384 nodes).
//! - **tree, pipelined**: the same tree, every message cut in chunks of c = 64 KiB, each passed on as it
//!   comes. The root's link takes S in and sends k·S out, every interior node's the same; a chunk crosses the
//!   height h in h·(L + k·c/B): up h·(L + c/B) + S/B, down k·S/B + h·(L + k·c/B).
//! - **Bruck's allgather** between the node servers: ⌈log₂ N⌉ rounds, in round i each node sends the 2^i parts
//!   it has to the node 2^i below it (the last round what is left): every link sends and takes (N−1)·p, and
//!   the fence takes ⌈log₂ N⌉·L + (N−1)·p/B. No root: every node sends the same.
//! - **ring allgather**: N−1 steps, each a part to the next node: (N−1)·(L + p/B).
//! - **gets on demand** (not a fence's data: each get fetches the key from its owner's node, PMI-2's
//!   `KVS_Get` names the source, a PMI-1 key can be hashed to a home node): a node that reads r keys takes
//!   r·(2L + p/B) one after another; it beats gathering everything while r < (time of the best gather) /
//!   (2L + p/B), which the last table gives.
//!
//! What the model leaves out: each node's own processing (a wake-up, a copy: tens of µs where `benches/tree`
//! measured them on loopback), contention in the switch, and the handshake a node makes with each peer it
//! talks to (a tree: its parent and children; Bruck: ⌈log₂ N⌉ peers).
//!
//! Run: `cargo bench --bench fence_model [-- --out DIR]` (default `benches/results`): writes `fence_model.md`.

use rpmi::collective::{Peer, Tree};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

/// Seconds a hop takes, before its bytes.
const L: f64 = 2e-6;
/// Bytes per second, each way, per node.
const B: f64 = 100e9 / 8.0;
/// The chunk of the pipelined tree.
const CHUNK: f64 = 65536.0;
const SIZES: [u32; 3] = [1_000, 10_000, 100_000];
const WIDTHS: [u32; 3] = [2, 4, 8];

/// One exchange: what each node brings.
struct Workload {
    name: &'static str,
    part: f64,
}

const WORKLOADS: [Workload; 3] = [
    Workload { name: "empty barrier", part: 0.0 },
    Workload { name: "node roots' cards only (MPICH 5 with PMI 1.2): 300 bytes a node", part: 300.0 },
    Workload { name: "every rank's card: 10 ranks of 300 bytes a node", part: 3000.0 },
];

/// A candidate's fence: seconds, and the bytes the root (or, without one, any node) sends, and the most any
/// other node sends.
struct Fence {
    name: String,
    seconds: f64,
    root_sends: f64,
    other_sends: f64,
}

/// The store-and-forward tree of width `k` over `n` nodes (`benches/tree`'s model on the tree itself).
fn store_and_forward(n: u32, k: u32, part: f64) -> Fence {
    let tree = Tree::new(n, k).expect("a tree");
    let (nodes, s) = (n as usize, f64::from(n) * part);
    // Nodes' children have higher numbers: subtree sizes and gather times go from the last node back.
    let mut size = vec![1.0f64; nodes];
    let mut gathered = vec![0.0f64; nodes];
    let gather_of = |children: std::ops::Range<u32>, size: &[f64], gathered: &[f64]| {
        let mut ready: Vec<(f64, f64)> = children.map(|c| (gathered[c as usize], size[c as usize] * part)).collect();
        ready.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut link = 0.0f64;
        for (at, bytes) in ready {
            link = link.max(at) + bytes / B;
        }
        link
    };
    for i in (0..n).rev() {
        let children = tree.children(Peer::Node(i));
        for c in children.clone() {
            size[i as usize] += size[c as usize];
        }
        gathered[i as usize] = if children.is_empty() { 0.0 } else { L + gather_of(children, &size, &gathered) };
    }
    // The root has every part once its link has taken its children's; each node then has the result at
    // its parent's time, a hop, and its place among its siblings times the result's transfer.
    let root_has = L + gather_of(tree.children(Peer::Root), &size, &gathered);
    let mut has = vec![0.0f64; nodes];
    let mut last = root_has;
    for i in 0..n {
        let parent = tree.parent(i);
        let (from, first) = match parent {
            Peer::Root => (root_has, tree.children(Peer::Root).start),
            Peer::Node(p) => (has[p as usize], tree.children(Peer::Node(p)).start),
        };
        has[i as usize] = from + L + f64::from(i - first + 1) * s / B;
        last = last.max(has[i as usize]);
    }
    let root_children = tree.children(Peer::Root).len() as f64;
    let busiest = (0..n).map(|i| tree.children(Peer::Node(i)).len()).max().unwrap_or(0) as f64;
    Fence {
        name: format!("tree k={k}, store and forward"),
        seconds: last,
        root_sends: root_children * s,
        other_sends: busiest * s + s,
    }
}

/// The same tree, pipelined in chunks.
fn pipelined(n: u32, k: u32, part: f64) -> Fence {
    let tree = Tree::new(n, k).expect("a tree");
    let (h, s, kf) = (f64::from(tree.height()), f64::from(n) * part, f64::from(k.min(n)));
    let chunk = CHUNK.min(s.max(1.0));
    let up = h * (L + chunk / B) + s / B;
    let down = kf * s / B + h * (L + kf * chunk / B);
    Fence { name: format!("tree k={k}, pipelined"), seconds: up + down, root_sends: kf * s, other_sends: kf * s + s }
}

fn bruck(n: u32, part: f64) -> Fence {
    let rounds = f64::from(32 - (n - 1).leading_zeros());
    let sends = f64::from(n - 1) * part;
    Fence { name: "Bruck's allgather".into(), seconds: rounds * L + sends / B, root_sends: sends, other_sends: sends }
}

fn ring(n: u32, part: f64) -> Fence {
    let sends = f64::from(n - 1) * part;
    Fence {
        name: "ring allgather".into(),
        seconds: f64::from(n - 1) * (L + part / B),
        root_sends: sends,
        other_sends: sends,
    }
}

fn time(s: f64) -> String {
    match s {
        s if s >= 1.0 => format!("{s:.2} s"),
        s if s >= 1e-3 => format!("{:.2} ms", s * 1e3),
        s => format!("{:.1} µs", s * 1e6),
    }
}

fn bytes(b: f64) -> String {
    match b {
        b if b >= 1e9 => format!("{:.2} GB", b / 1e9),
        b if b >= 1e6 => format!("{:.1} MB", b / 1e6),
        b if b >= 1e3 => format!("{:.1} kB", b / 1e3),
        b => format!("{b:.0} B"),
    }
}

fn report() -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# A fence's data on a large machine: the candidates, modelled\n");
    let _ = writeln!(
        out,
        "Written by `cargo bench --bench fence_model` (`benches/fence_model/main.rs`, which says what each \
         candidate does and what the model leaves out). 100 Gb/s: 2 µs a hop, 12.5 GB/s each way per node. \
         **S/B** is the time the result's bytes take to reach one node, the least any candidate can take; \
         \"× S/B\" a fence's time over it. **Root sends**: what the root (the tree's; without one, any node) \
         sends; **other**: the most any other node sends, at most.\n"
    );
    for w in &WORKLOADS {
        let _ = writeln!(out, "## {}\n", w.name);
        let _ = writeln!(out, "| nodes | S | S/B | candidate | fence | × S/B | root sends | other |");
        let _ = writeln!(out, "|---|---|---|---|---|---|---|---|");
        for n in SIZES {
            let s = f64::from(n) * w.part;
            let mut fences: Vec<Fence> = Vec::new();
            for k in WIDTHS {
                fences.push(store_and_forward(n, k, w.part));
            }
            if w.part > 0.0 {
                for k in WIDTHS {
                    fences.push(pipelined(n, k, w.part));
                }
            }
            fences.push(bruck(n, w.part));
            fences.push(ring(n, w.part));
            let best = fences.iter().map(|f| f.seconds).fold(f64::INFINITY, f64::min);
            for f in &fences {
                let ratio = if s > 0.0 { format!("{:.1}", f.seconds / (s / B)) } else { "-".into() };
                let name = if f.seconds == best { format!("**{}**", f.name) } else { f.name.clone() };
                let _ = writeln!(
                    out,
                    "| {n} | {} | {} | {name} | {} | {ratio} | {} | {} |",
                    bytes(s),
                    time(s / B),
                    time(f.seconds),
                    bytes(f.root_sends),
                    bytes(f.other_sends)
                );
            }
        }
        let _ = writeln!(out);
    }
    let _ = writeln!(out, "## Gets on demand against gathering everything\n");
    let _ = writeln!(
        out,
        "A get that fetches one key from its owner's node takes 2L + p/B. A node that reads fewer keys than \
         the best gather's time over that is done sooner fetching them on demand (the reads one after another; \
         a node that reads in parallel, sooner still).\n"
    );
    let _ = writeln!(out, "| nodes | part | best gather | one get | gets a node may read before gathering wins |");
    let _ = writeln!(out, "|---|---|---|---|---|");
    for w in WORKLOADS.iter().filter(|w| w.part > 0.0) {
        for n in SIZES {
            let mut best = bruck(n, w.part).seconds;
            for k in WIDTHS {
                best = best.min(store_and_forward(n, k, w.part).seconds).min(pipelined(n, k, w.part).seconds);
            }
            let get = 2.0 * L + w.part / B;
            let _ = writeln!(
                out,
                "| {n} | {} | {} | {} | {:.0} |",
                bytes(w.part),
                time(best),
                time(get),
                (best / get).floor()
            );
        }
    }
    out
}

fn main() -> ExitCode {
    let mut out = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/results");
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--out" => match args.next() {
                Some(dir) => out = dir.into(),
                None => {
                    eprintln!("fence_model: --out needs a directory");
                    return ExitCode::from(2);
                }
            },
            "--bench" => {}
            other => {
                eprintln!("fence_model: unknown argument {other}; usage: fence_model [--out DIR]");
                return ExitCode::from(2);
            }
        }
    }
    let text = report();
    print!("{text}");
    let file = out.join("fence_model.md");
    if let Err(e) = std::fs::create_dir_all(&out).and_then(|()| std::fs::write(&file, &text)) {
        eprintln!("fence_model: {}: {e}", file.display());
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

//! Fuzz target `frames`: arbitrary bytes as a TCP stream of the Slurm plugin's collective
//! (`rpmi_core::slurm::protocol`, version 3): what srun reads from a slurmstepd, a stepd from a child, a stepd from
//! srun or a stepd from its parent in the tree. The stream is cut into chunks chosen by the input, split into
//! frames by `FrameBuf` with the bounds the real receiver uses, and every frame decoded as `Up` and as
//! `Down`; the collective's frame inside a COLLECTIVE is decoded as `rpmi_core::collective::Frame` with the
//! receiver's bound on a part.
//!
//! Input format (see fuzz/README.md): 4 header bytes, then the stream. Byte 0: bits 0-1 the receiver (srun from
//! node n; node n's parent from n, a stepd unless the tree has none; stepd n from srun; stepd n from its
//! parent, srun if the tree has no stepd parent), bit 2 the stream starts at the connection's first byte
//! (the handshake's frames first, with their bounds), bit 3 small bounds instead of the real defaults, bits
//! 4-7 the tree's width (0: the star). Byte 1: n (modulo the nodes) and, with small bounds, the bound on a
//! node's part in units of 256 bytes (an exchange 4 times that). Byte 2: the number of nodes less one.
//! Byte 3: the chunk sizes (bits 0-1: at most 1, 7, 64 or 4096 bytes a chunk; the rest seeds the sizes,
//! and how many frames the receiver takes after each chunk: mostly all, sometimes 0 to 2). A missing header
//! byte reads as 0.
//!
//! Checks: no panic; `FrameBuf` hands out exactly the frames a model of the protocol finds, whatever the
//! chunks, refuses a frame over its bound before keeping it, reports `pending` and `announced` as the model
//! does, holds at most twice what it was given and nothing once `release` finds it empty; every receiver
//! takes any control frame and any COLLECTIVE the collective's machine takes, and nothing the machine
//! refuses for its size; a decoded message accounts for every byte of its frame, its texts are at most
//! `MESSAGE_MAX` bytes, decoding allocates in proportion to the frame, never to the counts and lengths
//! inside it; re-encoding gives back the same message (and the same bytes, unless a text was not UTF-8);
//! control frames fit `CONTROL_MAX`; a COLLECTIVE is `collective_head` and its frame unchanged; the frame
//! inside decodes the same with or without the bound on a part but for a part over it, reads its parts in
//! place, and is what the collective's encoders build; texts of any length are cut at a character boundary
//! to `MESSAGE_MAX` bytes when encoded, and reports of any length decode only if `frame::report` builds
//! them; the handshake proofs check only for their role, their link and their node; `Secret::from_hex`
//! takes exactly 64 hex digits.

#![no_main]

use libfuzzer_sys::fuzz_target;
use rpmi_core::collective::frame::{self as cframe, DecodeError};
use rpmi_core::collective::groups::done_max;
use rpmi_core::collective::{Bound, Bounds, Bytes, Frame, GroupRoot, Node, Peer, Root, Tree};
use rpmi_core::server::{Limits, TaskMap, GROUP_ID_MAX};
use rpmi_core::slurm::auth::{Prover, Secret, Transcript, NONCE_LEN, ROOT};
use rpmi_core::slurm::protocol::{
    collective_head, group_head, Direction, Down, FrameBuf, FrameError, Up, CONTROL_MAX, HELLO_LEN, MESSAGE_MAX,
    NAME_MAX, PROOF_LEN_ON_WIRE, SPAWN_FRAME_MAX, SPAWN_MAX,
};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};

/// srun's default bounds on one node's part of an exchange and on a whole exchange
/// (`SLURM_RPMI_NODE_BYTES_MAX`, `SLURM_RPMI_EXCHANGE_BYTES_MAX`, in src/slurm/options.rs).
const NODE_BYTES_MAX: usize = 256 << 20;
const EXCHANGE_BYTES_MAX: usize = 512 << 20;

/// The nonce the target's acceptor answers a HELLO with, and the one its joiner says HELLO with (the real
/// ones are random): make_seeds.py computes right proofs with them.
const ACCEPTOR_NONCE: [u8; NONCE_LEN] = [0x5a; NONCE_LEN];
const JOINER_NONCE: [u8; NONCE_LEN] = [0xa5; NONCE_LEN];

/// Counts the bytes allocated and still live, and the most live at once since [`peak_during`] started.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(by: usize) {
    let now = LIVE.fetch_add(by, Relaxed) + by;
    PEAK.fetch_max(now, Relaxed);
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Relaxed);
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size >= layout.size() {
            grew(new_size - layout.size());
        } else {
            LIVE.fetch_sub(layout.size() - new_size, Relaxed);
        }
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// `f`'s result and the most bytes it had allocated at once (its result included).
fn peak_during<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = LIVE.load(Relaxed);
    PEAK.store(base, Relaxed);
    let r = f();
    (r, PEAK.load(Relaxed) - base)
}

/// `RPMI_FUZZ_DEBUG=1`: print every frame and what it decodes to (to check what a seed does).
fn debug() -> bool {
    static DEBUG: OnceLock<bool> = OnceLock::new();
    *DEBUG.get_or_init(|| std::env::var_os("RPMI_FUZZ_DEBUG").is_some_and(|v| v != "0"))
}

/// Who reads the stream, and the bounds it puts on each frame's payload.
#[derive(Debug, Clone, Copy)]
struct Receiver {
    /// What it is, for the debug output.
    what: &'static str,
    /// The bounds on the handshake's frames, if the stream starts at the connection's first byte: an
    /// acceptor's (src/slurm/admit.rs: `HELLO_LEN`, then `PROOF_LEN_ON_WIRE`), or a joiner's
    /// (src/slurm/uplink.rs: CHALLENGE and WELCOME, and srun's PARENT or PARENT_DONE to a stepd whose
    /// parent is a stepd, each up to `CONTROL_MAX`).
    handshake: [usize; 3],
    handshakes: usize,
    /// The bound on every frame after the handshake, as srun's `StepMonitor::frame_max`
    /// (src/slurm/root/monitor.rs) and a stepd's `NodeMonitor::frame_max` (src/slurm/stepd/monitor.rs) compute it.
    session: usize,
    /// What the collective's machine takes from this peer (`Root::frame_max`, `Node::frame_max`): the bound
    /// on the frame inside a COLLECTIVE.
    machine: usize,
    /// The bound on one node's part of an exchange, as the machine decodes a CONTRIB or ALL with it.
    part_max: usize,
    /// Whether it is an acceptor (srun, or a parent stepd), which reads HELLO and PROOF, or a joiner (a
    /// stepd), which reads CHALLENGE and WELCOME.
    acceptor: bool,
    /// The node that joins (an acceptor learns it from HELLO) and who admits it, for the transcript.
    node: u32,
    to: u32,
}

impl Receiver {
    /// The bound on the payload of frame number `index` of the stream.
    fn max(&self, index: usize) -> usize {
        if index < self.handshakes {
            self.handshake[index]
        } else {
            self.session
        }
    }

    /// Whether it frees its buffer after each read: a `Link` does (srun's root and the stepds, after
    /// admission); an acceptor's connection in the handshake and a joiner's reads do not.
    fn releases(&self, index: usize) -> bool {
        index >= self.handshakes
    }
}

/// The receiver the header describes.
fn receiver(config: u8, small: u8, nodes_less_one: u8) -> Receiver {
    let nodes = u32::from(nodes_less_one) + 1;
    let width = match u32::from(config >> 4) {
        0 => nodes,
        w => w,
    };
    // The Slurm plugin's tree: its top at node 0, srun above it.
    let tree = Tree::new(nodes, width).expect("a tree of 1 to 256 nodes, width 1 or more").top_at_first_node();
    let n = u32::from(small) % nodes;
    // Node n, moved among the nodes with a stepd as their parent (every node but node 0) if there are any.
    let below = if nodes > 1 { 1 + n % (nodes - 1) } else { n };
    let (part, exchange, store) = if config & 8 != 0 {
        let part = usize::from(small) * 256;
        (part, 4 * part, 4 * part)
    } else {
        (NODE_BYTES_MAX, EXCHANGE_BYTES_MAX, Limits::default().kvs_bytes_max)
    };
    // srun's bounds; a stepd takes them capped to what its key-value store holds (`exchange_bounds` in
    // src/slurm/stepd/mod.rs), and an ALL of every node's part of a full store (`SlurmHost::new`).
    let srun_bounds = Bounds {
        part_max: Bound { bytes: part, option: "SLURM_RPMI_NODE_BYTES_MAX" },
        exchange_max: Bound { bytes: exchange, option: "SLURM_RPMI_EXCHANGE_BYTES_MAX" },
    };
    let mut stepd_bounds = srun_bounds;
    stepd_bounds.part_max.bytes = stepd_bounds.part_max.bytes.min(store);
    stepd_bounds.exchange_max.bytes = stepd_bounds.exchange_max.bytes.min(store);
    let all_max = cframe::parts_len(nodes as usize, store);
    let stepd = |me: u32| Node::new(tree, me, stepd_bounds, all_max).expect("a node of the tree");
    // PMI 1.2's group exchanges: a node's part to srun, the end of one from srun to a stepd.
    let group_part = GroupRoot::new(TaskMap::new((0..nodes).collect()), srun_bounds).contribution_max();
    let group_end = done_max(nodes, &stepd_bounds);
    let acceptor = [HELLO_LEN, PROOF_LEN_ON_WIRE, 0];
    let joiner = [CONTROL_MAX; 3];
    let handshake = config & 4 != 0;
    let mut r = match config & 3 {
        0 | 1 => {
            let child = if config & 3 == 0 { n } else { below };
            match tree.parent(child) {
                Peer::Root => {
                    let machine = Root::new(tree, srun_bounds).frame_max(child);
                    Receiver {
                        what: "srun from a node",
                        handshake: acceptor,
                        handshakes: 2,
                        // srun also takes a SPAWN and a node's part of a group exchange.
                        session: CONTROL_MAX.max(SPAWN_FRAME_MAX).max(machine + 1).max(group_part + 1),
                        machine,
                        part_max: srun_bounds.part_max.bytes,
                        acceptor: true,
                        node: child,
                        to: ROOT,
                    }
                }
                Peer::Node(p) => {
                    let machine = stepd(p).frame_max(Peer::Node(child));
                    Receiver {
                        what: "a stepd from its child",
                        handshake: acceptor,
                        handshakes: 2,
                        session: machine + 1,
                        machine,
                        part_max: stepd_bounds.part_max.bytes,
                        acceptor: true,
                        node: child,
                        to: p,
                    }
                }
            }
        }
        2 => {
            let machine = stepd(n).frame_max(Peer::Root);
            Receiver {
                what: "a stepd from srun",
                handshake: joiner,
                // srun says where a stepd's parent listens before the stepd's link to srun is served.
                handshakes: if tree.parent(n) == Peer::Root { 2 } else { 3 },
                session: CONTROL_MAX.max(machine + 1).max(group_end + 1),
                machine,
                part_max: stepd_bounds.part_max.bytes,
                acceptor: false,
                node: n,
                to: ROOT,
            }
        }
        _ => match tree.parent(below) {
            Peer::Root => {
                let machine = stepd(below).frame_max(Peer::Root);
                Receiver {
                    what: "a stepd from srun (its parent)",
                    handshake: joiner,
                    handshakes: 2,
                    session: CONTROL_MAX.max(machine + 1).max(group_end + 1),
                    machine,
                    part_max: stepd_bounds.part_max.bytes,
                    acceptor: false,
                    node: below,
                    to: ROOT,
                }
            }
            Peer::Node(p) => {
                let machine = stepd(below).frame_max(Peer::Node(p));
                Receiver {
                    what: "a stepd from its parent",
                    handshake: joiner,
                    handshakes: 2,
                    session: machine + 1,
                    machine,
                    part_max: stepd_bounds.part_max.bytes,
                    acceptor: false,
                    node: below,
                    to: p,
                }
            }
        },
    };
    if !handshake {
        r.handshakes = 0;
    }
    // After the handshake, every receiver takes a control frame of either layer (a REPORT of REPORT_MAX
    // bytes in a COLLECTIVE is the largest), and exactly the COLLECTIVE frames whose frame the machine takes.
    assert!(r.machine >= cframe::CONTROL_MAX, "{r:?}");
    // Beside the collective's frames, srun takes a SPAWN and a node's part of a group exchange, and a stepd
    // the end of a group exchange from srun.
    let control = match (r.acceptor, r.to == ROOT) {
        (true, true) => SPAWN_FRAME_MAX.max(group_part + 1),
        (false, true) => CONTROL_MAX.max(group_end + 1),
        _ => CONTROL_MAX,
    };
    assert_eq!(r.session - 1, r.machine.max(control - 1), "{r:?}");
    r
}

/// The chunk sizes, at most `max` bytes, and how many of the frames that have come the receiver takes
/// before the next chunk (mostly all of them, one time in four only 0 to 2), drawn from an xorshift generator
/// seeded by the input.
struct Chunks {
    max: usize,
    state: u32,
}

impl Chunks {
    fn new(byte: u8) -> Chunks {
        let max = [1, 7, 64, 4096][usize::from(byte & 3)];
        Chunks { max, state: (u32::from(byte >> 2) + 1).wrapping_mul(0x9E37_79B9) | 1 }
    }

    fn next(&mut self) -> (usize, usize) {
        let mut x = self.state;
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        self.state = x;
        let take = if x >> 30 == 0 { (x >> 28 & 3) as usize % 3 } else { usize::MAX };
        (1 + (x as usize) % self.max, take)
    }
}

fn be32(b: &[u8]) -> usize {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize
}

/// What a model of the protocol expects of `next(max)` with `rest` received and not handed out.
fn expected(rest: &[u8], max: usize) -> Result<Option<&[u8]>, FrameError> {
    if rest.len() < 4 {
        return Ok(None);
    }
    let len = be32(rest);
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    Ok(rest.get(4..4 + len))
}

/// Feeds `stream` to a `FrameBuf` in chunks, taking the frames `chunk` says after each (all of them after
/// the last), checks it against the model, and calls `frame` with every frame's number, payload and bound.
/// Returns how many frames there were and the error that ended the stream, if one did.
fn split(
    stream: &[u8],
    receiver: &Receiver,
    mut chunk: impl FnMut() -> (usize, usize),
    mut frame: impl FnMut(usize, &[u8], usize),
) -> (usize, Option<FrameError>) {
    let base = LIVE.load(Relaxed);
    let mut fb = FrameBuf::default();
    let (mut fed, mut at, mut count) = (0, 0, 0);
    while fed < stream.len() {
        let (n, mut take) = chunk();
        let n = n.clamp(1, stream.len() - fed);
        fb.extend(&stream[fed..fed + n]);
        fed += n;
        if fed == stream.len() {
            take = usize::MAX;
        }
        loop {
            let rest = &stream[at..fed];
            assert_eq!(fb.pending(), rest.len(), "pending() after {fed} bytes, {at} handed out");
            assert_eq!(fb.announced(), rest.get(..4).map(be32), "announced() at {at}");
            if take == 0 {
                break;
            }
            take -= 1;
            let max = receiver.max(count);
            let want = expected(rest, max);
            match fb.next(max) {
                Ok(None) => {
                    assert_eq!(want, Ok(None), "no frame at {at} after {fed} bytes");
                    break;
                }
                Ok(Some(payload)) => {
                    assert_eq!(want, Ok(Some(payload)), "frame {count} at {at}");
                    assert!(payload.len() <= max);
                    frame(count, payload, max);
                    count += 1;
                    at += 4 + payload.len();
                }
                Err(e) => {
                    assert_eq!(Err(e.clone()), want, "frame {count} at {at}");
                    let _ = e.to_string();
                    // Refused before anything of it was kept, and refused again if asked again.
                    assert_eq!(fb.pending(), rest.len());
                    assert_eq!(fb.next(max), Err(e.clone()));
                    return (count, Some(e));
                }
            }
        }
        if receiver.releases(count) {
            fb.release();
            if fb.pending() == 0 {
                assert_eq!(LIVE.load(Relaxed), base, "release() kept memory with nothing pending");
            }
        }
        // Whatever the lengths announce, the buffer holds what came (at most twice, as a Vec grows), and room
        // for the whole frame in progress once its announced length is within the receiver's bound (it is
        // received into one allocation of its size).
        let held = LIVE.load(Relaxed) - base;
        let room = fb.announced().filter(|&len| len <= receiver.max(count)).map_or(0, |len| 4 + len);
        assert!(held <= 2 * fed + 64 + room, "the FrameBuf holds {held} bytes after {fed} came");
    }
    (count, None)
}

/// Where the text of a frame starts in its payload, for the kinds that have one: a message's (`Up`'s ABORT
/// and ERROR, `Down`'s ANSWER) or a collective frame's (FAIL).
fn text_at(kind: u8, collective: bool) -> Option<usize> {
    match (collective, kind) {
        (false, 3) => Some(9),    // ABORT rank code text
        (false, 4) => Some(6),    // ERROR rank failed text
        (false, 0x89) => Some(6), // ANSWER task ok text
        (true, 0x82) => Some(5),  // FAIL epoch text
        _ => None,
    }
}

/// `payload` was re-encoded as `frame` (its payload): the same bytes, unless a text was not UTF-8 (it is
/// decoded with U+FFFD in place of what is not, and cut to `MESSAGE_MAX` bytes): then up to the text.
fn check_same(payload: &[u8], frame: &[u8], collective: bool) {
    match text_at(payload[0], collective) {
        Some(at) if payload.get(at..).is_some_and(|t| std::str::from_utf8(t).is_err()) => {
            assert_eq!(frame[..at], payload[..at], "re-encoding changed the frame before its text");
            assert!(frame.len() - at <= MESSAGE_MAX);
        }
        _ => assert_eq!(frame, payload, "re-encoding changed the frame"),
    }
}

/// The bytes one decoding may allocate: a text at most 3 bytes (U+FFFD) per byte of frame, in a string
/// that may have doubled; a COLLECTIVE's or a REPORT's bytes, copied once; an error message a few dozen
/// bytes.
fn decode_bound(payload: &[u8]) -> usize {
    6 * payload.len() + 256
}

/// What the target knows of the handshake so far: the transcript both proofs are over.
struct Handshake {
    secret: Secret,
    transcript: Option<Transcript>,
}

fn check_frame(payload: &[u8], max: usize, receiver: &Receiver, hs: &mut Handshake) {
    assert!(payload.len() <= max);
    let (up, peak) = peak_during(|| Up::decode(payload));
    assert!(peak <= decode_bound(payload), "decoding {} bytes as Up allocated {peak}", payload.len());
    let (down, peak) = peak_during(|| Down::decode(payload));
    assert!(peak <= decode_bound(payload), "decoding {} bytes as Down allocated {peak}", payload.len());
    if debug() {
        let show = |r: Result<String, String>| r.unwrap_or_else(|e| e);
        let up = show(up.as_ref().map(|m| format!("{m:?}")).map_err(|e| e.to_string()));
        let down = show(down.as_ref().map(|m| format!("{m:?}")).map_err(|e| e.to_string()));
        eprintln!("frame of {} bytes (at most {max}): {up} / {down}", payload.len());
    }
    // No kind is of both directions.
    assert!(up.is_err() || down.is_err());
    match up {
        Ok(m) => check_up(payload, m, receiver, hs),
        Err(e) => {
            let _ = e.to_string();
        }
    }
    match down {
        Ok(m) => check_down(payload, m, receiver, hs),
        Err(e) => {
            let _ = e.to_string();
        }
    }
}

/// The checks common to both directions: `frame` re-encodes the message decoded from `payload`.
fn check_encoded(payload: &[u8], frame: &[u8], name: &str, collective: Option<(Direction, &Bytes)>) {
    assert!(frame.len() >= 5);
    assert_eq!(be32(frame), frame.len() - 4, "a length prefix that is not the frame's length");
    assert!(!name.is_empty());
    match collective {
        Some((direction, inner)) => {
            // What a link sends: the head, then the collective's frame unchanged.
            let head = collective_head(direction, inner.len()).expect("a frame that came in fits its length");
            assert_eq!(frame[..5], head, "a COLLECTIVE's head is not collective_head's");
            assert_eq!(frame[5..], inner[..]);
        }
        None => {
            // A GROUP is bounded by what its receiver takes (its part, or every member's).
            let max = match name {
                "SPAWN" => SPAWN_FRAME_MAX,
                "GROUP" => payload.len(),
                _ => CONTROL_MAX,
            };
            assert!(frame.len() - 4 <= max, "a {name} frame of {} bytes", frame.len() - 4)
        }
    }
    check_same(payload, &frame[4..], false);
}

fn check_text(text: &str) {
    assert!(text.len() <= MESSAGE_MAX, "a decoded text of {} bytes", text.len());
}

fn check_up(payload: &[u8], m: Up, receiver: &Receiver, hs: &mut Handshake) {
    match &m {
        Up::Hello { node, nonce, .. } => {
            assert_eq!(payload.len(), HELLO_LEN);
            if receiver.acceptor {
                hs.transcript = Some(Transcript {
                    node: *node,
                    to: receiver.to,
                    joiner_nonce: *nonce,
                    acceptor_nonce: ACCEPTOR_NONCE,
                });
            }
        }
        Up::Proof { proof } => {
            assert_eq!(payload.len(), PROOF_LEN_ON_WIRE);
            if let Some(t) = &hs.transcript {
                check_proof(&hs.secret, Prover::Joiner, t, proof);
            }
        }
        Up::Collective(inner) => check_collective(inner, receiver),
        Up::Abort { message, .. } | Up::Error { message, .. } => check_text(message),
        Up::Name { name, port, .. } => assert!(name.len() <= NAME_MAX && port.len() <= NAME_MAX),
        Up::Spawn { request, .. } => assert!(request.len() <= SPAWN_MAX),
        Up::Group { id, part } => {
            assert!(
                id.len() <= GROUP_ID_MAX && 1 + 2 + id.len() + part.len() == payload.len(),
                "a group part of {id:?}"
            )
        }
        Up::Joined { .. } | Up::Completed { .. } | Up::Gone { .. } | Up::Bye | Up::Started => {}
    }
    let frame = m.encode().expect("a decoded message re-encodes");
    let collective = match &m {
        Up::Collective(inner) => Some((Direction::Up, inner)),
        _ => None,
    };
    check_encoded(payload, &frame, m.name(), collective);
    assert_eq!(Up::decode(&frame[4..]), Ok(m), "decode(encode(m)) != m");
}

fn check_down(payload: &[u8], m: Down, receiver: &Receiver, hs: &mut Handshake) {
    match &m {
        Down::Challenge { nonce } => {
            assert_eq!(payload.len(), 1 + NONCE_LEN);
            if let Some(t) = &mut hs.transcript {
                t.acceptor_nonce = *nonce;
            }
        }
        Down::Welcome { proof } => {
            assert_eq!(payload.len(), PROOF_LEN_ON_WIRE);
            if let Some(t) = &hs.transcript {
                check_proof(&hs.secret, Prover::Acceptor, t, proof);
            }
        }
        Down::Collective(inner) => check_collective(inner, receiver),
        Down::Peer { .. } => assert_eq!(payload.len(), 7),
        Down::PeerDone { .. } => assert_eq!(payload.len(), 5),
        Down::End => assert_eq!(payload.len(), 1),
        Down::Answer { text, .. } => check_text(text),
        Down::Group(done) => {
            let id = done.id();
            assert!(id.len() <= GROUP_ID_MAX && 4 * done.len() <= payload.len(), "a group end of {id:?}");
            // Read in place: every part is there, and the head a stepd checks first says the same.
            let bytes: usize = done.parts().map(<[u8]>::len).sum();
            assert_eq!(done.parts().count(), done.len());
            assert_eq!(1 + 2 + id.len() + 4 + 4 * done.len() + bytes, payload.len());
            assert_eq!(group_head(payload), Some(Ok((id, done.len() as u32))));
        }
    }
    let frame = m.encode().expect("a decoded message re-encodes");
    let collective = match &m {
        Down::Collective(inner) => Some((Direction::Down, inner)),
        _ => None,
    };
    check_encoded(payload, &frame, m.name(), collective);
    assert_eq!(Down::decode(&frame[4..]), Ok(m), "decode(encode(m)) != m");
}

/// The collective's frame in a COLLECTIVE, as the receiver's machine decodes it.
fn check_collective(inner: &Bytes, receiver: &Receiver) {
    // The transport took it: the machine's own check of its size takes it too.
    assert!(inner.len() <= receiver.machine, "a frame of {} bytes passed the transport, not the machine", inner.len());
    let part_max = receiver.part_max;
    let (decoded, peak) = peak_during(|| Frame::decode(inner, part_max));
    assert!(peak <= decode_bound(inner), "decoding {} bytes as a collective frame allocated {peak}", inner.len());
    // The bound on a part is the only difference the bound makes.
    let unbounded = Frame::decode(inner, cframe::FRAME_MAX);
    if debug() {
        eprintln!("  collective frame of {} bytes (parts at most {part_max}): {decoded:?}", inner.len());
    }
    match (&decoded, &unbounded) {
        (Ok(f), Ok(g)) => assert_eq!(f, g),
        (Err(DecodeError::Malformed(a)), Err(DecodeError::Malformed(b))) => assert_eq!(a, b),
        (
            Err(DecodeError::PartTooLarge { node, len }),
            Ok(Frame::Contrib { parts, .. } | Frame::All { parts, .. } | Frame::Round { parts, .. }),
        ) => {
            let first = parts.iter().find(|(_, b)| b.len() > part_max).map(|(n, b)| (n, b.len()));
            assert_eq!(first, Some((*node, *len)), "PartTooLarge names another part than the first over the bound");
        }
        (Err(DecodeError::PartTooLarge { len, .. }), Err(DecodeError::Malformed(_))) => assert!(*len > part_max),
        other => panic!("decoded with part_max {part_max} and without: {other:?}"),
    }
    let frame = match decoded {
        Ok(f) => f,
        Err(e) => {
            let _ = e.to_string();
            return;
        }
    };
    let _ = frame.to_string();
    let rebuilt = match &frame {
        Frame::Contrib { epoch, parts } | Frame::All { epoch, parts } | Frame::Round { epoch, parts, .. } => {
            // Read in place: the frame holds its parts, and accounts for every byte of them.
            assert!(Arc::ptr_eq(parts.frame(), inner), "parts copied out of their frame");
            assert_eq!(parts.iter().len(), parts.len());
            assert_eq!(parts.iter().count(), parts.len());
            assert_eq!(parts.iter().map(|(_, b)| b.len()).sum::<usize>(), parts.bytes());
            let round = usize::from(matches!(frame, Frame::Round { .. }));
            let len = cframe::parts_len(parts.len(), parts.bytes()) + round;
            assert_eq!(len, inner.len(), "parts that are not the frame");
            assert!(parts.iter().all(|(_, b)| b.len() <= part_max));
            assert!(parts.nodes().eq(parts.iter().map(|(n, _)| n)));
            let misplaced = parts.nodes().enumerate().find(|&(i, n)| n as usize != i).map(|(i, n)| (i as u32, n));
            assert_eq!(parts.misplaced(), misplaced);
            assert_eq!(parts.is_empty(), parts.iter().next().is_none());
            match frame {
                Frame::Contrib { .. } => cframe::contrib(*epoch, parts.iter()),
                Frame::Round { round, .. } => cframe::round(*epoch, round, parts.iter()),
                _ => cframe::all(*epoch, parts.iter()),
            }
            .expect("a frame that came in fits")
        }
        Frame::Fail { epoch, message } => {
            check_text(message);
            cframe::fail(*epoch, message)
        }
        Frame::Lost { node } => cframe::lost(*node),
        Frame::Bye => cframe::bye(),
        Frame::End => cframe::end(),
        Frame::Report(bytes) => {
            assert!(bytes.len() <= cframe::REPORT_MAX);
            cframe::report(bytes).expect("a report that came in fits")
        }
    };
    if !matches!(frame, Frame::Contrib { .. } | Frame::All { .. } | Frame::Round { .. }) {
        assert!(rebuilt.len() <= cframe::CONTROL_MAX, "a collective control frame of {} bytes", rebuilt.len());
    }
    check_same(inner, &rebuilt, true);
    assert_eq!(Frame::decode(&rebuilt, part_max), Ok(frame), "decode(encode(f)) != f");
}

/// A proof from the stream checks only if it is the right one for its role, link and node.
fn check_proof(secret: &Secret, role: Prover, t: &Transcript, proof: &[u8; 32]) {
    let right = secret.prove(role, t);
    let checks = secret.verify(role, t, proof);
    if debug() {
        eprintln!("  the {role:?}'s proof for node {} to {}: {}", t.node, t.to, if checks { "right" } else { "wrong" });
    }
    assert_eq!(checks, *proof == right);
    assert!(secret.verify(role, t, &right));
    let other = if role == Prover::Joiner { Prover::Acceptor } else { Prover::Joiner };
    assert!(!secret.verify(other, t, &right), "a {role:?} proof passes as the other role's");
    let elsewhere = Transcript { to: t.to ^ 1, ..*t };
    assert!(!secret.verify(role, &elsewhere, &right), "a proof for one link passes on another");
    let someone = Transcript { node: t.node ^ 1, ..*t };
    assert!(!secret.verify(role, &someone, &right), "a proof for one node passes for another");
}

/// Texts of any length and content are cut to `MESSAGE_MAX` bytes at a character boundary when encoded.
fn check_cut(stream: &[u8], shift: u8) {
    let text = String::from_utf8_lossy(stream);
    // The stream's characters around the cut: after MESSAGE_MAX - shift bytes of ASCII.
    let long = "a".repeat(MESSAGE_MAX - usize::from(shift)) + &text;
    for text in [&*text, &*long] {
        let want = {
            let mut end = text.len().min(MESSAGE_MAX);
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            &text[..end]
        };
        let messages = [
            Up::Abort { rank: 1, code: -1, message: text.to_string() }.encode().unwrap(),
            Up::Error { rank: 2, failed: true, message: text.to_string() }.encode().unwrap(),
        ];
        for f in &messages {
            assert_eq!(be32(f), f.len() - 4);
            assert!(f.len() - 4 <= CONTROL_MAX, "a message frame of {} bytes", f.len() - 4);
        }
        let fail = cframe::fail(3, text);
        assert!(fail.len() <= cframe::CONTROL_MAX, "a FAIL of {} bytes", fail.len());
        let got = [
            match Up::decode(&messages[0][4..]) {
                Ok(Up::Abort { message, .. }) => message,
                other => panic!("{other:?}"),
            },
            match Up::decode(&messages[1][4..]) {
                Ok(Up::Error { message, .. }) => message,
                other => panic!("{other:?}"),
            },
            match Frame::decode(&fail, 0) {
                Ok(Frame::Fail { message, .. }) => message,
                other => panic!("{other:?}"),
            },
        ];
        for g in got {
            assert_eq!(g, want, "a text of {} bytes was not cut to {} bytes", text.len(), want.len());
        }
    }
}

/// A report of any length: `frame::report` builds one of at most `REPORT_MAX` bytes, and decoding takes
/// exactly what it builds (the stream's bytes, and the stream's after `REPORT_MAX` - `shift` bytes).
fn check_report(stream: &[u8], shift: u8) {
    let long = [&vec![b'r'; cframe::REPORT_MAX - usize::from(shift)][..], stream].concat();
    for bytes in [stream, &long[..]] {
        let fits = bytes.len() <= cframe::REPORT_MAX;
        let built = cframe::report(bytes);
        assert_eq!(built.is_ok(), fits, "report() of {} bytes", bytes.len());
        let payload = Arc::new([&[4u8][..], bytes].concat());
        match Frame::decode(&payload, 0) {
            Ok(Frame::Report(r)) => {
                assert!(fits, "a report of {} bytes decoded", r.len());
                assert_eq!(r, bytes);
                assert_eq!(built.as_deref(), Ok(&*payload));
            }
            Err(DecodeError::Malformed(_)) => assert!(!fits, "a report of {} bytes refused", bytes.len()),
            other => panic!("{other:?}"),
        }
    }
}

/// `Secret::from_hex` takes exactly 64 hex digits, and gives them back (in lower case) with `to_hex`.
fn check_hex(stream: &[u8]) {
    for text in [stream, stream.get(..64).unwrap_or(stream)] {
        let Ok(text) = std::str::from_utf8(text) else { continue };
        let secret = Secret::from_hex(text);
        let hex = text.len() == 64 && text.bytes().all(|b| b.is_ascii_hexdigit());
        assert_eq!(secret.is_some(), hex, "from_hex({text:?})");
        if let Some(s) = secret {
            assert_eq!(s.to_hex(), text.to_ascii_lowercase());
        }
    }
}

fn run(data: &[u8]) {
    let header = |i: usize| data.get(i).copied().unwrap_or(0);
    let stream = data.get(4..).unwrap_or(&[]);
    let receiver = receiver(header(0), header(1), header(2));
    if debug() {
        eprintln!("{}, {} bytes: {receiver:?}", receiver.what, stream.len());
    }
    let secret = Secret::from_hex(&"5a".repeat(32)).unwrap();
    // A joiner knows its transcript but for the acceptor's nonce, which CHALLENGE brings; an acceptor learns
    // it from HELLO.
    let transcript = (!receiver.acceptor).then_some(Transcript {
        node: receiver.node,
        to: receiver.to,
        joiner_nonce: JOINER_NONCE,
        acceptor_nonce: [0; NONCE_LEN],
    });
    let mut hs = Handshake { secret, transcript };
    let mut chunks = Chunks::new(header(3));
    let (frames, error) =
        split(stream, &receiver, || chunks.next(), |_, payload, max| check_frame(payload, max, &receiver, &mut hs));
    if debug() {
        eprintln!("{frames} frames, then {error:?}");
    }
    // However the bytes come, the frames are the same.
    let whole = split(stream, &receiver, || (usize::MAX, usize::MAX), |_, _, _| {});
    assert_eq!(whole, (frames, error));
    check_cut(stream, header(1));
    check_report(stream, header(1));
    check_hex(stream);
}

fuzz_target!(|data: &[u8]| run(data));

//! Fuzz target `frames`: arbitrary bytes as the TCP stream between a slurmstepd and srun's collective root
//! (`rpmi::slurm::wire`), cut into chunks chosen by the input, split into frames by `FrameBuf` with the
//! bounds the root and the stepd use, and every frame decoded as `ToRoot` and as `FromRoot`.
//!
//! Input format (see README.md): 4 header bytes, then the stream. Byte 0 picks the receiver (bits 0-1:
//! the root from its first byte, the root after the handshake, a stepd after the handshake, a stepd in the
//! handshake) and, with bit 2, small bounds instead of the real defaults; byte 1 is the small bound in units
//! of 64 bytes; byte 2 the number of nodes less one; byte 3 the chunk sizes (bits 0-1: at most 1, 7, 64 or
//! 4096 bytes a chunk; the rest seeds the sizes, and how many frames the receiver takes after each chunk:
//! mostly all, sometimes 0 to 2). A missing header byte reads as 0.
//!
//! Checks: no panic; `FrameBuf` hands out exactly the frames a model of the protocol finds, whatever the
//! chunks, refuses a frame over its bound before keeping it, reports `pending` and `announced` as the model
//! does, holds at most twice what it was given and nothing once `release` finds it empty; a decoded message
//! accounts for every byte of its frame, its texts are at most `MESSAGE_MAX` bytes, decoding allocates in
//! proportion to the frame, never to the counts and lengths inside it; re-encoding gives back the same
//! message (and the same bytes, unless a text was not UTF-8); control frames fit `CONTROL_MAX`; one-part
//! CONTRIB and ALL frames are what `wire::contrib` and `wire::all` build, of the size `all_len` says;
//! texts of any length are cut at a character boundary to `MESSAGE_MAX` bytes when encoded; the handshake
//! proofs check only for their role; `Secret::from_hex` takes exactly 64 hex digits.

#![no_main]

use libfuzzer_sys::fuzz_target;
use rpmi::server::Limits;
use rpmi::slurm::auth::{Role, Secret, Transcript, NONCE_LEN};
use rpmi::slurm::wire::{
    self, FrameBuf, FrameError, FromRoot, ToRoot, CONTROL_MAX, HELLO_LEN, MESSAGE_MAX, PROOF_LEN_ON_WIRE,
};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::OnceLock;

/// The root's default bound on one node's part of an exchange (`RPMI_SLURM_NODE_BYTES_MAX`, in
/// src/slurm/client.rs).
const NODE_BYTES_MAX: usize = 256 << 20;

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

/// Who reads the stream, with the bound it puts on each frame's payload.
#[derive(Debug, Clone, Copy)]
enum Receiver {
    /// The root from a connection's first byte: HELLO, then PROOF, then an admitted node's frames
    /// (`State::frame_max` in src/slurm/root.rs).
    RootFromStart { node_max: usize },
    /// The root, the node admitted.
    RootAdmitted { node_max: usize },
    /// A stepd after the handshake: the bound of its uplink reader (src/slurm/stepd.rs).
    Stepd { all_max: usize },
    /// A stepd in the handshake (src/slurm/uplink.rs reads CHALLENGE and WELCOME up to `CONTROL_MAX`).
    StepdHandshake,
}

impl Receiver {
    /// The bound on the payload of frame number `index` of the stream.
    fn max(self, index: usize) -> usize {
        match self {
            Receiver::RootFromStart { .. } if index == 0 => HELLO_LEN,
            Receiver::RootFromStart { .. } if index == 1 => PROOF_LEN_ON_WIRE,
            Receiver::RootFromStart { node_max } | Receiver::RootAdmitted { node_max } => node_max,
            Receiver::Stepd { all_max } => all_max,
            Receiver::StepdHandshake => CONTROL_MAX,
        }
    }

    /// Whether it frees its buffer after each read, as the stepd's reader does.
    fn releases(self) -> bool {
        matches!(self, Receiver::Stepd { .. })
    }
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
    receiver: Receiver,
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
        if receiver.releases() {
            fb.release();
            if fb.pending() == 0 {
                assert_eq!(LIVE.load(Relaxed), base, "release() kept memory with nothing pending");
            }
        }
        // Whatever the lengths announce, the buffer holds only what came (at most twice, as a Vec grows).
        let held = LIVE.load(Relaxed) - base;
        assert!(held <= 2 * fed + 64, "the FrameBuf holds {held} bytes after {fed} came");
    }
    (count, None)
}

/// Where the text of a message frame starts in its payload, for the kinds that have one.
fn text_at(kind: u8) -> Option<usize> {
    match kind {
        3 => Some(9),    // ABORT rank code text
        4 => Some(6),    // ERROR rank failed text
        0x82 => Some(5), // FAIL epoch text
        _ => None,
    }
}

/// Whether re-encoding must give back the payload byte for byte: yes unless a text was not UTF-8 (it is
/// decoded with U+FFFD in place of what is not).
fn lossless(payload: &[u8]) -> bool {
    match text_at(payload[0]) {
        Some(at) => payload.get(at..).is_none_or(|t| std::str::from_utf8(t).is_ok()),
        None => true,
    }
}

/// The bytes one decoding may allocate: the parts of a CONTRIB or ALL take their bytes and 32 bytes of
/// vector per part of at least 8 bytes of frame; a text at most 3 bytes (U+FFFD) per byte of frame, in a
/// string that may have doubled; an error message a few dozen bytes.
fn decode_bound(payload: &[u8]) -> usize {
    6 * payload.len() + 256
}

fn check_frame(payload: &[u8], max: usize, hello: &mut Option<Transcript>, secret: &Secret) {
    assert!(payload.len() <= max);
    let (to_root, peak) = peak_during(|| ToRoot::decode(payload));
    assert!(peak <= decode_bound(payload), "decoding {} bytes as ToRoot allocated {peak}", payload.len());
    let (from_root, peak) = peak_during(|| FromRoot::decode(payload));
    assert!(peak <= decode_bound(payload), "decoding {} bytes as FromRoot allocated {peak}", payload.len());
    if debug() {
        eprintln!("frame of {} bytes (at most {max}): {to_root:?} / {from_root:?}", payload.len());
    }
    // No kind is both a stepd's and the root's.
    assert!(to_root.is_err() || from_root.is_err());
    match to_root {
        Ok(m) => check_to_root(payload, m, hello, secret),
        Err(e) => {
            let _ = e.to_string();
        }
    }
    match from_root {
        Ok(m) => check_from_root(payload, m, hello, secret),
        Err(e) => {
            let _ = e.to_string();
        }
    }
}

/// The checks common to both directions: `frame` re-encodes the message decoded from `payload`.
fn check_encoded(payload: &[u8], frame: &[u8], control: bool) {
    assert!(frame.len() >= 5);
    assert_eq!(be32(frame), frame.len() - 4, "a length prefix that is not the frame's length");
    if control {
        assert!(frame.len() - 4 <= CONTROL_MAX, "a control frame of {} bytes", frame.len() - 4);
    }
    match text_at(payload[0]) {
        // Up to its text, the frame is the same; the text is the same unless it was not UTF-8.
        Some(at) if !lossless(payload) => assert_eq!(frame[4..4 + at], payload[..at], "re-encoding changed the frame"),
        _ => assert_eq!(&frame[4..], payload, "re-encoding changed the frame"),
    }
}

/// The bytes a list of parts takes in a frame: a count, then each part's node, length and bytes.
fn parts_len(parts: &[(u32, Vec<u8>)]) -> usize {
    4 + parts.iter().map(|(_, b)| 8 + b.len()).sum::<usize>()
}

fn check_text(text: &str) {
    assert!(text.len() <= MESSAGE_MAX, "a decoded text of {} bytes", text.len());
}

fn check_to_root(payload: &[u8], m: ToRoot, hello: &mut Option<Transcript>, secret: &Secret) {
    match &m {
        ToRoot::Hello { node, nonce } => {
            assert_eq!(payload.len(), HELLO_LEN);
            *hello = Some(Transcript { node: *node, stepd_nonce: *nonce, root_nonce: [0x5a; NONCE_LEN] });
        }
        ToRoot::Proof { proof } => {
            assert_eq!(payload.len(), PROOF_LEN_ON_WIRE);
            if let Some(t) = hello {
                check_proof(secret, Role::Stepd, t, proof);
            }
        }
        ToRoot::Contrib { epoch, parts } => {
            assert_eq!(1 + 4 + parts_len(parts), payload.len(), "a CONTRIB's parts are not its frame");
            if let [(node, bytes)] = parts.as_slice() {
                assert_eq!(wire::contrib(*epoch, *node, bytes).unwrap()[4..], *payload);
                // The root's bound on a node's frame is that of a CONTRIB of one part of part_max bytes.
                assert_eq!(wire::all_len(1, bytes.len()) - 4, payload.len());
            }
        }
        ToRoot::Abort { message, .. } | ToRoot::Error { message, .. } => check_text(message),
        ToRoot::Gone { .. } | ToRoot::Bye => {}
    }
    let control = !matches!(m, ToRoot::Contrib { .. });
    let frame = m.encode().expect("a decoded message re-encodes");
    check_encoded(payload, &frame, control);
    assert_eq!(ToRoot::decode(&frame[4..]), Ok(m), "decode(encode(m)) != m");
}

fn check_from_root(payload: &[u8], m: FromRoot, hello: &mut Option<Transcript>, secret: &Secret) {
    match &m {
        FromRoot::Challenge { nonce } => {
            assert_eq!(payload.len(), 1 + NONCE_LEN);
            if let Some(t) = hello {
                t.root_nonce = *nonce;
            }
        }
        FromRoot::Welcome { proof } => {
            assert_eq!(payload.len(), PROOF_LEN_ON_WIRE);
            if let Some(t) = hello {
                check_proof(secret, Role::Root, t, proof);
            }
        }
        FromRoot::All { epoch, parts } => {
            assert_eq!(1 + 4 + parts_len(parts), payload.len(), "an ALL's parts are not its frame");
            let bytes = parts.iter().map(|(_, b)| b.len()).sum();
            assert_eq!(wire::all_len(parts.len(), bytes), 4 + payload.len());
            let built = wire::all(*epoch, parts.iter().map(|(n, b)| (*n, b.as_slice()))).unwrap();
            assert_eq!(built[4..], *payload);
        }
        FromRoot::Fail { message, .. } => check_text(message),
        FromRoot::End => {}
    }
    let control = !matches!(m, FromRoot::All { .. });
    let frame = m.encode().expect("a decoded message re-encodes");
    check_encoded(payload, &frame, control);
    assert_eq!(FromRoot::decode(&frame[4..]), Ok(m), "decode(encode(m)) != m");
}

/// A proof from the stream checks only if it is the right one for its role.
fn check_proof(secret: &Secret, role: Role, t: &Transcript, proof: &[u8; 32]) {
    let right = secret.prove(role, t);
    assert_eq!(secret.verify(role, t, proof), *proof == right);
    assert!(secret.verify(role, t, &right));
    let other = if role == Role::Stepd { Role::Root } else { Role::Stepd };
    assert!(!secret.verify(other, t, &right), "a {role:?} proof passes as the other role's");
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
            ToRoot::Abort { rank: 1, code: -1, message: text.to_string() }.encode().unwrap(),
            ToRoot::Error { rank: 2, task_failed: true, message: text.to_string() }.encode().unwrap(),
            FromRoot::Fail { epoch: 3, message: text.to_string() }.encode().unwrap(),
        ];
        for f in &messages {
            assert_eq!(be32(f), f.len() - 4);
            assert!(f.len() - 4 <= CONTROL_MAX, "a message frame of {} bytes", f.len() - 4);
        }
        let got = [
            match ToRoot::decode(&messages[0][4..]) {
                Ok(ToRoot::Abort { message, .. }) => message,
                other => panic!("{other:?}"),
            },
            match ToRoot::decode(&messages[1][4..]) {
                Ok(ToRoot::Error { message, .. }) => message,
                other => panic!("{other:?}"),
            },
            match FromRoot::decode(&messages[2][4..]) {
                Ok(FromRoot::Fail { message, .. }) => message,
                other => panic!("{other:?}"),
            },
        ];
        for g in got {
            assert_eq!(g, want, "a text of {} bytes was not cut to {} bytes", text.len(), want.len());
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
    let (config, bound, nodes) = (header(0), usize::from(header(1)) * 64, usize::from(header(2)) + 1);
    let small = config & 4 != 0;
    let part_max = if small { bound } else { NODE_BYTES_MAX };
    let kvs_bytes_max = if small { bound } else { Limits::default().kvs_bytes_max };
    let node_max = CONTROL_MAX.max(wire::all_len(1, part_max) - 4);
    let receiver = match config & 3 {
        0 => Receiver::RootFromStart { node_max },
        1 => Receiver::RootAdmitted { node_max },
        2 => Receiver::Stepd { all_max: wire::all_len(nodes, kvs_bytes_max) },
        _ => Receiver::StepdHandshake,
    };
    if debug() {
        eprintln!("{receiver:?}, {} bytes", stream.len());
    }
    let secret = Secret::from_hex(&"5a".repeat(32)).unwrap();
    let mut hello = None;
    let mut chunks = Chunks::new(header(3));
    let (frames, error) =
        split(stream, receiver, || chunks.next(), |_, payload, max| check_frame(payload, max, &mut hello, &secret));
    if debug() {
        eprintln!("{frames} frames, then {error:?}");
    }
    // However the bytes come, the frames are the same.
    let whole = split(stream, receiver, || (usize::MAX, usize::MAX), |_, _, _| {});
    assert_eq!(whole, (frames, error));
    check_cut(stream, header(1));
    check_hex(stream);
}

fuzz_target!(|data: &[u8]| run(data));

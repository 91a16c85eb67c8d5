//! The collective's frames: the payloads inside the transport's frames (the transport puts a `u32`
//! big-endian length before each and checks it against [`super::Node::frame_max`] or
//! [`super::Root::frame_max`] before reading the payload). The first byte is the kind; integers are
//! big-endian.
//!
//! ```text
//! up, to the parent                         down, to the children
//!   1 CONTRIB epoch:u32 count:u32 count*(node:u32 len:u32 bytes)
//!                                           0x81 ALL  epoch:u32 count:u32 count*(node:u32 len:u32 bytes)
//!                                           0x82 FAIL epoch:u32 message (UTF-8, at most MESSAGE_MAX bytes)
//!                                           0x83 END  (the root is done with the job: closing is normal)
//! straight to the root
//!   2 LOST   node:u32  (a child of the sender closed its connection without BYE)
//!   3 BYE              (the sender is done; also to its parent, its children and its Bruck peers)
//!   4 REPORT bytes     (what the host says about an abort or an error, at most REPORT_MAX bytes)
//! between Bruck peers (`Allgather::Bruck`), node i to node i - 2^round
//!   5 ROUND epoch:u32 round:u8 count:u32 count*(node:u32 len:u32 bytes)
//! ```
//!
//! Decoding never copies a part: [`Parts`] reads them in place from the shared frame, so that an ALL can
//! be passed on to the children and handed to the host without a second copy of the exchange.

use crate::codec::{FrameReader, FrameWriter, Malformed};
use std::fmt;
use std::sync::Arc;

/// A frame's payload, shared: a broadcast is encoded once and the same bytes go to every child.
pub type Bytes = Arc<Vec<u8>>;

/// The longest message text a FAIL carries; longer ones are cut.
pub const MESSAGE_MAX: usize = 4096;
/// The longest REPORT.
pub const REPORT_MAX: usize = 16 * 1024;
/// The largest frame of any kind but CONTRIB and ALL (a REPORT is the largest of them).
pub const CONTROL_MAX: usize = 1 + REPORT_MAX;
/// The largest payload the transport's `u32` length can announce.
pub const FRAME_MAX: usize = u32::MAX as usize;

const CONTRIB: u8 = 1;
const LOST: u8 = 2;
const BYE: u8 = 3;
const REPORT: u8 = 4;
const ROUND: u8 = 5;
const ALL: u8 = 0x81;
const FAIL: u8 = 0x82;
const END: u8 = 0x83;

/// A decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// Parts of exchange `epoch`, from a node to its parent: its own and its subtree's, in node order.
    Contrib { epoch: u32, parts: Parts },
    /// Exchange `epoch` is complete: every node's part, in node order.
    All { epoch: u32, parts: Parts },
    /// Round `round` of Bruck's allgather of exchange `epoch`: the parts the sender holds, from its own on.
    Round { epoch: u32, round: u8, parts: Parts },
    /// Exchange `epoch` failed; `message` says why.
    Fail { epoch: u32, message: String },
    /// The sender's child `node` closed its connection without saying BYE.
    Lost { node: u32 },
    /// The sender is done: its connections closing later is normal.
    Bye,
    /// An abort or error report, encoded by the host, for the root's host.
    Report(Vec<u8>),
    /// The root is done with the job.
    End,
}

/// What a frame is, for messages: "parts of PMI exchange 3".
impl fmt::Display for Frame {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Frame::Contrib { epoch, .. } => write!(f, "parts of PMI exchange {epoch}"),
            Frame::All { epoch, .. } => write!(f, "the result of PMI exchange {epoch}"),
            Frame::Round { epoch, round, .. } => write!(f, "round {round} of PMI exchange {epoch}"),
            Frame::Fail { epoch, .. } => write!(f, "a failure of PMI exchange {epoch}"),
            Frame::Lost { node } => write!(f, "a report that node {node} was lost"),
            Frame::Bye => f.write_str("a goodbye"),
            Frame::Report(_) => f.write_str("a report"),
            Frame::End => f.write_str("the end of the job"),
        }
    }
}

/// Why a payload is not a frame the receiver takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeError {
    /// Not a frame of this protocol: unknown kind, truncated, lengths that do not add up.
    Malformed(String),
    /// A part longer than the receiver's bound on one node's part.
    PartTooLarge { node: u32, len: usize },
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::Malformed(why) => write!(f, "a malformed frame ({why})"),
            DecodeError::PartTooLarge { node, len } => write!(f, "a part of {len} bytes for node {node}"),
        }
    }
}

impl From<Malformed> for DecodeError {
    fn from(m: Malformed) -> DecodeError {
        DecodeError::Malformed(m.0)
    }
}

/// A frame too large to encode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooLarge {
    pub len: usize,
    pub max: usize,
}

impl fmt::Display for TooLarge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a frame of {} bytes, more than the {} a frame may hold", self.len, self.max)
    }
}

impl std::error::Error for TooLarge {}

/// The parts of a CONTRIB or ALL, read in place from the frame they came in.
#[derive(Clone)]
pub struct Parts {
    frame: Bytes,
    /// Where the first part starts in the frame.
    start: usize,
    count: u32,
    bytes: usize,
    /// The first part whose node is not its place, and that node.
    misplaced: Option<(u32, u32)>,
}

impl Parts {
    /// How many parts.
    pub fn len(&self) -> usize {
        self.count as usize
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The parts' bytes, all together (without the frame's own).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Every part as (node, bytes), in the frame's order.
    pub fn iter(&self) -> PartsIter<'_> {
        PartsIter { frame: &self.frame, at: self.start, left: self.count }
    }

    /// Every part's node, in the frame's order.
    pub fn nodes(&self) -> Nodes<'_> {
        Nodes(self.iter())
    }

    /// The first part whose node is not its place (the ALL's order: part i is node i's), and that node.
    /// Known from decoding, so a node checks an ALL of N parts in one pass, not two.
    pub fn misplaced(&self) -> Option<(u32, u32)> {
        self.misplaced
    }

    /// The frame the parts are read from.
    pub fn frame(&self) -> &Bytes {
        &self.frame
    }
}

impl PartialEq for Parts {
    fn eq(&self, other: &Parts) -> bool {
        self.iter().eq(other.iter())
    }
}

impl Eq for Parts {}

impl fmt::Debug for Parts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Parts({} parts, {} bytes)", self.count, self.bytes)
    }
}

/// The parts of a [`Parts`], in order.
#[derive(Clone)]
pub struct PartsIter<'a> {
    frame: &'a [u8],
    /// Where the next part starts.
    at: usize,
    left: u32,
}

impl PartsIter<'_> {
    /// Steps over the next part: its node and where its bytes are.
    #[inline(always)]
    fn step(&mut self) -> Option<(u32, usize, usize)> {
        let part = if self.left == 0 { None } else { self.read() };
        match part {
            Some(part) => {
                self.left -= 1;
                self.at = part.2;
            }
            None => self.left = 0,
        }
        part
    }

    /// The next part's node, start and end. The frame was checked when decoded, so this cannot fall short,
    /// but it is not trusted to.
    #[inline(always)]
    fn read(&self) -> Option<(u32, usize, usize)> {
        let node = be32(self.frame, self.at)?;
        let len = be32(self.frame, self.at + 4)? as usize;
        let start = self.at + 8;
        let end = start.checked_add(len).filter(|&end| end <= self.frame.len())?;
        Some((node, start, end))
    }
}

impl<'a> Iterator for PartsIter<'a> {
    type Item = (u32, &'a [u8]);

    fn next(&mut self) -> Option<(u32, &'a [u8])> {
        let (node, start, end) = self.step()?;
        Some((node, self.frame.get(start..end)?))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left as usize, Some(self.left as usize))
    }
}

impl ExactSizeIterator for PartsIter<'_> {}

/// The nodes of a [`Parts`], in order: what checking a frame's order needs, without its bytes.
#[derive(Clone)]
pub struct Nodes<'a>(PartsIter<'a>);

impl Iterator for Nodes<'_> {
    type Item = u32;

    fn next(&mut self) -> Option<u32> {
        let (node, _, _) = self.0.step()?;
        Some(node)
    }
}

impl Frame {
    /// Decodes `payload`, refusing a part longer than `part_max`. Every length is checked against the bytes
    /// present before it is used; nothing is allocated for parts (they stay in `payload`) and a message or
    /// report is bounded before it is copied.
    pub fn decode(payload: &Bytes, part_max: usize) -> Result<Frame, DecodeError> {
        let mut r = FrameReader::new(payload);
        let kind = r.u8()?;
        let frame = match kind {
            CONTRIB | ALL => {
                let epoch = r.u32()?;
                // Each part takes at least 8 bytes.
                let count = r.count(8, "parts")?;
                let start = payload.len() - r.len();
                let (bytes, misplaced) = parts(&mut r, count, part_max)?;
                let parts = Parts { frame: payload.clone(), start, count, bytes, misplaced };
                if kind == CONTRIB {
                    Frame::Contrib { epoch, parts }
                } else {
                    Frame::All { epoch, parts }
                }
            }
            ROUND => {
                let epoch = r.u32()?;
                let round = r.u8()?;
                let count = r.count(8, "parts")?;
                let start = payload.len() - r.len();
                let (bytes, misplaced) = parts(&mut r, count, part_max)?;
                Frame::Round { epoch, round, parts: Parts { frame: payload.clone(), start, count, bytes, misplaced } }
            }
            FAIL => Frame::Fail { epoch: r.u32()?, message: r.text(MESSAGE_MAX, "a message")? },
            LOST => Frame::Lost { node: r.u32()? },
            BYE => Frame::Bye,
            REPORT => Frame::Report(r.rest_max(REPORT_MAX, "a report")?.to_vec()),
            END => Frame::End,
            k => return Err(malformed(format!("unknown kind {k}"))),
        };
        r.end()?;
        Ok(frame)
    }
}

/// The payload length of a CONTRIB or ALL of `count` parts holding `bytes` bytes in all.
pub fn parts_len(count: usize, bytes: usize) -> usize {
    count.saturating_mul(8).saturating_add(bytes).saturating_add(9)
}

/// A CONTRIB of `parts`, (node, bytes) each.
pub fn contrib<'a>(
    epoch: u32,
    parts: impl ExactSizeIterator<Item = (u32, &'a [u8])> + Clone,
) -> Result<Bytes, TooLarge> {
    parts_frame(CONTRIB, epoch, None, parts)
}

/// An ALL of `parts`, (node, bytes) each.
pub fn all<'a>(epoch: u32, parts: impl ExactSizeIterator<Item = (u32, &'a [u8])> + Clone) -> Result<Bytes, TooLarge> {
    parts_frame(ALL, epoch, None, parts)
}

/// The payload length of a ROUND of `count` parts holding `bytes` bytes in all.
pub fn round_len(count: usize, bytes: usize) -> usize {
    parts_len(count, bytes).saturating_add(1)
}

/// Round `round` of exchange `epoch` in Bruck's allgather, carrying `parts`, (node, bytes) each.
pub fn round<'a>(
    epoch: u32,
    round: u8,
    parts: impl ExactSizeIterator<Item = (u32, &'a [u8])> + Clone,
) -> Result<Bytes, TooLarge> {
    parts_frame(ROUND, epoch, Some(round), parts)
}

fn parts_frame<'a>(
    kind: u8,
    epoch: u32,
    round: Option<u8>,
    parts: impl ExactSizeIterator<Item = (u32, &'a [u8])> + Clone,
) -> Result<Bytes, TooLarge> {
    let count = parts.len();
    let bytes = parts.clone().map(|(_, b)| b.len()).fold(0usize, usize::saturating_add);
    let len = parts_len(count, bytes).saturating_add(usize::from(round.is_some()));
    if len > FRAME_MAX {
        return Err(TooLarge { len, max: FRAME_MAX });
    }
    // The frame's length fits a u32, so the count and every part's length do too.
    let too_large = TooLarge { len, max: FRAME_MAX };
    let mut f = FrameWriter::with_capacity(len);
    f.u8(kind).u32(epoch);
    if let Some(round) = round {
        f.u8(round);
    }
    f.len32(count).ok_or(too_large)?;
    for (node, part) in parts {
        f.u32(node).prefixed32(part).ok_or(too_large)?;
    }
    Ok(Arc::new(f.into_vec()))
}

/// A FAIL of exchange `epoch`, its message cut to [`MESSAGE_MAX`] bytes at a character boundary.
pub fn fail(epoch: u32, message: &str) -> Bytes {
    let mut f = FrameWriter::new();
    f.u8(FAIL).u32(epoch).text(message, MESSAGE_MAX);
    Arc::new(f.into_vec())
}

pub fn lost(node: u32) -> Bytes {
    let mut f = FrameWriter::with_capacity(5);
    f.u8(LOST).u32(node);
    Arc::new(f.into_vec())
}

pub fn bye() -> Bytes {
    Arc::new(vec![BYE])
}

/// Whether `frame` is a goodbye, without decoding it.
pub fn is_bye(frame: &[u8]) -> bool {
    frame == [BYE]
}

/// Whether `frame` is a CONTRIB: a node's parts going up.
pub fn is_contrib(frame: &[u8]) -> bool {
    frame.first() == Some(&CONTRIB)
}

/// Whether `frame` is a FAIL.
pub fn is_fail(frame: &[u8]) -> bool {
    frame.first() == Some(&FAIL)
}

/// Whether `frame` is an ALL: an exchange's result coming down.
pub fn is_all(frame: &[u8]) -> bool {
    frame.first() == Some(&ALL)
}

pub fn end() -> Bytes {
    Arc::new(vec![END])
}

/// A REPORT of the host's `bytes`, at most [`REPORT_MAX`] of them.
pub fn report(bytes: &[u8]) -> Result<Bytes, TooLarge> {
    if bytes.len() > REPORT_MAX {
        return Err(TooLarge { len: 1 + bytes.len(), max: CONTROL_MAX });
    }
    let mut f = FrameWriter::with_capacity(1 + bytes.len());
    f.u8(REPORT).bytes(bytes);
    Ok(Arc::new(f.into_vec()))
}

/// The big-endian `u32` at `at` in `b`, if it is all there. Inlined even without optimization: every
/// node reads every node's part header with it, N² reads per exchange when one process simulates N nodes.
#[inline(always)]
pub(super) fn be32(b: &[u8], at: usize) -> Option<u32> {
    if at > b.len().saturating_sub(4) || b.len() < 4 {
        return None;
    }
    Some((b[at] as u32) << 24 | (b[at + 1] as u32) << 16 | (b[at + 2] as u32) << 8 | b[at + 3] as u32)
}

fn malformed(why: String) -> DecodeError {
    DecodeError::Malformed(why)
}

/// Checks the `count` parts at the front of `r` and returns their bytes in all and the first part not in
/// its place. (Reads by index: this runs once per node for every node's part of every exchange.)
fn parts(r: &mut FrameReader, count: u32, part_max: usize) -> Result<(usize, Option<(u32, u32)>), DecodeError> {
    let b = r.unread();
    let (mut at, mut bytes, mut misplaced) = (0, 0usize, None);
    for place in 0..count {
        let (Some(node), Some(len)) = (be32(b, at), be32(b, at + 4)) else {
            return Err(malformed(format!("a part cut short at byte {at} of {}", b.len())));
        };
        let len = len as usize;
        at += 8;
        if len > b.len() - at {
            return Err(malformed(format!("a part of {len} bytes in the {} left", b.len() - at)));
        }
        if len > part_max {
            return Err(DecodeError::PartTooLarge { node, len });
        }
        at += len;
        bytes += len;
        if node != place && misplaced.is_none() {
            misplaced = Some((place, node));
        }
    }
    r.take(at)?;
    Ok((bytes, misplaced))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PART_MAX: usize = 1000;

    fn decode(payload: &[u8]) -> Result<Frame, DecodeError> {
        Frame::decode(&Arc::new(payload.to_vec()), PART_MAX)
    }

    fn parts_of(frame: &Frame) -> Vec<(u32, Vec<u8>)> {
        match frame {
            Frame::Contrib { parts, .. } | Frame::All { parts, .. } | Frame::Round { parts, .. } => {
                parts.iter().map(|(n, b)| (n, b.to_vec())).collect()
            }
            _ => panic!("no parts in {frame:?}"),
        }
    }

    fn sample_frames() -> Vec<Bytes> {
        let parts = [(3u32, &b"abc"[..]), (5, b""), (9, &[7; 300][..])];
        vec![
            contrib(4, parts.iter().copied()).unwrap(),
            all(7, parts.iter().copied()).unwrap(),
            fail(2, "node 3 was lost"),
            lost(12),
            bye(),
            report(b"rank 4 called PMI_Abort").unwrap(),
            end(),
            round(6, 2, parts.iter().copied()).unwrap(),
        ]
    }

    #[test]
    fn every_frame_round_trips() {
        let parts = [(3u32, &b"abc"[..]), (5, b""), (9, &[7; 300][..])];
        let want: Vec<(u32, Vec<u8>)> = parts.iter().map(|(n, b)| (*n, b.to_vec())).collect();
        let f = sample_frames();
        let Frame::Contrib { epoch: 4, parts: p } = Frame::decode(&f[0], PART_MAX).unwrap() else { panic!() };
        assert_eq!((p.len(), p.bytes()), (3, 303));
        assert!(Arc::ptr_eq(p.frame(), &f[0]), "the parts are read in place");
        assert_eq!(parts_of(&Frame::decode(&f[0], PART_MAX).unwrap()), want);
        let result = Frame::decode(&f[1], PART_MAX).unwrap();
        assert!(matches!(result, Frame::All { epoch: 7, .. }));
        assert_eq!(parts_of(&result), want);
        assert_eq!(f[1].len(), parts_len(3, 303));
        assert_eq!(Frame::decode(&f[2], PART_MAX), Ok(Frame::Fail { epoch: 2, message: "node 3 was lost".into() }));
        assert_eq!(Frame::decode(&f[3], PART_MAX), Ok(Frame::Lost { node: 12 }));
        assert_eq!(Frame::decode(&f[4], PART_MAX), Ok(Frame::Bye));
        assert_eq!(Frame::decode(&f[5], PART_MAX), Ok(Frame::Report(b"rank 4 called PMI_Abort".to_vec())));
        assert_eq!(Frame::decode(&f[6], PART_MAX), Ok(Frame::End));
        let sideways = Frame::decode(&f[7], PART_MAX).unwrap();
        assert!(matches!(sideways, Frame::Round { epoch: 6, round: 2, .. }));
        assert_eq!(parts_of(&sideways), want);
        assert_eq!(f[7].len(), round_len(3, 303));
        let empty = all(0, std::iter::empty()).unwrap();
        assert!(matches!(Frame::decode(&empty, 0), Ok(Frame::All { parts, .. }) if parts.is_empty()));
    }

    #[test]
    fn truncated_frames_are_refused() {
        for f in sample_frames() {
            let whole = Frame::decode(&f, PART_MAX).unwrap();
            for cut in 0..f.len() {
                let short = decode(&f[..cut]);
                // A shorter report or message is still a report or message; nothing else is.
                let still = matches!(
                    (&whole, &short),
                    (Frame::Report(_), Ok(Frame::Report(_))) | (Frame::Fail { .. }, Ok(Frame::Fail { .. }))
                );
                assert!(short.is_err() || still, "{whole:?} cut to {cut} bytes: {short:?}");
            }
            let mut long = f.to_vec();
            long.push(0);
            let longer = decode(&long);
            assert!(longer.is_err() || matches!(longer, Ok(Frame::Report(_) | Frame::Fail { .. })), "{longer:?}");
        }
    }

    #[test]
    fn lengths_that_lie_are_refused_before_anything_is_allocated() {
        // A count the frame cannot hold.
        assert!(decode(&[ALL, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]).is_err());
        // A part longer than what is left, and longer than anything.
        assert!(decode(&[CONTRIB, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 9, 1]).is_err());
        assert!(decode(&[CONTRIB, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 2, 0xff, 0xff, 0xff, 0xff]).is_err());
        // A part over the receiver's bound, present or not.
        let big = contrib(0, std::iter::once((6, &[0u8; PART_MAX + 1][..]))).unwrap();
        assert_eq!(Frame::decode(&big, PART_MAX), Err(DecodeError::PartTooLarge { node: 6, len: PART_MAX + 1 }));
        assert!(Frame::decode(&big, PART_MAX + 1).is_ok());
        // Texts longer than any encoder writes.
        let mut f = vec![FAIL, 0, 0, 0, 1];
        f.extend(std::iter::repeat_n(b'x', MESSAGE_MAX + 1));
        assert!(decode(&f).is_err());
        let mut r = vec![REPORT];
        r.extend(std::iter::repeat_n(b'x', REPORT_MAX + 1));
        assert!(decode(&r).is_err());
        assert_eq!(report(&r[1..]), Err(TooLarge { len: REPORT_MAX + 2, max: CONTROL_MAX }));
        // Unknown kinds and trailing bytes.
        assert!(decode(&[]).is_err());
        assert!(decode(&[0x42]).is_err());
        assert!(decode(&[BYE, 0]).is_err());
        assert!(decode(&[END, 0]).is_err());
        assert!(decode(&[LOST, 0, 0, 0, 1, 0]).is_err());
    }

    #[test]
    fn garbage_never_panics() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let kinds = [CONTRIB, ALL, ROUND, FAIL, LOST, BYE, REPORT, END, 0, 0xff];
        for _ in 0..20_000 {
            let len = (next() % 48) as usize;
            let mut f: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            if let Some(first) = f.first_mut() {
                *first = kinds[(next() % kinds.len() as u64) as usize];
            }
            // Small counts, nodes and lengths, so that some frames add up.
            for (i, b) in f.iter_mut().enumerate().skip(5) {
                *b = if (i - 5) % 4 < 3 { 0 } else { *b & 7 };
            }
            if let Ok(frame @ (Frame::Contrib { .. } | Frame::All { .. } | Frame::Round { .. })) = decode(&f) {
                assert!(parts_of(&frame).iter().all(|(_, b)| b.len() <= PART_MAX));
            }
        }
    }

    #[test]
    fn long_messages_are_cut_at_a_character() {
        let f = fail(1, &"é".repeat(MESSAGE_MAX));
        let Ok(Frame::Fail { message, .. }) = Frame::decode(&f, 0) else { panic!() };
        assert_eq!(message.len(), MESSAGE_MAX);
        assert!(message.chars().all(|c| c == 'é'));
        // Bytes that are not UTF-8 grow when decoded; the text is cut the same way.
        let mut bad = vec![FAIL, 0, 0, 0, 1];
        bad.extend(std::iter::repeat_n(0xff, MESSAGE_MAX));
        let Ok(Frame::Fail { message, .. }) = decode(&bad) else { panic!() };
        assert_eq!(message, "\u{fffd}".repeat(MESSAGE_MAX / 3));
    }
}

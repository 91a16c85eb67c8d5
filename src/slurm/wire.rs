//! The TCP protocol between each node's slurmstepd and the collective root in srun.
//!
//! Every message is a frame: a `u32` big-endian payload length, then the payload, whose first byte is the
//! message kind. Integers are big-endian. A connection starts with the handshake of [`super::auth`]
//! (HELLO, CHALLENGE, PROOF, WELCOME); nothing else is accepted before it completes.
//!
//! ```text
//! stepd -> root                                          root -> stepd
//!   1 HELLO    "RPMI" version:u16 node:u32 nonce:[32]      0x84 CHALLENGE nonce:[32]
//!   7 PROOF    mac:[32]                                    0x85 WELCOME   mac:[32] (the root's proof)
//!   2 CONTRIB  epoch:u32 count:u32 count*(node:u32 len:u32 bytes)
//!                                                          0x81 ALL  epoch:u32 count:u32 count*(node:u32 len:u32 bytes)
//!   3 ABORT    rank:u32 code:i32 message                   0x82 FAIL epoch:u32 message
//!   4 ERROR    rank:u32 failed:u8 message  (a job error the shell reported; failed=1 if a task failed
//!                                          on its own, 0 if rpmi ends the job though none did)
//!   5 GONE     rank:u32               (a task closed its connection without finalize)
//!   6 BYE                             (every local task has closed its connection: a normal end)
//!                                                          0x83 END  (srun is done with the step: the close
//!                                                                     that follows is the normal end)
//! ```
//!
//! A CONTRIB carries a list of (node, bytes) parts, not one, so that an interior stepd of a future tree can
//! forward its subtree's parts in one frame; today every stepd sends only its own part.
//!
//! Sizes are bounded on both sides: a message text at most [`MESSAGE_MAX`] bytes (longer ones are cut when
//! encoded), every other frame at most what its receiver accepts ([`FrameBuf::next`]); every length is
//! checked before it is written as a `u32`.

use super::auth::{Nonce, Proof, NONCE_LEN, PROOF_LEN};
use std::fmt;

/// The protocol version in HELLO (1 sent the secret itself; 2 is the challenge-response).
pub const VERSION: u16 = 2;
/// The payload length of HELLO and of PROOF: the only frames a root accepts before authentication.
pub const HELLO_LEN: usize = 1 + 4 + 2 + 4 + NONCE_LEN;
pub const PROOF_LEN_ON_WIRE: usize = 1 + PROOF_LEN;
/// The longest message text (abort, error, failure) a frame carries; longer ones are cut.
pub const MESSAGE_MAX: usize = 4096;
/// The largest frame of any kind but CONTRIB and ALL.
pub const CONTROL_MAX: usize = 16 + MESSAGE_MAX;

const MAGIC: &[u8; 4] = b"RPMI";

const HELLO: u8 = 1;
const CONTRIB: u8 = 2;
const ABORT: u8 = 3;
const ERROR: u8 = 4;
const GONE: u8 = 5;
const BYE: u8 = 6;
const PROOF: u8 = 7;
const ALL: u8 = 0x81;
const FAIL: u8 = 0x82;
const END: u8 = 0x83;
const CHALLENGE: u8 = 0x84;
const WELCOME: u8 = 0x85;

/// A message from a stepd to the root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToRoot {
    Hello {
        node: u32,
        nonce: Nonce,
    },
    Proof {
        proof: Proof,
    },
    Contrib {
        epoch: u32,
        parts: Vec<(u32, Vec<u8>)>,
    },
    Abort {
        rank: u32,
        code: i32,
        message: String,
    },
    /// A job error; `task_failed` if a task failed on its own (its status explains the end), not if rpmi
    /// ends a job none of whose tasks failed (a protocol error).
    Error {
        rank: u32,
        task_failed: bool,
        message: String,
    },
    Gone {
        rank: u32,
    },
    Bye,
}

/// A message from the root to a stepd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FromRoot {
    /// The root's nonce, in answer to HELLO.
    Challenge { nonce: Nonce },
    /// The stepd's proof was right: it is admitted, and this is the root's own proof.
    Welcome { proof: Proof },
    /// The collective of `epoch` finished: every node's part.
    All { epoch: u32, parts: Vec<(u32, Vec<u8>)> },
    /// The collective of `epoch` failed.
    Fail { epoch: u32, message: String },
    /// srun is done with the step: the connection closing next is the normal end, not srun's death.
    End,
}

/// A frame that does not decode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Malformed(pub String);

impl fmt::Display for Malformed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "malformed frame: {}", self.0)
    }
}

/// Why the next frame cannot be taken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameError {
    /// Its length prefix announces more than the receiver accepts.
    TooLarge { len: usize, max: usize },
}

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FrameError::TooLarge { len, max } => write!(f, "a frame of {len} bytes (at most {max} accepted here)"),
        }
    }
}

/// A frame too large for its `u32` length field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TooLarge(pub usize);

impl fmt::Display for TooLarge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a frame of {} bytes does not fit the protocol's 32-bit length", self.0)
    }
}

/// A frame of kind `kind` whose payload is `fields`, one after the other.
fn frame(kind: u8, fields: &[&[u8]]) -> Result<Vec<u8>, TooLarge> {
    let len = 1 + fields.iter().map(|f| f.len()).sum::<usize>();
    let mut f = Vec::with_capacity(4 + len);
    f.extend_from_slice(&u32::try_from(len).map_err(|_| TooLarge(4 + len))?.to_be_bytes());
    f.push(kind);
    fields.iter().for_each(|field| f.extend_from_slice(field));
    Ok(f)
}

/// A control frame: its size is bounded by [`CONTROL_MAX`] (texts are cut to [`MESSAGE_MAX`]), so it always
/// fits.
fn control(kind: u8, fields: &[&[u8]]) -> Vec<u8> {
    frame(kind, fields).unwrap_or_default()
}

/// A frame of `parts`, (node, bytes) each, for exchange `epoch`: CONTRIB or ALL.
fn parts_frame<'a>(
    kind: u8,
    epoch: u32,
    parts: impl ExactSizeIterator<Item = (u32, &'a [u8])> + Clone,
) -> Result<Vec<u8>, TooLarge> {
    let count = parts.len();
    let bytes = parts.clone().map(|(_, b)| b.len()).fold(0usize, usize::saturating_add);
    let len = all_len(count, bytes) - 4;
    let mut f = Vec::with_capacity(4 + len);
    f.extend_from_slice(&u32::try_from(len).map_err(|_| TooLarge(4 + len))?.to_be_bytes());
    f.push(kind);
    f.extend_from_slice(&epoch.to_be_bytes());
    f.extend_from_slice(&(count as u32).to_be_bytes());
    for (node, part) in parts {
        f.extend_from_slice(&node.to_be_bytes());
        // Each part is shorter than the whole, which fits (checked above).
        f.extend_from_slice(&(part.len() as u32).to_be_bytes());
        f.extend_from_slice(part);
    }
    Ok(f)
}

/// A message text cut to [`MESSAGE_MAX`] bytes (at a character boundary).
fn cut(text: &str) -> &[u8] {
    &text.as_bytes()[..text_end(text)]
}

/// The length of `text` cut to [`MESSAGE_MAX`] bytes (at a character boundary).
fn text_end(text: &str) -> usize {
    let mut end = text.len().min(MESSAGE_MAX);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    end
}

/// A CONTRIB frame with one part, built without copying the bytes twice.
pub fn contrib(epoch: u32, node: u32, bytes: &[u8]) -> Result<Vec<u8>, TooLarge> {
    parts_frame(CONTRIB, epoch, std::iter::once((node, bytes)))
}

/// An ALL frame over `parts` (sent, the same bytes, to every node).
pub fn all<'a>(epoch: u32, parts: impl ExactSizeIterator<Item = (u32, &'a [u8])> + Clone) -> Result<Vec<u8>, TooLarge> {
    parts_frame(ALL, epoch, parts)
}

/// The bytes an ALL frame of `parts` parts holding `bytes` bytes in all takes, length prefix included.
pub fn all_len(parts: usize, bytes: usize) -> usize {
    4 + 1 + 4 + 4 + parts.saturating_mul(8).saturating_add(bytes)
}

impl ToRoot {
    /// The whole frame, length prefix included.
    pub fn encode(&self) -> Result<Vec<u8>, TooLarge> {
        Ok(match self {
            ToRoot::Hello { node, nonce } => {
                control(HELLO, &[MAGIC, &VERSION.to_be_bytes(), &node.to_be_bytes(), nonce])
            }
            ToRoot::Proof { proof } => control(PROOF, &[proof]),
            ToRoot::Contrib { epoch, parts } => {
                parts_frame(CONTRIB, *epoch, parts.iter().map(|(n, b)| (*n, b.as_slice())))?
            }
            ToRoot::Abort { rank, code, message } => {
                control(ABORT, &[&rank.to_be_bytes(), &code.to_be_bytes(), cut(message)])
            }
            ToRoot::Error { rank, task_failed, message } => {
                control(ERROR, &[&rank.to_be_bytes(), &[u8::from(*task_failed)], cut(message)])
            }
            ToRoot::Gone { rank } => control(GONE, &[&rank.to_be_bytes()]),
            ToRoot::Bye => control(BYE, &[]),
        })
    }

    /// Decodes a payload (without its length prefix).
    pub fn decode(payload: &[u8]) -> Result<ToRoot, Malformed> {
        let mut r = Reader(payload);
        let m = match r.u8()? {
            HELLO => {
                if r.take(4)? != MAGIC {
                    return Err(Malformed("not an rpmi HELLO".into()));
                }
                let version = r.u16()?;
                if version != VERSION {
                    return Err(Malformed(format!("protocol version {version}, expected {VERSION}")));
                }
                ToRoot::Hello { node: r.u32()?, nonce: r.array()? }
            }
            PROOF => ToRoot::Proof { proof: r.array()? },
            CONTRIB => ToRoot::Contrib { epoch: r.u32()?, parts: r.parts()? },
            ABORT => ToRoot::Abort { rank: r.u32()?, code: r.u32()? as i32, message: r.rest_text()? },
            ERROR => ToRoot::Error {
                rank: r.u32()?,
                task_failed: match r.u8()? {
                    0 => false,
                    1 => true,
                    b => return Err(Malformed(format!("an error whose cause is {b}"))),
                },
                message: r.rest_text()?,
            },
            GONE => ToRoot::Gone { rank: r.u32()? },
            BYE => ToRoot::Bye,
            k => return Err(Malformed(format!("unknown kind {k}"))),
        };
        r.end()?;
        Ok(m)
    }
}

impl FromRoot {
    /// The whole frame, length prefix included.
    pub fn encode(&self) -> Result<Vec<u8>, TooLarge> {
        Ok(match self {
            FromRoot::Challenge { nonce } => control(CHALLENGE, &[nonce]),
            FromRoot::Welcome { proof } => control(WELCOME, &[proof]),
            FromRoot::All { epoch, parts } => all(*epoch, parts.iter().map(|(n, b)| (*n, b.as_slice())))?,
            FromRoot::Fail { epoch, message } => control(FAIL, &[&epoch.to_be_bytes(), cut(message)]),
            FromRoot::End => control(END, &[]),
        })
    }

    /// Decodes a payload (without its length prefix).
    pub fn decode(payload: &[u8]) -> Result<FromRoot, Malformed> {
        let mut r = Reader(payload);
        let m = match r.u8()? {
            CHALLENGE => FromRoot::Challenge { nonce: r.array()? },
            WELCOME => FromRoot::Welcome { proof: r.array()? },
            ALL => FromRoot::All { epoch: r.u32()?, parts: r.parts()? },
            FAIL => FromRoot::Fail { epoch: r.u32()?, message: r.rest_text()? },
            END => FromRoot::End,
            k => return Err(Malformed(format!("unknown kind {k}"))),
        };
        r.end()?;
        Ok(m)
    }
}

/// Splits whole frames off the front of a receive buffer.
#[derive(Default)]
pub struct FrameBuf {
    buf: Vec<u8>,
    /// Bytes at the front already handed out.
    used: usize,
}

impl FrameBuf {
    /// Appends received bytes.
    pub fn extend(&mut self, bytes: &[u8]) {
        if self.used > 0 && self.used == self.buf.len() {
            self.buf.clear();
            self.used = 0;
        }
        self.buf.extend_from_slice(bytes);
    }

    /// The length the next frame's prefix announces, once its 4 bytes have come.
    pub fn announced(&self) -> Option<usize> {
        let rest = &self.buf[self.used..];
        rest.get(..4).map(|p| u32::from_be_bytes([p[0], p[1], p[2], p[3]]) as usize)
    }

    /// The next whole frame's payload, `Ok(None)` if it has not all come yet, or an error if the length
    /// prefix announces more than `max` bytes (checked before anything of the frame is kept).
    pub fn next(&mut self, max: usize) -> Result<Option<&[u8]>, FrameError> {
        let Some(len) = self.announced() else {
            self.compact();
            return Ok(None);
        };
        if len > max {
            return Err(FrameError::TooLarge { len, max });
        }
        if self.buf.len() - self.used < 4 + len {
            self.compact();
            return Ok(None);
        }
        let start = self.used + 4;
        self.used = start + len;
        Ok(Some(&self.buf[start..start + len]))
    }

    /// Frees the buffer once every frame in it was handed out: after a fence it holds a whole exchange,
    /// which must not stay allocated beside the key-value store until the next one.
    pub fn release(&mut self) {
        if self.used == self.buf.len() {
            *self = FrameBuf::default();
        }
    }

    /// Bytes received and not yet handed out.
    pub fn pending(&self) -> usize {
        self.buf.len() - self.used
    }

    /// Drops what was handed out, so a long stream of frames does not grow the buffer.
    fn compact(&mut self) {
        if self.used > 0 {
            self.buf.drain(..self.used);
            self.used = 0;
        }
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Malformed> {
        if self.0.len() < n {
            return Err(Malformed(format!("{} bytes where {n} were expected", self.0.len())));
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], Malformed> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, Malformed> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, Malformed> {
        Ok(u16::from_be_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32, Malformed> {
        Ok(u32::from_be_bytes(self.array()?))
    }
    fn parts(&mut self) -> Result<Vec<(u32, Vec<u8>)>, Malformed> {
        let count = self.u32()? as usize;
        // Each part takes at least 8 bytes: a count beyond that is a lie, not a reason to allocate.
        if count > self.0.len() / 8 {
            return Err(Malformed(format!("{count} parts in {} bytes", self.0.len())));
        }
        let mut parts = Vec::with_capacity(count);
        for _ in 0..count {
            let node = self.u32()?;
            let len = self.u32()? as usize;
            parts.push((node, self.take(len)?.to_vec()));
        }
        Ok(parts)
    }
    fn rest_text(&mut self) -> Result<String, Malformed> {
        let rest = std::mem::take(&mut self.0);
        if rest.len() > MESSAGE_MAX {
            return Err(Malformed(format!("a message of {} bytes (at most {MESSAGE_MAX})", rest.len())));
        }
        // Every byte that is not UTF-8 becomes U+FFFD, 3 bytes: the text is cut as an encoder cuts it.
        let mut text = String::from_utf8_lossy(rest).into_owned();
        text.truncate(text_end(&text));
        Ok(text)
    }
    fn end(&self) -> Result<(), Malformed> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(Malformed(format!("{} bytes too many", self.0.len())))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn payload(frame: &[u8]) -> &[u8] {
        let len = u32::from_be_bytes(frame[..4].try_into().unwrap()) as usize;
        assert_eq!(frame.len(), 4 + len);
        &frame[4..]
    }

    #[test]
    fn every_message_round_trips() {
        for m in [
            ToRoot::Hello { node: 3, nonce: [7; NONCE_LEN] },
            ToRoot::Proof { proof: [9; PROOF_LEN] },
            ToRoot::Contrib { epoch: 9, parts: vec![(1, b"abc".to_vec()), (2, vec![])] },
            ToRoot::Abort { rank: 2, code: -7, message: "bye now".into() },
            ToRoot::Error { rank: 5, task_failed: true, message: "rank 5 went".into() },
            ToRoot::Error { rank: 6, task_failed: false, message: "bad line".into() },
            ToRoot::Gone { rank: 4 },
            ToRoot::Bye,
        ] {
            assert_eq!(ToRoot::decode(payload(&m.encode().unwrap())), Ok(m));
        }
        assert_eq!(payload(&ToRoot::Hello { node: 0, nonce: [0; NONCE_LEN] }.encode().unwrap()).len(), HELLO_LEN);
        assert_eq!(payload(&ToRoot::Proof { proof: [0; PROOF_LEN] }.encode().unwrap()).len(), PROOF_LEN_ON_WIRE);
        for m in [
            FromRoot::Challenge { nonce: [1; NONCE_LEN] },
            FromRoot::Welcome { proof: [2; PROOF_LEN] },
            FromRoot::All { epoch: 1, parts: vec![(0, b"x".to_vec()), (1, b"yz".to_vec())] },
            FromRoot::Fail { epoch: 2, message: "node n2 lost".into() },
            FromRoot::End,
        ] {
            assert_eq!(FromRoot::decode(payload(&m.encode().unwrap())), Ok(m));
        }
        assert_eq!(
            ToRoot::decode(payload(&contrib(4, 2, b"kv").unwrap())),
            Ok(ToRoot::Contrib { epoch: 4, parts: vec![(2, b"kv".to_vec())] })
        );
        let parts = [(0u32, &b"ab"[..]), (1, b"")];
        assert_eq!(all(0, parts.iter().copied()).unwrap().len(), all_len(2, 2));
    }

    #[test]
    fn garbage_is_refused() {
        assert!(ToRoot::decode(b"").is_err());
        assert!(ToRoot::decode(&[99]).is_err());
        assert!(ToRoot::decode(b"\x01HTTP/1.1 GET /").is_err());
        let mut hello = ToRoot::Hello { node: 0, nonce: [0; NONCE_LEN] }.encode().unwrap();
        hello.push(0);
        assert!(ToRoot::decode(&hello[4..]).is_err());
        // Version 1 (the secret in clear) is refused.
        let mut v1 = hello[4..hello.len() - 1].to_vec();
        v1[6] = 1;
        assert!(ToRoot::decode(&v1).unwrap_err().0.contains("version 1"));
        // A part count that the frame cannot hold.
        assert!(FromRoot::decode(&[ALL, 0, 0, 0, 1, 0xff, 0xff, 0xff, 0xff]).is_err());
        assert!(ToRoot::decode(&[CONTRIB, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 9, 1]).is_err());
        assert!(ToRoot::decode(&[BYE, 0]).is_err());
        // A message longer than any encoder writes.
        let mut abort = vec![ABORT, 0, 0, 0, 1, 0, 0, 0, 7];
        abort.extend(std::iter::repeat_n(b'x', MESSAGE_MAX + 1));
        assert!(ToRoot::decode(&abort).is_err());
    }

    #[test]
    fn long_messages_are_cut_at_a_character() {
        let message = "é".repeat(MESSAGE_MAX);
        let f = ToRoot::Abort { rank: 1, code: 2, message }.encode().unwrap();
        assert!(f.len() <= 4 + CONTROL_MAX);
        let ToRoot::Abort { message, .. } = ToRoot::decode(payload(&f)).unwrap() else { panic!() };
        assert_eq!(message.len(), MESSAGE_MAX);
        assert!(message.chars().all(|c| c == 'é'));
        // A text that is not UTF-8 grows when decoded (U+FFFD for each bad byte): it is cut the same way.
        let mut abort = vec![ABORT, 0, 0, 0, 1, 0, 0, 0, 2];
        abort.extend(std::iter::repeat_n(0xff, MESSAGE_MAX));
        let ToRoot::Abort { message, .. } = ToRoot::decode(&abort).unwrap() else { panic!() };
        assert_eq!(message, "\u{fffd}".repeat(MESSAGE_MAX / 3));
        let m = ToRoot::Abort { rank: 1, code: 2, message };
        assert_eq!(ToRoot::decode(payload(&m.encode().unwrap())), Ok(m));
    }

    #[test]
    fn frames_are_split_however_the_bytes_come() {
        let frames: Vec<u8> = [
            ToRoot::Gone { rank: 1 }.encode().unwrap(),
            ToRoot::Bye.encode().unwrap(),
            contrib(0, 1, &[5; 300]).unwrap(),
        ]
        .into_iter()
        .flatten()
        .collect();
        for chunk in [1, 3, 7, 1000] {
            let mut fb = FrameBuf::default();
            let mut got = Vec::new();
            for piece in frames.chunks(chunk) {
                fb.extend(piece);
                while let Some(p) = fb.next(CONTROL_MAX).unwrap() {
                    got.push(ToRoot::decode(p).unwrap());
                }
            }
            assert_eq!(got.len(), 3, "chunk {chunk}");
            assert_eq!(fb.pending(), 0);
        }
        let mut fb = FrameBuf::default();
        fb.extend(&[0, 0, 1, 0]);
        assert_eq!(fb.next(HELLO_LEN), Err(FrameError::TooLarge { len: 256, max: HELLO_LEN }));
        assert_eq!(fb.announced(), Some(256));
    }
}

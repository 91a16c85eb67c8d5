//! The TCP protocol between each node's slurmstepd and the collective root in srun.
//!
//! Every message is a frame: a `u32` big-endian payload length, then the payload, whose first byte is the
//! message kind. Integers are big-endian. A stepd's first frame must be [`ToRoot::Hello`] carrying the step's
//! secret; anything else, or a wrong secret, and the root closes the connection.
//!
//! ```text
//! stepd -> root                                    root -> stepd
//!   1 HELLO    "RPMI" version:u16 node:u32 secret:[32]   0x81 ALL  epoch:u32 count:u32 count*(node:u32 len:u32 bytes)
//!   2 CONTRIB  epoch:u32 count:u32 count*(node:u32 len:u32 bytes)
//!   3 ABORT    rank:u32 code:i32 message               0x82 FAIL epoch:u32 message
//!   4 ERROR    rank:u32 message       (a job error the shell reported)
//!   5 GONE     rank:u32               (a task closed its connection without finalize)   0x83 END  (srun is done
//!   6 BYE                             (every local task has closed its connection:          with the step:
//!                                      a normal end)                                         a normal close)
//! ```
//!
//! A CONTRIB carries a list of (node, bytes) parts, not one, so that an interior stepd of a future tree can
//! forward its subtree's parts in one frame; today every stepd sends only its own part.

use std::fmt;

/// Bytes of the per-step secret.
pub const SECRET_LEN: usize = 32;
/// The protocol version in HELLO.
pub const VERSION: u16 = 1;
/// The payload length of HELLO: the only frame accepted before authentication.
pub const HELLO_LEN: usize = 1 + 4 + 2 + 4 + SECRET_LEN;
/// The largest frame accepted after authentication (a shell's KVS is bounded well below this).
pub const FRAME_MAX: usize = 1 << 30;

const MAGIC: &[u8; 4] = b"RPMI";

const HELLO: u8 = 1;
const CONTRIB: u8 = 2;
const ABORT: u8 = 3;
const ERROR: u8 = 4;
const GONE: u8 = 5;
const BYE: u8 = 6;
const ALL: u8 = 0x81;
const FAIL: u8 = 0x82;
const END: u8 = 0x83;

/// A message from a stepd to the root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToRoot {
    Hello { node: u32, secret: [u8; SECRET_LEN] },
    Contrib { epoch: u32, parts: Vec<(u32, Vec<u8>)> },
    Abort { rank: u32, code: i32, message: String },
    Error { rank: u32, message: String },
    Gone { rank: u32 },
    Bye,
}

/// A message from the root to a stepd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FromRoot {
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

/// Starts a frame of kind `kind`; [`finish`] fills in the length.
fn start(kind: u8, capacity: usize) -> Vec<u8> {
    let mut f = Vec::with_capacity(5 + capacity);
    f.extend_from_slice(&[0, 0, 0, 0, kind]);
    f
}

fn finish(mut f: Vec<u8>) -> Vec<u8> {
    let len = (f.len() - 4) as u32;
    f[..4].copy_from_slice(&len.to_be_bytes());
    f
}

fn put_parts<'a>(f: &mut Vec<u8>, parts: impl ExactSizeIterator<Item = (u32, &'a [u8])>) {
    f.extend_from_slice(&(parts.len() as u32).to_be_bytes());
    for (node, bytes) in parts {
        f.extend_from_slice(&node.to_be_bytes());
        f.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
        f.extend_from_slice(bytes);
    }
}

/// A CONTRIB frame with one part, built without copying the message twice.
pub fn contrib(epoch: u32, node: u32, bytes: &[u8]) -> Vec<u8> {
    let mut f = start(CONTRIB, 16 + bytes.len());
    f.extend_from_slice(&epoch.to_be_bytes());
    put_parts(&mut f, std::iter::once((node, bytes)));
    finish(f)
}

/// An ALL frame over `parts` (sent, the same bytes, to every node).
pub fn all<'a>(epoch: u32, parts: impl ExactSizeIterator<Item = (u32, &'a [u8])>) -> Vec<u8> {
    let mut f = start(ALL, 8);
    f.extend_from_slice(&epoch.to_be_bytes());
    put_parts(&mut f, parts);
    finish(f)
}

impl ToRoot {
    /// The whole frame, length prefix included.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            ToRoot::Hello { node, secret } => {
                let mut f = start(HELLO, HELLO_LEN);
                f.extend_from_slice(MAGIC);
                f.extend_from_slice(&VERSION.to_be_bytes());
                f.extend_from_slice(&node.to_be_bytes());
                f.extend_from_slice(secret);
                finish(f)
            }
            ToRoot::Contrib { epoch, parts } => {
                let mut f = start(CONTRIB, 8);
                f.extend_from_slice(&epoch.to_be_bytes());
                put_parts(&mut f, parts.iter().map(|(n, b)| (*n, b.as_slice())));
                finish(f)
            }
            ToRoot::Abort { rank, code, message } => {
                let mut f = start(ABORT, 8 + message.len());
                f.extend_from_slice(&rank.to_be_bytes());
                f.extend_from_slice(&code.to_be_bytes());
                f.extend_from_slice(message.as_bytes());
                finish(f)
            }
            ToRoot::Error { rank, message } => {
                let mut f = start(ERROR, 4 + message.len());
                f.extend_from_slice(&rank.to_be_bytes());
                f.extend_from_slice(message.as_bytes());
                finish(f)
            }
            ToRoot::Gone { rank } => {
                let mut f = start(GONE, 4);
                f.extend_from_slice(&rank.to_be_bytes());
                finish(f)
            }
            ToRoot::Bye => finish(start(BYE, 0)),
        }
    }

    /// Decodes a payload (without its length prefix).
    pub fn decode(payload: &[u8]) -> Result<ToRoot, Malformed> {
        let mut r = Reader(payload);
        Ok(match r.u8()? {
            HELLO => {
                if r.take(4)? != MAGIC {
                    return Err(Malformed("not an rpmi HELLO".into()));
                }
                let version = r.u16()?;
                if version != VERSION {
                    return Err(Malformed(format!("protocol version {version}, expected {VERSION}")));
                }
                let node = r.u32()?;
                let secret = r.take(SECRET_LEN)?.try_into().expect("SECRET_LEN bytes");
                r.end()?;
                ToRoot::Hello { node, secret }
            }
            CONTRIB => {
                let epoch = r.u32()?;
                let parts = r.parts()?;
                ToRoot::Contrib { epoch, parts }
            }
            ABORT => ToRoot::Abort { rank: r.u32()?, code: r.u32()? as i32, message: r.rest_text() },
            ERROR => ToRoot::Error { rank: r.u32()?, message: r.rest_text() },
            GONE => {
                let rank = r.u32()?;
                r.end()?;
                ToRoot::Gone { rank }
            }
            BYE => {
                r.end()?;
                ToRoot::Bye
            }
            k => return Err(Malformed(format!("unknown kind {k}"))),
        })
    }
}

impl FromRoot {
    /// The whole frame, length prefix included.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            FromRoot::All { epoch, parts } => all(*epoch, parts.iter().map(|(n, b)| (*n, b.as_slice()))),
            FromRoot::Fail { epoch, message } => {
                let mut f = start(FAIL, 4 + message.len());
                f.extend_from_slice(&epoch.to_be_bytes());
                f.extend_from_slice(message.as_bytes());
                finish(f)
            }
            FromRoot::End => finish(start(END, 0)),
        }
    }

    /// Decodes a payload (without its length prefix).
    pub fn decode(payload: &[u8]) -> Result<FromRoot, Malformed> {
        let mut r = Reader(payload);
        Ok(match r.u8()? {
            ALL => {
                let epoch = r.u32()?;
                FromRoot::All { epoch, parts: r.parts()? }
            }
            FAIL => FromRoot::Fail { epoch: r.u32()?, message: r.rest_text() },
            END => {
                r.end()?;
                FromRoot::End
            }
            k => return Err(Malformed(format!("unknown kind {k}"))),
        })
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

    /// The next whole frame's payload, `Ok(None)` if it has not all come yet, or an error if the length
    /// prefix announces more than `max` bytes.
    pub fn next(&mut self, max: usize) -> Result<Option<&[u8]>, Malformed> {
        let rest = &self.buf[self.used..];
        if rest.len() < 4 {
            self.compact();
            return Ok(None);
        }
        let len = u32::from_be_bytes(rest[..4].try_into().expect("4 bytes")) as usize;
        if len > max {
            return Err(Malformed(format!("a frame of {len} bytes (at most {max} accepted here)")));
        }
        if rest.len() < 4 + len {
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
    fn u8(&mut self) -> Result<u8, Malformed> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, Malformed> {
        Ok(u16::from_be_bytes(self.take(2)?.try_into().expect("2 bytes")))
    }
    fn u32(&mut self) -> Result<u32, Malformed> {
        Ok(u32::from_be_bytes(self.take(4)?.try_into().expect("4 bytes")))
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
        self.end()?;
        Ok(parts)
    }
    fn rest_text(&mut self) -> String {
        String::from_utf8_lossy(std::mem::take(&mut self.0)).into_owned()
    }
    fn end(&self) -> Result<(), Malformed> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(Malformed(format!("{} bytes too many", self.0.len())))
        }
    }
}

/// The per-step secret: random bytes, passed to the stepds in hex.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Secret(pub [u8; SECRET_LEN]);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl Secret {
    /// A fresh secret from the kernel's random source (getrandom(2), else /dev/urandom).
    pub fn generate() -> std::io::Result<Secret> {
        let mut b = [0u8; SECRET_LEN];
        let mut got = 0;
        while got < SECRET_LEN {
            // SAFETY: writes at most the rest of our buffer.
            let n = unsafe { libc::getrandom(b[got..].as_mut_ptr().cast(), SECRET_LEN - got, 0) };
            if n > 0 {
                got += n as usize;
                continue;
            }
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            use std::io::Read;
            std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
            break;
        }
        Ok(Secret(b))
    }

    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    pub fn from_hex(text: &str) -> Option<Secret> {
        let t = text.as_bytes();
        if t.len() != 2 * SECRET_LEN {
            return None;
        }
        let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
        let mut b = [0u8; SECRET_LEN];
        for (i, out) in b.iter_mut().enumerate() {
            *out = digit(t[2 * i])? << 4 | digit(t[2 * i + 1])?;
        }
        Some(Secret(b))
    }

    /// Compares in time independent of where the bytes differ.
    pub fn matches(&self, other: &[u8; SECRET_LEN]) -> bool {
        self.0.iter().zip(other).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
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
        let secret = [7u8; SECRET_LEN];
        for m in [
            ToRoot::Hello { node: 3, secret },
            ToRoot::Contrib { epoch: 9, parts: vec![(1, b"abc".to_vec()), (2, vec![])] },
            ToRoot::Abort { rank: 2, code: -7, message: "bye now".into() },
            ToRoot::Error { rank: 5, message: "rank 5 went".into() },
            ToRoot::Gone { rank: 4 },
            ToRoot::Bye,
        ] {
            assert_eq!(ToRoot::decode(payload(&m.encode())), Ok(m));
        }
        assert_eq!(payload(&ToRoot::Hello { node: 0, secret }.encode()).len(), HELLO_LEN);
        for m in [
            FromRoot::All { epoch: 1, parts: vec![(0, b"x".to_vec()), (1, b"yz".to_vec())] },
            FromRoot::Fail { epoch: 2, message: "node n2 lost".into() },
            FromRoot::End,
        ] {
            assert_eq!(FromRoot::decode(payload(&m.encode())), Ok(m));
        }
        assert_eq!(
            ToRoot::decode(payload(&contrib(4, 2, b"kv"))),
            Ok(ToRoot::Contrib { epoch: 4, parts: vec![(2, b"kv".to_vec())] })
        );
    }

    #[test]
    fn garbage_is_refused() {
        assert!(ToRoot::decode(b"").is_err());
        assert!(ToRoot::decode(&[99]).is_err());
        assert!(ToRoot::decode(b"\x01HTTP/1.1 GET /").is_err());
        let mut hello = ToRoot::Hello { node: 0, secret: [0; SECRET_LEN] }.encode();
        hello.push(0);
        assert!(ToRoot::decode(&hello[4..]).is_err());
        // A part count that the frame cannot hold.
        assert!(FromRoot::decode(&[ALL, 0, 0, 0, 1, 0xff, 0xff, 0xff, 0xff]).is_err());
        assert!(ToRoot::decode(&[CONTRIB, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 9, 1]).is_err());
    }

    #[test]
    fn frames_are_split_however_the_bytes_come() {
        let frames: Vec<u8> = [ToRoot::Gone { rank: 1 }.encode(), ToRoot::Bye.encode(), contrib(0, 1, &[5; 300])]
            .into_iter()
            .flatten()
            .collect();
        for chunk in [1, 3, 7, 1000] {
            let mut fb = FrameBuf::default();
            let mut got = Vec::new();
            for piece in frames.chunks(chunk) {
                fb.extend(piece);
                while let Some(p) = fb.next(FRAME_MAX).unwrap() {
                    got.push(ToRoot::decode(p).unwrap());
                }
            }
            assert_eq!(got.len(), 3, "chunk {chunk}");
            assert_eq!(fb.pending(), 0);
        }
        let mut fb = FrameBuf::default();
        fb.extend(&[0, 0, 1, 0]);
        assert!(fb.next(HELLO_LEN).is_err());
    }

    #[test]
    fn secrets() {
        let s = Secret::generate().unwrap();
        assert_ne!(s, Secret::generate().unwrap());
        let hex = s.to_hex();
        assert_eq!(hex.len(), 64);
        assert_eq!(Secret::from_hex(&hex), Some(s));
        assert!(s.matches(&s.0));
        let mut other = s.0;
        other[31] ^= 1;
        assert!(!s.matches(&other));
        assert_eq!(Secret::from_hex("zz"), None);
        assert_eq!(Secret::from_hex(&"g".repeat(64)), None);
        assert!(!format!("{s:?}").contains(&hex[..8]));
    }
}

//! The TCP protocol of the plugin's collective: between each node's slurmstepd and srun's root, and between
//! a stepd and its parent in the tree.
//!
//! Every message is a frame: a `u32` big-endian payload length, then the payload, whose first byte is the
//! message kind. Integers are big-endian. A connection starts with the handshake of [`super::auth`]
//! (HELLO, CHALLENGE, PROOF, WELCOME); nothing else is accepted before it completes.
//!
//! ```text
//! up: a stepd to srun, or to its parent            down: srun, or a parent, to a stepd
//!   1 HELLO   "RPMI" version:u16 node:u32            0x84 CHALLENGE nonce:[32]
//!             nonce:[32] port:u16 width:u32
//!             allgather:u8 (0 tree, 1 bruck)
//!   7 PROOF   mac:[32]                               0x85 WELCOME   mac:[32] (the acceptor's proof)
//!   8 COLLECTIVE  a frame of the collective          0x88 COLLECTIVE  a frame of the collective
//!                 (crate::collective::frame)
//! to srun only                                      from srun only
//!   2 JOINED  epoch:u32   (this node's shell           0x86 PEER node:u32 port:u16 (connect to that node,
//!                          joined exchange epoch)                  a lower peer: your parent or one in
//!                                                                  Bruck's rounds, at its address, this port)
//!   3 ABORT   rank:u32 code:i32 message              0x87 PEER_DONE node:u32 (that lower peer finished
//!   4 ERROR   rank:u32 failed:u8 message                                before you joined it: no link)
//!   5 GONE    rank:u32 finalized:u8 (a task          0x83 END (srun is done with the step: the close
//!             closed its connection)                           that follows is the normal end)
//!   6 BYE     (every local task has closed its connection: a normal end)
//!   9 NAME    task:u32 op:u8 name_len:u16 name port   0x89 ANSWER task:u32 ok:u8 text (the answer
//!             (PMI_Publish_name, op 0, with the port;             to a NAME or a SPAWN, or why it
//!              Unpublish_name 1; Lookup_name 2)                   failed)
//!  10 SPAWN   task:u32 request (PMI_Spawn_multiple: the request as the plugin ABI's JSON, at most
//!             SPAWN_MAX bytes)
//!  11 STARTED (every local task has sent its first PMI line: its program runs)
//!  12 GROUP   id_len:u16 id part (this node's part    0x8A GROUP id_len:u16 id count:u32
//!             of PMI 1.2 group exchange `id`; srun                 count*(len:u32 bytes) (every member
//!             tells the member nodes from the id)                  node's part, in member order)
//! ```
//!
//! HELLO's `port` is where the stepd listens for its higher peers, its children in the tree and its peers in
//! Bruck's rounds above it (0: it has none), `width` the tree's width it builds the tree with and `allgather`
//! how its exchanges go ([`crate::collective::Allgather`]); a stepd joins each of its lower peers and admits
//! each of its higher ones, so each pair of peers has one connection; ANSWER's `text` to a SPAWN is the error code of every process (0:
//! all started, -1: none), to a NAME a lookup's port; ERROR's `failed` is 1 if something failed on its own (a task, a
//! node), 0 if rpmi ends a job in which nothing did (a protocol error, a bound). The collective's own frames
//! (CONTRIB, ALL, ROUND, FAIL, LOST, ...) travel inside COLLECTIVE on the links between peers: srun and node 0,
//! a stepd and its lower peers (up) and its higher ones (down).
//!
//! Sizes are bounded on both sides: a message text at most [`MESSAGE_MAX`] bytes (longer ones are cut when
//! encoded), every other frame at most what its receiver accepts ([`FrameBuf::next`]); every length is
//! checked before it is written as a `u32`.

use super::auth::{Nonce, Proof, NONCE_LEN, PROOF_LEN};
pub use crate::codec::Malformed;
use crate::codec::{cut, utf8, FrameReader, FrameWriter};
use crate::collective::groups::{self, DoneParts};
use crate::collective::{Allgather, Bytes};
pub use crate::server::NameOp;
use std::fmt;
use std::sync::Arc;

/// The protocol version in HELLO (1 sent the secret itself; 2 is the challenge-response over a star; 3 the
/// tree; 4 the name service; 5 spawn; 6 a spawn answered once its processes run; 7 PMI 1.2's group
/// exchanges; 8 a group's part without its member nodes; 9 a rank gone says whether it had spoken PMI; 10
/// JOINED only once the shell has waited in the exchange, and ahead of GONE, BYE and an ERROR of the exchange;
/// 11 the tree's top at node 0, srun out of every exchange, and COMPLETED after a JOINED; 12 Bruck's
/// allgather: HELLO's `allgather`, and PEER and PEER_DONE for every lower peer).
pub const VERSION: u16 = 12;
/// The payload length of HELLO and of PROOF: the only frames an acceptor takes before admission.
pub const HELLO_LEN: usize = 1 + 4 + 2 + 4 + NONCE_LEN + 2 + 4 + 1;
pub const PROOF_LEN_ON_WIRE: usize = 1 + PROOF_LEN;
/// The longest message text (abort, error) a frame carries; longer ones are cut.
pub const MESSAGE_MAX: usize = 4096;
/// The largest frame of any kind but COLLECTIVE.
pub const CONTROL_MAX: usize = 16 + MESSAGE_MAX;
/// The longest service name, and the longest port, a NAME carries (a stepd refuses longer ones to its task).
pub const NAME_MAX: usize = 1024;
/// The longest spawn request (its JSON) a SPAWN carries (a stepd refuses longer ones to its task).
pub const SPAWN_MAX: usize = 256 * 1024;
/// The largest SPAWN frame.
pub const SPAWN_FRAME_MAX: usize = 5 + SPAWN_MAX;

const MAGIC: &[u8; 4] = b"RPMI";

const HELLO: u8 = 1;
const JOINED: u8 = 2;
const ABORT: u8 = 3;
const ERROR: u8 = 4;
const GONE: u8 = 5;
const BYE: u8 = 6;
const PROOF: u8 = 7;
const UP_COLLECTIVE: u8 = 8;
const NAME: u8 = 9;
const SPAWN: u8 = 10;
const STARTED: u8 = 11;
const UP_GROUP: u8 = 12;
const COMPLETED: u8 = 13;
const END: u8 = 0x83;
const CHALLENGE: u8 = 0x84;
const WELCOME: u8 = 0x85;
const PEER: u8 = 0x86;
const PEER_DONE: u8 = 0x87;
const DOWN_COLLECTIVE: u8 = 0x88;
const ANSWER: u8 = 0x89;
const DOWN_GROUP: u8 = 0x8A;

/// A message from a stepd to srun's root or to its parent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Up {
    Hello {
        node: u32,
        nonce: Nonce,
        /// Where the stepd listens for its higher peers; 0 if it has none.
        port: u16,
        /// The tree's width the stepd builds the tree with.
        width: u32,
        /// How its exchanges reach every node.
        allgather: Allgather,
    },
    Proof {
        proof: Proof,
    },
    /// A frame of the collective (its payload).
    Collective(Bytes),
    /// The node's shell joined exchange `epoch`.
    Joined {
        epoch: u32,
    },
    /// Exchange `epoch`, which the node said it joined, completed (or failed) at the node.
    Completed {
        epoch: u32,
    },
    Abort {
        rank: u32,
        code: i32,
        message: String,
    },
    /// A job error; `failed` if something failed on its own (a task, a node): that explains the end, not
    /// rpmi, which only ends a job none of whose parts failed for a protocol error or a bound.
    Error {
        rank: u32,
        failed: bool,
        message: String,
    },
    /// Local rank `rank` closed its connection: after `finalize`, or without it; `spoke`: after a PMI line
    /// of its own (a task that never spoke PMI is no MPI process).
    Gone {
        rank: u32,
        finalized: bool,
        spoke: bool,
    },
    Bye,
    /// Local task `task` asks srun's name table (one per step) for `op`; `port` is empty but to publish.
    Name {
        task: u32,
        op: NameOp,
        name: String,
        port: String,
    },
    /// Local task `task` asks srun to start a new step (`request`: the plugin ABI's JSON of it).
    Spawn {
        task: u32,
        request: String,
    },
    /// Every local task has sent its first PMI line: its program was found and runs.
    Started,
    /// The node's part of group exchange `id` ([`crate::collective::groups`]; srun tells the member nodes
    /// from the id).
    Group {
        id: Vec<u8>,
        part: Vec<u8>,
    },
}

/// A message from srun's root, or from a parent, to a stepd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Down {
    /// The acceptor's nonce, in answer to HELLO.
    Challenge { nonce: Nonce },
    /// The stepd's proof was right: it is admitted, and this is the acceptor's own proof.
    Welcome { proof: Proof },
    /// A frame of the collective (its payload).
    Collective(Bytes),
    /// srun: the stepd's lower peer `node` (its parent, or one in Bruck's rounds) listens on `port` of its
    /// node's address.
    Peer { node: u32, port: u16 },
    /// srun: the stepd's lower peer `node` finished (every task of it closed its connection) before the stepd
    /// joined it.
    PeerDone { node: u32 },
    /// srun is done with the step: the connection closing next is the normal end, not srun's death.
    End,
    /// srun's answer to local task `task`'s NAME or SPAWN: the port of a lookup (empty for other names), the
    /// error code of every process of a spawn, or why it failed.
    Answer { task: u32, ok: bool, text: String },
    /// srun: a group exchange ended: every member node's part, in member order, read in place.
    Group(DoneParts),
}

/// Which way a COLLECTIVE frame goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Up,
    Down,
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
pub struct LengthOverflow(pub usize);

impl fmt::Display for LengthOverflow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a frame of {} bytes does not fit the protocol's 32-bit length", self.0)
    }
}

/// A frame of kind `kind` whose payload is the kind, then `fields`.
fn frame(kind: u8, fields: &[u8]) -> Result<Vec<u8>, LengthOverflow> {
    let len = 1 + fields.len();
    let mut f = FrameWriter::with_capacity(4 + len);
    f.len32(len).ok_or(LengthOverflow(4 + len))?.u8(kind).bytes(fields);
    Ok(f.into_vec())
}

/// A control frame: its size is bounded by [`CONTROL_MAX`] (texts are cut to [`MESSAGE_MAX`]), so it always
/// fits.
fn control(kind: u8, fields: &[u8]) -> Vec<u8> {
    frame(kind, fields).unwrap_or_default()
}

/// What goes before a collective frame of `len` bytes on the wire: the length prefix and the kind. The
/// frame itself follows unchanged, so that one frame is sent to several peers without a copy.
pub fn collective_head(direction: Direction, len: usize) -> Result<[u8; 5], LengthOverflow> {
    let prefix = u32::try_from(len + 1).map_err(|_| LengthOverflow(5 + len))?.to_be_bytes();
    let kind = match direction {
        Direction::Up => UP_COLLECTIVE,
        Direction::Down => DOWN_COLLECTIVE,
    };
    Ok([prefix[0], prefix[1], prefix[2], prefix[3], kind])
}

/// A COLLECTIVE's frame, copied out of the receive buffer (which is reused) into a frame of its own.
fn collective(r: &mut FrameReader) -> Bytes {
    Arc::new(r.rest().to_vec())
}

impl Up {
    /// The message's kind, for messages about it (not its contents: they may be the peer's to choose).
    pub fn name(&self) -> &'static str {
        match self {
            Up::Hello { .. } => "HELLO",
            Up::Proof { .. } => "PROOF",
            Up::Collective(_) => "COLLECTIVE",
            Up::Joined { .. } => "JOINED",
            Up::Completed { .. } => "COMPLETED",
            Up::Abort { .. } => "ABORT",
            Up::Error { .. } => "ERROR",
            Up::Gone { .. } => "GONE",
            Up::Bye => "BYE",
            Up::Name { .. } => "NAME",
            Up::Spawn { .. } => "SPAWN",
            Up::Started => "STARTED",
            Up::Group { .. } => "GROUP",
        }
    }

    /// The whole frame, length prefix included.
    pub fn encode(&self) -> Result<Vec<u8>, LengthOverflow> {
        Ok(match self {
            Up::Hello { node, nonce, port, width, allgather } => {
                let mut fields = FrameWriter::new();
                fields.bytes(MAGIC).u16(VERSION).u32(*node).bytes(nonce).u16(*port).u32(*width);
                control(HELLO, fields.u8(*allgather as u8))
            }
            Up::Proof { proof } => control(PROOF, proof),
            Up::Collective(payload) => frame(UP_COLLECTIVE, payload)?,
            Up::Joined { epoch } => control(JOINED, FrameWriter::new().u32(*epoch)),
            Up::Completed { epoch } => control(COMPLETED, FrameWriter::new().u32(*epoch)),
            Up::Abort { rank, code, message } => {
                control(ABORT, FrameWriter::new().u32(*rank).i32(*code).text(message, MESSAGE_MAX))
            }
            Up::Error { rank, failed, message } => {
                control(ERROR, FrameWriter::new().u32(*rank).flag(*failed).text(message, MESSAGE_MAX))
            }
            Up::Gone { rank, finalized, spoke } => {
                control(GONE, FrameWriter::new().u32(*rank).flag(*finalized).flag(*spoke))
            }
            Up::Bye => control(BYE, &[]),
            Up::Name { task, op, name, port } => {
                // A stepd checks both against NAME_MAX; cut here all the same, so the frame stays a control frame
                // (and the name's length fits its u16).
                let (name, port) = (cut(name, NAME_MAX), cut(port, NAME_MAX));
                let op = match op {
                    NameOp::Publish => 0,
                    NameOp::Unpublish => 1,
                    NameOp::Lookup => 2,
                };
                let mut fields = FrameWriter::new();
                fields.u32(*task).u8(op).u16(name.len() as u16).bytes(name.as_bytes()).bytes(port.as_bytes());
                control(NAME, &fields)
            }
            Up::Spawn { task, request } => frame(SPAWN, FrameWriter::new().u32(*task).bytes(request.as_bytes()))?,
            Up::Started => control(STARTED, &[]),
            Up::Group { id, part } => {
                let m = groups::encode_part(id, part).ok_or(LengthOverflow(id.len()))?;
                frame(UP_GROUP, &m)?
            }
        })
    }

    /// As [`Up::decode`], keeping a COLLECTIVE's frame in `payload`'s own buffer.
    pub fn decode_owned(payload: Owned) -> Result<Up, Malformed> {
        match payload.first() {
            Some(&UP_COLLECTIVE) => Ok(Up::Collective(payload.after_kind())),
            _ => Up::decode(&payload),
        }
    }

    /// Decodes a payload (without its length prefix).
    pub fn decode(payload: &[u8]) -> Result<Up, Malformed> {
        let mut r = FrameReader::new(payload);
        let m = match r.u8()? {
            HELLO => {
                if r.take(4)? != MAGIC {
                    return Err(Malformed("not an rpmi HELLO".into()));
                }
                let version = r.u16()?;
                if version != VERSION {
                    return Err(Malformed(format!("protocol version {version}, expected {VERSION}")));
                }
                let (node, nonce, port, width) = (r.u32()?, r.array()?, r.u16()?, r.u32()?);
                let allgather = match r.u8()? {
                    0 => Allgather::Tree,
                    1 => Allgather::Bruck,
                    a => return Err(Malformed(format!("allgather {a}, neither 0 (tree) nor 1 (bruck)"))),
                };
                Up::Hello { node, nonce, port, width, allgather }
            }
            PROOF => Up::Proof { proof: r.array()? },
            UP_COLLECTIVE => Up::Collective(collective(&mut r)),
            JOINED => Up::Joined { epoch: r.u32()? },
            COMPLETED => Up::Completed { epoch: r.u32()? },
            ABORT => Up::Abort { rank: r.u32()?, code: r.i32()?, message: r.text(MESSAGE_MAX, "a message")? },
            ERROR => Up::Error {
                rank: r.u32()?,
                failed: r.flag("an error whose cause")?,
                message: r.text(MESSAGE_MAX, "a message")?,
            },
            GONE => Up::Gone {
                rank: r.u32()?,
                finalized: r.flag("a rank gone whose finalize")?,
                spoke: r.flag("a rank gone whose first line")?,
            },
            BYE => Up::Bye,
            STARTED => Up::Started,
            UP_GROUP => {
                let groups::Part { id, part } = groups::decode_part(r.rest())?;
                Up::Group { id, part }
            }
            NAME => {
                let task = r.u32()?;
                let op = match r.u8()? {
                    0 => NameOp::Publish,
                    1 => NameOp::Unpublish,
                    2 => NameOp::Lookup,
                    b => return Err(Malformed(format!("a name request of kind {b}"))),
                };
                let name = utf8(r.prefixed16(NAME_MAX, "a name or port")?, "a name or port")?;
                let port = utf8(r.rest_max(NAME_MAX, "a name or port")?, "a name or port")?;
                Up::Name { task, op, name, port }
            }
            SPAWN => {
                let task = r.u32()?;
                let request = utf8(r.rest_max(SPAWN_MAX, "a spawn request")?, "a spawn request")?;
                Up::Spawn { task, request }
            }
            k => return Err(Malformed(format!("unknown kind {k}"))),
        };
        r.end()?;
        Ok(m)
    }
}

impl Down {
    /// The message's kind, for messages about it (not its contents: they may be the peer's to choose).
    pub fn name(&self) -> &'static str {
        match self {
            Down::Challenge { .. } => "CHALLENGE",
            Down::Welcome { .. } => "WELCOME",
            Down::Collective(_) => "COLLECTIVE",
            Down::Peer { .. } => "PEER",
            Down::PeerDone { .. } => "PEER_DONE",
            Down::End => "END",
            Down::Answer { .. } => "ANSWER",
            Down::Group(_) => "GROUP",
        }
    }

    /// The whole frame, length prefix included.
    pub fn encode(&self) -> Result<Vec<u8>, LengthOverflow> {
        Ok(match self {
            Down::Challenge { nonce } => control(CHALLENGE, nonce),
            Down::Welcome { proof } => control(WELCOME, proof),
            Down::Collective(payload) => frame(DOWN_COLLECTIVE, payload)?,
            Down::Peer { node, port } => control(PEER, FrameWriter::new().u32(*node).u16(*port)),
            Down::PeerDone { node } => control(PEER_DONE, FrameWriter::new().u32(*node)),
            Down::End => control(END, &[]),
            Down::Answer { task, ok, text } => {
                control(ANSWER, FrameWriter::new().u32(*task).flag(*ok).text(text, MESSAGE_MAX))
            }
            Down::Group(done) => frame(DOWN_GROUP, done.message())?,
        })
    }

    /// As [`Down::decode`], keeping a COLLECTIVE's frame, or a GROUP's parts, in `payload`'s own buffer.
    pub fn decode_owned(payload: Owned) -> Result<Down, Malformed> {
        match payload.first() {
            Some(&DOWN_COLLECTIVE) => Ok(Down::Collective(payload.after_kind())),
            Some(&DOWN_GROUP) => Ok(Down::Group(DoneParts::decode(payload.after_kind())?)),
            _ => Down::decode(&payload),
        }
    }

    /// Decodes a payload (without its length prefix).
    pub fn decode(payload: &[u8]) -> Result<Down, Malformed> {
        let mut r = FrameReader::new(payload);
        let m = match r.u8()? {
            CHALLENGE => Down::Challenge { nonce: r.array()? },
            WELCOME => Down::Welcome { proof: r.array()? },
            DOWN_COLLECTIVE => Down::Collective(collective(&mut r)),
            PEER => Down::Peer { node: r.u32()?, port: r.u16()? },
            PEER_DONE => Down::PeerDone { node: r.u32()? },
            END => Down::End,
            ANSWER => Down::Answer {
                task: r.u32()?,
                ok: r.flag("an answer whose outcome")?,
                text: r.text(MESSAGE_MAX, "a message")?,
            },
            DOWN_GROUP => Down::Group(DoneParts::decode(Arc::new(r.rest().to_vec()))?),
            k => return Err(Malformed(format!("unknown kind {k}"))),
        };
        r.end()?;
        Ok(m)
    }
}

/// Whether a payload from srun or a parent is an exchange's result (a COLLECTIVE holding an ALL).
pub fn is_result(payload: &[u8]) -> bool {
    payload.first() == Some(&DOWN_COLLECTIVE) && crate::collective::frame::is_all(&payload[1..])
}

/// The id and part count of a payload that is the end of a group exchange (`None`: another kind), read before
/// the rest of it is decoded or kept ([`groups::done_head`]).
pub fn group_head(payload: &[u8]) -> Option<Result<(&[u8], u32), Malformed>> {
    let (&kind, m) = payload.split_first()?;
    (kind == DOWN_GROUP).then(|| groups::done_head(m).map(|(id, count, _)| (id, count)))
}

/// A whole frame's payload in a buffer of its own ([`FrameBuf::next_owned`]): `buf[start..]`.
pub struct Owned {
    buf: Vec<u8>,
    start: usize,
}

impl std::ops::Deref for Owned {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.buf[self.start..]
    }
}

impl From<Vec<u8>> for Owned {
    fn from(buf: Vec<u8>) -> Owned {
        Owned { buf, start: 0 }
    }
}

impl Owned {
    /// What follows the payload's kind, in the same buffer (moved down in place once, not copied).
    fn after_kind(mut self) -> Bytes {
        self.buf.drain(..self.start + 1);
        Arc::new(self.buf)
    }
}

/// The smallest frame [`FrameBuf::next_owned`] hands over in its own buffer rather than copies.
pub const HANDOVER_MIN: usize = 64 * 1024;

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
        FrameReader::new(&self.buf[self.used..]).u32().ok().map(|len| len as usize)
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
            // Room for the whole frame at once (its length is within `max` now): grown by doubling as it
            // comes, a large frame (an exchange's result) would be copied again at every step and could
            // leave up to twice its size allocated.
            self.buf.reserve_exact(4 + len - self.buf.len());
            return Ok(None);
        }
        let start = self.used + 4;
        self.used = start + len;
        Ok(Some(&self.buf[start..start + len]))
    }

    /// As [`FrameBuf::next`], but the payload in a buffer of its own. A frame of [`HANDOVER_MIN`] bytes or
    /// more (an exchange's result) is handed over in the buffer it came into, never copied: what came after
    /// it (at most one read's worth) moves to a new buffer instead.
    pub fn next_owned(&mut self, max: usize) -> Result<Option<Owned>, FrameError> {
        let Some(len) = self.next(max)?.map(<[u8]>::len) else { return Ok(None) };
        let start = self.used - len;
        if start > 4 || len < HANDOVER_MIN {
            return Ok(Some(self.buf[start..self.used].to_vec().into()));
        }
        let rest = self.buf.split_off(self.used);
        let buf = std::mem::replace(&mut self.buf, rest);
        self.used = 0;
        Ok(Some(Owned { buf, start }))
    }

    /// Frees the buffer once every frame in it was handed out: after a fence it holds a whole exchange,
    /// which must not stay allocated beside the key-value store until the next one.
    pub fn release(&mut self) {
        if self.used == self.buf.len() {
            *self = FrameBuf::default();
        }
    }

    /// Bytes still due of a frame whose room [`FrameBuf::next`] reserved: a reader may receive them
    /// straight into [`FrameBuf::room`]'s spare capacity rather than through a buffer of its own.
    pub fn due(&self) -> usize {
        let Some(len) = self.announced() else { return 0 };
        let end = self.used + 4 + len;
        match self.buf.capacity() >= end {
            true => end - self.buf.len(),
            false => 0,
        }
    }

    /// The buffer, for a reader to append at most [`FrameBuf::due`] bytes to its spare capacity.
    pub fn room(&mut self) -> &mut Vec<u8> {
        &mut self.buf
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
            Up::Hello { node: 3, nonce: [7; NONCE_LEN], port: 4242, width: 8, allgather: Allgather::Tree },
            Up::Hello { node: 3, nonce: [7; NONCE_LEN], port: 4242, width: 8, allgather: Allgather::Bruck },
            Up::Proof { proof: [9; PROOF_LEN] },
            Up::Collective(Arc::new(vec![1, 0, 0, 0, 0])),
            Up::Joined { epoch: 9 },
            Up::Completed { epoch: 9 },
            Up::Abort { rank: 2, code: -7, message: "bye now".into() },
            Up::Error { rank: 5, failed: true, message: "rank 5 went".into() },
            Up::Error { rank: 6, failed: false, message: "bad line".into() },
            Up::Gone { rank: 4, finalized: false, spoke: true },
            Up::Gone { rank: 5, finalized: true, spoke: true },
            Up::Gone { rank: 6, finalized: false, spoke: false },
            Up::Bye,
            Up::Started,
            Up::Name { task: 1, op: NameOp::Publish, name: "svc".into(), port: "tag#0$port$".into() },
            Up::Name { task: 0, op: NameOp::Lookup, name: "x".repeat(NAME_MAX), port: String::new() },
            Up::Spawn { task: 2, request: r#"{"commands":[]}"#.into() },
            Up::Spawn { task: 0, request: "é".repeat(SPAWN_MAX / 2) },
            Up::Group { id: b"0,4:17".to_vec(), part: b"0 k=v\n".to_vec() },
            Up::Group { id: b"WORLD:0".to_vec(), part: vec![] },
        ] {
            assert_eq!(Up::decode(payload(&m.encode().unwrap())), Ok(m));
        }
        let hello = Up::Hello { node: 0, nonce: [0; NONCE_LEN], port: 0, width: 1, allgather: Allgather::Tree };
        assert_eq!(payload(&hello.encode().unwrap()).len(), HELLO_LEN);
        assert_eq!(payload(&Up::Proof { proof: [0; PROOF_LEN] }.encode().unwrap()).len(), PROOF_LEN_ON_WIRE);
        for m in [
            Down::Challenge { nonce: [1; NONCE_LEN] },
            Down::Welcome { proof: [2; PROOF_LEN] },
            Down::Collective(Arc::new(vec![0x83])),
            Down::Peer { node: 7, port: 65535 },
            Down::PeerDone { node: u32::MAX },
            Down::End,
            Down::Answer { task: 3, ok: true, text: "tag#0$port$".into() },
            Down::Answer { task: 0, ok: false, text: "the service name 'svc' is not published".into() },
            Down::Group(DoneParts::new(b"0,4:17", &[b"0 k=v\n".to_vec(), vec![]]).unwrap()),
        ] {
            assert_eq!(Down::decode(payload(&m.encode().unwrap())), Ok(m));
        }
    }

    #[test]
    fn a_collective_frame_goes_out_behind_its_head_unchanged() {
        let inner = Arc::new(vec![0x81, 1, 2, 3]);
        for (direction, whole) in [
            (Direction::Up, Up::Collective(inner.clone()).encode().unwrap()),
            (Direction::Down, Down::Collective(inner.clone()).encode().unwrap()),
        ] {
            let head = collective_head(direction, inner.len()).unwrap();
            assert_eq!([&head[..], &inner[..]].concat(), whole);
        }
        // A kind of one direction is not one of the other.
        assert!(Down::decode(&Up::Collective(inner.clone()).encode().unwrap()[4..]).is_err());
        assert!(Up::decode(&Down::Collective(inner).encode().unwrap()[4..]).is_err());
    }

    #[test]
    fn garbage_is_refused() {
        assert!(Up::decode(b"").is_err());
        assert!(Up::decode(&[99]).is_err());
        assert!(Up::decode(b"\x01HTTP/1.1 GET /").is_err());
        let mut hello = Up::Hello { node: 0, nonce: [0; NONCE_LEN], port: 1, width: 2, allgather: Allgather::Tree }
            .encode()
            .unwrap();
        let mut third = hello[4..].to_vec();
        *third.last_mut().unwrap() = 2;
        assert!(Up::decode(&third).unwrap_err().0.contains("allgather 2"));
        hello.push(0);
        assert!(Up::decode(&hello[4..]).is_err());
        // Version 2 (the star's) is refused.
        let mut v2 = hello[4..hello.len() - 1].to_vec();
        v2[6] = 2;
        assert!(Up::decode(&v2).unwrap_err().0.contains("version 2"));
        assert!(Up::decode(&[BYE, 0]).is_err());
        assert!(Up::decode(&[STARTED, 0]).is_err());
        assert!(Up::decode(&[JOINED, 0, 0]).is_err());
        assert!(Down::decode(&[PEER, 0, 0, 0, 1, 1]).is_err());
        assert!(Down::decode(&[PEER_DONE, 0]).is_err());
        // Counts that the bytes cannot hold, and an id over the bound.
        assert!(Up::decode(&[UP_GROUP, 0, 2, b'x']).is_err());
        assert!(Down::decode(&[DOWN_GROUP, 0, 0, 0x10, 0, 0, 0]).unwrap_err().0.contains("parts in"));
        assert!(Down::decode(&[DOWN_GROUP, 0, 0, 0, 0, 0, 1, 0, 0, 0, 9, 1]).is_err());
        assert!(Up::decode(&[UP_GROUP, 0x04, 0x01]).unwrap_err().0.contains("id of 1025 bytes"));
        // A message longer than any encoder writes.
        let mut abort = vec![ABORT, 0, 0, 0, 1, 0, 0, 0, 7];
        abort.extend(std::iter::repeat_n(b'x', MESSAGE_MAX + 1));
        assert!(Up::decode(&abort).is_err());
        // A spawn request longer than a stepd sends, or not UTF-8.
        let mut spawn = vec![SPAWN, 0, 0, 0, 1];
        spawn.extend(std::iter::repeat_n(b'{', SPAWN_MAX + 1));
        assert!(Up::decode(&spawn).unwrap_err().0.contains("spawn request of"));
        assert!(Up::decode(&[SPAWN, 0, 0, 0, 1, 0xff]).is_err());
    }

    #[test]
    fn long_messages_are_cut_at_a_character() {
        let message = "é".repeat(MESSAGE_MAX);
        let f = Up::Abort { rank: 1, code: 2, message }.encode().unwrap();
        assert!(f.len() <= 4 + CONTROL_MAX);
        let Up::Abort { message, .. } = Up::decode(payload(&f)).unwrap() else { panic!() };
        assert_eq!(message.len(), MESSAGE_MAX);
        assert!(message.chars().all(|c| c == 'é'));
        // A text that is not UTF-8 grows when decoded (U+FFFD for each bad byte): it is cut the same way.
        let mut abort = vec![ABORT, 0, 0, 0, 1, 0, 0, 0, 2];
        abort.extend(std::iter::repeat_n(0xff, MESSAGE_MAX));
        let Up::Abort { message, .. } = Up::decode(&abort).unwrap() else { panic!() };
        assert_eq!(message, "\u{fffd}".repeat(MESSAGE_MAX / 3));
        let m = Up::Abort { rank: 1, code: 2, message };
        assert_eq!(Up::decode(payload(&m.encode().unwrap())), Ok(m));
    }

    #[test]
    fn frames_are_split_however_the_bytes_come() {
        let frames: Vec<u8> = [
            Up::Gone { rank: 1, finalized: false, spoke: true }.encode().unwrap(),
            Up::Bye.encode().unwrap(),
            Up::Collective(Arc::new(vec![5; 300])).encode().unwrap(),
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
                    got.push(Up::decode(p).unwrap());
                }
            }
            assert_eq!(got.len(), 3, "chunk {chunk}");
            assert_eq!(fb.pending(), 0);
        }
        let mut fb = FrameBuf::default();
        fb.extend(&[0, 0, 1, 0]);
        assert_eq!(fb.next(HELLO_LEN), Err(FrameError::TooLarge { len: 256, max: HELLO_LEN }));
        assert_eq!(fb.announced(), Some(256));
        assert!(fb.buf.capacity() < 256, "room was made for a frame over the bound");
    }

    #[test]
    fn a_large_frame_is_handed_over_in_the_buffer_it_came_into() {
        let large = Down::Collective(Arc::new(vec![7; HANDOVER_MIN])).encode().unwrap();
        let small = Down::End.encode().unwrap();
        let mut fb = FrameBuf::default();
        fb.extend(&large[..100]);
        assert!(fb.next_owned(1 << 20).unwrap().is_none());
        fb.extend(&large[100..]);
        // The frame after it comes before the large one is taken.
        fb.extend(&small);
        let at = fb.buf.as_ptr();
        let payload = fb.next_owned(1 << 20).unwrap().unwrap();
        assert!(payload.buf.as_ptr() == at && *payload == large[4..], "copied, or not the frame");
        let Ok(Down::Collective(frame)) = Down::decode_owned(payload) else { panic!() };
        assert!(frame.as_ptr() == at && frame.len() == HANDOVER_MIN);
        // What came after it is still there; a small frame is a copy.
        assert_eq!(fb.next_owned(1 << 20).unwrap().as_deref(), Some(&small[4..]));
        assert_eq!(fb.pending(), 0);
    }

    #[test]
    fn a_large_frame_is_received_into_one_allocation_of_its_size() {
        let frame = Down::Collective(Arc::new(vec![7; 1 << 20])).encode().unwrap();
        let mut fb = FrameBuf::default();
        fb.extend(&frame[..1000]);
        assert_eq!(fb.next(2 << 20), Ok(None));
        let room = fb.buf.capacity();
        assert_eq!(room, frame.len());
        for piece in frame[1000..].chunks(65536) {
            fb.extend(piece);
        }
        assert_eq!(fb.buf.capacity(), room, "grew while the frame came");
        assert_eq!(fb.next(2 << 20).unwrap().map(<[u8]>::len), Some(frame.len() - 4));
    }
}

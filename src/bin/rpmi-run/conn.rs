//! One end of a socketpair between rpmi-run's processes, as frames: a kind byte, a little-endian u64 length,
//! and that many bytes. The socket never blocks: frames to send wait in a queue until it takes them, and a
//! frame coming in is held until it is whole. Also what the shells and the coordinator say in them.

use rpmi::collective::frame::REPORT_MAX;
use rpmi::collective::Bytes;
use rpmi_core::codec::{cut, FrameReader, FrameWriter};
use std::collections::VecDeque;
use std::io::{self, IoSlice, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;

/// A frame of the collective (`rpmi::collective::frame`), between a node and its parent, its children or
/// the coordinator.
pub const COLLECTIVE: u8 = 1;
/// Shell to coordinator: this node ended the job; what to say about it, if anything, in UTF-8. The job's
/// status is then the node's exit status: only the node knows it, once its tasks are reaped.
pub const ENDING: u8 = 2;
/// Coordinator to shell: end your tasks with this signal (an i32).
pub const KILL: u8 = 3;
/// Shell to coordinator: a task of this node called PMI_Abort (see [`abort`]).
pub const ABORT: u8 = 4;
/// Shell to coordinator: the node's part of a PMI 1.2 group exchange; coordinator to each member shell: its
/// end (`rpmi::collective::groups`' messages).
pub const GROUP: u8 = 5;
/// Shell to coordinator: this rank (a u32) of the node has exited: no group exchange can wait for it.
pub const LEFT: u8 = 6;

/// The largest frame of a kind other than [`COLLECTIVE`]; what to say is cut to fit.
pub const CONTROL_MAX: usize = 64 * 1024;

const HEAD: usize = 9;

/// A frame's head: its kind and its payload's length.
fn head(kind: u8, len: usize) -> [u8; HEAD] {
    let mut head = [kind; HEAD];
    head[1..].copy_from_slice(&(len as u64).to_le_bytes());
    head
}

fn read_head(head: &[u8; HEAD]) -> (u8, u64) {
    let [kind, len @ ..] = *head;
    (kind, u64::from_le_bytes(len))
}

/// What reading a connection gave.
#[derive(Debug, PartialEq, Eq)]
pub enum Heard {
    Frame(u8, Vec<u8>),
    /// No whole frame yet.
    Pending,
    /// The other end has gone (or the connection failed): nothing more comes, nothing more is sent.
    Ended,
    /// A frame longer than its kind may be: the connection is ended unread.
    TooLong {
        kind: u8,
        len: u64,
        max: usize,
    },
}

/// One end of a socketpair, non-blocking.
pub struct Conn {
    stream: UnixStream,
    /// The head of the frame coming in, and how much of it has come.
    head: [u8; HEAD],
    head_got: usize,
    /// Its payload, once the head is whole, and how much of it has come.
    payload: Option<(Vec<u8>, usize)>,
    /// Frames to send, each with its head.
    queue: VecDeque<([u8; HEAD], Bytes)>,
    /// Bytes of the first queued frame written, its head included.
    written: usize,
    /// Nothing more comes: the other end has gone (it may have gone before what it sent was read: writing
    /// to it can fail first, so that only stops writing).
    ended: bool,
    /// Writing failed: frames to send are dropped.
    unwritable: bool,
}

impl Conn {
    pub fn new(stream: UnixStream) -> io::Result<Conn> {
        stream.set_nonblocking(true)?;
        Ok(Conn {
            stream,
            head: [0; HEAD],
            head_got: 0,
            payload: None,
            queue: VecDeque::new(),
            written: 0,
            ended: false,
            unwritable: false,
        })
    }

    /// Whether nothing more comes from the other end.
    pub fn ended(&self) -> bool {
        self.ended
    }

    /// What to poll for: to read until the end, and to write while frames wait. A connection that has
    /// ended is left out (a negative fd).
    pub fn pollfd(&self) -> libc::pollfd {
        let fd = if self.ended { -1 } else { self.stream.as_raw_fd() };
        let events = if self.queue.is_empty() { libc::POLLIN } else { libc::POLLIN | libc::POLLOUT };
        libc::pollfd { fd, events, revents: 0 }
    }

    /// Whether frames sent now can still reach the other end.
    pub fn open(&self) -> bool {
        !self.ended && !self.unwritable
    }

    /// Queues a frame and writes what the socket takes now. Returns false if the other end has gone (the
    /// frame is dropped).
    pub fn send(&mut self, kind: u8, payload: Bytes) -> bool {
        if !self.open() {
            return false;
        }
        self.queue.push_back((head(kind, payload.len()), payload));
        self.flush();
        !self.unwritable
    }

    /// Whether frames wait to be written.
    pub fn sending(&self) -> bool {
        !self.queue.is_empty()
    }

    /// Writes queued frames until the socket takes no more.
    pub fn flush(&mut self) {
        while let Some((head, payload)) = self.queue.front() {
            let wrote = match self.written.checked_sub(HEAD) {
                None => self.stream.write_vectored(&[IoSlice::new(&head[self.written..]), IoSlice::new(payload)]),
                Some(at) => self.stream.write(&payload[at..]),
            };
            match wrote {
                Ok(0) => return self.unwritable(),
                Ok(n) => {
                    self.written += n;
                    if self.written == HEAD + payload.len() {
                        self.queue.pop_front();
                        self.written = 0;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return self.unwritable(),
            }
        }
    }

    /// The next whole frame; `max` gives the longest payload each kind may have.
    pub fn receive(&mut self, max: impl Fn(u8) -> usize) -> Heard {
        loop {
            if self.ended {
                return Heard::Ended;
            }
            let got = match &mut self.payload {
                None if self.head_got < HEAD => {
                    let got = read_into(&mut self.stream, &mut self.head[self.head_got..]);
                    if let Got::Bytes(n) = got {
                        self.head_got += n;
                    }
                    got
                }
                None => {
                    let (kind, len) = read_head(&self.head);
                    let max = max(kind);
                    if len > max as u64 {
                        self.end();
                        return Heard::TooLong { kind, len, max };
                    }
                    // At most `max`: what the receiver takes.
                    self.payload = Some((vec![0; len as usize], 0));
                    continue;
                }
                Some((payload, filled)) if *filled < payload.len() => {
                    let got = read_into(&mut self.stream, &mut payload[*filled..]);
                    if let Got::Bytes(n) = got {
                        *filled += n;
                    }
                    got
                }
                Some(_) => {
                    let payload = self.payload.take().map(|(p, _)| p).unwrap_or_default();
                    self.head_got = 0;
                    return Heard::Frame(self.head[0], payload);
                }
            };
            match got {
                Got::Bytes(_) => {}
                Got::Blocked => return Heard::Pending,
                Got::End => self.end(),
            }
        }
    }

    fn unwritable(&mut self) {
        self.unwritable = true;
        self.queue.clear();
        self.written = 0;
    }

    fn end(&mut self) {
        self.ended = true;
        self.unwritable();
        self.payload = None;
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

/// An ENDING's payload: what to say.
pub fn ending(message: &str) -> Bytes {
    Arc::new(cut(message, CONTROL_MAX).as_bytes().to_vec())
}

/// An ABORT's payload: the exit code, when the node's shell heard of it ([`rpmi::os::monotonic_ns`]), then what to say.
pub fn abort(code: i32, at: u64, message: &str) -> Bytes {
    let mut payload = FrameWriter::new();
    payload.i32_le(code).u64_le(at).text(message, CONTROL_MAX - 12);
    Arc::new(payload.into_vec())
}

/// An ABORT's exit code, when it was heard of, and what to say (1, never and nothing for what is missing).
pub fn read_abort(payload: &[u8]) -> (i32, u64, &[u8]) {
    let mut r = FrameReader::new(payload);
    match (r.i32_le(), r.u64_le()) {
        (Ok(code), Ok(at)) => (code, at, r.rest()),
        (code, _) => (code.unwrap_or(1), u64::MAX, &[]),
    }
}

/// A job error a node's machine of the collective found, as the node's shell reports it to the coordinator
/// (the machine's REPORT): node (u32 LE, all ones for the coordinator), left (one byte), message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blame {
    /// The node at fault; `None`: the coordinator.
    pub node: Option<u32>,
    /// That node had said it was done (its tasks had all gone) when the error was found. It sends nothing
    /// after its goodbye and its connections closing is normal, so the error is that it left an exchange
    /// the others joined.
    pub left: bool,
    pub message: String,
}

impl Blame {
    pub fn encode(&self) -> Vec<u8> {
        let mut bytes = FrameWriter::new();
        bytes.u32_le(self.node.unwrap_or(u32::MAX)).u8(u8::from(self.left)).text(&self.message, REPORT_MAX - 5);
        bytes.into_vec()
    }

    pub fn decode(bytes: &[u8]) -> Option<Blame> {
        let mut r = FrameReader::new(bytes);
        let node = r.u32_le().ok()?;
        Some(Blame {
            node: (node != u32::MAX).then_some(node),
            left: r.u8().ok()? != 0,
            message: String::from_utf8_lossy(r.rest()).into_owned(),
        })
    }
}

/// Writes a frame on a blocking end (a connection whose other end is a [`Conn`]).
pub fn write_frame(to: &mut impl Write, kind: u8, payload: &[u8]) -> io::Result<()> {
    to.write_all(&head(kind, payload.len()))?;
    to.write_all(payload)
}

/// The next frame on a blocking end, or `None` at the end; a frame longer than `max` is an error.
pub fn read_frame(from: &mut impl Read, max: usize) -> io::Result<Option<(u8, Vec<u8>)>> {
    let mut head = [0u8; HEAD];
    match from.read_exact(&mut head) {
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        other => other?,
    }
    let (kind, len) = read_head(&head);
    if len > max as u64 {
        return Err(io::Error::other(format!("a frame of {len} bytes, over the {max} taken")));
    }
    let mut payload = vec![0; len as usize];
    from.read_exact(&mut payload)?;
    Ok(Some((kind, payload)))
}

/// What one read gave.
#[derive(Clone, Copy)]
enum Got {
    Bytes(usize),
    /// Nothing until the socket is readable again.
    Blocked,
    /// The end of the stream, or a failed connection.
    End,
}

/// Reads into `buf` (not empty).
fn read_into(stream: &mut UnixStream, buf: &mut [u8]) -> Got {
    loop {
        return match stream.read(buf) {
            Ok(0) => Got::End,
            Ok(n) => Got::Bytes(n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Got::Blocked,
            Err(_) => Got::End,
        };
    }
}

#[cfg(test)]
pub mod tests {
    use super::*;
    use rpmi::collective::frame;

    fn pair() -> (Conn, UnixStream) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        (Conn::new(ours).unwrap(), theirs)
    }

    fn any(_: u8) -> usize {
        usize::MAX
    }

    /// Writes a frame on a blocking end, as the other side of a connection.
    pub fn write_frame(to: &mut UnixStream, kind: u8, payload: &[u8]) {
        super::write_frame(to, kind, payload).unwrap();
    }

    /// The next frame on a blocking end, or `None` at the end.
    pub fn read_frame(from: &mut UnixStream) -> Option<(u8, Vec<u8>)> {
        super::read_frame(from, usize::MAX).unwrap()
    }

    #[test]
    fn frames_larger_than_the_socket_takes_arrive_whole_and_in_order() {
        let (mut a, b) = pair();
        let mut b = Conn::new(b).unwrap();
        let sizes = [0, 1, 9, 300_000, 5, 2 << 20, 17];
        let sent: Vec<Vec<u8>> = sizes.iter().enumerate().map(|(i, &n)| vec![i as u8; n]).collect();
        for (i, p) in sent.iter().enumerate() {
            assert!(a.send(i as u8, Arc::new(p.clone())));
        }
        assert!(a.pollfd().events & libc::POLLOUT != 0, "the big frames wait in the queue");
        let mut got = Vec::new();
        while got.len() < sent.len() {
            a.flush();
            loop {
                match b.receive(any) {
                    Heard::Frame(kind, payload) => got.push((kind, payload)),
                    Heard::Pending => break,
                    other => panic!("{other:?}"),
                }
            }
        }
        assert_eq!(a.pollfd().events, libc::POLLIN, "nothing left to write");
        for (i, (kind, payload)) in got.into_iter().enumerate() {
            assert_eq!((kind, payload.len()), (i as u8, sizes[i]));
            assert_eq!(payload, sent[i]);
        }
    }

    #[test]
    fn a_frame_that_comes_a_byte_at_a_time_is_held_until_whole() {
        let (mut conn, mut other) = pair();
        let mut bytes = vec![ENDING];
        bytes.extend_from_slice(&3u64.to_le_bytes());
        bytes.extend_from_slice(b"bye");
        for b in &bytes {
            assert_eq!(conn.receive(any), Heard::Pending);
            other.write_all(&[*b]).unwrap();
        }
        assert_eq!(conn.receive(any), Heard::Frame(ENDING, b"bye".to_vec()));
        assert_eq!(conn.receive(any), Heard::Pending);
    }

    #[test]
    fn a_frame_longer_than_its_kind_may_be_ends_the_connection_unread() {
        let (mut conn, mut other) = pair();
        write_frame(&mut other, KILL, &[0; 8]);
        write_frame(&mut other, COLLECTIVE, &[0; 100]);
        let max = |kind| if kind == COLLECTIVE { 99 } else { 4 };
        assert_eq!(conn.receive(max), Heard::TooLong { kind: KILL, len: 8, max: 4 });
        assert!(conn.ended() && !conn.open());
        assert_eq!(conn.receive(max), Heard::Ended);
        assert_eq!(conn.pollfd().fd, -1, "no longer polled");
    }

    /// A peer that wrote and exited: writing to it fails, and what it wrote is still read, to its end.
    #[test]
    fn what_a_peer_sent_before_it_went_is_read_after_writing_to_it_fails() {
        let (mut conn, mut other) = pair();
        write_frame(&mut other, ENDING, b"rank 1 left");
        write_frame(&mut other, COLLECTIVE, &frame::bye());
        drop(other);
        assert!(!conn.send(KILL, Arc::new(vec![9, 0, 0, 0])), "the peer has gone");
        assert!(!conn.open() && !conn.ended());
        assert_eq!(conn.receive(any), Heard::Frame(ENDING, b"rank 1 left".to_vec()));
        match conn.receive(any) {
            Heard::Frame(COLLECTIVE, f) => assert!(frame::is_bye(&f)),
            other => panic!("{other:?}"),
        }
        assert_eq!(conn.receive(any), Heard::Ended);
        assert!(conn.ended());
    }

    #[test]
    fn what_to_say_is_cut_at_a_character_to_fit() {
        let long = "é".repeat(CONTROL_MAX);
        let payload = ending(&long);
        assert!(payload.len() <= CONTROL_MAX && std::str::from_utf8(&payload).is_ok());
        let payload = abort(-3, 5, &long);
        let (code, at, message) = read_abort(&payload);
        assert!(payload.len() <= CONTROL_MAX && std::str::from_utf8(message).is_ok());
        assert_eq!((code, at), (-3, 5));
        assert_eq!(read_abort(&abort(7, 1 << 40, "rank 2 aborts")), (7, 1 << 40, &b"rank 2 aborts"[..]));
    }

    #[test]
    fn a_blame_fits_a_report_and_reads_back() {
        for blame in [
            Blame { node: Some(3), left: true, message: "node 3 cannot join".into() },
            Blame { node: None, left: false, message: String::new() },
        ] {
            assert_eq!(Blame::decode(&blame.encode()), Some(blame));
        }
        let long = Blame { node: Some(0), left: false, message: "x".repeat(2 * REPORT_MAX) };
        assert_eq!(long.encode().len(), REPORT_MAX);
        assert!(frame::report(&long.encode()).is_ok());
        assert_eq!(Blame::decode(&[1, 0, 0]), None);
    }
}

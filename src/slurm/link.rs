//! One connection of the collective, served non-blocking in an epoll loop: frames come in as they arrive,
//! and go out through a queue that holds what the socket cannot take yet. srun's root serves one per node;
//! a stepd one to srun, one to its parent and one per child in the tree.

use super::protocol::{collective_head, Direction, FrameBuf, FrameError, LengthOverflow, Owned};
use crate::collective::frame;
use crate::collective::Bytes;
use crate::driver::Watcher;
use crate::os::Epoll;
use std::collections::VecDeque;
use std::io::{self, Read as _};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Of what a link may hold unsent, the share for control frames: each task has at most one name or spawn
/// request (or answer) out, a spawn's at most 256 KiB, and a node's other control frames are a few each.
pub const CONTROL_QUEUED_MAX: usize = 64 << 20;

/// The epoll set links and the acceptor are served in: srun's own, or a stepd's progress loop.
pub trait Watch: Send + Sync {
    fn add(&self, fd: RawFd, events: u32, token: u64) -> io::Result<()>;
    fn modify(&self, fd: RawFd, events: u32, token: u64) -> io::Result<()>;
    fn remove(&self, fd: RawFd) -> io::Result<()>;
}

impl Watch for Watcher {
    fn add(&self, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        Watcher::add(self, fd, events, token)
    }
    fn modify(&self, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        Watcher::modify(self, fd, events, token)
    }
    fn remove(&self, fd: RawFd) -> io::Result<()> {
        Watcher::remove(self, fd)
    }
}

/// An epoll set of its own: srun's root thread.
impl Watch for Epoll {
    fn add(&self, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        Epoll::add(self, fd, events, token)
    }
    fn modify(&self, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        Epoll::modify(self, fd, events, token)
    }
    fn remove(&self, fd: RawFd) -> io::Result<()> {
        Epoll::remove(self, fd)
    }
}

/// A frame waiting to go out: a short head (a collective frame's length and kind) and a body that may be
/// shared with other links (one ALL, queued for every child).
struct Out {
    head: [u8; 5],
    head_len: usize,
    body: Bytes,
    /// Bytes of head and body already written.
    at: usize,
}

impl Out {
    fn len(&self) -> usize {
        self.head_len + self.body.len()
    }
}

/// What one read brought.
#[derive(Debug, PartialEq, Eq)]
pub enum Read {
    /// This many bytes, now in the link's input.
    Data(usize),
    /// Nothing more for now.
    Blocked,
    /// The peer closed the connection, or it failed: why.
    Closed(String),
}

/// A framed, non-blocking connection.
pub struct Link {
    stream: TcpStream,
    token: u64,
    watch: Option<Arc<dyn Watch>>,
    input: FrameBuf,
    output: VecDeque<Out>,
    /// Bytes of `output` not written yet.
    queued: usize,
    /// The most `queued` may reach: a peer that leaves more unread has stopped reading (srun is the user's
    /// own process, which it may stop), and the link is broken rather than the queue grown.
    queued_max: usize,
    /// epoll watches it for writing too, while output waits.
    watching_out: bool,
    /// A write failed, or the peer left more than `queued_max` bytes unread: the link is of no more use.
    broken: bool,
    /// It broke for `queued_max`.
    overflowed: bool,
}

impl Link {
    /// A link over `stream` (made non-blocking), served under `token`, with `input` already received, that
    /// holds at most `queued_max` bytes of output its peer has not taken.
    pub fn new(stream: TcpStream, token: u64, input: FrameBuf, queued_max: usize) -> io::Result<Link> {
        stream.set_nonblocking(true)?;
        let _ = stream.set_nodelay(true);
        Ok(Link {
            stream,
            token,
            watch: None,
            input,
            output: VecDeque::new(),
            queued: 0,
            queued_max,
            watching_out: false,
            broken: false,
            overflowed: false,
        })
    }

    /// Adds the link to `watch`'s epoll set.
    pub fn watch(&mut self, watch: Arc<dyn Watch>) -> io::Result<()> {
        watch.add(self.stream.as_raw_fd(), self.events(), self.token)?;
        self.watch = Some(watch);
        Ok(())
    }

    /// Whether a CONTRIB (this node's parts of an exchange) is not all written yet: the peer cannot have the
    /// exchange's result.
    pub fn holds_unwritten_contrib(&self) -> bool {
        self.output.iter().any(|o| o.head_len > 0 && frame::is_contrib(&o.body))
    }

    /// Whether a write failed, or the peer left more than the link holds unread.
    pub fn is_broken(&self) -> bool {
        self.broken
    }

    /// Why the link broke, for messages: its peer stopped reading, or a write failed.
    pub fn broke_why(&self) -> String {
        match self.overflowed {
            true => format!("it left more than {} bytes unread", self.queued_max),
            false => "a write failed".into(),
        }
    }

    /// Queues a whole encoded frame and writes what the socket takes now.
    pub fn send(&mut self, frame: Vec<u8>) {
        self.queue(Out { head: [0; 5], head_len: 0, body: Arc::new(frame), at: 0 });
    }

    /// Queues a whole frame shared with other links (one encoding sent to many peers, not copied), and writes
    /// what the socket takes now.
    pub fn send_shared(&mut self, frame: &Bytes) {
        self.queue(Out { head: [0; 5], head_len: 0, body: frame.clone(), at: 0 });
    }

    /// Queues a collective frame (shared, not copied) behind its head, and writes what the socket takes now.
    pub fn send_collective(&mut self, direction: Direction, frame: &Bytes) -> Result<(), LengthOverflow> {
        let head = collective_head(direction, frame.len())?;
        self.queue(Out { head, head_len: head.len(), body: frame.clone(), at: 0 });
        Ok(())
    }

    fn queue(&mut self, out: Out) {
        if self.broken {
            return;
        }
        if self.queued + out.len() > self.queued_max {
            self.overflowed = true;
            self.break_off();
            return;
        }
        self.queued += out.len();
        self.output.push_back(out);
        self.flush();
    }

    /// Drops what waits to go out: the link is of no more use.
    fn break_off(&mut self) {
        self.broken = true;
        self.output.clear();
        self.queued = 0;
    }

    /// Writes queued frames until the socket would block; then has epoll say when it can take more.
    pub fn flush(&mut self) {
        while let Some(out) = self.output.front_mut() {
            let head = &out.head[..out.head_len];
            let (h, b) = match out.at.checked_sub(head.len()) {
                None => (&head[out.at..], &out.body[..]),
                Some(at) => (&[][..], &out.body[at..]),
            };
            match send_vectored(self.stream.as_raw_fd(), h, b) {
                Ok(n) => {
                    out.at += n;
                    self.queued -= n;
                    if out.at == out.len() {
                        self.output.pop_front();
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => {
                    self.break_off();
                    break;
                }
            }
        }
        let want_out = !self.output.is_empty();
        if want_out != self.watching_out {
            self.watching_out = want_out;
            if let Some(w) = &self.watch {
                let _ = w.modify(self.stream.as_raw_fd(), self.events(), self.token);
            }
        }
    }

    fn events(&self) -> u32 {
        (libc::EPOLLIN | if self.watching_out { libc::EPOLLOUT } else { 0 }) as u32
    }

    /// Reads once from the socket into the link's input: through `buf`, or, for the rest of a frame larger
    /// than `buf` whose room is reserved (an exchange's result), straight into that room, as much of it as
    /// has come (a result of megabytes then takes a few reads, not one a buffer, and no copy).
    pub fn read(&mut self, buf: &mut [u8]) -> Read {
        let due = self.input.due();
        if due > buf.len() {
            return self.read_due(due);
        }
        loop {
            return match self.stream.read(buf) {
                Ok(0) => Read::Closed("the peer closed the connection".into()),
                Ok(n) => {
                    self.input.extend(&buf[..n]);
                    Read::Data(n)
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => Read::Blocked,
                Err(e) => Read::Closed(e.to_string()),
            };
        }
    }

    fn read_due(&mut self, due: usize) -> Read {
        let room = self.input.room();
        let spare = &mut room.spare_capacity_mut()[..due];
        loop {
            // SAFETY: recv writes at most `due` bytes into `spare`, which has room for `due`.
            let n = unsafe { libc::recv(self.stream.as_raw_fd(), spare.as_mut_ptr().cast(), due, 0) };
            return match n {
                0 => Read::Closed("the peer closed the connection".into()),
                1.. => {
                    let n = n as usize;
                    // SAFETY: recv initialised the first n bytes of the spare capacity.
                    unsafe { room.set_len(room.len() + n) };
                    Read::Data(n)
                }
                _ => match io::Error::last_os_error() {
                    e if e.kind() == io::ErrorKind::Interrupted => continue,
                    e if e.kind() == io::ErrorKind::WouldBlock => Read::Blocked,
                    e => Read::Closed(e.to_string()),
                },
            };
        }
    }

    /// The next whole frame received (see [`FrameBuf::next`]).
    pub fn next(&mut self, max: usize) -> Result<Option<&[u8]>, FrameError> {
        self.input.next(max)
    }

    /// The next whole frame received, in a buffer of its own (see [`FrameBuf::next_owned`]).
    pub fn next_owned(&mut self, max: usize) -> Result<Option<Owned>, FrameError> {
        self.input.next_owned(max)
    }

    /// Frees the input buffer once every frame in it was handed out (see [`FrameBuf::release`]).
    pub fn release(&mut self) {
        self.input.release();
    }

    /// Writes what is queued on every link of `links`, waiting for their sockets at most until `deadline`
    /// (the loop that serves them has ended).
    pub fn drain(links: &mut [&mut Link], deadline: Instant) {
        Self::drain_until(links, |_| deadline)
    }

    /// Writes what is queued on every link of `links` for as long as their peers keep taking it: until a
    /// `stall` passes in which none took a byte, or once the time the bytes first queued take at `rate`
    /// bytes a second (and `longest` at most) has passed after one `stall`. For the links between stepds,
    /// whose last result may take longer than any fixed grace on a slow network; the rate and `longest` bound
    /// how long a peer that reads slowly holds the stepd's end (a user's process admitted with the step's
    /// secret can be one).
    pub fn drain_moving(links: &mut [&mut Link], stall: Duration, rate: u64, longest: Duration) {
        let start = Instant::now();
        let mut end = None;
        let mut last = (usize::MAX, start + stall);
        Self::drain_until(links, |queued| {
            // Set at the first call, from the bytes queued then.
            let end = *end.get_or_insert_with(|| {
                start + stall + Duration::from_millis((queued as u64).saturating_mul(1000) / rate.max(1)).min(longest)
            });
            if queued < last.0 {
                last = (queued, Instant::now() + stall);
            }
            last.1.min(end)
        })
    }

    /// Closes `links` as TCP closes without loss: each says it sends no more (FIN), then reads, and drops, what
    /// its peer still sends until the peer closes too or `deadline` passes. A socket closed with bytes unread is
    /// reset instead, and the reset can discard what the peer had not read yet of this side's last frames: a
    /// stepd's goodbye, which srun or a peer would then take for a stepd killed (srun tells a stepd of other
    /// nodes that finish at any time, so some may come as it closes).
    pub fn linger(links: &mut [&mut Link], deadline: Instant) {
        for l in links.iter() {
            let _ = l.stream.shutdown(std::net::Shutdown::Write);
        }
        let mut open: Vec<&mut Link> = links.iter_mut().map(|l| &mut **l).filter(|l| !l.broken).collect();
        let mut scratch = [0u8; 4096];
        while !open.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            let mut fds: Vec<libc::pollfd> = open
                .iter()
                .map(|l| libc::pollfd { fd: l.stream.as_raw_fd(), events: libc::POLLIN, revents: 0 })
                .collect();
            // SAFETY: a live array of pollfds, its length passed.
            unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, left.as_millis().clamp(1, 1000) as i32) };
            let mut closed = vec![false; open.len()];
            for (i, l) in open.iter_mut().enumerate().filter(|(i, _)| fds[*i].revents != 0) {
                closed[i] = loop {
                    match l.stream.read(&mut scratch) {
                        Ok(0) => break true,
                        Ok(_) => {}
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break false,
                        Err(_) => break true,
                    }
                };
            }
            let mut i = 0;
            open.retain(|_| {
                i += 1;
                !closed[i - 1]
            });
        }
    }

    /// Writes what is queued on every link of `links`, until `deadline` (given what is still queued) passes.
    fn drain_until(links: &mut [&mut Link], mut deadline: impl FnMut(usize) -> Instant) {
        loop {
            links.iter_mut().for_each(|l| l.flush());
            let queued: usize = links.iter().filter(|l| !l.broken).map(|l| l.queued).sum();
            let deadline = deadline(queued);
            let mut waiting: Vec<libc::pollfd> = links
                .iter()
                .filter(|l| !l.output.is_empty() && !l.broken)
                .map(|l| libc::pollfd { fd: l.stream.as_raw_fd(), events: libc::POLLOUT, revents: 0 })
                .collect();
            let left = deadline.saturating_duration_since(Instant::now());
            if waiting.is_empty() || left.is_zero() {
                return;
            }
            // SAFETY: a live array of pollfds, its length passed.
            unsafe {
                libc::poll(waiting.as_mut_ptr(), waiting.len() as libc::nfds_t, left.as_millis().clamp(1, 1000) as i32)
            };
        }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        // A copy of the socket elsewhere (a stepd keeps one to cut it at the end) would keep it in the set.
        if let Some(w) = &self.watch {
            let _ = w.remove(self.stream.as_raw_fd());
        }
    }
}

/// Writes `head` then `body` in one call. `sendmsg` with `MSG_NOSIGNAL`: a peer that closed its end must not
/// raise SIGPIPE in srun or slurmstepd.
fn send_vectored(fd: RawFd, head: &[u8], body: &[u8]) -> io::Result<usize> {
    let mut iov = [
        libc::iovec { iov_base: head.as_ptr() as *mut libc::c_void, iov_len: head.len() },
        libc::iovec { iov_base: body.as_ptr() as *mut libc::c_void, iov_len: body.len() },
    ];
    // SAFETY: an all-zero msghdr is valid (no name, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len();
    // SAFETY: the iovecs point into live buffers that are only read.
    let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::slurm::protocol::{Down, Up};
    use std::io::Write;
    use std::net::TcpListener;

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    /// How long `drain_moving` (1 s stall, `rate`, `longest`) holds 32 MiB for a peer that keeps reading
    /// 256 KiB every 100 ms, and whether the peer got it all.
    fn drained_for_a_slow_peer(rate: u64, longest: Duration) -> (Duration, bool) {
        let (a, mut peer) = pair();
        let mut link = Link::new(a, 0, FrameBuf::default(), usize::MAX).unwrap();
        let size = 32 << 20;
        link.send_collective(Direction::Down, &Arc::new(vec![7; size])).unwrap();
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reading = done.clone();
        let reader = std::thread::spawn(move || {
            let (mut buf, mut total) = (vec![0u8; 256 << 10], 0);
            while !reading.load(std::sync::atomic::Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(100));
                total += peer.read(&mut buf).unwrap_or(0);
            }
            total
        });
        let start = Instant::now();
        Link::drain_moving(&mut [&mut link], Duration::from_secs(1), rate, longest);
        let took = start.elapsed();
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        (took, reader.join().unwrap() >= size)
    }

    #[test]
    fn a_peer_that_reads_slowly_holds_the_end_only_as_long_as_its_bytes_take_at_the_least_rate() {
        // What the socket did not take at once of 32 MiB, at 16 MiB/s: under 2 s after the 1 s stall,
        // though the peer keeps taking bytes (it would take 13 s to read them all at its pace).
        let (took, all) = drained_for_a_slow_peer(16 << 20, Duration::from_secs(30));
        assert!(!all && took > Duration::from_millis(1500) && took < Duration::from_secs(8), "{took:?}");
        // And no longer than `longest` after the stall, whatever the rate allows.
        let (took, all) = drained_for_a_slow_peer(1, Duration::from_secs(1));
        assert!(!all && took > Duration::from_millis(1500) && took < Duration::from_secs(7), "{took:?}");
    }

    #[test]
    fn a_shared_frame_goes_out_whole_on_every_link_and_a_full_socket_waits() {
        let (a, mut peer) = pair();
        let mut link = Link::new(a, 0, FrameBuf::default(), usize::MAX).unwrap();
        // Far more than the socket buffers take: the rest waits in the queue.
        let big: Bytes = Arc::new(vec![7; 16 << 20]);
        link.send_collective(Direction::Down, &big).unwrap();
        link.send(Up::Bye.encode().unwrap());
        assert!(!link.output.is_empty(), "16 MiB went out at once");
        let reader = std::thread::spawn(move || {
            let mut all = Vec::new();
            peer.read_to_end(&mut all).unwrap();
            all
        });
        Link::drain(&mut [&mut link], Instant::now() + std::time::Duration::from_secs(20));
        assert!(link.output.is_empty() && !link.is_broken());
        drop(link);
        let all = reader.join().unwrap();
        let mut fb = FrameBuf::default();
        fb.extend(&all);
        assert_eq!(Down::decode(fb.next(usize::MAX).unwrap().unwrap()), Ok(Down::Collective(big)));
        assert_eq!(Up::decode(fb.next(usize::MAX).unwrap().unwrap()), Ok(Up::Bye));
    }

    #[test]
    fn a_peer_that_stops_reading_breaks_the_link_past_its_bound() {
        let (a, _peer) = pair();
        let mut link = Link::new(a, 0, FrameBuf::default(), 1 << 20).unwrap();
        let mut sent = 0;
        while !link.is_broken() {
            link.send(vec![0; 64 << 10]);
            sent += 64 << 10;
            assert!(link.queued <= 1 << 20, "{} bytes queued", link.queued);
            assert!(sent < 1 << 30, "never broke");
        }
        assert!(link.output.is_empty() && link.queued == 0);
        assert_eq!(link.broke_why(), format!("it left more than {} bytes unread", 1 << 20));
        // Nothing more is queued once it broke.
        link.send(vec![0; 16]);
        assert!(link.output.is_empty());
    }

    #[test]
    fn a_closed_peer_breaks_the_link_without_a_signal() {
        let (a, peer) = pair();
        let mut link = Link::new(a, 0, FrameBuf::default(), usize::MAX).unwrap();
        drop(peer);
        for _ in 0..100 {
            link.send(vec![0; 64 << 10]);
            if link.is_broken() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(link.is_broken());
        let mut buf = [0u8; 16];
        assert!(matches!(link.read(&mut buf), Read::Closed(_)));
    }

    #[test]
    fn frames_come_in_as_they_arrive() {
        let (a, mut peer) = pair();
        let mut link = Link::new(a, 0, FrameBuf::default(), usize::MAX).unwrap();
        let mut buf = [0u8; 4];
        assert_eq!(link.read(&mut buf), Read::Blocked);
        let joined = Up::Joined { epoch: 3 }.encode().unwrap();
        peer.write_all(&joined).unwrap();
        peer.flush().unwrap();
        let mut got = 0;
        while got < joined.len() {
            match link.read(&mut buf) {
                Read::Data(n) => got += n,
                Read::Blocked => std::thread::sleep(std::time::Duration::from_millis(1)),
                Read::Closed(why) => panic!("{why}"),
            }
        }
        assert_eq!(Up::decode(link.next(64).unwrap().unwrap()), Ok(Up::Joined { epoch: 3 }));
        assert_eq!(link.next(64), Ok(None));
    }

    /// A frame larger than the read buffer comes in whole and unchanged, its rest read straight into its
    /// room (reads longer than the buffer), and the frame after it too.
    #[test]
    fn a_large_frame_comes_in_straight_and_whole() {
        let (a, mut peer) = pair();
        let mut link = Link::new(a, 0, FrameBuf::default(), usize::MAX).unwrap();
        let big = Up::Collective(Arc::new((0..300_000u32).map(|i| i as u8).collect())).encode().unwrap();
        let joined = Up::Joined { epoch: 3 }.encode().unwrap();
        let writer = std::thread::spawn(move || {
            peer.write_all(&big).unwrap();
            peer.write_all(&joined).unwrap();
            (big, peer)
        });
        let mut buf = [0u8; 4096];
        let (mut frames, mut longest) = (Vec::new(), 0);
        while frames.len() < 2 {
            match link.read(&mut buf) {
                Read::Data(n) => longest = longest.max(n),
                Read::Blocked => std::thread::sleep(std::time::Duration::from_millis(1)),
                Read::Closed(why) => panic!("{why}"),
            }
            while let Some(f) = link.next_owned(1 << 20).unwrap() {
                frames.push(f.to_vec());
            }
        }
        let (big, _peer) = writer.join().unwrap();
        assert_eq!(frames[0], big[4..]);
        assert_eq!(Up::decode(&frames[1]), Ok(Up::Joined { epoch: 3 }));
        assert!(longest > buf.len(), "every read went through the buffer");
    }
}

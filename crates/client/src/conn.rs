//! The connection to the launcher's server: the socket it gave the process (`PMI_FD`), or its address
//! (`PMI_PORT=host:port`); what is read from it is bounded. Either is close-on-exec once init has it: a
//! program the process execs neither speaks on the rank's connection nor keeps it open after the rank ends.

use crate::{env, env_int, Failed};
use std::io;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// The longest line, or frame, read: a server that sends more is broken, and the session ends.
pub const READ_MAX: usize = 1 << 20;

enum Stream {
    /// Never closed here: the number stays the launcher's connection, so a file the program opens later can
    /// never be taken for it.
    Fd(RawFd),
    Tcp(TcpStream),
}

/// How much one read may take.
const CHUNK: usize = 8192;

/// The connection, and what was read from it and not yet taken (a read may end mid-line or carry more).
pub struct Conn {
    stream: Stream,
    /// Reads land in its spare capacity: nothing is zeroed or copied. Made with room for a first read, and
    /// handed to the reading side ([`Conn::reader`]): the side only written to keeps none.
    buf: Vec<u8>,
    /// An fd is expected with the next answer (rpmi's key-value image): reads take it, with `recvmsg`,
    /// until it comes. Other reads are plain `read`s, which leave any fd that comes to the kernel to close.
    expect_fd: bool,
    /// The fd the server sent with its bytes, until taken: one is kept, any other closed as it comes.
    received: Option<OwnedFd>,
}

impl Conn {
    /// The launcher's connection: `PMI_FD`, else `PMI_PORT`; `None` with neither (no launcher).
    pub fn from_env() -> Result<Option<Conn>, Failed> {
        // `PMI_PORT` only where there is no `PMI_FD`: each `getenv` walks the whole environment, and a
        // launcher's is large (Slurm's sets over a hundred variables).
        let stream = match env_int(c"PMI_FD")? {
            Some(fd) => Stream::Fd(launcher_fd(fd)?),
            None => match env(c"PMI_PORT").filter(|p| !p.is_empty()) {
                Some(port) => Stream::Tcp(
                    TcpStream::connect(port.as_str())
                        .map_err(|e| Failed::said(format!("cannot connect to PMI_PORT={port}: {e}")))?,
                ),
                None => return Ok(None),
            },
        };
        // The room of the first read made now: a read never grows it but where a line runs past it.
        let conn = Conn { stream, buf: Vec::with_capacity(CHUNK), expect_fd: false, received: None };
        conn.close_on_exec()?;
        Ok(Some(conn))
    }

    /// Makes `PMI_FD` close-on-exec, as std makes its own sockets (`PMI_PORT`'s). Close-on-exec is a
    /// descriptor's only flag: it is set without reading the others, one system call per start-up, which
    /// also finds a number that is not open.
    fn close_on_exec(&self) -> Result<(), Failed> {
        if let Stream::Fd(fd) = self.stream {
            // SAFETY: fcntl changes no memory; on a number that is not open it fails with EBADF.
            if unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } < 0 {
                return Err(self.failed("set close-on-exec on the connection to", io::Error::last_os_error()));
            }
        }
        Ok(())
    }

    /// A connection on `stream`, for the tests of what reads through it.
    #[cfg(test)]
    pub fn of_stream(stream: std::os::unix::net::UnixStream) -> Conn {
        use std::os::fd::IntoRawFd;
        Conn { stream: Stream::Fd(stream.into_raw_fd()), buf: Vec::new(), expect_fd: false, received: None }
    }

    /// A second handle on the same connection, for one thread to read while others write through this one;
    /// what this one had read and not yet handed out goes with it.
    pub fn reader(&mut self) -> Result<Conn, Failed> {
        let stream = match &self.stream {
            Stream::Fd(fd) => Stream::Fd(*fd),
            Stream::Tcp(s) => {
                Stream::Tcp(s.try_clone().map_err(|e| Failed::said(format!("cannot share the PMI connection: {e}")))?)
            }
        };
        Ok(Conn { stream, buf: std::mem::take(&mut self.buf), expect_fd: false, received: None })
    }

    /// The connection was made to `PMI_PORT`.
    pub fn is_port(&self) -> bool {
        matches!(self.stream, Stream::Tcp(_))
    }

    /// The server has closed the connection (or it failed): looked at without waiting and without reading.
    pub fn hung_up(&self) -> bool {
        let mut looked = libc::pollfd { fd: self.fd(), events: libc::POLLRDHUP, revents: 0 };
        // SAFETY: polls one pollfd of ours, without waiting.
        let n = unsafe { libc::poll(&mut looked, 1, 0) };
        n > 0 && looked.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0
    }

    fn fd(&self) -> RawFd {
        match &self.stream {
            Stream::Fd(fd) => *fd,
            Stream::Tcp(s) => s.as_raw_fd(),
        }
    }

    /// Sends `bytes` whole, with the C library's `send` as std's streams would (a closed server is an error
    /// here, not a SIGPIPE), but without their code: each 64 KiB of the library's text a process first runs
    /// costs it a page fault, and std's stream code lies far from the rest of a call's path.
    pub fn write(&mut self, mut bytes: &[u8]) -> Result<(), Failed> {
        let fd = self.fd();
        while !bytes.is_empty() {
            // SAFETY: the send reads at most `bytes.len()` bytes from `bytes`.
            let n = unsafe { libc::send(fd, bytes.as_ptr().cast(), bytes.len(), libc::MSG_NOSIGNAL) };
            let failure = match n {
                1.. => {
                    bytes = &bytes[n as usize..];
                    continue;
                }
                0 => io::Error::from(io::ErrorKind::WriteZero),
                _ => match io::Error::last_os_error() {
                    e if e.kind() == io::ErrorKind::Interrupted => continue,
                    e => e,
                },
            };
            return Err(self.failed("write to", failure));
        }
        Ok(())
    }

    /// Reads until the buffer holds `n` bytes (`n` at most [`READ_MAX`], which the caller checks).
    #[inline]
    fn fill_to(&mut self, n: usize) -> Result<(), Failed> {
        while self.buf.len() < n {
            self.fill()?;
        }
        Ok(())
    }

    /// The answer to the request about to be sent comes with an fd: the reads until it comes take it.
    pub fn expect_fd(&mut self) {
        self.received = None;
        self.expect_fd = matches!(self.stream, Stream::Fd(_));
    }

    /// The fd that came with an answer since [`Conn::expect_fd`], if one did; none is expected any more.
    pub fn take_fd(&mut self) -> Option<OwnedFd> {
        self.expect_fd = false;
        self.received.take()
    }

    /// Reads more into the buffer; `Err` if the server closed or failed. Where an fd is expected, with
    /// `recvmsg`, taking the fd (close-on-exec from the moment it arrives).
    fn fill(&mut self) -> Result<(), Failed> {
        let fd = self.fd();
        let unix = self.expect_fd;
        if matches!(self.stream, Stream::Fd(_)) {
            wait_readable(fd);
        }
        self.buf.reserve(CHUNK);
        let spare = self.buf.spare_capacity_mut();
        loop {
            let n = if unix {
                receive(fd, spare, &mut self.received)
            } else {
                // SAFETY: the read writes at most `spare.len()` bytes into the vector's own spare capacity.
                unsafe { libc::read(fd, spare.as_mut_ptr().cast(), spare.len()) }
            };
            return match n {
                0 => Err(Failed::said("the PMI server closed the connection".into())),
                1.. => {
                    // SAFETY: the read initialised the `n` bytes after the vector's length.
                    unsafe { self.buf.set_len(self.buf.len() + n as usize) };
                    Ok(())
                }
                _ => match io::Error::last_os_error() {
                    e if e.kind() == io::ErrorKind::Interrupted => continue,
                    e => Err(self.failed("read from", e)),
                },
            };
        }
    }

    /// Why a system call on the connection failed, naming a `PMI_FD` that is not open.
    fn failed(&self, doing: &str, e: io::Error) -> Failed {
        match (&self.stream, e.raw_os_error()) {
            (Stream::Fd(fd), Some(libc::EBADF)) => Failed::said(format!("PMI_FD={fd} is not an open file descriptor")),
            _ => Failed::said(format!("cannot {doing} the PMI server: {e}")),
        }
    }

    /// The next line, without its newline (and a `\r` before it).
    pub fn line(&mut self) -> Result<String, Failed> {
        let mut line = String::new();
        self.line_into(&mut line)?;
        Ok(line)
    }

    /// The next line, without its newline (and a `\r` before it), into `line`: one buffer from line to line,
    /// so that a reply allocates nothing.
    pub fn line_into(&mut self, line: &mut String) -> Result<(), Failed> {
        loop {
            if let Some(at) = newline(&self.buf) {
                let mut text = &self.buf[..at];
                if let [rest @ .., b'\r'] = text {
                    text = rest;
                }
                let read = match crate::utf8(text) {
                    Some(text) => {
                        line.clear();
                        line.push_str(text);
                        Ok(())
                    }
                    None => Err(Failed::said("the PMI server sent a line that is not UTF-8".into())),
                };
                // Taken either way, as a line that fails is no answer to wait on.
                self.buf.drain(..at + 1);
                return read;
            }
            if self.buf.len() > READ_MAX {
                return Err(Failed::said(format!("the PMI server sent more than {READ_MAX} bytes without a newline")));
            }
            self.fill()?;
        }
    }

    /// The next `n` bytes (`n` at most [`READ_MAX`]).
    pub fn exact(&mut self, n: usize) -> Result<Vec<u8>, Failed> {
        if n > READ_MAX {
            return Err(Failed::said(format!("the PMI server announced a message of {n} bytes")));
        }
        self.fill_to(n)?;
        Ok(self.take(n))
    }

    /// The next `N` bytes (a frame's header), with no allocation of their own.
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], Failed> {
        self.fill_to(N)?;
        let mut bytes = [0; N];
        bytes.copy_from_slice(&self.buf[..N]);
        self.buf.drain(..N);
        Ok(bytes)
    }

    /// The first `n` bytes of the buffer, copied out whole (a drain collected would go byte by byte).
    fn take(&mut self, n: usize) -> Vec<u8> {
        let taken = self.buf[..n].to_vec();
        self.buf.drain(..n);
        taken
    }
}

/// Waits until `fd` has something to read (or its end or an error, which the read then reports). A task
/// blocked in `read` on a Unix socket is woken each time its server reads what it wrote (the kernel's
/// write-space wake-up, which that sleep does not filter): once per request, for nothing, which costs the
/// server a wake-up and the task a switch there and back. Asleep in `poll` for input only, it is woken
/// once, by the answer: on one node an empty fence of 64 tasks takes about two thirds of the time
/// (docs/libpmi.md).
fn wait_readable(fd: RawFd) {
    let mut ready = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: polls one pollfd of ours.
    while unsafe { libc::poll(&mut ready, 1, -1) } < 0
        && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted
    {}
}

/// `recvmsg` into `spare`, as `read` would, keeping the first fd that comes with the bytes in `received` (in
/// place of one kept before) and closing any other. What `recvmsg` returns.
fn receive(fd: RawFd, spare: &mut [std::mem::MaybeUninit<u8>], received: &mut Option<OwnedFd>) -> isize {
    let mut iov = libc::iovec { iov_base: spare.as_mut_ptr().cast(), iov_len: spare.len() };
    // Room for a control message of a few fds, aligned as a cmsghdr is.
    let mut control = [0u64; 8];
    // SAFETY: an all-zero msghdr is a valid empty one.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control);
    // SAFETY: recvmsg writes at most `spare.len()` bytes into `spare` and at most `msg_controllen` into the
    // control buffer, both ours for the call.
    let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return n;
    }
    // SAFETY: the kernel wrote `msg_controllen` bytes of well-formed control messages; CMSG_FIRSTHDR and
    // CMSG_NXTHDR stay within them, and each SCM_RIGHTS message's data holds (cmsg_len - CMSG_LEN(0)) / 4 fds,
    // read unaligned, each new in this process and owned from here on.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                let count = ((*cmsg).cmsg_len - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    let fd = OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i)));
                    if i == 0 {
                        *received = Some(fd);
                    }
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    n
}

/// Where the first newline of `bytes` is: the C library's `memchr`, which looks at many bytes a step, where a
/// loop over them would take a step and a branch per byte of every reply.
fn newline(bytes: &[u8]) -> Option<usize> {
    // An empty vector's pointer is dangling, which C does not promise to take even for no bytes.
    if bytes.is_empty() {
        return None;
    }
    // SAFETY: memchr reads at most `bytes.len()` bytes from `bytes`, and what it returns, if not NULL, points
    // into them.
    let at = unsafe { libc::memchr(bytes.as_ptr().cast(), i32::from(b'\n'), bytes.len()) };
    (!at.is_null()).then(|| at as usize - bytes.as_ptr() as usize)
}

/// `PMI_FD`: a socket this process inherited, written and read by number.
fn launcher_fd(fd: i64) -> Result<RawFd, Failed> {
    RawFd::try_from(fd)
        .ok()
        .filter(|&fd| fd >= 0)
        .ok_or_else(|| Failed::said(format!("PMI_FD={fd} is not a file descriptor")))
}

#[cfg(test)]
mod tests {
    use super::Conn;
    use std::io::Write;
    use std::os::unix::net::UnixStream;

    #[test]
    fn a_line_that_is_not_utf8_fails_and_is_taken() {
        let (ours, mut server) = UnixStream::pair().unwrap();
        let mut conn = Conn::of_stream(ours);
        server.write_all(b"cmd=x v=\xff\r\ncmd=y rc=0\r\n").unwrap();
        let failed = conn.line().unwrap_err();
        assert!(failed.message.unwrap().contains("not UTF-8"));
        let mut line = String::from("left from before");
        conn.line_into(&mut line).unwrap();
        assert_eq!(line, "cmd=y rc=0");
    }
}

//! The connection to the launcher's server: the socket it gave the process (`PMI_FD`), or its address
//! (`PMI_PORT=host:port`); what is read from it is bounded.

use crate::{env, env_int, Failed};
use std::io::{self, Read, Write};
use std::mem::ManuallyDrop;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

/// The longest line, or frame, read: a server that sends more is broken, and the session ends.
pub const READ_MAX: usize = 1 << 20;

enum Stream {
    /// Never closed here: the number stays the launcher's connection, so a file the program opens later can
    /// never be taken for it.
    Fd(ManuallyDrop<UnixStream>),
    Tcp(TcpStream),
}

/// How much one read may take.
const CHUNK: usize = 8192;

/// The connection, and what was read from it and not yet taken (a read may end mid-line or carry more).
pub struct Conn {
    stream: Stream,
    /// Reads land in its spare capacity: nothing is zeroed or copied, and a connection only written to
    /// allocates nothing (each page first touched costs a fault, which a start-up pays in full).
    buf: Vec<u8>,
}

impl Conn {
    /// The launcher's connection: `PMI_FD`, else `PMI_PORT`; `None` with neither (no launcher).
    pub fn from_env() -> Result<Option<Conn>, Failed> {
        let stream = match (env_int(c"PMI_FD")?, env(c"PMI_PORT").filter(|p| !p.is_empty())) {
            (Some(fd), _) => Stream::Fd(ManuallyDrop::new(stream_of_fd(fd)?)),
            (None, Some(port)) => Stream::Tcp(
                TcpStream::connect(port.as_str())
                    .map_err(|e| Failed::said(format!("cannot connect to PMI_PORT={port}: {e}")))?,
            ),
            (None, None) => return Ok(None),
        };
        Ok(Some(Conn { stream, buf: Vec::new() }))
    }

    /// A connection on `stream`, for the tests of what reads through it.
    #[cfg(test)]
    pub fn of_stream(stream: UnixStream) -> Conn {
        Conn { stream: Stream::Fd(ManuallyDrop::new(stream)), buf: Vec::new() }
    }

    /// A second handle on the same connection, for one thread to read while others write through this one;
    /// what this one had read and not yet handed out goes with it.
    pub fn reader(&mut self) -> Result<Conn, Failed> {
        let stream = match &self.stream {
            // SAFETY: the same number, open for as long as the process lives: neither handle ever closes it.
            Stream::Fd(s) => Stream::Fd(ManuallyDrop::new(unsafe { UnixStream::from_raw_fd(s.as_raw_fd()) })),
            Stream::Tcp(s) => {
                Stream::Tcp(s.try_clone().map_err(|e| Failed::said(format!("cannot share the PMI connection: {e}")))?)
            }
        };
        Ok(Conn { stream, buf: std::mem::take(&mut self.buf) })
    }

    /// The connection was made to `PMI_PORT`.
    pub fn is_port(&self) -> bool {
        matches!(self.stream, Stream::Tcp(_))
    }

    fn io(&mut self) -> &mut dyn ReadWrite {
        match &mut self.stream {
            Stream::Fd(s) => &mut **s,
            Stream::Tcp(s) => s,
        }
    }

    pub fn write(&mut self, bytes: &[u8]) -> Result<(), Failed> {
        self.io().write_all(bytes).map_err(|e| Failed::said(format!("cannot write to the PMI server: {e}")))
    }

    /// Reads more into the buffer; `Err` if the server closed or failed.
    fn fill(&mut self) -> Result<(), Failed> {
        let fd = match &self.stream {
            Stream::Fd(s) => s.as_raw_fd(),
            Stream::Tcp(s) => s.as_raw_fd(),
        };
        self.buf.reserve(CHUNK);
        let spare = self.buf.spare_capacity_mut();
        loop {
            // SAFETY: the read writes at most `spare.len()` bytes into the vector's own spare capacity.
            let n = unsafe { libc::read(fd, spare.as_mut_ptr().cast(), spare.len()) };
            return match n {
                0 => Err(Failed::said("the PMI server closed the connection".into())),
                1.. => {
                    // SAFETY: the read initialised the `n` bytes after the vector's length.
                    unsafe { self.buf.set_len(self.buf.len() + n as usize) };
                    Ok(())
                }
                _ => match io::Error::last_os_error() {
                    e if e.kind() == io::ErrorKind::Interrupted => continue,
                    e => Err(Failed::said(format!("cannot read from the PMI server: {e}"))),
                },
            };
        }
    }

    /// The next line, without its newline (and a `\r` before it).
    pub fn line(&mut self) -> Result<String, Failed> {
        loop {
            if let Some(at) = self.buf.iter().position(|&b| b == b'\n') {
                let mut line = self.take(at + 1);
                line.pop();
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                return String::from_utf8(line)
                    .map_err(|_| Failed::said("the PMI server sent a line that is not UTF-8".into()));
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
        while self.buf.len() < n {
            self.fill()?;
        }
        Ok(self.take(n))
    }

    /// The first `n` bytes of the buffer, copied out whole (a drain collected would go byte by byte).
    fn take(&mut self, n: usize) -> Vec<u8> {
        let taken = self.buf[..n].to_vec();
        self.buf.drain(..n);
        taken
    }
}

trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}

/// `PMI_FD`'s connection: a socket this process inherited.
fn stream_of_fd(fd: i64) -> Result<UnixStream, Failed> {
    let bad = || Failed::said(format!("PMI_FD={fd} is not an open file descriptor"));
    let fd = RawFd::try_from(fd).map_err(|_| bad())?;
    // SAFETY: F_GETFD reads a flag of any number; -1 if it is not open.
    if fd < 0 || unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return Err(bad());
    }
    // SAFETY: an open fd the launcher gave this process for PMI, used by nothing else; never closed (the
    // caller keeps it in a ManuallyDrop).
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    Ok(UnixStream::from(owned))
}

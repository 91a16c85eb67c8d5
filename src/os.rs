//! The Linux calls the crate makes on fds of its own: epoll sets, eventfd wake-ups, timerfds, pipes and
//! socket pairs. Each is checked where it is made and handed out as an [`OwnedFd`], so every fd the
//! library opens is close-on-exec and closed when its owner goes.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Takes ownership of what a call that makes an fd returned, or its error.
///
/// # Safety
/// `fd` is the fresh result of such a call: nothing else owns it.
unsafe fn owned(fd: RawFd) -> io::Result<OwnedFd> {
    if fd < 0 {
        Err(io::Error::last_os_error())
    } else {
        // SAFETY: the caller's contract.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

/// `socketpair`'s or `pipe2`'s two fresh fds, owned.
///
/// # Safety
/// `rc` and `fds` are what such a call returned and wrote.
unsafe fn owned_pair(rc: i32, fds: [RawFd; 2]) -> io::Result<(OwnedFd, OwnedFd)> {
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the caller's contract: both fds are fresh and ours.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

pub(crate) fn set_nonblocking(fd: &impl AsRawFd) -> io::Result<()> {
    // SAFETY: fcntl on a live fd.
    unsafe {
        let flags = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
        if flags < 0 || libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// A connected pair of Unix stream sockets, both close-on-exec: (server end, task end).
/// The host clears close-on-exec on the task end in the child (`PMI_FD`).
pub fn socketpair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: fds has room for the two fds socketpair writes.
    let rc = unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0, fds.as_mut_ptr()) };
    // SAFETY: what socketpair returned and wrote.
    unsafe { owned_pair(rc, fds) }
}

#[cfg(feature = "slurm")] // the Slurm plugin's stepd
/// A non-blocking pipe, close-on-exec at both ends: (read end, write end).
pub(crate) fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: fds has room for the two fds pipe2 writes.
    let rc = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) };
    // SAFETY: what pipe2 returned and wrote.
    unsafe { owned_pair(rc, fds) }
}

/// A non-blocking eventfd: a counter that wakes whoever watches it.
pub(crate) fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: a plain syscall; the fd is checked and owned at once.
    unsafe { owned(libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK)) }
}

/// Adds one to an eventfd, waking its watcher. It fails only when the counter would overflow, and then the
/// watcher is awake anyway.
pub(crate) fn wake(eventfd: &OwnedFd) {
    let one = 1u64.to_ne_bytes();
    // SAFETY: writing 8 bytes from a live buffer to a live eventfd.
    unsafe { libc::write(eventfd.as_raw_fd(), one.as_ptr().cast(), one.len()) };
}

/// Empties a non-blocking eventfd or timerfd (8 bytes: its counter), so that it stops being readable.
pub(crate) fn drain_counter(fd: &OwnedFd) {
    let mut count = [0u8; 8];
    // SAFETY: an 8-byte read into a live buffer from a live, non-blocking fd.
    unsafe { libc::read(fd.as_raw_fd(), count.as_mut_ptr().cast(), count.len()) };
}

#[cfg(feature = "slurm")] // the Slurm plugin's stepd
/// A non-blocking timerfd on the monotonic clock.
pub(crate) fn timerfd() -> io::Result<OwnedFd> {
    // SAFETY: a plain syscall; the fd is checked and owned at once.
    unsafe { owned(libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_NONBLOCK | libc::TFD_CLOEXEC)) }
}

#[cfg(feature = "slurm")] // the Slurm plugin's stepd
/// Sets a timerfd to fire once, `after` from now (at least 1 ms, so that it is armed), or disarms it.
pub(crate) fn set_timer(timer: &OwnedFd, after: Option<std::time::Duration>) -> io::Result<()> {
    let zero = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    let value = match after {
        None => zero,
        Some(d) => {
            let d = d.max(std::time::Duration::from_millis(1));
            libc::timespec { tv_sec: d.as_secs() as libc::time_t, tv_nsec: d.subsec_nanos() as _ }
        }
    };
    let spec = libc::itimerspec { it_interval: zero, it_value: value };
    // SAFETY: a live timerfd and a live itimerspec.
    if unsafe { libc::timerfd_settime(timer.as_raw_fd(), 0, &spec, std::ptr::null_mut()) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// An epoll set, close-on-exec. Each fd in it is watched with a token that comes back with its events.
pub(crate) struct Epoll(OwnedFd);

impl Epoll {
    pub(crate) fn new() -> io::Result<Epoll> {
        // SAFETY: a plain syscall; the fd is checked and owned at once.
        unsafe { owned(libc::epoll_create1(libc::EPOLL_CLOEXEC)) }.map(Epoll)
    }

    pub(crate) fn fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }

    pub(crate) fn add(&self, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_ADD, fd, events, token)
    }

    pub(crate) fn modify(&self, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_MOD, fd, events, token)
    }

    pub(crate) fn remove(&self, fd: RawFd) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_DEL, fd, 0, 0)
    }

    fn ctl(&self, op: i32, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        let mut ev = libc::epoll_event { events, u64: token };
        // SAFETY: both fds are live; the event struct outlives the call.
        if unsafe { libc::epoll_ctl(self.fd(), op, fd, &mut ev) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Waits at most `timeout_ms` (-1: forever, 0: not at all) and fills `ready`; returns how many it
    /// filled, 0 on a timeout or a signal.
    pub(crate) fn wait(&self, ready: &mut [libc::epoll_event], timeout_ms: i32) -> io::Result<usize> {
        let room = i32::try_from(ready.len()).unwrap_or(i32::MAX);
        // SAFETY: the buffer outlives the call and its length is passed.
        let n = unsafe { libc::epoll_wait(self.fd(), ready.as_mut_ptr(), room, timeout_ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::Interrupted { Ok(0) } else { Err(e) };
        }
        Ok(n as usize)
    }
}

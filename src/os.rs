//! The Linux calls the crate makes on fds of its own: epoll sets, eventfd wake-ups, timerfds, pipes, socket
//! pairs and sealed memory files. Each is checked where it is made and handed out as an [`OwnedFd`], so every
//! fd the library opens is close-on-exec and closed when its owner goes.

use std::ffi::CStr;
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

/// How [`start_linked`] starts a process besides its link on fd 3 and stdin from /dev/null.
#[derive(Debug, Clone, Copy, Default)]
pub struct Start {
    /// In a process group of its own.
    pub own_group: bool,
    /// With no signal blocked and every one at its default (the caller's thread may block them all).
    pub default_signals: bool,
}

/// Starts `exe` with `argv` (`argv[0]` first) and `env` (`NAME=value`; `None`: this process's environment),
/// `link` on its fd 3 and stdin from /dev/null. With posix_spawn, not std's Command: the caller's threads
/// are not forked, an exec that fails is its result, and the child is reaped by whoever waits for it.
pub fn start_linked(
    exe: &std::ffi::CStr,
    argv: &[std::ffi::CString],
    env: Option<&[std::ffi::CString]>,
    link: &impl AsRawFd,
    how: Start,
) -> io::Result<libc::pid_t> {
    extern "C" {
        static environ: *const *const libc::c_char;
    }
    let check = |rc: libc::c_int| if rc == 0 { Ok(()) } else { Err(io::Error::from_raw_os_error(rc)) };
    // A copy above the standard fds and 3, so that dup2 onto 3 always makes a new fd (which exec keeps).
    // SAFETY: F_DUPFD_CLOEXEC on the caller's open fd.
    let copy = unsafe { owned(libc::fcntl(link.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 10)) }?;
    let nul_ended = |items: &[std::ffi::CString]| {
        items.iter().map(|a| a.as_ptr()).chain(std::iter::once(std::ptr::null())).collect::<Vec<_>>()
    };
    let argv = nul_ended(argv);
    let env_copy = env.map(nul_ended);
    // SAFETY: the attribute and action objects are initialized before use and destroyed after; every pointer
    // passed lives through the call; argv and env are NULL-terminated arrays of NUL-terminated strings
    // (`environ` is the process's environment).
    unsafe {
        let envp = env_copy.as_ref().map_or(environ, |e| e.as_ptr());
        let mut actions: libc::posix_spawn_file_actions_t = std::mem::zeroed();
        let mut attr: libc::posix_spawnattr_t = std::mem::zeroed();
        check(libc::posix_spawn_file_actions_init(&mut actions))?;
        check(libc::posix_spawnattr_init(&mut attr))?;
        let (mut none, mut all): (libc::sigset_t, libc::sigset_t) = (std::mem::zeroed(), std::mem::zeroed());
        libc::sigemptyset(&mut none);
        libc::sigfillset(&mut all);
        let mut flags = 0;
        if how.own_group {
            flags |= libc::POSIX_SPAWN_SETPGROUP;
        }
        if how.default_signals {
            flags |= libc::POSIX_SPAWN_SETSIGMASK | libc::POSIX_SPAWN_SETSIGDEF;
        }
        let mut pid: libc::pid_t = 0;
        let started = check(libc::posix_spawnattr_setflags(&mut attr, flags as libc::c_short))
            .and_then(|()| check(libc::posix_spawnattr_setpgroup(&mut attr, 0)))
            .and_then(|()| check(libc::posix_spawnattr_setsigmask(&mut attr, &none)))
            .and_then(|()| check(libc::posix_spawnattr_setsigdefault(&mut attr, &all)))
            .and_then(|()| check(libc::posix_spawn_file_actions_adddup2(&mut actions, copy.as_raw_fd(), 3)))
            .and_then(|()| {
                check(libc::posix_spawn_file_actions_addopen(&mut actions, 0, c"/dev/null".as_ptr(), libc::O_RDONLY, 0))
            })
            .and_then(|()| {
                check(libc::posix_spawn(&mut pid, exe.as_ptr(), &actions, &attr, argv.as_ptr().cast(), envp.cast()))
            });
        libc::posix_spawn_file_actions_destroy(&mut actions);
        libc::posix_spawnattr_destroy(&mut attr);
        started.map(|()| pid)
    }
}

/// Nanoseconds on the machine's monotonic clock: the same clock in every process of the machine, so that
/// processes (rpmi-run's, a spawning and a spawned srun) can tell which of two events came first.
pub fn monotonic_ns() -> u64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes into our own timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    (t.tv_sec as u64).saturating_mul(1_000_000_000).saturating_add(t.tv_nsec as u64)
}

/// A new memory file, empty and sealable: it has no path in any file system (only the processes that hold it
/// reach it), and is close-on-exec. Written, then [`seal`]ed.
pub fn memfd(name: &CStr) -> io::Result<OwnedFd> {
    // SAFETY: memfd_create reads the C string and makes a new fd, which `owned` takes.
    unsafe { owned(libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)) }
}

/// Seals memory file `file`: no process can write it, grow it, shrink it or change its seals from now on, so
/// every process it is sent to maps the same bytes, which none can change.
pub fn seal(file: &OwnedFd) -> io::Result<()> {
    add_seals(file, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE | libc::F_SEAL_SEAL)
}

/// Seals memory file `file`'s length: no process can grow it, shrink it or change its seals from now on, so
/// that no process it is sent to can make another's accesses to its mapping fault; its bytes stay writable.
pub fn seal_length(file: &OwnedFd) -> io::Result<()> {
    add_seals(file, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL)
}

fn add_seals(file: &OwnedFd, seals: libc::c_int) -> io::Result<()> {
    // SAFETY: fcntl on an fd of ours changes no memory.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Sends `bytes` on the connected Unix socket `socket` with a copy of `fd` going with their first byte
/// (`SCM_RIGHTS`), with `MSG_NOSIGNAL` as the driver's plain sends: what `sendmsg` returns (the bytes sent, or
/// -1 with errno set).
pub fn send_with_fd(socket: RawFd, bytes: &[u8], fd: RawFd) -> isize {
    let mut iov = libc::iovec { iov_base: bytes.as_ptr().cast_mut().cast(), iov_len: bytes.len() };
    // Room for one fd's control message, aligned as a cmsghdr is.
    let mut control = [0u64; 4];
    // SAFETY: CMSG_SPACE and CMSG_LEN compute lengths only.
    let (space, len) = unsafe {
        (libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32), libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32))
    };
    debug_assert!(space as usize <= std::mem::size_of_val(&control));
    // SAFETY: an all-zero msghdr is a valid empty one.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as usize;
    // SAFETY: the control buffer holds one header and one fd (checked above); CMSG_FIRSTHDR points into it,
    // and the fd is written unaligned into its data. sendmsg reads `bytes` through `iov` and the control
    // buffer, both alive for the call.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = len as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), fd);
        libc::sendmsg(socket, &msg, libc::MSG_NOSIGNAL)
    }
}

//! [`Driver`]: the I/O around one [`Server`]. It reads what tasks write on their PMI connections, feeds it
//! to the server, writes the answers back, and takes in completions that other threads post through a
//! [`DriverHandle`].
//!
//! Hosts with an event loop watch [`Driver::watch_fd`] themselves and call [`Driver::on_ready`]; hosts
//! without one run [`Driver::run`] on one progress thread for all local tasks (epoll, never a thread per
//! task). Tasks are answered in [`Turns`] of groups. Task fds are non-blocking; a task that does not read
//! its answers only holds its own output.
//!
//! **A task that does not read its answers** is read no more, until it does: once its connection is full,
//! epoll watches it for writing only; and while the server holds input of the task unparsed (its answers
//! are backed up, [`Server::holds_input`]), nothing more is read from it either. When a write empties the
//! task's output, the held input is parsed ([`Server::resume`]) within the same flush, so a task that has
//! stopped writing is still answered.

mod node_barrier;
mod turns;

pub use crate::os::socketpair;
pub use turns::{Turns, GROUPED_ABOVE};

use crate::os::{self, Epoll};
use crate::server::{pump, Attached, Host, HostReply, Server, TaskId};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;

/// Something another thread hands to the driver.
pub enum Event {
    /// The server's collective finished: every server's contribution, or why it failed.
    CollectiveDone(Result<Vec<Vec<u8>>, String>),
    /// The group exchange `id` finished ([`crate::server::Host::group_collective`]): every member server's
    /// contribution, or why it failed.
    GroupDone { id: Vec<u8>, result: Result<Vec<Vec<u8>>, String> },
    /// The host's answer to a service request of `task`.
    HostReply(TaskId, HostReply),
    /// A C host's untyped answer to a service request of `task` ([`Server::untyped_reply`]), posted only once
    /// claimed from the answers the host owes (the ABI's `service_complete`), so that one nobody waits for is
    /// refused where it comes in.
    UntypedReply { task: TaskId, ok: bool, text: Option<String> },
    /// The server end of `task`'s PMI connection, from now on served.
    Attach(TaskId, OwnedFd),
    /// The host has work that another thread handed it (a message from another shell): its
    /// [`HostFds::complete`] takes it.
    HostWork,
    /// Stop serving; [`Driver::run`] returns.
    Stop,
}

/// An exchange's result as the server takes it: the parts borrowed.
fn borrowed(result: &Result<Vec<Vec<u8>>, String>) -> Result<Vec<&[u8]>, &String> {
    result.as_ref().map(|all| all.iter().map(Vec::as_slice).collect())
}

/// Posts [`Event`]s to a driver from any thread, and wakes it.
#[derive(Clone)]
pub struct DriverHandle {
    tx: Sender<Event>,
    wake: Arc<OwnedFd>,
}

impl DriverHandle {
    /// Hands `event` to the driver. Fails only once the driver is gone.
    pub fn post(&self, event: Event) -> Result<(), Event> {
        self.tx.send(event).map_err(|e| e.0)?;
        os::wake(&self.wake);
        Ok(())
    }
}

/// The receiving side of a [`DriverHandle`], given to [`Driver::new`].
pub struct Inbox {
    rx: Receiver<Event>,
    wake: Arc<OwnedFd>,
}

/// A handle and the inbox it posts to. Made before the driver, so that the driver's host can hold the handle.
pub fn channel() -> io::Result<(DriverHandle, Inbox)> {
    let wake = Arc::new(os::eventfd()?);
    let (tx, rx) = std::sync::mpsc::channel();
    Ok((DriverHandle { tx, wake: wake.clone() }, Inbox { rx, wake }))
}

/// What `Driver::on_ready` reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Keep serving.
    Serving,
    /// Every task has closed its connection, or a stop was posted.
    Finished,
}

/// The I/O of one server: its task connections, its host and its wake-up fd.
pub struct Driver<H: HostFds> {
    server: Server,
    host: H,
    /// The server end of each task's connection; `None` before it is attached and after it closed.
    conns: Vec<Option<OwnedFd>>,
    /// How each task's connection is watched for writing.
    output: Vec<WriteState>,
    /// Tasks that were blocked and have become writable since the last flush.
    unblocked: Vec<TaskId>,
    closed: usize,
    stopped: bool,
    events: Receiver<Event>,
    wake: Arc<OwnedFd>,
    turns: Turns,
    buf: Vec<u8>,
    /// The image of the key-value space the server made at its last fence, as the node's one sealed memory
    /// file, sent with each task's answer that asks for it ([`Server::attached`]).
    kvs_image: Option<(u64, OwnedFd)>,
    /// The node barrier's page, sent with each answer to `get_node_barrier` ([`node_barrier`]); `None` where
    /// it could not be made (the tasks' barriers then go by lines).
    node_barrier: Option<node_barrier::Page>,
}

/// How a task's connection is watched for writing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WriteState {
    /// Answers are written as they come; epoll watches input only.
    Flowing,
    /// The connection was full: epoll watches EPOLLOUT only, and nothing is read from the task meanwhile.
    Blocked,
    /// Writable again: queued answers go out at the next flush; epoll still watches EPOLLOUT until they have.
    Unblocked,
}

/// The epoll token of the wake-up eventfd; task tokens are their `TaskId`.
const WAKE: u64 = u64::MAX >> 1;
/// The bit that marks the token of an fd the host serves itself ([`Watcher`]).
const HOST_FD: u64 = 1 << 62;

/// A host that serves connections of its own (links to other nodes) in the driver's loop, on the thread
/// that answers the tasks: so that no blocking I/O of the host holds the tasks up. The default serves none.
pub trait HostFds: Host {
    /// Called once, before the driver serves anything: the [`Watcher`] adds the host's fds to the loop.
    fn watch(&mut self, watcher: Watcher) {
        let _ = watcher;
    }

    /// The fd the host watches under `token` has `events` (epoll's flags). What it brings for the server (a
    /// collective's result, say) the host hands over in [`HostFds::complete`], which follows.
    fn ready(&mut self, token: u64, events: u32) {
        let _ = (token, events);
    }

    /// Hands `server` what has completed for it (a collective, a failure found while starting one, srun's
    /// answers): called after the host has carried out the server's effects, and after [`HostFds::ready`].
    fn complete(&mut self, server: &mut Server) {
        let _ = server;
    }

    /// Whether the loop goes on once every task has closed its connection, until a stop is posted: the
    /// host still serves the other shells (it relays their exchanges). The default is no.
    fn serves_after_tasks(&self) -> bool {
        false
    }
}

/// Adds, changes and removes the host's own fds in a driver's loop; their readiness comes to
/// [`HostFds::ready`] with the token given here.
#[derive(Clone)]
pub struct Watcher {
    epoll: Arc<Epoll>,
}

impl Watcher {
    /// Watches `fd` for `events` under `token` (below 2^62).
    pub fn add(&self, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        self.epoll.add(fd, events, Self::tag(token)?)
    }

    /// Changes what `fd` is watched for.
    pub fn modify(&self, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        self.epoll.modify(fd, events, Self::tag(token)?)
    }

    /// Stops watching `fd` (closing it does too).
    pub fn remove(&self, fd: RawFd) -> io::Result<()> {
        self.epoll.remove(fd)
    }

    fn tag(token: u64) -> io::Result<u64> {
        if token >= HOST_FD {
            return Err(invalid(format!("host fd token {token} is too large")));
        }
        Ok(token | HOST_FD)
    }
}

impl<H: HostFds> Driver<H> {
    /// A driver for `server`, whose requests go to `host`, taking events from `inbox` (see [`channel`]).
    /// Task connections come with [`Event::Attach`] or [`Driver::attach`].
    pub fn new(mut server: Server, mut host: H, inbox: Inbox) -> io::Result<Self> {
        let n = server.task_count();
        server.serve_groups(host.serves_groups());
        let turns = Turns::new(n)?;
        turns.watch(inbox.wake.as_raw_fd(), libc::EPOLLIN as u32, WAKE)?;
        host.watch(Watcher { epoll: turns.top() });
        let node_barrier = node_barrier::Page::new()
            .inspect_err(|e| host.log(log::Level::Warn, &format!("no node barrier page (barriers go by lines): {e}")))
            .ok();
        server.serve_node_barrier(node_barrier.is_some());
        Ok(Driver {
            server,
            host,
            conns: (0..n).map(|_| None).collect(),
            output: vec![WriteState::Flowing; n],
            unblocked: Vec::new(),
            closed: 0,
            stopped: false,
            events: inbox.rx,
            wake: inbox.wake,
            turns,
            buf: vec![0; 64 * 1024],
            kvs_image: None,
            node_barrier,
        })
    }

    /// The server this driver serves.
    pub fn server(&self) -> &Server {
        &self.server
    }

    /// The host.
    pub fn host_mut(&mut self) -> &mut H {
        &mut self.host
    }

    /// Serves `fd` (the server end of a socketpair, or any stream) as task `task`'s connection.
    pub fn attach(&mut self, task: TaskId, fd: OwnedFd) -> io::Result<()> {
        let slot = self.conns.get_mut(task).ok_or_else(|| invalid(format!("no local task {task}")))?;
        if slot.is_some() {
            return Err(invalid(format!("task {task} is already attached")));
        }
        os::set_nonblocking(&fd)?;
        self.turns.add(task, fd.as_raw_fd(), libc::EPOLLIN as u32)?;
        *slot = Some(fd);
        Ok(())
    }

    /// The one fd an event-loop host watches for readability: an epoll fd that becomes readable whenever
    /// [`Driver::on_ready`] has work.
    pub fn watch_fd(&self) -> RawFd {
        self.turns.fd()
    }

    /// Serves until every task has closed its connection or a stop is posted (the progress thread).
    pub fn run(&mut self) -> io::Result<()> {
        while self.on_ready(-1)? == Status::Serving {}
        Ok(())
    }

    /// Waits at most `timeout_ms` (-1: forever, 0: not at all) for work, and does it.
    pub fn on_ready(&mut self, timeout_ms: i32) -> io::Result<Status> {
        let mut ready = [libc::epoll_event { events: 0, u64: 0 }; 256];
        let n = self.turns.wait(&mut ready, timeout_ms)?;
        for ev in &ready[..n] {
            let (token, flags) = (ev.u64, ev.events);
            if token == WAKE {
                self.take_events()?;
            } else if token & HOST_FD != 0 {
                self.host.ready(token & !HOST_FD, flags);
                self.pump();
                self.flush()?;
            } else {
                let task = token as usize;
                // A hang-up or error is reported even while only EPOLLOUT is watched: the write that
                // follows then finds the connection closed (even while the task's input is held).
                let writable = (libc::EPOLLOUT | libc::EPOLLHUP | libc::EPOLLERR) as u32;
                if flags & writable != 0 && self.output[task] == WriteState::Blocked {
                    self.output[task] = WriteState::Unblocked;
                    self.unblocked.push(task);
                }
                // Input, or a hang-up or error (reported even while only EPOLLOUT is watched).
                if flags & !(libc::EPOLLOUT as u32) != 0 {
                    self.read(task);
                    // Answered at once, not after every ready task was read, so a task waits no longer
                    // than its own request takes (as the floor server in benches/side_by_side does).
                    self.flush()?;
                }
            }
        }
        self.flush()?;
        Ok(self.status())
    }

    fn status(&self) -> Status {
        if self.stopped || (self.closed == self.conns.len() && !self.host.serves_after_tasks()) {
            Status::Finished
        } else {
            Status::Serving
        }
    }

    fn take_events(&mut self) -> io::Result<()> {
        os::drain_counter(&self.wake);
        while let Ok(event) = self.events.try_recv() {
            self.apply(event)?;
        }
        Ok(())
    }

    /// Takes in what another thread posted.
    fn apply(&mut self, event: Event) -> io::Result<()> {
        match event {
            Event::CollectiveDone(result) => {
                let parts = borrowed(&result);
                self.server.collective_complete(parts.as_deref().map_err(|e| e.as_str()));
            }
            Event::GroupDone { id, result } => {
                let parts = borrowed(&result);
                self.server.group_complete(&id, parts.as_deref().map_err(|e| e.as_str()));
            }
            Event::HostReply(task, reply) => self.server.host_reply(task, reply),
            Event::UntypedReply { task, ok, text } => self.server.untyped_reply(task, ok, text),
            Event::Attach(task, fd) => {
                // A connection that cannot be watched is one the task has lost: it is seen leaving.
                if let Err(e) = self.attach(task, fd) {
                    self.host.log(log::Level::Error, &format!("cannot serve local task {task}'s connection: {e}"));
                    self.closed += 1;
                    self.server.disconnected(task);
                }
            }
            Event::HostWork => {}
            Event::Stop => {
                // What tasks wrote before they left (an abort line, say) is still served.
                for task in 0..self.conns.len() {
                    self.read(task);
                }
                self.stopped = true;
            }
        }
        self.pump();
        Ok(())
    }

    /// Carries out what the server asked of the host since the last call: before its answers are written,
    /// so that the host hears of an abort before the task can see its reply and exit.
    fn pump(&mut self) {
        loop {
            pump(&mut self.server, &mut self.host);
            self.host.complete(&mut self.server);
            if !self.server.has_effects() {
                return;
            }
        }
    }

    /// Reads what `task` has written, until the connection would block; nothing while the server holds input
    /// of the task.
    fn read(&mut self, task: TaskId) {
        let Some(fd) = self.conns.get(task).and_then(Option::as_ref).map(AsRawFd::as_raw_fd) else {
            return;
        };
        if self.server.holds_input(task) {
            return;
        }
        loop {
            // SAFETY: reading into our own buffer, its length passed.
            let n = unsafe { libc::read(fd, self.buf.as_mut_ptr().cast(), self.buf.len()) };
            match n {
                0 => return self.close(task),
                n if n > 0 => {
                    self.server.receive(task, &self.buf[..n as usize]);
                    self.pump();
                    if self.server.is_cut_off(task) {
                        return self.cut_off(task);
                    }
                    // Answers are written before more is read, so they never pile up (epoll is
                    // level-triggered: the rest of the input is reported again).
                    if (n as usize) < self.buf.len() || !self.server.output(task).is_empty() {
                        return;
                    }
                }
                _ => match io::Error::last_os_error().kind() {
                    io::ErrorKind::WouldBlock => return,
                    io::ErrorKind::Interrupted => {}
                    _ => return self.close(task),
                },
            }
        }
    }

    /// Writes every task's queued output as far as its connection takes it.
    fn flush(&mut self) -> io::Result<()> {
        self.keep_kvs_image();
        let written = self.write_ready();
        // After the writes: they may decide a release or a break too (held input parsed, a connection found
        // closed), which nothing else would bring the loop back for.
        if let (Some(release), Some(page)) = (self.server.node_release(), &self.node_barrier) {
            page.release(release);
        }
        written
    }

    fn write_ready(&mut self) -> io::Result<()> {
        // Tasks that have become writable; a write that finds a connection closed may queue answers for
        // others, which the loop below then sends.
        for task in std::mem::take(&mut self.unblocked) {
            self.write(task)?;
        }
        while let Some(task) = self.server.next_ready() {
            self.write(task)?;
        }
        Ok(())
    }

    /// Writes the image of the key-value space the server has due into a new sealed memory file, the node's
    /// one copy (the one of the fence before goes: tasks that mapped it keep their mapping).
    fn keep_kvs_image(&mut self) {
        let Some(fence) = self.server.kvs_image_due() else { return };
        let file = os::memfd(c"rpmi-kvs-image").and_then(|file| {
            let mut out = std::fs::File::from(file);
            self.server.write_kvs_image(&mut out)?;
            let file = OwnedFd::from(out);
            os::seal(&file)?;
            Ok(file)
        });
        self.kvs_image = match file {
            Ok(file) => Some((fence, file)),
            Err(e) => {
                let why = format!("no memory file for the key-value image of fence {fence} (tasks read the wire): {e}");
                self.host.log(log::Level::Warn, &why);
                None
            }
        };
    }

    fn write(&mut self, task: TaskId) -> io::Result<()> {
        let Some(fd) = self.conns.get(task).and_then(Option::as_ref).map(AsRawFd::as_raw_fd) else {
            // Closed: what it was owed goes nowhere.
            while !self.server.output(task).is_empty() {
                let n = self.server.output(task).len();
                self.server.consume(task, n);
            }
            return Ok(());
        };
        if self.output[task] == WriteState::Blocked {
            return Ok(());
        }
        while !self.server.output(task).is_empty() {
            let out = self.server.output(task);
            let attached = match self.server.attached(task) {
                Some(Attached::KvsImage(image)) => {
                    self.kvs_image.as_ref().filter(|(fence, _)| *fence == image).map(|(_, f)| f.as_raw_fd())
                }
                Some(Attached::NodeBarrier) => self.node_barrier.as_ref().map(node_barrier::Page::fd),
                None => None,
            };
            // SAFETY: writing from the server's live buffer, its length passed. MSG_NOSIGNAL: a task that
            // closed its end must not raise SIGPIPE in the host.
            let plain = |out: &[u8]| unsafe { libc::send(fd, out.as_ptr().cast(), out.len(), libc::MSG_NOSIGNAL) };
            let n = match attached.map(|file| os::send_with_fd(fd, out, file)) {
                // A connection that takes no fd (not a Unix socket): the answer goes alone, and the task
                // reads its keys on the wire (or its barriers go by lines).
                Some(-1)
                    if !matches!(
                        io::Error::last_os_error().kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                    ) =>
                {
                    plain(out)
                }
                Some(n) => n,
                None => plain(out),
            };
            if n >= 0 {
                self.server.consume(task, n as usize);
                continue;
            }
            match io::Error::last_os_error().kind() {
                io::ErrorKind::Interrupted => {}
                io::ErrorKind::WouldBlock => {
                    // Nothing more is read from a task that does not read its answers, until it does:
                    // otherwise it could make the server queue answers without bound.
                    let watched =
                        std::mem::replace(&mut self.output[task], WriteState::Blocked) == WriteState::Unblocked;
                    if watched {
                        return Ok(());
                    }
                    return self.turns.modify(task, fd, libc::EPOLLOUT as u32);
                }
                _ => {
                    self.close(task);
                    return Ok(());
                }
            }
        }
        // Back to reading only, if it had been waiting to write (one syscall per answer otherwise).
        if std::mem::replace(&mut self.output[task], WriteState::Flowing) == WriteState::Unblocked {
            self.turns.modify(task, fd, libc::EPOLLIN as u32)?;
        }
        if self.server.holds_input(task) {
            // Parsed now, though the task may write nothing more; the answers are queued and go out in the
            // flush this write is part of.
            self.server.resume(task);
            self.pump();
            if self.server.is_cut_off(task) {
                self.cut_off(task);
            }
        }
        Ok(())
    }

    /// RFC 13: after a protocol error (or an abort) the connection is closed, once what the task is owed
    /// (the abort reply) has been sent.
    fn cut_off(&mut self, task: TaskId) {
        let _ = self.write(task);
        self.close(task);
    }

    fn close(&mut self, task: TaskId) {
        if let Some(fd) = self.conns[task].take() {
            // Closing the fd removes it from the epoll set.
            drop(fd);
            self.closed += 1;
            self.output[task] = WriteState::Flowing;
            self.server.disconnected(task);
            self.pump();
        }
    }
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

#[cfg(test)]
mod tests;

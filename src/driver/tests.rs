//! The driver driven as an event-loop host drives it ([`Driver::on_ready`] without waiting, on this thread):
//! its back-pressure, a host's own fds served in its loop, and the node barrier's page, with the task's end
//! of a real socketpair (and the page as a task maps it, `rpmi_client`'s) in the test's hands.

use super::*;
use crate::server::{JobError, JobInfo, Limits, TaskMap};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

struct QuietHost;

impl Host for QuietHost {
    fn collective(&mut self, _contribution: &[u8]) -> Result<(), String> {
        panic!("no barrier here");
    }
    fn abort(&mut self, rank: u32, _exit_code: i32, message: &str) {
        panic!("rank {rank} aborted: {message}");
    }
    fn job_error(&mut self, error: &JobError) {
        panic!("{error}");
    }
}

impl HostFds for QuietHost {}

/// A driver for `host` serving the `n` tasks of a job of one node, and each task's end of its connection,
/// non-blocking.
fn node_of<H: HostFds>(host: H, n: usize) -> (Driver<H>, Vec<UnixStream>) {
    let ranks: Vec<u32> = (0..n as u32).collect();
    let job = JobInfo::new("kvs_7", TaskMap::block(&[n as u32]), ranks, vec!["node0".into()]);
    let server = Server::new(job, Limits::default()).unwrap();
    let (_handle, inbox) = channel().unwrap();
    let mut driver = Driver::new(server, host, inbox).unwrap();
    let tasks = (0..n)
        .map(|t| {
            let (server, task) = socketpair().unwrap();
            driver.attach(t, server).unwrap();
            let task = UnixStream::from(task);
            task.set_nonblocking(true).unwrap();
            task
        })
        .collect();
    (driver, tasks)
}

/// A driver serving one task (the only rank), and the task's end of its connection, non-blocking.
fn one_task() -> (Driver<QuietHost>, UnixStream) {
    let (driver, mut tasks) = node_of(QuietHost, 1);
    (driver, tasks.remove(0))
}

/// Whatever the task can read now.
fn read_now(task: &mut UnixStream) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match task.read(&mut buf) {
            Ok(0) => panic!("the server closed the connection"),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::WouldBlock => return got,
            Err(e) => panic!("{e}"),
        }
    }
}

#[test]
fn a_task_pipelining_requests_is_answered_within_bounds_and_in_order_after_it_stops_writing() {
    let (mut driver, mut task) = one_task();
    let value = "v".repeat(driver.server().limits().value_max());
    task.write_all(format!("cmd=put kvsname=kvs_7 key=big value={value}\n").as_bytes()).unwrap();
    driver.on_ready(0).unwrap();
    assert_eq!(read_now(&mut task), b"cmd=put_result rc=0\n");

    // 60 KB of gets in one write, for 1.6 MB of answers, none of which the task reads yet.
    let request = b"cmd=get kvsname=kvs_7 key=big\n";
    let count = 60_000 / request.len();
    task.write_all(&request.repeat(count)).unwrap();
    for _ in 0..4 {
        driver.on_ready(0).unwrap();
    }
    let answer = format!("cmd=get_result rc=0 value={value}\n").into_bytes();
    // The connection is full; beyond it the shell holds at most its bound and one answer.
    let queued = driver.server().output(0).len();
    assert!(queued <= 64 * 1024 + answer.len(), "{queued} bytes of answers queued in the server");
    assert!(driver.server().holds_input(0));

    // The task writes nothing more and reads: every answer comes, in order.
    let mut got = Vec::new();
    while got.len() < count * answer.len() {
        let before = got.len();
        got.extend(read_now(&mut task));
        driver.on_ready(0).unwrap();
        got.extend(read_now(&mut task));
        assert!(got.len() > before, "no answer after {} of {count}", got.len() / answer.len());
    }
    assert_eq!(got, answer.repeat(count));
    assert!(!driver.server().holds_input(0));
    // And the task is read again.
    task.write_all(b"cmd=get_appnum\n").unwrap();
    driver.on_ready(0).unwrap();
    assert_eq!(read_now(&mut task), b"cmd=appnum rc=0 appnum=0\n");
}

/// A host whose exchange goes over a connection of its own, served in the driver's loop: the result comes
/// when a byte arrives on it.
struct LinkHost {
    link: UnixStream,
    contribution: Option<Vec<u8>>,
    /// The exchange's result, once the link said so.
    done: Option<Vec<u8>>,
    watcher: Option<Watcher>,
}

const LINK: u64 = 7;

impl Host for LinkHost {
    fn collective(&mut self, contribution: &[u8]) -> Result<(), String> {
        self.contribution = Some(contribution.to_vec());
        Ok(())
    }
    fn abort(&mut self, rank: u32, _exit_code: i32, message: &str) {
        panic!("rank {rank} aborted: {message}");
    }
    fn job_error(&mut self, error: &JobError) {
        panic!("{error}");
    }
}

impl HostFds for LinkHost {
    fn watch(&mut self, watcher: Watcher) {
        watcher.add(self.link.as_raw_fd(), libc::EPOLLIN as u32, LINK).unwrap();
        assert!(watcher.add(self.link.as_raw_fd(), libc::EPOLLIN as u32, HOST_FD).is_err(), "a token too large");
        self.watcher = Some(watcher);
    }

    fn ready(&mut self, token: u64, events: u32) {
        assert_eq!((token, events & libc::EPOLLIN as u32), (LINK, libc::EPOLLIN as u32));
        let mut byte = [0u8; 1];
        assert_eq!(self.link.read(&mut byte).unwrap(), 1);
        self.done = Some(self.contribution.take().expect("a barrier waits"));
    }

    fn complete(&mut self, server: &mut Server) {
        if let Some(part) = self.done.take() {
            server.collective_complete(Ok(&[part.as_slice()]));
        }
    }
}

#[test]
fn a_hosts_own_fd_is_served_in_the_drivers_loop() {
    let job = JobInfo::new("kvs_7", TaskMap::block(&[1]), vec![0], vec!["node0".into()]);
    let server = Server::new(job, Limits::default()).unwrap();
    let (_handle, inbox) = channel().unwrap();
    let (ours, mut theirs) = UnixStream::pair().unwrap();
    let host = LinkHost { link: ours, contribution: None, done: None, watcher: None };
    let mut driver = Driver::new(server, host, inbox).unwrap();
    let (server, task) = socketpair().unwrap();
    driver.attach(0, server).unwrap();
    let mut task = UnixStream::from(task);
    task.set_nonblocking(true).unwrap();
    task.write_all(b"cmd=barrier_in\n").unwrap();
    driver.on_ready(0).unwrap();
    assert!(driver.host_mut().contribution.is_some(), "the barrier reached the host");
    assert_eq!(read_now(&mut task), b"");
    theirs.write_all(b"!").unwrap();
    driver.on_ready(0).unwrap();
    assert_eq!(read_now(&mut task), b"cmd=barrier_out rc=0\n");
}

/// A host of one node whose collective completes at once.
#[derive(Default)]
struct OneNode {
    done: Option<Vec<u8>>,
}

impl Host for OneNode {
    fn collective(&mut self, contribution: &[u8]) -> Result<(), String> {
        self.done = Some(contribution.to_vec());
        Ok(())
    }
    fn abort(&mut self, rank: u32, _exit_code: i32, message: &str) {
        panic!("rank {rank} aborted: {message}");
    }
    fn job_error(&mut self, _error: &JobError) {}
}

impl HostFds for OneNode {
    fn complete(&mut self, server: &mut Server) {
        if let Some(part) = self.done.take() {
            server.collective_complete(Ok(&[part.as_slice()]));
        }
    }
}

fn readable(fd: RawFd) -> bool {
    let mut looked = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: polls one pollfd of ours, without waiting.
    unsafe { libc::poll(&mut looked, 1, 0) > 0 }
}

/// The page as a task maps it, from the driver's file.
fn task_page(fd: RawFd, members: i64) -> rpmi_client::node_barrier::Page {
    // SAFETY: dup of an fd the driver holds open; the copy is owned at once.
    let copy = unsafe { OwnedFd::from_raw_fd(libc::dup(fd)) };
    rpmi_client::node_barrier::Page::map(copy, members).unwrap()
}

/// A break the server decides while the driver writes (held input parsed in the flush that ends
/// `on_ready`) reaches the page at once: nothing else would bring an event loop back, and task 1, asleep
/// on the page, would sleep on. Task 0 pipelines gets and a barrier by a line (which revision 1 allows),
/// so many that its input is held until it reads its answers.
#[test]
fn a_break_decided_while_the_driver_writes_reaches_the_page() {
    let (mut driver, mut tasks) = node_of(OneNode::default(), 2);
    let step = |driver: &mut Driver<OneNode>| (0..4).for_each(|_| assert!(driver.on_ready(0).is_ok()));
    for t in &mut tasks {
        t.write_all(b"cmd=init pmi_version=1 pmi_subversion=1 rpmi=3\n").unwrap();
    }
    step(&mut driver);
    tasks.iter_mut().for_each(|t| drop(read_now(t)));
    for t in &mut tasks {
        t.write_all(b"cmd=barrier_in\n").unwrap();
    }
    step(&mut driver);
    for t in &mut tasks {
        assert_eq!(read_now(t), b"cmd=barrier_out rc=0 node_barrier=2\n");
    }
    let page = task_page(driver.node_barrier.as_ref().unwrap().fd(), 2);
    // Task 1 counts itself in and waits on the page.
    let entry = page.enter();
    assert!(!entry.last);
    let value = "v".repeat(driver.server().limits().value_max());
    tasks[0].write_all(format!("cmd=put kvsname=kvs_7 key=big value={value}\n").as_bytes()).unwrap();
    step(&mut driver);
    drop(read_now(&mut tasks[0]));
    let request = b"cmd=get kvsname=kvs_7 key=big\n";
    let mut pipelined = request.repeat(60_000 / request.len());
    pipelined.extend_from_slice(b"cmd=barrier_in\n");
    tasks[0].write_all(&pipelined).unwrap();
    step(&mut driver);
    assert!(driver.server().holds_input(0));
    // Task 0 reads its answers; the driver runs only when its fd is readable, as an event loop runs it.
    loop {
        let got = read_now(&mut tasks[0]).len();
        if readable(driver.watch_fd()) {
            driver.on_ready(0).unwrap();
        } else if got == 0 && read_now(&mut tasks[0]).is_empty() {
            break;
        }
    }
    assert!(!driver.server().holds_input(0), "the barrier's line was parsed");
    // Broken at once: not after 0.1 s, the wait's first look at its connection.
    let woken = page.wait(&entry, || true);
    assert_eq!(woken, Ok(rpmi_client::node_barrier::Woken::Broken));
}

/// A task released on the page reads its release, however late it looks, and not a break that followed it
/// (a peer finalized at once) or came with it: the driver's page and a task's, in two threads, the task's
/// first look spread over the driver's writes, 100,000 rounds of each.
#[test]
fn a_task_woken_late_reads_its_release_not_a_break_that_followed() {
    use crate::server::NodeRelease;
    use rpmi_client::node_barrier::Woken;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    const ROUNDS: usize = 100_000;
    use crate::wire::node_barrier::{ARRIVED, BROKEN, PAGE};
    for ride in [false, true] {
        let host = node_barrier::Page::new().unwrap();
        let page = task_page(host.fd(), 1);
        // SAFETY: a third shared mapping of the page's file, PAGE bytes long, never unmapped (the test ends).
        let words = unsafe {
            let at = libc::mmap(std::ptr::null_mut(), PAGE, libc::PROT_WRITE, libc::MAP_SHARED, host.fd(), 0);
            assert_ne!(at, libc::MAP_FAILED);
            std::slice::from_raw_parts(at.cast::<std::sync::atomic::AtomicU32>(), PAGE / 4)
        };
        let go = Arc::new(AtomicUsize::new(0));
        let releases = {
            let go = go.clone();
            std::thread::spawn(move || {
                for i in 1..=ROUNDS {
                    while go.load(Ordering::Acquire) != 2 * i - 1 {
                        std::hint::spin_loop();
                    }
                    host.release(NodeRelease { code: Some(0), broken: ride });
                    if !ride {
                        host.release(NodeRelease { code: None, broken: true });
                    }
                    go.store(2 * i, Ordering::Release);
                }
            })
        };
        let mut broken = 0;
        for i in 1..=ROUNDS {
            // The page mended: the test plays every round's break afresh.
            words[BROKEN].store(0, Ordering::Relaxed);
            words[ARRIVED].store(0, Ordering::Relaxed);
            let entry = page.enter();
            go.store(2 * i - 1, Ordering::Release);
            (0..(i * 7919) % 400).for_each(|_| std::hint::spin_loop());
            if page.wait(&entry, || false) == Ok(Woken::Broken) {
                broken += 1;
            }
            while go.load(Ordering::Acquire) != 2 * i {
                std::hint::spin_loop();
            }
        }
        releases.join().unwrap();
        assert_eq!(broken, 0, "ride {ride}: {broken} of {ROUNDS} released barriers read as broken");
    }
}

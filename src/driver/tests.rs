//! The driver driven as an event-loop host drives it ([`Driver::on_ready`] without waiting, on this thread):
//! its back-pressure, and a host's own fds served in its loop, with the task's end of a real socketpair in
//! the test's hands.

use super::*;
use crate::server::{JobError, JobInfo, Limits, TaskMap};
use std::io::{ErrorKind, Read, Write};
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

/// A driver serving one task (the only rank), and the task's end of its connection, non-blocking.
fn one_task() -> (Driver<QuietHost>, UnixStream) {
    let job = JobInfo::new("kvs_7", TaskMap::block(&[1]), vec![0], vec!["node0".into()]);
    let server = Server::new(job, Limits::default()).unwrap();
    let (_handle, inbox) = channel().unwrap();
    let mut driver = Driver::new(server, QuietHost, inbox).unwrap();
    let (server, task) = socketpair().unwrap();
    driver.attach(0, server).unwrap();
    let task = UnixStream::from(task);
    task.set_nonblocking(true).unwrap();
    (driver, task)
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

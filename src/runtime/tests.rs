use super::*;
use crate::server::{Host, JobError, JobInfo, Limits, TaskMap};
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;

/// What the node told its host, in order.
#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<String>>>);

impl Seen {
    fn push(&self, s: String) {
        self.0.lock().unwrap().push(s);
    }

    fn all(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }

    /// Waits (at most 10 s) until something containing `what` was seen.
    fn wait_for(&self, what: &str) {
        for _ in 0..1000 {
            if self.all().iter().any(|s| s.contains(what)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("never saw {what:?}: {:?}", self.all());
    }
}

struct TestHost(Seen);

impl Host for TestHost {
    fn collective(&mut self, contribution: &[u8]) -> Result<(), String> {
        self.0.push(format!("collective {}", contribution.len()));
        Ok(())
    }
    fn abort(&mut self, rank: u32, exit_code: i32, message: &str) {
        self.0.push(format!("abort {rank} {exit_code} {message}"));
    }
    fn job_error(&mut self, error: &JobError) {
        self.0.push(format!("job_error {error}"));
    }
}

impl HostFds for TestHost {}

impl NodeHost for TestHost {
    fn served(&mut self, result: Result<(), String>) {
        self.0.push(format!("served {result:?}"));
    }
}

fn node(tasks: u32) -> (NodeRuntime<TestHost>, Seen) {
    let mut info = JobInfo::new("kvs", TaskMap::new(vec![0; tasks as usize]), (0..tasks).collect(), vec!["h".into()]);
    info.spawned = true;
    let server = Server::new(info, Limits::default()).unwrap();
    let seen = Seen::default();
    let job = JobVars { job_id: "42".into() };
    (NodeRuntime::new(server, TestHost(seen.clone()), job).unwrap(), seen)
}

fn var(vars: &[EnvVar], name: &str) -> String {
    let v = vars.iter().find(|v| v.name.to_str() == Ok(name)).unwrap_or_else(|| panic!("no {name}"));
    assert_eq!(v.entry.to_str().unwrap(), format!("{name}={}", v.value.to_str().unwrap()));
    v.value.to_str().unwrap().to_string()
}

/// The task's side of its connection: a copy of its end, as a forked child holds it.
fn task_end(vars: &[EnvVar]) -> UnixStream {
    let fd: RawFd = var(vars, "PMI_FD").parse().unwrap();
    // SAFETY: dup of the node's copy of the task's end, owned by the stream.
    UnixStream::from(unsafe { OwnedFd::from_raw_fd(libc::dup(fd)) })
}

fn ask(stream: &mut UnixStream, line: &str) -> String {
    stream.write_all(line.as_bytes()).unwrap();
    let mut answer = String::new();
    BufReader::new(stream).read_line(&mut answer).unwrap();
    answer
}

#[test]
fn a_task_is_answered_on_the_end_its_environment_names() {
    let (mut node, _) = node(2);
    node.start(Looping::OwnThread).unwrap();
    let vars = node.connect_task(1).unwrap().vars;
    assert_eq!(var(&vars, "PMI_RANK"), "1");
    assert_eq!(var(&vars, "PMI_SIZE"), "2");
    assert_eq!(var(&vars, "PMI_JOBID"), "42");
    assert_eq!(var(&vars, "PMI_SPAWNED"), "1");
    let mut task = task_end(&vars);
    node.forked(1).unwrap();
    assert_eq!(ask(&mut task, "cmd=get_my_kvsname\n"), "cmd=my_kvsname rc=0 kvsname=kvs\n");
}

#[test]
fn a_task_is_connected_once_and_only_if_it_is_local() {
    let (node, _) = node(2);
    node.connect_task(0).unwrap();
    assert!(matches!(node.connect_task(0), Err(NodeError::State(_))));
    assert!(matches!(node.connect_task(2), Err(NodeError::Invalid(_))));
    assert!(matches!(node.forked(2), Err(NodeError::Invalid(_))));
}

/// The hook in a real forked child: the task's own end survives exec, its siblings' ends are closed.
#[test]
fn the_exec_hook_keeps_the_tasks_end_and_closes_its_siblings() {
    let (node, _) = node(3);
    let fds: Vec<RawFd> = (0..3).map(|t| node.connect_task(t).unwrap().child_fd).collect();
    // SAFETY: the child calls only async-signal-safe functions (the hook, fcntl) and _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        let ok = node.exec_hook(1) == Ok(fds[1])
            // SAFETY (all three): fcntl on fds of this child.
            && unsafe { libc::fcntl(fds[1], libc::F_GETFD) } == 0
            && unsafe { libc::fcntl(fds[0], libc::F_GETFD) } < 0
            && unsafe { libc::fcntl(fds[2], libc::F_GETFD) } < 0;
        // SAFETY: ends the child without running the test harness's code.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    let mut status = 0;
    // SAFETY: waiting for our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert_eq!(status, 0, "the child's fds were not as the hook should leave them");
    // The parent's copies are untouched until it says the tasks are forked.
    // SAFETY: fcntl on our own fd.
    assert_eq!(unsafe { libc::fcntl(fds[0], libc::F_GETFD) }, libc::FD_CLOEXEC);
    node.forked_all();
    assert_eq!(node.exec_hook(0), Err(ExecError::NoEnd));
    assert_eq!(node.exec_hook(3), Err(ExecError::NoTask));
}

/// Once the node has closed its copy, a task that leaves closes its connection; once every task has, the
/// progress thread ends and says so.
#[test]
fn the_progress_thread_ends_when_every_task_has_left() {
    let (mut node, seen) = node(2);
    node.start(Looping::OwnThread).unwrap();
    let tasks: Vec<UnixStream> = (0..2).map(|t| task_end(&node.connect_task(t).unwrap().vars)).collect();
    node.forked_all();
    drop(tasks);
    seen.wait_for("served Ok(())");
}

#[test]
fn in_the_hosts_loop_work_is_done_by_progress_calls() {
    let (mut node, _) = node(1);
    node.start(Looping::HostLoop).unwrap();
    let mut task = task_end(&node.connect_task(0).unwrap().vars);
    node.forked(0).unwrap();
    task.write_all(b"cmd=get_my_kvsname\n").unwrap();
    let mut answer = String::new();
    let mut reader = BufReader::new(task.try_clone().unwrap());
    task.set_nonblocking(true).unwrap();
    for _ in 0..1000 {
        node.progress().unwrap();
        if reader.read_line(&mut answer).is_ok() {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(answer, "cmd=my_kvsname rc=0 kvsname=kvs\n");
}

#[test]
fn progress_is_refused_when_the_node_runs_its_own_thread() {
    let (mut node, _) = node(1);
    node.start(Looping::OwnThread).unwrap();
    assert!(matches!(node.progress(), Err(NodeError::State(_))));
    assert!(matches!(node.start(Looping::OwnThread), Err(NodeError::State(_))));
}

/// What a task wrote just before it left is still served at the stop, in either loop.
#[test]
fn the_stop_serves_what_tasks_wrote_before_they_left() {
    for looping in [Looping::OwnThread, Looping::HostLoop] {
        let (mut node, seen) = node(2);
        node.start(looping).unwrap();
        let mut task = task_end(&node.connect_task(0).unwrap().vars);
        let _other = node.connect_task(1).unwrap();
        node.forked_all();
        task.write_all(b"cmd=init pmi_version=1 pmi_subversion=1\ncmd=abort exitcode=7 message=bye\n").unwrap();
        drop(task);
        node.stop(None, || {});
        assert!(seen.all().contains(&"abort 0 7 bye".to_string()), "{looping:?}: {:?}", seen.all());
    }
}

/// A connection the host makes: an environment without `PMI_FD`, the host's end served once handed over (in
/// both modes), handed over once only, and a task that never got one seen leaving when it is abandoned.
#[test]
fn a_connection_the_host_makes_is_served_once_handed_over() {
    for looping in [Looping::OwnThread, Looping::HostLoop] {
        let (mut node, seen) = node(2);
        node.start(looping).unwrap();
        let vars = node.env_task(0).unwrap().vars;
        assert!(vars.iter().all(|v| v.name.to_str() != Ok("PMI_FD")), "{looping:?}");
        assert_eq!(var(&vars, "PMI_RANK"), "0");
        assert!(matches!(node.env_task(0), Err(NodeError::State(_))));
        let (ours, theirs) = socketpair().unwrap();
        assert!(matches!(node.attach_task(1, ours), Err(NodeError::State(_))), "task 1 has no environment yet");
        let (ours, theirs_again) = socketpair().unwrap();
        node.attach_task(0, ours).unwrap();
        drop(theirs);
        let mut task = UnixStream::from(theirs_again);
        let (spare, _) = socketpair().unwrap();
        assert!(matches!(node.attach_task(0, spare), Err(NodeError::State(_))), "attached twice");
        if looping == Looping::HostLoop {
            // The host's loop: the request is served by a progress call once it is written.
            task.write_all(b"cmd=get_my_kvsname\n").unwrap();
            // The attach is taken in, then the request read: a progress call each at most.
            for _ in 0..3 {
                node.progress().unwrap();
            }
            let mut answer = String::new();
            BufReader::new(&mut task).read_line(&mut answer).unwrap();
            assert_eq!(answer, "cmd=my_kvsname rc=0 kvsname=kvs\n");
        } else {
            assert_eq!(ask(&mut task, "cmd=get_my_kvsname\n"), "cmd=my_kvsname rc=0 kvsname=kvs\n");
        }
        // Task 0 waits in a barrier; task 1 never gets its connection, and is abandoned: it is seen leaving.
        task.write_all(b"cmd=init pmi_version=1 pmi_subversion=1\ncmd=barrier_in\n").unwrap();
        node.env_task(1).unwrap();
        node.abandon(1).unwrap();
        node.abandon(0).unwrap();
        if looping == Looping::HostLoop {
            for _ in 0..3 {
                node.progress().unwrap();
            }
        }
        seen.wait_for("rank 1");
        assert!(seen.all().iter().any(|s| s.starts_with("job_error") && s.contains("rank 1")), "{:?}", seen.all());
    }
}

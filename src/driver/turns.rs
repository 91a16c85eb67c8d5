//! [`Turns`]: the order in which a server answers its tasks when many are waiting.
//!
//! Every answer wakes a task blocked on its read, and that costs a switch into the task's address space.
//! When a node runs far more tasks than it has CPUs, that switch grows dearer the more distinct processes
//! take turns on a CPU, and answering whoever is ready makes every task take its turn, where answering the
//! tasks in turns keeps fewer of them switching (docs/architecture.md says why, benches/results/README.md
//! has the measurements). So the tasks are watched in groups of [`GROUP`], one epoll set each, nested in one
//! top set, and a group with requests keeps the server for a turn of up to [`TURN`] ready connections
//! before the next ready group has its turn. The server never waits while a request is ready: when the
//! group whose turn it is has nothing to ask, the next group with requests is served. Up to
//! [`GROUPED_ABOVE`] tasks are one set, answered whoever is ready: so few processes switch cheaply, and
//! turns would only add syscalls (at 64 tasks they made every workload of the benchmark slower).

use crate::os::Epoll;
use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;

/// Tasks per group.
pub const GROUP: usize = 16;
/// The most ready connections one group is served in a turn, while another group has requests: 64 per
/// task of a full group. A ready task waits at most for every other group's turn.
pub const TURN: usize = 64 * GROUP;
/// Tasks are grouped only when there are more than this many.
pub const GROUPED_ABOVE: usize = 4 * GROUP;

/// The bit of a top-set token that marks a group's epoll set; the caller's own fds in the top set carry
/// tokens without it.
const GROUP_TOKEN: u64 = 1 << 63;

/// Task connections in groups, each group an epoll set nested in one top set.
pub struct Turns {
    /// Shared with the host's [`super::Watcher`], which adds its own fds to it.
    top: Arc<Epoll>,
    /// Empty when the tasks are few: their connections are then in the top set.
    groups: Vec<Epoll>,
    tasks: usize,
    /// The group whose turn it is, and how many ready connections it was given in this turn.
    current: usize,
    given: usize,
    top_ready: Vec<libc::epoll_event>,
}

impl Turns {
    /// Sets for `tasks` tasks, numbered from 0.
    pub fn new(tasks: usize) -> io::Result<Self> {
        let top = Arc::new(Epoll::new()?);
        let count = if tasks > GROUPED_ABOVE { tasks.div_ceil(GROUP) } else { 0 };
        let groups = (0..count).map(|_| Epoll::new()).collect::<io::Result<Vec<_>>>()?;
        for (g, group) in groups.iter().enumerate() {
            top.add(group.fd(), libc::EPOLLIN as u32, GROUP_TOKEN | g as u64)?;
        }
        let top_ready = vec![libc::epoll_event { events: 0, u64: 0 }; groups.len() + 8];
        Ok(Turns { top, groups, tasks, current: 0, given: 0, top_ready })
    }

    /// The fd that is readable whenever [`Turns::wait`] has something to report.
    pub fn fd(&self) -> RawFd {
        self.top.fd()
    }

    /// The top set, for fds the host serves itself.
    pub(crate) fn top(&self) -> Arc<Epoll> {
        self.top.clone()
    }

    /// Watches `fd`, which is no task's connection, for `events` in the top set: [`Turns::wait`] reports
    /// it whoever's turn it is. `token` must not have bit 63 set.
    pub fn watch(&self, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        debug_assert_eq!(token & GROUP_TOKEN, 0);
        self.top.add(fd, events, token)
    }

    /// Watches `task`'s connection `fd` for `events`; its events carry `task` as their token.
    pub fn add(&self, task: usize, fd: RawFd, events: u32) -> io::Result<()> {
        self.group_of(task)?.add(fd, events, task as u64)
    }

    /// Changes the events watched on `task`'s connection `fd`.
    pub fn modify(&self, task: usize, fd: RawFd, events: u32) -> io::Result<()> {
        self.group_of(task)?.modify(fd, events, task as u64)
    }

    fn group_of(&self, task: usize) -> io::Result<&Epoll> {
        if task >= self.tasks {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "no such task"));
        }
        Ok(self.groups.get(task / GROUP).unwrap_or(&self.top))
    }

    /// Waits at most `timeout_ms` (-1: forever) for events, and fills `ready` with those of the fds given
    /// to [`Turns::watch`] followed by those of one group's connections: the group whose turn it is, or
    /// the next one with events. Returns how many it filled (0 on a timeout or a signal).
    pub fn wait(&mut self, ready: &mut [libc::epoll_event], timeout_ms: i32) -> io::Result<usize> {
        let top = if self.groups.is_empty() { &mut *ready } else { &mut self.top_ready[..] };
        let n = self.top.wait(top, timeout_ms)?;
        if self.groups.is_empty() {
            return Ok(n);
        }
        let top = &self.top_ready;
        let mut filled = 0;
        let mut next: Option<usize> = None;
        let mut current_ready = false;
        // How far group g comes after the current one, going round.
        let after = |g: usize| (g + self.groups.len() - self.current - 1) % self.groups.len();
        for ev in &top[..n] {
            if ev.u64 & GROUP_TOKEN == 0 {
                if filled < ready.len() {
                    ready[filled] = *ev;
                    filled += 1;
                }
                continue;
            }
            let g = (ev.u64 & !GROUP_TOKEN) as usize;
            current_ready |= g == self.current;
            if g != self.current && next.is_none_or(|best| after(g) < after(best)) {
                next = Some(g);
            }
        }
        let group = match next {
            Some(g) if !current_ready || self.given >= TURN => g,
            _ if current_ready => self.current,
            _ => return Ok(filled),
        };
        if group != self.current || self.given >= TURN {
            (self.current, self.given) = (group, 0);
        }
        let room = &mut ready[filled..];
        // A zero timeout: the top set said this group has events (epoll refuses an empty buffer).
        let m = if room.is_empty() { 0 } else { self.groups[group].wait(room, 0)? };
        self.given += m;
        Ok(filled + m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::socketpair;
    use std::os::fd::{AsRawFd, OwnedFd};

    /// Turns for enough tasks to be grouped, with task 0 (group 0) and task GROUP (group 1) connected;
    /// the task ends are returned to write requests on.
    fn two_groups() -> (Turns, Vec<OwnedFd>, Vec<OwnedFd>) {
        let turns = Turns::new(GROUPED_ABOVE + 1).unwrap();
        let (mut ours, mut theirs) = (Vec::new(), Vec::new());
        for task in [0, GROUP] {
            let (server, task_end) = socketpair().unwrap();
            turns.add(task, server.as_raw_fd(), libc::EPOLLIN as u32).unwrap();
            ours.push(server);
            theirs.push(task_end);
        }
        (turns, ours, theirs)
    }

    fn ask(fd: &OwnedFd) {
        // SAFETY: writing one byte from a live buffer.
        assert_eq!(unsafe { libc::write(fd.as_raw_fd(), b"x".as_ptr().cast(), 1) }, 1);
    }

    fn tokens(turns: &mut Turns) -> Vec<u64> {
        let mut ready = [libc::epoll_event { events: 0, u64: 0 }; GROUP + 1];
        let n = turns.wait(&mut ready, 1000).unwrap();
        ready[..n].iter().map(|ev| ev.u64).collect()
    }

    #[test]
    fn a_ready_group_keeps_its_turn_and_then_yields_it() {
        let (mut turns, _ours, theirs) = two_groups();
        ask(&theirs[0]);
        ask(&theirs[1]);
        // Nothing is read, so task 0 stays ready (level-triggered) and is given again until its turn ends.
        for _ in 0..TURN {
            assert_eq!(tokens(&mut turns), [0]);
        }
        assert_eq!(tokens(&mut turns), [GROUP as u64]);
        assert_eq!(tokens(&mut turns), [GROUP as u64], "the new turn is group 1's");
    }

    #[test]
    fn the_next_ready_group_is_served_when_the_current_one_has_nothing() {
        let (mut turns, _ours, theirs) = two_groups();
        ask(&theirs[1]);
        assert_eq!(tokens(&mut turns), [GROUP as u64]);
    }

    #[test]
    fn watched_fds_are_reported_in_every_turn() {
        let (mut turns, _ours, theirs) = two_groups();
        let (wake, waker) = socketpair().unwrap();
        turns.watch(wake.as_raw_fd(), libc::EPOLLIN as u32, 7).unwrap();
        ask(&waker);
        assert_eq!(tokens(&mut turns), [7]);
        ask(&theirs[1]);
        assert_eq!(tokens(&mut turns), [7, GROUP as u64]);
    }

    #[test]
    fn a_task_beyond_the_sets_is_refused() {
        let (turns, ours, _theirs) = two_groups();
        assert!(turns.add(GROUPED_ABOVE + 1, ours[0].as_raw_fd(), libc::EPOLLIN as u32).is_err());
    }

    #[test]
    fn few_tasks_are_answered_whoever_is_ready() {
        let mut turns = Turns::new(GROUPED_ABOVE).unwrap();
        let mut ends = Vec::new();
        for task in [0, GROUP, GROUPED_ABOVE - 1] {
            let (server, task_end) = socketpair().unwrap();
            turns.add(task, server.as_raw_fd(), libc::EPOLLIN as u32).unwrap();
            ask(&task_end);
            ends.push((server, task_end));
        }
        let mut got = tokens(&mut turns);
        got.sort();
        assert_eq!(got, [0, GROUP as u64, GROUPED_ABOVE as u64 - 1]);
        assert!(turns.add(GROUPED_ABOVE, ends[0].0.as_raw_fd(), libc::EPOLLIN as u32).is_err());
    }
}

//! The server's replies, for calls that wait at once: PMI 1.2 group barriers from several threads (threaded
//! MPICH enters one per thread, in any order on each rank), beside the plain requests of other threads.
//!
//! A plain request (every one but a group barrier) is sent and answered under the session's lock, so at most
//! one is outstanding; a group barrier is sent under the lock and waited for without it. Whichever waiting
//! thread finds nobody reading reads the next line and hands it out: a `barrier_out` whose `tag` is an
//! outstanding group barrier's goes to that barrier, any other line to the plain request. Group tags are
//! never 0 (`tag_of` in `lib.rs`), the tag of a plain barrier's `barrier_out`, and one tag is outstanding at a
//! time per process (a second barrier of the same tag waits for the first to end).

use rpmi_client::conn::Conn;
use rpmi_client::Failed;
use rpmi_wire::reply::{quote, Reply};
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Condvar, Mutex, MutexGuard};

pub struct Mailbox {
    /// The reading side of the connection, used by one thread at a time (the one that set `reading`).
    reader: Mutex<Conn>,
    state: Mutex<State>,
    /// A line was handed out, the connection broke, a reader stopped, or a group barrier ended.
    changed: Condvar,
}

#[derive(Default)]
struct State {
    /// A thread is reading the connection.
    reading: bool,
    /// The reply to the plain request outstanding, once read.
    plain: Option<String>,
    /// The group barriers outstanding, by tag, with their `barrier_out` once read.
    groups: BTreeMap<i64, Option<String>>,
    /// Why the connection can no longer be read: every waiter fails with it.
    broken: Option<String>,
}

/// What a waiter waits for.
#[derive(Clone, Copy)]
pub enum Awaited {
    Plain,
    Group(i64),
}

impl Mailbox {
    pub fn new(reader: Conn) -> Mailbox {
        Mailbox { reader: Mutex::new(reader), state: Mutex::new(State::default()), changed: Condvar::new() }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait_on<'a>(&self, state: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.changed.wait(state).unwrap_or_else(|e| e.into_inner())
    }

    /// A group barrier of `tag` is about to be sent: its `barrier_out` is kept for it. Waits while another
    /// thread's barrier of the same tag is outstanding.
    pub fn expect_group(&self, tag: i64) {
        let mut state = self.state();
        while state.groups.contains_key(&tag) {
            state = self.wait_on(state);
        }
        state.groups.insert(tag, None);
    }

    /// The group barrier of `tag` was not sent after all.
    pub fn forget_group(&self, tag: i64) {
        self.state().groups.remove(&tag);
        self.changed.notify_all();
    }

    /// The next line for `awaited`, reading the connection when no other thread is.
    pub fn take(&self, awaited: Awaited) -> Result<String, Failed> {
        let mut state = self.state();
        loop {
            let mine = match awaited {
                Awaited::Plain => state.plain.take(),
                Awaited::Group(tag) => match state.groups.get_mut(&tag) {
                    Some(slot @ Some(_)) => {
                        let line = slot.take();
                        state.groups.remove(&tag);
                        self.changed.notify_all();
                        line
                    }
                    _ => None,
                },
            };
            if let Some(line) = mine {
                return Ok(line);
            }
            if let Some(why) = state.broken.clone() {
                if let Awaited::Group(tag) = awaited {
                    state.groups.remove(&tag);
                }
                return Err(Failed::said(why));
            }
            if state.reading {
                state = self.wait_on(state);
                continue;
            }
            state.reading = true;
            drop(state);
            // A panic in the read must not leave `reading` set, or every other waiter would wait for ever.
            let read = catch_unwind(AssertUnwindSafe(|| self.reader.lock().unwrap_or_else(|e| e.into_inner()).line()));
            state = self.state();
            state.reading = false;
            match read {
                Ok(Ok(line)) => state.hand_out(line),
                Ok(Err(failed)) => state.broken = Some(failed.message.unwrap_or_default()),
                Err(_) => state.broken = Some("reading the PMI server's answer failed".into()),
            }
            self.changed.notify_all();
        }
    }
}

impl State {
    fn hand_out(&mut self, line: String) {
        let barrier = line.starts_with("cmd=barrier_out ");
        let tag = barrier.then(|| Reply::parse(&line).ok().and_then(|r| r.int("tag").ok())).flatten();
        if let Some(slot @ None) = tag.and_then(|t| self.groups.get_mut(&t)) {
            *slot = Some(line);
        } else if self.plain.is_none() {
            self.plain = Some(line);
        } else {
            self.broken = Some(format!("the PMI server sent {} where no answer was due", quote(&line)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::State;

    #[test]
    fn a_group_barriers_answer_goes_to_it_and_any_other_line_to_the_plain_request() {
        let mut state = State::default();
        state.groups.insert(7, None);
        state.hand_out("cmd=barrier_out rc=0 tag=7".into());
        assert_eq!(state.groups[&7].as_deref(), Some("cmd=barrier_out rc=0 tag=7"));
        // A plain barrier's answer (tag 0), and a second answer of a barrier whose first is not yet taken.
        state.hand_out("cmd=barrier_out rc=0 tag=0".into());
        assert_eq!(state.plain.as_deref(), Some("cmd=barrier_out rc=0 tag=0"));
        assert!(state.broken.is_none());
        state.hand_out("cmd=barrier_out rc=0 tag=7".into());
        assert!(state.broken.as_deref().unwrap().contains("where no answer was due"), "{:?}", state.broken);
    }
}

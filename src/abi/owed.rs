//! [`OwedAnswers`]: the C host's answers to service requests, refused where they come in when none is owed.

use crate::server::TaskId;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Which tasks the C host owes an answer to a service request, shared with the threads on which its answers
/// come in: `service_complete` may come on any thread and must be refused there and then when no answer is
/// owed, while what the task waits for is known only on the engine's thread.
///
/// [`super::c_host::CHost`] marks a task before it hands the request to the C host (which may answer before
/// its callback returns). The thread an answer comes in on claims the mark ([`OwedAnswers::claim`]) before
/// it passes the answer on; `CHost` claims it itself when the C host refuses. So each request lets one
/// answer through: an answer to a refused request, or a second answer, finds nothing owed, and an answer
/// claimed before the host refused is the one the task gets, never one left over for its next request.
/// Which service the task waits for stays recorded in the engine alone.
#[derive(Debug, Clone)]
pub struct OwedAnswers(Arc<[AtomicBool]>);

impl OwedAnswers {
    pub fn new(tasks: usize) -> OwedAnswers {
        OwedAnswers((0..tasks).map(|_| AtomicBool::new(false)).collect())
    }

    /// The host now owes `task` an answer.
    pub fn owe(&self, task: TaskId) {
        if let Some(flag) = self.0.get(task) {
            flag.store(true, Ordering::SeqCst);
        }
    }

    /// Takes the answer the host owes `task`: `false` if none is owed (none was asked for, the host
    /// refused it, or it was answered already), and then the answer must not reach the shell.
    pub fn claim(&self, task: TaskId) -> bool {
        self.0.get(task).is_some_and(|flag| flag.swap(false, Ordering::SeqCst))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_request_lets_one_answer_through() {
        let owed = OwedAnswers::new(2);
        assert!(!owed.claim(0), "an answer before any request");
        owed.owe(0);
        assert!(!owed.claim(1), "another task's answer");
        assert!(owed.claim(0));
        assert!(!owed.claim(0), "a second answer to one request");
        assert!(!owed.claim(7), "a task that is not there");
    }
}

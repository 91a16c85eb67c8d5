//! The node barrier (revision 3 of rpmi's additions to the wire): a page of memory that a node's tasks share
//! with their server, through which a full barrier's arrivals and its release go where every local task is a
//! client of rpmi's libraries that said `rpmi=3` at `init`. The first full barrier goes by lines; its
//! `barrier_out` then says `node_barrier=N` (the node's tasks) to each, with the page's memory file. Each task counts itself in; the last one in sends one
//! `node_barrier_in` line for all; the server's release bumps a generation that every task waits on with one
//! futex, woken together by one call. A line each way per task becomes none, and the server reads one line a
//! node rather than one a task.
//!
//! The page is a memory file the server makes, sealed so that nobody can shrink or grow it (a task's peers
//! cannot make its accesses fault). Every task of the job on
//! the node can write all of it: nothing in it is trusted by the server, which only writes [`GENERATION`],
//! [`CODE`] and [`BROKEN`] and never decides on what it reads there. What a task could do with it (count
//! itself twice, wake its peers early) it could do to its own job by its own lines.
//!
//! Layout: 32-bit words in the byte order of the machine (only processes of one node share it).

/// The page's length: what the server makes and what a library checks before it maps it.
pub const PAGE: usize = 4096;

/// The word each task adds one to as it comes in; the last one in (the count reaches the node's members) sets
/// it back to 0 before it sends `node_barrier_in`.
pub const ARRIVED: usize = 0;
/// The word tasks wait on (a futex): moved by 2 at each release, by 1 at a break alone, so that a task woken
/// late tells its barrier's release from a break that followed it.
pub const GENERATION: usize = 1;
/// The last release's return code, written before the generation moves: 0, or the failed barrier's. A break
/// alone leaves it.
pub const CODE: usize = 2;
/// Not 0 once the page is broken (a local task finalized, went, or came to a barrier by a line): no barrier
/// can complete on it again. A release marks it after it moves the generation, a break alone before: a task
/// that finds it set looks at the generation again, and where that has not moved by 2 since it came in, asks
/// the server by a line (`barrier_in`), whose answer names what went wrong.
pub const BROKEN: usize = 3;

//! The node barrier on a library's side (`rpmi_wire::node_barrier`): the page the server sends with its
//! answer to `get_node_barrier`, checked (its length sealed, so that no peer can make this process's accesses
//! fault) and mapped. A barrier counts itself in on the page, the last task in tells the server by one line,
//! and every task waits on the page's generation (a futex) for the release, looking at its connection now and
//! then so that a server that is gone is noticed rather than waited for.
//!
//! The node's other tasks can write the page: what they write can end or hang their own job's barrier (as
//! their own lines could), and nothing here reads past the page's four words.

use rpmi_wire::node_barrier::{ARRIVED, BROKEN, CODE, GENERATION, PAGE};
use std::os::fd::{AsRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

/// How long a wait on the page sleeps before it looks whether the server is still there.
const LOOK_EVERY: libc::timespec = libc::timespec { tv_sec: 0, tv_nsec: 100_000_000 };

/// The page, mapped (unmapped when dropped), and how many tasks of the node count themselves in on it.
pub struct Page {
    words: NonNull<AtomicU32>,
    members: u32,
}

// SAFETY: shared memory reached only through atomics.
unsafe impl Send for Page {}
// SAFETY: as above.
unsafe impl Sync for Page {}

/// A task's arrival at a barrier on the page.
pub struct Entry {
    /// The generation before it came in: its release moves it.
    generation: u32,
    /// It came in last: it tells the server (`node_barrier_in`).
    pub last: bool,
}

impl Page {
    /// Maps `file`, the page the server announced for `members` tasks: `Err` says why it cannot be used.
    pub fn map(file: OwnedFd, members: i64) -> Result<Page, String> {
        let members = u32::try_from(members).ok().filter(|&m| m > 0).ok_or(format!("{members} members"))?;
        let fd = file.as_raw_fd();
        let need = libc::F_SEAL_GROW | libc::F_SEAL_SHRINK;
        let (seals, size) = crate::image::seals_and_size(fd);
        if seals & need != need {
            return Err("its memory file's length is not sealed".into());
        }
        if size != i64::try_from(PAGE).ok() {
            return Err(format!("its memory file holds {size:?} bytes, not {PAGE}"));
        }
        // SAFETY: a new shared mapping of the whole file, which is PAGE bytes long and cannot change length.
        let at = unsafe {
            libc::mmap(std::ptr::null_mut(), PAGE, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
        };
        if at == libc::MAP_FAILED {
            return Err(format!("it cannot be mapped: {}", std::io::Error::last_os_error()));
        }
        let words = NonNull::new(at.cast()).ok_or("it was mapped at 0")?;
        Ok(Page { words, members })
    }

    fn word(&self, index: usize) -> &AtomicU32 {
        debug_assert!((index + 1) * 4 <= PAGE);
        // SAFETY: within the page, mapped until drop; a page's 4-multiple offsets are aligned for a u32.
        unsafe { &*self.words.as_ptr().add(index) }
    }

    /// A local task finalized or went: no barrier can complete on the page again.
    pub fn broken(&self) -> bool {
        self.word(BROKEN).load(Ordering::Acquire) != 0
    }

    /// Counts this task in. The generation is read first, so that no release can slip between the count and
    /// the wait; the last one in sets the count back before it tells the server, so that the next barrier's
    /// first arrival, which can only follow this one's release, counts from 0.
    pub fn enter(&self) -> Entry {
        let generation = self.word(GENERATION).load(Ordering::Acquire);
        let last = self.word(ARRIVED).fetch_add(1, Ordering::AcqRel).wrapping_add(1) == self.members;
        if last {
            self.word(ARRIVED).store(0, Ordering::Release);
        }
        Entry { generation, last }
    }

    /// Waits for `entry`'s release, or for a break of the page (the task then asks by a line). `Err` where
    /// `server_gone` says, on one of its looks, that the server is gone.
    pub fn wait(&self, entry: &Entry, mut server_gone: impl FnMut() -> bool) -> Result<Woken, String> {
        let generation = self.word(GENERATION);
        let released = || generation.load(Ordering::Acquire).wrapping_sub(entry.generation) >= 2;
        loop {
            let now = generation.load(Ordering::Acquire);
            if released() {
                return Ok(Woken::Released(self.word(CODE).load(Ordering::Relaxed) as i32));
            }
            // A release moves the generation before it marks the page broken: a page found broken is looked at
            // again, so that a barrier released before a break (a peer finalized right after it) is not taken
            // for broken.
            if self.broken() {
                return Ok(match released() {
                    true => Woken::Released(self.word(CODE).load(Ordering::Relaxed) as i32),
                    false => Woken::Broken,
                });
            }
            // SAFETY: FUTEX_WAIT on a word of our live mapping, with a timeout of ours; it reads nothing else.
            // Not private: the waker is the server, another process.
            let slept = unsafe {
                libc::syscall(
                    libc::SYS_futex,
                    generation.as_ptr(),
                    libc::FUTEX_WAIT,
                    now,
                    &LOOK_EVERY as *const libc::timespec,
                    0,
                    0,
                )
            };
            if slept < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ETIMEDOUT) && server_gone() {
                return Err("the PMI server closed the connection during the barrier".into());
            }
        }
    }
}

/// The node barrier as a process knows it.
pub enum NodeBarrier {
    /// The server speaks it (`rpmi=3`): the first full barrier's answer says whether it is on.
    Undecided,
    /// Full barriers go through the node's page (by lines once the page is broken).
    On(Page),
    /// Full barriers go by lines: not served, not on for this node, or not wanted.
    Off,
}

impl NodeBarrier {
    /// The revision of rpmi's additions a library says at `init`: 3 (the node barrier) unless the job says
    /// not to (`RPMI_NODE_BARRIER=0`), else 2.
    pub fn revision_asked() -> &'static str {
        match crate::env(c"RPMI_NODE_BARRIER").is_some_and(|v| v.trim() == "0") {
            true => "2",
            false => "3",
        }
    }

    /// As the server's answer to `init` says: `revision`, that of rpmi's additions it answered.
    pub fn answered(revision: u32) -> NodeBarrier {
        if revision >= 3 {
            NodeBarrier::Undecided
        } else {
            NodeBarrier::Off
        }
    }

    /// The first full barrier is about to go: its answer decides (the page comes with it).
    pub fn deciding(&self) -> bool {
        matches!(self, NodeBarrier::Undecided)
    }

    /// What the first full barrier's answer said (`node_barrier=N`, or nothing) and the file that came with
    /// it decide: on where the page maps, off otherwise. A page that does not map is named on stderr once,
    /// by library `lib`.
    pub fn decide(&mut self, lib: &str, members: Option<i64>, file: Option<OwnedFd>) {
        *self = match (members, file) {
            (Some(members), Some(file)) => match Page::map(file, members) {
                Ok(page) => NodeBarrier::On(page),
                Err(why) => {
                    crate::cabi::say(&format!(
                        "{lib}: the node barrier's page cannot be used ({why}): barriers go by lines"
                    ));
                    NodeBarrier::Off
                }
            },
            _ => NodeBarrier::Off,
        };
    }
}

/// How a wait on the page ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Woken {
    /// The barrier ended, with this code (0, or the failed barrier's).
    Released(i32),
    /// The page broke before the barrier ended: the task asks by a line.
    Broken,
}

impl Drop for Page {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, of that length, no longer used.
        unsafe { libc::munmap(self.words.as_ptr().cast(), PAGE) };
    }
}

//! The node barrier's page on the host's side (its layout is `rpmi_wire::node_barrier`'s): a memory file the
//! driver makes for its server's tasks, its length sealed, mapped here to write the releases the server
//! hands out ([`Server::node_release`]) and wake the tasks waiting on it.
//!
//! The tasks can write every byte of the page. The host writes three words and bumps one, and decides
//! nothing on what it reads there; and the length's seals mean no task can make the host's accesses fault.

use crate::os;
use crate::server::NodeRelease;
use crate::wire::node_barrier::{BROKEN, CODE, GENERATION, PAGE};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU32, Ordering};

pub struct Page {
    file: OwnedFd,
    /// The page's mapping, shared with the tasks: [`PAGE`] bytes, held until drop.
    words: std::ptr::NonNull<AtomicU32>,
}

// SAFETY: the mapping is shared memory reached only through atomics; the driver that owns it may move to its
// progress thread.
unsafe impl Send for Page {}

impl Page {
    /// A new page, its length sealed and mapped.
    pub fn new() -> io::Result<Page> {
        let file = os::memfd(c"rpmi-node-barrier")?;
        // SAFETY: ftruncate on an fd of ours changes no memory.
        if unsafe { libc::ftruncate(file.as_raw_fd(), PAGE as libc::off_t) } < 0 {
            return Err(io::Error::last_os_error());
        }
        os::seal_length(&file)?;
        // SAFETY: a new shared mapping of the whole file, which is PAGE bytes long and cannot change length.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let words = std::ptr::NonNull::new(map.cast()).ok_or_else(|| io::Error::other("mmap gave a null page"))?;
        Ok(Page { file, words })
    }

    /// The page's memory file, which goes with the answers to `get_node_barrier`.
    pub fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    fn word(&self, index: usize) -> &AtomicU32 {
        debug_assert!((index + 1) * 4 <= PAGE);
        // SAFETY: within the page, which is mapped until drop; a u32 is 4-aligned at a page's 4-multiple offset.
        unsafe { &*self.words.as_ptr().add(index) }
    }

    /// Writes `release` and wakes every task waiting on the page. A release writes its code and moves the
    /// generation by 2 before it marks the page broken (if it breaks it), and a break alone marks the page
    /// broken before it moves the generation by 1: so a task that finds the page broken and then looks at the
    /// generation again tells its barrier's release, however late it looks, from a break that came while it
    /// waited.
    pub fn release(&self, release: NodeRelease) {
        match release.code {
            Some(code) => {
                self.word(CODE).store(code as u32, Ordering::Relaxed);
                self.word(GENERATION).fetch_add(2, Ordering::Release);
                if release.broken {
                    self.word(BROKEN).store(1, Ordering::Release);
                }
            }
            None => {
                self.word(BROKEN).store(1, Ordering::Release);
                self.word(GENERATION).fetch_add(1, Ordering::Release);
            }
        }
        // SAFETY: FUTEX_WAKE on a word of our live mapping; it reads no memory of ours beyond its address.
        // Not private: the waiters are other processes.
        unsafe { libc::syscall(libc::SYS_futex, self.word(GENERATION).as_ptr(), libc::FUTEX_WAKE, i32::MAX, 0, 0, 0) };
    }
}

impl Drop for Page {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, of that length, no longer used.
        unsafe { libc::munmap(self.words.as_ptr().cast(), PAGE) };
    }
}

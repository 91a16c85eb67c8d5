//! rpmi's image of the node's key-value space (`rpmi_wire::image`), as a library maps it: the server sends a
//! sealed memory file with its answer to `get_kvs_image`; the library checks the file's seals and length and
//! the image whole, maps it read-only, closes the file, and answers gets from the mapping until the next
//! barrier. Nothing in the file is trusted: an image that breaks a rule is refused, and the library reads the
//! wire instead.

use rpmi_wire::image::Image;
use std::os::fd::{AsRawFd, OwnedFd};

/// The largest image mapped: rpmi's server bounds its store far below it.
const MAPPED_MAX: usize = 1 << 32;

/// An image mapped read-only, unmapped when dropped.
pub struct Mapped {
    at: *const u8,
    len: usize,
}

// SAFETY: a read-only mapping of a sealed file: no process can change its bytes, so any thread may read it.
unsafe impl Send for Mapped {}
// SAFETY: as above.
unsafe impl Sync for Mapped {}

/// The seals of memory file `fd` (none where it has none or is no memory file) and its length, if it has one.
pub(crate) fn seals_and_size(fd: std::os::fd::RawFd) -> (i32, Option<i64>) {
    // SAFETY: fcntl and fstat on an fd of ours; fstat writes into our own stat.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        (libc::fcntl(fd, libc::F_GET_SEALS).max(0), (libc::fstat(fd, &mut st) == 0).then_some(st.st_size))
    }
}

impl Mapped {
    /// Maps `file`, which the server announced as `bytes` long: `Err` says why it cannot be used.
    pub fn map(file: OwnedFd, bytes: usize) -> Result<Mapped, String> {
        let fd = file.as_raw_fd();
        // Sealed against writing, growing and shrinking: else its bytes could change after they were checked,
        // or a read past a shrunk end could raise SIGBUS.
        let need = libc::F_SEAL_WRITE | libc::F_SEAL_GROW | libc::F_SEAL_SHRINK;
        let (seals, size) = seals_and_size(fd);
        if seals & need != need {
            return Err("its memory file is not sealed against writing".into());
        }
        if size != i64::try_from(bytes).ok() || bytes == 0 || bytes >= MAPPED_MAX {
            return Err(format!("its memory file holds {size:?} bytes where {bytes} were announced"));
        }
        // SAFETY: a new read-only shared mapping of `bytes` bytes of the file, which holds that many and cannot
        // shrink; nothing else is at the address the kernel picks.
        let at = unsafe { libc::mmap(std::ptr::null_mut(), bytes, libc::PROT_READ, libc::MAP_SHARED, fd, 0) };
        if at == libc::MAP_FAILED {
            return Err(format!("it cannot be mapped: {}", std::io::Error::last_os_error()));
        }
        let mapped = Mapped { at: at.cast(), len: bytes };
        Image::parse(mapped.bytes()).map_err(|e| format!("it is malformed: {e}"))?;
        Ok(mapped)
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `len` bytes mapped read-only at `at` for as long as `self` lives; their file cannot change.
        unsafe { std::slice::from_raw_parts(self.at, self.len) }
    }

    /// The value of `key` in the image.
    pub fn get(&self, key: &[u8]) -> Option<&[u8]> {
        Image::open(self.bytes()).ok()?.get(key)
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: unmaps what `map` mapped; nothing borrows it past `self`.
        unsafe { libc::munmap(self.at.cast_mut().cast(), self.len) };
    }
}

/// How many gets after a full barrier go to the server, in a job of at most this many ranks, before the next
/// asks for the image: a get on the wire costs its client about 4.5 µs of CPU, and asking for, checking and
/// mapping an image about 34 µs (`benches/libpmi`, a job of one task under rpmi-run), so a fence of fewer gets
/// is cheaper on the wire. A start-up reads a key of each rank (or of each node's first): a job of more ranks
/// asks for the image at the first get after each barrier.
pub const WIRE_GETS_FIRST: u32 = 8;

/// When a session maps the image, and the one it has.
pub struct Images {
    state: State,
    mapped: Option<Mapped>,
    /// Gets since the last full barrier.
    gets: u32,
    /// How many of them go to the server before the image is asked for.
    wire_first: u32,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    /// The server serves no images: every get goes to it.
    Unserved,
    /// A full barrier ended: the next get asks for its image.
    Due,
    /// Asked for since the last full barrier (or a group barrier came since): gets use the image mapped, if
    /// any, else the wire, until the next full barrier.
    Asked,
    /// An image could not be used: the wire for the rest of the session (said once).
    Refused,
}

impl Images {
    /// Whether the server said at `init` that it serves images, and the job's size.
    pub fn new(served: bool, size: u32) -> Images {
        let state = if served { State::Asked } else { State::Unserved };
        let wire_first = if size > WIRE_GETS_FIRST { 0 } else { WIRE_GETS_FIRST };
        Images { state, mapped: None, gets: 0, wire_first }
    }

    /// A full barrier ended: the image mapped is of the fence before, and the next get asks for this one's.
    pub fn fence_ended(&mut self) {
        self.mapped = None;
        self.gets = 0;
        if self.state == State::Asked {
            self.state = State::Due;
        }
    }

    /// A group barrier ended: keys it exchanged are newer than the image, which goes; the wire until the next
    /// full barrier.
    pub fn stale(&mut self) {
        self.mapped = None;
        if self.state == State::Due {
            self.state = State::Asked;
        }
    }

    /// Counts a get: whether it should ask for the image first (see [`WIRE_GETS_FIRST`]).
    pub fn ask_now(&mut self) -> bool {
        self.gets = self.gets.saturating_add(1);
        self.state == State::Due && self.gets > self.wire_first
    }

    /// The server's answer to the request for the image: `Ok(Some(bytes))` where it sent one of that length,
    /// `Ok(None)` where it has none, `Err` where the connection failed (which the next request says); and the
    /// file that came with it, if any. `lib` names the library in what it says.
    pub fn arrived<E>(&mut self, lib: &str, answer: Result<Option<i64>, E>, file: Option<OwnedFd>) {
        self.state = State::Asked;
        let Ok(Some(bytes)) = answer else { return };
        let mapped = match (file, usize::try_from(bytes)) {
            (Some(file), Ok(bytes)) => Mapped::map(file, bytes),
            (None, _) => Err("it came without its memory file".into()),
            (_, Err(_)) => Err(format!("its length is {bytes}")),
        };
        match mapped {
            Ok(m) => self.mapped = Some(m),
            Err(why) => {
                crate::cabi::say(&format!(
                    "{lib}: the PMI server's image of the key-value space cannot be used ({why}): gets go to the server"
                ));
                self.state = State::Refused;
            }
        }
    }

    /// The value of `key` in the image mapped, if it has it.
    pub fn get(&self, key: &[u8]) -> Option<&[u8]> {
        self.mapped.as_ref()?.get(key)
    }
}

#[cfg(test)]
mod tests {
    use super::{Images, WIRE_GETS_FIRST};

    #[test]
    fn a_small_job_asks_after_a_few_gets_a_large_one_at_once_and_each_once_a_barrier() {
        let mut small = Images::new(true, 2);
        assert!(!small.ask_now(), "nothing to ask for before the first barrier");
        small.fence_ended();
        let asked: Vec<bool> = (0..WIRE_GETS_FIRST + 1).map(|_| small.ask_now()).collect();
        assert_eq!(asked.iter().position(|&a| a), Some(WIRE_GETS_FIRST as usize));
        small.arrived::<()>("test", Ok(None), None);
        assert!(!small.ask_now(), "asked once a barrier");
        let mut large = Images::new(true, 64);
        large.fence_ended();
        assert!(large.ask_now());
        large.stale();
        assert!(!large.ask_now(), "a group barrier makes the wire answer until the next full one");
        let mut unserved = Images::new(false, 64);
        unserved.fence_ended();
        assert!(!unserved.ask_now());
    }
}

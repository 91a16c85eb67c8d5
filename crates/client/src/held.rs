//! The one session of a process's PMI library, from its init to its finalize, behind one lock: calls from
//! several threads are served one at a time (the wire is lock-step), and a failure is said once on stderr,
//! naming the library, the rank and the call. The session is its process's: in a child of a fork it is not
//! there to use (`IN_CHILD`).

use crate::cabi::{guard, say};
use crate::{Failed, ERR_INIT, ERR_INVALID_ARG, FAIL, SUCCESS};
use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

/// This process is a child of a fork made once its parent began init. The session, its lock and its connection
/// are the parent's: the lock may be held for ever by a thread the child does not have, and what the child
/// read from the connection the parent would miss. Every call fails at once, touching neither: `PMI_Init`
/// with `FAIL`, saying why, any other as before init (`ERR_INIT`, initialized no, an abort told to no server).
/// A static of this crate, of which each library carries its own copy: one flag per library.
static IN_CHILD: AtomicBool = AtomicBool::new(false);

/// Run by `fork` in the child, from the first init on: a store, which is all a child of a threaded process may
/// safely do there.
extern "C" fn forked() {
    IN_CHILD.store(true, Ordering::Relaxed);
}

/// `forked` is registered with `pthread_atfork` (by an init, under the session's lock).
static WATCHING: AtomicBool = AtomicBool::new(false);

/// What a session tells about itself for messages.
pub trait Ranked {
    fn rank(&self) -> u32;
}

pub struct Held<S> {
    /// The library's name, for messages (`libpmi`, `libpmi2`).
    lib: &'static str,
    /// Boxed: made once, then only reached; what moves into place at init is a pointer, not the session.
    session: Mutex<Option<Box<S>>>,
    /// The session was finalized: the launcher's connection is spent.
    finalized: AtomicBool,
    /// The process is aborting: a call made now (an exit handler's finalize) fails at once instead of
    /// waiting for a thread that holds the session.
    aborting: AtomicBool,
}

impl<S: Ranked> Held<S> {
    pub const fn new(lib: &'static str) -> Held<S> {
        Held { lib, session: Mutex::new(None), finalized: AtomicBool::new(false), aborting: AtomicBool::new(false) }
    }

    fn lock(&self) -> MutexGuard<'_, Option<Box<S>>> {
        // A call that panicked left nothing half-changed that the next one could trip on.
        self.session.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The process aborts: from now on every call fails at once.
    pub fn abort(&self) {
        self.aborting.store(true, Ordering::SeqCst);
    }

    /// The session, unless another thread holds it (an abort must not wait for a barrier) or it is a parent's.
    pub fn try_with(&self, f: impl FnOnce(&mut S)) {
        if IN_CHILD.load(Ordering::Relaxed) {
            return;
        }
        if let Ok(Some(s)) = self.session.try_lock().as_deref_mut() {
            f(s);
        }
    }

    pub fn initialized(&self) -> bool {
        !IN_CHILD.load(Ordering::Relaxed) && guard(self.lib, "initialized", || self.lock().is_some() as c_int) == 1
    }

    /// Init `name`: the session `start` makes, once (a second init finds it made), then `then` on it.
    pub fn init(
        &self,
        name: &str,
        start: impl FnOnce() -> Result<Box<S>, Failed>,
        then: impl FnOnce(&S) -> c_int,
    ) -> c_int {
        guard(self.lib, name, || {
            if IN_CHILD.load(Ordering::Relaxed) {
                say(&format!(
                    "{}: {name}: a child of a fork cannot use PMI: the launcher's connection is its parent's",
                    self.lib
                ));
                return FAIL;
            }
            let mut s = self.lock();
            if s.is_none() && self.finalized.load(Ordering::SeqCst) {
                say(&format!("{}: {name}: finalized already: the launcher serves one session per process", self.lib));
                return FAIL;
            }
            if s.is_none() && !WATCHING.load(Ordering::Relaxed) {
                // Before the session is made (another thread may fork while it is), once; the C library forgets
                // it if the library is unloaded. It fails only where memory ran out.
                // SAFETY: `forked` only stores a flag.
                if unsafe { libc::pthread_atfork(None, None, Some(forked)) } != 0 {
                    say(&format!("{}: {name}: cannot watch for forks: out of memory", self.lib));
                    return FAIL;
                }
                WATCHING.store(true, Ordering::Relaxed);
            }
            if s.is_none() {
                match start() {
                    Ok(new) => *s = Some(new),
                    Err(failed) => {
                        say(&format!("{}: {name}: {}", self.lib, failed.message.unwrap_or_default()));
                        return failed.code;
                    }
                }
            }
            s.as_deref().map_or(FAIL, then)
        })
    }

    /// Runs call `name`'s `f` on the session, if init made one.
    pub fn with(&self, name: &str, f: impl FnOnce(&mut S) -> Result<(), Failed>) -> c_int {
        let mut f = Some(f);
        self.call(name, &mut |s| f.take().map_or(Ok(()), |f| f(s)))
    }

    /// Runs call `name`'s `f` on the session, if init made one, then `then` on what it gave, without the
    /// session's lock: a wait that other threads' calls must not queue behind.
    pub fn with_then<T>(
        &self,
        name: &str,
        f: impl FnOnce(&mut S) -> Result<T, Failed>,
        then: impl FnOnce(T) -> Result<(), Failed>,
    ) -> c_int {
        let (mut f, mut got, mut rank) = (Some(f), None, 0);
        let rc = self.call(name, &mut |s| {
            rank = s.rank();
            got = f.take().map(|f| f(s)).transpose()?;
            Ok(())
        });
        match got {
            Some(got) if rc == SUCCESS => guard(self.lib, name, || match then(got) {
                Ok(()) => SUCCESS,
                Err(failed) => self.failed(name, rank, failed),
            }),
            _ => rc,
        }
    }

    /// The body every call shares: `f` on the session under its lock, no panic let out, a failure said.
    /// Not generic over the call, and not inlined: one copy serves every call, and a process's first call
    /// brings it into the cache for the others (each call's own code is only its `f`).
    #[inline(never)]
    fn call(&self, name: &str, f: &mut dyn FnMut(&mut S) -> Result<(), Failed>) -> c_int {
        guard(self.lib, name, || {
            if self.aborting.load(Ordering::SeqCst) {
                return FAIL;
            }
            if IN_CHILD.load(Ordering::Relaxed) {
                return ERR_INIT;
            }
            let (rank, got) = {
                let mut s = self.lock();
                let Some(s) = s.as_mut() else { return ERR_INIT };
                (s.rank(), f(s))
            };
            match got {
                Ok(()) => SUCCESS,
                Err(failed) => self.failed(name, rank, failed),
            }
        })
    }

    /// Call `name` of rank `rank` failed: says why, where it is worth saying; the code it returns.
    fn failed(&self, name: &str, rank: u32, failed: Failed) -> c_int {
        if let Some(message) = failed.message {
            say(&format!("{}: rank {rank}: {name}: {message}", self.lib));
        }
        failed.code
    }

    /// Call `name`, which reads one number of the session into `*out`.
    ///
    /// # Safety
    /// `out` is NULL or points to a writable int.
    pub unsafe fn query(&self, name: &str, out: *mut c_int, f: impl FnOnce(&mut S) -> Result<c_int, Failed>) -> c_int {
        if out.is_null() {
            return ERR_INVALID_ARG;
        }
        let mut value = 0;
        let rc = self.with(name, |s| f(s).map(|v| value = v));
        if rc == SUCCESS {
            // SAFETY: the caller's contract.
            unsafe { *out = value };
        }
        rc
    }

    /// Finalize `name`: `f`, then the session is gone for good.
    pub fn finalize(&self, name: &str, f: impl FnOnce(&mut S) -> Result<(), Failed>) -> c_int {
        let rc = self.with(name, f);
        if rc == SUCCESS {
            *self.lock() = None;
            self.finalized.store(true, Ordering::SeqCst);
        }
        rc
    }
}

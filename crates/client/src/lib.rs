//! What rpmi's PMI client libraries (`crates/libpmi`, `crates/libpmi2`) share: the connection to the
//! launcher's server ([`conn`]), the answers of calls that wait without the session's lock ([`mailbox`]), the
//! puts kept until the fence ([`batch`]), the image of the node's key-value space ([`image`]), the node
//! barrier's page ([`node_barrier`]), the session behind one lock ([`held`]) and the C boundary ([`cabi`]): a
//! failure as a PMI code (RFC 13's, `rpmi_wire::response::rc`: PMI-2's have the same values), C strings in
//! and out, and no panic crossing into the caller.

#![deny(unsafe_op_in_unsafe_fn)]

use std::ffi::CStr;

pub mod batch;
pub mod cabi;
pub mod conn;
pub mod held;
pub mod image;
pub mod mailbox;
pub mod node_barrier;

pub use rpmi_wire::response::rc::{
    ERR_INIT, ERR_INVALID_ARG, ERR_INVALID_KEY, ERR_INVALID_LENGTH, ERR_INVALID_VAL, ERR_NOMEM, FAIL, SUCCESS,
};

/// Why a call failed: the code it returns, and what to print on stderr (nothing for an answer the caller
/// expects, such as a key not found).
#[derive(Debug)]
pub struct Failed {
    pub code: i32,
    pub message: Option<String>,
}

impl Failed {
    /// A failure the caller can expect (a missing key, a refused name): `FAIL`, said nowhere.
    pub fn quiet() -> Failed {
        Failed { code: FAIL, message: None }
    }

    /// A failure worth a line on stderr.
    pub fn said(message: String) -> Failed {
        Failed { code: FAIL, message: Some(message) }
    }

    /// A wrong argument: `code`, said nowhere (the caller reads the code).
    pub fn arg(code: i32) -> Failed {
        Failed { code, message: None }
    }

    /// A wrong argument whose fault the code cannot tell: `code`, and why on stderr.
    pub fn arg_said(code: i32, message: String) -> Failed {
        Failed { code, message: Some(message) }
    }
}

/// A variable of the environment, if it is set (as text: bytes that are not UTF-8 are replaced).
pub fn env(name: &CStr) -> Option<String> {
    env_with(name, lossy)
}

/// What `read` makes of a variable of the environment, if it is set. Read with the C library's `getenv`, as
/// the C program the library is loaded into reads its own, and used at once (another `setenv` may free it).
fn env_with<T>(name: &CStr, read: impl FnOnce(&[u8]) -> T) -> Option<T> {
    // SAFETY: `name` is a C string; what getenv returns is NULL or a C string, read before returning.
    let value = unsafe { libc::getenv(name.as_ptr()) };
    // SAFETY: as above.
    (!value.is_null()).then(|| read(unsafe { CStr::from_ptr(value) }.to_bytes()))
}

/// `bytes` as text, bytes that are not UTF-8 replaced (see [`utf8`]).
pub fn lossy(bytes: &[u8]) -> String {
    utf8(bytes).map_or_else(|| String::from_utf8_lossy(bytes).into_owned(), str::to_owned)
}

/// `bytes` as text, or `None` where they are not UTF-8. ASCII, which PMI's lines, names and variables are
/// in practice, is told by code inlined here; other bytes go to std's check. Each 64 KiB of this library's
/// text that a process first runs costs it a page fault (about 3 µs), and std's text code lies far from the
/// rest of a call's path.
pub fn utf8(bytes: &[u8]) -> Option<&str> {
    if bytes.is_ascii() {
        // SAFETY: ASCII is UTF-8.
        Some(unsafe { std::str::from_utf8_unchecked(bytes) })
    } else {
        std::str::from_utf8(bytes).ok()
    }
}

/// The C library's allocator, called from this library's own code (`System`'s methods are inlined) rather
/// than through std's default, which lies far from the rest of a call's path (see [`utf8`]).
#[global_allocator]
static ALLOCATOR: std::alloc::System = std::alloc::System;

/// An integer variable of the environment, if it is set; `Err` if it is set and not one. Read in place: a
/// start-up reads several, and allocates for none.
pub fn env_int(name: &CStr) -> Result<Option<i64>, Failed> {
    env_with(name, |value| {
        utf8(value.trim_ascii())
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| Failed::said(format!("{}={} is not an integer", name.to_string_lossy(), lossy(value))))
    })
    .transpose()
}

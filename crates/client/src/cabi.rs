//! The C boundary: strings in and out of the caller's buffers, and calls that never unwind into C.

use crate::{Failed, FAIL};
use std::ffi::{c_char, c_int, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Writes `line` and a newline on stderr in one write, so that the lines of ranks sharing a stderr do not
/// interleave (`eprintln!` writes the pieces of its format one by one). With the C library's `write`, not
/// std's stderr, whose lock a thread that a child of a fork does not have may hold.
pub fn say(line: &str) {
    let mut bytes = Vec::with_capacity(line.len() + 1);
    bytes.extend_from_slice(line.as_bytes());
    bytes.push(b'\n');
    let mut rest = &bytes[..];
    while !rest.is_empty() {
        // SAFETY: the write reads at most `rest.len()` bytes from `rest`.
        match unsafe { libc::write(libc::STDERR_FILENO, rest.as_ptr().cast(), rest.len()) } {
            n @ 1.. => rest = &rest[n as usize..],
            _ if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted => {}
            // Nowhere left to say it.
            _ => return,
        }
    }
}

/// Runs the body of library `lib`'s (`libpmi`, `libpmi2`) API call `call`: a panic is `FAIL`, said on stderr.
pub fn guard(lib: &str, call: &str, body: impl FnOnce() -> c_int) -> c_int {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|_| {
        say(&format!("{lib}: {call} failed (an internal error)"));
        FAIL
    })
}

/// A C string argument, as UTF-8; `None` for NULL or bytes that are not UTF-8.
///
/// # Safety
/// `p` is NULL or a NUL-terminated string.
pub unsafe fn text<'a>(p: *const c_char) -> Option<&'a str> {
    // SAFETY: the caller's contract.
    unsafe { bytes(p) }.and_then(crate::utf8)
}

/// A C string argument, as its bytes; `None` for NULL.
///
/// # Safety
/// `p` is NULL or a NUL-terminated string.
pub unsafe fn bytes<'a>(p: *const c_char) -> Option<&'a [u8]> {
    // SAFETY: the caller's contract.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_bytes())
}

/// A word of the wire (a key, a name, a service): visible characters but `=`, fewer than `max` bytes (`max`
/// counts the NUL, as PMI's limits do).
pub fn is_word(s: &str, max: usize) -> bool {
    !s.is_empty() && s.len() < max && s.bytes().all(|b| (0x21..=0x7e).contains(&b) && b != b'=')
}

/// A string of the wire (a value): no line break or NUL, fewer than `max` bytes.
pub fn is_string(s: &[u8], max: usize) -> bool {
    s.len() < max && !s.iter().any(|&b| b == b'\n' || b == b'\r' || b == 0)
}

/// Copies `s` and its NUL into the caller's `out[..length]`; `code` if it does not fit.
///
/// # Safety
/// `out` points to at least `length` writable bytes.
pub unsafe fn copy_out(s: &[u8], out: *mut c_char, length: usize, code: i32) -> Result<(), Failed> {
    if s.len() >= length {
        return Err(Failed::arg(code));
    }
    // SAFETY: the caller's contract; s.len() + 1 <= length.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), out.cast::<u8>(), s.len());
        *out.add(s.len()) = 0;
    }
    Ok(())
}

/// Copies as much of `s` as fits, and a NUL, into the caller's `out[..length]` (`length` at least 1): whether
/// it was cut, as MPICH's and Slurm's PMI-2 clients cut.
///
/// # Safety
/// `out` points to at least `length` writable bytes.
pub unsafe fn copy_cut(s: &[u8], out: *mut c_char, length: usize) -> bool {
    let n = s.len().min(length.saturating_sub(1));
    if length == 0 {
        return true;
    }
    // SAFETY: the caller's contract; n + 1 <= length.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), out.cast::<u8>(), n);
        *out.add(n) = 0;
    }
    n < s.len()
}

/// Writes `value` into `*out`; `ERR_INVALID_ARG` if `out` is NULL.
///
/// # Safety
/// `out` is NULL or points to a writable int.
pub unsafe fn set(out: *mut c_int, value: c_int) -> c_int {
    if out.is_null() {
        return crate::ERR_INVALID_ARG;
    }
    // SAFETY: the caller's contract.
    unsafe { *out = value };
    crate::SUCCESS
}

/// Writes a spawn's error code for each of its `procs` processes into `errors`: the server's list, its last
/// code repeated when it sent fewer (one for all), 0 when it sent none.
///
/// # Safety
/// `errors` points to at least `procs` writable ints.
pub unsafe fn set_errcodes(errors: *mut c_int, procs: usize, codes: &[i32]) {
    for i in 0..procs {
        let code = codes.get(i).or(codes.last()).copied().unwrap_or(0);
        // SAFETY: the caller's contract.
        unsafe { *errors.add(i) = code };
    }
}

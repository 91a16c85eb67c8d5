//! Random bytes from the kernel, for what must not be guessed: the step's secret, the nonces of the
//! handshake, the names of spawn files.

use rpmi_core::slurm::auth::{Nonce, Secret, SECRET_LEN};
use std::io::{self, Read};

/// 32 bytes from the kernel's random source (getrandom(2), else /dev/urandom).
pub fn random() -> io::Result<[u8; 32]> {
    let mut b = [0u8; 32];
    let mut got = 0;
    while got < b.len() {
        // SAFETY: writes at most the rest of our buffer.
        let n = unsafe { libc::getrandom(b[got..].as_mut_ptr().cast(), b.len() - got, 0) };
        if n > 0 {
            got += n as usize;
            continue;
        }
        if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
            continue;
        }
        std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
        break;
    }
    Ok(b)
}

/// A fresh secret for a step.
pub fn secret() -> io::Result<Secret> {
    const _: () = assert!(SECRET_LEN == 32);
    random().map(Secret::new)
}

/// A fresh nonce for the handshake.
pub fn nonce() -> io::Result<Nonce> {
    random()
}

#[cfg(test)]
mod tests {
    #[test]
    fn draws_differ() {
        assert_ne!(super::random().unwrap(), super::random().unwrap());
        assert_ne!(super::secret().unwrap(), super::secret().unwrap());
    }
}

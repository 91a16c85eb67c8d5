//! What rpmi's PMI client libraries (`crates/libpmi`, `crates/libpmi2`) share: the connection to the
//! launcher's server ([`conn`]), the session behind one lock ([`held`]) and the C boundary ([`cabi`]): a
//! failure as a PMI code, C strings in and out, and no panic crossing into the caller. PMI-1's and PMI-2's return codes have the same values.

#![deny(unsafe_op_in_unsafe_fn)]

pub mod cabi;
pub mod conn;
pub mod held;

/// `PMI_SUCCESS`, `PMI2_SUCCESS`.
pub const SUCCESS: i32 = 0;
/// `PMI_FAIL`, `PMI2_FAIL`.
pub const FAIL: i32 = -1;
pub const ERR_INIT: i32 = 1;
pub const ERR_NOMEM: i32 = 2;
pub const ERR_INVALID_ARG: i32 = 3;
pub const ERR_INVALID_KEY: i32 = 4;
pub const ERR_INVALID_VAL: i32 = 6;
pub const ERR_INVALID_LENGTH: i32 = 8;

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

/// An integer variable of the environment, if it is set; `Err` if it is set and not one.
pub fn env_int(name: &str) -> Result<Option<i64>, Failed> {
    match std::env::var(name) {
        Err(_) => Ok(None),
        Ok(v) => v.trim().parse().map(Some).map_err(|_| Failed::said(format!("{name}={v} is not an integer"))),
    }
}

//! What rpmi's PMI client libraries (`crates/libpmi`, `crates/libpmi2`) share: the connection to the
//! launcher's server ([`conn`]), the answers of calls that wait without the session's lock ([`mailbox`]), the session behind one lock ([`held`]) and the C boundary ([`cabi`]): a
//! failure as a PMI code (RFC 13's, `rpmi_wire::response::rc`: PMI-2's have the same values), C strings in
//! and out, and no panic crossing into the caller.

#![deny(unsafe_op_in_unsafe_fn)]

pub mod cabi;
pub mod conn;
pub mod held;
pub mod mailbox;

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

/// An integer variable of the environment, if it is set; `Err` if it is set and not one.
pub fn env_int(name: &str) -> Result<Option<i64>, Failed> {
    match std::env::var(name) {
        Err(_) => Ok(None),
        Ok(v) => v.trim().parse().map(Some).map_err(|_| Failed::said(format!("{name}={v} is not an integer"))),
    }
}

//! What the server advertises (`get_maxes`) and the bounds it keeps on what tasks send.

use crate::wire::response::MAX_LINE;
use std::fmt;

/// The most `request_line_max` may be: a PMI-2 answer can echo a request's `thrid` beside a value that came
/// in a request as long (a get's, a node attribute's), and the whole must fit a frame, whose length prefix
/// has 6 digits ([`crate::wire::pmi2::FRAME_MAX`]).
pub const REQUEST_LINE_CEILING: usize = 1 << 18;

/// Limits of one [`crate::server::Server`]. The defaults suit every client in docs/clients.md.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Advertised `kvsname_max` (includes the NUL, as PMI counts).
    pub kvsname_max: u32,
    /// Advertised `keylen_max` (includes the NUL).
    pub keylen_max: u32,
    /// Advertised `vallen_max` (includes the NUL).
    pub vallen_max: u32,
    /// Longest request line accepted, newline included. Puts are the longest real requests (about 1100
    /// bytes at the default maxes).
    pub request_line_max: usize,
    /// Bytes one shell may hold for the key-value store, all ranks' entries together, each charged its key,
    /// its value and [`crate::server::kvs::ENTRY_OVERHEAD`], with the puts not yet sent at a barrier
    /// charged twice their length. Over it, a put fails with `PMI_ERR_NOMEM` and a barrier bringing in
    /// more fails.
    pub kvs_bytes_max: usize,
    /// What one spawn request may be charged: its bytes as sent (PMI-1's lines, or a PMI-2 frame's body),
    /// and [`crate::wire::spawn::ITEM_OVERHEAD`] more for each item (program, argument, preput's or info's
    /// key or value), [`crate::wire::spawn::COMMAND_OVERHEAD`] for each command. What a task's unfinished
    /// request holds, decoded, is at most its charge; a PMI-2 frame is at most this long too.
    pub spawn_bytes_max: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            kvsname_max: 64,
            keylen_max: 64,
            vallen_max: 1024,
            request_line_max: 4096,
            kvs_bytes_max: 512 << 20,
            spawn_bytes_max: 256 << 10,
        }
    }
}

/// Limits that no client could work with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitsError(String);

impl fmt::Display for LimitsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for LimitsError {}

/// What `cmd=get_result rc=0 value=` costs on a response line, newline included.
const GET_RESULT_OVERHEAD: usize = "cmd=get_result rc=0 value=\n".len();

impl Limits {
    /// Checks that clients can live with these limits.
    pub fn validate(&self) -> Result<(), LimitsError> {
        let bad = |m: String| Err(LimitsError(m));
        if self.kvsname_max < 16 || self.keylen_max < 2 || self.vallen_max < 2 {
            return bad(format!(
                "maxes {}/{}/{} are too small (kvsname_max >= 16, keylen_max and vallen_max >= 2)",
                self.kvsname_max, self.keylen_max, self.vallen_max
            ));
        }
        if self.mpich_vallen() <= 256 {
            return bad(format!(
                "maxes {}/{}/{} leave MPICH a value buffer of {} bytes; MPICH 4 aborts at init below 257",
                self.kvsname_max,
                self.keylen_max,
                self.vallen_max,
                self.mpich_vallen()
            ));
        }
        if self.request_line_max < MAX_LINE {
            return bad(format!("request_line_max {} is under {MAX_LINE}", self.request_line_max));
        }
        if self.request_line_max > REQUEST_LINE_CEILING {
            return bad(format!(
                "request_line_max {} is over {REQUEST_LINE_CEILING}: a PMI-2 answer may echo a request's thrid \
                 beside a value as long, and must fit a frame",
                self.request_line_max
            ));
        }
        Ok(())
    }

    /// The longest key accepted (the advertised maximum counts the NUL).
    pub fn key_max(&self) -> usize {
        (self.keylen_max as usize).saturating_sub(1)
    }

    /// The longest kvsname (ours is made to fit).
    pub fn kvsname_len_max(&self) -> usize {
        (self.kvsname_max as usize).saturating_sub(1)
    }

    /// The longest value accepted by `put`, and so the longest any `get` returns. It is the least of:
    /// what was advertised (less the NUL); what MPICH 4.0.2's client can read back (see
    /// [`Limits::mpich_vallen`]); what fits on one response line.
    pub fn value_max(&self) -> usize {
        let advertised = (self.vallen_max as usize).saturating_sub(1);
        let line = MAX_LINE - GET_RESULT_OVERHEAD;
        advertised.min(self.mpich_vallen()).min(line)
    }

    /// The longest value a PMI-2 client's put may carry: what was advertised, less the NUL. PMI-2 frames
    /// have no line limit, and its clients (which never ask for `get_maxes`) hold values of up to 1024
    /// bytes with their NUL.
    pub fn pmi2_value_max(&self) -> usize {
        (self.vallen_max as usize).saturating_sub(1).max(self.value_max())
    }

    /// The `vallen_max` that `get_maxes` advertises: at most the longest value accepted plus its NUL, since
    /// a client that trusts the number (MPICH 5 cuts its business cards into pieces to fit it) would put
    /// longer values, which are refused; and even: MPICH 5.0.2 hex-encodes a card and cuts it into pieces
    /// whose length follows from this number, and when that length is odd a byte's two digits fall into
    /// different pieces, which it then decodes wrongly (over two virtual nodes with UCX, every job failed
    /// with 865 and 867 and none with 512, 700, 800 or 866).
    pub fn vallen_advertised(&self) -> u32 {
        let most = u32::try_from(self.value_max() + 1).unwrap_or(self.vallen_max).min(self.vallen_max);
        most - most % 2
    }

    /// MPICH 4.0.2's client shrinks its value buffer when `kvsname_max + keylen_max + vallen_max + 30`
    /// exceeds its 1024-byte line, to `1024 - kvsname_max - min(keylen_max, 256) - 30`, and crashes on a
    /// longer value (docs/clients.md). At 64/64/1024 that is 866.
    pub fn mpich_vallen(&self) -> usize {
        let (n, k, v) = (self.kvsname_max as usize, self.keylen_max as usize, self.vallen_max as usize);
        if n + k + v + 30 > MAX_LINE {
            MAX_LINE.saturating_sub(n + k.min(256) + 30)
        } else {
            v
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_give_mpich_its_866() {
        let l = Limits::default();
        assert_eq!(l.validate(), Ok(()));
        assert_eq!(l.value_max(), 866);
        assert_eq!(l.vallen_advertised(), 866, "what is accepted, not the 1024 asked for, made even");
        assert_eq!(l.key_max(), 63);
    }

    #[test]
    fn small_maxes_are_taken_as_advertised() {
        let l = Limits { vallen_max: 512, ..Limits::default() };
        assert_eq!(l.value_max(), 511);
    }

    #[test]
    fn the_longest_answer_the_longest_requests_allow_fits_a_frame() {
        use crate::wire::pmi2::FRAME_MAX;
        // A get's answer: a thrid as long as a request, and a value that came in a request as long (its `;`
        // doubled in both), with the answer's own words.
        let answer = "cmd=info-getnodeattr-response;thrid=;rc=0;found=TRUE;value=;".len();
        assert!(2 * REQUEST_LINE_CEILING + answer <= FRAME_MAX);
        let l = Limits { request_line_max: REQUEST_LINE_CEILING, ..Limits::default() };
        assert_eq!(l.validate(), Ok(()));
        assert!(Limits { request_line_max: REQUEST_LINE_CEILING + 1, ..Limits::default() }.validate().is_err());
    }

    #[test]
    fn maxes_that_make_mpich_abort_are_refused() {
        let l = Limits { kvsname_max: 512, keylen_max: 256, ..Limits::default() };
        assert!(l.validate().is_err());
        assert!(Limits { kvsname_max: 4, ..Limits::default() }.validate().is_err());
    }
}

//! Formatting response lines (RFC 13's `S:` messages) so that every real client can read them.
//!
//! The rules come from docs/clients.md: `cmd=` first (newer MPICH treats anything else as a PMI-2 frame), `rc=`
//! next, `value=` last (older Hydra appended keys after it and broke clients), no `key=` token with an empty
//! value (newer MPICH rejects it), and a whole line, newline included, of at most [`MAX_LINE`] bytes (MPICH
//! reads 1024-byte lines and desynchronises on longer ones).

/// The longest response line any client reads, newline included.
pub const MAX_LINE: usize = 1024;

/// RFC 13's return codes: the ones this server sends, and those the client libraries return (PMI-2's have
/// the same values).
pub mod rc {
    pub const SUCCESS: i32 = 0;
    pub const FAIL: i32 = -1;
    pub const ERR_INIT: i32 = 1;
    pub const ERR_NOMEM: i32 = 2;
    pub const ERR_INVALID_ARG: i32 = 3;
    pub const ERR_INVALID_KEY: i32 = 4;
    pub const ERR_INVALID_KEY_LENGTH: i32 = 5;
    pub const ERR_INVALID_VAL: i32 = 6;
    pub const ERR_INVALID_VAL_LENGTH: i32 = 7;
    pub const ERR_INVALID_LENGTH: i32 = 8;
}

/// Builds one response line in a task's output buffer: `cmd=NAME rc=RC` then fields, then `finish`.
pub struct Line<'a> {
    out: &'a mut Vec<u8>,
    start: usize,
}

impl<'a> Line<'a> {
    /// Starts `cmd=<cmd> rc=<rc>`.
    pub fn new(out: &'a mut Vec<u8>, cmd: &str, rc: i32) -> Self {
        let start = out.len();
        out.extend_from_slice(b"cmd=");
        out.extend_from_slice(cmd.as_bytes());
        out.extend_from_slice(b" rc=");
        push_int(out, i64::from(rc));
        Line { out, start }
    }

    /// Appends ` key=<integer>`.
    pub fn int(mut self, key: &str, n: i64) -> Self {
        self.key(key);
        push_int(self.out, n);
        self
    }

    /// Appends ` key=<word>`; an empty word is left out entirely, never sent as `key=`.
    pub fn word(mut self, key: &str, word: &[u8]) -> Self {
        if !word.is_empty() {
            self.key(key);
            self.out.extend_from_slice(word);
        }
        self
    }

    /// Appends ` msg=<text>` with spaces and `=` made into `_` so the message stays one token
    /// (PMI-1 clients split responses at spaces), cut to 200 bytes.
    pub fn msg(mut self, text: &str) -> Self {
        let text = text.trim();
        if !text.is_empty() {
            self.key("msg");
            self.out.extend(text.bytes().take(200).map(|b| match b {
                b' ' | b'=' | b'\t' | b'\n' | b'\r' => b'_',
                b => b,
            }));
        }
        self
    }

    /// Appends ` value=<value>` and ends the line: `value=` is always last.
    pub fn value(mut self, value: &[u8]) {
        self.key("value");
        self.out.extend_from_slice(value);
        self.finish();
    }

    /// Ends the line.
    pub fn finish(self) {
        self.out.push(b'\n');
        debug_assert!(self.out.len() - self.start <= MAX_LINE, "response line over {MAX_LINE} bytes");
    }

    fn key(&mut self, key: &str) {
        self.out.push(b' ');
        self.out.extend_from_slice(key.as_bytes());
        self.out.push(b'=');
    }
}

/// Appends a decimal integer without allocating.
pub fn push_int(out: &mut Vec<u8>, n: i64) {
    let mut buf = [0u8; 20];
    let mut i = buf.len();
    let mut m = n.unsigned_abs();
    loop {
        i -= 1;
        buf[i] = b'0' + (m % 10) as u8;
        m /= 10;
        if m == 0 {
            break;
        }
    }
    if n < 0 {
        out.push(b'-');
    }
    out.extend_from_slice(&buf[i..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(f: impl FnOnce(&mut Vec<u8>)) -> String {
        let mut out = Vec::new();
        f(&mut out);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn cmd_first_rc_next_value_last() {
        let s = line(|o| Line::new(o, "get_result", 0).value(b"a b=c"));
        assert_eq!(s, "cmd=get_result rc=0 value=a b=c\n");
        let s = line(|o| Line::new(o, "maxes", 0).int("kvsname_max", 64).int("keylen_max", -1).finish());
        assert_eq!(s, "cmd=maxes rc=0 kvsname_max=64 keylen_max=-1\n");
    }

    #[test]
    fn no_empty_tokens_and_messages_stay_one_token() {
        let s = line(|o| Line::new(o, "my_kvsname", -1).word("kvsname", b"").msg("  ").finish());
        assert_eq!(s, "cmd=my_kvsname rc=-1\n");
        let s = line(|o| Line::new(o, "lookup_result", -1).msg("no name service=here\n").finish());
        assert_eq!(s, "cmd=lookup_result rc=-1 msg=no_name_service_here\n");
    }

    #[test]
    fn integers_format_like_printf() {
        for n in [0, 7, -1, 1024, i64::MIN, i64::MAX] {
            let mut out = Vec::new();
            push_int(&mut out, n);
            assert_eq!(String::from_utf8(out).unwrap(), n.to_string());
        }
    }
}

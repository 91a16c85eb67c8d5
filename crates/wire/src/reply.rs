//! Reading PMI-1 response lines, as a client does (RFC 13's `S:` messages): `key=value` tuples in any order,
//! extra keys and spaces allowed, `rc` optional (0 when absent), `value=` running to the end of the line. The
//! server's side of the same lines is in [`crate::request`] and [`crate::response`].

/// Longest piece of a response quoted in an error message.
const MAX_QUOTE: usize = 200;

/// One parsed response line, borrowed from the client's buffer: a get allocates nothing, so the
/// client's own cost stays small beside the server's when many ranks share a machine.
#[derive(Debug)]
pub struct Reply<'a> {
    line: &'a str,
    cmd: &'a str,
    rc: i64,
}

/// The key=value tuples of a line. `value=` runs to the end of the line, because values may contain
/// spaces and `=`; every other tuple ends at whitespace. Yields `Err(tuple)` for a malformed one.
fn tuples(line: &str) -> impl Iterator<Item = Result<(&str, &str), &str>> {
    let mut rest = line.trim_ascii_start();
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        // Bytes, not chars: an ASCII byte is always a char boundary, and this runs for every tuple of
        // every reply.
        let bytes = rest.as_bytes();
        let end = bytes.iter().position(u8::is_ascii_whitespace).unwrap_or(bytes.len());
        let Some(eq) = bytes[..end].iter().position(|&b| b == b'=').filter(|&eq| eq > 0) else {
            let tuple = &rest[..end];
            rest = "";
            return Some(Err(tuple));
        };
        let key = &rest[..eq];
        if key == "value" {
            let val = &rest[eq + 1..];
            rest = "";
            return Some(Ok((key, val)));
        }
        let val = &rest[eq + 1..end];
        rest = rest[end..].trim_ascii_start();
        Some(Ok((key, val)))
    })
}

impl<'a> Reply<'a> {
    pub fn parse(line: &'a str) -> Result<Reply<'a>, String> {
        let (mut cmd, mut rc) = (None, None);
        for tuple in tuples(line) {
            let (key, val) =
                tuple.map_err(|t| format!("malformed response (`{t}` is not key=value): {}", quote(line)))?;
            match key {
                "cmd" if cmd.is_none() => cmd = Some(val),
                "rc" if rc.is_none() => rc = Some(val),
                _ => {}
            }
        }
        let cmd = cmd.ok_or_else(|| format!("malformed response (no cmd=): {}", quote(line)))?;
        let rc = match rc {
            None => 0,
            Some(rc) => rc.parse().map_err(|_| format!("malformed response (rc={rc}): {}", quote(line)))?,
        };
        Ok(Reply { line, cmd, rc })
    }

    /// The command answered.
    pub fn cmd(&self) -> &'a str {
        self.cmd
    }

    /// The line's `rc` (0 when absent).
    pub fn rc(&self) -> i64 {
        self.rc
    }

    /// The line as it came, quoted for a message.
    pub fn quoted(&self) -> String {
        quote(self.line)
    }

    /// The first tuple named `key` (a line that parsed has only well-formed tuples).
    pub fn get(&self, key: &str) -> Option<&'a str> {
        tuples(self.line).flatten().find(|(k, _)| *k == key).map(|(_, v)| v)
    }

    /// A field the reply must carry.
    pub fn field(&self, key: &str) -> Result<&'a str, String> {
        self.get(key).ok_or_else(|| format!("malformed response (no {key}= in cmd={}): {}", self.cmd, quote(self.line)))
    }

    /// An integer field the reply must carry.
    pub fn int(&self, key: &str) -> Result<i64, String> {
        let text = self.field(key)?;
        text.parse().map_err(|_| format!("malformed response ({key}={text} is not an integer): {}", quote(self.line)))
    }
}

/// Keeps error lines readable when a response carries a long value.
pub fn quote(line: &str) -> String {
    match line.char_indices().nth(MAX_QUOTE) {
        Some((cut, _)) => format!("`{}...` ({} bytes)", &line[..cut], line.len()),
        None => format!("`{line}`"),
    }
}

#[cfg(test)]
mod tests {
    use super::Reply;

    #[test]
    fn tuples_in_any_order_with_extra_keys() {
        let r = Reply::parse("  rc=0 msg=success cmd=get_result  x=1 value=a b=c  ").unwrap();
        assert_eq!(r.cmd(), "get_result");
        assert_eq!(r.rc(), 0);
        assert_eq!(r.get("value"), Some("a b=c  "));
        assert_eq!(r.get("x"), Some("1"));
    }

    #[test]
    fn rc_absent_means_success() {
        let r = Reply::parse("cmd=barrier_out").unwrap();
        assert_eq!(r.rc(), 0);
        let r = Reply::parse("cmd=get_result rc=-1 msg=key_missing_not_found").unwrap();
        assert_eq!(r.rc(), -1);
    }

    #[test]
    fn empty_value_is_kept() {
        let r = Reply::parse("cmd=get_result rc=0 value=").unwrap();
        assert_eq!(r.get("value"), Some(""));
    }

    #[test]
    fn malformed_responses() {
        for line in ["", "cmd", "rc=0", "cmd=put_result rc=x", "cmd=x =y", "cmd=x junk"] {
            assert!(Reply::parse(line).is_err(), "accepted {line:?}");
        }
    }
}

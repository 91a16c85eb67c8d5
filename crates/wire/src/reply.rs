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
    /// The `value=` tuple, which ends the line: kept from the parse, so that a get's answer is not read twice.
    value: Option<&'a str>,
}

/// The key=value tuples of a line. `value=` runs to the end of the line, because values may contain
/// spaces and `=`; every other tuple ends at whitespace. Yields `Err(tuple)` for a malformed one.
fn tuples(line: &str) -> impl Iterator<Item = Result<(&str, &str), &str>> {
    let bytes = line.as_bytes();
    let mut at = 0;
    std::iter::from_fn(move || {
        while at < bytes.len() && bytes[at].is_ascii_whitespace() {
            at += 1;
        }
        if at == bytes.len() {
            return None;
        }
        let start = at;
        at = word_end(bytes, at, true);
        if at == start || at == bytes.len() || bytes[at] != b'=' {
            // No `=`, or nothing before it: the tuple runs to the next whitespace.
            let tuple = &line[start..word_end(bytes, at, false)];
            at = bytes.len();
            return Some(Err(tuple));
        }
        let (key, eq) = (&line[start..at], at);
        at = if key == "value" { bytes.len() } else { word_end(bytes, eq + 1, false) };
        Some(Ok((key, &line[eq + 1..at])))
    })
}

/// Where the word from `at` ends: the first ASCII whitespace, or where `at_eq`, the first `=`, from `at`; the
/// line's length if none. Bytes, not chars: an ASCII byte is always a char boundary. A client reads every
/// reply it gets, so eight bytes are looked at together: a word's bytes are above the space and not `=`, and
/// a test of all eight for a byte that is not finds the first such byte exactly (the subtraction's borrow
/// only marks bytes after a marked one). A control character is a word's byte too: the scan goes on past it.
fn word_end(bytes: &[u8], mut at: usize, at_eq: bool) -> usize {
    const ONES: u64 = u64::from_le_bytes([1; 8]);
    const HIGH: u64 = ONES << 7;
    let ends = |b: u8| b.is_ascii_whitespace() || (at_eq && b == b'=');
    while let Some(eight) = bytes.get(at..).and_then(<[u8]>::first_chunk::<8>) {
        let x = u64::from_le_bytes(*eight);
        let low = x.wrapping_sub(ONES * 0x21) & !x;
        let eq = x ^ (ONES * u64::from(b'='));
        let eq = if at_eq { eq.wrapping_sub(ONES) & !eq } else { 0 };
        let marked = (low | eq) & HIGH;
        if marked == 0 {
            at += 8;
            continue;
        }
        at += marked.trailing_zeros() as usize / 8;
        if ends(bytes[at]) {
            return at;
        }
        at += 1;
    }
    let rest = bytes.get(at..).unwrap_or_default();
    at + rest.iter().position(|&b| ends(b)).unwrap_or(rest.len())
}

impl<'a> Reply<'a> {
    pub fn parse(line: &'a str) -> Result<Reply<'a>, String> {
        let (mut cmd, mut rc, mut value) = (None, None, None);
        for tuple in tuples(line) {
            let (key, val) =
                tuple.map_err(|t| format!("malformed response (`{t}` is not key=value): {}", quote(line)))?;
            match key {
                "cmd" if cmd.is_none() => cmd = Some(val),
                "rc" if rc.is_none() => rc = Some(val),
                "value" => value = Some(val),
                _ => {}
            }
        }
        let cmd = cmd.ok_or_else(|| format!("malformed response (no cmd=): {}", quote(line)))?;
        let rc = match rc {
            None => 0,
            Some(rc) => rc.parse().map_err(|_| format!("malformed response (rc={rc}): {}", quote(line)))?,
        };
        Ok(Reply { line, cmd, rc, value })
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
        if key == "value" {
            return self.value;
        }
        tuples(self.line).map_while(Result::ok).find_map(|(k, v)| (k == key).then_some(v))
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
    fn a_field_anywhere_in_a_long_line_is_found_and_the_first_of_a_key_wins() {
        let mut line = String::from("cmd=x rc=0");
        for i in 0..20 {
            line.push_str(&format!(" k{i}={i}"));
        }
        line.push_str(" k3=again value=v w=1");
        let r = Reply::parse(&line).unwrap();
        assert_eq!(r.get("k0"), Some("0"));
        assert_eq!(r.get("k3"), Some("3"));
        assert_eq!(r.get("k19"), Some("19"));
        assert_eq!(r.get("value"), Some("v w=1"));
        assert_eq!(r.get("w"), None);
        let r = Reply::parse("cmd=x k=1 k=2").unwrap();
        assert_eq!(r.get("k"), Some("1"));
    }

    /// RFC 13's reading of a line, written plainly: whitespace-separated `key=value` words, `value=` taking the
    /// rest of the line.
    fn plain_tuples(line: &str) -> Vec<Result<(&str, &str), &str>> {
        let mut out = Vec::new();
        let mut rest = line;
        loop {
            rest = rest.trim_start_matches(|c: char| c.is_ascii_whitespace());
            if rest.is_empty() {
                return out;
            }
            let word = &rest[..rest.find(|c: char| c.is_ascii_whitespace()).unwrap_or(rest.len())];
            match word.split_once('=') {
                Some(("value", _)) => {
                    out.push(Ok(("value", &rest["value=".len()..])));
                    return out;
                }
                Some((key, value)) if !key.is_empty() => out.push(Ok((key, value))),
                _ => {
                    out.push(Err(word));
                    return out;
                }
            }
            rest = &rest[word.len()..];
        }
    }

    #[test]
    fn tuples_read_every_short_line_as_the_plain_reading_does() {
        let alphabet = ["a", "=", " ", "\t", "v", "\u{1}", "\n", "e", "value="];
        let mut line = String::new();
        for n in 0..alphabet.len().pow(6) {
            line.clear();
            let mut k = n;
            for _ in 0..6 {
                line.push_str(alphabet[k % alphabet.len()]);
                k /= alphabet.len();
            }
            for prefix in ["", "cmd=x "] {
                let line = format!("{prefix}{line}");
                assert_eq!(super::tuples(&line).collect::<Vec<_>>(), plain_tuples(&line), "{line:?}");
            }
        }
    }

    #[test]
    fn a_word_ends_where_a_byte_by_byte_reading_ends_it() {
        // Every byte value, in words of every length and at every offset of the eight-byte reads.
        // Knuth's MMIX generator, its high bits taken.
        let mut state = 1u64;
        let mut next = || {
            state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            state >> 33
        };
        let pick = [b'a', b'=', b' ', b'\t', b'\x01', b'\x7f', b'\x80', b'\xa0', b'\xbd', b'\xff', b'!', b'<', b'>'];
        for _ in 0..20_000 {
            let len = (next() % 40) as usize;
            let bytes: Vec<u8> = (0..len)
                .map(|_| match next() % 4 {
                    0 => pick[(next() % pick.len() as u64) as usize],
                    _ => next() as u8,
                })
                .collect();
            for at in 0..=len {
                for at_eq in [false, true] {
                    let plain = (at..len)
                        .find(|&i| bytes[i].is_ascii_whitespace() || (at_eq && bytes[i] == b'='))
                        .unwrap_or(len);
                    assert_eq!(super::word_end(&bytes, at, at_eq), plain, "{bytes:?} from {at}, = ends: {at_eq}");
                }
            }
        }
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

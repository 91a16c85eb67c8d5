//! The byte codec of every binary frame: the collective's frames and group exchanges, the Slurm plugin's TCP
//! frames and rpmi-run's frames between its processes. A [`FrameReader`] reads a frame a peer wrote: every read is
//! checked against the bytes left, and every length or count the frame announces against them or the
//! caller's bound, before anything is copied. A [`FrameWriter`] builds one. Integers are big-endian, but for the
//! `_le` methods (rpmi-run's frames, which never leave the machine).

use std::fmt;
use std::ops::Deref;

/// A frame that does not decode: what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Malformed(pub String);

impl fmt::Display for Malformed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "malformed frame: {}", self.0)
    }
}

impl std::error::Error for Malformed {}

/// `text` cut to at most `max` bytes, at a character boundary.
pub fn cut(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// `bytes` as a `String`, if they are UTF-8; `what` names them in the error.
pub fn utf8(bytes: &[u8], what: &str) -> Result<String, Malformed> {
    String::from_utf8(bytes.to_vec()).map_err(|_| Malformed(format!("{what} not in UTF-8")))
}

/// Reads a frame front to back. A read that fails consumes nothing.
#[derive(Debug, Clone)]
pub struct FrameReader<'a>(&'a [u8]);

impl<'a> FrameReader<'a> {
    pub fn new(bytes: &'a [u8]) -> FrameReader<'a> {
        FrameReader(bytes)
    }

    /// Bytes not read yet.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The bytes not read yet, without reading them.
    pub fn unread(&self) -> &'a [u8] {
        self.0
    }

    /// The next `n` bytes.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], Malformed> {
        match self.0.split_at_checked(n) {
            Some((head, tail)) => {
                self.0 = tail;
                Ok(head)
            }
            None => Err(Malformed(format!("{} bytes where {n} were expected", self.0.len()))),
        }
    }

    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], Malformed> {
        match self.0.split_first_chunk::<N>() {
            Some((head, tail)) => {
                self.0 = tail;
                Ok(*head)
            }
            None => Err(Malformed(format!("{} bytes where {N} were expected", self.0.len()))),
        }
    }

    /// A byte that must be 0 (false) or 1 (true); `what` names it in the error.
    pub fn flag(&mut self, what: &str) -> Result<bool, Malformed> {
        let left = self.0;
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            b => {
                self.0 = left;
                Err(Malformed(format!("{what} is {b}")))
            }
        }
    }

    /// A `u32` count of items of at least `size` bytes each (not 0). A count the bytes left cannot hold is
    /// refused, so that nothing is sized by it; `what` names the items in the error.
    pub fn count(&mut self, size: usize, what: &str) -> Result<u32, Malformed> {
        let left = self.0;
        let count = self.u32()?;
        if count as usize > self.0.len() / size.max(1) {
            let error = Malformed(format!("{count} {what} in {} bytes", self.0.len()));
            self.0 = left;
            return Err(error);
        }
        Ok(count)
    }

    /// A field behind its `u16` length, at most `max` bytes: the length is checked before the field is read.
    pub fn prefixed16(&mut self, max: usize, what: &str) -> Result<&'a [u8], Malformed> {
        let left = self.0;
        let len = self.u16()? as usize;
        let field = bounded(len, max, what).and_then(|()| self.take(len));
        if field.is_err() {
            self.0 = left;
        }
        field
    }

    /// Every byte left.
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.0)
    }

    /// Every byte left, at most `max` of them.
    pub fn rest_max(&mut self, max: usize, what: &str) -> Result<&'a [u8], Malformed> {
        bounded(self.0.len(), max, what)?;
        Ok(self.rest())
    }

    /// Every byte left as a text of at most `max` bytes. A byte that is not UTF-8 becomes U+FFFD (3 bytes), so
    /// the text is cut to `max` again, as an encoder cuts it.
    pub fn text(&mut self, max: usize, what: &str) -> Result<String, Malformed> {
        let mut text = String::from_utf8_lossy(self.rest_max(max, what)?).into_owned();
        text.truncate(cut(&text, max).len());
        Ok(text)
    }

    /// Checks that every byte was read.
    pub fn end(&self) -> Result<(), Malformed> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(Malformed(format!("{} bytes too many", self.0.len())))
        }
    }
}

fn bounded(len: usize, max: usize, what: &str) -> Result<(), Malformed> {
    if len > max {
        return Err(Malformed(format!("{what} of {len} bytes (at most {max})")));
    }
    Ok(())
}

/// Builds a frame front to back.
#[derive(Debug, Default)]
pub struct FrameWriter(Vec<u8>);

impl FrameWriter {
    pub fn new() -> FrameWriter {
        FrameWriter(Vec::new())
    }

    /// Room for `n` bytes at first: a frame whose size is known is written into one allocation.
    pub fn with_capacity(n: usize) -> FrameWriter {
        FrameWriter(Vec::with_capacity(n))
    }

    pub fn into_vec(self) -> Vec<u8> {
        self.0
    }

    pub fn bytes(&mut self, bytes: &[u8]) -> &mut FrameWriter {
        self.0.extend_from_slice(bytes);
        self
    }

    /// 1 for true, 0 for false.
    pub fn flag(&mut self, v: bool) -> &mut FrameWriter {
        self.u8(u8::from(v))
    }

    /// `text` cut to at most `max` bytes at a character boundary.
    pub fn text(&mut self, text: &str, max: usize) -> &mut FrameWriter {
        self.bytes(cut(text, max).as_bytes())
    }

    /// A length or count as a `u32`; `None` if it does not fit one.
    pub fn len32(&mut self, n: usize) -> Option<&mut FrameWriter> {
        Some(self.u32(u32::try_from(n).ok()?))
    }

    /// `bytes` behind their `u16` length; `None` if they are too long for it.
    pub fn prefixed16(&mut self, bytes: &[u8]) -> Option<&mut FrameWriter> {
        Some(self.u16(u16::try_from(bytes.len()).ok()?).bytes(bytes))
    }

    /// `bytes` behind their `u32` length; `None` if they are too long for it.
    pub fn prefixed32(&mut self, bytes: &[u8]) -> Option<&mut FrameWriter> {
        Some(self.len32(bytes.len())?.bytes(bytes))
    }
}

/// The integers, read and written by one name each: `name: type, byte order`.
macro_rules! integers {
    ($($name:ident: $t:ident, $from:ident, $to:ident;)*) => {
        impl FrameReader<'_> {
            $(pub fn $name(&mut self) -> Result<$t, Malformed> {
                Ok($t::$from(self.array()?))
            })*
        }

        impl FrameWriter {
            $(pub fn $name(&mut self, v: $t) -> &mut FrameWriter {
                self.bytes(&v.$to())
            })*
        }
    };
}

integers! {
    u8: u8, from_be_bytes, to_be_bytes;
    u16: u16, from_be_bytes, to_be_bytes;
    u32: u32, from_be_bytes, to_be_bytes;
    i32: i32, from_be_bytes, to_be_bytes;
    u32_le: u32, from_le_bytes, to_le_bytes;
    i32_le: i32, from_le_bytes, to_le_bytes;
    u64_le: u64, from_le_bytes, to_le_bytes;
}

/// What was written so far.
impl Deref for FrameWriter {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_written_reads_back() {
        let mut w = FrameWriter::new();
        w.u8(7).u16(0x1234).u32(0xdead_beef).i32(-2).flag(true).flag(false);
        w.u32_le(5).i32_le(-1).u64_le(1 << 40).prefixed16(b"id").unwrap().len32(3).unwrap();
        w.prefixed32(b"part").unwrap().text("é!", 1).bytes(b"tail");
        let bytes = w.into_vec();
        let mut r = FrameReader::new(&bytes);
        assert_eq!((r.u8(), r.u16(), r.u32(), r.i32()), (Ok(7), Ok(0x1234), Ok(0xdead_beef), Ok(-2)));
        assert_eq!((r.flag("a"), r.flag("b")), (Ok(true), Ok(false)));
        assert_eq!((r.u32_le(), r.i32_le(), r.u64_le()), (Ok(5), Ok(-1), Ok(1 << 40)));
        assert_eq!(r.prefixed16(2, "an id"), Ok(&b"id"[..]));
        assert_eq!(r.u32(), Ok(3));
        assert_eq!(r.u32().and_then(|n| r.take(n as usize)), Ok(&b"part"[..]));
        assert_eq!(r.array::<4>(), Ok(*b"tail"), "a text cut short of a character is empty");
        assert_eq!(r.end(), Ok(()));
        assert_eq!(r.u8(), Err(Malformed("0 bytes where 1 were expected".into())));
        assert!(FrameWriter::new().prefixed16(&[0; 1 << 16]).is_none());
        assert_eq!(&FrameWriter::with_capacity(4).u16(1).prefixed16(b"").unwrap()[..], [0, 1, 0, 0]);
    }

    #[test]
    fn a_read_that_fails_consumes_nothing() {
        let bytes = [0, 5, b'a', b'b', 2];
        let mut r = FrameReader::new(&bytes);
        assert!(r.prefixed16(4, "a name").unwrap_err().0.contains("a name of 5 bytes (at most 4)"));
        assert!(r.prefixed16(5, "a name").unwrap_err().0.contains("3 bytes where 5 were expected"));
        assert_eq!(r.len(), 5);
        assert!(r.u64_le().is_err() && r.take(6).is_err() && r.array::<6>().is_err());
        assert_eq!(r.take(4), Ok(&bytes[..4]));
        assert_eq!(r.flag("a flag"), Err(Malformed("a flag is 2".into())));
        assert_eq!(r.end(), Err(Malformed("1 bytes too many".into())));
        assert_eq!(r.unread(), &[2]);
    }

    #[test]
    fn counts_and_lengths_that_lie_are_refused_before_anything_is_sized_by_them() {
        let bytes = [0, 0, 0, 3, 1, 2, 3, 4, 5, 6, 7, 8];
        assert_eq!(FrameReader::new(&bytes).count(4, "nodes"), Err(Malformed("3 nodes in 8 bytes".into())));
        assert_eq!(FrameReader::new(&bytes).count(2, "parts"), Ok(3));
        assert_eq!(
            FrameReader::new(&[0xff; 4]).count(0, "items"),
            Err(Malformed("4294967295 items in 0 bytes".into()))
        );
        let mut r = FrameReader::new(&[0xff, 0xff]);
        assert!(r.prefixed16(1024, "an id").is_err());
        assert_eq!(r.len(), 2);
        let mut r = FrameReader::new(b"abc");
        assert_eq!(r.rest_max(2, "a report"), Err(Malformed("a report of 3 bytes (at most 2)".into())));
        assert_eq!(r.rest_max(3, "a report"), Ok(&b"abc"[..]));
        assert!(r.is_empty());
    }

    #[test]
    fn texts_are_cut_at_a_character() {
        assert_eq!(cut("aé", 2), "a");
        assert_eq!(cut("aé", 9), "aé");
        // Bytes that are not UTF-8 grow when decoded: the text is cut again.
        let bytes = [0xff; 6];
        assert_eq!(FrameReader::new(&bytes).text(6, "a message"), Ok("\u{fffd}\u{fffd}".into()));
        assert!(FrameReader::new(&bytes).text(5, "a message").is_err());
        assert_eq!(utf8(b"ok", "a name"), Ok("ok".into()));
        assert_eq!(utf8(&[0xff], "a name"), Err(Malformed("a name not in UTF-8".into())));
    }
}

//! The image of a node's key-value space as it stood after a fence: what rpmi's server hands its node's tasks,
//! as a sealed read-only memory file, so that rpmi's client libraries answer gets from it with no round trip.
//! Written by the server ([`encode`]), read by the libraries ([`Image::parse`], then [`Image::get`]), which
//! trust nothing in it: every offset is checked against the image's length before a byte is read, and an
//! image that breaks a rule is refused whole, so that the library falls back to the wire.
//!
//! Layout, every integer little-endian:
//!
//! | bytes | what |
//! |---|---|
//! | 8 | [`MAGIC`] |
//! | 8 | the fence it follows: how many full barriers the server had completed when it was made (later fences that brought nothing keep it) |
//! | 4 | the number of entries, N |
//! | 4 | 0 |
//! | 16 N | the entries, by key in ascending byte order, each key once: the key's offset and length, the value's offset and length (u32 each), offsets from the image's start |
//! | ... | the keys and values |

/// What an image starts with: its name and the revision of its layout.
pub const MAGIC: &[u8; 8] = b"RPMIKVS\x01";
const HEADER: usize = 24;
const ENTRY: usize = 16;

use std::io::Write;

/// Why an image was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageError {
    /// Shorter than its header, or than its entries say.
    Short,
    /// Not an image of this layout.
    Magic,
    /// An entry points outside the image.
    Outside { entry: usize },
    /// The keys are not in strictly ascending order (a key twice, or out of place).
    Order { entry: usize },
    /// Larger than 32-bit offsets can address.
    TooLarge,
}

impl std::fmt::Display for ImageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ImageError::Short => write!(f, "shorter than its header and entries"),
            ImageError::Magic => write!(f, "not an image of rpmi's key-value space (layout 1)"),
            ImageError::Outside { entry } => write!(f, "entry {entry} points outside the image"),
            ImageError::Order { entry } => write!(f, "entry {entry}'s key is not after the one before it"),
            ImageError::TooLarge => write!(f, "more than 4 GiB"),
        }
    }
}

/// The length of the image of `entries` (keys and values of the given lengths).
pub fn encoded_len(entries: usize, bytes: usize) -> usize {
    HEADER + ENTRY * entries + bytes
}

/// The image of `entries` (each key once) after fence `fence`, in memory (see [`write()`]).
pub fn encode<'a>(fence: u64, entries: impl IntoIterator<Item = (&'a [u8], &'a [u8])>) -> Result<Vec<u8>, ImageError> {
    let mut out = Vec::new();
    write(&mut out, fence, entries).map_err(|_| ImageError::TooLarge)?;
    Ok(out)
}

/// Writes the image of `entries` (each key once) after fence `fence` to `out`, a piece at a time: beside what
/// `out` keeps, it holds the entries' order (two slices, 32 bytes an entry) and a buffer. An image past 32-bit offsets is
/// refused (`InvalidInput`) before anything is written.
pub fn write<'a>(
    out: &mut dyn std::io::Write,
    fence: u64,
    entries: impl IntoIterator<Item = (&'a [u8], &'a [u8])>,
) -> std::io::Result<()> {
    let mut entries: Vec<(&[u8], &[u8])> = entries.into_iter().collect();
    entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
    let bytes: usize = entries.iter().map(|(k, v)| k.len() + v.len()).sum();
    if u32::try_from(encoded_len(entries.len(), bytes)).is_err() {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, ImageError::TooLarge.to_string()));
    }
    let mut out = std::io::BufWriter::with_capacity(64 * 1024, out);
    out.write_all(MAGIC)?;
    out.write_all(&fence.to_le_bytes())?;
    out.write_all(&(entries.len() as u32).to_le_bytes())?;
    out.write_all(&0u32.to_le_bytes())?;
    let mut at = HEADER + ENTRY * entries.len();
    for (key, value) in &entries {
        for n in [at, key.len(), at + key.len(), value.len()] {
            out.write_all(&(n as u32).to_le_bytes())?;
        }
        at += key.len() + value.len();
    }
    for (key, value) in &entries {
        out.write_all(key)?;
        out.write_all(value)?;
    }
    out.flush()
}

/// The length of the image of `entries`.
pub fn len_of<'a>(entries: impl IntoIterator<Item = (&'a [u8], &'a [u8])>) -> usize {
    let (n, bytes) = entries.into_iter().fold((0, 0), |(n, b), (k, v)| (n + 1, b + k.len() + v.len()));
    encoded_len(n, bytes)
}

/// An image checked whole: every entry within it, its keys in strictly ascending order.
#[derive(Debug, Clone, Copy)]
pub struct Image<'a> {
    bytes: &'a [u8],
    fence: u64,
    entries: usize,
}

fn u32_at(bytes: &[u8], at: usize) -> Option<usize> {
    let b = bytes.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
}

impl<'a> Image<'a> {
    /// Checks `bytes` as an image, whole: `Err` says the first rule it breaks. O(entries): done once, when
    /// the image comes; each get then [`Image::open`]s it.
    pub fn parse(bytes: &'a [u8]) -> Result<Image<'a>, ImageError> {
        let image = Image::open(bytes)?;
        let mut before: Option<&[u8]> = None;
        for entry in 0..image.entries {
            let (key, _) = image.checked(entry).ok_or(ImageError::Outside { entry })?;
            if before.is_some_and(|b| b >= key) {
                return Err(ImageError::Order { entry });
            }
            before = Some(key);
        }
        Ok(image)
    }

    /// `bytes` as an image, its header and the room for its entries checked, not the entries: a get checks
    /// every offset it reads all the same, so an image that was not [`Image::parse`]d can give a wrong answer,
    /// never read outside `bytes`.
    pub fn open(bytes: &'a [u8]) -> Result<Image<'a>, ImageError> {
        if bytes.len() < HEADER {
            return Err(ImageError::Short);
        }
        if &bytes[..8] != MAGIC {
            return Err(ImageError::Magic);
        }
        let fence = u64::from_le_bytes(bytes[8..16].try_into().map_err(|_| ImageError::Short)?);
        let entries = u32_at(bytes, 16).ok_or(ImageError::Short)?;
        let table_end = entries.checked_mul(ENTRY).and_then(|n| n.checked_add(HEADER)).ok_or(ImageError::Short)?;
        if table_end > bytes.len() {
            return Err(ImageError::Short);
        }
        Ok(Image { bytes, fence, entries })
    }

    /// Entry `entry`'s key and value, if they lie within the image.
    fn checked(&self, entry: usize) -> Option<(&'a [u8], &'a [u8])> {
        let at = HEADER + ENTRY * entry;
        let piece = |n: usize| {
            let (start, len) = (u32_at(self.bytes, at + 8 * n)?, u32_at(self.bytes, at + 8 * n + 4)?);
            self.bytes.get(start..start.checked_add(len)?)
        };
        Some((piece(0)?, piece(1)?))
    }

    /// The fence the image follows.
    pub fn fence(&self) -> u64 {
        self.fence
    }

    pub fn len(&self) -> usize {
        self.entries
    }

    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    /// The value of `key`, by binary search.
    pub fn get(&self, key: &[u8]) -> Option<&'a [u8]> {
        let (mut lo, mut hi) = (0, self.entries);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            // Checked in `parse`; `?` rather than a panic all the same.
            let (k, v) = self.checked(mid)?;
            match k.cmp(key) {
                std::cmp::Ordering::Less => lo = mid + 1,
                std::cmp::Ordering::Greater => hi = mid,
                std::cmp::Ordering::Equal => return Some(v),
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_is_found_and_no_other() {
        let entries: Vec<(Vec<u8>, Vec<u8>)> =
            (0..100).rev().map(|i| (format!("key-{i}").into_bytes(), format!("value {i}").into_bytes())).collect();
        let bytes = encode(7, entries.iter().map(|(k, v)| (k.as_slice(), v.as_slice()))).unwrap();
        assert_eq!(bytes.len(), encoded_len(100, entries.iter().map(|(k, v)| k.len() + v.len()).sum()));
        let image = Image::parse(&bytes).unwrap();
        assert_eq!((image.fence(), image.len()), (7, 100));
        for (k, v) in &entries {
            assert_eq!(image.get(k), Some(v.as_slice()));
        }
        for missing in [&b""[..], b"key-", b"key-100", b"zzz", b"key-5x"] {
            assert_eq!(image.get(missing), None);
        }
        let empty = encode(0, []).unwrap();
        assert!(Image::parse(&empty).unwrap().get(b"a").is_none());
    }

    #[test]
    fn a_broken_image_is_refused_whole() {
        let good = encode(1, [(&b"a"[..], &b"1"[..]), (b"b", b"2")]).unwrap();
        assert_eq!(Image::parse(&good[..HEADER - 1]).unwrap_err(), ImageError::Short);
        assert_eq!(Image::parse(&good[..HEADER + ENTRY]).unwrap_err(), ImageError::Short);
        let mut magic = good.clone();
        magic[7] = 2;
        assert_eq!(Image::parse(&magic).unwrap_err(), ImageError::Magic);
        // The second entry's value runs one byte past the end.
        let mut outside = good.clone();
        let at = HEADER + ENTRY + 12;
        outside[at..at + 4].copy_from_slice(&2u32.to_le_bytes());
        assert_eq!(Image::parse(&outside).unwrap_err(), ImageError::Outside { entry: 1 });
        // Both entries name the same key.
        let mut twice = good.clone();
        let (first, second) = (HEADER, HEADER + ENTRY);
        let key = twice[first..first + 8].to_vec();
        twice[second..second + 8].copy_from_slice(&key);
        assert_eq!(Image::parse(&twice).unwrap_err(), ImageError::Order { entry: 1 });
        // A count of entries no image could hold.
        let mut count = good;
        count[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(Image::parse(&count).unwrap_err(), ImageError::Short);
    }
}

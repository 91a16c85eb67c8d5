//! The key-value store of one job shell, and the compact form in which a shell's new puts travel through
//! the host's collective.
//!
//! Every shell holds the whole job's KVS: puts are stored locally at once, and at each barrier the puts
//! since the last one go to every other shell as one contribution. Gets are then answered locally.
//!
//! **Duplicate keys.** RFC 13 forbids putting a key twice; real servers keep the last write, and some
//! clients rely on it. The rule here: a key belongs to the rank that first put it. That rank may put it
//! again (last write wins). Another rank putting the same value is harmless and accepted; another rank
//! putting a different value is refused (`PMI_ERR_INVALID_KEY`), or, when the two puts happen on different
//! shells in the same barrier epoch, the barrier fails on every shell with a message naming the key and
//! both ranks. No write is ever lost silently.
//!
//! **What an entry costs.** The bound on a store counts what its entries cost in memory, not only their
//! keys and values: each entry is charged its key, its value and [`ENTRY_OVERHEAD`].

use std::collections::HashMap;
use std::fmt;

/// The owner recorded for keys the server itself provides (`PMI_process_mapping`).
pub const SERVER: u32 = u32::MAX;

struct Entry {
    owner: u32,
    value: Box<[u8]>,
}

/// What one heap block costs beyond the bytes asked for, at most: glibc's malloc adds an 8-byte header,
/// rounds up to a multiple of 16 and gives at least 32 bytes, so a block of n >= 1 bytes takes less than
/// n + 32.
const BLOCK_OVERHEAD: usize = 32;

/// One bucket of the hash table: a slot for the boxed key and the entry, and a control byte.
const BUCKET: usize = std::mem::size_of::<(Box<[u8]>, Entry)>() + 1;

/// The hash table's share per entry, at its peak: the table is at most 7/8 full, so right after it grows
/// (doubling) it has 16/7 buckets per entry, and while it grows the old table (8/7 buckets per entry)
/// is still there beside the new one: 24/7 buckets per entry.
const TABLE_PER_ENTRY: usize = (24 * BUCKET).div_ceil(7);

/// What an entry is charged beyond its key and value: two heap blocks (the key's and the value's) and its
/// share of the table (205 bytes on 64-bit Linux). Measured: a million entries of a 7-byte key and a 1-byte
/// value raise a process's peak resident set by 111 to 205 bytes each, depending on where the table is
/// in its growth (tests/bounds.rs measures it through a shell).
pub const ENTRY_OVERHEAD: usize = 2 * BLOCK_OVERHEAD + TABLE_PER_ENTRY;

/// Keys and values of a job, as held by one shell.
pub struct Kvs {
    map: HashMap<Box<[u8]>, Entry>,
    /// What the entries are charged (see [`ENTRY_OVERHEAD`]).
    bytes: usize,
    bytes_max: usize,
}

/// Why a put was not stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PutError {
    /// The key belongs to another rank (or to the server) and holds a different value.
    Taken { owner: u32 },
    /// Storing it would take the shell over its byte bound.
    Full { bytes_max: usize },
}

impl fmt::Display for PutError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PutError::Taken { owner: SERVER } => write!(f, "the key is reserved by the server"),
            PutError::Taken { owner } => write!(f, "rank {owner} already put a different value under this key"),
            PutError::Full { bytes_max } => write!(f, "the job's key-value store is full ({bytes_max} bytes)"),
        }
    }
}

/// What a successful put did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// The value is new or changed.
    Changed,
    /// The same value was already there.
    Unchanged,
}

impl Kvs {
    /// An empty store whose entries may be charged at most `bytes_max` bytes.
    pub fn new(bytes_max: usize) -> Self {
        Kvs { map: HashMap::new(), bytes: 0, bytes_max }
    }

    /// The value of `key`.
    pub fn get(&self, key: &[u8]) -> Option<&[u8]> {
        self.map.get(key).map(|e| &*e.value)
    }

    /// Every key and its value, in no order.
    pub fn entries(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.map.iter().map(|(k, e)| (&**k, &*e.value))
    }

    /// Bytes the entries held are charged: their keys, their values and [`ENTRY_OVERHEAD`] each.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Stores `key=value` for `owner`, following the duplicate-key rule of this module.
    pub fn put(&mut self, owner: u32, key: &[u8], value: &[u8]) -> Result<Stored, PutError> {
        self.put_beside(owner, key, value, 0)
    }

    /// [`Kvs::put`], where `beside` bytes held elsewhere for this store (a shell's puts on their way to
    /// the other shells) count against the same bound.
    pub fn put_beside(&mut self, owner: u32, key: &[u8], value: &[u8], beside: usize) -> Result<Stored, PutError> {
        let full = PutError::Full { bytes_max: self.bytes_max };
        let fits = |bytes: usize| bytes.checked_add(beside).is_some_and(|b| b <= self.bytes_max);
        match self.map.get_mut(key) {
            Some(e) if *e.value == *value => Ok(Stored::Unchanged),
            Some(e) if e.owner != owner => Err(PutError::Taken { owner: e.owner }),
            Some(e) => {
                let bytes = self.bytes - e.value.len() + value.len();
                if !fits(bytes) {
                    return Err(full);
                }
                e.value = value.into();
                self.bytes = bytes;
                Ok(Stored::Changed)
            }
            None => {
                let bytes = self.bytes + key.len() + value.len() + ENTRY_OVERHEAD;
                if !fits(bytes) {
                    return Err(full);
                }
                self.map.insert(key.into(), Entry { owner, value: value.into() });
                self.bytes = bytes;
                Ok(Stored::Changed)
            }
        }
    }

    /// Stores every put of a collective's result (all shells' contributions, this one's included) by a rank
    /// `take` says yes to, with `beside` bytes held elsewhere for this store ([`Kvs::put_beside`]). A contribution that breaks the
    /// bounds or the duplicate rule is an error naming what is wrong; the store then holds the puts before
    /// it (the barrier fails and the job is expected to end).
    pub fn merge(
        &mut self,
        contribution: &[u8],
        bounds: &EntryBounds,
        beside: usize,
        take: impl Fn(u32) -> bool,
    ) -> Result<(), MergeError> {
        // A result is megabytes of lines: memchr looks at many bytes a step where a loop looks at one (at
        // 100 nodes x 400 ranks, the byte loop was an eighth of every slurmstepd's CPU in the exchange).
        let mut start = 0;
        for end in memchr::memchr_iter(b'\n', contribution).chain(std::iter::once(contribution.len())) {
            let line = &contribution[start..end];
            start = end + 1;
            if line.is_empty() {
                continue;
            }
            let (rank, key, value) = decode(line, bounds)?;
            if !take(rank) {
                continue;
            }
            self.put_beside(rank, key, value, beside).map_err(|e| match e {
                PutError::Taken { owner } => {
                    MergeError::Conflict { key: String::from_utf8_lossy(key).into_owned(), ranks: (owner, rank) }
                }
                PutError::Full { bytes_max } => MergeError::Full { bytes_max },
            })?;
        }
        Ok(())
    }
}

/// What a contribution from another shell may contain.
pub struct EntryBounds {
    pub size: u32,
    pub key_max: usize,
    pub value_max: usize,
}

/// Why a collective's result could not be taken in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MergeError {
    /// Two ranks put different values under one key in the same epoch, on different shells.
    Conflict { key: String, ranks: (u32, u32) },
    /// The store would go over its bound.
    Full { bytes_max: usize },
    /// The bytes are not a contribution (a host bug, or data that is not rpmi's).
    Malformed(String),
}

impl fmt::Display for MergeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MergeError::Conflict { key, ranks: (a, b) } => {
                write!(f, "ranks {a} and {b} put different values under key '{key}'")
            }
            MergeError::Full { bytes_max } => {
                write!(f, "the job's key-value store would exceed its bound of {bytes_max} bytes")
            }
            MergeError::Malformed(why) => write!(f, "malformed collective data: {why}"),
        }
    }
}

/// How many bytes [`encode`] appends for this put.
pub fn encoded_len(rank: u32, key: &[u8], value: &[u8]) -> usize {
    let digits = rank.checked_ilog10().map_or(1, |d| d as usize + 1);
    digits + key.len() + value.len() + 3
}

/// Appends one put to a contribution: `<rank> <key>=<value>\n`. Keys hold no space or `=` and values no
/// newline (the wire codec guarantees both), so the encoding needs no escaping.
pub fn encode(out: &mut Vec<u8>, rank: u32, key: &[u8], value: &[u8]) {
    crate::wire::response::push_int(out, i64::from(rank));
    out.push(b' ');
    out.extend_from_slice(key);
    out.push(b'=');
    out.extend_from_slice(value);
    out.push(b'\n');
}

fn decode<'a>(line: &'a [u8], bounds: &EntryBounds) -> Result<(u32, &'a [u8], &'a [u8]), MergeError> {
    let bad = |why: &str| MergeError::Malformed(format!("{why} in '{}'", crate::server::excerpt(line)));
    let sp = line.iter().position(|&b| b == b' ').ok_or_else(|| bad("no rank"))?;
    let rank = crate::wire::request::parse_int(&line[..sp])
        .and_then(|r| u32::try_from(r).ok())
        .filter(|&r| r < bounds.size)
        .ok_or_else(|| bad("no valid rank"))?;
    let rest = &line[sp + 1..];
    let eq = rest.iter().position(|&b| b == b'=').ok_or_else(|| bad("no '='"))?;
    let (key, value) = (&rest[..eq], &rest[eq + 1..]);
    if !is_key(key) || key.len() > bounds.key_max {
        return Err(bad("a bad key"));
    }
    if value.is_empty() || value.len() > bounds.value_max {
        return Err(bad("a value of bad length"));
    }
    Ok((rank, key, value))
}

/// RFC 13's `word`: one or more visible characters other than `=`.
pub fn is_key(key: &[u8]) -> bool {
    !key.is_empty() && key.iter().all(|&b| (0x21..=0x7e).contains(&b) && b != b'=')
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUNDS: EntryBounds = EntryBounds { size: 8, key_max: 63, value_max: 866 };

    #[test]
    fn owner_may_rewrite_others_may_not() {
        let mut kvs = Kvs::new(1 << 20);
        assert_eq!(kvs.put(1, b"k", b"v1"), Ok(Stored::Changed));
        assert_eq!(kvs.put(1, b"k", b"v2"), Ok(Stored::Changed));
        assert_eq!(kvs.get(b"k"), Some(&b"v2"[..]));
        assert_eq!(kvs.put(2, b"k", b"v2"), Ok(Stored::Unchanged));
        assert_eq!(kvs.put(2, b"k", b"v3"), Err(PutError::Taken { owner: 1 }));
        assert_eq!(kvs.get(b"k"), Some(&b"v2"[..]));
    }

    #[test]
    fn entries_are_charged_their_overhead_and_rewrites_their_change() {
        let mut kvs = Kvs::new(2 * ENTRY_OVERHEAD + 10);
        assert_eq!(kvs.put(0, b"abc", b"1234567"), Ok(Stored::Changed));
        assert_eq!(kvs.bytes(), 10 + ENTRY_OVERHEAD);
        let full = Err(PutError::Full { bytes_max: 2 * ENTRY_OVERHEAD + 10 });
        assert_eq!(kvs.put(0, b"x", b"yz"), full);
        assert_eq!(kvs.put(0, b"abc", b"1"), Ok(Stored::Changed));
        assert_eq!(kvs.bytes(), 4 + ENTRY_OVERHEAD);
        assert_eq!(kvs.put(0, b"x", b"yz"), Ok(Stored::Changed));
        assert_eq!(kvs.bytes(), 7 + 2 * ENTRY_OVERHEAD);
    }

    /// The figure docs/security.md gives.
    #[test]
    #[cfg(all(target_os = "linux", target_pointer_width = "64"))]
    fn an_entry_is_charged_205_bytes_beyond_its_key_and_value() {
        assert_eq!(ENTRY_OVERHEAD, 205);
    }

    #[test]
    fn bytes_held_beside_count_against_the_bound() {
        let mut kvs = Kvs::new(ENTRY_OVERHEAD + 100);
        assert_eq!(kvs.put_beside(0, b"k", b"v", 99), Err(PutError::Full { bytes_max: ENTRY_OVERHEAD + 100 }));
        assert_eq!(kvs.put_beside(0, b"k", b"v", 98), Ok(Stored::Changed));
        // Growing a value is charged with them; putting what is already there is not.
        assert_eq!(kvs.put_beside(0, b"k", b"vv", 98), Err(PutError::Full { bytes_max: ENTRY_OVERHEAD + 100 }));
        assert_eq!(kvs.put_beside(0, b"k", b"v", usize::MAX), Ok(Stored::Unchanged));
        assert_eq!(kvs.put_beside(0, b"k", b"vv", usize::MAX), Err(PutError::Full { bytes_max: ENTRY_OVERHEAD + 100 }));
    }

    #[test]
    fn encoded_len_is_what_encode_appends() {
        for rank in [0, 9, 10, 12345, u32::MAX] {
            let mut c = Vec::new();
            encode(&mut c, rank, b"key", b"value");
            assert_eq!(c.len(), encoded_len(rank, b"key", b"value"), "rank {rank}");
        }
    }

    #[test]
    fn contributions_round_trip() {
        let mut c = Vec::new();
        encode(&mut c, 3, b"card-3", b"a=b c");
        encode(&mut c, 4, b"card-4", b"x");
        assert_eq!(c, b"3 card-3=a=b c\n4 card-4=x\n");
        let mut kvs = Kvs::new(1 << 20);
        assert_eq!(kvs.merge(&c, &BOUNDS, 0, |_| true), Ok(()));
        assert_eq!(kvs.get(b"card-3"), Some(&b"a=b c"[..]));
        // The echo of a shell's own contribution changes nothing.
        assert_eq!(kvs.merge(&c, &BOUNDS, 0, |_| true), Ok(()));
    }

    #[test]
    fn conflicting_epoch_puts_name_key_and_ranks() {
        let mut kvs = Kvs::new(1 << 20);
        kvs.put(1, b"k", b"mine").unwrap();
        assert_eq!(
            kvs.merge(b"5 k=theirs\n", &BOUNDS, 0, |_| true),
            Err(MergeError::Conflict { key: "k".into(), ranks: (1, 5) })
        );
    }

    #[test]
    fn malformed_contributions_are_refused() {
        let mut kvs = Kvs::new(1 << 20);
        for bad in [&b"x k=v\n"[..], b"9 k=v\n", b"1 k\n", b"1 =v\n", b"1 k=\n", b"1 a b=v\n", b"-1 k=v\n"] {
            assert!(matches!(kvs.merge(bad, &BOUNDS, 0, |_| true), Err(MergeError::Malformed(_))), "{bad:?}");
        }
    }
}

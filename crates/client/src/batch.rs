//! Puts kept in the process until the fence that makes them visible, then written ahead of it in one write:
//! under rpmi's server (which says so at `init`, `rpmi=1`) a start-up's puts then cost one round trip in all,
//! not one each. A get of a key kept here is answered from here, as the server would answer it. What is kept
//! is bounded: past [`BATCH_BYTES_MAX`] bytes or [`BATCH_PUTS_MAX`] puts, the library sends them at once.

/// The most bytes of keys and values kept before they are sent: a start-up's puts fit many times over
/// (MPICH's business card is under 1 KiB), and the write that carries them stays one socket buffer's worth.
pub const BATCH_BYTES_MAX: usize = 64 * 1024;
/// The most puts kept before they are sent: a get looks through them one by one.
pub const BATCH_PUTS_MAX: usize = 256;

/// The puts since the last fence, not sent yet: a key put again keeps its place and takes the new value, as
/// the server keeps the last.
#[derive(Default)]
pub struct PutBatch {
    puts: Vec<(String, Vec<u8>)>,
    bytes: usize,
}

impl PutBatch {
    /// Keeps a put; `true` when the batch is full and must be sent now.
    pub fn put(&mut self, key: &str, value: &[u8]) -> bool {
        match self.puts.iter_mut().find(|(k, _)| k == key) {
            Some((_, v)) => {
                self.bytes = self.bytes - v.len() + value.len();
                v.clear();
                v.extend_from_slice(value);
            }
            None => {
                self.bytes += key.len() + value.len();
                self.puts.push((key.to_owned(), value.to_vec()));
            }
        }
        self.bytes >= BATCH_BYTES_MAX || self.puts.len() >= BATCH_PUTS_MAX
    }

    /// The value kept for `key`, if it was put since the last fence.
    pub fn get(&self, key: &str) -> Option<&[u8]> {
        self.puts.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_slice())
    }

    pub fn is_empty(&self) -> bool {
        self.puts.is_empty()
    }

    /// The puts kept, in the order first put, leaving none.
    pub fn take(&mut self) -> Vec<(String, Vec<u8>)> {
        self.bytes = 0;
        std::mem::take(&mut self.puts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_put_again_keeps_its_place_and_takes_the_last_value() {
        let mut batch = PutBatch::default();
        assert!(!batch.put("a", b"1"));
        assert!(!batch.put("b", b"2"));
        assert!(!batch.put("a", b"333"));
        assert_eq!(batch.get("a"), Some(&b"333"[..]));
        assert_eq!(batch.get("c"), None);
        assert_eq!(batch.take(), [("a".to_string(), b"333".to_vec()), ("b".to_string(), b"2".to_vec())]);
        assert!(batch.is_empty() && batch.get("a").is_none());
    }

    #[test]
    fn a_full_batch_asks_to_be_sent() {
        let mut batch = PutBatch::default();
        let value = vec![b'v'; 1000];
        let full = (0..BATCH_PUTS_MAX).position(|i| batch.put(&format!("k{i}"), &value));
        // 64 puts of 1000 bytes and their keys pass 64 KiB.
        assert_eq!(full, Some(65));
        let mut batch = PutBatch::default();
        let full = (0..BATCH_PUTS_MAX).position(|i| batch.put(&format!("k{i}"), b"v"));
        assert_eq!(full, Some(BATCH_PUTS_MAX - 1));
    }
}

//! Fuzz target `image`: arbitrary bytes as the image of a node's key-value space that rpmi's client libraries
//! map (`rpmi_core::wire::image`), as a broken or hostile server could send it.
//!
//! Checks: no panic and no read outside the bytes, whether the image is checked whole (`Image::parse`) or
//! only opened (`Image::open`, as each get opens it); an image that parses finds each of its keys, with the
//! value its entry names; and an image made of the keys and values it holds is read back the same.

#![no_main]

use libfuzzer_sys::fuzz_target;
use rpmi_core::wire::image::{encode, Image};

fuzz_target!(|data: &[u8]| {
    // Keys to look for: the input's own pieces, split at its zero bytes.
    let probes: Vec<&[u8]> = data.split(|&b| b == 0).take(16).collect();
    if let Ok(opened) = Image::open(data) {
        for probe in &probes {
            let _ = opened.get(probe);
        }
    }
    let Ok(image) = Image::parse(data) else { return };
    let mut pairs = Vec::new();
    for probe in &probes {
        if let Some(value) = image.get(probe) {
            pairs.push((*probe, value));
        }
    }
    // What it holds, written again, reads back the same (a key looked for twice is written once).
    pairs.sort_unstable();
    pairs.dedup();
    let again = encode(image.fence(), pairs.iter().copied()).expect("no larger than the input");
    let reread = Image::parse(&again).expect("an image rpmi writes parses");
    for (key, value) in &pairs {
        assert_eq!(reread.get(key), Some(*value));
    }
});

//! What srun passes to the stepds about the step's layout, the node list syntax, and node names in messages.
//!
//! The task map (the node of every rank) travels in `RPMI_SLURM_MAP` as `SIZE:BLOCKS`, where `BLOCKS` is a
//! `;`-separated list of `first,count,ppn` blocks (`count` consecutive nodes from `first`, `ppn` consecutive
//! ranks on each) that is repeated, cycle after cycle, until `SIZE` ranks are placed (the last cycle may end
//! early). Stride, cyclic and plane distributions each take one block, however many ranks:
//!
//! ```text
//! -N3 -n6  (block)            6:0,3,2        ranks 0 0 1 1 2 2
//! -N3 -n24 -m cyclic          24:0,3,1       ranks 0 1 2 0 1 2 ...
//! -N3 -n24 -m plane=2         24:0,3,2       ranks 0 0 1 1 2 2 0 0 ...
//! -N3 -n7  (block: 3,2,2)     7:0,1,3;1,2,2
//! arbitrary (-m arbitrary)    the run-length list, as long as it has to be
//! ```

/// Largest job accepted from the environment (the engine's own bound is similar).
const SIZE_MAX: usize = 1 << 24;
/// Periods tried when compressing a map (beyond it the full list is sent).
const PERIOD_MAX: usize = 64;

type Stride = (u32, u32, u32);

/// Runs of ranks on one node, merged into blocks over consecutive nodes with the same run length.
fn blocks(node_of: &[u32]) -> Vec<Stride> {
    let mut blocks: Vec<Stride> = Vec::new();
    let mut rest = node_of;
    while let Some(&node) = rest.first() {
        let run = rest.iter().take_while(|&&n| n == node).count();
        rest = &rest[run..];
        let run = run as u32;
        match blocks.last_mut() {
            Some((first, count, ppn)) if *ppn == run && first.checked_add(*count) == Some(node) => *count += 1,
            _ => blocks.push((node, 1, run)),
        }
    }
    blocks
}

/// The ranks `blocks` give, cycled until `size`; `None` as soon as one differs from `want` (if given).
fn expand(blocks: &[Stride], size: usize, want: Option<&[u32]>) -> Option<Vec<u32>> {
    let mut out = Vec::with_capacity(if want.is_some() { 0 } else { size });
    let mut rank = 0usize;
    while rank < size {
        for &(first, count, ppn) in blocks {
            for node in first..first.checked_add(count)? {
                for _ in 0..ppn {
                    if rank == size {
                        return Some(out);
                    }
                    match want {
                        Some(w) if w[rank] != node => return None,
                        Some(_) => {}
                        None => out.push(node),
                    }
                    rank += 1;
                }
            }
        }
    }
    Some(out)
}

/// The `RPMI_SLURM_MAP` value for `node_of`.
pub fn encode(node_of: &[u32]) -> String {
    let all = blocks(node_of);
    let period = (1..=all.len().min(PERIOD_MAX))
        .find(|&k| expand(&all[..k], node_of.len(), Some(node_of)).is_some())
        .unwrap_or(all.len());
    let list: Vec<String> = all[..period].iter().map(|(f, c, p)| format!("{f},{c},{p}")).collect();
    format!("{}:{}", node_of.len(), list.join(";"))
}

/// The task map from an `RPMI_SLURM_MAP` value of at most `size_max` ranks; every node index is below
/// `nodes`. The value comes from the user's environment: nothing is allocated for more ranks than allowed.
pub fn decode(text: &str, nodes: usize, size_max: usize) -> Result<Vec<u32>, String> {
    let bad = |why: &str| format!("RPMI_SLURM_MAP='{}': {why}", super::trace::escape_text(text, 80));
    let (size, list) = text.split_once(':').ok_or_else(|| bad("no ':'"))?;
    let size: usize = size.parse().map_err(|_| bad("the size is not a number"))?;
    if size == 0 || size > SIZE_MAX.min(size_max) {
        return Err(bad("the size is out of range"));
    }
    let mut blocks = Vec::new();
    for b in list.split(';') {
        let v: Vec<u32> = b.split(',').map(str::parse).collect::<Result<_, _>>().map_err(|_| bad("a bad block"))?;
        let [first, count, ppn] = v[..] else { return Err(bad("a block is not first,count,ppn")) };
        if count == 0 || ppn == 0 || first as usize + count as usize > nodes {
            return Err(bad(&format!("block {b} does not fit {nodes} nodes")));
        }
        blocks.push((first, count, ppn));
    }
    expand(&blocks, size, None).ok_or_else(|| bad("overflow"))
}

/// The longest node name read from a list. Slurm's own are far shorter; with it, a list is bounded by its
/// node count (see `sys::expand_nodelist`).
pub const NODE_NAME_MAX: usize = 256;

/// Expands a Slurm node list (`n[1-3,7],login[01-02]-ib,x`) into names, in order. Covers the forms srun
/// writes into `SLURM_STEP_NODELIST` on Slurm built with one dimension (not a box such as `nid[000x011]`);
/// where the process has Slurm's own hostlist functions, the plugin takes their names, once this has bounded
/// the list. Each item's names are counted before any is made, and each made once: a list naming more than
/// `max` nodes, or a name longer than [`NODE_NAME_MAX`], is refused having cost at most its own length.
pub fn expand_nodelist(list: &str, max: usize) -> Result<Vec<String>, String> {
    let bad = |why: &str| format!("node list '{}': {why}", super::trace::escape_text(list, 200));
    let mut items = Vec::new();
    let (mut open, mut start) = (false, 0);
    for (i, c) in list.char_indices() {
        match c {
            '[' if open => return Err(bad("a '[' inside brackets")),
            '[' => open = true,
            ']' if !open => return Err(bad("unbalanced ']'")),
            ']' => open = false,
            ',' if !open => {
                items.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if open {
        return Err(bad("unbalanced '['"));
    }
    items.push(&list[start..]);
    let mut names = Vec::new();
    for item in items.into_iter().map(str::trim).filter(|s| !s.is_empty()) {
        let pieces = pieces(item).map_err(|e| bad(&e))?;
        let count = pieces.iter().try_fold(1usize, |n, p| n.checked_mul(p.count()));
        if count.is_none_or(|n| n > max - names.len().min(max)) {
            return Err(bad(&format!("more than {max} names")));
        }
        if pieces.iter().map(Piece::len).sum::<usize>() > NODE_NAME_MAX {
            return Err(bad(&format!("a name longer than {NODE_NAME_MAX} bytes")));
        }
        // The item's names, the last bracket varying fastest: each bracket's range and number in turn.
        let mut at = vec![(0usize, 0u64); pieces.len()];
        loop {
            let mut name = String::new();
            for (piece, &(range, n)) in pieces.iter().zip(&at) {
                match piece {
                    Piece::Text(text) => name.push_str(text),
                    Piece::Ranges(ranges) => {
                        let (lo, _, width) = ranges[range];
                        name.push_str(&format!("{:0width$}", lo + n));
                    }
                }
            }
            names.push(name);
            // The next: the last bracket that has one more moves on, the ones after it start again.
            let next = pieces.iter().zip(at.iter_mut()).rev().find_map(|(piece, (range, n))| {
                let Piece::Ranges(ranges) = piece else { return None };
                let (lo, hi, _) = ranges[*range];
                if lo + *n < hi {
                    *n += 1;
                } else if *range + 1 < ranges.len() {
                    (*range, *n) = (*range + 1, 0);
                } else {
                    (*range, *n) = (0, 0);
                    return None;
                }
                Some(())
            });
            if next.is_none() {
                break;
            }
        }
    }
    Ok(names)
}

/// A part of one node list item: text, or a bracket's ranges (first, last, width).
enum Piece<'a> {
    Text(&'a str),
    Ranges(Vec<(u64, u64, usize)>),
}

impl Piece<'_> {
    /// How many names it makes (at least 1).
    fn count(&self) -> usize {
        match self {
            Piece::Text(_) => 1,
            Piece::Ranges(r) => r.iter().fold(0usize, |n, &(lo, hi, _)| {
                n.saturating_add(usize::try_from(hi - lo).unwrap_or(usize::MAX).saturating_add(1))
            }),
        }
    }

    /// The most bytes it puts in a name.
    fn len(&self) -> usize {
        match self {
            Piece::Text(text) => text.len(),
            Piece::Ranges(r) => r.iter().map(|&(_, hi, width)| width.max(hi.to_string().len())).max().unwrap_or(0),
        }
    }
}

/// An item (no comma outside brackets, brackets balanced and not nested) as text and brackets.
fn pieces(item: &str) -> Result<Vec<Piece<'_>>, String> {
    let mut pieces = Vec::new();
    let mut rest = item;
    while let Some(open) = rest.find('[') {
        let close = open + rest[open..].find(']').ok_or("no ']'")?;
        if open > 0 {
            pieces.push(Piece::Text(&rest[..open]));
        }
        let mut ranges = Vec::new();
        for range in rest[open + 1..close].split(',') {
            let (lo, hi) = range.split_once('-').unwrap_or((range, range));
            let number = |s: &str| match s.bytes().all(|b| b.is_ascii_digit()) {
                true => s.parse::<u64>().ok(),
                false => None,
            };
            match (number(lo), number(hi)) {
                (Some(l), Some(h)) if l <= h => ranges.push((l, h, lo.len())),
                _ => return Err(format!("range {range}")),
            }
        }
        pieces.push(Piece::Ranges(ranges));
        rest = &rest[close + 1..];
    }
    if !rest.is_empty() {
        pieces.push(Piece::Text(rest));
    }
    Ok(pieces)
}

/// A message of the collective's machines ([`crate::collective`]) as the user reads it: `node 3` becomes
/// `the slurmstepd of n4` (the step's node 3, by name), and `the root` becomes `srun`.
pub fn with_node_names(text: &str, names: &[String]) -> String {
    let text = text.replace("the root", "srun");
    let mut out = String::with_capacity(text.len());
    let mut rest = text.as_str();
    while let Some(at) = rest.find("node ") {
        let after = &rest[at + 5..];
        let digits = after.bytes().take_while(u8::is_ascii_digit).count();
        out.push_str(&rest[..at]);
        match after[..digits].parse::<usize>().ok().and_then(|i| names.get(i)) {
            Some(name) => {
                out.push_str("the slurmstepd of ");
                out.push_str(name);
            }
            None => out.push_str(&rest[at..at + 5 + digits]),
        }
        rest = &after[digits..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(node_of: &[u32], nodes: usize) -> String {
        let text = encode(node_of);
        assert_eq!(decode(&text, nodes, node_of.len()).unwrap(), node_of, "{text}");
        text
    }

    #[test]
    fn distributions_compress() {
        assert_eq!(roundtrip(&[0, 0, 1, 1, 2, 2], 3), "6:0,3,2");
        let cyclic: Vec<u32> = (0..24).map(|r| r % 3).collect();
        assert_eq!(roundtrip(&cyclic, 3), "24:0,3,1");
        let plane: Vec<u32> = (0..24).map(|r| (r / 2) % 3).collect();
        assert_eq!(roundtrip(&plane, 3), "24:0,3,2");
        assert_eq!(roundtrip(&[0, 0, 0, 1, 1, 2, 2], 3), "7:0,1,3;1,2,2");
        assert_eq!(roundtrip(&[0, 1, 2, 0, 1, 2, 0], 3), "7:0,3,1");
        assert_eq!(roundtrip(&[0, 0, 1, 1, 2, 2, 0], 3), "7:0,3,2");
        let big_cyclic: Vec<u32> = (0..100_000).map(|r| r % 4096).collect();
        assert_eq!(roundtrip(&big_cyclic, 4096), "100000:0,4096,1");
        roundtrip(&[2, 0, 1, 1, 0, 2, 2, 2], 3);
        roundtrip(&[0], 1);
    }

    #[test]
    fn bad_maps_are_refused() {
        for bad in ["", "6", "0:0,1,1", "x:0,1,1", "6:0,3", "6:0,4,2", "6:0,0,1", "6:0,1,0", "6:a,b,c"] {
            assert!(decode(bad, 3, 1000).is_err(), "{bad}");
        }
    }

    #[test]
    fn machine_messages_name_the_nodes() {
        let names: Vec<String> = ["n1", "n2", "n3"].map(String::from).to_vec();
        assert_eq!(
            with_node_names("node 2 was lost: its connection to node 1 closed before it said it was done", &names),
            "the slurmstepd of n3 was lost: its connection to the slurmstepd of n2 closed before it said it was done"
        );
        assert_eq!(
            with_node_names("node 0 brought 9 bytes to PMI exchange 1, over the limit of 4 bytes per node (X)", &names),
            "the slurmstepd of n1 brought 9 bytes to PMI exchange 1, over the limit of 4 bytes per node (X)"
        );
        assert_eq!(
            with_node_names("the root sent the result of PMI exchange 0, which nobody at node 1 waits for", &names),
            "srun sent the result of PMI exchange 0, which nobody at the slurmstepd of n2 waits for"
        );
        // Indexes outside the step, and words that only start like one, stay as they are.
        assert_eq!(with_node_names("node 7 and node x, per node", &names), "node 7 and node x, per node");
    }

    #[test]
    fn node_lists() {
        let e = |s: &str| expand_nodelist(s, 1000).unwrap();
        assert_eq!(e("n[1-3]"), ["n1", "n2", "n3"]);
        assert_eq!(e("n1"), ["n1"]);
        assert_eq!(e("a[01-02,7],b,c[9-10]x"), ["a01", "a02", "a7", "b", "c9x", "c10x"]);
        assert_eq!(e("r[1-2]n[1-2]"), ["r1n1", "r1n2", "r2n1", "r2n2"]);
        assert!(expand_nodelist("n[1-", 1000).is_err());
        assert!(expand_nodelist("n[3-1]", 1000).is_err());
        // A short list may name far more nodes than the step has: it is refused, not expanded.
        assert!(expand_nodelist("n[1-1000000]", 3).unwrap_err().contains("more than 3 names"));
        assert_eq!(expand_nodelist("n[1-3]", 3).unwrap().len(), 3);
        assert_eq!(e("n[1-2],m[7-8]x[1-2]"), ["n1", "n2", "m7x1", "m7x2", "m8x1", "m8x2"]);
        assert!(expand_nodelist("a[0-65535]b[0-65535]c[0]", 3).unwrap_err().contains("more than 3 names"));
        // One name of 30,000 brackets: refused by its length, read once, without a level a bracket.
        let deep = format!("a{}", "[0]".repeat(30_000));
        assert!(expand_nodelist(&deep, 400).unwrap_err().contains("a name longer than 256 bytes"));
        assert!(expand_nodelist("n[1[2]]", 3).unwrap_err().contains("inside brackets"));
        assert!(expand_nodelist("nid[000x011]", 3).is_err(), "a box of a Slurm of more dimensions");
    }
}

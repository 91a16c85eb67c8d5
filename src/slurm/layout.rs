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

/// Expands a Slurm node list (`n[1-3,7],login[01-02]-ib,x`) into names, in order, stopping at `max` + 1.
/// Covers the forms srun writes into `SLURM_STEP_NODELIST` on ordinary clusters; where the process has
/// Slurm's own hostlist functions, the plugin takes their names, once this has bounded the list.
pub fn expand_nodelist(list: &str, max: usize) -> Result<Vec<String>, String> {
    let bad = |why: &str| format!("node list '{}': {why}", super::trace::escape_text(list, 200));
    let mut names = Vec::new();
    let mut depth = 0;
    let mut start = 0;
    let mut items = Vec::new();
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' if depth == 0 => return Err(bad("unbalanced ']'")),
            ']' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(bad("unbalanced '['"));
    }
    items.push(&list[start..]);
    for item in items.into_iter().map(str::trim).filter(|s| !s.is_empty()) {
        expand_item(item, &mut names, max).map_err(|e| bad(&e))?;
    }
    Ok(names)
}

fn expand_item(item: &str, out: &mut Vec<String>, max: usize) -> Result<(), String> {
    let Some(open) = item.find('[') else {
        if out.len() == max {
            return Err(format!("more than {max} names"));
        }
        out.push(item.to_string());
        return Ok(());
    };
    let close = open + item[open..].find(']').ok_or("no ']'")?;
    let (prefix, ranges, suffix) = (&item[..open], &item[open + 1..close], &item[close + 1..]);
    for range in ranges.split(',') {
        let (lo, hi) = range.split_once('-').unwrap_or((range, range));
        let width = lo.len();
        let (l, h): (u64, u64) = (lo.parse().map_err(|_| "a bad range")?, hi.parse().map_err(|_| "a bad range")?);
        if h < l || h - l > 1 << 20 {
            return Err(format!("range {range}"));
        }
        for n in l..=h {
            // The suffix may hold further brackets (`a[1-2]b[3-4]`).
            expand_item(&format!("{prefix}{n:0width$}{suffix}"), out, max)?;
        }
    }
    Ok(())
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
    }
}

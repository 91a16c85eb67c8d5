//! Reading a `PMI_process_mapping` value (RFC 13) as a client does: which ranks share a node, derived the way
//! an MPI library derives it.

/// One `(nodeid,nnodes,ppn)` block: `ppn` consecutive ranks on each node `node..node+nnodes`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Block {
    node: u64,
    nnodes: u64,
    ppn: usize,
}

/// A parsed `(vector,(nodeid,nnodes,ppn),...)` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    /// Only blocks that assign at least one rank; parsing guarantees there is one.
    blocks: Vec<Block>,
}

impl Mapping {
    /// Parses the RFC 13 block format. Surrounding whitespace is ignored, anything else that
    /// does not follow the grammar is an error, as is a vector that assigns no rank at all
    /// (it could never place a rank on a node).
    pub fn parse(text: &str) -> Result<Mapping, String> {
        let mut cur = Cursor { text: text.trim(), pos: 0 };
        cur.expect("(vector")?;
        let mut blocks = Vec::new();
        while cur.eat(',') {
            cur.expect("(")?;
            let node = cur.number()?;
            cur.expect(",")?;
            let nnodes = cur.number()?;
            cur.expect(",")?;
            let ppn_at = cur.pos;
            let ppn = usize::try_from(cur.number()?)
                .map_err(|_| format!("processes per node too large at offset {ppn_at}"))?;
            cur.expect(")")?;
            if nnodes == 0 || ppn == 0 {
                continue;
            }
            if node.checked_add(nnodes - 1).is_none() {
                return Err(format!("node ids overflow in block ending at offset {}", cur.pos));
            }
            blocks.push(Block { node, nnodes, ppn });
        }
        cur.expect(")")?;
        if cur.pos != cur.text.len() {
            return Err(format!("unexpected text after the vector at offset {}", cur.pos));
        }
        if blocks.is_empty() {
            return Err("the vector assigns no ranks".to_string());
        }
        Ok(Mapping { blocks })
    }

    /// Node id of each rank in order. When the blocks run out the vector starts over, which is
    /// how MPICH reads it and what Hydra relies on (it sends `(vector,(0,2,1))` for 4 cyclic ranks).
    fn nodes(&self) -> impl Iterator<Item = u64> + '_ {
        self.blocks.iter().cycle().flat_map(|b| (0..b.nnodes).flat_map(move |j| std::iter::repeat_n(b.node + j, b.ppn)))
    }

    /// The first rank of every node of a `size`-rank job, ascending (MPICH's node roots).
    pub fn roots(&self, size: usize) -> Vec<usize> {
        let mut seen = std::collections::BTreeSet::new();
        self.nodes().take(size).enumerate().filter(|&(_, n)| seen.insert(n)).map(|(r, _)| r).collect()
    }

    /// Ranks of a `size`-rank job that share `rank`'s node, ascending (what `PMI_Get_clique_ranks`
    /// returned). Walks the ranks without storing a node per rank, so a huge size costs no memory.
    pub fn clique(&self, size: usize, rank: usize) -> Result<Vec<usize>, String> {
        let node =
            self.nodes().take(size).nth(rank).ok_or_else(|| format!("rank {rank} is outside a job of size {size}"))?;
        Ok(self.nodes().take(size).enumerate().filter(|&(_, n)| n == node).map(|(r, _)| r).collect())
    }
}

/// Byte-offset reader over the mapping text, so errors can say where parsing stopped.
struct Cursor<'a> {
    text: &'a str,
    pos: usize,
}

impl Cursor<'_> {
    fn eat(&mut self, c: char) -> bool {
        if self.text[self.pos..].starts_with(c) {
            self.pos += c.len_utf8();
            true
        } else {
            false
        }
    }

    fn expect(&mut self, s: &str) -> Result<(), String> {
        if self.text[self.pos..].starts_with(s) {
            self.pos += s.len();
            Ok(())
        } else {
            Err(format!("expected '{s}' at offset {}", self.pos))
        }
    }

    fn number(&mut self) -> Result<u64, String> {
        let start = self.pos;
        let digits = self.text[start..].bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err(format!("expected a number at offset {start}"));
        }
        self.pos += digits;
        self.text[start..self.pos].parse().map_err(|_| format!("number too large at offset {start}"))
    }
}

#[cfg(test)]
mod tests {
    use super::Mapping;

    fn nodes(text: &str, size: usize) -> Vec<u64> {
        Mapping::parse(text).unwrap().nodes().take(size).collect()
    }

    #[test]
    fn block_2x4() {
        assert_eq!(nodes("(vector,(0,2,4))", 8), [0, 0, 0, 0, 1, 1, 1, 1]);
        let m = Mapping::parse("(vector,(0,2,4))").unwrap();
        assert_eq!(m.clique(8, 5).unwrap(), [4, 5, 6, 7]);
        assert_eq!(m.clique(8, 0).unwrap(), [0, 1, 2, 3]);
    }

    #[test]
    fn cyclic_2x2() {
        assert_eq!(nodes("(vector,(0,2,1),(0,2,1))", 4), [0, 1, 0, 1]);
        let m = Mapping::parse("(vector,(0,2,1),(0,2,1))").unwrap();
        assert_eq!(m.clique(4, 1).unwrap(), [1, 3]);
    }

    #[test]
    fn irregular_block() {
        assert_eq!(nodes("(vector,(0,2,2),(2,2,4))", 12), [0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]);
        let m = Mapping::parse("(vector,(0,2,2),(2,2,4))").unwrap();
        assert_eq!(m.clique(12, 9).unwrap(), [8, 9, 10, 11]);
    }

    #[test]
    fn irregular_cyclic() {
        let text = "(vector,(0,4,1),(0,4,1),(2,2,1),(2,2,1))";
        assert_eq!(nodes(text, 12), [0, 1, 2, 3, 0, 1, 2, 3, 2, 3, 2, 3]);
        let m = Mapping::parse(text).unwrap();
        assert_eq!(m.clique(12, 0).unwrap(), [0, 4]);
        assert_eq!(m.clique(12, 2).unwrap(), [2, 6, 8, 10]);
    }

    #[test]
    fn short_vector_repeats() {
        assert_eq!(nodes("(vector,(0,2,1))", 4), [0, 1, 0, 1]);
        let m = Mapping::parse("(vector,(0,2,1))").unwrap();
        assert_eq!(m.clique(4, 2).unwrap(), [0, 2]);
        // Hydra's form for 2 ranks on one node.
        let m = Mapping::parse("(vector,(0,1,1))").unwrap();
        assert_eq!(m.clique(2, 1).unwrap(), [0, 1]);
    }

    #[test]
    fn long_vector_is_cut_at_size() {
        let m = Mapping::parse("(vector,(0,4096,256))").unwrap();
        assert_eq!(m.clique(3, 1).unwrap(), [0, 1, 2]);
    }

    #[test]
    fn empty_blocks_are_skipped() {
        let m = Mapping::parse(" (vector,(7,18446744073709551615,0),(0,0,5),(3,1,2)) ").unwrap();
        assert_eq!(m.clique(4, 3).unwrap(), [0, 1, 2, 3]);
    }

    #[test]
    fn rank_outside_size() {
        let m = Mapping::parse("(vector,(0,2,1))").unwrap();
        assert!(m.clique(4, 4).is_err());
        assert!(m.clique(0, 0).is_err());
    }

    #[test]
    fn malformed_is_an_error() {
        for text in [
            "",
            "vector",
            "(vector)",
            "(vector,)",
            "(list,(0,1,1))",
            "(vector,(0,2))",
            "(vector,(0,2,4)",
            "(vector,(0,2,4)))",
            "(vector,(0,2,4)),",
            "(vector,(0,2,4),)",
            "(vector,(a,2,4))",
            "(vector,(0,-2,4))",
            "(vector,(0,2,4)x)",
            "(vector,( 0,2,4))",
            "(vector,(0,0,4))",
            "(vector,(0,2,0),(1,0,1))",
            "(vector,(0,99999999999999999999,1))",
            "(vector,(18446744073709551615,2,1))",
            "(vector,(0,2,4é))",
        ] {
            assert!(Mapping::parse(text).is_err(), "accepted {text:?}");
        }
    }
}

//! PMI 1.2's barrier groups: the `group=` of `cmd=barrier_in`.
//!
//! A group is `WORLD` (every rank of the job), `NODE` (every rank on the caller's node) or a list of ranks
//! `r0,r1,...`, then optionally `:<tag>`, an integer that tells apart barriers over the same group (MPICH
//! sends a hash of a string it was given, or 0). A missing tag is 0. The answer, `cmd=barrier_out`, carries
//! the tag back, so that a client with several barriers outstanding (one per thread) knows which ended.

use super::request::parse_int;
use std::fmt;

/// Who takes part in a group barrier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Members {
    World,
    Node,
    /// Ascending, no rank twice.
    Ranks(Vec<u32>),
}

/// A `group=` value, read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    pub members: Members,
    pub tag: i64,
}

impl Group {
    /// Reads `text` for a job of `size` ranks. A list may name its ranks in any order; a rank named twice or
    /// outside the job is refused (two tasks could not then agree on one barrier).
    pub fn parse(text: &[u8], size: u32) -> Result<Group, String> {
        let (list, tag) = match text.iter().rposition(|&b| b == b':') {
            Some(colon) => {
                let tag = parse_int(&text[colon + 1..]).ok_or("its tag (after ':') is not an integer")?;
                (&text[..colon], tag)
            }
            None => (text, 0),
        };
        let members = match list {
            b"WORLD" => Members::World,
            b"NODE" => Members::Node,
            _ => {
                let mut ranks = Vec::new();
                for r in list.split(|&b| b == b',') {
                    let rank = parse_int(r)
                        .and_then(|r| u32::try_from(r).ok())
                        .ok_or("it is not WORLD, NODE or a comma-separated list of ranks")?;
                    if rank >= size {
                        return Err(format!("it names rank {rank}, not in this job of {size} ranks"));
                    }
                    ranks.push(rank);
                }
                ranks.sort_unstable();
                if let Some(w) = ranks.windows(2).find(|w| w[0] == w[1]) {
                    return Err(format!("it names rank {} twice", w[0]));
                }
                Members::Ranks(ranks)
            }
        };
        Ok(Group { members, tag })
    }

    /// Whether `rank`, on the caller's node, is a member.
    pub fn contains(&self, rank: u32) -> bool {
        match &self.members {
            Members::World | Members::Node => true,
            Members::Ranks(ranks) => ranks.binary_search(&rank).is_ok(),
        }
    }
}

/// The group's one written form, the same whichever way a task wrote it: `WORLD:<tag>`, `NODE:<tag>` or
/// ascending ranks `0,4,8:<tag>`. Shells name a group exchange by it.
impl fmt::Display for Group {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.members {
            Members::World => f.write_str("WORLD")?,
            Members::Node => f.write_str("NODE")?,
            Members::Ranks(ranks) => {
                for (i, r) in ranks.iter().enumerate() {
                    write!(f, "{}{r}", if i == 0 { "" } else { "," })?;
                }
            }
        }
        write!(f, ":{}", self.tag)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_form_reads_and_writes_one_way() {
        let g = |t: &str| Group::parse(t.as_bytes(), 16).map(|g| g.to_string());
        assert_eq!(g("WORLD:12"), Ok("WORLD:12".into()));
        assert_eq!(g("WORLD"), Ok("WORLD:0".into()));
        assert_eq!(g("NODE:7"), Ok("NODE:7".into()));
        assert_eq!(g("8,0,4:99"), Ok("0,4,8:99".into()));
        assert_eq!(g("3"), Ok("3:0".into()));
        assert_eq!(g("1,2:-5"), Ok("1,2:-5".into()));
    }

    #[test]
    fn a_group_two_tasks_could_not_agree_on_is_refused() {
        let e = |t: &str| Group::parse(t.as_bytes(), 16).unwrap_err();
        assert!(e("0,16:1").contains("rank 16, not in this job of 16"));
        assert!(e("0,3,3:1").contains("rank 3 twice"));
        assert!(e("0,x:1").contains("not WORLD, NODE"));
        assert!(e(":1").contains("not WORLD, NODE"));
        assert!(e("0,,1:1").contains("not WORLD, NODE"));
        assert!(e("world:1").contains("not WORLD, NODE"));
        assert!(e("0,1:").contains("tag"));
        assert!(e("0,1:x").contains("tag"));
        assert!(e("-1:0").contains("not WORLD, NODE"));
    }

    #[test]
    fn membership() {
        let g = Group::parse(b"2,5:0", 8).unwrap();
        assert!(g.contains(5) && !g.contains(3));
        assert!(Group::parse(b"NODE", 8).unwrap().contains(3));
    }
}

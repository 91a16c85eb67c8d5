//! Where every rank runs: the `PMI_process_mapping` value, cliques and Intel's `get_ranks2hosts` answer,
//! all derived from one [`TaskMap`] the host gives.

use std::collections::HashMap;
use std::fmt::Write as _;

/// The node (job-shell index) of every rank of the job: `node_of[rank]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskMap {
    node_of: Vec<u32>,
}

impl TaskMap {
    /// A map from the node of every rank. Nodes are numbered from 0 by the host.
    pub fn new(node_of: Vec<u32>) -> Self {
        TaskMap { node_of }
    }

    /// `nnodes` nodes with `ppn[i]` ranks each, ranks given out node by node (Slurm's and rpmi-run's
    /// default "block" distribution).
    pub fn block(ppn: &[u32]) -> Self {
        let node_of = (0..=u32::MAX).zip(ppn).flat_map(|(n, &k)| std::iter::repeat_n(n, k as usize));
        TaskMap { node_of: node_of.collect() }
    }

    /// Ranks dealt to nodes round-robin, skipping nodes that are full (`-m cyclic`).
    pub fn cyclic(ppn: &[u32]) -> Self {
        let mut left = ppn.to_vec();
        let total: u64 = ppn.iter().map(|&k| u64::from(k)).sum();
        let mut node_of = Vec::with_capacity(total as usize);
        while (node_of.len() as u64) < total {
            for (n, l) in (0..=u32::MAX).zip(left.iter_mut()) {
                if *l > 0 {
                    *l -= 1;
                    node_of.push(n);
                }
            }
        }
        TaskMap { node_of }
    }

    /// The number of ranks in the job.
    pub fn size(&self) -> usize {
        self.node_of.len()
    }

    /// The node of `rank`, if it is a rank of the job.
    pub fn node_of(&self, rank: u32) -> Option<u32> {
        self.node_of.get(rank as usize).copied()
    }

    /// One more than the highest node index.
    pub fn node_count(&self) -> usize {
        self.node_of.iter().max().map_or(0, |&m| m as usize + 1)
    }

    /// The ranks on `node`, ascending: the clique that can share memory.
    pub fn clique(&self, node: u32) -> Vec<u32> {
        (0..=u32::MAX).zip(&self.node_of).filter(|&(_, &n)| n == node).map(|(r, _)| r).collect()
    }

    /// RFC 13's `PMI_process_mapping` value, compressed as its examples show: consecutive ranks on one node
    /// make a run; runs of equal length on consecutive nodes make one `(nodeid,nnodes,ppn)` block.
    pub fn process_mapping(&self) -> String {
        // (first node, node count, ranks per node)
        let mut blocks: Vec<(u32, u32, u32)> = Vec::new();
        let mut rest = &self.node_of[..];
        while let Some(&node) = rest.first() {
            let run = rest.iter().take_while(|&&n| n == node).count();
            rest = &rest[run..];
            let run = u32::try_from(run).unwrap_or(u32::MAX);
            match blocks.last_mut() {
                Some((start, count, ppn)) if *ppn == run && start.checked_add(*count) == Some(node) => *count += 1,
                _ => blocks.push((node, 1, run)),
            }
        }
        let mut s = String::from("(vector");
        for (start, count, ppn) in blocks {
            let _ = write!(s, ",({start},{count},{ppn})");
        }
        s.push(')');
        s
    }

    /// Intel MPI's two-line `get_ranks2hosts` answer. `hostnames[node]` names each node; nodes with the
    /// same hostname (virtual nodes on one machine) are one host, since Intel requires unique names.
    /// Hosts come in the order of their first node; the work is linear in ranks and nodes.
    pub fn ranks2hosts(&self, hostnames: &[String]) -> String {
        // `host_of[node]` indexes `names`, the hosts in node order.
        let mut names: Vec<&str> = Vec::new();
        let mut index: HashMap<&str, usize> = HashMap::new();
        let host_of: Vec<usize> = (0..self.node_count())
            .map(|node| {
                let name = hostnames.get(node).map_or("unknown", String::as_str);
                *index.entry(name).or_insert_with(|| {
                    names.push(name);
                    names.len() - 1
                })
            })
            .collect();
        let mut ranks: Vec<Vec<u32>> = vec![Vec::new(); names.len()];
        for (rank, &node) in (0..=u32::MAX).zip(&self.node_of) {
            ranks[host_of[node as usize]].push(rank);
        }
        let mut second = String::new();
        let mut count = 0;
        // A node that holds no rank is not a host of the job.
        for (name, ranks) in names.iter().zip(&ranks).filter(|(_, r)| !r.is_empty()) {
            count += 1;
            let _ = write!(second, "{} {} ", name.len(), name);
            for r in ranks {
                let _ = write!(second, "{r},");
            }
            second.push(' ');
        }
        second.push('\n');
        // <msglen> counts the second line with its newline, plus one (Intel's spec and worked example).
        format!("put_ranks2hosts {} {count}\n{second}", second.len() + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 13's table of examples.
    #[test]
    fn rfc13_examples() {
        assert_eq!(TaskMap::block(&[2, 2]).process_mapping(), "(vector,(0,2,2))");
        assert_eq!(TaskMap::cyclic(&[2, 2]).process_mapping(), "(vector,(0,2,1),(0,2,1))");
        assert_eq!(TaskMap::block(&[4, 4]).process_mapping(), "(vector,(0,2,4))");
        assert_eq!(TaskMap::cyclic(&[4, 4]).process_mapping(), "(vector,(0,2,1),(0,2,1),(0,2,1),(0,2,1))");
        assert_eq!(TaskMap::block(&[2, 2, 4, 4]).process_mapping(), "(vector,(0,2,2),(2,2,4))");
        assert_eq!(TaskMap::cyclic(&[2, 2, 4, 4]).process_mapping(), "(vector,(0,4,1),(0,4,1),(2,2,1),(2,2,1))");
        assert_eq!(TaskMap::block(&[256; 4096]).process_mapping(), "(vector,(0,4096,256))");
        let cyclic = TaskMap::cyclic(&[256; 4096]).process_mapping();
        assert_eq!(cyclic.len(), "(vector".len() + 256 * ",(0,4096,1)".len() + 1);
    }

    #[test]
    fn irregular_and_single_node() {
        assert_eq!(TaskMap::new(vec![1, 1, 0, 2, 2]).process_mapping(), "(vector,(1,1,2),(0,1,1),(2,1,2))");
        assert_eq!(TaskMap::block(&[1]).process_mapping(), "(vector,(0,1,1))");
    }

    #[test]
    fn cliques() {
        let m = TaskMap::cyclic(&[2, 3]);
        assert_eq!(m.clique(0), vec![0, 2]);
        assert_eq!(m.clique(1), vec![1, 3, 4]);
        assert_eq!(m.node_count(), 2);
        assert_eq!(m.node_of(4), Some(1));
        assert_eq!(m.node_of(5), None);
    }

    /// The worked example of Intel's specification: 8 ranks, node001 holding the odd ones.
    #[test]
    fn ranks2hosts_intel_example() {
        let m = TaskMap::new(vec![1, 0, 1, 0, 1, 0, 1, 0]);
        let hosts = ["node001".to_string(), "node002".to_string()];
        assert_eq!(m.ranks2hosts(&hosts), "put_ranks2hosts 40 2\n7 node001 1,3,5,7, 7 node002 0,2,4,6, \n");
    }

    #[test]
    fn ranks2hosts_merges_nodes_with_one_hostname() {
        let m = TaskMap::cyclic(&[1, 1, 1]);
        let hosts = ["a".to_string(), "bb".to_string(), "a".to_string()];
        assert_eq!(m.ranks2hosts(&hosts), "put_ranks2hosts 19 2\n1 a 0,2, 2 bb 1, \n");
    }
}

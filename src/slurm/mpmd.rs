//! The appnums of a `srun --multi-prog` step: each rank's is the index of the configuration line that runs
//! it, as `mpiexec -n 2 ./a : -n 3 ./b` gives each `:`-separated program its index.
//!
//! srun reads the configuration file (at most 60000 bytes) and Slurm passes its text to every stepd. A line
//! is `RANKS PROGRAM ARGS...`: RANKS is `*` or a comma-separated list of ranks and `first-last` ranges; a
//! rank is run by the first line that names it (a `*` line names every rank, and comes last). Blank lines
//! and lines whose first word starts with `#` are no commands; a line that ends with `\` goes on in the next,
//! which is then not a command of its own.

/// The most of a configuration read: srun sends at most 60000 bytes; a longer text (from a modified srun)
/// leaves every appnum 0 rather than hold up the stepd.
pub const TEXT_MAX: usize = 1 << 20;

/// The ranks one line names.
enum Spec {
    All,
    Ranges(Vec<(u32, u32)>),
}

/// The appnum of each of `ranks` under `config`; 0 for a rank no line names (Slurm fails such a step itself).
pub fn appnums(config: &str, ranks: &[u32]) -> Vec<i32> {
    if config.len() > TEXT_MAX {
        return vec![0; ranks.len()];
    }
    let mut commands: Vec<Spec> = Vec::new();
    let mut continued = false;
    for line in config.lines() {
        let was_continued = std::mem::replace(&mut continued, line.ends_with('\\'));
        let spec = line.split_whitespace().next().unwrap_or("");
        if !was_continued && !spec.is_empty() && !spec.starts_with('#') {
            commands.push(parse(spec));
        }
    }
    let names = |spec: &Spec, rank: u32| match spec {
        Spec::All => true,
        Spec::Ranges(ranges) => ranges.iter().any(|&(first, last)| first <= rank && rank <= last),
    };
    ranks.iter().map(|&r| commands.iter().position(|spec| names(spec, r)).map_or(0, |i| i as i32)).collect()
}

/// A line's rank spec: `*`, or ranks and `first-last` ranges, comma-separated (what is no rank names none).
fn parse(spec: &str) -> Spec {
    if spec == "*" {
        return Spec::All;
    }
    let range = |r: &str| match r.split_once('-') {
        Some((first, last)) => Some((first.parse().ok()?, last.parse().ok()?)),
        None => r.parse().ok().map(|n| (n, n)),
    };
    Spec::Ranges(spec.split(',').filter_map(range).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rank_takes_the_index_of_the_first_line_that_names_it() {
        let config = "# an MPMD step\n0,2 ./a x\n\n1 ./b\n3-4 ./c\n* ./d\n";
        assert_eq!(appnums(config, &[0, 1, 2, 3, 4, 5, 9]), [0, 1, 0, 2, 2, 3, 3]);
    }

    #[test]
    fn continued_lines_and_what_is_no_rank_spec() {
        let config = "0 ./a \\\n  1 more\n1-2 ./b\n  #3 ./c\n3 ./d\n";
        assert_eq!(appnums(config, &[0, 1, 2, 3]), [0, 1, 1, 2]);
        assert_eq!(appnums("x-y ./a\n0 ./b\n", &[0, 1]), [1, 0]);
        assert_eq!(appnums("", &[0]), [0]);
        let long = format!("0 ./a\n1 ./b\n{}", "#\n".repeat(TEXT_MAX / 2));
        assert_eq!(appnums(&long, &[0, 1]), [0, 0]);
    }
}

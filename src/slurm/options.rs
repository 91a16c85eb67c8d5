//! The plugin's options: for the whole site in mpi.conf (`RpmiKvsBytesMax=...`), per job in srun's
//! environment (`SLURM_RPMI_KVS_BYTES_MAX=...`). docs/man/rpmi-options.7.md lists the same, one entry each.
//!
//! **Who reads what.** slurmctld and slurmd read mpi.conf (each its own copy, at start) and hand it to the
//! plugin (`mpi_p_conf_set`); slurmd passes what the plugin gives back (`mpi_p_conf_get`) to the slurmstepd
//! of every step, and slurmctld prints what the plugin says is in force (`mpi_p_conf_get_printable`) in
//! `scontrol show config`. srun never sees mpi.conf. So srun checks the job's variables by name and syntax
//! (an unknown `SLURM_RPMI_*` variable, or a value that is not one, ends srun before any task starts) and
//! passes the ones set to the stepds in `RPMI_SLURM_OPTIONS`; each stepd holds them against the site's and
//! refuses the step when a job asks more than a ceiling allows.
//!
//! **Trust.** A stepd runs as root and serves a user's job. The options that bound what a job can make it
//! hold or gather (the request line, the key-value store, the bytes of one exchange) are *ceilings*: the
//! site's value is the most a job may ask, and a job may only lower it. The others shape only the job's own
//! service (the maxes `get_maxes` advertises, which never let a task store more than a request line and the
//! store allow; the tree's width; the trace on the job's own stderr): the site's value is the default, and a
//! job may set any value in the option's range.
//!
//! The plugin's own variables, which srun's side sets for the stepds ([`INTERNAL`], prefix `RPMI_SLURM_`), are
//! no options: srun sets every one of them in every launch, so what a user put there never reaches a stepd
//! (and a task's copy does not hold up an srun it runs). [`ENV_SPAWN`] in srun's own environment is what a
//! spawning srun passed on (`super::spawn`): srun checks it and passes it on in turn; it shapes only the
//! user's own step. The options' names before they took the
//! `SLURM_RPMI_` prefix are refused, naming the new ones; other `RPMI_SLURM_*` names are not the plugin's
//! (the project's test scripts use some).

use super::protocol::SPAWN_MAX;
use super::trace::escape_text;
use crate::collective::{Allgather, Bound, Bounds, Tree, TreeError};
use crate::server::{Limits, REQUEST_LINE_CEILING};
use std::ffi::CStr;
use std::ops::RangeInclusive;

/// The prefix of the job's options in srun's environment.
pub const JOB_PREFIX: &str = "SLURM_RPMI_";
/// The root's port on `SLURM_SRUN_COMM_HOST`; stays in the tasks' environment.
pub const ENV_PORT: &str = "RPMI_SLURM_PORT";
/// The step's secret, 64 hex digits.
pub const ENV_SECRET: &str = "RPMI_SLURM_SECRET";
/// The task map (`super::layout`).
pub const ENV_MAP: &str = "RPMI_SLURM_MAP";
/// The job's options as srun took them from its environment: `VAR=value` of each one set, comma-separated.
pub const ENV_OPTIONS: &str = "RPMI_SLURM_OPTIONS";
/// What a spawned step serves beyond a step's own (`super::spawn::Spawn`); empty in a step not spawned. In
/// the environment of an srun that a spawning srun started, it is what that srun passes on.
pub const ENV_SPAWN: &str = "RPMI_SLURM_SPAWN";
/// Every variable srun's side sets for the stepds, in the order srun's prelaunch gives their values: the
/// port, the secret, the map, the options, the spawn. srun sets each of them in every launch.
pub const INTERNAL: [&str; 5] = [ENV_PORT, ENV_SECRET, ENV_MAP, ENV_OPTIONS, ENV_SPAWN];

/// Names the job's options had before they took the `SLURM_RPMI_` prefix, and their names now.
const RENAMED: [(&str, &str); 2] = [
    ("RPMI_SLURM_NODE_BYTES_MAX", "SLURM_RPMI_NODE_BYTES_MAX"),
    ("RPMI_SLURM_EXCHANGE_BYTES_MAX", "SLURM_RPMI_EXCHANGE_BYTES_MAX"),
];

/// The most a byte bound may be set to: what one frame's 32-bit length can carry.
pub const BYTES_MAX_LIMIT: u64 = (u32::MAX as u64) - (1 << 20);
/// The longest value of a variable or a key echoed in a message.
const ECHO_MAX: usize = 64;

/// One option.
pub struct Opt {
    /// mpi.conf's key (Slurm reads keys without regard to case).
    pub key: &'static CStr,
    /// The job's variable in srun's environment.
    pub var: &'static str,
    /// What a value is, for messages.
    what: &'static str,
    /// The values it takes (a switch: 0 and 1).
    pub range: RangeInclusive<u64>,
    pub default: u64,
    /// Protective options: the ceiling when mpi.conf sets none. mpi.conf's value is the ceiling otherwise, and
    /// a job's default is the lesser of the default and the ceiling.
    pub ceiling: Option<u64>,
}

impl Opt {
    fn key(&self) -> &'static str {
        self.key.to_str().unwrap_or_default()
    }

    fn is_switch(&self) -> bool {
        self.what == SWITCH
    }
}

const SWITCH: &str = "yes or no";
const ALLGATHER: &str = "tree or bruck";
/// [`ALLGATHER`]'s values, by number.
const ALLGATHERS: [Allgather; 2] = [Allgather::Tree, Allgather::Bruck];
const BYTES: &str = "a number of bytes";

/// The options, by their place in [`OPTIONS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Id {
    KvsnameMax,
    KeylenMax,
    VallenMax,
    RequestLineMax,
    KvsBytesMax,
    NodeBytesMax,
    ExchangeBytesMax,
    SpawnBytesMax,
    TreeWidth,
    Allgather,
    Trace,
}

/// Every option, in [`Id`]'s order.
pub const OPTIONS: [Opt; 11] = [
    // Advertised by get_maxes, NUL included. The upper end is a PMI-1 line (what MPICH reads one into):
    // longer keys or values could not travel anyway.
    Opt {
        key: c"RpmiKvsnameMax",
        var: "SLURM_RPMI_KVSNAME_MAX",
        what: "a length",
        range: 16..=1024,
        default: 64,
        ceiling: None,
    },
    Opt {
        key: c"RpmiKeylenMax",
        var: "SLURM_RPMI_KEYLEN_MAX",
        what: "a length",
        range: 2..=1024,
        default: 64,
        ceiling: None,
    },
    Opt {
        key: c"RpmiVallenMax",
        var: "SLURM_RPMI_VALLEN_MAX",
        what: "a length",
        range: 2..=1024,
        default: 1024,
        ceiling: None,
    },
    // What the stepd holds per task connection while a line comes in.
    Opt {
        key: c"RpmiRequestLineMax",
        var: "SLURM_RPMI_REQUEST_LINE_MAX",
        what: BYTES,
        range: 1024..=(REQUEST_LINE_CEILING as u64),
        default: 4096,
        ceiling: Some(4096),
    },
    // What the stepd holds for the key-value store.
    Opt {
        key: c"RpmiKvsBytesMax",
        var: "SLURM_RPMI_KVS_BYTES_MAX",
        what: BYTES,
        range: 1..=BYTES_MAX_LIMIT,
        default: 512 << 20,
        ceiling: Some(512 << 20),
    },
    // What a stepd with children gathers for one exchange; each stepd also holds both to its store's bound.
    Opt {
        key: c"RpmiNodeBytesMax",
        var: "SLURM_RPMI_NODE_BYTES_MAX",
        what: BYTES,
        range: 1..=BYTES_MAX_LIMIT,
        default: 256 << 20,
        ceiling: Some(BYTES_MAX_LIMIT),
    },
    Opt {
        key: c"RpmiExchangeBytesMax",
        var: "SLURM_RPMI_EXCHANGE_BYTES_MAX",
        what: BYTES,
        range: 1..=BYTES_MAX_LIMIT,
        default: 512 << 20,
        ceiling: Some(BYTES_MAX_LIMIT),
    },
    // What the stepd holds per task while a spawn request comes in (PMI-1's lines, or one PMI-2 frame): at
    // most what one frame to srun carries.
    Opt {
        key: c"RpmiSpawnBytesMax",
        var: "SLURM_RPMI_SPAWN_BYTES_MAX",
        what: BYTES,
        range: 1024..=(SPAWN_MAX as u64),
        default: SPAWN_MAX as u64,
        ceiling: Some(SPAWN_MAX as u64),
    },
    // Any width of at least the node count less one is the star about node 0.
    Opt {
        key: c"RpmiTreeWidth",
        var: "SLURM_RPMI_TREE_WIDTH",
        what: "a width",
        range: 1..=u32::MAX as u64,
        default: crate::collective::DEFAULT_WIDTH as u64,
        ceiling: None,
    },
    // How an exchange's parts reach every node: by name, `Allgather`'s order.
    Opt {
        key: c"RpmiAllgather",
        var: "SLURM_RPMI_ALLGATHER",
        what: ALLGATHER,
        range: 0..=1,
        default: 0,
        ceiling: None,
    },
    // The job's switch is PMI_DEBUG, which MPICH's own PMI client reads too: set and not 0 turns it on.
    Opt { key: c"RpmiTrace", var: "PMI_DEBUG", what: SWITCH, range: 0..=1, default: 0, ceiling: None },
];

impl Id {
    pub const ALL: [Id; OPTIONS.len()] = [
        Id::KvsnameMax,
        Id::KeylenMax,
        Id::VallenMax,
        Id::RequestLineMax,
        Id::KvsBytesMax,
        Id::NodeBytesMax,
        Id::ExchangeBytesMax,
        Id::SpawnBytesMax,
        Id::TreeWidth,
        Id::Allgather,
        Id::Trace,
    ];

    pub fn opt(self) -> &'static Opt {
        &OPTIONS[self as usize]
    }
}

/// A value in `text` for `opt`, or why not (naming `name`, as the user wrote it: a variable or a key).
fn parse(opt: &Opt, name: &str, text: &str) -> Result<u64, String> {
    let value = if opt.is_switch() {
        match text.trim().to_ascii_lowercase().as_str() {
            "yes" | "true" | "1" => Some(1),
            "no" | "false" | "0" => Some(0),
            _ => None,
        }
    } else if opt.what == ALLGATHER {
        let name = text.trim().to_ascii_lowercase();
        ALLGATHERS.iter().position(|a| a.name() == name).map(|i| i as u64)
    } else {
        text.trim().parse::<u64>().ok().filter(|v| opt.range.contains(v))
    };
    value.ok_or_else(|| {
        let range = match opt.is_switch() || opt.what == ALLGATHER {
            true => String::new(),
            false => format!(" from {} to {}", opt.range.start(), opt.range.end()),
        };
        format!("{name}={} is not {}{range}", escape_text(text, ECHO_MAX), opt.what)
    })
}

/// The options a job set, each at most once.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Job([Option<u64>; OPTIONS.len()]);

impl Job {
    /// The job's options in srun's environment (`vars`): every `SLURM_RPMI_*` variable must be an option with
    /// a value of its kind, and the options' old names are refused. The first fault, by name, is the error.
    pub fn from_env(vars: impl IntoIterator<Item = (String, String)>) -> Result<Job, String> {
        let mut vars: Vec<_> =
            vars.into_iter().filter(|(name, _)| name.starts_with(JOB_PREFIX) || renamed(name).is_some()).collect();
        vars.sort();
        let mut job = Job::default();
        for (name, text) in vars {
            if let Some(new) = renamed(&name) {
                return Err(format!("{name} is now named {new}"));
            }
            job.set(&name, &text)?;
        }
        Ok(job)
    }

    /// Sets the option whose variable is `name`.
    fn set(&mut self, name: &str, text: &str) -> Result<(), String> {
        let Some(id) = Id::ALL.into_iter().find(|id| id.opt().var == name && name.starts_with(JOB_PREFIX)) else {
            return Err(format!(
                "{} is not an option of mpi/rpmi (its options are {})",
                escape_text(name, ECHO_MAX),
                known()
            ));
        };
        let value = parse(id.opt(), name, text)?;
        match self.0[id as usize].replace(value) {
            None => Ok(()),
            Some(_) => Err(format!("{name} is given twice")),
        }
    }

    pub fn get(&self, id: Id) -> Option<u64> {
        self.0[id as usize]
    }

    /// `RPMI_SLURM_OPTIONS`' value.
    pub fn encode(&self) -> String {
        let set =
            Id::ALL.into_iter().filter_map(|id| self.get(id).map(|v| format!("{}={}", id.opt().var, shown(id, v))));
        set.collect::<Vec<_>>().join(",")
    }

    /// What [`Job::encode`] made, as a stepd reads it (srun is the user's: it is checked as anything else).
    pub fn decode(text: &str) -> Result<Job, String> {
        let mut job = Job::default();
        for item in text.split(',').filter(|i| !i.is_empty()) {
            let (name, value) = item.split_once('=').unwrap_or((item, ""));
            job.set(name, value).map_err(|e| format!("{ENV_OPTIONS}: {e}"))?;
        }
        Ok(job)
    }
}

/// The name an option's old variable `name` has now.
fn renamed(name: &str) -> Option<&'static str> {
    RENAMED.iter().find(|(old, _)| *old == name).map(|(_, new)| *new)
}

/// The job's variables, for messages.
fn known() -> String {
    let vars = Id::ALL.into_iter().map(|id| id.opt().var).filter(|v| v.starts_with(JOB_PREFIX));
    vars.collect::<Vec<_>>().join(", ")
}

/// mpi.conf's options, as the site wrote them (unchecked: a value that is not one refuses every step, see
/// [`resolve`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Site([Option<String>; OPTIONS.len()]);

impl Site {
    pub const EMPTY: Site = Site([const { None }; OPTIONS.len()]);

    pub fn set(&mut self, id: Id, text: String) {
        self.0[id as usize] = Some(text);
    }

    /// What the site wrote for `id`, if anything.
    pub fn text(&self, id: Id) -> Option<&str> {
        self.0[id as usize].as_deref()
    }

    /// The site's value for `id`, if it gives one, or why it is not one.
    pub fn get(&self, id: Id) -> Option<Result<u64, String>> {
        let mpi_conf = format!("mpi.conf's {}", id.opt().key());
        self.text(id).map(|t| parse(id.opt(), &mpi_conf, t))
    }

    /// What slurmd passes on to each slurmstepd for `id`, which Slurm's parser reads again there: a value
    /// as the plugin writes it, or, for one that is not a value, its text marked so that it stays none
    /// (`?` first, and for every character Slurm's parser would split or unquote it at), so that the
    /// stepd refuses the step as the daemons said it would.
    pub fn passed_on(&self, id: Id) -> Option<String> {
        match self.get(id)? {
            Ok(v) => Some(shown(id, v)),
            Err(_) => {
                let text = self.text(id).unwrap_or_default();
                let marked = text.chars().map(|c| if c.is_ascii_alphanumeric() || "._-".contains(c) { c } else { '?' });
                Some(std::iter::once('?').chain(marked).collect())
            }
        }
    }

    /// The site's faults: one line for each value that is not one.
    pub fn faults(&self) -> Vec<String> {
        Id::ALL.into_iter().filter_map(|id| self.get(id)?.err()).collect()
    }

    /// The ceiling of a protective option: the site's, else the built-in one.
    fn ceiling(&self, id: Id) -> Option<u64> {
        let ceiling = id.opt().ceiling?;
        Some(self.get(id).and_then(Result::ok).unwrap_or(ceiling))
    }

    /// Each option as this site sets it, for `scontrol show config`: the value, and what it is to a job.
    pub fn printable(&self) -> Vec<(String, String)> {
        let show = |id: Id| {
            let opt = id.opt();
            let given = match self.get(id) {
                Some(Err(_)) => {
                    let text = escape_text(self.text(id).unwrap_or_default(), ECHO_MAX);
                    return format!("{text} (not {}: mpi/rpmi refuses every step)", opt.what);
                }
                Some(Ok(v)) => Some(v),
                None => None,
            };
            let shown = |v: u64| shown(id, v);
            let source = if given.is_some() { "" } else { ", built in" };
            match self.ceiling(id) {
                Some(c) => format!("{} (ceiling{source}; default {})", shown(c), shown(opt.default.min(c))),
                None => format!("{} (default{source})", shown(given.unwrap_or(opt.default))),
            }
        };
        Id::ALL.into_iter().map(|id| (id.opt().key().to_string(), show(id))).collect()
    }
}

/// Option `id`'s value `v` as a user writes it.
fn shown(id: Id, v: u64) -> String {
    match id.opt().what {
        SWITCH => (if v == 1 { "yes" } else { "no" }).to_string(),
        ALLGATHER => allgather_of(v).name().to_string(),
        _ => v.to_string(),
    }
}

fn allgather_of(v: u64) -> Allgather {
    ALLGATHERS.get(v as usize).copied().unwrap_or_default()
}

/// The most misnamed keys [`misnamed_keys`] reports.
const MISNAMED_MAX: usize = 16;

/// The keys in mpi.conf's `text` that look like the plugin's (they start with `Rpmi`, without regard to case,
/// as Slurm reads keys) but are none of its options, escaped and cut. Slurm skips a key no MPI plugin takes
/// without a word at the usual log levels, so a misspelled ceiling would silently be no ceiling.
pub fn misnamed_keys(text: &str) -> Vec<String> {
    let ours = |key: &str| OPTIONS.iter().any(|o| o.key().eq_ignore_ascii_case(key));
    let words = text.lines().flat_map(|line| line.split('#').next().unwrap_or_default().split_whitespace());
    // `Key+=value` and the other operators Slurm's parser takes (one, right before `=`) name `Key`.
    let keys = words.map(|word| match word.split_once('=') {
        Some((key, _)) => key.strip_suffix(['+', '-', '*', '/']).unwrap_or(key),
        None => word,
    });
    let misnamed = keys.filter(|key| key.get(..4).is_some_and(|p| p.eq_ignore_ascii_case("rpmi")) && !ours(key));
    misnamed.take(MISNAMED_MAX).map(|key| escape_text(key, ECHO_MAX)).collect()
}

/// What a misnamed key is, in the daemons' logs and `scontrol show config`.
pub fn misnamed() -> String {
    let keys = OPTIONS.iter().map(|o| o.key()).collect::<Vec<_>>().join(", ");
    format!("not an option of mpi/rpmi, so Slurm skips it (its keys are {keys})")
}

/// The options a step runs with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    values: [u64; OPTIONS.len()],
    /// Which values are the site's ceiling (the job did not set them, and the site's is below the default).
    site_ceiling: [bool; OPTIONS.len()],
}

/// The options a step runs with: the job's (`job`; `pmi_debug`, the job's `PMI_DEBUG`), else the site's,
/// else the defaults; or why the step is refused: a value in mpi.conf that is not one, a job that asks more
/// than a ceiling, or maxes no client could use.
pub fn resolve(site: &Site, job: &Job, pmi_debug: Option<&str>) -> Result<Settings, String> {
    if let Some(fault) = site.faults().into_iter().next() {
        return Err(format!("{fault}; mpi/rpmi refuses every step until the site mends it"));
    }
    let mut s = Settings { values: [0; OPTIONS.len()], site_ceiling: [false; OPTIONS.len()] };
    for id in Id::ALL {
        let opt = id.opt();
        let asked = match id {
            Id::Trace => pmi_debug.map(|v| u64::from(!v.is_empty() && v != "0")),
            _ => job.get(id),
        };
        let value = match (site.ceiling(id), asked) {
            (Some(c), Some(v)) if v > c => {
                let whose = match site.get(id) {
                    Some(_) => format!("the site's ceiling, mpi.conf's {}", opt.key()),
                    None => format!("mpi/rpmi's ceiling where mpi.conf sets no {}", opt.key()),
                };
                return Err(format!("{}={v} asks more than this site allows: at most {c} ({whose})", opt.var));
            }
            (Some(_), Some(v)) => v,
            (Some(c), None) => {
                s.site_ceiling[id as usize] = c < opt.default;
                opt.default.min(c)
            }
            (None, asked) => free(site, id, asked),
        };
        s.values[id as usize] = value;
    }
    s.limits().validate().map_err(|e| {
        let [n, k, v] = [Id::KvsnameMax, Id::KeylenMax, Id::VallenMax].map(|id| id.opt().var);
        format!("{e} ({n}, {k} and {v}, or mpi.conf's RpmiKvsnameMax, RpmiKeylenMax and RpmiVallenMax)")
    })?;
    Ok(s)
}

/// A free option's value: the job's, else the site's, else the default.
fn free(site: &Site, id: Id, asked: Option<u64>) -> u64 {
    asked.or_else(|| site.get(id)?.ok()).unwrap_or(id.opt().default)
}

/// The tree's width this node builds the tree with, also when it refuses the step (srun's root checks that
/// every stepd's is the same).
pub fn tree_width(site: &Site, job: &Job) -> u32 {
    free(site, Id::TreeWidth, job.get(Id::TreeWidth)) as u32
}

/// How this node's exchanges reach every node, also when it refuses the step (srun's root checks that every
/// stepd's is the same).
pub fn allgather(site: &Site, job: &Job) -> Allgather {
    allgather_of(free(site, Id::Allgather, job.get(Id::Allgather)))
}

/// The tree of a step's `nodes` stepds with `width`: its top at node 0, so that no exchange passes through
/// srun (measured in docs/slurm.md's "The PMI tree"), which hears only the control frames.
pub fn step_tree(nodes: u32, width: u32) -> Result<Tree, TreeError> {
    Tree::new(nodes, width).map(Tree::top_at_first_node)
}

impl Settings {
    pub fn get(&self, id: Id) -> u64 {
        self.values[id as usize]
    }

    /// The engine's limits.
    pub fn limits(&self) -> Limits {
        let length = |id| self.get(id) as u32;
        Limits {
            kvsname_max: length(Id::KvsnameMax),
            keylen_max: length(Id::KeylenMax),
            vallen_max: length(Id::VallenMax),
            request_line_max: self.get(Id::RequestLineMax) as usize,
            kvs_bytes_max: self.get(Id::KvsBytesMax) as usize,
            spawn_bytes_max: self.get(Id::SpawnBytesMax) as usize,
        }
    }

    /// The bounds of one exchange, with what sets each, for messages.
    pub fn bounds(&self) -> Bounds {
        let bound =
            |id: Id| Bound { bytes: self.get(id) as usize, option: bound_option(id, self.site_ceiling[id as usize]) };
        Bounds { part_max: bound(Id::NodeBytesMax), exchange_max: bound(Id::ExchangeBytesMax) }
    }

    pub fn trace(&self) -> bool {
        self.get(Id::Trace) == 1
    }
}

/// What sets a bound of one exchange, as its messages say: the job's variable, or the site's ceiling.
pub fn bound_option(id: Id, site_ceiling: bool) -> &'static str {
    match (id, site_ceiling) {
        (Id::NodeBytesMax, false) => "SLURM_RPMI_NODE_BYTES_MAX: raise it in srun's environment if the job needs more",
        (Id::NodeBytesMax, true) => "mpi.conf's RpmiNodeBytesMax: the site's ceiling",
        (_, false) => "SLURM_RPMI_EXCHANGE_BYTES_MAX: raise it in srun's environment if the job needs more",
        (_, true) => "mpi.conf's RpmiExchangeBytesMax: the site's ceiling",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> Result<Job, String> {
        Job::from_env(vars.iter().map(|(n, v)| (n.to_string(), v.to_string())))
    }

    fn site(pairs: &[(Id, &str)]) -> Site {
        let mut s = Site::default();
        for (id, text) in pairs {
            s.set(*id, text.to_string());
        }
        s
    }

    #[test]
    fn the_table_is_in_the_order_of_its_ids() {
        for (i, id) in Id::ALL.into_iter().enumerate() {
            assert_eq!(id as usize, i);
            let opt = id.opt();
            assert!(opt.key().starts_with("Rpmi"), "{}", opt.key());
            assert!(opt.range.contains(&opt.default), "{}", opt.var);
            assert!(opt.ceiling.is_none_or(|c| opt.range.contains(&c) && c >= opt.default), "{}", opt.var);
        }
        assert_eq!(Settings::default_for_tests().limits(), Limits::default());
    }

    impl Settings {
        fn default_for_tests() -> Settings {
            resolve(&Site::default(), &Job::default(), None).unwrap()
        }
    }

    #[test]
    fn the_allgather_is_named_by_the_job_else_the_site() {
        let job = env(&[("SLURM_RPMI_ALLGATHER", " Bruck ")]).unwrap();
        assert_eq!(job.encode(), "SLURM_RPMI_ALLGATHER=bruck");
        assert_eq!(Job::decode(&job.encode()), Ok(job.clone()));
        assert_eq!(allgather(&Site::default(), &job), Allgather::Bruck);
        let site_bruck = site(&[(Id::Allgather, "bruck")]);
        assert_eq!(allgather(&site_bruck, &Job::default()), Allgather::Bruck);
        let job_tree = env(&[("SLURM_RPMI_ALLGATHER", "tree")]).unwrap();
        assert_eq!(allgather(&site_bruck, &job_tree), Allgather::Tree);
        assert_eq!(allgather(&Site::default(), &Job::default()), Allgather::Tree);
        assert_eq!(
            env(&[("SLURM_RPMI_ALLGATHER", "ring")]).unwrap_err(),
            "SLURM_RPMI_ALLGATHER=ring is not tree or bruck"
        );
        let shown = site_bruck.printable();
        assert!(shown.contains(&("RpmiAllgather".to_string(), "bruck (default)".to_string())), "{shown:?}");
    }

    #[test]
    fn a_jobs_options_come_from_its_variables() {
        let job = env(&[("SLURM_RPMI_TREE_WIDTH", "2"), ("SLURM_RPMI_KVS_BYTES_MAX", " 4096 "), ("HOME", "/")]);
        let job = job.unwrap();
        assert_eq!(
            (job.get(Id::TreeWidth), job.get(Id::KvsBytesMax), job.get(Id::KeylenMax)),
            (Some(2), Some(4096), None)
        );
        assert_eq!(Job::decode(&job.encode()), Ok(job.clone()));
        assert_eq!(job.encode(), "SLURM_RPMI_KVS_BYTES_MAX=4096,SLURM_RPMI_TREE_WIDTH=2");
        assert_eq!(Job::decode(""), Ok(Job::default()));
        // The plugin's own variables are srun's to set: not options, and no fault (srun overwrites them).
        let internal: Vec<_> = INTERNAL.iter().map(|&n| (n, "x")).collect();
        assert_eq!(env(&internal), Ok(Job::default()));
        // Nor are names of others with the same prefix (the project's test scripts set RPMI_SLURM_DIR).
        assert_eq!(env(&[("RPMI_SLURM_DIR", "/tmp/x")]), Ok(Job::default()));
    }

    #[test]
    fn unknown_and_malformed_variables_are_refused_by_name() {
        let e = env(&[("SLURM_RPMI_TREE_WIDHT", "2")]).unwrap_err();
        assert!(
            e.starts_with("SLURM_RPMI_TREE_WIDHT is not an option of mpi/rpmi (its options are SLURM_RPMI_KVSNAME_MAX"),
            "{e}"
        );
        assert_eq!(
            env(&[("RPMI_SLURM_NODE_BYTES_MAX", "1")]).unwrap_err(),
            "RPMI_SLURM_NODE_BYTES_MAX is now named SLURM_RPMI_NODE_BYTES_MAX"
        );
        assert_eq!(
            env(&[("SLURM_RPMI_TREE_WIDTH", "0")]).unwrap_err(),
            "SLURM_RPMI_TREE_WIDTH=0 is not a width from 1 to 4294967295"
        );
        let e = env(&[("SLURM_RPMI_KVS_BYTES_MAX", "1G\x1b[2J")]).unwrap_err();
        assert_eq!(e, "SLURM_RPMI_KVS_BYTES_MAX=1G\\x1b[2J is not a number of bytes from 1 to 4293918719");
        let e = env(&[("SLURM_RPMI_VALLEN_MAX", &"9".repeat(5000))]).unwrap_err();
        assert!(e.len() < 200 && e.contains("(5000 bytes)"), "{e}");
        // PMI_DEBUG is the job's trace switch, but not a SLURM_RPMI_ variable.
        assert!(env(&[("SLURM_RPMI_TRACE", "1")]).is_err());
        assert!(env(&[("PMI_DEBUG", "anything")]).is_ok());
        // The first fault by name.
        let e = env(&[("SLURM_RPMI_ZZZ", "1"), ("SLURM_RPMI_KEYLEN_MAX", "x")]).unwrap_err();
        assert!(e.starts_with("SLURM_RPMI_KEYLEN_MAX=x"), "{e}");
        // What srun passes on is checked as closely by the stepd.
        assert!(Job::decode("SLURM_RPMI_TREE_WIDTH=2,SLURM_RPMI_TREE_WIDTH=3").unwrap_err().contains("given twice"));
        assert!(Job::decode("PMI_DEBUG=1").unwrap_err().starts_with("RPMI_SLURM_OPTIONS: PMI_DEBUG is not an option"));
        assert!(Job::decode("SLURM_RPMI_TREE_WIDTH").is_err());
    }

    #[test]
    fn the_sites_ceilings_bound_what_a_job_asks() {
        let site = site(&[(Id::KvsBytesMax, "268435456"), (Id::RequestLineMax, "2048"), (Id::TreeWidth, "2")]);
        // What a job does not set: the site's value (the default, for a ceiling above it).
        let s = resolve(&site, &Job::default(), None).unwrap();
        assert_eq!((s.get(Id::KvsBytesMax), s.get(Id::RequestLineMax), s.get(Id::TreeWidth)), (256 << 20, 2048, 2));
        assert_eq!(tree_width(&site, &Job::default()), 2);
        assert_eq!(s.bounds().part_max.bytes, 256 << 20);
        // A job may lower a ceiling and set a free option as it likes.
        let job = env(&[("SLURM_RPMI_REQUEST_LINE_MAX", "1500"), ("SLURM_RPMI_TREE_WIDTH", "9")]).unwrap();
        let s = resolve(&site, &job, Some("1")).unwrap();
        assert_eq!((s.get(Id::RequestLineMax), s.get(Id::TreeWidth), s.trace()), (1500, 9, true));
        assert_eq!(tree_width(&site, &job), 9);
        // Not raise it.
        let job = env(&[("SLURM_RPMI_REQUEST_LINE_MAX", "4096")]).unwrap();
        assert_eq!(
            resolve(&site, &job, None).unwrap_err(),
            "SLURM_RPMI_REQUEST_LINE_MAX=4096 asks more than this site allows: at most 2048 (the site's ceiling, \
             mpi.conf's RpmiRequestLineMax)"
        );
        // Where mpi.conf is silent, the built-in ceiling holds; a site may raise it.
        let job = env(&[("SLURM_RPMI_KVS_BYTES_MAX", "1073741824")]).unwrap();
        let e = resolve(&Site::default(), &job, None).unwrap_err();
        assert!(e.contains("at most 536870912 (mpi/rpmi's ceiling where mpi.conf sets no RpmiKvsBytesMax)"), "{e}");
        let raised = site_with(Id::KvsBytesMax, "2147483648");
        assert_eq!(resolve(&raised, &job, None).unwrap().get(Id::KvsBytesMax), 1 << 30);
        // ... and the job's default stays the default.
        assert_eq!(resolve(&raised, &Job::default(), None).unwrap().get(Id::KvsBytesMax), 512 << 20);
    }

    fn site_with(id: Id, text: &str) -> Site {
        site(&[(id, text)])
    }

    #[test]
    fn a_bound_says_whose_it_is() {
        let s = resolve(&site_with(Id::NodeBytesMax, "4096"), &Job::default(), None).unwrap();
        assert_eq!(
            s.bounds().part_max,
            Bound { bytes: 4096, option: "mpi.conf's RpmiNodeBytesMax: the site's ceiling" }
        );
        assert!(s.bounds().exchange_max.option.starts_with("SLURM_RPMI_EXCHANGE_BYTES_MAX"));
        let job = env(&[("SLURM_RPMI_NODE_BYTES_MAX", "1000")]).unwrap();
        let s = resolve(&site_with(Id::NodeBytesMax, "4096"), &job, None).unwrap();
        assert!(s.bounds().part_max.option.starts_with("SLURM_RPMI_NODE_BYTES_MAX"));
    }

    #[test]
    fn a_site_value_that_is_not_one_refuses_every_step() {
        let bad = site_with(Id::TreeWidth, "0");
        let e = resolve(&bad, &Job::default(), None).unwrap_err();
        assert_eq!(e, "mpi.conf's RpmiTreeWidth=0 is not a width from 1 to 4294967295; mpi/rpmi refuses every step until the site mends it");
        assert_eq!(bad.faults().len(), 1);
        let trace = site_with(Id::Trace, "maybe");
        assert!(resolve(&trace, &Job::default(), None)
            .unwrap_err()
            .starts_with("mpi.conf's RpmiTrace=maybe is not yes or no"));
        assert!(resolve(&site_with(Id::Trace, "YES"), &Job::default(), None).unwrap().trace());
        // PMI_DEBUG turns the site's trace off and on for one job.
        assert!(!resolve(&site_with(Id::Trace, "yes"), &Job::default(), Some("0")).unwrap().trace());
    }

    #[test]
    fn maxes_no_client_could_use_are_refused_naming_the_options() {
        let job = env(&[("SLURM_RPMI_KVSNAME_MAX", "512"), ("SLURM_RPMI_KEYLEN_MAX", "256")]).unwrap();
        let e = resolve(&Site::default(), &job, None).unwrap_err();
        assert!(e.contains("MPICH") && e.contains("SLURM_RPMI_KVSNAME_MAX"), "{e}");
    }

    /// What slurmd passes on, which Slurm's parser splits at a space and unquotes again in the stepd: a value
    /// as the plugin writes it, and what is not one still none there, whatever its text.
    #[test]
    fn what_slurmd_passes_on_reads_the_same_in_the_stepd() {
        let passed = |id: Id, text: &str| site_with(id, text).passed_on(id).unwrap();
        assert_eq!(passed(Id::RequestLineMax, "2048"), "2048");
        assert_eq!(passed(Id::Trace, "YES"), "yes");
        assert_eq!(passed(Id::Allgather, "bruck"), "bruck");
        for (id, bad) in
            [(Id::RequestLineMax, "2048 bytes"), (Id::Trace, "\"yes"), (Id::TreeWidth, "8 x"), (Id::KvsBytesMax, "")]
        {
            let on = passed(id, bad);
            assert!(on.starts_with('?') && !on.contains([' ', '"', '\t']), "{bad:?} passed on as {on:?}");
            assert!(site_with(id, &on).get(id).unwrap().is_err(), "{bad:?} passed on as {on:?}, a value");
        }
        assert_eq!(Site::EMPTY.passed_on(Id::Trace), None);
    }

    #[test]
    fn misnamed_keys_are_found() {
        // Slurm takes `Key+=value` (and -=, *=, /=) for Key; not two operators, nor one apart from `=`.
        assert!(misnamed_keys("RpmiKvsBytesMax+=1024 RpmiTreeWidth*=3\n").is_empty());
        assert_eq!(misnamed_keys("RpmiKvsBytesMax++=1024 RpmiTrace+ =1\n"), ["RpmiKvsBytesMax+", "RpmiTrace+"]);
        let conf = "# RpmiCommented=1\nPMIxTimeout=30 rpmikvsbytesmax=1 RpmiKvsByteMax=2 # RpmiAfter=3\nRPMITREEWIDTH=4\nRpmi\x1b[2J=5\n";
        assert_eq!(misnamed_keys(conf), ["RpmiKvsByteMax", "Rpmi\\x1b[2J"]);
        assert_eq!(misnamed_keys(&"RpmiX=1\n".repeat(100)).len(), MISNAMED_MAX);
        assert!(misnamed().starts_with("not an option of mpi/rpmi, so Slurm skips it (its keys are RpmiKvsnameMax"));
    }

    #[test]
    fn what_scontrol_shows() {
        let shown = site(&[(Id::RequestLineMax, "2048"), (Id::TreeWidth, "2"), (Id::Trace, "bad")]).printable();
        let get = |key: &str| shown.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str()).unwrap();
        assert_eq!(shown.len(), OPTIONS.len());
        assert_eq!(get("RpmiRequestLineMax"), "2048 (ceiling; default 2048)");
        assert_eq!(get("RpmiKvsBytesMax"), "536870912 (ceiling, built in; default 536870912)");
        assert_eq!(get("RpmiNodeBytesMax"), "4293918719 (ceiling, built in; default 268435456)");
        assert_eq!(get("RpmiTreeWidth"), "2 (default)");
        assert_eq!(get("RpmiVallenMax"), "1024 (default, built in)");
        assert_eq!(get("RpmiTrace"), "bad (not yes or no: mpi/rpmi refuses every step)");
    }
}

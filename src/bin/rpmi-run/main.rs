//! rpmi-run: runs an MPI (or any PMI-1) program on this machine, its tasks served by `librpmi.so`, which it
//! loads through the job-shell plugin ABI exactly as a foreign job shell would: one plugin instance per
//! virtual node, each node's shell a process of its own when there are several, exchanging each collective
//! over a tree (see `coordinator`).

#![deny(unsafe_op_in_unsafe_fn)]

/// Prints one of rpmi-run's messages on stderr in a single write, so that lines from several virtual
/// nodes' shells do not mix.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write;
        let _ = std::io::stderr().write_all(format!("rpmi-run: {}\n", format_args!($($arg)*)).as_bytes());
    }};
}

mod branch;
mod conn;
mod coordinator;
mod host;
mod output;
mod plugin;
mod shell;

use plugin::Plugin;
use rpmi::abi::{ffi, Options};
use rpmi::collective::{Bound, Bounds, Tree};
use rpmi::server::TaskMap;
use std::ffi::{CString, OsString};
use std::path::PathBuf;
use std::process::exit;

const USAGE: &str = "usage: rpmi-run [-n N] [--nodes M] [--tree-width K] [--map block|cyclic] [-l] [--trace] \
[-o KEY=VALUE]... [--event-loop] [--plugin PATH] [--] PROGRAM [ARGS]...

  -n N              run N tasks (default 1)
  --nodes M         split them over M virtual nodes, one plugin instance each (default 1)
  --tree-width K    the nodes exchange over a tree, each with at most K children (default 4; 1 is a
                    chain, M or more a star around rpmi-run)
  --map block|cyclic  how ranks are dealt to nodes (default block)
  -l                prefix every line of output with its rank
  --trace           print every PMI line each task sends (C:) and receives (S:)
  -o KEY=VALUE      a plugin option (see the README), e.g. -o vallen_max=512
  --event-loop      drive the plugin from rpmi-run's own loop instead of its progress thread
  --plugin PATH     the plugin to load (default: librpmi.so next to rpmi-run, else the system's librpmi.so)";

/// `--tree-width`'s default, chosen by measurement (see the README).
const TREE_WIDTH: u32 = 4;

struct Args {
    n: u32,
    nodes: u32,
    tree_width: u32,
    cyclic: bool,
    label: bool,
    trace: bool,
    event_loop: bool,
    options: serde_json::Map<String, serde_json::Value>,
    plugin: Option<PathBuf>,
    program: Vec<OsString>,
}

fn die(msg: impl std::fmt::Display) -> ! {
    say!("{msg}");
    exit(2)
}

fn parse_args() -> Args {
    let mut a = Args {
        n: 1,
        nodes: 1,
        tree_width: TREE_WIDTH,
        cyclic: false,
        label: false,
        trace: false,
        event_loop: false,
        options: serde_json::Map::new(),
        plugin: None,
        program: Vec::new(),
    };
    let mut it = std::env::args_os().skip(1);
    let value = |it: &mut dyn Iterator<Item = OsString>, flag: &str| -> String {
        it.next().and_then(|v| v.into_string().ok()).unwrap_or_else(|| die(format!("{flag} needs a value\n{USAGE}")))
    };
    let count = |v: String, flag: &str| -> u32 {
        v.parse().ok().filter(|&n| n > 0).unwrap_or_else(|| die(format!("{flag} takes a positive number, not '{v}'")))
    };
    while let Some(arg) = it.next() {
        match arg.to_str().unwrap_or("") {
            "-n" | "--ntasks" => a.n = count(value(&mut it, "-n"), "-n"),
            "--nodes" | "-N" => a.nodes = count(value(&mut it, "--nodes"), "--nodes"),
            "--tree-width" => a.tree_width = count(value(&mut it, "--tree-width"), "--tree-width"),
            "--map" | "-m" => match value(&mut it, "--map").as_str() {
                "block" => a.cyclic = false,
                "cyclic" => a.cyclic = true,
                other => die(format!("--map takes block or cyclic, not '{other}'")),
            },
            "-l" | "--label" => a.label = true,
            "--trace" => a.trace = true,
            "--event-loop" => a.event_loop = true,
            "-o" | "--option" => {
                let kv = value(&mut it, "-o");
                let Some((k, v)) = kv.split_once('=') else { die(format!("-o takes KEY=VALUE, not '{kv}'")) };
                // Numbers and booleans are JSON; anything else is a string.
                let v = serde_json::from_str(v).unwrap_or_else(|_| serde_json::Value::String(v.to_string()));
                a.options.insert(k.to_string(), v);
            }
            "--plugin" => a.plugin = Some(PathBuf::from(value(&mut it, "--plugin"))),
            "-h" | "--help" => {
                println!("{USAGE}");
                exit(0)
            }
            "--" => {
                a.program.extend(it.by_ref());
                break;
            }
            s if s.starts_with('-') && a.program.is_empty() => die(format!("unknown option '{s}'\n{USAGE}")),
            _ => {
                a.program.push(arg);
                a.program.extend(it.by_ref());
                break;
            }
        }
    }
    if a.program.is_empty() {
        die(format!("no program to run\n{USAGE}"));
    }
    if a.nodes > a.n {
        die(format!("{} tasks cannot fill {} nodes", a.n, a.nodes));
    }
    if a.trace {
        a.options.insert("trace".into(), serde_json::Value::Bool(true));
    }
    a
}

/// `librpmi.so` next to rpmi-run, where a build leaves it; else the bare name, which `dlopen` looks up as the
/// dynamic linker does: the `rpmi` package installs rpmi-run in `/usr/bin` and the library in the system's
/// library directory.
fn default_plugin() -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_else(|e| die(format!("cannot find where rpmi-run is: {e}")));
    let beside = exe.with_file_name("librpmi.so");
    if beside.exists() {
        beside
    } else {
        PathBuf::from("librpmi.so")
    }
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into our buffer.
    if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } != 0 {
        return "localhost".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// What one exchange between the nodes may carry: what every instance must be able to hold, as
/// `kvs_bytes_max` bounds the store of each (an exchange over it fails there anyway). Options the plugin
/// refuses leave the default: the plugin says why.
fn exchange_bounds(options: &CString) -> Bounds {
    let limits = options.to_str().ok().and_then(|o| Options::parse(Some(o)).ok()).map(|o| o.limits);
    let bytes = limits.unwrap_or_default().kvs_bytes_max;
    let bound = Bound { bytes, option: "-o kvs_bytes_max" };
    Bounds { part_max: bound, exchange_max: bound }
}

/// The job as every node's shell sees it.
pub struct Plan {
    /// The node of each rank.
    pub task_map: Vec<u32>,
    /// Each node's ranks, in local order.
    pub cliques: Vec<Vec<u32>>,
    /// Each node's hostname (all this machine's).
    pub hostnames: Vec<CString>,
    pub job_id: CString,
    /// The plugin options, as JSON.
    pub options: CString,
    pub program: Vec<OsString>,
    pub label: bool,
    pub event_loop: bool,
    /// Messages at this level or more urgent are printed (RPMI_LOG_*).
    pub verbosity: i32,
}

fn main() {
    output::block_signals();
    let args = parse_args();
    let plugin_path = args.plugin.clone().unwrap_or_else(default_plugin);
    let plugin = Plugin::load(&plugin_path).unwrap_or_else(|e| die(e));
    if args.trace {
        say!("{} from {}", plugin.version(), plugin_path.display());
    }

    // Ranks over nodes: as even as can be, the first nodes taking one more.
    let ppn: Vec<u32> = (0..args.nodes).map(|i| args.n / args.nodes + u32::from(i < args.n % args.nodes)).collect();
    let map = if args.cyclic { TaskMap::cyclic(&ppn) } else { TaskMap::block(&ppn) };
    let plan = Plan {
        task_map: (0..args.n).map(|r| map.node_of(r).unwrap_or(0)).collect(),
        cliques: (0..args.nodes).map(|n| map.clique(n)).collect(),
        hostnames: (0..args.nodes).map(|_| CString::new(hostname()).unwrap_or_else(|_| c"localhost".into())).collect(),
        job_id: CString::new(format!("run{}", std::process::id())).unwrap_or_default(),
        options: CString::new(serde_json::Value::Object(args.options).to_string()).unwrap_or_default(),
        program: args.program,
        label: args.label,
        event_loop: args.event_loop,
        verbosity: if args.trace { ffi::RPMI_LOG_TRACE } else { ffi::RPMI_LOG_WARN },
    };
    if args.nodes == 1 {
        exit(shell::run(&plan, plugin, 0, None));
    }
    let tree = Tree::new(args.nodes, args.tree_width).unwrap_or_else(|e| die(e));
    let run_node = |index, branch| shell::run(&plan, plugin, index, Some(branch));
    match coordinator::coordinate(&plan.cliques, tree, exchange_bounds(&plan.options), plan.verbosity, run_node) {
        Ok(status) => exit(status),
        Err(e) => die(e),
    }
}

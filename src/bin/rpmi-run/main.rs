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
        let line = format!("{}: {}\n", crate::who(), format_args!($($arg)*));
        let _ = std::io::stderr().write_all(line.as_bytes());
    }};
}

mod branch;
mod conn;
mod coordinator;
mod host;
mod job;
mod output;
mod plugin;
mod services;
mod shell;

use job::{App, Job};
use plugin::Plugin;
use rpmi::abi::{ffi, Options};
use rpmi::collective::{Allgather, Bound, Bounds, Tree};
use rpmi::launch;
use rpmi::server::TaskMap;
use services::Ended;
use services::Launch;
use std::ffi::{CString, OsString};
use std::os::fd::FromRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::exit;
use std::sync::{Arc, Mutex, OnceLock};

const USAGE: &str = "usage: rpmi-run [-n N] [--nodes M] [--tree-width K] [--allgather tree|bruck] [--map block|cyclic] [--universe U] [-l] \
[--trace] [-o KEY=VALUE]... [--event-loop] [--plugin PATH] [--] PROGRAM [ARGS]... [: -n N PROGRAM [ARGS]...]...";

/// What `--help` prints after [`USAGE`]: one line per option, as docs/man/rpmi-run.1.md's OPTIONS lists them
/// (tests/docs.rs compares the two).
const HELP: &str = "
Runs PROGRAM as the tasks of one PMI job on this machine, served by librpmi.so (see rpmi-run(1)).

options:
  -n, --ntasks N            run N tasks (default 1)
  -N, --nodes M             split them over M virtual nodes, one plugin instance each (default 1)
  --tree-width K            the nodes exchange over a tree of at most K children each (default 4)
  --allgather tree|bruck    how each exchange's parts reach every node: up the tree and back down
                            (default), or Bruck's allgather between the nodes
  -m, --map block|cyclic    how ranks are dealt to the nodes (default block)
  --universe U              what PMI_Get_universe_size answers (default: the job's size)
  -l, --label               prefix every line of output with its rank
  --trace                   print every PMI line each task sends (C:) and receives (S:)
  -o, --option KEY=VALUE    a plugin option (see rpmi-options(7)), e.g. -o vallen_max=512
  --event-loop              drive the plugin from rpmi-run's own loop instead of its progress thread
  --plugin PATH             the plugin to load (default: librpmi.so beside rpmi-run, else the system's)
  -h, --help                print this help and exit

  : -n N PROGRAM [ARGS]...  one more application of N tasks in the same job (MPMD): its ranks follow
                            the ones before, with the next appnum; only -n may follow ':'";

/// How rpmi-run names itself in its messages: with the job's id in a spawned job's rpmi-run.
static WHO: OnceLock<String> = OnceLock::new();

fn who() -> &'static str {
    WHO.get().map_or("rpmi-run", String::as_str)
}

fn die(msg: impl std::fmt::Display) -> ! {
    say!("{msg}");
    exit(2)
}

/// The job the command line asks for.
fn parse_args() -> Job {
    let mut job = Job {
        apps: Vec::new(),
        // The pid and the clock: MPICH names a node's shared memory after the KVS name, and tasks killed by
        // an abort leave theirs behind, which a later job of a reused pid alone would find.
        job_id: format!("run{}-{:x}", std::process::id(), rpmi::os::monotonic_ns() & 0xffff_ffff),
        preputs: Vec::new(),
        spawned: false,
        universe: 0,
        nodes: 1,
        tree_width: rpmi::collective::DEFAULT_WIDTH,
        allgather: Allgather::Tree,
        cyclic: false,
        label: false,
        trace: false,
        event_loop: false,
        options: serde_json::Map::new(),
        plugin: None,
    };
    let mut it = std::env::args_os().skip(1).peekable();
    let value = |it: &mut dyn Iterator<Item = OsString>, flag: &str| -> String {
        it.next().and_then(|v| v.into_string().ok()).unwrap_or_else(|| die(format!("{flag} needs a value\n{USAGE}")))
    };
    let count = |v: String, flag: &str| -> u32 {
        v.parse().ok().filter(|&n| n > 0).unwrap_or_else(|| die(format!("{flag} takes a positive number, not '{v}'")))
    };
    // The options of the first application are rpmi-run's own; after each ':' only -n.
    let mut n = 1;
    while let Some(arg) = it.next() {
        match arg.to_str().unwrap_or("") {
            "-n" | "--ntasks" => n = count(value(&mut it, "-n"), "-n"),
            "--nodes" | "-N" => job.nodes = count(value(&mut it, "--nodes"), "--nodes"),
            "--tree-width" => job.tree_width = count(value(&mut it, "--tree-width"), "--tree-width"),
            "--allgather" => {
                let name = value(&mut it, "--allgather");
                let allgather = Allgather::from_name(&name);
                job.allgather =
                    allgather.unwrap_or_else(|| die(format!("--allgather takes tree or bruck, not '{name}'")));
            }
            "--map" | "-m" => match value(&mut it, "--map").as_str() {
                "block" => job.cyclic = false,
                "cyclic" => job.cyclic = true,
                other => die(format!("--map takes block or cyclic, not '{other}'")),
            },
            "--universe" => job.universe = count(value(&mut it, "--universe"), "--universe"),
            "-l" | "--label" => job.label = true,
            "--trace" => job.trace = true,
            "--event-loop" => job.event_loop = true,
            "-o" | "--option" => {
                let kv = value(&mut it, "-o");
                let Some((k, v)) = kv.split_once('=') else { die(format!("-o takes KEY=VALUE, not '{kv}'")) };
                // Numbers and booleans are JSON; anything else is a string.
                let v = serde_json::from_str(v).unwrap_or_else(|_| serde_json::Value::String(v.to_string()));
                job.options.insert(k.to_string(), v);
            }
            "--plugin" => job.plugin = Some(PathBuf::from(value(&mut it, "--plugin"))),
            "-h" | "--help" => {
                println!("{USAGE}\n{HELP}");
                exit(0)
            }
            "--" => {
                job.apps.push(App::new(n, application(&mut it)));
                break;
            }
            s if s.starts_with('-') => die(format!("unknown option '{s}'\n{USAGE}")),
            ":" => die(format!("no program before ':'\n{USAGE}")),
            _ => {
                let mut program = vec![arg];
                program.extend(application(&mut it));
                job.apps.push(App::new(n, program));
                break;
            }
        }
    }
    // Each ':' starts one more application: -n N, then its program.
    while it.next().is_some() {
        let mut n = 1;
        loop {
            match it.peek().and_then(|a| a.to_str()) {
                Some("-n" | "--ntasks") => {
                    it.next();
                    n = count(value(&mut it, "-n"), "-n");
                }
                Some("--") => {
                    it.next();
                    break;
                }
                Some(s) if s.starts_with('-') => die(format!("only -n may follow ':', not '{s}'\n{USAGE}")),
                _ => break,
            }
        }
        let program = application(&mut it);
        if program.is_empty() {
            die(format!("no program after ':'\n{USAGE}"));
        }
        job.apps.push(App::new(n, program));
    }
    if job.apps.first().is_none_or(|a| a.program.is_empty()) {
        die(format!("no program to run\n{USAGE}"));
    }
    let size: u64 = job.apps.iter().map(|a| u64::from(a.n)).sum();
    if size > u64::from(u32::MAX / 2) {
        die(format!("{size} tasks are more than rpmi-run runs"));
    }
    if u64::from(job.nodes) > size {
        die(format!("{size} tasks cannot fill {} nodes", job.nodes));
    }
    if job.trace {
        job.options.insert("trace".into(), serde_json::Value::Bool(true));
    }
    job
}

/// A program and its arguments, up to the next ':' (which is left for the caller).
fn application(it: &mut std::iter::Peekable<impl Iterator<Item = OsString>>) -> Vec<OsString> {
    std::iter::from_fn(|| it.next_if(|a| a != ":")).collect()
}

/// The job a spawned job's rpmi-run is to run (`rpmi-run --spawned-job FD`, started by the first rpmi-run of
/// the launch, see `services`), and its link to that rpmi-run.
fn read_spawned_job(fd: Option<String>) -> (Job, UnixStream) {
    let fd: i32 =
        fd.and_then(|f| f.parse().ok()).filter(|&f| f > 2).unwrap_or_else(|| die("--spawned-job needs its link's fd"));
    // SAFETY: F_GETFD only asks whether the fd is open.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        die(format!("--spawned-job: fd {fd} is not open"));
    }
    // SAFETY: an open fd the first rpmi-run handed down for this process alone; taken once. It is made
    // close-on-exec again, so that no task inherits it.
    let mut link = unsafe {
        libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
        UnixStream::from_raw_fd(fd)
    };
    match conn::read_frame(&mut link, services::FRAME_MAX) {
        Ok(Some((services::JOB, json))) => match Job::from_json(&json) {
            Ok(job) => {
                let _ = WHO.set(format!("rpmi-run (spawned job {})", job.job_id));
                (job, link)
            }
            Err(e) => die(format!("--spawned-job: {e}")),
        },
        _ => die("--spawned-job: no job came from the rpmi-run that spawned it"),
    }
}

/// Checks that every process of a spawned job can be started (its program found and executable, its
/// directory one, the preputs what a put may be) and tells the first rpmi-run the spawn's answer: one error
/// code per process, 0 for each that starts. If one cannot start, none does and every code is PMI_FAIL (-1),
/// and why is said: MPICH's spawner waits for the children to connect unless every code is non-zero.
fn answer_spawn(job: &Job, link: &mut UnixStream) -> bool {
    let mut fine = true;
    let mut fail = |why: String| {
        say!("{why}; the spawn fails");
        fine = false;
    };
    for app in &job.apps {
        if let Some(wdir) = app.wdir.as_ref().filter(|w| !w.is_dir()) {
            fail(format!("cannot start {} in {}: not a directory", app.program[0].to_string_lossy(), wdir.display()));
        } else if let Err(errno) = job::resolve(&app.program[0], app.wdir.as_deref(), app.path.as_ref()) {
            let why = std::io::Error::from_raw_os_error(errno);
            fail(format!("cannot start {}: {why}", app.program[0].to_string_lossy()));
        }
    }
    // The plugin's limits: options it refuses give the defaults, and it says why when the job starts.
    let options = serde_json::Value::Object(job.options.clone()).to_string();
    let limits = Options::parse(Some(&options)).map(|o| o.limits).unwrap_or_default();
    if let Err(why) = launch::check_preputs(&limits, job.preputs.iter().map(|(k, v)| (k.as_bytes(), v.as_bytes()))) {
        fail(why);
    }
    let code = if fine { 0 } else { launch::PMI_FAIL }.to_string();
    let mut payload = vec![1u8];
    payload.extend_from_slice(vec![code.as_str(); job.size() as usize].join(",").as_bytes());
    let _ = conn::write_frame(link, services::STARTED, &payload);
    fine
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
    /// Each rank's appnum: its application's index.
    pub appnums: Vec<i32>,
    /// Each node's ranks, in local order.
    pub cliques: Vec<Vec<u32>>,
    /// Each node's hostname (all this machine's).
    pub hostnames: Vec<CString>,
    pub job_id: CString,
    /// The plugin options, as JSON.
    pub options: CString,
    pub apps: Vec<App>,
    /// The job's preputs, as the plugin takes them.
    pub preputs: Vec<(CString, CString)>,
    pub universe: u32,
    pub spawned: bool,
    pub label: bool,
    pub event_loop: bool,
    /// Messages at this level or more urgent are printed (RPMI_LOG_*).
    pub verbosity: i32,
    /// The rpmi-runs of jobs spawned in this launch, which signals are passed on to as well.
    pub spawned_runs: Arc<Mutex<Vec<libc::pid_t>>>,
}

fn main() {
    output::block_signals();
    let mut args = std::env::args_os().skip(1);
    let (mut job, mut up) = match args.next() {
        Some(flag) if flag == "--spawned-job" => {
            let (job, link) = read_spawned_job(args.next().and_then(|fd| fd.into_string().ok()));
            (job, Some(link))
        }
        _ => (parse_args(), None),
    };
    let plugin_path = job.plugin.clone().unwrap_or_else(default_plugin);
    let plugin = Plugin::load(&plugin_path).unwrap_or_else(|e| die(e));
    if job.trace && up.is_none() {
        say!("{} from {}", plugin.version(), plugin_path.display());
    }
    job.plugin = Some(plugin_path);
    if let Some(link) = up.as_mut() {
        if !answer_spawn(&job, link) {
            // The spawner hears which processes could not start; this job ends without running any.
            let _ = conn::write_frame(link, services::EXIT, &services::exit_payload(Ended { status: 0, began: None }));
            exit(0);
        }
    }

    // Ranks over nodes: as even as can be, the first nodes taking one more.
    let (n, nodes) = (job.size(), job.nodes);
    let ppn: Vec<u32> = (0..nodes).map(|i| n / nodes + u32::from(i < n % nodes)).collect();
    let map = if job.cyclic { TaskMap::cyclic(&ppn) } else { TaskMap::block(&ppn) };
    let launch =
        Launch::new(&job, nodes as usize, up).unwrap_or_else(|e| die(format!("cannot set up the launch: {e}")));
    let c_string = |s: &str| CString::new(s.replace('\0', "")).unwrap_or_default();
    let plan = Plan {
        task_map: (0..n).map(|r| map.node_of(r).unwrap_or(0)).collect(),
        appnums: job.appnums(),
        cliques: (0..nodes).map(|i| map.clique(i)).collect(),
        hostnames: (0..nodes).map(|_| CString::new(hostname()).unwrap_or_else(|_| c"localhost".into())).collect(),
        job_id: c_string(&job.job_id),
        options: CString::new(serde_json::Value::Object(job.options.clone()).to_string()).unwrap_or_default(),
        apps: job.apps.clone(),
        preputs: job.preputs.iter().map(|(k, v)| (c_string(k), c_string(v))).collect(),
        universe: job.universe,
        spawned: job.spawned,
        label: job.label,
        event_loop: job.event_loop,
        verbosity: if job.trace { ffi::RPMI_LOG_TRACE } else { ffi::RPMI_LOG_WARN },
        spawned_runs: launch.spawned_runs(),
    };
    let ended = if nodes == 1 {
        launch.start(false);
        shell::run(&plan, plugin, 0, None, launch.node_link(0, false))
    } else {
        let tree = Tree::new(nodes, job.tree_width).unwrap_or_else(|e| die(e)).top_at_first_node();
        let run_node =
            |index, branch| shell::run(&plan, plugin, index, Some(branch), launch.node_link(index, true)).status;
        let bounds = exchange_bounds(&plan.options);
        let after_fork = || launch.start(true);
        let shape = (tree, job.allgather);
        coordinator::coordinate(&plan.cliques, shape, bounds, plan.verbosity, &plan.spawned_runs, after_fork, run_node)
            .unwrap_or_else(|e| die(e))
    };
    exit(launch.finish(ended))
}

//! rpmi-run: runs an MPI (or any PMI-1) program on this machine, its tasks served by `librpmi.so`, which it
//! loads through the job-shell plugin ABI exactly as a foreign job shell would: one plugin instance per
//! virtual node, the collective between them done in-process.

mod host;
mod output;
mod plugin;

use host::{Job, Node};
use plugin::{call, Plugin};
use rpmi::abi::ffi::{self, rpmi_instance, rpmi_job_info, rpmi_task_env};
use rpmi::server::TaskMap;
use std::ffi::{CString, OsString};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{exit, Command, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};

const USAGE: &str = "usage: rpmi-run [-n N] [--nodes M] [--map block|cyclic] [-l] [--trace] [-o KEY=VALUE]... \
[--event-loop] [--plugin PATH] [--] PROGRAM [ARGS]...

  -n N              run N tasks (default 1)
  --nodes M         split them over M virtual nodes, one plugin instance each (default 1)
  --map block|cyclic  how ranks are dealt to nodes (default block)
  -l                prefix every line of output with its rank
  --trace           print every PMI line each task sends (C:) and receives (S:)
  -o KEY=VALUE      a plugin option (see the README), e.g. -o vallen_max=512
  --event-loop      drive the plugin from rpmi-run's own loop instead of its progress thread
  --plugin PATH     the plugin to load (default: librpmi.so next to rpmi-run)";

struct Args {
    n: u32,
    nodes: u32,
    cyclic: bool,
    label: bool,
    trace: bool,
    event_loop: bool,
    options: serde_json::Map<String, serde_json::Value>,
    plugin: Option<PathBuf>,
    program: Vec<OsString>,
}

fn die(msg: impl std::fmt::Display) -> ! {
    eprintln!("rpmi-run: {msg}");
    exit(2)
}

fn parse_args() -> Args {
    let mut a = Args {
        n: 1,
        nodes: 1,
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

fn default_plugin() -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_else(|e| die(format!("cannot find where rpmi-run is: {e}")));
    exe.with_file_name("librpmi.so")
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

/// A task of the job: where it runs and, once started, its process.
struct Task {
    rank: u32,
    node: usize,
    local: u32,
    pid: libc::pid_t,
}

fn main() {
    output::block_signals();
    let args = parse_args();
    let plugin_path = args.plugin.clone().unwrap_or_else(default_plugin);
    let plugin = Plugin::load(&plugin_path).unwrap_or_else(|e| die(e));
    let verbosity = if args.trace { ffi::RPMI_LOG_TRACE } else { ffi::RPMI_LOG_WARN };
    let nodes = args.nodes as usize;
    let job: &'static Job = Box::leak(Box::new(Job::new(plugin, nodes, verbosity)));
    if args.trace {
        eprintln!("rpmi-run: {} from {}", job.plugin.version(), plugin_path.display());
    }

    // Ranks over nodes: as even as can be, the first nodes taking one more.
    let ppn: Vec<u32> = (0..args.nodes).map(|i| args.n / args.nodes + u32::from(i < args.n % args.nodes)).collect();
    let map = if args.cyclic { TaskMap::cyclic(&ppn) } else { TaskMap::block(&ppn) };
    let task_map: Vec<u32> = (0..args.n).map(|r| map.node_of(r).unwrap_or(0)).collect();
    let hostnames: Vec<CString> =
        (0..nodes).map(|_| CString::new(hostname()).unwrap_or_else(|_| c"localhost".into())).collect();
    let hostname_ptrs: Vec<*const std::ffi::c_char> = hostnames.iter().map(|h| h.as_ptr()).collect();
    let job_id = CString::new(format!("run{}", std::process::id())).unwrap_or_default();
    let options = CString::new(serde_json::Value::Object(args.options.clone()).to_string()).unwrap_or_default();

    // One instance per virtual node.
    let node_data: Vec<&'static Node> =
        (0..nodes).map(|index| &*Box::leak(Box::new(Node { job, index, watch: AtomicI32::new(-1) }))).collect();
    let cliques: Vec<Vec<u32>> = (0..args.nodes).map(|n| map.clique(n)).collect();
    let mut instances = Vec::with_capacity(nodes);
    for (index, node) in node_data.iter().enumerate() {
        let info = rpmi_job_info {
            struct_size: std::mem::size_of::<rpmi_job_info>() as u32,
            job_id: job_id.as_ptr(),
            shell_index: index as u32,
            shell_count: args.nodes,
            size: args.n,
            task_map: task_map.as_ptr(),
            local_ranks: cliques[index].as_ptr(),
            local_count: cliques[index].len() as u32,
            hostnames: hostname_ptrs.as_ptr(),
            options_json: options.as_ptr(),
            appnum: 0,
            universe_size: 0,
            spawned: 0,
        };
        let ops = Job::ops(node, args.event_loop);
        let mut inst: *mut rpmi_instance = std::ptr::null_mut();
        let mut err = [0 as std::ffi::c_char; 512];
        let rc = call!(job.plugin, create(&info, &ops, &mut inst, err.as_mut_ptr(), err.len()));
        if rc != ffi::RPMI_OK {
            // SAFETY: create wrote a NUL-terminated message into err.
            let msg = unsafe { std::ffi::CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned();
            die(format!("the plugin refused the job: {msg}"));
        }
        instances.push(inst as usize);
    }
    let _ = job.instances.set(instances.clone());
    let event_loop = args.event_loop.then(|| output::spawn_event_loop(job, &node_data));

    // SIGINT and SIGTERM go to the tasks; rpmi-run ends when they do.
    let signals = output::forward_signals(job);
    let mut labels = args.label.then(output::Labeler::new);

    let mut tasks: Vec<Task> = Vec::with_capacity(args.n as usize);
    for rank in 0..args.n {
        if job.ending.load(Ordering::SeqCst) {
            break;
        }
        let node = task_map[rank as usize] as usize;
        let local = cliques[node].iter().position(|&r| r == rank).unwrap_or(0) as u32;
        let inst = instances[node] as *mut rpmi_instance;
        let mut env = rpmi_task_env {
            struct_size: std::mem::size_of::<rpmi_task_env>() as u32,
            child_fd: -1,
            env_count: 0,
            env: std::ptr::null(),
        };
        if call!(job.plugin, task_init(inst, local, &mut env)) != ffi::RPMI_OK {
            job.end(libc::SIGKILL);
            eprintln!("rpmi-run: the plugin could not set up rank {rank}");
            break;
        }
        let mut cmd = Command::new(&args.program[0]);
        cmd.args(&args.program[1..]);
        // SAFETY: env holds env_count NUL-terminated strings, valid until task_forked.
        for i in 0..env.env_count {
            let var = unsafe { std::ffi::CStr::from_ptr(*env.env.add(i)) }.to_string_lossy().into_owned();
            if let Some((k, v)) = var.split_once('=') {
                cmd.env(k, v);
            }
        }
        if labels.is_some() {
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        }
        let task_exec = job.plugin.table.task_exec;
        let inst_addr = inst as usize;
        // SAFETY: runs in the child between fork and exec: task_exec is async-signal-safe (fcntl only), and
        // so is unblocking the signals rpmi-run keeps for its own thread.
        unsafe {
            cmd.pre_exec(move || {
                if let Some(f) = task_exec {
                    if f(inst_addr as *mut rpmi_instance, local) != ffi::RPMI_OK {
                        return Err(std::io::Error::other("cannot hand the PMI connection to the task"));
                    }
                }
                output::unblock_signals();
                Ok(())
            });
        }
        let spawned = cmd.spawn();
        call!(job.plugin, task_forked(inst, local));
        match spawned {
            Ok(mut child) => {
                let pid = child.id() as libc::pid_t;
                if let Some(l) = labels.as_mut() {
                    l.add(rank, child.stdout.take(), child.stderr.take());
                }
                if let Ok(mut pids) = job.pids.lock() {
                    pids.push(pid);
                }
                tasks.push(Task { rank, node, local, pid });
            }
            Err(e) => {
                eprintln!("rpmi-run: cannot start {}: {e}", args.program[0].to_string_lossy());
                job.end(libc::SIGKILL);
                if tasks.is_empty() {
                    exit(127);
                }
                break;
            }
        }
    }
    if job.ending.load(Ordering::SeqCst) {
        job.signal_all(libc::SIGKILL);
    }
    let output_thread = labels.map(output::Labeler::start);

    let status = wait_for(job, &mut tasks, &instances);
    if let Some(t) = event_loop {
        t.stop();
    }
    for &inst in &instances {
        call!(job.plugin, destroy(inst as *mut rpmi_instance));
    }
    if let Some(t) = output_thread {
        let _ = t.join();
    }
    drop(signals);
    exit(status);
}

/// Reaps every task; ends the job at the first that fails. Returns rpmi-run's exit status: the code a
/// PMI_Abort asked for; else the first failing task's code (128+signal if it was killed); else 1 if the
/// plugin ended the job (protocol error, lost task); else 0.
fn wait_for(job: &Job, tasks: &mut [Task], instances: &[usize]) -> i32 {
    let mut first_failure: Option<i32> = None;
    let mut left = tasks.len();
    while left > 0 {
        let mut status = 0;
        // SAFETY: waitpid for any child into a local.
        let pid = unsafe { libc::waitpid(-1, &mut status, 0) };
        if pid < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            break;
        }
        let Some(task) = tasks.iter_mut().find(|t| t.pid == pid) else { continue };
        task.pid = 0;
        left -= 1;
        call!(job.plugin, task_exit(instances[task.node] as *mut rpmi_instance, task.local, status));
        let code = if libc::WIFEXITED(status) { libc::WEXITSTATUS(status) } else { 128 + libc::WTERMSIG(status) };
        if code != 0 && first_failure.is_none() {
            // Tasks rpmi-run killed itself are not news; the first failure still decides the status.
            if !job.ending.load(Ordering::SeqCst) {
                if libc::WIFSIGNALED(status) {
                    let sig = libc::WTERMSIG(status);
                    eprintln!("rpmi-run: rank {} was killed by signal {sig}; ending the job", task.rank);
                } else {
                    eprintln!("rpmi-run: rank {} exited with code {code}; ending the job", task.rank);
                }
                job.end(libc::SIGKILL);
            }
            first_failure = Some(code);
        }
        if let Ok(mut pids) = job.pids.lock() {
            pids.retain(|&p| p != pid);
        }
    }
    let abort = job.abort_code.lock().ok().and_then(|c| *c);
    let error = job.error_code.lock().ok().and_then(|c| *c);
    abort.or(first_failure).or(error).unwrap_or(0)
}

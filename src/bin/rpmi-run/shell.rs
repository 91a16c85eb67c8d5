//! One virtual node's job shell: creates the node's plugin instance, starts the node's tasks through it, and
//! reaps them. The whole of rpmi-run for a one-node job; a process of its own per node otherwise.

use crate::branch::Branch;
use crate::host::{Cause, ShellHost};
use crate::plugin::{call, Plugin};
use crate::services::Ended;
use crate::services::NodeLink;
use crate::{job, output, Plan};
use rpmi::abi::ffi::{self, rpmi_instance, rpmi_job_info, rpmi_keyval, rpmi_task_env};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};

/// A task of this node: its ranks and, once started, its process.
struct Task {
    rank: u32,
    local: u32,
    pid: libc::pid_t,
}

/// Runs node `index` of the job to its end, its tasks' services through `link`; returns how it ended (its
/// exit status: see `host::Fate::status`).
pub fn run(plan: &Plan, plugin: Plugin, index: usize, branch: Option<Branch>, link: Option<NodeLink>) -> Ended {
    let host: &'static ShellHost = Box::leak(Box::new(ShellHost::new(plugin, branch, link, plan.verbosity)));
    let local_ranks = &plan.cliques[index];
    let hostname_ptrs: Vec<*const std::ffi::c_char> = plan.hostnames.iter().map(|h| h.as_ptr()).collect();
    let preputs: Vec<rpmi_keyval> =
        plan.preputs.iter().map(|(k, v)| rpmi_keyval { key: k.as_ptr(), value: v.as_ptr() }).collect();
    let info = rpmi_job_info {
        struct_size: std::mem::size_of::<rpmi_job_info>() as u32,
        job_id: plan.job_id.as_ptr(),
        shell_index: index as u32,
        shell_count: plan.cliques.len() as u32,
        size: plan.task_map.len() as u32,
        task_map: plan.task_map.as_ptr(),
        local_ranks: local_ranks.as_ptr(),
        local_count: local_ranks.len() as u32,
        hostnames: hostname_ptrs.as_ptr(),
        options_json: plan.options.as_ptr(),
        appnum: 0,
        universe_size: plan.universe,
        spawned: plan.spawned.into(),
        appnums: plan.appnums.as_ptr(),
        preputs: preputs.as_ptr(),
        preput_count: preputs.len() as u32,
    };
    // A node with a branch is driven by the loop that serves its connections (see `Branch`).
    let event_loop = plan.event_loop || host.branch.is_some();
    let ops = host.ops(event_loop);
    let mut inst: *mut rpmi_instance = std::ptr::null_mut();
    let mut err = [0 as std::ffi::c_char; 512];
    if call!(plugin, create(&info, &ops, &mut inst, err.as_mut_ptr(), err.len())) != ffi::RPMI_OK {
        // SAFETY: create wrote a NUL-terminated message into err.
        let msg = unsafe { std::ffi::CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned();
        host.end_job(Cause::Failed(2), &format!("the plugin refused the job: {msg}"));
        return host.ended(&[]);
    }
    let _ = host.instance.set(inst as usize);
    let event_loop = event_loop.then(|| output::spawn_event_loop(host));
    if let Some(link) = &host.link {
        std::thread::spawn(move || {
            link.serve(|task, ok, text| host.answer(task, ok, text), |status| host.end_by_launch(status))
        });
    }

    // SIGINT and SIGTERM go to the tasks; the shell ends when they do. Behind a coordinator, which says so
    // itself, the signal comes from it.
    let alone = host.branch.is_none();
    let spawned_runs = plan.spawned_runs.clone();
    let signals = output::forward_signals(move |sig| {
        if alone {
            say!("got signal {sig}, passing it to every task");
        }
        host.end(sig);
        output::signal_each(&spawned_runs, sig);
    });
    let mut labels = plan.label.then(output::Labeler::new);

    // Each application's program as exec finds it (in its `path` and `wdir`, for a spawned one); one that
    // is not found fails as it is, when it is started.
    let programs: Vec<PathBuf> = plan
        .apps
        .iter()
        .map(|a| {
            job::resolve(&a.program[0], a.wdir.as_deref(), a.path.as_ref())
                .unwrap_or_else(|_| a.program[0].clone().into())
        })
        .collect();
    let mut tasks: Vec<Task> = Vec::with_capacity(local_ranks.len());
    for (local, &rank) in local_ranks.iter().enumerate() {
        if host.ending() {
            break;
        }
        let local = local as u32;
        let mut env = rpmi_task_env {
            struct_size: std::mem::size_of::<rpmi_task_env>() as u32,
            child_fd: -1,
            env_count: 0,
            env: std::ptr::null(),
        };
        if call!(plugin, task_init(inst, local, &mut env)) != ffi::RPMI_OK {
            host.end_job(Cause::Failed(1), &format!("the plugin could not set up rank {rank}"));
            break;
        }
        let appnum = plan.appnums[rank as usize] as usize;
        let app = &plan.apps[appnum];
        let mut cmd = Command::new(&programs[appnum]);
        cmd.arg0(&app.program[0]).args(&app.program[1..]);
        if let Some(wdir) = &app.wdir {
            cmd.current_dir(wdir);
        }
        if let Some(path) = &app.path {
            cmd.env("PATH", path);
        }
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
        let task_exec = plugin.table.task_exec;
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
        call!(plugin, task_forked(inst, local));
        match spawned {
            Ok(mut child) => {
                let pid = child.id() as libc::pid_t;
                if let Some(l) = labels.as_mut() {
                    l.add(rank, child.stdout.take(), child.stderr.take());
                }
                if let Ok(mut pids) = host.pids.lock() {
                    pids.push(pid);
                }
                tasks.push(Task { rank, local, pid });
            }
            Err(e) => {
                let why = format!("cannot start {}: {e}", app.program[0].to_string_lossy());
                host.end_job(Cause::Failed(127), &why);
                break;
            }
        }
    }
    if host.ending() {
        host.signal_all(libc::SIGKILL);
    }
    let output_thread = labels.map(output::Labeler::start);

    let exits = wait_for(host, &mut tasks);
    finish(host, event_loop);
    if let Some(t) = output_thread {
        let _ = t.join();
    }
    drop(signals);
    // After `finish`: an abort line served by destroy still decides the status.
    host.ended(&exits)
}

/// Stops the event loop, then destroys the instance, which serves what the tasks wrote last (an abort line,
/// which still reaches the coordinator); then this node says it is done to the tree.
fn finish(host: &ShellHost, event_loop: Option<output::EventLoop>) {
    if let Some(t) = event_loop {
        t.stop();
    }
    host.close_services();
    call!(host.plugin, destroy(host.instance()));
    if let Some(branch) = &host.branch {
        branch.finish(crate::branch::FINISH_GRACE, &|acts| host.carry_out(acts));
    }
}

/// Reaps every task; ends the job at the first that fails on its own. Returns each task's rank and code
/// (128+signal if it was killed), in the order they were reaped.
fn wait_for(host: &ShellHost, tasks: &mut [Task]) -> Vec<(u32, i32)> {
    let mut exits = Vec::with_capacity(tasks.len());
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
        call!(host.plugin, task_exit(host.instance(), task.local, status));
        if let Some(branch) = &host.branch {
            branch.send_left(task.rank);
        }
        let code = if libc::WIFEXITED(status) { libc::WEXITSTATUS(status) } else { 128 + libc::WTERMSIG(status) };
        // Tasks rpmi-run killed itself are not news.
        if code != 0 && !host.ending() {
            let why = if libc::WIFSIGNALED(status) {
                format!("rank {} was killed by signal {}; ending the job", task.rank, libc::WTERMSIG(status))
            } else {
                format!("rank {} exited with code {code}; ending the job", task.rank)
            };
            host.end_job(Cause::Failed(code), &why);
        }
        exits.push((task.rank, code));
        if let Ok(mut pids) = host.pids.lock() {
            pids.retain(|&p| p != pid);
        }
    }
    exits
}

//! The slurmstepd side: one [`Server`] per node serving the node's tasks, and the node's place in the
//! collective's tree ([`crate::collective::Node`]): a connection to srun for the step's control frames (srun
//! takes no part in an exchange: node 0 is the tree's top), one to its parent stepd, and one from each child
//! stepd.
//!
//! `mpi_p_slurmstepd_prefork` (before the tasks are forked, as root) makes the step's plan ([`plan`]): the
//! step's ids, this node's index and the step's shape from Slurm's step record, and from the environment
//! what srun's side of the plugin put there (the root's port, the secret, the task map, the job's options),
//! checked against the record; the job's options are held to mpi.conf's ceilings (`super::options`), and a
//! step that asks more is refused before any task exists: the stepd joins srun only to say why, so that
//! srun's user reads it. Then the node joins the tree ([`join`]); the joins block in prefork, before any task
//! exists, so they hold nobody's PMI answers, and the progress loop needs no timers for connecting and
//! retrying. Then the node runs on the [`crate::runtime`] runtime: one socketpair per local task and one
//! progress thread, whose host ([`host`]) serves the tree's connections beside the tasks' and carries out
//! what the node's watch ([`watch`]) decides.
//!
//! **Failures.** A lost child is reported to srun by the collective (LOST), and srun ends the step naming
//! it (node 0, the top, also fails the exchange in progress itself). A lost parent, like a lost srun, ends the
//! step from this node (and srun hears why, if it can).
//!
//! **Trust.** slurmstepd runs as root; the job's environment is the user's (a user's srun can put anything
//! in it). So the ids the plugin acts on (above all the step it asks slurmctld to end) come only from Slurm's
//! step record; an id in the environment that disagrees is ignored and logged. What the environment gives
//! (the task map, the node names, the root's port, the parent's port, the width, the bounds) only shapes the
//! user's own step.
//!
//! `mpi_p_slurmstepd_task` runs in each forked task child, a child of this multi-threaded process: it takes
//! no lock our threads may take, and allocates only inside Slurm's own environment setter (as Slurm itself
//! does in the child; glibc's malloc is usable after fork). It hands the task its end of the socketpair
//! (`PMI_FD`, close-on-exec cleared), closes every other task's end, and writes a notice into a pipe, even
//! when it fails. Slurm forks every task of the node before it lets any of them run, so the first notice
//! means every child holds its own end: the progress thread then closes the stepd's copies of all of them, and
//! a task that dies, even one that never reached the hook, is seen at once (EOF on the server end).

mod host;
mod join;
mod monitor;
mod plan;

use super::options::{Settings, ENV_MAP, ENV_OPTIONS, ENV_PORT, ENV_SECRET, ENV_SPAWN};
use super::records::{self, stepd_step_rec_t, RecordFromEnv, NO_VAL};
use super::sys::{self, getenvp};
use super::trace::Trace;
use super::version::TaskInfo;
use crate::collective::{self, Bounds};
use crate::os;
use crate::runtime::{EnvVar, JobVars, Looping, NodeRuntime};
use crate::server::Server;
use host::{SlurmHost, FINI_GRACE, NOTICE_FORKED, NOTICE_IDS_CONFIRMED};
use join::{address_of, join_tree, refuse, Wiring};
use monitor::NodeShape;
use plan::{Component, Record};
use std::ffi::{c_char, c_int, CString};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, IntoRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering::SeqCst};
use std::sync::Arc;

/// The step this process serves; set at prefork, read without a lock in the task children.
static STEPD: AtomicPtr<Stepd> = AtomicPtr::new(std::ptr::null_mut());

/// What the task children and `fini` need.
struct Stepd {
    /// The step's ids, from Slurm's step record, as Slurm passes them to the task hook (a heterogeneous job's
    /// leader).
    job: u32,
    step: u32,
    /// The rank of each local task, ascending; a task's index here is its [`crate::server::TaskId`].
    local_ranks: Vec<u32>,
    /// The node's tasks, their connections and the progress thread.
    node: NodeRuntime<SlurmHost>,
    /// Each task's PMI variables, prepared before the fork: the child only sets them.
    task_env: Vec<Vec<EnvVar>>,
    env_overwrite: sys::EnvOverwriteFmt,
    /// The write end of the fork-notice pipe (inherited by each child, close-on-exec).
    notify_w: RawFd,
    notify_r: RawFd,
    /// `fini` is running: the connections closing now is the normal end.
    stopping: Arc<AtomicBool>,
    /// A copy of the connection to srun, to cut it if the progress thread cannot say BYE in time.
    uplink: TcpStream,
}

fn cstring(s: String) -> CString {
    CString::new(s).unwrap_or_default()
}

/// The bounds of one exchange, within what this node's key-value store can take in anyway (a larger
/// exchange could not complete, and an interior node would hold it for nothing).
fn exchange_bounds(settings: &Settings) -> Bounds {
    let mut b = settings.bounds();
    let store = collective::Bound {
        bytes: settings.limits().kvs_bytes_max,
        option: "the most this slurmstepd's key-value store holds (SLURM_RPMI_KVS_BYTES_MAX, within mpi.conf's \
                 RpmiKvsBytesMax)",
    };
    for bound in [&mut b.part_max, &mut b.exchange_max] {
        if bound.bytes > store.bytes {
            *bound = store;
        }
    }
    b
}

/// `mpi_p_slurmstepd_prefork`.
///
/// # Safety
/// `job` is slurmstepd's step record and `env` the `char ***` Slurm passes: the step's environment, which
/// the tasks inherit.
pub unsafe fn prefork(job: *const stepd_step_rec_t, env: *mut *mut *mut c_char) -> Result<(), String> {
    let slurm = sys::slurm();
    if env.is_null() {
        return Err("no environment".into());
    }
    // SAFETY: Slurm's environment array, as the caller promises.
    let envp = unsafe { *env } as *const *const c_char;
    if !STEPD.load(SeqCst).is_null() {
        return Err("prefork called twice in one slurmstepd".into());
    }
    let record = job;
    // SAFETY: Slurm's step record, as the caller promises; only its leading fields are read.
    let r = unsafe { job.as_ref() }.ok_or("no step record")?;
    let task_job = match r.het_job_id {
        0 | NO_VAL => r.step_id.job_id,
        leader => leader,
    };
    let rec = Record {
        job: r.step_id.job_id,
        step: r.step_id.step_id,
        id: r.step_id,
        nodes: r.nnodes,
        tasks: r.ntasks,
        node: r.nodeid,
        node_tasks: r.node_tasks,
        task_job,
        in_hetjob: !matches!(r.het_job_id, 0 | NO_VAL),
        // SAFETY: `job` and `env` as Slurm passes them (the caller's contract).
        component: unsafe { component(r, record, env) }?,
    };
    // SAFETY: Slurm's environment array, as the caller promises.
    let read = |name: &str| unsafe { getenvp(envp, name) };
    let expand = |list: &str, max: usize| slurm.expand_nodelist(list, max);
    let Some(mut plan) = plan::plan(&rec, &read, &expand, &super::site())? else {
        slurm.info(&format!("{ENV_PORT} is not set: this step was not started by `srun --mpi=rpmi`; no PMI"));
        return Ok(());
    };
    let env_overwrite = slurm.env_overwrite_fmt.ok_or("slurm_env_array_overwrite_fmt is not in this process")?;
    for note in &plan.notes {
        slurm.info(note);
    }
    let (tree, node, width) = (plan.tree, plan.place.node, plan.tree.width());
    let wiring = Wiring { tree, allgather: plan.allgather, node };
    let addrs: Vec<_> = (plan.host.as_str(), plan.port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve srun's address {}: {e}", plan.host))?
        .collect();
    let address = |n: u32, what: &str| address_of(slurm, &plan.names[n as usize], what);
    let settings = match &plan.settings {
        Ok(s) => s.clone(),
        Err(why) => {
            let why = format!("the slurmstepd of {} refuses the step: {why}", plan.place.node_name);
            refuse(&addrs, wiring, &plan.secret, &address, &why);
            return Err(why);
        }
    };
    let bounds = exchange_bounds(&settings);
    let trace = match settings.trace() {
        true => Some(Trace::start(libc::STDERR_FILENO).map_err(|e| format!("cannot start the trace: {e}"))?),
        false => None,
    };
    let links = join_tree(&addrs, wiring, &plan.secret, &plan.names, &address)?;
    for line in &links.debug {
        slurm.log(log::Level::Debug, line);
    }
    let srun_copy = links.srun.try_clone().map_err(|e| format!("socket: {e}"))?;
    // SAFETY: `job` and `env` as Slurm passes them (the caller's contract).
    let info = plan::job_info(&mut plan, &read, || unsafe { multi_prog_config(record, env) })?;
    let spawned = info.spawned;
    let (place, names, local_ranks) = (plan.place, plan.names, plan.local_ranks);
    let limits = settings.limits();
    let mut server = Server::new(info, limits.clone()).map_err(|e| format!("cannot serve this step: {e}"))?;
    server.set_trace(trace.is_some());

    let (notify_r, notify_w) = os::pipe().map_err(|e| format!("pipe: {e}"))?;

    let stopping = Arc::new(AtomicBool::new(false));
    let notify_r_raw = notify_r.as_raw_fd();
    let spawned_ranks = spawned.then(|| local_ranks.iter().copied().collect());
    let allgather = plan.allgather;
    let traced = trace.is_some();
    let shape = NodeShape { place: place.clone(), names, tree, allgather, bounds, limits, spawned_ranks, traced };
    let host_side = SlurmHost::new(shape, links, slurm, trace, notify_r, stopping.clone())?;
    let job = JobVars { job_id: format!("{task_job}.{}", rec.step) };
    let mut node_rt =
        NodeRuntime::new(server, host_side, job).map_err(|e| format!("cannot set up the progress loop: {e}"))?;
    let child_ends = node_rt.child_ends();
    if let Some(h) = node_rt.host_mut() {
        h.child_ends = Some(child_ends);
    }
    let task_env = (0..local_ranks.len())
        .map(|t| node_rt.connect_task(t).map(|c| c.vars).map_err(|e| format!("cannot serve local task {t}: {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    node_rt.start(Looping::OwnThread).map_err(|e| e.to_string())?;

    let stepd = Box::into_raw(Box::new(Stepd {
        job: task_job,
        step: rec.step,
        local_ranks,
        node: node_rt,
        task_env,
        env_overwrite,
        notify_w: notify_w.into_raw_fd(),
        notify_r: notify_r_raw,
        stopping,
        uplink: srun_copy,
    }));
    // SAFETY: just made; freed only in `fini`.
    let shared: &'static Stepd = unsafe { &*stepd };
    STEPD.store(stepd, SeqCst);
    // What srun passed for the stepds only; the tasks get their PMI_* variables.
    for name in [ENV_SECRET, ENV_MAP, ENV_OPTIONS, ENV_SPAWN] {
        // SAFETY: Slurm's environment array, as the caller promises.
        unsafe { slurm.unsetenv(*env, &cstring(name.into())) };
    }
    let component = rec.component.as_ref().map_or(String::new(), |c| {
        format!(
            " (component {} of heterogeneous step {task_job}.{}, its ranks from {})",
            c.index, rec.step, c.task_offset
        )
    });
    slurm.log(
        log::Level::Debug,
        &format!(
            "serving {} local tasks of step {}.{}{component} on {} (node {node}, PMI tree width {width})",
            shared.local_ranks.len(),
            rec.job,
            rec.step,
            place.node_name,
        ),
    );
    Ok(())
}

/// The step record from its `env` field on. Slurm passes the address of the record's `env` field as `env`;
/// the fields after it ([`RecordFromEnv`]) are read only if that address lies within the record's first KiB
/// and the record's `jmgr_pid` there is this process's pid, as Slurm sets it before prefork.
///
/// # Safety
/// `job` is NULL or Slurm's step record, and `env` the address Slurm passes with it.
unsafe fn record_from_env<'a>(job: *const stepd_step_rec_t, env: *mut *mut *mut c_char) -> Option<&'a RecordFromEnv> {
    let (start, at) = (job as usize, env as usize);
    if job.is_null() || at <= start || at - start > 1024 || at % std::mem::align_of::<RecordFromEnv>() != 0 {
        return None;
    }
    let rec = env as *const RecordFromEnv;
    // SAFETY: within Slurm's step record (larger than these fields in every supported line), a plain integer;
    // `jmgr_pid` confirms the layout before anything else is used.
    let pid = unsafe { std::ptr::addr_of!((*rec).jmgr_pid).read() };
    // SAFETY: as above, confirmed.
    (pid == unsafe { libc::getpid() }).then(|| unsafe { &*rec })
}

/// A C string of Slurm's, if not NULL.
///
/// # Safety
/// `text` is NULL or a NUL-terminated string that lives for the call.
unsafe fn text_of(text: *const c_char) -> Option<String> {
    // SAFETY: the caller's contract.
    (!text.is_null()).then(|| unsafe { std::ffi::CStr::from_ptr(text) }.to_string_lossy().into_owned())
}

/// The text of the step's `srun --multi-prog` configuration, if it is such a step: the record's `argv[1]`
/// when its launch flags say so.
///
/// # Safety
/// `job` is NULL or Slurm's step record, and `env` the address Slurm passes with it.
unsafe fn multi_prog_config(job: *const stepd_step_rec_t, env: *mut *mut *mut c_char) -> Option<String> {
    // SAFETY: the caller's contract.
    let rec = unsafe { record_from_env(job, env) }?;
    if rec.flags & records::LAUNCH_MULTI_PROG == 0 || rec.argv.is_null() {
        return None;
    }
    // SAFETY: Slurm's argv, NULL-terminated: argv[1] is read only after argv[0] is not its end.
    unsafe { (!(*rec.argv).is_null()).then(|| text_of(*rec.argv.add(1))).flatten() }
}

/// This step's place in a heterogeneous step, if it is a component of one (`het_job_offset` an index among
/// its components): the whole step's shape from the record, and this node's name, which places it in the
/// merged layout.
///
/// # Safety
/// `r` is `job`, Slurm's step record, and `env` the address Slurm passes with it.
unsafe fn component(
    r: &stepd_step_rec_t,
    job: *const stepd_step_rec_t,
    env: *mut *mut *mut c_char,
) -> Result<Option<Component>, String> {
    // A step of one component that srun runs alone has a hetjob's leader but no component index.
    if r.het_job_step_cnt == NO_VAL || r.het_job_offset >= r.het_job_step_cnt {
        return Ok(None);
    }
    let unread = || "this slurmstepd's step record cannot be read: no heterogeneous step here".to_string();
    // SAFETY: the caller's contract.
    let rec = unsafe { record_from_env(job, env) }.ok_or_else(unread)?;
    // SAFETY: Slurm's strings in its step record (confirmed by `record_from_env`).
    let (node_name, node_list) = unsafe { (text_of(rec.node_name), text_of(r.het_job_node_list)) };
    let (Some(node_name), Some(node_list)) = (node_name, node_list) else { return Err(unread()) };
    Ok(Some(Component {
        index: r.het_job_offset,
        nodes: r.het_job_nnodes,
        tasks: r.het_job_ntasks,
        node_list,
        task_offset: r.het_job_task_offset,
        node_name,
    }))
}

/// Stops the progress thread and frees the step: the thread gets [`FINI_GRACE`] to say BYE, then the
/// connection is cut (so that a root that reads slowly cannot hold it) and it is joined.
fn free(stepd: Box<Stepd>) {
    stepd.stopping.store(true, SeqCst);
    let uplink = &stepd.uplink;
    stepd.node.stop(Some(FINI_GRACE), || {
        let _ = uplink.shutdown(std::net::Shutdown::Both);
    });
    let _ = stepd.uplink.shutdown(std::net::Shutdown::Both);
    // SAFETY: our fd, closed once.
    unsafe { libc::close(stepd.notify_w) };
}

/// `fini` in a slurmstepd: stops the threads (the progress thread says BYE to the root) and frees the step.
pub fn fini() {
    let p = STEPD.swap(std::ptr::null_mut(), SeqCst);
    if !p.is_null() {
        // SAFETY: the pointer prefork made, taken out of STEPD, so freed once; the reader that shares it is
        // joined before the box is dropped.
        free(unsafe { Box::from_raw(p) });
    }
}

/// `mpi_p_slurmstepd_task`, in the forked task child: no lock our threads take; Slurm's environment setter
/// is the only thing that allocates.
///
/// # Safety
/// Pointers as Slurm passes them.
pub unsafe fn task(info: *const TaskInfo, env: *mut *mut *mut c_char) -> c_int {
    let p = STEPD.load(SeqCst);
    if p.is_null() {
        // Not an rpmi step (see prefork): nothing to set.
        return records::SLURM_SUCCESS;
    }
    // SAFETY: set at prefork and freed only at fini, which this forked child never runs.
    let Some(stepd) = (unsafe { p.as_ref() }) else { return records::SLURM_ERROR };
    // SAFETY: Slurm's task info, as the caller promises.
    let info = unsafe { info.as_ref() };
    // Slurm fills the task info from the same step record prefork read: ids that differ mean the record was
    // not read as it is laid out, and nothing read from it can be trusted.
    let confirmed = info.is_some_and(|i| i.step_id.job_id == stepd.job && i.step_id.step_id == stepd.step);
    let rc = match info {
        // SAFETY: as above.
        Some(info) if confirmed => unsafe { set_up_task(stepd, info, env) },
        _ => records::SLURM_ERROR,
    };
    // Whatever happened, tell the stepd: every task is forked now (see the module's documentation), and
    // whether the ids are Slurm's.
    let notice = [if confirmed { NOTICE_IDS_CONFIRMED } else { NOTICE_FORKED }];
    // SAFETY: a one-byte write from a live buffer, and closes of fds this child inherited.
    unsafe {
        libc::write(stepd.notify_w, notice.as_ptr().cast(), 1);
        libc::close(stepd.notify_w);
        libc::close(stepd.notify_r);
    }
    rc
}

/// Hands the task its `PMI_FD` (closing the other tasks' ends) and its PMI variables.
///
/// # Safety
/// `env` as Slurm passes it to the task hook.
unsafe fn set_up_task(stepd: &Stepd, info: &TaskInfo, env: *mut *mut *mut c_char) -> c_int {
    let Ok(task) = stepd.local_ranks.binary_search(&info.gtaskid) else { return records::SLURM_ERROR };
    if stepd.node.exec_hook(task).is_err() {
        return records::SLURM_ERROR;
    }
    let set = |v: &EnvVar| {
        // SAFETY: Slurm's setter with a "%s" format and one NUL-terminated string.
        unsafe { (stepd.env_overwrite)(env, v.name.as_ptr(), c"%s".as_ptr(), v.value.as_ptr()) == 1 }
    };
    if stepd.task_env[task].iter().all(set) {
        records::SLURM_SUCCESS
    } else {
        records::SLURM_ERROR
    }
}

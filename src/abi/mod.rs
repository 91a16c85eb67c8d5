//! The job-shell plugin ABI (`plugin-spec/rpmi_plugin.h`): the table [`rpmi_plugin_entry`] returns, and the
//! instance behind it. The C types come from the header through bindgen (`build.rs`), so they cannot drift.
//!
//! Every function of the table validates its pointers and catches panics: nothing unwinds into the host,
//! and the host process is never aborted (it may be a root daemon serving other jobs).

mod c_host;
mod options;
mod owed;
pub mod root;
mod shells;

pub use c_host::{spawn_json, spawn_request};
pub use options::Options;

use crate::driver::Event;
use crate::runtime::{EnvVar, ExecError, JobVars, Looping, NodeError, NodeRuntime};
use crate::server::{JobInfo, NameOp, Server, TaskMap};
use c_host::{CHost, FromShell, ShellInbox};
use owed::OwedAnswers;
use std::ffi::{c_char, c_int, CStr};
use std::os::fd::{FromRawFd, OwnedFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;

/// The C types and constants of `plugin-spec/rpmi_plugin.h`.
#[allow(non_camel_case_types, non_upper_case_globals, non_snake_case, dead_code)]
pub mod ffi {
    include!(concat!(env!("OUT_DIR"), "/rpmi_plugin.rs"));
}

use ffi::{rpmi_buf, rpmi_host_ops, rpmi_instance, rpmi_job_info, rpmi_plugin, rpmi_task_env};

/// The plugin table; static for the life of the library.
struct Table(rpmi_plugin);
// SAFETY: the table is immutable; its one pointer is to a static string.
unsafe impl Sync for Table {}

static PLUGIN: Table = Table(rpmi_plugin {
    struct_size: std::mem::size_of::<rpmi_plugin>() as u32,
    abi_version: ffi::RPMI_ABI_VERSION as u32,
    version: concat!("rpmi ", env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast(),
    create: Some(create),
    task_init: Some(task_init),
    task_exec: Some(task_exec),
    task_forked: Some(task_forked),
    task_exit: Some(task_exit),
    progress: Some(progress),
    collective_complete: Some(collective_complete),
    service_complete: Some(service_complete),
    destroy: Some(destroy),
    abi_revision: ffi::RPMI_ABI_REVISION as u32,
    group_complete: Some(group_complete),
    task_env: Some(task_env),
    task_attach: Some(task_attach),
    shell_message: Some(shell_message),
    shell_lost: Some(shell_lost),
    serve_name: Some(serve_name),
});

/// The one symbol a host looks up (`dlsym(lib, "rpmi_plugin_entry")`).
#[no_mangle]
pub extern "C" fn rpmi_plugin_entry() -> *const rpmi_plugin {
    &PLUGIN.0
}

/// Longest accepted job id (the KVS name adds a 5-character prefix to it and must fit in 63).
const JOB_ID_MAX: usize = 48;
/// A job larger than this is taken for a corrupt `size`.
const SIZE_MAX: u32 = 1 << 24;

/// The environment strings `task_init` handed out for one task, kept until the task is forked.
#[derive(Default)]
struct TaskSlot {
    env: Vec<EnvVar>,
    /// The `NAME=value` pointers over `env`, as `rpmi_task_env.env` points at them.
    env_ptrs: Vec<*const c_char>,
}

/// One instance: the PMI server of one job shell.
struct Instance {
    node: NodeRuntime<CHost>,
    tasks: Mutex<Vec<TaskSlot>>,
    /// The answers the C host owes: `service_complete` comes on any thread and refuses there an answer
    /// nobody waits for.
    owed: OwedAnswers,
    /// The host's log callback and data, for the reasons behind error codes of later calls.
    log: ffi::rpmi_host_ops,
    /// Where the messages of other shells wait for the progress loop, when the plugin runs the exchanges
    /// among the shells (the host's `shell_send`).
    shell_inbox: Option<ShellInbox>,
    /// Shell 0 of a job whose names the plugin holds: it serves `serve_name`.
    holds_names: bool,
}

fn node_failure(e: NodeError) -> Failure {
    match e {
        NodeError::Invalid(m) => (ffi::RPMI_ERR_INVALID, m),
        NodeError::State(m) => (ffi::RPMI_ERR_STATE, m),
        NodeError::System(m) => (ffi::RPMI_ERR_SYSTEM, m),
    }
}

impl Instance {
    /// Tells the host why a call failed, on the calling thread before the call returns (plugin-spec/README.md,
    /// section 4: no other thread may be left to carry it): through its log callback, or on stderr without one.
    fn log_error(&self, message: &str) {
        match self.log.log {
            // SAFETY: the host's own callback and data, with a buffer that lives through the call.
            Some(f) => unsafe { f(self.log.host_data, ffi::RPMI_LOG_ERROR, message.as_ptr().cast(), message.len()) },
            None => eprintln!("rpmi: {message}"),
        }
    }
}

type Failure = (c_int, String);

fn fail<T>(code: c_int, msg: impl Into<String>) -> Result<T, Failure> {
    Err((code, msg.into()))
}

/// Runs an entry point, turning a panic into `RPMI_ERR_INTERNAL`.
fn guard(f: impl FnOnce() -> c_int) -> c_int {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        eprintln!("rpmi: internal error (panic) in a plugin call; the instance should be destroyed");
        ffi::RPMI_ERR_INTERNAL
    })
}

/// The instance behind a handle the host passes in.
///
/// # Safety
/// `p` is NULL or a pointer `create` returned and `destroy` has not freed.
unsafe fn instance<'a>(p: *mut rpmi_instance) -> Result<&'a Instance, Failure> {
    // SAFETY: the caller's contract: NULL, or a live `Instance` that `create` boxed.
    unsafe { (p as *const Instance).as_ref() }.ok_or((ffi::RPMI_ERR_INVALID, "NULL instance".into()))
}

/// Runs an entry point on a live instance: the pointer checked, panics caught, a failure's reason sent to
/// the host's log.
fn on_instance(inst: *mut rpmi_instance, f: impl FnOnce(&Instance) -> Result<(), Failure>) -> c_int {
    // SAFETY: as for every call, `inst` is NULL or a live instance.
    guard(|| code(inst, unsafe { instance(inst) }.and_then(f)))
}

/// The return code of a call on `inst`; a failure's reason goes to the host's log.
fn code(inst: *mut rpmi_instance, r: Result<(), Failure>) -> c_int {
    match r {
        Ok(()) => ffi::RPMI_OK,
        Err((code, msg)) => {
            // SAFETY: as for every call, `inst` is NULL or a live instance.
            match unsafe { instance(inst) } {
                Ok(i) => i.log_error(&msg),
                Err(_) => eprintln!("rpmi: {msg}"),
            }
            code
        }
    }
}

/// The size of revision 1's `rpmi_job_info`: a host built against it passes no more.
const JOB_INFO_REVISION_1: usize = std::mem::offset_of!(rpmi_job_info, appnums);

/// # Safety
/// `job` points to the host's `rpmi_job_info` of `job_size` bytes, at least revision 1's (the caller checks),
/// its pointers as `rpmi_job_info` documents. Nothing beyond `job_size` is read.
unsafe fn read_job(job: *const rpmi_job_info, job_size: usize) -> Result<(JobInfo, Options, String), Failure> {
    // Revision 2's fields are read only when the host's struct reaches them; else they stay NULL and 0.
    // SAFETY: all zeroes is a valid rpmi_job_info (integers and NULL pointers); the copy takes the host's
    // job_size bytes, which it has, and no more than ours.
    let mut copy: rpmi_job_info = unsafe { std::mem::zeroed() };
    let n = job_size.min(std::mem::size_of::<rpmi_job_info>());
    // SAFETY: n bytes are readable at `job` (the caller's contract) and fit in `copy`.
    unsafe { std::ptr::copy_nonoverlapping(job.cast::<u8>(), (&mut copy as *mut rpmi_job_info).cast::<u8>(), n) };
    // A field is read only if it lies wholly within struct_size: a size that ends inside one leaves it unset.
    let within = |offset: usize, size: usize| offset + size <= job_size;
    if !within(std::mem::offset_of!(rpmi_job_info, appnums), std::mem::size_of::<*const i32>()) {
        copy.appnums = std::ptr::null();
    }
    if !within(std::mem::offset_of!(rpmi_job_info, preputs), std::mem::size_of::<*const ffi::rpmi_keyval>()) {
        copy.preputs = std::ptr::null();
    }
    if !within(std::mem::offset_of!(rpmi_job_info, preput_count), std::mem::size_of::<u32>()) {
        copy.preput_count = 0;
    }
    let job = &copy;
    let invalid = |m: String| fail(ffi::RPMI_ERR_INVALID, m);
    if job.job_id.is_null() {
        return invalid("job_id is NULL".into());
    }
    // SAFETY: job_id is not NULL (checked above) and NUL-terminated, as rpmi_job_info documents.
    let job_id = unsafe { CStr::from_ptr(job.job_id) }.to_string_lossy().into_owned();
    if job_id.is_empty()
        || job_id.len() > JOB_ID_MAX
        || !job_id.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
    {
        return invalid(format!("job_id '{job_id}' must be 1 to {JOB_ID_MAX} letters, digits, '.', '_' or '-'"));
    }
    if job.size == 0 || job.size > SIZE_MAX {
        return invalid(format!("job size {} is out of range", job.size));
    }
    if job.shell_count == 0 || job.shell_index >= job.shell_count || job.shell_count > job.size {
        return invalid(format!("server {} of {} in a job of {} ranks", job.shell_index, job.shell_count, job.size));
    }
    if job.task_map.is_null() || job.hostnames.is_null() || (job.local_count > 0 && job.local_ranks.is_null()) {
        return invalid("task_map, hostnames or local_ranks is NULL".into());
    }
    // SAFETY: task_map is not NULL (checked above) and has `size` entries, as rpmi_job_info documents.
    let task_map = unsafe { std::slice::from_raw_parts(job.task_map, job.size as usize) }.to_vec();
    if let Some(r) = task_map.iter().position(|&n| n >= job.shell_count) {
        return invalid(format!("task_map puts rank {r} on server {}, of {}", task_map[r], job.shell_count));
    }
    let local_ranks = if job.local_count == 0 {
        Vec::new()
    } else {
        // SAFETY: local_ranks is not NULL when local_count > 0 (checked above) and has local_count entries.
        unsafe { std::slice::from_raw_parts(job.local_ranks, job.local_count as usize) }.to_vec()
    };
    if let Some(&r) = local_ranks.iter().find(|&&r| task_map.get(r as usize) != Some(&job.shell_index)) {
        return invalid(format!("local rank {r} is not on server {} in task_map", job.shell_index));
    }
    // A shell serves every rank the map puts on it, and at least one: a shell without tasks would never join
    // the collective and the others would wait for it.
    let here = task_map.iter().filter(|&&n| n == job.shell_index).count();
    if here == 0 || here != local_ranks.len() {
        return invalid(format!(
            "task_map puts {here} ranks on server {}, local_ranks lists {}",
            job.shell_index,
            local_ranks.len()
        ));
    }
    let mut hostnames = Vec::with_capacity(job.shell_count as usize);
    // SAFETY: hostnames is not NULL (checked above) and has shell_count entries, as rpmi_job_info documents.
    for &h in unsafe { std::slice::from_raw_parts(job.hostnames, job.shell_count as usize) } {
        if h.is_null() {
            return invalid("a hostname is NULL".into());
        }
        // SAFETY: not NULL (checked above), and NUL-terminated as rpmi_job_info documents.
        hostnames.push(unsafe { CStr::from_ptr(h) }.to_string_lossy().into_owned());
    }
    let options_json = if job.options_json.is_null() {
        None
    } else {
        // SAFETY: not NULL (checked above), and NUL-terminated as rpmi_job_info documents.
        Some(unsafe { CStr::from_ptr(job.options_json) }.to_string_lossy().into_owned())
    };
    let options = Options::parse(options_json.as_deref()).or_else(|m| fail(ffi::RPMI_ERR_OPTION, m))?;
    let appnums = if job.appnums.is_null() {
        vec![job.appnum; local_ranks.len()]
    } else {
        // SAFETY: not NULL (checked above), and `size` entries, as rpmi_job_info documents.
        let all = unsafe { std::slice::from_raw_parts(job.appnums, job.size as usize) };
        local_ranks.iter().map(|&r| all[r as usize]).collect()
    };
    // SAFETY: the preputs as rpmi_job_info documents them.
    let preputs = unsafe { read_preputs(job) }?;
    let mut info = JobInfo::new(format!("rpmi_{job_id}"), TaskMap::new(task_map), local_ranks, hostnames);
    if job.universe_size != 0 {
        info.universe_size = job.universe_size;
    }
    info.appnums = appnums;
    info.preputs = preputs;
    info.spawned = job.spawned != 0;
    Ok((info, options, job_id))
}

/// # Safety
/// `job.preputs` is NULL or points to `job.preput_count` pairs of NUL-terminated strings.
unsafe fn read_preputs(job: &rpmi_job_info) -> Result<crate::wire::Pairs, Failure> {
    if job.preput_count == 0 {
        return Ok(Vec::new());
    }
    // At most launch::PREPUTS_MAX (a spawn's request is bounded by `spawn_bytes_max` already).
    if job.preputs.is_null() || job.preput_count as usize > crate::launch::PREPUTS_MAX {
        return fail(ffi::RPMI_ERR_INVALID, format!("{} preputs at {:?}", job.preput_count, job.preputs));
    }
    // SAFETY: not NULL (checked above) with preput_count entries (the caller's contract).
    let pairs = unsafe { std::slice::from_raw_parts(job.preputs, job.preput_count as usize) };
    let mut preputs = Vec::with_capacity(pairs.len());
    for (i, pair) in pairs.iter().enumerate() {
        if pair.key.is_null() || pair.value.is_null() {
            return fail(ffi::RPMI_ERR_INVALID, format!("preput {i} has a NULL key or value"));
        }
        // SAFETY: not NULL (checked above), and NUL-terminated (the caller's contract).
        let (key, value) = unsafe { (CStr::from_ptr(pair.key), CStr::from_ptr(pair.value)) };
        preputs.push((key.to_bytes().to_vec(), value.to_bytes().to_vec()));
    }
    Ok(preputs)
}

impl Instance {
    /// # Safety
    /// Pointers as the header documents for `create`.
    unsafe fn create(job: *const rpmi_job_info, ops: *const rpmi_host_ops) -> Result<*mut rpmi_instance, Failure> {
        if job.is_null() || ops.is_null() {
            return fail(ffi::RPMI_ERR_INVALID, "job or ops is NULL");
        }
        // The host's table may be shorter than ours (an older host): nothing of it is read, not even through a
        // reference, beyond its struct_size, which is its first field in every version.
        // SAFETY: the caller's contract: `ops` is the host's table, valid for the call; struct_size is its
        // first field.
        let ops_size = unsafe { std::ptr::addr_of!((*ops).struct_size).read() } as usize;
        if ops_size < std::mem::offset_of!(rpmi_host_ops, log) {
            return fail(ffi::RPMI_ERR_VERSION, format!("rpmi_host_ops of {ops_size} bytes is too short"));
        }
        // Copy only the part of the host's table it has; the rest stays NULL (unsupported).
        // SAFETY: all zeroes is a valid rpmi_host_ops: integers, a NULL pointer and None callbacks.
        let mut ops_copy: rpmi_host_ops = unsafe { std::mem::zeroed() };
        let n = ops_size.min(std::mem::size_of::<rpmi_host_ops>());
        // SAFETY: n bytes fit in both tables: the host's is struct_size bytes long, ours size_of.
        unsafe {
            std::ptr::copy_nonoverlapping(ops.cast::<u8>(), (&mut ops_copy as *mut rpmi_host_ops).cast::<u8>(), n)
        };
        if ops_copy.abi_version != ffi::RPMI_ABI_VERSION as u32 {
            return fail(
                ffi::RPMI_ERR_VERSION,
                format!(
                    "the host was built for ABI version {}, this plugin is version {}",
                    ops_copy.abi_version,
                    ffi::RPMI_ABI_VERSION
                ),
            );
        }
        if (ops_copy.collective.is_none() && ops_copy.shell_send.is_none()) || ops_copy.abort.is_none() {
            return fail(ffi::RPMI_ERR_INVALID, "rpmi_host_ops needs its abort callback, and collective or shell_send");
        }
        // SAFETY: the caller's contract: `job` is the host's rpmi_job_info, valid for the call; struct_size
        // is its first field.
        let job_size = unsafe { std::ptr::addr_of!((*job).struct_size).read() } as usize;
        if job_size < JOB_INFO_REVISION_1 {
            return fail(ffi::RPMI_ERR_VERSION, format!("rpmi_job_info of {job_size} bytes is too short"));
        }
        // SAFETY: the caller's contract: job's pointers are as rpmi_job_info documents; its size is checked.
        let (info, options, job_id) = unsafe { read_job(job, job_size) }?;
        let n = info.local_ranks.len();
        let shells = match ops_copy.shell_send {
            Some(_) => Some(shell_net(&info, &options).or_else(|e| fail(ffi::RPMI_ERR_INVALID, e))?),
            None => None,
        };
        let shell_inbox = shells.as_ref().map(|(_, inbox)| inbox.clone());
        let own_names = ops_copy.publish.is_some() || ops_copy.unpublish.is_some() || ops_copy.lookup.is_some();
        let holds_names = !own_names && shells.as_ref().is_some_and(|(s, _)| s.holds_names());
        let mut server = Server::new(info, options.limits).or_else(|e| fail(ffi::RPMI_ERR_INVALID, e.to_string()))?;
        server.set_trace(options.trace);
        let owed = OwedAnswers::new(n);
        let host = CHost { ops: ops_copy, instance: std::ptr::null_mut(), owed: owed.clone(), shells };
        let node = NodeRuntime::new(server, host, JobVars { job_id })
            .or_else(|e| fail(ffi::RPMI_ERR_SYSTEM, format!("cannot set up the progress loop: {e}")))?;
        let instance = Box::into_raw(Box::new(Instance {
            node,
            tasks: Mutex::new((0..n).map(|_| TaskSlot::default()).collect()),
            owed,
            log: ops_copy,
            shell_inbox,
            holds_names,
        }));
        // SAFETY: the live box made above; the host cannot call on it before create returns.
        let inst = unsafe { &mut *instance };
        if let Some(host) = inst.node.host_mut() {
            host.instance = instance.cast();
        }
        let looping = if ops_copy.watch_fd.is_some() { Looping::HostLoop } else { Looping::OwnThread };
        let started = inst.node.start(looping).map_err(node_failure).and_then(|()| match ops_copy.watch_fd {
            // SAFETY: the host's own callback and data, called during create as the header allows.
            Some(watch) => match unsafe { watch(ops_copy.host_data, instance.cast(), inst.node.watch_fd()) } {
                ffi::RPMI_OK => Ok(()),
                rc => fail(ffi::RPMI_ERR_SYSTEM, format!("the host's watch_fd failed ({rc})")),
            },
            None => Ok(()),
        });
        if let Err(e) = started {
            // SAFETY: the box made above, freed once; create fails, so the host never uses it.
            drop(unsafe { Box::from_raw(instance) });
            return Err(e);
        }
        Ok(instance.cast())
    }
}

/// This shell's side of the exchanges among the job's shells, and the inbox of their messages, which holds at
/// most two exchanges' results and a MiB of other messages unread.
fn shell_net(info: &JobInfo, options: &Options) -> Result<(shells::Shells, ShellInbox), String> {
    let task_map = info.task_map.clone();
    let nodes = task_map.node_count() as u32;
    let tree = crate::collective::Tree::new(nodes, options.tree_width).map_err(|e| e.to_string())?;
    let bound = crate::collective::Bound { bytes: options.limits.kvs_bytes_max, option: "the option kvs_bytes_max" };
    let bounds = crate::collective::Bounds { part_max: bound, exchange_max: bound };
    let me = task_map.node_of(info.local_ranks[0]).unwrap_or(0);
    let all_max = crate::collective::frame::parts_len(nodes as usize, bound.bytes);
    let inbox = ShellInbox::new(all_max.saturating_mul(2).saturating_add(1 << 20));
    let net = shells::Shells::new(tree, options.allgather, me, bounds, task_map, info.local_ranks.len())?;
    Ok((net, inbox))
}

unsafe extern "C" fn create(
    job: *const rpmi_job_info,
    ops: *const rpmi_host_ops,
    out: *mut *mut rpmi_instance,
    err: *mut c_char,
    errlen: usize,
) -> c_int {
    guard(|| {
        let result = if out.is_null() {
            fail(ffi::RPMI_ERR_INVALID, "instance is NULL")
        } else {
            // SAFETY: the host's arguments, as the header documents for create.
            unsafe { Instance::create(job, ops) }
        };
        match result {
            Ok(inst) => {
                // SAFETY: `out` is not NULL (checked above): the host's place for the instance pointer.
                unsafe { *out = inst };
                ffi::RPMI_OK
            }
            Err((code, msg)) => {
                if !err.is_null() && errlen > 0 {
                    let n = msg.len().min(errlen - 1);
                    // SAFETY: `err` is not NULL and holds errlen bytes; n < errlen.
                    unsafe { std::ptr::copy_nonoverlapping(msg.as_ptr(), err.cast(), n) };
                    // SAFETY: n < errlen: the terminating NUL stays within `err`.
                    unsafe { *err.add(n) = 0 };
                }
                code
            }
        }
    })
}

unsafe extern "C" fn task_init(inst: *mut rpmi_instance, task: u32, env: *mut rpmi_task_env) -> c_int {
    // SAFETY: the caller's contract, as the header documents for task_init.
    on_instance(inst, |inst| unsafe { set_up_task(inst, task, env, NodeRuntime::connect_task) })
}

unsafe extern "C" fn task_env(inst: *mut rpmi_instance, task: u32, env: *mut rpmi_task_env) -> c_int {
    // SAFETY: the caller's contract, as the header documents for task_env.
    on_instance(inst, |inst| unsafe { set_up_task(inst, task, env, NodeRuntime::env_task) })
}

unsafe extern "C" fn task_attach(inst: *mut rpmi_instance, task: u32, fd: c_int) -> c_int {
    if fd < 0 {
        return on_instance(inst, |_| fail(ffi::RPMI_ERR_INVALID, "fd is negative"));
    }
    // SAFETY: the header's contract: the host hands over an open fd it owns, and uses it no more; from here
    // on it is closed exactly once, by the node or by this drop on failure.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    on_instance(inst, |inst| inst.node.attach_task(task as usize, fd).map_err(node_failure))
}

/// Makes task `task`'s connection with `connect` and fills the host's `env` with its environment.
///
/// # Safety
/// `env` is NULL or the host's `rpmi_task_env`, valid for the call, its struct_size set.
unsafe fn set_up_task(
    inst: &Instance,
    task: u32,
    env: *mut rpmi_task_env,
    connect: fn(&NodeRuntime<CHost>, usize) -> Result<crate::runtime::TaskEnv, NodeError>,
) -> Result<(), Failure> {
    if env.is_null() {
        return fail(ffi::RPMI_ERR_INVALID, "env is NULL");
    }
    // SAFETY: the caller's contract: `env` is the host's rpmi_task_env, valid for the call; struct_size is
    // its first field, read before any reference to the whole is made.
    if (unsafe { std::ptr::addr_of!((*env).struct_size).read() } as usize) < std::mem::size_of::<rpmi_task_env>() {
        return fail(ffi::RPMI_ERR_VERSION, "rpmi_task_env is too short");
    }
    // SAFETY: as above, and at least as long as our rpmi_task_env (checked).
    let env = unsafe { &mut *env };
    let mut tasks = inst.tasks.lock().or_else(|_| fail(ffi::RPMI_ERR_INTERNAL, "task table poisoned"))?;
    let connection = connect(&inst.node, task as usize).map_err(node_failure)?;
    let slot = &mut tasks[task as usize];
    slot.env = connection.vars;
    slot.env_ptrs = slot.env.iter().map(|v| v.entry.as_ptr()).collect();
    env.child_fd = connection.child_fd;
    env.env_count = slot.env_ptrs.len();
    env.env = slot.env_ptrs.as_ptr();
    Ok(())
}

/// In the forked child: async-signal-safe only (no allocation, no lock, no panic path).
unsafe extern "C" fn task_exec(inst: *mut rpmi_instance, task: u32) -> c_int {
    // SAFETY: the caller's contract: NULL, or a live instance (in the child, the forked copy of it).
    let Some(inst) = (unsafe { (inst as *const Instance).as_ref() }) else { return ffi::RPMI_ERR_INVALID };
    match inst.node.exec_hook(task as usize) {
        Ok(_) => ffi::RPMI_OK,
        Err(ExecError::NoTask) => ffi::RPMI_ERR_INVALID,
        Err(ExecError::NoEnd) => ffi::RPMI_ERR_STATE,
        Err(ExecError::System) => ffi::RPMI_ERR_SYSTEM,
    }
}

/// Closes the host's copy of the task's end and frees its environment strings.
fn release_child(inst: &Instance, task: u32) -> Result<(), Failure> {
    let mut tasks = inst.tasks.lock().or_else(|_| fail(ffi::RPMI_ERR_INTERNAL, "task table poisoned"))?;
    inst.node.forked(task as usize).map_err(node_failure)?;
    tasks[task as usize] = TaskSlot::default();
    Ok(())
}

unsafe extern "C" fn task_forked(inst: *mut rpmi_instance, task: u32) -> c_int {
    on_instance(inst, |i| release_child(i, task))
}

unsafe extern "C" fn task_exit(inst: *mut rpmi_instance, task: u32, _status: c_int) -> c_int {
    // The engine learns that the task left from its connection closing; the status is the host's business. A
    // task whose connection the host was to make and never handed over is served one closed at once.
    on_instance(inst, |i| {
        release_child(i, task)?;
        i.node.abandon(task as usize).map_err(node_failure)
    })
}

unsafe extern "C" fn progress(inst: *mut rpmi_instance) -> c_int {
    on_instance(inst, |i| i.node.progress().map_err(node_failure))
}

unsafe extern "C" fn collective_complete(
    inst: *mut rpmi_instance,
    status: c_int,
    parts: *const rpmi_buf,
    nparts: usize,
    error: *const c_char,
) -> c_int {
    on_instance(inst, |inst| {
        // SAFETY: the caller's contract, as for `exchange_result`.
        let result = unsafe { exchange_result(status, parts, nparts, error) }?;
        post(inst, Event::CollectiveDone(result))
    })
}

unsafe extern "C" fn group_complete(
    inst: *mut rpmi_instance,
    id: *const u8,
    id_len: usize,
    status: c_int,
    parts: *const rpmi_buf,
    nparts: usize,
    error: *const c_char,
) -> c_int {
    on_instance(inst, |inst| {
        if id.is_null() || id_len == 0 || id_len > crate::server::GROUP_ID_MAX {
            return fail(ffi::RPMI_ERR_INVALID, "id is NULL, empty, or longer than a group exchange's");
        }
        // SAFETY: not NULL (checked above): the host's `id_len` bytes, borrowed for the call.
        let id = unsafe { std::slice::from_raw_parts(id, id_len) }.to_vec();
        // SAFETY: the caller's contract, as for `exchange_result`.
        let result = unsafe { exchange_result(status, parts, nparts, error) }?;
        post(inst, Event::GroupDone { id, result })
    })
}

unsafe extern "C" fn shell_message(
    inst: *mut rpmi_instance,
    from: u32,
    kind: u8,
    message: *const u8,
    len: usize,
) -> c_int {
    on_instance(inst, |inst| {
        if message.is_null() && len > 0 {
            return fail(ffi::RPMI_ERR_INVALID, "message is NULL");
        }
        let message = match len {
            0 => Vec::new(),
            // SAFETY: not NULL (checked above): the host's `len` bytes, borrowed for the call.
            _ => unsafe { std::slice::from_raw_parts(message, len) }.to_vec(),
        };
        to_shells(inst, FromShell::Message { from, kind, message })
    })
}

unsafe extern "C" fn shell_lost(inst: *mut rpmi_instance, shell: u32) -> c_int {
    on_instance(inst, |inst| to_shells(inst, FromShell::Lost(shell)))
}

unsafe extern "C" fn serve_name(
    inst: *mut rpmi_instance,
    request: u64,
    op: c_int,
    service: *const c_char,
    port: *const c_char,
) -> c_int {
    on_instance(inst, |inst| {
        if !inst.holds_names {
            return fail(ffi::RPMI_ERR_STATE, "this instance holds no names: not shell 0, or its host serves names");
        }
        let op = [NameOp::Publish, NameOp::Unpublish, NameOp::Lookup]
            .into_iter()
            .find(|o| *o as c_int == op)
            .ok_or_else(|| (ffi::RPMI_ERR_INVALID, format!("no request of the name service is numbered {op}")))?;
        // SAFETY (both): NULL, or NUL-terminated strings borrowed for the call, as the header documents.
        let word = |p: *const c_char, what: &str| match p.is_null() {
            true => fail(ffi::RPMI_ERR_INVALID, format!("{what} is NULL")),
            false => Ok(unsafe { CStr::from_ptr(p) }.to_bytes()),
        };
        let name = word(service, "service")?;
        let port = match op {
            NameOp::Publish => word(port, "port")?,
            _ => &[],
        };
        for (what, w) in [("service", name), ("port", port)] {
            if w.len() > shells::NAME_MAX || (!w.is_empty() && !crate::server::kvs::is_key(w)) {
                return fail(ffi::RPMI_ERR_INVALID, format!("the {what} is no RFC 13 word of at most 1024 bytes"));
            }
        }
        if name.is_empty() || (op == NameOp::Publish && port.is_empty()) {
            return fail(ffi::RPMI_ERR_INVALID, "an empty service or port");
        }
        let (name, port) = (String::from_utf8_lossy(name).into_owned(), String::from_utf8_lossy(port).into_owned());
        match to_shells(inst, FromShell::Name { request, op, name, port }) {
            Err((ffi::RPMI_ERR_STATE, _)) => fail(ffi::RPMI_ERR_STATE, "too many requests of the name service wait"),
            r => r,
        }
    })
}

/// Hands the exchanges among the shells what the host brought from another shell.
fn to_shells(inst: &Instance, item: FromShell) -> Result<(), Failure> {
    let Some(inbox) = &inst.shell_inbox else {
        return fail(ffi::RPMI_ERR_STATE, "this instance's host gave no shell_send: it runs the exchanges itself");
    };
    let kept = inbox.push(item);
    post(inst, Event::HostWork)?;
    match kept {
        true => Ok(()),
        false => fail(ffi::RPMI_ERR_STATE, "more messages from that shell than the instance holds unread"),
    }
}

/// Hands `event` to the instance's progress loop.
fn post(inst: &Instance, event: Event) -> Result<(), Failure> {
    inst.node.handle().post(event).or_else(|_| fail(ffi::RPMI_ERR_STATE, "instance stopped"))
}

/// An exchange's completion as a C host gives it, copied: every part, or why it failed.
///
/// # Safety
/// As the header documents for `collective_complete`: `parts` holds `nparts` buffers and `error` is NULL or
/// NUL-terminated, all valid for the call.
unsafe fn exchange_result(
    status: c_int,
    parts: *const rpmi_buf,
    nparts: usize,
    error: *const c_char,
) -> Result<Result<Vec<Vec<u8>>, String>, Failure> {
    if status != ffi::RPMI_OK {
        return Ok(Err(if error.is_null() {
            format!("the resource manager's exchange failed ({status})")
        } else {
            // SAFETY: not NULL (checked above), and NUL-terminated as the header documents.
            unsafe { CStr::from_ptr(error) }.to_string_lossy().into_owned()
        }));
    }
    if parts.is_null() && nparts > 0 {
        return fail(ffi::RPMI_ERR_INVALID, "parts is NULL");
    }
    let parts = if nparts == 0 {
        &[][..]
    } else {
        // SAFETY: not NULL (checked above); the host's `nparts` buffers, borrowed for the call.
        unsafe { std::slice::from_raw_parts(parts, nparts) }
    };
    let mut all = Vec::with_capacity(parts.len());
    for p in parts {
        if p.data.is_null() && p.len > 0 {
            return fail(ffi::RPMI_ERR_INVALID, "a part's data is NULL");
        }
        all.push(if p.len == 0 {
            Vec::new()
        } else {
            // SAFETY: data is not NULL (checked above) and holds len bytes, borrowed for the call.
            unsafe { std::slice::from_raw_parts(p.data, p.len) }.to_vec()
        });
    }
    Ok(Ok(all))
}

unsafe extern "C" fn service_complete(
    inst: *mut rpmi_instance,
    task: u32,
    status: c_int,
    result: *const c_char,
) -> c_int {
    on_instance(inst, |inst| {
        let task = task as usize;
        if task >= inst.node.task_count() {
            return fail(ffi::RPMI_ERR_INVALID, format!("no local task {task}"));
        }
        // Claimed here, on the caller's thread, so that the caller learns at once that nothing was owed;
        // the engine reads the answer by the service the task waits for, on its own thread.
        if !inst.owed.claim(task) {
            return fail(ffi::RPMI_ERR_STATE, format!("task {task} has no request waiting"));
        }
        // SAFETY: only when not NULL; NUL-terminated as the header documents.
        let text = (!result.is_null()).then(|| unsafe { CStr::from_ptr(result) }.to_string_lossy().into_owned());
        post(inst, Event::UntypedReply { task, ok: status == ffi::RPMI_OK, text })
    })
}

unsafe extern "C" fn destroy(inst: *mut rpmi_instance) {
    guard(|| {
        if inst.is_null() {
            return ffi::RPMI_ERR_INVALID;
        }
        // SAFETY: not NULL (checked above): the box `create` made, live until freed below. It is only borrowed
        // shared meanwhile, as the host's callbacks during the stop, which may call on it, borrow it too.
        let shared = unsafe { &*(inst as *const Instance) };
        // The node takes the stop after serving what the tasks wrote before they left (an abort line, say): on
        // its progress thread, or here, in event-loop mode, where the host has stopped calling progress.
        shared.node.stop(None, || {});
        // SAFETY: the box `create` made; no call on it runs after the stop (the host's contract), so it is freed
        // once.
        drop(unsafe { Box::from_raw(inst as *mut Instance) });
        ffi::RPMI_OK
    });
}

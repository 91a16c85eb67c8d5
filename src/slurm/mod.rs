//! Slurm's `mpi/rpmi` plugin: `srun --mpi=rpmi ./app` (feature `slurm`; the same librpmi.so, installed as
//! `<PluginDir>/mpi_rpmi.so` by `docker/install-slurm-plugin.sh`).
//!
//! ```text
//!  srun                                   slurmstepd (one per node)                    tasks
//!  client_prelaunch:                      slurmstepd_prefork:
//!    task map from step_layout              step ids and node index from Slurm's step
//!    secret (32 random bytes)               record; RPMI_SLURM_* from the environment;
//!    root thread: TCP listener  <-------    with children: listen on its own address;
//!    env RPMI_SLURM_PORT/SECRET/MAP/        join srun (challenge-response), then, told
//!        OPTIONS                            where (PARENT), its parent stepd; Server,
//!                                           socketpair per task, one progress thread
//!  root: the collective's root machine    slurmstepd_task (forked child):      PMI_FD PMI_RANK
//!        over a k-ary tree of stepds:       PMI_FD, PMI_RANK, PMI_SIZE,  ----> PMI_SIZE PMI_JOBID
//!        CONTRIB up, one ALL down           PMI_JOBID; close other tasks' ends
//!        abort / error / lost node:
//!        print on srun's stderr,
//!        slurm_kill_job_step(SIGKILL)
//!  client_fini: stop root; exit code of a PMI_Abort
//! ```
//!
//! The plugin's own protocol between srun and the stepds is rpmi-core's `slurm::protocol` and its
//! challenge-response `slurm::auth`; the accepting side of it, shared by srun and a stepd with children, in `admit`, the joining side
//! in `uplink`; a connection served in an epoll loop in `link`; the root in `root`, and the steps it starts
//! for `PMI_Spawn` in `spawn`; a `--multi-prog` step's appnums in `mpmd`; the stepd side in
//! `stepd`; srun's side in `client`; the options (mpi.conf's and the job's) in `options`; the layout
//! encoding in `layout`; Slurm's types and functions in `sys`;
//! the wire trace in `trace`. The exchange itself is [`crate::collective`]'s. The plugin is not linked
//! against libslurm: it finds the `slurm_*` functions it needs in the process that loads it (srun, slurmd
//! and slurmstepd carry libslurmfull).
//!
//! Every exported function catches panics and returns an error code: nothing unwinds into Slurm and the
//! daemon is never aborted.

// The handshake and the frames between slurmstepds and srun do no I/O: they are rpmi-core's.
use rpmi_core::slurm::{auth, protocol};

mod admit;
mod client;
mod layout;
mod link;
mod mpmd;
mod options;
mod random;
mod records;
mod root;
mod spawn;
mod stepd;
mod sys;
mod trace;
mod uplink;
mod version;

use options::{Id, Site};
use records::{StepInfo, SLURM_ERROR, SLURM_SUCCESS};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;
use version::{ConfOption, TaskInfo};

/// Slurm's plugin identification, read with `dlsym`: NUL-terminated arrays and `uint32_t`s.
#[no_mangle]
pub static plugin_name: [u8; 26] = *b"rpmi: PMI server for srun\0";
#[no_mangle]
pub static plugin_type: [u8; 9] = *b"mpi/rpmi\0";
/// "RPMI" in ASCII: unique, neither 0 nor `NO_VAL` (which Slurm refuses since 24.11), and clear of the ids
/// Slurm gives its own MPI plugins (101 to 108).
#[no_mangle]
pub static plugin_id: u32 = 0x5250_4d49;
/// Must equal the running Slurm's `SLURM_VERSION_NUMBER`, micro number included: the plugin is tied to the
/// Slurm it was built against (`<slurm/slurm_version.h>` at build time).
#[no_mangle]
pub static plugin_version: u32 = records::SLURM_VERSION_NUMBER;

/// Runs an entry point; a panic becomes `on_panic` and a line in Slurm's log.
fn guard<T>(on_panic: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        let _ = catch_unwind(|| sys::slurm().error("internal error (panic) in the mpi/rpmi plugin"));
        on_panic
    })
}

/// Logs a failure and turns it into Slurm's error code.
fn code(result: Result<(), String>) -> c_int {
    match result {
        Ok(()) => SLURM_SUCCESS,
        Err(e) => {
            sys::slurm().error(&e);
            SLURM_ERROR
        }
    }
}

/// Called when Slurm loads the plugin (slurmctld and slurmd load every MPI plugin: keep it cheap).
#[no_mangle]
pub extern "C" fn init() -> c_int {
    guard(SLURM_ERROR, || {
        // Find Slurm's functions now, before any fork.
        let slurm = sys::slurm();
        if sys::in_slurmstepd() && slurm.quiet_mpi_debug() {
            slurm.info(
                "DebugFlags=MPI is off in this slurmstepd: Slurm would log the step's environment, which carries \
                 the secret that admits its nodes to the step",
            );
        }
        SLURM_SUCCESS
    })
}

/// Called before Slurm unloads the plugin: stops every thread the plugin started in this process.
#[no_mangle]
pub extern "C" fn fini() {
    guard((), || {
        stepd::fini();
        client::stop_all();
        // Slurm unloads the plugin at a reconfigure, and a static's contents are never dropped.
        *SITE.lock().unwrap_or_else(|e| e.into_inner()) = Site::EMPTY;
        *MISNAMED.lock().unwrap_or_else(|e| e.into_inner()) = Vec::new();
    })
}

/// srun, before the launch.
///
/// # Safety
/// Pointers as srun passes them.
#[no_mangle]
pub unsafe extern "C" fn mpi_p_client_prelaunch(job: *const StepInfo, env: *mut *mut *mut c_char) -> *mut c_void {
    // SAFETY: srun's pointers, as the caller's contract says.
    guard(std::ptr::null_mut(), || match unsafe { client::prelaunch(job, env) } {
        Ok(state) => state,
        Err(e) => {
            sys::slurm().error(&e);
            std::ptr::null_mut()
        }
    })
}

/// srun, after the step: its return value becomes srun's exit code when non-zero.
///
/// # Safety
/// `state` is what `mpi_p_client_prelaunch` returned.
#[no_mangle]
pub unsafe extern "C" fn mpi_p_client_fini(state: *mut c_void) -> c_int {
    // SAFETY: srun gives back what `mpi_p_client_prelaunch` returned.
    guard(0, || unsafe { client::fini(state) })
}

/// slurmstepd, before it forks the tasks (as root).
///
/// # Safety
/// `job` is slurmstepd's step record and `env` the step's environment, as Slurm passes them.
#[no_mangle]
pub unsafe extern "C" fn mpi_p_slurmstepd_prefork(
    job: *const records::stepd_step_rec_t,
    env: *mut *mut *mut c_char,
) -> c_int {
    // SAFETY: slurmstepd's step record and environment, as the caller's contract says.
    guard(SLURM_ERROR, || code(unsafe { stepd::prefork(job, env) }))
}

/// In each forked task child, before exec (as the job's user).
///
/// # Safety
/// Pointers as Slurm passes them.
#[no_mangle]
pub unsafe extern "C" fn mpi_p_slurmstepd_task(job: *const TaskInfo, env: *mut *mut *mut c_char) -> c_int {
    // SAFETY: Slurm's pointers for this task, as the caller's contract says.
    guard(SLURM_ERROR, || unsafe { stepd::task(job, env) })
}

/// The plugin's mpi.conf options (every one `S_P_STRING`: the plugin reads the values itself, with the same
/// checks as the job's variables, see [`options`]), ending with a NULL key (Slurm copies them).
struct ConfOptions([ConfOption; options::OPTIONS.len() + 1]);

// SAFETY: only constant pointers to static strings, never written.
unsafe impl Sync for ConfOptions {}

static CONF_OPTIONS: ConfOptions = ConfOptions(conf_options());

const fn conf_options() -> [ConfOption; options::OPTIONS.len() + 1] {
    let mut all = [const { ConfOption::new(std::ptr::null(), 0) }; options::OPTIONS.len() + 1];
    let mut i = 0;
    while i < options::OPTIONS.len() {
        all[i] = ConfOption::new(options::OPTIONS[i].key.as_ptr(), sys::S_P_STRING);
        i += 1;
    }
    all
}

/// mpi.conf's options, as Slurm handed them to this process: slurmctld and slurmd read mpi.conf, and slurmd
/// passes each stepd what [`mpi_p_conf_get`] gives; srun never sees them.
static SITE: Mutex<Site> = Mutex::new(Site::EMPTY);

/// mpi.conf's options in this process.
fn site() -> Site {
    SITE.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// slurmctld and slurmd ask which options the plugin takes from mpi.conf.
///
/// # Safety
/// Pointers as Slurm passes them.
#[no_mangle]
pub unsafe extern "C" fn mpi_p_conf_options(full_options: *mut *mut ConfOption, full_opt_cnt: *mut c_int) {
    guard((), || {
        let slurm = sys::slurm();
        // Asked only where mpi.conf is read, before it is: the keys Slurm will skip are said now.
        let misnamed = slurm.extra_conf(c"mpi.conf").map(|text| options::misnamed_keys(&text)).unwrap_or_default();
        for key in &misnamed {
            slurm.error(&format!("mpi.conf: {key} is {}", options::misnamed()));
        }
        *MISNAMED.lock().unwrap_or_else(|e| e.into_inner()) = misnamed;
        // SAFETY: Slurm's pointers, and our static options.
        unsafe { slurm.add_conf_options(full_options, CONF_OPTIONS.0.as_ptr(), full_opt_cnt) }
    })
}

/// Keys in mpi.conf that look like the plugin's but are not (see [`options::misnamed_keys`]).
static MISNAMED: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// The options mpi.conf gave (slurmctld, slurmd: at start), or that slurmd passed on (slurmstepd). A value
/// that is not one is said here, in the daemon's log, and refuses every step (see `options::resolve`).
///
/// # Safety
/// `tbl` is NULL or the table Slurm passes.
#[no_mangle]
pub unsafe extern "C" fn mpi_p_conf_set(tbl: *mut c_void) {
    guard((), || {
        let mut site = Site::default();
        for id in Id::ALL {
            // SAFETY: Slurm's table, as the caller's contract says.
            if let Some(text) = unsafe { sys::slurm().conf_string(tbl, id.opt().key) } {
                site.set(id, text);
            }
        }
        for fault in site.faults() {
            sys::slurm().error(&format!("{fault}: mpi/rpmi refuses every step until it is mended"));
        }
        *SITE.lock().unwrap_or_else(|e| e.into_inner()) = site;
    })
}

/// The options to pass on to each slurmstepd, as mpi.conf wrote them, in a table Slurm packs and frees; NULL
/// if mpi.conf set none.
#[no_mangle]
pub extern "C" fn mpi_p_conf_get() -> *mut c_void {
    guard(std::ptr::null_mut(), || {
        let site = site();
        let pairs: Vec<(&CStr, CString)> = Id::ALL
            .into_iter()
            .filter_map(|id| site.passed_on(id).map(|t| (id.opt().key, CString::new(t).unwrap_or_default())))
            .collect();
        if pairs.is_empty() {
            return std::ptr::null_mut();
        }
        // SAFETY: our static options and NUL-terminated strings.
        unsafe { sys::slurm().conf_table(CONF_OPTIONS.0.as_ptr(), &pairs) }
    })
}

/// What `scontrol show config` prints under "MPI Plugins Configuration" (slurmctld asks): every option as
/// this site sets it, and the misnamed keys, in a list Slurm frees.
#[no_mangle]
pub extern "C" fn mpi_p_conf_get_printable() -> *mut c_void {
    guard(std::ptr::null_mut(), || {
        let mut lines = site().printable();
        let misnamed = MISNAMED.lock().unwrap_or_else(|e| e.into_inner()).clone();
        lines.extend(misnamed.into_iter().map(|key| (key, options::misnamed())));
        sys::slurm().key_pairs(&lines)
    })
}

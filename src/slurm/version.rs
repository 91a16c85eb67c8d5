//! What differs between the Slurm release lines the plugin supports, chosen when it is built: `build.rs`
//! reads `SLURM_VERSION_NUMBER` from the headers the build is pointed at (`SLURM_INCLUDE_DIR`, else
//! `pkg-config slurm`, else `/usr/include`), looks the line up in its `SLURM_LINES` and sets one cfg per
//! choice; a line not there fails the build, naming what to read in that release's sources.
//!
//! Slurm's MPI plugin interface is the same nine symbols in every supported line, but Slurm hands the plugin
//! private structs (not installed with its headers) whose layout moved, and two functions it calls changed
//! their arguments. Each difference is its own choice (read from each release's sources at its latest tag):
//!
//! | choice (cfg) | what | 22.05 | 23.11 | 24.05 | 24.11 | 25.05 | 25.11 | 26.05 |
//! |---|---|---|---|---|---|---|---|---|
//! | `slurm_sluid` | `slurm_step_id_t` (public) begins with the job's `sluid`: 24 bytes, not 12 | | | | yes | yes | yes | yes |
//! | `slurm_task_self` | the task info (`mpi_p_slurmstepd_task`) has a `self` pointer | yes | | | | | | |
//! | `slurm_conf_pack` | mpi.conf's option struct (`s_p_options_t`) has `pack` and `unpack` | | yes | yes | yes | yes | yes | yes |
//! | `slurm_kill` | `slurm_kill_job_step` takes `(job, step, signal)`: `ids`; and `flags`: `ids_flags`; `(slurm_step_id_t *, signal, flags)`: `step_id` | `ids` | `ids_flags` | `ids_flags` | `ids_flags` | `ids_flags` | `step_id` | `step_id` |
//! | `slurm_io` | the step record's I/O thread: `ioid`, or `io_running` with its condition and mutex | `ioid` | `io_running` | `io_running` | `io_running` | `io_running` | `io_running` | `io_running` |
//! | `slurm_run_prolog` | the step record still has `run_prolog` | yes | yes | yes | yes | yes | yes | |
//! | `slurm_node_list` | the step record has the job's `node_addrs` and `node_list` before the heterogeneous step's fields | | yes | yes | yes | yes | yes | yes |
//! | `slurm_het_step_tasks` | the step record has `het_job_step_task_cnts` before `het_job_task_offset` | | | | | yes | yes | yes |
//! | `slurm_load_job_step_id` | `slurm_load_job` takes the job's `slurm_step_id_t` by value, not its number | | | | | | | yes |
//!
//! 23.02 (out of SchedMD's support) mixes 22.05's task info and kill call with the newer option struct and
//! step record, and changed the record within the line (at 23.02.1): it is not supported.
//!
//! The step record's and srun's step info's fields are the same in every line; their offsets follow from
//! `slurm_step_id_t`'s size, which bindgen takes from the headers. They are declared once in
//! [`super::records`], and the offsets each line's sources give are asserted below, so a layout that
//! disagrees fails the build instead of reading the wrong bytes. `plugin_version` comes from the same
//! header, and Slurm loads only a plugin of its own exact version.

use super::records::{job_info_msg_t, slurm_step_id_t, stepd_step_rec_t, StepInfo};
use std::ffi::{c_char, c_int, c_void};
use std::mem::{offset_of, size_of};

/// What the task child passes to `mpi_p_slurmstepd_task`: `mpi_plugin_task_info_t` in 22.05
/// (`src/common/slurm_mpi.h`), `mpi_task_info_t` since (`src/interfaces/mpi.h`).
#[repr(C)]
pub struct TaskInfo {
    pub client: *const c_void,
    /// The task's global rank.
    pub gtaskid: u32,
    pub ltaskid: c_int,
    pub ltasks: u32,
    pub nnodes: u32,
    pub nodeid: u32,
    pub ntasks: u32,
    #[cfg(slurm_task_self)]
    self_: *const c_void,
    pub step_id: slurm_step_id_t,
}

/// `s_p_options_t` (`src/common/parse_config.h`): one option a plugin takes from mpi.conf.
#[repr(C)]
pub struct ConfOption {
    key: *const c_char,
    /// `slurm_parser_enum_t`.
    kind: c_int,
    handler: *const c_void,
    destroy: *const c_void,
    line_options: *const c_void,
    #[cfg(slurm_conf_pack)]
    pack: *const c_void,
    #[cfg(slurm_conf_pack)]
    unpack: *const c_void,
}

impl ConfOption {
    pub const fn new(key: *const c_char, kind: c_int) -> ConfOption {
        let null = std::ptr::null();
        ConfOption {
            key,
            kind,
            handler: null,
            destroy: null,
            line_options: null,
            #[cfg(slurm_conf_pack)]
            pack: null,
            #[cfg(slurm_conf_pack)]
            unpack: null,
        }
    }
}

/// `int slurm_kill_job_step(uint32_t job_id, uint32_t step_id, uint16_t signal)`.
#[cfg(slurm_kill = "ids")]
pub type KillJobStep = unsafe extern "C" fn(u32, u32, u16) -> c_int;
/// `int slurm_kill_job_step(uint32_t job_id, uint32_t step_id, uint16_t signal, uint16_t flags)`.
#[cfg(slurm_kill = "ids_flags")]
pub type KillJobStep = unsafe extern "C" fn(u32, u32, u16, u16) -> c_int;
/// `int slurm_kill_job_step(slurm_step_id_t *step_id, uint16_t signal, uint16_t flags)`.
#[cfg(slurm_kill = "step_id")]
pub type KillJobStep = unsafe extern "C" fn(*mut slurm_step_id_t, u16, u16) -> c_int;

/// `int slurm_signal_job_step(slurm_step_id_t *step_id, uint32_t signal)`: the signal to the step's tasks
/// through their nodes' slurmds.
#[cfg(slurm_kill = "step_id")]
pub type SignalJobStep = unsafe extern "C" fn(*mut slurm_step_id_t, u32) -> c_int;

/// Calls Slurm's `slurm_kill_job_step` for step `id`, with no flags. Where it takes the step's id, it is the
/// id as Slurm named the step to the plugin, its job's `sluid` included, as Slurm's own MPI plugins pass it
/// (slurmctld finds a job by its sluid when the id has one, else by its number).
///
/// # Safety
/// `f` is this line's `slurm_kill_job_step`.
pub unsafe fn kill_job_step(f: KillJobStep, id: &slurm_step_id_t, signal: u16) -> c_int {
    // SAFETY (each line): the caller's contract: the function has this signature; `id` outlives the call.
    #[cfg(slurm_kill = "ids")]
    return unsafe { f(id.job_id, id.step_id, signal) };
    #[cfg(slurm_kill = "ids_flags")]
    return unsafe { f(id.job_id, id.step_id, signal, 0) };
    #[cfg(slurm_kill = "step_id")]
    {
        let mut id = *id;
        unsafe { f(&mut id, signal, 0) }
    }
}

/// `int slurm_load_job(job_info_msg_t **resp, uint32_t job_id, uint16_t show_flags)`.
#[cfg(not(slurm_load_job_step_id))]
pub type LoadJob = unsafe extern "C" fn(*mut *mut job_info_msg_t, u32, u16) -> c_int;
/// `int slurm_load_job(job_info_msg_t **resp, slurm_step_id_t step_id, uint16_t show_flags)`.
#[cfg(slurm_load_job_step_id)]
pub type LoadJob = unsafe extern "C" fn(*mut *mut job_info_msg_t, slurm_step_id_t, u16) -> c_int;

/// Calls Slurm's `slurm_load_job` for the job of step `id` (by its number, or where it takes an id, by the id
/// as Slurm named the step to the plugin, as [`kill_job_step`]).
///
/// # Safety
/// `f` is this line's `slurm_load_job`; `resp` is a place for its answer.
pub unsafe fn load_job(f: LoadJob, resp: *mut *mut job_info_msg_t, id: &slurm_step_id_t, flags: u16) -> c_int {
    // SAFETY (each line): the caller's contract.
    #[cfg(not(slurm_load_job_step_id))]
    return unsafe { f(resp, id.job_id, flags) };
    #[cfg(slurm_load_job_step_id)]
    return unsafe { f(resp, *id, flags) };
}

/// The size of `slurm_step_id_t` each line's sources give.
const STEP_ID: usize = if cfg!(slurm_sluid) { 24 } else { 12 };

const _: () = {
    assert!(size_of::<slurm_step_id_t>() == STEP_ID, "slurm/slurm.h's slurm_step_id_t is not this line's");
    // The offsets the sources give, for a 12- or a 24-byte id.
    let (nnodes, node_tasks, step_layout) = if cfg!(slurm_sluid) { (144, 156, 32) } else { (132, 144, 24) };
    assert!(offset_of!(stepd_step_rec_t, step_id) == 112);
    assert!(offset_of!(stepd_step_rec_t, nnodes) == nnodes);
    assert!(offset_of!(stepd_step_rec_t, node_tasks) == node_tasks);
    // The heterogeneous step's fields: 22.05; 23.11 and 24.05; 24.11; since 25.05.
    let (het_job_id, het_job_task_offset) = match (cfg!(slurm_sluid), cfg!(slurm_node_list)) {
        (false, false) => (148, 184),
        (false, true) => (168, 200),
        (true, _) if cfg!(slurm_het_step_tasks) => (176, 216),
        (true, _) => (176, 208),
    };
    assert!(offset_of!(stepd_step_rec_t, het_job_id) == het_job_id);
    assert!(offset_of!(stepd_step_rec_t, het_job_task_offset) == het_job_task_offset);
    assert!(offset_of!(StepInfo, step_id) == 8);
    assert!(offset_of!(StepInfo, step_layout) == step_layout);
    assert!(offset_of!(TaskInfo, gtaskid) == 8);
    assert!(offset_of!(TaskInfo, ltaskid) == 12);
    // 22.05: `self` at 32, the id at 40, 56 bytes; since: the id at 32, 48 bytes (12-byte id) or 56 (24).
    let (task_step_id, task_size) = match (cfg!(slurm_task_self), cfg!(slurm_sluid)) {
        (true, _) => (40, 56),
        (false, false) => (32, 48),
        (false, true) => (32, 56),
    };
    assert!(offset_of!(TaskInfo, step_id) == task_step_id);
    assert!(size_of::<TaskInfo>() == task_size);
    assert!(size_of::<ConfOption>() == if cfg!(slurm_conf_pack) { 56 } else { 40 });
};

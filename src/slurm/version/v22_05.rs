//! Slurm 22.05 (checked against 22.05.8 on x86_64).

use super::super::records::{slurm_step_id_t, stepd_step_rec_t, StepInfo};
use std::ffi::{c_char, c_int, c_void};
use std::mem::{offset_of, size_of};

/// 22.05, as `SLURM_VERSION_NUMBER >> 8`.
pub const LINE: u32 = 0x16_05;

/// `mpi_plugin_task_info_t` (`src/common/slurm_mpi.h`): what the task child passes to
/// `mpi_p_slurmstepd_task`.
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
}

impl ConfOption {
    pub const fn new(key: *const c_char, kind: c_int) -> ConfOption {
        let null = std::ptr::null();
        ConfOption { key, kind, handler: null, destroy: null, line_options: null }
    }
}

/// `int slurm_kill_job_step(uint32_t job_id, uint32_t step_id, uint16_t signal)`.
pub type KillJobStep = unsafe extern "C" fn(u32, u32, u16) -> c_int;

/// Calls Slurm's `slurm_kill_job_step` for step `id`.
///
/// # Safety
/// `f` is this line's `slurm_kill_job_step`.
pub unsafe fn kill_job_step(f: KillJobStep, id: &slurm_step_id_t, signal: u16) -> c_int {
    // SAFETY: the caller's contract: the function has this signature.
    unsafe { f(id.job_id, id.step_id, signal) }
}

const _: () = {
    assert!(offset_of!(stepd_step_rec_t, step_id) == 112);
    assert!(offset_of!(stepd_step_rec_t, nnodes) == 132);
    assert!(offset_of!(stepd_step_rec_t, node_tasks) == 144);
    assert!(offset_of!(StepInfo, step_id) == 8);
    assert!(offset_of!(StepInfo, step_layout) == 24);
    assert!(offset_of!(TaskInfo, gtaskid) == 8);
    assert!(offset_of!(TaskInfo, ltaskid) == 12);
    assert!(offset_of!(TaskInfo, self_) == 32);
    assert!(offset_of!(TaskInfo, step_id) == 40);
    assert!(size_of::<TaskInfo>() == 56);
    assert!(size_of::<ConfOption>() == 40);
};

//! Slurm 24.11 (checked against 24.11.5 on x86_64); 26.05 keeps these structs.

use super::super::records::{slurm_step_id_t, stepd_step_rec_t, StepInfo};
use std::ffi::{c_char, c_int, c_void};
use std::mem::{offset_of, size_of};

/// 24.11, as `SLURM_VERSION_NUMBER >> 8`.
#[cfg(slurm = "24.11")]
pub const LINE: u32 = 0x18_0b;

/// `mpi_task_info_t` (`src/interfaces/mpi.h`): what the task child passes to `mpi_p_slurmstepd_task`. It
/// lost 22.05's `self` (23.11), and `step_id` starts with a `sluid` (24.11).
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
    pub step_id: slurm_step_id_t,
}

/// `s_p_options_t` (`src/common/parse_config.h`): one option a plugin takes from mpi.conf; `pack` and
/// `unpack` came in 23.02.
#[repr(C)]
pub struct ConfOption {
    key: *const c_char,
    /// `slurm_parser_enum_t`.
    kind: c_int,
    handler: *const c_void,
    destroy: *const c_void,
    line_options: *const c_void,
    pack: *const c_void,
    unpack: *const c_void,
}

impl ConfOption {
    pub const fn new(key: *const c_char, kind: c_int) -> ConfOption {
        let null = std::ptr::null();
        ConfOption { key, kind, handler: null, destroy: null, line_options: null, pack: null, unpack: null }
    }
}

/// `int slurm_kill_job_step(uint32_t job_id, uint32_t step_id, uint16_t signal, uint16_t flags)`.
#[cfg(slurm = "24.11")]
pub type KillJobStep = unsafe extern "C" fn(u32, u32, u16, u16) -> c_int;

/// Calls Slurm's `slurm_kill_job_step` for step `id`, with no flags.
///
/// # Safety
/// `f` is this line's `slurm_kill_job_step`.
#[cfg(slurm = "24.11")]
pub unsafe fn kill_job_step(f: KillJobStep, id: &slurm_step_id_t, signal: u16) -> c_int {
    // SAFETY: the caller's contract: the function has this signature.
    unsafe { f(id.job_id, id.step_id, signal, 0) }
}

const _: () = {
    assert!(offset_of!(stepd_step_rec_t, step_id) == 112);
    assert!(offset_of!(stepd_step_rec_t, nnodes) == 144);
    assert!(offset_of!(stepd_step_rec_t, node_tasks) == 156);
    assert!(offset_of!(StepInfo, step_id) == 8);
    assert!(offset_of!(StepInfo, step_layout) == 32);
    assert!(offset_of!(TaskInfo, gtaskid) == 8);
    assert!(offset_of!(TaskInfo, ltaskid) == 12);
    assert!(offset_of!(TaskInfo, step_id) == 32);
    assert!(size_of::<TaskInfo>() == 56);
    assert!(size_of::<ConfOption>() == 56);
};

//! Slurm 26.05 (checked against 26.05's sources on x86_64): 24.11's structs, and `slurm_kill_job_step` takes
//! the step's id.

use super::super::sys::{slurm_step_id_t, NO_VAL};
use std::ffi::c_int;

pub use super::v24_11::{ConfOption, TaskInfo};

/// 26.05, as `SLURM_VERSION_NUMBER >> 8`.
pub const LINE: u32 = 0x1a_05;

/// `int slurm_kill_job_step(slurm_step_id_t *step_id, uint16_t signal, uint16_t flags)`.
pub type KillJobStep = unsafe extern "C" fn(*mut slurm_step_id_t, u16, u16) -> c_int;

/// Calls Slurm's `slurm_kill_job_step` for the step, with no flags. As Slurm's own callers do, the id has no
/// `sluid` (slurmctld then finds the job by its id) and no het component.
///
/// # Safety
/// `f` is this line's `slurm_kill_job_step`.
pub unsafe fn kill_job_step(f: KillJobStep, job: u32, step: u32, signal: u16) -> c_int {
    // SAFETY: slurm_step_id_t is plain integers: all zeroes is a valid value.
    let mut id: slurm_step_id_t = unsafe { std::mem::zeroed() };
    id.job_id = job;
    id.step_id = step;
    id.step_het_comp = NO_VAL;
    // SAFETY: the caller's contract: the function has this signature; `id` outlives the call.
    unsafe { f(&mut id, signal, 0) }
}

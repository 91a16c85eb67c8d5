//! Slurm 26.05 (checked against 26.05's sources on x86_64): 24.11's structs, and `slurm_kill_job_step` takes
//! the step's id.

use super::super::records::slurm_step_id_t;
use std::ffi::c_int;

pub use super::v24_11::{ConfOption, TaskInfo};

/// 26.05, as `SLURM_VERSION_NUMBER >> 8`.
pub const LINE: u32 = 0x1a_05;

/// `int slurm_kill_job_step(slurm_step_id_t *step_id, uint16_t signal, uint16_t flags)`.
pub type KillJobStep = unsafe extern "C" fn(*mut slurm_step_id_t, u16, u16) -> c_int;

/// Calls Slurm's `slurm_kill_job_step` for step `id`, with no flags: the id as Slurm named the step to the
/// plugin, its job's `sluid` included, as Slurm's own MPI plugins pass it (slurmctld finds a job by its sluid
/// when the id has one, else by its number).
///
/// # Safety
/// `f` is this line's `slurm_kill_job_step`.
pub unsafe fn kill_job_step(f: KillJobStep, id: &slurm_step_id_t, signal: u16) -> c_int {
    let mut id = *id;
    // SAFETY: the caller's contract: the function has this signature; `id` outlives the call.
    unsafe { f(&mut id, signal, 0) }
}

//! What differs between the Slurm release lines the plugin supports, chosen when it is built: `build.rs`
//! reads `SLURM_VERSION_NUMBER` from the headers the build is pointed at (`SLURM_INCLUDE_DIR`, else
//! `/usr/include`) and sets `cfg(slurm = "22.05" | "24.11" | "26.05")`; any other line fails the build.
//!
//! Slurm's MPI plugin interface is the same nine symbols in all three, but Slurm hands the plugin private
//! structs (not in libslurm-dev) whose layout moved, and one function it calls changed its arguments:
//!
//! | what | 22.05 | 24.11 | 26.05 |
//! |---|---|---|---|
//! | `slurm_step_id_t` (public) | job, step, het component | a `sluid` first | as 24.11 |
//! | task info (`mpi_p_slurmstepd_task`) | `mpi_plugin_task_info_t`, with `self` | `mpi_task_info_t`, no `self` | as 24.11 |
//! | mpi.conf option (`s_p_options_t`) | 5 fields | 7 (`pack`, `unpack`) | as 24.11 |
//! | `slurm_kill_job_step` | `(job, step, signal)` | `(job, step, signal, flags)` | `(slurm_step_id_t *, signal, flags)` |
//! | step record from `env` to `flags` ([`super::records::RecordFromEnv`]) | `ioid` | `io_running`, `io_cond`, `io_mutex` | as 24.11, without `run_prolog` |
//!
//! The step record's and srun's step info's fields are the same in all three (their offsets move with
//! `slurm_step_id_t`): they are declared once in [`super::records`], and each line's module asserts the offsets
//! its sources give, so a layout that disagrees fails the build instead of reading the wrong bytes.
//! `plugin_version` comes from the same header, and Slurm loads only a plugin of its own exact version.

#[cfg(slurm = "22.05")]
mod v22_05;
#[cfg(any(slurm = "24.11", slurm = "26.05"))]
mod v24_11;
#[cfg(slurm = "26.05")]
mod v26_05;

#[cfg(slurm = "22.05")]
pub use v22_05::*;
#[cfg(slurm = "24.11")]
pub use v24_11::*;
#[cfg(slurm = "26.05")]
pub use v26_05::*;

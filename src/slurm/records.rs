//! Slurm's types as the plugin reads them: the public ones (bindgen over `<slurm/slurm.h>`) and the private
//! structs Slurm hands to MPI plugins that are alike in every supported line (what differs is in
//! [`super::version`], which asserts their offsets).

#![allow(non_camel_case_types, non_upper_case_globals, non_snake_case, dead_code)]

use std::ffi::{c_char, c_int, c_void};

/// The public Slurm types and constants (`build.rs`, feature `slurm`).
pub mod bindings {
    #![allow(non_camel_case_types, non_upper_case_globals, non_snake_case, dead_code)]
    include!(concat!(env!("OUT_DIR"), "/slurm.rs"));
}

pub use bindings::{
    job_info_msg_t, job_states_JOB_RUNNING, slurm_conf_t, slurm_step_id_t, slurm_step_layout_t, JOB_STATE_BASE, NO_VAL,
    SLURM_VERSION_NUMBER,
};

/// `DEBUG_FLAG_MPI` of `slurm_conf_t::debug_flags` (`SLURM_BIT(7)` in every supported line's `slurm.h`; bindgen
/// does not read the macro's cast).
pub const DEBUG_FLAG_MPI: u64 = 1 << 7;

/// `JOB_COMPLETING`, a flag of a job's state (`SLURM_BIT(15)` in every supported line's `slurm.h`).
pub const JOB_COMPLETING: u32 = 1 << 15;

/// `SHOW_LOCAL`, the flag that keeps `slurm_load_job` from asking for the federation first (`0x0010`, written
/// `SLURM_BIT(4)` from 26.05).
pub const SHOW_LOCAL: u16 = 1 << 4;

/// srun's step info for `mpi_p_client_prelaunch`: `mpi_plugin_client_info_t` in 22.05 (`src/common/slurm_mpi.h`),
/// `mpi_step_info_t` since (`src/interfaces/mpi.h`); not installed. The same fields in every supported line
/// (their offsets are asserted in [`super::version`]).
#[repr(C)]
pub struct StepInfo {
    /// Hetjob leader id, or `NO_VAL`.
    pub het_job_id: u32,
    pub het_job_task_offset: u32,
    pub step_id: slurm_step_id_t,
    pub step_layout: *const slurm_step_layout_t,
}

/// The start of slurmstepd's step record, `stepd_step_rec_t` (`src/slurmd/slurmstepd/slurmstepd_job.h`, not
/// installed), up to the fields the plugin reads; the same fields in every supported line but two pointers
/// (offsets asserted in [`super::version`]). The step the plugin serves is the one Slurm says, never one named in the job's
/// environment (which the user controls). Each task child checks the ids against its task info, which
/// Slurm fills from the same record, so a layout that ever disagreed would fail the step instead of acting
/// on wrong ids.
#[repr(C)]
pub struct stepd_step_rec_t {
    alias_list: *const c_char,
    container: *const c_char,
    state: c_int,
    state_cond: libc::pthread_cond_t,
    state_mutex: libc::pthread_mutex_t,
    pub step_id: slurm_step_id_t,
    array_job_id: u32,
    array_task_id: u32,
    /// Nodes and tasks of the step, this node's index and its task count.
    pub nnodes: u32,
    pub ntasks: u32,
    pub nodeid: u32,
    pub node_tasks: u32,
    #[cfg(slurm_node_list)]
    node_addrs: *const c_void,
    #[cfg(slurm_node_list)]
    node_list: *const c_char,
    /// The heterogeneous step this component's step belongs to (srun's `A : B`): the leader's job id, or
    /// `NO_VAL` (0 in a step of a component that srun runs alone).
    pub het_job_id: u32,
    /// Nodes of every component (each component's nodes counted apart), and their names in the order of
    /// srun's merged layout (srun sorts them by name where no node is in two components).
    pub het_job_nnodes: u32,
    pub het_job_node_list: *const c_char,
    het_job_node_offset: u32,
    /// Tasks of every component.
    pub het_job_ntasks: u32,
    /// This component's index in the step, if the step has several (`NO_VAL` or, from 23.11 on, `INFINITE`
    /// in a step of one component srun runs alone).
    pub het_job_offset: u32,
    /// The step's components.
    pub het_job_step_cnt: u32,
    #[cfg(slurm_het_step_tasks)]
    het_job_step_task_cnts: *const u32,
    /// The rank of this component's first task in the whole step.
    pub het_job_task_offset: u32,
}

/// The step record from its `env` field (whose address Slurm passes to `mpi_p_slurmstepd_prefork`) to its
/// launch flags, as each supported line lays it out (`slurmstepd_job.h` of 22.05.11, 23.11.11, 24.05.8, 24.11.7,
/// 25.05.8, 25.11.7 and 26.05.3; enums
/// are C `int`s). The plugin reads it only after checking `jmgr_pid` against slurmstepd's own pid, which
/// Slurm sets before prefork: a record laid out otherwise is not read further.
#[repr(C)]
pub struct RecordFromEnv {
    pub env: *mut *mut c_char,
    pub argv: *mut *mut c_char,
    cwd: *const c_char,
    task_dist: c_int,
    /// This node's name (slurmd's `NodeName`).
    pub node_name: *const c_char,
    cpu_bind_type: c_int,
    cpu_bind: *const c_char,
    mem_bind_type: c_int,
    mem_bind: *const c_char,
    accel_bind_type: u16,
    cpu_freq_min: u32,
    cpu_freq_max: u32,
    cpu_freq_gov: u32,
    switch_step: *const c_void,
    uid: u32,
    user_name: *const c_char,
    pw_gecos: *const c_char,
    pw_dir: *const c_char,
    pw_shell: *const c_char,
    gid: u32,
    ngids: c_int,
    gr_names: *const c_void,
    gids: *const c_void,
    aborted: bool,
    batch: bool,
    #[cfg(slurm_run_prolog)]
    run_prolog: bool,
    timelimit: i64,
    profile: u32,
    task_prolog: *const c_char,
    task_epilog: *const c_char,
    task: *const c_void,
    eio: *const c_void,
    sruns: *const c_void,
    clients: *const c_void,
    stdout_eio_objs: *const c_void,
    stderr_eio_objs: *const c_void,
    free_incoming: *const c_void,
    free_outgoing: *const c_void,
    incoming_count: c_int,
    outgoing_count: c_int,
    outgoing_cache: *const c_void,
    #[cfg(slurm_io = "ioid")]
    ioid: libc::pthread_t,
    #[cfg(slurm_io = "io_running")]
    io_running: bool,
    #[cfg(slurm_io = "io_running")]
    io_cond: libc::pthread_cond_t,
    #[cfg(slurm_io = "io_running")]
    io_mutex: libc::pthread_mutex_t,
    msgid: libc::pthread_t,
    msg_handle: *const c_void,
    /// slurmstepd's pid.
    pub jmgr_pid: libc::pid_t,
    pgid: libc::pid_t,
    /// `LAUNCH_*`.
    pub flags: u32,
}

/// The launch flag of a `srun --multi-prog` step (`slurm_protocol_defs.h`): its `argv[1]` is the text of the
/// configuration file.
pub const LAUNCH_MULTI_PROG: u32 = 1 << 1;

pub const SLURM_SUCCESS: c_int = bindings::SLURM_SUCCESS as c_int;
pub const SLURM_ERROR: c_int = bindings::SLURM_ERROR as c_int;

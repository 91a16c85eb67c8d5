//! The srun side: `mpi_p_client_prelaunch` checks the job's options (`super::options`), computes the task
//! map from the step layout, makes the step's
//! secret, starts the collective root and passes what the stepds need in the launch environment;
//! `mpi_p_client_fini` stops the root and hands srun the exit code of a `PMI_Abort`.

use super::layout;
use super::options::{allgather as allgather_of, bound_option, Id, Job, Site, INTERNAL};
use super::records::{slurm_step_id_t, slurm_step_layout_t, StepInfo, NO_VAL};
use super::root::{Outcome, Reporter, RootThread, Step};
use super::spawn::{self, Spawn, ENV_SPAWN};
use super::sys::{self, Slurm};
use crate::collective::{Bound, Bounds};
use crate::server::JOB_ERROR_EXIT_CODE;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};

/// srun's bounds of one exchange: the job's (srun's root checks what it gathers with them; the stepds hold
/// them to the site's ceilings too).
pub fn bounds(part_max: usize, exchange_max: usize) -> Bounds {
    Bounds {
        part_max: Bound { bytes: part_max, option: bound_option(Id::NodeBytesMax, false) },
        exchange_max: Bound { bytes: exchange_max, option: bound_option(Id::ExchangeBytesMax, false) },
    }
}

/// What `mpi_p_client_prelaunch` returns to srun (`mpi_plugin_client_state_t *`).
enum ClientState {
    /// A step's root.
    Step(RootThread),
    /// One component of the heterogeneous step in [`HET_STEP`].
    Component,
}

/// The heterogeneous step (`srun A : B`) this srun runs, if it runs one. srun calls `mpi_p_client_prelaunch`
/// once for each component, each on a thread of its own, with the same merged layout (every component's nodes
/// and tasks): the first call sets the step up for all (one root, one secret, one task map), the others pass
/// on the same variables; the last `mpi_p_client_fini` stops the root. srun runs one step, so one is kept;
/// it stays, stopped, so that a component that came after the others ended is refused, not served alone.
static HET_STEP: Mutex<Option<HetStep>> = Mutex::new(None);

struct HetStep {
    /// The step's job (the hetjob's leader, or the job a local heterogeneous step runs in) and step id.
    key: (u32, u32),
    /// The variables every component's launch environment gets, or why the set-up failed.
    vars: Result<Vars, String>,
    /// Until the last component's `fini`.
    root: Option<RootThread>,
    /// Components that called prelaunch and not yet fini.
    open: usize,
    /// Every component's step, for ending them all.
    components: Components,
}

fn het_step() -> std::sync::MutexGuard<'static, Option<HetStep>> {
    HET_STEP.lock().unwrap_or_else(|e| e.into_inner())
}

/// The plugin's variables in a launch environment, by name.
type Vars = Vec<(&'static str, String)>;

/// The steps the root ends when it ends the step: one, or a heterogeneous step's components as they come.
type Components = Arc<Mutex<Steps>>;

#[derive(Default)]
struct Steps {
    ids: Vec<slurm_step_id_t>,
    /// The root has ended them: a component that comes later is refused.
    ended: bool,
}

fn steps(components: &Components) -> std::sync::MutexGuard<'_, Steps> {
    components.lock().unwrap_or_else(|e| e.into_inner())
}

/// Clients not yet given back through `mpi_p_client_fini`, so `fini` can stop their threads before the
/// library is unloaded. Addresses, not pointers, so the list is `Send`.
static LIVE: Mutex<Vec<usize>> = Mutex::new(Vec::new());

fn live() -> std::sync::MutexGuard<'static, Vec<usize>> {
    LIVE.lock().unwrap_or_else(|e| e.into_inner())
}

/// The root's verdicts, as srun shows them: errors on srun's stderr (`srun: error: rpmi: ...`, printed even
/// with `-Q`), and the step ended through slurmctld.
struct SrunReporter {
    slurm: &'static Slurm,
    /// The step srun runs, as Slurm named it to the plugin: each component of a heterogeneous step.
    steps: Components,
    /// The job its spawned steps run in (see [`spawn_setup`]).
    job: u32,
    /// The hetjob's leader, if the step runs in a hetjob's allocation.
    hetjob_leader: Option<u32>,
}

impl SrunReporter {
    fn kill(&self, id: &slurm_step_id_t) {
        if let Err(e) = self.slurm.kill_step(id, libc::SIGKILL, self.hetjob_leader == Some(id.job_id)) {
            self.slurm.error(&e);
        }
    }
}

impl Reporter for SrunReporter {
    fn error(&mut self, message: &str) {
        self.slurm.error(message);
    }
    fn debug(&mut self, message: &str) {
        self.slurm.log(log::Level::Debug, message);
    }
    fn end_step(&mut self) {
        let steps = {
            let mut s = steps(&self.steps);
            s.ended = true;
            s.ids.clone()
        };
        for id in &steps {
            self.kill(id);
        }
    }
    fn job_ending(&mut self) -> bool {
        let ids = steps(&self.steps).ids.clone();
        ids.iter().any(|id| self.slurm.job_ending(id) == Some(true))
    }
    fn end_spawned(&mut self, step: u32) {
        let Some(&first) = steps(&self.steps).ids.first() else { return };
        // A spawned step is another step of `job`, never a het component; the sluid names the job where it is
        // this step's own job's (a hetjob component's sluid is its own, not the leader's).
        let mut id = first;
        (id.job_id, id.step_id, id.step_het_comp) = (self.job, step, NO_VAL);
        #[cfg(slurm_sluid)]
        if first.job_id != self.job {
            id.sluid = 0;
        }
        self.kill(&id);
    }
}

/// The node of every rank, from the step layout: `tids[node]` lists the ranks on `node`, whatever the
/// distribution (block, cyclic, plane, arbitrary).
///
/// # Safety
/// `layout` is Slurm's step layout with `node_cnt` entries in `tasks` and `tids`.
pub unsafe fn task_map(layout: &slurm_step_layout_t) -> Result<Vec<u32>, String> {
    let (nodes, size) = (layout.node_cnt as usize, layout.task_cnt as usize);
    if nodes == 0 || size == 0 || layout.tasks.is_null() || layout.tids.is_null() {
        return Err(format!("an empty step layout ({nodes} nodes, {size} tasks)"));
    }
    let mut node_of = vec![u32::MAX; size];
    for node in 0..nodes {
        // SAFETY: node < node_cnt, and `tasks` (not NULL, checked above) has node_cnt entries.
        let count = unsafe { *layout.tasks.add(node) } as usize;
        // SAFETY: node < node_cnt, and `tids` (not NULL, checked above) has node_cnt entries.
        let tids = unsafe { *layout.tids.add(node) };
        if count > 0 && tids.is_null() {
            return Err(format!("no task ids for node {node}"));
        }
        for i in 0..count {
            // SAFETY: i < count, and `tids` (not NULL when count > 0, checked above) has this node's count ids.
            let rank = unsafe { *tids.add(i) } as usize;
            match node_of.get_mut(rank) {
                Some(slot) if *slot == u32::MAX => *slot = node as u32,
                _ => return Err(format!("task {rank} of a {size}-task step appears twice or is out of range")),
            }
        }
    }
    if let Some(rank) = node_of.iter().position(|&n| n == u32::MAX) {
        return Err(format!("task {rank} has no node in the step layout"));
    }
    Ok(node_of)
}

/// `mpi_p_client_prelaunch`.
///
/// # Safety
/// Pointers as srun passes them.
pub unsafe fn prelaunch(info: *const StepInfo, env: *mut *mut *mut c_char) -> Result<*mut c_void, String> {
    // SAFETY: the caller's contract: `info` is NULL or srun's step information, valid for the call.
    let info = unsafe { info.as_ref() }.ok_or("no step information")?;
    if env.is_null() {
        return Err("no environment".into());
    }
    // The job's options: an unknown one, or a value that is not one, ends srun here, before any task starts.
    let vars = std::env::vars_os().map(|(n, v)| (n.to_string_lossy().into_owned(), v.to_string_lossy().into_owned()));
    let job = Job::from_env(vars)?;
    // The job its tasks belong to: a hetjob's leader (srun names each component's own job), else the step's.
    let job_id = match info.het_job_id {
        0 | NO_VAL => info.step_id.job_id,
        leader => leader,
    };
    let step = info.step_id.step_id;
    if info.het_job_task_offset == NO_VAL {
        let components = Arc::new(Mutex::new(Steps { ids: vec![info.step_id], ended: false }));
        // SAFETY: the caller's contract.
        let (root, vars) = unsafe { set_up(info, job, job_id, components) }?;
        // SAFETY: the caller's contract.
        unsafe { set_vars(env, &vars) }?;
        return Ok(live_state(ClientState::Step(root)));
    }
    // One component of a heterogeneous step: the first to come sets up the whole step.
    let key = (job_id, step);
    // SAFETY (both closures): the caller's contract.
    let set_up = |components| unsafe { set_up(info, job, job_id, components) };
    HetStep::join(&mut het_step(), key, info.step_id, set_up, |vars| unsafe { set_vars(env, vars) })?;
    Ok(live_state(ClientState::Component))
}

impl HetStep {
    /// Joins component `id` to heterogeneous step `key` in `slot`: the first sets the step up (`set_up`, given
    /// the list of components the root ends); each passes the step's variables to its launch environment
    /// (`pass`), and counts until its `fini` if it could.
    fn join(
        slot: &mut Option<HetStep>,
        key: (u32, u32),
        id: slurm_step_id_t,
        set_up: impl FnOnce(Components) -> Result<(RootThread, Vars), String>,
        pass: impl FnOnce(&Vars) -> Result<(), String>,
    ) -> Result<(), String> {
        let (job, step) = key;
        let h = match slot {
            Some(h) => h,
            None => {
                let components = Components::default();
                let (root, vars) = match set_up(components.clone()) {
                    Ok((root, vars)) => (Some(root), Ok(vars)),
                    Err(e) => (None, Err(e)),
                };
                slot.insert(HetStep { key, vars, root, open: 0, components })
            }
        };
        if h.key != key {
            return Err(format!("srun runs step {}.{} already, not {job}.{step}", h.key.0, h.key.1));
        }
        let vars = h.vars.as_ref().map_err(|e| format!("heterogeneous step {job}.{step}: {e}"))?;
        if h.root.is_none() || steps(&h.components).ended {
            return Err(format!(
                "a component of heterogeneous step {job}.{step} started after the step had ended; srun serves no \
                 component alone"
            ));
        }
        pass(vars)?;
        steps(&h.components).ids.push(id);
        h.open += 1;
        Ok(())
    }
}

/// Hands srun a client state, kept in [`LIVE`] until `fini` gives it back.
fn live_state(state: ClientState) -> *mut c_void {
    let client = Box::into_raw(Box::new(state));
    live().push(client as usize);
    client.cast()
}

/// Sets the plugin's own variables in srun's launch environment `env`.
///
/// # Safety
/// `env` is srun's `char ***` launch environment (not NULL).
unsafe fn set_vars(env: *mut *mut *mut c_char, vars: &[(&str, String)]) -> Result<(), String> {
    let text = |s: &str| CString::new(s).map_err(|_| format!("a NUL in {s:?}"));
    for (name, value) in vars {
        // SAFETY: the caller's contract.
        unsafe { sys::slurm().setenv(env, &text(name)?, &text(value)?) }?;
    }
    Ok(())
}

/// Sets the step up: its task map from srun's layout (a heterogeneous step's merged one), its secret and
/// options, and its root, running; and says the variables for the launch environment. `job` is the step's
/// job options, `job_id` the job its tasks belong to (a hetjob's leader), and `components` the steps the root
/// ends.
///
/// # Safety
/// `info` is srun's step information, valid for the call.
unsafe fn set_up(info: &StepInfo, job: Job, job_id: u32, components: Components) -> Result<(RootThread, Vars), String> {
    let slurm = sys::slurm();
    let step = info.step_id.step_id;
    // SAFETY: NULL or srun's step layout, valid for the call.
    let layout = unsafe { info.step_layout.as_ref() }.ok_or("no step layout")?;
    // SAFETY: Slurm's step layout: `tasks` and `tids` have node_cnt entries.
    let node_of = unsafe { task_map(layout) }?;
    let nodes = layout.node_cnt as usize;
    let list = if layout.node_list.is_null() {
        String::new()
    } else {
        // SAFETY: not NULL (checked above): Slurm's NUL-terminated node list.
        unsafe { CStr::from_ptr(layout.node_list) }.to_string_lossy().into_owned()
    };
    let (node_names, addresses) = match slurm.expand_nodelist(&list, nodes) {
        Ok(names) if names.len() == nodes => {
            // Only where slurm.conf gives every node's address: a node it cannot place must not be refused.
            let addresses: Option<Vec<_>> = names.iter().map(|n| slurm.node_address(n)).collect();
            (names, addresses)
        }
        _ => ((0..nodes).map(|n| format!("node {n}")).collect(), None),
    };
    let job_or_default = |id: Id| job.get(id).unwrap_or(id.opt().default);
    let bounds = bounds(job_or_default(Id::NodeBytesMax) as usize, job_or_default(Id::ExchangeBytesMax) as usize);
    let width = job.get(Id::TreeWidth).map(|w| w as u32);
    let allgather = job.get(Id::Allgather).map(|_| allgather_of(&Site::EMPTY, &job));
    let secret = crate::slurm::random::secret().map_err(|e| format!("no random bytes for the step's secret: {e}"))?;
    let listener = listen().map_err(|e| format!("cannot open the collective port: {e}"))?;
    let map = layout::encode(&node_of);
    let hex = secret.to_hex();
    // This step is a spawned one if a spawning srun started this srun (or the user says so: it is their step).
    let spawned = match std::env::var(ENV_SPAWN) {
        Ok(text) if !text.is_empty() => Some(Spawn::decode(&text)?),
        _ => None,
    };
    if let Some(s) = spawned.as_ref().filter(|s| s.job.size() != node_of.len() as u64) {
        return Err(format!("the spawn asked for {} processes, srun's step has {} tasks", s.job.size(), node_of.len()));
    }
    let spawn_var = spawned.as_ref().map_or(String::new(), |s| Spawn { fd: None, ..s.clone() }.encode());
    let spawned_by = spawned.as_ref().and_then(|s| s.fd);
    // Spawned steps run in the allocation of the step's first component: its own job's, or the component
    // whose ranks start at 0 if it sets up (the hetjob's leader when the step has the hetjob's first
    // component, as it does unless `--het-group` leaves it out).
    let spawn_job = if matches!(info.het_job_task_offset, 0 | NO_VAL) { info.step_id.job_id } else { job_id };
    let spawn = spawn_setup(spawn_job);
    // Before the root runs: its lines (`started`, `failed NS`) follow the step id.
    if let Some(fd) = spawned_by {
        spawn::tell_step(fd, step)?;
    }
    let step_info = Step { node_names, node_of, secret, addresses, bounds, width, allgather, spawn, spawned_by };
    let hetjob_leader = Some(info.het_job_id).filter(|&j| j != 0 && j != NO_VAL);
    let reporter = SrunReporter { slurm, steps: components, job: spawn_job, hetjob_leader };
    let root = RootThread::start(listener, step_info, Box::new(reporter))
        .map_err(|e| format!("cannot start the collective root: {e}"))?;
    // Every one of the plugin's own variables, whatever srun's environment held (see `options`).
    let values = [root.port().to_string(), hex, map, job.encode(), spawn_var];
    Ok((root, INTERNAL.into_iter().zip(values).collect()))
}

/// What the root needs to start the steps this one spawns: srun's executable and environment now (read
/// here, in srun's main thread, not while srun may change its environment). `None` if srun cannot find its
/// executable: its spawns are then refused.
fn spawn_setup(job: u32) -> Option<spawn::Setup> {
    use std::os::unix::ffi::OsStrExt;
    let srun = std::fs::read_link("/proc/self/exe").ok()?;
    let srun = CString::new(srun.as_os_str().as_bytes()).ok()?;
    let env = std::env::vars_os()
        .filter_map(|(name, value)| {
            let mut entry = name.as_bytes().to_vec();
            entry.push(b'=');
            entry.extend_from_slice(value.as_bytes());
            CString::new(entry).ok()
        })
        .collect();
    Some(spawn::Setup { srun, job, env })
}

/// The collective port: every address, as srun's other listening sockets (the stepds connect to
/// `SLURM_SRUN_COMM_HOST`, which may be IPv4 or IPv6). A dual-stack IPv6 socket where the system has one,
/// else IPv4.
fn listen() -> std::io::Result<TcpListener> {
    match TcpListener::bind(("::", 0)) {
        Ok(l) if !v6_only(&l) => Ok(l),
        _ => TcpListener::bind(("0.0.0.0", 0)),
    }
}

/// Whether an IPv6 socket refuses IPv4 peers (`IPV6_V6ONLY`, the system's `bindv6only` default).
fn v6_only(l: &TcpListener) -> bool {
    use std::os::fd::AsRawFd;
    let mut on: c_int = 1;
    let mut len = std::mem::size_of::<c_int>() as libc::socklen_t;
    // SAFETY: reads one int option into a buffer of that size.
    let rc = unsafe {
        libc::getsockopt(l.as_raw_fd(), libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, (&mut on as *mut c_int).cast(), &mut len)
    };
    rc != 0 || on != 0
}

/// `mpi_p_client_fini`: srun's exit code for the step (0 leaves srun's own).
///
/// # Safety
/// `state` is NULL or what `prelaunch` returned, given back once.
pub unsafe fn fini(state: *mut c_void) -> c_int {
    if state.is_null() {
        return 0;
    }
    let mut l = live();
    let Some(i) = l.iter().position(|&p| p == state as usize) else {
        sys::slurm().error("mpi_p_client_fini with an unknown state");
        return 0;
    };
    l.swap_remove(i);
    drop(l);
    // SAFETY: `state` was in the list: a live client `prelaunch` boxed, now taken out of it, so freed once.
    let client = unsafe { Box::from_raw(state as *mut ClientState) };
    match *client {
        ClientState::Step(root) => exit_code(&root.stop()),
        ClientState::Component => {
            // The last component's fini stops the root, and says the step's exit code (srun takes the
            // largest of its components').
            let root = het_step().as_mut().and_then(|h| {
                h.open = h.open.saturating_sub(1);
                if h.open == 0 {
                    h.root.take()
                } else {
                    None
                }
            });
            root.map_or(0, |r| exit_code(&r.stop()))
        }
    }
}

/// srun's exit code for the step (0 leaves srun's own): an abort's code as a process would exit with it (its
/// low 8 bits), [`JOB_ERROR_EXIT_CODE`] when rpmi ended a step none of whose tasks failed on its own; the
/// status of the srun of a spawned step that began to fail first goes before both. srun takes any non-zero value over the tasks' statuses, which then show only the SIGKILL that ended the
/// step.
pub fn exit_code(outcome: &Outcome) -> c_int {
    match (outcome.spawned_status, outcome.abort_code) {
        (Some(s), _) => s,
        (None, Some(c)) => c & 0xff,
        (None, None) if outcome.job_error => JOB_ERROR_EXIT_CODE,
        (None, None) => 0,
    }
}

/// `fini` in srun: stops the roots srun did not give back.
pub fn stop_all() {
    let pending: Vec<usize> = std::mem::take(&mut *live());
    for p in pending {
        // SAFETY: each address is a live client `prelaunch` boxed, taken out of the list once.
        drop(unsafe { Box::from_raw(p as *mut ClientState) });
    }
    let root = het_step().as_mut().and_then(|h| h.root.take());
    drop(root);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn task_maps_from_layouts() {
        let mut tasks = [2u16, 1, 3];
        let mut ids = [vec![0u32, 3], vec![1], vec![2, 4, 5]];
        let mut tids: Vec<*mut u32> = ids.iter_mut().map(|v| v.as_mut_ptr()).collect();
        // SAFETY: all zeroes is a valid layout: integers and NULL pointers.
        let mut layout: slurm_step_layout_t = unsafe { std::mem::zeroed() };
        layout.node_cnt = 3;
        layout.task_cnt = 6;
        layout.tasks = tasks.as_mut_ptr();
        layout.tids = tids.as_mut_ptr();
        // SAFETY: `tasks` and `tids` have node_cnt entries, each node's ids as many as
        // `tasks` says, all alive through the test.
        assert_eq!(unsafe { task_map(&layout) }, Ok(vec![0, 1, 2, 0, 2, 2]));
        // SAFETY: the last of node 2's three ids.
        let last = |v: u32| unsafe { *tids[2].add(2) = v };
        last(3);
        // SAFETY: as above.
        assert!(unsafe { task_map(&layout) }.is_err());
        last(9);
        // SAFETY: as above.
        assert!(unsafe { task_map(&layout) }.is_err());
        layout.task_cnt = 7;
        last(5);
        // SAFETY: as above.
        assert!(unsafe { task_map(&layout) }.unwrap_err().contains("task 6 has no node"));
    }

    /// A heterogeneous step whose set-up failed refuses every component with that reason; one whose components
    /// have all ended refuses a late one; srun's one step is the only one.
    #[test]
    fn components_join_the_one_heterogeneous_step_or_are_refused() {
        // SAFETY: an all-zero slurm_step_id_t is a valid value of that plain C struct.
        let id: slurm_step_id_t = unsafe { std::mem::zeroed() };
        let mut slot = None;
        let failed = |_| Err("cannot open the collective port: no".to_string());
        let never = |_: Components| -> Result<(RootThread, Vars), String> { panic!("set up twice") };
        let pass = |_: &Vars| Ok(());
        let e = HetStep::join(&mut slot, (7, 0), id, failed, pass).unwrap_err();
        assert_eq!(e, "heterogeneous step 7.0: cannot open the collective port: no");
        let e = HetStep::join(&mut slot, (7, 0), id, never, pass).unwrap_err();
        assert_eq!(e, "heterogeneous step 7.0: cannot open the collective port: no");
        let e = HetStep::join(&mut slot, (8, 0), id, never, pass).unwrap_err();
        assert_eq!(e, "srun runs step 7.0 already, not 8.0");
        // Set up, then ended by the last component's fini.
        let components = Arc::new(Mutex::new(Steps { ids: vec![id], ended: false }));
        slot = Some(HetStep { key: (7, 1), vars: Ok(vec![]), root: None, open: 0, components });
        let e = HetStep::join(&mut slot, (7, 1), id, never, pass).unwrap_err();
        assert!(e.starts_with("a component of heterogeneous step 7.1 started after the step had ended"), "{e}");
        assert_eq!(slot.as_ref().map(|h| h.open), Some(0));
        // A running step: a component joins and counts; once the root ended the step, a late one is refused.
        let (root, _) = crate::slurm::root::tests::start(crate::slurm::root::tests::step(
            1,
            &crate::slurm::random::secret().unwrap(),
        ));
        let components = Components::default();
        let vars: Vars = vec![("RPMI_SLURM_PORT", "1".into())];
        slot = Some(HetStep { key: (7, 1), vars: Ok(vars), root: Some(root), open: 0, components: components.clone() });
        let mut passed = Vec::new();
        let record = |v: &Vars| {
            passed.push(v[0].1.clone());
            Ok(())
        };
        HetStep::join(&mut slot, (7, 1), id, never, record).unwrap();
        assert_eq!(
            (passed, slot.as_ref().map(|h| h.open), steps(&components).ids.len()),
            (vec!["1".to_string()], Some(1), 1)
        );
        steps(&components).ended = true;
        let e = HetStep::join(&mut slot, (7, 1), id, never, pass).unwrap_err();
        assert!(e.starts_with("a component of heterogeneous step 7.1 started after the step had ended"), "{e}");
        assert_eq!(slot.as_ref().map(|h| h.open), Some(1));
    }

    #[test]
    fn the_collective_port_takes_ipv4() {
        let l = listen().unwrap();
        let port = l.local_addr().unwrap().port();
        std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    }

    #[test]
    fn exit_codes() {
        let code =
            |abort_code, job_error| exit_code(&Outcome { abort_code, ended: true, job_error, spawned_status: None });
        assert_eq!(exit_code(&Outcome::default()), 0);
        assert_eq!(code(Some(7), false), 7);
        assert_eq!(code(Some(-1), false), 255);
        assert_eq!(code(Some(256), false), 0);
        assert_eq!(code(None, true), JOB_ERROR_EXIT_CODE);
        assert_eq!(code(None, false), 0);
        let spawned = Outcome { ended: true, spawned_status: Some(2), ..Outcome::default() };
        assert_eq!(exit_code(&spawned), 2);
    }
}

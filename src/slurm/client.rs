//! The srun side: `mpi_p_client_prelaunch` computes the task map from the step layout, makes the step's
//! secret, starts the collective root and passes what the stepds need in the launch environment;
//! `mpi_p_client_fini` stops the root and hands srun the exit code of a `PMI_Abort`.

use super::layout;
use super::root::{Reporter, Root, Step};
use super::stepd::{ENV_MAP, ENV_PORT, ENV_SECRET};
use super::sys::{self, mpi_plugin_client_info_t, slurm_step_layout_t, Slurm, NO_VAL};
use super::wire::Secret;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::net::TcpListener;
use std::sync::Mutex;

/// What `mpi_p_client_prelaunch` returns to srun (`mpi_plugin_client_state_t *`).
pub struct Client {
    root: Root,
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
    job: u32,
    step: u32,
}

impl Reporter for SrunReporter {
    fn error(&mut self, message: &str) {
        self.slurm.error(message);
    }
    fn info(&mut self, message: &str) {
        self.slurm.info(message);
    }
    fn end_step(&mut self) {
        if let Err(e) = self.slurm.kill_step(self.job, self.step, libc::SIGKILL) {
            self.slurm.error(&format!("cannot end step {}.{}: {e}", self.job, self.step));
        }
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
        let count = *layout.tasks.add(node) as usize;
        let tids = *layout.tids.add(node);
        if count > 0 && tids.is_null() {
            return Err(format!("no task ids for node {node}"));
        }
        for i in 0..count {
            let rank = *tids.add(i) as usize;
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
pub unsafe fn prelaunch(
    info: *const mpi_plugin_client_info_t,
    env: *mut *mut *mut c_char,
) -> Result<*mut c_void, String> {
    let slurm = sys::slurm();
    let info = info.as_ref().ok_or("no step information")?;
    if env.is_null() {
        return Err("no environment".into());
    }
    let (job, step) = (info.step_id.job_id, info.step_id.step_id);
    if info.het_job_id != NO_VAL {
        return Err(format!(
            "step {job}.{step} is part of heterogeneous job {}: mpi/rpmi serves one component at a time; \
             launch the components as separate steps, or use --mpi=pmi2",
            info.het_job_id
        ));
    }
    let layout = info.step_layout.as_ref().ok_or("no step layout")?;
    let node_of = task_map(layout)?;
    let nodes = layout.node_cnt as usize;
    let list = if layout.node_list.is_null() {
        String::new()
    } else {
        CStr::from_ptr(layout.node_list).to_string_lossy().into_owned()
    };
    let node_names = match slurm.expand_nodelist(&list) {
        Ok(names) if names.len() == nodes => names,
        _ => (0..nodes).map(|n| format!("node {n}")).collect(),
    };
    let secret = Secret::generate().map_err(|e| format!("no random bytes for the step's secret: {e}"))?;
    let listener = listen().map_err(|e| format!("cannot open the collective port: {e}"))?;
    let map = layout::encode(&node_of);
    let step_info = Step { node_names, node_of, secret };
    let root = Root::start(listener, step_info, Box::new(SrunReporter { slurm, job, step }))
        .map_err(|e| format!("cannot start the collective root: {e}"))?;
    let text = |s: String| CString::new(s).expect("no NUL");
    for (name, value) in [(ENV_PORT, root.port().to_string()), (ENV_SECRET, secret.to_hex()), (ENV_MAP, map)] {
        slurm.setenv(env, &text(name.to_string()), &text(value))?;
    }
    let client = Box::into_raw(Box::new(Client { root }));
    live().push(client as usize);
    Ok(client.cast())
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
    let client = Box::from_raw(state as *mut Client);
    exit_code(client.root.stop().abort_code)
}

/// srun's exit code for an abort with `code`: as a process would exit with it (its low 8 bits). srun takes
/// any non-zero value over the tasks' statuses, which show only the SIGKILL that ended the step.
pub fn exit_code(abort_code: Option<i32>) -> c_int {
    abort_code.map_or(0, |c| c & 0xff)
}

/// `fini` in srun: stops the roots srun did not give back.
pub fn stop_all() {
    let pending: Vec<usize> = std::mem::take(&mut *live());
    for p in pending {
        // SAFETY: each address is a live client `prelaunch` boxed, taken out of the list once.
        drop(unsafe { Box::from_raw(p as *mut Client) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn task_maps_from_layouts() {
        let mut tasks = [2u16, 1, 3];
        let mut ids = [vec![0u32, 3], vec![1], vec![2, 4, 5]];
        let mut tids: Vec<*mut u32> = ids.iter_mut().map(|v| v.as_mut_ptr()).collect();
        let mut layout: slurm_step_layout_t = unsafe { std::mem::zeroed() };
        layout.node_cnt = 3;
        layout.task_cnt = 6;
        layout.tasks = tasks.as_mut_ptr();
        layout.tids = tids.as_mut_ptr();
        assert_eq!(unsafe { task_map(&layout) }, Ok(vec![0, 1, 2, 0, 2, 2]));
        let last = |v: u32| unsafe { *tids[2].add(2) = v };
        last(3);
        assert!(unsafe { task_map(&layout) }.is_err());
        last(9);
        assert!(unsafe { task_map(&layout) }.is_err());
        layout.task_cnt = 7;
        last(5);
        assert!(unsafe { task_map(&layout) }.unwrap_err().contains("task 6 has no node"));
    }

    #[test]
    fn the_collective_port_takes_ipv4() {
        let l = listen().unwrap();
        let port = l.local_addr().unwrap().port();
        std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    }

    #[test]
    fn exit_codes() {
        assert_eq!(exit_code(None), 0);
        assert_eq!(exit_code(Some(7)), 7);
        assert_eq!(exit_code(Some(-1)), 255);
        assert_eq!(exit_code(Some(256)), 0);
    }
}

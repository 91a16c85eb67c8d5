//! What a slurmstepd decides at prefork before any I/O: from Slurm's step record, the step's environment
//! (srun's, so the user's: every value is checked) and the site's options, the step's plan. Pure functions
//! of plain values, so that every refusal is tested without Slurm; prefork ([`super::prefork`]) reads
//! Slurm's record and environment, asks these, then joins the tree and starts the node.

use super::super::auth::Secret;
use super::super::layout;
use super::super::mpmd;
use super::super::options::{self, Job, Settings, Site, ENV_MAP, ENV_OPTIONS, ENV_PORT, ENV_SECRET, ENV_SPAWN};
use super::super::records::slurm_step_id_t;
use super::super::spawn::Spawn;
use super::super::trace::escape_text;
use crate::collective::{Allgather, Tree};
use crate::server::{JobInfo, TaskMap};

/// The longest text from a task or the environment (an abort message, an environment value) that reaches
/// slurmd's log.
pub const LOGGED_TEXT_MAX: usize = 256;

/// The most nodes a step's node list may name (the largest machines have about 160,000).
pub const NODES_MAX: u32 = 1 << 18;

/// The step as Slurm's step record gives it.
#[derive(Clone)]
pub struct Record {
    pub job: u32,
    pub step: u32,
    /// Slurm's own id of the step (from 24.11 on with its job's sluid), as slurmctld is asked to end it.
    pub id: slurm_step_id_t,
    pub nodes: u32,
    pub tasks: u32,
    /// This node's index in the step, and its task count.
    pub node: u32,
    pub node_tasks: u32,
    /// The job the tasks belong to, as Slurm tells them and the task hook (`SLURM_JOB_ID`): a heterogeneous
    /// job's leader, else `job`.
    pub task_job: u32,
    /// The step runs in a hetjob's allocation (a component's, or one srun runs alone).
    pub in_hetjob: bool,
    /// This step is one component of a heterogeneous step (`srun A : B`): one job of all components' tasks.
    pub component: Option<Component>,
}

/// One component of a heterogeneous step, from Slurm's step record: the whole step is every component's tasks,
/// ranked component after component, on every component's nodes, in the layout srun's side of the plugin
/// sees (`mpi_p_client_prelaunch` gets it merged).
#[derive(Clone)]
pub struct Component {
    /// Its index among the step's components (its tasks' appnum).
    pub index: u32,
    /// The whole step's nodes (each component's counted apart) and tasks.
    pub nodes: u32,
    pub tasks: u32,
    /// The whole step's node list, in the merged layout's order.
    pub node_list: String,
    /// The rank of this component's first task.
    pub task_offset: u32,
    /// The name of this stepd's node (the step record's), which places it in the merged layout.
    pub node_name: String,
}

/// Where this stepd stands: its step and its node.
#[derive(Clone)]
pub struct Place {
    pub job: u32,
    pub step: u32,
    /// Slurm's own id of the step (from 24.11 on with its job's sluid), as slurmctld is asked to end it.
    pub id: slurm_step_id_t,
    /// The step's job is a hetjob's leader (which slurmctld is not asked to end a step of: see
    /// `Slurm::kill_step`).
    pub leads_hetjob: bool,
    pub node: u32,
    pub node_name: String,
}

/// The step's environment, by variable name.
pub type Env<'a> = &'a dyn Fn(&str) -> Option<String>;
/// Slurm's expansion of a node list (`n[1-3]`) into at most so many names.
pub type Expand<'a> = &'a dyn Fn(&str, usize) -> Result<Vec<String>, String>;

/// What prefork does, decided.
pub struct Plan {
    pub place: Place,
    /// The job the tasks belong to ([`Record::task_job`]): the world's job id.
    pub task_job: u32,
    /// The appnum of every task of this node: its component's index, in a heterogeneous step.
    pub appnum: Option<i32>,
    /// Where srun's root listens: `SLURM_SRUN_COMM_HOST` (slurmd's, the address srun's launch came from) and
    /// the port srun passed.
    pub host: String,
    pub port: u16,
    pub secret: Secret,
    /// Every node's name, by node index.
    pub names: Vec<String>,
    /// The node of every rank, and this node's ranks.
    pub node_of: Vec<u32>,
    pub local_ranks: Vec<u32>,
    pub tree: Tree,
    /// How the exchanges go: the job's, else the site's (also when the stepd refuses the step, which it tells
    /// srun with the same HELLO as for the step).
    pub allgather: Allgather,
    /// The job's options held to the site's, or why this stepd refuses the step (which srun is told).
    pub settings: Result<Settings, String>,
    /// Lines for slurmd's log: the step's environment naming another step than Slurm's.
    pub notes: Vec<String>,
}

/// The step's plan, from Slurm's record `rec`, the step's environment `env`, the site's options and
/// `expand`, Slurm's hostlist expansion of the step's node list for at most so many nodes. `None`: srun did
/// not start this step with `--mpi=rpmi`, and it has no PMI.
pub fn plan(rec: &Record, env: Env, expand: Expand, site: &Site) -> Result<Option<Plan>, String> {
    let Some(port) = env(ENV_PORT) else { return Ok(None) };
    let mut notes = Vec::new();
    for (name, value) in [("SLURM_JOB_ID", rec.task_job), ("SLURM_STEP_ID", rec.step)] {
        if let Some(v) = env(name).filter(|v| *v != value.to_string()) {
            notes.push(format!(
                "ignored {name}={} in the step's environment: Slurm runs this step as {}.{}",
                escape_text(&v, LOGGED_TEXT_MAX),
                rec.job,
                rec.step
            ));
        }
    }
    let port: u16 = port.parse().map_err(|_| format!("{ENV_PORT}={} is not a port", escape_text(&port, 32)))?;
    let secret = Secret::from_hex(&need(env, ENV_SECRET)?).ok_or(format!("{ENV_SECRET} is malformed"))?;
    let host = need(env, "SLURM_SRUN_COMM_HOST")?;
    // The whole step: one component's, or every component's.
    let (nodes, tasks, list) = match &rec.component {
        None => (rec.nodes, rec.tasks, need(env, "SLURM_STEP_NODELIST")?),
        Some(c) => (c.nodes, c.tasks, c.node_list.clone()),
    };
    // A heterogeneous step's shape comes from the user's srun: a root slurmstepd expands no more names than
    // the step has tasks, and NODES_MAX at most.
    let names = expand(&list, nodes.min(tasks).min(NODES_MAX) as usize)?;
    let node_of = layout::decode(&need(env, ENV_MAP)?, names.len(), tasks as usize)?;
    if names.len() != nodes as usize || node_of.len() != tasks as usize || rec.node >= rec.nodes {
        return Err(format!(
            "the step's environment describes {} nodes and {} tasks, Slurm's step {}.{} has {} and {}",
            names.len(),
            node_of.len(),
            rec.job,
            rec.step,
            nodes,
            tasks
        ));
    }
    let node = match &rec.component {
        None => rec.node,
        Some(c) => component_node(rec, c, &names, &node_of)?,
    };
    let local_ranks: Vec<u32> = (0..node_of.len() as u32).filter(|&r| node_of[r as usize] == node).collect();
    if local_ranks.len() != rec.node_tasks as usize {
        return Err(format!("{ENV_MAP} puts {} tasks on this node, Slurm {}", local_ranks.len(), rec.node_tasks));
    }
    // The job's options as srun passed them (its user's: checked as anything else), held to mpi.conf's.
    let job = Job::decode(&need(env, ENV_OPTIONS)?)?;
    let settings = options::resolve(site, &job, env("PMI_DEBUG").as_deref());
    let tree = options::step_tree(nodes, options::tree_width(site, &job)).map_err(|e| e.to_string())?;
    let allgather = options::allgather(site, &job);
    let leads_hetjob = rec.task_job == rec.job && rec.in_hetjob;
    let node_name = names[node as usize].clone();
    let place = Place { job: rec.job, step: rec.step, id: rec.id, leads_hetjob, node, node_name };
    let (task_job, appnum) = (rec.task_job, rec.component.as_ref().map(|c| c.index as i32));
    Ok(Some(Plan {
        place,
        task_job,
        appnum,
        host,
        port,
        secret,
        names,
        node_of,
        local_ranks,
        tree,
        allgather,
        settings,
        notes,
    }))
}

/// This stepd's node in a heterogeneous step's merged layout: the node of its name that runs this component's
/// tasks (a node in two components is two nodes of the layout, one for each component's stepd).
fn component_node(rec: &Record, c: &Component, names: &[String], node_of: &[u32]) -> Result<u32, String> {
    let first = c.task_offset as usize;
    let ours = node_of.get(first..first.saturating_add(rec.tasks as usize)).filter(|r| r.len() == rec.tasks as usize);
    let Some(ours) = ours else {
        return Err(format!(
            "component {} of the step ({} tasks from rank {first}) lies beyond the {} tasks of {ENV_MAP}",
            c.index,
            rec.tasks,
            node_of.len()
        ));
    };
    let node = ours.iter().copied().find(|&n| names.get(n as usize) == Some(&c.node_name));
    node.ok_or_else(|| format!("{ENV_MAP} runs none of component {}'s tasks on {}", c.index, c.node_name))
}

/// What this node's shell serves: the job's shape, and in a spawned step its preputs and appnums as the
/// spawning srun passed them on, else a heterogeneous step's component index as every task's appnum, else an
/// `srun --multi-prog` step's appnums (`multi_prog` reads its
/// configuration, if it is one). The task map moves from the plan into it (a step may have 2^24 ranks).
pub fn job_info(plan: &mut Plan, env: Env, multi_prog: impl FnOnce() -> Option<String>) -> Result<JobInfo, String> {
    let tasks = plan.node_of.len();
    let mut info = JobInfo::new(
        // Unique to this instance of the step: MPICH names its shared memory after the kvsname, and tasks that
        // were killed leave theirs behind for a later step with the same ids (job ids start again when
        // slurmctld's state is reset).
        format!("rpmi_{}.{}_{}", plan.task_job, plan.place.step, plan.secret.instance_tag()),
        TaskMap::new(std::mem::take(&mut plan.node_of)),
        plan.local_ranks.clone(),
        plan.names.clone(),
    );
    let spawn = match env(ENV_SPAWN).filter(|v| !v.is_empty()) {
        Some(text) => Some(Spawn::decode(&text)?),
        None => None,
    };
    if let Some(Spawn { job, .. }) = &spawn {
        if job.size() != tasks as u64 {
            return Err(format!("{ENV_SPAWN} describes {} processes, Slurm's step has {}", job.size(), tasks));
        }
        info.appnums = job.appnums(&plan.local_ranks);
        info.preputs = job.pairs();
        info.spawned = true;
    } else if let Some(appnum) = plan.appnum {
        info.appnums = vec![appnum; plan.local_ranks.len()];
    } else if let Some(config) = multi_prog() {
        info.appnums = mpmd::appnums(&config, &plan.local_ranks);
    }
    Ok(info)
}

fn need(env: Env, name: &str) -> Result<String, String> {
    env(name).ok_or_else(|| format!("{name} is not in the step's environment"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::SpawnedJob;
    use crate::slurm::options::Id;
    use std::collections::HashMap;

    fn record(node: u32) -> Record {
        // SAFETY: an all-zero slurm_step_id_t is a valid value of that plain C struct.
        let mut id: slurm_step_id_t = unsafe { std::mem::zeroed() };
        (id.job_id, id.step_id) = (7, 2);
        Record {
            job: 7,
            step: 2,
            id,
            nodes: 3,
            tasks: 6,
            node,
            node_tasks: 2,
            task_job: 7,
            in_hetjob: false,
            component: None,
        }
    }

    /// The environment srun gives a step of 6 ranks in blocks of 2 over n1..n3.
    fn env_of(secret: &Secret) -> HashMap<String, String> {
        let node_of = [0, 0, 1, 1, 2, 2];
        [
            (ENV_PORT, "4567".to_string()),
            (ENV_SECRET, secret.to_hex()),
            ("SLURM_SRUN_COMM_HOST", "10.0.0.1".to_string()),
            ("SLURM_STEP_NODELIST", "n[1-3]".to_string()),
            (ENV_MAP, layout::encode(&node_of)),
            (ENV_OPTIONS, Job::default().encode()),
            ("SLURM_JOB_ID", "7".to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    fn plan_of(rec: Record, env: &HashMap<String, String>, site: &Site) -> Result<Option<Plan>, String> {
        let read = |name: &str| env.get(name).cloned();
        let expand = |list: &str, max: usize| layout::expand_nodelist(list, max);
        plan(&rec, &read, &expand, site)
    }

    #[test]
    fn a_step_srun_did_not_start_with_rpmi_has_no_plan() {
        assert!(plan_of(record(0), &HashMap::new(), &Site::default()).unwrap().is_none());
    }

    #[test]
    fn the_plan_places_this_node_in_its_step() {
        let secret = crate::slurm::random::secret().unwrap();
        let p = plan_of(record(1), &env_of(&secret), &Site::default()).unwrap().unwrap();
        assert_eq!((p.place.job, p.place.step, p.place.node, p.place.node_name.as_str()), (7, 2, 1, "n2"));
        assert_eq!((p.host.as_str(), p.port, p.local_ranks.clone()), ("10.0.0.1", 4567, vec![2, 3]));
        assert_eq!((p.tree.width(), p.names.len()), (crate::collective::DEFAULT_WIDTH, 3));
        assert!(p.settings.is_ok() && p.notes.is_empty());
        let mut p = p;
        let info = job_info(&mut p, &|_| None, || None).unwrap();
        assert_eq!(info.kvsname, format!("rpmi_7.2_{}", secret.instance_tag()));
        assert!(!info.spawned);
    }

    /// The user's environment names another step: Slurm's record wins, and slurmd's log says so.
    #[test]
    fn ids_in_the_environment_are_ignored_and_said() {
        let secret = crate::slurm::random::secret().unwrap();
        let mut env = env_of(&secret);
        env.insert("SLURM_JOB_ID".into(), "99".into());
        let p = plan_of(record(0), &env, &Site::default()).unwrap().unwrap();
        assert_eq!(p.place.job, 7);
        assert_eq!(p.notes, ["ignored SLURM_JOB_ID=99 in the step's environment: Slurm runs this step as 7.2"]);
    }

    #[test]
    fn an_environment_that_disagrees_with_slurm_is_refused_naming_what() {
        let secret = crate::slurm::random::secret().unwrap();
        let refused = |name: &str, value: &str, node: u32| {
            let mut env = env_of(&secret);
            env.insert(name.into(), value.into());
            plan_of(record(node), &env, &Site::default()).err().unwrap_or_else(|| panic!("{name}={value} taken"))
        };
        assert_eq!(refused(ENV_PORT, "x", 0), "RPMI_SLURM_PORT=x is not a port");
        assert_eq!(refused(ENV_SECRET, "00", 0), "RPMI_SLURM_SECRET is malformed");
        // Seven ranks where Slurm's step has six.
        let e = refused(ENV_MAP, &layout::encode(&[0, 0, 1, 1, 2, 2, 2]), 0);
        assert_eq!(e, "RPMI_SLURM_MAP='7:0,2,2;2,1,3': the size is out of range");
        // Node 3 of a 3-node step.
        let mut rec = record(0);
        rec.node = 3;
        let e = plan_of(rec, &env_of(&secret), &Site::default()).err().unwrap();
        assert_eq!(e, "the step's environment describes 3 nodes and 6 tasks, Slurm's step 7.2 has 3 and 6");
        // Three ranks on node 0 where Slurm runs two there.
        assert_eq!(
            refused(ENV_MAP, &layout::encode(&[0, 0, 0, 1, 2, 2]), 0),
            "RPMI_SLURM_MAP puts 3 tasks on this node, Slurm 2"
        );
        let mut env = env_of(&secret);
        env.remove("SLURM_SRUN_COMM_HOST");
        let e = plan_of(record(0), &env, &Site::default()).err().unwrap();
        assert_eq!(e, "SLURM_SRUN_COMM_HOST is not in the step's environment");
    }

    /// A job that asks more than the site's ceiling gets a plan that refuses the step, so that srun hears why.
    #[test]
    fn a_job_over_the_sites_ceiling_is_refused_with_the_reason() {
        let secret = crate::slurm::random::secret().unwrap();
        let mut site = Site::default();
        site.set(Id::RequestLineMax, "2048".into());
        let mut env = env_of(&secret);
        let job = Job::from_env([("SLURM_RPMI_REQUEST_LINE_MAX".to_string(), "4096".to_string())]).unwrap();
        env.insert(ENV_OPTIONS.into(), job.encode());
        let p = plan_of(record(0), &env, &site).unwrap().unwrap();
        let why = p.settings.err().unwrap();
        assert!(
            why.contains("SLURM_RPMI_REQUEST_LINE_MAX=4096 asks more than this site allows: at most 2048"),
            "{why}"
        );
    }

    #[test]
    fn a_spawned_steps_preputs_and_appnums_and_an_mpmd_steps_appnums() {
        let secret = crate::slurm::random::secret().unwrap();
        let env = env_of(&secret);
        let plan = || plan_of(record(1), &env, &Site::default()).unwrap().unwrap();
        let job = SpawnedJob { counts: vec![3, 3], preputs: vec![("k".into(), "v".into())] };
        let spawn = Spawn { job, fd: None };
        let text = spawn.encode();
        let read = |name: &str| (name == ENV_SPAWN).then(|| text.clone());
        let info = job_info(&mut plan(), &read, || panic!("a spawned step is no MPMD step")).unwrap();
        // Ranks 2 and 3: the first command's last rank, the second's first.
        assert_eq!((info.appnums.clone(), info.spawned), (vec![0, 1], true));
        assert_eq!(info.preputs.len(), 1);
        // Processes that are not Slurm's step.
        let wrong = Spawn { job: SpawnedJob { counts: vec![2], ..spawn.job }, ..spawn }.encode();
        let read = |name: &str| (name == ENV_SPAWN).then(|| wrong.clone());
        let e = job_info(&mut plan(), &read, || None).err().unwrap();
        assert_eq!(e, "RPMI_SLURM_SPAWN describes 2 processes, Slurm's step has 6");
        // srun --multi-prog: each rank's line.
        let info = job_info(&mut plan(), &|_| None, || Some("0-2 ./a\n3-5 ./b\n".into())).unwrap();
        assert_eq!(info.appnums, vec![0, 1]);
    }

    /// Component `index` of `srun -n2 A : -n3 B` (job 7 leads, the second component is job 8), on `node_name`,
    /// with `tasks` of its own on that node: the merged layout n1 (ranks 0-1), n2 (2-3), n3 (4).
    fn component_record(index: u32, node_name: &str, node: u32, node_tasks: u32) -> Record {
        let (job, tasks, nodes, task_offset) = if index == 0 { (7, 2, 1, 0) } else { (8, 3, 2, 2) };
        let mut rec = record(node);
        (rec.job, rec.id.job_id, rec.nodes, rec.tasks, rec.node_tasks) = (job, job, nodes, tasks, node_tasks);
        (rec.task_job, rec.in_hetjob) = (7, true);
        let node_name = node_name.to_string();
        rec.component =
            Some(Component { index, nodes: 3, tasks: 5, node_list: "n[1-3]".into(), task_offset, node_name });
        rec
    }

    #[test]
    fn a_component_of_a_heterogeneous_step_serves_its_nodes_part_of_the_whole_step() {
        let secret = crate::slurm::random::secret().unwrap();
        let mut env = env_of(&secret);
        env.insert(ENV_MAP.into(), layout::encode(&[0, 0, 1, 1, 2]));
        // The second component's second node (its node 1) is n3, the merged layout's node 2.
        let mut p = plan_of(component_record(1, "n3", 1, 1), &env, &Site::default()).unwrap().unwrap();
        assert_eq!((p.place.node, p.place.job, p.task_job, p.local_ranks.clone()), (2, 8, 7, vec![4]));
        assert!(!p.place.leads_hetjob);
        assert_eq!((p.tree.nodes(), p.names.len()), (3, 3));
        // SLURM_JOB_ID is the leader's in every component: no note.
        assert!(p.notes.is_empty());
        let info = job_info(&mut p, &|_| None, || panic!("a component's appnum is its index")).unwrap();
        assert_eq!((info.appnums, info.task_map.size()), (vec![1], 5));
        assert_eq!(info.kvsname, format!("rpmi_7.2_{}", secret.instance_tag()));
        let p = plan_of(component_record(0, "n1", 0, 2), &env, &Site::default()).unwrap().unwrap();
        assert_eq!((p.place.node, p.local_ranks, p.appnum), (0, vec![0, 1], Some(0)));
        // Job 7 leads the hetjob, job 8 is its second component.
        assert!(p.place.leads_hetjob);
    }

    #[test]
    fn a_component_that_the_layout_does_not_place_is_refused_naming_it() {
        let secret = crate::slurm::random::secret().unwrap();
        let mut env = env_of(&secret);
        env.insert(ENV_MAP.into(), layout::encode(&[0, 0, 1, 1, 2]));
        let e = plan_of(component_record(1, "n1", 0, 2), &env, &Site::default()).err().unwrap();
        assert_eq!(e, "RPMI_SLURM_MAP runs none of component 1's tasks on n1");
        let mut rec = component_record(1, "n2", 0, 2);
        rec.component.as_mut().unwrap().task_offset = 3;
        let e = plan_of(rec, &env, &Site::default()).err().unwrap();
        assert_eq!(e, "component 1 of the step (3 tasks from rank 3) lies beyond the 5 tasks of RPMI_SLURM_MAP");
        // Four ranks where the whole step has five.
        env.insert(ENV_MAP.into(), layout::encode(&[0, 0, 1, 1]));
        let e = plan_of(component_record(0, "n1", 0, 2), &env, &Site::default()).err().unwrap();
        assert_eq!(e, "the step's environment describes 3 nodes and 4 tasks, Slurm's step 7.2 has 3 and 5");
    }
}

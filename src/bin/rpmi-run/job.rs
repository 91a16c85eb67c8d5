//! What one job of rpmi-run runs: its applications (one, or several in an MPMD launch `-n 2 ./a : -n 3 ./b`,
//! or the commands of a spawn), each with its ranks' appnum, and what a spawned job also gets: the spawner's
//! preputs, `PMI_SPAWNED`, the universe size. A spawned job is run by an rpmi-run of its own, which reads its
//! [`Job`] as JSON from the rpmi-run that started it (see `services`).

use rpmi::collective::Allgather;
use rpmi::launch;
use serde_json::{json, Value};
use std::ffi::OsString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// One application: `n` tasks of one program.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct App {
    pub n: u32,
    /// The program and its arguments.
    pub program: Vec<OsString>,
    /// The tasks' working directory (a spawn's `wdir`); `None`: rpmi-run's own.
    pub wdir: Option<PathBuf>,
    /// Where to look for the program, and the tasks' `PATH` (a spawn's `path`); `None`: rpmi-run's own PATH.
    pub path: Option<OsString>,
}

impl App {
    pub fn new(n: u32, program: Vec<OsString>) -> App {
        App { n, program, wdir: None, path: None }
    }
}

/// What every job of one rpmi-run launch shares, and what is each job's own.
#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    pub apps: Vec<App>,
    /// The job's id: `run<pid>-<clock>` for the first, and `.<k>` after it for the k-th spawned.
    pub job_id: String,
    /// Keys in the job's key-value space before it starts (a spawn's preputs).
    pub preputs: Vec<(String, String)>,
    pub spawned: bool,
    /// `PMI_Get_universe_size`; 0: the job's size.
    pub universe: u32,
    /// How to run it, as the first job was asked to run: virtual nodes (at most one per task), tree width,
    /// rank placement, labels, trace, event loop, plugin options and the plugin's path.
    pub nodes: u32,
    pub tree_width: u32,
    /// How an exchange's parts reach every node.
    pub allgather: Allgather,
    pub cyclic: bool,
    pub label: bool,
    pub trace: bool,
    pub event_loop: bool,
    pub options: serde_json::Map<String, Value>,
    pub plugin: Option<PathBuf>,
}

impl Job {
    /// The processes of each application.
    fn counts(&self) -> Vec<u32> {
        self.apps.iter().map(|a| a.n).collect()
    }

    /// The job's size (a launch or a spawn of at most `u32::MAX` processes: rpmi-run's options and
    /// [`rpmi::launch::SPAWN_PROCS_MAX`] bound it).
    pub fn size(&self) -> u32 {
        u32::try_from(launch::size(&self.counts())).unwrap_or(u32::MAX)
    }

    /// The appnum of each rank: its application's index.
    pub fn appnums(&self) -> Vec<i32> {
        let ranks: Vec<u32> = (0..self.size()).collect();
        launch::appnums(&self.counts(), &ranks)
    }

    /// The job as the rpmi-run that runs it reads it (see [`Job::from_json`]).
    pub fn to_json(&self) -> Vec<u8> {
        let text = |s: &OsString| s.to_string_lossy().into_owned();
        let apps: Vec<Value> = self
            .apps
            .iter()
            .map(|a| {
                json!({
                    "n": a.n,
                    "program": a.program.iter().map(text).collect::<Vec<_>>(),
                    "wdir": a.wdir.as_ref().map(|w| w.to_string_lossy().into_owned()),
                    "path": a.path.as_ref().map(text),
                })
            })
            .collect();
        json!({
            "apps": apps,
            "job_id": self.job_id,
            "preputs": self.preputs,
            "spawned": self.spawned,
            "universe": self.universe,
            "nodes": self.nodes,
            "tree_width": self.tree_width,
            "allgather": self.allgather.name(),
            "cyclic": self.cyclic,
            "label": self.label,
            "trace": self.trace,
            "event_loop": self.event_loop,
            "options": self.options,
            "plugin": self.plugin.as_ref().map(|p| p.to_string_lossy().into_owned()),
        })
        .to_string()
        .into_bytes()
    }

    /// Reads what [`Job::to_json`] wrote.
    pub fn from_json(bytes: &[u8]) -> Result<Job, String> {
        let v: Value = serde_json::from_slice(bytes).map_err(|e| format!("a job description that is not JSON: {e}"))?;
        let bad = |what: &str| format!("a job description without a valid '{what}'");
        let u32_of = |key: &str| v[key].as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| bad(key));
        let bool_of = |key: &str| v[key].as_bool().ok_or_else(|| bad(key));
        let str_of = |v: &Value| v.as_str().map(str::to_string);
        let mut apps = Vec::new();
        for a in v["apps"].as_array().ok_or_else(|| bad("apps"))? {
            let n = a["n"].as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| bad("apps.n"))?;
            let program: Option<Vec<OsString>> =
                a["program"].as_array().and_then(|p| p.iter().map(|s| str_of(s).map(OsString::from)).collect());
            let program = program.filter(|p| !p.is_empty()).ok_or_else(|| bad("apps.program"))?;
            let wdir = str_of(&a["wdir"]).map(PathBuf::from);
            let path = str_of(&a["path"]).map(OsString::from);
            apps.push(App { n, program, wdir, path });
        }
        let mut preputs = Vec::new();
        for pair in v["preputs"].as_array().ok_or_else(|| bad("preputs"))? {
            match (pair[0].as_str(), pair[1].as_str()) {
                (Some(k), Some(v)) => preputs.push((k.to_string(), v.to_string())),
                _ => return Err(bad("preputs")),
            }
        }
        Ok(Job {
            apps,
            job_id: str_of(&v["job_id"]).ok_or_else(|| bad("job_id"))?,
            preputs,
            spawned: bool_of("spawned")?,
            universe: u32_of("universe")?,
            nodes: u32_of("nodes")?,
            tree_width: u32_of("tree_width")?,
            allgather: str_of(&v["allgather"])
                .and_then(|a| Allgather::from_name(&a))
                .ok_or_else(|| bad("allgather"))?,
            cyclic: bool_of("cyclic")?,
            label: bool_of("label")?,
            trace: bool_of("trace")?,
            event_loop: bool_of("event_loop")?,
            options: v["options"].as_object().cloned().ok_or_else(|| bad("options"))?,
            plugin: str_of(&v["plugin"]).map(PathBuf::from),
        })
    }
}

/// The file `program` names, as exec would run it from `wdir`: a name with a `/` relative to `wdir`, else the
/// first executable file of that name in `path` (or rpmi-run's PATH, relative entries relative to `wdir`),
/// made absolute (the task execs it once in `wdir`). `Err`: why it cannot be started, as errno.
pub fn resolve(program: &OsString, wdir: Option<&Path>, path: Option<&OsString>) -> Result<PathBuf, i32> {
    let found = find(program, wdir, path)?;
    match found.is_absolute() {
        true => Ok(found),
        false => {
            std::env::current_dir().map(|here| here.join(found)).map_err(|e| e.raw_os_error().unwrap_or(libc::ENOENT))
        }
    }
}

fn find(program: &OsString, wdir: Option<&Path>, path: Option<&OsString>) -> Result<PathBuf, i32> {
    let executable = |p: &Path| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
    if program.as_bytes().contains(&b'/') {
        let p = match wdir {
            Some(w) => w.join(program),
            None => PathBuf::from(program),
        };
        return match std::fs::metadata(&p) {
            Err(e) => Err(e.raw_os_error().unwrap_or(libc::ENOENT)),
            Ok(_) if !executable(&p) => Err(libc::EACCES),
            Ok(_) => Ok(p),
        };
    }
    let search = path.cloned().or_else(|| std::env::var_os("PATH")).unwrap_or_else(|| "/usr/bin:/bin".into());
    std::env::split_paths(&search)
        .map(|dir| {
            let dir = match wdir {
                Some(w) if dir.is_relative() => w.join(dir),
                _ => dir,
            };
            dir.join(program)
        })
        .find(|p| executable(p))
        .ok_or(libc::ENOENT)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job() -> Job {
        Job {
            apps: vec![
                App::new(2, vec!["./a".into(), "x y".into()]),
                App { n: 3, program: vec!["b".into()], wdir: Some("/tmp".into()), path: Some("/bin".into()) },
            ],
            job_id: "run7.1".into(),
            preputs: vec![("PARENT_ROOT_PORT_NAME".into(), "tag#0$description#x$".into())],
            spawned: true,
            universe: 9,
            nodes: 2,
            tree_width: 4,
            allgather: Allgather::Bruck,
            cyclic: true,
            label: false,
            trace: true,
            event_loop: false,
            options: serde_json::from_str(r#"{"vallen_max": 512}"#).unwrap(),
            plugin: Some("/x/librpmi.so".into()),
        }
    }

    #[test]
    fn a_job_reads_back_as_it_was_written() {
        let job = job();
        assert_eq!(Job::from_json(&job.to_json()), Ok(job));
    }

    #[test]
    fn each_rank_has_its_applications_appnum() {
        assert_eq!(job().appnums(), [0, 0, 1, 1, 1]);
        assert_eq!(job().size(), 5);
    }

    #[test]
    fn a_description_with_a_field_missing_or_of_the_wrong_kind_is_refused() {
        let mut v: Value = serde_json::from_slice(&job().to_json()).unwrap();
        v["apps"][0]["program"] = json!([]);
        assert!(Job::from_json(v.to_string().as_bytes()).unwrap_err().contains("apps.program"));
        v["apps"][0]["program"] = json!(["a"]);
        v["nodes"] = json!(-1);
        assert!(Job::from_json(v.to_string().as_bytes()).unwrap_err().contains("nodes"));
        assert!(Job::from_json(b"{").is_err());
    }

    #[test]
    fn programs_are_found_as_exec_finds_them() {
        assert_eq!(resolve(&"sh".into(), None, Some(&"/nonexistent:/bin".into())), Ok("/bin/sh".into()));
        assert_eq!(resolve(&"no-such-program-rpmi".into(), None, None), Err(libc::ENOENT));
        assert_eq!(resolve(&"./sh".into(), Some(Path::new("/bin")), None), Ok("/bin/./sh".into()));
        assert_eq!(resolve(&"/etc/passwd".into(), None, None), Err(libc::EACCES));
        assert_eq!(resolve(&"./missing".into(), Some(Path::new("/")), None), Err(libc::ENOENT));
        // Relative to rpmi-run's directory, so that the task, which execs it once in `wdir`, finds it.
        let here = std::env::current_dir().unwrap();
        let dir = here.join("target/resolve-test");
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::copy("/bin/sh", dir.join("sub/prog")).unwrap();
        let relative = dir.strip_prefix(&here).unwrap().join("sub");
        assert_eq!(resolve(&"./prog".into(), Some(&relative), None), Ok(here.join(&relative).join("./prog")));
        assert_eq!(
            resolve(&"prog".into(), Some(&relative), Some(&".".into())),
            Ok(here.join(&relative).join("./prog"))
        );
    }
}

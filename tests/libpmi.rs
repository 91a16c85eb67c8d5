//! `libpmi.so.0` (crates/libpmi): a C program that calls every function of the PMI-1 API, linked against
//! the library, under rpmi-run (one node and several), under MPICH's Hydra (a foreign PMI-1 server), and with
//! no launcher at all (a job of one). The Slurm cases are in tests/slurm.rs.
//!
//! The library is the one `cargo build` made beside this test (`target/<profile>/libpmi.so`); the program
//! finds it as `libpmi.so.0` through a directory of its own on its run path, so that a system's Slurm
//! `libpmi.so.0` is never taken instead.

mod support;

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;
use support::{compile_with, rpmi_run, run, Done};

/// `tests/programs/pmi_api.c`, built against this tree's `libpmi.so.0` in a temporary directory.
struct Program {
    _dir: tempdir::Dir,
    path: PathBuf,
}

mod tempdir {
    use std::path::{Path, PathBuf};

    /// A directory removed when dropped.
    pub struct Dir(PathBuf);

    impl Dir {
        pub fn new(what: &str) -> Dir {
            let path = std::env::temp_dir().join(format!("rpmi-{what}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&path);
            std::fs::create_dir_all(&path).unwrap();
            Dir(path)
        }
        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// The library `cargo build` made in this test's profile directory.
fn library() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile = exe.parent().and_then(Path::parent).unwrap();
    let lib = profile.join("libpmi.so");
    assert!(lib.exists(), "{} is missing: `cargo build` (the workspace) makes it before the tests", lib.display());
    lib
}

fn program() -> Program {
    let dir = tempdir::Dir::new(&format!("libpmi-{:?}", std::thread::current().id()).replace(['(', ')'], ""));
    let lib = library();
    std::os::unix::fs::symlink(&lib, dir.path().join("libpmi.so.0")).unwrap();
    let include = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/libpmi/include");
    let (i, l, rpath) = (
        format!("-I{}", include.display()),
        format!("-L{}", lib.parent().unwrap().display()),
        format!("-Wl,-rpath,{}", dir.path().display()),
    );
    let args = [OsStr::new(&i), OsStr::new(&l), OsStr::new("-lpmi"), OsStr::new(&rpath)];
    let path = compile_with("cc", "pmi_api", dir.path(), &args);
    Program { _dir: dir, path }
}

/// Every rank printed its line and the job succeeded; the lines' `groups=` values.
fn ranks_ok(done: &Done, size: usize) -> Vec<String> {
    done.assert_success("pmi_api");
    let mut lines: Vec<&str> = done.stdout.lines().filter(|l| l.contains(": ok ")).collect();
    lines.sort();
    assert_eq!(lines.len(), size, "{}", done.dump());
    for r in 0..size {
        assert!(lines.iter().any(|l| l.starts_with(&format!("rank {r} of {size}: ok"))), "{}", done.dump());
    }
    lines.iter().map(|l| l.rsplit(' ').next().unwrap_or_default().to_string()).collect()
}

#[test]
fn every_call_under_rpmi_run_on_one_node_and_on_three() {
    let p = program();
    let path = p.path.to_str().unwrap();
    let one = rpmi_run(&["-n", "4", path]);
    // rpmi's server answers PMI 1.2: the group barrier is served.
    assert!(ranks_ok(&one, 4).iter().all(|g| g == "groups=1"), "{}", one.dump());
    assert!(one.stdout.lines().filter(|l| l.contains("clique=4")).count() == 4, "{}", one.dump());
    let three = rpmi_run(&["-n", "6", "--nodes", "3", path]);
    ranks_ok(&three, 6);
    assert!(three.stdout.lines().filter(|l| l.contains("clique=2")).count() == 6, "{}", three.dump());
}

#[test]
fn a_program_without_a_launcher_is_a_job_of_one() {
    let p = program();
    let mut cmd = Command::new(&p.path);
    cmd.arg("alone");
    for var in ["PMI_FD", "PMI_PORT", "PMI_RANK", "PMI_SIZE", "PMI_ID", "RPMI_PMI_SUBVERSION"] {
        cmd.env_remove(var);
    }
    let done = support::start_in(cmd, &[] as &[&str], &[]).wait(support::GUARD);
    assert_eq!(ranks_ok(&done, 1), ["groups=1"]);
}

#[test]
fn an_abort_ends_the_job_with_its_code_and_message() {
    let p = program();
    let done = rpmi_run(&["-n", "4", p.path.to_str().unwrap(), "abort"]);
    assert_eq!(done.code(), Some(7), "{}", done.dump());
    assert!(done.stderr.contains("pmi_api: rank 1 aborts on purpose"), "{}", done.dump());
}

/// MPICH's Hydra serves PMI 1.1 on `PMI_FD`: the library asks it for no more (Hydra ends a job whose client
/// does), and the group barrier says it is not served.
#[test]
fn every_call_under_hydra() {
    if Command::new("mpiexec.hydra").arg("--version").output().is_err() {
        panic!("mpiexec.hydra is missing: {}", support::INSTALL_HINT);
    }
    let p = program();
    let done = run("mpiexec.hydra", &["-n", "4", p.path.to_str().unwrap()]);
    assert!(ranks_ok(&done, 4).iter().all(|g| g == "groups=0"), "{}", done.dump());
}

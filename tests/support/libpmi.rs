//! `libpmi.so.0` and `libpmi2.so.0` (crates/libpmi, crates/libpmi2) for the tests that run programs through
//! them: the libraries `cargo build` made beside the test (`target/<profile>/libpmi.so`, `libpmi2.so`), and
//! `tests/programs/pmi_api.c` and `pmi2_api.c` built against them. A program finds its library by its soname
//! through a directory of its own on its run path, so that a system's Slurm `libpmi.so.0` or `libpmi2.so.0` is
//! never taken instead.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// A test program built against this tree's library, in a temporary directory.
pub struct Program {
    _dir: tempdir::Dir,
    pub path: PathBuf,
}

pub mod tempdir {
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

/// Which of the two libraries: PMI-1's `libpmi.so.0` or PMI-2's `libpmi2.so.0`.
#[derive(Clone, Copy, Debug)]
pub enum Api {
    Pmi1,
    Pmi2,
}

impl Api {
    /// The library's name, its crate's directory, and the test program that calls every function of it.
    fn parts(self) -> (&'static str, &'static str, &'static str) {
        match self {
            Api::Pmi1 => ("pmi", "crates/libpmi", "pmi_api"),
            Api::Pmi2 => ("pmi2", "crates/libpmi2", "pmi2_api"),
        }
    }

    /// The library `cargo build` made in this test's profile directory.
    pub fn built(self) -> PathBuf {
        let exe = std::env::current_exe().unwrap();
        let profile = exe.parent().and_then(Path::parent).unwrap();
        let lib = profile.join(format!("lib{}.so", self.parts().0));
        assert!(lib.exists(), "{} is missing: `cargo build` (the workspace) makes it before the tests", lib.display());
        lib
    }

    /// Its file name as programs load it.
    pub fn soname(self) -> String {
        format!("lib{}.so.0", self.parts().0)
    }
}

/// A directory of the test's own holding `libpmi.so.0` and `libpmi2.so.0`, links to the libraries.
pub fn library_dir() -> tempdir::Dir {
    let dir = tempdir::Dir::new(&format!("libpmi-{:?}", std::thread::current().id()).replace(['(', ')'], ""));
    for api in [Api::Pmi1, Api::Pmi2] {
        std::os::unix::fs::symlink(api.built(), dir.path().join(api.soname())).unwrap();
    }
    dir
}

/// `tests/programs/pmi_api.c` (PMI-1) or `pmi2_api.c` (PMI-2), built against this tree's library.
pub fn program(api: Api) -> Program {
    let dir = library_dir();
    let (name, crate_dir, program) = api.parts();
    let lib = api.built();
    let include = Path::new(env!("CARGO_MANIFEST_DIR")).join(crate_dir).join("include");
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/programs/{program}.c"));
    let path = dir.path().join(program);
    let out = Command::new("cc")
        .args(["-O1", "-Wall", "-Wextra", "-o"])
        .arg(&path)
        .arg(&source)
        .arg(format!("-I{}", include.display()))
        .arg(format!("-L{}", lib.parent().unwrap().display()))
        .args([&format!("-l{name}"), "-pthread"])
        .arg(format!("-Wl,-rpath,{}", dir.path().display()))
        .output()
        .expect("cc (build-essential)");
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "cc {} failed or warned:\n{}",
        source.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    Program { _dir: dir, path }
}

/// What `pmi_api spawn` and `pmi2_api spawn` print when it worked: every rank of a job of `size` says it
/// spawned, and both spawned tasks read the preput.
pub fn spawned_and_read(stdout: &str, size: usize) -> bool {
    let mut lines: Vec<&str> = stdout.lines().filter(|l| l.contains(": ok")).collect();
    lines.sort();
    let mut want = vec!["child 0 of 2: ok".to_string(), "child 1 of 2: ok".to_string()];
    want.extend((0..size).map(|r| format!("rank {r} of {size}: ok spawned")));
    lines == want
}

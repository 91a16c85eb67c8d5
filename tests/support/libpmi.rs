//! `libpmi.so.0` (crates/libpmi) for the tests that run programs through it: the library `cargo build` made
//! beside the test (`target/<profile>/libpmi.so`), and `tests/programs/pmi_api.c` built against it. A program
//! finds the library as `libpmi.so.0` through a directory of its own on its run path, so that a system's
//! Slurm `libpmi.so.0` is never taken instead.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// `tests/programs/pmi_api.c`, built against this tree's `libpmi.so.0` in a temporary directory.
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

/// The library `cargo build` made in this test's profile directory.
fn library() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile = exe.parent().and_then(Path::parent).unwrap();
    let lib = profile.join("libpmi.so");
    assert!(lib.exists(), "{} is missing: `cargo build` (the workspace) makes it before the tests", lib.display());
    lib
}

/// A directory of the test's own holding `libpmi.so.0`, a link to the library.
pub fn library_dir() -> tempdir::Dir {
    let dir = tempdir::Dir::new(&format!("libpmi-{:?}", std::thread::current().id()).replace(['(', ')'], ""));
    std::os::unix::fs::symlink(library(), dir.path().join("libpmi.so.0")).unwrap();
    dir
}

pub fn program() -> Program {
    let dir = library_dir();
    let lib = library();
    let include = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/libpmi/include");
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/programs/pmi_api.c");
    let path = dir.path().join("pmi_api");
    let out = Command::new("cc")
        .args(["-O1", "-Wall", "-Wextra", "-o"])
        .arg(&path)
        .arg(&source)
        .arg(format!("-I{}", include.display()))
        .arg(format!("-L{}", lib.parent().unwrap().display()))
        .args(["-lpmi", "-pthread"])
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

//! Generates the Rust side of the plugin ABI from `plugin-spec/rpmi_plugin.h` (through `wrapper.h`).

use std::env;
use std::path::{Path, PathBuf};

/// The Slurm release lines the plugin supports: (major, minor) and the `slurm` cfg value that selects
/// `src/slurm/version/`'s module for it.
const SLURM_LINES: &[(u32, u32, &str)] = &[(22, 5, "22.05"), (24, 11, "24.11"), (26, 5, "26.05")];

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-changed=plugin-spec/rpmi_plugin.h");
    println!("cargo::rustc-check-cfg=cfg(slurm, values(\"22.05\", \"24.11\", \"26.05\"))");
    let bindings = bindgen::Builder::default()
        .header("wrapper.h")
        .allowlist_type("rpmi_.*")
        .allowlist_function("rpmi_.*")
        .allowlist_var("RPMI_.*")
        // The header's codes are ints; keep them signed so they compare with the functions' int results.
        .default_macro_constant_type(bindgen::MacroTypeVariation::Signed)
        .generate()
        .unwrap_or_else(|e| panic!("bindgen could not read plugin-spec/rpmi_plugin.h: {e}"));
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("rpmi_plugin.rs");
    bindings.write_to_file(&out).unwrap_or_else(|e| panic!("cannot write {}: {e}", out.display()));
    if env::var_os("CARGO_FEATURE_SLURM").is_some() {
        slurm_bindings();
    }
}

/// The `slurm` feature: the few public Slurm types and constants `src/slurm/` reads, from `<slurm/slurm.h>`
/// (libslurm-dev) under `SLURM_INCLUDE_DIR` (default `/usr/include`), so that `plugin_version` always matches
/// the Slurm the plugin is built against; and the release line, from the same headers, as `cfg(slurm)`.
fn slurm_bindings() {
    println!("cargo:rerun-if-env-changed=SLURM_INCLUDE_DIR");
    let include = PathBuf::from(env::var_os("SLURM_INCLUDE_DIR").unwrap_or_else(|| "/usr/include".into()));
    println!("cargo:rerun-if-changed={}", include.join("slurm/slurm.h").display());
    println!("cargo::rustc-cfg=slurm=\"{}\"", slurm_line(&include));
    let bindings = bindgen::Builder::default()
        .header("wrapper.h")
        .clang_arg("-DRPMI_SLURM")
        // Searched before /usr/include, so that a host's own libslurm-dev cannot shadow the headers asked for;
        // only their slurm/ (a chroot's libc headers would not match this system's).
        .clang_arg(format!("-I{}", slurm_only(&include).display()))
        .allowlist_type("slurm_step_layout_t")
        .allowlist_type("slurm_step_id_t")
        .allowlist_var("SLURM_VERSION_NUMBER")
        .allowlist_var("NO_VAL")
        .allowlist_var("SLURM_SUCCESS")
        .allowlist_var("SLURM_ERROR")
        .generate()
        .unwrap_or_else(|e| {
            panic!("bindgen could not read {}/slurm/slurm.h (is libslurm-dev installed?): {e}", include.display())
        });
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("slurm.rs");
    bindings.write_to_file(&out).unwrap_or_else(|e| panic!("cannot write {}: {e}", out.display()));
}

/// A directory in OUT_DIR that holds only `slurm/`, a link to `<include>/slurm`.
fn slurm_only(include: &Path) -> PathBuf {
    let dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("slurm-include");
    let link = dir.join("slurm");
    let _ = std::fs::remove_file(&link);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("cannot make {}: {e}", dir.display()));
    std::os::unix::fs::symlink(include.join("slurm"), &link)
        .unwrap_or_else(|e| panic!("cannot link {}: {e}", link.display()));
    dir
}

/// The supported release line `<include>/slurm/slurm_version.h` names; any other fails the build, since the
/// private structs Slurm hands the plugin are laid out per line (`src/slurm/version/`).
fn slurm_line(include: &Path) -> &'static str {
    let path = include.join("slurm/slurm_version.h");
    println!("cargo:rerun-if-changed={}", path.display());
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "cannot read {}: {e}; install libslurm-dev, or set SLURM_INCLUDE_DIR to the directory that holds slurm/",
            path.display()
        )
    });
    let number = text
        .lines()
        .find_map(|line| {
            let mut words = line.split_whitespace();
            let define = words.next() == Some("#define") && words.next() == Some("SLURM_VERSION_NUMBER");
            define.then(|| words.next()).flatten()
        })
        .and_then(|v| u32::from_str_radix(v.trim_start_matches("0x"), 16).ok())
        .unwrap_or_else(|| panic!("{} has no `#define SLURM_VERSION_NUMBER 0x...`", path.display()));
    let (major, minor, micro) = (number >> 16 & 0xff, number >> 8 & 0xff, number & 0xff);
    SLURM_LINES.iter().find(|&&(a, b, _)| (a, b) == (major, minor)).map(|&(_, _, line)| line).unwrap_or_else(|| {
        panic!(
            "the Slurm plugin does not support Slurm {major}.{minor:02}.{micro} (SLURM_VERSION_NUMBER {number:#08x} \
             in {}): it supports 22.05, 24.11 and 26.05. Another release line needs its own module in \
             src/slurm/version/, checked against that release's MPI plugin structs.",
            path.display()
        )
    })
}

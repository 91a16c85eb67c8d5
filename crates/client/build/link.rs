//! How the client libraries (`libpmi.so.0`, `libpmi2.so.0`) are linked; their build scripts include this file.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Names the library `soname`, and links the unwinder into it from `libgcc_eh.a` instead of `libgcc_s.so.1`.
///
/// Rust's std asks for `-lgcc_s`, the unwinder its panics need: one more library for every process of the job
/// to load at start, whose constructor also probes the CPU (`cpuid`, a trap to the hypervisor on a virtual
/// machine). A linker script of that name in this build's own directory, found before the system's, makes
/// `-lgcc_s` take `libgcc_eh.a` instead, as `gcc -static-libgcc` does for a shared library. rustc's version
/// script exports only the PMI API, so the unwinder stays local: it unwinds this library's panics (each
/// caught at the C boundary) and never meets the program's own. The search path reaches whatever links
/// against this crate too: nothing does (both are cdylibs only). Where the toolchain has no `libgcc_eh.a`
/// (not GNU, or a compiler without it), the library links as Rust links it, with `libgcc_s.so.1`.
pub fn client_library(soname: &str) {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,{soname}");
    let gnu = std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux")
        && std::env::var("CARGO_CFG_TARGET_ENV").as_deref() == Ok("gnu");
    // `cc -print-file-name` answers the bare name when it finds no such file.
    let found = Command::new("cc")
        .arg("-print-file-name=libgcc_eh.a")
        .output()
        .ok()
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .is_some_and(|path| Path::new(path.trim()).is_absolute());
    if !(gnu && found) {
        println!("cargo:warning=no libgcc_eh.a for this target: {soname} loads libgcc_s.so.1");
        return;
    }
    let dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    std::fs::write(dir.join("libgcc_s.so"), "INPUT(-lgcc_eh)\n").expect("OUT_DIR is writable");
    println!("cargo:rustc-link-search=native={}", dir.display());
}

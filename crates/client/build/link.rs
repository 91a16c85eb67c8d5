//! How the client libraries (`libpmi.so.0`, `libpmi2.so.0`) are linked; their build scripts include this file.

use std::path::PathBuf;

/// Names the library `soname`, and links the unwinder into it from `libgcc_eh.a` instead of `libgcc_s.so.1`.
///
/// Rust's std asks for `-lgcc_s`, the unwinder its panics need: one more library for every process of the job
/// to load at start, whose constructor also probes the CPU (`cpuid`, a trap to the hypervisor on a virtual
/// machine). A linker script of that name in this build's own directory, found before the system's, makes
/// `-lgcc_s` take `libgcc_eh.a` instead, as `gcc -static-libgcc` does for a shared library. rustc's version
/// script exports only the PMI API, so the unwinder stays local: it unwinds this library's panics (each
/// caught at the C boundary) and never meets the program's own.
pub fn client_library(soname: &str) {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,{soname}");
    let dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    std::fs::write(dir.join("libgcc_s.so"), "INPUT(-lgcc_eh)\n").expect("OUT_DIR is writable");
    println!("cargo:rustc-link-search=native={}", dir.display());
}

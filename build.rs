//! Generates the Rust side of the plugin ABI from `plugin-spec/rpmi_plugin.h` (through `wrapper.h`).

use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-changed=plugin-spec/rpmi_plugin.h");
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

/// The `slurm` feature: the few public Slurm types and constants `src/slurm/` reads, from the installed
/// `<slurm/slurm.h>` (libslurm-dev), so `plugin_version` always matches the Slurm the plugin is built against.
fn slurm_bindings() {
    println!("cargo:rerun-if-changed=/usr/include/slurm/slurm.h");
    println!("cargo:rerun-if-changed=/usr/include/slurm/slurm_version.h");
    let bindings = bindgen::Builder::default()
        .header("wrapper.h")
        .clang_arg("-DRPMI_SLURM")
        .allowlist_type("slurm_step_layout_t")
        .allowlist_type("slurm_step_id_t")
        .allowlist_var("SLURM_VERSION_NUMBER")
        .allowlist_var("NO_VAL")
        .allowlist_var("SLURM_SUCCESS")
        .allowlist_var("SLURM_ERROR")
        .generate()
        .unwrap_or_else(|e| panic!("bindgen could not read <slurm/slurm.h> (is libslurm-dev installed?): {e}"));
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("slurm.rs");
    bindings.write_to_file(&out).unwrap_or_else(|e| panic!("cannot write {}: {e}", out.display()));
}

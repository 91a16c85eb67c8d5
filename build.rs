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
}

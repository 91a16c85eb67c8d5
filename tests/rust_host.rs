//! A Rust host loading librpmi.so through the abi_stable root module: the right build loads, and a host
//! built against a different layout is refused at load time with a clear error.

use abi_stable::library::RootModule;
use abi_stable::sabi_types::VersionStrings;
use abi_stable::{declare_root_module_statics, package_version_strings, StableAbi};
use std::path::PathBuf;

/// The cdylib cargo built beside this test (target/<profile>/librpmi.so).
fn plugin() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target/<profile>/deps/..");
    dir.join("librpmi.so")
}

#[test]
fn the_matching_build_loads_and_hands_out_the_c_table() {
    let table = rpmi::abi::root::load(&plugin()).expect("librpmi.so loads through its root module");
    assert_eq!(table.abi_version, rpmi::abi::ffi::RPMI_ABI_VERSION as u32);
    assert_eq!(table.struct_size as usize, std::mem::size_of::<rpmi::abi::ffi::rpmi_plugin>());
    let version = unsafe { std::ffi::CStr::from_ptr(table.version) }.to_str().unwrap();
    assert_eq!(version, concat!("rpmi ", env!("CARGO_PKG_VERSION")));
    assert!(table.create.is_some() && table.destroy.is_some());
}

/// What a host built against another rpmi would expect: the entry returns something else.
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = OtherRootRef)))]
pub struct OtherRoot {
    pub abi_version: u32,
    #[sabi(last_prefix_field)]
    pub plugin_entry: extern "C" fn(u32) -> u64,
}

impl RootModule for OtherRootRef {
    declare_root_module_statics! {OtherRootRef}
    const BASE_NAME: &'static str = "rpmi";
    const NAME: &'static str = "rpmi";
    const VERSION_STRINGS: VersionStrings = package_version_strings!();
}

#[test]
fn a_host_built_against_another_layout_is_refused_at_load() {
    let err = OtherRootRef::load_from_file(&plugin()).err().expect("a mismatched layout must not load");
    let text = err.to_string();
    eprintln!("refused as expected: {text}");
    assert!(text.contains("plugin_entry") || text.to_lowercase().contains("incompatible"), "unclear error: {text}");
}

//! The checked way in for Rust hosts: an `abi_stable` root module whose layout and version abi_stable
//! verifies when the library is loaded, so a host built against a different rpmi is refused with a clear
//! error instead of calling into a table it misreads. It hands out the same table as `rpmi_plugin_entry`.

use super::ffi::{self, rpmi_plugin};
use abi_stable::library::{LibraryError, RootModule};
use abi_stable::sabi_types::VersionStrings;
use abi_stable::{declare_root_module_statics, export_root_module, package_version_strings, StableAbi};
use std::ffi::c_void;
use std::path::Path;

/// The root module of librpmi.so.
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = RpmiRootRef)))]
pub struct RpmiRoot {
    /// `RPMI_ABI_VERSION` of the plugin.
    pub abi_version: u32,
    /// The plugin table (`*const rpmi_plugin`), as `rpmi_plugin_entry` returns it.
    #[sabi(last_prefix_field)]
    pub plugin_entry: extern "C" fn() -> *const c_void,
}

impl RootModule for RpmiRootRef {
    declare_root_module_statics! {RpmiRootRef}
    const BASE_NAME: &'static str = "rpmi";
    const NAME: &'static str = "rpmi";
    const VERSION_STRINGS: VersionStrings = package_version_strings!();
}

extern "C" fn plugin_entry() -> *const c_void {
    super::rpmi_plugin_entry().cast()
}

#[export_root_module]
fn root_module() -> RpmiRootRef {
    use abi_stable::prefix_type::PrefixTypeTrait;
    RpmiRoot { abi_version: ffi::RPMI_ABI_VERSION as u32, plugin_entry }.leak_into_prefix()
}

/// Loads the plugin at `path` for a Rust host, with abi_stable's load-time checks, and returns its table.
pub fn load(path: &Path) -> Result<&'static rpmi_plugin, String> {
    let root = RpmiRootRef::load_from_file(path).map_err(|e: LibraryError| format!("{}: {e}", path.display()))?;
    if root.abi_version() != ffi::RPMI_ABI_VERSION as u32 {
        return Err(format!(
            "{} speaks plugin ABI version {}, this host speaks {}",
            path.display(),
            root.abi_version(),
            ffi::RPMI_ABI_VERSION
        ));
    }
    // SAFETY: the root module's layout was checked at load; the table is static in the loaded library,
    // which abi_stable never unloads.
    unsafe { (root.plugin_entry())().cast::<rpmi_plugin>().as_ref() }
        .ok_or_else(|| format!("{}: the plugin table is missing", path.display()))
}

//! Loading `librpmi.so` the way any job shell would: `dlopen`, `dlsym("rpmi_plugin_entry")`, version checks.

use rpmi::abi::ffi::{self, rpmi_plugin};
use std::ffi::{CStr, CString};
use std::path::Path;

/// The plugin's table, from a library that stays loaded for the life of the process.
#[derive(Clone, Copy)]
pub struct Plugin {
    pub table: &'static rpmi_plugin,
}

// SAFETY: the table is immutable for the life of the process; its functions may be called from any thread
// as the header documents.
unsafe impl Sync for Plugin {}
unsafe impl Send for Plugin {}

impl Plugin {
    /// Loads the plugin at `path` and checks that it speaks this host's ABI.
    pub fn load(path: &Path) -> Result<Plugin, String> {
        let c_path = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| format!("{}: a path with a NUL byte", path.display()))?;
        // SAFETY: dlopen/dlsym/dlerror with NUL-terminated strings; the library is never closed, so the table
        // it returns lives for the whole process.
        unsafe {
            let lib = libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
            if lib.is_null() {
                return Err(format!("cannot load the plugin: {}", dl_error()));
            }
            let entry = libc::dlsym(lib, c"rpmi_plugin_entry".as_ptr());
            if entry.is_null() {
                return Err(format!("{} is not an rpmi plugin: {}", path.display(), dl_error()));
            }
            let entry: extern "C" fn() -> *const rpmi_plugin = std::mem::transmute(entry);
            let table =
                entry().as_ref().ok_or_else(|| format!("{}: rpmi_plugin_entry returned NULL", path.display()))?;
            if table.abi_version != ffi::RPMI_ABI_VERSION as u32 {
                return Err(format!(
                    "{} speaks plugin ABI version {}, this rpmi-run speaks {}",
                    path.display(),
                    table.abi_version,
                    ffi::RPMI_ABI_VERSION
                ));
            }
            // rpmi-run comes with the library: it asks for its own header's revision, whatever it calls.
            if (table.struct_size as usize) < std::mem::size_of::<rpmi_plugin>()
                || table.abi_revision < ffi::RPMI_ABI_REVISION as u32
            {
                return Err(format!(
                    "{}: its plugin table is of an older revision than this rpmi-run's ({})",
                    path.display(),
                    ffi::RPMI_ABI_REVISION
                ));
            }
            let t = table;
            let complete = t.create.is_some()
                && t.task_init.is_some()
                && t.task_exec.is_some()
                && t.task_forked.is_some()
                && t.task_exit.is_some()
                && t.progress.is_some()
                && t.collective_complete.is_some()
                && t.service_complete.is_some()
                && t.destroy.is_some();
            if !complete {
                return Err(format!("{}: its plugin table lacks functions of ABI version 1", path.display()));
            }
            Ok(Plugin { table })
        }
    }

    /// The plugin's release string.
    pub fn version(&self) -> String {
        if self.table.version.is_null() {
            return "unknown".into();
        }
        // SAFETY: the table's version is a static NUL-terminated string.
        unsafe { CStr::from_ptr(self.table.version) }.to_string_lossy().into_owned()
    }
}

fn dl_error() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string valid until the next dl call.
    unsafe {
        let e = libc::dlerror();
        if e.is_null() {
            "unknown error".into()
        } else {
            CStr::from_ptr(e).to_string_lossy().into_owned()
        }
    }
}

/// Calls a function of the table; `load` checked that all of them are present.
macro_rules! call {
    ($plugin:expr, $f:ident ( $($arg:expr),* )) => {
        match $plugin.table.$f {
            // SAFETY: a function of the loaded plugin, called as the header documents.
            Some(f) => unsafe { f($($arg),*) },
            None => panic!(concat!("the plugin has no ", stringify!($f))),
        }
    };
}
pub(crate) use call;

/* What build.rs hands to bindgen: the normative plugin ABI, so the Rust side is generated from it and
 * cannot drift. */
#include "plugin-spec/rpmi_plugin.h"

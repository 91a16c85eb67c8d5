/* What build.rs hands to bindgen: the normative plugin ABI, so the Rust side is generated from it and
 * cannot drift. */
#include "plugin-spec/rpmi_plugin.h"

/* Only with the `slurm` feature (build.rs passes -DRPMI_SLURM in a second, separate bindgen run): the public
 * Slurm types the MPI plugin reads (slurm_step_layout_t, slurm_step_id_t) and SLURM_VERSION_NUMBER. */
#ifdef RPMI_SLURM
#include <slurm/slurm.h>
#include <slurm/slurm_version.h>
#endif

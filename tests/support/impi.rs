//! Intel MPI (PyPI's `impi-rt`, which `docker/install-deps.sh` installs in `/opt/rpmi-impi`, or the venv
//! `RPMI_IMPI` names) and its IMB-MPI1, run through a PMI library it loads (`I_MPI_PMI_LIBRARY`): Slurm's
//! `libpmi2.so.0` (Debian's `libpmi2-0`) or Flux's. Its shared-memory fabric runs on one node only, so every
//! run here is one node's, whatever the PMI.

#![allow(dead_code)]

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// Slurm's PMI-2 client library, as Debian's `libpmi2-0` installs it.
pub const SLURM_LIBPMI2: &str = "/usr/lib/x86_64-linux-gnu/libpmi2.so.0";

pub struct IntelMpi {
    root: PathBuf,
}

/// The installed runtime; panics saying how to install it when it is missing.
pub fn intel_mpi() -> IntelMpi {
    let root = std::env::var_os("RPMI_IMPI").map_or_else(|| PathBuf::from("/opt/rpmi-impi"), PathBuf::from);
    let imb = root.join("bin/IMB-MPI1");
    assert!(imb.exists(), "no Intel MPI at {}: run `docker/install-deps.sh` (as root)", imb.display());
    IntelMpi { root }
}

impl IntelMpi {
    /// The command and arguments of a short Allreduce over `ranks` ranks: MPI_Init's PMI start-up, ten
    /// Allreduces, MPI_Finalize.
    pub fn imb(&self, ranks: usize) -> Vec<String> {
        let imb = self.root.join("bin/IMB-MPI1").to_string_lossy().into_owned();
        let n = ranks.to_string();
        [imb.as_str(), "-npmin", &n, "-iter", "10", "-msglog", "2:2", "Allreduce"].map(String::from).to_vec()
    }

    /// The environment of a run on one node's shared memory, through `library` with `I_MPI_PMI=mode`
    /// (`pmi1`, `pmi2`), or through Intel MPI's own PMI-1 client when `None`.
    pub fn env(&self, library: Option<(&Path, &str)>) -> Vec<(&'static str, OsString)> {
        let lib = self.root.join("lib");
        let mut env = vec![
            ("LD_LIBRARY_PATH", lib.clone().into_os_string()),
            ("FI_PROVIDER_PATH", lib.join("libfabric/prov").into_os_string()),
            ("I_MPI_FABRICS", "shm".into()),
        ];
        if let Some((path, mode)) = library {
            env.push(("I_MPI_PMI_LIBRARY", path.as_os_str().to_owned()));
            env.push(("I_MPI_PMI", mode.into()));
        }
        env
    }
}

/// Whether IMB-MPI1's output shows its Allreduce ran over `ranks` processes to the end.
pub fn imb_ran(stdout: &str, ranks: usize) -> bool {
    stdout.contains(&format!("# #processes = {ranks}")) && stdout.contains("# All processes entering MPI_Finalize")
}

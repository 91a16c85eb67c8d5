#!/usr/bin/env bash
# The client-library benchmark (benches/libpmi): rpmi's libpmi.so.0 and libpmi2.so.0, Slurm's libpmi2.so.0 and
# (where flux-core is installed: pkg-config flux-pmi) Flux's libpmi.so.0 against clients that write the same
# requests by hand, under rpmi-run, srun --mpi=rpmi and srun --mpi=pmi2, at 2 and 16 tasks, 21 times each,
# each round in an order of its own, a job of one task with 30,000 gets, and that job's start-up alone 210
# times (about 10 minutes on 2 cores). Installs what is missing, builds the libraries, starts the local Slurm
# cluster with the plugin, and writes benches/results/libpmi.md and .json. Arguments go to the benchmark,
# e.g. --runs 3 --sizes 2,64 --gets 500 --servers rpmi-run --out DIR/libpmi.md.
set -euo pipefail
cd "$(dirname "$0")/.."
bash docker/install-deps.sh
cargo build --locked --release
export RPMI_SLURM_DIR=${RPMI_SLURM_DIR:-/tmp/rpmi-slurm-bench}
export RPMI_SLURM_MPI_CONF=   # the plugin as built, without the test cluster's site settings
exec bash docker/with-slurm.sh cargo bench --locked --features slurm --bench libpmi -- "$@"

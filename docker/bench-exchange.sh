#!/usr/bin/env bash
# The start-up exchange beside Slurm's PMIx (benches/exchange): every rank's puts, a collecting fence, gets of
# other ranks' keys and empty fences, through rpmi's libpmi.so.0 and PMI-1 lines by hand under srun --mpi=rpmi
# and through OpenPMIx's libpmix under srun --mpi=pmix, on one node of the local Slurm cluster, at 64 and 256
# tasks, 11 rounds. Installs what is missing, builds the libraries, starts the cluster with the plugin, and
# writes benches/results/exchange.md and .json. Arguments go to the benchmark, e.g. --runs 3 --sizes 16.
# Across nodes, each a network namespace with a /tmp of its own (Slurm's PMIx needs that: its per-step
# directories in /tmp collide where nodes share one):
#   RPMI_SLURM_NETNS=1 bash docker/bench-exchange.sh --nodes 3 --sizes 12,96,384 --out benches/results/exchange-3.md
set -euo pipefail
cd "$(dirname "$0")/.."
bash docker/install-deps.sh pmix
cargo build --locked --release
export RPMI_SLURM_DIR=${RPMI_SLURM_DIR:-/tmp/rpmi-slurm-bench}
export RPMI_SLURM_MPI_CONF=   # the plugin as built, without the test cluster's site settings
exec bash docker/with-slurm.sh cargo bench --locked --features slurm --bench exchange -- "$@"

#!/usr/bin/env bash
# The side-by-side benchmark (benches/side_by_side): rpmi-run, srun --mpi=rpmi, mpiexec.hydra, srun --mpi=pmi2
# and a floor server run the same PMI-1 workloads at 64, 256 and 1024 tasks, 5 times each, in one run (about
# 50 minutes on 2 cores). Installs what is missing, starts the local Slurm cluster with the plugin, and writes
# benches/results/ (side_by_side.md, .json, .png). Arguments go to the benchmark, e.g. --runs 3 --sizes 64,256
# --servers rpmi-run,floor --workloads a,c --out DIR. The tree against the star it replaced, on 100 nodes
# (about 30 minutes; benches/results/slurm-100/):
#   RPMI_SLURM_NODES=100 bash docker/bench.sh --slurm-nodes 100 --servers srun-rpmi,srun-rpmi-star,srun-pmi2 \
#     --workloads b,c --sizes 200,400 --barriers 100 --runs 11 --out benches/results/slurm-100
set -euo pipefail
cd "$(dirname "$0")/.."
bash docker/install-deps.sh bench
export RPMI_SLURM_DIR=${RPMI_SLURM_DIR:-/tmp/rpmi-slurm-bench}
export RPMI_SLURM_MPI_CONF=   # the plugin as built, without the test cluster's site settings
exec bash docker/with-slurm.sh cargo bench --locked --features slurm --bench side_by_side -- "$@"

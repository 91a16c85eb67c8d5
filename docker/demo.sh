#!/usr/bin/env bash
# The main job: a real MPI program started through the plugin. Installs what is missing, builds rpmi,
# compiles tests/programs/mpi_pairs.c with MPICH and runs it under rpmi-run (N tasks over M virtual nodes).
# Usage: bash docker/demo.sh [N [M]]   (default 8 tasks over 2 nodes)
set -euo pipefail
cd "$(dirname "$0")/.."
bash docker/install-deps.sh
cargo build --release --locked
mkdir -p target/demo
mpicc -O2 -o target/demo/mpi_pairs tests/programs/mpi_pairs.c
set -x
exec target/release/rpmi-run -n "${1:-8}" --nodes "${2:-2}" -l target/demo/mpi_pairs

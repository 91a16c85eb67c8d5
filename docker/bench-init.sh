#!/usr/bin/env bash
# MPI start-up side by side (benches/init): MPI_Init + MPI_Finalize under rpmi-run and MPICH's mpiexec.hydra,
# over 4 virtual nodes at 64 and 256 ranks, 5 runs each, for PMI-1 and PMI-2 (MPIR_CVAR_PMI_VERSION=2). It
# needs an MPICH that speaks PMI-2 (4.1 and later; Debian 12 has 4.0.2), so it runs in the Debian unstable
# chroot of docker/slurm-plugin.sh (MPICH 5.0.2; made with debootstrap where missing, a few minutes). Writes
# benches/results/init.md. Arguments go to the benchmark, e.g. --ranks 64 --runs 3 --out DIR/init.md.
set -euo pipefail
cd "$(dirname "$0")/.."
bash docker/install-deps.sh
# rpmi-run and librpmi.so next to it, and the benchmark: built here, run in the chroot (its glibc is newer).
cargo build --locked --release
bench=$(cargo bench --locked --bench init --no-run --message-format=json |
  grep '"src_path":"[^"]*/benches/init/main.rs"' | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)
[[ -x $bench ]] || { echo "bench-init: no benchmark binary" >&2; exit 1; }
exec bash docker/slurm-plugin.sh run 26.05 "$bench" --bench "$@"

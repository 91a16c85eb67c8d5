#!/usr/bin/env bash
# The project's test command (the README; .ci/run and so the Dockerfile run it): installs what is missing, then
# checks formatting and lints, and runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash docker/install-deps.sh
if command -v rustup >/dev/null 2>&1; then
  rustup component add rustfmt clippy >/dev/null 2>&1 || echo "note: rustup could not add rustfmt/clippy" >&2
fi
cargo fmt --all -- --check
cargo clippy --all-targets --locked -- -D warnings
# `cargo test` alone does not put the cdylib at target/debug/librpmi.so, where rpmi-run and the host tests
# load it from; a build does.
cargo build --all-targets --locked
cargo test --lib --bins --tests --locked   # not --all-targets: that would also run the benchmarks

# The Slurm plugin: its unit tests (the library with the `slurm` feature), and end to end: the same library
# installed into a throwaway PluginDir, `srun --mpi=rpmi` on a real local 3-node cluster, stopped on any exit
# (docker/with-slurm.sh).
cargo clippy --all-targets --locked --features slurm -- -D warnings
bash docker/with-slurm.sh cargo test --locked --features slurm --lib --test slurm
# The same plugin over 100 nodes (100 slurmd on this machine): the tests that need that many, which the run on
# 3 nodes leaves out (#[ignore]).
RPMI_SLURM_NODES=100 bash docker/with-slurm.sh cargo test --locked --features slurm --test slurm -- --ignored

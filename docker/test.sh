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
cargo test --all-targets --locked

# The Slurm plugin end to end: the same library built with the `slurm` feature, installed into a throwaway
# PluginDir, `srun --mpi=rpmi` on a real local 3-node cluster (docker/slurm-cluster.sh), stopped on any exit.
cargo clippy --all-targets --locked --features slurm -- -D warnings
slurm_plugin_dir=$(mktemp -d /tmp/rpmi-plugin.XXXXXX)
export RPMI_SLURM_DIR=${RPMI_SLURM_DIR:-/tmp/rpmi-slurm-test}
trap 'bash docker/slurm-cluster.sh stop >/dev/null 2>&1 || true; rm -rf "$slurm_plugin_dir"' EXIT
bash docker/install-slurm-plugin.sh --plugin-dir "$slurm_plugin_dir"
eval "$(bash docker/slurm-cluster.sh start --plugin-dir "$slurm_plugin_dir")"
cargo test --locked --features slurm --test slurm

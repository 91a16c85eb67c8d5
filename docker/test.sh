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
# The fuzz targets (fuzz/, a workspace of their own, run with cargo-fuzz on nightly) still build against the
# library as it is now.
cargo check --locked --manifest-path fuzz/Cargo.toml
# The API documentation builds without a warning (a broken intra-doc link is one), with the Slurm plugin too.
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --locked
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --locked --features slurm
# `cargo test` alone does not put the cdylib at target/debug/librpmi.so, where rpmi-run and the host tests
# load it from; a build does.
cargo build --all-targets --locked
cargo test --lib --bins --tests --locked   # not --all-targets: that would also run the benchmarks

# Flux's job-shell plugin (src/flux/), under 3-broker Flux instances: only where Flux is installed (no registry
# these machines reach carries it, and the project builds no Flux). Otherwise the Flux tests do not run, and say so.
cargo clippy --all-targets --locked --features flux -- -D warnings
if command -v flux >/dev/null; then
  bash docker/flux.sh test
else
  echo "NOT RUN: the Flux tests (tests/flux.rs): no flux on the PATH (see docker/flux.sh)" >&2
fi

# The Slurm plugin: its unit tests (the library with the `slurm` feature), and end to end: the same library
# installed into a throwaway PluginDir, `srun --mpi=rpmi` on a real local 3-node cluster, stopped on any exit
# (docker/with-slurm.sh).
cargo clippy --all-targets --locked --features slurm -- -D warnings
bash docker/with-slurm.sh cargo test --locked --features slurm --lib --test slurm
# Spawn under srun with real MPICH 5 programs (from /opt/rpmi-mpich5: the other Slurm lines' chroots lack it),
# Intel MPI through Slurm's libpmi2 and rpmi's (from /opt/rpmi-impi), and Debian's Open MPI through rpmi's
# libpmi.so.0 (the chroots lack it too).
bash docker/with-slurm.sh cargo test --locked --features slurm --test slurm -- --ignored mpich5_ impi_ ompi_
# Flux started by srun, and Intel MPI through Flux's PMI libraries: where Flux is installed.
if command -v flux >/dev/null; then
  bash docker/with-slurm.sh cargo test --locked --features slurm --test slurm -- --ignored flux_
else
  echo "NOT RUN: Flux under srun (tests/slurm.rs, flux_*): no flux on the PATH" >&2
fi
# The fault and soak campaign's CI part (docker/campaign.sh --ci: each fault kind twice, 50 soak steps) under rpmi
# and pmi2, its report kept out of the tree (the full campaign's, with --mpi=none too, is
# benches/results/campaign.md).
bash docker/campaign.sh --ci --mpi rpmi,pmi2 --out /tmp/rpmi-campaign-ci.md

# The same plugin over 100 nodes (100 slurmd on this machine): the tests that need that many, which the run on
# 3 nodes leaves out (#[ignore]).
RPMI_SLURM_NODES=100 bash docker/with-slurm.sh cargo test --locked --features slurm --test slurm -- --ignored hundred

# The same real-Slurm tests on the other supported Slurm lines: 24.11 (Debian 13) and 26.05 (Debian unstable),
# each built against and run on its own Slurm and MPICH in a Debian chroot (docker/slurm-plugin.sh; made with
# debootstrap where missing, a few minutes each).
bash docker/slurm-plugin.sh test 24.11
bash docker/slurm-plugin.sh test 26.05

# The Debian packages of each line: built with cargo-deb, installed with dpkg -i into that line's chroot (Debian 12
# for 22.05, so this machine's system stays as it is), then MPICH jobs through them (docker/check-packages.sh).
for version in 22.05 24.11 26.05; do
  bash docker/slurm-plugin.sh package-test "$version"
done

# The RPM for EL sites (packaging/rpm/rpmi-slurm.spec), made with Debian's rpm tools against this machine's Slurm
# headers and checked by what it says of itself (docker/rpm.sh); installing it is left to EL hosts.
bash docker/rpm.sh >/dev/null

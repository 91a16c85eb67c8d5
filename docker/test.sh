#!/usr/bin/env bash
# The project's test command (the README; .ci/run and so the Dockerfile run it): installs what is missing, then
# checks formatting and lints, and runs every test. Each step is timed; the times are printed, a line a step,
# when the run ends, passed or failed (docs/testing.md gives a run's figures).
set -euo pipefail
cd "$(dirname "$0")/.."

times=() current="" began=$SECONDS
# step NAME COMMAND...: runs COMMAND as the step NAME, and keeps its time.
step() {
  current=$1
  shift
  local t0=$SECONDS
  echo "=== $current" >&2
  "$@"
  times+=("$(printf '%6d s  %s' $((SECONDS - t0)) "$current")")
  current=""
}
summary() {
  local rc=$?
  {
    echo "=== step times"
    printf '%s\n' "${times[@]}"
    [[ -z $current ]] || echo "FAILED in step: $current"
    printf '%6d s  in all\n' $((SECONDS - began))
  } >&2
  return "$rc"
}
trap summary EXIT

step "install what is missing" bash docker/install-deps.sh
if command -v rustup >/dev/null 2>&1; then
  rustup component add rustfmt clippy >/dev/null 2>&1 || echo "note: rustup could not add rustfmt/clippy" >&2
fi
step "fmt" cargo fmt --all -- --check
# Every path of this repository that the docs and comments name exists.
step "paths named in docs and comments" python3 docker/check-paths.py
step "clippy" cargo clippy --all-targets --locked -- -D warnings
# The fuzz targets (fuzz/, a workspace of their own, run with cargo-fuzz on nightly) still build against the
# library as it is now.
step "fuzz targets build" cargo check --locked --manifest-path fuzz/Cargo.toml
# The API documentation builds without a warning (a broken intra-doc link is one), with the Slurm plugin too.
api_docs() {
  RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --locked
  RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --locked --features slurm
}
step "docs" api_docs
# `cargo test` alone does not put the cdylib at target/debug/librpmi.so, where rpmi-run and the host tests
# load it from; a build does.
step "build" cargo build --all-targets --locked
step "tests" cargo test --lib --bins --tests --locked   # not --all-targets: that would also run the benchmarks

# Flux's job-shell plugin (src/flux/), under 3-broker Flux instances: only where Flux is installed (no registry
# these machines reach carries it, and the project builds no Flux). Otherwise the Flux tests do not run, and say so.
step "clippy, Flux" cargo clippy --all-targets --locked --features flux -- -D warnings
if command -v flux >/dev/null; then
  step "Flux tests" bash docker/flux.sh test
else
  echo "NOT RUN: the Flux tests (tests/flux.rs): no flux on the PATH (see docker/flux.sh)" >&2
fi

# The Slurm plugin: its unit tests (the library with the `slurm` feature), and end to end: the same library
# installed into a throwaway PluginDir, `srun --mpi=rpmi` on a real local 3-node cluster, stopped on any exit
# (docker/with-slurm.sh).
step "clippy, Slurm" cargo clippy --all-targets --locked --features slurm -- -D warnings
step "Slurm 22.05: unit tests and tests/slurm.rs" \
  bash docker/with-slurm.sh cargo test --locked --features slurm --lib --test slurm
# Spawn under srun with real MPICH 5 programs (from /opt/rpmi-mpich5: the other Slurm lines' chroots lack it),
# Intel MPI through Slurm's libpmi2 and rpmi's (from /opt/rpmi-impi), and Debian's Open MPI through rpmi's
# libpmi.so.0 (the chroots lack it too).
step "Slurm 22.05: MPICH 5, Intel MPI, Open MPI" \
  bash docker/with-slurm.sh cargo test --locked --features slurm --test slurm -- --ignored mpich5_ impi_ ompi_
# Flux started by srun, and Intel MPI through Flux's PMI libraries: where Flux is installed.
if command -v flux >/dev/null; then
  step "Slurm 22.05: Flux under srun" \
    bash docker/with-slurm.sh cargo test --locked --features slurm --test slurm -- --ignored flux_
else
  echo "NOT RUN: Flux under srun (tests/slurm.rs, flux_*): no flux on the PATH" >&2
fi
# The fault and soak campaign's CI part (docker/campaign.sh --ci: each fault kind twice, 50 soak steps) under rpmi
# alone, held to every target itself; its report kept out of the tree (the full campaign's, beside pmi2 and
# --mpi=none, is benches/results/campaign.md).
step "campaign, CI part" bash docker/campaign.sh --ci --mpi rpmi --out /tmp/rpmi-campaign-ci.md

# The same plugin over 100 nodes (100 slurmd on this machine): the tests that need that many, which the run on
# 3 nodes leaves out (#[ignore]).
step "Slurm 22.05: 100 nodes" env RPMI_SLURM_NODES=100 \
  bash docker/with-slurm.sh cargo test --locked --features slurm --test slurm -- --ignored hundred

# The same real-Slurm tests on the other supported Slurm lines: 24.11 (Debian 13) and 26.05 (Debian unstable),
# each built against and run on its own Slurm and MPICH in a Debian chroot (docker/slurm-plugin.sh; made with
# debootstrap where missing, a few minutes each).
step "Slurm 24.11 (chroot)" bash docker/slurm-plugin.sh test 24.11
step "Slurm 26.05 (chroot)" bash docker/slurm-plugin.sh test 26.05

# The Debian packages of each line: built with cargo-deb, installed with dpkg -i into that line's chroot (Debian 12
# for 22.05, so this machine's system stays as it is), then MPICH jobs through them (docker/check-packages.sh).
for version in 22.05 24.11 26.05; do
  step "package, Slurm $version" bash docker/slurm-plugin.sh package-test "$version"
done

# The RPM for EL sites (packaging/rpm/rpmi-slurm.spec), made with Debian's rpm tools against this machine's Slurm
# headers and checked by what it says of itself (docker/rpm.sh); installing it is left to EL hosts. Here, where
# slurm-devel is no installed RPM, rpm.sh refuses a package that would require slurm = X unless told that it is
# only checked; one for a Slurm built from source requires no slurm RPM.
rpm_package() {
  local refused
  if refused=$(bash docker/rpm.sh 2>&1 >/dev/null); then
    echo "docker/rpm.sh made a package that requires a slurm RPM on a host with none" >&2
    return 1
  fi
  grep -q -- "--slurm-from-source" <<<"$refused" || { echo "$refused" >&2; return 1; }
  bash docker/rpm.sh --check-only >/dev/null
  bash docker/rpm.sh --check-only --slurm-from-source >/dev/null
}
step "RPM" rpm_package

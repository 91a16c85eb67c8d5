#!/usr/bin/env bash
# Installs every system package rpmi's build, tests and local Slurm cluster need on Debian 12.
# Used by the README's set-up, .ci/run and docker/Dockerfile alike; safe to run again.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
packages=(
  build-essential pkg-config
  libclang-dev clang          # bindgen (build.rs) generates the ABI types from plugin-spec/rpmi_plugin.h
  mpich libmpich-dev          # real MPI clients for the end-to-end tests
  slurm-wlm munge libslurm-dev # the local multi-node Slurm cluster and the srun --mpi=rpmi plugin
  procps psmisc               # pgrep/pkill/killall used by the test scripts to check for leftovers
  python3-venv                # MPICH 5 and Intel MPI from PyPI (below)
  libpmi2-0                   # Slurm's PMI-2 client library, which runtimes load (Intel MPI's I_MPI_PMI_LIBRARY)
  openmpi-bin libopenmpi-dev  # Open MPI 4.1, which loads a libpmi.so.0 through its flux component (tests/libpmi.rs)
)
# `install-deps.sh bench`: also what the side-by-side benchmark needs (docker/bench.sh).
if [[ ${1:-} == bench ]]; then
  packages+=(gnuplot-nox)     # the benchmark's plot
fi
# `install-deps.sh pmix`: also OpenPMIx's client library, which the exchange benchmark's PMIx client links
# (docker/bench-exchange.sh; Slurm's own mpi_pmix.so comes with slurm-wlm).
if [[ ${1:-} == pmix ]]; then
  packages+=(libpmix-dev)
  packages+=(iproute2)        # ip: the cluster's nodes in network namespaces of their own (slurm-cluster.sh --netns)
fi
# `install-deps.sh deb`: also what the Debian packages are made with (docker/slurm-plugin.sh, `cargo deb`).
if [[ ${1:-} == deb ]]; then
  packages+=(dpkg-dev)        # dpkg-shlibdeps, which gives cargo-deb its `$auto` Depends
  packages+=(lowdown)         # the manual pages, from docs/man's Markdown (docker/man.sh)
fi
# `install-deps.sh flux`: also what the Flux plugin's build needs beside the site's Flux (docker/flux.sh): jansson,
# for its options.
if [[ ${1:-} == flux ]]; then
  packages+=(libjansson-dev)
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  apt-get update
  apt-get install -y --no-install-recommends "${missing[@]}"
fi
# Open MPI's packages take over `mpicc` and `mpirun` (Debian's alternatives rank it above MPICH): the tests,
# the demo and every script mean MPICH by them, and call Open MPI's by name (mpicc.openmpi).
update-alternatives --set mpi /usr/bin/mpicc.mpich >/dev/null
update-alternatives --set mpirun /usr/bin/mpirun.mpich >/dev/null

# MPICH 5 (`pip install mpich`: mpicc and its Hydra) in a venv of its own, for the tests of dynamic processes:
# Debian 12's MPICH 4.0.2 (ch4:ucx) refuses MPI_Comm_spawn and MPI_Open_port itself. Pinned: the version the
# tests were written against.
mpich5=/opt/rpmi-mpich5
mpich5_version=5.0.2
if [[ $("$mpich5/bin/pip" list 2>/dev/null | awk '$1 == "mpich" { print $2 }') != "$mpich5_version" ]]; then
  /usr/bin/python3 -m venv "$mpich5"
  "$mpich5/bin/pip" install --quiet "mpich==$mpich5_version"
fi

# Intel MPI's runtime and its IMB-MPI1 (`pip install impi-rt`), in a venv of its own, for the tests of runtimes
# that load a PMI library (I_MPI_PMI_LIBRARY): a real client of Slurm's and Flux's libraries. Pinned: 2021.17
# is the release the tests were written against (2021.19 needs a libfabric pip cannot find here).
impi=/opt/rpmi-impi
impi_version=2021.17.0
if [[ $("$impi/bin/pip" list 2>/dev/null | awk '$1 == "impi-rt" { print $2 }') != "$impi_version" ]]; then
  /usr/bin/python3 -m venv "$impi"
  "$impi/bin/pip" install --quiet "impi-rt==$impi_version"
fi

# cargo-deb, from crates.io through cargo (Debian 12 has none): the version the packages were made and tested
# with, its dependencies as its Cargo.lock pins them.
cargo_deb_version=3.8.0
if [[ ${1:-} == deb && $(cargo deb --version 2>/dev/null) != "cargo-deb $cargo_deb_version" ]]; then
  cargo install cargo-deb --locked --version "$cargo_deb_version"
fi

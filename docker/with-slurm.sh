#!/usr/bin/env bash
# Runs a command where `srun --mpi=rpmi` works: builds the plugin (cargo feature `slurm`), installs it into a
# throwaway PluginDir, starts the local cluster (docker/slurm-cluster.sh, state in $RPMI_SLURM_DIR; 3 nodes, or
# $RPMI_SLURM_NODES) with SLURM_CONF exported, runs the command, and stops the cluster on any exit. With
# RPMI_PLUGIN_NO_BUILD=1 the plugin already built (in $CARGO_TARGET_DIR) is installed as it is. The cluster's
# mpi.conf is $RPMI_SLURM_MPI_CONF, by default tests/slurm/mpi.conf (the site settings tests/slurm.rs
# checks); empty for none.
#
#   [RPMI_SLURM_NODES=N] [RPMI_PLUGIN_NO_BUILD=1] [RPMI_SLURM_MPI_CONF=FILE] docker/with-slurm.sh COMMAND [ARGS]...
set -euo pipefail
cd "$(dirname "$0")/.."
(($#)) || { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
plugin_dir=$(mktemp -d /tmp/rpmi-plugin.XXXXXX)
export RPMI_SLURM_DIR=${RPMI_SLURM_DIR:-/tmp/rpmi-slurm-test}
trap 'bash docker/slurm-cluster.sh stop >/dev/null 2>&1 || true; rm -rf "$plugin_dir"' EXIT
install=(bash docker/install-slurm-plugin.sh --plugin-dir "$plugin_dir")
[[ ${RPMI_PLUGIN_NO_BUILD:-0} == 1 ]] && install+=(--no-build)
"${install[@]}"
start=(bash docker/slurm-cluster.sh start --plugin-dir "$plugin_dir" --nodes "${RPMI_SLURM_NODES:-3}")
mpi_conf=${RPMI_SLURM_MPI_CONF-tests/slurm/mpi.conf}
[[ -z $mpi_conf ]] || start+=(--mpi-conf "$mpi_conf")
eval "$("${start[@]}")"
"$@"

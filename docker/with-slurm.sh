#!/usr/bin/env bash
# Runs a command where `srun --mpi=rpmi` works: builds the plugin (cargo feature `slurm`), installs it into a
# throwaway PluginDir, starts the local cluster (docker/slurm-cluster.sh, state in $RPMI_SLURM_DIR; 3 nodes, or
# $RPMI_SLURM_NODES) with SLURM_CONF exported, runs the command, and stops the cluster on any exit. With
# RPMI_PLUGIN_NO_BUILD=1 the plugin already built (in $CARGO_TARGET_DIR) is installed as it is. The cluster's
# mpi.conf is $RPMI_SLURM_MPI_CONF, by default tests/slurm/mpi.conf (the site settings tests/slurm.rs
# checks); empty for none. With RPMI_SLURM_PREFIX, the Slurm installed under that prefix (built from source, say)
# runs the cluster instead of Debian's: the plugin is built against its include/ into target/slurm-prefix-NAME
# (unless CARGO_TARGET_DIR says otherwise; so is the COMMAND's cargo), and its bin/ comes first in PATH.
#
#   [RPMI_SLURM_PREFIX=DIR] [RPMI_SLURM_NODES=N] [RPMI_SLURM_NETNS=1] [RPMI_PLUGIN_NO_BUILD=1] \
#     [RPMI_SLURM_MPI_CONF=FILE] docker/with-slurm.sh COMMAND [ARGS]...
# RPMI_SLURM_NETNS=1 starts each node in a network namespace and with a /tmp of its own (slurm-cluster.sh --netns):
# the COMMAND's programs must then lie outside /tmp (a checkout under /tmp, or a test that builds into TMPDIR,
# gives the nodes paths they cannot see).
set -euo pipefail
cd "$(dirname "$0")/.."
(($#)) || { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
if [[ -n ${RPMI_SLURM_PREFIX:-} ]]; then
  export PATH=$RPMI_SLURM_PREFIX/sbin:$RPMI_SLURM_PREFIX/bin:$PATH
  export SLURM_INCLUDE_DIR=${SLURM_INCLUDE_DIR:-$RPMI_SLURM_PREFIX/include}
  export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/slurm-prefix-$(basename "$RPMI_SLURM_PREFIX")}
fi
plugin_dir=$(mktemp -d /tmp/rpmi-plugin.XXXXXX)
export RPMI_SLURM_DIR=${RPMI_SLURM_DIR:-/tmp/rpmi-slurm-test}
trap 'bash docker/slurm-cluster.sh stop >/dev/null 2>&1 || true; rm -rf "$plugin_dir"' EXIT
install=(bash docker/install-slurm-plugin.sh --plugin-dir "$plugin_dir")
[[ ${RPMI_PLUGIN_NO_BUILD:-0} == 1 ]] && install+=(--no-build)
"${install[@]}"
start=(bash docker/slurm-cluster.sh start --plugin-dir "$plugin_dir" --nodes "${RPMI_SLURM_NODES:-3}")
[[ ${RPMI_SLURM_NETNS:-0} != 1 ]] || start+=(--netns)
mpi_conf=${RPMI_SLURM_MPI_CONF-tests/slurm/mpi.conf}
[[ -z $mpi_conf ]] || start+=(--mpi-conf "$mpi_conf")
# The cluster's environment, once it is up (a cluster that did not come up ends the run here).
cluster_env=$("${start[@]}")
eval "$cluster_env"
"$@"

#!/usr/bin/env bash
# Builds librpmi.so with the Slurm plugin (cargo feature `slurm`) and installs it as <PluginDir>/mpi_rpmi.so,
# so that `srun --mpi=rpmi` works.
#
#   docker/install-slurm-plugin.sh [--plugin-dir DIR] [--no-build]
#
# PluginDir is taken from `scontrol show config` (the first entry of a colon-separated list), else Debian's
# /usr/lib/x86_64-linux-gnu/slurm-wlm; --plugin-dir overrides it. The plugin is tied to the Slurm it is built
# against (plugin_version = SLURM_VERSION_NUMBER of <slurm/slurm_version.h>): rebuild after a Slurm upgrade.
# The file is replaced atomically (install to a temporary name in the same directory, then mv): a loaded .so
# must never be overwritten in place. slurmd loads plugins only at start-up: restart it on every node.
# Environment: CARGO_TARGET_DIR (where cargo builds, as usual); SLURM_INCLUDE_DIR (the directory holding
# slurm/slurm.h; else `pkg-config slurm`'s, else /usr/include); RPMI_SLURM_PREFIX (a Slurm installed under a
# prefix: its bin/ comes first in PATH and its include/ is the default SLURM_INCLUDE_DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n ${RPMI_SLURM_PREFIX:-} ]]; then
  PATH=$RPMI_SLURM_PREFIX/bin:$PATH
  export SLURM_INCLUDE_DIR=${SLURM_INCLUDE_DIR:-$RPMI_SLURM_PREFIX/include}
fi

plugin_dir=""
build=1
while (($#)); do
  case $1 in
    --plugin-dir) (($# >= 2)) || { echo "--plugin-dir needs a directory" >&2; exit 2; }; plugin_dir=$2; shift 2 ;;
    --plugin-dir=*) plugin_dir=${1#*=}; shift ;;
    --no-build) build=0; shift ;;
    -h | --help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown option: $1" >&2; exit 2 ;;
  esac
done

if [[ -z $plugin_dir ]]; then
  plugin_dir=$(scontrol show config 2>/dev/null | awk -F= '/^PluginDir/ { gsub(/[ \t]/, "", $2); print $2; exit }' || true)
  plugin_dir=${plugin_dir%%:*}
  [[ -n $plugin_dir ]] || plugin_dir=/usr/lib/x86_64-linux-gnu/slurm-wlm
fi
[[ -d $plugin_dir ]] || { echo "PluginDir $plugin_dir is not a directory" >&2; exit 1; }

target_dir=${CARGO_TARGET_DIR:-target}
if ((build)); then
  cargo build --release --features slurm
fi
lib="$target_dir/release/librpmi.so"
[[ -f $lib ]] || { echo "$lib not found; build with: cargo build --release --features slurm" >&2; exit 1; }
nm -D --defined-only "$lib" | grep -qw mpi_p_client_prelaunch ||
  { echo "$lib was built without --features slurm" >&2; exit 1; }

tmp="$plugin_dir/.mpi_rpmi.so.$$"
trap 'rm -f "$tmp"' EXIT
install -m 0755 "$lib" "$tmp"
mv -f "$tmp" "$plugin_dir/mpi_rpmi.so"
trap - EXIT

echo "installed $plugin_dir/mpi_rpmi.so"
echo "Now restart slurmd on every node (and slurmctld), so that they load it; then:"
echo "  srun --mpi=list                 # shows rpmi"
echo "  srun --mpi=rpmi -N2 -n4 ./app   # per job, or for every job: MpiDefault=rpmi in slurm.conf"

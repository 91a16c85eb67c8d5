#!/usr/bin/env bash
# The fault and soak campaign of srun --mpi=rpmi beside Slurm's own --mpi=pmi2 and --mpi=none (plain tasks: what
# Slurm does on its own), on the local 3-node Slurm cluster (docker/with-slurm.sh starts and stops it; its state
# in $RPMI_SLURM_DIR, by default /tmp/rpmi-slurm-campaign). docker/campaign.py does the work: SIGKILL of a task, a
# slurmstepd, srun or a slurmd, and srun stopped then continued, each at a random point of a victim job's launch,
# exchange, barrier loop or finalize on n2,n3, with two bystander jobs on n1 (100 runs by default), each run under
# every plugin in turn with the same draws; then a soak of 1000 steps under each, 8 at a time, watching srun's,
# the slurmstepds' and slurmd's memory and fds. Writes benches/results/campaign.md and .json; exits 1 when rpmi
# misses a target that pmi2 meets in the same run.
#
#   bash docker/campaign.sh [--ci] [--faults N] [--soak N] [--seed S] [--mpi rpmi,pmi2,none] [--out PATH]
#
# --ci: 10 fault runs (each kind twice, docker/campaign.py's CI_PLAN) and 50 soak steps under each plugin, a few
# minutes. --mpi: the plugins, the one under test first, then the one it must do no worse than (--mpi rpmi:
# rpmi alone, every target its own).
# Runs as root on Debian 12 after docker/install-deps.sh. RPMI_PLUGIN_NO_BUILD=1 uses the plugin and
# rpmi-probe already built.
set -euo pipefail
cd "$(dirname "$0")/.."
case ${1:-} in -h | --help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
((EUID == 0)) || { echo "campaign: must run as root (the local cluster's slurmd)" >&2; exit 1; }
needed=(python3 mpicc srun stdbuf)
[[ ${RPMI_PLUGIN_NO_BUILD:-0} == 1 ]] || needed+=(cargo)
for c in "${needed[@]}"; do
  command -v "$c" >/dev/null || { echo "campaign: '$c' not found; run docker/install-deps.sh" >&2; exit 1; }
done
export RPMI_SLURM_DIR=${RPMI_SLURM_DIR:-/tmp/rpmi-slurm-campaign}
# The plugin as built, without the test cluster's site settings (as the benchmarks run it).
export RPMI_SLURM_MPI_CONF=${RPMI_SLURM_MPI_CONF-}
work=$(mktemp -d /tmp/rpmi-campaign.XXXXXX)
trap 'rm -rf "$work"' EXIT
mpicc -O1 -o "$work/mpi_pairs" tests/programs/mpi_pairs.c
# with-slurm.sh's build of the plugin (cargo build --release --features slurm) builds rpmi-probe too.
bash docker/with-slurm.sh python3 docker/campaign.py --work "$work" --pairs "$work/mpi_pairs" \
  --probe "${CARGO_TARGET_DIR:-target}/release/rpmi-probe" --command "bash docker/campaign.sh $*" "$@"

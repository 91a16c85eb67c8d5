#!/usr/bin/env bash
# Every shape of srun step a site runs, under Slurm's --mpi=pmi2 and --mpi=rpmi side by side: whether each
# ran and how long srun took (the median of --runs runs). A site runs it on its own cluster before it makes
# rpmi its MpiDefault; docker/with-slurm.sh runs it on the local 3-node cluster:
#
#   bash docker/shapes.sh [--runs N] [--out FILE]                        # on a cluster, from a login node
#   RPMI_SLURM_MPI_CONF= bash docker/with-slurm.sh bash docker/shapes.sh   # on the local cluster
#
# Needs srun, salloc and sbatch, mpicc (the MPI the site's programs use) and 3 nodes of 6 CPUs in the
# default partition (srun's own variables choose another: SLURM_PARTITION, SLURM_ACCOUNT). Heterogeneous
# shapes need hetjobs enabled (the backfill scheduler allocates them: with its default bf_interval of 30 s a
# step may wait that long first). The programs are tests/programs/mpi_pairs.c (every rank sends to and hears
# from every other) and mpi_mpmd.c (each rank checks its MPI_APPNUM); MPIR_CVAR_PMI_VERSION=2 in the
# environment makes MPICH 4.1 and later speak PMI-2. Prints a markdown table (also to --out FILE).
set -euo pipefail
cd "$(dirname "$0")/.."
runs=3 out=
while (($#)); do
  case $1 in
    --runs) runs=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    -h | --help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "shapes: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
for c in srun salloc sbatch sinfo mpicc timeout; do
  command -v "$c" >/dev/null || { echo "shapes: '$c' not found" >&2; exit 1; }
done
# On a shared file system where every node sees it (the current directory), as the site's programs are.
work=$(mktemp -d "$PWD/.rpmi-shapes.XXXXXX")
trap 'rm -rf "$work"' EXIT
mpicc -O1 -o "$work/mpi_pairs" tests/programs/mpi_pairs.c
mpicc -O1 -o "$work/mpi_mpmd" tests/programs/mpi_mpmd.c
pairs=$work/mpi_pairs mpmd=$work/mpi_mpmd
mapfile -t nodes < <(sinfo -h -N -o '%N' ${SLURM_PARTITION:+-p "$SLURM_PARTITION"} | sort -u | head -3)
((${#nodes[@]} == 3)) || { echo "shapes: needs 3 nodes, the partition has ${#nodes[@]}" >&2; exit 1; }
printf '%s\n' "${nodes[0]}" "${nodes[1]}" "${nodes[2]}" "${nodes[0]}" "${nodes[1]}" "${nodes[0]}" >"$work/hosts"
printf '0-1 %s a\n2-4 %s b\n' "$mpmd" "$mpmd" >"$work/mpmd.conf"
printf '0-2 %s\n3-5 %s\n' "$pairs" "$pairs" >"$work/pairs.conf"

ALL='all pairs exchanged'
WORLD='ranks in one MPI_COMM_WORLD'

# One run of a shape under --mpi=$1: its outcome ("ok", "fails: <status> (<why>)", or for an abort srun's
# status) and srun's seconds, tab-separated. $2 is what stdout must say (for an abort: "status"); the rest is
# the command, @MPI@ standing for --mpi=$1.
run_once() {
  local mpi=$1 want=$2; shift 2
  local cmd=() a
  for a in "$@"; do cmd+=("${a//@MPI@/--mpi=$mpi}"); done
  local start end status=0 output
  start=$(date +%s.%N)
  output=$(timeout 120 "${cmd[@]}" 2>"$work/stderr") || status=$?
  end=$(date +%s.%N)
  local secs
  secs=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.2f", b - a }')
  if [[ $want == status ]]; then
    printf 'status %s\t%s\n' "$status" "$secs"
  elif ((status == 0)) && grep -q "$want" <<<"$output"; then
    printf 'ok\t%s\n' "$secs"
  else
    printf 'fails: %s\t%s\n' "$(why "$status" "$work/stderr" "$output")" "$secs"
  fi
}

# The first line that says why a run failed, short.
why() {
  local line
  line=$({ grep -m1 -E 'error|Abort|unset|refused' "$2" || printf '%s\n' "$3" | grep -m1 -E 'error|Abort|unset'; } || true)
  line=${line//|/\\|}
  printf 'status %s%s' "$1" "${line:+ (${line:0:90})}"
}

# The median of the runs' seconds, and the outcome of the first run that differs from ok (or ok).
shape() {
  local name=$1; shift
  local row="| $name |" mpi
  for mpi in pmi2 rpmi; do
    local outcomes=() times=() r line
    for ((r = 0; r < runs; r++)); do
      line=$(run_once "$mpi" "$@")
      outcomes+=("${line%%$'\t'*}")
      times+=("${line##*$'\t'}")
    done
    local median outcome=${outcomes[0]} o
    median=$(printf '%s\n' "${times[@]}" | sort -n | awk '{ t[NR] = $1 } END { print t[int((NR + 1) / 2)] }')
    for o in "${outcomes[@]}"; do [[ $o == ok ]] || { outcome=$o; break; }; done
    row+=" $outcome, ${median} s |"
  done
  printf '%s\n' "$row"
}

# A batch script of a hetjob, its step over both components; sbatch's environment says which plugin.
printf '#!/bin/bash\n#SBATCH -N1 -n2\n#SBATCH hetjob\n#SBATCH -N2 -n3\nsrun "$SHAPES_MPI" --het-group=0,1 %s\n' \
  "$pairs" >"$work/hetjob.sh"
# sbatch --wait's own status is not the script's on every Slurm line: the output says how the step went.
hetjob="rm -f $work/hetjob.out; SHAPES_MPI=@MPI@ sbatch -Q --wait -o $work/hetjob.out $work/hetjob.sh; cat $work/hetjob.out"

{
  echo "| shape | \`--mpi=pmi2\` | \`--mpi=rpmi\` |"
  echo "|---|---|---|"
  shape "block, \`-N3 -n6\`" "$ALL" srun @MPI@ -N3 -n6 "$pairs"
  shape "cyclic, \`-N3 -n6 -m cyclic\`" "$ALL" srun @MPI@ -N3 -n6 -m cyclic "$pairs"
  shape "plane, \`-N3 -n6 -m plane=2\`" "$ALL" srun @MPI@ -N3 -n6 -m plane=2 "$pairs"
  shape "arbitrary, \`-n6 -m arbitrary\` (3, 2, 1 ranks)" "$ALL" env SLURM_HOSTFILE="$work/hosts" \
    srun @MPI@ -n6 -m arbitrary "$pairs"
  shape "\`-N3 -n3 -c 4\`" "$ALL" srun @MPI@ -N3 -n3 -c 4 "$pairs"
  shape "one task per node, \`-N3 --ntasks-per-node=1\`" "$ALL" srun @MPI@ -N3 --ntasks-per-node=1 "$pairs"
  shape "\`--multi-prog\`, one program" "$ALL" srun @MPI@ -N3 -n6 --multi-prog "$work/pairs.conf"
  shape "\`--multi-prog\`, two programs' \`MPI_APPNUM\`" "$WORLD" srun @MPI@ -N3 -n5 --multi-prog "$work/mpmd.conf"
  shape "three \`--overlap\` steps at once in \`salloc -N3 -n6\`" "$ALL" salloc -Q -N3 -n6 bash -c \
    "for i in 1 2 3; do srun @MPI@ --overlap -n6 $pairs & done; wait"
  shape "heterogeneous, \`-N1 -n2 A : -N1 -n3 B\`" "$ALL" srun @MPI@ -N1 -n2 "$pairs" : -N1 -n3 "$pairs"
  shape "heterogeneous, \`-N1 -n2 A : -N2 -n3 B\`" "$ALL" srun @MPI@ -N1 -n2 "$pairs" : -N2 -n3 "$pairs"
  shape "heterogeneous, each component's \`MPI_APPNUM\`" "$WORLD" srun @MPI@ -N1 -n2 "$mpmd" a : -N2 -n3 "$mpmd" b
  shape "\`#SBATCH hetjob\`, \`srun --het-group=0,1\`" "$ALL" bash -c "$hetjob"
  shape "\`MPI_Abort(7)\` in the second component (srun's status)" status \
    srun @MPI@ -N1 -n2 "$pairs" : -N2 -n3 "$pairs" abort=3:7
} | tee ${out:+"$out"}

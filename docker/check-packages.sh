#!/usr/bin/env bash
# Installs rpmi's two Debian packages on this system with dpkg -i, checks what they do, and removes them again.
# docker/slurm-plugin.sh package-test runs it as root in the Debian chroot of the Slurm the plugin was built for.
#
#   docker/check-packages.sh PLUGIN_DEB DEV_DEB
#
# rpmi-slurm (PLUGIN_DEB): dpkg -i puts mpi_rpmi.so in the PluginDir of this system's Slurm and its postinst says
# to restart the daemons. On a local 3-node cluster with that PluginDir alone (docker/slurm-cluster.sh), srun
# --mpi=list lists rpmi and an MPICH job runs with srun --mpi=rpmi. Installed again while the cluster runs, the
# file is a new one (a new inode: dpkg renames the new file over the old, which a daemon may have loaded, and
# never writes into it), and the next job runs. With MpiDefault=rpmi in slurm.conf, a job runs with it and
# no --mpi. Then docs/slurm.md's way back to pmi2, with a step running under rpmi: MpiDefault=pmi2 and
# `scontrol reconfigure`, then dpkg -r rpmi-slurm; the running step ends well, a new step of --mpi=pmi2 runs, and
# one of --mpi=rpmi is refused.
# rpmi (DEV_DEB): tests/c_host/host.c builds and links with `pkg-config --cflags --libs rpmi` and runs an MPICH
# job over the installed librpmi.so; the installed rpmi-run runs rpmi-probe and an MPICH job; the API programs
# (tests/programs/pmi_api.c, pmi2_api.c) build with `pkg-config rpmi-pmi` and `rpmi-pmi2`, load the package's
# libpmi.so.0 and libpmi2.so.0 (not Slurm's), and pass under rpmi-run and alone.
# Both: the manual pages (docs/man, made by docker/man.sh) and the documentation are where each package puts
# them, the pages roff that names itself; `man -w rpmi-options` finds the options' page with rpmi-slurm alone,
# with both packages, and with rpmi alone (each offers it as an alternative).
# Each step's time is said. Both packages are purged at the end (on a failure too) and their files checked gone.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf 'check-packages: %s\n' "$*" >&2; }
die() { log "FAILED: $*"; exit 1; }
(($# == 2)) || { sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
plugin_deb=$1 dev_deb=$2
[[ -f $plugin_deb && -f $dev_deb ]] || die "no such package: $plugin_deb or $dev_deb"

work=$(mktemp -d /tmp/rpmi-packages.XXXXXX)
export RPMI_SLURM_DIR=$work/slurm
cleanup() {
  bash docker/slurm-cluster.sh stop >/dev/null 2>&1 || true
  dpkg --purge rpmi-slurm rpmi >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

# Runs "$@" with its output in $work/out and says how long it took; fails, showing that output, if it fails.
step() {
  local what=$1 t=$EPOCHREALTIME
  shift
  if ! "$@" >"$work/out" 2>&1; then
    cat "$work/out" >&2
    die "$what"
  fi
  log "$what: ok, $(awk -v a="$t" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.2f", b - a }') s"
}

# Fails unless the last step's output has a line matching the extended regular expression $1.
expect() {
  grep -qE -- "$1" "$work/out" || { cat "$work/out" >&2; die "no line matching '$1' in that output"; }
}

# Fails if the last step's output has a line matching $1.
refuse() {
  ! grep -qE -- "$1" "$work/out" || { cat "$work/out" >&2; die "a line matching '$1' in that output"; }
}

start_cluster() { eval "$(bash docker/slurm-cluster.sh start "$@")"; }

# Fails unless package $1 installed file $2, not empty.
installed() {
  dpkg -L "$1" | grep -qxF -- "$2" || die "$1 does not list $2"
  [[ -s $2 ]] || die "$1 lists $2, but it is not there"
}

# Fails unless package $1 installed the manual page $2 (a path), of page $3 in section $4, and man finds it
# (through the alternative $5 where the page is one); says what it checked.
man_page() {
  local pkg=$1 file=$2 name=$3 section=$4 link=${5:-$2} found
  installed "$pkg" "$file"
  zcat -- "$file" | grep -qF ".TH \"${name^^}\" \"$section\"" || die "$file is not the manual page $name($section)"
  [[ $(readlink -f "$link") == "$(readlink -f "$file")" ]] || die "$link is not $file"
  found=$(man -w "$section" "$name") || die "man -w $section $name finds nothing"
  [[ $(readlink -f "$found") == "$(readlink -f "$file")" ]] || die "man -w $section $name finds $found, not $file"
  log "$pkg: $name($section) in $file, and man finds it"
}
options_page=/usr/share/man/man7/rpmi-options.7.gz

command -v man >/dev/null || die "man is missing (man-db): docker/slurm-plugin.sh installs it in its chroots"

step "mpicc tests/programs/mpi_pairs.c" mpicc -O1 -o "$work/mpi_pairs" tests/programs/mpi_pairs.c
pairs6='^mpi_pairs: 6 ranks, allreduce 21, all pairs exchanged$'
pairs4='^mpi_pairs: 4 ranks, allreduce 10, all pairs exchanged$'

# --- rpmi-slurm, alone
step "dpkg -i ${plugin_deb##*/}" dpkg -i "$plugin_deb"
expect 'Restart slurmctld, and slurmd on'
refuse 'warning'   # e.g. a control file without a field dpkg requires
plugin=$(dpkg -L rpmi-slurm | grep '/mpi_rpmi\.so$') || die "rpmi-slurm has no mpi_rpmi.so"
[[ -f $(dirname "$plugin")/mpi_pmi2.so ]] || die "$plugin is not beside Slurm's own MPI plugins"
log "rpmi-slurm installed $plugin"
man_page rpmi-slurm /usr/share/rpmi-slurm/rpmi-options.7.gz rpmi-options 7 "$options_page"
for doc in docs/slurm.md docs/security.md docs/troubleshooting.md; do
  installed rpmi-slurm "/usr/share/doc/rpmi-slurm/${doc##*/}"
done
installed rpmi-slurm /usr/share/doc/rpmi-slurm/copyright

step "the cluster, on Slurm's PluginDir" start_cluster
step "srun --mpi=list" timeout 60 srun --mpi=list
expect '(^|[[:space:]])rpmi$'
step "srun --mpi=rpmi -N3 -n6 mpi_pairs" timeout 120 srun -Q --mpi=rpmi -N3 -n6 "$work/mpi_pairs"
expect "$pairs6"

inode=$(stat -c %i "$plugin")
step "dpkg -i ${plugin_deb##*/} again, the cluster running" dpkg -i "$plugin_deb"
[[ $(stat -c %i "$plugin") != "$inode" ]] || die "dpkg -i wrote into $plugin (inode $inode) instead of replacing it"
step "srun --mpi=rpmi -N3 -n6 mpi_pairs after it" timeout 120 srun -Q --mpi=rpmi -N3 -n6 "$work/mpi_pairs"
expect "$pairs6"

step "the cluster again, with MpiDefault=rpmi" start_cluster --mpi-default rpmi
step "srun -N3 -n6 mpi_pairs (MpiDefault=rpmi)" timeout 120 srun -Q -N3 -n6 "$work/mpi_pairs"
expect "$pairs6"
step "srun -N1 -n1 printenv SLURM_MPI_TYPE" timeout 60 srun -Q -N1 -n1 printenv SLURM_MPI_TYPE
expect '^rpmi$'

# --- both packages
step "dpkg -i ${dev_deb##*/}, beside rpmi-slurm" dpkg -i "$dev_deb"
refuse 'warning'
man_page rpmi-slurm /usr/share/rpmi-slurm/rpmi-options.7.gz rpmi-options 7 "$options_page"

# --- the way back to pmi2 (docs/slurm.md), a step running under rpmi meanwhile
timeout 120 srun -Q --mpi=rpmi -N3 -n6 sh -c "echo started; sleep 3; exec $work/mpi_pairs" >"$work/running" 2>&1 &
running=$!
# Every task runs (its srun and slurmstepds have loaded the plugin) before anything changes.
for ((i = 0; i < 300; i++)); do
  (($(grep -c '^started$' "$work/running") == 6)) && break
  sleep 0.1
done
(($(grep -c '^started$' "$work/running") == 6)) || { cat "$work/running" >&2; die "the step under rpmi did not start"; }
step "MpiDefault=pmi2, scontrol reconfigure" sh -c \
  'sed -i "s/^MpiDefault=.*/MpiDefault=pmi2/" "$SLURM_CONF" && scontrol reconfigure'
step "dpkg -r rpmi-slurm, the step running" dpkg -r rpmi-slurm
[[ ! -e $plugin ]] || die "$plugin is left after dpkg -r"
wait "$running" || { cat "$work/running" >&2; die "the step that ran under rpmi failed once rpmi-slurm was removed"; }
grep -qE "$pairs6" "$work/running" || { cat "$work/running" >&2; die "the running step did not finish its exchange"; }
log "the step that ran under rpmi while rpmi-slurm was removed: ok"
step "srun -N3 -n6 mpi_pairs (MpiDefault=pmi2)" timeout 120 srun -Q -N3 -n6 "$work/mpi_pairs"
expect "$pairs6"
step "srun -N1 -n1 printenv SLURM_MPI_TYPE" timeout 60 srun -Q -N1 -n1 printenv SLURM_MPI_TYPE
expect '^pmi2$'
if timeout 60 srun -Q --mpi=rpmi -N1 -n1 true >"$work/out" 2>&1; then
  die "srun --mpi=rpmi ran after rpmi-slurm was removed"
fi
log "srun --mpi=rpmi after the removal is refused: $(head -1 "$work/out")"
man_page rpmi /usr/share/rpmi/rpmi-options.7.gz rpmi-options 7 "$options_page"
step "stopping the cluster" bash docker/slurm-cluster.sh stop

# --- rpmi
lib=$(dpkg -L rpmi | grep '/librpmi\.so$') || die "rpmi has no librpmi.so"
man_page rpmi /usr/share/man/man1/rpmi-run.1.gz rpmi-run 1
man_page rpmi /usr/share/man/man1/rpmi-probe.1.gz rpmi-probe 1
for doc in README.md CHANGELOG.md docs/*.md; do
  installed rpmi "/usr/share/doc/rpmi/${doc##*/}"
done
installed rpmi /usr/share/doc/rpmi/plugin-spec.md
installed rpmi /usr/share/doc/rpmi/copyright
grep -qF 'Permission is hereby granted' /usr/share/doc/rpmi/copyright || die "rpmi's copyright file lacks the licence"
log "rpmi: its documentation in /usr/share/doc/rpmi"
version=$(dpkg-query -W -f='${Version}' rpmi)
step "pkg-config --modversion rpmi" pkg-config --modversion rpmi
expect "^${version%-*}\$"
# The flags tests/c_host.rs builds it with, the header and library from pkg-config instead of the source tree.
# shellcheck disable=SC2046  # pkg-config's words are separate arguments
step "cc tests/c_host/host.c \$(pkg-config --cflags --libs rpmi)" cc -std=c99 -Wall -Wextra -Werror -O2 \
  -D_GNU_SOURCE $(pkg-config --cflags rpmi) tests/c_host/host.c -o "$work/host" $(pkg-config --libs rpmi) -ldl -lpthread
step "host -n 4 --nodes 2 librpmi.so mpi_pairs" timeout 120 "$work/host" -n 4 --nodes 2 librpmi.so "$work/mpi_pairs"
expect "$pairs4"
[[ $(command -v rpmi-run) == /usr/bin/rpmi-run ]] || die "rpmi-run is not the package's: $(command -v rpmi-run)"
step "rpmi-run -n 2 rpmi-probe info" timeout 60 rpmi-run -n 2 rpmi-probe info
expect '^rank=0 size=2 '
expect '^rank=1 size=2 '
step "rpmi-run -n 4 --nodes 2 mpi_pairs" timeout 120 rpmi-run -n 4 --nodes 2 "$work/mpi_pairs"
expect "$pairs4"
# The client libraries: tests/programs/NAME.c built with pkg-config's flags loads the package's SONAME (not
# Slurm's, installed beside it) and passes every call under the installed rpmi-run and with no launcher, each
# rank printing a line that ends with TAIL.
api_program() {
  local name=$1 pc=$2 soname=$3 tail=$4 installed loaded
  installed=$(dpkg -L rpmi | grep "/rpmi/${soname//./\\.}\$") || die "rpmi has no $soname"
  # shellcheck disable=SC2046  # pkg-config's words are separate arguments
  step "cc tests/programs/$name.c \$(pkg-config --cflags --libs $pc)" cc -Wall -Wextra -Werror -O2 \
    $(pkg-config --cflags "$pc") "tests/programs/$name.c" -o "$work/$name" $(pkg-config --libs "$pc") -pthread
  loaded=$(ldd "$work/$name" | awk -v so="$soname" '$1 == so { print $3 }')
  [[ $(readlink -f "$loaded") == "$(readlink -f "$installed")" ]] || die "$name loads ${loaded:-no $soname}, not $installed"
  step "rpmi-run -n 4 --nodes 2 $name" timeout 120 rpmi-run -n 4 --nodes 2 "$work/$name"
  expect "^rank 3 of 4: ok$tail\$"
  step "$name alone" env -u PMI_FD -u PMI_RANK -u PMI_SIZE -u PMI_JOBID "$work/$name" alone
  expect "^rank 0 of 1: ok"
  api_libs+=("$installed")
}
api_libs=()
api_program pmi_api rpmi-pmi libpmi.so.0 " clique=2 groups=1"
api_program pmi2_api rpmi-pmi2 libpmi2.so.0 ""

step "dpkg --purge rpmi-slurm rpmi" dpkg --purge rpmi-slurm rpmi
for f in "$plugin" "$lib" "${api_libs[@]}"; do
  [[ ! -e $f ]] || die "$f is left after the purge"
done
for f in /usr/share/man/man1/rpmi-run.1.gz "$options_page" /usr/share/rpmi /usr/share/rpmi-slurm /usr/share/doc/rpmi \
  /usr/share/doc/rpmi-slurm; do
  [[ ! -e $f ]] || die "$f is left after the purge"
done
log "every check passed"

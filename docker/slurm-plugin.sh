#!/usr/bin/env bash
# The Slurm plugin for one supported Slurm release line, built against and tested on that line's own Slurm.
#
#   docker/slurm-plugin.sh build VERSION OUTDIR   build mpi_rpmi.so for that Slurm into OUTDIR
#   docker/slurm-plugin.sh test VERSION           build it, start that Slurm's local 3-node cluster with it,
#                                                 run tests/slurm.rs against it, and stop the cluster
#   docker/slurm-plugin.sh chroot VERSION         make the Debian system that runs that Slurm (if missing)
#                                                 and print its path
#
# VERSION is 22.05 (this machine's own Slurm, Debian 12), 24.11 (Debian 13, trixie) or 26.05 (Debian unstable,
# sid). The other lines' Slurm lives in a Debian chroot made with debootstrap under
# ${RPMI_CHROOTS:-/var/tmp/rpmi-chroots}/SUITE, with Slurm, munge and MPICH installed from Debian: the plugin is
# built on this machine against the chroot's headers (SLURM_INCLUDE_DIR; it links against nothing newer than
# this machine's glibc, which the chroot's is not older than), and the tests run inside the chroot, where srun,
# the daemons and mpicc are that Slurm's and that Debian's. The project directory is bind-mounted into the
# chroot at the same path, so the test binary finds its programs. RPMI_CHROOT_FRESH=1 makes the chroot anew.
# Must run as root. Builds go to target/slurm-VERSION (CARGO_TARGET_DIR is not used). The cluster's state
# directory is $RPMI_SLURM_DIR, else /tmp/rpmi-slurm-VERSION (in the chroot's own /tmp); docker/slurm-cluster.sh
# tells its processes from others' by that path through /proc, which every chroot shares, so two runs of one
# VERSION at once (from two clones, with two RPMI_CHROOTS) need two different ones.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
chroots=${RPMI_CHROOTS:-/var/tmp/rpmi-chroots}

log() { printf 'slurm-plugin: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

# The Debian suite that carries each line's Slurm ("" for this machine's own).
suite_of() {
  case $1 in
    22.05) echo "" ;;
    24.11) echo trixie ;;
    26.05) echo sid ;;
    *) die "unsupported Slurm version '$1': 22.05, 24.11 or 26.05" ;;
  esac
}

# Mounts what a chroot needs to run daemons and builds (idempotent); `release_chroot` undoes it.
mount_chroot() {
  local dir=$1
  mountpoint -q "$dir/proc" || mount -t proc proc "$dir/proc"
  mountpoint -q "$dir/sys" || mount --rbind /sys "$dir/sys"
  mountpoint -q "$dir/dev" || mount --rbind /dev "$dir/dev"
  mountpoint -q "$dir/tmp" || mount -t tmpfs tmpfs "$dir/tmp"
  mkdir -p "$dir$repo"
  mountpoint -q "$dir$repo" || mount --bind "$repo" "$dir$repo"
}

# Stops what still runs in the chroot (its munged, which the cluster's `stop` leaves running), then unmounts.
release_chroot() {
  local dir=$1 m p
  for p in /proc/[0-9]*; do
    if [[ $(readlink "$p/root" 2>/dev/null) == "$dir" ]]; then kill "${p#/proc/}" 2>/dev/null || true; fi
  done
  sleep 0.5
  for m in "$dir$repo" "$dir/tmp" "$dir/dev" "$dir/sys" "$dir/proc"; do
    mountpoint -q "$m" && umount -R "$m" 2>/dev/null || umount -Rl "$m" 2>/dev/null || true
  done
}

# Makes the chroot for Slurm line $1 unless a complete one is there (marked by .rpmi-ready); prints its path.
ensure_chroot() {
  local version=$1 suite dir apt_opts=()
  suite=$(suite_of "$version")
  [[ -n $suite ]] || { echo /; return; }
  dir=$chroots/$suite
  if [[ ${RPMI_CHROOT_FRESH:-0} == 1 && -d $dir ]]; then
    release_chroot "$dir"
    rm -rf --one-file-system "$dir"
  fi
  if [[ ! -f $dir/.rpmi-ready ]]; then
    command -v debootstrap >/dev/null || { apt-get update >&2; apt-get install -y --no-install-recommends debootstrap >&2; }
    log "making a Debian $suite chroot in $dir (a few minutes)"
    release_chroot "$dir"
    rm -rf --one-file-system "$dir"
    mkdir -p "$chroots"
    debootstrap --variant=minbase "$suite" "$dir" http://deb.debian.org/debian >&2
    # sid's archive is signed for days at a time; an image older than that is still what is wanted here.
    [[ $suite == sid ]] && apt_opts=(-o Acquire::Check-Valid-Until=false)
    mount_chroot "$dir"
    chroot "$dir" apt-get "${apt_opts[@]}" update >&2
    chroot "$dir" env DEBIAN_FRONTEND=noninteractive apt-get "${apt_opts[@]}" install -y --no-install-recommends \
      slurm-wlm slurm-client munge libslurm-dev mpich libmpich-dev gcc libc6-dev binutils procps psmisc >&2
    touch "$dir/.rpmi-ready"
  fi
  mount_chroot "$dir"
  # Slurm 24.11's slurmctld answers a client by this machine's name: the chroot must resolve it as the host does.
  local name
  name=$(hostname)
  grep -qw -- "$name" "$dir/etc/hosts" 2>/dev/null || echo "127.0.1.1 $name" >>"$dir/etc/hosts"
  local want have
  want=$version
  have=$(chroot "$dir" slurmd -V | awk '{print $2}')
  [[ $have == "$want".* ]] || die "the $suite chroot runs Slurm $have, not $want"
  echo "$dir"
}

# Builds the plugin for line $1 into target/slurm-$1; prints the library's path.
build_plugin() {
  local version=$1 root include
  root=$(ensure_chroot "$version")
  include=${root%/}/usr/include
  [[ -f $include/slurm/slurm_version.h ]] || die "$include/slurm/slurm_version.h is missing (libslurm-dev)"
  local n
  n=$(sed -n 's/^#define SLURM_VERSION_NUMBER *\(0x[0-9a-fA-F]*\).*/\1/p' "$include/slurm/slurm_version.h")
  log "building the plugin against Slurm $((n >> 16 & 255)).$(printf %02d $((n >> 8 & 255))).$((n & 255)) ($include)"
  SLURM_INCLUDE_DIR=$include CARGO_TARGET_DIR=$repo/target/slurm-$version \
    cargo build --locked --release --features slurm >&2
  echo "$repo/target/slurm-$version/release/librpmi.so"
}

cmd=${1:-}
case $cmd in
  build)
    (($# == 3)) || usage
    version=$2 out=$3
    lib=$(build_plugin "$version")
    suite=$(suite_of "$version")
    [[ -z $suite ]] || release_chroot "$chroots/$suite"
    mkdir -p "$out"
    install -m 0755 "$lib" "$out/mpi_rpmi.so"
    log "$out/mpi_rpmi.so (Slurm $version)"
    ;;
  test)
    (($# == 2)) || usage
    version=$2
    root=$(ensure_chroot "$version")
    build_plugin "$version" >/dev/null
    # The test binary, built against the same headers; its path from cargo's own report.
    tests=$(SLURM_INCLUDE_DIR=${root%/}/usr/include CARGO_TARGET_DIR=$repo/target/slurm-$version \
      cargo test --locked --release --features slurm --test slurm --no-run --message-format=json |
      grep '"src_path":"[^"]*/tests/slurm.rs"' | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)
    [[ -x $tests ]] || die "no test binary"
    run=(env RPMI_PLUGIN_NO_BUILD=1 CARGO_TARGET_DIR=$repo/target/slurm-$version RPMI_SLURM_DIR=${RPMI_SLURM_DIR:-/tmp/rpmi-slurm-$version}
      bash docker/with-slurm.sh "$tests")
    if [[ $root == / ]]; then
      "${run[@]}"
    else
      trap 'release_chroot "$root"' EXIT
      chroot "$root" bash -c 'cd "$1" && shift && exec "$@"' - "$repo" "${run[@]}"
    fi
    ;;
  chroot)
    (($# == 2)) || usage
    ensure_chroot "$2"
    ;;
  *) usage ;;
esac

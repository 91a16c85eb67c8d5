#!/usr/bin/env bash
# The Slurm plugin for one supported Slurm release line, built against and tested on that line's own Slurm.
#
#   docker/slurm-plugin.sh build VERSION OUTDIR   build mpi_rpmi.so for that Slurm into OUTDIR, and its Debian
#                                                 package, rpmi-slurm_<rpmi>+slurm<X.Y.Z>-1_<arch>.deb
#   docker/slurm-plugin.sh test VERSION           build it, start that Slurm's local 3-node cluster with it,
#                                                 run tests/slurm.rs against it, and stop the cluster
#   docker/slurm-plugin.sh package-test VERSION   build its package and the developers' (cargo deb), install
#                                                 both with dpkg -i in that Slurm's Debian chroot, check them
#                                                 there (docker/check-packages.sh) and remove them
#   docker/slurm-plugin.sh chroot VERSION         make the Debian system that runs that Slurm (if missing)
#                                                 and print its path
#   docker/slurm-plugin.sh run VERSION CMD [ARG]...  run CMD in that Debian system (in the project directory,
#                                                 mounted at the same path), then release it
#
# VERSION is 22.05 (this machine's own Slurm, Debian 12), 24.11 (Debian 13, trixie) or 26.05 (Debian unstable,
# sid). The other lines' Slurm lives in a Debian chroot made with debootstrap under
# ${RPMI_CHROOTS:-/var/tmp/rpmi-chroots}/SUITE, with Slurm, munge and MPICH installed from Debian: the plugin is
# built on this machine against the chroot's headers (SLURM_INCLUDE_DIR; it links against nothing newer than
# this machine's glibc, which the chroot's is not older than), and the tests run inside the chroot, where srun,
# the daemons and mpicc are that Slurm's and that Debian's. The project directory is bind-mounted into the
# chroot at the same path, so the test binary finds its programs. The packages of 22.05 are tried in a Debian 12
# (bookworm) chroot made the same way, so that this machine's own system is left as it is. RPMI_CHROOT_FRESH=1
# makes the chroot anew. Must run as root. Every line builds in the project's target/ (CARGO_TARGET_DIR is not
# used: the chroots see the project directory only), so the dependencies are built once for all lines and the
# developers' package, and only the plugin's own crate again for each line; the packages are made with cargo-deb, which
# `docker/install-deps.sh deb` installs. The cluster's state directory is $RPMI_SLURM_DIR, else
# /tmp/rpmi-slurm-VERSION (in the chroot's own /tmp); docker/slurm-cluster.sh tells its processes from others' by
# that path through /proc, which every chroot shares, so two runs of one VERSION at once (from two clones, with
# two RPMI_CHROOTS) need two different ones.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
chroots=${RPMI_CHROOTS:-/var/tmp/rpmi-chroots}

log() { printf 'slurm-plugin: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

# The Debian suite that carries each line's Slurm ("" for this machine's own).
suite_of() {
  case $1 in
    22.05) echo "" ;;
    24.11) echo trixie ;;
    26.05) echo sid ;;
    *) die "no Debian chroot for Slurm '$1': 22.05, 24.11 or 26.05 (another installed Slurm: RPMI_SLURM_PREFIX with docker/with-slurm.sh)" ;;
  esac
}

# The Debian suite where the packages for each line are tried: its own, and bookworm for this machine's.
package_suite_of() {
  if [[ $1 == 22.05 ]]; then echo bookworm; else suite_of "$1"; fi
}

# What each chroot has installed: Slurm, munge and MPICH from Debian, and what the builds and tests run there.
chroot_packages=(slurm-wlm slurm-client munge libslurm-dev mpich libmpich-dev gcc libc6-dev binutils procps psmisc
  pkg-config man-db)

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

# Makes the chroot for Slurm line $1 in Debian suite $2 (default: the line's own, `suite_of`) unless one is there
# (its debootstrap marked complete by .rpmi-ready), installs what it lacks of chroot_packages, mounts what it
# needs; prints its path.
ensure_chroot() {
  local version=$1 suite=${2:-} dir apt_opts=()
  [[ -n $suite ]] || suite=$(suite_of "$version")
  [[ -n $suite ]] || { echo /; return; }
  dir=$chroots/$suite
  # sid's archive is signed for days at a time; an image older than that is still what is wanted here.
  [[ $suite == sid ]] && apt_opts=(-o Acquire::Check-Valid-Until=false)
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
    touch "$dir/.rpmi-ready"
  fi
  mount_chroot "$dir"
  local p missing=()
  for p in "${chroot_packages[@]}"; do
    chroot "$dir" dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  if ((${#missing[@]})); then
    chroot "$dir" apt-get "${apt_opts[@]}" update >&2
    chroot "$dir" env DEBIAN_FRONTEND=noninteractive apt-get "${apt_opts[@]}" install -y --no-install-recommends \
      "${missing[@]}" >&2
  fi
  # Slurm 24.11's slurmctld answers a client by this machine's name: the chroot must resolve it as the host does.
  # debootstrap's /etc/hosts lacks localhost, whose lookup then goes to DNS: MPICH's start-up waited 5 s for
  # it in about one job in three.
  local name
  name=$(hostname)
  grep -qw -- "$name" "$dir/etc/hosts" 2>/dev/null || echo "127.0.1.1 $name" >>"$dir/etc/hosts"
  grep -qw localhost "$dir/etc/hosts" 2>/dev/null || echo "127.0.0.1 localhost" >>"$dir/etc/hosts"
  local want have
  want=$version
  have=$(chroot "$dir" slurmd -V | awk '{print $2}')
  [[ $have == "$want".* ]] || die "the $suite chroot runs Slurm $have, not $want"
  echo "$dir"
}

# The Slurm release X.YY.Z of the headers under $1 (an include directory), from SLURM_VERSION_NUMBER, the
# number the plugin's plugin_version is built from.
slurm_release() {
  local n
  n=$(sed -n 's/^#define SLURM_VERSION_NUMBER *\(0x[0-9a-fA-F]*\).*/\1/p' "$1/slurm/slurm_version.h")
  [[ -n $n ]] || die "$1/slurm/slurm_version.h has no SLURM_VERSION_NUMBER"
  echo "$((n >> 16 & 255)).$(printf %02d $((n >> 8 & 255))).$((n & 255))"
}

# What the plugin's package installs in /usr/share/doc/rpmi-slurm besides the options' manual page.
plugin_docs=(docs/slurm.md docs/security.md docs/troubleshooting.md)

# Builds the plugin for line $1 into target/ (over the build of any other line); prints the library's path.
build_plugin() {
  local version=$1 root include
  root=$(ensure_chroot "$version")
  include=${root%/}/usr/include
  [[ -f $include/slurm/slurm_version.h ]] || die "$include/slurm/slurm_version.h is missing (libslurm-dev)"
  log "building the plugin against Slurm $(slurm_release "$include") ($include)"
  SLURM_INCLUDE_DIR=$include CARGO_TARGET_DIR=$repo/target cargo build --locked --release --features slurm >&2
  echo "$repo/target/release/librpmi.so"
}

# Makes the Debian package rpmi-slurm of the plugin that build_plugin built for line $1, in directory $2, with
# cargo-deb; prints its path. What the package depends on and where it puts the plugin are those of the Slurm
# the plugin was built against, and cargo-deb reads a package's metadata from its Cargo.toml alone: so that
# manifest is written here, per build, for a package that cargo never builds (cargo deb --no-build) and whose
# library is the one build_plugin just built. Beside the plugin it installs the site's documentation: the options'
# manual page (docker/man.sh makes it), which its postinst makes an alternative for the manual's own path (the
# developers' package rpmi offers the same page so, since dpkg lets no two packages own one file), and the
# guides a site admin reads.
package_plugin() {
  local version=$1 out=$2 root release next plugindir crate maintainer dir deb doc
  for doc in "${plugin_docs[@]}"; do
    [[ -f $doc ]] || die "$doc is missing: the rpmi-slurm package installs it"
  done
  bash docker/man.sh >&2
  root=$(ensure_chroot "$version")
  release=$(slurm_release "${root%/}/usr/include")
  next=${release%.*}.$((${release##*.} + 1))
  # The PluginDir: where the package that owns it, slurm-wlm-basic-plugins, put Slurm's own MPI plugins.
  plugindir=$(dpkg-query --admindir="${root%/}/var/lib/dpkg" -L slurm-wlm-basic-plugins | sed -n 's,/mpi_pmi2\.so$,,p')
  [[ -n $plugindir ]] || die "slurm-wlm-basic-plugins in $root has no mpi_pmi2.so: where is Slurm's PluginDir?"
  crate=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -1)
  maintainer=$(sed -n 's/^maintainer = "\(.*\)"$/\1/p' Cargo.toml)
  dir=$repo/target/slurm-$version/package
  mkdir -p "$dir" "$out"
  cat >"$dir/Cargo.toml" <<EOF
# Written by docker/slurm-plugin.sh for cargo-deb: the Debian package of the Slurm plugin built against Slurm
# $release, from the library in $repo/target/release.
[package]
name = "rpmi-slurm"
version = "$crate"
edition = "2021"
description = "rpmi's PMI plugin for Slurm $release (srun --mpi=rpmi): PMI-1, PMI 1.2 and PMI-2"
license = "MIT"
publish = false

[lib]
name = "rpmi"
path = "$repo/src/lib.rs"
crate-type = ["cdylib"]

[workspace]

[package.metadata.deb]
section = "net"
# Slurm loads a plugin only if it was built for its very release (plugin_version against its own
# SLURM_VERSION_NUMBER, to the micro release); the packages of slurmd, slurmctld and srun (slurm-client) each
# depend on exactly their own version of slurm-wlm-basic-plugins, which owns the PluginDir.
depends = "\$auto, slurm-wlm-basic-plugins (>= $release~), slurm-wlm-basic-plugins (<< $next~)"
extended-description = """\\
Installs mpi_rpmi.so in $plugindir, Slurm's PluginDir, and the manual page rpmi-options(7). Restart \\
slurmctld, and slurmd on every node, so that they load it; then srun --mpi=rpmi, or MpiDefault=rpmi in \\
slurm.conf, serves a job's tasks PMI-1, PMI 1.2 and PMI-2 with it."""
maintainer-scripts = "$repo/packaging/slurm-plugin/"
# dpkg unpacks every file as NAME.dpkg-new beside NAME and renames it over NAME, so a loaded mpi_rpmi.so is never
# written over (docker/check-packages.sh checks that an install gives the file a new inode).
assets = [
    ["target/release/librpmi.so", "${plugindir#/}/mpi_rpmi.so", "644"],
    # From this manifest's directory, target/slurm-$version/package (cargo-deb takes only target/release/ as
    # the target directory).
    ["../../man/rpmi-options.7.gz", "usr/share/rpmi-slurm/", "644"],
$(for doc in "${plugin_docs[@]}"; do printf '    ["%s", "usr/share/doc/rpmi-slurm/", "644"],\n' "$repo/$doc"; done)
]
copyright = "2026, rpmi contributors"
license-file = ["$repo/LICENSE", "0"]
EOF
  deb=$(CARGO_TARGET_DIR=$repo/target cargo deb --manifest-path "$dir/Cargo.toml" --no-build \
    --deb-version "$crate+slurm$release-1" --maintainer "$maintainer" --output "$out" | tail -1)
  [[ -f $deb ]] || die "cargo deb did not say where it put the package"
  echo "$deb"
}

cmd=${1:-}
case $cmd in
  build)
    (($# == 3)) || usage
    version=$2 out=$3
    bash docker/install-deps.sh deb >&2
    lib=$(build_plugin "$version")
    deb=$(package_plugin "$version" "$out")
    suite=$(suite_of "$version")
    [[ -z $suite ]] || release_chroot "$chroots/$suite"
    install -m 0755 "$lib" "$out/mpi_rpmi.so"
    log "$out/mpi_rpmi.so and $deb (Slurm $version)"
    ;;
  test)
    (($# == 2)) || usage
    version=$2
    root=$(ensure_chroot "$version")
    build_plugin "$version" >/dev/null
    # libpmi.so and libpmi2.so, which tests/slurm.rs runs programs through, beside the test binary (a test
    # build makes none).
    CARGO_TARGET_DIR=$repo/target cargo build --locked --release -p rpmi-libpmi -p rpmi-libpmi2 >&2
    # The test binary, built against the same headers; its path from cargo's own report.
    tests=$(SLURM_INCLUDE_DIR=${root%/}/usr/include CARGO_TARGET_DIR=$repo/target \
      cargo test --locked --release --features slurm --test slurm --no-run --message-format=json |
      grep '"src_path":"[^"]*/tests/slurm.rs"' | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)
    [[ -x $tests ]] || die "no test binary"
    run=(env RPMI_PLUGIN_NO_BUILD=1 CARGO_TARGET_DIR=$repo/target RPMI_SLURM_DIR=${RPMI_SLURM_DIR:-/tmp/rpmi-slurm-$version}
      bash docker/with-slurm.sh "$tests")
    if [[ $root == / ]]; then
      "${run[@]}"
    else
      # The chroots' MPICH speaks PMI-2 (4.1 and later): the tests that need one run there too; those that
      # need MPICH 5, Intel MPI, Open MPI or Flux from this machine, or 100 nodes, stay with its run (docker/test.sh).
      run+=(--include-ignored --skip mpich5_ --skip impi_ --skip ompi_ --skip flux_ --skip hundred)
      trap 'release_chroot "$root"' EXIT
      chroot "$root" bash -c 'cd "$1" && shift && exec "$@"' - "$repo" "${run[@]}"
    fi
    ;;
  package-test)
    (($# == 2)) || usage
    version=$2
    bash docker/install-deps.sh deb >&2
    debs=$repo/target/slurm-$version/debian
    rm -rf "$debs"
    build_plugin "$version" >/dev/null
    plugin_deb=$(package_plugin "$version" "$debs")
    # The developers' package as the README makes it: its manual pages first (package_plugin made them). Its
    # build of librpmi.so (without the plugin) replaces the plugin's in target/release: the plugin's package is
    # made by then.
    CARGO_TARGET_DIR=$repo/target cargo build --locked --release -p rpmi-libpmi -p rpmi-libpmi2 >&2
    dev_deb=$(CARGO_TARGET_DIR=$repo/target cargo deb --locked --output "$debs" | tail -1)
    [[ -f $dev_deb ]] || die "cargo deb did not say where it put the developers' package"
    suite=$(suite_of "$version")
    [[ -z $suite ]] || release_chroot "$chroots/$suite"
    root=$(ensure_chroot "$version" "$(package_suite_of "$version")")
    trap 'release_chroot "$root"' EXIT
    chroot "$root" bash -c 'cd "$1" && shift && exec "$@"' - "$repo" bash docker/check-packages.sh "$plugin_deb" "$dev_deb"
    ;;
  chroot)
    (($# == 2)) || usage
    ensure_chroot "$2"
    ;;
  run)
    (($# >= 3)) || usage
    version=$2
    shift 2
    root=$(ensure_chroot "$version")
    [[ $root == / ]] && exec "$@"
    trap 'release_chroot "$root"' EXIT
    chroot "$root" bash -c 'cd "$1" && shift && exec "$@"' - "$repo" "$@"
    ;;
  *) usage ;;
esac

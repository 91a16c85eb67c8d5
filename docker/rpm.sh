#!/usr/bin/env bash
# Makes the RPM of the Slurm plugin (packaging/rpm/rpmi-slurm.spec) against the Slurm headers that the build
# finds (SLURM_INCLUDE_DIR, else `pkg-config slurm`'s, else /usr/include), into target/rpm, and checks what the
# package says of itself: that it requires exactly that Slurm release, puts mpi_rpmi.so in the PluginDir, and
# carries the site's documents and the options' manual page.
#
#   docker/rpm.sh [--define "slurm_plugindir DIR"]...     (extra arguments go to rpmbuild)
#
# On an EL build host with SchedMD's slurm-devel, cargo, clang-devel and lowdown installed, rpmbuild checks the
# spec's BuildRequires. Where rpm knows no installed packages (Debian's rpm tools, installed here first), it
# cannot, and builds with --nodeps: the package is made and read, not installed.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive

die() { echo "rpm.sh: $*" >&2; exit 1; }
if ! command -v rpmbuild >/dev/null && command -v apt-get >/dev/null; then
  apt-get update
  apt-get install -y --no-install-recommends rpm lowdown
fi
command -v rpmbuild >/dev/null || die "rpmbuild is missing (the rpm-build package)"

include=${SLURM_INCLUDE_DIR:-$(pkg-config --variable=includedir slurm 2>/dev/null || true)}
include=${include:-/usr/include}
header=$include/slurm/slurm_version.h
[[ -f $header ]] || die "$header is missing: install slurm-devel, or set SLURM_INCLUDE_DIR"
number=$(sed -n 's/^#define SLURM_VERSION_NUMBER 0x\([0-9a-fA-F]*\)$/\1/p' "$header")
[[ -n $number ]] || die "$header has no SLURM_VERSION_NUMBER"
number=$((16#$number))
slurm=$((number >> 16 & 255)).$(printf %02d $((number >> 8 & 255))).$((number & 255))
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -1)

top=$PWD/target/rpm
rm -rf "$top"
mkdir -p "$top/SOURCES"
# The tracked files as they are now, committed or not.
tree=$(git stash create)
git archive --format=tar.gz --prefix="rpmi-$version/" -o "$top/SOURCES/rpmi-$version.tar.gz" "${tree:-HEAD}"
nodeps=()
rpm -q slurm-devel >/dev/null 2>&1 || nodeps=(--nodeps)
rpmbuild -ba "${nodeps[@]}" --define "_topdir $top" --define "rpmi_version $version" \
  --define "slurm_version $slurm" --define "slurm_include $include" "$@" packaging/rpm/rpmi-slurm.spec >&2
shopt -s nullglob
rpms=("$top"/RPMS/*/rpmi-slurm-"$version"-*.rpm)
((${#rpms[@]} == 1)) || die "rpmbuild made ${#rpms[@]} binary packages, not one"
package=${rpms[0]}

# What the package says of itself.
requires=$(rpm -qpR "$package")
grep -qx "slurm = $slurm" <<<"$requires" || die "$package does not require slurm = $slurm:"$'\n'"$requires"
files=$(rpm -qpl "$package")
for f in /mpi_rpmi.so /man7/rpmi-options.7.gz /slurm.md /security.md /troubleshooting.md /LICENSE; do
  grep -q -- "$f\$" <<<"$files" || die "$package lacks $f:"$'\n'"$files"
done
rpm -qp --scripts "$package" | grep -q "Restart slurmctld" || die "$package's post-install script says nothing"
echo "$package" >&2
echo "  requires: $(grep -v '^rpmlib(' <<<"$requires" | paste -sd, -)" >&2
echo "  plugin:   $(grep mpi_rpmi.so <<<"$files")" >&2
echo "$package"

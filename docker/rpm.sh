#!/usr/bin/env bash
# Makes the RPM of the Slurm plugin (packaging/rpm/rpmi-slurm.spec) against the Slurm headers that the build
# finds (SLURM_INCLUDE_DIR, else `pkg-config slurm`'s, else /usr/include), into target/rpm, and checks what the
# package says of itself: that it requires exactly that Slurm release, puts mpi_rpmi.so in the PluginDir, and
# carries the site's documents and the options' manual page.
#
#   docker/rpm.sh [--slurm-from-source] [--check-only] [--define "slurm_plugindir DIR"]...
#                                                         (--define and other arguments go to rpmbuild)
#
# On an EL build host with SchedMD's slurm-devel, cargo, clang-devel and lowdown installed, rpmbuild checks the
# spec's BuildRequires, and the package requires that very slurm release. Where slurm-devel is no installed
# RPM, a package that requires `slurm = X` could not install beside this Slurm, and rpm.sh refuses, saying so:
#   --slurm-from-source   Slurm was built from source (`make install`) on the hosts the package goes to: the
#                         package requires no slurm RPM, and goes into the PluginDir beside the headers'
#                         prefix (PREFIX/lib/slurm or lib64/slurm, from PREFIX/include) unless slurm_plugindir
#                         is defined; it says in its description which release it was built for;
#   --check-only          the package is only made and read, not installed anywhere (this project's CI, with
#                         Debian's rpm tools, which know no installed packages: rpmbuild runs with --nodeps).
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive

die() { echo "rpm.sh: $*" >&2; exit 1; }
from_source=0 check_only=0
while (($#)); do
  case $1 in
    --slurm-from-source) from_source=1; shift ;;
    --check-only) check_only=1; shift ;;
    *) break ;;
  esac
done
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
defines=(--define "_topdir $top" --define "rpmi_version $version" --define "slurm_version $slurm"
  --define "slurm_include $include")
nodeps=()
# Debian's rpm knows no installed packages: no BuildRequires can be checked.
rpm -q rpm >/dev/null 2>&1 || nodeps=(--nodeps)
if ((from_source)); then
  defines+=(--define "slurm_from_source 1")
  if [[ " $* " != *" slurm_plugindir "* ]]; then
    prefix=${include%/include}
    plugindir=
    for d in "$prefix/lib/slurm" "$prefix/lib64/slurm"; do [[ -d $d ]] && plugindir=$d; done
    [[ -n $plugindir || $check_only == 1 ]] ||
      die "no $prefix/lib/slurm or lib64/slurm beside $include: give the PluginDir (--define \"slurm_plugindir DIR\")"
    defines+=(--define "slurm_plugindir ${plugindir:-$prefix/lib/slurm}")
  fi
elif ! rpm -q slurm-devel >/dev/null 2>&1; then
  ((check_only)) || die "slurm-devel is no installed RPM here (Slurm $slurm's headers are in $include), so a package \
that requires slurm = $slurm could not install beside this Slurm. Where Slurm was built from source on the hosts the \
package goes to, pass --slurm-from-source; to only make and read the package, --check-only."
  nodeps=(--nodeps)
fi
rpmbuild -ba "${nodeps[@]}" "${defines[@]}" "$@" packaging/rpm/rpmi-slurm.spec >&2
shopt -s nullglob
rpms=("$top"/RPMS/*/rpmi-slurm-"$version"-*.rpm)
((${#rpms[@]} == 1)) || die "rpmbuild made ${#rpms[@]} binary packages, not one"
package=${rpms[0]}

# What the package says of itself.
requires=$(rpm -qpR "$package")
if ((from_source)); then
  ! grep -q "^slurm" <<<"$requires" || die "$package, for a Slurm built from source, requires a slurm RPM:"$'\n'"$requires"
  rpm -qp --qf '%{DESCRIPTION}' "$package" | grep -q "built from source" || die "$package does not say it is for a Slurm built from source"
else
  grep -qx "slurm = $slurm" <<<"$requires" || die "$package does not require slurm = $slurm:"$'\n'"$requires"
fi
files=$(rpm -qpl "$package")
for f in /mpi_rpmi.so /man7/rpmi-options.7.gz /slurm.md /security.md /troubleshooting.md /LICENSE; do
  grep -q -- "$f\$" <<<"$files" || die "$package lacks $f:"$'\n'"$files"
done
rpm -qp --scripts "$package" | grep -q "Restart slurmctld" || die "$package's post-install script says nothing"
echo "$package" >&2
echo "  requires: $(grep -v '^rpmlib(' <<<"$requires" | paste -sd, -)" >&2
echo "  plugin:   $(grep mpi_rpmi.so <<<"$files")" >&2
echo "$package"

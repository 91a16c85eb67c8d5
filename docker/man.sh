#!/usr/bin/env bash
# Makes the manual pages from their Markdown sources: docs/man/NAME.SECTION.md becomes
# target/man/NAME.SECTION.gz (roff, by lowdown), which the Debian packages install (Cargo.toml's
# [package.metadata.deb], docker/slurm-plugin.sh). Installs lowdown first if it is missing (Debian's package,
# as docker/install-deps.sh does). Safe to run again; every package build runs it first.
#
#   docker/man.sh            make them all
#   docker/man.sh --check    also format each with man, failing on any warning it gives
#
# A page's title and section come from its own metadata (its first lines, `title:` and `section:`); the
# source line (rpmi and its version, from Cargo.toml) and the volume are given here, and the date is that of
# the page's last commit, else none, so that the same sources make the same pages.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive

if ! command -v lowdown >/dev/null; then
  apt-get update
  apt-get install -y --no-install-recommends lowdown
fi

version=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -1)
out=target/man
mkdir -p "$out"
shopt -s nullglob
pages=(docs/man/*.md)
((${#pages[@]})) || { echo "man.sh: no pages in docs/man" >&2; exit 1; }
for src in "${pages[@]}"; do
  name=${src##*/}
  name=${name%.md}                   # rpmi-run.1
  section=${name##*.}
  [[ $(lowdown -X section "$src" 2>/dev/null) == "$section" ]] ||
    { echo "man.sh: $src names section '$(lowdown -X section "$src" 2>/dev/null)', its file name $section" >&2; exit 1; }
  date=$(git log -1 --format=%cs -- "$src" 2>/dev/null || true)
  # Links between the pages are for reading the sources; a manual page names its neighbours in SEE ALSO.
  lowdown -s -Tman --out-no-smarty --nroff-nolinks -m "source=rpmi $version" -m "volume=rpmi Manual" ${date:+-m "date=$date"} \
    "$src" -o "$out/$name"
  if [[ ${1:-} == --check ]]; then
    warnings=$(LC_ALL=C.UTF-8 MANWIDTH=80 man --warnings -l "$out/$name" 2>&1 >/dev/null || true)
    [[ -z $warnings ]] || { echo "man.sh: $out/$name:" >&2; echo "$warnings" >&2; exit 1; }
  fi
  gzip -9nf "$out/$name"
  echo "$out/$name.gz"
done

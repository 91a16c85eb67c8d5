#!/usr/bin/env bash
# rpmi's Flux job-shell plugin (src/flux/rpmi_shell.c) and the Flux it runs in.
#
#   bash docker/flux.sh build FLUX_SRC   builds flux-core from the source tree FLUX_SRC and installs it under
#                                        /usr/local (`flux` on the PATH), then does `install`
#   bash docker/flux.sh install          builds librpmi.so and the plugin and installs them where Flux's shell
#                                        loads every job's plugins: the site's way of enabling rpmi (a job still
#                                        asks for it with `-o pmi=rpmi`)
#   bash docker/flux.sh plugin OUT LIB   only compiles the plugin to OUT, loading librpmi.so from LIB
#   bash docker/flux.sh test             `install`, then the tests under 3-broker Flux instances (tests/flux.rs)
#
# flux-core is in no Debian suite and not on PyPI, so it is built from a source tree: a release tarball, a git
# checkout, or `git archive` of one. A tree without `configure` nor `.git` needs FLUX_VERSION, which this
# script takes from the tree's NEWS.md when unset.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
libdir=/usr/local/lib/rpmi

# Compiles the plugin with Flux's pkg-config files (flux-core, and jansson for its options).
plugin() {
  local out=$1 lib=$2
  cc -std=gnu99 -shared -fPIC -O2 -g -Wall -Wextra -Werror -I"$repo/plugin-spec" \
    $(pkg-config --cflags flux-core jansson) -DRPMI_LIBRARY="\"$lib\"" \
    -o "$out" "$repo/src/flux/rpmi_shell.c" $(pkg-config --libs flux-core jansson) -ldl
}

install_plugin() {
  command -v flux >/dev/null || { echo "flux-core is not installed: run docker/flux.sh build FLUX_SRC" >&2; exit 1; }
  bash docker/install-deps.sh flux
  cargo build --release --locked --lib
  install -D -m 644 target/release/librpmi.so "$libdir/librpmi.so"
  local dir
  dir=$(flux config builtin shell_pluginpath | cut -d: -f1)
  mkdir -p "$dir"
  plugin "$dir/rpmi.so" "$libdir/librpmi.so"
  echo "installed $dir/rpmi.so (loads $libdir/librpmi.so)"
}

build_flux() {
  local src=${1:?usage: docker/flux.sh build FLUX_SRC}
  [[ -f $src/configure.ac ]] || { echo "$src is not a flux-core source tree" >&2; exit 1; }
  bash docker/install-deps.sh flux
  cd "$src"
  if [[ ! -x configure ]]; then
    if [[ ! -e .git && -z ${FLUX_VERSION:-} ]]; then
      FLUX_VERSION=$(sed -n '1s/^flux-core version \([0-9.]*\).*/\1/p' NEWS.md)
      [[ -n $FLUX_VERSION ]] || { echo "set FLUX_VERSION: $src has no .git and NEWS.md names no version" >&2; exit 1; }
      export FLUX_VERSION
    fi
    ./autogen.sh
  fi
  ./configure --prefix=/usr/local --disable-docs PYTHON=/usr/bin/python3
  make -j"$(nproc)"
  make install
  ldconfig
  cd "$repo"
  install_plugin
}

case ${1:-} in
  build) build_flux "${2:-}" ;;
  install) install_plugin ;;
  plugin) plugin "${2:?usage: docker/flux.sh plugin OUT LIB}" "${3:?usage: docker/flux.sh plugin OUT LIB}" ;;
  test)
    install_plugin
    # The tests load target/debug/librpmi.so, which `cargo test` alone does not put there: a build does.
    cargo build --locked --features flux --lib --bins
    cargo test --locked --features flux --test flux
    ;;
  *)
    echo "usage: docker/flux.sh build FLUX_SRC | install | plugin OUT LIB | test" >&2
    exit 2
    ;;
esac

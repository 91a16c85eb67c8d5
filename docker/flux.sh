#!/usr/bin/env bash
# rpmi's Flux job-shell plugin (src/flux/rpmi_shell.c), built against the Flux installed on this machine (the
# site's own: the project builds no Flux; tested with flux-core 0.88.0).
#
#   bash docker/flux.sh install          builds librpmi.so and the plugin and installs them where Flux's shell
#                                        loads every job's plugins: the site's way of enabling rpmi (a job still
#                                        asks for it with `-o pmi=rpmi`)
#   bash docker/flux.sh plugin OUT LIB   only compiles the plugin to OUT, loading librpmi.so from LIB
#   bash docker/flux.sh test             `install`, then the tests under 3-broker Flux instances (tests/flux.rs)
#
# Flux's pkg-config files (flux-core) must be found: set PKG_CONFIG_PATH for a Flux under another prefix.
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
  command -v flux >/dev/null || { echo "flux-core is not installed (the site's own Flux: see docs/flux.md)" >&2; exit 1; }
  bash docker/install-deps.sh flux
  cargo build --release --locked --lib
  install -D -m 644 target/release/librpmi.so "$libdir/librpmi.so"
  local dir
  dir=$(flux config builtin shell_pluginpath | cut -d: -f1)
  mkdir -p "$dir"
  plugin "$dir/rpmi.so" "$libdir/librpmi.so"
  echo "installed $dir/rpmi.so (loads $libdir/librpmi.so)"
}

case ${1:-} in
  install) install_plugin ;;
  plugin) plugin "${2:?usage: docker/flux.sh plugin OUT LIB}" "${3:?usage: docker/flux.sh plugin OUT LIB}" ;;
  test)
    install_plugin
    # The tests load target/debug/librpmi.so, which `cargo test` alone does not put there: a build does.
    cargo build --locked --features flux --lib --bins
    cargo test --locked --features flux --test flux
    ;;
  *)
    echo "usage: docker/flux.sh install | plugin OUT LIB | test" >&2
    exit 2
    ;;
esac

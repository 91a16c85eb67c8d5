#!/usr/bin/env bash
# The project's test command (the README; .ci/run and so the Dockerfile run it): installs what is missing, then
# checks formatting and lints, and runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash docker/install-deps.sh
if command -v rustup >/dev/null 2>&1; then
  rustup component add rustfmt clippy >/dev/null 2>&1 || echo "note: rustup could not add rustfmt/clippy" >&2
fi
cargo fmt --all -- --check
cargo clippy --all-targets --locked -- -D warnings
cargo test --all-targets --locked

#!/usr/bin/env bash
# Configures and builds DeFT Server into build/ (or $DEFT_BUILD_DIR) with extra cmake arguments.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build_dir=${DEFT_BUILD_DIR:-$root/build}
export CCACHE_BASEDIR=$root CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/ccache}
cmake -S "$root" -B "$build_dir" -G Ninja "$@" >/dev/null
ninja -C "$build_dir" -j "$(nproc)"

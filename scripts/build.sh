#!/usr/bin/env bash
# Configures and builds DeFT Server into build/ (or $DEFT_BUILD_DIR) with extra cmake arguments;
# $DEFT_BUILD_TARGETS (space-separated) limits the build to those targets (default: all).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build_dir=${DEFT_BUILD_DIR:-$root/build}
export CCACHE_BASEDIR=$root CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/ccache}
cmake -S "$root" -B "$build_dir" -G Ninja "$@" >/dev/null
read -r -a targets <<<"${DEFT_BUILD_TARGETS:-}"
ninja -C "$build_dir" -j "$(nproc)" "${targets[@]}"

#!/usr/bin/env bash
# Command A: installs what is missing, builds, and runs the main job on the embedded default
# model (CPU backend when there is no GPU). Extra arguments go to the program.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install_deps.sh"
DEFT_BUILD_DIR=$root/build "$root/scripts/build.sh"
exec "$root/build/tools/deft-tree" "$@"

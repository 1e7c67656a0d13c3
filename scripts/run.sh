#!/usr/bin/env bash
# Command A: installs what is missing, builds, and starts deft-server on the embedded default
# model (CPU backend when there is no GPU), listening on 127.0.0.1:50051 with Prometheus metrics
# on 127.0.0.1:9464. Extra arguments go to the server (`scripts/run.sh --help`). Ctrl-C stops it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install_deps.sh"
DEFT_BUILD_DIR=$root/build "$root/scripts/build.sh"
exec "$root/build/server/deft-server" --config "$root/configs/default.json" "$@"

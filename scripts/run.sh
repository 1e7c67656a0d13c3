#!/usr/bin/env bash
# Command A: installs what is missing, builds deft-server, deft-cli and the Python client's stubs
# (no tests, no benchmarks), and starts the server on the embedded default model (CPU backend
# when there is no GPU), listening on 127.0.0.1:50051 (gRPC) and 127.0.0.1:8000 (the
# OpenAI-compatible HTTP API), with Prometheus metrics on 127.0.0.1:9464.
# Extra arguments go to the server.
# The first start on a fresh 2-core machine builds for several minutes; later starts are quick.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)

if [[ " $* " == *" --help "* || " $* " == *" -h "* ]]; then
  cat <<USAGE
usage: scripts/run.sh [deft-server flags]

Installs missing Debian packages, builds deft-server and deft-cli into build/, and starts the
server on the embedded default model (configs/default.json): gRPC on 127.0.0.1:50051, the
OpenAI-compatible HTTP API on 127.0.0.1:8000/v1, Prometheus metrics on 127.0.0.1:9464/metrics.
Ctrl-C stops it. Flags after scripts/run.sh go to the server, e.g.
scripts/run.sh --model /path/to/hf-model --listen 0.0.0.0:50051

deft-server flags (configs/server-flags.txt; option --kv-pages is field "kv_pages" of a JSON config):

USAGE
  cat "$root/configs/server-flags.txt"
  exit 0
fi

"$root/scripts/install_deps.sh"
# Without a visible GPU the server runs the CPU backend, so the CUDA kernels are not built (about
# half of the build); scripts/test.sh builds them whenever the toolkit is present.
cuda=ON
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "run.sh: no GPU visible (nvidia-smi); building the CPU-only server"
  cuda=OFF
fi
DEFT_BUILD_DIR=$root/build DEFT_BUILD_TARGETS="deft-server deft-cli deft_python_stubs" \
  "$root/scripts/build.sh" -DDEFT_ENABLE_CUDA=$cuda
exec "$root/build/server/deft-server" --config "$root/configs/default.json" "$@"

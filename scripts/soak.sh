#!/usr/bin/env bash
# Soak: a bounded mixed concurrent load (Generate, RunTree, TreeSession, Verify) against the real
# deft-server for N minutes, sampling its RSS, KV pages and step p99, then a verdict (RSS
# plateau, KV back to baseline, no errors, p99 stable). Arguments go to bench/soak/soak.py
# (--minutes M, --concurrency C[,C...], --smoke, --json FILE, --server-args "..."; --help).
# Uses the server and the Python stubs of build/ (or $DEFT_BUILD_DIR): build them first
# (scripts/build.sh, or DEFT_BUILD_TARGETS="deft-server deft_python_stubs").
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build_dir=${DEFT_BUILD_DIR:-$root/build}
for needed in "$build_dir/server/deft-server" "$build_dir/tests/integration/python_stubs"; do
  if [[ ! -e $needed ]]; then
    echo "soak: $needed is missing; build deft-server and deft_python_stubs first" >&2
    exit 2
  fi
done
# Debian's grpc modules belong to its own interpreter (see tests/integration/CMakeLists.txt).
export PYTHONPATH="$build_dir/tests/integration/python_stubs:$root/clients/python${PYTHONPATH:+:$PYTHONPATH}"
exec /usr/bin/python3 "$root/bench/soak/soak.py" --server "$build_dir/server/deft-server" "$@"

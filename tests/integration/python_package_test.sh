#!/usr/bin/env bash
# ctest integration.python_package: clients/python installed as a package into a fresh virtual
# environment, offline, as CI must (no package index): the venv sees Debian's grpcio, protobuf,
# setuptools and grpc_tools (--system-site-packages), and pip builds the wheel without build
# isolation, generating the stubs with grpc_tools. Then python_package_test.py runs with the
# venv's interpreter, outside the source tree and without PYTHONPATH.
#   python_package_test.sh PYTHON SOURCE_DIR WORK_DIR DEFT_SERVER_BINARY
set -euo pipefail
python=$1
source_dir=$2
work=$3
rm -rf "$work"
mkdir -p "$work/src/clients"
# A copy: pip builds in the source folder, which must stay clean.
cp -r "$source_dir/clients/python" "$work/src/clients/python"
cp -r "$source_dir/proto" "$work/src/proto"
"$python" -m venv --system-site-packages "$work/venv"
"$work/venv/bin/pip" install --quiet --no-build-isolation --no-index "$work/src/clients/python"
cd "$work"
DEFT_SERVER_BINARY=$4 PYTHONPATH= "$work/venv/bin/python" \
  "$source_dir/tests/integration/python_package_test.py" -v

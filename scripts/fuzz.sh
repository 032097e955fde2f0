#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/) with clang under AddressSanitizer + UndefinedBehaviorSanitizer
# and runs each for FUZZ_SECONDS (default 60) from the seed corpus in fuzz/corpus/, one target per core
# at a time. Fails on any crash, leak, sanitizer report or input slower than 10 s, and then keeps the
# scratch folder with the inputs that failed. New corpus entries go to that scratch folder, never into
# the repository. docs/RELIABILITY.md says how to run them longer.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${FUZZ_SECONDS:-60}
build=${FUZZ_BUILD_DIR:-build-fuzz}
flags="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g1 -O1"
CC=clang CXX=clang++ cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLATENTMOE_CUDA=OFF \
  -DLATENTMOE_BUILD_TESTS=OFF -DLATENTMOE_FUZZ=ON "-DCMAKE_CXX_FLAGS=$flags" "-DCMAKE_C_FLAGS=$flags" > /dev/null
cmake --build "$build" -j"$(nproc)" --target fuzz_config fuzz_safetensors fuzz_weights fuzz_checkpoint_index
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# One target per core at a time (libFuzzer runs one process each): on CI's two cores, two pairs.
# A target that ran clean leaves $scratch/TARGET.seconds; its absence is the one record of a finding.
run_target() {  # target -> its log in $scratch
  local target=$1 start
  mkdir -p "$scratch/$target"
  start=$(date +%s)
  if "$build/fuzz/fuzz_$target" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
    -print_final_stats=1 -artifact_prefix="$scratch/$target-" "$scratch/$target" "fuzz/corpus/$target" \
    > "$scratch/$target.log" 2>&1; then
    echo "$(($(date +%s) - start))" > "$scratch/$target.seconds"
  fi
}
export -f run_target
export build seconds scratch
targets=(config safetensors weights checkpoint_index)
echo "fuzz: ${targets[*]} for ${seconds} s each, $(nproc) at a time"
failed=0
printf '%s\n' "${targets[@]}" | xargs -P "$(nproc)" -I{} bash -c 'run_target {}'
for target in "${targets[@]}"; do
  if [ -f "$scratch/$target.seconds" ]; then
    echo "fuzz: $target $(grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "$scratch/$target.log" |
      tr '\n' ' ')($(cat "$scratch/$target.seconds") s)"
  else
    tail -40 "$scratch/$target.log"
    echo "fuzz: $target FAILED (the end of its log above)"
    failed=1
  fi
done
if [ "$failed" -ne 0 ]; then
  trap - EXIT
  echo "fuzz: the failing inputs are kept in $scratch"
  exit 1
fi
echo "fuzz: all targets ran ${seconds} s without a finding"

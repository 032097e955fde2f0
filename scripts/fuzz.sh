#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/) with clang under AddressSanitizer + UndefinedBehaviorSanitizer
# and runs each for FUZZ_SECONDS (default 60) from the seed corpus in fuzz/corpus/. Fails on any
# crash, leak, sanitizer report or input slower than 10 s. New corpus entries go to a scratch folder,
# never into the repository. docs/RELIABILITY.md says how to run them longer.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${FUZZ_SECONDS:-60}
build=${FUZZ_BUILD_DIR:-build-fuzz}
flags="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g -O1"
CC=clang CXX=clang++ cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLATENTMOE_CUDA=OFF \
  -DLATENTMOE_BUILD_TESTS=OFF -DLATENTMOE_FUZZ=ON "-DCMAKE_CXX_FLAGS=$flags" "-DCMAKE_C_FLAGS=$flags" > /dev/null
cmake --build "$build" -j"$(nproc)" --target fuzz_config fuzz_safetensors fuzz_weights fuzz_checkpoint_index
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for target in config safetensors weights checkpoint_index; do
  mkdir -p "$scratch/$target"
  echo "fuzz: $target for ${seconds} s"
  start=$(date +%s)
  "$build/fuzz/fuzz_$target" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
    -print_final_stats=1 -artifact_prefix="$scratch/" "$scratch/$target" "fuzz/corpus/$target" > "$scratch/$target.log" 2>&1 ||
    { tail -40 "$scratch/$target.log"; echo "fuzz: $target FAILED (artifacts above)"; exit 1; }
  grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "$scratch/$target.log" | tr '\n' ' '
  echo "($(($(date +%s) - start)) s)"
done
echo "fuzz: all targets ran ${seconds} s without a finding"

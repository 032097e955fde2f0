#!/usr/bin/env bash
# One call on the GPU machine (the workplace's device tool): GPU state, the grouped GEMM tests, the
# benchmark and the PyTorch peer, each under its own time limit, logs and JSON written to $OUT.
#   bench/run_grouped_gemm_device.sh COMMIT STEPS [BENCH_ARGS...]
# STEPS: a comma list of tests, sanitize, bench, peer. The binaries are build-gg/bench/ (built on the
# workstation with -DLATENTMOE_BENCH_STANDALONE=ON); they are rebuilt here if they do not start.
set -u
commit=$1
steps=$2
shift 2
out=${OUT:-/tmp/gg_out}
mkdir -p "$out"
bin=build-gg/bench
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw \
  --format=csv | tee "$out/nvidia_smi.csv"
if ! "$bin/grouped_gemm_tests" --gtest_list_tests > /dev/null 2>&1; then
  echo "binaries do not start here: rebuilding"
  cmake -S . -B /tmp/gg-build -DLATENTMOE_CUDA=ON -DLATENTMOE_BENCH_STANDALONE=ON > "$out/rebuild.log" 2>&1 &&
    cmake --build /tmp/gg-build -j16 --target grouped_gemm_tests grouped_gemm_bench >> "$out/rebuild.log" 2>&1
  bin=/tmp/gg-build/bench
  tail -3 "$out/rebuild.log"
fi
if [[ ,$steps, == *,tests,* ]]; then
  timeout 120 "$bin/grouped_gemm_tests" > "$out/tests.log" 2>&1
  echo "tests rc=$?"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|error:|relative error|Which is|Expected" "$out/tests.log" | head -40
fi
if [[ ,$steps, == *,sanitize,* ]]; then
  filter='*bf16_situ_t17*:*heavy*:*graph*'
  timeout 150 compute-sanitizer --tool memcheck "$bin/grouped_gemm_tests" --gtest_filter="$filter" \
    > "$out/memcheck.log" 2>&1
  echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|PASSED|FAILED" "$out/memcheck.log" | head -5
  timeout 150 compute-sanitizer --tool racecheck "$bin/grouped_gemm_tests" --gtest_filter='*bf16_situ_t17*' \
    > "$out/racecheck.log" 2>&1
  echo "racecheck rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$out/racecheck.log" | head -5
fi
if [[ ,$steps, == *,bench,* ]]; then
  timeout "${GG_BENCH_LIMIT:-200}" "$bin/grouped_gemm_bench" --commit "$commit" --json "$out/grouped_gemm.json" "$@" \
    > "$out/bench.log" 2>&1
  echo "bench rc=$?"
  cat "$out/bench.log"
fi
if [[ ,$steps, == *,peer,* ]]; then
  PYTHONUNBUFFERED=1 timeout "${GG_PEER_LIMIT:-120}" python3 bench/peers/torch_grouped_mm.py \
    --json "$out/torch_grouped_mm.json" > "$out/peer.log" 2>&1
  echo "peer rc=$?"
  cat "$out/peer.log"
fi

#!/usr/bin/env bash
# One call on the GPU machine (the workplace's device tool): GPU state, then the named steps, each under
# its own time limit, their JSON and logs written to $OUT (at most 8 files come back).
#   bench/run_grouped_gemm_device.sh COMMIT STEPS
# STEPS, a comma list:
#   tests     the grouped GEMM tests (tests.log)
#   sanitize  compute-sanitizer memcheck and racecheck on a subset of them (memcheck.log, racecheck.log)
#   sweep     every tensor-core variant, gate_up and down phases (sweep.json)
#   sweepdown the down phase with n-tiles-per-CTA overrides (sweep_down.json)
#   auto      the library's automatic choice, all phases: the reported numbers (grouped_gemm.json, bench.log)
#   peer      torch._grouped_mm on the same rows (torch_grouped_mm.json, peer.log)
#   ncu       Nsight Compute on one gate/up kernel, kimi-k3 tp 8, 4096 tokens, automatic variant (ncu.txt)
# The binaries are build-gg/bench/ (built on the workstation with -DLATENTMOE_BENCH_STANDALONE=ON); they
# are rebuilt here if they do not start.
set -u
commit=$1
steps=$2
out=${OUT:-/tmp/gg_out}
mkdir -p "$out"
bin=build-gg/bench
has() { [[ ,$steps, == *,$1,* ]]; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw \
  --format=csv | tee "$out/nvidia_smi.csv"
if ! "$bin/grouped_gemm_tests" --gtest_list_tests > /dev/null 2>&1; then
  echo "binaries do not start here: rebuilding"
  cmake -S . -B /tmp/gg-build -DLATENTMOE_CUDA=ON -DLATENTMOE_BENCH_STANDALONE=ON > /tmp/gg_rebuild.log 2>&1 &&
    cmake --build /tmp/gg-build -j16 --target grouped_gemm_tests grouped_gemm_bench >> /tmp/gg_rebuild.log 2>&1
  bin=/tmp/gg-build/bench
  tail -3 /tmp/gg_rebuild.log
fi
if has tests; then
  timeout 120 "$bin/grouped_gemm_tests" > "$out/tests.log" 2>&1
  echo "tests rc=$?"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |Failure|relative error|Which is|Expected" "$out/tests.log" | head -30
fi
if has auto; then
  timeout "${GG_AUTO_LIMIT:-100}" "$bin/grouped_gemm_bench" --commit "$commit" --json "$out/grouped_gemm.json" \
    > "$out/bench.log" 2>&1
  echo "auto rc=$?"
  cat "$out/bench.log"
fi
if has sweep; then
  timeout "${GG_SWEEP_LIMIT:-130}" "$bin/grouped_gemm_bench" --commit "$commit" --variants "${GG_SWEEP_VARIANTS:-all}" \
    --phases gate_up,down --json "$out/sweep.json" > /tmp/gg_sweep.log 2>&1
  echo "sweep rc=$?"
fi
if has sweepdown; then
  timeout "${GG_SWEEPDOWN_LIMIT:-60}" "$bin/grouped_gemm_bench" --commit "$commit" --phases down \
    --variants "${GG_SWEEPDOWN_VARIANTS:-mma_s_wide:ng2,mma_s_wide:ng4,mma_m:ng2,mma_l:ng2,mma_l:ng4,mma_xl:ng2}" \
    --json "$out/sweep_down.json" > /tmp/gg_sweepdown.log 2>&1
  echo "sweepdown rc=$?"
fi
if has sanitize; then
  timeout 100 compute-sanitizer --tool memcheck "$bin/grouped_gemm_tests" \
    --gtest_filter='*bf16_situ_t17*:*heavy*:*graph*' > "$out/memcheck.log" 2>&1
  echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|PASSED|FAILED" "$out/memcheck.log" | head -5
  timeout 80 compute-sanitizer --tool racecheck "$bin/grouped_gemm_tests" --gtest_filter='*f16_relu2_t3*' \
    > "$out/racecheck.log" 2>&1
  echo "racecheck rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$out/racecheck.log" | head -5
fi
if has peer; then
  PYTHONUNBUFFERED=1 timeout "${GG_PEER_LIMIT:-120}" python3 bench/peers/torch_grouped_mm.py \
    --json "$out/torch_grouped_mm.json" > "$out/peer.log" 2>&1
  echo "peer rc=$?"
  cat "$out/peer.log"
fi
if has ncu; then
  timeout "${GG_NCU_LIMIT:-90}" ncu --clock-control none --kernel-name regex:grouped_mma --launch-skip 2 \
    --launch-count 1 --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
    --section Occupancy --section LaunchStats "$bin/grouped_gemm_bench" --presets kimi-k3 --tp-shards 8 \
    --tokens 4096 --phases gate_up --variants automatic > "$out/ncu.txt" 2>&1
  echo "ncu rc=$?"
  grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Stall|Warp Cycles|Achieved Occupancy|L2 Hit|Registers" \
    "$out/ncu.txt" | head -40
fi

#!/usr/bin/env bash
# One call on the GPU machine: GPU state, the GPU test suite, compute-sanitizer, the layer benchmark
# and the PyTorch peers, each under its own time limit; logs and JSON go to $OUT.
#   scripts/gpu_run.sh BIN_DIR COMMIT STEPS
# BIN_DIR holds latentmoe and latentmoe_cuda_tests built on the workstation (scripts/gpu_build.sh);
# STEPS is a comma list of: tests, sanitize, bench, bench_decode, bench_no_skinny, bench_no_gemv, peers
# (run in that order: tests, bench, bench_decode, bench_no_skinny, bench_no_gemv, peers, sanitize).
set -u
bin=$1
commit=$2
steps=$3
out=${OUT:-/tmp/latentmoe_out}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw \
  --format=csv,noheader
has() { [[ ,$steps, == *,$1,* ]]; }
if has tests; then
  timeout 150 "$bin/latentmoe_cuda_tests" > "$out/cuda_tests.log" 2>&1
  echo "cuda tests rc=$?"
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|tests ran" "$out/cuda_tests.log" | head -20
  timeout 60 "$bin/latentmoe" run --help > /dev/null && echo "cli starts"
fi
if has bench; then
  timeout 180 "$bin/latentmoe" bench layer --preset kimi-k3,nemotron3-super --tp-shard 8,1 \
    --tokens 1,8,64,256,1024,4096 --commit "$commit" --json "$out/layer.json" 2>&1 | tee "$out/layer.log"
  echo "bench rc=${PIPESTATUS[0]}"
fi
if has bench_decode; then  # the decode token counts only
  timeout 90 "$bin/latentmoe" bench layer --preset kimi-k3,nemotron3-super --tp-shard 8,1 --tokens 1,8 \
    --commit "$commit" --json "$out/layer_decode.json" 2>&1 | tee "$out/layer_decode.log"
  echo "bench (decode) rc=${PIPESTATUS[0]}"
fi
if has bench_no_skinny; then  # the decode token counts without the skinny path, for comparison
  timeout 90 "$bin/latentmoe" bench layer --preset kimi-k3,nemotron3-super --tp-shard 8,1 --tokens 1,8 \
    --skinny-max-tokens 0 --commit "$commit" --json "$out/layer_no_skinny.json" 2>&1 | tee "$out/layer_no_skinny.log"
  echo "bench (no skinny) rc=${PIPESTATUS[0]}"
fi
if has bench_no_gemv; then  # the decode token counts with every linear on cuBLASLt, for comparison
  timeout 60 "$bin/latentmoe" bench layer --preset kimi-k3,nemotron3-super --tp-shard 8,1 --tokens 1,8 \
    --gemv-max-tokens 0 --commit "$commit" --json "$out/layer_no_gemv.json" 2>&1 | tee "$out/layer_no_gemv.log"
  echo "bench (no gemv) rc=${PIPESTATUS[0]}"
fi
if has peers; then
  timeout 90 python3 bench/peers/torch_eager_layer.py --json "$out/peer_eager_layer.json" 2>&1
  echo "eager peer rc=${PIPESTATUS[0]}"
  timeout 85 python3 bench/peers/torch_grouped_mm.py --json "$out/peer_grouped_mm.json" 2>&1 | tail -30
  echo "grouped_mm peer rc=${PIPESTATUS[0]}"
fi
if has sanitize; then
  timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 "$bin/latentmoe_cuda_tests" \
    --gtest_filter='*route_block*:*combine_is_exact*:*CudaGraph*:*Runner*:*split_k*:*f16_relu2_t160*:*f16_situ_t250*:*Skinny*:Gemv.matches_the_reference*:Gemv.every_launch_shape*' > "$out/memcheck.log" 2>&1
  echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|tests ran|FAILED" "$out/memcheck.log" | head -5
  timeout 120 compute-sanitizer --tool racecheck --error-exitcode 9 "$bin/latentmoe_cuda_tests" \
    --gtest_filter='*route_block_and_warp*:*split_k*:*f16_relu2_t160*:*f16_situ_t250*:Skinny.linear*:Skinny.a_token*:Skinny.routed_experts_with*' > "$out/racecheck.log" 2>&1
  echo "racecheck rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|tests ran|FAILED" "$out/racecheck.log" | head -5
  # The GEMV's launch shapes alone (67 s under racecheck on the H200): their own limit, appended.
  timeout 120 compute-sanitizer --tool racecheck --error-exitcode 9 "$bin/latentmoe_cuda_tests" \
    --gtest_filter='Gemv.every_launch_shape*' >> "$out/racecheck.log" 2>&1
  echo "racecheck (GEMV) rc=$?"; grep -E "RACECHECK SUMMARY" "$out/racecheck.log" | tail -1
fi

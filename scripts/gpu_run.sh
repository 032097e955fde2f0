#!/usr/bin/env bash
# One call on the GPU machine: GPU state, the GPU test suite, compute-sanitizer, the benchmarks and the
# PyTorch peers, each under its own time limit; logs and JSON go to $OUT.
#   scripts/gpu_run.sh BIN_DIR COMMIT STEPS
# BIN_DIR holds latentmoe and latentmoe_cuda_tests built on the workstation (scripts/gpu_build.sh), and
# grouped_gemm_bench and gemv_bench (build-gpu/bench/) for the steps that run them;
# STEPS is a comma list of: tests, nccl, demo, sanitize_comm, sanitize, bench, bench_ab, bench_gemv_ab, bench_decode,
# bench_no_skinny, bench_no_gemv, bench_mxfp4, bench_tail, grouped_gemm, grouped_gemm_sweep, gemv, peers (run in that
# order: tests, nccl, bench, bench_ab, bench_gemv_ab, bench_decode, bench_no_skinny, bench_no_gemv, bench_mxfp4,
# bench_tail, grouped_gemm, grouped_gemm_sweep, gemv, peers, sanitize).
#   nccl  the NCCL group tests (NcclGroup*: one GPU and every GPU present) against PyTorch's libnccl, the
#         release latentmoe is built against (the machine's default libnccl is older; NCCL's device API
#         has no ABI compatibility across releases), with the GPU links and NCCL's version recorded
#   bench_tail          latentmoe bench tail on ranks simulated on GPU 0: both presets, tp 2, 4, 8, tokens
#                       1..4096, every tier, the unfused tail, AR+RMSNorm, the AR ceiling (tail.json, tail.log,
#                       tail.png); ~3-4 min expected, stopped by --max-seconds 400 (then listed as skipped)
#                       and by a 540 s timeout: give it a call of its own (run after bench_no_gemv)
#   bench_ab            latentmoe bench layer alternating with a baseline build (BASE_BIN: the folder of its latentmoe),
#                       two rounds (the second in the reverse order), dense and MXFP4 experts, tp-shard 8:
#                       behaviour-preserving changes are checked against the baseline in the same call
#                       (layer_ab_{new,base}_{dense,mxfp4}_{1,2}.json; their medians and ratios by
#                       scripts/layer_ab_table.py: layer_ab_table.txt)
#   bench_gemv_ab       the decode GEMV's rule (gemv_max_tokens, default 1): bench layer with --gemv-max-tokens 0
#                       (cuBLASLt), 1 and 4 alternating in one binary, three rounds (the second reversed), both
#                       presets, bf16, tp-shard 8, 1-4 tokens (gemv_ab/layer_ab_g{0,1,4}_dense_*.json; medians
#                       and ratios against g0: gemv_ab_table.txt)
#   grouped_gemm        grouped_gemm_bench, the library's variant choice, every phase (grouped_gemm.json)
#   grouped_gemm_sweep  grouped_gemm_bench, every tensor-core variant, gate_up and down (grouped_gemm_sweep.json)
#   gemv                gemv_bench: the decode GEMV against cuBLAS and a plain read (gemv.json)
# A device call brings back at most 8 files from $OUT: end the call's command with scripts/gpu_bundle_out.sh, which
# packs them into one out.tar.gz when there are more (session 22 lost 7 result files to that limit).
source "$(dirname "$0")/gpu_script_env.sh" "$@"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw \
  --format=csv,noheader
if has tests; then
  # A short collective timeout: a hang in a simulated-rank test fails in seconds, not minutes.
  LATENTMOE_COLLECTIVE_TIMEOUT_MS=5000 timeout 300 "$bin/latentmoe_cuda_tests" > "$out/cuda_tests.log" 2>&1
  echo "cuda tests rc=$?"
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|tests ran" "$out/cuda_tests.log" | head -20
  timeout 60 "$bin/latentmoe" run --help > /dev/null && echo "cli starts"
fi
if has nccl; then
  nccl_lib="$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])')/lib"
  echo "libnccl for the nccl step: $nccl_lib"; ls "$nccl_lib"
  nvidia-smi topo -m 2>&1 | head -20
  # NCCL_NVLS_ENABLE=0 stays exported (above): latentmoe refuses any other value, unset included.
  LD_LIBRARY_PATH="$nccl_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" LATENTMOE_TEST_REQUIRE_NCCL=1 \
    LATENTMOE_COLLECTIVE_TIMEOUT_MS=5000 NCCL_DEBUG=WARN timeout 420 "$bin/latentmoe_cuda_tests" \
    --gtest_filter='NcclGroup*' > "$out/nccl_tests.log" 2>&1
  echo "nccl tests rc=$?"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED  \]|^\[  SKIPPED \]|tests ran|NCCL WARN" "$out/nccl_tests.log" | head -30
fi
if has demo; then  # the main job on the GPU (tp > 1 on simulated ranks) against the CPU reference
  timeout 240 "$bin/latentmoe" demo --backend cuda --tokens 37 --runs 1 > "$out/demo.log" 2>&1
  echo "demo rc=$?"; grep -cE " ok$" "$out/demo.log"; grep -E "FAILED|all checks" "$out/demo.log" | head -5
fi
if has sanitize_comm; then  # the collectives under compute-sanitizer (one rank: it serialises kernels)
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 "$bin/latentmoe_cuda_tests" \
    --gtest_filter='GpuGroup.a_one_rank*:GpuGroup.rejects*' > "$out/memcheck_comm.log" 2>&1
  echo "memcheck (comm) rc=$?"; grep -E "ERROR SUMMARY" "$out/memcheck_comm.log" | tail -1
  timeout 120 compute-sanitizer --tool racecheck --error-exitcode 9 "$bin/latentmoe_cuda_tests" \
    --gtest_filter='GpuGroup.a_one_rank*' > "$out/racecheck_comm.log" 2>&1
  echo "racecheck (comm) rc=$?"; grep -E "RACECHECK SUMMARY" "$out/racecheck_comm.log" | tail -1
fi
if has bench; then
  timeout 180 "$bin/latentmoe" bench layer --preset kimi-k3,nemotron3-super --tp-shard 8,1 \
    --tokens 1,8,64,256,1024,4096 --commit "$commit" --json "$out/layer.json" 2>&1 | tee "$out/layer.log"
  echo "bench rc=${PIPESTATUS[0]}"
fi
if has bench_ab; then
  for round in 1 2; do
    order="new base"; [[ $round == 2 ]] && order="base new"  # the order inside a round is worth ~1%: reversed
    for experts in dense mxfp4; do
      for which in $order; do
        b=$bin; [[ $which == base ]] && b=${BASE_BIN:?bench_ab needs BASE_BIN}
        timeout 120 "$b/latentmoe" bench layer --preset kimi-k3,nemotron3-super --tp-shard 8 --tokens 1,8,64,1024 \
          --experts "$experts" --commit "$commit-$which" --json "$out/layer_ab_${which}_${experts}_$round.json" \
          > "$out/layer_ab_${which}_${experts}_$round.log" 2>&1
        echo "bench ab $which $experts round $round rc=$?"
      done
    done
  done
  python3 scripts/layer_ab_table.py "$out" | tee "$out/layer_ab_table.txt"  # medians per build, new/base
fi
if has bench_gemv_ab; then
  mkdir -p "$out/gemv_ab"  # a folder of its own: layer_ab_table.py reads every layer_ab_* file of a folder
  for round in 1 2 3; do
    order="g0 g1 g4"; [[ $round == 2 ]] && order="g4 g1 g0"
    for which in $order; do
      timeout 90 "$bin/latentmoe" bench layer --preset kimi-k3,nemotron3-super --tp-shard 8 --tokens 1,2,3,4 \
        --gemv-max-tokens "${which#g}" --commit "$commit-$which" --json "$out/gemv_ab/layer_ab_${which}_dense_$round.json" \
        > "$out/gemv_ab/layer_ab_${which}_dense_$round.log" 2>&1
      echo "bench gemv ab $which round $round rc=$?"
    done
  done
  python3 scripts/layer_ab_table.py "$out/gemv_ab" --base g0 | tee "$out/gemv_ab_table.txt"
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
if has bench_mxfp4; then  # MXFP4 routed experts on the decode kernels against the bf16 experts, same call
  for experts in mxfp4 dense; do
    timeout 120 "$bin/latentmoe" bench layer --preset kimi-k3,nemotron3-super --tp-shard 8,1 --tokens 1,2,4,8 \
      --experts "$experts" --commit "$commit" --json "$out/layer_$experts.json" > "$out/layer_$experts.log" 2>&1
    echo "bench layer --experts $experts rc=$?"; tail -n 12 "$out/layer_$experts.log"
  done
  # The PyTorch peer: the touched experts dequantised to bf16, then torch._grouped_mm (its best case).
  timeout 200 python3 bench/peers/torch_mxfp4_experts.py --tp-shards 8,1 --tokens 1,2,4,8 \
    --json "$out/peer_torch_mxfp4.json" > "$out/peer_torch_mxfp4.log" 2>&1
  echo "torch mxfp4 peer rc=$?"; tail -n 12 "$out/peer_torch_mxfp4.log"
fi
if has bench_tail; then  # simulated ranks: rows say placement "simulated", no NVLink cost in them
  # A latentmoe built with NCCL loads the libnccl it was built against (PyTorch's, as the nccl step).
  tail_lib=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)/lib
  LD_LIBRARY_PATH="$tail_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" LATENTMOE_COLLECTIVE_TIMEOUT_MS=10000 \
    timeout 540 "$bin/latentmoe" bench tail --backend cuda --placement simulated \
    --preset kimi-k3,nemotron3-super --tp 2,4,8 --max-seconds 400 --commit "$commit" --json "$out/tail.json" \
    > "$out/tail.log" 2>&1
  echo "bench tail rc=$?"; tail -n 30 "$out/tail.log"
  if ! python3 bench/plot_tail.py "$out/tail.json" --out "$out/tail.png" > "$out/tail_plot.log" 2>&1; then
    echo "plot failed (bench/plot_tail.py needs matplotlib; draw it from tail.json afterwards):"
    tail -n 2 "$out/tail_plot.log"
  fi
fi
# The kernel benchmarks, skipped with a note when their binary is not in BIN_DIR.
run_bench() {  # run_bench LIMIT LOG LINES NAME ARGS...: $bin/NAME ARGS... > $out/LOG, then its last LINES lines
  local limit=$1 log=$2 lines=$3 name=$4
  shift 4
  if [[ ! -x $bin/$name ]]; then echo "$name: not in $bin, skipped"; return; fi
  timeout "$limit" "$bin/$name" "$@" > "$out/$log" 2>&1
  echo "$name rc=$?"
  tail -n "$lines" "$out/$log"
}
if has grouped_gemm; then
  run_bench 100 grouped_gemm.log 40 grouped_gemm_bench --commit "$commit" --json "$out/grouped_gemm.json"
fi
if has grouped_gemm_sweep; then
  run_bench 130 grouped_gemm_sweep.log 3 grouped_gemm_bench --commit "$commit" --variants all \
    --phases gate_up,down --json "$out/grouped_gemm_sweep.json"
fi
if has gemv; then
  run_bench 60 gemv.log 30 gemv_bench --json "$out/gemv.json"
fi
if has peers; then
  timeout 90 python3 bench/peers/torch_eager_layer.py --json "$out/peer_eager_layer.json" 2>&1
  echo "eager peer rc=${PIPESTATUS[0]}"
  timeout 85 python3 bench/peers/torch_grouped_mm.py --json "$out/peer_grouped_mm.json" 2>&1 | tail -30
  echo "grouped_mm peer rc=${PIPESTATUS[0]}"
fi
if has sanitize; then
  timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 "$bin/latentmoe_cuda_tests" \
    --gtest_filter='*route_block*:*Route*:*combine_is_exact*:*CudaGraph*:*Runner*:GpuGroup.a_one_rank*:*Activations*:*split_k*:*f16_relu2_t160*:*f16_situ_t250*:*Skinny*:Gemv.matches_the_reference*:Gemv.every_launch_shape*' > "$out/memcheck.log" 2>&1
  echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|tests ran|FAILED" "$out/memcheck.log" | head -5
  timeout 120 compute-sanitizer --tool racecheck --error-exitcode 9 "$bin/latentmoe_cuda_tests" \
    --gtest_filter='*Route.*block_and_warp*:GpuGroup.a_one_rank*:*split_k*:*f16_relu2_t160*:*f16_situ_t250*:Skinny.linear*:Skinny.a_token*:Skinny.routed_experts_with*' > "$out/racecheck.log" 2>&1
  echo "racecheck rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|tests ran|FAILED" "$out/racecheck.log" | head -5
  # The GEMV's launch shapes alone (67 s under racecheck on the H200): their own limit, appended.
  timeout 120 compute-sanitizer --tool racecheck --error-exitcode 9 "$bin/latentmoe_cuda_tests" \
    --gtest_filter='Gemv.every_launch_shape*' >> "$out/racecheck.log" 2>&1
  echo "racecheck (GEMV) rc=$?"; grep -E "RACECHECK SUMMARY" "$out/racecheck.log" | tail -1
fi

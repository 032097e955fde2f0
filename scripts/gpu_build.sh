#!/usr/bin/env bash
# Builds the GPU binaries (the tool, the GPU tests, the kernel benches) on the workstation and copies them, stripped, to .device/bin (git-ignored),
# the folder a GPU-machine call carries. Only sm_90a code (the H200), so that the binaries fit the
# 64 MiB a call may carry; the normal build adds sm_80 and PTX.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=/usr/local/cuda/bin:$PATH
cmake -S . -B build-gpu -DLATENTMOE_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
  "-DLATENTMOE_CUDA_GENCODE=-gencode=arch=compute_90a,code=sm_90a" > /dev/null
cmake --build build-gpu -j"$(nproc)" --target latentmoe_cli latentmoe_cuda_tests grouped_gemm_bench gemv_bench lamport_bench
mkdir -p .device/bin
cp build-gpu/latentmoe build-gpu/tests/latentmoe_cuda_tests build-gpu/bench/grouped_gemm_bench build-gpu/bench/gemv_bench build-gpu/bench/lamport_bench .device/bin/
strip .device/bin/*
du -sh .device/bin

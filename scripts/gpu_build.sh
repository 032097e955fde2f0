#!/usr/bin/env bash
# Builds the GPU binaries on the workstation (sm_90a + sm_80 + PTX) and copies them, stripped, to
# .device/bin (git-ignored), the folder a GPU-machine call carries.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=/usr/local/cuda/bin:$PATH
cmake -S . -B build-gpu -DLATENTMOE_CUDA=ON -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build build-gpu -j"$(nproc)" --target latentmoe_cli latentmoe_cuda_tests
mkdir -p .device/bin
cp build-gpu/latentmoe build-gpu/tests/latentmoe_cuda_tests .device/bin/
strip .device/bin/latentmoe .device/bin/latentmoe_cuda_tests
du -sh .device/bin

#!/usr/bin/env bash
# Builds the Python package's wheel here with the CUDA backend, for the GPU machine: sm_90a code only
# (H100, H200), NCCL, stripped, into .device/wheel/ (git-ignored), which a device call carries for
# scripts/gpu_python.sh. One wheel for every CPython >= 3.10 and PyTorch >= 2.6 (py3-none-linux_x86_64).
# The build folder build-gpu-wheel/ is kept, so that a second run recompiles only what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=/usr/local/cuda/bin:$PATH
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
python=${LATENTMOE_PYTHON:-python3}
rm -rf .device/wheel
mkdir -p .device/wheel
start=$(date +%s)
# The gencode flag goes through CMAKE_ARGS: its value holds '=' and ',', which -C cmake.define.* does not take.
CMAKE_ARGS="-DLATENTMOE_CUDA_GENCODE=-gencode=arch=compute_90a,code=sm_90a" \
  "$python" -m pip wheel . --no-deps --no-build-isolation -q -w .device/wheel \
  -C cmake.define.LATENTMOE_CUDA=ON -C build-dir=build-gpu-wheel -C install.strip=true
wheel=$(ls .device/wheel/latentmoe-*.whl)
echo "build_gpu_wheel: $wheel ($(du -h "$wheel" | cut -f1), $(($(date +%s) - start)) s)"

#!/usr/bin/env bash
# Packs the GPU binaries that scripts/gpu_build.sh left in .device/bin (and, when given, a baseline
# build's latentmoe) into .device/pack/*.tar.xz, the folder a GPU-machine call carries: the stripped
# sm_90a binaries are ~120 MB, over the 64 MiB a call may carry, and ~10 MB once compressed (their
# fatbins compress 10-15x). scripts/gpu_unpack.sh undoes it there.
#   scripts/gpu_pack.sh [BASELINE_BIN_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .device/pack
rm -f .device/pack/*.tar.xz
tar -C .device/bin -cJf .device/pack/bin.tar.xz .
if [[ $# -ge 1 ]]; then tar -C "$1" -cJf .device/pack/base.tar.xz latentmoe; fi
du -sh .device/pack/*

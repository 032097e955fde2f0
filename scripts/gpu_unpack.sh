#!/usr/bin/env bash
# On the GPU machine: unpacks what scripts/gpu_pack.sh packed into /tmp/lmoe/bin (and /tmp/lmoe/base).
set -euo pipefail
cd "$(dirname "$0")/.."
for pack in .device/pack/*.tar.xz; do
  name=$(basename "$pack" .tar.xz)
  mkdir -p "/tmp/lmoe/$name"
  tar -C "/tmp/lmoe/$name" -xJf "$pack" 2>/dev/null ||
    python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$pack" "/tmp/lmoe/$name"
done
ls -la /tmp/lmoe/*

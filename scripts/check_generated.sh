#!/usr/bin/env bash
# Fails (exit 1, one line on stderr) when a generated file differs from what its generator writes now:
# src/cuda/gemm/grouped_gemm_wgmma_ops.cuh from scripts/gen_wgmma_ops.py. Needs python3 and clang-format.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tmp="$(mktemp)"
trap 'rm -f "$tmp"' EXIT
file=src/cuda/gemm/grouped_gemm_wgmma_ops.cuh
command -v clang-format >/dev/null || { echo "check_generated: clang-format is not installed" >&2; exit 1; }
python3 "$root/scripts/gen_wgmma_ops.py" --output "$tmp" || { echo "check_generated: scripts/gen_wgmma_ops.py failed" >&2; exit 1; }
if ! cmp -s "$tmp" "$root/$file"; then
  echo "check_generated: $file differs from the output of scripts/gen_wgmma_ops.py; run 'python3 scripts/gen_wgmma_ops.py' and commit the result" >&2
  exit 1
fi
echo "check_generated: $file is up to date"

#!/usr/bin/env python3
# Generates the wgmma wrappers of src/cuda/gemm/grouped_gemm_wgmma_ops.cuh (one inline-asm function per N and
# element type: an asm statement's register list must be spelled out), clang-formatted with the repository's
# .clang-format. Regenerate with
#   python3 scripts/gen_wgmma_ops.py
# (or --output FILE to write elsewhere; scripts/check_generated.sh uses that to check the committed file).
import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = "src/cuda/gemm/grouped_gemm_wgmma_ops.cuh"
COMMAND = "python3 scripts/gen_wgmma_ops.py"

MAX_N = 256
out = []
out.append(f"""// GENERATED FILE, DO NOT EDIT: written by scripts/gen_wgmma_ops.py (`{COMMAND}` from the repository
// root); change the generator and regenerate. scripts/check_generated.sh fails when this file differs from
// what the generator writes.
//
// wgmma.mma_async m64nNk16 with fp32 accumulators, both operands from shared memory through descriptors,
// both K-major (no transpose), for the N values the Hopper grouped GEMM dispatches among (8 to {MAX_N} in steps
// of 8) and bf16/f16. d holds the accumulators (an array of at least N/2; an m64nN fragment uses its first
// N/2). scale_d == 0 computes D = A*B (the first k-step of a tile), otherwise D += A*B. One function per N
// and type: the register list of an inline-asm statement must be spelled out.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace latentmoe::cuda::gg {{

inline constexpr int kWgmmaMaxN = {MAX_N};

template <class T, int N>
struct WgmmaOp;  // specialised below for every (type, N)

template <class T, int N, int A>
__device__ __forceinline__ void wgmma_m64k16(float (&d)[A], uint64_t desc_a, uint64_t desc_b, int scale_d) {{
  static_assert(N % 8 == 0 && N >= 8 && N <= kWgmmaMaxN && A >= N / 2, "an m64nN fragment needs N/2 accumulators");
  WgmmaOp<T, N>::run(d, desc_a, desc_b, scale_d);
}}
""")
out.append("// Defined only where the sm_90a instructions exist (the kernel body is empty elsewhere).")
out.append("#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)")
for tname, ptx in (("__nv_bfloat16", "bf16"), ("__half", "f16")):
    for n in range(8, MAX_N + 1, 8):
        r = n // 2
        reg_chunks = [", ".join(f"%{i}" for i in range(s, min(r, s + 16))) for s in range(0, r, 16)]
        ops = [f'"+f"(d[{i}])' for i in range(r)]
        op_lines = [", ".join(ops[s:s + 8]) for s in range(0, r, 8)]
        out.append("template <>")
        out.append(f"struct WgmmaOp<{tname}, {n}> {{")
        out.append("  template <int A>")
        out.append("  __device__ __forceinline__ static void run(float (&d)[A], uint64_t desc_a, uint64_t desc_b, int scale_d) {")
        out.append("    asm volatile(")
        out.append('        "{\\n.reg .pred p;\\n"')
        out.append(f'        "setp.ne.b32 p, %{r + 2}, 0;\\n"')
        out.append(f'        "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptx}.{ptx} {{"')
        for i, c in enumerate(reg_chunks):
            sep = ", " if i + 1 < len(reg_chunks) else ""
            out.append(f'        "{c}{sep}"')
        out.append(f'        "}}, %{r}, %{r + 1}, p, 1, 1, 0, 0;\\n}}\\n"')
        for i, l in enumerate(op_lines):
            prefix = "        : " if i == 0 else "          "
            out.append(prefix + l + ("," if i + 1 < len(op_lines) else ""))
        out.append('        : "l"(desc_a), "l"(desc_b), "r"(scale_d));')
        out.append("  }")
        out.append("};")
out.append("#endif")
out.append("")
out.append("}  // namespace latentmoe::cuda::gg")


def main():
    parser = argparse.ArgumentParser(description=f"writes {TARGET} (clang-formatted)")
    parser.add_argument("--output", default=os.path.join(ROOT, TARGET), help=f"where to write (default: {TARGET})")
    args = parser.parse_args()
    text = "\n".join(out) + "\n"
    # Formatted as if it were the committed file, so that the repository's .clang-format applies.
    formatted = subprocess.run(["clang-format", f"--assume-filename={os.path.join(ROOT, TARGET)}"], input=text,
                               capture_output=True, text=True, check=True).stdout
    with open(args.output, "w") as f:
        f.write(formatted)


if __name__ == "__main__":
    sys.exit(main())

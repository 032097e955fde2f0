// The pushing dense GEMM: tier 0's up-projection on the tensor cores for the token counts above the skinny
// kernels. One launch computes this rank's block of the output, block = addend + x · W^T, and stores
// each element into every rank's receive region of the GPU group's next all-gather (the all-gather's
// send step, done by the GEMM's epilogue), so that the Lamport kernel after it only receives
// (LamportCall::presend). It is the mma.sync grouped GEMM (grouped_gemm_mma.cuh) run on one matrix, with
// its split-K and a push epilogue; the tile shape follows the rows (dense_push_variant).
//
// Numerics: bf16/f16 operands, fp32 accumulation, the addend added in fp32, one rounding per element (what
// cuBLASLt with beta = 1 computes). The split-K reduction adds the splits in split order: the bits do
// not depend on scheduling, so every rank's copy of a block is the same.
// No allocation, no host synchronisation: capturable in a CUDA graph.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "cuda/comm/lamport.h"
#include "cuda/gemm/dense_push_bounds.h"  // kDensePushMaxRows
#include "latentmoe/dtype.h"

namespace latentmoe::cuda {

struct DensePushProblem {
  DType dtype = DType::bf16;
  const void* x = nullptr;  // [rows, k], contiguous (row stride k)
  int64_t rows = 0;
  const void* w = nullptr;  // [n, k], contiguous
  int64_t n = 0;            // this rank's columns of the output: the all-gather's chunk
  int64_t k = 0;
  const void* addend = nullptr;  // [rows, n], row stride ld_addend: added to the product
  int64_t ld_addend = 0;
};

// True when dense_push_gemm takes the problem: bf16 or f16, 1..kDensePushMaxRows rows, n and k multiples
// of 8, x and w 16-byte aligned, a device of compute capability 8.0 or later.
bool dense_push_supported(const DensePushProblem& problem);

// Split-K workspace of one stream (tile counters and fp32 partials); zero-filled once before its first
// use, left zeroed by every call. Smaller workspaces mean fewer splits, never a failure.
size_t dense_push_workspace_bytes();

// Pushes block [rows, n] = addend + x · W^T into every rank's region for this rank in the slot of the
// rank's next group call, as lamport::push_all_gather_pair; a LamportCall all_gather with presend must
// follow on the stream. Launched as a programmatic dependent: it streams its first weights before it
// waits for the previous kernel (which may write x and addend, not w). Throws Error when
// !dense_push_supported or the peers' regions cannot hold the block (rows x n elements).
void dense_push_gemm(const DensePushProblem& problem, const LamportPeers& peers, void* workspace,
                     size_t workspace_bytes, cudaStream_t stream);

// The tile shape for `rows` rows (the benchmark names it): mma_s_wide up to 16, mma_m32 up to 32, mma_m up
// to 64, mma_l above.
const char* dense_push_variant(int64_t rows);

}  // namespace latentmoe::cuda

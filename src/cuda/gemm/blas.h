// Dense GEMMs of the CUDA backend: y [rows, cols] (+)= x [rows, inner] · w [cols, inner]^T with
// row-major operands that may have row strides (a column block of a wider matrix).
//
// cuBLASLt runs every problem whose x and w share a dtype and whose y is that dtype or f32:
// compute type CUBLAS_COMPUTE_32F with fp32 scale, so bf16/f16 inputs accumulate in fp32 and f32
// inputs run true fp32 (never TF32, which only CUBLAS_COMPUTE_32F_FAST_TF32 would allow). Other
// dtype mixes run a plain tiled fp32 kernel. Plans (descriptors and the heuristic's algorithm) are
// cached per shape, strides, dtypes and pointer alignment, so a call after the first only enqueues
// work; nothing allocates and nothing synchronises, so every call is CUDA-graph capturable.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "latentmoe/dtype.h"

namespace latentmoe::cuda {

struct GemmProblem {
  DType x_dtype = DType::f32;
  DType w_dtype = DType::f32;
  DType y_dtype = DType::f32;
  int64_t rows = 0;   // T
  int64_t cols = 0;   // n
  int64_t inner = 0;  // m
  const void* x = nullptr;
  int64_t ldx = 0;
  const void* w = nullptr;
  int64_t ldw = 0;
  void* y = nullptr;
  int64_t ldy = 0;
  bool accumulate = false;  // y += x w^T (beta = 1) instead of y = x w^T
};

// The workspace cuBLASLt may use per stream (32 MiB, the size NVIDIA recommends for Hopper).
inline constexpr size_t kBlasWorkspaceBytes = size_t{32} << 20;

class Blas {
 public:
  Blas();  // creates the cuBLASLt handle on the calling thread's current device
  ~Blas();
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;

  // Enqueues the GEMM on `stream`. `workspace` (kBlasWorkspaceBytes or fewer) must not be in use by
  // another stream concurrently. Throws Error on an unsupported dtype or a cuBLAS failure.
  void gemm(const GemmProblem& problem, void* workspace, size_t workspace_bytes, cudaStream_t stream);

  // True when `problem` goes to cuBLASLt (rather than the fallback kernel).
  static bool uses_cublaslt(const GemmProblem& problem);

  // Number of distinct plans built so far (each costs one heuristic query).
  size_t num_plans() const;

 private:
  struct Cache;
  cublasLtHandle_t handle_ = nullptr;
  std::unique_ptr<Cache> cache_;
};

// The fallback: any compute dtypes, fp32 accumulation, one rounding. Slow; for rare dtype mixes.
void launch_fallback_gemm(const GemmProblem& problem, cudaStream_t stream);

}  // namespace latentmoe::cuda

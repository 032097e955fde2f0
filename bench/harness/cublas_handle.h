// A cuBLAS handle bound to a stream and destroyed with its owner: the one guard of the benchmarks that
// call cuBLAS themselves (grouped_gemm_bench.cu's GEMM ceiling, micro/gemv_bench.cu's cublasGemmEx row).
// Header-only, so that the harness library (and the latentmoe CLI that links it) needs no libcublas;
// the benchmarks that include it link CUDA::cublas (bench/CMakeLists.txt).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <memory>
#include <type_traits>

#include "bench_access.h"  // internal: LATENTMOE_CUBLAS_CHECK

namespace latentmoe::bench {

class CublasHandle {
 public:
  // cublasCreate, then cublasSetStream(stream); either failing throws latentmoe::Error.
  explicit CublasHandle(cudaStream_t stream) : handle_(create()) {
    LATENTMOE_CUBLAS_CHECK(cublasSetStream(handle_.get(), stream));
  }
  cublasHandle_t get() const { return handle_.get(); }

 private:
  struct Destroy {
    void operator()(cublasHandle_t handle) const { cublasDestroy(handle); }
  };
  static cublasHandle_t create() {
    cublasHandle_t handle = nullptr;
    LATENTMOE_CUBLAS_CHECK(cublasCreate(&handle));
    return handle;
  }
  std::unique_ptr<std::remove_pointer_t<cublasHandle_t>, Destroy> handle_;
};

}  // namespace latentmoe::bench

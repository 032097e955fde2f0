// Error checking for CUDA runtime and cuBLAS(Lt) calls: every failure becomes a latentmoe::Error
// naming the call, the source location and the library's own error name and text. Usable from
// host C++ (.cpp) and CUDA (.cu) files alike.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "latentmoe/error.h"

namespace latentmoe::cuda {

[[noreturn]] inline void throw_cuda_error(cudaError_t status, const char* call, const char* file, int line) {
  ::latentmoe::detail::throw_error("CUDA error in ", call, " at ", file, ":", line, ": ", cudaGetErrorName(status),
                                   " (", cudaGetErrorString(status), ")");
}

[[noreturn]] inline void throw_cublas_error(cublasStatus_t status, const char* call, const char* file, int line) {
  ::latentmoe::detail::throw_error("cuBLAS error in ", call, " at ", file, ":", line, ": ",
                                   cublasLtGetStatusName(status), " (", cublasLtGetStatusString(status), ")");
}

inline void check_cuda(cudaError_t status, const char* call, const char* file, int line) {
  if (status != cudaSuccess) {
    // Clear a non-sticky error so that it is not reported again by the next, unrelated check.
    (void)cudaGetLastError();
    throw_cuda_error(status, call, file, line);
  }
}

inline void check_cublas(cublasStatus_t status, const char* call, const char* file, int line) {
  if (status != CUBLAS_STATUS_SUCCESS) throw_cublas_error(status, call, file, line);
}

}  // namespace latentmoe::cuda

// LATENTMOE_CUDA_CHECK(cudaMemcpyAsync(...)) throws latentmoe::Error when the call fails.
#define LATENTMOE_CUDA_CHECK(call) ::latentmoe::cuda::check_cuda((call), #call, __FILE__, __LINE__)
#define LATENTMOE_CUBLAS_CHECK(call) ::latentmoe::cuda::check_cublas((call), #call, __FILE__, __LINE__)
// After every kernel launch: reports a bad launch configuration (or an earlier asynchronous error).
#define LATENTMOE_CUDA_CHECK_LAUNCH(kernel_name) \
  ::latentmoe::cuda::check_cuda(cudaGetLastError(), "launch of " kernel_name, __FILE__, __LINE__)

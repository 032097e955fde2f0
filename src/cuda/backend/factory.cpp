// The CUDA backend's entry points for src/core (declared in core/backend.h), so that the core
// includes no CUDA header.
#include "core/backend.h"
#include "cuda/backend/cuda_backend.h"
#include "cuda/common/device.h"

namespace latentmoe::detail {

std::unique_ptr<Backend> make_cuda_backend(int device_ordinal) {
  return std::make_unique<cuda::CudaBackend>(device_ordinal);
}

int cuda_device_count() noexcept { return cuda::cuda_device_count(); }

}  // namespace latentmoe::detail

// The CUDA backend's entry points for src/core (declared in core/backend.h), so that the core
// includes no CUDA header, and the public device queries (latentmoe/device.h).
#include <cuda_runtime_api.h>

#include "core/backend.h"
#include "cuda/backend/cuda_backend.h"
#include "cuda/common/device.h"
#include "latentmoe/device.h"

namespace latentmoe::detail {

std::unique_ptr<Backend> make_cuda_backend(int device_ordinal) {
  return std::make_unique<cuda::CudaBackend>(device_ordinal);
}

}  // namespace latentmoe::detail

namespace latentmoe {

int cuda_device_count() noexcept { return cuda::cuda_device_count(); }

CudaDeviceProperties cuda_device_properties(int device_ordinal) {
  const cuda::DeviceInfo info = cuda::device_info(device_ordinal);
  return {info.ordinal, info.name, info.major, info.minor, info.num_sms, info.total_memory};
}

std::string cuda_device_name(int device_ordinal) { return cuda::device_info(device_ordinal).name; }

bool cuda_peer_access_between(int num_devices) noexcept {
  if (num_devices > cuda::cuda_device_count()) return false;
  for (int a = 0; a < num_devices; ++a) {
    for (int b = 0; b < num_devices; ++b) {
      int can_access = 0;
      if (a != b && (cudaDeviceCanAccessPeer(&can_access, a, b) != cudaSuccess || can_access == 0)) {
        (void)cudaGetLastError();
        return false;
      }
    }
  }
  return true;
}

}  // namespace latentmoe

#include <cuda_runtime_api.h>

#include "cuda/cuda_check.h"
#include "cuda/device.h"

namespace latentmoe::cuda {

int cuda_device_count() noexcept {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no device: not an error for the caller
    return 0;
  }
  return count;
}

DeviceInfo device_info(int ordinal) {
  const int count = cuda_device_count();
  LATENTMOE_CHECK(ordinal >= 0 && ordinal < count, "CUDA device ", ordinal, " does not exist (", count, " found)");
  cudaDeviceProp properties{};
  LATENTMOE_CUDA_CHECK(cudaGetDeviceProperties(&properties, ordinal));
  DeviceInfo info;
  info.ordinal = ordinal;
  info.name = properties.name;
  info.major = properties.major;
  info.minor = properties.minor;
  info.num_sms = properties.multiProcessorCount;
  info.shared_memory_per_block_optin = properties.sharedMemPerBlockOptin;
  info.total_memory = properties.totalGlobalMem;
  return info;
}

DeviceGuard::DeviceGuard(int ordinal) : ordinal_(ordinal) {
  LATENTMOE_CUDA_CHECK(cudaGetDevice(&previous_));
  if (previous_ != ordinal_) LATENTMOE_CUDA_CHECK(cudaSetDevice(ordinal_));
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0 && previous_ != ordinal_) (void)cudaSetDevice(previous_);
}

}  // namespace latentmoe::cuda

#include <cuda_runtime_api.h>

#include <atomic>

#include "cuda/cuda_check.h"
#include "cuda/device.h"
#include "cuda/pdl.cuh"

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

bool pdl_supported() {
  // Per device, read once (the attribute query is not free and this runs at every launch).
  static std::atomic<int> cached[64] = {};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) {
    (void)cudaGetLastError();
    return false;
  }
  int value = cached[device].load(std::memory_order_relaxed);
  if (value == 0) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    value = major >= 9 ? 1 : 2;
    cached[device].store(value, std::memory_order_relaxed);
  }
  return value == 1;
}

}  // namespace latentmoe::cuda

#include <cuda_runtime_api.h>

#include <array>
#include <atomic>

#include "cuda/common/cuda_check.h"
#include "cuda/common/device.h"
#include "cuda/common/pdl.cuh"

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

namespace {

// One attribute of the current device, read once per device and cached (device ordinals < 64; the
// cache holds value + 1, so that 0 means "not read yet" even for an attribute that is 0).
int cached_current_attribute(cudaDeviceAttr attribute, std::array<std::atomic<int>, 64>& cache) {
  int device = 0;
  LATENTMOE_CUDA_CHECK(cudaGetDevice(&device));
  const bool cacheable = device >= 0 && device < static_cast<int>(cache.size());
  const int cached = cacheable ? cache[device].load(std::memory_order_relaxed) : 0;
  if (cached != 0) return cached - 1;
  int value = 0;
  LATENTMOE_CUDA_CHECK(cudaDeviceGetAttribute(&value, attribute, device));
  if (cacheable) cache[device].store(value + 1, std::memory_order_relaxed);
  return value;
}

}  // namespace

int current_compute_capability() {
  static std::array<std::atomic<int>, 64> major_cache{}, minor_cache{};
  return 10 * cached_current_attribute(cudaDevAttrComputeCapabilityMajor, major_cache) +
         cached_current_attribute(cudaDevAttrComputeCapabilityMinor, minor_cache);
}

int current_sm_count() {
  static std::array<std::atomic<int>, 64> cache{};
  return cached_current_attribute(cudaDevAttrMultiProcessorCount, cache);
}

int current_shared_memory_optin() {
  static std::array<std::atomic<int>, 64> cache{};
  return cached_current_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, cache);
}

bool pdl_supported() { return current_compute_capability() >= 90; }

}  // namespace latentmoe::cuda

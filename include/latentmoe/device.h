// What latentmoe sees of the machine's CUDA devices: for tools, tests and engines that choose a backend,
// a placement or a tune table (latentmoe/tune.h takes a GPU model's name). Every function works in a
// build without CUDA too (no device there).
#pragma once

#include <cstddef>
#include <string>

namespace latentmoe {

// Number of CUDA devices; 0 without CUDA (in this build or the machine), a driver or a GPU. Never throws.
int cuda_device_count() noexcept;

struct CudaDeviceProperties {
  int ordinal = 0;
  std::string name;  // cudaDeviceProp::name, e.g. "NVIDIA H200"
  int major = 0;     // compute capability major.minor (9.0 on Hopper)
  int minor = 0;
  int num_sms = 0;
  size_t total_memory = 0;  // bytes
};

// Throws Error when latentmoe was built without CUDA or the device does not exist.
CudaDeviceProperties cuda_device_properties(int device_ordinal);
// cuda_device_properties(device_ordinal).name.
std::string cuda_device_name(int device_ordinal);
// Whether each of GPUs 0..num_devices-1 can access every other's memory (cudaDeviceCanAccessPeer);
// false without CUDA or on any error. Never throws.
bool cuda_peer_access_between(int num_devices) noexcept;

}  // namespace latentmoe

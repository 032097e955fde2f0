// Device queries and the current-device guard of the CUDA backend. Host-only; includable from C++.
#pragma once

#include <cstddef>
#include <string>

namespace latentmoe::cuda {

// Number of CUDA devices; 0 when there is no driver, no GPU or any other CUDA error. Never throws.
int cuda_device_count() noexcept;

struct DeviceInfo {
  int ordinal = 0;
  std::string name;
  int major = 0;  // compute capability
  int minor = 0;
  int num_sms = 0;
  size_t shared_memory_per_block_optin = 0;  // the most dynamic shared memory a block may opt in to
  size_t total_memory = 0;
};

// Throws Error when the ordinal does not exist.
DeviceInfo device_info(int ordinal);

// The current device's compute capability (major * 10 + minor) and SM count, each read once per
// device (they are consulted on every launch). Throw Error when there is no current device.
int current_compute_capability();
int current_sm_count();
// The most dynamic shared memory one block of the current device may opt in to, in bytes (cached).
int current_shared_memory_optin();

// Makes `ordinal` the calling thread's current device for its lifetime and restores the previous
// one afterwards (several ranks may share a thread pool or a process).
class DeviceGuard {
 public:
  explicit DeviceGuard(int ordinal);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
  int ordinal_ = -1;
};

}  // namespace latentmoe::cuda

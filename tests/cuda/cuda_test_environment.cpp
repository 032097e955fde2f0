// The process environment the GPU tests need, set before CUDA starts (a static initializer runs
// before main, and CUDA reads these at its first call): ranks simulated on one GPU spin on each
// other, so every rank's streams need their own hardware queue (CUDA_DEVICE_MAX_CONNECTIONS, 8 by
// default, 32 at most) and every kernel is loaded up front (CUDA_MODULE_LOADING=EAGER); see
// latentmoe/gpu_group.h. The NCCL groups refuse to start unless NVLink multicast is off
// (NCCL_NVLS_ENABLE=0), which the library never sets itself. Values already set by the caller are kept.
#include <cstdlib>

namespace {

const bool kEnvironmentSet = [] {
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", /*overwrite=*/0);
  setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0);
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  return true;
}();

}  // namespace

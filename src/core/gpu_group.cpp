// The portable part of latentmoe/gpu_group.h: the timeout default, and the stand-in that reports a
// build without CUDA (src/cuda/comm/simulated_group.cpp defines the group otherwise).
#include "latentmoe/gpu_group.h"

#include <cstdlib>
#include <string>

#include "latentmoe/error.h"

namespace latentmoe {

std::chrono::milliseconds default_collective_timeout() {
  const char* value = std::getenv("LATENTMOE_COLLECTIVE_TIMEOUT_MS");
  if (value == nullptr || *value == '\0') return std::chrono::milliseconds(30000);
  char* end = nullptr;
  const long long ms = std::strtoll(value, &end, 10);
  LATENTMOE_CHECK(end != value && *end == '\0' && ms > 0 && ms <= 3600000,
                  "LATENTMOE_COLLECTIVE_TIMEOUT_MS must be an integer in 1..3600000 (milliseconds)");
  return std::chrono::milliseconds(ms);
}

#ifndef LATENTMOE_WITH_CUDA
std::vector<std::unique_ptr<Communicator>> make_simulated_gpu_group(int, const GpuGroupOptions&) {
  detail::throw_error("a GPU group needs the CUDA backend: latentmoe was built without CUDA");
}
#endif

}  // namespace latentmoe

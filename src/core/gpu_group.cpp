// The portable part of latentmoe/gpu_group.h: the timeout and one-shot defaults, the placements, and the stand-ins
// that report a build without CUDA (src/cuda/comm/simulated_group.cpp and nccl_group.cpp define the
// groups otherwise).
#include "latentmoe/gpu_group.h"

#include <algorithm>
#include <string>

#include "core/backend.h"
#include "core/nccl_checks.h"
#include "core/settings.h"
#include "latentmoe/device.h"
#include "latentmoe/error.h"

namespace latentmoe {

std::chrono::milliseconds default_collective_timeout() {
  return std::chrono::milliseconds(detail::integer_setting(detail::Setting::collective_timeout_ms));
}

int64_t default_one_shot_tokens(int tp_size) {
  if (auto tokens = detail::read_integer(detail::Setting::one_shot_max_tokens)) return *tokens;
  return tp_size <= 2 ? kDefaultOneShotTokensTwoRanks : kDefaultOneShotTokens;
}

void size_nccl_group(GpuGroupOptions& options, int64_t max_tokens, int64_t per_token_elements,
                     int64_t one_shot_tokens) {
  LATENTMOE_CHECK(max_tokens >= 1 && per_token_elements >= 1 && one_shot_tokens >= 1, "GPU group: sized for ",
                  max_tokens, " tokens of ", per_token_elements, " elements, the one-shot path for ", one_shot_tokens,
                  " (each must be at least 1)");
  options.capacity_elements = std::min(max_tokens, one_shot_tokens) * per_token_elements;
  options.max_elements = max_tokens * per_token_elements;
}

std::string_view to_string(GpuPlacement placement) {
  switch (placement) {
    case GpuPlacement::automatic:
      return "auto";
    case GpuPlacement::simulated:
      return "simulated";
    case GpuPlacement::devices:
      return "devices";
  }
  return "auto";
}

GpuPlacement parse_gpu_placement(std::string_view name) {
  if (name == "auto") return GpuPlacement::automatic;
  if (name == "simulated") return GpuPlacement::simulated;
  if (name == "devices") return GpuPlacement::devices;
  detail::throw_error("unknown GPU placement '", name, "' (expected auto, simulated or devices)");
}

GpuPlacement resolve_gpu_placement(GpuPlacement requested, int tp_size, std::string* why) {
  LATENTMOE_CHECK(tp_size >= 1, "GPU placement: tp must be at least 1, got ", tp_size);
  const int devices = cuda_device_count();
  // NCCL and peer access are asked only when they could matter (peer access initialises every device).
  const bool wanted = requested != GpuPlacement::simulated && devices >= tp_size;
  const std::string nccl = wanted ? detail::nccl_problem() : std::string();
  const bool peers_ok = wanted && nccl.empty() && cuda_peer_access_between(tp_size);
  return detail::choose_gpu_placement(requested, tp_size, devices, peers_ok, nccl, why);
}

#ifndef LATENTMOE_WITH_CUDA
std::vector<std::unique_ptr<Communicator>> make_simulated_gpu_group(int, const GpuGroupOptions&) {
  detail::throw_error("a GPU group needs the CUDA backend: latentmoe was built without CUDA");
}
std::vector<std::unique_ptr<Communicator>> make_nccl_gpu_group(int, const GpuGroupOptions&) {
  detail::throw_error("an NCCL GPU group needs the CUDA backend and NCCL: latentmoe was built without CUDA");
}
namespace detail {
std::string nccl_problem() { return "latentmoe was built without CUDA and NCCL"; }
}  // namespace detail
#endif

}  // namespace latentmoe

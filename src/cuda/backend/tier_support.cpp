// CudaBackend::tier_support: what each tail tier can run on this backend over a given communicator.
// With a GPU group (a LamportCommunicator) every collective of the tails is a one-shot Lamport call
// whose message must fit the group's receive region, so each tier is bounded by the widest message it
// sends per token; any other communicator runs the composed steps, with that communicator's limits.
#include <algorithm>
#include <string>

#include "cuda/backend/cuda_backend.h"
#include "cuda/comm/lamport_communicator.h"

namespace latentmoe::cuda {

TierSupport CudaBackend::tier_support(const LayerConfig& config, DType dtype, int tp_size,
                                      const Communicator& comm) const {
  TierSupport support = Backend::tier_support(config, dtype, tp_size, comm);
  const auto* group = dynamic_cast<const LamportCommunicator*>(&comm);
  if (group == nullptr || tp_size <= 1) return support;  // one rank never communicates

  support.peers_reachable = true;
  support.collectives = "one-shot Lamport collectives on the GPU (ranks load/store each other's buffers)";
  constexpr TailTier kTiers[] = {TailTier::native, TailTier::tail_fusion, TailTier::allreduce_overlap,
                                 TailTier::column_parallel};
  if (group->lamport_dtype() != dtype) {
    const std::string reason = "cannot run: the GPU group carries " + std::string(dtype_name(group->lamport_dtype())) +
                               " but this layer runs in " + std::string(dtype_name(dtype));
    for (TailTier tier : kTiers) support.refuse(tier, reason);
    return support;
  }
  // Bytes per rank of each source region; a message of T rows x `cols` elements fits when
  // T * cols * element <= capacity (the capacity is a multiple of 16, the messages' rounding).
  const int64_t capacity = group->lamport_peers().capacity_bytes;
  const int64_t element = static_cast<int64_t>(dtype_size(dtype));
  const int64_t d = config.hidden_size, l = config.latent_size;
  auto bound = [&](TailTier tier, int64_t cols, const char* message) {
    const int64_t max_tokens = capacity / (cols * element);
    const std::string reason = "the GPU group's one-shot buffer holds " + std::to_string(capacity) +
                               " bytes per rank, and " + message + " is " + std::to_string(cols) + " " +
                               std::string(dtype_name(dtype)) + " per token (GpuGroupOptions::capacity_elements)";
    if (max_tokens < 1) {
      support.refuse(tier, "cannot run: " + reason);
    } else {
      support.bound(tier, max_tokens, reason);
    }
  };
  const int64_t widest = config.has_shared_expert() ? std::max(d, l) : l;  // the all-reduces of L_r, S_r / out
  bound(TailTier::native, widest, "its widest all-reduce");
  bound(TailTier::tail_fusion, l + d / tp_size, "its collective (L_r and a 1/tp shard of S_r)");
  bound(TailTier::allreduce_overlap, widest, "its widest all-reduce");
  bound(TailTier::column_parallel, widest, "its widest all-reduce");
  return support;
}

}  // namespace latentmoe::cuda

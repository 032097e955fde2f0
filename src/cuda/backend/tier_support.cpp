// CudaBackend::tier_support: what each tail tier can run on this backend over a given communicator.
// With a GPU group (Communicator::one_shot_kernels) every collective of the tails is a one-shot Lamport call
// whose message must fit the group's receive region, or (NCCL groups) an NCCL collective above it or
// when the ranks cannot all load/store each other; the arithmetic is core/gpu_tier_support.cpp. Any
// other communicator runs the composed steps, with that communicator's limits.
#include "core/gpu_tier_support.h"
#include "cuda/backend/cuda_backend.h"
#include "cuda/comm/lamport_communicator.h"

namespace latentmoe::cuda {

TierSupport CudaBackend::tier_support(const LayerConfig& config, DType dtype, int tp_size,
                                      const Communicator& comm) const {
  TierSupport support = Backend::tier_support(config, dtype, tp_size, comm);
  const LamportCommunicator* group = comm.one_shot_kernels();
  if (group == nullptr || tp_size <= 1) return support;  // one rank never communicates

  ::latentmoe::detail::GpuGroupLimits limits;
  limits.dtype = group->lamport_dtype();
  limits.one_shot = group->one_shot();
  limits.capacity_bytes = group->lamport_peers().capacity_bytes;
  limits.fallback_elements = group->fallback_elements();
  ::latentmoe::detail::apply_gpu_group_limits(support, config, dtype, tp_size, limits);
  return support;
}

}  // namespace latentmoe::cuda

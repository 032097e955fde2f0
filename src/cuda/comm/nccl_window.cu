// The only use of NCCL's device API: each peer's pointer into a symmetric window, read once when a group
// is built and copied into the plain LamportPeers struct, so that the collective kernels depend on no
// communication library. (The device API has no ABI compatibility across NCCL releases: the group checks
// the loaded libnccl against the one compiled here before it calls this.)
#if defined(LATENTMOE_WITH_NCCL)
#include <nccl.h>
#include <nccl_device.h>

#include "cuda/comm/nccl_window.h"
#include "cuda/common/cuda_check.h"

static_assert(NCCL_VERSION_CODE >= 22800, "latentmoe's NCCL group needs NCCL 2.28 or newer (symmetric device API)");

namespace latentmoe::cuda {
namespace {

// One warp: thread p reads world rank p's address of the window (the window descriptor lives in device
// memory; ncclGetPeerPointer maps a world rank into the LSA team's flat mapping), thread 0 also this
// rank's own. No synchronisation: the kernel only reads the descriptor.
__global__ void read_peer_pointers_kernel(ncclWindow_t window, int size, void** out) {
  for (int peer = static_cast<int>(threadIdx.x); peer < size; peer += static_cast<int>(blockDim.x))
    out[peer] = ncclGetPeerPointer(window, 0, peer);
  if (threadIdx.x == 0) out[size] = ncclGetLocalPointer(window, 0);
}

}  // namespace

std::vector<void*> read_window_peer_pointers(ncclWindow_t window, int size, cudaStream_t stream) {
  void** device_out = nullptr;
  LATENTMOE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&device_out), sizeof(void*) * (size + 1)));
  std::vector<void*> pointers(size + 1, nullptr);
  try {
    read_peer_pointers_kernel<<<1, 32, 0, stream>>>(window, size, device_out);
    LATENTMOE_CUDA_CHECK_LAUNCH("read_peer_pointers_kernel");
    LATENTMOE_CUDA_CHECK(
        cudaMemcpyAsync(pointers.data(), device_out, sizeof(void*) * (size + 1), cudaMemcpyDeviceToHost, stream));
    LATENTMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  } catch (...) {
    (void)cudaFree(device_out);
    throw;
  }
  LATENTMOE_CUDA_CHECK(cudaFree(device_out));
  return pointers;
}

int lsa_team_size(ncclComm_t comm) { return ncclTeamLsa(comm).nRanks; }

}  // namespace latentmoe::cuda
#endif  // LATENTMOE_WITH_NCCL

// NCCL's device API, kept in one translation unit (nccl_window.cu): the peers' pointers into a symmetric
// window, read once when a group is built, and the size of the load/store-accessible (LSA) team. Host
// interface; needs nccl.h (CUDA builds with NCCL only).
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <vector>

namespace latentmoe::cuda {

// Every world rank's address of the window's first byte, as this rank's kernels reach it
// (ncclGetPeerPointer), then this rank's own (ncclGetLocalPointer): size + 1 pointers. Enqueues one tiny
// kernel on `stream` and waits for it. Valid only when every rank is in this rank's LSA team.
std::vector<void*> read_window_peer_pointers(ncclWindow_t window, int size, cudaStream_t stream);

// The number of ranks of `comm` that this rank can load from and store to (NCCL's LSA team).
int lsa_team_size(ncclComm_t comm);

}  // namespace latentmoe::cuda

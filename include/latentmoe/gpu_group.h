// A tensor-parallel group whose collectives run on the GPU: one communicator per rank, every
// collective enqueued on the caller's stream (nothing blocks the host), device tensors only.
//
// Simulated placement: all `tp_size` ranks on one GPU, each rank with its own streams (its own
// Runner), the peer buffers in that GPU's memory. Every tier of the layer then runs, and is tested,
// on one GPU; only the cost of NVLink is missing. The collectives are the one-shot Lamport kernels
// of src/cuda/comm (bounded waits, bit-identical sums on every rank).
//
// Ranks that share a GPU spin on each other, so such a process needs, set before its first CUDA call
// (the latentmoe tool and the GPU tests set both):
//   CUDA_MODULE_LOADING=EAGER: with lazy loading, a rank's first launch of a kernel can wait for a
//     peer's collective that spins waiting for it;
//   CUDA_DEVICE_MAX_CONNECTIONS >= 4 x tp (32 from tp 8 on): streams beyond the hardware queues share
//     one in order, and a waiting collective would hold back a peer's kernel (checked: the group
//     refuses to be built with fewer).
#pragma once

#include <chrono>
#include <memory>
#include <vector>

#include "latentmoe/communicator.h"
#include "latentmoe/dtype.h"

namespace latentmoe {

struct GpuGroupOptions {
  int device = 0;             // the GPU every simulated rank runs on
  DType dtype = DType::bf16;  // the dtype of every collective (the layer's compute dtype)
  // The largest message one collective moves, in elements of `dtype` per rank: T (d + l) holds
  // every collective of a layer of T tokens (tier 0's carries [T, l + d/tp]); each rank's receive
  // area is 3 x tp_size x this.
  int64_t capacity_elements = 0;
  // How long a collective waits for its peers before it fails (LATENTMOE_COLLECTIVE_TIMEOUT_MS
  // overrides the default).
  std::chrono::milliseconds timeout{30000};
};

// The default timeout, or LATENTMOE_COLLECTIVE_TIMEOUT_MS when set (a positive integer).
std::chrono::milliseconds default_collective_timeout();

// Throws Error without CUDA or a GPU, for tp_size outside 1..16, or a capacity below 1.
std::vector<std::unique_ptr<Communicator>> make_simulated_gpu_group(int tp_size, const GpuGroupOptions& options);

}  // namespace latentmoe

// The collectives the tails need, over the ranks of one tensor-parallel group.
//
// Contract shared by every implementation:
//   - sums accumulate in fp32 (or wider) and add the ranks' contributions in rank order 0..tp-1,
//     so every rank obtains bit-identical results (an NCCL group above its one-shot capacity sums in
//     NCCL's order instead, still identical on every rank: latentmoe/gpu_group.h);
//   - tensors are rank-2 [rows, cols] with a contiguous last dimension; shards are column blocks:
//     rank r owns columns [r*cols/tp, (r+1)*cols/tp);
//   - every call is collective: all ranks call the same sequence of operations with equal shapes;
//   - a rank that waits longer than the implementation's timeout throws Error (never hangs).
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "latentmoe/tensor.h"

namespace latentmoe {

namespace cuda {
class LamportCommunicator;  // internal: src/cuda/comm/lamport_communicator.h
}  // namespace cuda

// An opaque execution stream: cudaStream_t for CUDA communicators, ignored (nullptr) on the CPU.
using StreamHandle = void*;

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int size() const = 0;
  virtual int rank() const = 0;

  // In place: every rank's `buffer` becomes the sum of all ranks' buffers.
  virtual void all_reduce_sum(const TensorView& buffer, StreamHandle stream = nullptr) = 0;
  // `input` [rows, cols]; `output` [rows, cols/tp] receives this rank's column shard of the sum.
  virtual void reduce_scatter_sum(const TensorView& input, const TensorView& output, StreamHandle stream = nullptr) = 0;
  // `input` [rows, cols/tp] is this rank's shard; `output` [rows, cols] receives all shards.
  virtual void all_gather(const TensorView& input, const TensorView& output, StreamHandle stream = nullptr) = 0;
  virtual void barrier(StreamHandle stream = nullptr) = 0;

  // The check point of communicators whose collectives only enqueue work (GPU groups): throws Error
  // naming the rank and the collective if one enqueued earlier has failed on the device (a peer
  // never arrived within the timeout, or the group was aborted). Call it once the stream's work has
  // completed (after a synchronisation the caller makes anyway, e.g. copying the output to the host).
  // Communicators that fail synchronously (the in-process group) have nothing to report here.
  virtual void check() {}

  // Gives up on the group after a failure on some rank: collectives blocked now or called later,
  // on every rank of the group, throw Error instead of waiting for peers that will never come.
  virtual void abort() = 0;

  // Diagnostics for an error message: the last collectives this rank enqueued, oldest first, with the
  // path each took (e.g. "all_reduce [37, 3584] NCCL"); empty where the communicator keeps none. Host
  // bookkeeping at enqueue time only: under graph capture it describes the capture.
  virtual std::string recent_collectives() const { return {}; }

  // What the group can do beyond the collectives above, asked by latentmoe's CUDA backend: a GPU group's
  // one-shot (Lamport) kernels, which the backend launches itself to fuse a tail's collective with its
  // norm, its reduce-scatter or its GEMM (latentmoe/gpu_group.h). nullptr (the default, and every
  // communicator outside latentmoe): only the collectives above, which the backend then composes.
  virtual cuda::LamportCommunicator* one_shot_kernels() { return nullptr; }
  virtual const cuda::LamportCommunicator* one_shot_kernels() const { return nullptr; }

  // How long a collective of this group waits for its peers before it fails; 0 where the
  // implementation does not say. A host that waits for a rank's device work gives up after twice this
  // (twice default_collective_timeout(), latentmoe/gpu_group.h, where it is 0).
  virtual std::chrono::milliseconds timeout() const { return std::chrono::milliseconds(0); }
};

}  // namespace latentmoe

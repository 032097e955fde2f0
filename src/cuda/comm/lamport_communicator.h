// The GPU groups' communicator (simulated ranks, NCCL groups): where every rank can load and store its
// peers' receive areas (one_shot()), the CUDA backend's fused collective steps launch their own kernels
// through its plain peer parameters, so the kernels depend on no communication library. The backend finds
// it through Communicator::one_shot_kernels(). Host-only; includable from C++.
#pragma once

#include "cuda/comm/lamport.h"
#include "latentmoe/communicator.h"

namespace latentmoe::cuda {

class LamportCommunicator : public Communicator {
 public:
  // The capability query of Communicator: this group's one-shot kernels are there.
  LamportCommunicator* one_shot_kernels() override { return this; }
  const LamportCommunicator* one_shot_kernels() const override { return this; }

  // Bound once when the group is built; valid as long as the communicator.
  virtual const LamportPeers& lamport_peers() const = 0;
  // The dtype every collective of the group carries.
  virtual DType lamport_dtype() const = 0;
  // Whether the one-shot kernels run at all: false when not every rank can load and store its peers'
  // buffers (or the group was built without them); its collectives then go through another library
  // (NCCL) and the fused collective steps are composed.
  virtual bool one_shot() const { return true; }
  // The largest tensor (rows x cols elements) a collective carries when its one-shot message exceeds the
  // capacity or one_shot() is false (through NCCL); 0: none, such a collective is an Error.
  virtual int64_t fallback_elements() const { return 0; }
  // Enqueues one one-shot kernel of this rank on `stream` (the group's collectives and the backend's
  // fused steps alike). A group whose ranks share a GPU keeps them in step around it.
  virtual void launch(const LamportCall& call, cudaStream_t stream) { launch_lamport(lamport_peers(), call, stream); }
  // The group's one-shot deadline (GpuGroupOptions::timeout).
  std::chrono::milliseconds timeout() const override {
    return std::chrono::milliseconds(static_cast<int64_t>(lamport_peers().timeout_ns / 1000000));
  }
};

}  // namespace latentmoe::cuda

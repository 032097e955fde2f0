// A communicator whose ranks can load and store each other's receive areas (the GPU groups): the
// CUDA backend's fused collective steps launch their own kernels through its plain peer parameters,
// so the kernels depend on no communication library. Host-only; includable from C++.
#pragma once

#include "cuda/comm/lamport.h"
#include "latentmoe/communicator.h"

namespace latentmoe::cuda {

class LamportCommunicator : public Communicator {
 public:
  // Bound once when the group is built; valid as long as the communicator.
  virtual const LamportPeers& lamport_peers() const = 0;
  // The dtype every collective of the group carries.
  virtual DType lamport_dtype() const = 0;
};

}  // namespace latentmoe::cuda

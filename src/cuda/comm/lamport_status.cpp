// The Error a GPU group's status word reports (lamport.h), shared by the simulated and NCCL groups.
#include "cuda/comm/lamport.h"
#include "latentmoe/error.h"

namespace latentmoe::cuda {

const char* lamport_op_name(LamportOp op) {
  switch (op) {
    case LamportOp::all_reduce:
      return "all-reduce";
    case LamportOp::reduce_scatter:
      return "reduce-scatter";
    case LamportOp::all_gather:
      return "all-gather";
    case LamportOp::barrier:
      return "barrier";
  }
  return "collective";
}

void throw_lamport_failure(int status, int rank, int64_t timeout_ms) {
  if (status == 0) return;
  const int failure = status & 0xff, op = status >> 8;
  if (failure == static_cast<int>(LamportFailure::aborted)) {
    detail::throw_error("rank ", rank, ": the GPU ", lamport_op_name(static_cast<LamportOp>(op)),
                        " was aborted: another rank of the group failed");
  }
  detail::throw_error("rank ", rank, ": the GPU ", lamport_op_name(static_cast<LamportOp>(op)), " timed out after ",
                      timeout_ms, " ms waiting for its peers (a rank never arrived)");
}

}  // namespace latentmoe::cuda

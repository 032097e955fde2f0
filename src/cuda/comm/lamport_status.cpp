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
  const auto word = static_cast<uint32_t>(status);
  const int failure = static_cast<int>(word & 0xffu);
  const char* op = lamport_op_name(static_cast<LamportOp>((word >> 8) & 0xfu));
  const int source = static_cast<int>((word >> 12) & 0xfu);
  const unsigned call = word >> 16;
  if (failure == static_cast<int>(LamportFailure::peer_timeout)) {
    detail::throw_error("rank ", rank, ": the GPU ", op, " timed out: another rank of the group waited ", timeout_ms,
                        " ms for a message that never came, and released this rank, which was waiting for rank ",
                        source, "'s message of call ", call,
                        " mod 65536 (that rank never arrived, or the ranks' calls diverged)");
  }
  if (failure == static_cast<int>(LamportFailure::aborted)) {
    detail::throw_error("rank ", rank, ": the GPU ", op, " was aborted: another rank of the group failed (call ", call,
                        " mod 65536, waiting for rank ", source, ")");
  }
  detail::throw_error("rank ", rank, ": the GPU ", op, " timed out after ", timeout_ms, " ms waiting for rank ", source,
                      "'s message of call ", call,
                      " mod 65536 (that rank never arrived, or the ranks' calls diverged)");
}

}  // namespace latentmoe::cuda

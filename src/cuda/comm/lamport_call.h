// The one way a LamportCall (cuda/comm/lamport.h) is made from tensor views: by the groups' collectives
// (simulated_group.cpp, nccl_group.cpp) and by the CUDA backend's fused steps (backend/fused_tails.cpp).
// Host-only; includable from C++.
#pragma once

#include <cstdint>

#include "cuda/comm/lamport.h"
#include "latentmoe/tensor.h"

namespace latentmoe::cuda {

// Elements between consecutive rows of a rank-1 (one row) or rank-2 view.
inline int64_t lamport_row_stride(const TensorView& view) { return view.rank() == 2 ? view.stride(0) : view.numel(); }

// `op` from `in` into `out`, over the collective's whole [rows, cols]: all_reduce in [rows, cols] -> out
// of the same shape (out may be in); reduce_scatter in [rows, cols] -> out this rank's column block;
// all_gather in this rank's block -> out [rows, cols] (either undefined with LamportCall::presend: the
// producer already sent). The caller has checked the views (device tensors of the group's dtype, rank 1
// or 2 with a contiguous last dimension, block shapes) and names the rank in its errors.
inline LamportCall make_lamport_call(LamportOp op, const TensorView& in, const TensorView& out) {
  const TensorView& whole = op == LamportOp::all_gather ? out : in;
  LamportCall call;
  call.op = op;
  call.dtype = whole.dtype();
  call.rows = whole.rank() == 2 ? whole.size(0) : 1;
  call.cols = whole.rank() == 2 ? whole.size(1) : whole.numel();
  if (in.defined()) {
    call.in = in.data();
    call.ld_in = lamport_row_stride(in);
  }
  if (out.defined()) {
    call.out = out.data();
    call.ld_out = lamport_row_stride(out);
  }
  return call;
}

}  // namespace latentmoe::cuda

// CudaBackend's per-row operations: the top-k routing, the RMSNorm, the residual add and the zero
// experts' scaled add.
#include "cuda/backend/backend_state.h"
#include "cuda/kernels/elementwise.h"
#include "cuda/kernels/norm.h"
#include "cuda/kernels/routing.h"

namespace latentmoe::cuda {

void CudaBackend::route(const RoutingParams& params, const TensorView& logits, const TensorView& bias,
                        const TensorView& topk_ids, const TensorView& topk_weights, const TensorView& zero_weight_sum) {
  State& s = *state_;
  DeviceGuard guard(s.ordinal);
  debug_require_dtype(logits.dtype(), DType::f32, "router logits");
  debug_require_dtype(topk_ids.dtype(), DType::i32, "topk_ids");
  debug_require_dtype(topk_weights.dtype(), DType::f32, "topk_weights");
  debug_require_dtype(zero_weight_sum.dtype(), DType::f32, "zero_weight_sum");
  const RowMatrix rows = as_rows(logits, "router logits");
  debug_require_contiguous_device(topk_ids, "topk_ids");
  debug_require_contiguous_device(topk_weights, "topk_weights");
  debug_require_contiguous_device(zero_weight_sum, "zero_weight_sum");
  const int64_t num_tokens = rows.rows;
  const int64_t num_outputs = params.num_experts + params.num_zero_experts;
  const int64_t k = topk_ids.rank() == 2 ? topk_ids.size(1) : topk_ids.numel();
  LATENTMOE_DEBUG_CHECK(rows.cols == num_outputs, "CUDA routing: logits have ", rows.cols,
                        " columns, expected E+Z = ", num_outputs);
  LATENTMOE_DEBUG_CHECK(k == params.top_k, "CUDA routing: topk_ids has ", k, " columns but top_k is ", params.top_k);
  LATENTMOE_DEBUG_CHECK(topk_ids.numel() == num_tokens * k && topk_weights.numel() == num_tokens * k &&
                            zero_weight_sum.numel() == num_tokens,
                        "CUDA routing: output shapes do not match ", num_tokens, " tokens and top_k ", k);
  RouteArgs args;
  args.logits = static_cast<const float*>(rows.data);
  args.ld_logits = rows.ld;
  if (bias.defined()) {
    debug_require_dtype(bias.dtype(), DType::f32, "e_score_correction_bias");
    debug_require_contiguous_device(bias, "e_score_correction_bias");
    LATENTMOE_DEBUG_CHECK(bias.numel() == num_outputs, "CUDA routing: bias of shape ", bias.shape_string(),
                          " does not match E+Z = ", num_outputs);
    args.bias = bias.data_as<const float>();
  }
  args.topk_ids = topk_ids.data_as<int32_t>();
  args.topk_weights = topk_weights.data_as<float>();
  args.zero_weight_sum = zero_weight_sum.data_as<float>();
  args.num_tokens = num_tokens;
  launch_route(params, args, s.info.shared_memory_per_block_optin, s.current);
}

void CudaBackend::rms_norm(const TensorView& in, const TensorView& gamma, float eps, const TensorView& out) {
  State& s = *state_;
  DeviceGuard guard(s.ordinal);
  debug_require_compute_dtype(in.dtype(), "RMSNorm input");
  debug_require_compute_dtype(out.dtype(), "RMSNorm output");
  debug_require_compute_dtype(gamma.dtype(), "RMSNorm gamma");
  debug_require_contiguous_device(gamma, "RMSNorm gamma");
  const RowMatrix input = as_rows(in, "RMSNorm input");
  const RowMatrix output = as_rows(out, "RMSNorm output");
  LATENTMOE_DEBUG_CHECK(output.rows == input.rows && output.cols == input.cols && gamma.numel() == input.cols,
                        "CUDA RMSNorm: input ", in.shape_string(), ", gamma ", gamma.shape_string(), " and output ",
                        out.shape_string(), " do not match");
  launch_rms_norm(input, gamma.data(), gamma.dtype(), eps, output, s.current);
}

void CudaBackend::add(const TensorView& a, const TensorView& b, const TensorView& out) {
  State& s = *state_;
  DeviceGuard guard(s.ordinal);
  debug_require_compute_dtype(a.dtype(), "add input a");
  debug_require_compute_dtype(b.dtype(), "add input b");
  debug_require_compute_dtype(out.dtype(), "add output");
  const RowMatrix left = as_rows(a, "add input a");
  const RowMatrix right = as_rows(b, "add input b");
  const RowMatrix output = as_rows(out, "add output");
  LATENTMOE_DEBUG_CHECK(
      left.rows == right.rows && left.cols == right.cols && output.rows == left.rows && output.cols == left.cols,
      "CUDA add: shapes ", a.shape_string(), " + ", b.shape_string(), " -> ", out.shape_string(), " do not match");
  launch_add(left, right, output, s.current);
}

void CudaBackend::add_scaled_rows(const TensorView& x, const TensorView& scale, const TensorView& out) {
  State& s = *state_;
  DeviceGuard guard(s.ordinal);
  debug_require_compute_dtype(x.dtype(), "add_scaled_rows input");
  debug_require_compute_dtype(out.dtype(), "add_scaled_rows output");
  debug_require_dtype(scale.dtype(), DType::f32, "add_scaled_rows scale");
  debug_require_contiguous_device(scale, "add_scaled_rows scale");
  const RowMatrix input = as_rows(x, "add_scaled_rows input");
  const RowMatrix output = as_rows(out, "add_scaled_rows output");
  LATENTMOE_DEBUG_CHECK(input.rows == output.rows && input.cols == output.cols && scale.numel() == input.rows,
                        "CUDA add_scaled_rows: x ", x.shape_string(), ", scale ", scale.shape_string(), " and out ",
                        out.shape_string(), " do not match");
  launch_add_scaled_rows(input, scale.data_as<const float>(), output, s.current);
}

}  // namespace latentmoe::cuda

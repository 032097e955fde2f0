// routed_experts and dense_mlp: gate/up GEMMs, the activation on the unrounded double accumulators,
// `a` rounded to the activation dtype, the down GEMM; the routed sum in double, rounded once.
#include <algorithm>
#include <string>
#include <vector>

#include "cpu/activation.h"
#include "cpu/cpu_ops.h"
#include "cpu/matmul.h"
#include "latentmoe/mxfp4.h"

namespace latentmoe::detail::cpu {
namespace {

struct MlpScratch {
  std::vector<double> gate;
  std::vector<double> up;
  std::vector<float> activated;
};

// y [rows, down.rows] (doubles) = down(act(gate(u), up(u))) for contiguous float rows u [rows, up.cols].
// `gate` is null for relu2. `a` is rounded to `activation_dtype` before the down projection.
// W is Matrix (dense) or Mxfp4Matrix (decoded exactly by matmul_nt).
template <class W>
void mlp_rows(const ActivationParams& params, DType activation_dtype, const float* u, int64_t rows, const W* gate,
              const W& up, const W& down, MlpScratch& scratch, double* y) {
  const int64_t size = rows * up.rows;
  scratch.up.resize(static_cast<size_t>(size));
  scratch.activated.resize(static_cast<size_t>(size));
  matmul_nt(u, rows, up, scratch.up.data());
  if (gate != nullptr) {
    scratch.gate.resize(static_cast<size_t>(size));
    matmul_nt(u, rows, *gate, scratch.gate.data());
  }
  for (int64_t i = 0; i < size; ++i) {
    const double g = gate != nullptr ? scratch.gate[i] : 0.0;
    scratch.activated[i] = round_to_dtype(activation_dtype, activate(params, g, scratch.up[i]));
  }
  matmul_nt(scratch.activated.data(), rows, down, y);
}

bool is_gated(const ActivationParams& params) { return params.activation != Activation::relu2; }

void check_mlp_shapes(const Matrix* gate, const Matrix& up, const Matrix& down, int64_t in_cols, int64_t out_cols,
                      const char* what) {
  LATENTMOE_CHECK(up.cols == in_cols && down.rows == out_cols && down.cols == up.rows, "CPU ", what,
                  ": weight shapes up [", up.rows, ", ", up.cols, "], down [", down.rows, ", ", down.cols,
                  "] do not match input width ", in_cols, " and output width ", out_cols);
  LATENTMOE_CHECK(gate == nullptr || (gate->rows == up.rows && gate->cols == up.cols), "CPU ", what, ": gate weight [",
                  gate->rows, ", ", gate->cols, "] does not match up [", up.rows, ", ", up.cols, "]");
}

// The MXFP4 experts' views: U8 codes and scales of the shapes in MlpWeights (src/core/backend.h).
void check_mxfp4_experts(const MlpWeights& experts, bool gated, int64_t width) {
  auto check = [](const TensorView& view, const char* what) {
    LATENTMOE_CHECK(view.defined() && view.rank() == 3, "CPU routed experts: MXFP4 ", what, " must be a rank-3 tensor");
    require_dtype(view.dtype(), DType::u8, std::string("MXFP4 ") + what);
    LATENTMOE_CHECK(view.device() == Device::cpu && view.is_contiguous(), "CPU routed experts: MXFP4 ", what,
                    " must be a contiguous host tensor");
  };
  check(experts.up, "expert up codes");
  check(experts.up_scale, "expert up scales");
  check(experts.down, "expert down codes");
  check(experts.down_scale, "expert down scales");
  if (gated) {
    check(experts.gate, "expert gate codes");
    check(experts.gate_scale, "expert gate scales");
  }
  const int64_t num_experts = experts.up.size(0), inter = experts.up.size(1);
  const int64_t group = kMxfp4GroupSize;
  const std::vector<int64_t> row_codes{num_experts, inter, width / 2}, row_scales{num_experts, inter, width / group};
  const std::vector<int64_t> down_codes{num_experts, width, inter / 2}, down_scales{num_experts, width, inter / group};
  LATENTMOE_CHECK(width % group == 0 && inter % group == 0 && experts.up.shape() == row_codes &&
                      experts.up_scale.shape() == row_scales && experts.down.shape() == down_codes &&
                      experts.down_scale.shape() == down_scales &&
                      (!gated || (experts.gate.shape() == row_codes && experts.gate_scale.shape() == row_scales)),
                  "CPU routed experts: MXFP4 shapes up ", experts.up.shape_string(), " (scales ",
                  experts.up_scale.shape_string(), "), down ", experts.down.shape_string(), " (scales ",
                  experts.down_scale.shape_string(), ") do not match input width ", width,
                  " (whole groups of 32 columns)");
}

// Matrix e of stacked MXFP4 codes [E, rows, cols/2] and scales [E, rows, cols/32].
Mxfp4Matrix stacked_mxfp4(const TensorView& codes, const TensorView& scales, int64_t index) {
  const int64_t rows = codes.size(1), packed_cols = codes.size(2), groups = scales.size(2);
  return Mxfp4Matrix{static_cast<const uint8_t*>(codes.data()) + index * rows * packed_cols,
                     static_cast<const uint8_t*>(scales.data()) + index * rows * groups,
                     rows,
                     2 * packed_cols,
                     packed_cols,
                     groups};
}

}  // namespace

void routed_experts(const ActivationParams& activation, const TensorView& z, const TensorView& topk_ids,
                    const TensorView& topk_weights, const MlpWeights& experts, const TensorView& out) {
  require_compute_dtype(z.dtype(), "routed expert input");
  require_compute_dtype(out.dtype(), "routed expert output");
  const bool mxfp4 = experts.format == ExpertWeightFormat::mxfp4;
  if (!mxfp4) {
    require_compute_dtype(experts.up.dtype(), "expert up weights");
    require_compute_dtype(experts.down.dtype(), "expert down weights");
  }
  require_dtype(topk_ids.dtype(), DType::i32, "topk_ids");
  require_dtype(topk_weights.dtype(), DType::f32, "topk_weights");
  const bool gated = is_gated(activation);
  if (gated) {
    LATENTMOE_CHECK(experts.gate.defined(), "CPU routed experts: ", to_string(activation.activation),
                    " needs expert gate weights");
    if (!mxfp4) require_compute_dtype(experts.gate.dtype(), "expert gate weights");
  }
  const Matrix inputs = as_matrix(z, "routed expert input");
  const Matrix output = as_matrix(out, "routed expert output");
  const Matrix ids = as_matrix(topk_ids, "topk_ids");
  const Matrix weights = as_matrix(topk_weights, "topk_weights");
  LATENTMOE_CHECK(experts.up.rank() == 3 && experts.down.rank() == 3 && (!gated || experts.gate.rank() == 3),
                  "CPU routed experts: expert weights must be stacked [E, rows, cols]");
  const int64_t num_experts = experts.up.size(0);
  const int64_t num_tokens = inputs.rows;
  const int64_t k = ids.cols;
  const int64_t width = inputs.cols;
  if (mxfp4) check_mxfp4_experts(experts, gated, width);
  LATENTMOE_CHECK(ids.rows == num_tokens && weights.rows == num_tokens && weights.cols == k &&
                      output.rows == num_tokens && output.cols == width,
                  "CPU routed experts: shapes of z, topk_ids, topk_weights and out do not match");

  // Bucket the (token, weight) pairs by expert, tokens ascending within each (a counting sort), so
  // each expert's weights are converted and streamed once per call.
  std::vector<int64_t> offsets(static_cast<size_t>(num_experts + 1), 0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const auto* row = static_cast<const int32_t*>(ids.row(t));
    for (int64_t j = 0; j < k; ++j) {
      LATENTMOE_CHECK(row[j] >= 0, "CPU routed experts: topk_ids[", t, ", ", j, "] = ", row[j], " is negative");
      if (row[j] < num_experts) ++offsets[row[j] + 1];
    }
  }
  for (int64_t e = 0; e < num_experts; ++e) offsets[e + 1] += offsets[e];
  std::vector<int64_t> slot_token(static_cast<size_t>(offsets[num_experts]));
  std::vector<float> slot_weight(slot_token.size());
  std::vector<int64_t> fill(offsets.begin(), offsets.end() - 1);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const auto* row = static_cast<const int32_t*>(ids.row(t));
    const auto* weight_row = static_cast<const float*>(weights.row(t));
    for (int64_t j = 0; j < k; ++j) {
      if (row[j] >= num_experts) continue;  // a zero expert: handled by add_scaled_rows
      const int64_t slot = fill[row[j]]++;
      slot_token[slot] = t;
      slot_weight[slot] = weight_row[j];
    }
  }

  std::vector<float> input_rows(static_cast<size_t>(num_tokens * width));
  load_rows(inputs, 0, num_tokens, input_rows.data());
  std::vector<double> sums(static_cast<size_t>(num_tokens * width), 0.0);
  int64_t max_rows = 0;
  for (int64_t e = 0; e < num_experts; ++e) max_rows = std::max(max_rows, offsets[e + 1] - offsets[e]);
  std::vector<float> gathered(static_cast<size_t>(max_rows * width));
  std::vector<double> expert_out(static_cast<size_t>(max_rows * width));
  MlpScratch scratch;

  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t begin = offsets[e];
    const int64_t rows = offsets[e + 1] - begin;
    if (rows == 0) continue;
    for (int64_t i = 0; i < rows; ++i) {
      std::copy_n(input_rows.data() + slot_token[begin + i] * width, width, gathered.data() + i * width);
    }
    if (mxfp4) {
      // Decoded exactly to double inside matmul_nt, block by block (no dequantised copy of the experts).
      const Mxfp4Matrix up = stacked_mxfp4(experts.up, experts.up_scale, e);
      const Mxfp4Matrix down = stacked_mxfp4(experts.down, experts.down_scale, e);
      Mxfp4Matrix gate;
      if (gated) gate = stacked_mxfp4(experts.gate, experts.gate_scale, e);
      mlp_rows(activation, z.dtype(), gathered.data(), rows, gated ? &gate : nullptr, up, down, scratch,
               expert_out.data());
    } else {
      const Matrix up = stacked_matrix(experts.up, e, "expert up weights");
      const Matrix down = stacked_matrix(experts.down, e, "expert down weights");
      Matrix gate;
      if (gated) gate = stacked_matrix(experts.gate, e, "expert gate weights");
      check_mlp_shapes(gated ? &gate : nullptr, up, down, width, width, "routed experts");
      mlp_rows(activation, z.dtype(), gathered.data(), rows, gated ? &gate : nullptr, up, down, scratch,
               expert_out.data());
    }
    for (int64_t i = 0; i < rows; ++i) {
      const double weight = slot_weight[begin + i];
      double* sum = sums.data() + slot_token[begin + i] * width;
      const double* y = expert_out.data() + i * width;
      for (int64_t c = 0; c < width; ++c) sum[c] += weight * y[c];
    }
  }
  store_rows(sums.data(), output);
}

void dense_mlp(const ActivationParams& activation, const TensorView& x, const MlpWeights& mlp, const TensorView& out) {
  require_compute_dtype(x.dtype(), "MLP input");
  require_compute_dtype(out.dtype(), "MLP output");
  require_compute_dtype(mlp.up.dtype(), "MLP up weight");
  require_compute_dtype(mlp.down.dtype(), "MLP down weight");
  LATENTMOE_CHECK(mlp.format == ExpertWeightFormat::dense,
                  "CPU dense MLP: MXFP4 weights are for the routed experts only");
  const bool gated = is_gated(activation);
  Matrix gate;
  if (gated) {
    LATENTMOE_CHECK(mlp.gate.defined(), "CPU dense MLP: ", to_string(activation.activation), " needs a gate weight");
    require_compute_dtype(mlp.gate.dtype(), "MLP gate weight");
    gate = as_matrix(mlp.gate, "MLP gate weight");
  }
  const Matrix inputs = as_matrix(x, "MLP input");
  const Matrix output = as_matrix(out, "MLP output");
  const Matrix up = as_matrix(mlp.up, "MLP up weight");
  const Matrix down = as_matrix(mlp.down, "MLP down weight");
  check_mlp_shapes(gated ? &gate : nullptr, up, down, inputs.cols, output.cols, "dense MLP");
  LATENTMOE_CHECK(output.rows == inputs.rows, "CPU dense MLP: ", inputs.rows, " input rows but ", output.rows,
                  " output rows");

  std::vector<float> input_rows(static_cast<size_t>(inputs.rows * inputs.cols));
  load_rows(inputs, 0, inputs.rows, input_rows.data());
  std::vector<double> result(static_cast<size_t>(output.rows * output.cols));
  MlpScratch scratch;
  mlp_rows(activation, x.dtype(), input_rows.data(), inputs.rows, gated ? &gate : nullptr, up, down, scratch,
           result.data());
  store_rows(result.data(), output);
}

}  // namespace latentmoe::detail::cpu

// CudaBackend's dense linears: the router logits, linear() (W_down, W_up, tier 1-2's up-projection) and
// the shared expert's MLP, each on the skinny decode kernels, the decode GEMV or cuBLASLt, as the measured
// decode dispatch (decode_dispatch.h) and the knobs choose.
#include "cuda/backend/backend_state.h"
#include "cuda/gemm/gemv.h"
#include "cuda/gemm/skinny_gemm.h"
#include "cuda/kernels/elementwise.h"

namespace latentmoe::cuda {

void CudaBackend::router_logits(const TensorView& x, const TensorView& gate, const TensorView& logits) {
  State& s = *state_;
  DeviceGuard guard(s.ordinal);
  debug_require_dtype(logits.dtype(), DType::f32, "router logits");
  debug_require_compute_dtype(x.dtype(), "router input");
  debug_require_compute_dtype(gate.dtype(), "router gate weight");
  const RowMatrix in = as_rows(x, "router input");
  const RowMatrix w = as_rows(gate, "router gate weight");
  const RowMatrix out = as_rows(logits, "router logits");
  LATENTMOE_DEBUG_CHECK(in.cols == w.cols && out.rows == in.rows && out.cols == w.rows, "CUDA router logits: x ",
                        x.shape_string(), " and gate ", gate.shape_string(), " do not give logits ",
                        logits.shape_string());
  GemmProblem problem{in.dtype, w.dtype, DType::f32, in.rows,  w.rows, in.cols, in.data,
                      in.ld,    w.data,  w.ld,       out.data, out.ld, false};
  // A 16-bit x with an f32 gate (the reference casts x to fp32): widen x into the workspace and run
  // a true-fp32 cuBLASLt GEMM; without a prepared workspace the fp32 fallback kernel runs it.
  const size_t widened_bytes = static_cast<size_t>(in.rows * in.cols) * sizeof(float);
  if (w.dtype == DType::f32 && in.dtype != DType::f32 && widened_bytes <= s.router_bytes) {
    s.mark_slot(s.router_slots, "router_logits");
    const RowMatrix widened{s.router_workspace.get(), DType::f32, in.rows, in.cols, in.cols};
    launch_convert(in, widened, s.current);
    problem.x_dtype = DType::f32;
    problem.x = widened.data;
    problem.ldx = widened.ld;
  }
  s.blas->gemm(problem, s.blas_buffer(), kBlasWorkspaceBytes, s.current);
}

void CudaBackend::linear(const TensorView& x, const TensorView& w, const TensorView& y, bool accumulate) {
  State& s = *state_;
  DeviceGuard guard(s.ordinal);
  debug_require_compute_dtype(x.dtype(), "linear input");
  debug_require_compute_dtype(w.dtype(), "linear weight");
  debug_require_compute_dtype(y.dtype(), "linear output");
  const RowMatrix in = as_rows(x, "linear input");
  const RowMatrix weight = as_rows(w, "linear weight");
  const RowMatrix out = as_rows(y, "linear output");
  LATENTMOE_DEBUG_CHECK(in.cols == weight.cols && out.rows == in.rows && out.cols == weight.rows,
                        "CUDA linear: shapes ", x.shape_string(), " x ", w.shape_string(), "^T -> ", y.shape_string(),
                        " do not match");
  if (s.skinny(in.rows) && (s.skinny_always || skinny_pays(*s.dispatch, SkinnyOp::linear, in.rows, in.cols, 0)) &&
      weight.dtype == in.dtype && out.dtype == in.dtype &&
      skinny_supported(in.dtype, in.rows, in.cols, {{in.data, in.ld}, {weight.data, weight.ld}})) {
    SkinnyWeights w{nullptr, weight.data, weight.rows, weight.cols, weight.ld, 0};
    skinny_down(in.dtype, SkinnyRouting{}, {in.data, in.ld}, in.rows, w, out.data, out.ld, accumulate, s.current,
                s.skinny_shape);
    return;
  }
  // Decode: the GEMV streams the weights from before the previous kernel ends (cuda/gemm/gemv.h).
  if (in.rows >= 1 && in.rows <= s.gemv_max_tokens && in.dtype != DType::f32 && weight.dtype == in.dtype &&
      out.dtype == in.dtype &&
      gemv_supported(in.dtype, in.rows, weight.rows, in.cols, in.data, in.ld, weight.data, weight.ld)) {
    gemv(in.dtype, in.data, in.ld, in.rows, weight.data, weight.ld, weight.rows, in.cols, out.data, out.ld, accumulate,
         s.current);
    return;
  }
  GemmProblem problem{in.dtype, weight.dtype, out.dtype, in.rows,  weight.rows, in.cols,   in.data,
                      in.ld,    weight.data,  weight.ld, out.data, out.ld,      accumulate};
  s.blas->gemm(problem, s.blas_buffer(), kBlasWorkspaceBytes, s.current);
}

void CudaBackend::rms_norm_linear(const TensorView& in, const TensorView& gamma, float eps, const TensorView& normed,
                                  const TensorView& w, const TensorView& y, bool accumulate) {
  State& s = *state_;
  DeviceGuard guard(s.ordinal);
  debug_require_compute_dtype(in.dtype(), "norm-linear input");
  debug_require_compute_dtype(w.dtype(), "norm-linear weight");
  debug_require_compute_dtype(y.dtype(), "norm-linear output");
  debug_require_compute_dtype(gamma.dtype(), "norm-linear gamma");
  debug_require_contiguous_device(gamma, "norm-linear gamma");
  const RowMatrix input = as_rows(in, "norm-linear input");
  const RowMatrix weight = as_rows(w, "norm-linear weight");
  const RowMatrix out = as_rows(y, "norm-linear output");
  LATENTMOE_DEBUG_CHECK(
      input.cols == weight.cols && out.rows == input.rows && out.cols == weight.rows && gamma.numel() == input.cols,
      "CUDA norm-linear: shapes ", in.shape_string(), ", gamma ", gamma.shape_string(), " x ", w.shape_string(),
      "^T -> ", y.shape_string(), " do not match");
  // Decode: the norm in each CTA's copy of x, inside the GEMV (cuda/gemm/gemv.h), unless the skinny kernels
  // are forced (they would take the linear).
  if (!(s.skinny_always && s.skinny(input.rows)) && input.rows >= 1 && input.rows <= s.gemv_max_tokens &&
      input.dtype != DType::f32 && weight.dtype == input.dtype && out.dtype == input.dtype &&
      normed.dtype() == input.dtype &&
      gemv_rms_norm_supported(input.dtype, input.rows, weight.rows, input.cols, input.data, input.ld, gamma.data(),
                              gamma.dtype(), weight.data, weight.ld)) {
    gemv_rms_norm(input.dtype, input.data, input.ld, input.rows, gamma.data(), gamma.dtype(), eps, weight.data,
                  weight.ld, weight.rows, input.cols, out.data, out.ld, accumulate, s.current);
    return;
  }
  Backend::rms_norm_linear(in, gamma, eps, normed, w, y, accumulate);  // rms_norm into `normed`, then linear
}

void CudaBackend::dense_mlp(const ActivationParams& activation, const TensorView& x, const MlpWeights& mlp,
                            const TensorView& out) {
  State& s = *state_;
  DeviceGuard guard(s.ordinal);
  const bool gated = activation.activation != Activation::relu2;
  debug_require_compute_dtype(x.dtype(), "MLP input");
  debug_require_compute_dtype(out.dtype(), "MLP output");
  debug_require_compute_dtype(mlp.up.dtype(), "MLP up weight");
  debug_require_compute_dtype(mlp.down.dtype(), "MLP down weight");
  const RowMatrix input = as_rows(x, "MLP input");
  const RowMatrix output = as_rows(out, "MLP output");
  const RowMatrix up = as_rows(mlp.up, "MLP up weight");
  const RowMatrix down = as_rows(mlp.down, "MLP down weight");
  RowMatrix gate;
  if (gated) {
    LATENTMOE_DEBUG_CHECK(mlp.gate.defined(), "CUDA dense MLP: ", to_string(activation.activation),
                          " needs a gate weight");
    debug_require_compute_dtype(mlp.gate.dtype(), "MLP gate weight");
    gate = as_rows(mlp.gate, "MLP gate weight");
    LATENTMOE_DEBUG_CHECK(gate.rows == up.rows && gate.cols == up.cols, "CUDA dense MLP: gate ",
                          mlp.gate.shape_string(), " does not match up ", mlp.up.shape_string());
  }
  const int64_t num_tokens = input.rows, intermediate = up.rows;
  LATENTMOE_DEBUG_CHECK(
      up.cols == input.cols && down.rows == output.cols && down.cols == intermediate && output.rows == num_tokens,
      "CUDA dense MLP: x ", x.shape_string(), ", up ", mlp.up.shape_string(), ", down ", mlp.down.shape_string(),
      " and out ", out.shape_string(), " do not match");
  if (num_tokens == 0) return;
  s.mark_slot(s.dense_slots, "dense_mlp");
  const size_t half_needed = static_cast<size_t>(num_tokens * intermediate) * dtype_size(x.dtype());
  LATENTMOE_CHECK(s.prepared && half_needed <= s.dense_half_bytes,
                  "CUDA dense MLP: the workspace prepared for max_tokens = ", s.spec.max_tokens,
                  " and Is/tp = ", s.spec.dense_intermediate, " does not fit ", num_tokens,
                  " tokens with intermediate size ", intermediate, "; call prepare() with the layer's shapes first");
  // The intermediate [T, Is] is stored in the input's dtype.
  auto* base = static_cast<char*>(s.dense_workspace.get());
  const bool one_dtype = up.dtype == x.dtype() && down.dtype == x.dtype() && out.dtype() == x.dtype() &&
                         (!gated || gate.dtype == x.dtype());
  // Decode: the gate/up GEMV (both matrices and the activation in one launch) and the down projection's
  // GEMV, each weight read once (cuda/gemm/gemv.h), alone or beside routed experts that stream at most
  // kSharedGemvBesideMaxBytes; the skinny kernels, where set_skinny_always sends the MLP to them, come first.
  const void* gate_data = gated ? gate.data : nullptr;
  if (!(s.skinny_always && s.skinny(num_tokens)) && num_tokens <= s.gemv_max_tokens &&
      (!s.overlapping || s.beside_bytes <= kSharedGemvBesideMaxBytes) && one_dtype && x.dtype() != DType::f32 &&
      (!gated || up.ld == gate.ld) &&
      gemv_gate_up_supported(x.dtype(), activation.activation, num_tokens, intermediate, input.cols, input.data,
                             input.ld, gate_data, up.data, up.ld) &&
      gemv_supported(x.dtype(), num_tokens, down.rows, intermediate, base, intermediate, down.data, down.ld)) {
    // At most shared_gemv_ctas_per_sm CTAs per SM (0: the kernel's own).
    GemvShape beside;
    beside.ctas_per_sm = s.shared_gemv_ctas_per_sm;
    gemv_gate_up(x.dtype(), activation, input.data, input.ld, num_tokens, gate_data, up.data, up.ld, intermediate,
                 input.cols, base, intermediate, s.current, beside);
    gemv(x.dtype(), base, intermediate, num_tokens, down.data, down.ld, down.rows, intermediate, output.data, output.ld,
         /*accumulate=*/false, s.current, beside);
    return;
  }
  if (s.skinny(num_tokens) &&
      (s.skinny_always || skinny_pays(*s.dispatch, SkinnyOp::dense_mlp, num_tokens, input.cols, intermediate)) &&
      one_dtype && (!gated || up.ld == gate.ld) &&
      skinny_supported(x.dtype(), num_tokens, input.cols,
                       {{input.data, input.ld}, {up.data, up.ld}, {gated ? gate.data : nullptr, gate.ld}}) &&
      skinny_supported(x.dtype(), num_tokens, intermediate, {{base, intermediate}, {down.data, down.ld}})) {
    const SkinnyWeights gate_up{gated ? gate.data : nullptr, up.data, intermediate, input.cols, up.ld, 0};
    const SkinnyWeights projection{nullptr, down.data, down.rows, intermediate, down.ld, 0};
    skinny_gate_up(x.dtype(), activation, SkinnyRouting{}, {input.data, input.ld}, num_tokens, gate_up, base,
                   intermediate, s.current, s.skinny_shape);
    skinny_down(x.dtype(), SkinnyRouting{}, {base, intermediate}, num_tokens, projection, output.data, output.ld, false,
                s.current, s.skinny_shape);
    return;
  }
  const RowMatrix gate_rows{base, x.dtype(), num_tokens, intermediate, intermediate};
  const RowMatrix up_rows{base + s.dense_half_bytes, x.dtype(), num_tokens, intermediate, intermediate};
  void* blas_buffer = s.blas_buffer();
  auto project = [&](const RowMatrix& a, const RowMatrix& w, const RowMatrix& y) {
    GemmProblem problem{a.dtype, w.dtype, y.dtype, a.rows, w.rows, a.cols, a.data,
                        a.ld,    w.data,  w.ld,    y.data, y.ld,   false};
    s.blas->gemm(problem, blas_buffer, kBlasWorkspaceBytes, s.current);
  };
  project(input, up, up_rows);
  if (gated) project(input, gate, gate_rows);
  const RowMatrix& activated = gated ? gate_rows : up_rows;
  launch_gated_activation(activation, x.dtype(), gated ? gate_rows.data : nullptr, up_rows.data, activated.data,
                          num_tokens * intermediate, s.current);
  project(activated, down, output);
}

}  // namespace latentmoe::cuda

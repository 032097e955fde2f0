// CudaBackend: workspaces, streams, the dispatch and the order of the kernels of each Backend
// operation. The kernels are in kernels/ (routing, norm, elementwise) and gemm/ (blas, gemv, skinny,
// grouped). Arguments are validated once, by the runner (src/core/backend.h): an operation checks
// only what the runner cannot know (the prepared workspace fits, kernel limits, run_overlapped's
// slot rule); its argument checks are LATENTMOE_DEBUG_CHECKs, gone under NDEBUG.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string_view>
#include <thread>

#include "core/settings.h"
#include "cuda/backend/cuda_backend.h"
#include "cuda/backend/decode_dispatch.h"
#include "cuda/comm/lamport_communicator.h"
#include "cuda/common/cuda_check.h"
#include "cuda/common/debug_check.h"
#include "cuda/common/device.h"
#include "cuda/gemm/blas.h"
#include "cuda/gemm/dense_push_gemm.h"
#include "cuda/gemm/gemv.h"
#include "cuda/gemm/grouped_gemm.h"
#include "cuda/gemm/mxfp4_decode.h"
#include "cuda/gemm/skinny_gemm.h"
#include "cuda/kernels/elementwise.h"
#include "cuda/kernels/norm.h"
#include "cuda/kernels/routing.h"

namespace latentmoe::cuda {

using ::latentmoe::detail::ActivationParams;
using ::latentmoe::detail::DeviceBuffer;
using ::latentmoe::detail::MlpWeights;
using ::latentmoe::detail::RoutingParams;

namespace {

constexpr size_t kAlignment = 256;

size_t align_up(size_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }

// LATENTMOE_MXFP4_GATE_UP_SPLIT: the MXFP4 tensor-core gate/up's warps per tile along K (1, 2 or 8) in place of
// its measured rule, for measuring the rule and for the tests that reach each split through a runner. Read
// once, when a backend is made.
int mxfp4_gate_up_split_from_environment() {
  // 0: unset, the rule (the registry, core/settings.h, accepts only 1, 2 and 8).
  using ::latentmoe::detail::Setting;
  return static_cast<int>(::latentmoe::detail::read_integer(Setting::mxfp4_gate_up_split).value_or(0));
}

// A tensor as rows x cols with a row stride: rank 1 is one row, rank 2 keeps its row stride (a
// column block), higher ranks must be contiguous and fold their leading dimensions into rows.
RowMatrix as_rows(const TensorView& view, std::string_view what) {
  LATENTMOE_DEBUG_CHECK(view.defined() && view.device() == Device::cuda, "CUDA backend: ", what,
                        " is undefined or not a device tensor");
  const int last = view.rank() - 1;
  LATENTMOE_DEBUG_CHECK(view.size(last) <= 1 || view.stride(last) == 1, "CUDA backend: ", what,
                        " needs a contiguous last dimension");
  RowMatrix matrix{view.data(), view.dtype(), 1, view.size(last), view.size(last)};
  if (view.rank() == 2) {
    matrix.rows = view.size(0);
    matrix.ld = view.size(0) <= 1 ? std::max<int64_t>(view.stride(0), view.size(1)) : view.stride(0);
  } else if (view.rank() > 2) {
    LATENTMOE_DEBUG_CHECK(view.is_contiguous(), "CUDA backend: ", what, " of shape ", view.shape_string(),
                          " must be contiguous");
    matrix.rows = view.size(last) == 0 ? 0 : view.numel() / view.size(last);
  }
  LATENTMOE_DEBUG_CHECK(matrix.rows == 0 || matrix.cols == 0 || view.data() != nullptr, "CUDA backend: ", what,
                        " has no data");
  return matrix;
}

// Debug builds only (the runner validated these): a dtype, a compute dtype, a contiguous device tensor.
void debug_require_dtype(DType dtype, DType expected, std::string_view what) {
  LATENTMOE_DEBUG_CHECK(dtype == expected, "CUDA backend: ", what, " has dtype ", dtype_name(dtype), ", expected ",
                        dtype_name(expected));
}

void debug_require_compute_dtype(DType dtype, std::string_view what) {
  LATENTMOE_DEBUG_CHECK(is_compute_dtype(dtype), "CUDA backend: ", what, " has dtype ", dtype_name(dtype),
                        "; only F32, BF16 and F16 are supported");
}

void debug_require_contiguous_device(const TensorView& view, std::string_view what) {
  LATENTMOE_DEBUG_CHECK(view.defined() && view.device() == Device::cuda && view.is_contiguous(), "CUDA backend: ", what,
                        " of shape ", view.shape_string(), " must be a contiguous device tensor");
}

enum OpSlot : unsigned { kMainSlot = 1u, kAuxSlot = 2u };

}  // namespace

struct CudaBackend::State {
  int ordinal = 0;
  DeviceInfo info;
  cudaStream_t main_stream = nullptr;  // the backend's own
  cudaStream_t bound = nullptr;        // the main stream of the operations: the caller's (bind_stream) or main_stream
  cudaStream_t aux_stream = nullptr;
  cudaStream_t current = nullptr;
  cudaEvent_t fork = nullptr;
  cudaEvent_t join = nullptr;
  std::unique_ptr<Blas> blas;
  DeviceBuffer blas_workspace[2];  // [0]: main stream, [1]: aux stream
  DeviceBuffer push_workspace[2];  // tier 0's pushing GEMM's split-K (dense_push_gemm.h), per stream
  int64_t num_allocations = 0;

  // Workspaces sized by prepare().
  WorkspaceSpec spec;
  bool prepared = false;
  DeviceBuffer routed_workspace;  // layout | act rows | y rows | grouped-GEMM workspace
  size_t layout_bytes = 0, act_bytes = 0, y_bytes = 0, grouped_bytes = 0;
  DeviceBuffer dense_workspace;  // gate rows | up rows
  size_t dense_half_bytes = 0;
  DeviceBuffer router_workspace;  // x widened to f32 [max_tokens, d]
  size_t router_bytes = 0;

  // Rows up to which linear, dense_mlp and routed_experts take the skinny kernels (0: never).
  int skinny_max_tokens = kSkinnyMaxRows;
  bool skinny(int64_t rows) const { return rows >= 1 && rows <= skinny_max_tokens; }
  // false: the measured rule (decode_dispatch.h); true: every call within skinny_max_tokens (tests).
  bool skinny_always = false;
  SkinnyShape skinny_shape;  // {}: each call chooses
  // Rows up to which linear takes the decode GEMV (0: never).
  int gemv_max_tokens = 0;  // off: slower than cuBLASLt as measured (cuda_backend.h)
  // Rows up to which tier 0's up-projection pushes into the peers from its epilogue (0: never).
  int fused_up_projection_max_tokens = kDefaultFusedUpProjectionMaxTokens;
  // The longest latent it pushes with; -1: the decode dispatch's measured rule.
  int64_t fused_up_projection_max_latent = -1;
  // The measured decode dispatch of this device's architecture (decode_dispatch.h).
  const DecodeDispatch* dispatch = nullptr;
  // The MXFP4 tensor-core gate/up's warps per tile (Mxfp4GateUpCall::warps_per_tile; 0: its measured rule).
  int mxfp4_gate_up_warps_per_tile = 0;

  // run_overlapped bookkeeping: which streams routed_experts / dense_mlp ran on in this region.
  bool overlapping = false;
  unsigned routed_slots = 0, dense_slots = 0, router_slots = 0;

  bool on_aux() const { return current == aux_stream; }
  void* blas_buffer() const { return blas_workspace[on_aux() ? 1 : 0].get(); }
  void* push_buffer() const { return push_workspace[on_aux() ? 1 : 0].get(); }

  DeviceBuffer device_alloc(size_t bytes) {
    void* pointer = nullptr;
    LATENTMOE_CUDA_CHECK(cudaMalloc(&pointer, std::max<size_t>(bytes, 1)));
    ++num_allocations;
    const int device = ordinal;
    return DeviceBuffer(pointer, bytes, [device](void* p) {
      // Never throws (it runs in destructors); errors are dropped.
      int previous = -1;
      (void)cudaGetDevice(&previous);
      if (previous != device) (void)cudaSetDevice(device);
      (void)cudaFree(p);
      if (previous >= 0 && previous != device) (void)cudaSetDevice(previous);
    });
  }

  void mark_slot(unsigned& slots, const char* op) {
    if (!overlapping) return;
    slots |= on_aux() ? kAuxSlot : kMainSlot;
    LATENTMOE_CHECK(slots != (kMainSlot | kAuxSlot), "CUDA backend: ", op,
                    " was called on both streams of one run_overlapped; its workspace is not shared");
  }
};

CudaBackend::CudaBackend(int device_ordinal) : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.ordinal = device_ordinal;
  s.info = device_info(device_ordinal);
  s.dispatch = &decode_dispatch(10 * s.info.major + s.info.minor);
  s.mxfp4_gate_up_warps_per_tile = mxfp4_gate_up_split_from_environment();
  DeviceGuard guard(device_ordinal);
  LATENTMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s.main_stream, cudaStreamNonBlocking));
  LATENTMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s.aux_stream, cudaStreamNonBlocking));
  LATENTMOE_CUDA_CHECK(cudaEventCreateWithFlags(&s.fork, cudaEventDisableTiming));
  LATENTMOE_CUDA_CHECK(cudaEventCreateWithFlags(&s.join, cudaEventDisableTiming));
  s.bound = s.current = s.main_stream;
  s.blas = std::make_unique<Blas>();
  for (auto& buffer : s.blas_workspace) buffer = s.device_alloc(kBlasWorkspaceBytes);
  for (auto& buffer : s.push_workspace) {
    buffer = s.device_alloc(dense_push_workspace_bytes());
    LATENTMOE_CUDA_CHECK(cudaMemset(buffer.get(), 0, dense_push_workspace_bytes()));  // its counters start at 0
  }
}

CudaBackend::~CudaBackend() {
  State& s = *state_;
  int previous = -1;
  (void)cudaGetDevice(&previous);
  (void)cudaSetDevice(s.ordinal);
  // Work still queued may read the workspaces: finish it before they are freed.
  if (s.main_stream != nullptr) (void)cudaStreamSynchronize(s.main_stream);
  if (s.aux_stream != nullptr) (void)cudaStreamSynchronize(s.aux_stream);
  s.routed_workspace = {};
  s.dense_workspace = {};
  s.router_workspace = {};
  for (auto& buffer : s.blas_workspace) buffer = {};
  for (auto& buffer : s.push_workspace) buffer = {};
  s.blas.reset();
  if (s.join != nullptr) (void)cudaEventDestroy(s.join);
  if (s.fork != nullptr) (void)cudaEventDestroy(s.fork);
  if (s.aux_stream != nullptr) (void)cudaStreamDestroy(s.aux_stream);
  if (s.main_stream != nullptr) (void)cudaStreamDestroy(s.main_stream);
  if (previous >= 0 && previous != s.ordinal) (void)cudaSetDevice(previous);
}

int CudaBackend::device_ordinal() const { return state_->ordinal; }
int64_t CudaBackend::num_device_allocations() const { return state_->num_allocations; }
StreamHandle CudaBackend::stream() const { return state_->current; }

void CudaBackend::synchronize() {
  State& s = *state_;
  DeviceGuard guard(s.ordinal);
  LATENTMOE_CUDA_CHECK(cudaStreamSynchronize(s.main_stream));
  LATENTMOE_CUDA_CHECK(cudaStreamSynchronize(s.aux_stream));
}

// Polls instead of blocking in the driver, so that the wait can end: a stream whose collective never
// completes would hold cudaStreamSynchronize for ever.
bool CudaBackend::synchronize_for(std::chrono::milliseconds limit) {
  State& s = *state_;
  DeviceGuard guard(s.ordinal);
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (cudaStream_t stream : {s.main_stream, s.aux_stream}) {
    for (int polls = 0;; ++polls) {
      const cudaError_t status = cudaStreamQuery(stream);
      if (status == cudaSuccess) break;
      if (status != cudaErrorNotReady) LATENTMOE_CUDA_CHECK(status);
      if (std::chrono::steady_clock::now() >= deadline) return false;
      // Spin briefly (a forward ends in microseconds), then give the core away.
      if (polls > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  return true;
}

void CudaBackend::bind_stream(StreamHandle stream) {
  State& s = *state_;
  LATENTMOE_CHECK(!s.overlapping, "CUDA backend: bind_stream inside run_overlapped");
  s.bound = s.current = stream != nullptr ? static_cast<cudaStream_t>(stream) : s.main_stream;
}
const WorkspaceSpec& CudaBackend::workspace_spec() const { return state_->spec; }

void CudaBackend::set_skinny_max_tokens(int tokens) {
  LATENTMOE_CHECK(tokens >= 0 && tokens <= kSkinnyMaxRows, "CUDA backend: skinny_max_tokens ", tokens,
                  " is outside 0..", kSkinnyMaxRows);
  state_->skinny_max_tokens = tokens;
}
int CudaBackend::skinny_max_tokens() const { return state_->skinny_max_tokens; }
void CudaBackend::set_skinny_shape(const SkinnyShape& shape) { state_->skinny_shape = shape; }
void CudaBackend::set_skinny_always(bool always) { state_->skinny_always = always; }
void CudaBackend::set_gemv_max_tokens(int tokens) {
  LATENTMOE_CHECK(tokens >= 0 && tokens <= kGemvMaxRows, "CUDA backend: gemv_max_tokens ", tokens, " is outside 0..",
                  kGemvMaxRows);
  state_->gemv_max_tokens = tokens;
}
int CudaBackend::gemv_max_tokens() const { return state_->gemv_max_tokens; }

void CudaBackend::set_fused_up_projection_max_tokens(int tokens) {
  LATENTMOE_CHECK(tokens >= 0 && tokens <= kDensePushMaxRows, "CUDA backend: fused_up_projection_max_tokens ", tokens,
                  " is outside 0..", kDensePushMaxRows);
  state_->fused_up_projection_max_tokens = tokens;
}
void CudaBackend::set_fused_up_projection_max_latent(int64_t latent) {
  LATENTMOE_CHECK(latent >= -1, "CUDA backend: fused_up_projection_max_latent ", latent, " is below -1");
  state_->fused_up_projection_max_latent = latent;
}

DeviceBuffer CudaBackend::allocate(size_t bytes) {
  State& s = *state_;
  DeviceGuard guard(s.ordinal);
  DeviceBuffer buffer = s.device_alloc(bytes);
  // Zeroed, as the CPU backend's memory is (stream-ordered before any later use).
  if (bytes > 0) LATENTMOE_CUDA_CHECK(cudaMemsetAsync(buffer.get(), 0, bytes, s.main_stream));
  return buffer;
}

void CudaBackend::copy(const TensorView& src, const TensorView& dst) {
  State& s = *state_;
  DeviceGuard guard(s.ordinal);
  LATENTMOE_CHECK(src.defined() && dst.defined(), "CUDA copy: undefined tensor");
  LATENTMOE_CHECK(src.shape() == dst.shape(), "CUDA copy: shape ", src.shape_string(), " vs ", dst.shape_string());
  LATENTMOE_CHECK(src.dtype() == dst.dtype(), "CUDA copy: dtype ", dtype_name(src.dtype()), " vs ",
                  dtype_name(dst.dtype()));
  const size_t element = dtype_size(src.dtype());
  const int64_t count = src.numel();
  if (count == 0) return;
  LATENTMOE_CHECK(src.data() != nullptr && dst.data() != nullptr, "CUDA copy: tensor without data");
  const bool touches_host = src.device() == Device::cpu || dst.device() == Device::cpu;
  // Into pageable host memory: wait for the stream first, so that the driver's staging of the copy is
  // never held while the stream waits (for a simulated peer's collective, whose rank may need that
  // staging for its own input copy: a deadlock until the collective's timeout).
  if (dst.device() == Device::cpu) LATENTMOE_CUDA_CHECK(cudaStreamSynchronize(s.current));
  if (src.is_contiguous() && dst.is_contiguous()) {
    LATENTMOE_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), count * element, cudaMemcpyDefault, s.current));
  } else {
    LATENTMOE_CHECK(src.rank() == 2 && src.stride(1) == 1 && dst.stride(1) == 1, "CUDA copy: tensors of shape ",
                    src.shape_string(), " need contiguous rows (a rank-2 view with row strides)");
    const int64_t rows = src.size(0), cols = src.size(1);
    const size_t src_pitch = static_cast<size_t>(rows > 1 ? src.stride(0) : cols) * element;
    const size_t dst_pitch = static_cast<size_t>(rows > 1 ? dst.stride(0) : cols) * element;
    LATENTMOE_CUDA_CHECK(cudaMemcpy2DAsync(dst.data(), dst_pitch, src.data(), src_pitch, cols * element, rows,
                                           cudaMemcpyDefault, s.current));
  }
  // Host memory may be reused or read as soon as copy() returns.
  if (touches_host) LATENTMOE_CUDA_CHECK(cudaStreamSynchronize(s.current));
}

void CudaBackend::check_layer(const LayerConfig& config, DType dtype, int tp_size) {
  // MXFP4 experts run on the decode kernels (gemm/mxfp4_decode.h) up to 8 tokens and, from 64 tokens with
  // bf16/f16 activations, on the grouped tensor-core GEMMs (gemm/grouped_gemm.h), in between and for f32
  // in batches of 8 on the decode kernels; decoded in registers or shared memory, never through a
  // dequantised copy (four times the experts' memory). So no layer is refused for them here.
  LATENTMOE_CHECK(tp_size >= 1, "CUDA backend: tp_size ", tp_size, " must be positive");
  LATENTMOE_CHECK(is_compute_dtype(dtype), "CUDA backend: ", dtype_name(dtype), " is not a compute dtype");
  // The kernels' own limits, reported when the runner is built rather than at the first forward.
  LATENTMOE_CHECK(config.top_k <= kMaxRouteTopK, "the CUDA backend routes at most ", kMaxRouteTopK,
                  " experts per token; num_experts_per_tok is ", config.top_k);
  LATENTMOE_CHECK(config.num_experts <= kMaxLayoutExperts, "the CUDA backend takes at most ", kMaxLayoutExperts,
                  " routed experts; n_routed_experts is ", config.num_experts);
}

void CudaBackend::prepare(const WorkspaceSpec& spec) {
  State& s = *state_;
  DeviceGuard guard(s.ordinal);
  LATENTMOE_CHECK(spec.max_tokens >= 0 && spec.num_experts >= 0 && spec.top_k >= 0 && spec.latent_size >= 0 &&
                      spec.expert_intermediate >= 0 && spec.dense_intermediate >= 0 && spec.element_size >= 1,
                  "CUDA prepare: negative workspace shape");
  // Release the old workspaces first (cudaFree waits for the work that may still use them).
  s.routed_workspace = {};
  s.dense_workspace = {};
  s.router_workspace = {};
  s.prepared = false;
  s.spec = spec;
  s.layout_bytes = s.act_bytes = s.y_bytes = s.grouped_bytes = s.dense_half_bytes = s.router_bytes = 0;

  if (spec.num_experts > 0 && spec.top_k > 0 && spec.max_tokens > 0) {
    const int64_t num_pairs = spec.max_tokens * spec.top_k;
    const int top_k = static_cast<int>(spec.top_k);
    const int num_experts = static_cast<int>(spec.num_experts);
    s.layout_bytes = align_up(moe_layout_workspace_bytes(spec.max_tokens, top_k, num_experts));
    s.act_bytes = align_up(static_cast<size_t>(num_pairs * spec.expert_intermediate) * spec.element_size);
    s.y_bytes = align_up(static_cast<size_t>(num_pairs * spec.latent_size) * spec.element_size);
    s.grouped_bytes = align_up(grouped_gemm_workspace_bytes(spec.max_tokens, top_k, num_experts));
    s.routed_workspace = s.device_alloc(s.layout_bytes + s.act_bytes + s.y_bytes + s.grouped_bytes);
    // The grouped GEMMs' split-K counters start at zero (each launch leaves them so).
    LATENTMOE_CUDA_CHECK(cudaMemset(
        static_cast<char*>(s.routed_workspace.get()) + s.layout_bytes + s.act_bytes + s.y_bytes, 0, s.grouped_bytes));
  }
  if (spec.dense_intermediate > 0 && spec.max_tokens > 0) {
    s.dense_half_bytes = align_up(static_cast<size_t>(spec.max_tokens * spec.dense_intermediate) * spec.element_size);
    s.dense_workspace = s.device_alloc(2 * s.dense_half_bytes);
  }
  if (spec.hidden_size > 0 && spec.max_tokens > 0) {
    s.router_bytes = align_up(static_cast<size_t>(spec.max_tokens * spec.hidden_size) * sizeof(float));
    s.router_workspace = s.device_alloc(s.router_bytes);
  }
  s.prepared = true;
}

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

struct CudaBackend::RoutedBuffers {
  void* layout = nullptr;
  void* act_rows = nullptr;
  void* y_rows = nullptr;
  void* grouped = nullptr;
};

namespace {

// The grouped GEMMs' view of one rank's stacked experts; MXFP4: the codes, with their scales.
ExpertGemmWeights expert_gemm_weights(const MlpWeights& experts, bool gated, int64_t intermediate, int64_t latent) {
  ExpertGemmWeights w;
  w.gate = gated ? experts.gate.data() : nullptr;
  w.up = experts.up.data();
  w.down = experts.down.data();
  if (experts.format == ExpertWeightFormat::mxfp4) {
    w.gate_scales = gated ? experts.gate_scale.data_as<uint8_t>() : nullptr;
    w.up_scales = experts.up_scale.data_as<uint8_t>();
    w.down_scales = experts.down_scale.data_as<uint8_t>();
  }
  w.intermediate = intermediate;
  w.latent = latent;
  w.num_experts = static_cast<int>(experts.up.size(0));
  return w;
}

}  // namespace

void CudaBackend::routed_experts(const ActivationParams& activation, const TensorView& z, const TensorView& topk_ids,
                                 const TensorView& topk_weights, const MlpWeights& experts, const TensorView& out) {
  State& s = *state_;
  DeviceGuard guard(s.ordinal);
  const bool gated = activation.activation != Activation::relu2;
  if (experts.format == ExpertWeightFormat::mxfp4) {
    // gate/up: codes [E, I_r, l/2] and scales [E, I_r, l/32]; down: [E, l, I_r/2] and [E, l, I_r/32].
    const int64_t num_tokens = z.size(0), k = topk_ids.size(1), num_experts = experts.up.size(0);
    const int64_t intermediate = experts.up.size(1), latent = 2 * experts.up.size(2);
    if (num_tokens == 0) return;
    s.mark_slot(s.routed_slots, "routed_experts");
    // From kMxfp4GroupedMinTokens on: the grouped tensor-core GEMMs, which decode the codes into each
    // shared-memory stage (gemm/grouped_gemm_mma.cuh): each touched expert is read once per tile of its
    // rows. Below, the decode kernels in batches of 8 measured faster (H200, docs/MXFP4.md: at 16 tokens
    // 1.2-1.8x, at 64 tokens kimi-k3 5-14% faster and nemotron3-super 1.9x slower, at 256 2.6x slower).
    constexpr int64_t kMxfp4GroupedMinTokens = 64;
    if (num_tokens >= kMxfp4GroupedMinTokens && grouped_mxfp4_supported(z.dtype(), intermediate, latent)) {
      grouped_routed_experts(activation, z, topk_ids, topk_weights,
                             expert_gemm_weights(experts, gated, intermediate, latent), out);
      return;
    }
    // The activations of at most kMxfp4DecodeMaxRows tokens at a time (the workspace holds max_tokens').
    const int64_t chunk_tokens = std::min<int64_t>(num_tokens, kMxfp4DecodeMaxRows);
    const size_t act_needed = static_cast<size_t>(chunk_tokens * k * intermediate) * dtype_size(z.dtype());
    LATENTMOE_CHECK(s.prepared && act_needed <= s.act_bytes, "CUDA routed experts: the workspace prepared for ",
                    "max_tokens = ", s.spec.max_tokens, " does not hold ", chunk_tokens, " tokens' activations");
    void* act = static_cast<char*>(s.routed_workspace.get()) + s.layout_bytes;
    auto matrices = [](const TensorView& packed, const TensorView& scales, int64_t rows, int64_t cols) {
      return Mxfp4Matrices{packed.data_as<uint8_t>(), scales.data_as<uint8_t>(), rows, cols};
    };
    Mxfp4GateUpCall gate_up;
    gate_up.dtype = z.dtype();
    gate_up.activation = activation;
    gate_up.top_k = static_cast<int>(k);
    gate_up.num_experts = static_cast<int>(num_experts);
    gate_up.ld_z = z.stride(0);
    gate_up.up = matrices(experts.up, experts.up_scale, intermediate, latent);
    if (gated) gate_up.gate = matrices(experts.gate, experts.gate_scale, intermediate, latent);
    gate_up.act = act;
    gate_up.warps_per_tile = s.mxfp4_gate_up_warps_per_tile;
    Mxfp4DownCall down;
    down.dtype = z.dtype();
    down.top_k = gate_up.top_k;
    down.num_experts = gate_up.num_experts;
    down.act = act;
    down.down = matrices(experts.down, experts.down_scale, latent, intermediate);
    down.ld_out = out.stride(0);
    // The decode kernels take up to kMxfp4DecodeMaxRows tokens; more, where the grouped kernels do not
    // take them (f32 activations), run through them in consecutive batches of that many, each batch
    // reading its touched experts again.
    for (int64_t first = 0; first < num_tokens; first += kMxfp4DecodeMaxRows) {
      const int tokens = static_cast<int>(std::min<int64_t>(kMxfp4DecodeMaxRows, num_tokens - first));
      gate_up.tokens = down.tokens = tokens;
      gate_up.ids = down.ids = topk_ids.data_as<int32_t>() + first * k;
      gate_up.z = static_cast<const char*>(z.data()) + first * z.stride(0) * dtype_size(z.dtype());
      down.weights = topk_weights.data_as<float>() + first * k;
      down.out = static_cast<char*>(out.data()) + first * out.stride(0) * dtype_size(out.dtype());
      mxfp4_routed_gate_up(gate_up, s.current);
      mxfp4_routed_down(down, s.current);
    }
    return;
  }
  debug_require_compute_dtype(z.dtype(), "routed expert input");
  debug_require_compute_dtype(out.dtype(), "routed expert output");
  debug_require_dtype(topk_ids.dtype(), DType::i32, "topk_ids");
  debug_require_dtype(topk_weights.dtype(), DType::f32, "topk_weights");
  debug_require_contiguous_device(z, "routed expert input");
  debug_require_contiguous_device(topk_ids, "topk_ids");
  debug_require_contiguous_device(topk_weights, "topk_weights");
  debug_require_contiguous_device(experts.up, "expert up weights");
  debug_require_contiguous_device(experts.down, "expert down weights");
  if (gated) {
    LATENTMOE_DEBUG_CHECK(experts.gate.defined(), "CUDA routed experts: ", to_string(activation.activation),
                          " needs expert gate weights");
    debug_require_contiguous_device(experts.gate, "expert gate weights");
  }
  LATENTMOE_DEBUG_CHECK(experts.up.rank() == 3 && experts.down.rank() == 3 && (!gated || experts.gate.rank() == 3),
                        "CUDA routed experts: expert weights must be stacked [E, rows, cols]");
  LATENTMOE_DEBUG_CHECK(experts.up.dtype() == z.dtype() && experts.down.dtype() == z.dtype() &&
                            (!gated || experts.gate.dtype() == z.dtype()),
                        "CUDA routed experts: the expert weights' dtype is not the input's, ", dtype_name(z.dtype()));
  const RowMatrix input = as_rows(z, "routed expert input");
  const RowMatrix output = as_rows(out, "routed expert output");
  const int64_t num_experts = experts.up.size(0);
  const int64_t intermediate = experts.up.size(1);
  const int64_t latent = experts.up.size(2);
  const int64_t num_tokens = input.rows;
  const int64_t k = topk_ids.rank() == 2 ? topk_ids.size(1) : topk_ids.numel();
  LATENTMOE_DEBUG_CHECK(input.cols == latent && output.rows == num_tokens && output.cols == latent &&
                            experts.down.size(0) == num_experts && experts.down.size(1) == latent &&
                            experts.down.size(2) == intermediate &&
                            (!gated || experts.gate.shape() == experts.up.shape()),
                        "CUDA routed experts: z ", z.shape_string(), ", up ", experts.up.shape_string(), ", down ",
                        experts.down.shape_string(), " and out ", out.shape_string(), " do not match");
  LATENTMOE_DEBUG_CHECK(topk_ids.numel() == num_tokens * k && topk_weights.numel() == num_tokens * k,
                        "CUDA routed experts: topk_ids ", topk_ids.shape_string(), " and topk_weights ",
                        topk_weights.shape_string(), " do not match ", num_tokens, " tokens");
  if (num_tokens == 0) return;
  LATENTMOE_CHECK(k >= 1 && k <= kMaxRouteTopK, "CUDA routed experts: top_k ", k, " is outside 1..", kMaxRouteTopK);
  s.mark_slot(s.routed_slots, "routed_experts");

  const RoutedBuffers buffers = routed_buffers(z.dtype(), num_tokens, k, num_experts, intermediate, latent);
  void* act_rows = buffers.act_rows;

  // Decode: two skinny kernels do the whole step, the distinct experts found from topk_ids and the
  // combine folded into the down projection (act rows indexed by pair).
  const bool same_dtype = out.dtype() == z.dtype();
  if (s.skinny(num_tokens) &&
      (s.skinny_always || skinny_pays(*s.dispatch, SkinnyOp::routed_experts, num_tokens, latent, intermediate)) &&
      same_dtype && k <= kSkinnyMaxTopK &&
      skinny_supported(
          z.dtype(), num_tokens, latent,
          {{z.data(), latent}, {experts.up.data(), latent}, {gated ? experts.gate.data() : nullptr, latent}}) &&
      skinny_supported(z.dtype(), num_tokens, intermediate,
                       {{act_rows, intermediate}, {experts.down.data(), intermediate}})) {
    const SkinnyRouting routing{topk_ids.data_as<const int32_t>(), topk_weights.data_as<const float>(),
                                static_cast<int>(k), static_cast<int>(num_experts)};
    const SkinnyWeights gate_up{
        gated ? experts.gate.data() : nullptr, experts.up.data(), intermediate, latent, latent, intermediate * latent};
    const SkinnyWeights down{nullptr, experts.down.data(), latent, intermediate, intermediate, latent * intermediate};
    skinny_gate_up(z.dtype(), activation, routing, {z.data(), latent}, num_tokens, gate_up, act_rows, intermediate,
                   s.current, s.skinny_shape);
    skinny_down(z.dtype(), routing, {act_rows, intermediate}, num_tokens, down, output.data, output.ld, false,
                s.current, s.skinny_shape);
    return;
  }
  grouped_routed_experts(activation, z, topk_ids, topk_weights,
                         expert_gemm_weights(experts, gated, intermediate, latent), out);
}

CudaBackend::RoutedBuffers CudaBackend::routed_buffers(DType dtype, int64_t num_tokens, int64_t k, int64_t num_experts,
                                                       int64_t intermediate, int64_t latent) {
  State& s = *state_;
  // The workspace prepare() sized must hold this call's layout and rows.
  const size_t element = dtype_size(dtype);
  const int64_t num_pairs = num_tokens * k;
  const size_t layout_needed =
      moe_layout_workspace_bytes(num_tokens, static_cast<int>(k), static_cast<int>(num_experts));
  const size_t act_needed = static_cast<size_t>(num_pairs * intermediate) * element;
  const size_t y_needed = static_cast<size_t>(num_pairs * latent) * element;
  const size_t grouped_needed =
      grouped_gemm_workspace_bytes(num_tokens, static_cast<int>(k), static_cast<int>(num_experts));
  LATENTMOE_CHECK(s.prepared && layout_needed <= s.layout_bytes && act_needed <= s.act_bytes && y_needed <= s.y_bytes &&
                      grouped_needed <= s.grouped_bytes,
                  "CUDA routed experts: the workspace prepared for max_tokens = ", s.spec.max_tokens,
                  " (E = ", s.spec.num_experts, ", k = ", s.spec.top_k, ", l = ", s.spec.latent_size,
                  ", I_r = ", s.spec.expert_intermediate, ") does not fit ", num_tokens,
                  " tokens with E = ", num_experts, ", k = ", k, ", l = ", latent, ", I_r = ", intermediate,
                  "; call prepare() with the layer's shapes before forward");
  auto* base = static_cast<char*>(s.routed_workspace.get());
  return RoutedBuffers{base, base + s.layout_bytes, base + s.layout_bytes + s.act_bytes,
                       base + s.layout_bytes + s.act_bytes + s.y_bytes};
}

void CudaBackend::grouped_routed_experts(const ActivationParams& activation, const TensorView& z,
                                         const TensorView& topk_ids, const TensorView& topk_weights,
                                         const ExpertGemmWeights& weights, const TensorView& out) {
  State& s = *state_;
  const int64_t num_tokens = z.size(0), k = topk_ids.size(1);
  const RoutedBuffers buffers =
      routed_buffers(z.dtype(), num_tokens, k, weights.num_experts, weights.intermediate, weights.latent);
  const MoeLayout layout = build_moe_layout(topk_ids.data_as<const int32_t>(), num_tokens, static_cast<int>(k),
                                            weights.num_experts, buffers.layout, s.layout_bytes, s.current);
  grouped_gate_up(z.dtype(), activation, z.data(), layout, weights, buffers.act_rows, buffers.grouped, s.grouped_bytes,
                  s.current);
  grouped_down(z.dtype(), buffers.act_rows, layout, weights, buffers.y_rows, buffers.grouped, s.grouped_bytes,
               s.current);
  launch_combine(z.dtype(), buffers.y_rows, layout.pair_rows, topk_weights.data_as<const float>(), static_cast<int>(k),
                 as_rows(out, "routed expert output"), s.current);
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

namespace {

// The GPU group behind `comm` when its one-shot Lamport kernels run and can carry `dtype`, else nullptr.
LamportCommunicator* lamport_group(Communicator& comm, DType dtype) {
  auto* group = dynamic_cast<LamportCommunicator*>(&comm);
  return group != nullptr && group->one_shot() && group->lamport_dtype() == dtype ? group : nullptr;
}

// Whether `call` fits the group's one-shot capacity; a group with another path (NCCL above the capacity)
// composes the step from its collectives otherwise. A group without one launches anyway and fails with
// the capacity Error (tier support keeps the runner inside the capacity).
bool one_shot_fits(const LamportCommunicator& group, const LamportCall& call) {
  const LamportPeers& peers = group.lamport_peers();
  return group.fallback_elements() == 0 || lamport_message_bytes(call, peers.size) <= peers.capacity_bytes;
}

LamportCall all_reduce_call(const TensorView& partial, const TensorView& gamma, float eps, const TensorView& out) {
  LamportCall call;
  call.op = LamportOp::all_reduce;
  call.dtype = partial.dtype();
  call.in = partial.data();
  call.ld_in = partial.stride(0);
  call.out = out.data();
  call.ld_out = out.stride(0);
  call.rows = partial.size(0);
  call.cols = partial.size(1);
  if (gamma.defined()) {
    call.gamma = gamma.data();
    call.gamma_dtype = gamma.dtype();
  }
  call.eps = eps;
  return call;
}

}  // namespace

void CudaBackend::all_reduce_rms_norm(Communicator& comm, const TensorView& partial, const TensorView& gamma, float eps,
                                      const TensorView& out) {
  LamportCommunicator* group = lamport_group(comm, partial.dtype());
  if (group == nullptr || !gamma.defined() || out.dtype() != partial.dtype()) {
    Backend::all_reduce_rms_norm(comm, partial, gamma, eps, out);
    return;
  }
  const LamportCall call = all_reduce_call(partial, gamma, eps, out);
  if (!one_shot_fits(*group, call)) {
    Backend::all_reduce_rms_norm(comm, partial, gamma, eps, out);
    return;
  }
  State& s = *state_;
  DeviceGuard guard(s.ordinal);
  group->launch(call, s.current);
}

void CudaBackend::tail_fusion_collective(Communicator& comm, const TensorView& latent_partial,
                                         const TensorView& shared_partial, const TensorView& gamma, float eps,
                                         const TensorView& latent_out, const TensorView& shared_shard_out) {
  LamportCommunicator* group = lamport_group(comm, latent_partial.dtype());
  if (group == nullptr || latent_out.dtype() != latent_partial.dtype() ||
      shared_partial.dtype() != latent_partial.dtype() || shared_shard_out.dtype() != latent_partial.dtype()) {
    Backend::tail_fusion_collective(comm, latent_partial, shared_partial, gamma, eps, latent_out, shared_shard_out);
    return;
  }
  LamportCall call = all_reduce_call(latent_partial, gamma, eps, latent_out);
  call.scatter_in = shared_partial.data();
  call.ld_scatter_in = shared_partial.stride(0);
  call.scatter_out = shared_shard_out.data();
  call.ld_scatter_out = shared_shard_out.stride(0);
  call.scatter_cols = shared_partial.size(1);
  if (!one_shot_fits(*group, call)) {
    Backend::tail_fusion_collective(comm, latent_partial, shared_partial, gamma, eps, latent_out, shared_shard_out);
    return;
  }
  State& s = *state_;
  DeviceGuard guard(s.ordinal);
  group->launch(call, s.current);
}

void CudaBackend::up_projection_all_gather(Communicator& comm, const TensorView& x, const TensorView& w_shard,
                                           const TensorView& shard, const TensorView& out) {
  State& s = *state_;
  LamportCommunicator* group = lamport_group(comm, out.dtype());
  const int64_t rows = x.size(0), latent = x.size(1);
  const bool pushable = group != nullptr && rows >= 1 && rows <= s.fused_up_projection_max_tokens &&
                        (s.fused_up_projection_max_latent < 0 || latent <= s.fused_up_projection_max_latent) &&
                        x.dtype() == out.dtype() && w_shard.dtype() == out.dtype() && shard.dtype() == out.dtype() &&
                        x.stride(1) == 1 && w_shard.stride(1) == 1 && shard.stride(1) == 1 && out.stride(1) == 1;
  // Which GEMM pushes: the skinny kernel where the decode dispatch finds it pays, else the tensor-core
  // kernel (dense_push_gemm.h) where the dispatch finds that one pays; a latent bound, when set, replaces
  // both rules (decode_dispatch.h).
  const bool bound_set = s.fused_up_projection_max_latent >= 0;
  const bool skinny =
      pushable && s.skinny(rows) && (bound_set || skinny_pays(*s.dispatch, SkinnyOp::tier0_push, rows, latent, 0)) &&
      skinny_supported(x.dtype(), rows, latent, {{x.data(), x.stride(0)}, {w_shard.data(), w_shard.stride(0)}});
  const DensePushProblem dense{out.dtype(),     x.data(), rows,         w_shard.data(),
                               w_shard.size(0), latent,   shard.data(), shard.stride(0)};
  const bool tensor_core = pushable && !skinny &&
                           (bound_set || latent <= s.dispatch->tier0_tensor_core_push_max_latent) &&
                           x.stride(0) == latent && w_shard.stride(0) == latent && dense_push_supported(dense);
  if (!skinny && !tensor_core) {
    Backend::up_projection_all_gather(comm, x, w_shard, shard, out);
    return;
  }
  // The receiving half, checked before the GEMM pushes anything.
  LamportCall gather;
  gather.op = LamportOp::all_gather;
  gather.dtype = out.dtype();
  gather.presend = true;
  gather.out = out.data();
  gather.ld_out = out.stride(0);
  gather.rows = rows;
  gather.cols = out.size(1);
  const LamportPeers& peers = group->lamport_peers();
  if (!one_shot_fits(*group, gather)) {
    Backend::up_projection_all_gather(comm, x, w_shard, shard, out);
    return;
  }
  check_lamport_call(peers, gather);
  LATENTMOE_CHECK(
      shard.size(0) == rows && shard.size(1) * peers.size == out.size(1) && w_shard.size(0) == shard.size(1),
      "CUDA tier 0: up-projection shard ", w_shard.shape_string(), ", block ", shard.shape_string(), " and output ",
      out.shape_string(), " do not fit ", peers.size, " ranks");
  DeviceGuard guard(s.ordinal);
  // The GEMM's push is the all-gather's send; keep the two adjacent on the stream, each rank in step.
  if (skinny) {
    const SkinnyWeights weights{nullptr, w_shard.data(), w_shard.size(0), latent, w_shard.stride(0), 0};
    skinny_down(x.dtype(), SkinnyRouting{}, {x.data(), x.stride(0)}, rows, weights, shard.data(), shard.stride(0),
                /*accumulate=*/true, s.current, s.skinny_shape, &peers);
  } else {
    dense_push_gemm(dense, peers, s.push_buffer(), dense_push_workspace_bytes(), s.current);
  }
  group->launch(gather, s.current);
}

void CudaBackend::run_overlapped(const std::function<void()>& main, const std::function<void()>& aux) {
  State& s = *state_;
  LATENTMOE_CHECK(!s.overlapping, "CUDA backend: run_overlapped cannot be nested");
  {
    DeviceGuard guard(s.ordinal);
    LATENTMOE_CUDA_CHECK(cudaEventRecord(s.fork, s.bound));
    LATENTMOE_CUDA_CHECK(cudaStreamWaitEvent(s.aux_stream, s.fork, 0));
  }
  s.overlapping = true;
  s.routed_slots = s.dense_slots = s.router_slots = 0;
  // The join is enqueued even when a function throws, so the aux stream never dangles (an open
  // fork would also invalidate a graph capture in progress).
  auto finish = [&s] {
    s.current = s.bound;
    s.overlapping = false;
    DeviceGuard guard(s.ordinal);
    LATENTMOE_CUDA_CHECK(cudaEventRecord(s.join, s.aux_stream));
    LATENTMOE_CUDA_CHECK(cudaStreamWaitEvent(s.bound, s.join, 0));
  };
  try {
    s.current = s.bound;
    main();
    s.current = s.aux_stream;
    aux();
  } catch (...) {
    try {
      finish();
    } catch (...) {
      // The first error is the one to report.
    }
    throw;
  }
  finish();
}

}  // namespace latentmoe::cuda

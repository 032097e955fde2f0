// CudaBackend's life cycle and streams: construction (streams, events, cuBLASLt, the per-stream
// workspaces), destruction, binding the caller's stream, synchronisation, the decode knobs, allocation
// and copies, what layers the kernels can run, and run_overlapped's fork and join. The operations live
// beside it, one file a job: workspaces.cpp (prepare), linears.cpp, row_ops.cpp, routed_experts.cpp,
// fused_tails.cpp, tier_support.cpp. Arguments are validated once, by the runner (src/core/backend.h): an
// operation checks only what the runner cannot know (the prepared workspace fits, kernel limits,
// run_overlapped's slot rule); its argument checks are LATENTMOE_DEBUG_CHECKs, gone under NDEBUG.
#include <chrono>
#include <thread>

#include "core/settings.h"
#include "cuda/backend/backend_state.h"
#include "cuda/gemm/dense_push_gemm.h"
#include "cuda/gemm/grouped_gemm.h"
#include "cuda/kernels/moe_layout.h"
#include "cuda/kernels/mxfp4_order.h"
#include "cuda/kernels/routing.h"

namespace latentmoe::cuda {

namespace {

// LATENTMOE_MXFP4_GATE_UP_SPLIT: the MXFP4 tensor-core gate/up's warps per tile along K (1, 2 or 8) in place of
// its measured rule, for measuring the rule and for the tests that reach each split through a runner. Read
// once, when a backend is made.
int mxfp4_gate_up_split_from_environment() {
  // 0: unset, the rule (the registry, core/settings.h, accepts only 1, 2 and 8).
  using ::latentmoe::detail::Setting;
  return static_cast<int>(::latentmoe::detail::read_integer(Setting::mxfp4_gate_up_split).value_or(0));
}

// LATENTMOE_MXFP4_DECODE_MAX_TOKENS: up to how many tokens the MXFP4 decode kernels run (above 8 in batches
// of 8); read once, when a backend is made. Unset: kMxfp4DecodeTokens.
int mxfp4_decode_max_tokens_from_environment() {
  using ::latentmoe::detail::Setting;
  return static_cast<int>(
      ::latentmoe::detail::read_integer(Setting::mxfp4_decode_max_tokens).value_or(kMxfp4DecodeTokens));
}

// LATENTMOE_MXFP4_PAIRS_MAX_TOKENS: up to how many tokens the MXFP4 pair kernels run; read once, when a backend
// is made. Unset: kMxfp4PairsTokens.
int mxfp4_pairs_max_tokens_from_environment() {
  using ::latentmoe::detail::Setting;
  return static_cast<int>(
      ::latentmoe::detail::read_integer(Setting::mxfp4_pairs_max_tokens).value_or(kMxfp4PairsTokens));
}

}  // namespace

CudaBackend::CudaBackend(int device_ordinal) : state_(std::make_unique<State>()) {
  State& s = *state_;
  s.ordinal = device_ordinal;
  s.info = device_info(device_ordinal);
  s.dispatch = &decode_dispatch(10 * s.info.major + s.info.minor);
  s.mxfp4_gate_up_warps_per_tile = mxfp4_gate_up_split_from_environment();
  s.mxfp4_decode_max_tokens = mxfp4_decode_max_tokens_from_environment();
  s.mxfp4_pairs_max_tokens = mxfp4_pairs_max_tokens_from_environment();
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
void CudaBackend::set_shared_gemv_ctas_per_sm(int ctas) {
  LATENTMOE_CHECK(ctas >= 0 && ctas <= 2, "CUDA backend: shared_gemv_ctas_per_sm ", ctas, " is outside 0..2");
  state_->shared_gemv_ctas_per_sm = ctas;
}
int CudaBackend::shared_gemv_ctas_per_sm() const { return state_->shared_gemv_ctas_per_sm; }
void CudaBackend::set_mxfp4_pairs_max_tokens(int tokens) {
  LATENTMOE_CHECK(tokens >= 0 && tokens <= kMxfp4PairsMaxTokens, "CUDA backend: mxfp4_pairs_max_tokens ", tokens,
                  " is outside 0..", kMxfp4PairsMaxTokens);
  state_->mxfp4_pairs_max_tokens = tokens;
}
int CudaBackend::mxfp4_pairs_max_tokens() const { return state_->mxfp4_pairs_max_tokens; }

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

void CudaBackend::mxfp4_codes_to_kernel_order(const TensorView& codes) {
  State& s = *state_;
  DeviceGuard guard(s.ordinal);
  LATENTMOE_CHECK(
      codes.defined() && codes.dtype() == DType::u8 && codes.device() == Device::cuda && codes.is_contiguous(),
      "MXFP4 codes to the kernel order: a contiguous U8 tensor on the GPU, not ", codes.shape_string());
  cuda::mxfp4_codes_to_kernel_order(codes.data(), static_cast<size_t>(codes.numel()), s.current);
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
  // MXFP4 experts run on the decode kernels (gemm/mxfp4_decode.h) up to 8 tokens and, above with bf16/f16
  // activations, on the grouped tensor-core GEMMs (gemm/grouped_gemm.h: the rows kernel, then the tile kernels);
  // f32, and shapes the grouped kernels do not take, in batches of 8 on the decode kernels; decoded in registers or
  // shared memory, never through a dequantised copy (four times the experts' memory). So no layer is refused for
  // them here.
  LATENTMOE_CHECK(tp_size >= 1, "CUDA backend: tp_size ", tp_size, " must be positive");
  LATENTMOE_CHECK(is_compute_dtype(dtype), "CUDA backend: ", dtype_name(dtype), " is not a compute dtype");
  // The kernels' own limits, reported when the runner is built rather than at the first forward.
  LATENTMOE_CHECK(config.top_k <= kMaxRouteTopK, "the CUDA backend routes at most ", kMaxRouteTopK,
                  " experts per token; num_experts_per_tok is ", config.top_k);
  LATENTMOE_CHECK(config.num_experts <= kMaxLayoutExperts, "the CUDA backend takes at most ", kMaxLayoutExperts,
                  " routed experts; n_routed_experts is ", config.num_experts);
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
  s.beside_bytes = 0;
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

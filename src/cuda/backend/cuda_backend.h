// The CUDA backend: every Backend operation of src/core/backend.h on one NVIDIA GPU.
//
// Life cycle (docs/CUDA_BACKEND.md):
//   1. detail::make_cuda_backend(ordinal) (src/cuda/backend/factory.cpp): creates the backend's two non-blocking
//   streams (main and aux),
//      its events, the cuBLASLt handle, 2 x 32 MiB of cuBLASLt workspace and 2 x 8 MiB of split-K workspace
//      for tier 0's pushing GEMM (one each per stream).
//   2. allocate()/copy(): the runner places the weights.
//   3. prepare(spec): called by the rank context (core/rank_context_state.h) before the first forward, with
//      the element-wise maximum of its layers' WorkspaceSpec;
//      sizes the internal workspaces of routed_experts (MoE layout, grouped-GEMM rows), dense_mlp
//      (the shared expert's intermediate) and router_logits (x widened to f32 for an f32 gate) for
//      up to max_tokens tokens. linear, route, rms_norm, add and add_scaled_rows need no prepare;
//      router_logits without it runs a slower fp32 kernel for a 16-bit x with an f32 gate.
//   4. forward: every operation only enqueues work on stream(): no allocation, no host
//      synchronisation (except copy() into or out of host memory), so a whole forward can be captured
//      into a CUDA graph and replayed. An operation whose workspace prepare() did not size throws.
//      Operations do not re-validate what the runner validated (shapes, dtypes, devices, contiguity:
//      src/core/backend.h); those checks are debug-only (LATENTMOE_DEBUG_CHECK, cuda/common/debug_check.h).
//
// Threads: one backend serves one rank; its operations are called from one thread at a time.
// Each operation makes the backend's device current for its duration and restores the caller's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "core/backend.h"
#include "cuda/backend/fused_up_projection_bounds.h"
#include "cuda/common/device.h"  // cuda_device_count, for the users of this header
#include "cuda/gemm/dense_push_gemm.h"
#include "cuda/gemm/gemv.h"
#include "cuda/gemm/skinny_gemm.h"

namespace latentmoe::cuda {

struct ExpertGemmWeights;  // cuda/gemm/grouped_gemm.h

// The shapes the internal workspaces are sized for (core/backend.h).
using WorkspaceSpec = ::latentmoe::detail::WorkspaceSpec;

// The most weight bytes the routed experts beside the shared expert (run_overlapped) may stream for
// dense_mlp to take the decode GEMV pair. Measured on an H100 at one token (session 29,
// bench/results/layer_ab_h100_session29.txt): beside Kimi-K3's MXFP4 experts at tp 8 (35 MB, latency-bound
// decode kernels that leave the memory idle) the GEMV pair made the layer 8-10% faster; beside bf16
// experts at tp 8 (Kimi-K3 132 MB, Nemotron 3 Super 182 MB) and MXFP4 experts at tp 1 (282 MB), which
// stream near the read rate, it made it 2.6-9% slower, the skinny kernels leaving them more of the GPU.
inline constexpr int64_t kSharedGemvBesideMaxBytes = int64_t{64} << 20;

class CudaBackend final : public ::latentmoe::detail::Backend {
 public:
  // Throws Error when the device does not exist or a CUDA/cuBLAS call fails.
  explicit CudaBackend(int device_ordinal);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  Device device() const override { return Device::cuda; }
  ::latentmoe::detail::DeviceBuffer allocate(size_t bytes) override;
  // Equal shape and dtype; rank-2 views may have row strides (cudaMemcpy2DAsync). A copy that
  // touches host memory synchronises the stream before returning; device-to-device copies are
  // stream-ordered and capturable.
  void copy(const TensorView& src, const TensorView& dst) override;
  // The stream operations are enqueued on: the main stream, or the aux stream inside the `aux`
  // function of run_overlapped.
  StreamHandle stream() const override;
  // The caller's stream becomes the main stream (nullptr: the backend's own again); the aux stream
  // forks from and joins into it.
  void bind_stream(StreamHandle stream) override;
  void synchronize() override;
  bool synchronize_for(std::chrono::milliseconds limit) override;
  // The MXFP4 kernels read the kernel order (latentmoe/mxfp4.h); the conversion runs on the current stream.
  Mxfp4CodeOrder mxfp4_code_order() const override { return Mxfp4CodeOrder::kernel; }
  void mxfp4_codes_to_kernel_order(const TensorView& codes) override;

  // Refuses what the kernels cannot run (top_k and E beyond their limits; MXFP4 experts run at any shape
  // the loader accepts).
  void check_layer(const LayerConfig& config, DType dtype, int tp_size) override;
  // Sizes the workspaces for `spec` exactly (the rank context: the maximum over its layers; tests).
  void prepare(const WorkspaceSpec& spec) override;
  // check_layer + prepare(WorkspaceSpec::for_layer(...)): E, k, l, I/tp and Is/tp, in `dtype`.
  using ::latentmoe::detail::Backend::prepare;
  const WorkspaceSpec& workspace_spec() const;

  void router_logits(const TensorView& x, const TensorView& gate, const TensorView& logits) override;
  void route(const ::latentmoe::detail::RoutingParams& params, const TensorView& logits, const TensorView& bias,
             const TensorView& topk_ids, const TensorView& topk_weights, const TensorView& zero_weight_sum) override;
  void linear(const TensorView& x, const TensorView& w, const TensorView& y, bool accumulate) override;
  void routed_experts(const ::latentmoe::detail::ActivationParams& activation, const TensorView& z,
                      const TensorView& topk_ids, const TensorView& topk_weights,
                      const ::latentmoe::detail::MlpWeights& experts, const TensorView& out) override;
  void dense_mlp(const ::latentmoe::detail::ActivationParams& activation, const TensorView& x,
                 const ::latentmoe::detail::MlpWeights& mlp, const TensorView& out) override;
  void rms_norm(const TensorView& in, const TensorView& gamma, float eps, const TensorView& out) override;
  // Up to gemv_max_tokens rows, the norm inside the decode GEMV (gemv_rms_norm; `normed` untouched);
  // otherwise rms_norm into `normed`, then linear.
  void rms_norm_linear(const TensorView& in, const TensorView& gamma, float eps, const TensorView& normed,
                       const TensorView& w, const TensorView& y, bool accumulate) override;
  void add(const TensorView& a, const TensorView& b, const TensorView& out) override;
  void add_scaled_rows(const TensorView& x, const TensorView& scale, const TensorView& out) override;

  // `main` on the main stream and `aux` on the aux stream, forked from and joined back into the
  // main stream with events (capturable). routed_experts and dense_mlp each own one workspace, so
  // each may run on one of the two streams per call, not on both (checked).
  void run_overlapped(const std::function<void()>& main, const std::function<void()>& aux) override;

  // With a GPU group (cuda/comm/lamport_communicator.h) and a gamma: one Lamport kernel sums the
  // partials of every rank in rank order and normalises each row (fp32 throughout, one rounding);
  // otherwise the composed default.
  void all_reduce_rms_norm(Communicator& comm, const TensorView& partial, const TensorView& gamma, float eps,
                           const TensorView& out) override;
  // Tier 0's collective in one Lamport kernel with a GPU group: the latent partial's all-reduce (+
  // RMSNorm when gamma is defined) and the shared partial's reduce-scatter travel in the same
  // messages; otherwise the composed default.
  void tail_fusion_collective(Communicator& comm, const TensorView& latent_partial, const TensorView& shared_partial,
                              const TensorView& gamma, float eps, const TensorView& latent_out,
                              const TensorView& shared_shard_out) override;

  // Tier 0's up-projection + all-gather with a GPU group, up to fused_up_projection_max_tokens rows:
  // one GEMM whose epilogue adds the shared shard and stores each result into every rank's receive region
  // (lamport_device.cuh), then a Lamport kernel that only receives, copies out and re-arms the sentinels
  // (LamportCall::presend). The GEMM is the skinny kernel where the skinny kernels take the rows (so not
  // after set_skinny_max_tokens(0)) and the decode dispatch finds it pays (decode_dispatch.h: on sm_90 a
  // latent of at most 2048), else the tensor-core kernel of dense_push_gemm.h (contiguous x and W, n and
  // k multiples of 8) where the dispatch finds that one pays (on sm_90: never, as measured on simulated
  // ranks). set_fused_up_projection_max_latent replaces both rules. Otherwise, and where the block does
  // not fit the group's receive region, the composed default (cuBLASLt accumulating into the shard,
  // then the one-shot all-gather).
  void up_projection_all_gather(Communicator& comm, const TensorView& x, const TensorView& w_shard,
                                const TensorView& shard, const TensorView& out) override;

  // With a GPU group (tier_support.cpp): every tier bounded by the tokens its widest one-shot message
  // fits in the group's receive region, and none when the group carries another dtype; otherwise the
  // default (the communicator's collectives, unbounded).
  TierSupport tier_support(const LayerConfig& config, DType dtype, int tp_size,
                           const Communicator& comm) const override;

  // Up to how many rows (tokens) linear, dense_mlp and routed_experts may run on the skinny kernels
  // (cuda/gemm/skinny_gemm.h) instead of cuBLASLt and the grouped GEMMs: 0..kSkinnyMaxRows (8, the default);
  // 0 turns them off (the benchmark compares both). Throws Error outside that range. Within it a call
  // takes them where they were measured faster (the per-architecture table of
  // cuda/backend/decode_dispatch.h: on sm_90 the routed experts with a long latent and the small
  // shared expert, at one token), or always after
  // set_skinny_always(true) (tests).
  void set_skinny_max_tokens(int tokens);
  int skinny_max_tokens() const;
  // The launch shape of every skinny call from now on (tests reach each schedule with it); the
  // default {} lets each call choose. The call checks the shape when it launches.
  void set_skinny_shape(const SkinnyShape& shape);
  void set_skinny_always(bool always);
  // Up to how many rows (tokens) linear() and dense_mlp() run on the decode GEMV (cuda/gemm/gemv.h) instead of
  // cuBLASLt: 0..kGemvMaxRows (4), default 1. Measured on an H100 (session 28, docs/CUDA_BACKEND.md "Decode GEMV"): at
  // one row its warp-rows kernel streams Kimi-K3's 51 MB W_down faster than cuBLASLt and W_up about as fast, and the
  // one-token layer graph is no slower with it; at 2-4 rows the layer was slower, so those stay on cuBLASLt. Throws
  // Error outside that range. Within it a call takes the GEMV when x, w and y share a 16-bit dtype (f32 stays on
  // cuBLASLt's true-fp32 path) and gemv_supported() holds; the skinny kernels, where set_skinny_always sends a linear
  // to them, come first. dense_mlp (the shared expert) takes the same rows on the GEMV pair, gemv_gate_up then gemv,
  // under the same rules, when it runs alone or beside routed experts (run_overlapped) that stream at most
  // kSharedGemvBesideMaxBytes (above, with the measurement).
  void set_gemv_max_tokens(int tokens);
  int gemv_max_tokens() const;
  // CTAs per SM of dense_mlp's decode GEMVs (GemvShape::ctas_per_sm): 0 (the default: the kernel's own,
  // two at one row), 1 or 2; the benchmark compares them (session 29, H100, kimi-k3 tp-shard 8 MXFP4 at one
  // token: 0.903 and 0.917 of main's graph time at 0 and 1). Throws Error outside 0..2.
  void set_shared_gemv_ctas_per_sm(int ctas);
  int shared_gemv_ctas_per_sm() const;
  // Up to how many tokens MXFP4 routed experts with bf16 activations, where the decode kernels take them, run on
  // the pair kernels (cuda/gemm/mxfp4_pairs.h: each (token, expert) pair its own tiles, 16-byte loads) instead
  // of the tile decode kernels: 0..kMxfp4PairsMaxTokens (8); default kMxfp4PairsTokens (0, off until measured:
  // mxfp4_pairs.h), LATENTMOE_MXFP4_PAIRS_MAX_TOKENS when set; 0 turns them off (the benchmark compares both).
  // Throws Error outside that range.
  void set_mxfp4_pairs_max_tokens(int tokens);
  int mxfp4_pairs_max_tokens() const;

  // Up to how many rows tier 0's up-projection pushes into the peers from its epilogue
  // (up_projection_all_gather): 0..kDensePushMaxRows (128); default kDefaultFusedUpProjectionMaxTokens;
  // 0 turns it off (the benchmark and the tests compare both). Throws Error outside that range.
  void set_fused_up_projection_max_tokens(int tokens);
  // The longest latent (the GEMM's reduction) with which it pushes, in place of the decode dispatch's
  // measured rules: the skinny kernel where it takes the rows, else the tensor-core kernel (bench tail
  // measures the push past the rules with it); -1 (the default) restores the rules. Throws Error below -1.
  void set_fused_up_projection_max_latent(int64_t latent);

  int device_ordinal() const;
  // cudaMalloc calls made so far (allocate() and internal workspaces); forward adds none.
  int64_t num_device_allocations() const;

 private:
  struct State;
  struct RoutedBuffers;
  // This call's parts of the routed workspace (MoE layout, act rows, y rows, grouped-GEMM workspace),
  // checked against what prepare() sized.
  RoutedBuffers routed_buffers(DType dtype, int64_t num_tokens, int64_t top_k, int64_t num_experts,
                               int64_t intermediate, int64_t latent);
  // The routed experts in MXFP4 (codes and E8M0 scales, decoded inside the kernels): the grouped GEMMs from
  // 64 tokens where they take the shapes, else the decode kernels in batches of up to 8 tokens.
  void mxfp4_routed_experts(const ::latentmoe::detail::ActivationParams& activation, const TensorView& z,
                            const TensorView& topk_ids, const TensorView& topk_weights,
                            const ::latentmoe::detail::MlpWeights& experts, const TensorView& out);
  // The grouped path of the routed experts (weights in the compute dtype or MXFP4): the MoE layout, the
  // gate/up and down grouped GEMMs, the combine into `out`.
  void grouped_routed_experts(const ::latentmoe::detail::ActivationParams& activation, const TensorView& z,
                              const TensorView& topk_ids, const TensorView& topk_weights,
                              const ExpertGemmWeights& weights, const TensorView& out);
  std::unique_ptr<State> state_;
};

}  // namespace latentmoe::cuda

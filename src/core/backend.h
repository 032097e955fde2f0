// The narrow set of operations a backend implements. The runner and the tails (src/core/runner.cpp,
// src/core/layer_forward.cpp, src/core/tails.cpp) are written once against this interface, so the CPU reference proves
// the same orchestration the GPU runs. Every tensor argument lives on the backend's device; every operation validates
// nothing that the runner already validated (shapes are checked once, in the runner).
//
// Precision contract for all backends: reductions (dot products, sums over experts, norms,
// collectives) accumulate in fp32 or wider; results are rounded once to the output's dtype.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "latentmoe/communicator.h"
#include "latentmoe/config.h"
#include "latentmoe/mxfp4.h"
#include "latentmoe/tensor.h"
#include "latentmoe/tier.h"

namespace latentmoe::detail {

// Device memory owned by a backend; released by the deleter given at allocation.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(void* pointer, size_t bytes, std::function<void(void*)> release)
      : pointer_(pointer), bytes_(bytes), release_(std::move(release)) {}
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      reset();
      pointer_ = other.pointer_;
      bytes_ = other.bytes_;
      release_ = std::move(other.release_);
      other.pointer_ = nullptr;
      other.bytes_ = 0;
    }
    return *this;
  }
  ~DeviceBuffer() { reset(); }
  void* get() const { return pointer_; }
  size_t bytes() const { return bytes_; }

 private:
  void reset() {
    if (pointer_ != nullptr && release_) release_(pointer_);
    pointer_ = nullptr;
  }
  void* pointer_ = nullptr;
  size_t bytes_ = 0;
  std::function<void(void*)> release_;
};

struct RoutingParams {
  ScoringFunc scoring = ScoringFunc::sigmoid;
  int64_t num_experts = 0;       // E (real experts); ids >= E are zero experts
  int64_t num_zero_experts = 0;  // Z
  int64_t top_k = 0;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  bool norm_topk_prob = true;
  float routed_scaling_factor = 1.0f;

  static RoutingParams from_config(const LayerConfig& config);
};

struct ActivationParams {
  Activation activation = Activation::silu;
  float situ_beta = 4.0f;
  float situ_linear_beta = 25.0f;

  static ActivationParams from_config(const LayerConfig& config);
};

// One rank's shard of the routed experts (stacked) or of a dense gated/non-gated MLP.
// For the routed experts: gate/up [E, I_r, l], down [E, l, I_r]; for a dense MLP: gate/up [Is_r, d],
// down [d, Is_r]. `gate` is undefined for relu2.
// MXFP4 routed experts (format mxfp4; never a dense MLP): gate/up/down hold the packed U8 codes
// (gate/up [E, I_r, l/2], down [E, l, I_r/2]) and the *_scale views their U8 E8M0 scales
// (gate/up [E, I_r, l/32], down [E, l, I_r/32]); latentmoe/mxfp4.h.
struct MlpWeights {
  TensorView gate;
  TensorView up;
  TensorView down;
  ExpertWeightFormat format = ExpertWeightFormat::dense;
  TensorView gate_scale, up_scale, down_scale;  // mxfp4 only
};

// The shapes a backend's internal workspaces are sized for (Backend::prepare). Several layers that
// share one backend (a RankContext) prepare it once with the element-wise maximum of their specs:
// every workspace size grows monotonically with each field, so the maximum fits each layer.
struct WorkspaceSpec {
  int64_t max_tokens = 0;
  size_t element_size = 4;          // bytes per element of the compute dtype (4 fits every dtype)
  int64_t hidden_size = 0;          // d; > 0: room to widen x to f32 for an f32 router gate
  int64_t num_experts = 0;          // E; 0: no routed experts
  int64_t top_k = 0;                // k
  int64_t latent_size = 0;          // l
  int64_t expert_intermediate = 0;  // I / tp
  int64_t dense_intermediate = 0;   // Is / tp; 0: no dense MLP

  // The spec of one layer of `config` in `dtype` at `tp_size` ranks for up to max_tokens tokens.
  static WorkspaceSpec for_layer(const LayerConfig& config, DType dtype, int64_t max_tokens, int tp_size);
  // The element-wise maximum of two specs.
  static WorkspaceSpec max(const WorkspaceSpec& a, const WorkspaceSpec& b);
  // Whether every field of this spec is at least `other`'s.
  bool covers(const WorkspaceSpec& other) const;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual Device device() const = 0;
  // Device memory for weights and workspaces. Only called at construction, never in forward.
  virtual DeviceBuffer allocate(size_t bytes) = 0;
  // Copies equal-shape, equal-dtype tensors (rows contiguous) between the host and this device or
  // within the device, in stream order. A copy into host memory has completed when copy() returns.
  virtual void copy(const TensorView& src, const TensorView& dst) = 0;
  // Stream the backend's operations run on (nullptr on the CPU); passed to the communicator.
  virtual StreamHandle stream() const { return nullptr; }
  // Makes `stream` the stream the following operations are enqueued on (nullptr: the backend's own).
  // The runner binds the caller's stream for the duration of one forward. Ignored on the CPU.
  virtual void bind_stream(StreamHandle stream) {}
  // Waits until everything the backend enqueued on its own streams has completed (construction).
  virtual void synchronize() {}
  // The same wait with a limit: false when the work has not completed within `limit` (a device wait
  // that never ends, e.g. a collective of NCCL's, which has no deadline of its own). The work is left
  // as it is; the caller aborts the group so that it ends.
  virtual bool synchronize_for(std::chrono::milliseconds limit) {
    synchronize();
    return true;
  }
  // The order in which this backend's kernels read MXFP4 codes (latentmoe/mxfp4.h): the CPU reference reads the
  // canonical order, the CUDA kernels the kernel order.
  virtual Mxfp4CodeOrder mxfp4_code_order() const { return Mxfp4CodeOrder::canonical; }
  // Converts MXFP4 codes on this backend's device (U8, contiguous) from the canonical order to
  // mxfp4_code_order(), in place, in stream order: the runner runs it on the codes it has copied to the device.
  // Throws Error on a backend whose order is canonical (nothing to convert).
  virtual void mxfp4_codes_to_kernel_order(const TensorView& codes);
  // Called by the runner at construction, before any weight is placed: a backend refuses a layer it
  // cannot run (its kernel limits, a weight format it has no kernels for) before the weights cost
  // device memory.
  virtual void check_layer(const LayerConfig& config, DType dtype, int tp_size) {}
  // Sizes the internal workspaces (e.g. the grouped-GEMM layout) for `spec`, so that no operation
  // allocates during forward. Called by the rank context when a layer needs more than the spec it last
  // prepared (never after a forward); replaces the previous workspaces.
  virtual void prepare(const WorkspaceSpec& spec) {}
  // check_layer, then prepare for that one layer (a backend serving a single layer; tests).
  void prepare(const LayerConfig& config, DType dtype, int64_t max_tokens, int tp_size) {
    check_layer(config, dtype, tp_size);
    prepare(WorkspaceSpec::for_layer(config, dtype, max_tokens, tp_size));
  }
  // What each tier can run on this backend for a layer of `config` in `dtype` over `comm` (tp_size
  // ranks): dtype limits, token capacities of fused collectives, whether the ranks reach each other.
  // Only the backend's own limits: the runner adds the structural ones (structural_tier_support).
  // The default: every tier supported, unbounded, through the communicator's collectives.
  virtual TierSupport tier_support(const LayerConfig& config, DType dtype, int tp_size, const Communicator& comm) const;

  // logits [T, E+Z] f32 = x [T, d] · gate [E+Z, d]^T, computed in fp32.
  virtual void router_logits(const TensorView& x, const TensorView& gate, const TensorView& logits) = 0;

  // DESIGN section 1 step 1. logits [T, E+Z] f32; bias [E+Z] f32 or undefined.
  // Writes topk_ids [T, k] i32 (ordered by descending biased score, ties to the lower id),
  // topk_weights [T, k] f32 and zero_weight_sum [T] f32 (the summed weights of ids >= E).
  virtual void route(const RoutingParams& params, const TensorView& logits, const TensorView& bias,
                     const TensorView& topk_ids, const TensorView& topk_weights, const TensorView& zero_weight_sum) = 0;

  // y [T, n] = x [T, m] · w [n, m]^T, plus the previous y when `accumulate`. y may be a strided
  // column block of a wider matrix (its last dimension is contiguous).
  virtual void linear(const TensorView& x, const TensorView& w, const TensorView& y, bool accumulate) = 0;

  // out [T, l] = sum over j < k with ids[t, j] < E of weights[t, j] · expert_{ids[t, j]}(z[t]).
  virtual void routed_experts(const ActivationParams& activation, const TensorView& z, const TensorView& topk_ids,
                              const TensorView& topk_weights, const MlpWeights& experts, const TensorView& out) = 0;

  // out [T, d] = act(x Wg^T, x Wu^T) Wd^T (or relu(x Wu^T)^2 Wd^T).
  virtual void dense_mlp(const ActivationParams& activation, const TensorView& x, const MlpWeights& mlp,
                         const TensorView& out) = 0;

  // out[t] = in[t] / sqrt(mean(in[t]^2) + eps) · gamma (gamma f32), in fp32.
  virtual void rms_norm(const TensorView& in, const TensorView& gamma, float eps, const TensorView& out) = 0;

  // y (+)= rms_norm(in) · w^T, the one-rank tail's norm and up-projection. `normed` [T, l] is scratch
  // that the backend may write with rms_norm(in) (the default: rms_norm into it, then linear) or leave
  // untouched (the CUDA backend at decode normalises inside the GEMV); callers must not read it after.
  virtual void rms_norm_linear(const TensorView& in, const TensorView& gamma, float eps, const TensorView& normed,
                               const TensorView& w, const TensorView& y, bool accumulate);

  // out = a + b, elementwise (out may alias a or b).
  virtual void add(const TensorView& a, const TensorView& b, const TensorView& out) = 0;

  // out[t, :] += scale[t] · x[t, :] (the zero experts; scale f32).
  virtual void add_scaled_rows(const TensorView& x, const TensorView& scale, const TensorView& out) = 0;

  // --- Collective steps of the tails. The defaults compose the communicator's collectives with
  // --- the operations above; a backend overrides them with fused kernels.

  // out = RMSNorm(AR(partial)) when gamma is defined, else out = AR(partial). `partial` may be
  // overwritten with the reduced sum.
  virtual void all_reduce_rms_norm(Communicator& comm, const TensorView& partial, const TensorView& gamma, float eps,
                                   const TensorView& out);

  // Tier 0's collective: latent_out = RMSNorm(AR(latent_partial)) (no norm when gamma is undefined)
  // on every rank, and shared_shard_out [T, d/tp] = this rank's column shard of RS(shared_partial).
  virtual void tail_fusion_collective(Communicator& comm, const TensorView& latent_partial,
                                      const TensorView& shared_partial, const TensorView& gamma, float eps,
                                      const TensorView& latent_out, const TensorView& shared_shard_out);

  // Tier 0's last steps: out [T, d] = the all-gather over the group of this rank's block
  // shard [T, d/tp] + x [T, l] · w_shard [d/tp, l]^T, where `shard` holds this rank's shard of the
  // reduced shared output (it may be overwritten). The default composes linear (accumulating into
  // `shard`) and comm.all_gather; a backend delivers the GEMM's results straight into the peers.
  virtual void up_projection_all_gather(Communicator& comm, const TensorView& x, const TensorView& w_shard,
                                        const TensorView& shard, const TensorView& out);

  // Runs `main` and `aux` so that they may overlap (CUDA: aux on a second stream joined by events).
  // The default runs main, then aux.
  virtual void run_overlapped(const std::function<void()>& main, const std::function<void()>& aux);
};

std::unique_ptr<Backend> make_cpu_backend();

// The CUDA backend on device `device_ordinal` (src/cuda/backend/); throws Error when latentmoe was
// built without CUDA or the device does not exist.
std::unique_ptr<Backend> make_cuda_backend(int device_ordinal);

}  // namespace latentmoe::detail

// The tail alone (DESIGN section 2): this rank's un-reduced partials S_r [T, d] and L_r [T, l] in, the
// layer output [T, d] out on every rank, through one of the four TailTier paths. For an engine that keeps
// its own routed and shared experts and adopts only latentmoe's tail (the reference runner's
// _small_batch_tail / _overlap_allreduce_tail / _shard_up_proj_tail and the native path).
//
// The same orchestration as the Runner's tails (src/core/tails.cpp): the tail registers its scratch with
// the rank context like a layer (so it shares the context's buffers with the rank's layers, under the same
// rule: build every layer and tail before the first forward through the context), and forward() runs the
// tier's steps on the caller's stream, allocating nothing and never synchronising the host.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include "latentmoe/communicator.h"
#include "latentmoe/dtype.h"
#include "latentmoe/rank_context.h"
#include "latentmoe/tensor.h"
#include "latentmoe/tier.h"

namespace latentmoe {

namespace detail {
struct TailState;
}  // namespace detail

// The tail's weights, replicated on every rank as in the reference (views: host views are copied to the
// context's device, views already on that device are used in place and must outlive the Tail).
struct TailWeights {
  TensorView latent_norm;  // [l] f32, the latent RMSNorm's gamma; undefined: no latent norm
  TensorView up_proj;      // [d, l] W_up, whole (tiers 0 and 2 use this rank's rows), in the compute dtype
};

class Tail {
 public:
  // A tail of hidden size d and latent size l on `context` (whose tp must divide d and l), computing in
  // `dtype` (F32, BF16 or F16); `eps` is the latent RMSNorm's epsilon. Throws Error naming the problem
  // (a bad size, weight shape or dtype, a context that already ran a forward and holds too little).
  Tail(RankContext& context, int64_t hidden_size, int64_t latent_size, const TailWeights& weights, float eps,
       DType dtype, const TierPolicy& policy = {});
  // The constructor's checks of its arguments for a context of `tp_size` ranks (sizes, dtype, eps, the
  // weights' shapes and dtypes): throws Error naming the problem.
  static void validate(int tp_size, int64_t hidden_size, int64_t latent_size, const TailWeights& weights, float eps,
                       DType dtype);
  ~Tail();
  Tail(const Tail&) = delete;
  Tail& operator=(const Tail&) = delete;

  DType dtype() const;
  Device device() const;
  // What each tier can run here (the structural requirements: tp > 1 for the fused tiers, and the
  // backend's and communicator's limits). Fixed at construction.
  const TierSupport& tier_support() const;
  // The tier forward() takes for `num_tokens` tokens when none is forced.
  TailTier select_tier(int64_t num_tokens) const;
  // The checks forward() makes before it runs anything: shapes [T, d], [T, l], [T, d], the dtype, the
  // device, contiguity, T <= the context's max_tokens, a forced tier against tier_support(). Throws Error
  // naming the problem; returns the tier forward() would run. Allocates nothing.
  TailTier check_forward(const TensorView& shared_partial, const TensorView& latent_partial, const TensorView& out,
                         std::optional<TailTier> tier) const;
  // out = the layer output from every rank's S_r (`shared_partial`) and L_r (`latent_partial`); the
  // inputs are read, never written (they are copied into the context's scratch, or S_r into `out` for
  // column_parallel, before the tier's collectives reduce in place). Every rank calls it with the same T
  // and tier. CUDA: enqueued on `stream` (a cudaStream_t; nullptr: the context's own stream), capturable
  // into a CUDA graph. Returns the tier it ran.
  TailTier forward(const TensorView& shared_partial, const TensorView& latent_partial, const TensorView& out,
                   std::optional<TailTier> tier, StreamHandle stream = nullptr);

 private:
  std::unique_ptr<detail::TailState> state_;
};

}  // namespace latentmoe

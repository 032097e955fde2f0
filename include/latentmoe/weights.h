// The layer's weights, by the names of DESIGN section 3, in the stacked layout the backends use,
// and their per-rank tensor-parallel sharding (DESIGN section 2).
#pragma once

#include <string>
#include <string_view>

#include "latentmoe/checkpoint.h"
#include "latentmoe/config.h"
#include "latentmoe/mxfp4.h"
#include "latentmoe/parallel.h"
#include "latentmoe/safetensors.h"
#include "latentmoe/tensor.h"

namespace latentmoe {

// Either the whole layer (tp 1) or one rank's shard. Matrices are stored in the compute dtype
// (`dtype`), the router and norm vectors in f32. I_r = I / tp and Is_r = Is / tp.
// With MXFP4 experts (experts_format, which must equal the config's) the three expert fields hold
// the packed E2M1 codes (U8: gate/up [E, I_r, l/2], down [E, l, I_r/2]) and the *_scale fields their
// E8M0 scales (U8: gate/up [E, I_r, l/32], down [E, l, I_r/32]); latentmoe/mxfp4.h decodes them.
struct LayerWeights {
  DType dtype = DType::f32;
  ExpertWeightFormat experts_format = ExpertWeightFormat::dense;
  HostTensor gate;               // [E+Z, d] f32; optional (undefined when router logits are supplied)
  HostTensor score_bias;         // [E+Z] f32; optional (e_score_correction_bias)
  HostTensor down_proj;          // [l, d]   W_down (replicated)
  HostTensor latent_norm;        // [l] f32; present iff config.use_latent_norm (replicated)
  HostTensor up_proj;            // [d, l]   W_up (replicated)
  HostTensor expert_gate;        // [E, I_r, l]; present iff gated
  HostTensor expert_up;          // [E, I_r, l]
  HostTensor expert_down;        // [E, l, I_r]
  HostTensor expert_gate_scale;  // MXFP4 only: [E, I_r, l/32] U8; present iff gated
  HostTensor expert_up_scale;    // MXFP4 only: [E, I_r, l/32] U8
  HostTensor expert_down_scale;  // MXFP4 only: [E, l, I_r/32] U8
  HostTensor shared_gate;        // [Is_r, d]; present iff shared expert and gated
  HostTensor shared_up;          // [Is_r, d]; present iff shared expert
  HostTensor shared_down;        // [d, Is_r]; present iff shared expert
};

// Non-owning views of one rank's weights (fields as in LayerWeights), each either on the host or
// already on the device the runner will use. A Runner copies host views to its device and uses
// device views in place: an engine that loaded its weights itself keeps them alive and unchanged
// for the runner's lifetime, and the runner holds no second copy.
// MXFP4 expert codes (expert_gate/up/down with experts_format mxfp4): the CUDA kernels read them in the kernel
// order (latentmoe/mxfp4.h, Mxfp4CodeOrder). Host views are always canonical (the checkpoint's order): a runner
// converts the codes it copies to a GPU itself. Device views are used in place, so they must already be in the
// kernel order: convert each code tensor once with mxfp4_to_kernel_order (latentmoe/runner.h) and set
// expert_code_order to kernel; a CUDA runner refuses device codes declared canonical, and any runner refuses
// host codes declared kernel. Scales are never permuted.
struct LayerWeightViews {
  DType dtype = DType::f32;
  ExpertWeightFormat experts_format = ExpertWeightFormat::dense;
  Mxfp4CodeOrder expert_code_order = Mxfp4CodeOrder::canonical;  // of expert_gate/up/down; MXFP4 only
  TensorView gate, score_bias, down_proj, latent_norm, up_proj;
  TensorView expert_gate, expert_up, expert_down;
  TensorView expert_gate_scale, expert_up_scale, expert_down_scale;  // MXFP4 only
  TensorView shared_gate, shared_up, shared_down;
};

// Views of host weights (valid while `weights` lives).
LayerWeightViews views_of(const LayerWeights& weights);

// Throws Error naming the first tensor whose presence, dtype or shape does not match `config`
// for a rank of a tp_size group. With MXFP4 experts, host scale tensors are also checked for 0xFF.
void validate_layer_weights(const LayerWeights& weights, const LayerConfig& config, int tp_size);
// The same for views; also requires every present view to be contiguous.
void validate_layer_weights(const LayerWeightViews& weights, const LayerConfig& config, int tp_size);

// Loads rank `parallel.rank`'s shard straight from the file (only that rank's slices are copied),
// converting matrices to `dtype`. Names may carry `prefix` (e.g. "model.layers.3.mlp."); the
// Nemotron-H names fc1_latent_proj / fc2_latent_proj are accepted for the two latent projections.
// Missing tensors, wrong shapes and unsupported dtypes are errors naming the tensor.
// When the config declares MXFP4 experts, they are read from the Kimi K3 names
// experts.{e}.w1|w3|w2.weight_packed / .weight_scale (U8, copied as they are, scales checked for 0xFF).
// `weights` is one file or a sharded checkpoint (Checkpoint::open): only the shards holding this
// layer's tensors are opened.
LayerWeights load_layer_weights(const Checkpoint& weights, const LayerConfig& config, std::string_view prefix,
                                const ParallelConfig& parallel, DType dtype);
// The same for one opened file.
LayerWeights load_layer_weights(const SafetensorsFile& file, const LayerConfig& config, std::string_view prefix,
                                const ParallelConfig& parallel, DType dtype);

// Rank `parallel.rank`'s shard of full (tp 1) weights.
LayerWeights shard_layer_weights(const LayerWeights& full, const LayerConfig& config, const ParallelConfig& parallel);

// Writes full (tp 1) weights under the canonical names with `prefix` (used by demo and tests); MXFP4
// experts under the Kimi K3 names (experts.{e}.w1|w3|w2.weight_packed / .weight_scale).
void save_layer_weights(const std::string& path, const LayerWeights& full, const LayerConfig& config,
                        std::string_view prefix = "");

// Seeded random full weights for tests and the demo: matrices ~ U(-1,1)/sqrt(fan_in), bias and
// gamma near 1, in `dtype`. `with_gate` also makes the router gate [E+Z, d]. With MXFP4 experts
// (config.experts_format) the experts get uniform random codes and scale bytes
// 124 - floor(log2(fan_in)/2) + {-1, 0, 1} (docs/FILES.md), whose values are exact in F32, BF16 and F16.
LayerWeights make_random_layer_weights(const LayerConfig& config, DType dtype, uint64_t seed, bool with_gate = true);

// `weights` with MXFP4 experts replaced by dense ones in weights.dtype holding exactly the decoded
// values (the dense twin the CPU reference must agree with bit for bit); dense weights are copied.
// Throws Error naming the tensor and position of a value the dtype cannot hold exactly (e.g. 6 * 2^127
// in BF16, or any value below 2^-24 in F16).
LayerWeights dequantize_layer_weights(const LayerWeights& weights);

}  // namespace latentmoe

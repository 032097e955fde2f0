// The grouped expert GEMMs (src/cuda/gemm/grouped_gemm.h) against a host fp64 loop: every engine variant,
// every activation and dtype, odd shapes, experts with no rows and one with many, zero-expert pairs,
// poisoned outputs, and CUDA-graph capture replayed with a new layout.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/settings.h"
#include "cuda/gemm/grouped_gemm.h"
#include "cuda/gemm/mxfp4_decode.h"
#include "latentmoe/error.h"
#include "latentmoe/mxfp4.h"

namespace latentmoe::cuda {
namespace {

using detail::GemmChoice;
using detail::GemmVariant;
using latentmoe::detail::ActivationParams;

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

bool has_gpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

class DeviceMem {
 public:
  explicit DeviceMem(size_t bytes) : bytes_(bytes) {
    if (cudaMalloc(&ptr_, std::max<size_t>(bytes, 16)) != cudaSuccess) ptr_ = nullptr;
  }
  ~DeviceMem() { cudaFree(ptr_); }
  DeviceMem(const DeviceMem&) = delete;
  DeviceMem& operator=(const DeviceMem&) = delete;
  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
};

// Host values already rounded through the dtype, and their device encoding.
struct HostArray {
  std::vector<double> values;
  std::vector<unsigned char> bytes;
};

HostArray random_array(DType dtype, size_t count, float scale, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-scale, scale);
  HostArray out;
  out.values.resize(count);
  out.bytes.resize(count * dtype_size(dtype));
  for (size_t i = 0; i < count; ++i) {
    const float v = round_through(dtype, dist(rng));
    out.values[i] = v;
    store_from_float(out.bytes.data(), dtype, static_cast<int64_t>(i), v);
  }
  return out;
}

// MXFP4 weights [rows, cols] (cols a multiple of 32): random codes (every code appears), scale bytes
// `scale_lo`..`scale_lo + 2`, and the exact values they decode to.
struct Mxfp4Array {
  std::vector<double> values;
  std::vector<unsigned char> codes;   // [rows, cols / 2]
  std::vector<unsigned char> scales;  // [rows, cols / 32]
};

Mxfp4Array random_mxfp4(int64_t rows, int64_t cols, int scale_lo, std::mt19937& rng) {
  Mxfp4Array out;
  std::uniform_int_distribution<int> byte(0, 255), scale(scale_lo, scale_lo + 2);
  out.codes.resize(rows * cols / 2);
  out.scales.resize(rows * cols / 32);
  for (auto& c : out.codes) c = static_cast<unsigned char>(byte(rng));
  for (auto& c : out.scales) c = static_cast<unsigned char>(scale(rng));
  out.values.resize(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    mxfp4_decode_row(out.codes.data() + r * cols / 2, out.scales.data() + r * cols / 32, 0, cols,
                     out.values.data() + r * cols);
  }
  return out;
}

struct HostLayout {
  std::vector<int32_t> topk_ids;        // [T, k]
  std::vector<int32_t> expert_offsets;  // [E + 1]
  std::vector<int32_t> sorted_pairs;    // [T * k] (tail unused)
  std::vector<int32_t> pair_rows;       // [T * k]
};

// Distinct ids per token from [0, E + Z); `heavy` (if >= 0) is chosen by every token, so that one
// expert gets T rows; with E large against T * k many experts get none.
HostLayout random_layout(int64_t num_tokens, int num_experts, int num_zero, int top_k, int heavy, std::mt19937& rng) {
  HostLayout layout;
  const int total_ids = num_experts + num_zero;
  layout.topk_ids.resize(num_tokens * top_k);
  std::vector<int> ids(total_ids);
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    if (heavy >= 0) {
      auto it = std::find(ids.begin(), ids.end(), heavy);
      std::iter_swap(ids.begin(), it);
    }
    for (int j = 0; j < top_k; ++j) layout.topk_ids[t * top_k + j] = ids[j];
  }
  const int64_t num_pairs = num_tokens * top_k;
  layout.expert_offsets.assign(num_experts + 1, 0);
  for (int64_t p = 0; p < num_pairs; ++p) {
    if (layout.topk_ids[p] < num_experts) ++layout.expert_offsets[layout.topk_ids[p] + 1];
  }
  for (int e = 0; e < num_experts; ++e) layout.expert_offsets[e + 1] += layout.expert_offsets[e];
  layout.sorted_pairs.assign(std::max<int64_t>(num_pairs, 1), -7);
  layout.pair_rows.assign(std::max<int64_t>(num_pairs, 1), -1);
  std::vector<int32_t> fill(layout.expert_offsets.begin(), layout.expert_offsets.end() - 1);
  for (int64_t p = 0; p < num_pairs; ++p) {
    const int id = layout.topk_ids[p];
    if (id >= num_experts) continue;
    const int row = fill[id]++;
    layout.sorted_pairs[row] = static_cast<int32_t>(p);
    layout.pair_rows[p] = row;
  }
  return layout;
}

double activate(const ActivationParams& act, double g, double u) {
  switch (act.activation) {
    case Activation::silu:
      return g / (1.0 + std::exp(-g)) * u;
    case Activation::situ: {
      const double b1 = act.situ_beta;
      const double b2 = act.situ_linear_beta;
      return (b1 * std::tanh(g / b1) / (1.0 + std::exp(-g))) * (b2 * std::tanh(u / b2));
    }
    case Activation::relu2: {
      const double r = std::max(u, 0.0);
      return r * r;
    }
  }
  return 0.0;
}

struct Case {
  std::string name;
  DType dtype;
  Activation activation;
  int64_t num_tokens;
  int num_experts;
  int num_zero;
  int top_k;
  int64_t intermediate;
  int64_t latent;
  int heavy;  // expert chosen by every token, or -1
};

std::ostream& operator<<(std::ostream& os, const Case& c) { return os << c.name; }

double tolerance(DType dtype) { return dtype == DType::f32 ? 1e-5 : 1e-2; }

// Everything one problem needs on the host and the device.
class Problem {
 public:
  // mxfp4: the expert weights in MXFP4 (I_r and l multiples of 32), their decoded values the reference's.
  // big_scale_every > 0: every such MXFP4 scale byte is 135 (2^8, past the 128 up to which mxfp4_rows folds
  // the scales into its bf16 operands: that step takes its fp32 path).
  Problem(const Case& c, uint32_t seed, bool mxfp4 = false, int big_scale_every = 0)
      : c_(c), rng_(seed), mxfp4_(mxfp4) {
    act_.activation = c.activation;
    act_.situ_beta = 4.0f;
    act_.situ_linear_beta = 25.0f;
    const size_t el = dtype_size(c.dtype);
    const int64_t E = c.num_experts;
    const int64_t I = c.intermediate;
    const int64_t l = c.latent;
    const float w_scale = 1.0f / std::sqrt(static_cast<float>(l));
    if (gated()) gate_ = random_array(c.dtype, E * I * l, 2.0f * w_scale, rng_);
    up_ = random_array(c.dtype, E * I * l, 2.0f * w_scale, rng_);
    down_ = random_array(c.dtype, E * l * I, 1.0f / std::sqrt(static_cast<float>(I)), rng_);
    if (mxfp4) {
      // Scales near 2^-6 (gate/up) and 2^-5 (down): values up to 6 x 2^-4, sums of order one.
      auto adopt = [&](HostArray& host, std::unique_ptr<DeviceMem>& d_scales, int64_t rows, int64_t cols, int lo) {
        Mxfp4Array m = random_mxfp4(rows, cols, lo, rng_);
        if (big_scale_every > 0) {
          for (size_t i = 0; i < m.scales.size(); i += big_scale_every) m.scales[i] = 135;
          for (int64_t r = 0; r < rows; ++r) {
            mxfp4_decode_row(m.codes.data() + r * cols / 2, m.scales.data() + r * cols / 32, 0, cols,
                             m.values.data() + r * cols);
          }
        }
        host.values = std::move(m.values);  // the reference's: decoded from the canonical codes
        // The kernels read the codes in the kernel order (latentmoe/mxfp4.h), as the runner puts them on the GPU.
        mxfp4_codes_to_kernel_order(m.codes.data(), m.codes.size());
        host.bytes = std::move(m.codes);
        d_scales = std::make_unique<DeviceMem>(m.scales.size());
        cudaMemcpy(d_scales->get(), m.scales.data(), m.scales.size(), cudaMemcpyHostToDevice);
      };
      if (gated()) adopt(gate_, d_gate_scales_, E * I, l, 119);
      adopt(up_, d_up_scales_, E * I, l, 119);
      adopt(down_, d_down_scales_, E * l, I, 120);
    }
    d_gate_ = std::make_unique<DeviceMem>(gate_.bytes.size());
    d_up_ = std::make_unique<DeviceMem>(up_.bytes.size());
    d_down_ = std::make_unique<DeviceMem>(down_.bytes.size());
    cudaMemcpy(d_gate_->get(), gate_.bytes.data(), gate_.bytes.size(), cudaMemcpyHostToDevice);
    cudaMemcpy(d_up_->get(), up_.bytes.data(), up_.bytes.size(), cudaMemcpyHostToDevice);
    cudaMemcpy(d_down_->get(), down_.bytes.data(), down_.bytes.size(), cudaMemcpyHostToDevice);
    const int64_t rows = std::max<int64_t>(c.num_tokens * c.top_k, 1);
    d_z_ = std::make_unique<DeviceMem>(std::max<int64_t>(c.num_tokens, 1) * l * el);
    d_act_ = std::make_unique<DeviceMem>(rows * I * el);
    d_y_ = std::make_unique<DeviceMem>(rows * l * el);
    d_offsets_ = std::make_unique<DeviceMem>((E + 1) * sizeof(int32_t));
    d_sorted_ = std::make_unique<DeviceMem>(rows * sizeof(int32_t));
    d_pair_rows_ = std::make_unique<DeviceMem>(rows * sizeof(int32_t));
    d_workspace_ = std::make_unique<DeviceMem>(grouped_gemm_workspace_bytes(c.num_tokens, c.top_k, c.num_experts));
    cudaMemset(d_workspace_->get(), 0, d_workspace_->bytes());
    new_inputs();
  }

  bool gated() const { return c_.activation != Activation::relu2; }

  // Fresh routing and z, written into the same device buffers (what a graph replay sees).
  void new_inputs() {
    layout_ = random_layout(c_.num_tokens, c_.num_experts, c_.num_zero, c_.top_k, c_.heavy, rng_);
    z_ = random_array(c_.dtype, c_.num_tokens * c_.latent, 1.0f, rng_);
    cudaMemcpy(d_z_->get(), z_.bytes.data(), z_.bytes.size(), cudaMemcpyHostToDevice);
    cudaMemcpy(d_offsets_->get(), layout_.expert_offsets.data(), layout_.expert_offsets.size() * 4,
               cudaMemcpyHostToDevice);
    cudaMemcpy(d_sorted_->get(), layout_.sorted_pairs.data(), layout_.sorted_pairs.size() * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(d_pair_rows_->get(), layout_.pair_rows.data(), layout_.pair_rows.size() * 4, cudaMemcpyHostToDevice);
  }

  void poison() {
    cudaMemset(d_act_->get(), 0xff, d_act_->bytes());
    cudaMemset(d_y_->get(), 0xff, d_y_->bytes());
  }

  MoeLayout layout() const {
    MoeLayout l;
    l.expert_offsets = static_cast<const int32_t*>(d_offsets_->get());
    l.sorted_pairs = static_cast<const int32_t*>(d_sorted_->get());
    l.pair_rows = static_cast<const int32_t*>(d_pair_rows_->get());
    l.num_experts = c_.num_experts;
    l.top_k = c_.top_k;
    l.num_tokens = c_.num_tokens;
    return l;
  }

  ExpertGemmWeights weights() const {
    ExpertGemmWeights w;
    w.gate = gated() ? d_gate_->get() : nullptr;
    w.up = d_up_->get();
    w.down = d_down_->get();
    w.intermediate = c_.intermediate;
    w.latent = c_.latent;
    w.num_experts = c_.num_experts;
    if (mxfp4_) {
      w.gate_scales = gated() ? static_cast<const uint8_t*>(d_gate_scales_->get()) : nullptr;
      w.up_scales = static_cast<const uint8_t*>(d_up_scales_->get());
      w.down_scales = static_cast<const uint8_t*>(d_down_scales_->get());
    }
    return w;
  }

  void run(GemmChoice choice, cudaStream_t stream) {
    void* ws = d_workspace_->get();
    const size_t bytes = d_workspace_->bytes();
    detail::grouped_gate_up_variant(choice, c_.dtype, act_, d_z_->get(), layout(), weights(), d_act_->get(), ws, bytes,
                                    stream);
    detail::grouped_down_variant(choice, c_.dtype, d_act_->get(), layout(), weights(), d_y_->get(), ws, bytes, stream);
  }

  // The workspace is allocated before, so that this can run inside graph capture.
  void run_public(cudaStream_t stream) {
    const size_t ws = d_workspace_->bytes();
    grouped_gate_up(c_.dtype, act_, d_z_->get(), layout(), weights(), d_act_->get(), d_workspace_->get(), ws, stream);
    grouped_down(c_.dtype, d_act_->get(), layout(), weights(), d_y_->get(), d_workspace_->get(), ws, stream);
  }

  // Compares both outputs with the fp64 reference (down from the device's act rows, so errors do not
  // compound) and checks that every valid row was written and no row past them was.
  void check(const std::string& what) {
    const size_t el = dtype_size(c_.dtype);
    const int64_t I = c_.intermediate;
    const int64_t l = c_.latent;
    const int64_t E = c_.num_experts;
    const int64_t rows_bound = c_.num_tokens * c_.top_k;
    const int64_t rows = layout_.expert_offsets[E];
    std::vector<unsigned char> act_bytes(std::max<int64_t>(rows_bound, 1) * I * el);
    std::vector<unsigned char> y_bytes(std::max<int64_t>(rows_bound, 1) * l * el);
    ASSERT_EQ(cudaMemcpy(act_bytes.data(), d_act_->get(), act_bytes.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(y_bytes.data(), d_y_->get(), y_bytes.size(), cudaMemcpyDeviceToHost), cudaSuccess);

    double act_err = 0, act_norm = 0, y_err = 0, y_norm = 0;
    int64_t unwritten = 0;
    std::vector<double> a(I);
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t r = layout_.expert_offsets[e]; r < layout_.expert_offsets[e + 1]; ++r) {
        const int64_t token = layout_.sorted_pairs[r] / c_.top_k;
        const double* u = &z_.values[token * l];
        for (int64_t i = 0; i < I; ++i) {
          const double* wu = &up_.values[(e * I + i) * l];
          double g = 0, v = 0;
          if (gated()) {
            const double* wg = &gate_.values[(e * I + i) * l];
            for (int64_t x = 0; x < l; ++x) g += u[x] * wg[x];
          }
          for (int64_t x = 0; x < l; ++x) v += u[x] * wu[x];
          const double ref = activate(act_, g, v);
          const double got = load_as_float(act_bytes.data(), c_.dtype, r * I + i);
          if (std::isnan(got)) ++unwritten;
          act_err += (got - ref) * (got - ref);
          act_norm += ref * ref;
          a[i] = got;
        }
        for (int64_t o = 0; o < l; ++o) {
          const double* wd = &down_.values[(e * l + o) * I];
          double ref = 0;
          for (int64_t i = 0; i < I; ++i) ref += a[i] * wd[i];
          const double got = load_as_float(y_bytes.data(), c_.dtype, r * l + o);
          if (std::isnan(got)) ++unwritten;
          y_err += (got - ref) * (got - ref);
          y_norm += ref * ref;
        }
      }
    }
    EXPECT_EQ(unwritten, 0) << what << ": valid elements left unwritten (NaN poison)";
    if (rows > 0) {
      const double act_rel = std::sqrt(act_err / std::max(act_norm, 1e-300));
      const double y_rel = std::sqrt(y_err / std::max(y_norm, 1e-300));
      EXPECT_LT(act_rel, tolerance(c_.dtype)) << what << ": gate/up relative error";
      EXPECT_LT(y_rel, tolerance(c_.dtype)) << what << ": down relative error";
      EXPECT_GT(act_norm, 0.0) << what;
    }
    // Rows past expert_offsets[E] keep their poison.
    int64_t written_past = 0;
    for (int64_t r = rows; r < rows_bound; ++r) {
      for (int64_t i = 0; i < I; ++i) written_past += !std::isnan(load_as_float(act_bytes.data(), c_.dtype, r * I + i));
      for (int64_t o = 0; o < l; ++o) written_past += !std::isnan(load_as_float(y_bytes.data(), c_.dtype, r * l + o));
    }
    EXPECT_EQ(written_past, 0) << what << ": rows past the last expert's were written";
  }

  const HostLayout& host_layout() const { return layout_; }

 private:
  Case c_;
  std::mt19937 rng_;
  ActivationParams act_;
  HostArray gate_, up_, down_, z_;
  HostLayout layout_;
  std::unique_ptr<DeviceMem> d_gate_, d_up_, d_down_, d_z_, d_act_, d_y_, d_offsets_, d_sorted_, d_pair_rows_,
      d_workspace_;
  bool mxfp4_ = false;
  std::unique_ptr<DeviceMem> d_gate_scales_, d_up_scales_, d_down_scales_;
};

// Runs every choice on fresh poison and checks it, then the public entry points (automatic choice,
// workspace as sized).
void check_choices(Problem& problem, const std::string& name, const std::vector<GemmChoice>& choices) {
  for (const GemmChoice& choice : choices) {
    const std::string what = name + " / " + detail::to_string(choice.variant) + " x" +
                             std::to_string(choice.n_tiles_per_cta) + " split " + std::to_string(choice.k_splits);
    problem.poison();
    problem.run(choice, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
    problem.check(what);
  }
  problem.poison();
  problem.run_public(nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  problem.check(name + " / public");
}

class GroupedGemmCase : public ::testing::TestWithParam<Case> {};

TEST_P(GroupedGemmCase, every_variant_matches_fp64_reference) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
  const Case& c = GetParam();
  Problem problem(c, 1234u + static_cast<uint32_t>(c.num_tokens));
  // Every variant with its own choice of n-tiles per CTA, and the tensor-core ones also with three
  // n-tiles per CTA (a pipeline that runs across n-tile boundaries, the last group partial).
  std::vector<GemmChoice> choices = {GemmChoice(GemmVariant::automatic)};
  for (GemmVariant v : detail::all_variants()) {
    if (detail::is_wgmma(v) && !detail::wgmma_available()) continue;
    if (detail::is_mxfp4_only(v)) {  // refused for weights in the compute dtype (its own test: MXFP4 below)
      EXPECT_THROW(problem.run(GemmChoice(v), nullptr), Error) << c.name;
      continue;
    }
    choices.emplace_back(v);
    if (v != GemmVariant::simt) choices.emplace_back(v, 3);
    // Split-K forced: 2 and 3 splits (the last split shorter when the k-tiles do not divide), on the
    // small-row variants split-K is chosen for (the larger ones' partial tiles outgrow the workspace).
    if (v == GemmVariant::mma_s || v == GemmVariant::mma_s_wide || v == GemmVariant::mma_s_k128 ||
        v == GemmVariant::mma_m32) {
      choices.emplace_back(v, 0, 2);
      choices.emplace_back(v, 0, 3);
    }
  }
  check_choices(problem, c.name, choices);
}

INSTANTIATE_TEST_SUITE_P(
    Cuda_GroupedGemm, GroupedGemmCase,
    ::testing::Values(
        // name, dtype, act, T, E, Z, k, I_r, l, heavy
        Case{"bf16_situ_t17_i192_l1024", DType::bf16, Activation::situ, 17, 8, 1, 3, 192, 1024, -1},
        Case{"bf16_silu_t133_i336_l200", DType::bf16, Activation::silu, 133, 16, 0, 4, 336, 200, 5},
        Case{"f16_relu2_t3_i336_l1024", DType::f16, Activation::relu2, 3, 32, 2, 2, 336, 1024, -1},
        Case{"bf16_relu2_t133_i192_l200_heavy", DType::bf16, Activation::relu2, 133, 8, 2, 2, 192, 200, 3},
        Case{"f16_situ_t1_i384_l1024", DType::f16, Activation::situ, 1, 64, 0, 8, 384, 1024, -1},
        Case{"bf16_silu_t17_i100_l200_odd", DType::bf16, Activation::silu, 17, 6, 0, 2, 100, 200, -1},
        Case{"bf16_situ_t3_i192_l60_odd", DType::bf16, Activation::situ, 3, 5, 1, 2, 192, 60, -1},
        Case{"f32_situ_t17_i192_l200", DType::f32, Activation::situ, 17, 8, 1, 2, 192, 200, 2},
        Case{"f32_relu2_t1_i336_l1024", DType::f32, Activation::relu2, 1, 4, 0, 2, 336, 1024, -1},
        Case{"f32_silu_t133_i336_l200", DType::f32, Activation::silu, 133, 12, 1, 3, 336, 200, -1},
        // Experts of 100-300 rows (several 128-row wgmma tiles and every N from 16 to 128), I_r and l
        // multiples of 8 but not of 64 (partial n-tiles, a warpgroup with few or no valid weight rows, a
        // partial last k-step).
        Case{"bf16_situ_t300_i200_l264_heavy", DType::bf16, Activation::situ, 300, 8, 1, 2, 200, 264, 2},
        Case{"f16_relu2_t160_i136_l456_heavy", DType::f16, Activation::relu2, 160, 4, 0, 2, 136, 456, 1},
        Case{"bf16_silu_t257_i328_l136", DType::bf16, Activation::silu, 257, 6, 0, 3, 328, 136, -1},
        // Experts of 250-520 rows: the tall wgmma tiles at N = 256 (6 padded rows), several tall tiles per
        // expert with a last one of 8 rows, gated n-tiles of 64 columns whose last holds 8 (one warpgroup
        // without a valid column), a partial last k-step.
        Case{"bf16_silu_t520_i200_l136_tall", DType::bf16, Activation::silu, 520, 4, 0, 3, 200, 136, 0},
        Case{"f16_situ_t250_i72_l200_tall", DType::f16, Activation::situ, 250, 2, 0, 2, 72, 200, -1},
        Case{"bf16_relu2_t300_i264_l328_tall", DType::bf16, Activation::relu2, 300, 3, 0, 2, 264, 328, -1},
        // 16 rows per expert and 384+ output columns: the automatic choice is wgmma on an H200.
        Case{"bf16_silu_t64_i384_l512_auto", DType::bf16, Activation::silu, 64, 8, 0, 2, 384, 512, -1}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// MXFP4 weights on the tensor-core kernels (issue 16's prefill path): the three instantiated tile shapes,
// several n-tiles per CTA, forced split-K, the automatic choice, against the fp64 loop over the decoded
// weights; odd shapes (a partial n-tile, l of 5 and 17 scale groups: a partial last k-tile); other
// variants and f32 are refused.
TEST(Cuda_GroupedGemm, mxfp4_weights_match_fp64_reference_on_every_instance) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
  const Case cases[] = {
      // name, dtype, act, T, E, Z, k, I_r, l, heavy
      Case{"mxfp4_bf16_situ_t17_i192_l1024", DType::bf16, Activation::situ, 17, 8, 1, 3, 192, 1024, -1},
      Case{"mxfp4_f16_relu2_t133_i192_l544_heavy", DType::f16, Activation::relu2, 133, 8, 2, 2, 192, 544, 3},
      Case{"mxfp4_bf16_silu_t300_i96_l160", DType::bf16, Activation::silu, 300, 4, 0, 2, 96, 160, -1},
      // Whole 128-column steps (the scale words aligned), experts of ~27 rows (a pass of 16 and one of 11:
      // both n8-tile counts of mxfp4_rows), several 64-row blocks per CTA in the down projection.
      Case{"mxfp4_bf16_situ_t40_i256_l512", DType::bf16, Activation::situ, 40, 3, 0, 2, 256, 512, -1},
      // One and two tokens, few output columns and a long K: mxfp4_rows splits the gate/up reduction on its
      // own (4 touched experts x 2 blocks leave most SMs idle); l of 35 groups: a partial last step.
      Case{"mxfp4_bf16_situ_t1_i128_l2048", DType::bf16, Activation::situ, 1, 16, 0, 4, 128, 2048, -1},
      Case{"mxfp4_f16_silu_t2_i96_l1120", DType::f16, Activation::silu, 2, 8, 0, 3, 96, 1120, -1},
  };
  for (const Case& c : cases) {
    ASSERT_TRUE(grouped_mxfp4_supported(c.dtype, c.intermediate, c.latent)) << c.name;
    Problem problem(c, 99u + static_cast<uint32_t>(c.num_tokens), /*mxfp4=*/true);
    std::vector<GemmChoice> choices = {
        GemmChoice(GemmVariant::automatic), GemmChoice(GemmVariant::mma_s_wide), GemmChoice(GemmVariant::mma_s_wide, 3),
        GemmChoice(GemmVariant::mma_s_wide, 0, 2), GemmChoice(GemmVariant::mma_m), GemmChoice(GemmVariant::mma_m, 3),
        GemmChoice(GemmVariant::mma_l4), GemmChoice(GemmVariant::mma_l4, 2), GemmChoice(GemmVariant::mxfp4_rows),
        GemmChoice(GemmVariant::mxfp4_rows, 1),
        // mxfp4_rows with the reduction split (the sums of 2, 3 and every k-step's CTA added by the last).
        GemmChoice(GemmVariant::mxfp4_rows, 0, 2), GemmChoice(GemmVariant::mxfp4_rows, 1, 3),
        GemmChoice(GemmVariant::mxfp4_rows, 0, 64),
        // Its copies without an L2 prefetch, codes with 128 and with 256 bytes, codes and scales with 128
        // (GemmChoice::option 1-4).
        GemmChoice(GemmVariant::mxfp4_rows, 0, 0, 1), GemmChoice(GemmVariant::mxfp4_rows, 0, 3, 2),
        GemmChoice(GemmVariant::mxfp4_rows, 0, 0, 3), GemmChoice(GemmVariant::mxfp4_rows, 0, 0, 4),
        GemmChoice(GemmVariant::mxfp4_rows, 0, 2, 4)};
    if (detail::wgmma_available()) {  // the Hopper kernels decode into their swizzled weight tiles
      // wgmma_ws and wgmma_ws_tall: their producer warpgroup decodes; one CTA per SM, at least 3 tiles per CTA,
      // and one CTA walking every tile (its raw-copy cursor running ahead across the tiles).
      for (const GemmChoice& wgmma :
           {GemmChoice(GemmVariant::wgmma), GemmChoice(GemmVariant::wgmma, 3), GemmChoice(GemmVariant::wgmma_tall),
            GemmChoice(GemmVariant::wgmma_tall, 2), GemmChoice(GemmVariant::wgmma_narrow),
            GemmChoice(GemmVariant::wgmma_narrow, 3), GemmChoice(GemmVariant::wgmma_ws),
            GemmChoice(GemmVariant::wgmma_ws, 3), GemmChoice(GemmVariant::wgmma_ws, 1 << 20),
            GemmChoice(GemmVariant::wgmma_ws_tall), GemmChoice(GemmVariant::wgmma_ws_tall, 3),
            GemmChoice(GemmVariant::wgmma_ws_tall, 1 << 20),
            // The down projection's rows by cp.async (option bit 2) instead of TMA.
            GemmChoice(GemmVariant::wgmma_ws, 3, 0, 2), GemmChoice(GemmVariant::wgmma_ws_tall, 0, 0, 2)})
        choices.push_back(wgmma);
    }
    check_choices(problem, c.name, choices);
    EXPECT_THROW(problem.run(GemmChoice(GemmVariant::mma_l), nullptr), Error) << c.name;
    EXPECT_THROW(problem.run(GemmChoice(GemmVariant::simt), nullptr), Error) << c.name;  // never reads codes as bf16
    EXPECT_THROW(problem.run(GemmChoice(GemmVariant::mxfp4_rows, 2), nullptr), Error) << c.name;  // one CTA shape
    // Options a variant does not have: refused, never ignored.
    EXPECT_THROW(problem.run(GemmChoice(GemmVariant::mxfp4_rows, 0, 0, 5), nullptr), Error) << c.name;
    EXPECT_THROW(problem.run(GemmChoice(GemmVariant::mxfp4_rows, 0, 0, -1), nullptr), Error) << c.name;
    EXPECT_THROW(problem.run(GemmChoice(GemmVariant::mma_m, 0, 0, 1), nullptr), Error) << c.name;
  }
  // Scale bytes past 128 among the others (whole 128-column steps: the aligned scale words). mxfp4_rows: the steps
  // that hold one take the fp32 scale path instead of folding the scales into its bf16 operands, with and without
  // split-K. The tile kernels' decode (mxfp4_decode8): a group with one takes the two-multiply path, the others
  // the one-multiply path.
  for (int every : {5, 97}) {
    const Case c{"mxfp4_bf16_silu_t40_i256_l512_big_scales", DType::bf16, Activation::silu, 40, 3, 0, 2, 256, 512, -1};
    Problem problem(c, 7u + static_cast<uint32_t>(every), /*mxfp4=*/true, every);
    std::vector<GemmChoice> choices = {GemmChoice(GemmVariant::mxfp4_rows, 1),
                                       GemmChoice(GemmVariant::mxfp4_rows, 0, 3),
                                       GemmChoice(GemmVariant::mxfp4_rows, 0, 0, 1),
                                       GemmChoice(GemmVariant::mxfp4_rows, 0, 0, 4),
                                       GemmChoice(GemmVariant::mma_m),
                                       GemmChoice(GemmVariant::mma_l4)};
    if (detail::wgmma_available()) {
      for (GemmVariant v :
           {GemmVariant::wgmma, GemmVariant::wgmma_narrow, GemmVariant::wgmma_ws, GemmVariant::wgmma_ws_tall})
        choices.push_back(GemmChoice(v));
    }
    check_choices(problem, c.name + " every " + std::to_string(every), choices);
  }
  // The automatic MXFP4 shape follows the rows per touched expert (kimi-k3 tp-shard 8: E 896, k 16).
  EXPECT_EQ(detail::choose_mxfp4_variant(DType::bf16, false, true, 9, 16, 896, 384, 3584), GemmVariant::mxfp4_rows);
  EXPECT_EQ(detail::choose_mxfp4_variant(DType::bf16, false, true, 256, 16, 896, 384, 3584), GemmVariant::mxfp4_rows);
  // 1024 tokens: 18 rows per expert, the last count the rows kernel takes (kMxfp4RowsMaxMeanRows).
  EXPECT_EQ(detail::choose_mxfp4_variant(DType::bf16, true, false, 1024, 16, 896, 384, 3584), GemmVariant::mxfp4_rows);
  EXPECT_EQ(detail::choose_mxfp4_variant(DType::bf16, false, true, 1024, 16, 896, 336, 3584), GemmVariant::mxfp4_rows);
  // Above 18 rows per expert: the narrow wgmma tiles on Hopper (at least 384 output columns), else mma.sync.
  const bool hopper = detail::wgmma_available();
  EXPECT_EQ(detail::choose_mxfp4_variant(DType::bf16, true, false, 2048, 16, 896, 384, 3584),
            hopper ? GemmVariant::wgmma_narrow : GemmVariant::mma_m);
  EXPECT_EQ(detail::choose_mxfp4_variant(DType::bf16, false, true, 4096, 16, 896, 384, 3584),
            hopper ? GemmVariant::wgmma_narrow : GemmVariant::mma_l4);
  EXPECT_EQ(detail::choose_mxfp4_variant(DType::bf16, false, true, 4096, 16, 896, 336, 3584), GemmVariant::mma_l4);
  // Above 96 rows (kMxfp4WsTallMinMeanRows) the persistent tall tiles on Hopper: Kimi-K3 at 6144 and 8192 tokens (109,
  // 146 rows), Nemotron3-super tp-shard 1 (E 512, k 22, I_r 2688, l 1024) at 4096 (176 rows), not at 2048 (88 rows);
  // an intermediate that is not a multiple of 32 keeps the mma.sync tiles.
  EXPECT_EQ(detail::choose_mxfp4_variant(DType::bf16, false, true, 6144, 16, 896, 384, 3584),
            hopper ? GemmVariant::wgmma_ws_tall : GemmVariant::mma_l4);
  EXPECT_EQ(detail::choose_mxfp4_variant(DType::bf16, false, true, 8192, 16, 896, 384, 3584),
            hopper ? GemmVariant::wgmma_ws_tall : GemmVariant::mma_l4);
  EXPECT_EQ(detail::choose_mxfp4_variant(DType::bf16, true, false, 8192, 16, 896, 384, 3584),
            hopper ? GemmVariant::wgmma_ws_tall : GemmVariant::mma_l4);
  EXPECT_EQ(detail::choose_mxfp4_variant(DType::bf16, false, false, 4096, 22, 512, 2688, 1024),
            hopper ? GemmVariant::wgmma_ws_tall : GemmVariant::mma_l4);
  EXPECT_EQ(detail::choose_mxfp4_variant(DType::bf16, true, false, 4096, 22, 512, 2688, 1024),
            hopper ? GemmVariant::wgmma_ws_tall : GemmVariant::mma_l4);
  EXPECT_EQ(detail::choose_mxfp4_variant(DType::bf16, false, false, 2048, 22, 512, 2688, 1024),
            hopper ? GemmVariant::wgmma_narrow : GemmVariant::mma_l4);
  EXPECT_EQ(detail::choose_mxfp4_variant(DType::bf16, false, true, 8192, 16, 896, 336, 3584), GemmVariant::mma_l4);
  EXPECT_EQ(detail::choose_mxfp4_variant(DType::bf16, false, true, 2048, 16, 896, 336, 3584), GemmVariant::mma_m);
  EXPECT_FALSE(grouped_mxfp4_supported(DType::f32, 192, 1024));
  EXPECT_FALSE(grouped_mxfp4_supported(DType::bf16, 200, 1024));  // I_r not a multiple of 32
}

// The persistent kernels' L2 handling of their weights (detail::ws_weight_l2): a short reduction (the down projections
// at tp-shard 8) at normal priority without the promotion, a longer one evict-first with it, the option bits forcing
// either way. Host only: runs without a GPU too.
TEST(Cuda_GroupedGemm, wgmma_ws_weight_l2_handling_by_reduction_length) {
  auto is = [](detail::WsWeightL2 got, bool normal, bool promote) {
    return got.normal_priority == normal && got.promote == promote;
  };
  EXPECT_TRUE(is(detail::ws_weight_l2(0, 336), true, false));  // Nemotron's down at tp-shard 8
  EXPECT_TRUE(is(detail::ws_weight_l2(0, 384), true, false));  // Kimi-K3's
  EXPECT_TRUE(is(detail::ws_weight_l2(0, detail::kWsShortReductionK), true, false));
  EXPECT_TRUE(is(detail::ws_weight_l2(0, detail::kWsShortReductionK + 8), false, true));
  EXPECT_TRUE(is(detail::ws_weight_l2(0, 1024), false, true));  // Nemotron's gate/up
  EXPECT_TRUE(is(detail::ws_weight_l2(16, 336), false, true));  // the old handling, whatever K
  EXPECT_TRUE(is(detail::ws_weight_l2(4, 1024), true, true));
  EXPECT_TRUE(is(detail::ws_weight_l2(8, 1024), false, false));
  EXPECT_TRUE(is(detail::ws_weight_l2(12, 7168), true, false));
  EXPECT_TRUE(is(detail::ws_weight_l2(1 | 2, 336), true, false));  // the epilogue and rows bits change nothing here
  EXPECT_TRUE(is(detail::ws_weight_l2(1 | 2, 2688), false, true));
}

// The settings registry declares the decode kernels' token bound the backend applies when the variable is
// unset (the registry, in core, cannot name the CUDA constant). Host only: runs without a GPU too.
TEST(Cuda_GroupedGemm, mxfp4_decode_token_bound_is_the_registrys_default) {
  EXPECT_EQ(latentmoe::detail::setting_spec(latentmoe::detail::Setting::mxfp4_decode_max_tokens).fallback,
            int64_t{kMxfp4DecodeTokens});
  EXPECT_LE(kMxfp4DecodeTokens,
            latentmoe::detail::setting_spec(latentmoe::detail::Setting::mxfp4_decode_max_tokens).max);
}

// Captures `enqueue` into a CUDA graph once and replays it three times, with a new layout and new inputs
// written into the same buffers before the second and third replay, checking every replay.
void check_graph_replays(Problem& problem, const std::function<void(cudaStream_t)>& enqueue, const std::string& what) {
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  enqueue(stream);
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    if (replay > 0) problem.new_inputs();
    problem.poison();
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    problem.check(what + " " + std::to_string(replay));
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(Cuda_GroupedGemm, graph_replay_with_new_layout) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
  const Case c{"graph", DType::bf16, Activation::situ, 64, 24, 1, 4, 192, 1024, 7};
  Problem problem(c, 99u);
  check_graph_replays(
      problem, [&](cudaStream_t stream) { problem.run_public(stream); }, "graph replay");
}

// The MXFP4 rows kernel reads its experts' row counts on the device: a replay with a new layout and new
// activations (experts of 0 to ~40 rows, one chosen by every token) must follow them.
TEST(Cuda_GroupedGemm, mxfp4_rows_graph_replay_with_new_layout) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
  const Case c{"graph_mxfp4", DType::bf16, Activation::situ, 37, 24, 1, 4, 192, 1024, 7};
  Problem problem(c, 77u, /*mxfp4=*/true);
  check_graph_replays(
      problem, [&](cudaStream_t stream) { problem.run(GemmChoice(GemmVariant::mxfp4_rows), stream); },
      "mxfp4_rows graph replay");
  // Split-K: the tile counters must be back at zero after every replay, for new row counts too.
  check_graph_replays(
      problem, [&](cudaStream_t stream) { problem.run(GemmChoice(GemmVariant::mxfp4_rows, 0, 3), stream); },
      "mxfp4_rows split-K graph replay");
  check_graph_replays(
      problem, [&](cudaStream_t stream) { problem.run(GemmChoice(GemmVariant::mxfp4_rows, 0, 2, 1), stream); },
      "mxfp4_rows split-K graph replay, no L2 prefetch");
}

// The persistent warp-specialised kernel (wgmma_ws, and its tall shape wgmma_ws_tall) walks a static tile schedule
// computed on the device. Its grid
// is one CTA per SM, or smaller when GemmChoice::n_tiles_per_cta asks for at least that many tiles per CTA: one
// CTA walking every tile (its mbarrier ring wrapping many times, the tiles' k-steps (5 here) not a multiple of the
// 4 stages, so the stage and parity of a tile's first step differ from tile to tile), 3 and 7 CTAs (tile counts
// that do not divide); and, on the other side, grids larger than the tiles there are (experts mostly empty, most
// pairs routed to no expert), so that some CTAs get no tile at all. Both epilogues: through shared memory (the
// default) and from registers (GemmChoice::option 1); the down projection's rows by TMA (the default: boxes of 32
// rows running past the tile's rows into the next expert's, or past the last row into zeros) and by cp.async (option
// 2).
TEST(Cuda_GroupedGemm, wgmma_ws_persistent_schedule) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
  if (!detail::wgmma_available()) GTEST_SKIP() << "no sm_90a device";
  std::vector<GemmChoice> small_grids;
  for (GemmVariant v : {GemmVariant::wgmma_ws, GemmVariant::wgmma_ws_tall}) {
    for (int per_cta : {1 << 20, 7, 3, 0}) small_grids.emplace_back(v, per_cta);
    small_grids.emplace_back(v, 3, 0, /*option: the register epilogue*/ 1);
    // The down projection's contiguous rows by cp.async instead of TMA (option bit 2), alone and with bit 1.
    small_grids.emplace_back(v, 3, 0, 2);
    small_grids.emplace_back(v, 0, 0, 3);
    // The weights' L2 priority and promotion (bits 4 and 8, and 16 the old handling: the same results).
    small_grids.emplace_back(v, 0, 0, 12);
    small_grids.emplace_back(v, 3, 0, 16);
  }
  const Case many_tiles[] = {
      // name, dtype, act, T, E, Z, k, I_r, l, heavy
      // Experts of ~150-300 rows (two or three 128-row tiles, the last partial), 2 n-tiles of gate/up and down.
      Case{"ws_bf16_silu_t300_i200_l264", DType::bf16, Activation::silu, 300, 5, 0, 2, 200, 264, 1},
      Case{"ws_f16_relu2_t257_i456_l328", DType::f16, Activation::relu2, 257, 7, 0, 3, 456, 328, -1},
      Case{"ws_bf16_situ_t129_i136_l520", DType::bf16, Activation::situ, 129, 3, 0, 2, 136, 520, 0},
      // Experts of ~400 rows: two 256-row tall tiles each (the last partial), gated n-tiles of 64 columns whose
      // last holds 8 (one consumer without a valid column).
      Case{"ws_tall_bf16_situ_t600_i136_l200", DType::bf16, Activation::situ, 600, 3, 0, 2, 136, 200, -1},
  };
  for (const Case& c : many_tiles) {
    Problem problem(c, 4242u + static_cast<uint32_t>(c.num_tokens));
    check_choices(problem, c.name, small_grids);
  }
  const Case idle_ctas[] = {
      // One expert of 40 rows, ~40 more rows spread over 63 experts: the host's bound (65 row tiles) is about
      // twice the tiles there are.
      Case{"ws_bf16_silu_t40_e64_heavy", DType::bf16, Activation::silu, 40, 64, 0, 2, 192, 256, 0},
      // 200 of 216 ids route to no expert: most pairs have no row, most experts are empty, one CTA per SM.
      Case{"ws_f16_situ_t33_e16_z200", DType::f16, Activation::situ, 33, 16, 200, 4, 384, 136, -1},
      // One token: one row tile of 2 rows (N = 8), the rest of the grid idle.
      Case{"ws_bf16_relu2_t1_e8", DType::bf16, Activation::relu2, 1, 8, 0, 2, 264, 200, -1},
  };
  for (const Case& c : idle_ctas) {
    Problem problem(c, 777u + static_cast<uint32_t>(c.num_tokens));
    check_choices(problem, c.name,
                  {GemmChoice(GemmVariant::wgmma_ws), GemmChoice(GemmVariant::wgmma_ws, 2),
                   GemmChoice(GemmVariant::wgmma_ws_tall), GemmChoice(GemmVariant::wgmma_ws_tall, 2)});
    // Option bits it does not have: refused, never ignored.
    EXPECT_THROW(problem.run(GemmChoice(GemmVariant::wgmma_ws_tall, 0, 0, 32), nullptr), Error) << c.name;
    EXPECT_THROW(problem.run(GemmChoice(GemmVariant::wgmma_ws_tall, 0, 0, 20), nullptr), Error) << c.name;
    EXPECT_THROW(problem.run(GemmChoice(GemmVariant::wgmma_ws, 0, 0, 24), nullptr), Error) << c.name;
    EXPECT_THROW(problem.run(GemmChoice(GemmVariant::wgmma_ws, 0, 0, -1), nullptr), Error) << c.name;
  }
}

// wgmma_ws reads the experts' row counts on the device: a replay with a new layout must follow them.
TEST(Cuda_GroupedGemm, wgmma_ws_graph_replay_with_new_layout) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
  if (!detail::wgmma_available()) GTEST_SKIP() << "no sm_90a device";
  const Case c{"graph_ws", DType::bf16, Activation::situ, 150, 24, 1, 4, 192, 1024, 7};
  for (GemmVariant v : {GemmVariant::wgmma_ws, GemmVariant::wgmma_ws_tall}) {
    const std::string name = detail::to_string(v);
    Problem problem(c, 31u);
    check_graph_replays(
        problem, [&](cudaStream_t stream) { problem.run(GemmChoice(v), stream); }, name + " graph replay");
    Problem small_grid(c, 32u);
    check_graph_replays(
        small_grid, [&](cudaStream_t stream) { small_grid.run(GemmChoice(v, 5), stream); },
        name + " (at least 5 tiles per CTA) graph replay");
  }
}

// wgmma_ws keeps a per-expert prefix in shared memory: more experts than it holds are refused with a message.
TEST(Cuda_GroupedGemm, wgmma_ws_refuses_too_many_experts) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
  if (!detail::wgmma_available()) GTEST_SKIP() << "no sm_90a device";
  const Case c{"ws_too_many_experts", DType::bf16, Activation::silu, 2, 4097, 0, 1, 8, 8, -1};
  Problem problem(c, 5u);
  EXPECT_THROW(problem.run(GemmChoice(GemmVariant::wgmma_ws), nullptr), Error);
  EXPECT_THROW(problem.run(GemmChoice(GemmVariant::wgmma_ws_tall), nullptr), Error);
}

// The same with MXFP4 weights (the producer decodes them): new layouts on replay, and a CTA walking many tiles.
TEST(Cuda_GroupedGemm, wgmma_ws_mxfp4_graph_replay_with_new_layout) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
  if (!detail::wgmma_available()) GTEST_SKIP() << "no sm_90a device";
  const Case c{"graph_ws_mxfp4", DType::f16, Activation::silu, 150, 24, 1, 4, 192, 1024, 7};
  for (GemmVariant v : {GemmVariant::wgmma_ws, GemmVariant::wgmma_ws_tall}) {
    const std::string name = detail::to_string(v);
    Problem problem(c, 33u, /*mxfp4=*/true);
    check_graph_replays(
        problem, [&](cudaStream_t stream) { problem.run(GemmChoice(v), stream); }, name + " MXFP4 graph replay");
    Problem small_grid(c, 34u, /*mxfp4=*/true);
    check_graph_replays(
        small_grid, [&](cudaStream_t stream) { small_grid.run(GemmChoice(v, 5), stream); },
        name + " MXFP4 (at least 5 tiles per CTA) graph replay");
  }
}

TEST(Cuda_GroupedGemm, no_tokens_launches_nothing) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
  MoeLayout layout;
  layout.num_experts = 4;
  layout.top_k = 2;
  layout.num_tokens = 0;
  ExpertGemmWeights w;
  w.num_experts = 4;
  w.intermediate = 64;
  w.latent = 64;
  latentmoe::detail::ActivationParams act;
  EXPECT_NO_THROW(grouped_gate_up(DType::bf16, act, nullptr, layout, w, nullptr, nullptr, 0, nullptr));
  EXPECT_NO_THROW(grouped_down(DType::bf16, nullptr, layout, w, nullptr, nullptr, 0, nullptr));
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// Argument checks run before any CUDA call, so these run without a GPU too.
TEST(Cuda_GroupedGemm, rejects_bad_arguments) {
  MoeLayout layout;
  layout.num_experts = 4;
  layout.top_k = 2;
  layout.num_tokens = 3;
  int32_t dummy = 0;
  layout.expert_offsets = &dummy;
  layout.sorted_pairs = &dummy;
  ExpertGemmWeights w;
  w.num_experts = 5;  // disagrees with the layout
  w.intermediate = 64;
  w.latent = 64;
  w.up = &dummy;
  w.gate = &dummy;
  w.down = &dummy;
  latentmoe::detail::ActivationParams act;
  EXPECT_THROW(grouped_gate_up(DType::bf16, act, &dummy, layout, w, &dummy, nullptr, 0, nullptr), Error);
  w.num_experts = 4;
  EXPECT_THROW(grouped_down(DType::i32, &dummy, layout, w, &dummy, nullptr, 0, nullptr), Error);
  w.gate = nullptr;  // a gated activation needs the gate weights
  EXPECT_THROW(grouped_gate_up(DType::bf16, act, &dummy, layout, w, &dummy, nullptr, 0, nullptr), Error);
  w.down = nullptr;
  EXPECT_THROW(grouped_down(DType::bf16, &dummy, layout, w, &dummy, nullptr, 0, nullptr), Error);
}

TEST(Cuda_GroupedGemm, automatic_choice_follows_dtype_and_shape) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
  int device = 0, major = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  EXPECT_EQ(detail::choose_variant(DType::f32, false, true, 64, 16, 896, 384, 3584), GemmVariant::simt);
  EXPECT_EQ(detail::choose_variant(DType::bf16, false, true, 64, 16, 896, 100, 3584), GemmVariant::simt);
  if (major >= 8)
    EXPECT_NE(detail::choose_variant(DType::bf16, false, true, 64, 16, 896, 384, 3584), GemmVariant::simt);
  // Hopper: the wgmma kernel from 16 rows per touched expert and 384 output columns (Kimi at 1024
  // tokens); mma.sync below either (Kimi at 256 tokens, Nemotron's 336-column gate/up).
  if (detail::wgmma_available()) {
    EXPECT_EQ(detail::choose_variant(DType::bf16, false, true, 1024, 16, 896, 384, 3584), GemmVariant::wgmma);
    EXPECT_EQ(detail::choose_variant(DType::bf16, true, false, 1024, 16, 896, 384, 3584), GemmVariant::wgmma);
    EXPECT_NE(detail::choose_variant(DType::bf16, false, true, 256, 16, 896, 384, 3584), GemmVariant::wgmma);
    EXPECT_NE(detail::choose_variant(DType::bf16, false, false, 1024, 22, 512, 336, 1024), GemmVariant::wgmma);
    // Nemotron (relu2, a latent of 1024): the warp-specialised tall tiles for the gate/up above 64 rows per expert
    // (2048, 4096, 8192 tokens: 88, 176, 352 rows; mma.sync at 1024 tokens, 44), and for the down projection above 32
    // rows with a short reduction (tp-shard 8: I_r 336) and above 64 with a long one (tp-shard 1: 2688). From 8 to 16
    // rows (256 tokens, 11) not the decode-sized mma_s_wide: the gate/up mma_m (336 columns) or wgmma (2688), the
    // down wgmma_ws with a short reduction (up to 32 rows: 512 tokens, 22) and wgmma with a long one. Below 8 rows
    // (128 tokens, 5) mma_s_wide.
    EXPECT_EQ(detail::choose_variant(DType::bf16, false, false, 2048, 22, 512, 336, 1024), GemmVariant::wgmma_ws_tall);
    EXPECT_EQ(detail::choose_variant(DType::bf16, false, false, 4096, 22, 512, 336, 1024), GemmVariant::wgmma_ws_tall);
    EXPECT_EQ(detail::choose_variant(DType::bf16, false, false, 8192, 22, 512, 336, 1024), GemmVariant::wgmma_ws_tall);
    EXPECT_EQ(detail::choose_variant(DType::bf16, false, false, 8192, 22, 512, 2688, 1024), GemmVariant::wgmma_ws_tall);
    EXPECT_EQ(detail::choose_variant(DType::bf16, false, false, 1024, 22, 512, 336, 1024), GemmVariant::mma_m);
    EXPECT_EQ(detail::choose_variant(DType::bf16, true, false, 8192, 22, 512, 336, 1024), GemmVariant::wgmma_ws_tall);
    EXPECT_EQ(detail::choose_variant(DType::bf16, true, false, 4096, 22, 512, 336, 1024), GemmVariant::wgmma_ws_tall);
    EXPECT_EQ(detail::choose_variant(DType::bf16, true, false, 1024, 22, 512, 336, 1024), GemmVariant::wgmma_ws_tall);
    EXPECT_EQ(detail::choose_variant(DType::bf16, true, false, 256, 22, 512, 336, 1024), GemmVariant::wgmma_ws);
    EXPECT_EQ(detail::choose_variant(DType::bf16, true, false, 512, 22, 512, 336, 1024), GemmVariant::wgmma_ws);
    EXPECT_EQ(detail::choose_variant(DType::bf16, true, false, 128, 22, 512, 336, 1024), GemmVariant::mma_s_wide);
    EXPECT_EQ(detail::choose_variant(DType::bf16, false, false, 256, 22, 512, 336, 1024), GemmVariant::mma_m);
    EXPECT_EQ(detail::choose_variant(DType::bf16, false, false, 128, 22, 512, 336, 1024), GemmVariant::mma_s_wide);
    EXPECT_EQ(detail::choose_variant(DType::bf16, false, false, 256, 22, 512, 2688, 1024), GemmVariant::wgmma);
    EXPECT_EQ(detail::choose_variant(DType::bf16, true, false, 256, 22, 512, 2688, 1024), GemmVariant::wgmma);
    // Kimi-K3 below 16 rows keeps mma_s_wide (256 tokens, 4 rows; 512, 9).
    EXPECT_EQ(detail::choose_variant(DType::bf16, false, true, 512, 16, 896, 384, 3584), GemmVariant::mma_s_wide);
    EXPECT_EQ(detail::choose_variant(DType::bf16, true, false, 512, 16, 896, 384, 3584), GemmVariant::mma_s_wide);
    EXPECT_EQ(detail::choose_variant(DType::bf16, true, false, 8192, 22, 512, 2688, 1024), GemmVariant::wgmma_ws_tall);
    EXPECT_EQ(detail::choose_variant(DType::bf16, true, false, 2048, 22, 512, 2688, 1024), GemmVariant::wgmma_ws_tall);
    EXPECT_EQ(detail::choose_variant(DType::bf16, true, false, 1024, 22, 512, 2688, 1024), GemmVariant::wgmma);
    EXPECT_EQ(detail::choose_variant(DType::bf16, false, true, 4096, 16, 896, 384, 3584), GemmVariant::wgmma);
    // Kimi-K3 (gated, a latent of 3584), experts larger than the 96-row tiles hold (the 160-row warp-specialised
    // tiles): gate/up above 96 rows (8192 tokens, 146, both shards), the down projection with a short reduction
    // above 64 rows (tp-shard 8: 73 rows at 4096 tokens; the 96-row tiles at 36, 2048 tokens); a long reduction keeps
    // wgmma_tall (tp-shard 1: I_r 3072).
    EXPECT_EQ(detail::choose_variant(DType::bf16, true, false, 4096, 16, 896, 384, 3584), GemmVariant::wgmma_ws);
    EXPECT_EQ(detail::choose_variant(DType::bf16, true, false, 2048, 16, 896, 384, 3584), GemmVariant::wgmma);
    EXPECT_EQ(detail::choose_variant(DType::f16, false, true, 8192, 16, 896, 384, 3584), GemmVariant::wgmma_ws);
    EXPECT_EQ(detail::choose_variant(DType::bf16, false, true, 8192, 16, 896, 3072, 3584), GemmVariant::wgmma_ws);
    EXPECT_EQ(detail::choose_variant(DType::bf16, true, false, 8192, 16, 896, 384, 3584), GemmVariant::wgmma_ws);
    EXPECT_EQ(detail::choose_variant(DType::bf16, true, false, 8192, 16, 896, 3072, 3584), GemmVariant::wgmma_tall);
    // Never for more experts than the persistent kernels take (their per-expert prefix in shared memory): 8192
    // experts with 128 rows each keep wgmma, and a Nemotron-shaped down of 8192 experts with 88 rows the 96-row tiles.
    EXPECT_EQ(detail::choose_variant(DType::bf16, false, true, 65536, 16, 8192, 384, 3584), GemmVariant::wgmma);
    EXPECT_EQ(detail::choose_variant(DType::bf16, true, false, 65536, 16, 8192, 384, 3584), GemmVariant::wgmma_tall);
    EXPECT_EQ(detail::choose_variant(DType::bf16, true, false, 32768, 22, 8192, 336, 1024), GemmVariant::wgmma);
    // Nemotron-shaped with 8192 experts and 176 rows each: relu2's gate/up on wgmma_tall, a long-reduction down too.
    EXPECT_EQ(detail::choose_variant(DType::bf16, false, false, 65536, 22, 8192, 336, 1024), GemmVariant::wgmma_tall);
    EXPECT_EQ(detail::choose_variant(DType::bf16, true, false, 65536, 22, 8192, 2688, 1024), GemmVariant::wgmma_tall);
  } else {
    EXPECT_NE(detail::choose_variant(DType::bf16, false, true, 1024, 16, 896, 384, 3584), GemmVariant::wgmma);
  }
}

// Split-K inside a CUDA graph: the tile counters must be back at zero after every replay, or the
// next replay's last-arriving CTA would be the wrong one and its sums incomplete.
TEST(Cuda_GroupedGemm, split_k_graph_replays_reset_the_counters) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device";
  const Case c{"split_graph", DType::bf16, Activation::silu, 3, 16, 0, 2, 192, 1024, -1};
  Problem problem(c, 77u);
  check_graph_replays(
      problem, [&](cudaStream_t stream) { problem.run(GemmChoice(GemmVariant::mma_s, 0, 4), stream); },
      "split-K graph replay");
}

TEST(Cuda_GroupedGemm, split_choice_fills_one_wave) {
  EXPECT_EQ(detail::choose_k_splits(400, 112, 396), 1);  // the tiles fill the GPU already
  EXPECT_EQ(detail::choose_k_splits(199, 112, 396), 1);  // over half of it
  EXPECT_EQ(detail::choose_k_splits(56, 112, 396), 7);   // 392 CTAs: one wave
  EXPECT_EQ(detail::choose_k_splits(112, 56, 396), 3);   // 336 CTAs, not a second wave
  EXPECT_EQ(detail::choose_k_splits(112, 12, 396), 3);   // capped: at least 4 k-tiles per split
  EXPECT_EQ(detail::choose_k_splits(56, 7, 396), 1);     // too short to split
  EXPECT_EQ(detail::choose_k_splits(0, 100, 396), 1);
}

}  // namespace
}  // namespace latentmoe::cuda

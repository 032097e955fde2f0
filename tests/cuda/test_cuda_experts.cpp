// The MoE layout kernels (counting sort of (token, slot) pairs by expert) and routed_experts (layout,
// grouped GEMMs, weighted combine) against the CPU reference.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "cuda/backend/cuda_backend.h"
#include "cuda/kernels/elementwise.h"
#include "cuda/kernels/moe_layout.h"
#include "cuda_test_util.h"
#include "latentmoe/error.h"

namespace latentmoe::cuda::testing {
namespace {

using ::latentmoe::detail::ActivationParams;
using ::latentmoe::detail::make_cpu_backend;
using ::latentmoe::detail::MlpWeights;

// topk_ids [tokens, k]: k distinct ids per token from [0, E + Z) (ids >= E are zero experts).
HostTensor random_ids(int64_t tokens, int64_t k, int64_t num_experts, int64_t num_zero_experts, uint32_t seed) {
  HostTensor ids(DType::i32, {tokens, k});
  std::mt19937 generator(seed);
  std::vector<int32_t> all(static_cast<size_t>(num_experts + num_zero_experts));
  std::iota(all.begin(), all.end(), 0);
  for (int64_t t = 0; t < tokens; ++t) {
    std::shuffle(all.begin(), all.end(), generator);
    std::copy_n(all.begin(), k, ids.data_as<int32_t>() + t * k);
  }
  return ids;
}

class CudaExperts : public ::testing::Test {
 protected:
  void SetUp() override {
    LATENTMOE_REQUIRE_GPU();
    gpu_ = std::make_unique<CudaBackend>(0);
    cpu_ = make_cpu_backend();
  }

  // Builds the layout on the device and checks it against the definition in cuda/kernels/moe_layout.h.
  void check_layout(int64_t tokens, int64_t k, int64_t num_experts, int64_t num_zero_experts, uint32_t seed) {
    SCOPED_TRACE("Z = " + std::to_string(num_zero_experts));
    check_layout_of(random_ids(tokens, k, num_experts, num_zero_experts, seed), num_experts);
  }

  // ids [tokens, k] with values in [0, E + Z): any multiset (repeats within a token allowed).
  void check_layout_of(const HostTensor& ids, int64_t num_experts) {
    const int64_t tokens = ids.size(0), k = ids.size(1);
    SCOPED_TRACE("T = " + std::to_string(tokens) + ", k = " + std::to_string(k) +
                 ", E = " + std::to_string(num_experts));
    DeviceTensor dids = upload(*gpu_, ids);
    const size_t bytes = moe_layout_workspace_bytes(tokens, static_cast<int>(k), static_cast<int>(num_experts));
    DeviceTensor workspace = poisoned(*gpu_, DType::u8, {static_cast<int64_t>(bytes)});
    auto stream = static_cast<cudaStream_t>(gpu_->stream());
    const MoeLayout layout = build_moe_layout(dids.view.data_as<const int32_t>(), tokens, static_cast<int>(k),
                                              static_cast<int>(num_experts), workspace.buffer.get(), bytes, stream);
    EXPECT_EQ(layout.num_experts, num_experts);
    EXPECT_EQ(layout.top_k, k);
    EXPECT_EQ(layout.num_tokens, tokens);
    const int64_t pairs = tokens * k;
    auto fetch = [&](const int32_t* pointer, int64_t count) {
      return download(*gpu_, TensorView(const_cast<int32_t*>(pointer), DType::i32, {count}, Device::cuda));
    };
    const HostTensor offsets = fetch(layout.expert_offsets, num_experts + 1);
    const HostTensor rows = fetch(layout.pair_rows, pairs);
    const int32_t* offset = offsets.data_as<int32_t>();
    const int32_t* pair_rows = rows.data_as<int32_t>();
    const int32_t* id = ids.data_as<int32_t>();

    // Reference: a stable counting sort on the host.
    std::vector<int32_t> expected_offsets(static_cast<size_t>(num_experts + 1), 0);
    for (int64_t p = 0; p < pairs; ++p) {
      if (id[p] < num_experts) ++expected_offsets[id[p] + 1];
    }
    std::partial_sum(expected_offsets.begin(), expected_offsets.end(), expected_offsets.begin());
    for (int64_t e = 0; e <= num_experts; ++e)
      ASSERT_EQ(offset[e], expected_offsets[e]) << "expert_offsets[" << e << "]";
    const int64_t real_pairs = offset[num_experts];
    const HostTensor sorted = fetch(layout.sorted_pairs, std::max<int64_t>(real_pairs, 1));
    const int32_t* sorted_pairs = sorted.data_as<int32_t>();
    std::vector<int32_t> cursor(expected_offsets.begin(), expected_offsets.end() - 1);
    for (int64_t p = 0; p < pairs; ++p) {
      if (id[p] >= num_experts) {
        EXPECT_EQ(pair_rows[p], -1) << "zero-expert pair " << p;
        continue;
      }
      const int32_t row = cursor[id[p]]++;  // ascending pair order within the expert
      ASSERT_EQ(pair_rows[p], row) << "pair_rows[" << p << "]";
      ASSERT_EQ(sorted_pairs[row], p) << "sorted_pairs[" << row << "]";
    }
  }

  std::unique_ptr<CudaBackend> gpu_;
  std::unique_ptr<Backend> cpu_;
};

TEST_F(CudaExperts, layout_is_a_stable_counting_sort) {
  check_layout(1, 16, 896, 0, 1);     // decode: the fused single-block path
  check_layout(3, 8, 64, 5, 2);       // zero experts get no rows
  check_layout(17, 6, 8, 0, 3);       // few experts, many pairs each
  check_layout(133, 8, 256, 16, 4);   // 1064 pairs: two segments, the three-kernel path
  check_layout(600, 16, 896, 0, 5);   // 9600 pairs: 10 segments
  check_layout(64, 32, 1024, 64, 6);  // k = 32, E + Z = 1088
  check_layout(5, 4, 1, 3, 7);        // a single real expert
}

// Every path switch of build_moe_layout: one block up to kLayoutSegment pairs when its shared memory
// fits (1 to 8 walking warps), the three-kernel path above (1 to 32 segments, 1 to 8 walkers).
TEST_F(CudaExperts, layout_paths_cross_their_thresholds) {
  uint32_t seed = 50;
  for (int64_t tokens : {1, 2, 7, 8, 9, 64, 127, 128, 129, 4096}) {
    check_layout(tokens, 16, 896, 0, ++seed);  // Kimi K3: 128 tokens = one full segment
  }
  check_layout(9, 22, 512, 0, ++seed);
  check_layout(2, 1, 37, 0, ++seed);
  check_layout(3, 16, 30, 7, ++seed);      // E + Z = 37
  check_layout(93, 22, 512, 0, ++seed);    // 2046 pairs: fused
  check_layout(94, 22, 512, 0, ++seed);    // 2068 pairs: two segments
  check_layout(1, 16, 6000, 0, ++seed);    // fused with one walking warp
  check_layout(3, 8, 7000, 0, ++seed);     // counts + histogram do not fit: three kernels, one segment
  check_layout(300, 8, 10240, 0, ++seed);  // the largest E: scatter with one walking warp
  check_layout(2, 16, 896, 64, ++seed);
}

TEST_F(CudaExperts, layout_handles_repeated_and_zero_only_ids) {
  std::mt19937 generator(8);
  for (int64_t tokens : {1, 9, 300}) {
    for (int64_t num_experts : {1, 3, 896}) {
      HostTensor ids(DType::i32, {tokens, 16});  // drawn with replacement, 1 zero expert
      std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(num_experts));
      for (int64_t i = 0; i < ids.numel(); ++i) ids.data_as<int32_t>()[i] = pick(generator);
      check_layout_of(ids, num_experts);
    }
  }
  HostTensor zero_only(DType::i32, {2, 16});  // no real pair: offsets all 0, every pair_rows -1
  for (int64_t i = 0; i < zero_only.numel(); ++i) zero_only.data_as<int32_t>()[i] = 896 + static_cast<int32_t>(i % 5);
  check_layout_of(zero_only, 896);
  EXPECT_THROW(check_layout_of(zero_only, kMaxLayoutExperts + 1), Error);
}

// launch_combine against a host loop with the same operation order (fp32 fmaf in j order): exact.
void check_combine(CudaBackend& gpu, DType y_dtype, DType out_dtype, int64_t tokens, int top_k, int64_t cols,
                   int64_t ld, uint32_t seed) {
  SCOPED_TRACE(name_of(y_dtype) + " -> " + name_of(out_dtype) + ", T = " + std::to_string(tokens) +
               ", k = " + std::to_string(top_k) + ", cols = " + std::to_string(cols) + ", ld = " + std::to_string(ld));
  const int64_t num_rows = tokens * top_k;
  const HostTensor y = random_tensor(y_dtype, {num_rows, cols}, seed, -2.0f, 2.0f);
  const HostTensor weights = random_tensor(DType::f32, {tokens, top_k}, seed + 1, 0.0f, 1.0f);
  HostTensor rows(DType::i32, {tokens, top_k});
  std::vector<int32_t> order(static_cast<size_t>(num_rows));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(seed + 2));
  for (int64_t p = 0; p < num_rows; ++p) rows.data_as<int32_t>()[p] = p % 5 == 3 ? -1 : order[p];  // some zero experts
  if (tokens > 1) {
    for (int j = 0; j < top_k; ++j) rows.data_as<int32_t>()[top_k + j] = -1;  // token 1: no real expert: 0
  }
  HostTensor expected(out_dtype, {tokens, ld});
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t c = 0; c < ld; ++c) {
      float acc = 0.0f;
      for (int j = 0; j < top_k; ++j) {
        const int32_t row = rows.data_as<int32_t>()[t * top_k + j];
        if (row < 0) continue;
        acc = std::fma(weights.data_as<float>()[t * top_k + j], value_at(y, row * cols + c), acc);
      }
      // Columns past `cols` keep the poison (all bits set) the device output starts with.
      if (c < cols) store_from_float(expected.data(), out_dtype, t * ld + c, acc);
    }
  }
  DeviceTensor dy = upload(gpu, y), drows = upload(gpu, rows), dweights = upload(gpu, weights);
  DeviceTensor dout = poisoned(gpu, out_dtype, {tokens, ld});
  const RowMatrix out{dout.view.data(), out_dtype, tokens, cols, ld};
  launch_combine(y_dtype, dy.view.data(), drows.view.data_as<const int32_t>(), dweights.view.data_as<const float>(),
                 top_k, out, static_cast<cudaStream_t>(gpu.stream()));
  const HostTensor got = download(gpu, dout.view);
  int64_t wrong = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t c = 0; c < ld; ++c) {
      const int64_t i = t * ld + c;
      const size_t size = dtype_size(out_dtype);
      const bool same = c < cols ? std::memcmp(static_cast<const char*>(got.data()) + i * size,
                                               static_cast<const char*>(expected.data()) + i * size, size) == 0
                                 : std::isnan(value_at(got, i));
      if (!same && ++wrong <= 5) ADD_FAILURE() << "out[" << t << ", " << c << "] = " << value_at(got, i);
    }
  }
  EXPECT_EQ(wrong, 0);
  if (tokens > 1) {
    for (int64_t c = 0; c < cols; ++c) ASSERT_EQ(value_at(got, ld + c), 0.0f) << "token without experts, column " << c;
  }
}

TEST_F(CudaExperts, combine_is_exact_on_every_path) {
  uint32_t seed = 60;
  // l = 3584 (7 blocks of 64 vectors per token), a partial last block, one vector, unaligned (scalar).
  for (int64_t tokens : {1, 2, 9, 300}) {
    for (int k : {1, 16, 22, 32}) {
      check_combine(*gpu_, DType::bf16, DType::bf16, tokens, k, 3584, 3584, ++seed);
    }
  }
  check_combine(*gpu_, DType::f32, DType::f32, 3, 16, 3584, 3584, ++seed);
  check_combine(*gpu_, DType::bf16, DType::f32, 3, 9, 520, 600, ++seed);  // strided output rows
  check_combine(*gpu_, DType::f16, DType::f16, 2, 8, 8, 8, ++seed);
  check_combine(*gpu_, DType::bf16, DType::bf16, 5, 16, 3583, 3583, ++seed);  // not a multiple of 8: scalar
  check_combine(*gpu_, DType::f32, DType::bf16, 4, 3, 200, 204, ++seed);      // ld not 16-byte aligned: scalar
}

struct ExpertCase {
  int64_t num_experts, num_zero_experts, top_k, latent, intermediate;
};

void run_routed_experts_case(CudaBackend& gpu, Backend& cpu, const ExpertCase& c, Activation act, DType dtype,
                             int64_t tokens, uint32_t seed) {
  SCOPED_TRACE(std::string(to_string(act)) + ", " + name_of(dtype) + ", T = " + std::to_string(tokens) +
               ", E = " + std::to_string(c.num_experts) + ", k = " + std::to_string(c.top_k) +
               ", l = " + std::to_string(c.latent) + ", I = " + std::to_string(c.intermediate));
  ActivationParams activation;
  activation.activation = act;
  const bool gated = act != Activation::relu2;
  const int64_t e = c.num_experts, l = c.latent, i = c.intermediate;
  const HostTensor z = random_tensor(dtype, {tokens, l}, seed + 1, -2.0f, 2.0f);
  const HostTensor gate = random_tensor(dtype, {e, i, l}, seed + 2, -0.15f, 0.15f);
  const HostTensor up = random_tensor(dtype, {e, i, l}, seed + 3, -0.15f, 0.15f);
  const HostTensor down = random_tensor(dtype, {e, l, i}, seed + 4, -0.15f, 0.15f);
  const HostTensor ids = random_ids(tokens, c.top_k, e, c.num_zero_experts, seed + 5);
  const HostTensor weights = random_tensor(DType::f32, {tokens, c.top_k}, seed + 6, 0.05f, 1.0f);

  HostTensor ref(dtype, {tokens, l});
  cpu.routed_experts(activation, z.view(), ids.view(), weights.view(),
                     MlpWeights{gated ? gate.view() : TensorView(), up.view(), down.view()}, ref.view());

  DeviceTensor dz = upload(gpu, z), dgate = upload(gpu, gate), dup = upload(gpu, up), ddown = upload(gpu, down),
               dids = upload(gpu, ids), dweights = upload(gpu, weights);
  DeviceTensor dout = poisoned(gpu, dtype, {tokens, l});
  gpu.routed_experts(activation, dz.view, dids.view, dweights.view,
                     MlpWeights{gated ? dgate.view : TensorView(), dup.view, ddown.view}, dout.view);
  const HostTensor out = download(gpu, dout.view);
  EXPECT_EQ(count_non_finite(out), 0);
  EXPECT_LT(relative_error(out, ref), tolerance(dtype));
}

TEST_F(CudaExperts, routed_experts_match_cpu_for_every_activation_and_dtype) {
  const ExpertCase cases[] = {
      {16, 3, 4, 192, 96},  // zero experts among the choices
      {64, 0, 8, 192, 72},  // I not a multiple of 16
  };
  WorkspaceSpec spec;
  spec.max_tokens = 133;
  spec.num_experts = 64;
  spec.top_k = 8;
  spec.latent_size = 192;
  spec.expert_intermediate = 96;
  gpu_->prepare(spec);
  uint32_t seed = 10;
  for (const ExpertCase& c : cases) {
    for (Activation act : {Activation::silu, Activation::situ, Activation::relu2}) {
      for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
        for (int64_t tokens : {int64_t{1}, int64_t{3}, int64_t{17}, int64_t{133}}) {
          run_routed_experts_case(*gpu_, *cpu_, c, act, dtype, tokens, seed += 10);
        }
      }
    }
  }
}

// A wider problem in bf16: k = 16 of 128 experts, l = 512, I = 384, enough rows per expert for the
// larger tiles.
TEST_F(CudaExperts, routed_experts_match_cpu_on_a_wider_bf16_problem) {
  WorkspaceSpec spec;
  spec.max_tokens = 64;
  spec.num_experts = 128;
  spec.top_k = 16;
  spec.latent_size = 512;
  spec.expert_intermediate = 384;
  spec.element_size = 2;
  gpu_->prepare(spec);
  run_routed_experts_case(*gpu_, *cpu_, {128, 0, 16, 512, 384}, Activation::situ, DType::bf16, 64, 77);
}

// A token whose every id is a zero expert gets exactly 0 (not the poison), on both paths: the grouped
// GEMMs (skinny kernels off; f32) and the skinny kernels (every decode-sized call; bf16).
struct ZeroExpertCase {
  const char* name;
  bool skinny;
  DType dtype;
  int64_t latent, intermediate;
};

class ZeroExperts : public CudaExperts, public ::testing::WithParamInterface<ZeroExpertCase> {};

TEST_P(ZeroExperts, a_token_with_only_zero_experts_gets_zero) {
  const ZeroExpertCase& c = GetParam();
  if (c.skinny) {
    gpu_->set_skinny_always(true);
  } else {
    gpu_->set_skinny_max_tokens(0);
  }
  const int64_t l = c.latent, inter = c.intermediate;
  WorkspaceSpec spec;
  spec.max_tokens = 2;
  spec.num_experts = 4;
  spec.top_k = 2;
  spec.latent_size = l;
  spec.expert_intermediate = inter;
  gpu_->prepare(spec);
  HostTensor ids(DType::i32, {2, 2});
  const int32_t values[] = {4, 5, 1, 6};  // token 0: zero experts only; token 1: expert 1 and a zero expert
  std::copy(values, values + 4, ids.data_as<int32_t>());
  const HostTensor weights = random_tensor(DType::f32, {2, 2}, 3, 0.5f, 1.0f);
  const HostTensor z = random_tensor(c.dtype, {2, l}, 4);
  const HostTensor gate = random_tensor(c.dtype, {4, inter, l}, 5);
  const HostTensor up = random_tensor(c.dtype, {4, inter, l}, 6);
  const HostTensor down = random_tensor(c.dtype, {4, l, inter}, 7);
  HostTensor ref(c.dtype, {2, l});
  cpu_->routed_experts(ActivationParams{}, z.view(), ids.view(), weights.view(),
                       MlpWeights{gate.view(), up.view(), down.view()}, ref.view());
  DeviceTensor dz = upload(*gpu_, z), dgate = upload(*gpu_, gate), dup = upload(*gpu_, up), ddown = upload(*gpu_, down),
               dids = upload(*gpu_, ids), dweights = upload(*gpu_, weights);
  DeviceTensor dout = poisoned(*gpu_, c.dtype, {2, l});
  gpu_->routed_experts(ActivationParams{}, dz.view, dids.view, dweights.view,
                       MlpWeights{dgate.view, dup.view, ddown.view}, dout.view);
  const HostTensor out = download(*gpu_, dout.view);
  for (int64_t col = 0; col < l; ++col) EXPECT_EQ(value_at(out, col), 0.0f) << col;
  EXPECT_LT(relative_error(out, ref), tolerance(c.dtype));
}

INSTANTIATE_TEST_SUITE_P(Paths, ZeroExperts,
                         ::testing::Values(ZeroExpertCase{"grouped_f32", false, DType::f32, 16, 8},
                                           ZeroExpertCase{"skinny_bf16", true, DType::bf16, 64, 32}),
                         [](const ::testing::TestParamInfo<ZeroExpertCase>& info) { return info.param.name; });

TEST_F(CudaExperts, routed_experts_need_a_prepared_workspace) {
  const int64_t latent = 256;
  const HostTensor z = random_tensor(DType::bf16, {4, latent}, 1);
  const HostTensor w = random_tensor(DType::bf16, {4, 8, latent}, 2);
  const HostTensor wd = random_tensor(DType::bf16, {4, latent, 8}, 3);
  const HostTensor ids = random_ids(4, 2, 4, 0, 4);
  const HostTensor weights = random_tensor(DType::f32, {4, 2}, 5);
  DeviceTensor dz = upload(*gpu_, z), dw = upload(*gpu_, w), dwd = upload(*gpu_, wd), dids = upload(*gpu_, ids),
               dweights = upload(*gpu_, weights), dout = device_empty(*gpu_, DType::bf16, {4, latent});
  const MlpWeights experts{dw.view, dw.view, dwd.view};
  EXPECT_THROW(gpu_->routed_experts(ActivationParams{}, dz.view, dids.view, dweights.view, experts, dout.view), Error);
  WorkspaceSpec spec;
  spec.max_tokens = 2;  // too few: the 4 tokens' expert output rows need twice the bytes
  spec.element_size = 2;
  spec.num_experts = 4;
  spec.top_k = 2;
  spec.latent_size = latent;
  spec.expert_intermediate = 8;
  gpu_->prepare(spec);
  try {
    gpu_->routed_experts(ActivationParams{}, dz.view, dids.view, dweights.view, experts, dout.view);
    ADD_FAILURE() << "expected an Error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("prepare"), std::string::npos) << error.what();
  }
  spec.max_tokens = 4;
  gpu_->prepare(spec);
  EXPECT_NO_THROW(gpu_->routed_experts(ActivationParams{}, dz.view, dids.view, dweights.view, experts, dout.view));
}

}  // namespace
}  // namespace latentmoe::cuda::testing

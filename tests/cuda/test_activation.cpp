// NaN and infinities through the expert activations (cuda/common/activation.cuh) on every GPU path
// that applies one, against the CPU reference (src/cpu/activation.h, docs/NUMERICS.md) and against
// the pattern worked out by hand:
//   the shared expert: dense_mlp on cuBLASLt + the elementwise activation, and on the skinny kernels;
//   the routed experts: the grouped GEMMs (SIMT for f32, tensor cores for bf16) and the skinny kernels.
// The weights' column 0 (gate and up) is positive and row c of every down projection has the sign
// s_c = +1 for even c, -1 for odd c, so a token whose input column 0 is special gets g and u of one
// known sign in every intermediate, and a known output:
//   token 0  finite inputs                  finite everywhere (within the tolerance of the dtype)
//   token 1  x[0] = NaN                     NaN for every activation (relu2 too: max(NaN, 0)² is NaN)
//   token 2  x[0] = +inf: g = u = +inf      silu, relu2: s_c · inf; situ saturates: finite
//   token 3  x[0] = -inf: g = u = -inf      silu: NaN (-inf · sigmoid(-inf) = -inf · 0); relu2: 0; situ: finite
//   token 4  x[0] = 1e25: g, u ~ 1e24       silu, relu2: a overflows to inf, so s_c · inf; situ: finite
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cuda/backend/cuda_backend.h"
#include "cuda/gemm/skinny_gemm.h"
#include "cuda_test_util.h"

namespace latentmoe::cuda::testing {
namespace {

using ::latentmoe::detail::ActivationParams;
using ::latentmoe::detail::make_cpu_backend;
using ::latentmoe::detail::MlpWeights;

enum class Path { dense_cublas, dense_skinny, routed_grouped, routed_skinny };

const char* path_name(Path path) {
  switch (path) {
    case Path::dense_cublas:
      return "dense_cublas";
    case Path::dense_skinny:
      return "dense_skinny";
    case Path::routed_grouped:
      return "routed_grouped";
    case Path::routed_skinny:
      return "routed_skinny";
  }
  return "?";
}

struct ActivationCase {
  Path path;
  Activation activation;
  DType dtype;
};

constexpr int64_t kTokens = 5, kWidth = 64, kInter = 32, kExperts = 4, kTopK = 2;

enum class Expect { finite, nan, signed_inf, zero };

Expect expected(Activation activation, int64_t token) {
  switch (token) {
    case 1:
      return Expect::nan;
    case 2:
    case 4:
      return activation == Activation::situ ? Expect::finite : Expect::signed_inf;
    case 3:
      return activation == Activation::silu    ? Expect::nan
             : activation == Activation::relu2 ? Expect::zero
                                               : Expect::finite;
    default:
      return Expect::finite;
  }
}

// Inputs [kTokens, kWidth]: random in [-1, 1) with column 0 of tokens 1-4 special (see the top).
HostTensor special_inputs(DType dtype, uint32_t seed) {
  HostTensor x = random_tensor(dtype, {kTokens, kWidth}, seed);
  const float special[] = {NAN, INFINITY, -INFINITY, 1e25f};
  for (int64_t t = 1; t < kTokens; ++t) store_from_float(x.data(), dtype, t * kWidth, special[t - 1]);
  return x;
}

// `count` matrices [rows, cols]: random magnitudes in [0.05, 0.2), column 0 positive (positive_col0)
// or every entry of row r with the sign s_r (signed_rows), else random signs.
HostTensor weights(DType dtype, std::vector<int64_t> shape, uint32_t seed, bool positive_col0, bool signed_rows) {
  HostTensor w(dtype, shape);
  const int64_t cols = shape.back(), rows = shape[shape.size() - 2];
  std::mt19937 generator(seed);
  std::uniform_real_distribution<float> magnitude(0.05f, 0.2f);
  std::bernoulli_distribution negative(0.5);
  for (int64_t i = 0; i < w.numel(); ++i) {
    const int64_t c = i % cols, r = (i / cols) % rows;
    float value = magnitude(generator);
    if (signed_rows) {
      if (r % 2 == 1) value = -value;
    } else if (!(positive_col0 && c == 0) && negative(generator)) {
      value = -value;
    }
    store_from_float(w.data(), dtype, i, value);
  }
  return w;
}

class Activations : public ::testing::TestWithParam<ActivationCase> {
 protected:
  void SetUp() override {
    LATENTMOE_REQUIRE_GPU();
    gpu_ = std::make_unique<CudaBackend>(0);
    cpu_ = make_cpu_backend();
  }

  // out [kTokens, kWidth] from one path and from the CPU reference.
  void run(const ActivationCase& c, HostTensor& out, HostTensor& ref) {
    ActivationParams activation;
    activation.activation = c.activation;
    const bool gated = c.activation != Activation::relu2;
    const bool dense = c.path == Path::dense_cublas || c.path == Path::dense_skinny;
    const bool skinny = c.path == Path::dense_skinny || c.path == Path::routed_skinny;
    if (skinny) {
      ASSERT_TRUE(skinny_supported(c.dtype, kTokens, kWidth, {}) && skinny_supported(c.dtype, kTokens, kInter, {}));
      gpu_->set_skinny_always(true);
    } else {
      gpu_->set_skinny_max_tokens(0);
    }
    WorkspaceSpec spec;
    spec.max_tokens = kTokens;
    spec.element_size = dtype_size(c.dtype);
    spec.num_experts = dense ? 0 : kExperts;
    spec.top_k = dense ? 0 : kTopK;
    spec.latent_size = kWidth;
    spec.expert_intermediate = kInter;
    spec.dense_intermediate = dense ? kInter : 0;
    gpu_->prepare(spec);

    const HostTensor x = special_inputs(c.dtype, 1);
    const std::vector<int64_t> in_shape =
        dense ? std::vector<int64_t>{kInter, kWidth} : std::vector<int64_t>{kExperts, kInter, kWidth};
    const std::vector<int64_t> out_shape =
        dense ? std::vector<int64_t>{kWidth, kInter} : std::vector<int64_t>{kExperts, kWidth, kInter};
    const HostTensor gate = weights(c.dtype, in_shape, 2, true, false);
    const HostTensor up = weights(c.dtype, in_shape, 3, true, false);
    const HostTensor down = weights(c.dtype, out_shape, 4, false, true);
    HostTensor ids(DType::i32, {kTokens, kTopK});
    HostTensor topk_weights(DType::f32, {kTokens, kTopK});
    for (int64_t t = 0; t < kTokens; ++t) {
      for (int64_t j = 0; j < kTopK; ++j) {
        ids.data_as<int32_t>()[t * kTopK + j] = static_cast<int32_t>((t + j) % kExperts);
        topk_weights.data_as<float>()[t * kTopK + j] = 0.5f + 0.25f * static_cast<float>(j);
      }
    }

    ref = HostTensor(c.dtype, {kTokens, kWidth});
    const MlpWeights host{gated ? gate.view() : TensorView(), up.view(), down.view()};
    DeviceTensor dx = upload(*gpu_, x), dgate = upload(*gpu_, gate), dup = upload(*gpu_, up),
                 ddown = upload(*gpu_, down), dids = upload(*gpu_, ids), dweights = upload(*gpu_, topk_weights);
    const MlpWeights device{gated ? dgate.view : TensorView(), dup.view, ddown.view};
    DeviceTensor dout = poisoned(*gpu_, c.dtype, {kTokens, kWidth});
    if (dense) {
      cpu_->dense_mlp(activation, x.view(), host, ref.view());
      gpu_->dense_mlp(activation, dx.view, device, dout.view);
    } else {
      cpu_->routed_experts(activation, x.view(), ids.view(), topk_weights.view(), host, ref.view());
      gpu_->routed_experts(activation, dx.view, dids.view, dweights.view, device, dout.view);
    }
    out = download(*gpu_, dout.view);
  }

  std::unique_ptr<CudaBackend> gpu_;
  std::unique_ptr<Backend> cpu_;
};

// Checks one output element against the hand-worked pattern.
void expect_pattern(Expect expect, int64_t c, float value, const char* who) {
  const float sign = c % 2 == 0 ? 1.0f : -1.0f;
  switch (expect) {
    case Expect::finite:
      EXPECT_TRUE(std::isfinite(value)) << who << ": " << value;
      break;
    case Expect::nan:
      EXPECT_TRUE(std::isnan(value)) << who << ": " << value;
      break;
    case Expect::signed_inf:
      EXPECT_EQ(value, sign * INFINITY) << who;
      break;
    case Expect::zero:
      EXPECT_EQ(value, 0.0f) << who;
      break;
  }
}

TEST_P(Activations, nan_and_inf_follow_the_cpu_reference) {
  const ActivationCase c = GetParam();
  HostTensor out, ref;
  run(c, out, ref);
  const double tolerance = c.dtype == DType::f32 ? 1e-4 : 2e-2;
  for (int64_t t = 0; t < kTokens; ++t) {
    const Expect expect = expected(c.activation, t);
    for (int64_t col = 0; col < kWidth; ++col) {
      SCOPED_TRACE("token " + std::to_string(t) + ", column " + std::to_string(col));
      const float got = value_at(out, t * kWidth + col), want = value_at(ref, t * kWidth + col);
      expect_pattern(expect, col, want, "CPU reference");
      expect_pattern(expect, col, got, path_name(c.path));
      if (std::isfinite(want) && std::isfinite(got)) {
        EXPECT_LE(std::fabs(got - want), tolerance * (std::fabs(want) + 1.0)) << got << " vs " << want;
      }
    }
  }
}

std::vector<ActivationCase> all_cases() {
  std::vector<ActivationCase> cases;
  for (Activation activation : {Activation::silu, Activation::situ, Activation::relu2}) {
    for (Path path : {Path::dense_cublas, Path::dense_skinny, Path::routed_grouped, Path::routed_skinny}) {
      const bool skinny = path == Path::dense_skinny || path == Path::routed_skinny;
      cases.push_back({path, activation, DType::bf16});
      if (!skinny) cases.push_back({path, activation, DType::f32});  // the skinny kernels are 16-bit only
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(EveryPath, Activations, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<ActivationCase>& info) {
                           return std::string(path_name(info.param.path)) + "_" +
                                  std::string(to_string(info.param.activation)) + "_" + name_of(info.param.dtype);
                         });

}  // namespace
}  // namespace latentmoe::cuda::testing

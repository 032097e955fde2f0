// The small-token GEMV path (src/cuda/small_gemm.cu) through CudaBackend::linear and dense_mlp,
// against the CPU reference: token counts on both sides of the cut-over (16), inner sizes that are
// and are not multiples of 8, output widths down to 1, bf16 and f16, accumulation into a strided
// column block, every activation of the fused gate/up, misaligned views (which must take the general
// path), poisoned outputs (an unwritten element reads as NaN) and a CUDA-graph capture + replay.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/backend.h"
#include "cuda/blas.h"
#include "cuda/cuda_backend.h"
#include "cuda/small_gemm.cuh"
#include "cuda_test_util.h"
#include "latentmoe/error.h"

namespace latentmoe::cuda::testing {
namespace {

using ::latentmoe::detail::ActivationParams;
using ::latentmoe::detail::make_cpu_backend;
using ::latentmoe::detail::MlpWeights;

constexpr int64_t kTokenCounts[] = {1, 2, 3, 8, 15, 16, 17};
constexpr DType kDTypes[] = {DType::bf16, DType::f16};
constexpr Activation kActivations[] = {Activation::silu, Activation::situ, Activation::relu2};

GemmProblem problem_of(const TensorView& x, const TensorView& w, const TensorView& y, bool accumulate) {
  return GemmProblem{x.dtype(),   w.dtype(), y.dtype(),   x.size(0), w.size(0),   x.size(1), x.data(),
                     x.stride(0), w.data(),  w.stride(0), y.data(),  y.stride(0), accumulate};
}

RowMatrix rows_of(const TensorView& view) {
  if (!view.defined()) return RowMatrix{};
  return RowMatrix{view.data(), view.dtype(), view.size(0), view.size(1), view.stride(0)};
}

bool bytes_equal(const HostTensor& a, const HostTensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

// Columns [begin, begin + n) of a host matrix, contiguous.
HostTensor host_columns(const HostTensor& wide, int64_t begin, int64_t n) {
  HostTensor block(wide.dtype(), {wide.size(0), n});
  const size_t element = dtype_size(wide.dtype());
  for (int64_t t = 0; t < wide.size(0); ++t) {
    std::memcpy(static_cast<char*>(block.data()) + t * n * element,
                static_cast<const char*>(wide.data()) + (t * wide.size(1) + begin) * element, n * element);
  }
  return block;
}

std::string label(DType dtype, int64_t tokens, int64_t m, int64_t n) {
  return name_of(dtype) + " T = " + std::to_string(tokens) + ", m = " + std::to_string(m) + ", n = " +
         std::to_string(n);
}

class SmallGemm : public ::testing::Test {
 protected:
  void SetUp() override {
    LATENTMOE_REQUIRE_GPU();
    gpu_ = std::make_unique<CudaBackend>(0);
    cpu_ = make_cpu_backend();
  }

  void prepare_dense(int64_t max_tokens, int64_t intermediate) {
    WorkspaceSpec spec;
    spec.max_tokens = max_tokens;
    spec.element_size = 2;
    spec.dense_intermediate = intermediate;
    gpu_->prepare(spec);
  }

  std::unique_ptr<CudaBackend> gpu_;
  std::unique_ptr<Backend> cpu_;
};

TEST(SmallGemmSupport, takes_only_small_aligned_16_bit_problems) {
  alignas(16) static uint16_t storage[64];
  auto problem = [](DType x, DType w, DType y, int64_t rows, int64_t inner, const void* xp, int64_t ldx) {
    return GemmProblem{x, w, y, rows, 7, inner, xp, ldx, storage, 16, storage, 7, false};
  };
  EXPECT_TRUE(small_gemm_supports(problem(DType::bf16, DType::bf16, DType::bf16, 1, 16, storage, 16)));
  EXPECT_TRUE(small_gemm_supports(problem(DType::f16, DType::f16, DType::f16, 16, 13, storage, 16)));
  EXPECT_FALSE(small_gemm_supports(problem(DType::bf16, DType::bf16, DType::bf16, 17, 16, storage, 16)));
  EXPECT_FALSE(small_gemm_supports(problem(DType::f32, DType::f32, DType::f32, 1, 16, storage, 16)));
  EXPECT_FALSE(small_gemm_supports(problem(DType::bf16, DType::bf16, DType::f32, 1, 16, storage, 16)));
  EXPECT_FALSE(small_gemm_supports(problem(DType::bf16, DType::f16, DType::bf16, 1, 16, storage, 16)));
  EXPECT_FALSE(small_gemm_supports(problem(DType::bf16, DType::bf16, DType::bf16, 1, 16, storage + 1, 16)));
  EXPECT_FALSE(small_gemm_supports(problem(DType::bf16, DType::bf16, DType::bf16, 2, 13, storage, 13)));
  EXPECT_TRUE(small_gemm_supports(problem(DType::bf16, DType::bf16, DType::bf16, 1, 13, storage, 13)));  // one row
  EXPECT_FALSE(small_gemm_supports(problem(DType::bf16, DType::bf16, DType::bf16, 1, 0, storage, 16)));
  EXPECT_THROW(launch_small_gemm(problem(DType::bf16, DType::bf16, DType::bf16, 17, 16, storage, 16), nullptr),
               Error);
}

// y = x w^T into a poisoned y for every token count; the GEMV path runs exactly when T <= 16.
void check_linear(CudaBackend& gpu, Backend& cpu, DType dtype, int64_t m, int64_t n, uint32_t seed) {
  const HostTensor w = random_tensor(dtype, {n, m}, seed);
  DeviceTensor dw = upload(gpu, w);
  for (int64_t tokens : kTokenCounts) {
    SCOPED_TRACE(label(dtype, tokens, m, n));
    const HostTensor x = random_tensor(dtype, {tokens, m}, seed + 1 + static_cast<uint32_t>(tokens));
    HostTensor ref(dtype, {tokens, n});
    cpu.linear(x.view(), w.view(), ref.view(), false);
    DeviceTensor dx = upload(gpu, x);
    DeviceTensor dy = poisoned(gpu, dtype, {tokens, n});
    EXPECT_EQ(small_gemm_supports(problem_of(dx.view, dw.view, dy.view, false)), tokens <= kSmallGemmMaxTokens);
    gpu.linear(dx.view, dw.view, dy.view, false);
    const HostTensor out = download(gpu, dy.view);
    EXPECT_EQ(count_non_finite(out), 0);
    EXPECT_LT(relative_error(out, ref), 1e-2);
  }
}

TEST_F(SmallGemm, linear_matches_cpu_on_both_sides_of_the_cut_over) {
  const std::pair<int64_t, int64_t> shapes[] = {{7168, 768}, {3584, 7}, {200, 3584}, {200, 1}, {16, 1}};
  uint32_t seed = 100;
  for (DType dtype : kDTypes) {
    for (auto [m, n] : shapes) check_linear(*gpu_, *cpu_, dtype, m, n, seed += 50);
  }
}

TEST_F(SmallGemm, linear_is_deterministic) {
  const HostTensor x = random_tensor(DType::bf16, {5, 3584}, 1);
  const HostTensor w = random_tensor(DType::bf16, {333, 3584}, 2);
  DeviceTensor dx = upload(*gpu_, x), dw = upload(*gpu_, w);
  DeviceTensor dy = poisoned(*gpu_, DType::bf16, {5, 333});
  gpu_->linear(dx.view, dw.view, dy.view, false);
  const HostTensor first = download(*gpu_, dy.view);
  poison(*gpu_, dy);
  gpu_->linear(dx.view, dw.view, dy.view, false);
  EXPECT_TRUE(bytes_equal(download(*gpu_, dy.view), first));
}

// y[:, begin:begin+n] += x w^T inside a wider matrix of random values: the block matches the CPU,
// every other column keeps its bits.
TEST_F(SmallGemm, linear_accumulates_into_a_strided_column_block) {
  const std::pair<int64_t, int64_t> shapes[] = {{200, 7}, {3584, 768}, {24, 1}};
  uint32_t seed = 300;
  for (DType dtype : kDTypes) {
    for (auto [m, n] : shapes) {
      const HostTensor w = random_tensor(dtype, {n, m}, ++seed);
      DeviceTensor dw = upload(*gpu_, w);
      const int64_t begin = 3, width = n + 12;  // an odd row stride for odd n
      for (int64_t tokens : kTokenCounts) {
        SCOPED_TRACE(label(dtype, tokens, m, n));
        const HostTensor x = random_tensor(dtype, {tokens, m}, ++seed);
        const HostTensor initial = random_tensor(dtype, {tokens, width}, ++seed);
        HostTensor ref(dtype, {tokens, width});
        std::memcpy(ref.data(), initial.data(), initial.nbytes());
        cpu_->linear(x.view(), w.view(), ref.view().slice_cols(begin, begin + n), true);
        DeviceTensor dx = upload(*gpu_, x), dy = upload(*gpu_, initial);
        const TensorView block = dy.view.slice_cols(begin, begin + n);
        EXPECT_EQ(small_gemm_supports(problem_of(dx.view, dw.view, block, true)), tokens <= kSmallGemmMaxTokens);
        gpu_->linear(dx.view, dw.view, block, true);
        const HostTensor out = download(*gpu_, dy.view);
        int64_t changed_outside = 0;
        for (int64_t t = 0; t < tokens; ++t) {
          for (int64_t c = 0; c < width; ++c) {
            if (c >= begin && c < begin + n) continue;
            const int64_t i = t * width + c;
            changed_outside += out.data_as<uint16_t>()[i] != initial.data_as<uint16_t>()[i];
          }
        }
        EXPECT_EQ(changed_outside, 0);
        EXPECT_LT(relative_error(download(*gpu_, block), host_columns(ref, begin, n)), 1e-2);
      }
    }
  }
}

// Inner sizes that are not multiples of 8 on the GEMV path: x and w are column views of matrices
// whose rows are 16-byte aligned, so the vector loop runs and the scalar tail adds the rest.
TEST_F(SmallGemm, inner_sizes_off_the_vector_width_use_the_scalar_tail) {
  const std::pair<int64_t, int64_t> shapes[] = {{13, 768}, {205, 7}, {3, 33}, {7163, 5}};
  uint32_t seed = 500;
  for (DType dtype : kDTypes) {
    for (auto [m, n] : shapes) {
      const int64_t ld = (m + 7) / 8 * 8;
      const HostTensor w_wide = random_tensor(dtype, {n, ld}, ++seed);
      const TensorView w = w_wide.view().slice_cols(0, m);
      DeviceTensor dw_wide = upload(*gpu_, w_wide);
      const TensorView dw = dw_wide.view.slice_cols(0, m);
      for (int64_t tokens : kTokenCounts) {
        SCOPED_TRACE(label(dtype, tokens, m, n));
        const HostTensor x_wide = random_tensor(dtype, {tokens, ld}, ++seed);
        const TensorView x = x_wide.view().slice_cols(0, m);
        HostTensor ref(dtype, {tokens, n});
        cpu_->linear(x, w, ref.view(), false);
        DeviceTensor dx_wide = upload(*gpu_, x_wide);
        const TensorView dx = dx_wide.view.slice_cols(0, m);
        DeviceTensor dy = poisoned(*gpu_, dtype, {tokens, n});
        EXPECT_EQ(small_gemm_supports(problem_of(dx, dw, dy.view, false)), tokens <= kSmallGemmMaxTokens);
        gpu_->linear(dx, dw, dy.view, false);
        const HostTensor out = download(*gpu_, dy.view);
        EXPECT_EQ(count_non_finite(out), 0);
        EXPECT_LT(relative_error(out, ref), 1e-2);
      }
    }
  }
}

// Views offset by one element (2 bytes) or with odd contiguous rows cannot be read with 16-byte
// loads: they go to cuBLASLt and still match.
TEST_F(SmallGemm, misaligned_views_take_the_general_path) {
  const int64_t m = 200, n = 96;
  for (DType dtype : kDTypes) {
    for (int64_t tokens : {int64_t{1}, int64_t{3}, int64_t{16}}) {
      SCOPED_TRACE(label(dtype, tokens, m, n));
      const HostTensor x = random_tensor(dtype, {tokens, m}, 600 + static_cast<uint32_t>(tokens));
      const HostTensor w = random_tensor(dtype, {n, m}, 700);
      HostTensor ref(dtype, {tokens, n});
      cpu_->linear(x.view(), w.view(), ref.view(), false);
      // Buffers one element longer; the views start at element 1.
      DeviceTensor x_buffer = device_empty(*gpu_, dtype, {tokens * m + 1});
      DeviceTensor w_buffer = device_empty(*gpu_, dtype, {n * m + 1});
      const size_t element = dtype_size(dtype);
      const TensorView dx(static_cast<char*>(x_buffer.buffer.get()) + element, dtype, {tokens, m}, Device::cuda);
      const TensorView dw(static_cast<char*>(w_buffer.buffer.get()) + element, dtype, {n, m}, Device::cuda);
      const TensorView dw_aligned(static_cast<char*>(w_buffer.buffer.get()), dtype, {n, m}, Device::cuda);
      gpu_->copy(x.view(), dx);
      for (const TensorView& weight : {dw, dw_aligned}) {
        gpu_->copy(w.view(), weight);
        DeviceTensor dy = poisoned(*gpu_, dtype, {tokens, n});
        EXPECT_FALSE(small_gemm_supports(problem_of(dx, weight, dy.view, false)));
        gpu_->linear(dx, weight, dy.view, false);
        const HostTensor out = download(*gpu_, dy.view);
        EXPECT_EQ(count_non_finite(out), 0);
        EXPECT_LT(relative_error(out, ref), 1e-2);
      }
    }
  }
}

// --- dense_mlp: the fused gate/up GEMV + the down GEMV ---------------------------------------------

struct DenseCase {
  int64_t d, intermediate;
  std::vector<int64_t> tokens;
};

TEST_F(SmallGemm, dense_mlp_matches_cpu_for_every_activation) {
  const std::vector<int64_t> all(std::begin(kTokenCounts), std::end(kTokenCounts));
  const DenseCase cases[] = {{336, 160, all}, {200, 7, all}, {7168, 48, {1, 16, 17}}, {16, 1, {1, 2, 17}}};
  prepare_dense(17, 160);
  uint32_t seed = 800;
  for (DType dtype : kDTypes) {
    for (const DenseCase& c : cases) {
      const HostTensor gate = random_tensor(dtype, {c.intermediate, c.d}, ++seed, -0.1f, 0.1f);
      const HostTensor up = random_tensor(dtype, {c.intermediate, c.d}, ++seed, -0.1f, 0.1f);
      const HostTensor down = random_tensor(dtype, {c.d, c.intermediate}, ++seed, -0.1f, 0.1f);
      DeviceTensor dgate = upload(*gpu_, gate), dup = upload(*gpu_, up), ddown = upload(*gpu_, down);
      for (Activation act : kActivations) {
        ActivationParams activation;
        activation.activation = act;
        const bool gated = act != Activation::relu2;
        const MlpWeights cpu_weights{gated ? gate.view() : TensorView(), up.view(), down.view()};
        const MlpWeights gpu_weights{gated ? dgate.view : TensorView(), dup.view, ddown.view};
        for (int64_t tokens : c.tokens) {
          SCOPED_TRACE(std::string(to_string(act)) + " " + label(dtype, tokens, c.d, c.intermediate));
          const HostTensor x = random_tensor(dtype, {tokens, c.d}, ++seed);
          HostTensor ref(dtype, {tokens, c.d});
          cpu_->dense_mlp(activation, x.view(), cpu_weights, ref.view());
          DeviceTensor dx = upload(*gpu_, x);
          DeviceTensor dout = poisoned(*gpu_, dtype, {tokens, c.d});
          // The intermediate lives in the backend's workspace; any aligned pointer answers the question.
          const RowMatrix intermediate{dx.view.data(), dtype, tokens, c.intermediate, c.intermediate};
          EXPECT_EQ(small_gate_up_supports(activation, rows_of(dx.view), rows_of(gpu_weights.gate),
                                           rows_of(dup.view), intermediate),
                    tokens <= kSmallGemmMaxTokens);
          gpu_->dense_mlp(activation, dx.view, gpu_weights, dout.view);
          const HostTensor out = download(*gpu_, dout.view);
          EXPECT_EQ(count_non_finite(out), 0);
          EXPECT_LT(relative_error(out, ref), 1e-2);
        }
      }
    }
  }
}

TEST_F(SmallGemm, dense_mlp_with_a_misaligned_input_takes_the_general_path) {
  const int64_t d = 200, intermediate = 24, tokens = 3;
  prepare_dense(tokens, intermediate);
  for (DType dtype : kDTypes) {
    const HostTensor gate = random_tensor(dtype, {intermediate, d}, 901, -0.1f, 0.1f);
    const HostTensor up = random_tensor(dtype, {intermediate, d}, 902, -0.1f, 0.1f);
    const HostTensor down = random_tensor(dtype, {d, intermediate}, 903, -0.1f, 0.1f);
    const HostTensor x = random_tensor(dtype, {tokens, d}, 904);
    DeviceTensor dgate = upload(*gpu_, gate), dup = upload(*gpu_, up), ddown = upload(*gpu_, down);
    DeviceTensor x_buffer = device_empty(*gpu_, dtype, {tokens * d + 1});
    const TensorView dx(static_cast<char*>(x_buffer.buffer.get()) + dtype_size(dtype), dtype, {tokens, d},
                        Device::cuda);
    gpu_->copy(x.view(), dx);
    for (Activation act : kActivations) {
      SCOPED_TRACE(std::string(to_string(act)) + " " + name_of(dtype));
      ActivationParams activation;
      activation.activation = act;
      const bool gated = act != Activation::relu2;
      HostTensor ref(dtype, {tokens, d});
      cpu_->dense_mlp(activation, x.view(), MlpWeights{gated ? gate.view() : TensorView(), up.view(), down.view()},
                      ref.view());
      const MlpWeights weights{gated ? dgate.view : TensorView(), dup.view, ddown.view};
      const RowMatrix workspace{dup.view.data(), dtype, tokens, intermediate, intermediate};
      EXPECT_FALSE(
          small_gate_up_supports(activation, rows_of(dx), rows_of(weights.gate), rows_of(dup.view), workspace));
      DeviceTensor dout = poisoned(*gpu_, dtype, {tokens, d});
      gpu_->dense_mlp(activation, dx, weights, dout.view);
      const HostTensor out = download(*gpu_, dout.view);
      EXPECT_EQ(count_non_finite(out), 0);
      EXPECT_LT(relative_error(out, ref), 1e-2);
    }
  }
}

// --- CUDA graphs ------------------------------------------------------------------------------------

// A latent down-projection, a shared expert and an accumulating up-projection at T = 3, captured once
// and replayed with new inputs: bit-identical to eager runs on the same inputs.
TEST_F(SmallGemm, graph_capture_replays_bit_identically) {
  const int64_t tokens = 3, d = 512, l = 256, intermediate = 96;
  const DType dtype = DType::bf16;
  prepare_dense(tokens, intermediate);
  ActivationParams activation;
  activation.activation = Activation::situ;
  DeviceTensor x = device_empty(*gpu_, dtype, {tokens, d});
  DeviceTensor w_down = upload(*gpu_, random_tensor(dtype, {l, d}, 1001, -0.1f, 0.1f));
  DeviceTensor w_up = upload(*gpu_, random_tensor(dtype, {d, l}, 1002, -0.1f, 0.1f));
  DeviceTensor gate = upload(*gpu_, random_tensor(dtype, {intermediate, d}, 1003, -0.1f, 0.1f));
  DeviceTensor up = upload(*gpu_, random_tensor(dtype, {intermediate, d}, 1004, -0.1f, 0.1f));
  DeviceTensor down = upload(*gpu_, random_tensor(dtype, {d, intermediate}, 1005, -0.1f, 0.1f));
  DeviceTensor latent = device_empty(*gpu_, dtype, {tokens, l});
  DeviceTensor out = device_empty(*gpu_, dtype, {tokens, d});
  auto forward = [&] {
    gpu_->linear(x.view, w_down.view, latent.view, false);
    gpu_->dense_mlp(activation, x.view, MlpWeights{gate.view, up.view, down.view}, out.view);
    gpu_->linear(latent.view, w_up.view, out.view, true);
  };
  auto run_eager = [&](uint32_t seed) {
    gpu_->copy(random_tensor(dtype, {tokens, d}, seed).view(), x.view);
    forward();
    return download(*gpu_, out.view);
  };
  const HostTensor eager_a = run_eager(11), eager_b = run_eager(22);
  EXPECT_FALSE(bytes_equal(eager_a, eager_b));

  auto stream = static_cast<cudaStream_t>(gpu_->stream());
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  try {
    forward();
  } catch (...) {
    cudaStreamEndCapture(stream, &graph);
    throw;
  }
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (auto [seed, expected] : {std::pair<uint32_t, const HostTensor*>{11, &eager_a}, {22, &eager_b}}) {
    poison(*gpu_, out);
    poison(*gpu_, latent);
    gpu_->copy(random_tensor(dtype, {tokens, d}, seed).view(), x.view);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    EXPECT_TRUE(bytes_equal(download(*gpu_, out.view), *expected)) << "seed " << seed;
  }
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
}

}  // namespace
}  // namespace latentmoe::cuda::testing

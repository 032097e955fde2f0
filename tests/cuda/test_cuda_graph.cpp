// The stream rules of the CUDA backend: a whole layer's worth of operations (routing, projections,
// routed and shared experts through run_overlapped, norm, adds) is captured into one CUDA graph and
// replayed with new inputs, bit-identical to eager runs; the operations allocate no device memory
// once prepared; run_overlapped refuses to share a workspace between its two streams.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstring>

#include "cuda/cuda_backend.h"
#include "cuda_test_util.h"
#include "latentmoe/error.h"

namespace latentmoe::cuda::testing {
namespace {

using ::latentmoe::detail::ActivationParams;
using ::latentmoe::detail::MlpWeights;
using ::latentmoe::detail::RoutingParams;

bool bytes_equal(const HostTensor& a, const HostTensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

// A miniature layer on one device, all in bf16 except routing: d = 336, l = 192, E = 32 (+4 zero
// experts), k = 6, I = 96, Is = 160, T = 17.
class MiniLayer {
 public:
  static constexpr int64_t kTokens = 17, kHidden = 336, kLatent = 192, kExperts = 32, kZero = 4, kTopK = 6, kInter = 96,
                           kShared = 160;
  static constexpr DType kDType = DType::bf16;

  explicit MiniLayer(CudaBackend& gpu) : gpu_(gpu) {
    routing_.num_experts = kExperts;
    routing_.num_zero_experts = kZero;
    routing_.top_k = kTopK;
    activation_.activation = Activation::situ;
    x_ = device_empty(gpu, kDType, {kTokens, kHidden});
    gate_ = upload(gpu, random_tensor(kDType, {kExperts + kZero, kHidden}, 1));
    bias_ = upload(gpu, random_tensor(DType::f32, {kExperts + kZero}, 2, -0.1f, 0.1f));
    down_proj_ = upload(gpu, random_tensor(kDType, {kLatent, kHidden}, 3, -0.1f, 0.1f));
    norm_ = upload(gpu, random_tensor(DType::f32, {kLatent}, 4, 0.5f, 1.5f));
    up_proj_ = upload(gpu, random_tensor(kDType, {kHidden, kLatent}, 5, -0.1f, 0.1f));
    expert_gate_ = upload(gpu, random_tensor(kDType, {kExperts, kInter, kLatent}, 6, -0.1f, 0.1f));
    expert_up_ = upload(gpu, random_tensor(kDType, {kExperts, kInter, kLatent}, 7, -0.1f, 0.1f));
    expert_down_ = upload(gpu, random_tensor(kDType, {kExperts, kLatent, kInter}, 8, -0.1f, 0.1f));
    shared_gate_ = upload(gpu, random_tensor(kDType, {kShared, kHidden}, 9, -0.1f, 0.1f));
    shared_up_ = upload(gpu, random_tensor(kDType, {kShared, kHidden}, 10, -0.1f, 0.1f));
    shared_down_ = upload(gpu, random_tensor(kDType, {kHidden, kShared}, 11, -0.1f, 0.1f));
    logits_ = device_empty(gpu, DType::f32, {kTokens, kExperts + kZero});
    ids_ = device_empty(gpu, DType::i32, {kTokens, kTopK});
    weights_ = device_empty(gpu, DType::f32, {kTokens, kTopK});
    zero_sum_ = device_empty(gpu, DType::f32, {kTokens});
    latent_ = device_empty(gpu, kDType, {kTokens, kLatent});
    latent_out_ = device_empty(gpu, kDType, {kTokens, kLatent});
    latent_norm_ = device_empty(gpu, kDType, {kTokens, kLatent});
    shared_ = device_empty(gpu, kDType, {kTokens, kHidden});
    out_ = device_empty(gpu, kDType, {kTokens, kHidden});
    WorkspaceSpec spec;
    spec.max_tokens = kTokens;
    spec.element_size = 2;
    spec.num_experts = kExperts;
    spec.top_k = kTopK;
    spec.latent_size = kLatent;
    spec.expert_intermediate = kInter;
    spec.dense_intermediate = kShared;
    gpu.prepare(spec);
  }

  void set_input(uint32_t seed) { gpu_.copy(random_tensor(kDType, {kTokens, kHidden}, seed).view(), x_.view); }

  // The forward: every operation enqueued on the backend's stream(s), nothing else.
  void forward() {
    gpu_.router_logits(x_.view, gate_.view, logits_.view);
    gpu_.route(routing_, logits_.view, bias_.view, ids_.view, weights_.view, zero_sum_.view);
    gpu_.linear(x_.view, down_proj_.view, latent_.view, false);
    gpu_.run_overlapped(
        [&] {
          gpu_.routed_experts(activation_, latent_.view, ids_.view, weights_.view,
                              MlpWeights{expert_gate_.view, expert_up_.view, expert_down_.view}, latent_out_.view);
          gpu_.rms_norm(latent_out_.view, norm_.view, 1e-5f, latent_norm_.view);
          gpu_.linear(latent_norm_.view, up_proj_.view, out_.view, false);
        },
        [&] {
          gpu_.dense_mlp(activation_, x_.view, MlpWeights{shared_gate_.view, shared_up_.view, shared_down_.view},
                         shared_.view);
        });
    gpu_.add(out_.view, shared_.view, out_.view);
    gpu_.add_scaled_rows(x_.view, zero_sum_.view, out_.view);
  }

  HostTensor output() { return download(gpu_, out_.view); }
  HostTensor ids() { return download(gpu_, ids_.view); }

  void poison_outputs() {
    for (DeviceTensor* tensor :
         {&logits_, &ids_, &weights_, &zero_sum_, &latent_, &latent_out_, &latent_norm_, &shared_, &out_}) {
      poison(gpu_, *tensor);
    }
  }

 private:
  CudaBackend& gpu_;
  RoutingParams routing_;
  ActivationParams activation_;
  DeviceTensor x_, gate_, bias_, down_proj_, norm_, up_proj_, expert_gate_, expert_up_, expert_down_, shared_gate_,
      shared_up_, shared_down_;
  DeviceTensor logits_, ids_, weights_, zero_sum_, latent_, latent_out_, latent_norm_, shared_, out_;
};

class CudaGraph : public ::testing::Test {
 protected:
  void SetUp() override {
    LATENTMOE_REQUIRE_GPU();
    gpu_ = std::make_unique<CudaBackend>(0);
  }
  std::unique_ptr<CudaBackend> gpu_;
};

TEST_F(CudaGraph, a_captured_layer_replays_with_new_inputs_bit_identically) {
  MiniLayer layer(*gpu_);
  // Eager reference outputs for two inputs (the first run also loads every kernel).
  layer.set_input(100);
  layer.forward();
  const HostTensor eager_a = layer.output();
  const HostTensor ids_a = layer.ids();
  layer.set_input(200);
  layer.forward();
  const HostTensor eager_b = layer.output();
  EXPECT_EQ(count_non_finite(eager_a), 0);
  EXPECT_FALSE(bytes_equal(eager_a, eager_b));

  auto stream = static_cast<cudaStream_t>(gpu_->stream());
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  try {
    layer.forward();
  } catch (...) {
    cudaStreamEndCapture(stream, &graph);
    throw;
  }
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  size_t num_nodes = 0;
  ASSERT_EQ(cudaGraphGetNodes(graph, nullptr, &num_nodes), cudaSuccess);
  EXPECT_GE(num_nodes, 10u);

  layer.poison_outputs();
  layer.set_input(100);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  EXPECT_TRUE(bytes_equal(layer.output(), eager_a));
  EXPECT_TRUE(bytes_equal(layer.ids(), ids_a));
  layer.poison_outputs();
  layer.set_input(200);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  EXPECT_TRUE(bytes_equal(layer.output(), eager_b));
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
}

TEST_F(CudaGraph, operations_allocate_no_device_memory) {
  MiniLayer layer(*gpu_);
  layer.set_input(1);
  layer.forward();  // loads the kernels and builds the GEMM plans
  ASSERT_EQ(cudaStreamSynchronize(static_cast<cudaStream_t>(gpu_->stream())), cudaSuccess);
  const int64_t allocations = gpu_->num_device_allocations();
  size_t free_before = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_before, &total), cudaSuccess);
  for (int i = 0; i < 3; ++i) layer.forward();
  ASSERT_EQ(cudaStreamSynchronize(static_cast<cudaStream_t>(gpu_->stream())), cudaSuccess);
  size_t free_after = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_after, &total), cudaSuccess);
  EXPECT_EQ(gpu_->num_device_allocations(), allocations);
  EXPECT_EQ(free_after, free_before);
}

TEST_F(CudaGraph, run_overlapped_refuses_one_workspace_on_both_streams) {
  MiniLayer layer(*gpu_);
  const HostTensor x = random_tensor(DType::bf16, {4, 32}, 1);
  const HostTensor w = random_tensor(DType::bf16, {16, 32}, 2);
  const HostTensor wd = random_tensor(DType::bf16, {32, 16}, 3);
  DeviceTensor dx = upload(*gpu_, x), dw = upload(*gpu_, w), dwd = upload(*gpu_, wd);
  DeviceTensor out_a = device_empty(*gpu_, DType::bf16, {4, 32}), out_b = device_empty(*gpu_, DType::bf16, {4, 32});
  const MlpWeights mlp{dw.view, dw.view, dwd.view};
  ActivationParams activation;
  EXPECT_THROW(gpu_->run_overlapped([&] { gpu_->dense_mlp(activation, dx.view, mlp, out_a.view); },
                                    [&] { gpu_->dense_mlp(activation, dx.view, mlp, out_b.view); }),
               Error);
  // The backend is usable afterwards, back on its main stream.
  EXPECT_NO_THROW(gpu_->run_overlapped([&] { gpu_->dense_mlp(activation, dx.view, mlp, out_a.view); },
                                       [&] { gpu_->add(dx.view, dx.view, out_b.view); }));
  const void* main_stream = gpu_->stream();
  const void* seen_in_aux = nullptr;
  gpu_->run_overlapped([] {}, [&] { seen_in_aux = gpu_->stream(); });
  EXPECT_NE(seen_in_aux, main_stream);
  EXPECT_EQ(gpu_->stream(), main_stream);
  EXPECT_EQ(count_non_finite(download(*gpu_, out_a.view)), 0);
}

}  // namespace
}  // namespace latentmoe::cuda::testing

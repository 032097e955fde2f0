// The stream rules of the CUDA path, through the public API: Runner::forward enqueues everything on
// the caller's stream, so an engine can capture it into a CUDA graph and replay it with new inputs,
// bit-identical to eager runs; forward allocates no device memory; weights given as device views are
// used in place; run_overlapped refuses to share a workspace between its two streams.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include "core/runner_state.h"
#include "cuda_test_util.h"
#include "latentmoe/compare.h"
#include "latentmoe/error.h"
#include "latentmoe/in_process_group.h"
#include "latentmoe/runner.h"
#include "latentmoe/weights.h"
#include "layer_test_util.h"

namespace latentmoe::cuda::testing {
namespace {

using ::latentmoe::detail::ActivationParams;
using ::latentmoe::detail::MlpWeights;

// A stream of the test's own (the caller's stream of an engine), destroyed at the end.
class OwnStream {
 public:
  OwnStream() { EXPECT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess); }
  ~OwnStream() { cudaStreamDestroy(stream_); }
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// A Kimi-like layer (situ, latent norm, zero experts, bias) at tp 1 in bf16 on the GPU, its weights
// uploaded by the test and handed to the Runner as device views, its inputs and outputs in device
// buffers the test owns; every copy and the forward on one caller stream.
class GraphLayer {
 public:
  static constexpr int64_t kTokens = 17;
  static constexpr DType kDType = DType::bf16;

  GraphLayer()
      : config_(latentmoe::testing::kimi_like_config()),
        host_weights_(make_random_layer_weights(config_, kDType, 7)),
        staging_(detail::make_cuda_backend(0)),
        group_(make_in_process_group(1)) {
    LayerWeightViews views = views_of(host_weights_);
    for (TensorView* field : {&views.down_proj, &views.up_proj, &views.expert_gate, &views.expert_up,
                              &views.expert_down, &views.shared_gate, &views.shared_up, &views.shared_down}) {
      device_weights_.push_back(upload(*staging_, to_host_tensor(*field, field->dtype())));
      *field = device_weights_.back().view;
    }
    up_proj_ = views.up_proj;
    staging_->synchronize();
    RunnerOptions options;
    options.backend = BackendKind::cuda;
    options.max_tokens = kTokens;
    runner_ = std::make_unique<Runner>(config_, ParallelConfig{}, views, *group_[0], options);
    x_ = device_empty(*staging_, kDType, {kTokens, config_.hidden_size});
    out_ = device_empty(*staging_, kDType, {kTokens, config_.hidden_size});
    ids_ = device_empty(*staging_, DType::i32, {kTokens, config_.top_k});
  }

  // Writes a new input, stream-ordered on `stream` (no host sync before the forward).
  void set_input(uint64_t seed, cudaStream_t stream) {
    input_ = latentmoe::testing::random_host_tensor(kDType, {kTokens, config_.hidden_size}, seed);
    ASSERT_EQ(cudaMemcpyAsync(x_.view.data(), input_.data(), input_.nbytes(), cudaMemcpyHostToDevice, stream),
              cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);  // input_ is pageable: finish before it changes
  }
  void poison_outputs(cudaStream_t stream) {
    ASSERT_EQ(cudaMemsetAsync(out_.view.data(), 0xff, out_.buffer.bytes(), stream), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(ids_.view.data(), 0xff, ids_.buffer.bytes(), stream), cudaSuccess);
  }
  void forward(cudaStream_t stream) {
    ForwardInputs inputs;
    inputs.hidden_states = x_.view;
    runner_->forward(inputs, ForwardOutputs{out_.view, ids_.view, {}}, stream);
  }
  HostTensor output(cudaStream_t stream) { return fetch(out_.view, stream); }
  HostTensor ids(cudaStream_t stream) { return fetch(ids_.view, stream); }

  Runner& runner() { return *runner_; }
  const TensorView& up_proj() const { return up_proj_; }

 private:
  HostTensor fetch(const TensorView& view, cudaStream_t stream) {
    HostTensor host(view.dtype(), view.shape());
    EXPECT_EQ(cudaMemcpyAsync(host.data(), view.data(), host.nbytes(), cudaMemcpyDeviceToHost, stream), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    return host;
  }

  LayerConfig config_;
  LayerWeights host_weights_;
  std::unique_ptr<detail::Backend> staging_;  // owns the test's device buffers
  std::vector<std::unique_ptr<Communicator>> group_;
  std::vector<DeviceTensor> device_weights_;
  TensorView up_proj_;
  std::unique_ptr<Runner> runner_;
  DeviceTensor x_, out_, ids_;
  HostTensor input_;
};

TEST(CudaGraph, a_captured_runner_forward_replays_with_new_inputs_bit_identically) {
  LATENTMOE_REQUIRE_GPU();
  GraphLayer layer;
  OwnStream stream;
  // Eager reference outputs for two inputs (the first run also loads every kernel).
  layer.set_input(100, stream.get());
  layer.forward(stream.get());
  const HostTensor eager_a = layer.output(stream.get());
  const HostTensor ids_a = layer.ids(stream.get());
  layer.set_input(200, stream.get());
  layer.forward(stream.get());
  const HostTensor eager_b = layer.output(stream.get());
  EXPECT_EQ(count_non_finite(eager_a), 0);
  EXPECT_FALSE(bitwise_equal(eager_a.view(), eager_b.view()));

  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal), cudaSuccess);
  try {
    layer.forward(stream.get());
  } catch (...) {
    cudaStreamEndCapture(stream.get(), &graph);
    throw;
  }
  ASSERT_EQ(cudaStreamEndCapture(stream.get(), &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  size_t num_nodes = 0;
  ASSERT_EQ(cudaGraphGetNodes(graph, nullptr, &num_nodes), cudaSuccess);
  EXPECT_GE(num_nodes, 8u);

  layer.poison_outputs(stream.get());
  layer.set_input(100, stream.get());
  ASSERT_EQ(cudaGraphLaunch(exec, stream.get()), cudaSuccess);
  EXPECT_TRUE(bitwise_equal(layer.output(stream.get()).view(), eager_a.view()));
  EXPECT_TRUE(bitwise_equal(layer.ids(stream.get()).view(), ids_a.view()));
  layer.poison_outputs(stream.get());
  layer.set_input(200, stream.get());
  ASSERT_EQ(cudaGraphLaunch(exec, stream.get()), cudaSuccess);
  EXPECT_TRUE(bitwise_equal(layer.output(stream.get()).view(), eager_b.view()));
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
}

TEST(CudaGraph, forward_allocates_no_device_memory) {
  LATENTMOE_REQUIRE_GPU();
  GraphLayer layer;
  OwnStream stream;
  layer.set_input(1, stream.get());
  layer.forward(stream.get());  // loads the kernels and builds the GEMM plans
  ASSERT_EQ(cudaStreamSynchronize(stream.get()), cudaSuccess);
  auto& backend = dynamic_cast<CudaBackend&>(*detail::RunnerAccess::state(layer.runner()).backend);
  const int64_t allocations = backend.num_device_allocations();
  size_t free_before = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_before, &total), cudaSuccess);
  for (int i = 0; i < 3; ++i) layer.forward(stream.get());
  ASSERT_EQ(cudaStreamSynchronize(stream.get()), cudaSuccess);
  size_t free_after = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_after, &total), cudaSuccess);
  EXPECT_EQ(backend.num_device_allocations(), allocations);
  EXPECT_EQ(free_after, free_before);
}

TEST(CudaGraph, device_weight_views_are_used_in_place) {
  LATENTMOE_REQUIRE_GPU();
  GraphLayer layer;
  OwnStream stream;
  layer.set_input(5, stream.get());
  layer.forward(stream.get());
  const HostTensor before = layer.output(stream.get());
  // Zeroing the caller's W_up changes what the runner computes: it holds no copy of it.
  ASSERT_EQ(
      cudaMemsetAsync(layer.up_proj().data(), 0,
                      static_cast<size_t>(layer.up_proj().numel()) * dtype_size(layer.up_proj().dtype()), stream.get()),
      cudaSuccess);
  layer.forward(stream.get());
  const HostTensor after = layer.output(stream.get());
  EXPECT_FALSE(bitwise_equal(before.view(), after.view()));
  EXPECT_EQ(count_non_finite(after), 0);
}

TEST(CudaGraph, run_overlapped_refuses_one_workspace_on_both_streams) {
  LATENTMOE_REQUIRE_GPU();
  CudaBackend gpu(0);
  WorkspaceSpec spec;
  spec.max_tokens = 4;
  spec.element_size = 2;
  spec.dense_intermediate = 16;
  gpu.prepare(spec);
  const HostTensor x = random_tensor(DType::bf16, {4, 32}, 1);
  const HostTensor w = random_tensor(DType::bf16, {16, 32}, 2);
  const HostTensor wd = random_tensor(DType::bf16, {32, 16}, 3);
  DeviceTensor dx = upload(gpu, x), dw = upload(gpu, w), dwd = upload(gpu, wd);
  DeviceTensor out_a = device_empty(gpu, DType::bf16, {4, 32}), out_b = device_empty(gpu, DType::bf16, {4, 32});
  const MlpWeights mlp{dw.view, dw.view, dwd.view};
  ActivationParams activation;
  EXPECT_THROW(gpu.run_overlapped([&] { gpu.dense_mlp(activation, dx.view, mlp, out_a.view); },
                                  [&] { gpu.dense_mlp(activation, dx.view, mlp, out_b.view); }),
               Error);
  // The backend is usable afterwards, back on its main stream.
  EXPECT_NO_THROW(gpu.run_overlapped([&] { gpu.dense_mlp(activation, dx.view, mlp, out_a.view); },
                                     [&] { gpu.add(dx.view, dx.view, out_b.view); }));
  const void* main_stream = gpu.stream();
  const void* seen_in_aux = nullptr;
  gpu.run_overlapped([] {}, [&] { seen_in_aux = gpu.stream(); });
  EXPECT_NE(seen_in_aux, main_stream);
  EXPECT_EQ(gpu.stream(), main_stream);
  EXPECT_EQ(count_non_finite(download(gpu, out_a.view)), 0);
}

}  // namespace
}  // namespace latentmoe::cuda::testing

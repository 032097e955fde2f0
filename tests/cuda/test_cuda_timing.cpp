// Not a timed test: a disabled probe that prints the device time of the backend's operations at the
// Kimi K3 shapes of one tp=8 rank (d 7168, l 3584, E 896, k 16, I/8 384, Is/8 768, bf16), for
// docs/CUDA_BACKEND.md. Run it on a GPU with --gtest_also_run_disabled_tests
// --gtest_filter='*CudaTiming*'. Each figure: 20 calls captured in one CUDA graph, the graph replayed
// 5 times after a warm-up, the mean per call (so launch gaps inside a graph are included).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <functional>

#include "cuda/cuda_backend.h"
#include "cuda/elementwise.cuh"
#include "cuda/routing.cuh"
#include "cuda_test_util.h"

namespace latentmoe::cuda::testing {
namespace {

using ::latentmoe::detail::ActivationParams;
using ::latentmoe::detail::MlpWeights;
using ::latentmoe::detail::RoutingParams;

double microseconds_per_call(CudaBackend& gpu, const std::function<void()>& op) {
  auto stream = static_cast<cudaStream_t>(gpu.stream());
  op();  // eager warm-up: kernels loaded, GEMM plans built
  constexpr int kCallsPerGraph = 20, kReplays = 5;
  cudaGraph_t graph = nullptr;
  EXPECT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  for (int i = 0; i < kCallsPerGraph; ++i) op();
  EXPECT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  EXPECT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  EXPECT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  cudaEventRecord(start, stream);
  for (int i = 0; i < kReplays; ++i) cudaGraphLaunch(exec, stream);
  cudaEventRecord(stop, stream);
  EXPECT_EQ(cudaEventSynchronize(stop), cudaSuccess);
  float milliseconds = 0.0f;
  cudaEventElapsedTime(&milliseconds, start, stop);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return 1000.0 * milliseconds / (kCallsPerGraph * kReplays);
}

// Any finite bf16 content will do for timing: every byte 0x3c (bf16 0x3c3c = 0.0115).
DeviceTensor filled(Backend& backend, DType dtype, const std::vector<int64_t>& shape) {
  DeviceTensor tensor = device_empty(backend, dtype, shape);
  EXPECT_EQ(
      cudaMemsetAsync(tensor.buffer.get(), 0x3c, tensor.buffer.bytes(), static_cast<cudaStream_t>(backend.stream())),
      cudaSuccess);
  return tensor;
}

TEST(CudaTiming, DISABLED_kimi_k3_tp8_rank) {
  LATENTMOE_REQUIRE_GPU();
  constexpr int64_t d = 7168, l = 3584, e = 896, k = 16, inter = 384, shared = 768, max_tokens = 4096;
  constexpr DType dtype = DType::bf16;
  CudaBackend gpu(0);
  WorkspaceSpec spec;
  spec.max_tokens = max_tokens;
  spec.element_size = 2;
  spec.num_experts = e;
  spec.top_k = k;
  spec.latent_size = l;
  spec.expert_intermediate = inter;
  spec.dense_intermediate = shared;
  spec.hidden_size = d;
  gpu.prepare(spec);
  DeviceTensor x = filled(gpu, dtype, {max_tokens, d});
  DeviceTensor gate = filled(gpu, dtype, {e, d});
  DeviceTensor gate_f32 = upload(gpu, random_tensor(DType::f32, {e, d}, 4, -0.05f, 0.05f));
  DeviceTensor bias = upload(gpu, random_tensor(DType::f32, {e}, 1, -0.1f, 0.1f));
  DeviceTensor logits = upload(gpu, random_tensor(DType::f32, {max_tokens, e}, 2, -4.0f, 4.0f));
  DeviceTensor ids = device_empty(gpu, DType::i32, {max_tokens, k});
  DeviceTensor weights = device_empty(gpu, DType::f32, {max_tokens, k});
  DeviceTensor zero_sum = device_empty(gpu, DType::f32, {max_tokens});
  DeviceTensor down_proj = filled(gpu, dtype, {l, d});
  DeviceTensor z = filled(gpu, dtype, {max_tokens, l});
  DeviceTensor latent_out = device_empty(gpu, dtype, {max_tokens, l});
  DeviceTensor norm = upload(gpu, random_tensor(DType::f32, {l}, 3, 0.5f, 1.5f));
  DeviceTensor expert_gate = filled(gpu, dtype, {e, inter, l});
  DeviceTensor expert_up = filled(gpu, dtype, {e, inter, l});
  DeviceTensor expert_down = filled(gpu, dtype, {e, l, inter});
  DeviceTensor shared_gate = filled(gpu, dtype, {shared, d});
  DeviceTensor shared_up = filled(gpu, dtype, {shared, d});
  DeviceTensor shared_down = filled(gpu, dtype, {d, shared});
  DeviceTensor out = device_empty(gpu, dtype, {max_tokens, d});
  const size_t layout_bytes = moe_layout_workspace_bytes(max_tokens, k, e);
  DeviceTensor layout_workspace = device_empty(gpu, DType::u8, {static_cast<int64_t>(layout_bytes)});
  DeviceTensor y_rows = filled(gpu, dtype, {max_tokens * k, l});
  RoutingParams routing;
  routing.num_experts = e;
  routing.top_k = k;
  ActivationParams activation;
  activation.activation = Activation::situ;
  auto stream = [&] { return static_cast<cudaStream_t>(gpu.stream()); };

  std::printf("# Kimi K3, one tp=8 rank, bf16, H200; microseconds per call (20 calls per graph)\n");
  std::printf("%6s %9s %9s %9s %9s %9s %9s %9s %9s %9s %9s\n", "tokens", "router", "router32", "route", "layout",
              "combine", "experts", "rmsnorm", "down_proj", "up_proj", "shared");
  for (int64_t tokens : {int64_t{1}, int64_t{8}, int64_t{64}, int64_t{256}, int64_t{1024}, int64_t{4096}}) {
    const TensorView xt = x.view.slice_rows(0, tokens);
    const TensorView logits_t = logits.view.slice_rows(0, tokens);
    const TensorView ids_t = ids.view.slice_rows(0, tokens), weights_t = weights.view.slice_rows(0, tokens);
    const TensorView zero_t = zero_sum.view.slice_rows(0, tokens);
    const TensorView z_t = z.view.slice_rows(0, tokens), latent_t = latent_out.view.slice_rows(0, tokens);
    const TensorView out_t = out.view.slice_rows(0, tokens);
    DeviceTensor router_out = device_empty(gpu, DType::f32, {tokens, e});
    gpu.route(routing, logits_t, bias.view, ids_t, weights_t, zero_t);  // realistic ids for the experts
    const RowMatrix combine_out{latent_t.data(), dtype, tokens, l, l};
    const MoeLayout layout_of_ids = build_moe_layout(ids_t.data_as<const int32_t>(), tokens, k, e,
                                                     layout_workspace.buffer.get(), layout_bytes, stream());
    const double router = microseconds_per_call(gpu, [&] { gpu.router_logits(xt, gate.view, router_out.view); });
    const double router32 = microseconds_per_call(gpu, [&] { gpu.router_logits(xt, gate_f32.view, router_out.view); });
    const double route =
        microseconds_per_call(gpu, [&] { gpu.route(routing, logits_t, bias.view, ids_t, weights_t, zero_t); });
    const double layout = microseconds_per_call(gpu, [&] {
      build_moe_layout(ids_t.data_as<const int32_t>(), tokens, k, e, layout_workspace.buffer.get(), layout_bytes,
                       stream());
    });
    const double combine = microseconds_per_call(gpu, [&] {
      launch_combine(dtype, y_rows.buffer.get(), layout_of_ids.pair_rows, weights_t.data_as<const float>(), k,
                     combine_out, stream());
    });
    const double experts = microseconds_per_call(gpu, [&] {
      gpu.routed_experts(activation, z_t, ids_t, weights_t,
                         MlpWeights{expert_gate.view, expert_up.view, expert_down.view}, latent_t);
    });
    const double rmsnorm = microseconds_per_call(gpu, [&] { gpu.rms_norm(latent_t, norm.view, 1e-5f, latent_t); });
    const double down = microseconds_per_call(gpu, [&] { gpu.linear(xt, down_proj.view, z_t, false); });
    const double up = microseconds_per_call(gpu, [&] {
      gpu.linear(z_t, down_proj.view.reshaped({d, l}), out_t, false);
    });
    const double shared_mlp = microseconds_per_call(gpu, [&] {
      gpu.dense_mlp(activation, xt, MlpWeights{shared_gate.view, shared_up.view, shared_down.view}, out_t);
    });
    std::printf("%6lld %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f\n", static_cast<long long>(tokens),
                router, router32, route, layout, combine, experts, rmsnorm, down, up, shared_mlp);
  }
}

}  // namespace
}  // namespace latentmoe::cuda::testing

// Pieces the CUDA-graph replay tests share (test_gpu_group.cpp on simulated ranks, test_nccl_group.cpp
// on real GPUs): pinned host buffers, and the replay loop that counts wrong replays.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <memory>
#include <vector>

namespace latentmoe::cuda::testing {

// Pinned host memory (copies into it never go through the driver's pageable staging).
struct PinnedBuffer {
  void* data = nullptr;
  explicit PinnedBuffer(size_t bytes) { EXPECT_EQ(cudaMallocHost(&data, bytes), cudaSuccess); }
  ~PinnedBuffer() { cudaFreeHost(data); }
};

// `replays` launches on `stream` of one rank's graphs (graphs[t], one per tier, captured reading `x` and
// writing `out`, `bytes` each): replay n writes input n % inputs.size() into x, poisons out, replays
// tier (n / inputs.size()) % graphs.size() and compares out, copied into `result`, with
// expected(input, tier). Returns how many replays had a wrong byte (every replay left, after a failed
// CUDA call).
inline int wrong_replays(cudaStream_t stream, const std::vector<cudaGraphExec_t>& graphs, void* x, void* out,
                         size_t bytes, const std::vector<std::unique_ptr<PinnedBuffer>>& inputs, PinnedBuffer& result,
                         const std::function<const void*(int input, int tier)>& expected, int replays) {
  const int num_inputs = static_cast<int>(inputs.size()), num_tiers = static_cast<int>(graphs.size());
  auto ok = [](cudaError_t error) {
    EXPECT_EQ(error, cudaSuccess) << cudaGetErrorString(error);
    return error == cudaSuccess;
  };
  int wrong = 0;
  for (int replay = 0; replay < replays; ++replay) {
    const int i = replay % num_inputs, t = (replay / num_inputs) % num_tiers;
    if (!ok(cudaMemcpyAsync(x, inputs[i]->data, bytes, cudaMemcpyHostToDevice, stream)) ||
        !ok(cudaMemsetAsync(out, 0xff, bytes, stream)) || !ok(cudaGraphLaunch(graphs[t], stream)) ||
        !ok(cudaMemcpyAsync(result.data, out, bytes, cudaMemcpyDeviceToHost, stream)) ||
        !ok(cudaStreamSynchronize(stream))) {
      return wrong + replays - replay;
    }
    if (std::memcmp(result.data, expected(i, t), bytes) != 0) ++wrong;
  }
  return wrong;
}

}  // namespace latentmoe::cuda::testing

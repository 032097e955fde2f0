// Helpers of the CUDA backend tests: device tensors owned by the backend under test, seeded random
// host tensors, poisoned outputs (all bits set: NaN for every float dtype, -1 for i32) and the
// relative error ||out - ref|| / ||ref||.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <exception>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/backend.h"
#include "cuda/backend/cuda_backend.h"
#include "latentmoe/dtype.h"
#include "latentmoe/tensor.h"

namespace latentmoe::cuda::testing {

using ::latentmoe::detail::Backend;
using ::latentmoe::detail::DeviceBuffer;

#define LATENTMOE_REQUIRE_GPU()                                                        \
  do {                                                                                 \
    if (::latentmoe::cuda::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device"; \
  } while (false)

// A device tensor owned by the test (memory from the backend under test).
struct DeviceTensor {
  DeviceBuffer buffer;
  TensorView view;
};

inline DeviceTensor device_empty(Backend& backend, DType dtype, const std::vector<int64_t>& shape) {
  int64_t count = 1;
  for (int64_t extent : shape) count *= extent;
  DeviceTensor tensor;
  tensor.buffer = backend.allocate(static_cast<size_t>(std::max<int64_t>(count, 1)) * dtype_size(dtype));
  tensor.view = TensorView(tensor.buffer.get(), dtype, shape, Device::cuda);
  return tensor;
}

inline DeviceTensor upload(Backend& backend, const HostTensor& host) {
  DeviceTensor tensor = device_empty(backend, host.dtype(), host.shape());
  backend.copy(host.view(), tensor.view);
  return tensor;
}

// A contiguous host copy of a device view (which may be a strided column block).
inline HostTensor download(Backend& backend, const TensorView& view) {
  HostTensor host(view.dtype(), view.shape());
  backend.copy(view, host.view());
  return host;
}

// Every byte 0xff, stream-ordered on the backend's stream.
inline void poison(Backend& backend, const DeviceTensor& tensor) {
  ASSERT_EQ(
      cudaMemsetAsync(tensor.buffer.get(), 0xff, tensor.buffer.bytes(), static_cast<cudaStream_t>(backend.stream())),
      cudaSuccess);
}

inline DeviceTensor poisoned(Backend& backend, DType dtype, const std::vector<int64_t>& shape) {
  DeviceTensor tensor = device_empty(backend, dtype, shape);
  poison(backend, tensor);
  return tensor;
}

// Uniform values in [low, high), rounded to `dtype`; fixed seed.
inline HostTensor random_tensor(DType dtype, const std::vector<int64_t>& shape, uint32_t seed, float low = -1.0f,
                                float high = 1.0f) {
  HostTensor tensor(dtype, shape);
  std::mt19937 generator(seed);
  std::uniform_real_distribution<float> distribution(low, high);
  for (int64_t i = 0; i < tensor.numel(); ++i) store_from_float(tensor.data(), dtype, i, distribution(generator));
  return tensor;
}

inline float value_at(const HostTensor& tensor, int64_t index) {
  return load_as_float(tensor.data(), tensor.dtype(), index);
}

// ||out - ref|| / ||ref|| over all elements (ref != 0 somewhere).
inline double relative_error(const HostTensor& out, const HostTensor& ref) {
  EXPECT_EQ(out.numel(), ref.numel());
  double diff = 0.0, norm = 0.0;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    const double a = value_at(out, i), b = value_at(ref, i);
    diff += (a - b) * (a - b);
    norm += b * b;
  }
  return norm > 0.0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

// Number of elements that are NaN or infinite (a poisoned, unwritten element reads as NaN).
inline int64_t count_non_finite(const HostTensor& tensor) {
  int64_t count = 0;
  for (int64_t i = 0; i < tensor.numel(); ++i) count += std::isfinite(value_at(tensor, i)) ? 0 : 1;
  return count;
}

// The tolerance of a compute dtype (the limits).
inline double tolerance(DType dtype) { return dtype == DType::f32 ? 1e-5 : 1e-2; }

inline std::string name_of(DType dtype) { return std::string(dtype_name(dtype)); }

// dense_mlp of `gpu` against `cpu` on seeded random inputs x [tokens, d] (in [-2, 2)) and weights
// (in [-0.15, 0.15)): every output written, finite and within tolerance(dtype). The caller prepares
// the workspace and picks the path (cuBLASLt or the skinny kernels) through the backend's knobs.
inline void check_dense_mlp(CudaBackend& gpu, Backend& cpu, Activation act, DType dtype, int64_t tokens, int64_t d,
                            int64_t inter, uint32_t seed) {
  SCOPED_TRACE(std::string(to_string(act)) + ", " + name_of(dtype) + ", T = " + std::to_string(tokens) +
               ", d = " + std::to_string(d) + ", Is = " + std::to_string(inter));
  ::latentmoe::detail::ActivationParams activation;
  activation.activation = act;
  const bool gated = act != Activation::relu2;
  const HostTensor x = random_tensor(dtype, {tokens, d}, seed, -2.0f, 2.0f);
  const HostTensor gate = random_tensor(dtype, {inter, d}, seed + 1, -0.15f, 0.15f);
  const HostTensor up = random_tensor(dtype, {inter, d}, seed + 2, -0.15f, 0.15f);
  const HostTensor down = random_tensor(dtype, {d, inter}, seed + 3, -0.15f, 0.15f);
  HostTensor ref(dtype, {tokens, d});
  cpu.dense_mlp(activation, x.view(),
                ::latentmoe::detail::MlpWeights{gated ? gate.view() : TensorView(), up.view(), down.view()},
                ref.view());
  DeviceTensor dx = upload(gpu, x), dgate = upload(gpu, gate), dup = upload(gpu, up), ddown = upload(gpu, down);
  DeviceTensor dout = poisoned(gpu, dtype, {tokens, d});
  gpu.dense_mlp(activation, dx.view,
                ::latentmoe::detail::MlpWeights{gated ? dgate.view : TensorView(), dup.view, ddown.view}, dout.view);
  const HostTensor out = download(gpu, dout.view);
  EXPECT_EQ(count_non_finite(out), 0);
  EXPECT_LT(relative_error(out, ref), tolerance(dtype));
}

// Runs `body(rank)` on one thread per rank (the ranks' launches interleave as they would in a
// process with one thread per GPU); an exception on a rank's thread becomes a test failure. The
// bodies must not allocate or free device memory: cudaMalloc and cudaFree may wait for the device,
// where a peer's collective is waiting for this rank.
inline void on_rank_threads(int tp, const std::function<void(int)>& body) {
  std::vector<std::thread> threads;
  for (int r = 0; r < tp; ++r) {
    threads.emplace_back([&body, r] {
      try {
        body(r);
      } catch (const std::exception& error) {
        ADD_FAILURE() << "rank " << r << ": " << error.what();
      }
    });
  }
  for (auto& thread : threads) thread.join();
}

}  // namespace latentmoe::cuda::testing

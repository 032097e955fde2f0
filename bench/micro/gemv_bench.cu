// Why is the decode GEMV (src/cuda/gemm/gemv.h) slower than cuBLASLt at one row? A measurement for
// docs/CUDA_BACKEND.md: the two Kimi-K3 linears at one token (W_down [3584, 7168], W_up [7168, 3584],
// bf16, 51 MB each), each timed alone after an L2 flush (a read of 512 MB), CUDA events, median of 30
// after 3 warm-ups:
//   read      a plain read of the same 51 MB (16-byte loads, 8 in flight per thread, grid of 4 CTAs of
//             512 threads per SM): the ceiling of a one-pass kernel of this size
//   cublas    cublasGemmEx, bf16 in, fp32 compute (what CudaBackend::linear runs without the GEMV)
//   gemv w/s  gemv() with w warps per CTA and clusters of s CTAs (0: the launcher's choice)
// Timing (L2 flush by reading, events, warm-ups, median), the repro line and the JSON: the benchmark
// harness (bench/harness/timing.h). Build: the gemv_bench target (bench/CMakeLists.txt).
// Usage: gemv_bench [--json FILE]
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "cuda/gemm/gemv.h"
#include "cuda/kernels/fill.h"
#include "harness/cublas_handle.h"
#include "harness/timing.h"
#include "latentmoe/error.h"

namespace {

// Reads n 16-byte vectors, 8 loads in flight per thread, and keeps one xor so nothing is dropped.
__global__ void read_kernel(const uint4* p, size_t n, uint32_t* sink) {
  uint32_t acc = 0;
  const size_t stride = size_t{gridDim.x} * blockDim.x;
  size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x;
  for (; i + 7 * stride < n; i += 8 * stride) {
    uint4 v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = __ldcs(p + i + j * stride);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  }
  for (; i < n; i += stride) {
    const uint4 v = __ldcs(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) *sink = acc;
}

int run(int argc, char** argv) {
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    LATENTMOE_CHECK(a == "--json" && i + 1 < argc, "usage: gemv_bench [--json FILE]");
    json_path = argv[++i];
  }
  using latentmoe::bench::DeviceMemory;
  int device = 0, sms = 0;
  LATENTMOE_CUDA_CHECK(cudaGetDevice(&device));
  LATENTMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  cudaStream_t stream = nullptr;
  LATENTMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // 3 warm-ups, the median of 30, the L2 flushed by reading 512 MiB before each run.
  latentmoe::bench::Timer timer({.warmup = 3, .iterations = 30, .flush_l2 = true}, size_t{512} << 20);
  const DeviceMemory sink(16);
  const latentmoe::bench::CublasHandle handle(stream);

  struct Shape {
    const char* name;
    int64_t n, k;
  };
  const Shape shapes[] = {{"W_down", 3584, 7168}, {"W_up", 7168, 3584}};
  nlohmann::json report;
  report["bench"] = "gemv_bench";
  report["rows"] = nlohmann::json::array();
  std::printf("# gemv_bench  one row, bf16, L2 flushed before each run, median of 30 (us)\n");
  std::printf("# %-7s %-12s %9s %8s\n", "matrix", "kernel", "time_us", "TB/s");
  for (const Shape& s : shapes) {
    const size_t elements = static_cast<size_t>(s.n * s.k);
    const DeviceMemory w(elements * 2), x(s.k * 2), y(s.n * 2);
    latentmoe::cuda::fill_uniform(w.get(), latentmoe::DType::bf16, static_cast<int64_t>(elements), 1, 1.0f, 0.0f,
                                  stream);
    latentmoe::cuda::fill_uniform(x.get(), latentmoe::DType::bf16, s.k, 2, 1.0f, 0.0f, stream);
    LATENTMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    const double bytes = static_cast<double>(elements) * 2;
    auto report_row = [&](const std::string& kernel, double us) {
      std::printf("  %-7s %-12s %9.2f %8.2f\n", s.name, kernel.c_str(), us, bytes / us * 1e-6);
      report["rows"].push_back({{"matrix", s.name},
                                {"n", s.n},
                                {"k", s.k},
                                {"kernel", kernel},
                                {"time_us", us},
                                {"tb_per_s", bytes / us * 1e-6}});
    };
    report_row("read", timer.median_us(stream, [&] {
      read_kernel<<<sms * 4, 512, 0, stream>>>(w.as<const uint4>(), elements / 8, sink.as<uint32_t>());
      LATENTMOE_CUDA_CHECK_LAUNCH("read_kernel");
    }));
    const float one = 1.0f, zero = 0.0f;
    report_row("cublas", timer.median_us(stream, [&] {
      // y[n] = W[n, k] x[k]: column-major W^T is [k, n], so op(A) = A^T with A = W^T (lda = k).
      LATENTMOE_CUBLAS_CHECK(cublasGemmEx(handle.get(), CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(s.n), 1,
                                          static_cast<int>(s.k), &one, w.get(), CUDA_R_16BF, static_cast<int>(s.k),
                                          x.get(), CUDA_R_16BF, static_cast<int>(s.k), &zero, y.get(), CUDA_R_16BF,
                                          static_cast<int>(s.n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }));
    for (int warps : {8, 12, 16}) {
      for (int split : {0, 1, 2}) {
        latentmoe::cuda::GemvShape shape;
        shape.warps = warps;
        shape.split = split;
        report_row("gemv " + std::to_string(warps) + "/" + std::to_string(split), timer.median_us(stream, [&] {
          latentmoe::cuda::gemv(latentmoe::DType::bf16, x.get(), s.k, 1, w.get(), s.k, s.n, s.k, y.get(), s.n, false,
                                stream, shape);
        }));
      }
    }
  }
  latentmoe::bench::Repro repro("gemv_bench");
  repro.print();
  report["repro"] = repro.line();
  if (!json_path.empty()) latentmoe::bench::write_json(json_path, report);
  LATENTMOE_CUDA_CHECK(cudaStreamDestroy(stream));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return latentmoe::bench::run_main("gemv_bench", [&] { return run(argc, argv); });
}

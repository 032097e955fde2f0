// Why is the decode GEMV (src/cuda/gemm/gemv.h) slower than cuBLASLt at one row? A measurement for
// docs/CUDA_BACKEND.md: the two Kimi-K3 linears at one token (W_down [3584, 7168], W_up [7168, 3584],
// bf16, 51 MB each), each timed alone after an L2 flush (a read of 512 MB), CUDA events, median of 30
// after 3 warm-ups:
//   read      a plain read of the same 51 MB (16-byte loads, 8 in flight per thread, grid of 4 CTAs of
//             512 threads per SM): the ceiling of a one-pass kernel of this size
//   cublas    cublasGemmEx, bf16 in, fp32 compute (what CudaBackend::linear runs without the GEMV)
//   gemv w/s  gemv() with w warps per CTA and clusters of s CTAs (0: the launcher's choice)
// Build: the gemv_bench target (bench/CMakeLists.txt). Usage: gemv_bench [--json FILE]
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda/common/device.h"
#include "cuda/gemm/gemv.h"

namespace {

#define CHECK(x)                                                                     \
  do {                                                                               \
    cudaError_t e = (x);                                                             \
    if (e != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

__global__ void fill_kernel(uint16_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    // bf16 of a value in about [-1, 1): sign, exponent 119..126, random mantissa
    p[i] = static_cast<uint16_t>(((h & 1u) << 15) | ((119u + (h >> 1) % 8u) << 7) | ((h >> 8) & 0x7fu));
  }
}

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

struct Timer {
  cudaStream_t stream;
  uint4* flush;
  size_t flush_vectors;
  uint32_t* sink;
  int sms;
  template <class F>
  double median_us(F&& f) {
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    std::vector<float> times;
    for (int i = 0; i < 33; ++i) {
      read_kernel<<<sms * 4, 512, 0, stream>>>(flush, flush_vectors, sink);
      CHECK(cudaEventRecord(a, stream));
      f();
      CHECK(cudaEventRecord(b, stream));
      CHECK(cudaEventSynchronize(b));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, a, b));
      if (i >= 3) times.push_back(ms * 1000.0f);
    }
    CHECK(cudaGetLastError());
    std::sort(times.begin(), times.end());
    CHECK(cudaEventDestroy(a));
    CHECK(cudaEventDestroy(b));
    return times[times.size() / 2];
  }
};

}  // namespace

int main(int argc, char** argv) {
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json" && i + 1 < argc) {
      json_path = argv[++i];
    } else {
      std::fprintf(stderr, "usage: gemv_bench [--json FILE]\n");
      return 2;
    }
  }
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  Timer timer;
  CHECK(cudaStreamCreateWithFlags(&timer.stream, cudaStreamNonBlocking));
  timer.flush_vectors = (size_t{512} << 20) / 16;
  CHECK(cudaMalloc(&timer.flush, timer.flush_vectors * 16));
  CHECK(cudaMalloc(&timer.sink, 4));
  timer.sms = sms;
  CHECK(cudaMemset(timer.flush, 1, timer.flush_vectors * 16));
  cublasHandle_t handle;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) return 1;
  cublasSetStream(handle, timer.stream);

  struct Shape {
    const char* name;
    int64_t n, k;
  };
  const Shape shapes[] = {{"W_down", 3584, 7168}, {"W_up", 7168, 3584}};
  std::string json = "{\"bench\": \"gemv_bench\", \"rows\": [\n";
  bool first = true;
  std::printf("# gemv_bench  one row, bf16, L2 flushed before each run, median of 30 (us)\n");
  std::printf("# %-7s %-12s %9s %8s\n", "matrix", "kernel", "time_us", "TB/s");
  for (const Shape& s : shapes) {
    const size_t elements = static_cast<size_t>(s.n * s.k);
    uint16_t *w, *x, *y;
    CHECK(cudaMalloc(&w, elements * 2));
    CHECK(cudaMalloc(&x, s.k * 2));
    CHECK(cudaMalloc(&y, s.n * 2));
    fill_kernel<<<sms * 8, 256>>>(w, elements, 1u);
    fill_kernel<<<sms, 256>>>(x, s.k, 2u);
    CHECK(cudaDeviceSynchronize());
    const double bytes = static_cast<double>(elements) * 2;
    auto report = [&](const std::string& kernel, double us) {
      std::printf("  %-7s %-12s %9.2f %8.2f\n", s.name, kernel.c_str(), us, bytes / us * 1e-6);
      json += std::string(first ? "" : ",\n") + "  {\"matrix\": \"" + s.name + "\", \"n\": " + std::to_string(s.n) +
              ", \"k\": " + std::to_string(s.k) + ", \"kernel\": \"" + kernel +
              "\", \"time_us\": " + std::to_string(us) + ", \"tb_per_s\": " + std::to_string(bytes / us * 1e-6) + "}";
      first = false;
    };
    report("read", timer.median_us([&] {
      read_kernel<<<sms * 4, 512, 0, timer.stream>>>(reinterpret_cast<const uint4*>(w), elements / 8, timer.sink);
    }));
    const float one = 1.0f, zero = 0.0f;
    report("cublas", timer.median_us([&] {
      // y[n] = W[n, k] x[k]: column-major W^T is [k, n], so op(A) = A^T with A = W^T (lda = k).
      if (cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(s.n), 1, static_cast<int>(s.k), &one, w,
                       CUDA_R_16BF, static_cast<int>(s.k), x, CUDA_R_16BF, static_cast<int>(s.k), &zero, y, CUDA_R_16BF,
                       static_cast<int>(s.n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
        std::fprintf(stderr, "cublasGemmEx failed\n");
        std::exit(1);
      }
    }));
    for (int warps : {8, 12, 16}) {
      for (int split : {0, 1, 2}) {
        latentmoe::cuda::GemvShape shape;
        shape.warps = warps;
        shape.split = split;
        report("gemv " + std::to_string(warps) + "/" + std::to_string(split), timer.median_us([&] {
          latentmoe::cuda::gemv(latentmoe::DType::bf16, x, s.k, 1, w, s.k, s.n, s.k, y, s.n, false, timer.stream,
                                shape);
        }));
      }
    }
    CHECK(cudaFree(w));
    CHECK(cudaFree(x));
    CHECK(cudaFree(y));
  }
  json += "\n]}\n";
  if (!json_path.empty()) {
    FILE* f = std::fopen(json_path.c_str(), "w");
    if (f == nullptr) return 1;
    std::fputs(json.c_str(), f);
    std::fclose(f);
  }
  cublasDestroy(handle);
  return 0;
}

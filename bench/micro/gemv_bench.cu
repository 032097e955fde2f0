// The decode GEMV (src/cuda/gemm/gemv.h) against cuBLAS at one row, a measurement for docs/CUDA_BACKEND.md:
// the two Kimi-K3 linears at one token (W_down [3584, 7168], W_up [7168, 3584], bf16, 51 MB each) and
// Nemotron 3 Super's (n_W_down [1024, 4096], n_W_up [4096, 1024], 8 MB each), each timed alone after an
// L2 flush (a read of 512 MB), CUDA events, median of 30 after 3 warm-ups:
//   read      a plain read of the same 51 MB (16-byte loads, 8 in flight per thread, grid of 4 CTAs of
//             512 threads per SM): the ceiling of a one-pass kernel of this size
//   cublas    cublasGemmEx, bf16 in, fp32 compute (what CudaBackend::linear runs without the GEMV)
//   gemv w/s  gemv()'s ring kernel with w warps per CTA and clusters of s CTAs (0: the launcher's choice)
//   gemv warp-rows w    gemv()'s warp-rows kernel (the default since session 28), w warps per CTA (0: the
//                       launcher's choice; 14: Kimi-K3's rows spread evenly over the SMs, at most 28 W_down
//                       rows an SM instead of 32, not yet measured)
// and, to find what separates the GEMV from the plain read (session 28), the same bytes read in other
// orders:
//   read warp-ranges c   each warp reads its own contiguous range (the GEMV's order), 8 loads in flight
//                        per lane, c CTAs of 512 threads per SM
//   read cta-ranges      each CTA reads its own contiguous range, its threads interleaved
//   gemv team t         the warp-rows kernel with rows shared by teams of t warps (0: the rule; session 29)
// and the shared expert at one token (Kimi-K3 at tp 8: situ, gate/up [768, 7168], down [7168, 768];
// Nemotron 3 Super: relu2, up [672, 4096], down [4096, 672]), whole (gate/up then down, 33 MB / 11 MB):
//   shared skinny       skinny_gate_up + skinny_down, what dense_mlp ran at one token until session 29
//   shared gemv t       gemv_gate_up (teams of t warps, 0: the rule) + gemv, what it runs since
//   shared read         a plain read of the same bytes
// Each GEMV's output is compared with cuBLAS's (max |difference|, in the JSON). Session 28 also timed a
// bench-only warp-per-row kernel with non-coherent loads and x from L1 (27.6 µs for W_down,
// gemv_bench_h100_172fc2b.json's "rows 7"/"rows 14"); it was removed once the library had its own (145a6be has it).
// Timing (L2 flush by reading, events, warm-ups, median), the repro line and the JSON: the benchmark
// harness (bench/harness/timing.h). Build: the gemv_bench target (bench/CMakeLists.txt).
// Usage: gemv_bench [--json FILE]
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/gemm/gemv.h"
#include "cuda/gemm/skinny_gemm.h"
#include "cuda/kernels/fill.h"
#include "harness/cublas_handle.h"
#include "harness/timing.h"
#include "latentmoe/error.h"

namespace {

// The order in which read_kernel's threads cover the n vectors.
enum class ReadOrder {
  sweep,       // the whole grid sweeps the vectors: thread t reads t, t + T, t + 2T, ... (T threads)
  cta_ranges,  // each CTA a contiguous range, its threads interleaved
  warp_ranges  // each warp a contiguous range (the ring GEMV's order)
};

// Reads n 16-byte vectors in kOrder, 8 loads in flight per thread, and keeps one xor so nothing is dropped.
template <ReadOrder kOrder>
__global__ void read_kernel(const uint4* p, size_t n, uint32_t* sink) {
  size_t i = 0, end = n, stride = 0;
  if constexpr (kOrder == ReadOrder::sweep) {
    stride = size_t{gridDim.x} * blockDim.x;
    i = blockIdx.x * size_t{blockDim.x} + threadIdx.x;
  } else if constexpr (kOrder == ReadOrder::cta_ranges) {
    stride = blockDim.x;
    i = n * blockIdx.x / gridDim.x + threadIdx.x;
    end = n * (blockIdx.x + 1) / gridDim.x;
  } else {
    const size_t warps = size_t{gridDim.x} * blockDim.x / 32;
    const size_t warp = (blockIdx.x * size_t{blockDim.x} + threadIdx.x) / 32;
    stride = 32;
    i = n * warp / warps + (threadIdx.x & 31);
    end = n * (warp + 1) / warps;
  }
  uint32_t acc = 0;
  for (; i + 7 * stride < end; i += 8 * stride) {
    uint4 v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = __ldcs(p + i + j * stride);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
  }
  for (; i < end; i += stride) {
    const uint4 v = __ldcs(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) *sink = acc;
}

// The largest |a - b| over n bf16 values on the device (copied to the host).
double max_abs_difference(const void* a, const void* b, int64_t n) {
  std::vector<uint16_t> ha(static_cast<size_t>(n)), hb(static_cast<size_t>(n));
  LATENTMOE_CUDA_CHECK(cudaMemcpy(ha.data(), a, ha.size() * 2, cudaMemcpyDeviceToHost));
  LATENTMOE_CUDA_CHECK(cudaMemcpy(hb.data(), b, hb.size() * 2, cudaMemcpyDeviceToHost));
  auto widen = [](uint16_t bits) {
    const uint32_t word = uint32_t{bits} << 16;
    float f;
    std::memcpy(&f, &word, sizeof(f));
    return static_cast<double>(f);
  };
  double worst = 0.0;
  for (size_t i = 0; i < ha.size(); ++i) worst = std::max(worst, std::abs(widen(ha[i]) - widen(hb[i])));
  return worst;
}

// One row of the table and of the JSON: `bytes` read in `us` by `kernel` on a [n, k] matrix (or MLP).
void add_row(nlohmann::json& report, const char* matrix, int64_t n, int64_t k, const std::string& kernel, double us,
             double bytes) {
  std::printf("  %-15s %-18s %9.2f %8.2f\n", matrix, kernel.c_str(), us, bytes / us * 1e-6);
  report["rows"].push_back(
      {{"matrix", matrix}, {"n", n}, {"k", k}, {"kernel", kernel}, {"time_us", us}, {"tb_per_s", bytes / us * 1e-6}});
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
  const Shape shapes[] = {{"W_down", 3584, 7168}, {"W_up", 7168, 3584},  {"n_W_down", 1024, 4096},
                          {"n_W_up", 4096, 1024}, {"s_down", 7168, 768}, {"ns_down", 4096, 672}};
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
      add_row(report, s.name, s.n, s.k, kernel, us, bytes);
    };
    report_row("read", timer.median_us(stream, [&] {
      read_kernel<ReadOrder::sweep>
          <<<sms * 4, 512, 0, stream>>>(w.as<const uint4>(), elements / 8, sink.as<uint32_t>());
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
    for (int ctas : {1, 4}) {
      report_row("read warp-ranges " + std::to_string(ctas), timer.median_us(stream, [&] {
        read_kernel<ReadOrder::warp_ranges>
            <<<sms * ctas, 512, 0, stream>>>(w.as<const uint4>(), elements / 8, sink.as<uint32_t>());
        LATENTMOE_CUDA_CHECK_LAUNCH("read_kernel (warp ranges)");
      }));
    }
    report_row("read cta-ranges", timer.median_us(stream, [&] {
      read_kernel<ReadOrder::cta_ranges>
          <<<sms * 4, 512, 0, stream>>>(w.as<const uint4>(), elements / 8, sink.as<uint32_t>());
      LATENTMOE_CUDA_CHECK_LAUNCH("read_kernel (CTA ranges)");
    }));
    // cuBLAS's y, the reference for the GEMV's (both fp32 sums of the same products, rounded once).
    const DeviceMemory y_ref(s.n * 2);
    LATENTMOE_CUBLAS_CHECK(cublasGemmEx(handle.get(), CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(s.n), 1,
                                        static_cast<int>(s.k), &one, w.get(), CUDA_R_16BF, static_cast<int>(s.k),
                                        x.get(), CUDA_R_16BF, static_cast<int>(s.k), &zero, y_ref.get(), CUDA_R_16BF,
                                        static_cast<int>(s.n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    for (int warps : {0, 8, 14, 16}) {
      latentmoe::cuda::GemvShape shape;
      shape.warps = warps;
      shape.kernel = latentmoe::cuda::GemvKernel::warp_rows;
      auto launch = [&] {
        latentmoe::cuda::gemv(latentmoe::DType::bf16, x.get(), s.k, 1, w.get(), s.k, s.n, s.k, y.get(), s.n, false,
                              stream, shape);
      };
      launch();
      LATENTMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
      const double diff = max_abs_difference(y.get(), y_ref.get(), s.n);
      report_row("gemv warp-rows " + std::to_string(warps), timer.median_us(stream, launch));
      report["rows"].back()["max_abs_diff_vs_cublas"] = diff;
    }
    for (int team : {1, 2, 4, 8}) {
      latentmoe::cuda::GemvShape shape;
      shape.team = team;
      shape.kernel = latentmoe::cuda::GemvKernel::warp_rows;
      report_row("gemv team " + std::to_string(team), timer.median_us(stream, [&] {
        latentmoe::cuda::gemv(latentmoe::DType::bf16, x.get(), s.k, 1, w.get(), s.k, s.n, s.k, y.get(), s.n, false,
                              stream, shape);
      }));
    }
    for (int warps : {8, 12, 16}) {
      for (int split : {0, 1, 2}) {
        latentmoe::cuda::GemvShape shape;
        shape.warps = warps;
        shape.split = split;
        shape.kernel = latentmoe::cuda::GemvKernel::ring;
        report_row("gemv " + std::to_string(warps) + "/" + std::to_string(split), timer.median_us(stream, [&] {
          latentmoe::cuda::gemv(latentmoe::DType::bf16, x.get(), s.k, 1, w.get(), s.k, s.n, s.k, y.get(), s.n, false,
                                stream, shape);
        }));
      }
    }
  }
  // The shared expert at one token, whole: the skinny pair against the GEMV pair.
  struct Mlp {
    const char* name;
    latentmoe::Activation activation;
    int64_t inter, d;
  };
  for (const Mlp& m : {Mlp{"kimi_shared", latentmoe::Activation::situ, 768, 7168},
                       Mlp{"nemotron_shared", latentmoe::Activation::relu2, 672, 4096}}) {
    const bool gated = m.activation != latentmoe::Activation::relu2;
    const size_t matrix = static_cast<size_t>(m.inter * m.d);
    const DeviceMemory gate(matrix * 2), up(matrix * 2), down(matrix * 2), x(m.d * 2), act(m.inter * 2), y(m.d * 2);
    for (const auto* buffer : {&gate, &up, &down}) {
      latentmoe::cuda::fill_uniform(buffer->get(), latentmoe::DType::bf16, static_cast<int64_t>(matrix), 3, 0.1f, 0.0f,
                                    stream);
    }
    latentmoe::cuda::fill_uniform(x.get(), latentmoe::DType::bf16, m.d, 4, 1.0f, 0.0f, stream);
    LATENTMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    const double bytes = static_cast<double>(matrix) * 2 * (gated ? 3 : 2);
    auto report_row = [&](const std::string& kernel, double us) {
      add_row(report, m.name, m.inter, m.d, kernel, us, bytes);
    };
    report_row("shared read", timer.median_us(stream, [&] {
      for (const auto* buffer : {&gate, &up, &down}) {
        if (buffer == &gate && !gated) continue;
        read_kernel<ReadOrder::sweep>
            <<<sms * 4, 512, 0, stream>>>(buffer->as<const uint4>(), matrix / 8, sink.as<uint32_t>());
        LATENTMOE_CUDA_CHECK_LAUNCH("read_kernel");
      }
    }));
    latentmoe::detail::ActivationParams activation;
    activation.activation = m.activation;
    report_row("shared skinny", timer.median_us(stream, [&] {
      const latentmoe::cuda::SkinnyWeights gate_up{gated ? gate.get() : nullptr, up.get(), m.inter, m.d, m.d, 0};
      const latentmoe::cuda::SkinnyWeights projection{nullptr, down.get(), m.d, m.inter, m.inter, 0};
      latentmoe::cuda::skinny_gate_up(latentmoe::DType::bf16, activation, latentmoe::cuda::SkinnyRouting{},
                                      {x.get(), m.d}, 1, gate_up, act.get(), m.inter, stream);
      latentmoe::cuda::skinny_down(latentmoe::DType::bf16, latentmoe::cuda::SkinnyRouting{}, {act.get(), m.inter}, 1,
                                   projection, y.get(), m.d, false, stream);
    }));
    for (int team : {0, 1, 2, 4, 8}) {
      latentmoe::cuda::GemvShape shape;
      shape.team = team;
      report_row("shared gemv " + std::to_string(team), timer.median_us(stream, [&] {
        latentmoe::cuda::gemv_gate_up(latentmoe::DType::bf16, activation, x.get(), m.d, 1, gated ? gate.get() : nullptr,
                                      up.get(), m.d, m.inter, m.d, act.get(), m.inter, stream, shape);
        latentmoe::cuda::gemv(latentmoe::DType::bf16, act.get(), m.inter, 1, down.get(), m.inter, m.d, m.inter, y.get(),
                              m.d, false, stream);
      }));
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

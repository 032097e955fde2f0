// Which global-load pattern streams a decode GEMM's weights at the DRAM bandwidth? A throwaway
// measurement for docs/SKINNY_GEMM.md: each kernel reads a [n, k] bf16 matrix once, 16 rows per CTA,
// the CTA's warps taking the k range round robin, and folds what it read into one word per CTA so
// nothing is optimised away. Patterns (bytes one warp instruction reads per row):
//   frag64   lane (g, c) reads rows g and g + 8 at 16c: 8 rows x 64 B (the MMA fragment layout)
//   line128  4 rows x 128 B
//   row512   1 row x 512 B
// each through a per-warp cp.async ring of `stages` steps, and frag64 also straight into registers.
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a skinny_stream_bench.cu
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#define CHECK(x)                                                                     \
  do {                                                                               \
    cudaError_t e = (x);                                                             \
    if (e != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

enum Pattern { kFrag64 = 0, kLine128 = 1, kRow512 = 2 };

__device__ __forceinline__ void cp16(void* dst, const void* src, bool prefetch) {
  const auto a = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  if (prefetch) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(a), "l"(src) : "memory");
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(a), "l"(src) : "memory");
  }
}
// The zero-filling form (a source size operand), as a kernel that guards its edges writes it.
__device__ __forceinline__ void cp16_zfill(void* dst, const void* src, bool valid) {
  const auto a = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(a), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait_n() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// One step of a warp: 16 rows x kStepBytes bytes; 512 B per instruction => kStepBytes / 32 instructions.
template <int kPattern, int kStages, bool kPrefetch>
__global__ void __launch_bounds__(512) ring_kernel(const uint8_t* w, int64_t row_bytes, uint32_t* sink) {
  constexpr int kStepBytes = kPattern == kFrag64 ? 64 : kPattern == kLine128 ? 128 : 512;  // per row
  constexpr int kInstr = 16 * kStepBytes / 512;
  extern __shared__ uint4 ring[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  uint4* mine = ring + (warp * kStages * kInstr) * 32;
  const uint8_t* base = w + static_cast<int64_t>(blockIdx.x) * 16 * row_bytes;
  const int steps = static_cast<int>(row_bytes / kStepBytes / gridDim.y);  // this CTA's k slice
  const int my_steps = steps > warp ? (steps - warp + warps - 1) / warps : 0;
  auto source = [&](int step, int i) -> const uint8_t* {
    const int64_t k0 = static_cast<int64_t>(blockIdx.y * steps + warp + step * warps) * kStepBytes;
    if (kPattern == kFrag64) {
      const int g = lane >> 2, c = lane & 3;
      return base + (g + 8 * i) * row_bytes + k0 + 16 * c;
    } else if (kPattern == kLine128) {
      return base + (4 * i + lane / 8) * row_bytes + k0 + 16 * (lane % 8);
    } else {
      return base + i * row_bytes + k0 + 16 * lane;
    }
  };
  auto issue = [&](int step) {
    if (step < my_steps) {
      for (int i = 0; i < kInstr; ++i)
        cp16(mine + ((step % kStages) * kInstr + i) * 32 + lane, source(step, i), kPrefetch);
    }
    commit();
  };
  for (int s = 0; s < kStages - 1; ++s) issue(s);
  uint32_t acc = 0;
  for (int step = 0; step < my_steps; ++step) {
    wait_n<kStages - 2>();
    __syncwarp();
    for (int i = 0; i < kInstr; ++i) {
      const uint4 v = mine[((step % kStages) * kInstr + i) * 32 + lane];
      acc ^= v.x + v.y + v.z + v.w;
    }
    __syncwarp();
    issue(step + kStages - 1);
  }
  wait_n<0>();
  if (acc == 0x12345678u) sink[blockIdx.x] = acc;
}

// frag64 straight into registers, kUnroll steps of loads in flight per warp (the first skinny kernel).
template <int kUnroll>
__global__ void __launch_bounds__(512) register_kernel(const uint8_t* w, int64_t row_bytes, uint32_t* sink) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const uint8_t* base = w + static_cast<int64_t>(blockIdx.x) * 16 * row_bytes;
  const int steps = static_cast<int>(row_bytes / 64);
  uint32_t acc = 0;
  for (int s0 = warp; s0 < steps; s0 += warps * kUnroll) {
    uint4 v0[kUnroll], v1[kUnroll];
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      const int s = s0 + i * warps;
      const uint8_t* p0 = base + g * row_bytes + s * 64 + 16 * c;
      if (s < steps) {
        asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v0[i].x), "=r"(v0[i].y), "=r"(v0[i].z), "=r"(v0[i].w)
                     : "l"(p0));
        asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v1[i].x), "=r"(v1[i].y), "=r"(v1[i].z), "=r"(v1[i].w)
                     : "l"(p0 + 8 * row_bytes));
      } else {
        v0[i] = v1[i] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) acc ^= v0[i].x + v0[i].y + v1[i].z + v1[i].w + v0[i].z + v1[i].x;
  }
  if (acc == 0x12345678u) sink[blockIdx.x] = acc;
}

__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The skinny_down loop: contiguous per-warp ranges of 64-element steps (4 pieces of 16 B per lane:
// rows g, g + 8 x chunks 0, 1), kStages-deep ring; kMma: multiply on the tensor cores; kInput: the
// B operand loaded from global memory (an L2-resident vector) one step ahead.
template <int kStages, bool kMma, bool kInput, bool kZfill = false>
__global__ void __launch_bounds__(512)
    step_kernel(const uint8_t* w, int64_t row_bytes, const uint8_t* x, uint32_t* sink) {
  extern __shared__ uint4 ring[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  uint4* mine_ring = ring + warp * kStages * 4 * 32 + lane;
  const int steps = static_cast<int>(row_bytes / 128);
  const int begin = steps * warp / warps, mine = steps * (warp + 1) / warps - begin;
  const uint8_t* lo = w + (static_cast<int64_t>(blockIdx.x) * 16 + g) * row_bytes + begin * 128 + 16 * c;
  const uint8_t* hi = lo + 8 * row_bytes;
  const uint8_t* xp = x + begin * 128 + 16 * c;
  int issued = 0, is = 0;
  auto issue = [&] {
    if (issued < mine) {
      if (kZfill) {
        cp16_zfill(mine_ring + (is * 4 + 0) * 32, lo, row_bytes > 0);
      } else {
        cp16(mine_ring + (is * 4 + 0) * 32, lo, true);
      }
      if (kZfill) {
        cp16_zfill(mine_ring + (is * 4 + 1) * 32, hi, row_bytes > 0);
      } else {
        cp16(mine_ring + (is * 4 + 1) * 32, hi, true);
      }
      if (kZfill) {
        cp16_zfill(mine_ring + (is * 4 + 2) * 32, lo + 64, row_bytes > 0);
      } else {
        cp16(mine_ring + (is * 4 + 2) * 32, lo + 64, true);
      }
      if (kZfill) {
        cp16_zfill(mine_ring + (is * 4 + 3) * 32, hi + 64, row_bytes > 0);
      } else {
        cp16(mine_ring + (is * 4 + 3) * 32, hi + 64, true);
      }
      lo += 128;
      hi += 128;
    }
    commit();
    ++issued;
    is = is + 1 == kStages ? 0 : is + 1;
  };
  for (int s = 0; s < kStages - 1; ++s) issue();
  float acc[4] = {0, 0, 0, 0};
  uint32_t sum = 0;
  uint4 xn0 = make_uint4(0x3f803f80u, 0x3f803f80u, 0x3f803f80u, 0x3f803f80u), xn1 = xn0;
  if (kInput && g == 0) {
    xn0 = *reinterpret_cast<const uint4*>(xp);
    xn1 = *reinterpret_cast<const uint4*>(xp + 64);
  }
  for (int j = 0, st = 0; j < mine; ++j, st = st + 1 == kStages ? 0 : st + 1) {
    wait_n<kStages - 2>();
    uint4 v[4];
    for (int q = 0; q < 4; ++q) v[q] = mine_ring[(st * 4 + q) * 32];
    const uint4 x0 = xn0, x1 = xn1;
    if (kInput && g == 0 && j + 1 < mine) {
      xp += 128;
      xn0 = __ldg(reinterpret_cast<const uint4*>(xp));
      xn1 = __ldg(reinterpret_cast<const uint4*>(xp + 64));
    }
    issue();
    if (kMma) {
      mma16816(acc, v[0].x, v[1].x, v[0].y, v[1].y, x0.x, x0.y);
      mma16816(acc, v[0].z, v[1].z, v[0].w, v[1].w, x0.z, x0.w);
      mma16816(acc, v[2].x, v[3].x, v[2].y, v[3].y, x1.x, x1.y);
      mma16816(acc, v[2].z, v[3].z, v[2].w, v[3].w, x1.z, x1.w);
    } else {
      for (int q = 0; q < 4; ++q) sum ^= v[q].x + v[q].y + v[q].z + v[q].w;
    }
  }
  wait_n<0>();
  if (sum == 0x12345678u || acc[0] == 1234.5f) sink[blockIdx.x] = sum + acc[1];
}

__global__ void fill_random(uint32_t* p, size_t n) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = (h & 0x00ff00ffu) | 0x3c003c00u;  // bf16 pairs in [0.0078, 0.03]
  }
}

__global__ void read_flush(const uint4* p, size_t n, uint32_t* sink) {
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) acc ^= p[i].x;
  if (acc == 0x12345678u) *sink = acc;
}

int main() {
  const int64_t n = 3584, k = 7168;  // Kimi-K3's W_down: 51 MB of bf16
  const int64_t row_bytes = k * 2, bytes = n * row_bytes;
  uint8_t* w;
  uint32_t* sink;
  uint4* flush;
  const size_t flush_bytes = 256u << 20;
  CHECK(cudaMalloc(&w, bytes));
  CHECK(cudaMalloc(&sink, 1 << 20));
  CHECK(cudaMalloc(&flush, flush_bytes));
  CHECK(cudaMemset(w, 1, bytes));
  CHECK(cudaMemset(flush, 0, flush_bytes));
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  auto time = [&](auto&& body) {
    std::vector<float> t;
    for (int r = 0; r < 25; ++r) {
      read_flush<<<528, 512>>>(flush, flush_bytes / 16, sink);
      cudaEventRecord(a);
      body();
      cudaEventRecord(b);
      CHECK(cudaEventSynchronize(b));
      float ms;
      cudaEventElapsedTime(&ms, a, b);
      if (r >= 5) t.push_back(ms * 1000);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  uint8_t* copy_dst;
  CHECK(cudaMalloc(&copy_dst, bytes));
  const float copy_us = time([&] { cudaMemcpyAsync(copy_dst, w, bytes, cudaMemcpyDeviceToDevice); });
  std::printf("memcpy 51 MB: %.1f us  %.2f TB/s (read+write)\n", copy_us, 2.0 * bytes / copy_us / 1e6);
  const float read_us =
      time([&] { read_flush<<<528 * 2, 512>>>(reinterpret_cast<const uint4*>(w), bytes / 16, sink); });
  std::printf("linear read 51 MB: %.1f us  %.2f TB/s\n", read_us, bytes / read_us / 1e6);
  const unsigned grid = n / 16;
  auto report = [&](const char* name, int warps, int stages, float us) {
    std::printf("%-10s warps %2d stages %2d: %6.1f us  %.2f TB/s\n", name, warps, stages, us, bytes / us / 1e6);
  };
  auto ring = [&](auto kernel, const char* name, int step_bytes, int stages, int warps, int split = 1) {
    const size_t smem = static_cast<size_t>(warps) * stages * 16 * step_bytes;
    if (smem > 227 * 1024) return;
    CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));
    if (split > 1) std::printf("k split %d: ", split);
    report(name, warps, stages, time([&] { kernel<<<dim3(grid, split), warps * 32, smem>>>(w, row_bytes, sink); }));
    CHECK(cudaGetLastError());
  };
  for (int warps : {4, 8, 16}) {
    report("reg u6", warps, 6, time([&] { register_kernel<6><<<grid, warps * 32>>>(w, row_bytes, sink); }));
    report("reg u2", warps, 2, time([&] { register_kernel<2><<<grid, warps * 32>>>(w, row_bytes, sink); }));
    ring(ring_kernel<kFrag64, 4, true>, "frag64", 64, 4, warps);
    ring(ring_kernel<kFrag64, 10, true>, "frag64", 64, 10, warps);
    ring(ring_kernel<kFrag64, 10, false>, "frag64np", 64, 10, warps);
    ring(ring_kernel<kLine128, 3, true>, "line128", 128, 3, warps);
    ring(ring_kernel<kLine128, 6, true>, "line128", 128, 6, warps);
    ring(ring_kernel<kLine128, 6, false>, "line128np", 128, 6, warps);
    ring(ring_kernel<kRow512, 2, true>, "row512", 512, 2, warps);
    ring(ring_kernel<kRow512, 3, false>, "row512np", 512, 3, warps);
  }
  uint8_t* x;
  CHECK(cudaMalloc(&x, row_bytes));
  CHECK(cudaMemset(x, 0, row_bytes));
  auto steps = [&](auto kernel, const char* name, int stages, int warps) {
    const size_t smem = static_cast<size_t>(warps) * stages * 4 * 512;
    if (smem > 227 * 1024) return;
    CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));
    report(name, warps, stages, time([&] { kernel<<<grid, warps * 32, smem>>>(w, row_bytes, x, sink); }));
    CHECK(cudaGetLastError());
  };
  for (int data = 0; data < 2; ++data) {
    if (data == 1) {
      fill_random<<<1024, 256>>>(reinterpret_cast<uint32_t*>(w), bytes / 4);
      std::printf("random data:\n");
      ring(ring_kernel<kFrag64, 4, true>, "frag64", 64, 4, 8);
    }
    for (int warps : {4, 8, 16}) {
      steps(step_kernel<4, false, false>, "step", 4, warps);
      steps(step_kernel<4, true, false>, "step+mma", 4, warps);
      steps(step_kernel<4, true, true>, "step+mma+x", 4, warps);
      steps(step_kernel<8, true, true>, "step+mma+x", 8, warps);
      steps(step_kernel<4, true, true, true>, "zfill+mma+x", 4, warps);
    }
  }
  for (int split : {2, 4}) {
    for (int warps : {4, 8}) {
      ring(ring_kernel<kFrag64, 6, true>, "frag64", 64, 6, warps, split);
      ring(ring_kernel<kLine128, 4, true>, "line128", 128, 4, warps, split);
    }
  }
  return 0;
}

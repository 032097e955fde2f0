// Benchmark of the grouped expert GEMMs (src/cuda/gemm/grouped_gemm.h) against the device's own ceilings.
//
// One run measures the ceilings (device-to-device copy bandwidth counting bytes read plus written; a
// dense bf16 8192^3 cuBLAS GEMM on random data), then for each preset, tp shard and token count:
// uniform random routing (k distinct experts per token, seeded), kNumLayouts different routings and
// inputs rotated so that the L2 does not hold the touched weights between iterations, one CUDA graph
// of kNumLayouts iterations per phase (gate_up, down, both), warm-up, then the median over replays.
// Floors: bytes (distinct touched experts' weights + activations read and written) / copy bandwidth
// and FLOPs / GEMM rate; floor = max; fraction of floor = floor / time.
//
//   grouped_gemm_bench [--presets kimi-k3,nemotron3-super] [--tp-shards 8,1] [--tokens 1,8,64,256,1024,4096]
//                      [--variants automatic|all|mma_s,mma_l,...] [--phases gate_up,down,both]
//                      [--json FILE] [--commit SHA]
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/gemm/grouped_gemm.h"

namespace {

using latentmoe::Activation;
using latentmoe::DType;
using latentmoe::cuda::ExpertGemmWeights;
using latentmoe::cuda::MoeLayout;
using latentmoe::cuda::detail::GemmChoice;
using latentmoe::cuda::detail::GemmVariant;

constexpr int kNumLayouts = 16;

#define CK(expr)                                                                                    \
  do {                                                                                              \
    cudaError_t err_ = (expr);                                                                      \
    if (err_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(err_)); \
      std::exit(1);                                                                                 \
    }                                                                                               \
  } while (0)

struct Preset {
  std::string name;
  int64_t latent;
  int num_experts;
  int top_k;
  int64_t intermediate;
  Activation activation;
};

const std::vector<Preset> kPresets = {
    {"kimi-k3", 3584, 896, 16, 3072, Activation::situ},
    {"nemotron3-super", 1024, 512, 22, 2688, Activation::relu2},
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t comma = s.find(',', start);
    if (comma == std::string::npos) comma = s.size();
    if (comma > start) out.push_back(s.substr(start, comma - start));
    start = comma + 1;
  }
  return out;
}

__global__ void fill_uniform_bf16(__nv_bfloat16* p, size_t n, float scale, uint64_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    x ^= x >> 33;
    const float u = static_cast<float>(x >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    p[i] = __float2bfloat16_rn((2.0f * u - 1.0f) * scale);
  }
}

void fill(void* p, size_t n, float scale, uint64_t seed) {
  fill_uniform_bf16<<<4096, 256>>>(static_cast<__nv_bfloat16*>(p), n, scale, seed);
  CK(cudaGetLastError());
}

void* device_alloc(size_t bytes) {
  void* p = nullptr;
  CK(cudaMalloc(&p, std::max<size_t>(bytes, 256)));
  return p;
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Copy bandwidth: bytes read + bytes written per second (GB/s = 1e9 B/s).
double measure_copy_bandwidth() {
  const size_t bytes = size_t{2} << 30;
  void* a = device_alloc(bytes);
  void* b = device_alloc(bytes);
  CK(cudaMemset(a, 1, bytes));
  cudaEvent_t start, stop;
  CK(cudaEventCreate(&start));
  CK(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int i = 0; i < 13; ++i) {
    CK(cudaEventRecord(start));
    CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
    CK(cudaEventRecord(stop));
    CK(cudaEventSynchronize(stop));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, start, stop));
    if (i >= 3) times.push_back(ms);
  }
  CK(cudaFree(a));
  CK(cudaFree(b));
  return 2.0 * bytes / (median(times) * 1e-3);
}

// Dense bf16 GEMM rate (FLOP/s) through cuBLAS, 8192^3, random data, fp32 accumulation.
double measure_gemm_rate() {
  const int n = 8192;
  const size_t count = static_cast<size_t>(n) * n;
  void* a = device_alloc(count * 2);
  void* b = device_alloc(count * 2);
  void* c = device_alloc(count * 2);
  fill(a, count, 1.0f, 1);
  fill(b, count, 1.0f, 2);
  cublasHandle_t handle;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) throw std::runtime_error("cublasCreate failed");
  const float alpha = 1.0f, beta = 0.0f;
  cudaEvent_t start, stop;
  CK(cudaEventCreate(&start));
  CK(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int i = 0; i < 13; ++i) {
    CK(cudaEventRecord(start));
    const cublasStatus_t st =
        cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &alpha, a, CUDA_R_16BF, n, b, CUDA_R_16BF, n, &beta, c,
                     CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS) throw std::runtime_error("cublasGemmEx failed");
    CK(cudaEventRecord(stop));
    CK(cudaEventSynchronize(stop));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, start, stop));
    if (i >= 3) times.push_back(ms);
  }
  cublasDestroy(handle);
  CK(cudaFree(a));
  CK(cudaFree(b));
  CK(cudaFree(c));
  return 2.0 * n * double(n) * n / (median(times) * 1e-3);
}

struct LayoutSet {
  int32_t* offsets = nullptr;  // [kNumLayouts][E + 1]
  int32_t* sorted = nullptr;   // [kNumLayouts][T * k]
  int32_t* pair_rows = nullptr;
  double mean_touched = 0;  // distinct experts per layout
};

LayoutSet make_layouts(int64_t tokens, int num_experts, int top_k, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t pairs = tokens * top_k;
  std::vector<int32_t> offsets(kNumLayouts * (num_experts + 1));
  std::vector<int32_t> sorted(kNumLayouts * pairs);
  std::vector<int32_t> pair_rows(kNumLayouts * pairs);
  std::vector<int32_t> ids(pairs);
  std::vector<int32_t> perm(num_experts);
  double touched_sum = 0;
  for (int li = 0; li < kNumLayouts; ++li) {
    for (int64_t t = 0; t < tokens; ++t) {
      std::iota(perm.begin(), perm.end(), 0);
      for (int j = 0; j < top_k; ++j) {  // partial Fisher-Yates: k distinct experts
        std::uniform_int_distribution<int> pick(j, num_experts - 1);
        std::swap(perm[j], perm[pick(rng)]);
        ids[t * top_k + j] = perm[j];
      }
    }
    int32_t* off = &offsets[li * (num_experts + 1)];
    std::fill(off, off + num_experts + 1, 0);
    for (int64_t p = 0; p < pairs; ++p) ++off[ids[p] + 1];
    int touched = 0;
    for (int e = 0; e < num_experts; ++e) touched += off[e + 1] > 0;
    touched_sum += touched;
    for (int e = 0; e < num_experts; ++e) off[e + 1] += off[e];
    std::vector<int32_t> fill_pos(off, off + num_experts);
    for (int64_t p = 0; p < pairs; ++p) {
      const int row = fill_pos[ids[p]]++;
      sorted[li * pairs + row] = static_cast<int32_t>(p);
      pair_rows[li * pairs + p] = row;
    }
  }
  LayoutSet set;
  set.offsets = static_cast<int32_t*>(device_alloc(offsets.size() * 4));
  set.sorted = static_cast<int32_t*>(device_alloc(sorted.size() * 4));
  set.pair_rows = static_cast<int32_t*>(device_alloc(pair_rows.size() * 4));
  CK(cudaMemcpy(set.offsets, offsets.data(), offsets.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(set.sorted, sorted.data(), sorted.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(set.pair_rows, pair_rows.data(), pair_rows.size() * 4, cudaMemcpyHostToDevice));
  set.mean_touched = touched_sum / kNumLayouts;
  return set;
}

enum class Phase { gate_up, down, both };

// Median time of one iteration (ms) of `phase`, from replays of a graph of kNumLayouts iterations.
double time_phase(Phase phase, GemmChoice gu_variant, GemmChoice down_variant, const Preset& p,
                  const ExpertGemmWeights& w, const LayoutSet& layouts, int64_t tokens, const void* z_all, void* act,
                  void* y, cudaStream_t stream) {
  latentmoe::detail::ActivationParams act_params;
  act_params.activation = p.activation;
  const int64_t pairs = tokens * p.top_k;
  // The split-K workspace (the same size for every shape), zeroed once (every launch leaves it zeroed).
  static void* workspace = nullptr;
  const size_t workspace_bytes = latentmoe::cuda::grouped_gemm_workspace_bytes(tokens, p.top_k, p.num_experts);
  if (workspace == nullptr) {
    workspace = device_alloc(workspace_bytes);
    CK(cudaMemset(workspace, 0, workspace_bytes));
  }
  cudaGraph_t graph;
  CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int li = 0; li < kNumLayouts; ++li) {
    MoeLayout layout;
    layout.expert_offsets = layouts.offsets + li * (p.num_experts + 1);
    layout.sorted_pairs = layouts.sorted + li * pairs;
    layout.pair_rows = layouts.pair_rows + li * pairs;
    layout.num_experts = p.num_experts;
    layout.top_k = p.top_k;
    layout.num_tokens = tokens;
    const void* z = static_cast<const char*>(z_all) + li * tokens * w.latent * 2;
    if (phase != Phase::down) {
      latentmoe::cuda::detail::grouped_gate_up_variant(gu_variant, DType::bf16, act_params, z, layout, w, act,
                                                       workspace, workspace_bytes, stream);
    }
    if (phase != Phase::gate_up) {
      latentmoe::cuda::detail::grouped_down_variant(down_variant, DType::bf16, act, layout, w, y, workspace,
                                                    workspace_bytes, stream);
    }
  }
  CK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t start, stop;
  CK(cudaEventCreate(&start));
  CK(cudaEventCreate(&stop));
  // Warm-up, then as many replays as fit in about 150 ms (5 to 50).
  CK(cudaGraphLaunch(exec, stream));
  CK(cudaEventRecord(start, stream));
  CK(cudaGraphLaunch(exec, stream));
  CK(cudaEventRecord(stop, stream));
  CK(cudaEventSynchronize(stop));
  float first = 0;
  CK(cudaEventElapsedTime(&first, start, stop));
  const int reps = std::clamp(static_cast<int>(150.0f / std::max(first, 1e-3f)), 5, 50);
  std::vector<float> times;
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(start, stream));
    CK(cudaGraphLaunch(exec, stream));
    CK(cudaEventRecord(stop, stream));
    CK(cudaEventSynchronize(stop));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  CK(cudaEventDestroy(start));
  CK(cudaEventDestroy(stop));
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  return median(times) / kNumLayouts;
}

struct Row {
  std::string preset;
  int tp_shard;
  int64_t tokens;
  std::string gu_variant, down_variant;
  double touched;
  double gu_ms, down_ms, both_ms;
  double gu_bytes, down_bytes, gu_flops, down_flops;
  double gu_floor_ms, down_floor_ms, experts_floor_ms;
  double gu_byte_floor_ms, gu_flop_floor_ms, down_byte_floor_ms, down_flop_floor_ms;
};

std::string json_row(const Row& r) {
  char buf[2048];
  std::snprintf(
      buf, sizeof(buf),
      "{\"preset\": \"%s\", \"tp_shard\": %d, \"tokens\": %lld, \"dtype\": \"bf16\", \"gate_up_variant\": \"%s\", "
      "\"down_variant\": \"%s\", \"touched_experts\": %.2f, "
      "\"gate_up\": {\"time_us\": %.3f, \"bytes\": %.0f, \"flops\": %.0f, \"byte_floor_us\": %.3f, "
      "\"flop_floor_us\": %.3f, \"floor_us\": %.3f, \"fraction_of_floor\": %.4f, \"tb_per_s\": %.3f, "
      "\"tflop_per_s\": %.2f}, "
      "\"down\": {\"time_us\": %.3f, \"bytes\": %.0f, \"flops\": %.0f, \"byte_floor_us\": %.3f, "
      "\"flop_floor_us\": %.3f, \"floor_us\": %.3f, \"fraction_of_floor\": %.4f, \"tb_per_s\": %.3f, "
      "\"tflop_per_s\": %.2f}, "
      "\"experts\": {\"time_us\": %.3f, \"floor_us\": %.3f, \"tb_per_s\": %.3f, \"tflop_per_s\": %.2f}, "
      "\"experts_fraction_of_floor\": %.4f}",
      r.preset.c_str(), r.tp_shard, static_cast<long long>(r.tokens), r.gu_variant.c_str(), r.down_variant.c_str(),
      r.touched, r.gu_ms * 1e3, r.gu_bytes, r.gu_flops, r.gu_byte_floor_ms * 1e3, r.gu_flop_floor_ms * 1e3,
      r.gu_floor_ms * 1e3, r.gu_floor_ms / r.gu_ms, r.gu_bytes / (r.gu_ms * 1e-3) / 1e12,
      r.gu_flops / (r.gu_ms * 1e-3) / 1e12, r.down_ms * 1e3, r.down_bytes, r.down_flops, r.down_byte_floor_ms * 1e3,
      r.down_flop_floor_ms * 1e3, r.down_floor_ms * 1e3, r.down_floor_ms / r.down_ms,
      r.down_bytes / (r.down_ms * 1e-3) / 1e12, r.down_flops / (r.down_ms * 1e-3) / 1e12, r.both_ms * 1e3,
      r.experts_floor_ms * 1e3, (r.gu_bytes + r.down_bytes) / (r.both_ms * 1e-3) / 1e12,
      (r.gu_flops + r.down_flops) / (r.both_ms * 1e-3) / 1e12, r.experts_floor_ms / r.both_ms);
  // Phases not timed are NaN: JSON null.
  std::string s = buf;
  for (const char* token : {"-nan", "nan"}) {
    for (size_t at = s.find(token); at != std::string::npos; at = s.find(token, at))
      s.replace(at, std::strlen(token), "null");
  }
  return s;
}

// "mma_l", "mma_l:ng4" (4 n-tiles per CTA), "mma_s:ks2" (2 split-K CTAs per tile), "mma_s:ng1:ks1";
// "automatic".
GemmChoice parse_choice(const std::string& spec) {
  const size_t colon = spec.find(':');
  const std::string name = spec.substr(0, colon);
  int per_cta = 0;
  int splits = 0;
  for (size_t at = colon; at != std::string::npos;) {
    const size_t next = spec.find(':', at + 1);
    const std::string option = spec.substr(at + 1, next == std::string::npos ? std::string::npos : next - at - 1);
    if (option.rfind("ng", 0) == 0) {
      per_cta = std::stoi(option.substr(2));
    } else if (option.rfind("ks", 0) == 0) {
      splits = std::stoi(option.substr(2));
    } else {
      std::fprintf(stderr, "unknown option %s in %s\n", option.c_str(), spec.c_str());
      std::exit(2);
    }
    at = next;
  }
  if (name == "automatic") return GemmChoice(GemmVariant::automatic, per_cta, splits);
  for (GemmVariant v : latentmoe::cuda::detail::all_variants()) {
    if (latentmoe::cuda::detail::to_string(v) == name) return GemmChoice(v, per_cta, splits);
  }
  std::fprintf(stderr, "unknown variant %s\n", spec.c_str());
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  std::string presets_arg = "kimi-k3,nemotron3-super";
  std::string tp_arg = "8,1";
  std::string tokens_arg = "1,8,64,256,1024,4096";
  std::string variants_arg = "automatic";
  std::string json_path;
  std::string commit = "unknown";
  std::string phases_arg = "gate_up,down,both";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--presets")
      presets_arg = next();
    else if (a == "--tp-shards")
      tp_arg = next();
    else if (a == "--tokens")
      tokens_arg = next();
    else if (a == "--variants")
      variants_arg = next();
    else if (a == "--json")
      json_path = next();
    else if (a == "--commit")
      commit = next();
    else if (a == "--phases")
      phases_arg = next();
    else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  // Variants swept: "automatic" (the library's choice), "all" (every tensor-core variant), or a list.
  std::vector<GemmChoice> variants;
  if (variants_arg == "all") {
    for (GemmVariant v : latentmoe::cuda::detail::all_variants()) {
      if ((v == GemmVariant::wgmma || v == GemmVariant::wgmma_tall) && !latentmoe::cuda::detail::wgmma_available())
        continue;
      if (v != GemmVariant::simt) variants.emplace_back(v);
    }
  } else {
    for (const std::string& v : split(variants_arg)) variants.push_back(parse_choice(v));
  }

  int device = 0;
  CK(cudaGetDevice(&device));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, device));
  std::printf("# grouped_gemm_bench  device %s  sm_%d%d  %d SMs  L2 %d MB  commit %s\n", prop.name, prop.major,
              prop.minor, prop.multiProcessorCount, prop.l2CacheSize >> 20, commit.c_str());
  const double copy_bw = measure_copy_bandwidth();
  const double gemm_rate = measure_gemm_rate();
  std::printf("# ceilings: copy %.3f TB/s (read+write), dense bf16 GEMM 8192^3 %.1f TFLOP/s\n", copy_bw / 1e12,
              gemm_rate / 1e12);
  std::printf("# %-16s %3s %6s %-14s %-14s %7s %10s %10s %10s %10s %7s %7s %7s\n", "preset", "tp", "tokens", "gu_var",
              "down_var", "touched", "gu_us", "down_us", "both_us", "floor_us", "gu_frac", "dn_frac", "frac");

  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<Row> rows;
  // Rewritten after every row, so that a run cut short still leaves its rows.
  const auto write_json = [&]() {
    if (json_path.empty()) return;
    FILE* f = std::fopen(json_path.c_str(), "w");
    if (f == nullptr) {
      std::fprintf(stderr, "cannot write %s\n", json_path.c_str());
      std::exit(1);
    }
    std::fprintf(f,
                 "{\"bench\": \"grouped_gemm_bench\", \"commit\": \"%s\", \"device\": \"%s\", \"sm_count\": %d, "
                 "\"copy_bandwidth_tb_per_s\": %.4f, \"gemm_bf16_tflop_per_s\": %.2f, \"layouts_rotated\": %d,\n"
                 " \"rows\": [\n",
                 commit.c_str(), prop.name, prop.multiProcessorCount, copy_bw / 1e12, gemm_rate / 1e12, kNumLayouts);
    for (size_t i = 0; i < rows.size(); ++i) {
      std::fprintf(f, "  %s%s\n", json_row(rows[i]).c_str(), i + 1 < rows.size() ? "," : "");
    }
    std::fprintf(f, "]}\n");
    std::fclose(f);
  };
  for (const std::string& preset_name : split(presets_arg)) {
    const Preset* preset = nullptr;
    for (const Preset& p : kPresets) {
      if (p.name == preset_name) preset = &p;
    }
    if (preset == nullptr) {
      std::fprintf(stderr, "unknown preset %s\n", preset_name.c_str());
      return 2;
    }
    for (const std::string& tp_s : split(tp_arg)) {
      const int tp = std::stoi(tp_s);
      const Preset& p = *preset;
      const bool gated = p.activation != Activation::relu2;
      const int64_t ir = p.intermediate / tp;
      const int64_t l = p.latent;
      const size_t mat = static_cast<size_t>(p.num_experts) * ir * l;  // elements of one stacked matrix
      void* gate = gated ? device_alloc(mat * 2) : nullptr;
      void* up = device_alloc(mat * 2);
      void* down = device_alloc(mat * 2);
      if (gate) fill(gate, mat, 2.0f / std::sqrt(float(l)), 11);
      fill(up, mat, 2.0f / std::sqrt(float(l)), 12);
      fill(down, mat, 1.0f / std::sqrt(float(ir)), 13);
      ExpertGemmWeights w;
      w.gate = gate;
      w.up = up;
      w.down = down;
      w.intermediate = ir;
      w.latent = l;
      w.num_experts = p.num_experts;
      for (const std::string& t_s : split(tokens_arg)) {
        const int64_t tokens = std::stoll(t_s);
        const int64_t pairs = tokens * p.top_k;
        LayoutSet layouts = make_layouts(tokens, p.num_experts, p.top_k, 1000 + tokens);
        void* z_all = device_alloc(kNumLayouts * tokens * l * 2);
        void* act = device_alloc(pairs * ir * 2);
        void* y = device_alloc(pairs * l * 2);
        fill(z_all, kNumLayouts * tokens * l, 1.0f, 21);
        CK(cudaDeviceSynchronize());

        Row r;
        r.preset = p.name;
        r.tp_shard = tp;
        r.tokens = tokens;
        r.touched = layouts.mean_touched;
        const double weight_mats = gated ? 2.0 : 1.0;
        r.gu_bytes = r.touched * weight_mats * ir * l * 2 + tokens * l * 2.0 + pairs * ir * 2.0;
        r.down_bytes = r.touched * ir * l * 2.0 + pairs * ir * 2.0 + pairs * l * 2.0;
        r.gu_flops = 2.0 * pairs * l * ir * weight_mats;
        r.down_flops = 2.0 * pairs * ir * l;
        r.gu_byte_floor_ms = r.gu_bytes / copy_bw * 1e3;
        r.gu_flop_floor_ms = r.gu_flops / gemm_rate * 1e3;
        r.down_byte_floor_ms = r.down_bytes / copy_bw * 1e3;
        r.down_flop_floor_ms = r.down_flops / gemm_rate * 1e3;
        r.gu_floor_ms = std::max(r.gu_byte_floor_ms, r.gu_flop_floor_ms);
        r.down_floor_ms = std::max(r.down_byte_floor_ms, r.down_flop_floor_ms);
        r.experts_floor_ms =
            std::max((r.gu_bytes + r.down_bytes) / copy_bw, (r.gu_flops + r.down_flops) / gemm_rate) * 1e3;

        for (const GemmChoice& v : variants) {
          const auto resolve = [&](bool is_down) {
            const GemmVariant resolved =
                v.variant == GemmVariant::automatic
                    ? latentmoe::cuda::detail::choose_variant(DType::bf16, is_down, gated && !is_down, tokens, p.top_k,
                                                              p.num_experts, ir, l)
                    : v.variant;
            std::string name = latentmoe::cuda::detail::to_string(resolved);
            if (v.n_tiles_per_cta > 0) name += ":ng" + std::to_string(v.n_tiles_per_cta);
            if (v.k_splits > 0) name += ":ks" + std::to_string(v.k_splits);
            return name;
          };
          r.gu_variant = resolve(false);
          r.down_variant = resolve(true);
          const auto timed = [&](Phase phase, const char* name) {
            return phases_arg.find(name) == std::string::npos
                       ? std::nan("")
                       : time_phase(phase, v, v, p, w, layouts, tokens, z_all, act, y, stream);
          };
          r.gu_ms = timed(Phase::gate_up, "gate_up");
          r.down_ms = timed(Phase::down, "down");
          r.both_ms = timed(Phase::both, "both");
          rows.push_back(r);
          write_json();
          std::printf("  %-16s %3d %6lld %-14s %-14s %7.1f %10.2f %10.2f %10.2f %10.2f %7.3f %7.3f %7.3f\n",
                      r.preset.c_str(), tp, static_cast<long long>(tokens), r.gu_variant.c_str(),
                      r.down_variant.c_str(), r.touched, r.gu_ms * 1e3, r.down_ms * 1e3, r.both_ms * 1e3,
                      r.experts_floor_ms * 1e3, r.gu_floor_ms / r.gu_ms, r.down_floor_ms / r.down_ms,
                      r.experts_floor_ms / r.both_ms);
          std::fflush(stdout);
        }
        CK(cudaFree(layouts.offsets));
        CK(cudaFree(layouts.sorted));
        CK(cudaFree(layouts.pair_rows));
        CK(cudaFree(z_all));
        CK(cudaFree(act));
        CK(cudaFree(y));
      }
      if (gate) CK(cudaFree(gate));
      CK(cudaFree(up));
      CK(cudaFree(down));
    }
  }
  std::printf("# done: %zu rows\n", rows.size());
  return 0;
}

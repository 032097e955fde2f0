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
//                      [--weights bf16|mxfp4] [--json FILE] [--commit SHA]
// --weights mxfp4: the experts' weights as MXFP4 codes (random bytes) and E8M0 scales (2^-6), the
// activations bf16; their bytes counted at 17/32 byte per weight; "all" then sweeps the tile shapes
// that have MXFP4 instances (mxfp4_rows, three mma.sync shapes, and on Hopper wgmma, wgmma_tall,
// wgmma_narrow, wgmma_ws and wgmma_ws_tall). (Up to 8 tokens the layer runs MXFP4 on the decode kernels instead:
// latentmoe bench layer --experts mxfp4 measures both.) Timing, the repro line and the JSON go through the
// benchmark harness (bench/harness/timing.h).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda/gemm/grouped_gemm.h"
#include "cuda/kernels/fill.h"
#include "cuda/kernels/mxfp4_order.h"
#include "harness/cublas_handle.h"
#include "harness/timing.h"
#include "latentmoe/error.h"

namespace {

using latentmoe::Activation;
using latentmoe::DType;
using latentmoe::bench::DeviceMemory;
using latentmoe::bench::Runs;
using latentmoe::bench::Timer;
using latentmoe::cuda::ExpertGemmWeights;
using latentmoe::cuda::MoeLayout;
using latentmoe::cuda::detail::GemmChoice;
using latentmoe::cuda::detail::GemmVariant;

constexpr int kNumLayouts = 16;
// The ceilings: 3 warm-up and 10 timed runs, no L2 flush (a 2 GiB copy and an 8192^3 GEMM dwarf it).
constexpr Runs kCeilingRuns{.warmup = 3, .iterations = 10, .flush_l2 = false};

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

// bf16 data uniform in [-scale, scale), seeded, made on the GPU.
void fill(void* p, size_t n, float scale, uint64_t seed, cudaStream_t stream) {
  latentmoe::cuda::fill_uniform(p, DType::bf16, static_cast<int64_t>(n), seed, scale, 0.0f, stream);
}

// Dense bf16 GEMM rate (FLOP/s) through cuBLAS, 8192^3, random data, fp32 accumulation.
double measure_gemm_rate(Timer& timer, cudaStream_t stream) {
  const int n = 8192;
  const size_t count = static_cast<size_t>(n) * n;
  DeviceMemory a(count * 2), b(count * 2), c(count * 2);
  fill(a.get(), count, 1.0f, 1, stream);
  fill(b.get(), count, 1.0f, 2, stream);
  const latentmoe::bench::CublasHandle handle(stream);
  const float alpha = 1.0f, beta = 0.0f;
  const double us = timer.median_us(
      stream,
      [&] {
        LATENTMOE_CUBLAS_CHECK(cublasGemmEx(handle.get(), CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &alpha, a.get(),
                                            CUDA_R_16BF, n, b.get(), CUDA_R_16BF, n, &beta, c.get(), CUDA_R_16BF, n,
                                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      },
      kCeilingRuns);
  return 2.0 * n * double(n) * n / (us * 1e-6);
}

struct LayoutSet {
  DeviceMemory offsets;     // int32 [kNumLayouts][E + 1]
  DeviceMemory sorted;      // int32 [kNumLayouts][T * k]
  DeviceMemory pair_rows;   // int32 [kNumLayouts][T * k]
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
  auto upload = [](const std::vector<int32_t>& host) {
    DeviceMemory device(host.size() * 4);
    LATENTMOE_CUDA_CHECK(cudaMemcpy(device.get(), host.data(), host.size() * 4, cudaMemcpyHostToDevice));
    return device;
  };
  set.offsets = upload(offsets);
  set.sorted = upload(sorted);
  set.pair_rows = upload(pair_rows);
  set.mean_touched = touched_sum / kNumLayouts;
  return set;
}

enum class Phase { gate_up, down, both };

// Median time of one iteration (ms) of `phase`, from replays of a graph of kNumLayouts iterations.
// `workspace`: the grouped GEMMs' split-K workspace (grouped_gemm_workspace_bytes), zeroed once (every
// launch leaves it zeroed).
double time_phase(Timer& timer, Phase phase, GemmChoice gu_variant, GemmChoice down_variant, const Preset& p,
                  const ExpertGemmWeights& w, const LayoutSet& layouts, int64_t tokens, const void* z_all, void* act,
                  void* y, const DeviceMemory& workspace, cudaStream_t stream) {
  latentmoe::detail::ActivationParams act_params;
  act_params.activation = p.activation;
  const int64_t pairs = tokens * p.top_k;
  const latentmoe::bench::Graph graph(stream, [&] {
    for (int li = 0; li < kNumLayouts; ++li) {
      MoeLayout layout;
      layout.expert_offsets = layouts.offsets.as<int32_t>() + li * (p.num_experts + 1);
      layout.sorted_pairs = layouts.sorted.as<int32_t>() + li * pairs;
      layout.pair_rows = layouts.pair_rows.as<int32_t>() + li * pairs;
      layout.num_experts = p.num_experts;
      layout.top_k = p.top_k;
      layout.num_tokens = tokens;
      const void* z = static_cast<const char*>(z_all) + li * tokens * w.latent * 2;
      if (phase != Phase::down) {
        latentmoe::cuda::detail::grouped_gate_up_variant(gu_variant, DType::bf16, act_params, z, layout, w, act,
                                                         workspace.get(), workspace.bytes(), stream);
      }
      if (phase != Phase::gate_up) {
        latentmoe::cuda::detail::grouped_down_variant(down_variant, DType::bf16, act, layout, w, y, workspace.get(),
                                                      workspace.bytes(), stream);
      }
    }
  });
  // The rotated layouts keep the L2 from holding the touched weights: no flush. One warm-up replay and
  // one timed, then as many replays as fit in about 150 ms (5 to 50).
  const auto replay = [&] { graph.launch(stream); };
  const double first_us = timer.median_us(stream, replay, {.warmup = 1, .iterations = 1, .flush_l2 = false});
  const int reps = std::clamp(static_cast<int>(150e3 / std::max(first_us, 1.0)), 5, 50);
  return timer.median_us(stream, replay, {.warmup = 0, .iterations = reps, .flush_l2 = false}) * 1e-3 / kNumLayouts;
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

// Phases not timed are NaN, written as null.
nlohmann::json json_row(const Row& r) {
  auto gemm = [](double ms, double bytes, double flops, double byte_floor_ms, double flop_floor_ms, double floor_ms) {
    return nlohmann::json{{"time_us", ms * 1e3},
                          {"bytes", bytes},
                          {"flops", flops},
                          {"byte_floor_us", byte_floor_ms * 1e3},
                          {"flop_floor_us", flop_floor_ms * 1e3},
                          {"floor_us", floor_ms * 1e3},
                          {"fraction_of_floor", floor_ms / ms},
                          {"tb_per_s", bytes / (ms * 1e-3) / 1e12},
                          {"tflop_per_s", flops / (ms * 1e-3) / 1e12}};
  };
  nlohmann::json row;
  row["preset"] = r.preset;
  row["tp_shard"] = r.tp_shard;
  row["tokens"] = r.tokens;
  row["dtype"] = "bf16";
  row["gate_up_variant"] = r.gu_variant;
  row["down_variant"] = r.down_variant;
  row["touched_experts"] = r.touched;
  row["gate_up"] = gemm(r.gu_ms, r.gu_bytes, r.gu_flops, r.gu_byte_floor_ms, r.gu_flop_floor_ms, r.gu_floor_ms);
  row["down"] =
      gemm(r.down_ms, r.down_bytes, r.down_flops, r.down_byte_floor_ms, r.down_flop_floor_ms, r.down_floor_ms);
  row["experts"] = {{"time_us", r.both_ms * 1e3},
                    {"floor_us", r.experts_floor_ms * 1e3},
                    {"tb_per_s", (r.gu_bytes + r.down_bytes) / (r.both_ms * 1e-3) / 1e12},
                    {"tflop_per_s", (r.gu_flops + r.down_flops) / (r.both_ms * 1e-3) / 1e12}};
  row["experts_fraction_of_floor"] = r.experts_floor_ms / r.both_ms;
  return row;
}

// "mma_l", "mma_l:ng4" (4 n-tiles per CTA), "mma_s:ks2" (2 split-K CTAs per tile), "mma_s:ng1:ks1";
// "wgmma_ws_tall:op1" (GemmChoice::option 1: the register epilogue; op2 the down projection's rows by cp.async
// instead of TMA; op4 the weights at normal L2 priority, op8 without the L2 promotion, op16 the weights' L2 handling
// before session 20 whatever K; bits add up), "mxfp4_rows:op1"
// (its copies without an L2 prefetch; op2 128 bytes for codes, op3 256 bytes, op4 128 bytes for codes and scales);
// "automatic".
GemmChoice parse_choice(const std::string& spec) {
  const size_t colon = spec.find(':');
  const std::string name = spec.substr(0, colon);
  int per_cta = 0;
  int splits = 0;
  int variant_option = 0;
  for (size_t at = colon; at != std::string::npos;) {
    const size_t next = spec.find(':', at + 1);
    const std::string option = spec.substr(at + 1, next == std::string::npos ? std::string::npos : next - at - 1);
    if (option.rfind("ng", 0) == 0) {
      per_cta = std::stoi(option.substr(2));
    } else if (option.rfind("ks", 0) == 0) {
      splits = std::stoi(option.substr(2));
    } else if (option.rfind("op", 0) == 0) {
      variant_option = std::stoi(option.substr(2));
    } else {
      latentmoe::detail::throw_error("unknown option ", option, " in ", spec);
    }
    at = next;
  }
  if (name == "automatic") return GemmChoice(GemmVariant::automatic, per_cta, splits, variant_option);
  for (GemmVariant v : latentmoe::cuda::detail::all_variants()) {
    if (latentmoe::cuda::detail::to_string(v) == name) return GemmChoice(v, per_cta, splits, variant_option);
  }
  latentmoe::detail::throw_error("unknown variant ", spec);
}

int run(int argc, char** argv) {
  std::string presets_arg = "kimi-k3,nemotron3-super";
  std::string tp_arg = "8,1";
  std::string tokens_arg = "1,8,64,256,1024,4096";
  std::string variants_arg = "automatic";
  std::string json_path;
  std::string commit = "unknown";
  std::string phases_arg = "gate_up,down,both";
  std::string weights_arg = "bf16";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      LATENTMOE_CHECK(i + 1 < argc, a, " needs a value");
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
    else if (a == "--weights")
      weights_arg = next();
    else
      latentmoe::detail::throw_error("unknown argument ", a);
  }
  LATENTMOE_CHECK(weights_arg == "bf16" || weights_arg == "mxfp4", "--weights ", weights_arg, " is not bf16 or mxfp4");
  const bool mxfp4 = weights_arg == "mxfp4";
  // Variants swept: "automatic" (the library's choice), "all" (every tensor-core variant), or a list.
  std::vector<GemmChoice> variants;
  if (variants_arg == "all" && mxfp4) {
    for (GemmVariant v : {GemmVariant::mxfp4_rows, GemmVariant::mma_s_wide, GemmVariant::mma_m, GemmVariant::mma_l4})
      variants.emplace_back(v);
    if (latentmoe::cuda::detail::wgmma_available()) {
      for (GemmVariant v : {GemmVariant::wgmma, GemmVariant::wgmma_tall, GemmVariant::wgmma_narrow,
                            GemmVariant::wgmma_ws, GemmVariant::wgmma_ws_tall})
        variants.emplace_back(v);
    }
  } else if (variants_arg == "all") {
    for (GemmVariant v : latentmoe::cuda::detail::all_variants()) {
      if (latentmoe::cuda::detail::is_wgmma(v) && !latentmoe::cuda::detail::wgmma_available()) continue;
      if (v != GemmVariant::simt && !latentmoe::cuda::detail::is_mxfp4_only(v)) variants.emplace_back(v);
    }
  } else {
    for (const std::string& v : split(variants_arg)) variants.push_back(parse_choice(v));
  }
  latentmoe::bench::Repro repro("grouped_gemm_bench");
  repro.flag("--presets", presets_arg)
      .flag("--tp-shards", tp_arg)
      .flag("--tokens", tokens_arg)
      .flag("--variants", variants_arg)
      .flag("--phases", phases_arg)
      .flag("--weights", weights_arg);

  int device = 0;
  LATENTMOE_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop;
  LATENTMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  std::printf("# grouped_gemm_bench  device %s  sm_%d%d  %d SMs  L2 %d MB  commit %s\n", prop.name, prop.major,
              prop.minor, prop.multiProcessorCount, prop.l2CacheSize >> 20, commit.c_str());
  cudaStream_t stream = nullptr;
  LATENTMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Timer timer(kCeilingRuns);
  const double copy_bw = latentmoe::bench::copy_bandwidth(timer, stream, kCeilingRuns);
  const double gemm_rate = measure_gemm_rate(timer, stream);
  std::printf("# ceilings: copy %.3f TB/s (read+write), dense bf16 GEMM 8192^3 %.1f TFLOP/s\n", copy_bw / 1e12,
              gemm_rate / 1e12);
  std::printf("# %-16s %3s %6s %-14s %-14s %7s %10s %10s %10s %10s %7s %7s %7s\n", "preset", "tp", "tokens", "gu_var",
              "down_var", "touched", "gu_us", "down_us", "both_us", "floor_us", "gu_frac", "dn_frac", "frac");

  nlohmann::json report;
  report["bench"] = "grouped_gemm_bench";
  report["commit"] = commit;
  report["device"] = prop.name;
  report["sm_count"] = prop.multiProcessorCount;
  report["copy_bandwidth_tb_per_s"] = copy_bw / 1e12;
  report["gemm_bf16_tflop_per_s"] = gemm_rate / 1e12;
  report["layouts_rotated"] = kNumLayouts;
  report["weights"] = weights_arg;
  report["repro"] = repro.line();
  report["rows"] = nlohmann::json::array();
  report["skipped"] = nlohmann::json::array();
  // Rewritten after every row, so that a run cut short still leaves its rows.
  const auto write_json = [&] {
    if (!json_path.empty()) latentmoe::bench::write_json(json_path, report);
  };
  for (const std::string& preset_name : split(presets_arg)) {
    const Preset* preset = nullptr;
    for (const Preset& p : kPresets) {
      if (p.name == preset_name) preset = &p;
    }
    LATENTMOE_CHECK(preset != nullptr, "unknown preset ", preset_name);
    for (const std::string& tp_s : split(tp_arg)) {
      const int tp = std::stoi(tp_s);
      const Preset& p = *preset;
      const bool gated = p.activation != Activation::relu2;
      const int64_t ir = p.intermediate / tp;
      const int64_t l = p.latent;
      if (mxfp4 && !latentmoe::cuda::grouped_mxfp4_supported(DType::bf16, ir, l)) {
        std::printf("# skipped %s at tp-shard %d: MXFP4 needs I/tp (%lld) and l (%lld) multiples of 32\n",
                    p.name.c_str(), tp, static_cast<long long>(ir), static_cast<long long>(l));
        report["skipped"].push_back(p.name + " tp-shard " + std::to_string(tp));
        continue;
      }
      const size_t mat = static_cast<size_t>(p.num_experts) * ir * l;  // elements of one stacked matrix
      // bf16: 2 bytes per weight. MXFP4: half a byte of code (random bytes: random bf16 bits) and a
      // scale byte per 32 weights.
      const size_t mat_bytes = mxfp4 ? mat / 2 : mat * 2;
      DeviceMemory gate, up(mat_bytes), down(mat_bytes), gate_scales, up_scales, down_scales;
      auto fill_weights = [&](const DeviceMemory& m, float scale, uint64_t seed) {
        fill(m.get(), m.bytes() / 2, scale, seed, stream);
      };
      if (gated) {
        gate = DeviceMemory(mat_bytes);
        fill_weights(gate, 2.0f / std::sqrt(float(l)), 11);
      }
      fill_weights(up, 2.0f / std::sqrt(float(l)), 12);
      fill_weights(down, 1.0f / std::sqrt(float(ir)), 13);
      if (mxfp4) {
        // The codes in the order the kernels read (random bits either way: the timing does not depend on it).
        for (const DeviceMemory* codes : {&gate, &up, &down}) {
          if (codes->get() != nullptr)
            latentmoe::cuda::mxfp4_codes_to_kernel_order(codes->get(), codes->bytes(), stream);
        }
        for (DeviceMemory* s : {&gate_scales, &up_scales, &down_scales}) {
          if (s == &gate_scales && !gated) continue;
          *s = DeviceMemory(mat / 32);
          LATENTMOE_CUDA_CHECK(cudaMemsetAsync(s->get(), 0x79, mat / 32, stream));  // 2^-6
        }
      }
      ExpertGemmWeights w;
      w.gate = gate.get();
      w.up = up.get();
      w.down = down.get();
      w.gate_scales = static_cast<const uint8_t*>(gate_scales.get());
      w.up_scales = static_cast<const uint8_t*>(up_scales.get());
      w.down_scales = static_cast<const uint8_t*>(down_scales.get());
      w.intermediate = ir;
      w.latent = l;
      w.num_experts = p.num_experts;
      for (const std::string& t_s : split(tokens_arg)) {
        const int64_t tokens = std::stoll(t_s);
        const int64_t pairs = tokens * p.top_k;
        const LayoutSet layouts = make_layouts(tokens, p.num_experts, p.top_k, 1000 + tokens);
        const DeviceMemory z_all(kNumLayouts * tokens * l * 2), act(pairs * ir * 2), y(pairs * l * 2);
        fill(z_all.get(), kNumLayouts * tokens * l, 1.0f, 21, stream);
        const DeviceMemory workspace(latentmoe::cuda::grouped_gemm_workspace_bytes(tokens, p.top_k, p.num_experts));
        LATENTMOE_CUDA_CHECK(cudaMemsetAsync(workspace.get(), 0, workspace.bytes(), stream));
        LATENTMOE_CUDA_CHECK(cudaStreamSynchronize(stream));

        Row r;
        r.preset = p.name;
        r.tp_shard = tp;
        r.tokens = tokens;
        r.touched = layouts.mean_touched;
        const double weight_mats = gated ? 2.0 : 1.0;
        const double weight_bytes = mxfp4 ? 0.5 + 1.0 / 32 : 2.0;
        r.gu_bytes = r.touched * weight_mats * ir * l * weight_bytes + tokens * l * 2.0 + pairs * ir * 2.0;
        r.down_bytes = r.touched * ir * l * weight_bytes + pairs * ir * 2.0 + pairs * l * 2.0;
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
            const auto choose =
                mxfp4 ? latentmoe::cuda::detail::choose_mxfp4_variant : latentmoe::cuda::detail::choose_variant;
            const GemmVariant resolved =
                v.variant == GemmVariant::automatic
                    ? choose(DType::bf16, is_down, gated && !is_down, tokens, p.top_k, p.num_experts, ir, l)
                    : v.variant;
            std::string name = latentmoe::cuda::detail::to_string(resolved);
            if (v.n_tiles_per_cta > 0) name += ":ng" + std::to_string(v.n_tiles_per_cta);
            if (v.k_splits > 0) name += ":ks" + std::to_string(v.k_splits);
            if (v.option > 0) name += ":op" + std::to_string(v.option);
            return name;
          };
          r.gu_variant = resolve(false);
          r.down_variant = resolve(true);
          const auto timed = [&](Phase phase, const char* name) {
            return phases_arg.find(name) == std::string::npos
                       ? std::nan("")
                       : time_phase(timer, phase, v, v, p, w, layouts, tokens, z_all.get(), act.get(), y.get(),
                                    workspace, stream);
          };
          r.gu_ms = timed(Phase::gate_up, "gate_up");
          r.down_ms = timed(Phase::down, "down");
          r.both_ms = timed(Phase::both, "both");
          report["rows"].push_back(json_row(r));
          write_json();
          std::printf("  %-16s %3d %6lld %-14s %-14s %7.1f %10.2f %10.2f %10.2f %10.2f %7.3f %7.3f %7.3f\n",
                      r.preset.c_str(), tp, static_cast<long long>(tokens), r.gu_variant.c_str(),
                      r.down_variant.c_str(), r.touched, r.gu_ms * 1e3, r.down_ms * 1e3, r.both_ms * 1e3,
                      r.experts_floor_ms * 1e3, r.gu_floor_ms / r.gu_ms, r.down_floor_ms / r.down_ms,
                      r.experts_floor_ms / r.both_ms);
          std::fflush(stdout);
        }
      }
    }
  }
  std::printf("# done: %zu rows\n", report["rows"].size());
  repro.print();
  LATENTMOE_CUDA_CHECK(cudaStreamDestroy(stream));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return latentmoe::bench::run_main("grouped_gemm_bench", [&] { return run(argc, argv); });
}

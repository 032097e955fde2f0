// latentmoe bench tail: what one run measured, and its two renderings: the table printed on stdout
// (nccl-tests-like: one line per token count) and the JSON document (format latentmoe-bench-tail-1,
// documented in docs/PERFORMANCE.md, "Tail benchmark"). Pure functions of the measurements, no
// backend, so that the tests check them directly.
#pragma once

#include <array>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "latentmoe/config.h"
#include "latentmoe/tier.h"

namespace latentmoe::tools {

// What one point measures, in table order: the four tiers forced (their tail alone, and the whole
// layer with it), the unfused tail (AR of L_r, RMSNorm, the full W_up GEMM, AR of S_r, add, composed
// by the bench from the communicator's collectives and the backend's operations), the AR+RMSNorm
// step of the fused tiers alone (Backend::all_reduce_rms_norm of L_r: one fused kernel where the
// backend has one), the same as the communicator's all-reduce followed by the backend's RMSNorm, and
// the all-reduce of a [T, d] message (the ceiling the floors use).
enum class TailPath {
  native,
  tail_fusion,
  allreduce_overlap,
  column_parallel,
  unfused,
  ar_rmsnorm,
  ar_then_rmsnorm,
  all_reduce,
};
constexpr std::array<TailPath, 8> kTailPaths = {
    TailPath::native,  TailPath::tail_fusion, TailPath::allreduce_overlap, TailPath::column_parallel,
    TailPath::unfused, TailPath::ar_rmsnorm,  TailPath::ar_then_rmsnorm,   TailPath::all_reduce};

std::string_view path_name(TailPath path);
// "tier" for the four tiers, "unfused" for the unfused tail, "collective" for the rest.
std::string_view path_kind(TailPath path);
bool is_tier(TailPath path);

// One group measurement: each rank's median, and the group's time (the median over the runs of the
// slowest rank's time, bench::median_of_slowest).
struct GroupTime {
  double us = 0;
  std::vector<double> us_per_rank;
};

struct PathResult {
  TailPath path = TailPath::native;
  bool ran = false;
  std::string reason;                    // why it did not run (a tier the runners do not support here)
  GroupTime time;                        // the tail, the unfused tail, or the collective
  std::optional<GroupTime> layer;        // tiers: the whole layer through Runner::forward with the tier
  double message_bytes = 0;              // collectives: the bytes each rank contributes
  std::optional<double> floor_us;        // tail_fusion: its floor (tail_floor_us)
  std::optional<double> layer_floor_us;  // tiers: the layer's byte floor + two one-shot rounds
};

// One (preset, tp, tokens) point: every TailPath in kTailPaths order.
struct TailPoint {
  std::string preset;
  int scale = 1;
  int tp = 2;
  int64_t tokens = 1;
  std::string dtype;
  std::string placement = "simulated";          // "simulated" (every rank on one device) or "devices" (one per rank)
  std::string collectives = "one_shot";         // "one_shot" (the group's one-shot kernels, NCCL above) or "nccl"
  int64_t one_shot_max_tokens = 0;              // ranks on GPUs of their own: one-shot up to this many tokens
  int fused_up_projection_max_tokens = 0;       // CUDA: tier 0's fused up-projection bound; the CPU: 0
  int64_t fused_up_projection_max_latent = -1;  // CUDA: its latent bound, -1: the dispatch's rule
  int64_t hidden_size = 0, latent_size = 0;
  int64_t touched_experts = 0;  // distinct routed experts the tokens' routing touched
  // The tier the runner's automatic policy takes at these tokens (Runner::select_tier: the defaults or the
  // LATENTMOE_* variables); nullopt where not known.
  std::optional<TailTier> policy_tier;
  std::vector<PathResult> paths;

  const PathResult& at(TailPath path) const;
};

// What holds for the whole run.
struct TailRunInfo {
  std::string backend;    // "cuda" or "cpu"
  std::string placement;  // the largest tp's placement ("simulated" or "devices"); each row has its own
  std::string device;     // the GPU's name, or the CPU model
  std::string commit;
  int warmup = 0, iterations = 0;
  bool flush = false;
  double copy_bytes_per_s = 0;  // bytes read + written per second
  std::string repro;
  // Points left out because --max-seconds ran out (empty: none).
  std::vector<std::string> skipped;
  // false while the run is under way: the JSON is rewritten after every (preset, tp) block, so a run
  // that is killed or fails keeps what it measured.
  bool complete = true;
  std::string error;  // the failure that ended the run early (empty: none)
};

// The report's tier columns follow kAllTailTiers (latentmoe/tier.h), as TailPath's first four paths do.
// The path that times `tier`.
TailPath path_of(TailTier tier);

// The policy's whole-layer time over the fastest forced tier's at this point (issue 14: at most 1.05);
// nullopt without a policy tier or where its tier's layer was not measured.
std::optional<double> policy_layer_ratio(const TailPoint& point);

// Tier 0's floor (issue 14): two dependent one-shot rounds, each timed as the all-reduce of a [T, d]
// message on the same ranks, plus reading this rank's 1/tp of W_up at the copy bandwidth.
double tail_floor_us(double all_reduce_us, double w_up_shard_bytes, double copy_bytes_per_s);
// The layer's floor per rank: its bytes at the copy bandwidth plus the two one-shot rounds.
double layer_floor_us(double layer_bytes, double copy_bytes_per_s, double all_reduce_us);

// "# ..." lines describing the run (backend, placement, device, commit, ceilings, method).
std::string format_run_header(const TailRunInfo& info);
// "# preset ..." and the two column-title lines of one (preset, tp) block.
std::string format_block_header(const TailPoint& first);
// The table line of one point: µs with one decimal, "-" for what did not run.
std::string format_point_line(const TailPoint& point);

// The JSON document: run fields, ceilings, and one row per (point, path) carrying the run's
// placement, backend, device and commit (docs/PERFORMANCE.md, "Tail benchmark", has the schema).
nlohmann::json to_json(const TailRunInfo& info, const std::vector<TailPoint>& points);

// A preset scaled down by `scale` (d, l, E, I and Is divided by it, top_k capped at E); scale 1 is
// the preset itself. Throws Error naming the size `scale` does not divide.
LayerConfig scaled_preset(const std::string& preset, int scale);

}  // namespace latentmoe::tools

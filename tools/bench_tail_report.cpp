// latentmoe bench tail's report (bench_tail_report.h).
#include "bench_tail_report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <utility>

#include "latentmoe/error.h"
#include "latentmoe/presets.h"
#include "tool_common.h"

namespace latentmoe::tools {
namespace {

constexpr int kColumn = 9;  // width of one time column

std::string cell(const std::string& text) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), " %*s", kColumn, text.c_str());
  return buffer;
}

std::string time_cell(bool ran, double us) {
  if (!ran || !std::isfinite(us)) return cell("-");
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f", us);
  return cell(text);
}

}  // namespace

std::string_view path_name(TailPath path) {
  switch (path) {
    case TailPath::native:
      return "native";
    case TailPath::tail_fusion:
      return "tail_fusion";
    case TailPath::allreduce_overlap:
      return "allreduce_overlap";
    case TailPath::column_parallel:
      return "column_parallel";
    case TailPath::unfused:
      return "unfused";
    case TailPath::ar_rmsnorm:
      return "ar_rmsnorm";
    case TailPath::ar_then_rmsnorm:
      return "ar_then_rmsnorm";
    case TailPath::all_reduce:
      return "all_reduce";
  }
  return "?";
}

bool is_tier(TailPath path) {
  return path == TailPath::native || path == TailPath::tail_fusion || path == TailPath::allreduce_overlap ||
         path == TailPath::column_parallel;
}

std::string_view path_kind(TailPath path) {
  if (is_tier(path)) return "tier";
  return path == TailPath::unfused ? "unfused" : "collective";
}

const PathResult& TailPoint::at(TailPath path) const {
  for (const PathResult& result : paths) {
    if (result.path == path) return result;
  }
  detail::throw_error("bench tail: the point at ", tokens, " tokens has no ", path_name(path), " result");
}

double tail_floor_us(double all_reduce_us, double w_up_shard_bytes, double copy_bytes_per_s) {
  LATENTMOE_CHECK(copy_bytes_per_s > 0, "bench tail: the copy bandwidth must be positive");
  return 2.0 * all_reduce_us + 1e6 * w_up_shard_bytes / copy_bytes_per_s;
}

double layer_floor_us(double layer_bytes, double copy_bytes_per_s, double all_reduce_us) {
  LATENTMOE_CHECK(copy_bytes_per_s > 0, "bench tail: the copy bandwidth must be positive");
  return 1e6 * layer_bytes / copy_bytes_per_s + 2.0 * all_reduce_us;
}

std::string format_run_header(const TailRunInfo& info) {
  std::string text;
  char line[512];
  std::snprintf(line, sizeof(line), "# latentmoe bench tail  backend %s  placement %s  device %s  commit %s\n",
                info.backend.c_str(), info.placement.c_str(), info.device.c_str(),
                info.commit.empty() ? "(not given)" : info.commit.c_str());
  text += line;
  if (info.placement == "simulated") {
    text += "# simulated: every rank on one " + std::string(info.backend == "cpu" ? "CPU (threads)" : "GPU") +
            ", sharing it: no NVLink cost, and each rank's time includes its peers' work on the same device\n";
  }
  std::snprintf(line, sizeof(line), "# copy bandwidth %.3f TB/s (read + written)\n", info.copy_bytes_per_s / 1e12);
  text += line;
  std::snprintf(line, sizeof(line),
                "# us, the median over %d runs (after %d warm-ups) of the slowest rank's time; %s; all ranks start "
                "each run together\n",
                info.iterations, info.warmup,
                info.flush ? "cache flushed before each run" : "no cache flush (CPU mode: times are not a result)");
  text += line;
  text +=
      "# tail: the tier's tail alone on restored partials; layer: Runner::forward with the tier; unfused: AR(L), "
      "norm, L W_up^T, AR(S), add;\n# ar+rms: the fused tiers' AR+RMSNorm step of L; ar,rms: AR then RMSNorm; "
      "ar(Txd): AR of [T, d]; t0_floor: 2 ar(Txd) + W_up/tp at copy bandwidth\n";
  return text;
}

TailPath path_of(TailTier tier) {
  switch (tier) {
    case TailTier::native:
      return TailPath::native;
    case TailTier::tail_fusion:
      return TailPath::tail_fusion;
    case TailTier::allreduce_overlap:
      return TailPath::allreduce_overlap;
    case TailTier::column_parallel:
      return TailPath::column_parallel;
  }
  return TailPath::native;
}

namespace {

// The column label of a tier in the block header and the auto column.
const char* tier_label(TailTier tier) {
  switch (tier) {
    case TailTier::native:
      return "native";
    case TailTier::tail_fusion:
      return "fusion";
    case TailTier::allreduce_overlap:
      return "overlap";
    case TailTier::column_parallel:
      return "column";
  }
  return "?";
}

}  // namespace

std::optional<double> policy_layer_ratio(const TailPoint& point) {
  if (!point.policy_tier) return std::nullopt;
  double best = std::numeric_limits<double>::infinity();
  for (TailTier tier : kAllTailTiers) {
    const PathResult& result = point.at(path_of(tier));
    if (result.ran && result.layer) best = std::min(best, result.layer->us);
  }
  const PathResult& chosen = point.at(path_of(*point.policy_tier));
  if (!chosen.ran || !chosen.layer || !(best > 0.0) || !std::isfinite(best)) return std::nullopt;
  return chosen.layer->us / best;
}

std::string format_block_header(const TailPoint& first) {
  char line[512];
  std::snprintf(line, sizeof(line), "\n# preset %s (scale %d)  tp %d  %s  d %lld  l %lld\n", first.preset.c_str(),
                first.scale, first.tp, first.dtype.c_str(), static_cast<long long>(first.hidden_size),
                static_cast<long long>(first.latent_size));
  std::string text = line;
  std::string titles = "#       tokens";
  titles.append(cell("touched"));
  std::string subtitles = "#             ";
  subtitles.append(cell(""));
  for (TailTier tier : kAllTailTiers) {
    titles.append(cell(tier_label(tier))).append(cell(tier_label(tier)));
    subtitles.append(cell("tail")).append(cell("layer"));
  }
  for (const char* label : {"unfused", "ar+rms", "ar,rms", "ar(Txd)", "t0_floor", "auto", "auto/best"}) {
    titles += cell(label);
    subtitles += cell("");
  }
  // Trailing blanks of the subtitle line go.
  subtitles.erase(subtitles.find_last_not_of(' ') + 1);
  text.append(titles).append("\n").append(subtitles).append("\n");
  return text;
}

std::string format_point_line(const TailPoint& point) {
  char head[64];
  std::snprintf(head, sizeof(head), " %13lld", static_cast<long long>(point.tokens));
  std::string text = head;
  text.append(cell(std::to_string(point.touched_experts)));
  for (TailTier tier : kAllTailTiers) {
    const PathResult& result = point.at(path_of(tier));
    text += time_cell(result.ran, result.time.us);
    text += time_cell(result.ran && result.layer.has_value(), result.layer ? result.layer->us : 0.0);
  }
  for (TailPath path : {TailPath::unfused, TailPath::ar_rmsnorm, TailPath::ar_then_rmsnorm, TailPath::all_reduce}) {
    const PathResult& result = point.at(path);
    text += time_cell(result.ran, result.time.us);
  }
  const PathResult& fusion = point.at(TailPath::tail_fusion);
  text += time_cell(fusion.floor_us.has_value(), fusion.floor_us.value_or(0.0));
  // The automatic policy's tier here and its layer time over the fastest forced tier's.
  text += cell(point.policy_tier ? tier_label(*point.policy_tier) : "-");
  const std::optional<double> ratio = policy_layer_ratio(point);
  char ratio_text[32] = "-";
  if (ratio) std::snprintf(ratio_text, sizeof(ratio_text), "%.3f", *ratio);
  text += cell(ratio_text);
  return text + "\n";
}

nlohmann::json to_json(const TailRunInfo& info, const std::vector<TailPoint>& points) {
  nlohmann::json document;
  document["format"] = "latentmoe-bench-tail-1";
  document["commit"] = info.commit;
  document["backend"] = info.backend;
  document["placement"] = info.placement;
  document["device"] = info.device;
  document["runs"] = {{"warmup", info.warmup}, {"iterations", info.iterations}, {"flush", info.flush}};
  document["ceilings"] = {{"copy_tb_per_s", info.copy_bytes_per_s / 1e12}};
  document["method"] =
      "per rank: CUDA events (CPU: the host clock) around the work, every rank starting each run together after "
      "its cache flush and input restore; time_us is the median over the runs of the slowest rank's time";
  document["repro"] = info.repro;
  document["skipped"] = info.skipped;
  document["complete"] = info.complete;
  if (!info.error.empty()) document["error"] = info.error;
  nlohmann::json rows = nlohmann::json::array();
  for (const TailPoint& point : points) {
    for (const PathResult& result : point.paths) {
      nlohmann::json row;
      row["preset"] = point.preset;
      row["scale"] = point.scale;
      row["tp"] = point.tp;
      row["tokens"] = point.tokens;
      row["dtype"] = point.dtype;
      row["hidden_size"] = point.hidden_size;
      row["latent_size"] = point.latent_size;
      row["touched_experts"] = point.touched_experts;
      if (point.policy_tier) row["policy_tier"] = std::string(to_string(*point.policy_tier));
      if (const std::optional<double> ratio = policy_layer_ratio(point)) row["policy_layer_ratio"] = *ratio;
      row["placement"] = point.placement;
      row["collectives"] = point.collectives;
      row["one_shot_max_tokens"] = point.one_shot_max_tokens;
      row["fused_up_projection_max_tokens"] = point.fused_up_projection_max_tokens;
      row["fused_up_projection_max_latent"] = point.fused_up_projection_max_latent;
      row["backend"] = info.backend;
      row["device"] = info.device;
      row["commit"] = info.commit;
      row["path"] = std::string(path_name(result.path));
      row["kind"] = std::string(path_kind(result.path));
      row["ran"] = result.ran;
      if (!result.ran) {
        row["reason"] = result.reason;
        rows.push_back(std::move(row));
        continue;
      }
      row["time_us"] = result.time.us;
      row["time_us_per_rank"] = result.time.us_per_rank;
      if (result.layer) {
        row["layer_time_us"] = result.layer->us;
        row["layer_time_us_per_rank"] = result.layer->us_per_rank;
      }
      if (result.message_bytes > 0) row["message_bytes"] = result.message_bytes;
      if (result.floor_us) row["floor_us"] = *result.floor_us;
      if (result.layer_floor_us) row["layer_floor_us"] = *result.layer_floor_us;
      rows.push_back(std::move(row));
    }
  }
  document["rows"] = std::move(rows);
  return document;
}

LayerConfig scaled_preset(const std::string& preset, int scale) {
  return scaled_down(preset_config(preset), scale, preset);
}

}  // namespace latentmoe::tools

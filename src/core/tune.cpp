// The tuned crossover table (latentmoe/tune.h): reading, matching, and the policy a runner takes.
#include "latentmoe/tune.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <vector>

#include "core/bounded_file.h"
#include "core/builtin_tune.h"
#include "core/settings.h"
#include "latentmoe/atomic_file.h"
#include "latentmoe/error.h"
#include "latentmoe/tier.h"

namespace latentmoe {
namespace {

using nlohmann::json;

constexpr std::string_view kFormat = "latentmoe-tune-1";
// A table has an entry per tp, dtype and shape measured: kilobytes. Anything near this is not one.
constexpr size_t kMaxTuneTableBytes = size_t{16} << 20;

int64_t count_field(const json& entry, const char* key, std::string_view where, int64_t low) {
  LATENTMOE_CHECK(entry.contains(key), where, ": \"", key, "\" is missing");
  const json& value = entry.at(key);
  LATENTMOE_CHECK(value.is_number_integer(), where, ": \"", key, "\" must be an integer");
  const int64_t count = value.get<int64_t>();
  LATENTMOE_CHECK(count >= low && count <= (int64_t{1} << 30), where, ": \"", key, "\" is ", count, ", outside ", low,
                  "..", int64_t{1} << 30);
  return count;
}

// How many of the optional fields an entry pins (its specificity).
int pinned(const TuneEntry& entry) {
  return (entry.dtype ? 1 : 0) + (entry.hidden_size ? 1 : 0) + (entry.latent_size ? 1 : 0);
}

bool same_key(const TuneEntry& a, const TuneEntry& b) {
  return a.tp_size == b.tp_size && a.dtype == b.dtype && a.hidden_size == b.hidden_size &&
         a.latent_size == b.latent_size;
}

// The table's spelling of a compute dtype (from_json reads these three).
std::string_view table_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::bf16:
      return "bf16";
    case DType::f16:
      return "f16";
    case DType::f32:
      return "f32";
    default:
      break;
  }
  detail::throw_error("a tune table entry's dtype must be bf16, f16 or f32, not ", dtype_name(dtype));
}

}  // namespace

TuneTable TuneTable::from_json(std::string_view text, std::string_view origin) {
  json root;
  try {
    root = json::parse(text.begin(), text.end());
  } catch (const json::exception& error) {
    detail::throw_error(origin, ": invalid JSON in the tune table: ", error.what());
  }
  LATENTMOE_CHECK(root.is_object(), origin, ": a tune table is a JSON object");
  LATENTMOE_CHECK(
      root.contains("format") && root.at("format").is_string() && root.at("format").get<std::string>() == kFormat,
      origin, ": \"format\" must be \"", kFormat, "\"");
  TuneTable table;
  if (root.contains("machine")) {
    LATENTMOE_CHECK(root.at("machine").is_string(), origin, ": \"machine\" must be a string");
    table.machine = root.at("machine").get<std::string>();
  }
  if (root.contains("device")) {
    const json& device = root.at("device");
    LATENTMOE_CHECK(device.is_string() && !device.get<std::string>().empty(), origin,
                    ": \"device\" must be a non-empty string (the CUDA device name)");
    table.device = device.get<std::string>();
  }
  LATENTMOE_CHECK(root.contains("entries") && root.at("entries").is_array(), origin, ": \"entries\" must be an array");
  const json& entries = root.at("entries");
  for (size_t i = 0; i < entries.size(); ++i) {
    const std::string where = std::string(origin) + ": entries[" + std::to_string(i) + "]";
    const json& item = entries[i];
    LATENTMOE_CHECK(item.is_object(), where, " must be an object");
    TuneEntry entry;
    entry.tp_size = static_cast<int>(count_field(item, "tp", where, 1));
    if (item.contains("dtype")) {
      LATENTMOE_CHECK(item.at("dtype").is_string(), where, ": \"dtype\" must be a string");
      const std::string name = item.at("dtype").get<std::string>();
      if (name == "bf16") {
        entry.dtype = DType::bf16;
      } else if (name == "f16") {
        entry.dtype = DType::f16;
      } else if (name == "f32") {
        entry.dtype = DType::f32;
      } else {
        detail::throw_error(where, ": \"dtype\" must be bf16, f16 or f32");
      }
    }
    if (item.contains("hidden_size")) entry.hidden_size = count_field(item, "hidden_size", where, 1);
    if (item.contains("latent_size")) entry.latent_size = count_field(item, "latent_size", where, 1);
    entry.tail_fusion_max_tokens = count_field(item, "tail_fusion_max_tokens", where, 0);
    entry.shared_stream_token_threshold = count_field(item, "shared_stream_token_threshold", where, 0);
    for (const TuneEntry& earlier : table.entries) {
      LATENTMOE_CHECK(!same_key(earlier, entry), where, " repeats the tp, dtype and shapes of an earlier entry");
    }
    table.entries.push_back(entry);
  }
  return table;
}

TuneTable TuneTable::from_file(const std::string& path) {
  return from_json(detail::read_bounded_file(path, kMaxTuneTableBytes, "tune table"), path);
}

std::optional<TuneEntry> TuneTable::find(int tp_size, DType dtype, int64_t hidden_size, int64_t latent_size) const {
  const TuneEntry* best = nullptr;
  bool tie = false;
  for (const TuneEntry& entry : entries) {
    if (entry.tp_size != tp_size || (entry.dtype && *entry.dtype != dtype) ||
        (entry.hidden_size && *entry.hidden_size != hidden_size) ||
        (entry.latent_size && *entry.latent_size != latent_size))
      continue;
    if (best == nullptr || pinned(entry) > pinned(*best)) {
      best = &entry;
      tie = false;
    } else if (pinned(entry) == pinned(*best)) {
      tie = true;
    }
  }
  LATENTMOE_CHECK(!tie, "the tune table has two entries that match tp ", tp_size, ", ", dtype_name(dtype), ", d ",
                  hidden_size, ", l ", latent_size, " equally; pin dtype or the shapes");
  if (best == nullptr) return std::nullopt;
  return *best;
}

std::string TuneTable::to_json() const {
  nlohmann::ordered_json root;
  root["format"] = kFormat;
  root["machine"] = machine;
  if (!device.empty()) root["device"] = device;
  root["entries"] = nlohmann::ordered_json::array();
  for (const TuneEntry& entry : entries) {
    nlohmann::ordered_json item;
    item["tp"] = entry.tp_size;
    if (entry.dtype) item["dtype"] = std::string(table_dtype_name(*entry.dtype));
    if (entry.hidden_size) item["hidden_size"] = *entry.hidden_size;
    if (entry.latent_size) item["latent_size"] = *entry.latent_size;
    item["tail_fusion_max_tokens"] = entry.tail_fusion_max_tokens;
    item["shared_stream_token_threshold"] = entry.shared_stream_token_threshold;
    root["entries"].push_back(item);
  }
  try {
    return root.dump(2) + "\n";
  } catch (const nlohmann::json::exception& error) {  // e.g. a machine text that is not UTF-8
    detail::throw_error("cannot encode the tune table: ", error.what());
  }
}

void TuneTable::write_file(const std::string& path) const {
  const std::string text = to_json();
  AtomicFile file(path, text.size());
  file.write(text.data(), text.size());
  file.commit();
}

Crossovers derive_crossovers(const std::vector<TierTimes>& times) {
  LATENTMOE_CHECK(!times.empty(), "derive_crossovers: no measured token counts");
  for (size_t i = 0; i < times.size(); ++i) {
    LATENTMOE_CHECK(times[i].num_tokens >= 1, "derive_crossovers: token count ", times[i].num_tokens, " is below 1");
    LATENTMOE_CHECK(i == 0 || times[i].num_tokens > times[i - 1].num_tokens,
                    "derive_crossovers: token counts must be strictly increasing (", times[i - 1].num_tokens, " then ",
                    times[i].num_tokens, ")");
    for (size_t tier = 0; tier < times[i].ms.size(); ++tier) {
      const std::optional<double>& ms = times[i].ms[tier];
      LATENTMOE_CHECK(!ms.has_value() || (std::isfinite(*ms) && *ms >= 0.0), "derive_crossovers: the time of tier ",
                      to_string(static_cast<TailTier>(tier)), " at ", times[i].num_tokens, " tokens is ",
                      ms.value_or(0.0), " ms");
    }
  }
  // Rows where a fused tier ran (the others cannot tell one threshold from another), each with what the
  // policy may take there (the tiers measured) and the fastest time measured.
  struct Row {
    const TierTimes* times;
    TierSupport measured;
    double best = std::numeric_limits<double>::infinity();
  };
  std::vector<Row> rows;
  for (const TierTimes& row : times) {
    if (!row.ms[static_cast<size_t>(TailTier::tail_fusion)] &&
        !row.ms[static_cast<size_t>(TailTier::allreduce_overlap)] &&
        !row.ms[static_cast<size_t>(TailTier::column_parallel)]) {
      continue;
    }
    Row r{&row, {}, std::numeric_limits<double>::infinity()};
    for (size_t tier = 0; tier < row.ms.size(); ++tier) {
      if (row.ms[tier]) {
        r.best = std::min(r.best, *row.ms[tier]);
      } else {
        r.measured.refuse(static_cast<TailTier>(tier), "was not measured");
      }
    }
    rows.push_back(std::move(r));
  }
  Crossovers crossovers;
  if (rows.empty()) return crossovers;
  std::vector<int64_t> candidates = {0};
  for (const Row& row : rows) candidates.push_back(row.times->num_tokens);

  // What the policy (select_tail_tier, over the tiers measured) loses at one row: its time over the
  // fastest measured; infinite where it would fall through to native and native was not measured.
  auto ratio = [](const Row& row, int64_t tail_fusion_max, int64_t shared_stream_max) {
    TierPolicy policy;
    policy.tail_fusion_max_tokens = tail_fusion_max;
    policy.shared_stream_token_threshold = shared_stream_max;
    const TailTier pick = select_tail_tier(policy, row.measured, row.times->num_tokens);
    const auto& chosen = row.times->ms[static_cast<size_t>(pick)];
    if (!chosen) return std::numeric_limits<double>::infinity();
    return row.best > 0.0 ? *chosen / row.best : (*chosen > 0.0 ? std::numeric_limits<double>::infinity() : 1.0);
  };
  // Worst ratios within kNoise of each other count as equal (a median of a few runs moves by that much),
  // and the sum decides: otherwise a 0.01% difference at one T would outweigh a percent at every other.
  constexpr double kNoise = 0.01;
  struct Score {
    double worst = 0.0, sum = 0.0;
    bool operator<(const Score& other) const {
      if (worst < other.worst - kNoise) return true;
      if (worst > other.worst + kNoise) return false;
      return sum < other.sum;
    }
  };
  auto score = [&](int64_t tail_fusion_max, int64_t shared_stream_max) {
    Score s;
    for (const Row& row : rows) {
      const double r = ratio(row, tail_fusion_max, shared_stream_max);
      s.worst = std::max(s.worst, r);
      s.sum += r;
    }
    return s;
  };
  // Candidates from the largest down, taking only a strictly better score: a tie keeps the larger.
  auto best_of = [&](auto&& score_of) {
    int64_t chosen = candidates.back();
    Score best = score_of(chosen);
    for (auto it = candidates.rbegin() + 1; it != candidates.rend(); ++it) {
      const Score s = score_of(*it);
      if (s < best) {
        best = s;
        chosen = *it;
      }
    }
    return chosen;
  };
  crossovers.shared_stream_token_threshold = best_of([&](int64_t sst) { return score(0, sst); });
  crossovers.tail_fusion_max_tokens =
      best_of([&](int64_t tf) { return score(tf, crossovers.shared_stream_token_threshold); });
  return crossovers;
}

namespace detail {

std::vector<TuneTable> read_builtin_tune_tables(std::span<const BuiltinTuneFile> files) {
  std::vector<TuneTable> tables;  // one per device: the entries of all its files
  for (const BuiltinTuneFile& file : files) {
    TuneTable table = TuneTable::from_json(file.text, file.name);
    LATENTMOE_CHECK(!table.device.empty(), file.name,
                    ": a built-in tune table must name its \"device\" (measured on GPUs of their own)");
    auto same_device = std::find_if(tables.begin(), tables.end(),
                                    [&](const TuneTable& earlier) { return earlier.device == table.device; });
    if (same_device == tables.end()) {
      tables.push_back(std::move(table));
      continue;
    }
    for (size_t i = 0; i < table.entries.size(); ++i) {
      for (const TuneEntry& earlier : same_device->entries) {
        LATENTMOE_CHECK(!same_key(earlier, table.entries[i]), file.name, ": entries[", i,
                        "] repeats the tp, dtype and shapes of an entry of another table for device '", table.device,
                        "'");
      }
    }
    same_device->entries.insert(same_device->entries.end(), table.entries.begin(), table.entries.end());
  }
  return tables;
}

TierPolicy tuned_policy_over(const std::vector<TuneTable>& builtin, const std::string& table_path, int tp_size,
                             DType dtype, int64_t hidden_size, int64_t latent_size, std::string_view device) {
  TierPolicy base;
  auto take = [&](const TuneTable& table) {
    if (const auto entry = table.find(tp_size, dtype, hidden_size, latent_size)) {
      base.tail_fusion_max_tokens = entry->tail_fusion_max_tokens;
      base.shared_stream_token_threshold = entry->shared_stream_token_threshold;
    }
  };
  if (!device.empty()) {
    for (const TuneTable& table : builtin) {
      if (table.device == device) take(table);
    }
  }
  const std::string path = !table_path.empty() ? table_path : read_path(Setting::tune_file).value_or("");
  if (!path.empty()) take(TuneTable::from_file(path));
  return TierPolicy::from_lookup(environment_value, base);
}

}  // namespace detail

const std::vector<TuneTable>& builtin_tune_tables() {
  static const std::vector<TuneTable> tables = detail::read_builtin_tune_tables(detail::builtin_tune_files());
  return tables;
}

TierPolicy tuned_policy(const std::string& table_path, int tp_size, DType dtype, int64_t hidden_size,
                        int64_t latent_size, std::string_view device) {
  static const std::vector<TuneTable> none;  // no device: the built-in tables are not even read
  return detail::tuned_policy_over(device.empty() ? none : builtin_tune_tables(), table_path, tp_size, dtype,
                                   hidden_size, latent_size, device);
}

}  // namespace latentmoe

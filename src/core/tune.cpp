// The tuned crossover table (latentmoe/tune.h): reading, matching, and the policy a runner takes.
#include "latentmoe/tune.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "latentmoe/error.h"

namespace latentmoe {
namespace {

using nlohmann::json;

constexpr std::string_view kFormat = "latentmoe-tune-1";

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
  std::error_code ec;
  LATENTMOE_CHECK(std::filesystem::is_regular_file(path, ec), path, ": cannot read the tune table: ",
                  std::filesystem::exists(path, ec) ? "not a regular file" : "no such file");
  std::ifstream in(path, std::ios::binary);
  if (!in) detail::throw_error(path, ": cannot read the tune table: ", std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  return from_json(text.str(), path);
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

TierPolicy tuned_policy(const std::string& table_path, int tp_size, DType dtype, int64_t hidden_size,
                        int64_t latent_size) {
  std::string path = table_path;
  if (path.empty()) {
    const char* value = std::getenv("LATENTMOE_TUNE_FILE");
    if (value != nullptr) path = value;
  }
  TierPolicy base;
  if (!path.empty()) {
    if (const auto entry = TuneTable::from_file(path).find(tp_size, dtype, hidden_size, latent_size)) {
      base.tail_fusion_max_tokens = entry->tail_fusion_max_tokens;
      base.shared_stream_token_threshold = entry->shared_stream_token_threshold;
    }
  }
  return TierPolicy::from_lookup(
      [](std::string_view name) -> std::optional<std::string> {
        const char* value = std::getenv(std::string(name).c_str());
        if (value == nullptr) return std::nullopt;
        return std::string(value);
      },
      base);
}

}  // namespace latentmoe

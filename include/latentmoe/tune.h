// A table of tier crossovers measured on one machine, which the policy takes instead of its
// constant defaults (DESIGN section 2: thresholds measured per machine, not fixed).
//
// Format (JSON):
//   {"format": "latentmoe-tune-1",
//    "machine": "8x NVIDIA H200, NVLink",                   (free text, reported)
//    "entries": [{"tp": 8, "dtype": "bf16",                 (dtype optional: any)
//                 "hidden_size": 7168, "latent_size": 3584, (optional: any shape)
//                 "tail_fusion_max_tokens": 64, "shared_stream_token_threshold": 256}, ...]}
// For a layer, the entry with the same tp that also matches the most of dtype and shapes wins; two
// entries that match equally are an error when the table is read. Knobs set by the LATENTMOE_*
// variables still override the table (defaults < table < environment).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "latentmoe/dtype.h"
#include "latentmoe/tier.h"

namespace latentmoe {

struct TuneEntry {
  int tp_size = 1;
  std::optional<DType> dtype;
  std::optional<int64_t> hidden_size;
  std::optional<int64_t> latent_size;
  int64_t tail_fusion_max_tokens = TierPolicy::kDefaultTailFusionMaxTokens;
  int64_t shared_stream_token_threshold = TierPolicy::kDefaultSharedStreamTokenThreshold;
};

struct TuneTable {
  std::string machine;
  std::vector<TuneEntry> entries;

  // Throws Error naming the file (or `origin`) and the offending entry or key.
  static TuneTable from_file(const std::string& path);
  static TuneTable from_json(std::string_view text, std::string_view origin);

  // The most specific entry for a layer, or nullopt when none has this tp (and matching fields).
  std::optional<TuneEntry> find(int tp_size, DType dtype, int64_t hidden_size, int64_t latent_size) const;
};

// The policy a runner of this layout takes: the defaults, then the table's entry for it (when a table
// is given and has one), then the LATENTMOE_* variables. `table_path` empty: LATENTMOE_TUNE_FILE, if
// set, names the table.
TierPolicy tuned_policy(const std::string& table_path, int tp_size, DType dtype, int64_t hidden_size,
                        int64_t latent_size);

}  // namespace latentmoe

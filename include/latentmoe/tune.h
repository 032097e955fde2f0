// A table of tier crossovers measured on one machine, which the policy takes instead of its
// constant defaults (DESIGN section 2: thresholds measured per machine, not fixed).
//
// Format (JSON):
//   {"format": "latentmoe-tune-1",
//    "machine": "8x NVIDIA H200, NVLink",                   (free text, reported)
//    "device": "NVIDIA H200",                               (optional: see TuneTable::device)
//    "entries": [{"tp": 8, "dtype": "bf16",                 (dtype optional: any)
//                 "hidden_size": 7168, "latent_size": 3584, (optional: any shape)
//                 "tail_fusion_max_tokens": 64, "shared_stream_token_threshold": 256}, ...]}
// For a layer, the entry with the same tp that also matches the most of dtype and shapes wins; two
// entries that match equally are an error when the table is read. Knobs set by the LATENTMOE_*
// variables still override the table (defaults < built-in table < table < environment).
//
// Built-in tables: the tables under tune/ in the source tree, measured by `latentmoe tune` on lent
// machines and compiled into the library, are the defaults for ranks on GPUs of their own whose device
// name is the table's "device" (tuned_policy's `device`).
#pragma once

#include <array>
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
  // The CUDA device (its cudaDeviceProp::name, e.g. "NVIDIA H200") on which every entry's ranks ran,
  // one GPU per rank; empty where they ran as threads or simulated on one GPU. `latentmoe tune` sets it
  // only when every tp it measured had GPUs of its own. A built-in table must have one.
  std::string device;
  std::vector<TuneEntry> entries;

  // Throws Error naming the file (or `origin`) and the offending entry or key.
  static TuneTable from_file(const std::string& path);
  static TuneTable from_json(std::string_view text, std::string_view origin);

  // The most specific entry for a layer, or nullopt when none has this tp (and matching fields).
  std::optional<TuneEntry> find(int tp_size, DType dtype, int64_t hidden_size, int64_t latent_size) const;

  // The table in the format above (from_json reads it back to an equal table).
  std::string to_json() const;
  // Writes to_json() to `path` atomically (a temporary file in the same directory renamed into
  // place: a failure leaves no file); refuses to replace anything but a regular file.
  void write_file(const std::string& path) const;
};

// One measured token count of `latentmoe tune`: each tier's time (the median of its repeats), or
// nullopt where the tier does not run at this token count (not supported, not measured).
struct TierTimes {
  int64_t num_tokens = 0;
  std::array<std::optional<double>, 4> ms;  // indexed by TailTier
};

// The policy's two thresholds as the measured times say. The policy at T is select_tail_tier's
// (tier.cpp): tail_fusion for T <= tail_fusion_max_tokens, else allreduce_overlap for T <=
// shared_stream_token_threshold, else column_parallel, each only where it runs (was measured), falling
// through to the next (native last). A choice of the two thresholds is scored by what the policy would
// lose against the fastest tier measured at each T (native included): the worst ratio over the measured
// T, then (where two worst ratios are within 1%, the noise of a median) the sum of the ratios; the
// lowest score wins. Each threshold is one of 0 and the measured
// token counts, so nothing is extrapolated past the largest measured T.
//   shared_stream_token_threshold first, as if tier 0 were off (it is, past its capacity, for
//     layouts without it, or with LATENTMOE_DISABLE_TAIL_FUSION);
//   then tail_fusion_max_tokens with that threshold; 0 turns tier 0 off.
// A tie goes to the larger threshold (the tier the policy tries first). So one noisy point costs what
// it measured, instead of ending a run of wins as a "wins from the smallest T on" rule would. T where
// no fused tier ran do not count; with none left both thresholds are 0.
// Throws Error for an empty list, token counts that are not >= 1 and strictly increasing, or a time
// that is negative or not finite.
struct Crossovers {
  int64_t tail_fusion_max_tokens = 0;
  int64_t shared_stream_token_threshold = 0;
};
Crossovers derive_crossovers(const std::vector<TierTimes>& times);

// The built-in tables (tune/*.json, compiled in), read on the first call: one per device, holding the
// entries of every file that names it. Throws Error naming the file if one is malformed, has no device or
// repeats an entry of another file of its device (a test reads them all).
const std::vector<TuneTable>& builtin_tune_tables();

// The policy a runner of this layout takes: the defaults; then, where `device` names the GPUs its
// ranks run on, one GPU per rank (empty: ranks as threads or simulated on one GPU), the built-in table
// of that device's entry for the layout; then the entry of the table at `table_path` (empty:
// LATENTMOE_TUNE_FILE, if set, names it); then the LATENTMOE_* variables. Each step keeps what the one
// before set where it has no entry or no variable.
TierPolicy tuned_policy(const std::string& table_path, int tp_size, DType dtype, int64_t hidden_size,
                        int64_t latent_size, std::string_view device = {});

}  // namespace latentmoe

// The one registry of the environment variables latentmoe reads: each is declared once in kSettings
// (name, type and accepted values, what unset means, meaning, when it is read), parsed by one function per
// type with one style of error (`NAME='value' is ...; expected ...`), and read through read_integer /
// read_boolean / read_path, whose environment lookup (settings.cpp) holds the only getenv of src/ and
// include/. The library sets no variable (tests/test_settings.cpp fails on any getenv, setenv or putenv
// elsewhere).
//
// When: each variable is read when the object that uses it is made (a tier policy, a GPU group, a
// backend), never on a forward: an engine calls forward from anywhere (a torch custom op, a captured
// graph) and must not pay for, or be surprised by, the environment there. The object keeps what it read.
//
// docs/CONFIG.md, "Environment variables", is settings_markdown()'s table: tests/test_settings.cpp fails
// when the two differ, prints the table, and writes it into the file with LATENTMOE_REGENERATE_DOCS=1.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "latentmoe/gpu_group.h"
#include "latentmoe/tier.h"

namespace latentmoe::detail {

enum class Setting {
  tail_fusion_max_tokens,
  shared_stream_token_threshold,
  disable_shared_stream,
  disable_tail_fusion,
  tune_file,
  collective_timeout_ms,
  one_shot_max_tokens,
  mxfp4_gate_up_split,
  mxfp4_decode_max_tokens,
  mxfp4_pairs_max_tokens,
  cuda_device_max_connections,
  nccl_nvls_enable,
  cuda_module_loading,
};

// integer: decimal digits only (no sign, space, fraction or trailing text), within [min, max] (and one of
// `values` where given). boolean: 0/1, true/false, yes/no, on/off, any case. path: any text.
enum class SettingType { integer, boolean, path };

struct SettingSpec {
  Setting id{};
  std::string_view name{};
  SettingType type{};
  int64_t min = 0;  // integer: the accepted range
  int64_t max = std::numeric_limits<int64_t>::max();
  std::span<const int64_t> values{};  // integer: the accepted values, where not every one of [min, max] is
  std::string_view unit{};            // integer: what it counts ("tokens"), for messages and the docs
  std::optional<int64_t> fallback{};  // the value when unset (boolean: 0 or 1), where one value says it
  std::string_view unset{};           // what unset means, where `fallback` alone does not say it
  std::string_view meaning{};
  std::string_view read_when{};
};

inline constexpr int64_t kMxfp4GateUpSplits[] = {1, 2, 8};

// In the order of enum Setting (checked at compile time). Markdown cells: no '|'.
inline constexpr std::array<SettingSpec, 13> kSettings{{
    {.id = Setting::tail_fusion_max_tokens,
     .name = "LATENTMOE_TAIL_FUSION_MAX_TOKENS",
     .type = SettingType::integer,
     .unit = "tokens",
     .fallback = TierPolicy::kDefaultTailFusionMaxTokens,
     .meaning = "`TierPolicy::tail_fusion_max_tokens`: tier 0 (tail_fusion) up to this many tokens; 0 turns it off",
     .read_when = "when a tier policy is made: `TierPolicy::from_environment()` (its first call, cached for the "
                  "process), `tuned_policy()` (every call: `latentmoe run`, `bench tail`)"},
    {.id = Setting::shared_stream_token_threshold,
     .name = "LATENTMOE_SHARED_STREAM_TOKEN_THRESHOLD",
     .type = SettingType::integer,
     .unit = "tokens",
     .fallback = TierPolicy::kDefaultSharedStreamTokenThreshold,
     .meaning = "`TierPolicy::shared_stream_token_threshold`: allreduce_overlap up to this many tokens, "
                "column_parallel above",
     .read_when = "as LATENTMOE_TAIL_FUSION_MAX_TOKENS"},
    {.id = Setting::disable_shared_stream,
     .name = "LATENTMOE_DISABLE_SHARED_STREAM",
     .type = SettingType::boolean,
     .fallback = 0,
     .meaning = "`TierPolicy::disable_shared_stream`: never allreduce_overlap",
     .read_when = "as LATENTMOE_TAIL_FUSION_MAX_TOKENS"},
    {.id = Setting::disable_tail_fusion,
     .name = "LATENTMOE_DISABLE_TAIL_FUSION",
     .type = SettingType::boolean,
     .fallback = 0,
     .meaning = "`TierPolicy::disable_tail_fusion`: never tail_fusion",
     .read_when = "as LATENTMOE_TAIL_FUSION_MAX_TOKENS"},
    {.id = Setting::tune_file,
     .name = "LATENTMOE_TUNE_FILE",
     .type = SettingType::path,
     .unset = "no table (`--tune-file` wins where given)",
     .meaning = "a table of tier crossovers measured by `latentmoe tune`, taken over the built-in table of the "
                "ranks' GPU",
     .read_when = "`tuned_policy()` with no table path (every call: `latentmoe run`, `bench tail`)"},
    {.id = Setting::collective_timeout_ms,
     .name = "LATENTMOE_COLLECTIVE_TIMEOUT_MS",
     .type = SettingType::integer,
     .min = 1,
     .max = 3600000,
     .unit = "milliseconds",
     .fallback = kDefaultCollectiveTimeout.count(),
     .meaning = "how long a GPU group's collective waits for its peers before it fails; a host waits for a rank's "
                "device work twice that",
     .read_when = "`default_collective_timeout()`: when the local group or `bench tail` builds a GPU group (the "
                  "group keeps it: `Communicator::timeout()`); for a communicator that states no timeout, when a "
                  "Runner is constructed (its host waits' limit)"},
    {.id = Setting::one_shot_max_tokens,
     .name = "LATENTMOE_ONE_SHOT_MAX_TOKENS",
     .type = SettingType::integer,
     .min = 1,
     .max = 1048576,
     .unit = "tokens",
     .unset = "512 (`kDefaultOneShotTokensTwoRanks`) up to two ranks, 64 (`kDefaultOneShotTokens`) above",
     .meaning = "how many tokens of a layer the one-shot collectives of ranks on GPUs of their own carry; NCCL "
                "above",
     .read_when = "`default_one_shot_tokens(tp)`: when such a group is sized (the local group, `tune`, `bench "
                  "tail`, engines)"},
    {.id = Setting::mxfp4_gate_up_split,
     .name = "LATENTMOE_MXFP4_GATE_UP_SPLIT",
     .type = SettingType::integer,
     .min = 1,
     .max = 8,
     .values = kMxfp4GateUpSplits,
     .unit = "warps per tile",
     .unset = "the rule measured per shape (docs/MXFP4.md)",
     .meaning = "forces the MXFP4 tensor-core gate/up kernel's warps per tile along K (to measure the rule; tests)",
     .read_when = "when a CUDA backend is made (each runner's or rank context's)"},
    {.id = Setting::mxfp4_decode_max_tokens,
     .name = "LATENTMOE_MXFP4_DECODE_MAX_TOKENS",
     .type = SettingType::integer,
     .min = 0,
     .max = 64,
     .unit = "tokens",
     .fallback = 8,
     .meaning = "up to how many tokens MXFP4 routed experts with bf16/f16 activations run on the decode kernels "
                "(mxfp4_decode_mma.cu; above 8 in batches of 8); above, on the grouped GEMMs (to measure the "
                "boundary; the default is `kMxfp4DecodeTokens`, measured: docs/MXFP4.md)",
     .read_when = "when a CUDA backend is made (each runner's or rank context's)"},
    {.id = Setting::mxfp4_pairs_max_tokens,
     .name = "LATENTMOE_MXFP4_PAIRS_MAX_TOKENS",
     .type = SettingType::integer,
     .min = 0,
     .max = 8,
     .unit = "tokens",
     .fallback = 0,
     .meaning = "up to how many tokens MXFP4 routed experts with bf16 activations on the decode kernels run on the "
                "pair kernels (mxfp4_pairs.cu: 16-byte loads, a pair's own tiles) instead of the tile decode kernels "
                "(mxfp4_decode_mma.cu); 0: never (the default, `kMxfp4PairsTokens`, until they are measured: "
                "docs/MXFP4.md)",
     .read_when = "when a CUDA backend is made (each runner's or rank context's)"},
    {.id = Setting::cuda_device_max_connections,
     .name = "CUDA_DEVICE_MAX_CONNECTIONS",
     .type = SettingType::integer,
     .min = 1,
     .max = 32,
     .unit = "hardware queues",
     .fallback = 8,
     .unset = "(CUDA's default)",
     .meaning = "CUDA's, checked and never set by the library: tp ranks simulated on one GPU need at least 4 tp "
                "(32 from tp 8 on), set before the process first calls CUDA (the tool and the GPU tests set 32)",
     .read_when = "when a simulated GPU group of tp > 1 is built"},
    {.id = Setting::nccl_nvls_enable,
     .name = "NCCL_NVLS_ENABLE",
     .type = SettingType::integer,
     .min = 0,
     .max = 2,
     .unset = "NCCL's default (NVLink multicast where the GPUs have it): refused",
     .meaning = "NCCL's, checked and never set by the library: an NCCL group needs 0 (NVLink multicast off: it "
                "can put GPUs shared with others out of service); the tool sets 0 for its own process where it is "
                "unset",
     .read_when = "when an NCCL group is built (`make_nccl_gpu_group`, `make_nccl_communicator`)"},
    {.id = Setting::cuda_module_loading,
     .name = "CUDA_MODULE_LOADING",
     .type = SettingType::path,
     .unset = "CUDA's default (lazy loading): refused for simulated GPU groups made through the C ABI",
     .meaning = "CUDA's (text, not a path), checked and never set by the library: ranks simulated on one GPU need "
                "EAGER, set before the process first calls CUDA (a lazily loaded kernel can wait for a peer's "
                "collective that waits for it); the tool and the GPU tests set it, the Python package at import "
                "while CUDA is not started",
     .read_when = "when the C ABI makes a simulated GPU group of tp > 1 (`lmoe_simulated_group_create`, the Python "
                  "package's `simulated_group`)"},
}};

const SettingSpec& setting_spec(Setting id);

// Any lookup of a variable's value by name (nullopt: unset); tests pass a map.
using SettingLookup = std::function<std::optional<std::string>(std::string_view)>;
// The process environment's value of a declared variable (the library's one getenv); throws Error for a
// name kSettings does not declare.
std::optional<std::string> environment_value(std::string_view name);

// The parsers, one per type: the value, or Error naming the variable, the value and what is expected.
int64_t parse_integer(const SettingSpec& spec, std::string_view text);
bool parse_boolean(const SettingSpec& spec, std::string_view text);

// The value of `id` from `lookup` (the environment without one), parsed; nullopt when unset or empty
// (an empty value counts as unset, so `LATENTMOE_X= cmd` restores the default).
std::optional<int64_t> read_integer(Setting id);
std::optional<int64_t> read_integer(Setting id, const SettingLookup& lookup);
std::optional<bool> read_boolean(Setting id);
std::optional<bool> read_boolean(Setting id, const SettingLookup& lookup);
std::optional<std::string> read_path(Setting id);
// read_integer, or the spec's fallback when unset.
int64_t integer_setting(Setting id);

// The registry as the Markdown table of docs/CONFIG.md, "Environment variables" (one row a variable,
// in kSettings' order, ending with a newline).
std::string settings_markdown();

}  // namespace latentmoe::detail

// The C ABI's shared pieces (capi_internal.h) and its library-level functions: version, build info,
// last error, config normalisation.
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>

#include "capi_internal.h"
#include "latentmoe/config.h"
#include "latentmoe/device.h"
#include "latentmoe/tune.h"

namespace latentmoe::capi {
namespace {

thread_local std::string last_error;

}  // namespace

void set_last_error(const char* message) { last_error = message == nullptr ? "" : message; }
const char* last_error_text() { return last_error.c_str(); }

void require(const void* pointer, const char* what) {
  if (pointer == nullptr) throw InvalidArgument(std::string(what) + " is NULL");
}

void require_struct(uint32_t size, size_t expected, const char* what) {
  if (size < expected) {
    throw InvalidArgument(std::string(what) + ".struct_size is " + std::to_string(size) + " but this library's " +
                          what + " has " + std::to_string(expected) + " bytes (set it to sizeof(" + what +
                          ") of latentmoe/c_api.h, ABI version " + std::to_string(LMOE_ABI_VERSION) + ")");
  }
}

DType dtype_from_code(int32_t code, const char* what) {
  switch (code) {
    case LMOE_DTYPE_F32:
      return DType::f32;
    case LMOE_DTYPE_BF16:
      return DType::bf16;
    case LMOE_DTYPE_F16:
      return DType::f16;
    case LMOE_DTYPE_I32:
      return DType::i32;
    case LMOE_DTYPE_U8:
      return DType::u8;
    default:
      throw InvalidArgument(std::string(what) + ": unknown dtype code " + std::to_string(code));
  }
}

int32_t dtype_code(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return LMOE_DTYPE_F32;
    case DType::bf16:
      return LMOE_DTYPE_BF16;
    case DType::f16:
      return LMOE_DTYPE_F16;
    case DType::i32:
      return LMOE_DTYPE_I32;
    case DType::u8:
      return LMOE_DTYPE_U8;
    default:
      return -2;
  }
}

std::optional<TailTier> tier_from_code(int32_t code) {
  if (code == LMOE_TIER_AUTO) return std::nullopt;
  if (code < 0 || code >= static_cast<int32_t>(kAllTailTiers.size())) {
    throw InvalidArgument("unknown tier code " + std::to_string(code) +
                          " (expected -1 for auto, 0 native, 1 tail_fusion, 2 allreduce_overlap, 3 column_parallel)");
  }
  return kAllTailTiers[static_cast<size_t>(code)];
}

int32_t tier_code(TailTier tier) { return static_cast<int32_t>(tier); }

std::string describe(const Placement& placement) {
  return placement.device == Device::cpu ? std::string("cpu") : "cuda:" + std::to_string(placement.index);
}

TensorView view_of(const lmoe_tensor* tensor, const char* what, const Placement& context, bool host_allowed) {
  if (tensor == nullptr || tensor->ndim == 0) return {};
  const lmoe_tensor& t = *tensor;
  if (t.ndim < 0 || t.ndim > TensorView::kMaxRank) {
    throw InvalidArgument(std::string(what) + " has " + std::to_string(t.ndim) + " dimensions (at most " +
                          std::to_string(TensorView::kMaxRank) + ")");
  }
  const DType dtype = dtype_from_code(t.dtype, what);
  Placement placement;
  if (t.device_type == LMOE_DEVICE_CPU) {
    placement.device = Device::cpu;
  } else if (t.device_type == LMOE_DEVICE_CUDA) {
    placement.device = Device::cuda;
    placement.index = t.device_index;
  } else {
    throw InvalidArgument(std::string(what) + ": unknown device type code " + std::to_string(t.device_type));
  }
  const bool on_context = placement.device == context.device && placement.index == context.index;
  if (!on_context && !(host_allowed && placement.device == Device::cpu)) {
    throw InvalidArgument(std::string(what) + " is on " + describe(placement) + " but the rank context is on " +
                          describe(context));
  }
  std::vector<int64_t> shape(t.shape, t.shape + t.ndim);
  int64_t numel = 1;
  for (int64_t extent : shape) {
    if (extent < 0) throw InvalidArgument(std::string(what) + " has a negative extent: " + shape_string(shape));
    numel *= extent;
  }
  // Row-major contiguity as PyTorch defines it: the stride of a dimension of extent 1 does not matter.
  int64_t expected = 1;
  bool contiguous = true;
  for (int dim = t.ndim - 1; dim >= 0; --dim) {
    if (shape[dim] != 1 && t.strides[dim] != expected) contiguous = false;
    expected *= shape[dim];
  }
  if (!contiguous && numel > 0) {
    throw InvalidArgument(std::string(what) + " must be contiguous (shape " + shape_string(shape) + ", strides " +
                          shape_string(std::vector<int64_t>(t.strides, t.strides + t.ndim)) + ")");
  }
  return TensorView(t.data, dtype, shape, placement.device);
}

void write_text(const std::string& text, char* out, size_t out_size, size_t* needed) {
  require(needed, "needed");
  *needed = text.size() + 1;
  if (out != nullptr && out_size >= text.size() + 1) {
    std::memcpy(out, text.c_str(), text.size() + 1);
  }
}

TierPolicy policy_for(const lmoe_tier_policy* policy, int tp, DType dtype, int64_t hidden_size, int64_t latent_size,
                      const std::string& device_name) {
  TierPolicy result = tuned_policy("", tp, dtype, hidden_size, latent_size, device_name);
  if (policy == nullptr) return result;
  require_struct(policy->struct_size, sizeof(lmoe_tier_policy), "lmoe_tier_policy");
  auto flag = [](int32_t value, const char* name) {
    if (value > 1) throw InvalidArgument(std::string("lmoe_tier_policy.") + name + " must be 0, 1 or < 0 (default)");
    return value == 1;
  };
  if (policy->tail_fusion_max_tokens >= 0) result.tail_fusion_max_tokens = policy->tail_fusion_max_tokens;
  if (policy->shared_stream_token_threshold >= 0) {
    result.shared_stream_token_threshold = policy->shared_stream_token_threshold;
  }
  if (policy->disable_shared_stream >= 0) {
    result.disable_shared_stream = flag(policy->disable_shared_stream, "disable_shared_stream");
  }
  if (policy->disable_tail_fusion >= 0) {
    result.disable_tail_fusion = flag(policy->disable_tail_fusion, "disable_tail_fusion");
  }
  return result;
}

std::string describe_tiers(const TierSupport& support) {
  nlohmann::json out = nlohmann::json::object();
  for (TailTier tier : kAllTailTiers) {
    const TierLimit& limit = support[tier];
    nlohmann::json entry = {{"supported", limit.supported}, {"reason", limit.reason}};
    entry["max_tokens"] =
        limit.max_tokens == TierLimit::kUnbounded ? nlohmann::json(nullptr) : nlohmann::json(limit.max_tokens);
    out[std::string(to_string(tier))] = entry;
  }
  out["peers_reachable"] = support.peers_reachable;
  out["collectives"] = support.collectives;
  return out.dump();
}

}  // namespace latentmoe::capi

using namespace latentmoe;
using namespace latentmoe::capi;

extern "C" {

int32_t lmoe_abi_version(void) { return LMOE_ABI_VERSION; }

const char* lmoe_version(void) { return LATENTMOE_VERSION; }

const char* lmoe_last_error(void) { return last_error_text(); }

int lmoe_get_build_info(lmoe_build_info* info) {
  return guarded([&] {
    require(info, "info");
    require_struct(info->struct_size, sizeof(lmoe_build_info), "lmoe_build_info");
#ifdef LATENTMOE_WITH_CUDA
    info->has_cuda = 1;
#else
    info->has_cuda = 0;
#endif
#ifdef LATENTMOE_WITH_NCCL
    info->has_nccl = 1;
    info->nccl_version_code = built_nccl_version_code();
#else
    info->has_nccl = 0;
    info->nccl_version_code = 0;
#endif
    info->cuda_device_count = cuda_device_count();
  });
}

int lmoe_config_normalize(const char* config_json, char* out, size_t out_size, size_t* needed) {
  return guarded([&] {
    require(config_json, "config_json");
    const LayerConfig config = as_invalid_argument([&] { return LayerConfig::from_json(config_json, "config"); });
    write_text(config.to_json(), out, out_size, needed);
  });
}

int lmoe_config_check_parallel(const char* config_json, int32_t tp) {
  return guarded([&] {
    require(config_json, "config_json");
    as_invalid_argument([&] {
      const LayerConfig config = LayerConfig::from_json(config_json, "config");
      validate_parallel(config, ParallelConfig{tp, 0, false});
    });
  });
}

}  // extern "C"

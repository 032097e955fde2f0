#include "latentmoe/weights.h"

#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "latentmoe/error.h"
#include "latentmoe/random.h"

namespace latentmoe {
namespace {

// Converts `count` elements of a compute dtype; the source may be unaligned (it points into a
// mapped file), so elements are loaded with memcpy.
template <class Load>
void store_all(Load load, void* dst, DType dst_dtype, int64_t count) {
  switch (dst_dtype) {
    case DType::f32: {
      auto* out = static_cast<float*>(dst);
      for (int64_t i = 0; i < count; ++i) out[i] = load(i);
      break;
    }
    case DType::bf16: {
      auto* out = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < count; ++i) out[i] = float_to_bf16(load(i));
      break;
    }
    case DType::f16: {
      auto* out = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < count; ++i) out[i] = float_to_f16(load(i));
      break;
    }
    default:
      detail::throw_error("cannot convert to ", dtype_name(dst_dtype));
  }
}

void convert_elements(const std::byte* src, DType src_dtype, void* dst, DType dst_dtype, int64_t count) {
  if (count == 0) return;
  if (src_dtype == dst_dtype) {
    std::memcpy(dst, src, static_cast<size_t>(count) * dtype_size(src_dtype));
    return;
  }
  switch (src_dtype) {
    case DType::f32:
      store_all(
          [src](int64_t i) {
            float value;
            std::memcpy(&value, src + 4 * i, 4);
            return value;
          },
          dst, dst_dtype, count);
      break;
    case DType::bf16:
      store_all(
          [src](int64_t i) {
            uint16_t bits;
            std::memcpy(&bits, src + 2 * i, 2);
            return bf16_to_float(bits);
          },
          dst, dst_dtype, count);
      break;
    case DType::f16:
      store_all(
          [src](int64_t i) {
            uint16_t bits;
            std::memcpy(&bits, src + 2 * i, 2);
            return f16_to_float(bits);
          },
          dst, dst_dtype, count);
      break;
    default:
      detail::throw_error("cannot convert from ", dtype_name(src_dtype));
  }
}

std::byte* byte_pointer(const HostTensor& tensor, int64_t element_offset) {
  return static_cast<std::byte*>(tensor.data()) + element_offset * static_cast<int64_t>(dtype_size(tensor.dtype()));
}

// Slices of a row-major [rows, cols] matrix into a contiguous destination (same dtype: byte copies).
void copy_row_block(const HostTensor& src, int64_t src_offset, int64_t cols, int64_t row_begin, int64_t row_end,
                    const HostTensor& dst, int64_t dst_offset) {
  const size_t element = dtype_size(src.dtype());
  std::memcpy(byte_pointer(dst, dst_offset), byte_pointer(src, src_offset + row_begin * cols),
              static_cast<size_t>((row_end - row_begin) * cols) * element);
}

void copy_col_block(const HostTensor& src, int64_t src_offset, int64_t rows, int64_t cols, int64_t col_begin,
                    int64_t col_end, const HostTensor& dst, int64_t dst_offset) {
  const size_t element = dtype_size(src.dtype());
  const int64_t width = col_end - col_begin;
  for (int64_t row = 0; row < rows; ++row) {
    std::memcpy(byte_pointer(dst, dst_offset + row * width), byte_pointer(src, src_offset + row * cols + col_begin),
                static_cast<size_t>(width) * element);
  }
}

HostTensor clone(const HostTensor& tensor) {
  if (!tensor.defined()) return {};
  return to_host_tensor(tensor.view(), tensor.dtype());
}

// --- loading ----------------------------------------------------------------------------------

class Loader {
 public:
  Loader(const SafetensorsFile& file, std::string_view prefix) : file_(file), prefix_(prefix) {}

  // The entry under `name` (or its alias), checked against `shape`; nullptr when absent and optional.
  const SafetensorsEntry* find(const std::string& name, const std::vector<int64_t>& shape, bool required,
                               const std::string& alias = "") const {
    const std::string full_name = prefix_ + name;
    const SafetensorsEntry* entry = file_.find(full_name);
    std::string found_name = full_name;
    if (!alias.empty()) {
      const SafetensorsEntry* alias_entry = file_.find(prefix_ + alias);
      LATENTMOE_CHECK(entry == nullptr || alias_entry == nullptr, file_.path(), ": both ", full_name, " and ",
                      prefix_ + alias, " are present; keep one");
      if (alias_entry != nullptr) {
        entry = alias_entry;
        found_name = prefix_ + alias;
      }
    }
    if (entry == nullptr) {
      LATENTMOE_CHECK(!required, file_.path(), ": missing tensor ", full_name,
                      alias.empty() ? "" : " (or " + prefix_ + alias + ")", " (expected shape ", shape_string(shape),
                      ")");
      return nullptr;
    }
    LATENTMOE_CHECK(is_compute_dtype(entry->dtype), file_.path(), ": tensor ", found_name, " has dtype ",
                    dtype_name(entry->dtype), "; weights must be F32, BF16 or F16");
    LATENTMOE_CHECK(entry->shape == shape, file_.path(), ": tensor ", found_name, " has shape ",
                    shape_string(entry->shape), ", expected ", shape_string(shape));
    return entry;
  }

  // Rows [row_begin, row_end) of a 2-d entry, converted, into `dst` at element `dst_offset`.
  void copy_rows(const SafetensorsEntry& entry, int64_t row_begin, int64_t row_end, const HostTensor& dst,
                 int64_t dst_offset) const {
    const int64_t cols = entry.shape.size() == 2 ? entry.shape[1] : 1;
    const std::byte* src = file_.bytes(entry) + row_begin * cols * static_cast<int64_t>(dtype_size(entry.dtype));
    convert_elements(src, entry.dtype, byte_pointer(dst, dst_offset), dst.dtype(), (row_end - row_begin) * cols);
  }

  // Columns [col_begin, col_end) of every row of a 2-d entry, into `dst` at element `dst_offset`.
  void copy_cols(const SafetensorsEntry& entry, int64_t col_begin, int64_t col_end, const HostTensor& dst,
                 int64_t dst_offset) const {
    const int64_t rows = entry.shape[0], cols = entry.shape[1], width = col_end - col_begin;
    const int64_t element = static_cast<int64_t>(dtype_size(entry.dtype));
    const std::byte* base = file_.bytes(entry);
    for (int64_t row = 0; row < rows; ++row) {
      convert_elements(base + (row * cols + col_begin) * element, entry.dtype,
                       byte_pointer(dst, dst_offset + row * width), dst.dtype(), width);
    }
  }

  // A whole entry (already checked by find), converted to `dtype`; undefined when absent.
  HostTensor load_whole(const SafetensorsEntry* entry, DType dtype) const {
    if (entry == nullptr) return {};
    HostTensor result(dtype, entry->shape);
    convert_elements(file_.bytes(*entry), entry->dtype, result.data(), dtype, result.numel());
    return result;
  }

 private:
  const SafetensorsFile& file_;
  std::string prefix_;
};

std::string expert_name(int64_t expert, const char* projection) {
  return "experts." + std::to_string(expert) + "." + projection + ".weight";
}

// --- validation -------------------------------------------------------------------------------

enum class Presence { required, optional, absent };

void check_field(const char* field, const TensorView& tensor, Presence presence, const char* absent_reason, DType dtype,
                 const std::vector<int64_t>& shape) {
  if (!tensor.defined()) {
    LATENTMOE_CHECK(presence != Presence::required, "layer weights: ", field, " is missing (expected ",
                    dtype_name(dtype), " ", shape_string(shape), ")");
    return;
  }
  LATENTMOE_CHECK(presence != Presence::absent, "layer weights: ", field, " is present but ", absent_reason);
  LATENTMOE_CHECK(tensor.dtype() == dtype, "layer weights: ", field, " has dtype ", dtype_name(tensor.dtype()),
                  ", expected ", dtype_name(dtype));
  LATENTMOE_CHECK(tensor.shape() == shape, "layer weights: ", field, " has shape ", shape_string(tensor.shape()),
                  ", expected ", shape_string(shape));
  LATENTMOE_CHECK(tensor.is_contiguous(), "layer weights: ", field, " must be contiguous");
  LATENTMOE_CHECK(tensor.data() != nullptr || tensor.numel() == 0, "layer weights: ", field, " has no data");
}

// --- random weights ---------------------------------------------------------------------------

// One independent stream per field, so that e.g. with_gate does not shift the other fields' values.
uint64_t field_seed(uint64_t seed, uint64_t field) {
  return SplitMix64(seed ^ (0xd1b54a32d192ed03ull * (field + 1))).next();
}

HostTensor random_tensor(uint64_t seed, uint64_t field, DType dtype, std::vector<int64_t> shape, float scale,
                         float offset) {
  return random_uniform_tensor(dtype, std::move(shape), field_seed(seed, field), scale, offset);
}

float inverse_sqrt(int64_t fan_in) { return 1.0f / std::sqrt(static_cast<float>(fan_in)); }

}  // namespace

LayerWeightViews views_of(const LayerWeights& weights) {
  auto view = [](const HostTensor& tensor) { return tensor.defined() ? tensor.view() : TensorView(); };
  LayerWeightViews views;
  views.dtype = weights.dtype;
  views.gate = view(weights.gate);
  views.score_bias = view(weights.score_bias);
  views.down_proj = view(weights.down_proj);
  views.latent_norm = view(weights.latent_norm);
  views.up_proj = view(weights.up_proj);
  views.expert_gate = view(weights.expert_gate);
  views.expert_up = view(weights.expert_up);
  views.expert_down = view(weights.expert_down);
  views.shared_gate = view(weights.shared_gate);
  views.shared_up = view(weights.shared_up);
  views.shared_down = view(weights.shared_down);
  return views;
}

void validate_layer_weights(const LayerWeights& weights, const LayerConfig& config, int tp_size) {
  validate_layer_weights(views_of(weights), config, tp_size);
}

void validate_layer_weights(const LayerWeightViews& weights, const LayerConfig& config, int tp_size) {
  LATENTMOE_CHECK(tp_size >= 1, "layer weights: tp size ", tp_size, " is not positive");
  LATENTMOE_CHECK(config.intermediate_size % tp_size == 0, "layer weights: tp size ", tp_size,
                  " does not divide moe_intermediate_size ", config.intermediate_size);
  LATENTMOE_CHECK(config.shared_intermediate_size % tp_size == 0, "layer weights: tp size ", tp_size,
                  " does not divide shared_expert_intermediate_size ", config.shared_intermediate_size);
  LATENTMOE_CHECK(is_compute_dtype(weights.dtype), "layer weights: dtype ", dtype_name(weights.dtype),
                  " is not a compute dtype (F32, BF16, F16)");
  const int64_t d = config.hidden_size, l = config.latent_size, num_experts = config.num_experts;
  const int64_t rank_i = config.intermediate_size / tp_size, rank_is = config.shared_intermediate_size / tp_size;
  const DType dt = weights.dtype;
  const bool gated = config.is_gated(), shared = config.has_shared_expert();
  const Presence if_gated = gated ? Presence::required : Presence::absent;
  const Presence if_shared = shared ? Presence::required : Presence::absent;
  const Presence if_shared_gated = shared && gated ? Presence::required : Presence::absent;

  check_field("gate", weights.gate, Presence::optional, "", DType::f32, {config.num_router_outputs(), d});
  check_field("score_bias", weights.score_bias, Presence::optional, "", DType::f32, {config.num_router_outputs()});
  check_field("down_proj", weights.down_proj, Presence::required, "", dt, {l, d});
  check_field("latent_norm", weights.latent_norm, config.use_latent_norm ? Presence::required : Presence::absent,
              "latent_moe_use_norm is false", DType::f32, {l});
  check_field("up_proj", weights.up_proj, Presence::required, "", dt, {d, l});
  check_field("expert_gate", weights.expert_gate, if_gated, "the activation is not gated", dt,
              {num_experts, rank_i, l});
  check_field("expert_up", weights.expert_up, Presence::required, "", dt, {num_experts, rank_i, l});
  check_field("expert_down", weights.expert_down, Presence::required, "", dt, {num_experts, l, rank_i});
  check_field("shared_gate", weights.shared_gate, if_shared_gated,
              shared ? "the activation is not gated" : "the layer has no shared expert", dt, {rank_is, d});
  check_field("shared_up", weights.shared_up, if_shared, "the layer has no shared expert", dt, {rank_is, d});
  check_field("shared_down", weights.shared_down, if_shared, "the layer has no shared expert", dt, {d, rank_is});
}

LayerWeights load_layer_weights(const SafetensorsFile& file, const LayerConfig& config, std::string_view prefix,
                                const ParallelConfig& parallel, DType dtype) {
  validate_parallel(config, parallel);
  LATENTMOE_CHECK(is_compute_dtype(dtype), file.path(), ": cannot load weights as ", dtype_name(dtype),
                  "; the compute dtype must be F32, BF16 or F16");
  const int64_t d = config.hidden_size, l = config.latent_size, num_experts = config.num_experts;
  const int64_t full_i = config.intermediate_size, full_is = config.shared_intermediate_size;
  const int64_t rank_i = full_i / parallel.tp_size, rank_is = full_is / parallel.tp_size;
  const int64_t i_begin = parallel.rank * rank_i, is_begin = parallel.rank * rank_is;
  const Loader loader(file, prefix);

  // Every tensor's presence, dtype and shape is checked against the file's header before any
  // output is allocated: a config whose sizes disagree with the file (E or I far too large, say)
  // must fail with the shape message, not first allocate and fill gigabytes of expert buffers.
  const bool gated = config.is_gated(), shared = config.has_shared_expert();
  const SafetensorsEntry* gate = loader.find("gate.weight", {config.num_router_outputs(), d}, false);
  const SafetensorsEntry* score_bias =
      loader.find("gate.e_score_correction_bias", {config.num_router_outputs()}, false);
  const SafetensorsEntry* down_proj =
      loader.find("routed_expert_down_proj.weight", {l, d}, true, "fc1_latent_proj.weight");
  const SafetensorsEntry* latent_norm =
      config.use_latent_norm ? loader.find("routed_expert_norm.weight", {l}, true) : nullptr;
  const SafetensorsEntry* up_proj = loader.find("routed_expert_up_proj.weight", {d, l}, true, "fc2_latent_proj.weight");
  for (int64_t e = 0; e < num_experts; ++e) {
    if (gated) loader.find(expert_name(e, "gate_proj"), {full_i, l}, true);
    loader.find(expert_name(e, "up_proj"), {full_i, l}, true);
    loader.find(expert_name(e, "down_proj"), {l, full_i}, true);
  }
  const SafetensorsEntry* shared_gate =
      shared && gated ? loader.find("shared_experts.gate_proj.weight", {full_is, d}, true) : nullptr;
  const SafetensorsEntry* shared_up =
      shared ? loader.find("shared_experts.up_proj.weight", {full_is, d}, true) : nullptr;
  const SafetensorsEntry* shared_down =
      shared ? loader.find("shared_experts.down_proj.weight", {d, full_is}, true) : nullptr;

  LayerWeights weights;
  weights.dtype = dtype;
  weights.gate = loader.load_whole(gate, DType::f32);
  weights.score_bias = loader.load_whole(score_bias, DType::f32);
  weights.down_proj = loader.load_whole(down_proj, dtype);
  weights.latent_norm = loader.load_whole(latent_norm, DType::f32);
  weights.up_proj = loader.load_whole(up_proj, dtype);

  // Stacked experts: each rank copies only its rows of gate/up and its columns of down (the
  // entries were checked above; find() returns the same ones again).
  if (gated) weights.expert_gate = HostTensor(dtype, {num_experts, rank_i, l});
  weights.expert_up = HostTensor(dtype, {num_experts, rank_i, l});
  weights.expert_down = HostTensor(dtype, {num_experts, l, rank_i});
  for (int64_t e = 0; e < num_experts; ++e) {
    if (gated) {
      const SafetensorsEntry* expert_gate = loader.find(expert_name(e, "gate_proj"), {full_i, l}, true);
      loader.copy_rows(*expert_gate, i_begin, i_begin + rank_i, weights.expert_gate, e * rank_i * l);
    }
    const SafetensorsEntry* up = loader.find(expert_name(e, "up_proj"), {full_i, l}, true);
    loader.copy_rows(*up, i_begin, i_begin + rank_i, weights.expert_up, e * rank_i * l);
    const SafetensorsEntry* down = loader.find(expert_name(e, "down_proj"), {l, full_i}, true);
    loader.copy_cols(*down, i_begin, i_begin + rank_i, weights.expert_down, e * l * rank_i);
  }

  if (shared_gate != nullptr) {
    weights.shared_gate = HostTensor(dtype, {rank_is, d});
    loader.copy_rows(*shared_gate, is_begin, is_begin + rank_is, weights.shared_gate, 0);
  }
  if (shared_up != nullptr) {
    weights.shared_up = HostTensor(dtype, {rank_is, d});
    loader.copy_rows(*shared_up, is_begin, is_begin + rank_is, weights.shared_up, 0);
    weights.shared_down = HostTensor(dtype, {d, rank_is});
    loader.copy_cols(*shared_down, is_begin, is_begin + rank_is, weights.shared_down, 0);
  }
  return weights;
}

LayerWeights shard_layer_weights(const LayerWeights& full, const LayerConfig& config, const ParallelConfig& parallel) {
  validate_parallel(config, parallel);
  validate_layer_weights(full, config, 1);
  const int64_t d = config.hidden_size, l = config.latent_size, num_experts = config.num_experts;
  const int64_t full_i = config.intermediate_size, full_is = config.shared_intermediate_size;
  const int64_t rank_i = full_i / parallel.tp_size, rank_is = full_is / parallel.tp_size;
  const int64_t i_begin = parallel.rank * rank_i, is_begin = parallel.rank * rank_is;
  const DType dtype = full.dtype;

  LayerWeights shard;
  shard.dtype = dtype;
  shard.gate = clone(full.gate);
  shard.score_bias = clone(full.score_bias);
  shard.down_proj = clone(full.down_proj);
  shard.latent_norm = clone(full.latent_norm);
  shard.up_proj = clone(full.up_proj);
  if (full.expert_gate.defined()) shard.expert_gate = HostTensor(dtype, {num_experts, rank_i, l});
  shard.expert_up = HostTensor(dtype, {num_experts, rank_i, l});
  shard.expert_down = HostTensor(dtype, {num_experts, l, rank_i});
  for (int64_t e = 0; e < num_experts; ++e) {
    if (full.expert_gate.defined()) {
      copy_row_block(full.expert_gate, e * full_i * l, l, i_begin, i_begin + rank_i, shard.expert_gate, e * rank_i * l);
    }
    copy_row_block(full.expert_up, e * full_i * l, l, i_begin, i_begin + rank_i, shard.expert_up, e * rank_i * l);
    copy_col_block(full.expert_down, e * l * full_i, l, full_i, i_begin, i_begin + rank_i, shard.expert_down,
                   e * l * rank_i);
  }
  if (full.shared_gate.defined()) {
    shard.shared_gate = HostTensor(dtype, {rank_is, d});
    copy_row_block(full.shared_gate, 0, d, is_begin, is_begin + rank_is, shard.shared_gate, 0);
  }
  if (full.shared_up.defined()) {
    shard.shared_up = HostTensor(dtype, {rank_is, d});
    copy_row_block(full.shared_up, 0, d, is_begin, is_begin + rank_is, shard.shared_up, 0);
    shard.shared_down = HostTensor(dtype, {d, rank_is});
    copy_col_block(full.shared_down, 0, d, full_is, is_begin, is_begin + rank_is, shard.shared_down, 0);
  }
  return shard;
}

void save_layer_weights(const std::string& path, const LayerWeights& full, const LayerConfig& config,
                        std::string_view prefix) {
  validate_layer_weights(full, config, 1);
  const std::string p(prefix);
  const int64_t l = config.latent_size, full_i = config.intermediate_size;
  std::vector<std::pair<std::string, TensorView>> tensors;
  auto add = [&](const std::string& name, const HostTensor& tensor) {
    if (tensor.defined()) tensors.emplace_back(p + name, tensor.view());
  };
  add("gate.weight", full.gate);
  add("gate.e_score_correction_bias", full.score_bias);
  add("routed_expert_down_proj.weight", full.down_proj);
  add("routed_expert_norm.weight", full.latent_norm);
  add("routed_expert_up_proj.weight", full.up_proj);
  for (int64_t e = 0; e < config.num_experts; ++e) {
    if (full.expert_gate.defined()) {
      tensors.emplace_back(p + expert_name(e, "gate_proj"),
                           full.expert_gate.view().slice_rows(e, e + 1).reshaped({full_i, l}));
    }
    tensors.emplace_back(p + expert_name(e, "up_proj"),
                         full.expert_up.view().slice_rows(e, e + 1).reshaped({full_i, l}));
    tensors.emplace_back(p + expert_name(e, "down_proj"),
                         full.expert_down.view().slice_rows(e, e + 1).reshaped({l, full_i}));
  }
  add("shared_experts.gate_proj.weight", full.shared_gate);
  add("shared_experts.up_proj.weight", full.shared_up);
  add("shared_experts.down_proj.weight", full.shared_down);
  write_safetensors(path, tensors, {{"format", "pt"}});
}

LayerWeights make_random_layer_weights(const LayerConfig& config, DType dtype, uint64_t seed, bool with_gate) {
  config.validate();
  LATENTMOE_CHECK(is_compute_dtype(dtype), "random weights: dtype ", dtype_name(dtype),
                  " is not a compute dtype (F32, BF16, F16)");
  const int64_t d = config.hidden_size, l = config.latent_size, num_experts = config.num_experts;
  const int64_t full_i = config.intermediate_size, full_is = config.shared_intermediate_size;

  LayerWeights weights;
  weights.dtype = dtype;
  if (with_gate)
    weights.gate = random_tensor(seed, 1, DType::f32, {config.num_router_outputs(), d}, inverse_sqrt(d), 0);
  weights.score_bias = random_tensor(seed, 2, DType::f32, {config.num_router_outputs()}, 0.1f, 0);
  weights.down_proj = random_tensor(seed, 3, dtype, {l, d}, inverse_sqrt(d), 0);
  if (config.use_latent_norm) weights.latent_norm = random_tensor(seed, 4, DType::f32, {l}, 0.25f, 1.0f);
  weights.up_proj = random_tensor(seed, 5, dtype, {d, l}, inverse_sqrt(l), 0);
  if (config.is_gated())
    weights.expert_gate = random_tensor(seed, 6, dtype, {num_experts, full_i, l}, inverse_sqrt(l), 0);
  weights.expert_up = random_tensor(seed, 7, dtype, {num_experts, full_i, l}, inverse_sqrt(l), 0);
  weights.expert_down = random_tensor(seed, 8, dtype, {num_experts, l, full_i}, inverse_sqrt(full_i), 0);
  if (config.has_shared_expert()) {
    if (config.is_gated()) weights.shared_gate = random_tensor(seed, 9, dtype, {full_is, d}, inverse_sqrt(d), 0);
    weights.shared_up = random_tensor(seed, 10, dtype, {full_is, d}, inverse_sqrt(d), 0);
    weights.shared_down = random_tensor(seed, 11, dtype, {d, full_is}, inverse_sqrt(full_is), 0);
  }
  return weights;
}

}  // namespace latentmoe

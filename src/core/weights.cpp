#include "latentmoe/weights.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "core/parallel_for.h"
#include "latentmoe/error.h"
#include "latentmoe/mxfp4.h"
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
  Loader(const Checkpoint& file, std::string_view prefix) : file_(file), prefix_(prefix) {}

  // The entry under `name` (or its alias), checked against `shape`; nullptr when absent and optional.
  // A compute dtype is required, or U8 when `packed` (MXFP4 codes and scales).
  const SafetensorsEntry* find(const std::string& name, const std::vector<int64_t>& shape, bool required,
                               const std::string& alias = "", bool packed = false) const {
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
      // The echoed names are parts of their own (each capped alone), the words around them are not.
      if (!alias.empty()) {
        LATENTMOE_CHECK(!required, file_.path(), ": missing tensor ", full_name, " (or ", prefix_ + alias,
                        ") (expected shape ", shape_string(shape), ")");
      }
      LATENTMOE_CHECK(!required, file_.path(), ": missing tensor ", full_name, " (expected shape ", shape_string(shape),
                      ")");
      return nullptr;
    }
    if (packed) {
      LATENTMOE_CHECK(entry->dtype == DType::u8, file_.file_path(*entry), ": tensor ", found_name, " has dtype ",
                      dtype_name(entry->dtype), "; MXFP4 weight_packed and weight_scale tensors must be U8");
    } else {
      LATENTMOE_CHECK(is_compute_dtype(entry->dtype), file_.file_path(*entry), ": tensor ", found_name, " has dtype ",
                      dtype_name(entry->dtype), "; weights must be F32, BF16 or F16");
    }
    LATENTMOE_CHECK(entry->shape == shape, file_.file_path(*entry), ": tensor ", found_name, " has shape ",
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

  // An MXFP4 expert tensor of the file (U8, checked by find) under `prefix + name`.
  const SafetensorsEntry* find_packed(const std::string& name, const std::vector<int64_t>& shape) const {
    return find(name, shape, true, "", /*packed=*/true);
  }

  bool has(const std::string& name) const { return file_.find(prefix_ + name) != nullptr; }
  std::string describe(const std::string& name) const { return file_.path() + ": tensor " + prefix_ + name; }
  const std::string& prefix() const { return prefix_; }

  // A whole entry (already checked by find), converted to `dtype`; undefined when absent.
  HostTensor load_whole(const SafetensorsEntry* entry, DType dtype) const {
    if (entry == nullptr) return {};
    HostTensor result(dtype, entry->shape);
    convert_elements(file_.bytes(*entry), entry->dtype, result.data(), dtype, result.numel());
    return result;
  }

 private:
  const Checkpoint& file_;  // one file, or the shards of a sharded checkpoint
  std::string prefix_;
};

std::string expert_name(int64_t expert, const char* projection) {
  return "experts." + std::to_string(expert) + "." + projection + ".weight";
}

// The Kimi K3 (compressed-tensors) names of an MXFP4 expert projection: w1 gate, w3 up, w2 down;
// `part` is "weight_packed" or "weight_scale".
std::string mxfp4_expert_name(int64_t expert, const char* projection, const char* part) {
  return "experts." + std::to_string(expert) + "." + projection + "." + part;
}

// One expert projection under both naming schemes, for the error that says the file holds the other
// format than the config declares.
struct ExpertProjection {
  const char* dense;  // gate_proj, up_proj, down_proj
  const char* mxfp4;  // w1, w3, w2
};
constexpr ExpertProjection kGateProjection{"gate_proj", "w1"};
constexpr ExpertProjection kUpProjection{"up_proj", "w3"};
constexpr ExpertProjection kDownProjection{"down_proj", "w2"};

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

// MXFP4 experts: every code uniform (a random byte holds two), every scale byte
// 124 - floor(log2(fan_in) / 2) + {-1, 0, 1}: values of roughly the dense weights' U / sqrt(fan_in)
// magnitude, and far inside the range where F32, BF16 and F16 hold them exactly.
HostTensor random_codes(uint64_t seed, uint64_t field, std::vector<int64_t> shape) {
  HostTensor tensor(DType::u8, std::move(shape));
  auto* bytes = tensor.data_as<uint8_t>();
  detail::parallel_draws(tensor.numel(), field_seed(seed, field),
                         [&](int64_t i, SplitMix64& rng) { bytes[i] = static_cast<uint8_t>(rng.next() >> 56); });
  return tensor;
}

HostTensor random_scales(uint64_t seed, uint64_t field, std::vector<int64_t> shape, int64_t fan_in) {
  HostTensor tensor(DType::u8, std::move(shape));
  const int base = 124 - (std::bit_width(static_cast<uint64_t>(fan_in)) - 1) / 2;
  auto* bytes = tensor.data_as<uint8_t>();
  detail::parallel_draws(tensor.numel(), field_seed(seed, field), [&](int64_t i, SplitMix64& rng) {
    bytes[i] = static_cast<uint8_t>(base + static_cast<int>(rng.next() % 3) - 1);
  });
  return tensor;
}

// A stacked MXFP4 tensor [E, rows, cols/2] with scales [E, rows, cols/32] as dense [E, rows, cols] in
// `dtype`, every value checked to be held exactly.
HostTensor dequantize_stack(const HostTensor& packed, const HostTensor& scales, DType dtype, const char* field) {
  if (!packed.defined()) return {};
  LATENTMOE_CHECK(packed.dtype() == DType::u8 && packed.shape().size() == 3, "dequantize: ", field,
                  " must be U8 [E, rows, cols/2]");
  const int64_t num_experts = packed.size(0), rows = packed.size(1), cols = 2 * packed.size(2);
  const int64_t groups = cols / kMxfp4GroupSize;
  LATENTMOE_CHECK(cols % kMxfp4GroupSize == 0 && scales.defined() && scales.dtype() == DType::u8 &&
                      scales.shape() == (std::vector<int64_t>{num_experts, rows, groups}),
                  "dequantize: ", field, "_scale must be U8 ", shape_string({num_experts, rows, groups}));
  HostTensor result(dtype, {num_experts, rows, cols});
  std::vector<double> row(static_cast<size_t>(cols));
  for (int64_t e = 0; e < num_experts; ++e) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t index = e * rows + r;
      mxfp4_decode_row(packed.data_as<uint8_t>() + index * (cols / 2), scales.data_as<uint8_t>() + index * groups, 0,
                       cols, row.data());
      for (int64_t c = 0; c < cols; ++c) {
        const auto value = static_cast<float>(row[c]);
        store_from_float(result.data(), dtype, index * cols + c, value);
        LATENTMOE_CHECK(static_cast<double>(load_as_float(result.data(), dtype, index * cols + c)) == row[c],
                        "dequantize: ", field, " value ", row[c], " of expert ", e, " at [", r, ", ", c,
                        "] is not exactly representable in ", dtype_name(dtype));
      }
    }
  }
  return result;
}

}  // namespace

LayerWeightViews views_of(const LayerWeights& weights) {
  auto view = [](const HostTensor& tensor) { return tensor.defined() ? tensor.view() : TensorView(); };
  LayerWeightViews views;
  views.dtype = weights.dtype;
  views.experts_format = weights.experts_format;
  views.gate = view(weights.gate);
  views.score_bias = view(weights.score_bias);
  views.down_proj = view(weights.down_proj);
  views.latent_norm = view(weights.latent_norm);
  views.up_proj = view(weights.up_proj);
  views.expert_gate = view(weights.expert_gate);
  views.expert_up = view(weights.expert_up);
  views.expert_down = view(weights.expert_down);
  views.expert_gate_scale = view(weights.expert_gate_scale);
  views.expert_up_scale = view(weights.expert_up_scale);
  views.expert_down_scale = view(weights.expert_down_scale);
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
  LATENTMOE_CHECK(weights.experts_format == config.experts_format, "layer weights: the experts are ",
                  to_string(weights.experts_format), " but the config declares ", to_string(config.experts_format),
                  " experts (quantization_config)");
  LATENTMOE_CHECK(weights.expert_code_order == Mxfp4CodeOrder::canonical || config.has_mxfp4_experts(),
                  "layer weights: expert_code_order is kernel but the experts are dense (the order is of MXFP4 codes)");
  if (config.has_mxfp4_experts() && weights.expert_code_order == Mxfp4CodeOrder::kernel) {
    // Host codes are the checkpoint's: a runner converts what it copies to the GPU (latentmoe/weights.h).
    for (const auto& [name, codes] : {std::pair<const char*, const TensorView&>{"expert_gate", weights.expert_gate},
                                      {"expert_up", weights.expert_up},
                                      {"expert_down", weights.expert_down}}) {
      LATENTMOE_CHECK(!codes.defined() || codes.device() != Device::cpu, "layer weights: ", name,
                      " is on the host but expert_code_order is kernel; MXFP4 codes on the host must be in the "
                      "canonical order (the runner converts the codes it copies to the GPU)");
    }
  }
  if (config.has_mxfp4_experts()) {
    LATENTMOE_CHECK(l % kMxfp4GroupSize == 0 && rank_i % kMxfp4GroupSize == 0, "layer weights: MXFP4 experts need ",
                    "moe_latent_size (", l, ") and moe_intermediate_size / tp (", rank_i, ") to be multiples of ",
                    kMxfp4GroupSize);
    const int64_t l_groups = l / kMxfp4GroupSize, i_groups = rank_i / kMxfp4GroupSize;
    check_field("expert_gate", weights.expert_gate, if_gated, "the activation is not gated", DType::u8,
                {num_experts, rank_i, l / 2});
    check_field("expert_up", weights.expert_up, Presence::required, "", DType::u8, {num_experts, rank_i, l / 2});
    check_field("expert_down", weights.expert_down, Presence::required, "", DType::u8, {num_experts, l, rank_i / 2});
    check_field("expert_gate_scale", weights.expert_gate_scale, if_gated, "the activation is not gated", DType::u8,
                {num_experts, rank_i, l_groups});
    check_field("expert_up_scale", weights.expert_up_scale, Presence::required, "", DType::u8,
                {num_experts, rank_i, l_groups});
    check_field("expert_down_scale", weights.expert_down_scale, Presence::required, "", DType::u8,
                {num_experts, l, i_groups});
    // Scales the host holds are checked for NaN here too (weights made in memory, not loaded).
    auto check_scales = [num_experts](const char* field, const TensorView& scales) {
      if (!scales.defined() || scales.device() != Device::cpu) return;
      const int64_t rows = scales.size(1), groups = scales.size(2);
      for (int64_t e = 0; e < num_experts; ++e) {
        check_e8m0_scales(static_cast<const uint8_t*>(scales.data()) + e * rows * groups, rows, groups, groups,
                          "layer weights: " + std::string(field) + " of expert " + std::to_string(e));
      }
    };
    check_scales("expert_gate_scale", weights.expert_gate_scale);
    check_scales("expert_up_scale", weights.expert_up_scale);
    check_scales("expert_down_scale", weights.expert_down_scale);
  } else {
    check_field("expert_gate", weights.expert_gate, if_gated, "the activation is not gated", dt,
                {num_experts, rank_i, l});
    check_field("expert_up", weights.expert_up, Presence::required, "", dt, {num_experts, rank_i, l});
    check_field("expert_down", weights.expert_down, Presence::required, "", dt, {num_experts, l, rank_i});
    const char* dense_reason = "the experts are dense (no MXFP4 quantization_config)";
    check_field("expert_gate_scale", weights.expert_gate_scale, Presence::absent, dense_reason, DType::u8, {});
    check_field("expert_up_scale", weights.expert_up_scale, Presence::absent, dense_reason, DType::u8, {});
    check_field("expert_down_scale", weights.expert_down_scale, Presence::absent, dense_reason, DType::u8, {});
  }
  check_field("shared_gate", weights.shared_gate, if_shared_gated,
              shared ? "the activation is not gated" : "the layer has no shared expert", dt, {rank_is, d});
  check_field("shared_up", weights.shared_up, if_shared, "the layer has no shared expert", dt, {rank_is, d});
  check_field("shared_down", weights.shared_down, if_shared, "the layer has no shared expert", dt, {d, rank_is});
}

LayerWeights load_layer_weights(const Checkpoint& file, const LayerConfig& config, std::string_view prefix,
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
  const bool mxfp4 = config.has_mxfp4_experts();
  const int64_t l_groups = l / kMxfp4GroupSize, full_i_groups = full_i / kMxfp4GroupSize;
  const int64_t rank_i_groups = rank_i / kMxfp4GroupSize;
  // An expert projection of `rows` x `cols` (dense) or its packed codes and scales (MXFP4). A file
  // in the other format than the config declares is named as such rather than as a missing tensor.
  auto check_expert = [&](int64_t e, const ExpertProjection& projection, int64_t rows, int64_t cols) {
    const std::string dense = expert_name(e, projection.dense);
    const std::string packed = mxfp4_expert_name(e, projection.mxfp4, "weight_packed");
    if (mxfp4) {
      LATENTMOE_CHECK(loader.has(packed) || !loader.has(dense), file.path(),
                      ": the config declares MXFP4 experts (quantization_config) but the file holds dense expert ",
                      "tensors: ", loader.prefix(), dense, " instead of ", loader.prefix(), packed);
      loader.find_packed(packed, {rows, cols / 2});
      loader.find_packed(mxfp4_expert_name(e, projection.mxfp4, "weight_scale"), {rows, cols / kMxfp4GroupSize});
    } else {
      LATENTMOE_CHECK(loader.has(dense) || !loader.has(packed), file.path(), ": the file holds MXFP4 expert tensors (",
                      loader.prefix(), packed, ") but the config declares dense experts (no quantization_config ",
                      "covering them); expected ", loader.prefix(), dense);
      loader.find(dense, {rows, cols}, true);
    }
  };
  for (int64_t e = 0; e < num_experts; ++e) {
    if (gated) check_expert(e, kGateProjection, full_i, l);
    check_expert(e, kUpProjection, full_i, l);
    check_expert(e, kDownProjection, l, full_i);
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
  if (mxfp4) {
    weights.experts_format = ExpertWeightFormat::mxfp4;
    if (gated) {
      weights.expert_gate = HostTensor(DType::u8, {num_experts, rank_i, l / 2});
      weights.expert_gate_scale = HostTensor(DType::u8, {num_experts, rank_i, l_groups});
    }
    weights.expert_up = HostTensor(DType::u8, {num_experts, rank_i, l / 2});
    weights.expert_up_scale = HostTensor(DType::u8, {num_experts, rank_i, l_groups});
    weights.expert_down = HostTensor(DType::u8, {num_experts, l, rank_i / 2});
    weights.expert_down_scale = HostTensor(DType::u8, {num_experts, l, rank_i_groups});
    // Gate/up: rows [i_begin, i_begin + I_r) of codes and scales. Down: the same input columns, i.e.
    // packed columns [i_begin/2, ...) and scale columns [i_begin/32, ...) (whole groups: I_r % 32 == 0).
    auto copy_rows_projection = [&](int64_t e, const char* projection, const HostTensor& packed,
                                    const HostTensor& scales) {
      loader.copy_rows(*loader.find_packed(mxfp4_expert_name(e, projection, "weight_packed"), {full_i, l / 2}), i_begin,
                       i_begin + rank_i, packed, e * rank_i * (l / 2));
      const std::string scale_name = mxfp4_expert_name(e, projection, "weight_scale");
      loader.copy_rows(*loader.find_packed(scale_name, {full_i, l_groups}), i_begin, i_begin + rank_i, scales,
                       e * rank_i * l_groups);
      check_e8m0_scales(scales.data_as<uint8_t>() + e * rank_i * l_groups, rank_i, l_groups, l_groups,
                        loader.describe(scale_name), i_begin, 0);
    };
    for (int64_t e = 0; e < num_experts; ++e) {
      if (gated) copy_rows_projection(e, kGateProjection.mxfp4, weights.expert_gate, weights.expert_gate_scale);
      copy_rows_projection(e, kUpProjection.mxfp4, weights.expert_up, weights.expert_up_scale);
      loader.copy_cols(
          *loader.find_packed(mxfp4_expert_name(e, kDownProjection.mxfp4, "weight_packed"), {l, full_i / 2}),
          i_begin / 2, (i_begin + rank_i) / 2, weights.expert_down, e * l * (rank_i / 2));
      const std::string scale_name = mxfp4_expert_name(e, kDownProjection.mxfp4, "weight_scale");
      loader.copy_cols(*loader.find_packed(scale_name, {l, full_i_groups}), i_begin / kMxfp4GroupSize,
                       i_begin / kMxfp4GroupSize + rank_i_groups, weights.expert_down_scale, e * l * rank_i_groups);
      check_e8m0_scales(weights.expert_down_scale.data_as<uint8_t>() + e * l * rank_i_groups, l, rank_i_groups,
                        rank_i_groups, loader.describe(scale_name), 0, i_begin / kMxfp4GroupSize);
    }
  } else {
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
  shard.experts_format = full.experts_format;
  // Expert e's rows [i_begin, i_begin + I_r) of a [E, I, cols] tensor and its columns
  // [col_begin, col_begin + width) of a [E, l, full_cols] tensor, whatever the element type (MXFP4
  // codes and scales are U8 with cols = l/2 or l/32, and full_cols = I/2 or I/32).
  auto shard_rows = [&](const HostTensor& source, int64_t cols) {
    if (!source.defined()) return HostTensor();
    HostTensor result(source.dtype(), {num_experts, rank_i, cols});
    for (int64_t e = 0; e < num_experts; ++e) {
      copy_row_block(source, e * full_i * cols, cols, i_begin, i_begin + rank_i, result, e * rank_i * cols);
    }
    return result;
  };
  auto shard_cols = [&](const HostTensor& source, int64_t full_cols, int64_t col_begin, int64_t width) {
    if (!source.defined()) return HostTensor();
    HostTensor result(source.dtype(), {num_experts, l, width});
    for (int64_t e = 0; e < num_experts; ++e) {
      copy_col_block(source, e * l * full_cols, l, full_cols, col_begin, col_begin + width, result, e * l * width);
    }
    return result;
  };
  if (full.experts_format == ExpertWeightFormat::mxfp4) {
    // validate_parallel made I_r a multiple of 32, so a rank's columns of w2 are whole scale groups.
    const int64_t l_groups = l / kMxfp4GroupSize;
    shard.expert_gate = shard_rows(full.expert_gate, l / 2);
    shard.expert_up = shard_rows(full.expert_up, l / 2);
    shard.expert_down = shard_cols(full.expert_down, full_i / 2, i_begin / 2, rank_i / 2);
    shard.expert_gate_scale = shard_rows(full.expert_gate_scale, l_groups);
    shard.expert_up_scale = shard_rows(full.expert_up_scale, l_groups);
    shard.expert_down_scale = shard_cols(full.expert_down_scale, full_i / kMxfp4GroupSize, i_begin / kMxfp4GroupSize,
                                         rank_i / kMxfp4GroupSize);
  } else {
    shard.expert_gate = shard_rows(full.expert_gate, l);
    shard.expert_up = shard_rows(full.expert_up, l);
    shard.expert_down = shard_cols(full.expert_down, full_i, i_begin, rank_i);
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
  if (full.experts_format == ExpertWeightFormat::mxfp4) {
    // Kimi K3's names: per expert w1 (gate), w3 (up), w2 (down), each its codes then its scales.
    auto add_expert = [&](int64_t e, const char* projection, const HostTensor& packed, const HostTensor& scales,
                          int64_t rows, int64_t cols) {
      if (!packed.defined()) return;
      tensors.emplace_back(p + mxfp4_expert_name(e, projection, "weight_packed"),
                           packed.view().slice_rows(e, e + 1).reshaped({rows, cols / 2}));
      tensors.emplace_back(p + mxfp4_expert_name(e, projection, "weight_scale"),
                           scales.view().slice_rows(e, e + 1).reshaped({rows, cols / kMxfp4GroupSize}));
    };
    for (int64_t e = 0; e < config.num_experts; ++e) {
      add_expert(e, kGateProjection.mxfp4, full.expert_gate, full.expert_gate_scale, full_i, l);
      add_expert(e, kUpProjection.mxfp4, full.expert_up, full.expert_up_scale, full_i, l);
      add_expert(e, kDownProjection.mxfp4, full.expert_down, full.expert_down_scale, l, full_i);
    }
  }
  for (int64_t e = 0; e < config.num_experts && full.experts_format == ExpertWeightFormat::dense; ++e) {
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
  if (config.has_mxfp4_experts()) {
    weights.experts_format = ExpertWeightFormat::mxfp4;
    const int64_t l_groups = l / kMxfp4GroupSize, i_groups = full_i / kMxfp4GroupSize;
    if (config.is_gated()) {
      weights.expert_gate = random_codes(seed, 6, {num_experts, full_i, l / 2});
      weights.expert_gate_scale = random_scales(seed, 12, {num_experts, full_i, l_groups}, l);
    }
    weights.expert_up = random_codes(seed, 7, {num_experts, full_i, l / 2});
    weights.expert_up_scale = random_scales(seed, 13, {num_experts, full_i, l_groups}, l);
    weights.expert_down = random_codes(seed, 8, {num_experts, l, full_i / 2});
    weights.expert_down_scale = random_scales(seed, 14, {num_experts, l, i_groups}, full_i);
  } else {
    if (config.is_gated())
      weights.expert_gate = random_tensor(seed, 6, dtype, {num_experts, full_i, l}, inverse_sqrt(l), 0);
    weights.expert_up = random_tensor(seed, 7, dtype, {num_experts, full_i, l}, inverse_sqrt(l), 0);
    weights.expert_down = random_tensor(seed, 8, dtype, {num_experts, l, full_i}, inverse_sqrt(full_i), 0);
  }
  if (config.has_shared_expert()) {
    if (config.is_gated()) weights.shared_gate = random_tensor(seed, 9, dtype, {full_is, d}, inverse_sqrt(d), 0);
    weights.shared_up = random_tensor(seed, 10, dtype, {full_is, d}, inverse_sqrt(d), 0);
    weights.shared_down = random_tensor(seed, 11, dtype, {d, full_is}, inverse_sqrt(full_is), 0);
  }
  return weights;
}

LayerWeights dequantize_layer_weights(const LayerWeights& weights) {
  LayerWeights result;
  result.dtype = weights.dtype;
  result.gate = clone(weights.gate);
  result.score_bias = clone(weights.score_bias);
  result.down_proj = clone(weights.down_proj);
  result.latent_norm = clone(weights.latent_norm);
  result.up_proj = clone(weights.up_proj);
  result.shared_gate = clone(weights.shared_gate);
  result.shared_up = clone(weights.shared_up);
  result.shared_down = clone(weights.shared_down);
  if (weights.experts_format == ExpertWeightFormat::dense) {
    result.expert_gate = clone(weights.expert_gate);
    result.expert_up = clone(weights.expert_up);
    result.expert_down = clone(weights.expert_down);
    return result;
  }
  LATENTMOE_CHECK(is_compute_dtype(weights.dtype), "dequantize: dtype ", dtype_name(weights.dtype),
                  " is not a compute dtype (F32, BF16, F16)");
  result.expert_gate = dequantize_stack(weights.expert_gate, weights.expert_gate_scale, weights.dtype, "expert_gate");
  result.expert_up = dequantize_stack(weights.expert_up, weights.expert_up_scale, weights.dtype, "expert_up");
  result.expert_down = dequantize_stack(weights.expert_down, weights.expert_down_scale, weights.dtype, "expert_down");
  return result;
}

LayerWeights load_layer_weights(const SafetensorsFile& file, const LayerConfig& config, std::string_view prefix,
                                const ParallelConfig& parallel, DType dtype) {
  return load_layer_weights(Checkpoint::view(file), config, prefix, parallel, dtype);
}

}  // namespace latentmoe

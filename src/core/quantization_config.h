// The quantization_config of a Hugging Face config (compressed-tensors): read, the routed experts'
// weight format it declares; written, the one latentmoe gives MXFP4 experts (LayerConfig::to_json).
// docs/CONFIG.md section 1 says which configs are read and why.
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <string_view>

#include "latentmoe/config.h"

namespace latentmoe::detail {

// The format of the routed experts that `quantization_config` declares: dense when no config group
// covers any of their projections (w1 gate, w3 up, w2 down; no w1 unless `gated`), mxfp4 when groups
// cover all of them with MXFP4 weights. Partial coverage, two groups on one projection, another
// method or scheme: an Error "<source>: ..." naming the key by its path under quantization_config.
ExpertWeightFormat experts_format(const nlohmann::json& quantization_config, std::string_view source, bool gated);

// The quantization_config of MXFP4 routed experts: one group over every routed expert projection,
// the shared expert ignored.
nlohmann::json mxfp4_quantization_config();

}  // namespace latentmoe::detail

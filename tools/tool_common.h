// Small pieces the commands share: a layer scaled down for quick runs, the CPU's name.
#pragma once

#include <string>
#include <string_view>

#include "latentmoe/config.h"

namespace latentmoe::tools {

// `config` with d, l, E, I and Is divided by `scale` (top_k capped at the new E), for runs on the
// CPU of layers the size of a real model's; scale 1 returns it unchanged. A scale below 1 or one that
// does not divide every size is an Error naming the size and `label` (the preset or file).
LayerConfig scaled_down(const LayerConfig& config, int scale, std::string_view label);

// The CPU's model name from /proc/cpuinfo ("CPU" when unknown).
std::string cpu_model();

}  // namespace latentmoe::tools

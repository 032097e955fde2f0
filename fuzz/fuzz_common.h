// Shared pieces of the libFuzzer targets: the tiny layer the weight-loader target loads, and a
// scratch file that holds each input (the readers take paths; one file per process, rewritten).
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "latentmoe/config.h"
#include "latentmoe/presets.h"

namespace latentmoe::fuzz {

// Kimi-like (situ, latent norm, shared expert) at d 16, l 8, E 4, k 2, I 8, Is 8.
inline LayerConfig tiny_config() { return resized(kimi_k3_config(), {16, 8, 4, 2, 8, 8}); }

// The same with MXFP4 routed experts, at the smallest sizes MXFP4 allows at tp 2 (l and I/2
// multiples of the 32-column scale group): d 16, l 32, E 2, k 1, I 64, Is 8.
inline LayerConfig tiny_mxfp4_config() {
  LayerConfig config = resized(kimi_k3_config(), {16, 32, 2, 1, 64, 8});
  config.experts_format = ExpertWeightFormat::mxfp4;
  return config;
}

// Writes `size` bytes to this process's scratch file and returns its path.
inline std::string scratch_file(const uint8_t* data, size_t size) {
  static const std::string path = "/tmp/latentmoe_fuzz_" + std::to_string(::getpid()) + ".bin";
  std::FILE* file = std::fopen(path.c_str(), "wb");
  if (file == nullptr) __builtin_trap();
  if (size > 0 && std::fwrite(data, 1, size, file) != size) __builtin_trap();
  std::fclose(file);
  return path;
}

}  // namespace latentmoe::fuzz

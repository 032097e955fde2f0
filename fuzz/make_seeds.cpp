// Writes the seed corpus of the fuzz targets (fuzz/corpus/): valid configs and files made with the
// library itself, and a few broken ones. Run from the repository root after a change of format:
//   build-fuzz/fuzz/make_seeds fuzz/corpus
#include <cstdio>
#include <fstream>
#include <string>

#include "fuzz_common.h"
#include "latentmoe/safetensors.h"
#include "latentmoe/weights.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seeds CORPUS_DIR\n");
    return 2;
  }
  const std::string root = argv[1];
  using namespace latentmoe;
  auto write = [](const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; };
  const LayerConfig tiny = fuzz::tiny_config();
  write(root + "/config/tiny.json", tiny.to_json());
  write(root + "/config/kimi_k3.json", kimi_k3_config().to_json());
  write(root + "/config/nemotron.json", nemotron3_super_config().to_json());
  write(root + "/config/aliases.json",
        R"({"hidden_size": 64, "routed_expert_hidden_size": 32, "num_experts": 8, "num_experts_per_token": 2,)"
        R"( "moe_intermediate_size": 16, "num_shared_experts": 1, "hidden_act": "relu2", "moe_renormalize": true})");
  write(root + "/config/missing_key.json", R"({"hidden_size": 64})");
  write(root + "/config/nested.json", R"({"hidden_size": [[[[[[1]]]]]], "moe_latent_size": {"a": {"b": 1}}})");
  write(root + "/config/tune_table.json",
        R"({"format": "latentmoe-tune-1", "machine": "8x H200", "device": "NVIDIA H200", "entries": [)"
        R"({"tp": 8, "dtype": "bf16", "hidden_size": 7168, "latent_size": 3584, "tail_fusion_max_tokens": 64,)"
        R"( "shared_stream_token_threshold": 256}, {"tp": 2, "tail_fusion_max_tokens": 512,)"
        R"( "shared_stream_token_threshold": 1024}]})");
  const LayerWeights weights = make_random_layer_weights(tiny, DType::bf16, 1);
  save_layer_weights(root + "/weights/tiny_bf16.safetensors", weights, tiny);
  save_layer_weights(root + "/weights/tiny_f32.safetensors", make_random_layer_weights(tiny, DType::f32, 2), tiny);
  save_layer_weights(root + "/safetensors/tiny_bf16.safetensors", weights, tiny);
  HostTensor small(DType::f16, {3, 5});
  write_safetensors(root + "/safetensors/one_f16.safetensors", {{"x", small.view()}});
  write(root + "/safetensors/empty_header.safetensors", std::string("\x02\0\0\0\0\0\0\0{}", 10));
  write(root + "/safetensors/bad_offsets.safetensors",
        std::string("\x40\0\0\0\0\0\0\0", 8) + R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}}          )" +
            std::string(8, '\0'));
  const LayerConfig mxfp4 = fuzz::tiny_mxfp4_config();
  save_layer_weights(root + "/weights/tiny_mxfp4.safetensors", make_random_layer_weights(mxfp4, DType::bf16, 3), mxfp4);
  // Indexes of a sharded checkpoint (the target's folder holds a.safetensors with tensor "x").
  write(root + "/checkpoint_index/valid.json",
        R"({"metadata": {"total_size": 24}, "weight_map": {"x": "a.safetensors"}})");
  write(root + "/checkpoint_index/two_shards.json",
        R"({"metadata": {}, "weight_map": {"x": "a.safetensors", "y": "sub/b.safetensors", "z": "a.safetensors"}})");
  write(root + "/checkpoint_index/escaping.json", R"({"weight_map": {"x": "../a.safetensors", "y": "/etc/passwd"}})");
  write(root + "/checkpoint_index/duplicate.json", R"({"weight_map": {"x": "a.safetensors", "x": "a.safetensors"}})");
  write(root + "/checkpoint_index/nested.json", R"({"weight_map": {"x": {"y": ["a.safetensors"]}}})");
  std::printf("seeds written under %s\n", root.c_str());
  return 0;
}

// latentmoe run: the contract of DESIGN section 3. Reads a config, weights and inputs, runs the
// layer on --tp ranks, checks that every rank holds the same output, and writes output, topk_ids
// and topk_weights. Any failure is one Error line; the output file is written (atomically) only
// after everything succeeded.
#include <cstdio>
#include <memory>
#include <string>

#include "commands.h"
#include "latentmoe/checkpoint.h"
#include "latentmoe/compare.h"
#include "latentmoe/config.h"
#include "latentmoe/device.h"
#include "latentmoe/error.h"
#include "latentmoe/gpu_group.h"
#include "latentmoe/local_group.h"
#include "latentmoe/safetensors.h"
#include "latentmoe/tune.h"
#include "latentmoe/weights.h"
#include "version.h"

namespace latentmoe::tools {
namespace {

struct RunArguments {
  std::string config_path, weights_path, input_path, output_path, prefix;
  int tp_size = 1;
  std::string tier = "auto";
  std::string backend = "auto";
  std::string placement = "auto";
  std::string tune_file;  // empty: LATENTMOE_TUNE_FILE, if set
};

HostTensor read_optional(const SafetensorsFile& file, const char* name) {
  return file.find(name) != nullptr ? file.read(name) : HostTensor();
}

void check_input(const HostTensor& tensor, const std::string& file, const char* name, std::vector<int64_t> shape,
                 DType dtype) {
  LATENTMOE_CHECK(tensor.shape() == shape, file, ": ", name, " has shape ", tensor.view().shape_string(), ", expected ",
                  shape_string(shape));
  LATENTMOE_CHECK(tensor.dtype() == dtype, file, ": ", name, " has dtype ", dtype_name(tensor.dtype()), ", expected ",
                  dtype_name(dtype));
}

void run_command(const RunArguments& args) {
  const LayerConfig config = LayerConfig::from_file(args.config_path);
  LATENTMOE_CHECK(args.tp_size >= 1, "--tp must be at least 1, got ", args.tp_size);
  validate_parallel(config, ParallelConfig{args.tp_size, 0, false});
  std::optional<TailTier> tier;
  if (args.tier != "auto") tier = parse_tail_tier(args.tier);
  const BackendKind backend = resolve_backend_kind(parse_backend_kind(args.backend));
  const GpuPlacement requested_placement = parse_gpu_placement(args.placement);

  const SafetensorsFile input_file = SafetensorsFile::open(args.input_path);
  LocalGroupInputs inputs;
  LATENTMOE_CHECK(input_file.find("hidden_states") != nullptr, args.input_path, ": no tensor named hidden_states");
  inputs.hidden_states = input_file.read("hidden_states");
  const DType dtype = inputs.hidden_states.dtype();
  LATENTMOE_CHECK(is_compute_dtype(dtype), args.input_path, ": hidden_states has dtype ", dtype_name(dtype),
                  ", expected F32, BF16 or F16");
  LATENTMOE_CHECK(inputs.hidden_states.shape().size() == 2, args.input_path,
                  ": hidden_states must have shape [tokens, ", config.hidden_size, "], got ",
                  inputs.hidden_states.view().shape_string());
  const int64_t num_tokens = inputs.hidden_states.size(0);
  check_input(inputs.hidden_states, args.input_path, "hidden_states", {num_tokens, config.hidden_size}, dtype);
  inputs.router_logits = read_optional(input_file, "router_logits");
  if (inputs.router_logits.defined()) {
    check_input(inputs.router_logits, args.input_path, "router_logits", {num_tokens, config.num_router_outputs()},
                DType::f32);
  }
  inputs.latent_states = read_optional(input_file, "latent_states");
  if (inputs.latent_states.defined()) {
    check_input(inputs.latent_states, args.input_path, "latent_states", {num_tokens, config.latent_size}, dtype);
  }

  // --weights: a safetensors file, a checkpoint folder or its index (docs/FILES.md).
  const Checkpoint checkpoint = Checkpoint::open(args.weights_path);
  // Fail on a bad weights file before spawning ranks (rank 0's shard is checked fully here).
  LayerWeights first_rank = load_layer_weights(checkpoint, config, args.prefix, {args.tp_size, 0, false}, dtype);
  LATENTMOE_CHECK(inputs.router_logits.defined() || first_rank.gate.defined(), args.input_path,
                  ": no router_logits, and ", args.weights_path, " has no ", args.prefix,
                  "gate.weight to compute them from");

  GpuPlacement placement = GpuPlacement::simulated;
  if (backend == BackendKind::cuda && args.tp_size > 1) {
    // N real GPUs (one thread per GPU, NCCL) when present with peer access, else N ranks on GPU 0.
    std::string why;
    placement = resolve_gpu_placement(requested_placement, args.tp_size, &why);
    std::fprintf(stderr, "latentmoe run: tp %d on the CUDA backend: %s\n", args.tp_size, why.c_str());
  }
  LocalGroupOptions options;
  options.placement = placement;
  options.tp_size = args.tp_size;
  options.backend = backend;
  options.tier = tier;
  // Ranks on GPUs of their own take the crossovers measured on that GPU model, where tune/ has them.
  const std::string device = placement == GpuPlacement::devices ? cuda_device_name(0) : std::string();
  options.policy = tuned_policy(args.tune_file, args.tp_size, dtype, config.hidden_size, config.latent_size, device);
  auto results = run_local_group(
      config,
      [&](const ParallelConfig& parallel) {
        if (parallel.rank == 0) return std::move(first_rank);
        return load_layer_weights(checkpoint, config, args.prefix, parallel, dtype);
      },
      inputs, options);

  for (int rank = 1; rank < args.tp_size; ++rank) {
    LATENTMOE_CHECK(bitwise_equal(results[rank].output.view(), results[0].output.view()) &&
                        bitwise_equal(results[rank].topk_ids.view(), results[0].topk_ids.view()) &&
                        bitwise_equal(results[rank].topk_weights.view(), results[0].topk_weights.view()),
                    "internal error: rank ", rank, " holds a different output than rank 0");
  }
  const RankResult& result = results[0];
  write_safetensors(args.output_path,
                    {{"output", result.output.view()},
                     {"topk_ids", result.topk_ids.view()},
                     {"topk_weights", result.topk_weights.view()}},
                    {{"producer", version_string()},
                     {"tier", std::string(to_string(result.tier))},
                     {"tp", std::to_string(args.tp_size)},
                     {"backend", std::string(to_string(backend))}});
  std::printf("latentmoe run: %lld tokens, tp %d, tier %s, backend %s, %s -> %s\n", static_cast<long long>(num_tokens),
              args.tp_size, std::string(to_string(result.tier)).c_str(), std::string(to_string(backend)).c_str(),
              std::string(dtype_name(dtype)).c_str(), args.output_path.c_str());
}

}  // namespace

void register_run_command(CLI::App& app) {
  auto args = std::make_shared<RunArguments>();
  CLI::App* command = app.add_subcommand("run", "Run the layer on files (DESIGN section 3)");
  command->add_option("--config", args->config_path, "Layer config (JSON, Hugging Face keys)")->required();
  command
      ->add_option("--weights", args->weights_path,
                   "Weights: a safetensors file, a checkpoint folder or its model.safetensors.index.json")
      ->required();
  command
      ->add_option("--input", args->input_path,
                   "Inputs (safetensors): hidden_states [T, d], optional router_logits [T, E+Z] F32, "
                   "optional latent_states [T, l]")
      ->required();
  command->add_option("--output", args->output_path, "Output (safetensors): output, topk_ids, topk_weights")
      ->required();
  command->add_option("--prefix", args->prefix, "Prefix of the weight names, e.g. model.layers.3.mlp.");
  command->add_option("--tp", args->tp_size, "Tensor-parallel ranks (threads on the CPU backend)");
  command->add_option("--tier", args->tier, "auto|native|tail_fusion|allreduce_overlap|column_parallel");
  command->add_option("--backend", args->backend, "auto|cpu|cuda");
  command->add_option("--placement", args->placement,
                      "auto|simulated|devices: where the CUDA backend's tp > 1 ranks run (auto: one GPU each when "
                      "tp GPUs with peer access are present, else simulated on GPU 0)");
  command->add_option("--tune-file", args->tune_file,
                      "Tier crossovers measured on this machine (JSON, docs/CONFIG.md; default: LATENTMOE_TUNE_FILE)");
  command->callback([args] { run_command(*args); });
}

}  // namespace latentmoe::tools

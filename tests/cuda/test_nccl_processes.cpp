// One process per GPU, as inference engines run latentmoe (latentmoe/nccl_group.h): every process is one
// rank with its own ncclComm_t, built from a unique id that rank 0 writes into a shared folder. The test
// runs only inside such a launch (scripts/gpu_run_multi.sh `processes`, or any launcher that sets the
// variables); it skips otherwise:
//   LATENTMOE_TEST_PROCESS_RANK   this process's rank (its GPU)
//   LATENTMOE_TEST_PROCESS_WORLD  the number of processes (ranks)
//   LATENTMOE_TEST_PROCESS_DIR    a folder every process can read and write (the unique id goes there)
// Every tier the runner supports, on both reference families at T 1, 17 and 133 (133: above the one-shot
// capacity, through NCCL), against the CPU runner at the same tp (every process computes it), and the
// outputs of all ranks compared byte for byte through an ncclAllGather of them.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "cuda_test_util.h"
#include "latentmoe/compare.h"
#include "latentmoe/gpu_group.h"
#include "latentmoe/local_group.h"
#include "latentmoe/runner.h"
#include "latentmoe/weights.h"
#include "layer_test_util.h"
#include "nccl_test_util.h"

#if defined(LATENTMOE_WITH_NCCL)
#include "latentmoe/nccl_group.h"
#endif

namespace latentmoe::cuda::testing {
namespace {

#if defined(LATENTMOE_WITH_NCCL)
namespace fs = std::filesystem;

struct ProcessLaunch {
  int rank = -1, world = 0;
  fs::path folder;
};

// The launch's variables, or world 0 when this process was not started as one rank of it.
ProcessLaunch process_launch() {
  ProcessLaunch launch;
  const char* rank = std::getenv("LATENTMOE_TEST_PROCESS_RANK");
  const char* world = std::getenv("LATENTMOE_TEST_PROCESS_WORLD");
  const char* folder = std::getenv("LATENTMOE_TEST_PROCESS_DIR");
  if (rank == nullptr || world == nullptr || folder == nullptr) return launch;
  launch.rank = std::atoi(rank);
  launch.world = std::atoi(world);
  launch.folder = folder;
  return launch;
}

// Rank 0 writes the id (renamed into place, so a reader never sees half of it); the others wait for it,
// at most `timeout`.
ncclUniqueId exchange_unique_id(const ProcessLaunch& launch, std::chrono::seconds timeout) {
  ncclUniqueId id{};
  const fs::path path = launch.folder / "nccl_unique_id";
  if (launch.rank == 0) {
    EXPECT_EQ(ncclGetUniqueId(&id), ncclSuccess);
    const fs::path temporary = launch.folder / "nccl_unique_id.tmp";
    std::ofstream(temporary, std::ios::binary).write(id.internal, sizeof(id.internal));
    fs::rename(temporary, path);
    return id;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!fs::exists(path)) {
    if (std::chrono::steady_clock::now() > deadline) {
      ADD_FAILURE() << "rank " << launch.rank << ": no unique id from rank 0 in " << path << " after "
                    << timeout.count() << " s";
      return id;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::ifstream(path, std::ios::binary).read(id.internal, sizeof(id.internal));
  return id;
}

// Every rank's bytes of `output` gathered through NCCL: true when all equal this rank's.
bool equal_on_every_rank(ncclComm_t comm, int world, const HostTensor& output) {
  const size_t bytes = output.nbytes();
  void* mine = nullptr;
  void* all = nullptr;
  EXPECT_EQ(cudaMalloc(&mine, bytes), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&all, bytes * world), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(mine, output.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(ncclAllGather(mine, all, bytes, ncclUint8, comm, nullptr), ncclSuccess);
  std::vector<char> gathered(bytes * world);
  EXPECT_EQ(cudaMemcpy(gathered.data(), all, bytes * world, cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(mine);
  cudaFree(all);
  bool equal = true;
  for (int r = 0; r < world; ++r) equal = equal && std::memcmp(gathered.data() + r * bytes, output.data(), bytes) == 0;
  return equal;
}
#endif

TEST(NcclProcess, one_process_per_gpu_runs_every_tier_against_the_cpu_runner) {
#if defined(LATENTMOE_WITH_NCCL)
  const ProcessLaunch launch = process_launch();
  if (launch.world == 0) GTEST_SKIP() << "not started as a rank (LATENTMOE_TEST_PROCESS_RANK/_WORLD/_DIR)";
  ASSERT_GE(launch.world, 1);
  ASSERT_TRUE(launch.rank >= 0 && launch.rank < launch.world) << "rank " << launch.rank;
  LATENTMOE_REQUIRE_NCCL(launch.rank + 1);
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  const int tp = launch.world, rank = launch.rank;
  DeviceGuard guard(rank);
  const ncclUniqueId id = exchange_unique_id(launch, std::chrono::seconds(60));
  ncclComm_t comm = nullptr;
  ASSERT_EQ(ncclCommInitRank(&comm, tp, id, rank), ncclSuccess);
  const DType dtype = DType::bf16;
  constexpr int64_t kMaxTokens = 133;
  int tiers_run = 0;
  {
    uint64_t seed = 313;
    for (const LayerConfig& config :
         {latentmoe::testing::kimi_like_config(), latentmoe::testing::nemotron_like_config()}) {
      GpuGroupOptions options;
      options.dtype = dtype;
      options.capacity_elements = 17 * (config.hidden_size + config.latent_size);  // one-shot up to 17 tokens
      options.max_elements = kMaxTokens * (config.hidden_size + config.latent_size);
      options.timeout = std::chrono::milliseconds(20000);
      auto communicator = make_nccl_communicator(comm, options);
      const LayerWeights weights = make_random_layer_weights(config, dtype, seed += 1000);
      auto shard = [&](const ParallelConfig& parallel) { return shard_layer_weights(weights, config, parallel); };
      RunnerOptions runner_options;
      runner_options.backend = BackendKind::cuda;
      runner_options.max_tokens = kMaxTokens;
      runner_options.device_ordinal = rank;
      runner_options.host_staging = true;
      Runner runner(config, ParallelConfig{tp, rank, false}, shard(ParallelConfig{tp, rank, false}), *communicator,
                    runner_options);
      const TierSupport support = runner.tier_support();
      for (int64_t tokens : {int64_t{1}, int64_t{17}, kMaxTokens}) {
        const LocalGroupInputs inputs = latentmoe::testing::random_inputs(config, tokens, dtype, seed + tokens);
        for (TailTier tier :
             {TailTier::native, TailTier::tail_fusion, TailTier::allreduce_overlap, TailTier::column_parallel}) {
          if (!support.allows(tier, tokens)) continue;
          SCOPED_TRACE("rank " + std::to_string(rank) + ", d " + std::to_string(config.hidden_size) + ", tp " +
                       std::to_string(tp) + ", T " + std::to_string(tokens) + ", " + std::string(to_string(tier)));
          LocalGroupOptions cpu;
          cpu.tp_size = tp;
          cpu.tier = tier;
          cpu.backend = BackendKind::cpu;
          const auto ref = run_local_group(config, shard, inputs, cpu);
          HostTensor output(dtype, {tokens, config.hidden_size});
          ForwardInputs forward_inputs;
          forward_inputs.hidden_states = inputs.hidden_states.view();
          forward_inputs.router_logits = inputs.router_logits.view();
          forward_inputs.tier = tier;
          EXPECT_EQ(runner.forward_host(forward_inputs, ForwardOutputs{output.view(), {}, {}}), tier);
          EXPECT_EQ(count_non_finite(output), 0);
          EXPECT_LT(relative_error(output, ref[0].output), tolerance(dtype));
          EXPECT_TRUE(equal_on_every_rank(comm, tp, output)) << "the ranks' outputs differ";
          ++tiers_run;
        }
      }
    }
  }
  // At tp >= 2 every tier runs at least at one token; alone, only the native tier exists.
  EXPECT_GE(tiers_run, tp >= 2 ? 4 : 1);
  EXPECT_EQ(ncclCommDestroy(comm), ncclSuccess);
#else
  GTEST_SKIP() << "built without NCCL";
#endif
}

}  // namespace
}  // namespace latentmoe::cuda::testing

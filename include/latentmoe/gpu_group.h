// A tensor-parallel group whose collectives run on the GPU: one communicator per rank, every
// collective enqueued on the caller's stream (nothing blocks the host), device tensors only. Three
// placements of the ranks, one code path (the one-shot Lamport kernels of src/cuda/comm, reached through
// a plain peer-pointer struct; docs/ARCHITECTURE.md, "Ranks on the GPU"):
//
// Simulated (make_simulated_gpu_group): all `tp_size` ranks on one GPU, each rank with its own streams
// (its own Runner), the peer buffers in that GPU's memory. Every tier of the layer then runs, and is
// tested, on one GPU; only the cost of NVLink is missing.
//
// One thread per GPU (make_nccl_gpu_group): rank r on GPU r, the library creates the NCCL communicator;
// one process per GPU (latentmoe/nccl_group.h): the caller passes its ncclComm_t. On real GPUs the
// receive buffers come from NCCL 2.28 (ncclMemAlloc + ncclCommWindowRegister, symmetric), each peer's
// pointer read once through NCCL's device API. Where not every rank can load and store its peers'
// buffers, or a message exceeds the one-shot capacity, the collectives go through ncclAllReduce /
// ncclReduceScatter / ncclAllGather (column blocks packed into NCCL's contiguous chunks). NVLink
// multicast stays off: the process must set NCCL_NVLS_ENABLE=0 before NCCL starts (latentmoe sets no
// NCCL variable; unset or another value is refused), and the loaded libnccl must be the release
// latentmoe was built against (the device API has no ABI compatibility across releases).
//
// Ranks that share a GPU spin on each other, so such a process needs, set before its first CUDA call
// (the latentmoe tool and the GPU tests set both):
//   CUDA_MODULE_LOADING=EAGER: with lazy loading, a rank's first launch of a kernel can wait for a
//     peer's collective that spins waiting for it;
//   CUDA_DEVICE_MAX_CONNECTIONS >= 4 x tp (32 from tp 8 on): streams beyond the hardware queues share
//     one in order, and a waiting collective would hold back a peer's kernel (checked: the group
//     refuses to be built with fewer).
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "latentmoe/communicator.h"
#include "latentmoe/dtype.h"

namespace latentmoe {

// Where the ranks of a CUDA group of tp > 1 run: `simulated` on GPU 0, `devices` on GPUs 0..tp-1 (one
// thread per GPU, NCCL), `automatic` on devices when tp GPUs with peer access are present and
// latentmoe has NCCL, simulated otherwise.
enum class GpuPlacement { automatic, simulated, devices };
std::string_view to_string(GpuPlacement placement);
// "auto", "simulated" or "devices"; throws Error otherwise.
GpuPlacement parse_gpu_placement(std::string_view name);

// What `requested` resolves to on this machine for tp_size ranks (GPU count, peer access between every
// pair of GPUs 0..tp-1, NCCL built in). Throws Error when `requested` is devices and they cannot be had.
// `why` receives one line for people ("8 ranks on GPUs 0..7, ..." or "... simulated on GPU 0 (...)").
GpuPlacement resolve_gpu_placement(GpuPlacement requested, int tp_size, std::string* why = nullptr);

// How long a collective waits for its peers by default (LATENTMOE_COLLECTIVE_TIMEOUT_MS overrides it:
// default_collective_timeout()).
inline constexpr std::chrono::milliseconds kDefaultCollectiveTimeout{30000};

struct GpuGroupOptions {
  int device = 0;             // the GPU every simulated rank runs on (NCCL groups: rank r on GPU r)
  DType dtype = DType::bf16;  // the dtype of every collective (the layer's compute dtype)
  // The largest message one collective moves, in elements of `dtype` per rank: T (d + l) holds
  // every collective of a layer of T tokens (tier 0's carries [T, l + d/tp]); each rank's receive
  // area is 3 x tp_size x this.
  int64_t capacity_elements = 0;
  // How long a collective waits for its peers before it fails (the local group and bench tail pass
  // default_collective_timeout()).
  std::chrono::milliseconds timeout = kDefaultCollectiveTimeout;
  // NCCL groups only. The largest tensor (rows x cols elements) one collective may carry: a message above
  // the one-shot capacity goes through NCCL, staged through a buffer of this many elements per rank
  // (column blocks packed into NCCL's contiguous chunks). 0: capacity_elements (every message one-shot).
  int64_t max_elements = 0;
  // NCCL groups only. false: every collective through NCCL, no one-shot kernels and no fused tiers (the
  // unfused baseline; also what a group whose ranks cannot all load/store each other gets).
  bool one_shot = true;
  // Simulated groups only. true: every one-shot launch of a rank waits on the host, before and after
  // it is enqueued, until every rank of the group has reached the same launch (bounded by `timeout`,
  // released by abort()). Ranks that share a GPU share one CUDA context, and a host thread inside a
  // driver call that waits for the whole context (a library loading its kernels on first use, as
  // cuBLASLt does) would otherwise wait for a peer's spinning collective that waits for that very
  // rank: a hang until the timeout, seen on the H200 at tp 8. With the rendezvous no collective
  // spins while a rank is between launches. Skipped while the stream is being captured (a graph's
  // replay has no host step). false: the device-side protocol alone, for tests that drive several
  // ranks from one thread.
  bool host_rendezvous = true;
};

// kDefaultCollectiveTimeout, or LATENTMOE_COLLECTIVE_TIMEOUT_MS when set (an integer in 1..3600000), read
// now: call it when a group is built, not per collective (docs/CONFIG.md, "Environment variables").
std::chrono::milliseconds default_collective_timeout();

// How many tokens of a layer the one-shot collectives of a group of GPUs of their own (NCCL groups)
// carry by default; NCCL carries larger messages. The one-shot kernels win on latency and lose on
// bandwidth, and each rank reads every peer's message, so the crossover falls as tp grows. Measured on
// two H200s at 2f06526 (docs/PERFORMANCE.md, "Two real H200s"): the one-shot all-reduce of [T, d] beat
// NCCL's up to 512 tokens of kimi-k3 (7.3 MB; 48.6 against 53.0 us) and lost from 1024 (82.9 against
// 75.3), the AR+RMSNorm of the latent likewise; so 512 tokens for two ranks. Larger groups keep 64
// until they are measured. A group for layers of hidden size d and latent l then gets
//   capacity_elements = min(T, one_shot_tokens) x (d + l),  max_elements = T x (d + l)
// for T tokens (size_nccl_group below); tier 0, whose collective must be one-shot, runs up to
// that many tokens. Simulated groups have no NCCL path and carry every message one-shot.
inline constexpr int64_t kDefaultOneShotTokens = 64;
inline constexpr int64_t kDefaultOneShotTokensTwoRanks = 512;
// For a group of `tp_size` ranks: kDefaultOneShotTokensTwoRanks up to two ranks, else
// kDefaultOneShotTokens; LATENTMOE_ONE_SHOT_MAX_TOKENS, when set (an integer in 1..1048576), for any.
// Read now: call it when a group is sized.
int64_t default_one_shot_tokens(int tp_size);
// Sets options.capacity_elements and options.max_elements for layers of `per_token_elements` (d + l)
// and up to `max_tokens` tokens: the one-shot path up to `one_shot_tokens` of them, NCCL above.
void size_nccl_group(GpuGroupOptions& options, int64_t max_tokens, int64_t per_token_elements, int64_t one_shot_tokens);

// Throws Error without CUDA or a GPU, for tp_size outside 1..16, or a capacity below 1.
std::vector<std::unique_ptr<Communicator>> make_simulated_gpu_group(int tp_size, const GpuGroupOptions& options);

// One thread per GPU: rank r on GPU r (0..tp_size-1). Creates the NCCL communicators (ncclCommInitAll
// over GPUs 0..tp_size-1), registers every rank's receive area as a
// symmetric window and reads the peers' pointers. Every rank's calls must then come from that rank's
// own thread or stream, in the same order on every rank. Throws Error without CUDA or NCCL, with fewer
// than tp_size GPUs, when NCCL_NVLS_ENABLE is not 0 (unset included: NCCL would then use NVLink multicast
// where the GPUs have it, and latentmoe sets no NCCL variable itself; the latentmoe tool sets it to 0 for
// its process), when the loaded libnccl is not the release latentmoe was built against, or when NCCL fails.
// The communicators free their NCCL resources together, when the last of them is destroyed.
std::vector<std::unique_ptr<Communicator>> make_nccl_gpu_group(int tp_size, const GpuGroupOptions& options);

}  // namespace latentmoe

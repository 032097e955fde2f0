// The execution context of one tensor-parallel rank, shared by every layer of that rank.
//
// An engine runs 60-92 MoE layers per rank. What does not depend on a layer's weights belongs to one
// object per rank: the backend (streams, BLAS handles, the backend's workspaces), the per-forward
// scratch tensors and the communicator. Each Runner built on the context holds its weights and
// little else, and takes views of the context's scratch with its own shapes at forward time.
//
// Life cycle: build the context, then every layer of the rank (Runner(RankContext&, ...)); each
// layer registers its needs and the context grows its scratch and the backend's workspaces to the
// element-wise maximum. After the first forward through the context nothing may grow (captured CUDA
// graphs hold the buffers' addresses): a layer that needs more is refused. The layers of one context
// run one at a time (from one thread at a time), as the layers of a model do.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#include "latentmoe/communicator.h"
#include "latentmoe/parallel.h"
#include "latentmoe/tensor.h"

namespace latentmoe {

namespace detail {
struct RankContextState;
struct RankContextAccess;  // internal (src/core/rank_context_state.h)
}  // namespace detail

enum class BackendKind { automatic, cpu, cuda };
std::string_view to_string(BackendKind kind);
// "auto", "cpu", "cuda"; throws on anything else.
BackendKind parse_backend_kind(std::string_view name);

// The backend `auto` resolves to here (cuda when built with CUDA and a GPU is present, else cpu);
// throws Error when an explicitly requested backend is not available.
BackendKind resolve_backend_kind(BackendKind kind);

struct RankContextOptions {
  BackendKind backend = BackendKind::cpu;
  // CUDA: the device this rank runs on; -1 picks rank % number of devices (so several ranks share
  // one GPU when there are fewer GPUs than ranks).
  int device_ordinal = -1;
  // Largest token count any layer's forward() accepts; the scratch is sized for it.
  int64_t max_tokens = 4096;
  // GPU backends: make forward_host's staging buffers (inputs and outputs for max_tokens, for the
  // largest layer) as the layers register. Off by default: an engine calls forward() on its own
  // device tensors.
  bool host_staging = false;
};

class RankContext {
 public:
  // `communicator` must outlive the context and every layer built on it, and be rank parallel.rank
  // of parallel.tp_size. Creates the backend (the CUDA backend's streams and handles on its device).
  RankContext(const ParallelConfig& parallel, Communicator& communicator, const RankContextOptions& options = {});
  ~RankContext();
  RankContext(const RankContext&) = delete;
  RankContext& operator=(const RankContext&) = delete;

  const ParallelConfig& parallel() const;
  Communicator& communicator() const;
  const RankContextOptions& options() const;
  Device device() const;
  // Layers built on this context and not yet destroyed.
  int num_layers() const;
  // Whether a forward has run through this context (from then on its buffers never move).
  bool frozen() const;
  // Bytes of the shared scratch (and staging) the context holds now.
  size_t scratch_bytes() const;

 private:
  friend struct detail::RankContextAccess;
  std::unique_ptr<detail::RankContextState> impl_;
};

}  // namespace latentmoe

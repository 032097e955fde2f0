// The C ABI's contexts: one rank alone, the ranks of a group in this process (the in-process group on
// the CPU, the simulated GPU group on one GPU), and one rank per process over NCCL.
#include <cstring>
#include <string>

#include "capi_internal.h"
#include "core/settings.h"
#include "latentmoe/device.h"
#include "latentmoe/gpu_group.h"
#include "latentmoe/in_process_group.h"

#if defined(LATENTMOE_WITH_NCCL)
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "core/nccl_checks.h"
#include "latentmoe/nccl_group.h"
#endif

namespace latentmoe::capi {
namespace {

Placement placement_of(const lmoe_context_options* options) {
  require(options, "options");
  require_struct(options->struct_size, sizeof(lmoe_context_options), "lmoe_context_options");
  Placement placement;
  if (options->device_type == LMOE_DEVICE_CPU) {
    if (options->device_index != 0) {
      throw InvalidArgument("a CPU context has device index 0, got " + std::to_string(options->device_index));
    }
    return placement;
  }
  if (options->device_type != LMOE_DEVICE_CUDA) {
    throw InvalidArgument("unknown device type code " + std::to_string(options->device_type));
  }
#ifndef LATENTMOE_WITH_CUDA
  throw InvalidArgument("device cuda:" + std::to_string(options->device_index) +
                        ": latentmoe was built without CUDA (this build runs on the CPU only)");
#else
  const int count = cuda_device_count();
  if (options->device_index < 0 || options->device_index >= count) {
    throw InvalidArgument("device cuda:" + std::to_string(options->device_index) + " does not exist (" +
                          std::to_string(count) + " CUDA device" + (count == 1 ? "" : "s") + " found)");
  }
  placement.device = Device::cuda;
  placement.index = options->device_index;
  return placement;
#endif
}

int64_t max_tokens_of(const lmoe_context_options* options) {
  if (options->max_tokens < 1) {
    throw InvalidArgument("max_tokens must be at least 1, got " + std::to_string(options->max_tokens));
  }
  return options->max_tokens;
}

RankContextOptions rank_context_options(const ContextState& state) {
  RankContextOptions options;
  options.backend = state.placement.device == Device::cpu ? BackendKind::cpu : BackendKind::cuda;
  options.device_ordinal = state.placement.index;
  options.max_tokens = state.max_tokens;
  return options;
}

std::shared_ptr<ContextState> new_state(const Placement& placement, int64_t max_tokens, int tp, int rank) {
  auto state = std::make_shared<ContextState>();
  state->placement = placement;
  state->max_tokens = max_tokens;
  state->parallel = ParallelConfig{tp, rank, false};
  return state;
}

lmoe_context* new_handle(std::shared_ptr<ContextState> state) {
  auto* handle = new lmoe_context;
  handle->state = std::move(state);
  return handle;
}

// Ranks that share one GPU spin on each other: a kernel loaded lazily, on first use, can wait for a peer's
// collective that waits for that very rank (latentmoe/gpu_group.h). CUDA reads the variable when the
// process initialises it, so it is checked here (through the settings registry), never set.
void check_module_loading() {
  const std::optional<std::string> value = detail::read_path(detail::Setting::cuda_module_loading);
  if (value != std::optional<std::string>("EAGER")) {
    throw Error("ranks simulated on one GPU need CUDA_MODULE_LOADING=EAGER (it is " +
                (value.has_value() ? "'" + *value + "'" : std::string("unset")) +
                "): with lazy loading a rank's first launch of a kernel can wait for a peer's collective that "
                "waits for it; set it before the process initialises CUDA (importing latentmoe before CUDA "
                "starts sets it)");
  }
}

}  // namespace

ContextState::~ContextState() {
  // The context (its backend and scratch) before the communicator it refers to, and latentmoe's
  // communicator (whose teardown is collective over the NCCL communicator) before the NCCL one.
  context.reset();
  nccl_communicator.reset();
  if (owns_nccl_comm && nccl_comm != nullptr) destroy_nccl_comm(nccl_comm);
}

RankContext& ContextState::ensure(DType dtype, int64_t per_token) {
  if (context != nullptr) return *context;
  Communicator* communicator = nullptr;
  if (nccl_comm != nullptr) {
    nccl_communicator = nccl_communicator_for(nccl_comm, dtype, per_token, max_tokens);
    communicator = nccl_communicator.get();
  } else if (group->simulated_gpu) {
    communicator = &simulated_gpu_communicator(*group, parallel.rank, dtype, per_token, max_tokens);
  } else {
    communicator = group->ranks[static_cast<size_t>(parallel.rank)].get();
  }
  context = std::make_unique<RankContext>(parallel, *communicator, rank_context_options(*this));
  return *context;
}

std::string ContextState::policy_device() const {
  // The built-in tune tables are measured with one GPU per rank: only such ranks take them.
  if (nccl_comm == nullptr || placement.device != Device::cuda) return {};
  return cuda_device_name(placement.index);
}

Communicator& simulated_gpu_communicator(GroupState& group, int rank, DType dtype, int64_t per_token,
                                         int64_t max_tokens) {
  std::lock_guard<std::mutex> lock(group.mutex);
  if (group.ranks.empty()) {
    GpuGroupOptions options;
    options.device = group.device;
    options.dtype = dtype;
    // Every collective of a layer of T tokens fits T (d + l) elements (tier 0's [T, l + d/tp] too).
    options.capacity_elements = max_tokens * per_token;
    options.max_elements = options.capacity_elements;
    options.timeout = default_collective_timeout();
    group.ranks = make_simulated_gpu_group(group.tp, options);
  }
  return *group.ranks[static_cast<size_t>(rank)];
}

#if defined(LATENTMOE_WITH_NCCL)

int built_nccl_version_code() { return NCCL_VERSION_CODE; }

namespace {

void check_nccl(ncclResult_t result, const char* call, ncclComm_t comm) {
  if (result == ncclSuccess) return;
  const char* last = ncclGetLastError(comm);
  throw Error(std::string(call) + " failed: " + ncclGetErrorString(result) +
              (last != nullptr && *last != '\0' ? std::string(": ") + last : std::string()));
}

// The loaded libnccl must be the release latentmoe was compiled against (its device API has no ABI
// compatibility across releases): the library's own check and message.
void check_nccl_version() {
  int loaded = 0;
  check_nccl(ncclGetVersion(&loaded), "ncclGetVersion", nullptr);
  if (auto mismatch = detail::nccl_version_mismatch(loaded, NCCL_VERSION_CODE)) throw Error(*mismatch);
}

// Makes `device` current for the calling thread and restores the previous device when it ends.
class CurrentDevice {
 public:
  explicit CurrentDevice(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    const cudaError_t result = cudaSetDevice(device);
    if (result != cudaSuccess) {
      throw Error("cudaSetDevice(" + std::to_string(device) + ") failed: " + cudaGetErrorString(result));
    }
  }
  ~CurrentDevice() {
    if (previous_ >= 0) (void)cudaSetDevice(previous_);
  }
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace

std::unique_ptr<Communicator> nccl_communicator_for(void* comm, DType dtype, int64_t per_token, int64_t max_tokens) {
  int tp = 0;
  check_nccl(ncclCommCount(static_cast<ncclComm_t>(comm), &tp), "ncclCommCount", static_cast<ncclComm_t>(comm));
  GpuGroupOptions options;
  options.dtype = dtype;
  options.timeout = default_collective_timeout();
  // One-shot collectives up to the default token count for the group's size, NCCL above, up to max_tokens
  // (latentmoe/gpu_group.h, "one process per GPU").
  size_nccl_group(options, max_tokens, per_token, default_one_shot_tokens(tp));
  return make_nccl_communicator(static_cast<ncclComm_t>(comm), options);
}

void destroy_nccl_comm(void* comm) noexcept { (void)ncclCommDestroy(static_cast<ncclComm_t>(comm)); }

#else

int built_nccl_version_code() { return 0; }

std::unique_ptr<Communicator> nccl_communicator_for(void*, DType, int64_t, int64_t) {
  throw Error("latentmoe was built without NCCL");
}

void destroy_nccl_comm(void*) noexcept {}

#endif

}  // namespace latentmoe::capi

using namespace latentmoe;
using namespace latentmoe::capi;

extern "C" {

int lmoe_context_create(const lmoe_context_options* options, lmoe_context** out) {
  return guarded([&] {
    require(out, "out");
    *out = nullptr;
    const Placement placement = placement_of(options);
    auto state = new_state(placement, max_tokens_of(options), 1, 0);
    // One rank never communicates (its tails take no collective), so any one-rank group serves, and
    // the context is made now: a missing device shows here rather than at the first layer.
    state->group = std::make_shared<GroupState>();
    state->group->ranks = make_in_process_group(1);
    state->context =
        std::make_unique<RankContext>(state->parallel, *state->group->ranks[0], rank_context_options(*state));
    *out = new_handle(std::move(state));
  });
}

int lmoe_simulated_group_create(int32_t tp, const lmoe_context_options* options, lmoe_context** out) {
  return guarded([&] {
    require(out, "out");
    if (tp < 1 || tp > 64) throw InvalidArgument("tp must be in 1..64, got " + std::to_string(tp));
    for (int32_t r = 0; r < tp; ++r) out[r] = nullptr;
    const Placement placement = placement_of(options);
    const int64_t max_tokens = max_tokens_of(options);
    auto group = std::make_shared<GroupState>();
    group->tp = tp;
    std::vector<std::shared_ptr<ContextState>> states;
    if (placement.device == Device::cuda && tp > 1) {
      check_module_loading();
      group->simulated_gpu = true;
      group->device = placement.index;
    } else {
      group->ranks = make_in_process_group(tp);
    }
    for (int32_t r = 0; r < tp; ++r) {
      auto state = new_state(placement, max_tokens, tp, r);
      state->group = group;
      // Contexts over the in-process group are made now; a simulated GPU group's when its first layer
      // or tail fixes the dtype and width of its collectives.
      if (!group->simulated_gpu) {
        state->context = std::make_unique<RankContext>(state->parallel, *group->ranks[static_cast<size_t>(r)],
                                                       rank_context_options(*state));
      }
      states.push_back(std::move(state));
    }
    for (int32_t r = 0; r < tp; ++r) out[r] = new_handle(std::move(states[static_cast<size_t>(r)]));
  });
}

int lmoe_nccl_unique_id(uint8_t* id, size_t id_size) {
  return guarded([&] {
    require(id, "id");
    if (id_size != LMOE_NCCL_UNIQUE_ID_BYTES) {
      throw InvalidArgument("an ncclUniqueId has " + std::to_string(LMOE_NCCL_UNIQUE_ID_BYTES) + " bytes, got " +
                            std::to_string(id_size));
    }
#if defined(LATENTMOE_WITH_NCCL)
    static_assert(sizeof(ncclUniqueId) == LMOE_NCCL_UNIQUE_ID_BYTES, "ncclUniqueId size");
    check_nccl_version();
    ncclUniqueId unique{};
    check_nccl(ncclGetUniqueId(&unique), "ncclGetUniqueId", nullptr);
    std::memcpy(id, &unique, sizeof(unique));
#else
    throw Error("latentmoe was built without NCCL: no process-group contexts");
#endif
  });
}

int lmoe_nccl_check(void) {
  return guarded([&] {
#if defined(LATENTMOE_WITH_NCCL)
    detail::require_nvls_off();
    check_nccl_version();
#else
    throw Error("latentmoe was built without NCCL: no process-group contexts");
#endif
  });
}

int lmoe_context_create_nccl(const lmoe_context_options* options, int32_t tp, int32_t rank, const uint8_t* id,
                             size_t id_size, lmoe_context** out) {
  return guarded([&] {
    require(out, "out");
    *out = nullptr;
    require(id, "id");
    const Placement placement = placement_of(options);
    const int64_t max_tokens = max_tokens_of(options);
    if (placement.device != Device::cuda) {
      throw InvalidArgument("an NCCL context runs on a CUDA device; on the CPU use a simulated group");
    }
    if (tp < 1 || rank < 0 || rank >= tp) {
      throw InvalidArgument("rank " + std::to_string(rank) + " of tp " + std::to_string(tp) + " is not a rank");
    }
    if (id_size != LMOE_NCCL_UNIQUE_ID_BYTES) {
      throw InvalidArgument("an ncclUniqueId has " + std::to_string(LMOE_NCCL_UNIQUE_ID_BYTES) + " bytes, got " +
                            std::to_string(id_size));
    }
#if defined(LATENTMOE_WITH_NCCL)
    detail::require_nvls_off();
    check_nccl_version();
    ncclUniqueId unique{};
    std::memcpy(&unique, id, sizeof(unique));
    ncclComm_t comm = nullptr;
    {
      CurrentDevice device(placement.index);
      check_nccl(ncclCommInitRank(&comm, tp, unique, rank), "ncclCommInitRank", nullptr);
    }
    auto state = new_state(placement, max_tokens, tp, rank);
    state->nccl_comm = comm;
    state->owns_nccl_comm = true;
    *out = new_handle(std::move(state));
#else
    (void)max_tokens;
    throw Error("latentmoe was built without NCCL: no process-group contexts");
#endif
  });
}

int lmoe_context_create_from_nccl_comm(const lmoe_context_options* options, void* nccl_comm, lmoe_context** out) {
  return guarded([&] {
    require(out, "out");
    *out = nullptr;
    require(nccl_comm, "nccl_comm");
    const Placement placement = placement_of(options);
    const int64_t max_tokens = max_tokens_of(options);
    if (placement.device != Device::cuda) throw InvalidArgument("an NCCL context runs on a CUDA device");
#if defined(LATENTMOE_WITH_NCCL)
    check_nccl_version();
    auto comm = static_cast<ncclComm_t>(nccl_comm);
    int tp = 0, rank = 0, device = -1;
    check_nccl(ncclCommCount(comm, &tp), "ncclCommCount", comm);
    check_nccl(ncclCommUserRank(comm, &rank), "ncclCommUserRank", comm);
    check_nccl(ncclCommCuDevice(comm, &device), "ncclCommCuDevice", comm);
    if (device != placement.index) {
      throw InvalidArgument("the NCCL communicator is on cuda:" + std::to_string(device) + " but the context on " +
                            describe(placement));
    }
    auto state = new_state(placement, max_tokens, tp, rank);
    state->nccl_comm = nccl_comm;
    *out = new_handle(std::move(state));
#else
    (void)max_tokens;
    throw Error("latentmoe was built without NCCL: no process-group contexts");
#endif
  });
}

int lmoe_context_destroy(lmoe_context* context) {
  return guarded([&] { delete context; });
}

int lmoe_context_get_info(const lmoe_context* context, lmoe_context_info* info) {
  return guarded([&] {
    require(context, "context");
    require(info, "info");
    require_struct(info->struct_size, sizeof(lmoe_context_info), "lmoe_context_info");
    const ContextState& state = *context->state;
    info->tp = state.parallel.tp_size;
    info->rank = state.parallel.rank;
    info->device_type = state.placement.device == Device::cpu ? LMOE_DEVICE_CPU : LMOE_DEVICE_CUDA;
    info->device_index = state.placement.index;
    info->max_tokens = state.max_tokens;
    info->num_layers = state.context != nullptr ? state.context->num_layers() : 0;
    info->frozen = state.context != nullptr && state.context->frozen() ? 1 : 0;
  });
}

int lmoe_context_check(lmoe_context* context) {
  return guarded([&] {
    require(context, "context");
    if (context->state->context != nullptr) context->state->context->communicator().check();
  });
}

int lmoe_context_abort(lmoe_context* context) {
  return guarded([&] {
    require(context, "context");
    ContextState& state = *context->state;
    if (state.context != nullptr) {
      state.context->communicator().abort();
    } else if (state.group != nullptr) {
      std::lock_guard<std::mutex> lock(state.group->mutex);
      if (!state.group->ranks.empty()) state.group->ranks[static_cast<size_t>(state.parallel.rank)]->abort();
    }
  });
}

}  // extern "C"

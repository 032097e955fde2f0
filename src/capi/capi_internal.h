// What the C ABI's sources (latentmoe/c_api.h) share: the handles' contents, the error translation
// (C++ exceptions -> status codes and the per-thread message) and the tensor descriptors -> TensorView.
// Built on the public C++ API (include/latentmoe/) into the shared library latentmoe_capi.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "latentmoe/c_api.h"
#include "latentmoe/communicator.h"
#include "latentmoe/error.h"
#include "latentmoe/parallel.h"
#include "latentmoe/rank_context.h"
#include "latentmoe/runner.h"
#include "latentmoe/tail.h"
#include "latentmoe/tensor.h"
#include "latentmoe/tier.h"

namespace latentmoe::capi {

// The caller's input is wrong (LMOE_INVALID_ARGUMENT); every other Error is LMOE_RUNTIME_ERROR.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// Runs `body`, turning an Error it throws into InvalidArgument: for the library's own validation steps
// (config parsing, weight validation, Runner::check_forward), whose failures are the caller's input.
template <class Body>
auto as_invalid_argument(Body&& body) -> decltype(body()) {
  try {
    return body();
  } catch (const InvalidArgument&) {
    throw;
  } catch (const Error& error) {
    throw InvalidArgument(error.what());
  }
}

void set_last_error(const char* message);
const char* last_error_text();
// NCCL_VERSION_CODE latentmoe was built against (0 without NCCL).
int built_nccl_version_code();

// The status of `body`: LMOE_OK, or the failure's code with its message kept for lmoe_last_error().
template <class Body>
int guarded(Body&& body) noexcept {
  try {
    body();
    return LMOE_OK;
  } catch (const InvalidArgument& error) {
    set_last_error(error.what());
    return LMOE_INVALID_ARGUMENT;
  } catch (const std::bad_alloc&) {
    set_last_error("out of host memory");
    return LMOE_RUNTIME_ERROR;
  } catch (const std::exception& error) {
    set_last_error(error.what());
    return LMOE_RUNTIME_ERROR;
  } catch (...) {
    set_last_error("unknown C++ exception");
    return LMOE_RUNTIME_ERROR;
  }
}

// Throws InvalidArgument naming `what` unless `pointer` is set.
void require(const void* pointer, const char* what);
// Throws InvalidArgument unless `size` (a struct's struct_size) covers `expected` bytes.
void require_struct(uint32_t size, size_t expected, const char* what);

DType dtype_from_code(int32_t code, const char* what);
int32_t dtype_code(DType dtype);
std::optional<TailTier> tier_from_code(int32_t code);
int32_t tier_code(TailTier tier);

// Where a context's tensors live.
struct Placement {
  Device device = Device::cpu;
  int index = 0;
};
std::string describe(const Placement& placement);

// `tensor` as a view (undefined when null or ndim 0). Refuses, naming `what`: a bad dtype or device code,
// ndim outside 1..4, negative extents, a non-contiguous layout, and a device other than the context's
// (a host tensor is allowed where `host_allowed`: weights, which are copied to the device).
TensorView view_of(const lmoe_tensor* tensor, const char* what, const Placement& context, bool host_allowed);

// Writes `text` NUL-terminated into out[0..out_size) when it fits; *needed gets its size with the NUL.
void write_text(const std::string& text, char* out, size_t out_size, size_t* needed);

// The tier policy of a layer or tail: tuned_policy's for the layout, then the caller's fields that are set.
TierPolicy policy_for(const lmoe_tier_policy* policy, int tp, DType dtype, int64_t hidden_size, int64_t latent_size,
                      const std::string& device_name);
std::string describe_tiers(const TierSupport& support);

// A group of communicators made in one piece and shared by its ranks' contexts: the in-process group, or
// a simulated GPU group made when the first layer or tail of any rank is built (its buffers are sized for
// the layer's dtype and width).
struct GroupState {
  int tp = 1;
  std::mutex mutex;
  std::vector<std::unique_ptr<Communicator>> ranks;
  // Simulated GPU groups only: the device, and the dtype/width it was made for (none until then).
  bool simulated_gpu = false;
  int device = 0;
};

// One rank: its communicator and its latentmoe::RankContext (made at construction, or for GPU groups at
// the first layer or tail, which fixes the group's dtype and one-shot capacity).
struct ContextState {
  ~ContextState();

  // The rank's context, made now if needed for a layer or tail of `dtype` whose collectives carry
  // `per_token` (d + l) elements per token.
  RankContext& ensure(DType dtype, int64_t per_token);
  // The GPU's name where each rank has a GPU of its own (NCCL), for the built-in tune tables; else empty.
  std::string policy_device() const;

  Placement placement;
  int64_t max_tokens = 0;
  ParallelConfig parallel;
  std::shared_ptr<GroupState> group;  // in-process or simulated GPU group; null for NCCL
  // NCCL: the communicator (owned when the context initialised it) and latentmoe's over it.
  void* nccl_comm = nullptr;
  bool owns_nccl_comm = false;
  std::unique_ptr<Communicator> nccl_communicator;
  std::unique_ptr<RankContext> context;
};

// The simulated GPU group's one-shot buffers, made by the first rank that needs them.
Communicator& simulated_gpu_communicator(GroupState& group, int rank, DType dtype, int64_t per_token,
                                         int64_t max_tokens);
// NCCL: latentmoe's communicator over `comm` (collective; latentmoe/nccl_group.h), and the comm's end.
std::unique_ptr<Communicator> nccl_communicator_for(void* comm, DType dtype, int64_t per_token, int64_t max_tokens);
void destroy_nccl_comm(void* comm) noexcept;

}  // namespace latentmoe::capi

// The handles. Each holds its context's state, so that destruction order does not matter.
struct lmoe_context {
  std::shared_ptr<latentmoe::capi::ContextState> state;
};

struct lmoe_layer {
  std::shared_ptr<latentmoe::capi::ContextState> context;
  std::unique_ptr<latentmoe::Runner> runner;
  int64_t hidden_size = 0, latent_size = 0, top_k = 0, num_router_outputs = 0;
  bool has_gate = false;
};

struct lmoe_tail {
  std::shared_ptr<latentmoe::capi::ContextState> context;
  std::unique_ptr<latentmoe::Tail> tail;
  int64_t hidden_size = 0, latent_size = 0;
};

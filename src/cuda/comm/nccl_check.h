// Error checking for NCCL calls: every failure becomes a latentmoe::Error naming the call, the source
// location, NCCL's error string and its last error message. Host-only; needs nccl.h (CUDA builds with
// NCCL only).
#pragma once

#include <nccl.h>

#include <string>

#include "latentmoe/error.h"

namespace latentmoe::cuda {

[[noreturn]] inline void throw_nccl_error(ncclResult_t status, ncclComm_t comm, const char* call, const char* file,
                                          int line) {
  const char* last = ncclGetLastError(comm);
  const std::string detail = last != nullptr && *last != '\0' ? std::string(" (") + last + ")" : std::string();
  ::latentmoe::detail::throw_error("NCCL error in ", call, " at ", file, ":", line, ": ", ncclGetErrorString(status),
                                   detail);
}

inline void check_nccl(ncclResult_t status, ncclComm_t comm, const char* call, const char* file, int line) {
  if (status != ncclSuccess) throw_nccl_error(status, comm, call, file, line);
}

}  // namespace latentmoe::cuda

// LATENTMOE_NCCL_CHECK(comm, ncclAllReduce(...)) throws latentmoe::Error when the call fails; `comm` (may
// be nullptr) names the communicator whose last error the message quotes.
#define LATENTMOE_NCCL_CHECK(comm, call) ::latentmoe::cuda::check_nccl((call), (comm), #call, __FILE__, __LINE__)

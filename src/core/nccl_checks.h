// The host-side decisions of the NCCL GPU group that need no GPU and no NCCL header, so that they
// are unit-tested on the CPU (tests/test_nccl_checks.cpp): the library version check, the NVLink
// multicast (NVLS) setting, and where a GPU group's ranks are placed.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "latentmoe/gpu_group.h"

namespace latentmoe::detail {

// "2.28.9" for NCCL's version code (major * 10000 + minor * 100 + patch from 2.9 on, major * 1000 +
// minor * 100 + patch before).
std::string nccl_version_text(int code);

// NCCL's device API (the symmetric-window pointers latentmoe reads) has no ABI compatibility across
// releases: the libnccl a process loaded (ncclGetVersion) must be the release latentmoe was compiled
// against (NCCL_VERSION_CODE). nullopt when they match, else the whole Error message: both versions and
// what to do.
std::optional<std::string> nccl_version_mismatch(int loaded_code, int built_code);

// What to do with NCCL_NVLS_ENABLE (`value`: the environment's, nullptr when unset). latentmoe keeps
// NVLink multicast off: `library_initialises` (the library calls ncclCommInitRank itself): unset ->
// set it to "0" before NCCL starts; "0" -> keep; anything else -> refuse. A communicator the caller
// created (one process per GPU) was initialised before latentmoe saw it, so there "0" is required.
struct NvlsDecision {
  bool set_zero = false;             // setenv("NCCL_NVLS_ENABLE", "0") before the first NCCL call
  std::optional<std::string> error;  // refuse, with this message
};
NvlsDecision nvls_decision(const char* value, bool library_initialises);

// Why NCCL groups cannot run in this process (built without NCCL, or the loaded libnccl is not the release
// latentmoe was built against: nccl_version_mismatch's message); empty when they can. Never throws.
std::string nccl_problem();

// Where a GPU group of `tp_size` ranks runs, given what the machine has: `devices` needs at least
// tp_size GPUs with peer access between every pair (`peers_ok`) and usable NCCL (`nccl_problem` empty);
// `automatic` takes devices when they are there and simulated ranks on GPU 0 otherwise. Throws Error
// when `requested` is devices and it cannot be had (naming why). `why` receives one line for people.
GpuPlacement choose_gpu_placement(GpuPlacement requested, int tp_size, int device_count, bool peers_ok,
                                  const std::string& nccl_problem, std::string* why);

}  // namespace latentmoe::detail

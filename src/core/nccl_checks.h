// The host-side decisions of the NCCL GPU group that need no GPU and no NCCL header, so that they
// are unit-tested on the CPU (tests/test_nccl_checks.cpp): the library version check, the NVLink
// multicast (NVLS) setting, and where a GPU group's ranks are placed.
#pragma once

#include <cstdint>
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

// NVLink multicast (NVLS) stays off in every NCCL communicator latentmoe uses (it can put GPUs shared
// with others out of service), and latentmoe sets no NCCL variable: the process sets NCCL_NVLS_ENABLE=0
// before NCCL starts (the latentmoe tool does for itself). `value`: the variable as the settings registry
// read it, nullopt when unset. nullopt when it is 0, else the whole Error message: unset is refused like
// 1 or 2, since NCCL's default uses multicast where the GPUs have it.
std::optional<std::string> nvls_problem(std::optional<int64_t> value);
// Reads NCCL_NVLS_ENABLE (core/settings.h) and throws Error unless it is 0; every NCCL group calls it when
// it is built, before its first NCCL call.
void require_nvls_off();

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

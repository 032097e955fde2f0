// One process per GPU (inference engines): this rank's latentmoe communicator over the caller's NCCL
// communicator. Only for the CUDA build with NCCL (it includes nccl.h); latentmoe/gpu_group.h says what
// the group does, docs/ARCHITECTURE.md ("Ranks on the GPU") how.
//
//   ncclComm_t comm = ...;  // the engine's, initialised with NCCL_NVLS_ENABLE=0 in the environment
//   latentmoe::GpuGroupOptions options;
//   options.dtype = latentmoe::DType::bf16;
//   latentmoe::size_nccl_group(options, 4096, d + l, latentmoe::default_one_shot_tokens(tp));
//                                // one-shot up to 64 tokens (latentmoe/gpu_group.h), NCCL above, up to 4096
//   auto communicator = latentmoe::make_nccl_communicator(comm, options);  // collective: every rank calls it
//   latentmoe::Runner runner(config, parallel, weights, *communicator, runner_options);
#pragma once

#include <nccl.h>

#include <memory>

#include "latentmoe/communicator.h"
#include "latentmoe/gpu_group.h"

namespace latentmoe {

// Collective over `comm`'s ranks (each process calls it with its own communicator, before any capture):
// allocates this rank's receive area with ncclMemAlloc, registers it as a symmetric window
// (ncclCommWindowRegister, NCCL_WIN_COLL_SYMMETRIC) and reads every peer's pointer once through NCCL's
// device API. The rank, the size and the GPU are `comm`'s (options.device is ignored); `comm` is not
// owned and must outlive the returned communicator, whose destruction (collective too: the window is
// deregistered) must come before ncclCommDestroy. abort() releases this rank's one-shot waits and
// revokes `comm` (ncclCommRevoke); the peers' waits end at their timeout. Throws Error when
// NCCL_NVLS_ENABLE is not 0 in this process's environment (unset included: `comm` was then initialised
// with NVLink multicast where the GPUs have it), on a version mismatch (latentmoe/gpu_group.h), or when
// NCCL fails.
std::unique_ptr<Communicator> make_nccl_communicator(ncclComm_t comm, const GpuGroupOptions& options);

}  // namespace latentmoe

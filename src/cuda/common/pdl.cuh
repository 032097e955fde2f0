// Programmatic dependent launch (sm_90 and later): consecutive kernels of one stream overlap the
// next kernel's launch and prologue with the previous kernel's tail.
//
// Protocol, which every kernel launched with launch_dependent() follows:
//   1. Before pdl_wait() a kernel reads only data no kernel of this forward writes (weights), or data
//      written two or more kernels earlier (see 3).
//   2. pdl_wait() returns once the previous kernel of the stream has completed and its writes are
//      visible. Every CTA calls it before it reads what that kernel wrote, writes anything, or exits.
//   3. A kernel calls pdl_trigger() only after its own pdl_wait() (or, when it is never launched as a
//      dependent, anywhere): so once all of its CTAs have triggered, everything before it has
//      completed, and the kernel launched after it may start its prologue (1.).
// Without the launch attribute (older GPUs, or a launch with <<<>>>) both instructions are no-ops,
// and a dependent launched after a kernel that never triggers starts when that kernel completes.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "cuda/common/cuda_check.h"

namespace latentmoe::cuda {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Whether the current device runs programmatic dependent launches (compute capability 9.0 or later).
bool pdl_supported();

// Launches `kernel` on `stream`, as a programmatic dependent of the previous kernel when `programmatic`
// (the caller has checked pdl_supported()), in clusters of `cluster` CTAs along x when cluster > 1
// (sm_90+; grid.x a multiple of it). Throws latentmoe::Error naming `what` if the launch fails.
template <class... Params, class... Args>
void launch_kernel_clustered(const char* what, bool programmatic, unsigned cluster, void (*kernel)(Params...),
                             dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  cudaLaunchAttribute attributes[2];
  unsigned count = 0;
  if (programmatic) {
    attributes[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[count].val.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  if (cluster > 1) {
    attributes[count].id = cudaLaunchAttributeClusterDimension;
    attributes[count].val.clusterDim.x = cluster;
    attributes[count].val.clusterDim.y = 1;
    attributes[count].val.clusterDim.z = 1;
    ++count;
  }
  config.attrs = attributes;
  config.numAttrs = count;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    ::latentmoe::detail::throw_error("launch of ", what, " failed: ", cudaGetErrorString(err));
  }
}

// launch_kernel_clustered without clusters.
template <class... Params, class... Args>
void launch_kernel(const char* what, bool programmatic, void (*kernel)(Params...), dim3 grid, dim3 block,
                   size_t shared_bytes, cudaStream_t stream, Args&&... args) {
  launch_kernel_clustered(what, programmatic, 1, kernel, grid, block, shared_bytes, stream,
                          std::forward<Args>(args)...);
}

// launch_kernel as a programmatic dependent wherever the device supports it.
template <class... Params, class... Args>
void launch_dependent(const char* what, void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
                      cudaStream_t stream, Args&&... args) {
  launch_kernel(what, pdl_supported(), kernel, grid, block, shared_bytes, stream, std::forward<Args>(args)...);
}

}  // namespace latentmoe::cuda

// MXFP4 codes on the device into the kernel order (core/mxfp4_kernel_order.h, docs/MXFP4.md "The kernel order"),
// in place: what the runner runs on the expert codes it copies to the GPU, and the public
// mxfp4_to_kernel_order (latentmoe/runner.h) on codes an engine keeps on the GPU itself.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace latentmoe::cuda {

// Permutes the bits of each little-endian 32-bit word of `codes` (device memory, `bytes` bytes, 4-byte aligned, a
// multiple of 4) from the canonical order to the kernel order. Enqueued on `stream`. Throws Error on a length or
// an address that is not whole aligned words.
void mxfp4_codes_to_kernel_order(void* codes, size_t bytes, cudaStream_t stream);

}  // namespace latentmoe::cuda

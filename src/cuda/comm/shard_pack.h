// Packing between latentmoe's column-block shards and NCCL's contiguous chunks (src/core/shard_layout.h
// gives the layout and the host reference): around ncclReduceScatter and ncclAllGather at rows > 1.
// Host interface; includable from C++.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace latentmoe::cuda {

// packed [size][rows][cols/size] <- the column blocks of in [rows, cols] (row stride ld_in elements);
// elements of 2 or 4 bytes. Enqueued on `stream`; no-op for an empty tensor.
void launch_pack_column_blocks(const void* in, int64_t ld_in, int64_t rows, int64_t cols, int size,
                               size_t element_bytes, void* packed, cudaStream_t stream);

// out [rows, cols] (row stride ld_out) <- packed [size][rows][cols/size].
void launch_unpack_column_blocks(const void* packed, int64_t rows, int64_t cols, int size, size_t element_bytes,
                                 void* out, int64_t ld_out, cudaStream_t stream);

}  // namespace latentmoe::cuda

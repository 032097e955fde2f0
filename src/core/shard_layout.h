// The two shard layouts of a row-major [rows, cols] tensor split over `size` ranks, and the packing
// between them. latentmoe's communicators give rank r the column block [r * cols/size, (r+1) *
// cols/size) of every row (latentmoe/communicator.h); NCCL's reduce-scatter and all-gather give rank r
// the r-th contiguous chunk of the buffer, which for rows > 1 is a block of rows. The NCCL group
// therefore packs column blocks into consecutive chunks ([size][rows][cols/size]) before
// ncclReduceScatter and unpacks after ncclAllGather. Header-only; the index map is shared by the
// pack kernels (src/cuda/comm/shard_pack.cu) and the host reference below (tests/test_nccl_checks.cpp).
#pragma once

#include <cstdint>
#include <cstring>

#include "latentmoe/host_device.h"

namespace latentmoe::detail {

// Where element (row, col) of [rows, cols] lands in the packed [size][rows][cols/size] buffer.
LATENTMOE_HOST_DEVICE inline int64_t packed_index(int64_t row, int64_t col, int64_t rows, int64_t cols, int size) {
  const int64_t chunk = cols / size;
  const int64_t block = col / chunk;
  return block * rows * chunk + row * chunk + (col - block * chunk);
}

// Host reference: `packed` [size][rows][cols/size] <- column blocks of `in` [rows, cols] (row stride
// ld_in elements), elements of `element_bytes` bytes.
inline void pack_column_blocks_host(const void* in, int64_t ld_in, int64_t rows, int64_t cols, int size,
                                    size_t element_bytes, void* packed) {
  for (int64_t row = 0; row < rows; ++row)
    for (int64_t col = 0; col < cols; ++col)
      std::memcpy(static_cast<char*>(packed) + packed_index(row, col, rows, cols, size) * element_bytes,
                  static_cast<const char*>(in) + (row * ld_in + col) * element_bytes, element_bytes);
}

// Host reference: `out` [rows, cols] (row stride ld_out) <- the packed [size][rows][cols/size] buffer.
inline void unpack_column_blocks_host(const void* packed, int64_t rows, int64_t cols, int size, size_t element_bytes,
                                      void* out, int64_t ld_out) {
  for (int64_t row = 0; row < rows; ++row)
    for (int64_t col = 0; col < cols; ++col)
      std::memcpy(static_cast<char*>(out) + (row * ld_out + col) * element_bytes,
                  static_cast<const char*>(packed) + packed_index(row, col, rows, cols, size) * element_bytes,
                  element_bytes);
}

}  // namespace latentmoe::detail

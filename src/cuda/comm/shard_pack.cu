// The pack and unpack kernels of shard_pack.h: plain element copies through the index map of
// src/core/shard_layout.h (one definition of the layout for the kernels and the host reference).
#include <algorithm>

#include "core/shard_layout.h"
#include "cuda/comm/shard_pack.h"
#include "cuda/common/cuda_check.h"
#include "latentmoe/error.h"

namespace latentmoe::cuda {
namespace {

constexpr int kThreads = 256;

// Grid-stride over the rows x cols elements of the unpacked tensor, in row-major order (coalesced on
// the strided side); each element moves between (row, col) and its packed index. No shared state.
template <class Word, bool kPack>
__global__ void __launch_bounds__(kThreads)
    column_blocks_kernel(const Word* from, Word* to, int64_t ld, int64_t rows, int64_t cols, int size) {
  const int64_t total = rows * cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t row = i / cols, col = i % cols;
    const int64_t packed = ::latentmoe::detail::packed_index(row, col, rows, cols, size);
    if constexpr (kPack) {
      to[packed] = from[row * ld + col];
    } else {
      to[row * ld + col] = from[packed];
    }
  }
}

template <bool kPack>
void launch(const void* from, void* to, int64_t ld, int64_t rows, int64_t cols, int size, size_t element_bytes,
            cudaStream_t stream) {
  LATENTMOE_CHECK(size >= 1 && cols % size == 0, "column-block packing: ", cols, " columns do not split over ", size,
                  " ranks");
  LATENTMOE_CHECK(element_bytes == 2 || element_bytes == 4, "column-block packing: elements of ", element_bytes,
                  " bytes (2 or 4 expected)");
  LATENTMOE_CHECK(ld >= cols, "column-block packing: row stride ", ld, " is shorter than the ", cols, " columns");
  if (rows == 0 || cols == 0) return;
  const int blocks = static_cast<int>(std::min<int64_t>((rows * cols + kThreads - 1) / kThreads, 1024));
  if (element_bytes == 2) {
    column_blocks_kernel<uint16_t, kPack><<<blocks, kThreads, 0, stream>>>(
        static_cast<const uint16_t*>(from), static_cast<uint16_t*>(to), ld, rows, cols, size);
  } else {
    column_blocks_kernel<uint32_t, kPack><<<blocks, kThreads, 0, stream>>>(
        static_cast<const uint32_t*>(from), static_cast<uint32_t*>(to), ld, rows, cols, size);
  }
  LATENTMOE_CUDA_CHECK_LAUNCH("column_blocks_kernel");
}

}  // namespace

void launch_pack_column_blocks(const void* in, int64_t ld_in, int64_t rows, int64_t cols, int size,
                               size_t element_bytes, void* packed, cudaStream_t stream) {
  launch<true>(in, packed, ld_in, rows, cols, size, element_bytes, stream);
}

void launch_unpack_column_blocks(const void* packed, int64_t rows, int64_t cols, int size, size_t element_bytes,
                                 void* out, int64_t ld_out, cudaStream_t stream) {
  launch<false>(packed, out, ld_out, rows, cols, size, element_bytes, stream);
}

}  // namespace latentmoe::cuda

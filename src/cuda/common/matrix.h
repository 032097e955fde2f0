// The device matrix view every launcher takes, and the small host helpers of launch shapes.
// Host-only; includable from C++.
#pragma once

#include <cstddef>
#include <cstdint>

#include "latentmoe/dtype.h"

namespace latentmoe::cuda {

// A row-major matrix on the device: element (r, c) at data[r * ld + c] of `dtype`.
struct RowMatrix {
  void* data = nullptr;
  DType dtype = DType::f32;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t ld = 0;
};

// True when `pointer` and every row start (`ld` elements apart) are aligned to `bytes`.
inline bool rows_aligned(const void* pointer, int64_t ld, size_t element_size, size_t bytes) {
  return reinterpret_cast<uintptr_t>(pointer) % bytes == 0 && (static_cast<size_t>(ld) * element_size) % bytes == 0;
}

// Blocks for a grid-stride loop over `work_items` items with `threads` threads per block.
int grid_for(int64_t work_items, int threads);

}  // namespace latentmoe::cuda

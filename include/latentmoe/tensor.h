// A small non-owning tensor view (pointer, dtype, shape, strides, device) and an owning host tensor.
// Views carry strides so that a column block of a row-major matrix (a tp shard of the hidden
// dimension) can be passed without a copy; most operations require the last dimension contiguous.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "latentmoe/dtype.h"

namespace latentmoe {

enum class Device : uint8_t { cpu, cuda };

// "[3, 17]": how every message names a shape.
std::string shape_string(const std::vector<int64_t>& shape);

class TensorView {
 public:
  static constexpr int kMaxRank = 4;

  TensorView() = default;
  // A contiguous row-major view.
  TensorView(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device = Device::cpu);
  TensorView(void* data, DType dtype, const std::vector<int64_t>& shape, Device device = Device::cpu);

  // A default-constructed view (rank 0) stands for "no tensor".
  bool defined() const { return rank_ > 0; }
  void* data() const { return data_; }
  template <class T>
  T* data_as() const {
    return static_cast<T*>(data_);
  }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  int rank() const { return rank_; }
  int64_t size(int dim) const { return shape_[dim]; }
  int64_t stride(int dim) const { return strides_[dim]; }
  std::vector<int64_t> shape() const { return {shape_.begin(), shape_.begin() + rank_}; }
  int64_t numel() const;
  bool is_contiguous() const;
  // "[3, 17]"
  std::string shape_string() const;

  // Rows [begin, end) of dimension 0 (a pointer offset, still contiguous if this was).
  TensorView slice_rows(int64_t begin, int64_t end) const;
  // Columns [begin, end) of the last dimension of a rank-2 view (strided: row stride unchanged).
  TensorView slice_cols(int64_t begin, int64_t end) const;
  // The same memory with a new contiguous shape of equal numel (this view must be contiguous).
  TensorView reshaped(std::initializer_list<int64_t> shape) const;

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::f32;
  Device device_ = Device::cpu;
  int rank_ = 0;
  std::array<int64_t, kMaxRank> shape_{};
  std::array<int64_t, kMaxRank> strides_{};
};

// Owning, contiguous, 64-byte aligned host memory. Zero-initialised.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::vector<int64_t> shape);

  TensorView view() const;
  void* data() const { return storage_.get(); }
  template <class T>
  T* data_as() const {
    return reinterpret_cast<T*>(storage_.get());
  }
  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t size(int dim) const { return shape_.at(dim); }
  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  bool defined() const { return storage_ != nullptr; }

 private:
  struct FreeAligned {
    void operator()(std::byte* pointer) const;
  };
  DType dtype_ = DType::f32;
  std::vector<int64_t> shape_;
  std::unique_ptr<std::byte, FreeAligned> storage_;
};

// Copies `src` into a new contiguous host tensor of `dtype`, converting element by element
// (compute dtypes only; same-dtype copies of any dtype are byte copies). src must be on the CPU.
HostTensor to_host_tensor(const TensorView& src, DType dtype);
// Copies element values between two host views of equal shape, converting dtypes (compute dtypes).
void copy_convert(const TensorView& src, const TensorView& dst);

}  // namespace latentmoe

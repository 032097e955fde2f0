#include "latentmoe/tensor.h"

#include <cstdlib>
#include <cstring>
#include <sstream>

#include "latentmoe/error.h"

namespace latentmoe {
namespace {

void set_contiguous(int rank, const int64_t* shape, std::array<int64_t, TensorView::kMaxRank>& shape_out,
                    std::array<int64_t, TensorView::kMaxRank>& strides_out) {
  int64_t stride = 1;
  for (int dim = rank - 1; dim >= 0; --dim) {
    LATENTMOE_CHECK(shape[dim] >= 0, "tensor dimension ", dim, " is negative (", shape[dim], ")");
    shape_out[dim] = shape[dim];
    strides_out[dim] = stride;
    stride *= shape[dim];
  }
}

}  // namespace

TensorView::TensorView(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device)
    : TensorView(data, dtype, std::vector<int64_t>(shape), device) {}

TensorView::TensorView(void* data, DType dtype, const std::vector<int64_t>& shape, Device device)
    : data_(data), dtype_(dtype), device_(device), rank_(static_cast<int>(shape.size())) {
  LATENTMOE_CHECK(rank_ >= 1 && rank_ <= kMaxRank, "tensor rank ", rank_, " is outside 1..", kMaxRank);
  set_contiguous(rank_, shape.data(), shape_, strides_);
}

int64_t TensorView::numel() const {
  if (rank_ == 0) return 0;
  int64_t count = 1;
  for (int dim = 0; dim < rank_; ++dim) count *= shape_[dim];
  return count;
}

bool TensorView::is_contiguous() const {
  int64_t expected = 1;
  for (int dim = rank_ - 1; dim >= 0; --dim) {
    if (shape_[dim] != 1 && strides_[dim] != expected) return false;
    expected *= shape_[dim];
  }
  return true;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << '[';
  for (size_t dim = 0; dim < shape.size(); ++dim) out << (dim ? ", " : "") << shape[dim];
  out << ']';
  return out.str();
}

std::string TensorView::shape_string() const { return latentmoe::shape_string(shape()); }

TensorView TensorView::slice_rows(int64_t begin, int64_t end) const {
  LATENTMOE_CHECK(rank_ >= 1 && 0 <= begin && begin <= end && end <= shape_[0], "row slice [", begin, ", ", end,
                  ") is outside a tensor of shape ", shape_string());
  TensorView result = *this;
  result.data_ = static_cast<std::byte*>(data_) + begin * strides_[0] * static_cast<int64_t>(dtype_size(dtype_));
  result.shape_[0] = end - begin;
  return result;
}

TensorView TensorView::slice_cols(int64_t begin, int64_t end) const {
  LATENTMOE_CHECK(rank_ == 2 && 0 <= begin && begin <= end && end <= shape_[1], "column slice [", begin, ", ", end,
                  ") is outside a tensor of shape ", shape_string());
  TensorView result = *this;
  result.data_ = static_cast<std::byte*>(data_) + begin * strides_[1] * static_cast<int64_t>(dtype_size(dtype_));
  result.shape_[1] = end - begin;
  return result;
}

TensorView TensorView::reshaped(std::initializer_list<int64_t> shape) const {
  LATENTMOE_CHECK(is_contiguous(), "cannot reshape a non-contiguous tensor of shape ", shape_string());
  TensorView result(data_, dtype_, shape, device_);
  LATENTMOE_CHECK(result.numel() == numel(), "cannot reshape ", shape_string(), " to ", result.shape_string());
  return result;
}

void HostTensor::FreeAligned::operator()(std::byte* pointer) const { std::free(pointer); }

HostTensor::HostTensor(DType dtype, std::vector<int64_t> shape) : dtype_(dtype), shape_(std::move(shape)) {
  int64_t count = 1;
  for (int64_t extent : shape_) {
    LATENTMOE_CHECK(extent >= 0, "tensor dimension is negative (", extent, ")");
    LATENTMOE_CHECK(extent == 0 || count <= (int64_t{1} << 50) / extent, "tensor is too large");
    count *= extent;
  }
  size_t bytes = static_cast<size_t>(count) * dtype_size(dtype_);
  size_t rounded = (bytes + 63) / 64 * 64;
  if (rounded == 0) rounded = 64;
  auto* pointer = static_cast<std::byte*>(std::aligned_alloc(64, rounded));
  LATENTMOE_CHECK(pointer != nullptr, "out of host memory allocating ", bytes, " bytes");
  std::memset(pointer, 0, rounded);
  storage_.reset(pointer);
}

int64_t HostTensor::numel() const {
  int64_t count = 1;
  for (int64_t extent : shape_) count *= extent;
  return count;
}

TensorView HostTensor::view() const {
  LATENTMOE_CHECK(defined(), "use of an empty host tensor");
  if (shape_.empty()) return TensorView(storage_.get(), dtype_, {1});
  return TensorView(storage_.get(), dtype_, shape_);
}

void copy_convert(const TensorView& src, const TensorView& dst) {
  LATENTMOE_CHECK(src.device() == Device::cpu && dst.device() == Device::cpu, "copy_convert needs host tensors");
  LATENTMOE_CHECK(src.shape() == dst.shape(), "copy_convert: shape ", src.shape_string(), " vs ", dst.shape_string());
  const int64_t count = src.numel();
  if (src.dtype() == dst.dtype() && src.is_contiguous() && dst.is_contiguous()) {
    std::memcpy(dst.data(), src.data(), static_cast<size_t>(count) * dtype_size(src.dtype()));
    return;
  }
  LATENTMOE_CHECK(is_compute_dtype(src.dtype()) && is_compute_dtype(dst.dtype()), "cannot convert ",
                  dtype_name(src.dtype()), " to ", dtype_name(dst.dtype()));
  // Walk both views in row-major index order (handles strided views of rank <= 4).
  const int rank = src.rank();
  std::array<int64_t, TensorView::kMaxRank> index{};
  for (int64_t flat = 0; flat < count; ++flat) {
    int64_t src_offset = 0, dst_offset = 0;
    for (int dim = 0; dim < rank; ++dim) {
      src_offset += index[dim] * src.stride(dim);
      dst_offset += index[dim] * dst.stride(dim);
    }
    store_from_float(dst.data(), dst.dtype(), dst_offset, load_as_float(src.data(), src.dtype(), src_offset));
    for (int dim = rank - 1; dim >= 0; --dim) {
      if (++index[dim] < src.size(dim)) break;
      index[dim] = 0;
    }
  }
}

HostTensor to_host_tensor(const TensorView& src, DType dtype) {
  HostTensor result(dtype, src.shape());
  copy_convert(src, result.view());
  return result;
}

}  // namespace latentmoe

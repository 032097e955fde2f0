// The device conversion of MXFP4 codes into the kernel order (issue 31; src/cuda/kernels/mxfp4_order.cu and the
// public mxfp4_to_kernel_order of latentmoe/runner.h): the same bytes as the host conversion (latentmoe/mxfp4.h)
// for buffers the 16-byte kernel takes and for those only the 4-byte one takes, on the caller's stream, and the
// refusals (a length or an address that is not whole words, host memory, not U8).
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "cuda/kernels/mxfp4_order.h"
#include "cuda_test_util.h"
#include "error_test_util.h"
#include "latentmoe/mxfp4.h"
#include "latentmoe/random.h"
#include "latentmoe/runner.h"

namespace latentmoe::cuda::testing {
namespace {

using latentmoe::testing::expect_error;

std::vector<uint8_t> random_bytes(size_t count, uint64_t seed) {
  SplitMix64 rng(seed);
  std::vector<uint8_t> bytes(count);
  for (uint8_t& byte : bytes) byte = static_cast<uint8_t>(rng.next());
  return bytes;
}

TEST(Cuda_Mxfp4KernelOrder, the_device_conversion_matches_the_host_one) {
  LATENTMOE_REQUIRE_GPU();
  auto backend = ::latentmoe::detail::make_cuda_backend(0);
  const auto stream = static_cast<cudaStream_t>(backend->stream());
  // Whole 16-byte words, a length that is only whole 4-byte words, one word; at offset 0 (16-byte aligned) and 4.
  for (size_t bytes : {size_t{16} * 4099, size_t{4} * 1001, size_t{4}}) {
    for (size_t offset : {size_t{0}, size_t{4}}) {
      const std::vector<uint8_t> host = random_bytes(bytes + offset, bytes + offset);
      HostTensor source(DType::u8, {static_cast<int64_t>(host.size())});
      std::copy(host.begin(), host.end(), source.data_as<uint8_t>());
      DeviceTensor device = upload(*backend, source);
      uint8_t* codes = device.view.data_as<uint8_t>() + offset;
      mxfp4_codes_to_kernel_order(codes, bytes, stream);
      std::vector<uint8_t> expected = host;
      ::latentmoe::mxfp4_codes_to_kernel_order(expected.data() + offset, bytes);  // the host's (latentmoe/mxfp4.h)
      const HostTensor got = download(*backend, device.view);
      EXPECT_TRUE(std::equal(expected.begin(), expected.end(), got.data_as<uint8_t>()))
          << bytes << " bytes at offset " << offset;
    }
  }
  // The public entry on a tensor, on the backend's stream.
  const std::vector<uint8_t> host = random_bytes(4096, 7);
  HostTensor source(DType::u8, {64, 64});
  std::copy(host.begin(), host.end(), source.data_as<uint8_t>());
  DeviceTensor device = upload(*backend, source);
  ::latentmoe::mxfp4_to_kernel_order(device.view, stream);
  std::vector<uint8_t> expected = host;
  ::latentmoe::mxfp4_codes_to_kernel_order(expected.data(), expected.size());
  const HostTensor got = download(*backend, device.view);
  EXPECT_TRUE(std::equal(expected.begin(), expected.end(), got.data_as<uint8_t>()));
}

TEST(Cuda_Mxfp4KernelOrder, what_is_not_whole_words_of_device_codes_is_refused) {
  LATENTMOE_REQUIRE_GPU();
  auto backend = ::latentmoe::detail::make_cuda_backend(0);
  DeviceTensor device = device_empty(*backend, DType::u8, {64});
  expect_error([&] { mxfp4_codes_to_kernel_order(device.view.data(), 6, nullptr); }, {"6 bytes", "32-bit words"});
  expect_error([&] { mxfp4_codes_to_kernel_order(device.view.data_as<uint8_t>() + 2, 8, nullptr); },
               {"not 4-byte aligned"});
  expect_error(
      [&] { ::latentmoe::mxfp4_to_kernel_order(TensorView(device.view.data(), DType::u8, {6}, Device::cuda)); },
      {"6 bytes"});
  expect_error(
      [&] { ::latentmoe::mxfp4_to_kernel_order(TensorView(device.view.data(), DType::bf16, {8}, Device::cuda)); },
      {"MXFP4 codes are U8"});
  std::vector<uint8_t> host(16);
  expect_error([&] { ::latentmoe::mxfp4_to_kernel_order(TensorView(host.data(), DType::u8, {16})); },
               {"the codes are on the host"});
  // Host memory marked as on the GPU.
  expect_error([&] { ::latentmoe::mxfp4_to_kernel_order(TensorView(host.data(), DType::u8, {16}, Device::cuda)); },
               {"not in CUDA device memory"});
}

}  // namespace
}  // namespace latentmoe::cuda::testing

// A check shared by the GPU-group tests (simulated and NCCL): the fused AR + RMSNorm kernel of a
// one-rank group, launched through the group's peer struct, against the norm computed on the host.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>

#include "cuda/comm/lamport_communicator.h"
#include "cuda_test_util.h"

namespace latentmoe::cuda::testing {

// input [rows, cols] bf16, gamma [cols] f32, eps 1e-5; `device` makes and reads the tensors.
inline void expect_one_rank_fused_norm(Communicator& comm, Backend& device, cudaStream_t stream,
                                       const HostTensor& input, const HostTensor& gamma) {
  const int64_t rows = input.size(0), cols = input.size(1);
  DeviceTensor in = upload(device, input), g = upload(device, gamma);
  DeviceTensor normed = poisoned(device, input.dtype(), {rows, cols});
  LamportCall call;
  call.dtype = input.dtype();
  call.in = in.view.data();
  call.ld_in = cols;
  call.out = normed.view.data();
  call.ld_out = cols;
  call.rows = rows;
  call.cols = cols;
  call.gamma = g.view.data();
  call.gamma_dtype = DType::f32;
  call.eps = 1e-5f;
  launch_lamport(dynamic_cast<LamportCommunicator&>(comm).lamport_peers(), call, stream);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  comm.check();
  const HostTensor got = download(device, normed.view);
  for (int64_t t = 0; t < rows; ++t) {
    double squares = 0;
    for (int64_t c = 0; c < cols; ++c) squares += std::pow(value_at(input, t * cols + c), 2);
    const double inverse = 1.0 / std::sqrt(squares / static_cast<double>(cols) + 1e-5);
    for (int64_t c = 0; c < cols; ++c) {
      const double expected = value_at(input, t * cols + c) * inverse * value_at(gamma, c);
      EXPECT_NEAR(value_at(got, t * cols + c), expected, 1e-2 * std::abs(expected) + 1e-3) << t << ", " << c;
    }
  }
}

}  // namespace latentmoe::cuda::testing

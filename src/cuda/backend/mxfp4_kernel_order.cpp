// latentmoe/runner.h's mxfp4_to_kernel_order: MXFP4 codes an engine keeps on a GPU into the kernel order, on the
// device that holds them (the kernel: src/cuda/kernels/mxfp4_order.cu).
#include <cuda_runtime_api.h>

#include "cuda/common/cuda_check.h"
#include "cuda/common/device.h"
#include "cuda/kernels/mxfp4_order.h"
#include "latentmoe/error.h"
#include "latentmoe/runner.h"

namespace latentmoe {

void mxfp4_to_kernel_order(const TensorView& codes, StreamHandle stream) {
  constexpr const char* kWhat = "mxfp4_to_kernel_order";
  LATENTMOE_CHECK(codes.defined(), kWhat, ": no tensor");
  LATENTMOE_CHECK(codes.dtype() == DType::u8, kWhat, ": MXFP4 codes are U8, not ", dtype_name(codes.dtype()));
  LATENTMOE_CHECK(codes.device() == Device::cuda, kWhat,
                  ": the codes are on the host; host codes stay in the canonical order (a Runner converts the codes it "
                  "copies to the GPU; mxfp4_codes_to_kernel_order in latentmoe/mxfp4.h converts a host buffer)");
  LATENTMOE_CHECK(codes.is_contiguous(), kWhat, ": the codes ", codes.shape_string(), " must be contiguous");
  if (codes.numel() == 0) return;
  cudaPointerAttributes attributes{};
  const cudaError_t status = cudaPointerGetAttributes(&attributes, codes.data());
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    detail::throw_error(kWhat, ": cudaPointerGetAttributes on the codes failed: ", cudaGetErrorString(status));
  }
  LATENTMOE_CHECK(attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged, kWhat,
                  ": the codes are not in CUDA device memory (a tensor marked as on the GPU must be)");
  cuda::DeviceGuard guard(attributes.device);
  cuda::mxfp4_codes_to_kernel_order(codes.data(), static_cast<size_t>(codes.numel()),
                                    stream == nullptr ? cudaStreamLegacy : static_cast<cudaStream_t>(stream));
}

}  // namespace latentmoe

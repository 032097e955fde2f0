// LATENTMOE_HOST_DEVICE: marks an inline function that both host code and CUDA kernels call
// (__host__ __device__ under nvcc, nothing elsewhere).
#pragma once

#if defined(__CUDACC__)
#define LATENTMOE_HOST_DEVICE __host__ __device__
#else
#define LATENTMOE_HOST_DEVICE
#endif

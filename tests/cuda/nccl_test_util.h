// LATENTMOE_REQUIRE_NCCL for the GPU tests that run NCCL (test_nccl_group.cpp, test_nccl_processes.cpp).
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

#include "cuda/common/device.h"

#if defined(LATENTMOE_WITH_NCCL)
#include <nccl.h>
#endif

// Skips without `gpus` GPUs, or when the loaded libnccl is not the one compiled against (a failure when
// LATENTMOE_TEST_REQUIRE_NCCL=1).
#if defined(LATENTMOE_WITH_NCCL)
#define LATENTMOE_REQUIRE_NCCL(gpus)                                                                         \
  do {                                                                                                       \
    if (::latentmoe::cuda::cuda_device_count() < (gpus)) GTEST_SKIP() << "fewer than " << (gpus) << " GPUs"; \
    int loaded_ = 0;                                                                                         \
    ncclGetVersion(&loaded_);                                                                                \
    if (loaded_ != NCCL_VERSION_CODE) {                                                                      \
      const char* require_ = std::getenv("LATENTMOE_TEST_REQUIRE_NCCL");                                     \
      if (require_ != nullptr && std::strcmp(require_, "1") == 0)                                            \
        FAIL() << "libnccl " << loaded_ << " loaded, built against " << NCCL_VERSION_CODE;                   \
      GTEST_SKIP() << "libnccl " << loaded_ << " loaded, built against " << NCCL_VERSION_CODE                \
                   << " (set LD_LIBRARY_PATH to the matching one)";                                          \
    }                                                                                                        \
  } while (false)
#else
#define LATENTMOE_REQUIRE_NCCL(gpus) GTEST_SKIP() << "built without NCCL"
#endif

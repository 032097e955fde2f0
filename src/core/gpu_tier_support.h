// What a GPU group's collectives allow each tail tier (the host arithmetic of CudaBackend::tier_support,
// src/cuda/backend/tier_support.cpp), kept apart from CUDA so that it is tested on the CPU
// (tests/test_nccl_checks.cpp).
#pragma once

#include <cstdint>

#include "latentmoe/config.h"
#include "latentmoe/dtype.h"
#include "latentmoe/tier.h"

namespace latentmoe::detail {

struct GpuGroupLimits {
  DType dtype = DType::bf16;      // the dtype every collective of the group carries
  bool one_shot = true;           // every rank load/store reachable: the one-shot kernels run
  int64_t capacity_bytes = 0;     // one source region of the one-shot receive area
  int64_t fallback_elements = 0;  // the largest tensor through NCCL above the capacity; 0: none
};

// Narrows `support` for a layer of `config` in `dtype` at tp_size > 1 over such a group: every tier
// refused when the group carries another dtype; without the one-shot path tier 0 (tail_fusion: its
// collective is fused) is refused and the others go through NCCL, bounded by fallback_elements; with
// it each tier is bounded by the larger of its one-shot bound (its widest message per token in the
// capacity) and its NCCL bound (its widest tensor per token in fallback_elements).
void apply_gpu_group_limits(TierSupport& support, const LayerConfig& config, DType dtype, int tp_size,
                            const GpuGroupLimits& group);

}  // namespace latentmoe::detail

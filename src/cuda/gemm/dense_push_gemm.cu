// The pushing dense GEMM (dense_push_gemm.h): argument checks, the tile shape and the split-K workspace,
// then the mma.sync grouped kernel's kPush instance.
#include <cstdint>

#include "cuda/common/device.h"
#include "cuda/gemm/dense_push_gemm.h"
#include "cuda/gemm/grouped_gemm_mma_impl.cuh"
#include "latentmoe/error.h"

namespace latentmoe::cuda {
namespace {

// The workspace: tile counters, then fp32 partial sums. 8 MB of partials holds 256 split tiles of the
// 64 x 128 shape: about two per SM of an H200, as many as the split-K choice asks for at these sizes.
constexpr int64_t kCounters = 1024;
constexpr size_t kPartialBytes = size_t{8} << 20;

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

template <class T>
void launch_typed(int64_t rows, const gg::KernelArgs& args, const gg::MmaLaunch& launch, cudaStream_t stream) {
  using gg::Mode;
  if (rows <= 16) return gg::launch_cfg<T, gg::CfgSWide, Mode::plain, false, true>(args, launch, stream);
  if (rows <= 32) return gg::launch_cfg<T, gg::CfgM32, Mode::plain, false, true>(args, launch, stream);
  if (rows <= 64) return gg::launch_cfg<T, gg::CfgM, Mode::plain, false, true>(args, launch, stream);
  return gg::launch_cfg<T, gg::CfgL, Mode::plain, false, true>(args, launch, stream);
}

}  // namespace

const char* dense_push_variant(int64_t rows) {
  if (rows <= 16) return "mma_s_wide";
  if (rows <= 32) return "mma_m32";
  if (rows <= 64) return "mma_m";
  return "mma_l";
}

bool dense_push_supported(const DensePushProblem& p) {
  return (p.dtype == DType::bf16 || p.dtype == DType::f16) && p.rows >= 1 && p.rows <= kDensePushMaxRows && p.n > 0 &&
         p.k > 0 && p.n % 8 == 0 && p.k % 8 == 0 && p.n < (int64_t{1} << 30) && p.k < (int64_t{1} << 30) &&
         aligned16(p.x) && aligned16(p.w) && p.addend != nullptr && p.ld_addend >= p.n &&
         current_compute_capability() >= 80;
}

size_t dense_push_workspace_bytes() { return kCounters * sizeof(int) + kPartialBytes; }

void dense_push_gemm(const DensePushProblem& p, const LamportPeers& peers, void* workspace, size_t workspace_bytes,
                     cudaStream_t stream) {
  LATENTMOE_CHECK(dense_push_supported(p), "dense push GEMM: ", dtype_name(p.dtype), " [", p.rows, ", ", p.k, "] x [",
                  p.n, ", ", p.k,
                  "]^T is not supported (bf16/f16, 1..128 rows, n and k multiples of 8, 16-byte aligned x and w, an "
                  "addend, compute capability 8.0+)");
  LATENTMOE_CHECK(p.rows * p.n * static_cast<int64_t>(dtype_size(p.dtype)) <= peers.capacity_bytes,
                  "dense push GEMM: a block of ", p.rows, " x ", p.n, " ", dtype_name(p.dtype),
                  " does not fit the group's receive region (", peers.capacity_bytes, " bytes)");
  gg::KernelArgs args;
  args.a = p.x;
  args.w0 = p.w;
  args.num_experts = 1;
  args.top_k = 1;
  args.n = static_cast<int>(p.n);
  args.k = static_cast<int>(p.k);
  args.dense_rows = static_cast<int>(p.rows);
  args.addend = p.addend;
  args.ld_addend = p.ld_addend;
  args.push = peers;

  gg::MmaLaunch launch;
  launch.max_rows = p.rows;
  launch.num_tokens = p.rows;
  // A programmatic dependent (sm_90): the weights stream before the wait on the kernel that wrote x and
  // the addend (tier 0's collective); the all-gather that receives may launch once every CTA has waited.
  const bool hopper = current_compute_capability() >= 90;
  launch.programmatic = hopper;
  launch.trigger = hopper;
  launch.sm_count = current_sm_count();
  gg::attach_split_k(launch, workspace, workspace_bytes, kCounters, kPartialBytes, "dense push GEMM");
  if (p.dtype == DType::bf16) {
    launch_typed<__nv_bfloat16>(p.rows, args, launch, stream);
  } else {
    launch_typed<__half>(p.rows, args, launch, stream);
  }
}

}  // namespace latentmoe::cuda

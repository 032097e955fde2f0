// The decode dispatch table (src/cuda/backend/decode_dispatch.h): which decode-sized calls take the
// skinny kernels or tier 0's push, per architecture. Host-only: runs without a GPU (in CI too). The
// boundaries asserted are the measured thresholds each constant's comment cites.
#include <gtest/gtest.h>

#include "cuda/backend/decode_dispatch.h"

namespace latentmoe::cuda::testing {
namespace {

TEST(DecodeDispatch, the_h200_row_holds_the_measured_thresholds) {
  const DecodeDispatch& h200 = decode_dispatch(90);
  EXPECT_EQ(h200.compute_capability, 90);
  // Routed experts: one token, a latent of at least 2048 (Kimi-K3's 3584 wins, Nemotron-3's 1024 loses).
  EXPECT_TRUE(skinny_pays(h200, SkinnyOp::routed_experts, 1, 3584, 0));
  EXPECT_TRUE(skinny_pays(h200, SkinnyOp::routed_experts, 1, 2048, 0));
  EXPECT_FALSE(skinny_pays(h200, SkinnyOp::routed_experts, 1, 2047, 0));
  EXPECT_FALSE(skinny_pays(h200, SkinnyOp::routed_experts, 2, 3584, 0));
  // The shared expert: one token, a tp shard of at most 1024.
  EXPECT_TRUE(skinny_pays(h200, SkinnyOp::dense_mlp, 1, 7168, 768));
  EXPECT_FALSE(skinny_pays(h200, SkinnyOp::dense_mlp, 1, 7168, 6144));
  EXPECT_FALSE(skinny_pays(h200, SkinnyOp::dense_mlp, 2, 7168, 768));
  // A dense linear: never (cuBLASLt measured faster at every shape).
  EXPECT_FALSE(skinny_pays(h200, SkinnyOp::linear, 1, 3584, 0));
  // Tier 0's push: any decode token count the caller allows, a latent of at most 2048.
  EXPECT_TRUE(skinny_pays(h200, SkinnyOp::tier0_push, 1, 1024, 0));
  EXPECT_TRUE(skinny_pays(h200, SkinnyOp::tier0_push, 8, 2048, 0));
  EXPECT_FALSE(skinny_pays(h200, SkinnyOp::tier0_push, 1, 3584, 0));
  // No rows: nothing pays.
  for (SkinnyOp op : {SkinnyOp::routed_experts, SkinnyOp::dense_mlp, SkinnyOp::linear, SkinnyOp::tier0_push}) {
    EXPECT_FALSE(skinny_pays(h200, op, 0, 1024, 512));
  }
}

TEST(DecodeDispatch, an_unmeasured_architecture_takes_the_h200_row) {
  const DecodeDispatch& unmeasured = decode_dispatch(100);
  EXPECT_EQ(unmeasured.compute_capability, 90);
  EXPECT_EQ(&unmeasured, &decode_dispatch(90));
}

}  // namespace
}  // namespace latentmoe::cuda::testing

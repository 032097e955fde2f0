// MXFP4 routed experts at decode, one (token, expert) pair at a time (issue 31): the same two calls as
// mxfp4_routed_gate_up / mxfp4_routed_down (mxfp4_decode.h), the same act rows and output, for bf16
// activations on sm_90. Where the tile decode kernels (mxfp4_decode_mma.cu) give a token its MMA column and
// read each lane's codes four bytes at a time, these give each pair its own 16-row tiles and read 16 bytes (one
// whole scale group of one row) a lane and load: a tenth of the load instructions per byte, and every warp's
// share of a unit in flight at once. An expert named by several pairs is read once per pair (at one token, once).
// Design, numerics and measurements: mxfp4_pairs.cu, docs/MXFP4.md ("The pair kernels"). Host interface.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/gemm/mxfp4_decode.h"

namespace latentmoe::cuda {

// Up to how many tokens the layer runs MXFP4 experts with bf16 activations on the pair kernels
// (CudaBackend::set_mxfp4_pairs_max_tokens, LATENTMOE_MXFP4_PAIRS_MAX_TOKENS; 0: never). 0 until they are measured:
// as of session 30 they have not run on a GPU (no machine started), so the layer keeps the tile decode kernels
// unless asked (docs/MXFP4.md, "The pair kernels").
inline constexpr int kMxfp4PairsTokens = 0;
// The most tokens the kernels take (pairs <= kMxfp4PairsMaxPairs).
inline constexpr int kMxfp4PairsMaxTokens = 8;
inline constexpr int kMxfp4PairsMaxPairs = 256;

// True when the pair kernels take a call of `tokens` tokens with `top_k` experts each: bf16, 1..8 tokens and
// at most 256 pairs, gate/up rows (I) a multiple of 16 and down rows (l) a multiple of 16, every code matrix
// and the activations (x with row stride ld_x elements) 16-byte aligned, compute capability 9.0 (clusters).
// Both calls of one step must take the same kernels: the caller asks once, with the gate/up and down calls.
bool mxfp4_pairs_supported(const Mxfp4GateUpCall& gate_up, const Mxfp4DownCall& down);

// The down kernel's launch for `pairs` pairs (a host rule, tested without a GPU): each CTA takes pairs_per_cta =
// ceil(pairs / min(8, ceil(pairs / 4))) consecutive pairs on `warps` warps (a warp a pair at a time, at most 8), and
// a cluster of `cluster` CTAs, as many as the pairs fill, takes 16 output rows. Throws Error for pairs
// outside 1..kMxfp4PairsMaxPairs.
struct Mxfp4PairsDownShape {
  int cluster = 1;
  int pairs_per_cta = 1;
  int warps = 1;
};
Mxfp4PairsDownShape mxfp4_pairs_down_shape(int pairs);

// act[p] for every pair p whose expert is real (as mxfp4_routed_gate_up: act row p = t * top_k + j).
void mxfp4_pairs_gate_up(const Mxfp4GateUpCall& call, cudaStream_t stream);
// out[t] = sum over j of w_tj · (act[t * top_k + j] · Wd_e) in fp32 in j order, rounded once; every row
// written. A programmatic dependent of the gate/up kernel before it (the same ordering rule as
// mxfp4_routed_down: nothing between the two calls may write ids or weights).
void mxfp4_pairs_down(const Mxfp4DownCall& call, cudaStream_t stream);

}  // namespace latentmoe::cuda

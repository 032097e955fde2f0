// The device side of the one-shot Lamport protocol (lamport.cu opens with it) that kernels outside
// the collective kernel share: the sentinel and payload encoding, the addressing of a receive region,
// and the push a GEMM epilogue uses to deliver its block of an all-gather straight into every peer's
// receive area (tier 0's fused up-projection; the collective kernel then only receives).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/comm/lamport.h"

namespace latentmoe::cuda::lamport {

// The sentinel of an idle element (-0.0) and the bits it is compared as.
template <class T>
struct Bits;
template <>
struct Bits<float> {
  using type = uint32_t;
  static constexpr uint32_t sentinel = 0x80000000u;
};
template <>
struct Bits<__nv_bfloat16> {
  using type = uint16_t;
  static constexpr uint16_t sentinel = 0x8000u;
};
template <>
struct Bits<__half> {
  using type = uint16_t;
  static constexpr uint16_t sentinel = 0x8000u;
};

template <class T>
__device__ __forceinline__ typename Bits<T>::type bits_of(T value) {
  typename Bits<T>::type bits;
  memcpy(&bits, &value, sizeof(T));
  return bits;
}

template <class T>
__device__ __forceinline__ T from_bits(typename Bits<T>::type bits) {
  T value;
  memcpy(&value, &bits, sizeof(T));
  return value;
}

// A payload element as sent: -0.0 becomes +0.0 (the sentinel is never a payload).
template <class T>
__device__ __forceinline__ T as_payload(T value) {
  return bits_of(value) == Bits<T>::sentinel ? from_bits<T>(0) : value;
}

// Rank `owner`'s region in `slot` for messages from rank `source`.
template <class T>
__device__ __forceinline__ T* region_of(const LamportPeers& peers, int owner, int slot, int source) {
  auto* base = static_cast<char*>(peers.recv[owner]);
  return reinterpret_cast<T*>(base + (static_cast<int64_t>(slot) * peers.size + source) * peers.capacity_bytes);
}

// The slot of the rank's next call. Read it only after the previous kernel of the stream has completed
// (after pdl_wait() in a programmatic dependent): the previous collective advances the epoch.
__device__ __forceinline__ int next_slot(const LamportPeers& peers) {
  return static_cast<int>(*static_cast<volatile const uint32_t*>(peers.state) % kLamportSlots);
}

// Element (row, col) of this rank's [rows, chunk] block of an all-gather, stored into every rank's
// region for this rank in `slot`: what the all-gather's send step would store (LamportCall::presend).
template <class T>
__device__ __forceinline__ void push_all_gather(const LamportPeers& peers, int slot, int64_t chunk, int64_t row,
                                                int64_t col, T value) {
  const T payload = as_payload(value);
  for (int peer = 0; peer < peers.size; ++peer)
    region_of<T>(peers, peer, slot, peers.rank)[row * chunk + col] = payload;
}

// Elements (row, col) and (row, col + 1) of this rank's block, stored as one 4-byte word into every rank's
// region (T 16-bit, col even, chunk even: the word is aligned).
template <class T>
__device__ __forceinline__ void push_all_gather_pair(const LamportPeers& peers, int slot, int64_t chunk, int64_t row,
                                                     int64_t col, T lo, T hi) {
  static_assert(sizeof(T) == 2, "a pair of 16-bit elements");
  const uint32_t word = static_cast<uint32_t>(bits_of(as_payload(lo))) | static_cast<uint32_t>(bits_of(as_payload(hi)))
                                                                             << 16;
  for (int peer = 0; peer < peers.size; ++peer)
    *reinterpret_cast<uint32_t*>(region_of<T>(peers, peer, slot, peers.rank) + row * chunk + col) = word;
}

}  // namespace latentmoe::cuda::lamport

// Splits [0, count) into contiguous pieces run on several threads (the host's hardware threads, at
// most one piece per `min_piece` elements); small ranges run on the calling thread. `body(begin, end)`
// must touch only its own piece. Used to fill and copy multi-gigabyte host tensors (random weights of
// a full-size layer) in seconds rather than minutes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <thread>
#include <vector>

#include "latentmoe/random.h"

namespace latentmoe::detail {

template <class Body>
void parallel_for(int64_t count, int64_t min_piece, Body&& body) {
  const int64_t hardware = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t pieces = std::clamp<int64_t>(count / std::max<int64_t>(min_piece, 1), 1, hardware);
  if (pieces == 1) {
    body(int64_t{0}, count);
    return;
  }
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(pieces));
  const int64_t step = (count + pieces - 1) / pieces;
  auto run_piece = [&](int64_t piece) {
    try {
      body(piece * step, std::min(count, (piece + 1) * step));
    } catch (...) {
      errors[static_cast<size_t>(piece)] = std::current_exception();
    }
  };
  for (int64_t piece = 1; piece < pieces; ++piece) {
    try {
      threads.emplace_back(run_piece, piece);
    } catch (...) {
      run_piece(piece);  // no thread to spare: run it here
    }
  }
  run_piece(0);
  for (std::thread& thread : threads) thread.join();
  for (const std::exception_ptr& error : errors)
    if (error) std::rethrow_exception(error);
}

// Element i of [0, count) from the i-th draw of SplitMix64(seed), in parallel pieces: draw(i, rng) takes
// one draw from rng, which each piece positions where a sequential pass would be (the same bits).
template <class Draw>
void parallel_draws(int64_t count, uint64_t seed, Draw&& draw) {
  parallel_for(count, int64_t{1} << 22, [&](int64_t begin, int64_t end) {
    SplitMix64 rng(seed);
    rng.discard(static_cast<uint64_t>(begin));
    for (int64_t i = begin; i < end; ++i) draw(i, rng);
  });
}

}  // namespace latentmoe::detail

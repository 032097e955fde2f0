// tp ranks as threads of one process: an in-process communicator for host tensors, and a helper
// that runs one function per rank and propagates the first failure.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "latentmoe/communicator.h"

namespace latentmoe {

struct InProcessGroupOptions {
  // How long a rank waits for its peers at any rendezvous before throwing Error.
  std::chrono::milliseconds timeout{60000};
};

// One communicator per rank, all bound to the same shared state. Host (Device::cpu) tensors of
// compute dtypes; the sum is accumulated in double in rank order and rounded once to the dtype.
std::vector<std::unique_ptr<Communicator>> make_in_process_group(int tp_size, InProcessGroupOptions options = {});

// Runs body(rank) for rank 0..tp_size-1, each on its own thread, and waits for all. If any rank
// throws, the group's communicators are aborted (peers blocked in a collective throw instead of
// waiting for the timeout) and the exception of the rank that failed first (not the aborts it
// caused on its peers) is rethrown on the calling thread.
void run_ranks(std::vector<std::unique_ptr<Communicator>>& group, const std::function<void(int rank)>& body);

}  // namespace latentmoe

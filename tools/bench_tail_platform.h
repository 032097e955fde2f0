// latentmoe bench tail: what differs between the backends, so that the benchmark itself
// (bench_tail.cpp) is one code path with the backend as a parameter. The CUDA side is compiled only
// into a CUDA build; without CUDA, asking for it throws Error.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bench_access.h"  // internal: the Backend interface, for benchmarks only
#include "harness/group_timing.h"
#include "latentmoe/communicator.h"
#include "latentmoe/gpu_group.h"
#include "latentmoe/runner.h"

namespace latentmoe::bench {
class StartGate;  // harness/start_gate.h (CUDA builds)
}  // namespace latentmoe::bench

namespace latentmoe::tools {

// The ranks of one benchmark group and where they run.
struct BenchGroup {
  std::vector<std::unique_ptr<Communicator>> comms;
  // CUDA: the start gate every rank's clock holds its timed runs at (group_timing.h); null on the CPU.
  std::shared_ptr<bench::StartGate> gate;
  // "simulated": every rank on one device (ranks as threads on the CPU; on one GPU with the
  // simulated GPU group's collectives); "devices": one device per rank.
  std::string placement;
  std::vector<int> rank_device;  // the device ordinal of each rank (-1 on the CPU)
};

// How the benchmark places its ranks and runs their collectives.
struct GroupRequest {
  std::string placement = "auto";  // auto|simulated|devices (latentmoe/gpu_group.h's GpuPlacement)
  bool one_shot = true;            // false: every collective through NCCL (devices only): the NCCL baseline
  int device = 0;                  // simulated ranks: the GPU they share
  int64_t one_shot_tokens = 0;     // ranks on GPUs of their own: one-shot up to this many tokens, NCCL above;
                                   // 0: default_one_shot_tokens(tp)

  // one_shot_tokens, or the library's default for a group of `tp` ranks.
  int64_t one_shot_tokens_for(int tp) const {
    return one_shot_tokens > 0 ? one_shot_tokens : default_one_shot_tokens(tp);
  }
};

// `tp` ranks whose collectives carry layers of up to `max_tokens` tokens of `per_token_elements`
// (d + l) elements of `dtype` per rank: all of it one-shot on simulated ranks; on GPUs of their own
// one-shot up to request.one_shot_tokens tokens and NCCL above (size_nccl_group). CUDA:
// simulated on request.device, or on GPUs 0..tp-1 (one thread per GPU, NCCL) when `devices` (or `auto`
// finds tp GPUs with peer access and NCCL); one line on stderr says which. The CPU: threads over the
// in-process group ("simulated"; `devices` is refused).
BenchGroup make_bench_group(BackendKind backend, int tp, DType dtype, int64_t max_tokens, int64_t per_token_elements,
                            const GroupRequest& request);

// Checks a request before anything runs (throws Error naming the option).
void check_group_request(BackendKind backend, const GroupRequest& request);

// The device, for people: the GPU's name, or the CPU model and its hardware threads.
std::string describe_device(BackendKind backend, int device);

// Makes `device` the calling thread's current device (CUDA; nothing on the CPU).
void bind_thread_to_device(BackendKind backend, int device);

// A backend of the benchmark's own on `device`, to allocate and fill its buffers before a Runner exists.
std::unique_ptr<bench_access::Backend> make_scratch_backend(BackendKind backend, int device);

// view[i] = offset + scale * u_i, u_i uniform in [-1, 1) a function of (seed, i) only (the same values
// on every backend), issued on backend's stream (view lives on backend's device).
void fill_uniform(bench_access::Backend& backend, const TensorView& view, uint64_t seed, float scale, float offset);

// The clock of one rank's stream: CUDA events, flushing the L2 when `flush`, holding each timed run at
// group.gate (the host clock on the CPU).
std::unique_ptr<bench::RunClock> make_clock(BackendKind backend, const BenchGroup& group, StreamHandle stream,
                                            bool flush);

// The copy bandwidth of `device`, bytes read + written per second, the median of `runs`: a 2 GiB
// device-to-device copy on CUDA, a 64 MiB memcpy on the CPU.
double measure_copy_bandwidth(BackendKind backend, int device, const bench::Runs& runs);

}  // namespace latentmoe::tools

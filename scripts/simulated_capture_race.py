# Repeats test_simulated_ranks_captured_per_rank's scenario (two simulated ranks, each replaying its own CUDA graph
# of the layer, three replays a try) with the host copies to pageable memory made before ("nobarrier") or after
# ("barrier") every rank has launched its replay; prints one line per try and the count of failed tries.
# On the GPU machine, with the wheel installed by scripts/gpu_python.sh:
#   PYTHONPATH=/tmp/latentmoe-site python3 scripts/simulated_capture_race.py nobarrier|barrier TRIES
# Session 25 (H100, 1024846): nobarrier 6 of 8 tries timed out, barrier 0 of 8
# (bench/results/simulated_capture_race_h100_1024846.txt).
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "tests"))

import torch  # noqa: E402
import test_gpu  # noqa: E402
from conftest import FAMILIES, make_inputs, make_weights, run_ranks  # noqa: E402


def run(contexts, streams, body, barrier):
    gate = threading.Barrier(len(contexts))

    def rank_body(rank, ctx):
        streams[rank].wait_stream(torch.cuda.default_stream(test_gpu.DEVICE))
        with torch.cuda.stream(streams[rank]):
            result = body(rank, ctx)
            if barrier:
                gate.wait(timeout=60)
            result = [r.cpu() for r in result]
        ctx.check()
        return result

    return run_ranks(contexts, rank_body)


def one_try(barrier, tp=2, replays=3):
    config = FAMILIES["kimi"]()
    named, _ = make_weights(config, torch.bfloat16, seed=3)
    contexts, layers, streams = test_gpu.simulated(config, named, tp)
    cpu_x, cpu_logits = make_inputs(config, 9, torch.bfloat16, seed=3)
    statics = [test_gpu.on_device(cpu_x, cpu_logits) for _ in range(tp)]
    run(contexts, streams, lambda rank, ctx: list(layers[rank](*statics[rank])), barrier=True)
    graphs, captured = [None] * tp, [None] * tp

    def capture(rank, ctx):
        graphs[rank] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[rank], stream=streams[rank], capture_error_mode="thread_local"):
            captured[rank] = layers[rank](*statics[rank])
        return []

    run_ranks(contexts, capture)
    torch.cuda.synchronize()

    def replay(rank, ctx):
        graphs[rank].replay()
        return list(captured[rank])

    for _ in range(replays):
        run(contexts, streams, replay, barrier)


def main():
    mode, tries = sys.argv[1], int(sys.argv[2])
    if mode not in ("nobarrier", "barrier"):
        sys.exit("usage: simulated_capture_race.py nobarrier|barrier TRIES")
    failed = 0
    for attempt in range(tries):
        start = time.time()
        try:
            one_try(mode == "barrier")
            outcome = "ok"
        except Exception as error:  # noqa: BLE001 - a failed try is counted and reported
            failed += 1
            outcome = "FAIL " + str(error)[:150]
        print(f"{mode} try {attempt}: {outcome} ({time.time() - start:.1f} s)", flush=True)
    print(f"{mode}: {failed} of {tries} failed", flush=True)


if __name__ == "__main__":
    main()

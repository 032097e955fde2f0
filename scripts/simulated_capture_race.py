# Repeats test_simulated_ranks_captured_per_rank's scenario (two simulated ranks, each replaying its own CUDA graph
# of the layer, three replays a try) with the host copies to pageable memory made before ("nobarrier") or after
# ("barrier") every rank has launched its replay; prints one line per try and the count of failed tries.
# On the GPU machine, with the wheel installed by scripts/gpu_python.sh:
#   PYTHONPATH=/tmp/latentmoe-site python3 scripts/simulated_capture_race.py nobarrier|barrier TRIES
# Session 25 (H100, 1024846): nobarrier 6 of 8 tries timed out, barrier 0 of 8
# (bench/results/simulated_capture_race_h100_1024846.txt).
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "tests"))

import torch  # noqa: E402
import test_gpu  # noqa: E402
from conftest import FAMILIES, make_inputs, make_weights  # noqa: E402


def one_try(barrier, tp=2, replays=3):
    config = FAMILIES["kimi"]()
    named, _ = make_weights(config, torch.bfloat16, seed=3)
    contexts, layers, streams = test_gpu.simulated(config, named, tp)
    cpu_x, cpu_logits = make_inputs(config, 9, torch.bfloat16, seed=3)
    statics = [test_gpu.on_device(cpu_x, cpu_logits) for _ in range(tp)]
    test_gpu.run_on_streams(contexts, streams, lambda rank, ctx: list(layers[rank](*statics[rank])))
    replay = test_gpu.capture_per_rank(contexts, layers, streams, statics)
    torch.cuda.synchronize()
    for _ in range(replays):
        test_gpu.run_on_streams(contexts, streams, replay, enqueue_first=barrier)


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

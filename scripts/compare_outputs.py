#!/usr/bin/env python3
"""Compares two outputs of `latentmoe run` (safetensors: output, topk_ids, topk_weights):

    python3 scripts/compare_outputs.py A.safetensors B.safetensors [--tolerance 3e-2]

Prints max|a - b| / max|b| of `output` and whether topk_ids are equal; exits 1 when the error exceeds
the tolerance or the routing differs, 2 on a file it cannot read. Reads the format itself (an 8-byte
little-endian header length, the JSON header, the data): numpy only.
"""
import argparse
import json
import struct
import sys

import numpy as np


def read_tensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    base = 8 + length
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        raw = np.frombuffer(data[base + begin : base + end], dtype=np.uint8)
        dtype = entry["dtype"]
        if dtype == "BF16":
            values = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif dtype in ("F32", "F16", "I32"):
            values = raw.view({"F32": np.float32, "F16": np.float16, "I32": np.int32}[dtype])
        else:
            raise ValueError(f"{path}: {name} has dtype {dtype}")
        tensors[name] = values.reshape(entry["shape"])
    return tensors


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--tolerance", type=float, default=3e-2)
    args = parser.parse_args()
    try:
        a, b = read_tensors(args.a), read_tensors(args.b)
    except (OSError, ValueError, KeyError, struct.error) as error:
        print(f"compare_outputs: {error}", file=sys.stderr)
        return 2
    out_a, out_b = a["output"].astype(np.float64), b["output"].astype(np.float64)
    if out_a.shape != out_b.shape:
        print(f"output shapes differ: {out_a.shape} vs {out_b.shape}")
        return 1
    error = float(np.max(np.abs(out_a - out_b)) / max(float(np.max(np.abs(out_b))), 1e-30))
    same_routing = bool(np.array_equal(a["topk_ids"], b["topk_ids"]))
    ok = error <= args.tolerance and same_routing and np.isfinite(out_a).all()
    print(f"max_rel_err {error:.3e}  routing {'equal' if same_routing else 'DIFFERS'}  {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""PyTorch peer of `latentmoe bench layer --experts mxfp4`: MXFP4 routed experts, dequantised to bf16,
then torch._grouped_mm.

PyTorch has no MXFP4 grouped GEMM on Hopper; this is its best case, as issue 16 asks: each forward
dequantises only the touched experts' codes (E2M1 through a 16-entry bf16 table, times the E8M0 scale,
exact in bf16 for the scales used here) into a compact [U, ...] bf16 copy, then runs gate/up, the
activation and down as grouped GEMMs over the compacted experts. Two timings per row:

  dequant_chain  dequantise + gate/up + activation + down: what a user without an MXFP4 kernel runs
  bf16_chain     gate/up + activation + down on bf16 experts already in memory (the dequantised copy
                 kept): the same GEMMs without the dequantisation, as if the experts were stored in bf16

The floor counts the touched experts' MXFP4 bytes (codes and scales, 17/32 byte per weight) at the copy
bandwidth measured in the same run, as latentmoe's experts floor does. Same presets, tp shards and
token counts as the bench; routing: k distinct uniform random experts per token, seeded; NUM_LAYOUTS
routings rotated, each a CUDA graph when capture works (eager otherwise), medians over replays.

  python3 bench/peers/torch_mxfp4_experts.py --json out.json [--presets kimi-k3] [--tp-shards 8,1]
      [--tokens 1,2,4,8]
"""
import argparse
import json

import torch

# The presets and the timing, graph and activation helpers of the grouped-GEMM peer (same folder).
from torch_grouped_mm import PRESETS, ceilings, graph_or_eager, situ, time_ms

NUM_LAYOUTS = 4  # each keeps a bf16 copy of its touched experts (kimi-k3 tp 1, T 8: ~8 GB)
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def dequantise(codes, scales, table):
    """codes [U, rows, cols/2] u8, scales [U, rows, cols/32] u8 -> [U, rows, cols] bf16."""
    low = table[(codes & 0xF).long()]
    high = table[(codes >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # column 2b low nibble, 2b + 1 high
    scale = torch.exp2(scales.float() - 127.0).to(torch.bfloat16)
    u, rows, cols = values.shape
    return (values.view(u, rows, cols // 32, 32) * scale.unsqueeze(-1)).view(u, rows, cols)


def run_row(name, p, tp, tokens, experts, copy_bw, gen, table):
    gated = p["act"] != "relu2"
    E, k, l = p["experts"], p["top_k"], p["latent"]
    ir = p["intermediate"] // tp
    gu_codes, gu_scales, d_codes, d_scales = experts
    mats = 2 if gated else 1
    layouts = []
    touched = 0.0
    for _ in range(NUM_LAYOUTS):
        ids = torch.rand(tokens, E, device="cuda", generator=gen).topk(k, dim=1).indices.flatten()
        unique, compact = torch.unique(ids, return_inverse=True)
        order = torch.argsort(compact, stable=True)
        offs = torch.cumsum(torch.bincount(compact, minlength=unique.numel()), 0).to(torch.int32)
        z = torch.empty(tokens, l, dtype=torch.bfloat16, device="cuda").uniform_(-1, 1)
        layouts.append((unique, offs, (order // k).contiguous(), z))
        touched += unique.numel()
    touched /= NUM_LAYOUTS

    def chain(li, w_gu, w_d):
        _, offs, token_of_row, z = layouts[li]
        h = torch._grouped_mm(z[token_of_row], w_gu.transpose(1, 2), offs=offs)
        a = situ(h[:, :ir], h[:, ir:]) if gated else torch.relu(h).square()
        return torch._grouped_mm(a, w_d.transpose(1, 2), offs=offs)

    def dequant_weights(li):
        unique = layouts[li][0]
        return (dequantise(gu_codes[unique], gu_scales[unique], table),
                dequantise(d_codes[unique], d_scales[unique], table))

    kept = [dequant_weights(li) for li in range(NUM_LAYOUTS)]

    def dequant_chain():
        for li in range(NUM_LAYOUTS):
            chain(li, *dequant_weights(li))

    def bf16_chain():
        for li in range(NUM_LAYOUTS):
            chain(li, *kept[li])

    weights_bytes = touched * (mats * ir * l + l * ir) * (0.5 + 1.0 / 32.0)
    floor_us = weights_bytes / copy_bw * 1e6
    result = dict(preset=name, tp_shard=tp, tokens=tokens, dtype="bf16", touched_experts=touched,
                  experts_floor_us=floor_us)
    for label, body in (("dequant_chain", dequant_chain), ("bf16_chain", bf16_chain)):
        try:
            fn, mode = graph_or_eager(body)
            us = time_ms(fn) / NUM_LAYOUTS * 1e3
            result[label] = dict(time_us=us, fraction_of_floor=floor_us / us, timing=mode)
        except Exception as exc:  # noqa: BLE001
            result[label] = dict(error=f"{type(exc).__name__}: {exc}")
    del kept
    torch.cuda.empty_cache()
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True)
    parser.add_argument("--presets", default="kimi-k3")
    parser.add_argument("--tp-shards", default="8,1")
    parser.add_argument("--tokens", default="1,2,4,8")
    parser.add_argument("--seed", type=int, default=2026)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(args.seed)
    table = torch.tensor(E2M1, dtype=torch.bfloat16, device="cuda")
    # The decode checked on a hand-made row: byte 0x21 is 0.5 (low nibble) then 1.0 (high nibble), 0x9F is
    # -6.0 then -0.5; scale byte 128 is 2.
    codes = torch.zeros(1, 1, 16, dtype=torch.uint8, device="cuda")
    codes[0, 0, 0], codes[0, 0, 1] = 0x21, 0x9F
    got = dequantise(codes, torch.full((1, 1, 1), 128, dtype=torch.uint8, device="cuda"), table)[0, 0, :4]
    assert got.float().tolist() == [1.0, 2.0, -12.0, -1.0], got
    copy_bw, _ = ceilings()
    print(f"# torch {torch.__version__}  device {torch.cuda.get_device_name()}  copy {copy_bw / 1e12:.2f} TB/s")
    print(f"# {'preset':16s} {'tp':>3s} {'T':>3s} {'touched':>8s} {'floor_us':>9s} {'dequant+mm_us':>14s} "
          f"{'%floor':>7s} {'bf16_mm_us':>11s}")
    rows = []
    for name in args.presets.split(","):
        p = PRESETS[name]
        gated = p["act"] != "relu2"
        for tp in (int(v) for v in args.tp_shards.split(",")):
            ir = p["intermediate"] // tp
            if ir % 32 != 0:
                print(f"# {name} tp-shard {tp}: skipped, I / tp = {ir} splits a scale group")
                continue
            E, l, mats = p["experts"], p["latent"], (2 if gated else 1)
            # Random codes and scale bytes near the weights' magnitude (2^-8 .. 2^-5): the dequantised
            # values are exact in bf16.
            experts = (
                torch.randint(0, 256, (E, mats * ir, l // 2), dtype=torch.uint8, device="cuda"),
                torch.randint(119, 123, (E, mats * ir, l // 32), dtype=torch.uint8, device="cuda"),
                torch.randint(0, 256, (E, l, ir // 2), dtype=torch.uint8, device="cuda"),
                torch.randint(119, 123, (E, l, ir // 32), dtype=torch.uint8, device="cuda"),
            )
            for tokens in (int(v) for v in args.tokens.split(",")):
                row = run_row(name, p, tp, tokens, experts, copy_bw, gen, table)
                rows.append(row)
                dq, mm = row["dequant_chain"], row["bf16_chain"]
                print(f"  {name:16s} {tp:3d} {tokens:3d} {row['touched_experts']:8.1f} {row['experts_floor_us']:9.1f} "
                      f"{dq.get('time_us', float('nan')):14.1f} {100 * dq.get('fraction_of_floor', 0):6.1f}% "
                      f"{mm.get('time_us', float('nan')):11.1f}")
            del experts
            torch.cuda.empty_cache()
    report = dict(format="latentmoe-peer-torch-mxfp4-1", backend="torch", torch=torch.__version__,
                  device=torch.cuda.get_device_name(), copy_tb_per_s=copy_bw / 1e12, rows=rows,
                  method="dequantise the touched experts' MXFP4 codes to bf16, then torch._grouped_mm gate/up, "
                         "activation, down; CUDA graph of NUM_LAYOUTS routings, median over replays; floor = "
                         "touched experts' MXFP4 bytes / copy bandwidth")
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

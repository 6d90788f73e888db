"""Sweep the decode kernel's configurations on the GPU, beside SDPA.

    python bench/tune_decode.py [--batches 1,8] [--kv 8192,32768] [--budget S]
                                [--splits auto,16,32,64] [--tiles 64x4,128x4,128x8] [--stages 3,4]
                                [--grid '{"USE_TMA": [true, false]}']

One query token at position S-1 against a KV cache of S tokens, 32 query heads on 8 KV
heads, D=128, bf16, no mask. For each case it times (CUDA-graph replay, so launch gaps
between the split and merge kernels count but Python overhead does not) SDPA with
enable_gqa, and flexattn with each (SPLIT_KV, BLOCK_N, num_warps, num_stages) pinned
through kernel_options (each one under every combination of the ``--grid``
kernel_options), and prints the best configurations. The decode DEFAULTS and
split heuristic of flexattn/lowering/decode.py are chosen from these readings.
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
import torch.nn.functional as F
import triton.testing

import flexattn
from _tuning import allow_recompiles, grid_settings

HQ, HKV, D = 32, 8, 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--kv", default="8192,32768")
    parser.add_argument("--splits", default="auto,16,32,64")
    parser.add_argument("--tiles", default="64x4,128x4,128x8", help="BLOCK_N x num_warps pairs")
    parser.add_argument("--stages", default="3,4")
    parser.add_argument("--budget", type=float, default=1e9, help="stop starting new configs after this many s")
    parser.add_argument("--top", type=int, default=4, help="configurations kept in the summary per case")
    parser.add_argument("--grid", default="{}", help="JSON: kernel_options key -> list of values, each config "
                        "is timed under every combination")
    args = parser.parse_args()
    settings = grid_settings(args.grid)
    allow_recompiles()
    ours = torch.compile(flexattn.flex_attention, fullgraph=True, dynamic=False)
    start = time.time()
    summary = []
    for B, S in itertools.product((int(b) for b in args.batches.split(",")), (int(s) for s in args.kv.split(","))):
        q = torch.randn(B, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, HKV, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        sdpa_ms = triton.testing.do_bench_cudagraph(
            lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), rep=50, return_mode="median")
        print(f"B={B} S={S}: sdpa {sdpa_ms * 1e3:.1f} us", flush=True)
        rows = []
        for fused, extra in itertools.product((True, False), settings):
            opts = {"FUSED_MERGE": fused, **extra}
            ours(q, k, v, kernel_options=opts, enable_gqa=True)
            ms = triton.testing.do_bench_cudagraph(lambda: ours(q, k, v, kernel_options=opts, enable_gqa=True), rep=50,
                                                   return_mode="median")
            described = "".join(f" {key}={value}" for key, value in opts.items())
            line = (f"| {B} | {S} | defaults,{described} | {ms * 1e3:.1f} | {sdpa_ms * 1e3:.1f} | "
                    f"{sdpa_ms / ms:.2f} |")
            summary.append(line)
            print(line, flush=True)
        tiles = [tuple(int(x) for x in tile.split("x")) for tile in args.tiles.split(",")]
        stages = [int(st) for st in args.stages.split(",")]
        for split, (bn, w), st, extra in itertools.product(args.splits.split(","), tiles, stages, settings):
            if time.time() - start > args.budget:
                break
            opts = dict(BLOCK_N=bn, num_warps=w, num_stages=st, **extra)
            if split != "auto":
                opts["SPLIT_KV"] = int(split)
            name = f"split={split} BLOCK_N={bn} w{w} s{st}" + "".join(f" {key}={value}" for key, value in extra.items())
            try:
                ours(q, k, v, kernel_options=opts, enable_gqa=True)
                ms = triton.testing.do_bench_cudagraph(lambda: ours(q, k, v, kernel_options=opts, enable_gqa=True), rep=50,
                                                       return_mode="median")
            except Exception as exc:  # a config the compiler rejects is skipped, not fatal
                print(f"  skip {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}", flush=True)
                continue
            rows.append((ms, name))
        rows.sort()
        for ms, name in rows[:args.top]:
            line = f"| {B} | {S} | {name} | {ms * 1e3:.1f} | {sdpa_ms * 1e3:.1f} | {sdpa_ms / ms:.2f} |"
            summary.append(line)
            print(line, flush=True)
    print("\n| B | KV | config | flexattn us | sdpa us | flexattn/sdpa speed |")
    print("|---|---|---|---|---|---|")
    print("\n".join(summary))


if __name__ == "__main__":
    main()

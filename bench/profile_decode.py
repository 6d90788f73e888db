"""Where decoding's time goes: per-kernel GPU time of flexattn's decode beside SDPA's.

    python bench/profile_decode.py [--batches 1,8] [--kv 8192,32768] [--options '{"FUSED_MERGE": true}']
    python bench/profile_decode.py --batches 8 --kv 8192 --window 1024 --paged

One query token at position S-1 against S cached tokens, 32 query heads on 8 KV heads,
D=128, bf16, no mask or ``--window`` (bench_decode.py's cases, built by its functions).
For each (B, S) it prints, for flexattn (default kernel_options, and each ``--options``
set), for flexattn on a paged cache with ``--paged`` (bench_decode's pages of 128
tokens in shuffled order; the same kernel_options sets) and, without a window, for SDPA with enable_gqa: the CUDA-graph replay time (as bench_decode reports it) and every kernel of
one call from torch.profiler: name, microseconds and launches, so that the split-KV pass,
the merge pass and SDPA's own kernels (their names say which backend SDPA picked) can be
compared one by one. A diagnosis tool; nothing is written to bench/results.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton.testing

import flexattn
from _tuning import allow_recompiles
from bench_decode import Case, paged_inputs, window_mask
from profile_case import PROFILED_CALLS, kernel_table

HQ, HKV, D = 32, 8, 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--kv", default="8192,32768")
    parser.add_argument("--options", action="append", default=[],
                        help="JSON kernel_options for one more flexattn row (repeatable)")
    parser.add_argument("--window", type=int, default=None, help="sliding window of this many keys")
    parser.add_argument("--paged", action="store_true", help="also flexattn on a paged KV cache")
    parser.add_argument("--page-size", type=int, default=128)
    parser.add_argument("--pool-layouts", default="heads",
                        help="comma list of PagedKVCache layouts of the paged rows (heads, tokens, pages)")
    args = parser.parse_args()
    allow_recompiles()
    ours = torch.compile(flexattn.flex_attention, fullgraph=True, dynamic=False)
    variants = [("flexattn", {})] + [(f"flexattn {text}", json.loads(text)) for text in args.options]
    summary = []
    for B, S in itertools.product((int(b) for b in args.batches.split(",")), (int(s) for s in args.kv.split(","))):
        q = torch.randn(B, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, HKV, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        case = Case(B, HQ, HKV, S, D, args.window)
        mask = None if args.window is None else flexattn.create_block_mask(
            window_mask(S - 1, args.window), None, None, 1, S, device="cuda")
        calls = [(name, lambda opts=opts: ours(q, k, v, block_mask=mask, kernel_options=opts, enable_gqa=True))
                 for name, opts in variants]
        for layout in args.pool_layouts.split(",") if args.paged else []:
            k_pool, v_pool, paged_mask = paged_inputs(case, k, v, args.page_size, layout)
            calls += [(name.replace("flexattn", f"flexattn paged {layout}", 1),
                       lambda opts=opts, k_pool=k_pool, v_pool=v_pool, paged_mask=paged_mask: ours(
                           q, k_pool, v_pool, block_mask=paged_mask, kernel_options=opts, enable_gqa=True))
                      for name, opts in variants]
        if args.window is None:
            calls.append(("sdpa", lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)))
        for name, call in calls:
            call()
            graph_us = 1e3 * triton.testing.do_bench_cudagraph(call, rep=50, return_mode="median")
            rows = kernel_table(call, [])
            print(f"===== B={B} S={S} {name}: CUDA graph {graph_us:.1f} us; kernels per call "
                  f"(over {PROFILED_CALLS} calls):", flush=True)
            for kernel, us, launches in rows:
                print(f"  {us:8.1f} us  x{launches}  {kernel[:120]}")
            summary.append(f"| {B} | {S} | {name} | {graph_us:.1f} | "
                           + "; ".join(f"{kernel[:48]} {us:.1f}" for kernel, us, _ in rows[:3]) + " |")
    print("\n| B | KV | impl | CUDA-graph us | kernels (us) |\n|---|---|---|---|---|")
    print("\n".join(summary))


if __name__ == "__main__":
    main()

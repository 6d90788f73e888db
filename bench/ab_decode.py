"""A/B timing of decode kernel_options variants beside SDPA, round-robin.

    python bench/ab_decode.py --cases 32x8192,32x32768 \
        --variants '{"default": {}, "wide": {"BLOCK_N": 128, "num_stages": 2}}' [--rounds 5]

One query token at position S-1 against a KV cache of S tokens (case ``BxS``), 32 query
heads on 8 KV heads, D=128, bf16, no mask (flex_attention's default mask). Each variant is
``torch.compile(flexattn.flex_attention)`` with its kernel_options. tune_decode.py times each
configuration once, so two readings a few tenths of a percent apart say little; here every
variant and SDPA are timed ``--rounds`` times in turn (CUDA-graph replay) and the table
gives the median and the spread (max - min over the rounds, in % of the median), and each
variant's SDPA time over its own (> 1: flexattn faster).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
import triton.testing

import flexattn
from _tuning import allow_recompiles

HQ, HKV, D = 32, 8, 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="32x8192,32x32768", help="comma list of BxS")
    parser.add_argument("--variants", default='{"default": {}}', help="JSON: name -> kernel_options")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rep", type=int, default=100, help="ms of replays per timing")
    args = parser.parse_args()
    variants = json.loads(args.variants)
    allow_recompiles()
    print("| B | KV | impl | median us | spread % | sdpa/impl |")
    print("|---|---|---|---|---|---|")
    for case in args.cases.split(","):
        B, S = (int(x) for x in case.split("x"))
        q = torch.randn(B, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, HKV, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        calls = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)}
        for name, options in variants.items():
            compiled = torch.compile(flexattn.flex_attention, fullgraph=True, dynamic=False)
            calls[name] = lambda c=compiled, o=options: c(q, k, v, kernel_options=o or None, enable_gqa=True)
        for call in calls.values():
            call()
        torch.cuda.synchronize()
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, call in calls.items():
                times[name].append(1e3 * triton.testing.do_bench_cudagraph(call, rep=args.rep, return_mode="median"))
        sdpa = statistics.median(times["sdpa"])
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"| {B} | {S} | {name} | {med:.1f} | {100 * (max(ts) - min(ts)) / med:.2f} | {sdpa / med:.4f} |",
                  flush=True)
        del q, k, v, calls
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

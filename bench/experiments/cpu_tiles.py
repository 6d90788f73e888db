"""Which tiles should the CPU engine use? Query tile rows x KV span keys, on the CPU.

Each plan is forced on the lowering (``flexattn.cpu.plan.plan`` patched), the call
compiled afresh and timed in rounds taken in turn: B=1 H=8 D=64 float32 forward at
S=4096, causal and document (8 docs) masks with 128-blocks, and the causal
forward+backward.
The forward merges query blocks with the same KV list (a document's) up to the plan's query
tile, so 256 rows are a plan too; spans of 128, 256 or 512 keys (512 is also the longest
row a mod function takes).

    PYTHONPATH=. python bench/experiments/cpu_tiles.py --rounds 3
    PYTHONPATH=. python bench/experiments/cpu_tiles.py --length 16384 --cases document_8/fwd,causal/fwd \
        --plans 256x512,256x256,128x512 --dtype bfloat16 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_cpu  # noqa: E402
from flexattn.cpu import plan as cpu_plan  # noqa: E402

PLANS = [(q, kv) for q in (64, 128) for kv in (128, 256, 512)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--plans", help="comma list of QxKV (default: 64 and 128 rows x 128, 256, 512 keys)")
    parser.add_argument("--cases", default="causal/fwd,document_8/fwd,causal/fwdbwd", help="variant/mode list")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    plans = [tuple(map(int, p.split("x"))) for p in args.plans.split(",")] if args.plans else PLANS
    dtype = getattr(torch, args.dtype)
    original = cpu_plan.plan
    cases = [tuple(c.split("/")) for c in args.cases.split(",")]
    times = {(c, p): [] for c in cases for p in plans}
    calls = {}
    for plan in plans:
        cpu_plan.plan = lambda inputs, plan=plan: cpu_plan.CpuPlan(q_tile=plan[0], kv_tile=plan[1])
        for variant, mode in cases:
            torch._dynamo.reset()
            fn = bench_cpu.make_call("flexattn", variant, args.length, dtype, mode == "fwdbwd")
            fn()
            calls[(variant, mode), plan] = fn
    cpu_plan.plan = original
    for _ in range(args.rounds):
        for key, fn in calls.items():
            times[key].append(bench_cpu.time_ms(fn, 2))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, S={args.length}, {args.dtype}, ms")
    print("| q tile | kv span | " + " | ".join(f"{v} {m}" for v, m in cases) + " |")
    print("| --- | --- |" + " --- |" * len(cases))
    for plan in plans:
        cells = [f"{statistics.median(times[c, plan]):.1f}" for c in cases]
        print(f"| {plan[0]} | {plan[1]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

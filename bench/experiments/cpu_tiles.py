"""Which tiles should the CPU engine use? Query tile rows x KV span keys, on the CPU.

Each plan is forced on the lowering (``configs.cpu.plan`` patched), the call compiled
afresh and timed in rounds taken in turn: B=1 H=8 D=64 float32 forward at S=4096,
causal and document (8 docs) masks with 128-blocks, and the causal forward+backward.
A query tile cannot pass the mask's 128-row blocks, so the question is 64 or 128 rows,
and spans of 128, 256 or 512 keys (512 is also the longest row a mod function takes).

    PYTHONPATH=. python bench/experiments/cpu_tiles.py --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_cpu  # noqa: E402
from flexattn.lowering.configs import cpu as cpu_configs  # noqa: E402

PLANS = [(q, kv) for q in (64, 128) for kv in (128, 256, 512)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    original = cpu_configs.plan
    cases = [("causal", "fwd"), ("document_8", "fwd"), ("causal", "fwdbwd")]
    times = {(c, p): [] for c in cases for p in PLANS}
    calls = {}
    for plan in PLANS:
        cpu_configs.plan = lambda inputs, plan=plan: cpu_configs.CpuPlan(q_tile=plan[0], kv_tile=plan[1])
        for variant, mode in cases:
            torch._dynamo.reset()
            fn = bench_cpu.make_call("flexattn", variant, args.length, torch.float32, mode == "fwdbwd")
            fn()
            calls[(variant, mode), plan] = fn
    cpu_configs.plan = original
    for _ in range(args.rounds):
        for key, fn in calls.items():
            times[key].append(bench_cpu.time_ms(fn, 2))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, S={args.length}, float32, ms")
    print("| q tile | kv span | " + " | ".join(f"{v} {m}" for v, m in cases) + " |")
    print("| --- | --- |" + " --- |" * len(cases))
    for plan in PLANS:
        cells = [f"{statistics.median(times[c, plan]):.1f}" for c in cases]
        print(f"| {plan[0]} | {plan[1]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

"""What does one small compiled call cost on the CPU, where the host's work is most of it?
flexattn's and torch's compiled flex_attention (Inductor's C++ backend), float32 unless
``--dtype`` says otherwise, at shapes whose arithmetic is a few microseconds: a 16-token
causal call, decode steps (one query row against S keys), four query rows (speculative
decoding's check), a 128-token causal forward and a 64-token forward+backward (flexattn
alone: torch's flex has no CPU backward). Median microseconds per call over ``--rounds``
rounds taken in turn, each round ``--calls`` back-to-back calls.

    PYTHONPATH=. python bench/experiments/cpu_call_cost.py
    PYTHONPATH=. python bench/experiments/cpu_call_cost.py --dtype bfloat16 --cases "decode S=4096 H=8 D=64"
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from torch.nn.attention import flex_attention as tflex

import flexattn

#: name -> (B, H, L, S, D, forward+backward)
CASES = {
    "causal S=16 D=16": (1, 1, 16, 16, 16, False),
    "decode S=512 H=8 D=64": (1, 8, 1, 512, 64, False),
    "decode S=4096 H=8 D=64": (1, 8, 1, 4096, 64, False),
    "4 queries S=4096 H=8 D=64": (1, 8, 4, 4096, 64, False),
    "causal S=128 H=4 D=64": (1, 4, 128, 128, 64, False),
    "causal S=64 H=2 D=32 fwd+bwd": (1, 2, 64, 64, 32, True),
}


def build(lib, B, H, L, S, D, backward, dtype=torch.float32):
    q = torch.randn(B, H, L, D, dtype=dtype, requires_grad=backward)
    k, v = (torch.randn(B, H, S, D, dtype=dtype, requires_grad=backward) for _ in range(2))

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + (S - L)

    block_mask = lib.create_block_mask(causal, None, None, L, S, device="cpu")
    compiled = torch.compile(lib.flex_attention, fullgraph=True)

    def call():
        out = compiled(q, k, v, block_mask=block_mask)
        if backward:
            out.sum().backward()

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch._dynamo.config.cache_size_limit = 64
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}; us per call, median of {args.rounds} "
          f"rounds of {args.calls} calls taken in turn")
    print("| case | flexattn us | torch us | flexattn / torch |")
    print("| --- | --- | --- | --- |")
    for name in args.cases.split(","):
        B, H, L, S, D, backward = CASES[name]
        calls = {"flexattn": build(flexattn, B, H, L, S, D, backward, dtype)}
        if not backward:
            calls["torch"] = build(tflex, B, H, L, S, D, backward, dtype)
        times = {lib: [] for lib in calls}
        for call in calls.values():
            for _ in range(20):
                call()
        for _ in range(args.rounds):
            for lib, call in calls.items():
                start = time.perf_counter()
                for _ in range(args.calls):
                    call()
                times[lib].append((time.perf_counter() - start) / args.calls * 1e6)
        med = {lib: statistics.median(t) for lib, t in times.items()}
        torch_us = med.get("torch")
        print(f"| {name} | {med['flexattn']:.1f} | " + (f"{torch_us:.1f} | {med['flexattn'] / torch_us:.2f} |"
                                                       if torch_us else "- | - |"), flush=True)


if __name__ == "__main__":
    main()

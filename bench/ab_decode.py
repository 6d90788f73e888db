"""A/B timing of decode kernel_options variants beside SDPA, round-robin.

    python bench/ab_decode.py --cases 32x8192,32x32768 \
        --variants '{"default": {}, "wide": {"BLOCK_N": 128, "num_stages": 2}}' [--rounds 5]

One query token at position S-1 against a KV cache of S tokens (case ``BxS``), 32 query
heads on 8 KV heads, D=128, bf16, no mask (flex_attention's default mask). Each variant is
``torch.compile(flexattn.flex_attention)`` with its kernel_options. ``bench/tune.py
--kernel decode`` times each configuration once, so two readings a few tenths of a percent
apart say little; here every variant and SDPA are timed ``--rounds`` times in turn
(CUDA-graph replay) and the table gives the median and the spread (max - min over the
rounds, in % of the median), and each variant's SDPA time over its own (> 1: flexattn
faster). ``--read-roof`` adds ``read``, a kernel that only streams the same K and V bytes,
and each variant's fraction of its speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing

import flexattn

sys.path.insert(0, str(Path(__file__).resolve().parent))   # bench/, for its shared helpers
from _tuning import allow_recompiles  # noqa: E402

HQ, HKV, D = 32, 8, 128
#: (programs per SM, elements per load, num_warps) of the read-roof kernel tried.
READ_SHAPES = [(p, b, w) for p in (1, 2, 4) for b in (4096, 8192) for w in (4, 8)]


@triton.jit
def stream_sum(X, Y, OUT, N_PER_PROGRAM, BLOCK: tl.constexpr):
    """Program p sums elements [p * N_PER_PROGRAM, (p + 1) * N_PER_PROGRAM) of X and of
    Y (N_PER_PROGRAM a multiple of BLOCK) into OUT[p]: a pure streaming read."""
    off = tl.program_id(0).to(tl.int64) * N_PER_PROGRAM
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, N_PER_PROGRAM, BLOCK):
        acc += tl.load(X + off + start + offs).to(tl.float32)
        acc += tl.load(Y + off + start + offs).to(tl.float32)
    tl.store(OUT + tl.program_id(0), tl.sum(acc))


def read_roof_call(k: torch.Tensor, v: torch.Tensor):
    """The fastest stream_sum launch over k and v (one CUDA-graph timing per shape)."""
    sms = torch.cuda.get_device_properties(k.device).multi_processor_count
    n = k.numel()
    best = None
    for per_sm, block, warps in READ_SHAPES:
        programs = sms * per_sm
        per_program = n // programs // block * block
        if per_program == 0:
            continue
        out = torch.empty(programs, device=k.device, dtype=torch.float32)

        def call(programs=programs, per_program=per_program, block=block, warps=warps, out=out):
            stream_sum[(programs,)](k, v, out, per_program, BLOCK=block, num_warps=warps)

        call()
        t = triton.testing.do_bench_cudagraph(call, rep=50, return_mode="median")
        # Shapes that leave a remainder unread are scaled up to the whole bytes.
        t *= n / (programs * per_program)
        if best is None or t < best[0]:
            best = (t, call, n / (programs * per_program))
    _, call, scale = best
    return call, scale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="32x8192,32x32768", help="comma list of BxS")
    parser.add_argument("--variants", default='{"default": {}}', help="JSON: name -> kernel_options")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rep", type=int, default=100, help="ms of replays per timing")
    parser.add_argument("--read-roof", action="store_true", help="time a pure streaming read of K and V too")
    args = parser.parse_args()
    variants = json.loads(args.variants)
    allow_recompiles()
    print("| B | KV | impl | median us | spread % | sdpa/impl | read/impl |")
    print("|---|---|---|---|---|---|---|")
    for case in args.cases.split(","):
        B, S = (int(x) for x in case.split("x"))
        q = torch.randn(B, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, HKV, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        calls = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)}
        for name, options in variants.items():
            compiled = torch.compile(flexattn.flex_attention, fullgraph=True, dynamic=False)
            calls[name] = lambda c=compiled, o=options: c(q, k, v, kernel_options=o or None, enable_gqa=True)
        read_scale = 1.0
        if args.read_roof:
            calls["read"], read_scale = read_roof_call(k, v)
        for call in calls.values():
            call()
        torch.cuda.synchronize()
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, call in calls.items():
                scale = read_scale if name == "read" else 1.0
                times[name].append(1e3 * scale * triton.testing.do_bench_cudagraph(call, rep=args.rep,
                                                                                    return_mode="median"))
        sdpa = statistics.median(times["sdpa"])
        read = statistics.median(times["read"]) if "read" in times else None
        for name, ts in times.items():
            med = statistics.median(ts)
            roof = "" if read is None else f"{read / med:.4f}"
            print(f"| {B} | {S} | {name} | {med:.1f} | {100 * (max(ts) - min(ts)) / med:.2f} | {sdpa / med:.4f} "
                  f"| {roof} |", flush=True)
        del q, k, v, calls
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

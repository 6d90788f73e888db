"""Which backward programs repay their descriptors? flexattn's forward+backward with the
backward's walked tiles through descriptors in both program kinds, in the dK/dV programs
only, in the dQ programs only, or in neither, bf16 B=4 H=16; GPU kernel time per call
(profiler), rounds in turn (bench/DECISIONS.md#tma-backward-programs). Every call asks
for USE_TMA=True, so the forward is the same descriptor kernel in every variant and the
differences are the backward's.

    PYTHONPATH=. python bench/experiments/backward_tma_split.py --lengths 2048,4096,8192
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import flexattn  # noqa: E402
from flexattn.lowering.configs import tma as tma_configs  # noqa: E402
from tma_by_length import B, H, kernel_us, masks  # noqa: E402

# Each variant's kernels are chosen while it compiles; cached graphs would hand one
# variant's kernels to the next.
torch._inductor.config.force_disable_caches = True
torch._dynamo.config.cache_size_limit = 512

#: variant: the backward's (dK/dV, dQ) descriptor use.
VARIANTS = {
    "both": tma_configs.BackwardTma(dkdv=True, dq=True),
    "dkdv": tma_configs.BackwardTma(dkdv=True, dq=False),
    "dq": tma_configs.BackwardTma(dkdv=False, dq=True),
    "pointer": tma_configs.BackwardTma(dkdv=False, dq=False),
}


def compiled_call(tag: str):
    """A compiled wrapper with a code object of its own, so that Dynamo keeps one cache
    entry per variant (the variants differ only in what the lowering decides)."""
    namespace = {"flex_attention": flexattn.flex_attention}
    exec(f"def attn_{tag}(q, k, v, bm, opts):\n"
         "    return flex_attention(q, k, v, block_mask=bm, kernel_options=opts)\n", namespace)
    return torch.compile(namespace[f"attn_{tag}"], fullgraph=True, dynamic=False)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="2048,4096,8192")
    parser.add_argument("--dims", default="128")
    parser.add_argument("--masks", default="causal,document_causal")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    names = args.variants.split(",")
    ratios = [n for n in names if n != "both"] if "both" in names else []
    header = ["S", "D", "mask", *(f"{n} us" for n in names), *(f"{n} / both" for n in ratios)]
    print("| " + " | ".join(header) + " |")
    print("| --- " * len(header) + "|", flush=True)
    original = tma_configs.backward_tma_programs
    for S in map(int, args.lengths.split(",")):
        for D in map(int, args.dims.split(",")):
            for mask_name in args.masks.split(","):
                mask = masks(S)[mask_name]
                bm = None if mask is None else flexattn.create_block_mask(mask, None, None, S, S, device="cuda")
                q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                           for _ in range(3))
                do = torch.randn_like(q)
                calls = {}
                for name in names:
                    f = compiled_call(f"{name}_{S}_{D}_{mask_name}")

                    def call(f=f):
                        f(q, k, v, bm, {"USE_TMA": True}).backward(do)
                    tma_configs.backward_tma_programs = (
                        lambda use_tma, requested, dq_atomic, wanted=VARIANTS[name]:
                        tma_configs.BackwardTma(dkdv=use_tma and wanted.dkdv, dq=use_tma and wanted.dq))
                    try:
                        call()  # the forward and the backward compile here, under this variant's choice
                    finally:
                        tma_configs.backward_tma_programs = original
                    calls[name] = call
                times = {name: [] for name in names}
                for _ in range(args.rounds):
                    for name, call in calls.items():
                        times[name].append(kernel_us(call, [q, k, v]))
                med = {name: statistics.median(t) for name, t in times.items()}
                cells = [f"{med[n]:.1f}" for n in names]
                cells += [f"{med[n] / med['both']:.3f}" for n in ratios]
                print(f"| {S} | {D} | {mask_name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()

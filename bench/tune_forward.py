"""Sweep forward tile configurations on the GPU, beside torch's flex_attention.

    python bench/tune_forward.py [--cases no_mask,causal] [--dims 64,128,256] [--seq 8192]

For each (case, head dim) it times flexattn with each configuration pinned through
kernel_options, and torch's compiled flex_attention with its defaults, and prints the
TFLOP/s of each and the best configuration. The tables in
flexattn/lowering/configs.py are chosen from these readings.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton.testing
from torch.nn.attention import flex_attention as torch_flex

import flexattn
from flexattn import mods

CONFIGS = [
    dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
    for m, n, w, s in itertools.product((64, 128), (64, 128), (4, 8), (2, 3))
]

MASKS = {"no_mask": None, "causal": mods.causal_mask}


def _fits(cfg: dict, dim: int) -> bool:
    """Skip shapes that cannot fit in shared memory or need too many registers."""
    tile_bytes = 2 * dim * (cfg["BLOCK_M"] + 2 * cfg["BLOCK_N"] * cfg["num_stages"])
    if tile_bytes > 220 * 1024:
        return False
    if dim == 256 and cfg["BLOCK_M"] == 128 and cfg["num_warps"] == 4:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", default="no_mask,causal")
    parser.add_argument("--dims", default="64,128,256")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--top", type=int, default=3)
    args = parser.parse_args()
    S, B, H = args.seq, args.batch, args.heads
    ours = torch.compile(flexattn.flex_attention, fullgraph=True)
    theirs = torch.compile(torch_flex.flex_attention, fullgraph=True)
    lines = []
    for case in args.cases.split(","):
        mask_mod = MASKS[case]
        bm = flexattn.create_block_mask(mask_mod, None, None, S, S, device="cuda") if mask_mod else None
        tbm = torch_flex.create_block_mask(mask_mod, None, None, S, S, device="cuda") if mask_mod else None
        density = 0.5 if mask_mod else 1.0
        for dim in (int(d) for d in args.dims.split(",")):
            b = max(1, B * 128 // dim) if dim > 128 else B
            q, k, v = (torch.randn(b, H, S, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            flops = 4 * b * H * S * S * dim * density
            ms = triton.testing.do_bench(lambda: theirs(q, k, v, block_mask=tbm), warmup=25, rep=100, return_mode="median")
            torch_tflops = flops / ms / 1e9
            results = []
            for cfg in CONFIGS:
                if not _fits(cfg, dim):
                    continue
                try:
                    ms = triton.testing.do_bench(lambda: ours(q, k, v, block_mask=bm, kernel_options=cfg),
                                                 warmup=25, rep=100, return_mode="median")
                except Exception as exc:  # a config the compiler rejects is skipped, not fatal
                    print(f"  skip {cfg}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
                    continue
                results.append((flops / ms / 1e9, cfg))
            results.sort(key=lambda r: -r[0])
            for tflops, cfg in results[: args.top]:
                lines.append(f"| {case} | {dim} | {tflops:.0f} | {torch_tflops:.0f} | {tflops / torch_tflops:.2f} | "
                             f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']} |")
            print(lines[-1], flush=True)
    print("\n| case | D | flexattn TFLOP/s | torch flex | ratio | config |")
    print("|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""Sweep forward tile configurations on the GPU, beside torch's flex_attention.

    python bench/tune_forward.py [--cases no_mask,causal,softcap] [--dims 64,128,256] [--seq 8192]
                                 [--budget SECONDS] [--configs 128x64w4s2,...]
                                 [--grid '{"USE_TMA": [true, false], "ONE_KV_LOOP": [true, false]}']

For each (case, head dim) it times the bf16 forward of flexattn with each candidate
configuration pinned through kernel_options (each one under every combination of the
``--grid`` kernel_options), and torch's compiled flex_attention with
its defaults, and prints the TFLOP/s of each and the best configurations. The tables in
flexattn/lowering/configs.py are chosen from these readings.
"""

from __future__ import annotations

import argparse
import itertools
import re
import time

import torch
import triton.testing
from torch.nn.attention import flex_attention as torch_flex

import flexattn
from _tuning import allow_recompiles, grid_settings
from flexattn import mods

#: (score_mod, mask_mod, fraction of the scores computed) per case.
CASES = {
    "no_mask": (None, None, 1.0),
    "causal": (None, mods.causal_mask, 0.5),
    "softcap": (mods.tanh_softcap(30.0), mods.causal_mask, 0.5),
}


def candidates(dim: int) -> list[dict]:
    """Configurations tried at head dim ``dim``: those whose pipelined K/V tiles fit in
    Hopper's shared memory, and no 128-row tile with 4 warps at D=256 (register spills)."""
    block_ns = (32, 64) if dim > 128 else (64, 128)
    grid = itertools.product((64, 128), block_ns, (4, 8), (2, 3, 4))
    out = []
    for m, n, w, s in grid:
        if 2 * dim * (m + 2 * n * s) > 220 * 1024:
            continue
        if dim > 128 and m == 128 and w == 4:
            continue
        out.append(dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s))
    return out


def parse_configs(text: str) -> list[dict]:
    """``128x64w4s2,...`` as kernel_options dicts (BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    configs = []
    for item in text.split(","):
        match = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)", item.strip())
        if match is None:
            raise SystemExit(f"--configs: expected MxNwWsS, e.g. 128x64w4s2, got {item!r}")
        m, n, w, s = (int(g) for g in match.groups())
        configs.append(dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s))
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", default="no_mask,causal")
    parser.add_argument("--dims", default="64,128,256")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4, help="halved at D=256, as in the benchmark")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--top", type=int, default=3)
    parser.add_argument("--budget", type=float, default=1e9, help="stop starting new configs after this many s")
    parser.add_argument("--grid", default="{}", help="JSON: kernel_options key -> list of values, each config "
                        "is timed under every combination")
    parser.add_argument("--configs", default="", help="these configs instead of the candidate list, e.g. 128x64w4s2,128x128w8s3")
    args = parser.parse_args()
    settings = grid_settings(args.grid)
    S, H = args.seq, args.heads
    allow_recompiles()
    ours = torch.compile(flexattn.flex_attention, fullgraph=True, dynamic=False)
    theirs = torch.compile(torch_flex.flex_attention, fullgraph=True, dynamic=False)
    start = time.time()
    lines = []
    for case in args.cases.split(","):
        score_mod, mask_mod, density = CASES[case]
        bm = flexattn.create_block_mask(mask_mod, None, None, S, S, device="cuda") if mask_mod else None
        tbm = torch_flex.create_block_mask(mask_mod, None, None, S, S, device="cuda") if mask_mod else None
        for dim in (int(d) for d in args.dims.split(",")):
            b = max(1, args.batch // 2) if dim > 128 else args.batch
            q, k, v = (torch.randn(b, H, S, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            flops = 4 * b * H * S * S * dim * density
            ms = triton.testing.do_bench(lambda: theirs(q, k, v, score_mod, block_mask=tbm),
                                         warmup=25, rep=100, return_mode="median")
            torch_tflops = flops / ms / 1e9
            print(f"{case} D={dim}: torch flex {torch_tflops:.0f} TFLOP/s", flush=True)
            results = []
            configs = parse_configs(args.configs) if args.configs else candidates(dim)
            for cfg, extra in itertools.product(configs, settings):
                if time.time() - start > args.budget:
                    print("  budget spent; stopping", flush=True)
                    break
                name = f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']}"
                cfg = dict(cfg, **extra)
                name += "".join(f" {key}={value}" for key, value in extra.items())
                try:
                    ms = triton.testing.do_bench(lambda: ours(q, k, v, score_mod, block_mask=bm, kernel_options=cfg),
                                                 warmup=25, rep=100, return_mode="median")
                except Exception as exc:  # a config the compiler rejects is skipped, not fatal
                    print(f"  skip {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", flush=True)
                    continue
                results.append((flops / ms / 1e9, name))
                print(f"  {name}: {results[-1][0]:.0f} TFLOP/s ({results[-1][0] / torch_tflops:.2f}x)", flush=True)
            results.sort(key=lambda r: -r[0])
            for tflops, name in results[: args.top]:
                lines.append(f"| {case} | {dim} | {tflops:.0f} | {torch_tflops:.0f} | {tflops / torch_tflops:.2f} | "
                             f"{name} |")
    print("\n| case | D | flexattn TFLOP/s | torch flex | ratio | config |")
    print("|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

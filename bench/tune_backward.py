"""Sweep backward tile configurations on the GPU, beside torch's flex_attention.

    python bench/tune_backward.py [--dims 64,128,256] [--seq 4096] [--cases causal,no_mask,alibi,...]
                                  [--exhaustive] [--configs 64/64/64/64w4s2,...] [--kv-heads 4]
                                  [--grid '{"USE_TMA": [true, false], "bwd_ONE_KV_LOOP": [true, false]}']

For each head dim it times forward+backward of bf16 attention (causal by default) with flexattn's
backward tiles pinned through kernel_options (``bwd_BLOCK_M1`` ... ``bwd_num_stages``;
the forward keeps its defaults), and torch's compiled flex_attention with its defaults,
and prints the TFLOP/s of each configuration (each one under every combination of the
``--grid`` kernel_options), best first. The ``DEFAULTS`` table of
flexattn/lowering/backward_configs.py is chosen from these readings.
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
    "alibi": ("alibi", mods.causal_mask, 0.5),
    "softcap": (mods.tanh_softcap(30.0), mods.causal_mask, 0.5),
    "document": (None, "document", None),
}


def candidates(dim: int, exhaustive: bool, dq_atomic: bool = False) -> list[tuple[int, int, int, int, int, int]]:
    """(BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages) to try at ``dim``.
    With dQ atomics there are no dQ programs (BLOCK_M2/N2 unused), and a wide key tile
    spreads each atomic dQ share over more keys."""
    if dq_atomic:
        tiles = [(64, 128, 64, 64), (32, 128, 64, 64), (64, 64, 64, 64), (128, 128, 64, 64)] if dim <= 128 \
            else [(32, 64, 64, 64), (64, 64, 64, 64), (32, 128, 64, 64)]
        stages = (1, 2, 3) if exhaustive or dim > 128 else (2, 3)
        return [(*t, w, s) for t, w, s in itertools.product(tiles, (4, 8), stages)
                if not (t[0] * t[1] >= 64 * 128 and w == 4)]
    if dim <= 64:
        tiles = [(64, 128, 128, 64), (32, 128, 128, 32), (64, 64, 64, 64)]
    elif dim <= 128:
        tiles = [(64, 128, 128, 64), (32, 128, 128, 32), (64, 64, 64, 64), (32, 64, 64, 32)]
    else:
        tiles = [(32, 64, 64, 32), (64, 64, 64, 64), (16, 64, 64, 16), (32, 128, 128, 32),
                 (64, 64, 64, 32), (32, 64, 64, 64)]
    warps = (4, 8)
    stages = (1, 2, 3) if exhaustive or dim > 128 else (2, 3)
    return [(*t, w, s) for t, w, s in itertools.product(tiles, warps, stages)]


def parse_configs(text: str) -> list[tuple[int, int, int, int, int, int]]:
    """``64/64/64/64w4s2,...`` as (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages)."""
    configs = []
    for item in text.split(","):
        match = re.fullmatch(r"(\d+)/(\d+)/(\d+)/(\d+)w(\d+)s(\d+)", item.strip())
        if match is None:
            raise SystemExit(f"--configs: expected M1/N1/M2/N2wWsS, e.g. 64/64/64/64w4s2, got {item!r}")
        configs.append(tuple(int(g) for g in match.groups()))
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dims", default="64,128,256")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--cases", default="causal", help=f"comma-separated, of {sorted(CASES)}")
    parser.add_argument("--dq-atomic", choices=("default", "on", "off"), default="default",
                        help="kernel_options DQ_ATOMIC: dQ through atomics in the dK/dV programs, or dQ programs")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=None, help="GQA: fewer key/value heads")
    parser.add_argument("--tokens", type=int, default=16384,
                        help="batch = tokens // seq (// 2 at D=256, as in the benchmark)")
    parser.add_argument("--exhaustive", action="store_true")
    parser.add_argument("--budget", type=float, default=1e9, help="stop starting new configs after this many s")
    parser.add_argument("--grid", default="{}", help="JSON: kernel_options key -> list of values, each config "
                        "is timed under every combination")
    parser.add_argument("--configs", default="", help="these configs instead of the candidate list, e.g. 64/64/64/64w4s2,64/64/128/64w8s2")
    args = parser.parse_args()
    settings = grid_settings(args.grid)
    S, H = args.seq, args.heads
    Hkv = args.kv_heads or H
    allow_recompiles()
    ours = torch.compile(flexattn.flex_attention, fullgraph=True, dynamic=False)
    theirs = torch.compile(torch_flex.flex_attention, fullgraph=True, dynamic=False)
    start = time.time()
    summary = []
    for case, dim in itertools.product(args.cases.split(","), (int(d) for d in args.dims.split(","))):
        score_mod, mask_mod, density = CASES[case]
        if score_mod == "alibi":
            score_mod = mods.alibi(H, device="cuda")
        if mask_mod == "document":
            doc_ids = (torch.arange(S, device="cuda") * 7) // S  # seven documents of equal length
            mask_mod = mods.document_mask(doc_ids)
            density = sum(n * n for n in torch.bincount(doc_ids).tolist()) / (S * S)
        bm = flexattn.create_block_mask(mask_mod, None, None, S, S, device="cuda") if mask_mod else None
        tbm = torch_flex.create_block_mask(mask_mod, None, None, S, S, device="cuda") if mask_mod else None
        B = max(1, args.tokens // S // (2 if dim > 128 else 1))
        q = torch.randn(B, H, S, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(B, Hkv, S, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))
        dout = torch.randn(B, H, S, dim, device="cuda", dtype=torch.bfloat16)
        flops = 3.5 * 4 * B * H * S * S * dim * density

        def fwd_bwd(fn, **kw):
            def run():
                out = fn(q, k, v, score_mod, enable_gqa=Hkv != H, **kw)
                torch.autograd.grad(out, (q, k, v), dout)
            return run

        ms = triton.testing.do_bench(fwd_bwd(theirs, block_mask=tbm), warmup=25, rep=100, return_mode="median")
        torch_tflops = flops / ms / 1e9
        print(f"{case} D={dim} B={B}: torch flex {torch_tflops:.0f} TFLOP/s", flush=True)
        rows = []
        configs = parse_configs(args.configs) if args.configs else candidates(dim, args.exhaustive,
                                                                                 args.dq_atomic == "on")
        for (m1, n1, m2, n2, w, s), extra in itertools.product(configs, settings):
            if time.time() - start > args.budget:
                print("  budget spent; stopping", flush=True)
                break
            name = f"{m1}/{n1}/{m2}/{n2} w{w} s{s}"
            opts = dict(bwd_BLOCK_M1=m1, bwd_BLOCK_N1=n1, bwd_BLOCK_M2=m2, bwd_BLOCK_N2=n2,
                        bwd_num_warps=w, bwd_num_stages=s, **extra)
            if args.dq_atomic != "default":
                opts["DQ_ATOMIC"] = args.dq_atomic == "on"
            name += "".join(f" {key}={value}" for key, value in extra.items())
            try:
                ms = triton.testing.do_bench(fwd_bwd(ours, block_mask=bm, kernel_options=opts),
                                             warmup=25, rep=100, return_mode="median")
            except Exception as exc:  # a config the compiler rejects is skipped, not fatal
                print(f"  skip {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}", flush=True)
                continue
            rows.append((flops / ms / 1e9, name))
            print(f"  {name}: {rows[-1][0]:.0f} TFLOP/s ({rows[-1][0] / torch_tflops:.2f}x)", flush=True)
        rows.sort(key=lambda r: -r[0])
        for tflops, name in rows[:3]:
            summary.append(f"| {case} | {dim} | {name} | {tflops:.0f} | {torch_tflops:.0f} | {tflops / torch_tflops:.2f} |")
    print("\n| case | D | bwd config M1/N1/M2/N2 | flexattn TFLOP/s | torch flex | ratio |")
    print("|---|---|---|---|---|---|")
    print("\n".join(summary))


if __name__ == "__main__":
    main()

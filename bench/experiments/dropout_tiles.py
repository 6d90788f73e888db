"""Which tiles should a call with dropout take? Dropout adds Philox integer work and
registers to every tile, so the forward's and backward's defaults (chosen without it)
may no longer be best. Each case times, on the GPU, the forward with dropout under each
forward tile config (and without dropout under the same config), then forward+backward
with dropout under each backward config (the forward at its default), in one process.
``--dq-atomic`` times instead the backward that forms dQ in the dK/dV programs (DQ_ATOMIC,
one keep mask per tile pair instead of two), with and without dropout, beside the default.

    PYTHONPATH=. python bench/experiments/dropout_tiles.py --out bench/results

Writes ``dropout-tiles-<gpu>-<stamp>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
from triton.testing import do_bench

import flexattn
from flexattn import mods

DROPOUT_P = 0.1
B, H, S = 4, 16, 8192
# (BLOCK_M, BLOCK_N, warps, stages, ONE_KV_LOOP); the first is the sm90 default.
FORWARD = {
    64: [(64, 128, 4, 2, False), (64, 64, 4, 2, False), (64, 64, 4, 3, False), (128, 64, 8, 2, False),
         (128, 64, 4, 2, False), (128, 32, 4, 3, False), (64, 128, 8, 2, False), (128, 128, 8, 2, False)],
    128: [(128, 64, 4, 2, True), (128, 32, 4, 2, True), (64, 64, 4, 2, False), (128, 64, 8, 2, False),
          (128, 64, 8, 3, False), (64, 128, 4, 2, False), (128, 128, 8, 2, False), (64, 32, 4, 3, False)],
}
# (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, warps, stages, ONE_KV_LOOP); the first is the default.
BACKWARD = {
    64: [(64, 64, 64, 64, 4, 3, False), (64, 64, 64, 64, 8, 3, False), (64, 128, 128, 64, 8, 2, False),
         (64, 128, 128, 64, 8, 3, False), (32, 64, 64, 32, 4, 3, False), (64, 64, 64, 64, 8, 2, False),
         (64, 64, 64, 64, 4, 3, True)],
    128: [(64, 64, 64, 64, 4, 2, False), (64, 64, 64, 64, 8, 2, False), (32, 64, 64, 32, 4, 2, False),
          (64, 128, 128, 64, 8, 2, False), (32, 128, 128, 32, 8, 2, False), (64, 64, 64, 64, 8, 3, False),
          (64, 64, 64, 64, 4, 2, True)],
}
# DQ_ATOMIC backward variants: per-element atomics at the default tiles, then bulk
# reductions through a descriptor (USE_TMA) at the tiles that measured best for them.
DQ_ATOMIC_VARIANTS = [
    {"DQ_ATOMIC": True},
    {"DQ_ATOMIC": True, "bwd_num_warps": 8},
    {"DQ_ATOMIC": True, "USE_TMA": True, "bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_num_warps": 8, "bwd_num_stages": 2},
    {"DQ_ATOMIC": True, "USE_TMA": True, "bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_num_warps": 8,
     "bwd_num_stages": 2},
]
FORWARD_KEYS = ("fwd_BLOCK_M", "fwd_BLOCK_N", "fwd_num_warps", "fwd_num_stages", "fwd_ONE_KV_LOOP")
BACKWARD_KEYS = ("bwd_BLOCK_M1", "bwd_BLOCK_N1", "bwd_BLOCK_M2", "bwd_BLOCK_N2", "bwd_num_warps",
                 "bwd_num_stages", "bwd_ONE_KV_LOOP")


def timed(call) -> float:
    """The median of three do_bench medians, after one call (compilation)."""
    call()
    torch.cuda.synchronize()
    return sorted(do_bench(call, warmup=25, rep=150) for _ in range(3))[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="causal:64,causal:128,none:128", help="mask:head_dim, comma-separated")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--dq-atomic", action="store_true", help="time the DQ_ATOMIC backward variants only")
    args = parser.parse_args()
    torch._dynamo.config.cache_size_limit = 1000
    rows = []
    for case in args.cases.split(","):
        mask, D = case.split(":")[0], int(case.split(":")[1])
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        grad = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
        bm = flexattn.create_block_mask(mods.causal_mask, None, None, S, S, device="cuda") if mask == "causal" else None

        def compiled(p, options):
            return torch.compile(lambda q, k, v: flexattn.flex_attention(
                q, k, v, block_mask=bm, dropout_p=p, kernel_options=options), fullgraph=True)

        def forward_ms(f):
            with torch.no_grad():
                return timed(lambda: f(q, k, v))

        def fwd_bwd_ms(f):
            return timed(lambda: torch.autograd.grad(f(q, k, v), (q, k, v), grad))

        plain = compiled(0.0, None)
        rows.append({"case": f"{mask} D={D}", "config": "no dropout, defaults", "fwd_ms": forward_ms(plain),
                     "fwdbwd_ms": fwd_bwd_ms(plain)})
        if args.dq_atomic:
            for options in [None, *DQ_ATOMIC_VARIANTS]:
                rows.append({"case": f"{mask} D={D}", "config": "bwd " + json.dumps(options),
                             "fwdbwd_ms": fwd_bwd_ms(compiled(DROPOUT_P, options)),
                             "plain_fwdbwd_ms": fwd_bwd_ms(compiled(0.0, options)) if options else None})
                print(rows[-1], flush=True)
            torch._dynamo.reset()
            continue
        for cfg in FORWARD[D]:
            options = dict(zip(FORWARD_KEYS, cfg))
            rows.append({"case": f"{mask} D={D}", "config": "fwd " + json.dumps(list(cfg)),
                         "fwd_ms": forward_ms(compiled(DROPOUT_P, options)),
                         "plain_fwd_ms": forward_ms(compiled(0.0, options))})
            print(rows[-1], flush=True)
        for cfg in BACKWARD[D]:
            options = dict(zip(BACKWARD_KEYS, cfg))
            rows.append({"case": f"{mask} D={D}", "config": "bwd " + json.dumps(list(cfg)),
                         "fwdbwd_ms": fwd_bwd_ms(compiled(DROPOUT_P, options))})
            print(rows[-1], flush=True)
        torch._dynamo.reset()
    gpu = torch.cuda.get_device_name()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"dropout-tiles-{gpu.lower().replace(' ', '-')}-{stamp}.json"
    path.write_text(json.dumps({"gpu": gpu, "torch": torch.__version__, "dropout_p": DROPOUT_P,
                                "shape": [B, H, S], "rows": rows}, indent=1))
    cell = lambda x: f"{x:.3f}" if x is not None else ""  # noqa: E731
    print("| case | config | fwd ms | fwd+bwd ms | no dropout, same config, fwd ms | no dropout, same config, "
          "fwd+bwd ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['case']} | {row['config']} | {cell(row.get('fwd_ms'))} | {cell(row.get('fwdbwd_ms'))} | "
              f"{cell(row.get('plain_fwd_ms'))} | {cell(row.get('plain_fwdbwd_ms'))} |")
    print(f"results: {path}")


if __name__ == "__main__":
    main()

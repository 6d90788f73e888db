"""A/B timing of forward kernel_options variants beside torch's compiled flex_attention.

    PYTHONPATH=. python bench/ab_forward.py --lengths 2048,8192 --dims 128 --masks causal,document_causal \
        --variants '{"default": {}, "m64": {"BLOCK_M": 64}}' [--rounds 5] [--timer call]

Each case (S, head dim, mask; bf16 B=4 H=16) compiles every ``--variants`` entry (name ->
kernel_options; default: the index order against REVERSED_Q_TILES) and torch's flex afresh
(static shapes) and times them in rounds taken in turn; the table gives median
microseconds and each one's time over the first variant's. ``--timer graph`` (default)
replays each call in a CUDA graph, the GPU's time: below S=4096 a call's host time exceeds
its kernels'; ``--timer call`` times the compiled call as the suite does. Masks:
``causal``, ``sliding`` (1024 keys back), ``document`` / ``document_causal`` (8 equal
documents, or ``:N``-token ones), ``document_random:N`` / ``document_random_causal:N`` (N
documents of the suite's seeded random lengths), ``padding`` (a per-batch key length
between S/2 and S: a mask that reads memory and keeps long rows).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.nn.attention import flex_attention as tflex
from triton.testing import do_bench_cudagraph

import flexattn
from flexattn import mods

sys.path.insert(0, str(Path(__file__).resolve().parent))   # bench/, for its shared helpers
from _tuning import medians_in_turn  # noqa: E402
from bench_attention import document_ids  # noqa: E402

VARIANTS = {
    "index": {"REVERSED_Q_TILES": False},
    "reversed": {"REVERSED_Q_TILES": True},
}


def mask_of(name: str, S: int):
    """``name`` or ``name:N``: a document mask takes N-token documents (default: 8 per
    sequence); ``document_random:N`` / ``document_random_causal:N``: N documents of the
    suite's seeded random lengths (``bench_attention.document_ids``); ``padding`` keeps
    keys below a per-batch length between S/2 and S (a mask that reads memory and keeps
    long rows)."""
    name, _, arg = name.partition(":")
    if name in ("document_random", "document_random_causal"):
        docs = mods.document_mask(document_ids(S, int(arg or 8), torch.device("cuda")))
        return docs if name == "document_random" else flexattn.and_masks(docs, mods.causal_mask)
    if name in ("document", "document_causal") and arg:
        docs = mods.document_mask(torch.arange(S, device="cuda") // int(arg))
        return docs if name == "document" else flexattn.and_masks(docs, mods.causal_mask)
    if name == "padding":
        lengths = torch.linspace(S // 2, S, 4, device="cuda").long()
        # lengths[b] as one aten.index op (a 0-d index tensor traces; Python indexing would not).
        return lambda b, h, q_idx, kv_idx: kv_idx < torch.ops.aten.index.Tensor(lengths, [b])
    if name == "causal":
        return mods.causal_mask
    if name == "document":
        return mods.document_mask(torch.arange(S, device="cuda") * 8 // S)
    if name == "document_causal":
        return flexattn.and_masks(mods.document_mask(torch.arange(S, device="cuda") * 8 // S), mods.causal_mask)
    if name == "sliding":
        return mods.sliding_window(1024)
    raise ValueError(f"unknown mask {name!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,4096,8192")
    parser.add_argument("--dims", default="64,128")
    parser.add_argument("--masks", default="causal,document_causal")
    parser.add_argument("--variants", default=None, help="JSON {name: kernel_options}; default: " + json.dumps(VARIANTS))
    parser.add_argument("--timer", choices=("graph", "call"), default="graph")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    args = parser.parse_args()
    variants = json.loads(args.variants) if args.variants else VARIANTS
    torch._dynamo.config.cache_size_limit = 256
    B, H = args.batch, args.heads
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, B={B} H={H} bf16, timer {args.timer}, "
          f"{args.rounds} rounds in turn; variants {json.dumps(variants)}", flush=True)
    names = list(variants) + ["torch"]
    timer = (lambda call: do_bench_cudagraph(call, rep=100)) if args.timer == "graph" else None
    print("| S | D | mask | " + " | ".join(f"{n} us" for n in names) + " | "
          + " | ".join(f"{n} / {names[0]}" for n in names[1:]) + " |")
    print("| --- " * (3 + 2 * len(names) - 1) + "|")
    for S in (int(s) for s in args.lengths.split(",")):
        for D in (int(d) for d in args.dims.split(",")):
            for mask in args.masks.split(","):
                # Fresh Dynamo caches per case: each compile sees static shapes, as the suite's.
                torch.compiler.reset()
                mm = mask_of(mask, S)
                q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                bm = flexattn.create_block_mask(mm, None, None, S, S, device="cuda")
                tbm = tflex.create_block_mask(mm, None, None, S, S, device="cuda")
                fns = {name: torch.compile(lambda q, k, v, o=opts: flexattn.flex_attention(
                    q, k, v, block_mask=bm, kernel_options=o)) for name, opts in variants.items()}
                fns["torch"] = torch.compile(lambda q, k, v: tflex.flex_attention(q, k, v, block_mask=tbm))
                med = {name: ms * 1e3 for name, ms in medians_in_turn(fns, q, k, v, rounds=args.rounds,
                                                                        timer=timer).items()}
                base = med[names[0]]
                print(f"| {S} | {D} | {mask} | " + " | ".join(f"{med[n]:.1f}" for n in names) + " | "
                      + " | ".join(f"{med[n] / base:.3f}" for n in names[1:]) + " |", flush=True)


if __name__ == "__main__":
    main()

"""Sweep one kernel's tile configurations on the GPU, beside torch's flex_attention or SDPA.

    python bench/tune.py --kernel forward [--cases no_mask,causal,softcap] [--dims 64,128,256] [--seq 8192]
                         [--batch 4] [--configs 128x64w4s2,...] [--budget SECONDS]
                         [--grid '{"USE_TMA": [true, false], "ONE_KV_LOOP": [true, false]}']
    python bench/tune.py --kernel backward [--cases causal,no_mask,alibi,softcap,document] [--dims 64,128,256]
                         [--seq 4096] [--tokens 16384] [--kv-heads 4] [--exhaustive] [--dq-atomic on]
                         [--configs 64/64/64/64w4s2,...]
                         [--grid '{"USE_TMA": [true, false], "bwd_ONE_KV_LOOP": [true, false]}']
    python bench/tune.py --kernel decode [--batches 1,8] [--kv 8192,32768] [--splits auto,16,32,64]
                         [--tiles 64x4,128x4,128x8] [--stages 3,4] [--grid '{"USE_TMA": [true, false]}']

forward, backward: for each (case, head dim) it times bf16 attention, the forward alone or
forward+backward, with each candidate configuration pinned through kernel_options (the
forward's ``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``; the backward's
``bwd_BLOCK_M1`` ... ``bwd_num_stages``, the forward keeping its defaults), each under
every combination of the ``--grid`` kernel_options, and torch's compiled flex_attention
with its defaults, and prints the TFLOP/s of each and the best configurations. The
tables of flexattn/lowering/configs/forward.py and configs/backward.py are chosen from
these readings.

decode: one query token at position S-1 against a KV cache of S tokens, 32 query heads on
8 KV heads, D=128, bf16, no mask. For each case it times (CUDA-graph replay, so launch
gaps between the split and merge kernels count but Python overhead does not) SDPA with
enable_gqa, flexattn's defaults with either merge, and flexattn with each (SPLIT_KV,
BLOCK_N, num_warps, num_stages) pinned through kernel_options (each under every ``--grid``
combination), and prints the best configurations. The tables of
flexattn/lowering/configs/decode.py and the split rule of flexattn/lowering/decode_plan.py
are chosen from these readings.

Where each default was measured, and with what readings: bench/DECISIONS.md.
"""

from __future__ import annotations

import itertools
import math
import re
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import flex_attention as torch_flex

import flexattn
from _tuning import KernelParser, allow_recompiles, grid_settings
from flexattn import mods

KERNELS = ("forward", "backward", "decode")
#: (score_mod, mask_mod, fraction of the scores computed) per case of the forward and
#: backward sweeps; "alibi" and "document" are built per call (see ``case_mods``).
CASES = {
    "no_mask": (None, None, 1.0),
    "causal": (None, mods.causal_mask, 0.5),
    "alibi": ("alibi", mods.causal_mask, 0.5),
    "softcap": (mods.tanh_softcap(30.0), mods.causal_mask, 0.5),
    "document": (None, "document", None),
}
#: Per kernel: the pattern of a ``--configs`` item, the kernel_options its numbers pin,
#: and how a configuration is named in the output.
CONFIG_FORMS = {
    "forward": (r"(\d+)x(\d+)w(\d+)s(\d+)", ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"),
                "{}x{} w{} s{}"),
    "backward": (r"(\d+)/(\d+)/(\d+)/(\d+)w(\d+)s(\d+)",
                 ("bwd_BLOCK_M1", "bwd_BLOCK_N1", "bwd_BLOCK_M2", "bwd_BLOCK_N2", "bwd_num_warps", "bwd_num_stages"),
                 "{}/{}/{}/{} w{} s{}"),
}
#: The decode sweep's query heads, KV heads and head dim.
HQ, HKV, D = 32, 8, 128


def forward_candidates(dim: int) -> list[tuple[int, ...]]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) tried at head dim ``dim``: those whose
    pipelined K/V tiles fit in Hopper's shared memory, and no 128-row tile with 4 warps
    at D=256 (register spills)."""
    block_ns = (32, 64) if dim > 128 else (64, 128)
    out = []
    for m, n, w, s in itertools.product((64, 128), block_ns, (4, 8), (2, 3, 4)):
        if 2 * dim * (m + 2 * n * s) > 220 * 1024:
            continue
        if dim > 128 and m == 128 and w == 4:
            continue
        out.append((m, n, w, s))
    return out


def backward_candidates(dim: int, exhaustive: bool, dq_atomic: bool = False) -> list[tuple[int, ...]]:
    """(BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages) tried at ``dim``.
    With dQ atomics there are no dQ programs (BLOCK_M2/N2 unused), and a wide key tile
    spreads each atomic dQ share over more keys."""
    stages = (1, 2, 3) if exhaustive or dim > 128 else (2, 3)
    if dq_atomic:
        tiles = [(64, 128, 64, 64), (32, 128, 64, 64), (64, 64, 64, 64), (128, 128, 64, 64)] if dim <= 128 \
            else [(32, 64, 64, 64), (64, 64, 64, 64), (32, 128, 64, 64)]
        return [(*t, w, s) for t, w, s in itertools.product(tiles, (4, 8), stages)
                if not (t[0] * t[1] >= 64 * 128 and w == 4)]
    if dim <= 64:
        tiles = [(64, 128, 128, 64), (32, 128, 128, 32), (64, 64, 64, 64)]
    elif dim <= 128:
        tiles = [(64, 128, 128, 64), (32, 128, 128, 32), (64, 64, 64, 64), (32, 64, 64, 32)]
    else:
        tiles = [(32, 64, 64, 32), (64, 64, 64, 64), (16, 64, 64, 16), (32, 128, 128, 32),
                 (64, 64, 64, 32), (32, 64, 64, 64)]
    return [(*t, w, s) for t, w, s in itertools.product(tiles, (4, 8), stages)]


def parse_configs(kernel: str, text: str) -> list[tuple[int, ...]]:
    """``--configs`` of the forward (``128x64w4s2,...``) or backward (``64/64/64/64w4s2,...``)."""
    pattern, _, _ = CONFIG_FORMS[kernel]
    configs = []
    for item in text.split(","):
        match = re.fullmatch(pattern, item.strip())
        if match is None:
            example = "128x64w4s2" if kernel == "forward" else "64/64/64/64w4s2"
            raise SystemExit(f"--configs: expected items like {example}, got {item!r}")
        configs.append(tuple(int(g) for g in match.groups()))
    return configs


def attention_configs(args, dim: int) -> list[tuple[str, dict[str, Any]]]:
    """(name, kernel_options) of each forward or backward configuration to time at ``dim``."""
    _, keys, name_format = CONFIG_FORMS[args.kernel]
    if args.configs:
        configs = parse_configs(args.kernel, args.configs)
    elif args.kernel == "forward":
        configs = forward_candidates(dim)
    else:
        configs = backward_candidates(dim, args.exhaustive, args.dq_atomic == "on")
    extra = {} if args.kernel == "forward" or args.dq_atomic == "default" else {"DQ_ATOMIC": args.dq_atomic == "on"}
    return [(name_format.format(*values), {**dict(zip(keys, values)), **extra}) for values in configs]


def case_mods(case: str, S: int, H: int):
    """(score_mod, mask_mod, density) of a forward/backward case at length S with H heads."""
    if case not in CASES:
        raise SystemExit(f"--cases: unknown case {case!r}; known: {sorted(CASES)}")
    score_mod, mask_mod, density = CASES[case]
    if score_mod == "alibi":
        score_mod = mods.alibi(H, device="cuda")
    if mask_mod == "document":
        doc_ids = (torch.arange(S, device="cuda") * 7) // S  # seven documents of equal length
        mask_mod = mods.document_mask(doc_ids)
        density = sum(n * n for n in torch.bincount(doc_ids).tolist()) / (S * S)
    return score_mod, mask_mod, density


def sweep(configs, settings: list[dict], time_ms: Callable[[dict], float], deadline: float,
          show: Callable[[float], str] | None = None) -> list[tuple[float, str]]:
    """(ms, name) of each (name, kernel_options) in ``configs`` under each ``--grid``
    setting, fastest first, until ``deadline``; a configuration the compiler rejects is
    reported and skipped. ``show`` prints each timing as it comes."""
    rows = []
    for (name, options), extra in itertools.product(configs, settings):
        if time.time() > deadline:
            print("  budget spent; stopping", flush=True)
            break
        name += "".join(f" {key}={value}" for key, value in extra.items())
        try:
            ms = time_ms({**options, **extra})
        except Exception as exc:  # a config the compiler rejects is skipped, not fatal
            print(f"  skip {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", flush=True)
            continue
        rows.append((ms, name))
        if show is not None:
            print(f"  {name}: {show(ms)}", flush=True)
    return sorted(rows)


def compiled(fn):
    return torch.compile(fn, fullgraph=True, dynamic=False)


def tune_attention(args) -> list[str]:
    """The forward or backward sweep; returns the summary table's lines."""
    backward = args.kernel == "backward"
    S, H = args.seq, args.heads
    Hkv = args.kv_heads or H
    ours, theirs = compiled(flexattn.flex_attention), compiled(torch_flex.flex_attention)
    settings = grid_settings(args.grid)
    deadline = time.time() + args.budget
    summary = []
    for case, dim in itertools.product(args.cases.split(","), (int(d) for d in args.dims.split(","))):
        score_mod, mask_mod, density = case_mods(case, S, H)
        bm = flexattn.create_block_mask(mask_mod, None, None, S, S, device="cuda") if mask_mod else None
        tbm = torch_flex.create_block_mask(mask_mod, None, None, S, S, device="cuda") if mask_mod else None
        halve = 2 if dim > 128 else 1   # as the benchmark's D=256 case
        B = max(1, args.tokens // S // halve) if backward else max(1, args.batch // halve)
        q = torch.randn(B, H, S, dim, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
        k, v = (torch.randn(B, Hkv, S, dim, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
                for _ in range(2))
        dout = torch.randn(B, H, S, dim, device="cuda", dtype=torch.bfloat16) if backward else None
        flops = (3.5 if backward else 1.0) * 4 * B * H * S * S * dim * density

        def time_ms(fn, **kw) -> float:
            def run():
                out = fn(q, k, v, score_mod, enable_gqa=Hkv != H, **kw)
                if backward:
                    torch.autograd.grad(out, (q, k, v), dout)
            return triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")

        torch_tflops = flops / time_ms(theirs, block_mask=tbm) / 1e9
        print(f"{case} D={dim} B={B}: torch flex {torch_tflops:.0f} TFLOP/s", flush=True)
        rows = sweep(attention_configs(args, dim), settings,
                     lambda options: time_ms(ours, block_mask=bm, kernel_options=options), deadline,
                     show=lambda ms: f"{flops / ms / 1e9:.0f} TFLOP/s ({flops / ms / 1e9 / torch_tflops:.2f}x)")
        for ms, name in rows[:args.top]:
            tflops = flops / ms / 1e9
            summary.append(f"| {case} | {dim} | {name} | {tflops:.0f} | {torch_tflops:.0f} | "
                           f"{tflops / torch_tflops:.2f} |")
    return ["| case | D | config | flexattn TFLOP/s | torch flex | ratio |", "|---|---|---|---|---|---|", *summary]


def graph_ms(call: Callable[[], Any]) -> float:
    """Median ms of CUDA-graph replays of ``call`` (called once first, to compile)."""
    call()
    return triton.testing.do_bench_cudagraph(call, rep=50, return_mode="median")


def tune_decode(args) -> list[str]:
    """The decode sweep; returns the summary table's lines."""
    ours = compiled(flexattn.flex_attention)
    settings = grid_settings(args.grid)
    deadline = time.time() + args.budget
    tiles = [tuple(int(x) for x in tile.split("x")) for tile in args.tiles.split(",")]
    stages = [int(st) for st in args.stages.split(",")]
    pinned = []
    for split, (bn, w), st in itertools.product(args.splits.split(","), tiles, stages):
        options = dict(BLOCK_N=bn, num_warps=w, num_stages=st)
        if split != "auto":
            options["SPLIT_KV"] = int(split)
        pinned.append((f"split={split} BLOCK_N={bn} w{w} s{st}", options))
    defaults = [(f"defaults FUSED_MERGE={fused}", {"FUSED_MERGE": fused}) for fused in (True, False)]
    summary = []
    for B, S in itertools.product((int(b) for b in args.batches.split(",")), (int(s) for s in args.kv.split(","))):
        q = torch.randn(B, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, HKV, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        sdpa_ms = graph_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        print(f"B={B} S={S}: sdpa {sdpa_ms * 1e3:.1f} us", flush=True)

        def time_ms(options: dict) -> float:
            return graph_ms(lambda: ours(q, k, v, kernel_options=options, enable_gqa=True))

        def line(ms: float, name: str) -> str:
            return f"| {B} | {S} | {name} | {ms * 1e3:.1f} | {sdpa_ms * 1e3:.1f} | {sdpa_ms / ms:.2f} |"

        rows = sweep(defaults, settings, time_ms, math.inf) + sweep(pinned, settings, time_ms, deadline)[:args.top]
        for ms, name in rows:
            summary.append(line(ms, name))
            print(summary[-1], flush=True)
    return ["| B | KV | config | flexattn us | sdpa us | flexattn/sdpa speed |", "|---|---|---|---|---|---|", *summary]


def parse_args(argv=None):
    parser = KernelParser(__doc__, KERNELS)
    attention = ("forward", "backward")
    parser.add("--cases", {"forward": "no_mask,causal", "backward": "causal"}, f"comma list of {list(CASES)}")
    parser.add("--dims", dict.fromkeys(attention, "64,128,256"), "comma list of head dims")
    parser.add("--seq", {"forward": 8192, "backward": 4096}, "query and key length", type=int)
    parser.add("--heads", dict.fromkeys(attention, 16), "query heads", type=int)
    parser.add("--kv-heads", dict.fromkeys(attention, None), "GQA: fewer key/value heads", type=int)
    parser.add("--batch", {"forward": 4}, "batch, halved at D=256 as in the benchmark", type=int)
    parser.add("--tokens", {"backward": 16384}, "batch = tokens // seq (// 2 at D=256, as in the benchmark)",
               type=int)
    parser.add("--exhaustive", {"backward": False}, "1 to 3 stages at every head dim", action="store_true")
    parser.add("--dq-atomic", {"backward": "default"},
               "kernel_options DQ_ATOMIC: dQ through atomics in the dK/dV programs (on), or dQ programs (off)",
               choices=("default", "on", "off"))
    parser.add("--configs", dict.fromkeys(attention, ""),
               "these configs instead of the candidate list: forward MxNwWsS (128x64w4s2,128x128w8s3), "
               "backward M1/N1/M2/N2wWsS (64/64/64/64w4s2,64/64/128/64w8s2)")
    parser.add("--batches", {"decode": "1,8"}, "comma list of batch sizes")
    parser.add("--kv", {"decode": "8192,32768"}, "comma list of KV cache lengths")
    parser.add("--splits", {"decode": "auto,16,32,64"}, "comma list of SPLIT_KV values (auto: the split rule)")
    parser.add("--tiles", {"decode": "64x4,128x4,128x8"}, "comma list of BLOCK_N x num_warps pairs")
    parser.add("--stages", {"decode": "3,4"}, "comma list of num_stages")
    parser.add("--top", {"forward": 3, "backward": 3, "decode": 4}, "configurations kept in the summary per case",
               type=int)
    parser.add("--budget", dict.fromkeys(KERNELS, 1e9), "stop starting new configs after this many s", type=float)
    parser.add("--grid", dict.fromkeys(KERNELS, "{}"),
               "JSON: kernel_options key -> list of values; each config is timed under every combination")
    return parser.parse(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    allow_recompiles()
    lines = tune_decode(args) if args.kernel == "decode" else tune_attention(args)
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()

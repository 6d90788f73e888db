"""Benchmark: one generation step over a KV cache, fused against the sequence users write.

A step is: rotary embeddings on the new query and key, the new key and value written into
the cache at each sequence's length, attention of the query over the updated cache. Cases:
32 query heads on 8 KV heads, D=128, bf16, one new token per sequence, B=1 at KV 2k and
8k, B=8 at KV 32k (ragged lengths near the end of the cache). Implementations, each
compiled (``dynamic=False``) and replayed from one CUDA graph:

* ``fused``         ``flexattn.flex_attention_with_kvcache`` (the prologue kernel and the
                    decode kernel)
* ``unfused``       the sequence a user of flexattn writes without it: rotary on q and k
                    in torch ops (the ``rotate_half`` form of transformers), eagerly; the
                    cache write as an ``index_put_``; then compiled ``flexattn.flex_attention``
                    with a length mask made by ``create_block_mask`` in the same compiled
                    function
* ``unfused_compiled`` the same three steps in one compiled function (Inductor fuses the
                    rotary and the writes into its own kernels)
* ``decode_alone``  compiled ``flexattn.flex_attention`` on the updated cache with a block
                    mask made before the graph: the attention kernel and nothing else (the
                    floor the step cannot go under)

Each cell is the median over ``--rounds`` rounds (taken in turn) of the mean time of 200
graph replays; kernels per step are counted by the profiler on one call outside the
graph. Ratios: unfused / fused and unfused_compiled / fused (> 1: the fused step is
faster), fused / decode_alone (what the step costs beyond attention). The fused output
and caches are checked against the unfused ones.

    python bench/bench_kvcache_step.py              # the three cases, 5 rounds
    python bench/bench_kvcache_step.py --dry-run    # CPU, tiny shapes (checks the script)

Writes ``kvcache-step-<gpu>-<stamp>.json`` and ``.md`` under ``--out`` (default bench/results).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import flexattn  # noqa: E402

IMPLS = ("fused", "unfused", "unfused_compiled", "decode_alone")
REPLAYS = 200


def cases(dry_run: bool) -> list[tuple[int, int]]:
    """(B, S_max) pairs."""
    return [(2, 256)] if dry_run else [(1, 2048), (1, 8192), (8, 32768)]


def rotate_half_rotary(x, cos, sin, positions):
    """transformers' form: x * cos + rotate_half(x) * sin, tables of the whole head dim."""
    c = torch.cat([cos, cos], -1)[positions][:, None]
    s = torch.cat([sin, sin], -1)[positions][:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return (x.float() * c + rotated.float() * s).to(x.dtype)


def make_calls(B: int, S: int, device, dtype, Hq=32, Hkv=8, D=128):
    """The implementations' step callables on shared inputs, and each one's cache pair."""
    gen = torch.Generator().manual_seed(0)
    k_base = torch.randn(B, Hkv, S, D, generator=gen).to(device, dtype)
    v_base = torch.randn(B, Hkv, S, D, generator=gen).to(device, dtype)
    q = torch.randn(B, Hq, 1, D, generator=gen).to(device, dtype)
    k = torch.randn(B, Hkv, 1, D, generator=gen).to(device, dtype)
    v = torch.randn(B, Hkv, 1, D, generator=gen).to(device, dtype)
    angles = torch.arange(S)[:, None] * (10000.0 ** (-torch.arange(0, D, 2) / D))[None]
    cos, sin = torch.cos(angles).to(device), torch.sin(angles).to(device)
    lens = (S - 1 - 7 * torch.arange(B)).to(device, torch.int32)
    rows = torch.arange(B, device=device)
    caches = {impl: (k_base.clone(), v_base.clone()) for impl in IMPLS}

    def fused_step(q, k, v, lens, kc, vc):
        return flexattn.flex_attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, rotary_cos=cos,
                                                    rotary_sin=sin, enable_gqa=True)

    def attend(q, kc, vc, lens):
        lengths = lens + 1

        def in_length(b, h, q_idx, kv_idx):
            return kv_idx < lengths[b]

        mask = flexattn.create_block_mask(in_length, B, None, 1, S, device=device)
        return flexattn.flex_attention(q, kc, vc, block_mask=mask, enable_gqa=True)

    def unfused_steps(q, k, v, lens, kc, vc, attention):
        pos = lens.long()[:, None]
        q = rotate_half_rotary(q, cos, sin, pos)
        kc.index_put_((rows[:, None], torch.arange(Hkv, device=device)[None], lens.long()[:, None]),
                      rotate_half_rotary(k, cos, sin, pos)[:, :, 0])
        vc.index_put_((rows[:, None], torch.arange(Hkv, device=device)[None], lens.long()[:, None]), v[:, :, 0])
        return attention(q, kc, vc, lens)

    fused = torch.compile(fused_step, fullgraph=True, dynamic=False)
    attend_c = torch.compile(attend, fullgraph=True, dynamic=False)
    unfused_c = torch.compile(lambda *a: unfused_steps(*a, attend), fullgraph=True, dynamic=False)
    q_rot = rotate_half_rotary(q, cos, sin, lens.long()[:, None])
    alone_mask = flexattn.create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx <= lens[b], B, None, 1, S,
                                            device=device)
    alone = torch.compile(lambda q, kc, vc: flexattn.flex_attention(q, kc, vc, block_mask=alone_mask,
                                                                    enable_gqa=True), fullgraph=True, dynamic=False)
    calls = {
        "fused": lambda: fused(q, k, v, lens, *caches["fused"]),
        "unfused": lambda: unfused_steps(q, k, v, lens, *caches["unfused"], attend_c),
        "unfused_compiled": lambda: unfused_c(q, k, v, lens, *caches["unfused_compiled"]),
        "decode_alone": lambda: alone(q_rot, *caches["decode_alone"]),
    }
    return calls, caches


def graphed(fn, device):
    """(replay, output) of fn captured in a CUDA graph after warm-up calls on a side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    return graph.replay, out


def time_us(replay, device) -> float:
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(3):
            replay()
        return (time.perf_counter() - start) / 3 * 1e6
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(20):
        replay()
    start.record()
    for _ in range(REPLAYS):
        replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / REPLAYS * 1e3


def kernels_per_call(fn, device) -> int | None:
    if device.type != "cuda":
        return None
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "Memcpy" not in e.name and "Memset" not in e.name)


def run_case(B: int, S: int, args, device, dtype) -> dict:
    calls, caches = make_calls(B, S, device, dtype)
    row = {"B": B, "S": S, "Hq": 32, "Hkv": 8, "D": 128, "kernels": {}, "errors": {}}
    replays, outputs = {}, {}
    for impl, fn in calls.items():
        try:
            fn()  # compile
            row["kernels"][impl] = kernels_per_call(fn, device)
            if device.type == "cuda":
                replays[impl], outputs[impl] = graphed(fn, device)
            else:
                replays[impl], outputs[impl] = fn, fn()
        except Exception as error:  # noqa: BLE001 - recorded, the run goes on
            row["errors"][impl] = f"{type(error).__name__}: {str(error)[:300]}"
    if "fused" in outputs and "unfused" in outputs:
        row["max_abs_diff_out"] = float((outputs["fused"].float() - outputs["unfused"].float()).abs().max())
        row["max_abs_diff_k_cache"] = float((caches["fused"][0].float() - caches["unfused"][0].float()).abs().max())
        row["v_caches_equal"] = bool(torch.equal(caches["fused"][1], caches["unfused"][1]))
    times = {impl: [] for impl in replays}
    for _ in range(args.rounds):
        for impl, replay in replays.items():
            times[impl].append(time_us(replay, device))
    row["rounds_us"] = times
    row["median_us"] = med = {impl: statistics.median(t) for impl, t in times.items()}
    for name, (num, den) in {"unfused/fused": ("unfused", "fused"),
                             "unfused_compiled/fused": ("unfused_compiled", "fused"),
                             "fused/decode_alone": ("fused", "decode_alone")}.items():
        if num in med and den in med:
            row[name] = med[num] / med[den]
    return row


def markdown(report: dict) -> str:
    ratios = ("unfused/fused", "unfused_compiled/fused", "fused/decode_alone")
    lines = [f"# KV-cache step, {report['device']} (torch {report['torch']})", "", f"    {report['command']}", "",
             "| B | KV | " + " | ".join(f"{i} us (kernels)" for i in IMPLS) + " | " + " | ".join(ratios)
             + " | max abs diff out |",
             "|" + " --- |" * (2 + len(IMPLS) + len(ratios) + 1)]
    for row in report["rows"]:
        cells = [f"{row['median_us'][i]:.1f} ({row['kernels'].get(i)})" if i in row["median_us"]
                 else row["errors"].get(i, "-")[:60] for i in IMPLS]
        cells += [f"{row[r]:.2f}x" if r in row else "-" for r in ratios]
        lines.append(f"| {row['B']} | {row['S']} | " + " | ".join(cells)
                     + f" | {row.get('max_abs_diff_out', float('nan')):.2e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, float32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, help="results folder (default bench/results; dry run: "
                        "bench/results/dry-run)")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    if args.out is None:
        args.out = REPO / "bench" / "results" / ("dry-run" if args.dry_run else "")
    if args.dry_run:
        args.rounds = min(args.rounds, 2)
    rows = []
    for B, S in cases(args.dry_run):
        torch._dynamo.reset()
        rows.append(run_case(B, S, args, device, dtype))
        print(json.dumps({k: rows[-1][k] for k in ("B", "S", "median_us", "kernels", "errors")}), flush=True)
    gpu = "cpu" if args.dry_run else torch.cuda.get_device_name().lower().replace(" ", "-")
    report = {"command": "python " + " ".join(shlex.quote(a) for a in (sys.argv if argv is None else
                                                                       ["bench/bench_kvcache_step.py", *argv])),
              "device": gpu, "torch": torch.__version__, "rounds": args.rounds, "rows": rows,
              "stamp": datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M")}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"kvcache-step-{gpu}-{report['stamp']}"
    path.with_suffix(".json").write_text(json.dumps(report, indent=1))
    path.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()

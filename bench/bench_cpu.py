"""Benchmark: flexattn's CPU path beside torch's compiled flex_attention and SDPA, on the CPU.

For each length S and dtype, B=1 H=8 D=64 (self-attention, L = S), it times compiled
calls (``torch.compile``, Inductor's C++ backend) in rounds taken in turn:

* forward (under ``torch.no_grad``) of five variants: ``causal``, ``sliding_256``
  (causal, 256 keys back), ``document_8`` (8 equal documents), ``alibi`` (causal +
  ALiBi) and ``softcap`` (causal + tanh soft-cap 30): flexattn and torch's flex, and
  SDPA (``is_causal=True``, ATen's CPU flash kernel) for ``causal``;
* forward + backward of ``causal``: flexattn and SDPA (torch's flex has no CPU backward;
  its cell records the error).

It reports median ms per call and the ratios torch / flexattn (> 1: flexattn faster)
and flexattn / SDPA, and, with ``--memory``, the peak resident-memory growth of one
flexattn causal forward and forward+backward at the largest length. Writes
``cpu-<host>-<stamp>.json`` to bench/results and prints a table.

    python bench/bench_cpu.py                                # S = 1024, 4096, 16384; float32 and bfloat16
    python bench/bench_cpu.py --lengths 1024 --dtypes float32 --rounds 1 --reps 1   # seconds
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import flex_attention as torch_flex

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import flexattn  # noqa: E402
from flexattn import mods  # noqa: E402
from bench_block_mask import PeakResidentMemory  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
B, H, D = 1, 8, 64
WINDOW, DOCUMENTS, SOFTCAP = 256, 8, 30.0
VARIANTS = ("causal", "sliding_256", "document_8", "alibi", "softcap")


def variant_mods(name: str, S: int):
    """(score_mod, mask_mod) of a variant (one set of functions for both libraries)."""
    if name == "causal":
        return None, mods.causal_mask
    if name == "sliding_256":
        return None, mods.sliding_window(WINDOW)
    if name == "document_8":
        return None, mods.document_mask(torch.arange(S) * DOCUMENTS // S)
    if name == "alibi":
        return mods.alibi(H), mods.causal_mask
    if name == "softcap":
        return mods.tanh_softcap(SOFTCAP), mods.causal_mask
    raise ValueError(name)


def make_call(impl: str, variant: str, S: int, dtype: torch.dtype, train: bool):
    """A closure running one call of ``impl`` on fresh inputs."""
    gen = torch.Generator().manual_seed(S)
    q, k, v = (torch.randn(B, H, S, D, generator=gen).to(dtype).requires_grad_(train) for _ in range(3))
    grad_out = torch.randn(B, H, S, D, generator=gen).to(dtype)
    score_mod, mask_mod = variant_mods(variant, S)
    if impl == "sdpa":
        attend = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    elif impl == "flexattn":
        bm = flexattn.create_block_mask(mask_mod, None, None, S, S, device="cpu")
        attend = torch.compile(lambda q, k, v: flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm))
    else:
        bm = torch_flex.create_block_mask(mask_mod, None, None, S, S, device="cpu")
        attend = torch.compile(lambda q, k, v: torch_flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm))

    def run():
        if not train:
            with torch.no_grad():
                return attend(q, k, v)
        out = attend(q, k, v)
        torch.autograd.grad(out, (q, k, v), grad_out)
        return out

    return run


def time_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def cases(lengths, dtypes):
    for S in lengths:
        for dtype in dtypes:
            for variant in VARIANTS:
                impls = ("flexattn", "torch_flex") + (("sdpa",) if variant == "causal" else ())
                yield S, dtype, variant, "fwd", impls
            yield S, dtype, "causal", "fwdbwd", ("flexattn", "sdpa", "torch_flex")


def run_case(S, dtype, variant, mode, impls, args) -> dict:
    calls, errors, first = {}, {}, {}
    # One reset per case: a reset between implementations would drop the compiled
    # code of the ones before, which would then recompile inside the timed calls.
    torch._dynamo.reset()
    for impl in impls:
        try:
            fn = make_call(impl, variant, S, dtype, mode == "fwdbwd")
            started = time.perf_counter()
            fn()  # compile and warm up
            first[impl] = time.perf_counter() - started
            calls[impl] = fn
        except Exception as error:  # noqa: BLE001 - recorded, the run goes on
            errors[impl] = f"{type(error).__name__}: {str(error)[:200]}"
    rounds = {impl: [] for impl in calls}
    for _ in range(args.rounds):
        for impl, fn in calls.items():
            rounds[impl].append(time_ms(fn, args.reps))
    medians = {impl: statistics.median(t) for impl, t in rounds.items()}
    row = {"S": S, "dtype": str(dtype).replace("torch.", ""), "variant": variant, "mode": mode,
           "median_ms": medians, "rounds_ms": rounds, "first_call_s": first, "errors": errors}
    if "flexattn" in medians and "torch_flex" in medians:
        row["torch_over_flexattn"] = medians["torch_flex"] / medians["flexattn"]
    if "flexattn" in medians and "sdpa" in medians:
        row["flexattn_over_sdpa"] = medians["flexattn"] / medians["sdpa"]
    return row


def _release_freed_heap() -> None:
    """Hand the allocator's freed pages back to the system (glibc), so that a call's
    allocations show in the resident size instead of reusing what an earlier call left."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def memory(S: int, dtype: torch.dtype) -> dict:
    """Peak resident-memory growth of one flexattn causal call (after a warm-up call and
    with the heap's freed pages released; what the engine keeps between calls, the 16-bit
    K/V copy, is resident before and not counted)."""
    out = {}
    for mode in ("fwd", "fwdbwd"):
        torch._dynamo.reset()
        fn = make_call("flexattn", "causal", S, dtype, mode == "fwdbwd")
        fn()
        _release_freed_heap()
        with PeakResidentMemory() as peak:
            fn()
        out[mode] = peak.peak_bytes
    return out


def table(report: dict) -> str:
    lines = ["| S | dtype | variant | mode | flexattn ms | torch flex ms | SDPA ms | torch / flexattn | flexattn / SDPA |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in report["rows"]:
        m = row["median_ms"]
        cell = lambda k: f"{m[k]:.1f}" if k in m else "-"  # noqa: E731
        ratio = lambda k: f"{row[k]:.2f}x" if k in row else "-"  # noqa: E731
        lines.append(f"| {row['S']} | {row['dtype']} | {row['variant']} | {row['mode']} | {cell('flexattn')} | "
                     f"{cell('torch_flex')} | {cell('sdpa')} | {ratio('torch_over_flexattn')} | "
                     f"{ratio('flexattn_over_sdpa')} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,4096,16384")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="forward variants to time")
    parser.add_argument("--rounds", type=int, default=3, help="rounds taken in turn per case")
    parser.add_argument("--reps", type=int, default=3, help="timed calls per round (the median is kept)")
    parser.add_argument("--memory", action="store_true", help="peak memory of flexattn at the largest length")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    dtypes = [getattr(torch, x) for x in args.dtypes.split(",")]
    variants = set(args.variants.split(","))
    rows = []
    for S, dtype, variant, mode, impls in cases(lengths, dtypes):
        if mode == "fwd" and variant not in variants:
            continue
        rows.append(run_case(S, dtype, variant, mode, impls, args))
        print(table({"rows": rows[-1:]}).splitlines()[-1], flush=True)
    report = {"command": "python " + " ".join(shlex.quote(a) for a in sys.argv), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
              "stamp": datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M"), "rows": rows}
    if args.memory:
        report["memory_bytes"] = {str(dtype): memory(max(lengths), dtype) for dtype in dtypes}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"cpu-{platform.node() or 'host'}-{report['stamp']}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"results: {path}")
    print(table(report))
    if args.memory:
        print("peak resident-memory growth (MB):",
              {k: {m: round(v / 2**20, 1) for m, v in d.items()} for k, d in report["memory_bytes"].items()})
    return report


if __name__ == "__main__":
    main()

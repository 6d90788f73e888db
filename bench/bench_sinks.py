"""Benchmark: what attention sinks cost, and against the workaround users have today.

For each case it times, in rounds taken in turn (a GPU's clock drifts between rounds):

* ``flexattn``        compiled ``flexattn.flex_attention`` without sinks;
* ``flexattn_sinks``  the same call with ``sinks=`` (folded into the kernels);
* ``torch_renorm``    compiled torch ``flex_attention`` returning its lse, then the sink
                      applied after the kernel, ``out * exp(lse - logaddexp(lse, sink))``
                      (what transformers does for gpt-oss on torch's flex);

forward (``fwd``), forward and backward (``fwdbwd``), and a decode step (one query row
against a long cache). Prints a table of median ms and the ratios sinks / no sinks and
flexattn_sinks / torch_renorm, and writes ``sinks-<gpu>-<stamp>.json`` to bench/results.

    python bench/bench_sinks.py              # the suite, 5 rounds
    python bench/bench_sinks.py --dry-run    # CPU, tiny shapes, seconds (checks the script)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn.attention import flex_attention as torch_flex

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import flexattn  # noqa: E402
from flexattn import mods  # noqa: E402

RESULTS_DIR = REPO / "bench" / "results"
IMPLS = ("flexattn", "flexattn_sinks", "torch_renorm")


@dataclasses.dataclass(frozen=True)
class Case:
    """B query rows of length L per (batch, head) against S keys; causal unless L == 1."""

    name: str
    mode: str  # "fwd", "fwdbwd" or "decode"
    B: int
    H: int
    Hkv: int
    L: int
    S: int
    D: int


def suite(dry_run: bool) -> list[Case]:
    if dry_run:
        return [Case("causal_tiny", "fwdbwd", 1, 2, 2, 64, 64, 16), Case("decode_tiny", "decode", 2, 4, 2, 1, 256, 16)]
    cases = []
    for D in (64, 128):
        for mode in ("fwd", "fwdbwd"):
            cases.append(Case(f"causal_s8192_d{D}", mode, 4, 16, 16, 8192, 8192, D))
    cases.append(Case("decode_s32768_gqa4_d128", "decode", 8, 32, 8, 1, 32768, 128))
    return cases


def _renorm(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    total = torch.logaddexp(lse, sinks[None, :, None])
    return (out * torch.exp(lse - total)[..., None]).to(out.dtype)


def make_call(impl: str, case: Case, device: torch.device, dtype: torch.dtype) -> tuple[Callable, list]:
    """A closure running one call of ``impl`` on fresh inputs, and the tensors whose .grad
    it fills (reset between timed runs)."""
    train = case.mode == "fwdbwd"
    q = torch.randn(case.B, case.H, case.L, case.D, device=device, dtype=dtype, requires_grad=train)
    k = torch.randn(case.B, case.Hkv, case.S, case.D, device=device, dtype=dtype, requires_grad=train)
    v = torch.randn(case.B, case.Hkv, case.S, case.D, device=device, dtype=dtype, requires_grad=train)
    sinks = torch.randn(case.H, device=device, requires_grad=train)
    block_mask = None if case.mode == "decode" else flexattn.create_block_mask(
        mods.causal_mask, None, None, case.L, case.S, device=device)
    gqa = case.H != case.Hkv
    if impl == "torch_renorm":
        torch_mask = None if block_mask is None else torch_flex.create_block_mask(
            mods.causal_mask, None, None, case.L, case.S, device=device)

        def attend(q, k, v, sinks):
            out, lse = torch_flex.flex_attention(q, k, v, block_mask=torch_mask, enable_gqa=gqa, return_lse=True)
            return _renorm(out, lse, sinks)
    else:
        use_sinks = impl == "flexattn_sinks"

        def attend(q, k, v, sinks):
            return flexattn.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa,
                                           sinks=sinks if use_sinks else None)

    compiled = torch.compile(attend, fullgraph=True)
    leaves = [q, k, v] + ([sinks] if impl != "flexattn" else [])
    grad_out = torch.randn(case.B, case.H, case.L, case.D, device=device, dtype=dtype)

    def run():
        out = compiled(q, k, v, sinks)
        if train:
            torch.autograd.grad(out, [t for t in leaves if t.requires_grad], grad_out)
        return out

    return run, leaves


def time_ms(fn: Callable, device: torch.device, dry_run: bool) -> float:
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median"))
    times = []
    for _ in range(2 if dry_run else 6):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


def run(args: argparse.Namespace) -> dict:
    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    rows = []
    for case in suite(args.dry_run):
        calls = {}
        for impl in IMPLS:
            torch._dynamo.reset()
            try:
                fn, _ = make_call(impl, case, device, dtype)
                fn()  # compile and warm up
                calls[impl] = fn
            except Exception as error:  # noqa: BLE001 - recorded, the run goes on
                calls[impl] = f"{type(error).__name__}: {str(error)[:200]}"
        times: dict[str, list[float]] = {impl: [] for impl in IMPLS if callable(calls[impl])}
        for _ in range(args.rounds):
            for impl in times:
                times[impl].append(time_ms(calls[impl], device, args.dry_run))
        medians = {impl: statistics.median(t) for impl, t in times.items()}
        row = {**dataclasses.asdict(case), "median_ms": medians, "rounds_ms": times,
               "errors": {impl: c for impl, c in calls.items() if not callable(c)}}
        if "flexattn" in medians and "flexattn_sinks" in medians:
            row["sinks_over_plain"] = medians["flexattn_sinks"] / medians["flexattn"]
        if "torch_renorm" in medians and "flexattn_sinks" in medians:
            row["sinks_over_torch_renorm"] = medians["flexattn_sinks"] / medians["torch_renorm"]
        rows.append(row)
    name = "cpu" if args.dry_run else torch.cuda.get_device_name().lower().replace(" ", "-")
    return {"command": "python " + " ".join(shlex.quote(a) for a in sys.argv), "device": name,
            "torch": torch.__version__, "rounds": args.rounds, "rows": rows,
            "stamp": datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M")}


def table(report: dict) -> str:
    lines = ["| case | mode | flexattn ms | with sinks ms | torch + renorm ms | sinks / plain | sinks / torch+renorm |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in report["rows"]:
        m = row["median_ms"]

        def cell(key, fmt="{:.3f}"):
            value = m.get(key) if key in IMPLS else row.get(key)
            return fmt.format(value) if value is not None else "-"

        lines.append(f"| {row['name']} | {row['mode']} | {cell('flexattn')} | {cell('flexattn_sinks')} | "
                     f"{cell('torch_renorm')} | {cell('sinks_over_plain', '{:.3f}x')} | "
                     f"{cell('sinks_over_torch_renorm', '{:.3f}x')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: checks that the script runs")
    parser.add_argument("--rounds", type=int, default=5, help="rounds taken in turn per case")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="directory for the JSON result")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.rounds = min(args.rounds, 2)
    report = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"sinks-{report['device']}-{report['stamp']}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"results: {path}")
    print(table(report))
    return report


if __name__ == "__main__":
    main()

"""The runner shared by the feature benchmarks (bench_sinks.py, bench_dropout.py): each
names its implementations, its cases and how to make one timed call; this module times
them in rounds taken in turn (a GPU's clock drifts between rounds), records medians and
the feature's ratios, writes ``<feature>-<gpu>-<stamp>.json`` to bench/results and prints
a table.
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

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

RESULTS_DIR = REPO / "bench" / "results"


@dataclasses.dataclass(frozen=True)
class Case:
    """B x H query rows of length L against S keys (Hkv heads), head dim D; ``mask``:
    "causal" or "none" (a decode step, L == 1, has none)."""

    name: str
    mode: str  # "fwd", "fwdbwd" or "decode"
    B: int
    H: int
    Hkv: int
    L: int
    S: int
    D: int
    mask: str = "causal"


@dataclasses.dataclass(frozen=True)
class Feature:
    """A feature benchmark: ``impls`` in table order; ``suite(dry_run)`` its cases;
    ``make_call(impl, case, device, dtype)`` one call on fresh inputs (the backward too
    for "fwdbwd"); ``ratios``: column name -> (numerator impl, denominator impl)."""

    name: str
    description: str
    impls: tuple[str, ...]
    suite: Callable[[bool], list[Case]]
    make_call: Callable[[str, Case, torch.device, torch.dtype], Callable]
    ratios: dict[str, tuple[str, str]]


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


def run(feature: Feature, args: argparse.Namespace) -> dict:
    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    rows = []
    cases = feature.suite(args.dry_run)
    if args.cases:
        cases = [c for c in cases if c.name in args.cases.split(",")]
    for case in cases:
        calls = {}
        for impl in feature.impls:
            torch._dynamo.reset()
            try:
                fn = feature.make_call(impl, case, device, dtype)
                fn()  # compile and warm up
                calls[impl] = fn
            except Exception as error:  # noqa: BLE001 - recorded, the run goes on
                calls[impl] = f"{type(error).__name__}: {str(error)[:200]}"
        times: dict[str, list[float]] = {impl: [] for impl in feature.impls if callable(calls[impl])}
        for _ in range(args.rounds):
            for impl in times:
                times[impl].append(time_ms(calls[impl], device, args.dry_run))
        medians = {impl: statistics.median(t) for impl, t in times.items()}
        row = {**dataclasses.asdict(case), "median_ms": medians, "rounds_ms": times,
               "errors": {impl: c for impl, c in calls.items() if not callable(c)}}
        for column, (num, den) in feature.ratios.items():
            if num in medians and den in medians:
                row[column] = medians[num] / medians[den]
        rows.append(row)
    name = "cpu" if args.dry_run else torch.cuda.get_device_name().lower().replace(" ", "-")
    return {"command": "python " + " ".join(shlex.quote(a) for a in sys.argv), "device": name,
            "torch": torch.__version__, "rounds": args.rounds, "rows": rows,
            "stamp": datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M")}


def table(feature: Feature, report: dict) -> str:
    columns = [f"{impl} ms" for impl in feature.impls] + list(feature.ratios)
    lines = ["| case | mode | " + " | ".join(columns) + " |", "|" + " --- |" * (len(columns) + 2)]
    for row in report["rows"]:
        cells = [f"{row['median_ms'][impl]:.3f}" if impl in row["median_ms"] else "-" for impl in feature.impls]
        cells += [f"{row[c]:.3f}x" if c in row else "-" for c in feature.ratios]
        lines.append(f"| {row['name']} | {row['mode']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(feature: Feature, argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=feature.description)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: checks that the script runs")
    parser.add_argument("--rounds", type=int, default=5, help="rounds taken in turn per case")
    parser.add_argument("--cases", help="comma-separated case names (default: the whole suite)")
    parser.add_argument("--out", type=Path, help="directory for the JSON result (default bench/results; "
                        "the dry run: bench/results/dry-run, as the attention suite's)")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = RESULTS_DIR / "dry-run" if args.dry_run else RESULTS_DIR
    if args.dry_run:
        args.rounds = min(args.rounds, 2)
    report = run(feature, args)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{feature.name}-{report['device']}-{report['stamp']}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"results: {path}")
    print(table(feature, report))
    return report

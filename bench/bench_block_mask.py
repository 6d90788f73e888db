"""Benchmark: building block masks, flexattn versus torch's create_block_mask.

For each mask (causal, sliding window 1024, document mask with 8 equal documents) and
each sequence length (B=1, H=1, Q_LEN = KV_LEN = n, BLOCK_SIZE=128) it times:

* flexattn eager          flexattn.block_mask.create_block_mask(...)
* flexattn compiled       the same with _compile=True
* torch eager             torch.nn.attention.flex_attention.create_block_mask(...)
* torch compiled          torch.compile(torch's create_block_mask)

Each variant is warmed up once (which also pays any compilation), then timed ``--repeats``
times; the median wall time is reported, with CUDA synchronized around each run, and
the peak device memory of one run (CUDA) or its peak resident-memory growth (CPU,
sampled every millisecond).
A run that fails (out of memory, for example) is recorded with its error instead.

Prints a markdown table and writes JSON (device name, torch version, every
measurement) as ``block-mask-<device>-<stamp>.json`` in ``--out`` (default bench/results),
or to ``--out`` itself when it names a ``.json`` file.

    python bench/bench_block_mask.py --device cpu --sizes 1024,4096
    python bench/bench_block_mask.py --device cuda --sizes 8192,32768,131072
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path

import torch
from torch.nn.attention import flex_attention as torch_flex

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexattn.block_mask import create_block_mask  # noqa: E402
from flexattn.mods import causal_mask, document_mask, sliding_window  # noqa: E402

DEFAULT_SIZES = "8192,32768,131072"
WINDOW = 1024
NUM_DOCUMENTS = 8
BLOCK_SIZE = 128
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _mask_mods(length: int, device: torch.device) -> dict:
    doc_ids = torch.arange(length, device=device) * NUM_DOCUMENTS // length
    return {
        "causal": causal_mask,
        f"sliding_window_{WINDOW}": sliding_window(WINDOW),
        f"document_{NUM_DOCUMENTS}": document_mask(doc_ids),
    }


def _builders() -> dict:
    torch_compiled = torch.compile(torch_flex.create_block_mask)
    return {
        "flexattn eager": lambda *args: create_block_mask(*args, BLOCK_SIZE=BLOCK_SIZE),
        "flexattn compiled": lambda *args: create_block_mask(*args, BLOCK_SIZE=BLOCK_SIZE, _compile=True),
        "torch eager": lambda *args: torch_flex.create_block_mask(*args, BLOCK_SIZE=BLOCK_SIZE),
        "torch compiled": lambda *args: torch_compiled(*args, BLOCK_SIZE=BLOCK_SIZE),
    }


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PeakResidentMemory:
    """Peak growth of this process's resident memory over a ``with`` block (Linux).

    A background thread samples /proc/self/statm every millisecond; short spikes can
    be missed, so CPU figures are a lower bound. Reports 0 where /proc is absent.
    """

    def __init__(self) -> None:
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")

    def _resident(self) -> int:
        try:
            with open("/proc/self/statm") as statm:
                return int(statm.read().split()[1]) * self._page
        except OSError:
            return 0

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, self._resident() - self._baseline)
            time.sleep(0.001)

    def __enter__(self):
        self._baseline = self._resident()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self._resident() - self._baseline)


def _measure(build, args, device: torch.device, repeats: int) -> dict:
    """Warm up once, then time ``repeats`` runs; peak memory of one extra run."""
    try:
        build(*args)
        _synchronize(device)
        times = []
        for _ in range(repeats):
            _synchronize(device)
            start = time.perf_counter()
            build(*args)
            _synchronize(device)
            times.append(time.perf_counter() - start)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            baseline = torch.cuda.memory_allocated(device)
            build(*args)
            _synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - baseline
        else:
            with PeakResidentMemory() as memory:
                build(*args)
            peak = memory.peak_bytes
        return {"median_ms": 1e3 * statistics.median(times), "peak_bytes": peak, "runs": repeats}
    except Exception as error:  # a failing variant (e.g. OOM) must not stop the table
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"}


def _format_cell(result: dict) -> str:
    if "error" in result:
        return "failed"
    return f"{result['median_ms']:.1f} ms / {result['peak_bytes'] / 2**20:.0f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated sequence lengths")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per variant (median)")
    parser.add_argument("--variants", default=None, help="comma-separated subset of the variant names")
    parser.add_argument("--out", type=Path, default=None, help="JSON output path, or a folder for block-mask-<device>-<stamp>.json (default bench/results)")
    options = parser.parse_args()

    device = torch.device(options.device)
    sizes = [int(size) for size in options.sizes.split(",") if size]
    builders = _builders()
    if options.variants:
        wanted = [name.strip() for name in options.variants.split(",")]
        builders = {name: builders[name] for name in wanted}
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    rows = []
    for length in sizes:
        for mask_name, mask_mod in _mask_mods(length, device).items():
            row = {"mask": mask_name, "seq_len": length, "results": {}}
            for variant, build in builders.items():
                args = (mask_mod, 1, 1, length, length, device)
                row["results"][variant] = _measure(build, args, device, options.repeats)
                print(f"{mask_name:>20} {length:>7} {variant:>18}: {_format_cell(row['results'][variant])}", file=sys.stderr)
            rows.append(row)

    header = "| mask | seq len | " + " | ".join(builders) + " | flexattn / torch (eager) |"
    lines = [
        f"create_block_mask on {device_name} ({device.type}), torch {torch.__version__}, "
        f"B=1, H=1, BLOCK_SIZE={BLOCK_SIZE}; median time / peak memory",
        "",
        header,
        "|" + " --- |" * (len(builders) + 3),
    ]
    for row in rows:
        results = row["results"]
        ratio = "n/a"
        ours, theirs = results.get("flexattn eager", {}), results.get("torch eager", {})
        if "median_ms" in ours and "median_ms" in theirs:
            ratio = f"{ours['median_ms'] / theirs['median_ms']:.2f}"
        cells = " | ".join(_format_cell(results[name]) for name in builders)
        lines.append(f"| {row['mask']} | {row['seq_len']} | {cells} | {ratio} |")
    table = "\n".join(lines)
    print(table)

    out = options.out or RESULTS_DIR
    if out.is_dir() or out.suffix != ".json":
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M")
        out = out / f"block-mask-{device_name.lower().replace(' ', '-')}-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": "create_block_mask",
        "device": device_name,
        "device_type": device.type,
        "torch_version": torch.__version__,
        "block_size": BLOCK_SIZE,
        "repeats": options.repeats,
        "rows": rows,
        "table_markdown": table,
    }
    out.write_text(json.dumps(record, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

"""Benchmark: the cost of a decode step's paged BlockMask (``PagedKVCache.block_mask_on_pages``).

A decode step of ``--batch`` sequences of ``--length`` tokens each (one query token at the
last position, a causal mask over logical positions), in a pool of ``--pool-pages`` pages
of ``--page-size`` tokens handed out in random order, ``--kv-heads`` KV heads. For each
pool layout (head- and page-major) and each ``max_pages_per_slot`` (the default,
n_pages, and the sequences' own page count) it times, eagerly:

* logical   ``create_block_mask`` of the step's mask over logical positions;
* on pages  ``block_mask_on_pages`` of it (without the transposed lists, the default);
* with q    the same with ``compute_q_blocks=True`` (what a backward would need).

Median wall time of ``--repeats`` runs after one warm-up, the device synchronized around
each. Prints a markdown table; ``--out`` writes the JSON (a folder:
``paged-mask-<device>-<stamp>.json`` in it).

    python bench/bench_paged_mask.py --device cpu
    python bench/bench_paged_mask.py --device cuda --out bench/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flexattn  # noqa: E402

LAYOUTS = ("heads", "pages")


def _time(fn, device: torch.device, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def run(args) -> list[dict]:
    device = torch.device(args.device)
    pages_per_sequence = -(-args.length // args.page_size)
    results = []
    for layout in LAYOUTS:
        for cap in (None, pages_per_sequence):
            cache = flexattn.PagedKVCache(args.pool_pages, args.page_size, args.batch, device, layout=layout,
                                          num_kv_heads=args.kv_heads, max_pages_per_slot=cap)
            cache.shuffle_free_pages(torch.Generator().manual_seed(0))
            for slot in range(args.batch):
                cache.reserve(slot, args.length)
            slots = torch.arange(args.batch, device=device)
            last = args.length - 1

            def up_to_last(b, h, q_idx, kv_idx):
                return kv_idx <= last

            def logical():
                return flexattn.create_block_mask(up_to_last, args.batch, None, 1, args.length, device=device,
                                                  BLOCK_SIZE=(128, args.page_size))

            mask = logical()
            row = {"layout": layout, "max_pages_per_slot": cache.max_pages_per_slot,
                   "kv_columns": cache.pool_length // args.page_size,
                   "index_width": cache.block_mask_on_pages(mask, slots).kv_indices.shape[-1],
                   "logical_ms": _time(logical, device, args.repeats),
                   "on_pages_ms": _time(lambda: cache.block_mask_on_pages(mask, slots, validate=False), device,
                                        args.repeats),
                   "with_q_ms": _time(lambda: cache.block_mask_on_pages(mask, slots, validate=False,
                                                                        compute_q_blocks=True), device, args.repeats)}
            results.append(row)
            print(f"| {layout} | {row['max_pages_per_slot']} | {row['kv_columns']} | {row['index_width']} "
                  f"| {row['logical_ms']:.2f} | {row['on_pages_ms']:.2f} | {row['with_q_ms']:.2f} |", flush=True)
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=131072, help="tokens per sequence")
    parser.add_argument("--pool-pages", type=int, default=32768)
    parser.add_argument("--page-size", type=int, default=128)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="JSON path, or a folder for paged-mask-<device>-<stamp>.json")
    args = parser.parse_args(argv)
    if args.batch * -(-args.length // args.page_size) > args.pool_pages:
        parser.error("--pool-pages must hold --batch sequences of --length tokens")
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"block_mask_on_pages on {name}: B={args.batch}, {args.length} tokens each, {args.pool_pages} pages of "
          f"{args.page_size}, {args.kv_heads} KV heads; median ms of {args.repeats}\n")
    print("| layout | max_pages_per_slot | KV block columns | index row width | logical mask ms | on pages ms "
          "| with q lists ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    summary = {"device": name, "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()},
               "results": run(args)}
    if args.out is not None:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M")
        out = args.out / f"paged-mask-{name.lower().replace(' ', '-')}-{stamp}.json" if args.out.is_dir() else args.out
        out.write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()

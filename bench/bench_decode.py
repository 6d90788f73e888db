"""Benchmark: decoding, one new query token against a long KV cache.

Cases: batch B in {1, 8, 32} x KV length in {2k, 8k, 32k, 128k}, 32 query heads on 8
KV heads (GQA), D=128, bf16, query length 1 at position S-1; each with no mask and with
a causal sliding window of 1024 tokens (expressed in logical positions with the query's
offset S-1). Implementations side by side in one run:

* ``flexattn``     ``torch.compile(flexattn.flex_attention)`` (the split-KV decode kernel)
* ``flexattn_main`` the same with ``kernel_options={"FORCE_DECODE": False}`` (main kernel;
  ``--with-main``)
* ``flexattn_paged`` the same shapes and values with the KV cache in a
  ``flexattn.PagedKVCache``: pages of ``--page-size`` tokens (128), each sequence's pages
  scattered over the pool in random order, the BlockMask translated onto the pages
  (``block_mask_on_pages``), on a head-major pool; ``flexattn_paged_pages`` the same on
  a page-major pool (``--pool-layouts``); ``--no-paged`` skips them
* ``torch_flex``   ``torch.compile(torch.nn.attention.flex_attention.flex_attention)``
* ``sdpa``         ``scaled_dot_product_attention(..., enable_gqa=True)``, default backend
  choice (no-mask cases only: SDPA has no sliding window)

Each cell: median ms with ``triton.testing.do_bench`` (launch overhead included), with
``do_bench_cudagraph`` (the kernels alone, replayed from a CUDA graph; ``--no-cudagraph``
skips it) and, for flexattn, the paged variants and sdpa (the implementations the
targets compare), a *cold* graph timing; the bytes that must be read (the visible K/V rows
plus q and out), the achieved bandwidth as a fraction of the device copy bandwidth
measured at the start of the run, and the largest |difference| of the output from a
float32 reference.

Warm and cold. The warm graph timing replays one call on one cache, so a cache whose read
bytes fit in the L2 cache (the sliding window at B <= 8, B=1 without a mask at 2k-8k) is
read from L2 after the first replay. In a model every layer reads its own cache once per
step, so a decode step finds none of it in L2: the cold timing gives each call another
copy of the cache (pool, for the paged variants), cycling through enough copies that
their read bytes span COLD_L2_SPAN times the L2 cache, or as many as fit in
COLD_MEMORY_FRACTION of the free memory (``cold_copies``; a warning says when that is
fewer; ``--warm-only`` skips the cold timings and their columns). For the compared implementations both graph timings are the median of
``--rounds`` timings taken in turn (two captures of the same call can differ by 0.5-1 us
at a few microseconds). Every compile is static (``dynamic=False``): taken in turn, the
implementations call one function with different shapes (a pool is longer than the
contiguous cache), and Dynamo's automatic dynamic shapes would time a symbolic-shape
recompile of all but the first (bench/DECISIONS.md, bench-static-shapes).

Ratios per case (> 1 means flexattn is faster): flexattn / torch_flex (warm), flexattn /
sdpa, warm and cold; paged / contiguous, warm and cold: the time of flexattn_paged over
flexattn's (the target is <= 1.05), for each pool layout of ``--pool-layouts``
(``PagedKVCache(..., layout=...)``, see ``flexattn.paged.POOL_LAYOUTS``): by default
head-major (``flexattn_paged``) and page-major (``flexattn_paged_pages``); ``tokens``
adds ``flexattn_paged_tokens``. Each layout has its own ratio columns.

    python bench/bench_decode.py                          # the whole suite (~5-8 min)
    python bench/bench_decode.py --batches 1 --kv 32768   # a slice
    python bench/bench_decode.py --split-kv 16,32,64      # flexattn at pinned SPLIT_KV values
    python bench/bench_decode.py --page-size 64           # paged variant with pages of 64 tokens
    python bench/bench_decode.py --dry-run                # CPU, tiny shapes, seconds

Writes ``decode-<gpu>-<date>.json`` and ``.md`` under ``--out`` (default bench/results).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import itertools
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import flex_attention as torch_flex

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import flexattn  # noqa: E402

RESULTS_DIR = REPO / "bench" / "results"
#: The paged variant's name in the results, per pool layout.
PAGED_IMPLS = {"heads": "flexattn_paged", "tokens": "flexattn_paged_tokens", "pages": "flexattn_paged_pages"}
#: Implementations timed --rounds times in turn (the ones the targets' ratios compare).
ROUND_ROBIN_IMPLS = ("flexattn", *PAGED_IMPLS.values(), "sdpa")
WINDOW = 1024
SEED = 0
#: Cold timing: the copies of the cache a call cycles through hold at least this many
#: times the L2 cache's bytes between two reads of one copy ...
COLD_L2_SPAN = 4
#: ... within this fraction of the free device memory (fewer copies if they do not fit).
COLD_MEMORY_FRACTION = 0.5


@dataclasses.dataclass(frozen=True)
class Case:
    B: int
    Hq: int
    Hkv: int
    S: int
    D: int
    window: int | None  # None: no mask

    @property
    def name(self) -> str:
        mask = f"window{self.window}" if self.window else "nomask"
        return f"b{self.B}_kv{self.S}_h{self.Hq}on{self.Hkv}_d{self.D}_{mask}"

    def visible_keys(self) -> int:
        return self.S if self.window is None else min(self.S, self.window)


def suite(batches, kv_lengths, Hq=32, Hkv=8, D=128) -> list[Case]:
    return [Case(B, Hq, Hkv, S, D, window) for window in (None, WINDOW) for B in batches for S in kv_lengths]


def window_mask(offset: int, window: int):
    """Causal sliding window for a query at logical position q_idx + offset."""
    def decode_window(b, h, q_idx, kv_idx):
        pos = q_idx + offset
        return (pos >= kv_idx) & (pos - kv_idx < window)
    return decode_window


def logical_block_mask(case: Case, page: int, device: torch.device) -> flexattn.BlockMask:
    """The case's mask over logical positions with KV blocks of one page: for no mask,
    every block full (as flex_attention's default mask); for the window, the same
    create_block_mask call as the contiguous run, with KV_BLOCK_SIZE = page."""
    q_block = flexattn.block_mask.DEFAULT_BLOCK_SIZE
    if case.window is None:
        n = math.ceil(case.S / page)
        order = torch.arange(n, dtype=torch.int32, device=device).view(1, 1, 1, n)
        return flexattn.BlockMask.from_kv_blocks(
            torch.zeros(1, 1, 1, dtype=torch.int32, device=device), order,
            torch.full((1, 1, 1), n, dtype=torch.int32, device=device), order,
            BLOCK_SIZE=(q_block, page), seq_lengths=(1, case.S))
    return flexattn.create_block_mask(window_mask(case.S - 1, case.window), None, None, 1, case.S,
                                      device=device, BLOCK_SIZE=(q_block, page))


def paged_inputs(case: Case, k: torch.Tensor, v: torch.Tensor, page: int, layout: str = "heads"):
    """k, v (B, Hkv, S, D) copied into a paged pool (PagedKVCache's ``layout``) whose
    pages are handed out in random order; returns (k_pool, v_pool, paged BlockMask)."""
    device = k.device
    pages_per_sequence = math.ceil(case.S / page)
    cache = flexattn.PagedKVCache(case.B * pages_per_sequence, page, case.B, device=device, layout=layout,
                                  num_kv_heads=case.Hkv)
    cache.shuffle_free_pages(torch.Generator().manual_seed(SEED))
    k_pool, v_pool = cache.allocate(case.Hkv, case.D, k.dtype)
    positions = torch.arange(case.S, device=device)[None]
    for b in range(case.B):
        cache.reserve(b, case.S)
        cache.append([b], positions, k[b:b + 1], v[b:b + 1], k_pool, v_pool)
    slots = torch.arange(case.B, device=device)
    return k_pool, v_pool, cache.block_mask_on_pages(logical_block_mask(case, page, device), slots)


def strided_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its sizes and strides, over a copy of its whole storage
    (``clone`` would lay a pool view whose positions overlap, the "pages" layout, out
    contiguously: num_kv_heads times the memory)."""
    storage = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage()).clone()
    return storage.as_strided(t.shape, t.stride(), t.storage_offset())


def cold_copies(touched_bytes: int, copy_bytes: int, l2_bytes: int, free_bytes: int) -> int:
    """Copies of the KV cache that the cold timing cycles through: enough that the bytes
    one call reads (``touched_bytes``), over all copies, span COLD_L2_SPAN times the L2
    cache (so that no call finds its keys in L2, as in a model whose layers each read
    their own cache once per step), as many as fit in COLD_MEMORY_FRACTION of
    ``free_bytes`` at ``copy_bytes`` per extra copy; at least 1 (the cache itself)."""
    wanted = math.ceil(COLD_L2_SPAN * l2_bytes / max(touched_bytes, 1))
    fits = 1 + int(COLD_MEMORY_FRACTION * free_bytes // max(copy_bytes, 1))
    return max(1, min(wanted, fits))


def cycling(call: Callable[[int], Any], copies: int) -> Callable[[], Any]:
    """A zero-argument call that runs ``call`` on copy 0, 1, ..., copies - 1, 0, ... in turn
    (a CUDA graph captured from it replays the copies in that order)."""
    counter = itertools.count()
    return lambda: call(next(counter) % copies)


def copy_bandwidth(device: torch.device) -> float | None:
    """Device copy bandwidth in bytes/s (read + write of a 1 GiB buffer)."""
    if device.type != "cuda":
        return None
    import triton.testing

    src = torch.empty(1 << 29, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def time_ms(fn: Callable[[], Any], device: torch.device, cudagraph: bool, cpu_reps: int) -> float:
    if device.type == "cuda":
        import triton.testing

        if cudagraph:
            return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    times = []
    for _ in range(cpu_reps + 1):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


def error_text(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def run_case(case: Case, args, device, dtype, bandwidth) -> list[dict[str, Any]]:
    gen = torch.Generator(device=device).manual_seed(SEED)
    q = torch.randn(case.B, case.Hq, 1, case.D, generator=gen, device=device, dtype=dtype)
    k = torch.randn(case.B, case.Hkv, case.S, case.D, generator=gen, device=device, dtype=dtype)
    v = torch.randn(case.B, case.Hkv, case.S, case.D, generator=gen, device=device, dtype=dtype)
    group = case.Hq // case.Hkv
    keep = slice(case.S - case.visible_keys(), case.S)
    # float32 reference on the visible keys (the window is the last `window` keys),
    # grouped without repeating K/V (B=32 x 128k keys would not fit repeated).
    scores = torch.einsum("bhgd,bhsd->bhgs", q.float().view(case.B, case.Hkv, group, case.D),
                          k[:, :, keep].float()) * case.D ** -0.5
    expect = torch.einsum("bhgs,bhsd->bhgd", scores.softmax(-1), v[:, :, keep].float())
    expect = expect.reshape(case.B, case.Hq, 1, case.D).double()
    del scores
    masks = {"flexattn": None, "torch_flex": None}
    if case.window is not None:
        mask_mod = window_mask(case.S - 1, case.window)
        masks["flexattn"] = flexattn.create_block_mask(mask_mod, None, None, 1, case.S, device=device)
        masks["torch_flex"] = torch_flex.create_block_mask(mask_mod, None, None, 1, case.S, device=device)
    # K/V rows that must be read: the visible keys, widened to whole 128-key blocks
    # (a window not aligned to the blocks touches one block more).
    kv_rows = case.S if case.window is None else min(case.S, (math.ceil(case.window / 128) + 1) * 128)
    nbytes = (2 * case.B * case.Hkv * kv_rows * case.D + 2 * case.B * case.Hq * case.D) * q.element_size()

    # Each implementation is a call of a copy index: copy 0 is the cache above; the cold
    # timing adds copies (cold_copies) and cycles through them.
    kv = [(k, v)]
    pools: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    impls: list[tuple[str, Callable[[int], torch.Tensor]]] = []
    for split in args.split_kv or [None]:
        options = {} if split is None else {"SPLIT_KV": split}
        name = "flexattn" if split is None else f"flexattn_split{split}"
        compiled = torch.compile(flexattn.flex_attention, fullgraph=True, dynamic=False, backend=args.compile_backend)
        impls.append((name, lambda i, c=compiled, o=options: c(q, *kv[i], block_mask=masks["flexattn"],
                                                                  enable_gqa=True, kernel_options=o or None)))
    if args.with_main:
        compiled = torch.compile(flexattn.flex_attention, fullgraph=True, dynamic=False, backend=args.compile_backend)
        impls.append(("flexattn_main", lambda i, c=compiled: c(q, *kv[i], block_mask=masks["flexattn"],
                                                               enable_gqa=True,
                                                               kernel_options={"FORCE_DECODE": False})))
    for layout in [] if args.no_paged else args.pool_layouts:
        k_pool, v_pool, paged_mask = paged_inputs(case, k, v, args.page_size, layout)
        pools[layout] = [(k_pool, v_pool)]
        compiled = torch.compile(flexattn.flex_attention, fullgraph=True, dynamic=False, backend=args.compile_backend)
        impls.append((PAGED_IMPLS[layout], lambda i, c=compiled, p=pools[layout], m=paged_mask: c(
            q, *p[i], block_mask=m, enable_gqa=True)))
    compiled_torch = torch.compile(torch_flex.flex_attention, fullgraph=True, dynamic=False, backend=args.compile_backend)
    impls.append(("torch_flex", lambda i: compiled_torch(q, *kv[i], block_mask=masks["torch_flex"],
                                                         enable_gqa=True)))
    if case.window is None:
        impls.append(("sdpa", lambda i: F.scaled_dot_product_attention(q, *kv[i], enable_gqa=True)))

    records = []
    timed: dict[str, Callable[[int], torch.Tensor]] = {}
    for name, call in impls:
        fn = functools.partial(call, 0)
        record: dict[str, Any] = {"case": case.name, "impl": name, **dataclasses.asdict(case), "bytes": nbytes}
        torch._dynamo.reset()
        try:
            start = time.perf_counter()
            out = fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            record["first_call_s"] = time.perf_counter() - start
            record["max_abs_err"] = float((out.double() - expect).abs().max())
            record["ms"] = time_ms(fn, device, False, args.cpu_reps)
            if device.type == "cuda" and not args.no_cudagraph:
                record["ms_graph"] = time_ms(fn, device, True, args.cpu_reps)
                if name in ROUND_ROBIN_IMPLS:
                    record["ms_graph_rounds"] = [record["ms_graph"]]
                    timed[name] = call
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            record["error"] = error_text(e)
            print(f"warning: {case.name} {name}: {record['error']}", file=sys.stderr)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        records.append(record)
    copies = 1
    if timed and not args.warm_only:
        # Copies of what the timed calls read: the cache (flexattn, sdpa) and the pools of
        # the timed paged variants.
        torch.cuda.empty_cache()
        timed_pools = [pairs for layout, pairs in pools.items() if PAGED_IMPLS[layout] in timed]
        copy_set = sum(t.untyped_storage().nbytes() for t in (k, v))
        copy_set += sum(t.untyped_storage().nbytes() for pairs in timed_pools for t in pairs[0])
        l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
        copies = cold_copies(nbytes, copy_set, l2_bytes, torch.cuda.mem_get_info(device)[0])
        if copies * nbytes < COLD_L2_SPAN * l2_bytes:
            print(f"warning: {case.name}: {copies} copies of the cache fit in memory, spanning "
                  f"{copies * nbytes / l2_bytes:.1f} L2 caches; the cold timings may find some keys in L2",
                  file=sys.stderr)
        kv += [(k.clone(), v.clone()) for _ in range(copies - 1)]
        for pairs in timed_pools:
            pairs += [(strided_copy(pairs[0][0]), strided_copy(pairs[0][1])) for _ in range(copies - 1)]
        for record in records:
            if record["impl"] in timed:
                record["cold_copies"] = copies
                record["cold_l2_span"] = copies * nbytes / l2_bytes
                record["ms_graph_cold_rounds"] = []
    # More graph timings of the impls the targets compare, in turn (each call compiled
    # again once after the resets above, from the warm caches, before any timing): warm
    # (copy 0 every call) and, unless --warm-only, cold (the copies in turn). A call that
    # fails here ends that impl's timings with an error in its record; the run goes on.
    by_impl = {record["impl"]: record for record in records}

    def timing_failed(name: str, error: Exception) -> None:
        by_impl[name]["error"] = error_text(error)
        print(f"warning: {case.name} {name}: {by_impl[name]['error']}", file=sys.stderr)
        del timed[name]

    if timed and (args.rounds > 1 or copies > 1):
        for name, call in list(timed.items()):
            try:
                for i in range(copies):
                    call(i)
                torch.cuda.synchronize(device)
            except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                timing_failed(name, e)
    for round_ in range(max(args.rounds, 1)):
        for name, call in list(timed.items()):
            record = by_impl[name]
            try:
                if round_ > 0:
                    record["ms_graph_rounds"].append(
                        time_ms(functools.partial(call, 0), device, True, args.cpu_reps))
                if "ms_graph_cold_rounds" in record:
                    record["ms_graph_cold_rounds"].append(time_ms(cycling(call, copies), device, True, args.cpu_reps))
            except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                timing_failed(name, e)
    for record in records:
        if "error" in record:
            continue
        if "ms_graph_rounds" in record:
            record["ms_graph"] = statistics.median(record["ms_graph_rounds"])
        timings = {"": min(record.get("ms_graph", math.inf), record["ms"])}
        if record.get("ms_graph_cold_rounds"):
            record["ms_graph_cold"] = timings["_cold"] = statistics.median(record["ms_graph_cold_rounds"])
        for suffix, ms in timings.items():
            record[f"GBps{suffix}"] = nbytes / (ms * 1e-3) / 1e9
            if bandwidth:
                record[f"copy_bw_fraction{suffix}"] = nbytes / (ms * 1e-3) / bandwidth
        print(json.dumps(record), flush=True)
    return records


def markdown(results: list[dict[str, Any]], bandwidth: float | None, gpu: str) -> str:
    by_case: dict[str, dict[str, dict]] = {}
    for r in results:
        by_case.setdefault(r["case"], {})[r["impl"]] = r
    impls = sorted({r["impl"] for r in results}, key=lambda n: (not n.startswith("flexattn"), n))
    paged_impls = {impl: "" if impl == PAGED_IMPLS["heads"] else f" ({layout})"
                   for layout, impl in PAGED_IMPLS.items() if impl in impls}
    # Ratio columns per graph timing: the cold ones when some cell has a cold timing (none
    # with --warm-only or on the CPU).
    timings = {"ms_graph": "", "ms_graph_cold": " cold"}
    if not any("ms_graph_cold" in r for r in results):
        del timings["ms_graph_cold"]
    ratio_columns = ["flexattn/torch_flex", *(f"flexattn/sdpa{label}" for label in timings.values())]
    for suffix in paged_impls.values():
        ratio_columns += [f"paged/contiguous{label}{suffix}" for label in timings.values()]
    lines = [f"Decode suite on {gpu}; copy bandwidth "
             f"{bandwidth / 1e9:.0f} GB/s" if bandwidth else f"Decode suite on {gpu}",
             "", "ms (cuda-graph ms, warm L2) {cold: each call on another copy of the cache, x copies} "
             "[fraction of copy bandwidth, cold when timed] per impl; ratios from the graph times when "
             "present (> 1: flexattn faster); paged/contiguous: flexattn_paged's time over flexattn's "
             "(target <= 1.05; tokens, pages: the token-major, page-major pool's)", "",
             "| case | " + " | ".join(impls) + " | " + " | ".join(ratio_columns) + " |",
             "| --- |" + " --- |" * (len(impls) + len(ratio_columns))]

    def best(r, key="ms_graph"):
        if r is None or "error" in r:
            return None
        if key == "ms_graph_cold":
            return r.get(key)
        return r.get("ms_graph", r.get("ms"))

    def ratio(theirs, ours, fmt):
        return format(theirs / ours, fmt) if ours and theirs else ""

    for case, cells in by_case.items():
        row = [case]
        for impl in impls:
            r = cells.get(impl)
            if r is None:
                row.append("")
            elif "error" in r:
                row.append("error")
            else:
                text = f"{r['ms']:.3f}"
                if "ms_graph" in r:
                    text += f" ({r['ms_graph']:.3f})"
                if "ms_graph_cold" in r:
                    text += f" {{{r['ms_graph_cold']:.3f} x{r['cold_copies']}}}"
                fraction = r.get("copy_bw_fraction_cold", r.get("copy_bw_fraction"))
                if fraction is not None:
                    text += f" [{fraction:.2f}]"
                row.append(text)
        flex = cells.get("flexattn")
        for other, key, fmt in (("torch_flex", "ms_graph", ".2f"), *(("sdpa", key, ".3f") for key in timings)):
            text = ratio(best(cells.get(other), key), best(flex, key), fmt)
            row.append(text + "x" if text else "")
        for impl in paged_impls:
            for key in timings:
                row.append(ratio(best(cells.get(impl), key), best(flex, key), ".3f"))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--kv", default="2048,8192,32768,131072")
    p.add_argument("--masks", default="nomask,window", help="nomask, window or both")
    p.add_argument("--split-kv", default="", help="comma list: time flexattn at these pinned SPLIT_KV values")
    p.add_argument("--with-main", action="store_true", help="also time flexattn's main kernel (FORCE_DECODE=False)")
    p.add_argument("--no-cudagraph", action="store_true")
    p.add_argument("--page-size", type=int, default=None,
                   help="tokens per page of the paged variant (default 128; 16 in the dry run)")
    p.add_argument("--no-paged", action="store_true", help="skip the paged-KV-cache variant")
    p.add_argument("--pool-layouts", default="heads,pages",
                   help="comma list of PagedKVCache layouts timed (heads: flexattn_paged, "
                        "tokens: flexattn_paged_tokens, pages: flexattn_paged_pages)")
    p.add_argument("--compile-backend", default=None)
    p.add_argument("--cpu-reps", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3,
                   help="graph timings, warm and cold, taken in turn, of flexattn, the paged variants and sdpa "
                        "(their median)")
    p.add_argument("--warm-only", action="store_true",
                   help="skip the cold graph timings (each call on another copy of the cache)")
    p.add_argument("--out", default=None)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, eager compile backend")
    args = p.parse_args(argv)
    args.split_kv = [int(x) for x in args.split_kv.split(",") if x]
    args.pool_layouts = [x.strip() for x in args.pool_layouts.split(",") if x.strip()]
    unknown = set(args.pool_layouts) - set(PAGED_IMPLS)
    if unknown:
        p.error(f"--pool-layouts: expected layouts from {sorted(PAGED_IMPLS)}, got {sorted(unknown)}")
    return args


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.dry_run:
        device, dtype = torch.device("cpu"), torch.float32
        cases = [Case(B, 4, 2, 300, 16, w) for w in (None, 64) for B in (1, 2)]
        args.compile_backend = args.compile_backend or "eager"
        args.page_size = args.page_size or 16
        out_dir = Path(args.out) if args.out else RESULTS_DIR / "dry-run"
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
        masks = {m.strip() for m in args.masks.split(",")}
        cases = [c for c in suite([int(b) for b in args.batches.split(",")], [int(s) for s in args.kv.split(",")])
                 if ("window" if c.window else "nomask") in masks]
        args.compile_backend = args.compile_backend or "inductor"
        args.page_size = args.page_size or 128
        out_dir = Path(args.out) if args.out else RESULTS_DIR
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bandwidth = copy_bandwidth(device)
    results = []
    for case in cases:
        results += run_case(case, args, device, dtype, bandwidth)
    report = {
        "gpu": gpu, "torch": torch.__version__, "python": platform.python_version(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["python", "bench/bench_decode.py", *(argv if argv is not None else sys.argv[1:])]),
        "copy_bandwidth_Bps": bandwidth, "results": results,
    }
    report["markdown"] = markdown(results, bandwidth, gpu)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"decode-{gpu.lower().replace(' ', '-')}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=1))
    (out_dir / f"{stem}.md").write_text(report["markdown"])
    print(report["markdown"])
    return report


if __name__ == "__main__":
    main()

"""Where the time goes: per-kernel GPU time, flexattn beside torch flex or SDPA.

    python bench/profiler.py --kernel attention [--cases no_mask_s8192_d128,causal_s8192_d128] [--mode fwdbwd]
                             [--impls flexattn,torch_flex] [--compile-profile] [--trace DIR]
    python bench/profiler.py --kernel decode [--batches 1,8] [--kv 8192,32768] [--options '{"FUSED_MERGE": true}']
    python bench/profiler.py --kernel decode --batches 8 --kv 8192 --window 1024 --paged [--pool-layouts heads,pages]

attention: for each case of bench_attention's suite (same shapes, masks and inputs) and
each flex implementation it prints

* the first call's wall time (fresh Inductor/Triton caches, after one throwaway compile
  per library, as the benchmark does) and, with ``--compile-profile``, the functions
  of that first call with the most cumulative time (cProfile), which splits it into
  Dynamo tracing, AOTAutograd, Inductor lowering, Triton compiles and autotuning;
* every GPU kernel of one steady-state call (torch.profiler over a few calls): its name,
  microseconds per call and share of the call's GPU time;
* the time per call as the benchmark takes it (do_bench, L2 flushed) and back to back,
  whose difference from the kernels' sum is idle GPU time, and the synchronizing CUDA
  calls of one call (torch.cuda.set_sync_debug_mode).

decode: one query token at position S-1 against S cached tokens, 32 query heads on 8 KV
heads, D=128, bf16, no mask or ``--window`` (bench_decode.py's cases, built by its
functions). For each (B, S) it prints, for flexattn (default kernel_options, and each
``--options`` set), for flexattn on a paged cache with ``--paged`` (bench_decode's pages
in shuffled order, one row per ``--pool-layouts`` layout; the same kernel_options sets)
and, without a window, for SDPA with enable_gqa: the CUDA-graph replay time (as
bench_decode reports it) and every kernel of one call from torch.profiler: name,
microseconds and launches, so that the split-KV pass, the merge pass and SDPA's own
kernels (their names say which backend SDPA picked) can be compared one by one.

A diagnosis tool beside the benchmarks; nothing is written to bench/results. (Not named
profile.py: run from bench/, that name would shadow the standard library's profile
module, which cProfile, and so torch, imports.)
"""

from __future__ import annotations

import cProfile
import collections
import itertools
import json
import pstats
import time

import torch
import torch.nn.functional as F
import triton.testing
from torch.profiler import ProfilerActivity, profile

import bench_attention as ba
import flexattn
from _tuning import KernelParser, allow_recompiles
from bench_decode import Case, paged_inputs, window_mask

KERNELS = ("attention", "decode")
#: The decode cases' query heads, KV heads and head dim.
HQ, HKV, D = 32, 8, 128

PROFILED_CALLS = 5
#: Python frames shown for each synchronizing call.
SYNC_FRAMES = 6
#: The warning torch emits once per process on entering sync debug mode: not a sync.
SYNC_MODE_NOTICE = "Synchronization debug mode is a prototype feature"


def _first_call(step, compile_profile: bool) -> float:
    profiler = cProfile.Profile() if compile_profile else None
    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    step()
    torch.cuda.synchronize()
    if profiler is not None:
        profiler.disable()
    elapsed = time.perf_counter() - start
    if profiler is not None:
        stats = pstats.Stats(profiler)
        stats.sort_stats("cumulative").print_stats(40)
    return elapsed


def kernel_table(step, grads, trace: str = "") -> list[tuple[str, float, int]]:
    """(kernel name, microseconds per call, launches per call), longest first; the
    profile also goes to ``trace`` (chrome trace JSON) when given."""
    for _ in range(2):
        step()
        for tensor in grads:
            tensor.grad = None
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_CALLS):
            step()
            for tensor in grads:
                tensor.grad = None
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    totals: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
            counts[event.name] += 1
    rows = [(name, total / PROFILED_CALLS, counts[name] // PROFILED_CALLS) for name, total in totals.items()]
    return sorted(rows, key=lambda row: -row[1])


def _timings(step, grads) -> dict[str, float]:
    """ms per call three ways: do_bench's median (L2 flushed, as the benchmark times),
    the mean of back-to-back calls between two events, and the span the profiler saw."""
    median = triton.testing.do_bench(step, warmup=25, rep=200, grad_to_none=grads, return_mode="median")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls = 10
    start.record()
    for _ in range(calls):
        step()
        for tensor in grads:
            tensor.grad = None
    end.record()
    torch.cuda.synchronize()
    return {"do_bench": median, "back_to_back": start.elapsed_time(end) / calls}


def _synchronizations(step, grads) -> list[str]:
    """The synchronizing CUDA calls one steady-state call makes (torch's sync debug mode),
    each with the innermost Python frames that led to it (generated wrapper code, flexattn
    or torch), so that the call can be found."""
    import traceback
    import warnings

    found: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None):
        if str(message).startswith(SYNC_MODE_NOTICE):
            return
        frames = traceback.extract_stack()[:-1]
        where = " <- ".join(f"{frame.filename.rsplit('/', 2)[-1]}:{frame.lineno} {frame.name}"
                            for frame in reversed(frames[-SYNC_FRAMES:]))
        found.append(f"{str(message).splitlines()[0][:80]} at {where}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for tensor in grads:
        tensor.grad = None
    return found


def profile_attention(args) -> list[str]:
    """The attention report (see the module docstring); returns the summary table's lines."""
    suite = {case.name: case for case in ba.full_suite() + ba.quick_suite() + ba.short_suite()}
    ba._fresh_compile_caches()
    settings = ba.Settings(device=torch.device("cuda"), dtype=torch.bfloat16, compile_backend="inductor",
                           warmup_ms=25, rep_ms=100, cpu_reps=1, not_run={})
    ba.warm_up_compilers(settings, [args.mode])
    summary = []
    for name in args.cases.split(","):
        prepared = ba.prepare(suite[name], settings, [args.mode])
        q, k, v = prepared.inputs[args.mode]
        grads = [q, k, v] if args.mode == "fwdbwd" else []
        for impl in args.impls.split(","):
            torch._dynamo.reset()
            forward = ba._flex_call(impl, prepared, settings, args.mode)

            def step(forward=forward):
                out = forward()
                if args.mode == "fwdbwd":
                    out.backward(prepared.grad_out)
                return out

            print(f"===== {name} {args.mode} {impl}", flush=True)
            first = _first_call(step, args.compile_profile)
            for tensor in grads:
                tensor.grad = None
            rows = kernel_table(step, grads, f"{args.trace}/{name}-{impl}.json" if args.trace else "")
            total = sum(us for _, us, _ in rows)
            times = _timings(step, grads)
            syncs = _synchronizations(step, grads)
            print(f"first call {first:.2f} s; GPU time per call {total:.1f} us; do_bench {times['do_bench']:.3f} ms, "
                  f"back-to-back {times['back_to_back']:.3f} ms; {len(syncs)} synchronizations per call")
            for line in syncs[:5]:
                print(f"  sync: {line}")
            for kernel, us, launches in rows:
                print(f"  {us:9.1f} us {100 * us / total:5.1f}%  x{launches}  {kernel[:110]}")
            summary.append(f"| {name} | {impl} | {first:.2f} | {total:.1f} | {times['do_bench'] * 1e3:.1f} | "
                           f"{times['back_to_back'] * 1e3:.1f} | {len(syncs)} | "
                           + "; ".join(f"{kernel[:40]} {us:.0f}" for kernel, us, _ in rows[:4]) + " |")
    return ["| case | impl | first call s | kernel us per call | do_bench us | back-to-back us | syncs "
            "| top kernels (us) |", "|---|---|---|---|---|---|---|---|", *summary]


def profile_decode(args) -> list[str]:
    """The decode report (see the module docstring); returns the summary table's lines."""
    allow_recompiles()
    ours = torch.compile(flexattn.flex_attention, fullgraph=True, dynamic=False)
    variants = [("flexattn", {})] + [(f"flexattn {text}", json.loads(text)) for text in args.options]
    summary = []
    for B, S in itertools.product((int(b) for b in args.batches.split(",")), (int(s) for s in args.kv.split(","))):
        q = torch.randn(B, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, HKV, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        case = Case(B, HQ, HKV, S, D, args.window)
        mask = None if args.window is None else flexattn.create_block_mask(
            window_mask(S - 1, args.window), None, None, 1, S, device="cuda")
        calls = [(name, lambda opts=opts: ours(q, k, v, block_mask=mask, kernel_options=opts, enable_gqa=True))
                 for name, opts in variants]
        for layout in args.pool_layouts.split(",") if args.paged else []:
            k_pool, v_pool, paged_mask = paged_inputs(case, k, v, args.page_size, layout)
            calls += [(name.replace("flexattn", f"flexattn paged {layout}", 1),
                       lambda opts=opts, k_pool=k_pool, v_pool=v_pool, paged_mask=paged_mask: ours(
                           q, k_pool, v_pool, block_mask=paged_mask, kernel_options=opts, enable_gqa=True))
                      for name, opts in variants]
        if args.window is None:
            calls.append(("sdpa", lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)))
        for name, call in calls:
            call()
            graph_us = 1e3 * triton.testing.do_bench_cudagraph(call, rep=50, return_mode="median")
            rows = kernel_table(call, [])
            print(f"===== B={B} S={S} {name}: CUDA graph {graph_us:.1f} us; kernels per call "
                  f"(over {PROFILED_CALLS} calls):", flush=True)
            for kernel, us, launches in rows:
                print(f"  {us:8.1f} us  x{launches}  {kernel[:120]}")
            summary.append(f"| {B} | {S} | {name} | {graph_us:.1f} | "
                           + "; ".join(f"{kernel[:48]} {us:.1f}" for kernel, us, _ in rows[:3]) + " |")
    return ["| B | KV | impl | CUDA-graph us | kernels (us) |", "|---|---|---|---|---|", *summary]


def parse_args(argv=None):
    parser = KernelParser(__doc__, KERNELS)
    parser.add("--cases", {"attention": "no_mask_s8192_d128,causal_s8192_d128"},
               "comma list of bench_attention case names (bench_attention.py --list)")
    parser.add("--mode", {"attention": "fwdbwd"}, "fwd or fwdbwd", choices=ba.MODES)
    parser.add("--impls", {"attention": "flexattn,torch_flex"}, "comma list of flexattn, torch_flex")
    parser.add("--compile-profile", {"attention": False}, "cProfile of the first (compiling) call",
               action="store_true")
    parser.add("--trace", {"attention": ""}, "folder for one chrome trace per (case, impl)")
    parser.add("--batches", {"decode": "1,8"}, "comma list of batch sizes")
    parser.add("--kv", {"decode": "8192,32768"}, "comma list of KV cache lengths")
    parser.add("--options", {"decode": []}, "JSON kernel_options for one more flexattn row (repeatable)",
               action="append")
    parser.add("--window", {"decode": None}, "sliding window of this many keys", type=int)
    parser.add("--paged", {"decode": False}, "also flexattn on a paged KV cache", action="store_true")
    parser.add("--page-size", {"decode": 128}, "tokens per page of the paged cache", type=int)
    parser.add("--pool-layouts", {"decode": "heads"},
               "comma list of PagedKVCache layouts of the paged rows (heads, tokens, pages)")
    return parser.parse(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    lines = profile_decode(args) if args.kernel == "decode" else profile_attention(args)
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()

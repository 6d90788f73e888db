"""Where the time goes: per-kernel GPU time and the compile's phases, flexattn beside torch flex.

    python bench/profile_case.py [--cases no_mask_s8192_d128,causal_s8192_d128] [--mode fwdbwd]
                                 [--impls flexattn,torch_flex] [--compile-profile]

For each case of bench_attention's suite (same shapes, masks and inputs) and each flex
implementation it prints

* the first call's wall time (fresh Inductor/Triton caches, after one throwaway compile
  per library, as the benchmark does) and, with ``--compile-profile``, the functions
  of that first call with the most cumulative time (cProfile), which splits it into
  Dynamo tracing, AOTAutograd, Inductor lowering, Triton compiles and autotuning;
* every GPU kernel of one steady-state call (torch.profiler over a few calls): its name,
  microseconds per call and share of the call's GPU time;
* the time per call as the benchmark takes it (do_bench, L2 flushed) and back to back,
  whose difference from the kernels' sum is idle GPU time, and the synchronizing CUDA
  calls of one call (torch.cuda.set_sync_debug_mode).

Nothing is written to bench/results: this is a diagnosis tool beside the benchmark.
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

import bench_attention as ba

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
    import triton.testing

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", default="no_mask_s8192_d128,causal_s8192_d128")
    parser.add_argument("--mode", choices=ba.MODES, default="fwdbwd")
    parser.add_argument("--impls", default="flexattn,torch_flex")
    parser.add_argument("--compile-profile", action="store_true")
    parser.add_argument("--trace", default="", help="folder for one chrome trace per (case, impl)")
    args = parser.parse_args()
    suite = {case.name: case for case in ba.full_suite() + ba.quick_suite()}
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
    print("\n| case | impl | first call s | kernel us per call | do_bench us | back-to-back us | syncs "
          "| top kernels (us) |\n|---|---|---|---|---|---|---|---|")
    print("\n".join(summary))


if __name__ == "__main__":
    main()

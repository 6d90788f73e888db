"""Where does a short call's time go? flexattn's and torch's compiled flex_attention on
short or sparse calls (bf16; B=4 H=16 unless the case says otherwise): the host's time to
issue one call, the GPU's kernel time per call (profiler), the time of back-to-back calls
and do_bench's median (L2 flushed), plus the kernels each call launches and the host's
busiest operators; ``--variants`` compares flexattn kernel_options. Modes: ``fwd`` (no
grad), ``fwd_grad`` (inputs requiring grad, forward only) and ``fwdbwd``. ``--code DIR``
also writes each library's Inductor output code per case.

    PYTHONPATH=. python bench/experiments/host_overhead.py --code $OUT/code
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from pathlib import Path

import torch
from torch._inductor.utils import run_and_get_code
from torch.nn.attention import flex_attention as tflex
from triton.testing import do_bench

import flexattn
from flexattn import mods

torch._dynamo.config.cache_size_limit = 256


def document(S):
    return mods.document_mask(torch.arange(S, device="cuda") * 8 // S)


def document_causal(S):
    return flexattn.and_masks(document(S), mods.causal_mask)


def window(S):
    return mods.sliding_window(S // 8)


def long_document_causal(S):
    """Four documents: rows walk twice as far as document_causal's."""
    return flexattn.and_masks(mods.document_mask(torch.arange(S, device="cuda") * 4 // S), mods.causal_mask)


# name: (B, H, S, D, score_mod, mask_mod or a function of S building one)
CASES = {
    "causal_s1024_d64": (4, 16, 1024, 64, None, mods.causal_mask),
    "causal_s1024_d128": (4, 16, 1024, 128, None, mods.causal_mask),
    "document_s1024_d64": (4, 16, 1024, 64, None, document),
    "document_s1024_d128": (4, 16, 1024, 128, None, document),
    "alibi_causal_s2048_d64": (4, 16, 2048, 64, "alibi", mods.causal_mask),
    "causal_s2048_d128": (4, 16, 2048, 128, None, mods.causal_mask),
    "document_s8192_d128": (4, 16, 8192, 128, None, document),
    # Issue #49's host-time cases.
    "doc_causal_b2h8s4096_d64": (2, 8, 4096, 64, None, document_causal),
    "window_b2h8s4096_d128": (2, 8, 4096, 128, None, window),
    # Short and long KV walks at large shapes: where descriptor loads pay for their launcher.
    "causal_s4096_d128": (4, 16, 4096, 128, None, mods.causal_mask),
    "causal_s8192_d128": (4, 16, 8192, 128, None, mods.causal_mask),
    "window_s8192_d128": (4, 16, 8192, 128, None, window),
    "doc_causal_s8192_d128": (4, 16, 8192, 128, None, document_causal),
    "doc_causal_s8192_d64": (4, 16, 8192, 64, None, document_causal),
    "long_doc_causal_s8192_d128": (4, 16, 8192, 128, None, long_document_causal),
}


def build(name, library, mode, kernel_options=None):
    B, H, S, D, score, mask = CASES[name]
    mask = mask(S) if mask in (document, document_causal, window, long_document_causal) else mask
    score_mod = mods.alibi(H, device="cuda") if score == "alibi" else None
    lib = tflex if library == "torch" else flexattn
    block_mask = lib.create_block_mask(mask, None, None, S, S, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen,
                           requires_grad=mode != "fwd") for _ in range(3))
    grad = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    compiled = torch.compile(lib.flex_attention, fullgraph=True, dynamic=False)

    extra = {} if kernel_options is None else {"kernel_options": kernel_options}

    def call(split=None):
        start = time.perf_counter()
        out = compiled(q, k, v, score_mod=score_mod, block_mask=block_mask, **extra)
        middle = time.perf_counter()
        if mode == "fwdbwd":
            out.backward(grad)
        if split is not None:
            split.append((middle - start, time.perf_counter() - middle))
        return out

    return call, [q, k, v] if mode != "fwd" else []


def issue(call, grads, n, *args):
    """n calls back to back, each with the inputs' gradients cleared first."""
    for _ in range(n):
        for t in grads:
            t.grad = None
        call(*args)


def host_us(call, grads, n=50):
    """Host time to issue one call, queue not full, GPU behind."""
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        issue(call, grads, n)
        times.append((time.perf_counter() - start) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def split_host_us(call, grads, n=50):
    """Host time of the forward call and of ``backward()`` apart, queue not full."""
    split = []
    for _ in range(5):
        torch.cuda.synchronize()
        issue(call, grads, n, split)
        torch.cuda.synchronize()
    return tuple(statistics.median(part[i] for part in split) * 1e6 for i in range(2))


def back_to_back_us(call, grads, n=50):
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        issue(call, grads, n)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / n * 1e3)
    return statistics.median(times)


def profile(call, grads, n=10):
    """Kernels per call with their mean GPU time, and the host's top operators by self time."""
    from torch.profiler import ProfilerActivity, profile as prof

    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        issue(call, grads, n)
        torch.cuda.synchronize()
    kernels = collections.defaultdict(list)
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name].append(e.device_time if hasattr(e, "device_time") else e.cuda_time)
    ks = sorted(((name, len(v) / n, statistics.mean(v)) for name, v in kernels.items()), key=lambda r: -r[1] * r[2])
    gpu = sum(c * t for _, c, t in ks)
    cpu = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    return ks, gpu, cpu


def cprofile(call, grads, n, top):
    """The host's busiest Python functions over n calls, by own time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    issue(call, grads, n)
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--modes", default="fwd,fwdbwd")
    parser.add_argument("--code", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="also print each library's top functions by own time over N calls")
    parser.add_argument("--variants", default='{"flexattn": null}',
                        help="JSON {name: kernel_options or null} of flexattn calls to compare")
    args = parser.parse_args()
    variants = json.loads(args.variants)
    rows = []
    for name in args.cases.split(","):
        for mode in args.modes.split(","):
            calls = {lib: build(name, lib, mode, options) for lib, options in variants.items()}
            calls["torch"] = build(name, "torch", mode)
            for lib, (call, grads) in calls.items():
                if args.code:
                    args.code.mkdir(parents=True, exist_ok=True)
                    torch._dynamo.reset()
                    _, codes = run_and_get_code(call)
                    (args.code / f"{name}-{mode}-{lib}.py").write_text("\n\n# ----\n\n".join(codes))
                call()
            stats = {lib: collections.defaultdict(list) for lib in calls}
            for _ in range(args.rounds):
                for lib, (call, grads) in calls.items():
                    stats[lib]["host"].append(host_us(call, grads))
                    fwd_host, bwd_host = split_host_us(call, grads)
                    stats[lib]["host_fwd"].append(fwd_host)
                    stats[lib]["host_bwd"].append(bwd_host)
                    stats[lib]["b2b"].append(back_to_back_us(call, grads))
                    stats[lib]["bench"].append(1e3 * do_bench(call, warmup=25, rep=100, grad_to_none=grads,
                                                              return_mode="median"))
            for lib, (call, grads) in calls.items():
                if args.cprofile:
                    print(f"== {name} {mode} {lib}: cProfile of {args.cprofile} calls")
                    print(cprofile(call, grads, args.cprofile, 30), flush=True)
                ks, gpu, cpu = profile(call, grads)
                med = {key: statistics.median(v) for key, v in stats[lib].items()}
                rows.append((name, mode, lib, med["host"], gpu, med["b2b"], med["bench"], len(ks),
                             sum(c for _, c, _ in ks), med["host_fwd"], med["host_bwd"]))
                print(f"== {name} {mode} {lib}: kernels per call")
                for kname, count, t in ks:
                    print(f"   {count:4.1f} x {t:8.1f} us  {kname[:110]}")
                print(cpu, flush=True)
    print("| case | mode | lib | host us/call | of it forward | of it backward | GPU kernel us/call | back-to-back us "
          "| do_bench us | kernels | launches |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.1f} | {r[9]:.1f} | {r[10]:.1f} | {r[4]:.1f} | {r[5]:.1f} "
              f"| {r[6]:.1f} | {r[7]} | {r[8]:.1f} |")


if __name__ == "__main__":
    main()

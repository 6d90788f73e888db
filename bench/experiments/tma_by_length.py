"""From which sequence length do tensor-descriptor loads (USE_TMA) pay? flexattn's forward and
forward+backward with USE_TMA automatic (the TMA_DEFAULTS) and off, bf16 B=4 H=16, timed as the GPU's kernel time per call
(profiler: the sum of the call's kernels, so the host's launch time, which descriptors also
raise, stays out), rounds in turn (bench/DECISIONS.md#tma-short-sequences).

    PYTHONPATH=. python bench/experiments/tma_by_length.py --lengths 1024,2048,4096,8192
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

import flexattn
from flexattn import mods

torch._dynamo.config.cache_size_limit = 512
B, H = 4, 16


def masks(S):
    return {"none": None, "causal": mods.causal_mask,
            "document": mods.document_mask(torch.arange(S, device="cuda") * 8 // S),
            "document_causal": flexattn.and_masks(mods.document_mask(torch.arange(S, device="cuda") * 8 // S),
                                                  mods.causal_mask)}


def kernel_us(call, grads, n=10):
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(n):
            for t in grads:
                t.grad = None
            call()
        torch.cuda.synchronize()
    return sum(e.device_time for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA) / n


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--dims", default="64,128")
    parser.add_argument("--masks", default="none,causal,document")
    parser.add_argument("--modes", default="fwd,fwdbwd")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--options", default="{}", help="kernel_options (JSON) for both arms, e.g. "
                        "'{\"fwd_ONE_KV_LOOP\": true}'")
    args = parser.parse_args()
    options = json.loads(args.options)
    if "USE_TMA" in options:
        parser.error("--options: USE_TMA is what the two arms compare; leave it out")
    print("| S | D | mask | mode | default us | no TMA us | default / no TMA |")
    print("| --- | --- | --- | --- | --- | --- | --- |", flush=True)
    for S in map(int, args.lengths.split(",")):
        for D in map(int, args.dims.split(",")):
            for name in args.masks.split(","):
                mask = masks(S)[name]
                bm = None if mask is None else flexattn.create_block_mask(mask, None, None, S, S, device="cuda")
                for mode in args.modes.split(","):
                    grad = mode == "fwdbwd"
                    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
                               for _ in range(3))
                    do = torch.randn_like(q)
                    calls = {}
                    for tma in (None, False):
                        f = torch.compile(flexattn.flex_attention, fullgraph=True, dynamic=False)

                        def call(f=f, tma=tma):
                            out = f(q, k, v, block_mask=bm,
                                    kernel_options={**options, **({"USE_TMA": tma} if tma is False else {})})
                            if grad:
                                out.backward(do)
                        call()
                        calls[tma] = call
                    times = {None: [], False: []}
                    for _ in range(args.rounds):
                        for tma, call in calls.items():
                            times[tma].append(kernel_us(call, [q, k, v] if grad else []))
                    on, off = statistics.median(times[None]), statistics.median(times[False])
                    print(f"| {S} | {D} | {name} | {mode} | {on:.1f} | {off:.1f} | {on / off:.3f} |", flush=True)


if __name__ == "__main__":
    main()

"""What do sinks cost on the GPU itself? do_bench medians of a short forward+backward
move by several percent between rounds on some machines; the profiler's kernel times do
not. Causal S=8192, B=4, H=16, bf16, D=64 and 128: each compiled forward+backward with and
without learned per-head sinks, five calls profiled, the kernels listed by time (the sinks'
gradient is a reduction Inductor may share with the backward's rowsum(dO * O)).

    PYTHONPATH=. python bench/experiments/sinks_kernel_time.py
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

import flexattn
from flexattn import mods

B, H, S, CALLS = 4, 16, 8192, 5


def main() -> None:
    for D in (64, 128):
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        sinks = torch.randn(H, device="cuda", requires_grad=True)
        grad = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
        bm = flexattn.create_block_mask(mods.causal_mask, None, None, S, S, device="cuda")
        for use in (False, True):
            f = torch.compile(lambda q, k, v, s, use=use: flexattn.flex_attention(
                q, k, v, block_mask=bm, sinks=s if use else None), fullgraph=True)
            leaves = [q, k, v] + ([sinks] if use else [])

            def run():
                return torch.autograd.grad(f(q, k, v, sinks), leaves, grad)

            for _ in range(3):
                run()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(CALLS):
                    run()
                torch.cuda.synchronize()
            rows = [(e.self_device_time_total / 1e3 / CALLS, e.key) for e in prof.key_averages()
                    if e.self_device_time_total > 0]
            print(f"D={D} sinks={use}: kernels {sum(ms for ms, _ in rows):.3f} ms per call")
            for ms, name in sorted(rows, reverse=True)[:8]:
                print(f"   {ms:.3f} {name[:110]}")
        torch._dynamo.reset()


if __name__ == "__main__":
    main()

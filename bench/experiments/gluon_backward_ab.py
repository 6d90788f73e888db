"""Is the Gluon backward (kernel_options BWD_BACKEND="GLUON", issue #50) faster than the
Triton template's, and by how much does each trail FLASH's?

    PYTHONPATH=. python bench/experiments/gluon_backward_ab.py [--cases causal_s8192_d128,...] [--rounds 3]

Forward+backward of flexattn's compiled flex_attention with the backward on the Triton
template and on the Gluon kernel (the same forward), bf16, B=4 H=16 (D=256: B=2), medians
of rounds taken in turn (do_bench), TFLOP/s over the unmasked entries (forward 4 and
backward 10 multiply-adds x2 per entry and head dim), and the largest difference of the
Gluon run's gradients from the template's.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

import flexattn
from flexattn import mods

sys.path.insert(0, "bench")
from _tuning import allow_recompiles, medians_in_turn  # noqa: E402

# name: (B, H, S, D, causal)
CASES = {
    "no_mask_s8192_d128": (4, 16, 8192, 128, False),
    "causal_s8192_d128": (4, 16, 8192, 128, True),
    "no_mask_s8192_d64": (4, 16, 8192, 64, False),
    "causal_s8192_d64": (4, 16, 8192, 64, True),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    allow_recompiles()
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}), flush=True)
    for case in args.cases.split(","):
        B, H, S, D, causal = CASES[case]
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, grad = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                         for _ in range(4))
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
        block_mask = flexattn.create_block_mask(mods.causal_mask, None, None, S, S) if causal else None
        steps, grads = {}, {}
        for backend in ("TRITON", "GLUON"):
            fn = torch.compile(lambda q, k, v, b=backend: flexattn.flex_attention(
                q, k, v, block_mask=block_mask, kernel_options={"BWD_BACKEND": b}))

            def step(fn=fn):
                q.grad = k.grad = v.grad = None
                fn(q, k, v).backward(grad)

            try:
                step()
                grads[backend] = [t.grad.clone() for t in (q, k, v)]
                steps[backend] = step
            except Exception as e:  # noqa: BLE001 - a variant that fails is a reading
                print(json.dumps({"case": case, "backend": backend, "error": f"{type(e).__name__}: {str(e)[:300]}"}))
        ms = medians_in_turn(steps, rounds=args.rounds)
        flops = 2 * (2 + 5) * B * H * S * S * D * (0.5 if causal else 1.0)
        row = {"case": case, "ms": {n: round(t, 3) for n, t in ms.items()},
               "fwdbwd_tflops": {n: round(flops / (t * 1e-3) / 1e12, 1) for n, t in ms.items()}}
        if len(grads) == 2:
            row["maxdiff_grads"] = [float((a.float() - b.float()).abs().max()) for a, b in zip(grads["TRITON"],
                                                                                              grads["GLUON"])]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

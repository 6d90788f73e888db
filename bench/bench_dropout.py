"""Benchmark: what attention dropout costs in flexattn's kernels, beside SDPA's.

For each case it times, in rounds taken in turn (bench/_feature_bench.py), forward and
backward together:

* ``flexattn``          compiled ``flexattn.flex_attention`` without dropout;
* ``flexattn_dropout``  the same call with ``dropout_p=0.1`` (the mask drawn in the kernels);
* ``flexattn_dropout_dq_atomic``  the same with ``kernel_options={"DQ_ATOMIC": True}``: dQ
                        formed in the dK/dV programs (FlashAttention-2's scheme), so the
                        backward draws each keep mask once instead of twice;
* ``sdpa_dropout``      ``scaled_dot_product_attention`` with ``dropout_p=0.1`` on its
                        flash backend (FlashAttention-2's dropout), ``is_causal`` for causal
                        cases (on a CPU: whatever backend SDPA picks);
* ``sdpa``              the same without dropout: what dropout costs FlashAttention-2;

causal and unmasked, S=8192, D=64 and 128, bfloat16. Prints median ms and the ratios
dropout / no dropout (flexattn's and SDPA's) and flexattn_dropout / sdpa_dropout, and writes
``dropout-<gpu>-<stamp>.json`` to bench/results.

    python bench/bench_dropout.py              # the suite, 5 rounds
    python bench/bench_dropout.py --dry-run    # CPU, tiny shapes, seconds (checks the script)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from _feature_bench import Case, Feature, main

import flexattn
from flexattn import mods

DROPOUT_P = 0.1


def suite(dry_run: bool) -> list[Case]:
    if dry_run:
        return [Case("causal_tiny", "fwdbwd", 1, 2, 2, 64, 64, 16),
                Case("nomask_tiny", "fwdbwd", 1, 2, 2, 64, 64, 16, mask="none")]
    return [Case(f"{mask}_s8192_d{D}", "fwdbwd", 4, 16, 16, 8192, 8192, D, mask=mask)
            for mask in ("causal", "none") for D in (64, 128)]


def make_call(impl: str, case: Case, device: torch.device, dtype: torch.dtype) -> Callable:
    """A closure running one forward and backward of ``impl`` on fresh inputs."""
    q, k, v = (torch.randn(case.B, case.H, n, case.D, device=device, dtype=dtype, requires_grad=True)
               for n in (case.L, case.S, case.S))
    grad_out = torch.randn(case.B, case.H, case.L, case.D, device=device, dtype=dtype)
    causal = case.mask == "causal"
    if impl in ("sdpa_dropout", "sdpa"):
        p = DROPOUT_P if impl == "sdpa_dropout" else 0.0

        def attend(q, k, v):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION) if device.type == "cuda" else contextlib.nullcontext():
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal)
    else:
        block_mask = flexattn.create_block_mask(mods.causal_mask, None, None, case.L, case.S,
                                                device=device) if causal else None
        p = DROPOUT_P if impl.startswith("flexattn_dropout") else 0.0
        options = {"DQ_ATOMIC": True} if impl == "flexattn_dropout_dq_atomic" else None
        attend = torch.compile(lambda q, k, v: flexattn.flex_attention(
            q, k, v, block_mask=block_mask, dropout_p=p, kernel_options=options), fullgraph=True)

    def run():
        out = attend(q, k, v)
        torch.autograd.grad(out, (q, k, v), grad_out)
        return out

    return run


DROPOUT = Feature("dropout", __doc__.splitlines()[0],
                  ("flexattn", "flexattn_dropout", "flexattn_dropout_dq_atomic", "sdpa_dropout", "sdpa"),
                  suite, make_call, {"dropout_over_plain": ("flexattn_dropout", "flexattn"),
                                     "dropout_over_sdpa": ("flexattn_dropout", "sdpa_dropout"),
                                     "dq_atomic_dropout_over_sdpa": ("flexattn_dropout_dq_atomic", "sdpa_dropout"),
                                     "sdpa_dropout_over_sdpa": ("sdpa_dropout", "sdpa")})

if __name__ == "__main__":
    main(DROPOUT)

"""Benchmark: what attention sinks cost, and against the workaround users have today.

For each case it times, in rounds taken in turn (bench/_feature_bench.py):

* ``flexattn``        compiled ``flexattn.flex_attention`` without sinks;
* ``flexattn_sinks``  the same call with ``sinks=`` (folded into the kernels);
* ``torch_renorm``    compiled torch ``flex_attention`` returning its lse, then the sink
                      applied after the kernel, ``out * exp(lse - logaddexp(lse, sink))``
                      (what transformers does for gpt-oss on torch's flex);

forward (``fwd``), forward and backward (``fwdbwd``), and a decode step (one query row
against a long cache). Prints a table of median ms and the ratios sinks / no sinks and
flexattn_sinks / torch_renorm, and writes ``sinks-<gpu>-<stamp>.json`` to bench/results.

    python bench/bench_sinks.py              # the suite, 5 rounds
    python bench/bench_sinks.py --dry-run    # CPU, tiny shapes, seconds (checks the script)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.attention import flex_attention as torch_flex

from _feature_bench import Case, Feature, main

import flexattn
from flexattn import mods


def suite(dry_run: bool) -> list[Case]:
    if dry_run:
        return [Case("causal_tiny", "fwdbwd", 1, 2, 2, 64, 64, 16), Case("decode_tiny", "decode", 2, 4, 2, 1, 256, 16)]
    cases = []
    for D in (64, 128):
        for mode in ("fwd", "fwdbwd"):
            cases.append(Case(f"causal_s8192_d{D}", mode, 4, 16, 16, 8192, 8192, D))
    cases.append(Case("decode_s32768_gqa4_d128", "decode", 8, 32, 8, 1, 32768, 128))
    return cases


def _renorm(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    total = torch.logaddexp(lse, sinks[None, :, None])
    return (out * torch.exp(lse - total)[..., None]).to(out.dtype)


def make_call(impl: str, case: Case, device: torch.device, dtype: torch.dtype) -> Callable:
    """A closure running one call of ``impl`` on fresh inputs (and its backward for fwdbwd)."""
    train = case.mode == "fwdbwd"
    q = torch.randn(case.B, case.H, case.L, case.D, device=device, dtype=dtype, requires_grad=train)
    k = torch.randn(case.B, case.Hkv, case.S, case.D, device=device, dtype=dtype, requires_grad=train)
    v = torch.randn(case.B, case.Hkv, case.S, case.D, device=device, dtype=dtype, requires_grad=train)
    sinks = torch.randn(case.H, device=device, requires_grad=train)
    block_mask = None if case.mode == "decode" else flexattn.create_block_mask(
        mods.causal_mask, None, None, case.L, case.S, device=device)
    gqa = case.H != case.Hkv
    if impl == "torch_renorm":
        torch_mask = None if block_mask is None else torch_flex.create_block_mask(
            mods.causal_mask, None, None, case.L, case.S, device=device)

        def attend(q, k, v, sinks):
            out, lse = torch_flex.flex_attention(q, k, v, block_mask=torch_mask, enable_gqa=gqa, return_lse=True)
            return _renorm(out, lse, sinks)
    else:
        use_sinks = impl == "flexattn_sinks"

        def attend(q, k, v, sinks):
            return flexattn.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa,
                                           sinks=sinks if use_sinks else None)

    compiled = torch.compile(attend, fullgraph=True)
    leaves = [q, k, v] + ([sinks] if impl != "flexattn" else [])
    grad_out = torch.randn(case.B, case.H, case.L, case.D, device=device, dtype=dtype)

    def run():
        out = compiled(q, k, v, sinks)
        if train:
            torch.autograd.grad(out, [t for t in leaves if t.requires_grad], grad_out)
        return out

    return run


SINKS = Feature("sinks", __doc__.splitlines()[0], ("flexattn", "flexattn_sinks", "torch_renorm"), suite, make_call,
                {"sinks_over_plain": ("flexattn_sinks", "flexattn"),
                 "sinks_over_torch_renorm": ("flexattn_sinks", "torch_renorm")})

if __name__ == "__main__":
    main(SINKS)

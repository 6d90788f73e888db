"""Benchmark: a training step with a learnable bias (a captured tensor that requires grad).

Torch's FLASH backend refuses such a score_mod, so the peer is torch's compiled Triton flex.
For each case it times, in rounds taken in turn (bench/_feature_bench.py), forward and
backward with the gradients of q, k, v and the bias table:

* ``flexattn``         compiled ``flexattn.flex_attention``, the table requiring grad;
* ``flexattn_frozen``  the same call with the table frozen (what the table's gradient costs);
* ``torch_flex``       compiled torch ``flex_attention``, the same score_mod and table.

Biases (causal mask, float32 tables as a model keeps its parameters, indexed with plain
subscripts): ``rel`` a relative-position table (H, 2S-1) read at the clamped ``kv_idx -
q_idx``, ``slope`` a learnable ALiBi slope per head, ``key`` a bias per key (H, S) read at
``kv_idx``, ``pair`` a full (H, S, S) bias (pair bias of structure models). Prints median ms and ``torch_over_flexattn`` (torch's time over
flexattn's: above 1 is flexattn faster), and writes ``learnable-bias-<gpu>-<stamp>.json``.

    python bench/bench_learnable_bias.py              # the suite, 5 rounds
    python bench/bench_learnable_bias.py --dry-run    # CPU, tiny shapes, seconds (checks the script)
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
        return [Case(f"{bias}_tiny", "fwdbwd", 1, 2, 2, 64, 64, 16) for bias in ("rel", "slope", "key", "pair")]
    return [Case("rel_s8192_d128", "fwdbwd", 4, 16, 16, 8192, 8192, 128),
            Case("slope_s8192_d128", "fwdbwd", 4, 16, 16, 8192, 8192, 128),
            Case("key_s8192_d128", "fwdbwd", 4, 16, 16, 8192, 8192, 128),
            Case("rel_s4096_d64", "fwdbwd", 4, 16, 16, 4096, 4096, 64),
            Case("pair_s4096_d128", "fwdbwd", 2, 16, 16, 4096, 4096, 128),
            Case("pair_s2048_d64", "fwdbwd", 4, 16, 16, 2048, 2048, 64)]


def _bias(case: Case, device: torch.device, train: bool) -> tuple[torch.Tensor, Callable]:
    """The case's float32 table (small values, as a trained bias) and its score_mod, indexed
    as users write it (plain subscripts), the same function for both libraries."""
    kind = case.name.split("_")[0]
    generator = torch.Generator(device=device).manual_seed(0)
    shapes = {"rel": (case.H, 2 * case.S - 1), "slope": (case.H,), "key": (case.H, case.S),
              "pair": (case.H, case.L, case.S)}
    if kind not in shapes:
        raise ValueError(f"case name must start with rel, slope, key or pair, got {case.name!r}")
    table = (0.1 * torch.randn(shapes[kind], device=device, generator=generator)).requires_grad_(train)
    last = case.S - 1

    def rel(score, b, h, q_idx, kv_idx):
        return score + table[h, (kv_idx - q_idx).clamp(-last, last) + last]

    def slope(score, b, h, q_idx, kv_idx):
        return score + table[h] * (kv_idx - q_idx)

    def key(score, b, h, q_idx, kv_idx):
        return score + table[h, kv_idx]

    def pair(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx, kv_idx]

    return table, {"rel": rel, "slope": slope, "key": key, "pair": pair}[kind]


def make_call(impl: str, case: Case, device: torch.device, dtype: torch.dtype) -> Callable:
    """A closure running one forward and backward of ``impl`` on fresh inputs."""
    q, k, v = (torch.randn(case.B, heads, length, case.D, device=device, dtype=dtype, requires_grad=True)
               for heads, length in ((case.H, case.L), (case.Hkv, case.S), (case.Hkv, case.S)))
    table, score_mod = _bias(case, device, train=impl != "flexattn_frozen")
    library = torch_flex if impl == "torch_flex" else flexattn
    block_mask = library.create_block_mask(mods.causal_mask, None, None, case.L, case.S, device=device)

    def attend(q, k, v):
        return library.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)

    compiled = torch.compile(attend, fullgraph=True)
    leaves = [t for t in (q, k, v, table) if t.requires_grad]
    grad_out = torch.randn(case.B, case.H, case.L, case.D, device=device, dtype=dtype)

    def run():
        out = compiled(q, k, v)
        torch.autograd.grad(out, leaves, grad_out)
        return out

    return run


LEARNABLE_BIAS = Feature("learnable-bias", __doc__.splitlines()[0], ("flexattn", "flexattn_frozen", "torch_flex"),
                         suite, make_call,
                         {"torch_over_flexattn": ("torch_flex", "flexattn"),
                          "grad_over_frozen": ("flexattn", "flexattn_frozen")})

if __name__ == "__main__":
    main(LEARNABLE_BIAS)

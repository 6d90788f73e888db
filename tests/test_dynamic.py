"""Inductor with changing shapes and options: the lowering under dynamic shapes.

After a second sequence length, Dynamo recompiles with symbolic lengths; kernel_options
or a head dim that change between calls from outside the compiled function arrive as
symbolic ints. The fused kernel must handle the first and specialise on the others.
"""

from __future__ import annotations

import pytest
import torch

import flexattn
from flexattn import mods

from conftest import DEVICE


pytestmark = pytest.mark.usefixtures("inductor_runs_flexattn_kernels")


def _check(compiled, q, k, v, bm, **kwargs):
    out = compiled(q, k, v, block_mask=bm, **kwargs)
    ref = flexattn.flex_attention(q.double(), k.double(), v.double(), block_mask=bm, **kwargs)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_lengths_options_and_head_dims_change_between_calls():
    compiled = torch.compile(flexattn.flex_attention, fullgraph=True)
    scale = 4 if DEVICE == "cuda" else 1
    for L in (32 * scale, 48 * scale, 80 * scale):
        q, k, v = (torch.randn(2, 2, L, 16, device=DEVICE) for _ in range(3))
        bm = flexattn.create_block_mask(mods.causal_mask, None, None, L, L, device=DEVICE, BLOCK_SIZE=16)
        _check(compiled, q, k, v, bm)
    for options in ({"BLOCK_M": 16, "BLOCK_N": 16}, {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 2}):
        _check(compiled, q, k, v, bm, kernel_options=options)
    for E in (16, 32):
        q, k, v = (torch.randn(2, 2, L, E, device=DEVICE) for _ in range(3))
        _check(compiled, q, k, v, bm)

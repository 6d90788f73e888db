"""The shared Triton helpers of templates/common.py.jinja on their own, element by
element against float64 (on CPU through the Triton interpreter): exp2_fma, the
polynomial exp2 of kernel_options EXP2_SPLIT (the softmax's exponents, slightly
positive ones included; -inf and NaN), and exp2_split, which must put each column back
where it came from."""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest
import torch

from conftest import DEVICE

triton = pytest.importorskip("triton")

from flexattn.templates import read_template  # noqa: E402

#: exp2_fma's documented bound (the fit's 1.0e-4), with float32 rounding on top.
EXP2_FMA_REL_ERR = 1.1e-4


#: A kernel that applies both helpers to one (ROWS, COLS) tile; it lives in the helpers'
#: module, where Triton resolves the names it calls.
PROBE_KERNEL = """

@triton.jit
def exp2_probe(X, FMA_OUT, SPLIT_OUT, ROWS: tl.constexpr, COLS: tl.constexpr):
    offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    x = tl.load(X + offs)
    tl.store(FMA_OUT + offs, exp2_fma(x))
    tl.store(SPLIT_OUT + offs, exp2_split(x, ROWS, COLS))
"""


@pytest.fixture(scope="module")
def helpers(tmp_path_factory):
    """templates/common.py.jinja as an importable module (its Jinja header comment
    removed) with PROBE_KERNEL appended; Triton's jit reads kernel source from files,
    so it is written to one."""
    source = re.sub(r"\{#.*?#\}", "", read_template("common"), flags=re.S)
    path = tmp_path_factory.mktemp("helpers") / "flexattn_common_helpers.py"
    path.write_text("import triton\nimport triton.language as tl\n" + source + PROBE_KERNEL)
    spec = importlib.util.spec_from_file_location("flexattn_common_helpers", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def _run(helpers, x: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    fma_out, split_out = torch.empty_like(x), torch.empty_like(x)
    helpers.exp2_probe[(1,)](x, fma_out, split_out, rows, cols)
    return fma_out, split_out


def test_exp2_fma_and_split(helpers):
    rows, cols = 16, 64
    gen = torch.Generator().manual_seed(0)
    x = -torch.rand(rows, cols, generator=gen, dtype=torch.float64) * 40
    # The edges: 0, integers and half-integers (the rounding points), the underflow
    # clamp and beyond, -inf (a masked score) and NaN in an even and an odd column, small
    # positive exponents (the backward's s - lse after rounding).
    edges = torch.tensor([0.0, -0.5, -1.0, -1.5, -2.4999, -2.5, -10.0, -100.0, -126.0, -126.9, -127.0,
                          -130.0, -1e30, float("-inf"), float("-inf"), 1e-6, 0.75, float("nan"), float("nan")],
                         dtype=torch.float64)
    x.view(-1)[: edges.numel()] = edges
    x32 = x.to(torch.float32).to(DEVICE)
    fma_out, split_out = (t.cpu().double() for t in _run(helpers, x32, rows, cols))
    exact = torch.exp2(x32.cpu().double())

    nan = torch.isnan(x)
    assert torch.isnan(fma_out[nan]).all() and torch.isnan(split_out[nan]).all()
    fma_out, split_out, exact = (t.masked_fill(nan, 1.0) for t in (fma_out, split_out, exact))
    normal = exact >= 2.0 ** -126
    rel = ((fma_out - exact).abs() / exact)[normal]
    assert rel.max().item() <= EXP2_FMA_REL_ERR, rel.max().item()
    # Below the smallest normal float the result is tiny (at most 2**-126), and exactly 0
    # at and past the clamp, as a masked score must be.
    assert (fma_out[~normal].abs() <= 2.0 ** -126).all()
    assert (fma_out[x <= -127.0] == 0).all()
    assert not torch.isnan(fma_out).any()  # NaN only where x is NaN (filled above)

    # exp2_split: even columns the full-precision exp2 (closer than the polynomial
    # gets), odd columns exactly exp2_fma's values.
    even = normal[:, 0::2]
    even_rel = ((split_out[:, 0::2] - exact[:, 0::2]).abs() / exact[:, 0::2])[even]
    poly_rel = ((fma_out[:, 0::2] - exact[:, 0::2]).abs() / exact[:, 0::2])[even]
    assert even_rel.max().item() <= 1e-6 < poly_rel.max().item()
    assert (split_out[:, 0::2][x[:, 0::2] == float("-inf")] == 0).all()
    assert torch.equal(split_out[:, 1::2], fma_out[:, 1::2])

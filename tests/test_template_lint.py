"""Lint of the rendered templates: the Triton code Inductor generates from each flexattn
template (forward, backward with captured-tensor gradients, decode and its merge) passes
pyflakes, apart from what every Inductor kernel carries. The decode kernel is checked in
its three forms: one launch with the merge fused, two launches, and one share; every
kernel also without BlockMask tables (flex_attention's default mask, DENSE_KV).

Allowed: unused imports (Inductor's kernel header) and unused local assignments (every
function of a template gets all the kernel's constexprs from ``gen_defines()``, and an
index a given mod does not read stays unused). Anything else, an undefined name above
all, is a template bug that would otherwise show only when a kernel compiles on the GPU.
"""

from __future__ import annotations

import re

import pytest
import torch

import flexattn
from flexattn import mods

from conftest import DEVICE

pyflakes_api = pytest.importorskip("pyflakes.api", reason="pyflakes is in the [test] extra")
from pyflakes import messages as pyflakes_messages  # noqa: E402
from pyflakes.reporter import Reporter  # noqa: E402

pytestmark = pytest.mark.usefixtures("inductor_runs_flexattn_kernels")

ALLOWED = (pyflakes_messages.UnusedImport, pyflakes_messages.UnusedVariable)
KERNEL_SOURCE = re.compile(r"async_compile\.triton\('(\w+)', '''\n(.*?)''', device_str='\w+'\)", re.S)


def _template_kernels(fn, *args) -> dict[str, str]:
    from torch._inductor.utils import run_and_get_code

    _, codes = run_and_get_code(torch.compile(fn), *args)
    return {name: src for code in codes for name, src in KERNEL_SOURCE.findall(code) if "_tem_" in name}


def _pyflakes_messages(source: str, name: str) -> list:
    collected: list = []

    class Collect(Reporter):
        def __init__(self):
            super().__init__(None, None)

        def flake(self, message):
            collected.append(message)

        def syntaxError(self, filename, msg, lineno, offset, text):
            collected.append(f"syntax error at line {lineno}: {msg}")

        def unexpectedError(self, filename, msg):
            collected.append(f"unexpected error: {msg}")

    pyflakes_api.check(source, name, Collect())
    return collected


def _assert_clean(kernels: dict[str, str], expect_at_least: int) -> None:
    assert len(kernels) >= expect_at_least, f"expected {expect_at_least}+ template kernels, got {list(kernels)}"
    for name, source in kernels.items():
        bad = [m for m in _pyflakes_messages(source, name) if not isinstance(m, ALLOWED)]
        assert not bad, f"{name}:\n" + "\n".join(str(m) for m in bad)


def test_forward_and_backward_kernels_lint_clean():
    n = 64 if DEVICE == "cpu" else 256
    slopes = torch.rand(2, device=DEVICE, requires_grad=True)
    table = torch.randn(2 * n - 1, device=DEVICE, requires_grad=True)
    cyclic = torch.randn(7, 7, device=DEVICE, requires_grad=True)
    block_mask = flexattn.create_block_mask(mods.causal_mask, None, None, n, n, device=DEVICE, BLOCK_SIZE=32)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx) + table[q_idx - kv_idx + n - 1] + cyclic[q_idx % 7, kv_idx % 7]

    def step(q, k, v):
        out = flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
        out.sum().backward()

    q, k, v = (torch.randn(1, 2, n, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    # The forward template and the backward template (with reduced, diagonal and
    # per-element captured-tensor gradients).
    _assert_clean(_template_kernels(step, q, k, v), expect_at_least=2)


def test_default_mask_forward_and_backward_lint_clean():
    """block_mask=None: both kernels without BlockMask tables (DENSE_KV), with a score_mod
    whose captured tensor needs a gradient."""
    n = 64 if DEVICE == "cpu" else 256
    table = torch.randn(2 * n - 1, device=DEVICE, requires_grad=True)

    def step(q, k, v):
        out = flexattn.flex_attention(q, k, v, score_mod=mods.relative_bias(table))
        out.sum().backward()

    q, k, v = (torch.randn(1, 2, n, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    found = _template_kernels(step, q, k, v)
    assert all("DENSE_KV : tl.constexpr = True" in src for src in found.values()), list(found)
    _assert_clean(found, expect_at_least=2)


@pytest.mark.parametrize("options,kernels,default_mask", [
    ({"FUSED_MERGE": True}, 1, False),           # one launch: the last share merges
    ({}, 2, False),                              # default: the split-KV pass and the merge pass
    ({"SPLIT_KV": 1}, 1, False),                 # one share: the output written directly
    ({}, 2, True),                               # block_mask=None: no BlockMask tables (DENSE_KV)
], ids=["fused_merge", "merge_pass", "split_kv_1", "dense_kv"])
def test_decode_kernels_lint_clean(options, kernels, default_mask):
    q = torch.randn(1, 4, 1, 16, device=DEVICE)
    k, v = (torch.randn(1, 2, 512, 16, device=DEVICE) for _ in range(2))
    block_mask = None if default_mask else flexattn.create_block_mask(
        mods.sliding_window(200), None, None, 1, 512, device=DEVICE)

    def decode(q, k, v):
        return flexattn.flex_attention(q, k, v, score_mod=mods.tanh_softcap(20.0), block_mask=block_mask,
                                       enable_gqa=True, kernel_options={**options, "SPLIT_KV": options.get("SPLIT_KV", 4)})

    found = _template_kernels(decode, q, k, v)
    assert len(found) == kernels, list(found)
    _assert_clean(found, expect_at_least=kernels)

"""The CPU dense path (Inductor's C++ backend): mods that index captured tensors in steps,
and mods that index out of range where the block mask excludes the position."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import flexattn
from flexattn.lowering.dense import broadcastable_mod

import _harness as harness

B, H, S, E = 2, 3, 48, 16


@pytest.fixture(autouse=True)
def cpp_backend():
    with torch._inductor.config.patch(cpu_backend="cpp", force_disable_caches=True):
        torch._dynamo.reset()
        yield


def _graph(mod, *buffers):
    from torch.fx.experimental.proxy_tensor import make_fx

    from flexattn._hop import IndexWithTensors

    zeros = [torch.zeros((), dtype=torch.int32) for _ in range(4)]
    with IndexWithTensors():
        return make_fx(mod)(torch.zeros(()), *zeros, *buffers)


def test_chained_indexing_is_not_broadcast():
    """``bias[b][q_idx]`` indexes the result of an index: under broadcasting the second
    index would land on the wrong dim, so such a graph goes through vmap."""
    bias = torch.randn(B, S)
    assert broadcastable_mod(_graph(lambda s, b, h, q, kv, t: s + t[b, q], bias))
    assert not broadcastable_mod(_graph(lambda s, b, h, q, kv, t: s + t[b][q], bias))


@pytest.mark.parametrize("name", ["bias[b][q_idx]", "bias[b][h][which, q_idx]", "bias[b][h, kv_idx]"])
def test_chained_indexing_forward_and_backward(name):
    gen = harness.generator(0)
    bias2 = harness.randn(gen, B, S, device="cpu", requires_grad=True)
    bias4 = harness.randn(gen, B, H, 4, S, device="cpu")
    which = torch.tensor(2)
    mods = {
        "bias[b][q_idx]": lambda s, b, h, q, kv: s + bias2[b][q],
        "bias[b][h][which, q_idx]": lambda s, b, h, q, kv: s + bias4[b][h][which, q],
        "bias[b][h, kv_idx]": lambda s, b, h, q, kv: s * bias4[b][h, which, kv],
    }
    mod = mods[name]
    q, k, v = harness.make_inputs(gen, B=B, Hq=H, L=S, S=S, E=E, dtype=torch.float32, device="cpu",
                                  requires_grad=True)
    out = torch.compile(flexattn.flex_attention)(q, k, v, score_mod=mod)
    golden = flexattn.flex_attention(*(t.double() for t in (q, k, v)), score_mod=mod)
    with flexattn.eager_mods():
        ref = flexattn.flex_attention(q, k, v, score_mod=mod)
    harness.check_three_way("out", out, ref, golden, torch.float32)
    if name == "bias[b][q_idx]":
        grads = torch.autograd.grad(out.sum(), (q, bias2))
        ref_grads = torch.autograd.grad(ref.sum(), (q, bias2))
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


_OUT_OF_RANGE_SCRIPT = textwrap.dedent("""
    import torch
    import flexattn
    torch._inductor.config.cpu_backend = "cpp"
    S, BLK = 256, 128
    table = torch.randn(BLK)

    def same_block(b, h, q, kv):
        return (q // BLK) == (kv // BLK)

    def score_mod(score, b, h, q, kv):  # in range exactly where same_block holds
        return score + table[kv - (q // BLK) * BLK]

    def clamped(score, b, h, q, kv):
        return score + table[(kv - (q // BLK) * BLK).clamp(0, BLK - 1)]

    mask = flexattn.create_block_mask(same_block, 1, 1, S, S, device="cpu")
    q, k, v = (torch.randn(1, 1, S, 16) for _ in range(3))
    ref = flexattn.flex_attention(q, k, v, score_mod=clamped, block_mask=mask)
    out = torch.compile(flexattn.flex_attention)(q, k, v, score_mod=score_mod, block_mask=mask)
    print("max_diff", (out - ref).abs().max().item())
""")


def test_mod_out_of_range_where_the_mask_excludes_does_not_crash():
    """A score_mod valid only inside the mask (as a page table is) must not abort the
    process through Inductor's C++ bounds check: run in a child process."""
    done = subprocess.run([sys.executable, "-c", _OUT_OF_RANGE_SCRIPT], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.split("max_diff")[-1]) < 1e-5

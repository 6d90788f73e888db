"""Attention sinks: per-head logits that join every row's softmax as a key of value zero.

The reference (``dense_math(..., sinks)``) is checked against the definition written
out (one more key column); the kernels (forward, backward, the decode kernel with and
without its one-launch merge, the CPU dense path) against the reference with the
three-way bound of tests/_harness.py, the sinks' gradient included.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import flexattn
from flexattn import AuxRequest, BlockMask, create_block_mask, mods, noop_mask
from flexattn.reference import dense_math

import _harness as harness
from conftest import DEVICE

pytestmark = pytest.mark.usefixtures("flexattn_kernels")

ON_CUDA, DTYPES, scaled = harness.ON_CUDA, harness.DTYPES, harness.scaled



def _identity(score, b, h, q_idx, kv_idx):
    return score


def _rows_without_keys_mask(masked_row: int):
    """Causal, and row ``masked_row`` of batch 0 sees no key at all."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((b != 0) | (q_idx != masked_row))

    return mask_mod


def test_reference_is_one_more_key_of_value_zero():
    """dense_math with sinks equals plain softmax attention over S + 1 keys whose last
    score is the sink and whose last value is zero; a row with every key masked puts
    all its weight on the sink (out 0, lse = sink); max_scores ignores the sink."""
    gen = harness.generator(1)
    B, H, L, S, E = 2, 3, 9, 11, 8
    q, k, v = harness.make_inputs(gen, B=B, Hq=H, L=L, S=S, E=E, dtype=torch.float64, device="cpu")
    sinks = harness.randn(gen, B, H, dtype=torch.float64, device="cpu")
    mask_mod = _rows_without_keys_mask(4)
    bm = create_block_mask(mask_mod, B, None, L, S, device="cpu", BLOCK_SIZE=4)
    out, lse, max_scores = dense_math(q, k, v, _identity, bm.as_tuple(), 0.3, (), (), sinks)

    allowed = flexattn.create_mask(mask_mod, B, H, L, S, device="cpu")
    scores = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~allowed, -math.inf)
    scores = torch.cat([scores, sinks[:, :, None, None].expand(B, H, L, 1)], dim=-1)
    values = torch.cat([v, torch.zeros(B, H, 1, E, dtype=v.dtype)], dim=2)
    torch.testing.assert_close(out, scores.softmax(-1) @ values)
    torch.testing.assert_close(lse, scores.logsumexp(-1))
    assert torch.all(out[0, :, 4] == 0) and torch.equal(lse[0, :, 4], sinks[0])
    plain = dense_math(q, k, v, _identity, bm.as_tuple(), 0.3, (), ())
    torch.testing.assert_close(max_scores, plain[2])


def _check_call(attend, q, k, v, sinks, reference_mods, dtype, grad_out, grad_lse):
    """Three-way check of out, lse and the gradients of q, k, v and sinks: ``attend``
    against the dense reference (``reference_mods``: block-mask tuple, scale, score_mod)
    in float64 and in ``dtype``. Returns the compiled run's (out, lse, grads)."""
    bm_tuple, scale, score_mod = reference_mods

    def reference(q, k, v, sinks, grad_out, grad_lse):
        return harness.attention_grads(
            lambda q, k, v, s: dense_math(q, k, v, score_mod, bm_tuple, scale, (), (), s)[:2],
            (q, k, v, sinks), grad_out, grad_lse)

    test = harness.attention_grads(attend, harness.copies((q, k, v, sinks)), grad_out, grad_lse)
    golden, ref = harness.reference_runs(reference, (q, k, v, sinks, grad_out, grad_lse))
    harness.check_attention(test, ref, golden, dtype, max_scores=False)
    harness.check_gradients(test[2], ref[2], golden[2], dtype)
    return test


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("per_batch", [False, True], ids=["sinks_h", "sinks_bh"])
def test_forward_and_backward(dtype, per_batch):
    """GQA, a soft-capped score, a row with every key masked and odd lengths: out, lse
    and every gradient (q, k, v, sinks) through torch.compile."""
    B, Hq, Hkv, E = 2, 4, 2, 16
    L, S = scaled(37, 300), scaled(45, 333)
    gen = harness.generator(3)
    q, k, v = harness.make_inputs(gen, B=B, Hq=Hq, Hkv=Hkv, L=L, S=S, E=E, dtype=dtype, requires_grad=True)
    sinks = harness.randn(gen, *((B, Hq) if per_batch else (Hq,)), requires_grad=True)
    grad_out, grad_lse = harness.make_output_grads(gen, q, v, with_lse=True)
    bm = create_block_mask(_rows_without_keys_mask(5), B, None, L, S, device=DEVICE, BLOCK_SIZE=scaled(16, 64))
    score_mod, scale = mods.tanh_softcap(4.0), E ** -0.5

    def attend(q, k, v, sinks):
        out, aux = flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True,
                                           sinks=sinks, return_aux=AuxRequest(lse=True))
        return out, aux.lse

    compiled = torch.compile(attend, backend="inductor", fullgraph=True)
    test = _check_call(compiled, q, k, v, sinks, (bm.as_tuple(), scale, score_mod), dtype, grad_out, grad_lse)
    assert test[2][3].dtype == sinks.dtype and test[2][3].shape == sinks.shape
    torch.testing.assert_close(test[1][0, :, 5], sinks[0].detach() if per_batch else sinks.detach())


@pytest.mark.parametrize("options", [{}, {"FUSED_MERGE": False}, {"SPLIT_KV": 1}, {"SPLIT_KV": 4, "FUSED_MERGE": True}],
                         ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_decode_kernel(options):
    """Short queries against long keys (the split-KV decode kernel): each way it
    finishes a row (its own program, the last of a tile, the merge pass) folds the sink
    in once; GQA heads packed in a tile each read their own sink."""
    B, Hq, Hkv, L, S, E = 2, 4, 2, 3, scaled(300, 2000), 16
    gen = harness.generator(4)
    q, k, v = harness.make_inputs(gen, B=B, Hq=Hq, Hkv=Hkv, L=L, S=S, E=E, dtype=torch.float16)
    sinks = harness.randn(gen, B, Hq) * 3
    mask_mod = _rows_without_keys_mask(1)
    bm = create_block_mask(mask_mod, B, None, L, S, device=DEVICE, BLOCK_SIZE=16)

    def attend(q, k, v, sinks):
        return flexattn.flex_attention(q, k, v, block_mask=bm, enable_gqa=True, sinks=sinks, kernel_options=options,
                                       return_aux=AuxRequest(lse=True, max_scores=True))

    out, aux = torch.compile(attend, backend="inductor", fullgraph=True)(q, k, v, sinks)
    golden, ref = harness.reference_runs(
        lambda q, k, v, s: dense_math(q, k, v, _identity, bm.as_tuple(), E ** -0.5, (), (), s), (q, k, v, sinks))
    harness.check_attention((out, aux.lse, aux.max_scores), ref, golden, torch.float16)


def test_eager_and_compiled_calls():
    """torch.compile and the eager API (on the CPU: of either kernel path) give the
    reference's results and gradients."""
    gen = harness.generator(6)
    q, k, v = harness.make_inputs(gen, B=1, Hq=2, L=20, S=28, E=8, dtype=torch.float32, requires_grad=True)
    sinks = harness.randn(gen, 2, requires_grad=True)
    bm = create_block_mask(mods.causal_mask, None, None, 20, 28, device=DEVICE, BLOCK_SIZE=16)

    def attend(q, k, v, sinks):
        out, aux = flexattn.flex_attention(q, k, v, block_mask=bm, sinks=sinks, return_aux=AuxRequest(lse=True))
        return out, aux.lse

    golden = harness.attention_grads(
        lambda q, k, v, s: dense_math(q, k, v, _identity, bm.as_tuple(), 8 ** -0.5, (), (), s)[:2],
        harness.copies((q, k, v, sinks), torch.float64), torch.ones(1, 2, 20, 8, dtype=torch.float64, device=DEVICE))
    for fn in (torch.compile(attend, backend="inductor", fullgraph=True), attend):
        test = harness.attention_grads(fn, harness.copies((q, k, v, sinks)), torch.ones(1, 2, 20, 8, device=DEVICE))
        for t, g in zip((test[0], test[1], *test[2]), (golden[0], golden[1], *golden[2])):
            torch.testing.assert_close(t.double(), g, atol=2e-5, rtol=2e-5)


def test_only_the_sinks_learn():
    """Frozen q, k, v and a mask without the transposed lists (compute_q_blocks=False):
    the sinks' gradient needs no backward kernel."""
    gen = harness.generator(8)
    q, k, v = harness.make_inputs(gen, B=2, Hq=2, L=32, S=32, E=8, dtype=torch.float32)
    sinks = harness.randn(gen, 2, requires_grad=True)
    causal = create_block_mask(mods.causal_mask, None, None, 32, 32, device=DEVICE, BLOCK_SIZE=16)
    bm = BlockMask.from_kv_blocks(causal.kv_num_blocks, causal.kv_indices, causal.full_kv_num_blocks,
                                  causal.full_kv_indices, BLOCK_SIZE=16, mask_mod=mods.causal_mask,
                                  compute_q_blocks=False)
    assert bm.q_indices is None
    out = flexattn.flex_attention(q, k, v, block_mask=bm, sinks=sinks)
    (grad,) = torch.autograd.grad(out.sum(), sinks)
    sinks64 = sinks.detach().double().requires_grad_(True)
    want = dense_math(q.double(), k.double(), v.double(), _identity, bm.as_tuple(), 8 ** -0.5, (), (), sinks64)[0]
    (want_grad,) = torch.autograd.grad(want.sum(), sinks64)
    torch.testing.assert_close(grad.double(), want_grad, atol=1e-5, rtol=1e-5)


def test_bad_sinks_are_refused():
    q, k, v = harness.make_inputs(0, B=2, Hq=4, L=8, S=8, E=8, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"sinks must have shape \(H,\) = \(4,\) or \(B, H\) = \(2, 4\)"):
        flexattn.flex_attention(q, k, v, sinks=torch.zeros(3, device=DEVICE))
    with pytest.raises(TypeError, match="sinks must have a floating dtype, got torch.int64"):
        flexattn.flex_attention(q, k, v, sinks=torch.zeros(4, dtype=torch.int64, device=DEVICE))
    with pytest.raises(TypeError, match="sinks must be a torch.Tensor or None, got list"):
        flexattn.flex_attention(q, k, v, sinks=[0.0] * 4)
    if ON_CUDA:
        with pytest.raises(ValueError, match="sinks must be on query's device"):
            flexattn.flex_attention(q, k, v, sinks=torch.zeros(4))


@pytest.mark.workflow
def test_training_steps_over_lengths_compile_at_most_twice():
    """A compiled step reused over sequence lengths with learned sinks (a Parameter shared
    by all steps): results within the three-way bound at every length, at most two
    compiles (the first length, then one dynamic graph)."""
    counter = CompileCounterWithBackend("inductor")
    H, Hkv, E = 4, 2, 16
    sinks = torch.nn.Parameter(harness.randn(harness.generator(30), H))

    def step(q, k, v, sinks, block_mask):
        out, aux = flexattn.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, sinks=sinks,
                                           return_aux=AuxRequest(lse=True))
        return out, aux.lse

    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for i, n in enumerate((64, 96, 80)):
        gen = harness.generator(31 + i)
        q, k, v = harness.make_inputs(gen, B=1, Hq=H, Hkv=Hkv, L=n, S=n, E=E, dtype=torch.float32,
                                      requires_grad=True)
        grad_out, grad_lse = harness.make_output_grads(gen, q, v, with_lse=True)
        bm = create_block_mask(mods.causal_mask, None, None, n, n, device=DEVICE, BLOCK_SIZE=16)
        _check_call(lambda q, k, v, s, bm=bm: compiled(q, k, v, s, bm), q, k, v, sinks,
                    (bm.as_tuple(), E ** -0.5, _identity), torch.float32, grad_out, grad_lse)
    assert counter.frame_count <= 2, counter.frame_count


@pytest.mark.parametrize("L, S", [(scaled(40, 300), scaled(72, 333)), (2, scaled(300, 2000))], ids=["forward", "decode"])
def test_default_mask(L, S):
    """block_mask=None (the kernels' walk over every key without tables, DENSE_KV) folds
    the sinks in as the listed walk does, in the forward and the decode kernel."""
    gen = harness.generator(40)
    q, k, v = harness.make_inputs(gen, B=2, Hq=4, Hkv=2, L=L, S=S, E=16, dtype=torch.float16)
    sinks = harness.randn(gen, 4)
    out, aux = torch.compile(
        lambda q, k, v, s: flexattn.flex_attention(q, k, v, sinks=s, enable_gqa=True, return_aux=AuxRequest(lse=True)),
        backend="inductor", fullgraph=True)(q, k, v, sinks)
    full = create_block_mask(noop_mask, None, None, L, S, device=DEVICE).as_tuple()
    golden, ref = harness.reference_runs(
        lambda q, k, v, s: dense_math(q, k, v, _identity, full, 0.25, (), (), s), (q, k, v, sinks))
    harness.check_attention((out, aux.lse), ref, golden, torch.float16, max_scores=False)

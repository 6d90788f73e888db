"""Inductor with changing shapes and options: the lowering under dynamic shapes.

After a second sequence length, Dynamo recompiles with symbolic lengths; kernel_options
or a head dim that change between calls from outside the compiled function arrive as
symbolic ints. The fused kernel must handle the first and specialise on the others.
"""

from __future__ import annotations

import functools

import pytest
import torch

import torch._dynamo.testing
from torch._inductor.utils import fresh_inductor_cache

import flexattn
from flexattn import mods

import _harness as harness
from conftest import DEVICE


pytestmark = pytest.mark.usefixtures("flexattn_kernels")


def _check(compiled, q, k, v, bm, **kwargs):
    out = compiled(q, k, v, block_mask=bm, **kwargs)
    ref = flexattn.flex_attention(q.double(), k.double(), v.double(), block_mask=bm, **kwargs)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.workflow
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


def test_one_graph_for_a_dynamic_partial():
    """flex_attention bound with functools.partial and compiled with dynamic=True (as torch's
    own tests call it) is one graph on its first call: no default argument is a float,
    which Dynamo would take as a symbolic input and then restart its analysis to specialise
    (two compiles; AOT autograd's pass is the one that asks, hence aot_eager)."""
    L = 32
    bm = flexattn.create_block_mask(mods.causal_mask, None, None, L, L, device=DEVICE, BLOCK_SIZE=16)
    q, k, v = (torch.randn(2, 2, L, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    with fresh_inductor_cache():
        torch._dynamo.reset()
        out = torch.compile(functools.partial(flexattn.flex_attention, block_mask=bm), backend=counter,
                            dynamic=True)(q, k, v)
    assert counter.frame_count == 1
    ref = flexattn.flex_attention(q.double(), k.double(), v.double(), block_mask=bm)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.workflow
def test_captured_float_that_changes_between_calls():
    """After a recompile Dynamo passes a closed-over float (the soft-cap) as a 0-d
    tensor read with .item(); the kernels read the tensor instead, forward and backward."""
    compiled = torch.compile(flexattn.flex_attention, fullgraph=True)
    L = 128 if DEVICE == "cuda" else 32
    bm = flexattn.create_block_mask(mods.causal_mask, None, None, L, L, device=DEVICE, BLOCK_SIZE=16)
    for cap in (30.0, 20.0, 10.0):
        q, k, v = (torch.randn(1, 2, L, 16, device=DEVICE, requires_grad=True) for _ in range(3))
        out = compiled(q, k, v, mods.tanh_softcap(cap), bm)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = flexattn.flex_attention(q64, k64, v64, mods.tanh_softcap(cap), bm)
        ref_grads = torch.autograd.grad(ref.sum(), (q64, k64, v64))
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g.double(), r, atol=1e-4, rtol=1e-4)


@pytest.mark.workflow
def test_gradients_keep_their_batch_when_the_batch_becomes_symbolic():
    """A second batch size and head dim make Dynamo recompile with a symbolic batch for
    query and key/value each; the key/value gradients must not be summed over it (that
    is only for a shared KV batch of 1)."""
    compiled = torch.compile(flexattn.flex_attention, fullgraph=True)
    L = 128
    bm = flexattn.create_block_mask(mods.causal_mask, None, None, L, L, device=DEVICE)
    for B, E in ((2, 32), (4, 16), (3, 16)):
        q, k, v = (torch.randn(B, 2, L, E, device=DEVICE, requires_grad=True) for _ in range(3))
        grad_out = torch.randn(B, 2, L, E, device=DEVICE)
        grads = torch.autograd.grad(compiled(q, k, v, block_mask=bm), (q, k, v), grad_out)
        q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
        expected = torch.autograd.grad(flexattn.flex_attention(q64, k64, v64, block_mask=bm), (q64, k64, v64),
                                       grad_out.double())
        for got, want in zip(grads, expected):
            assert got.shape == want.shape
            torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def _learned_bias_attention(bias):
    def attend(q, k, v):
        out, aux = flexattn.flex_attention(q, k, v, score_mod=lambda s, b, h, m, n: s + bias[n],
                                           return_aux=flexattn.AuxRequest(lse=True))
        return out, aux.lse
    return attend


@pytest.mark.workflow
def test_training_step_over_changing_lengths_with_a_learned_bias():
    """A compiled step reused over lengths 64, 96, 128, its score_mod reading a learned
    bias as long as the sequence: Dynamo goes dynamic after the second length and lifts
    the bias's length (a SymInt) among the captured values, which the autograd operator
    must keep beside, not inside, its saved tensors. Output, lse and every gradient
    (the bias's too) within the three-way bound at each step; at most two compiles."""
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")

    def step(q, k, v, bias):
        return _learned_bias_attention(bias)(q, k, v)

    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for i, S in enumerate((64, 96, 128)):
        q, k, v = harness.make_inputs(i, B=1, Hq=2, L=S, S=S, E=16, dtype=torch.float32, requires_grad=True)
        gen = harness.generator(100 + i)
        bias = harness.randn(gen, S, device=DEVICE, requires_grad=True)
        grad_out, grad_lse = harness.make_output_grads(gen, q, v, with_lse=True)
        test = harness.attention_grads(lambda *t: compiled(*t, bias), (q, k, v), grad_out, grad_lse, (bias,))
        golden, ref = (harness.attention_grads(_learned_bias_attention(b), qkv, grad_out.to(dtype), grad_lse, (b,))
                       for dtype, qkv, b in ((torch.float64, harness.copies((q, k, v), torch.float64),
                                             harness.copies(bias, torch.float64)),
                                            (torch.float32, harness.copies((q, k, v)), harness.copies(bias))))
        harness.check_attention(test[:2], ref[:2], golden[:2], torch.float32, max_scores=False, prefix=f"S={S} ")
        harness.check_gradients(test[2], ref[2], golden[2], torch.float32)
    assert counter.frame_count <= 2, counter.frame_count


def _packed_attention(table, doc_ids):
    mask_mod = flexattn.and_masks(mods.causal_mask, mods.document_mask(doc_ids))

    def attend(q, k, v, block_mask):
        out, aux = flexattn.flex_attention(q, k, v, score_mod=mods.relative_bias(table), block_mask=block_mask,
                                           return_aux=flexattn.AuxRequest(lse=True))
        return out, aux.lse

    return attend, mask_mod


@pytest.mark.workflow
def test_packed_document_training_loop(capsys, flexattn_kernels):
    """Packed-document training as users write it: each batch brings its own length and
    document boundaries (doc ids rebuilt, the block mask rebuilt from them outside the
    compiled step), a learned relative bias per head shared by all steps. Output, lse and
    every gradient (the bias's too) within the three-way bound at every step; at most
    two compiles. The recompile count is printed."""
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    H, max_len = 2, 160
    table = harness.randn(harness.generator(7), H, 2 * max_len - 1, device=DEVICE, requires_grad=True)

    def step(q, k, v, table, doc_ids, block_mask):
        return _packed_attention(table, doc_ids)[0](q, k, v, block_mask)

    compiled = torch.compile(step, backend=counter, fullgraph=True)
    lengths = (64, 96, 128, 80, 160)
    for i, S in enumerate(lengths):
        gen = harness.generator(200 + i)
        cuts = torch.sort(torch.randperm(S - 1, generator=gen)[:3] + 1).values
        doc_ids = torch.zeros(S, dtype=torch.int32)
        doc_ids[cuts] = 1
        doc_ids = doc_ids.cumsum(0).to(torch.int32).to(DEVICE)
        block_mask = flexattn.create_block_mask(_packed_attention(table, doc_ids)[1], None, None, S, S,
                                                device=DEVICE, BLOCK_SIZE=32)
        q, k, v = harness.make_inputs(gen, B=1, Hq=H, L=S, S=S, E=16, dtype=torch.float32, requires_grad=True)
        grad_out, grad_lse = harness.make_output_grads(gen, q, v, with_lse=True)
        test = harness.attention_grads(lambda *t: compiled(*t, table, doc_ids, block_mask), (q, k, v),
                                       grad_out, grad_lse, (table,))

        def reference(q, k, v, table):
            return _packed_attention(table, doc_ids)[0](q, k, v, block_mask)

        golden, ref = (harness.attention_grads(lambda *t, tb=tb: reference(*t, tb), qkv, grad_out.to(dtype),
                                               grad_lse, (tb,))
                       for dtype, qkv, tb in ((torch.float64, harness.copies((q, k, v), torch.float64),
                                               harness.copies(table, torch.float64)),
                                              (torch.float32, harness.copies((q, k, v)), harness.copies(table))))
        harness.check_attention(test[:2], ref[:2], golden[:2], torch.float32, max_scores=False, prefix=f"S={S} ")
        harness.check_gradients(test[2], ref[2], golden[2], torch.float32)
    with capsys.disabled():
        print(f"\npacked-document training ({flexattn_kernels}): {counter.frame_count} compiles over {len(lengths)} lengths")
    assert counter.frame_count <= 2, counter.frame_count


@pytest.mark.workflow
@pytest.mark.parametrize("mask_built", ["outside", "inside"])
def test_recompiles_over_changing_lengths_are_as_the_guide_says(mask_built):
    """The guide's count: a BlockMask built outside the compiled function costs one
    recompile for the first new length and one more when its block count first changes;
    one built inside costs one; then every length reuses the graph."""
    def loss(x, bm):
        B, H, L, _ = x.shape
        if bm is None:
            bm = flexattn.create_block_mask(mods.causal_mask, None, None, L, L, device=DEVICE)
        return flexattn.flex_attention(x, x, x, block_mask=bm).float().sum()

    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(loss, backend=counter)
    for L in (256, 192, 320, 448, 200):
        x = torch.randn(1, 2, L, 16, device=DEVICE, requires_grad=True)
        bm = flexattn.create_block_mask(mods.causal_mask, None, None, L, L, device=DEVICE) \
            if mask_built == "outside" else None
        compiled(x, bm).backward()
    assert counter.frame_count == (3 if mask_built == "outside" else 2)

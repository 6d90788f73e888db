"""Capture: make_fx traces the operator into subgraphs; torch.compile captures whole.

Mostly with Dynamo's ``eager`` and ``aot_eager`` backends (no kernels), so it tests the
operator's tracing paths alone; the one-frame model also runs under ``inductor`` (the
fused kernels on CUDA, the lowered dense path on CPU).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.fx.experimental.proxy_tensor import make_fx

import flexattn
from flexattn import mods
from flexattn._hop import ModError, MutatingModError, flex_attention_hop

from conftest import DEVICE

F32 = torch.float32


def _qkv(B=2, H=4, L=32, S=40, E=16, requires_grad=False, Hkv=None, device="cpu"):
    Hkv = Hkv or H
    q = torch.randn(B, H, L, E, requires_grad=requires_grad, device=device)
    k = torch.randn(B, Hkv, S, E, requires_grad=requires_grad, device=device)
    v = torch.randn(B, Hkv, S, E, requires_grad=requires_grad, device=device)
    return q, k, v


def _hop_nodes(gm: torch.fx.GraphModule, op=flex_attention_hop):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is op]


def test_make_fx_traces_mods_into_subgraphs():
    q, k, v = _qkv()
    slopes = torch.rand(4)
    bm = flexattn.create_block_mask(mods.causal_mask, None, None, 32, 40, device="cpu", BLOCK_SIZE=16)

    def fn(q, k, v, slopes):
        return flex_attention_hop(
            q, k, v, lambda s, b, h, qi, ki, sl: s + sl[h] * (ki - qi), bm.as_tuple(), 0.25,
            {}, (slopes,), (),
        )

    for mode in ("real", "fake", "symbolic"):
        gm = make_fx(fn, tracing_mode=mode)(q, k, v, slopes)
        (node,) = _hop_nodes(gm)
        score_graph = getattr(gm, node.args[3].target)
        mask_graph = getattr(gm, node.args[4][-1].target)
        assert isinstance(score_graph, torch.fx.GraphModule)
        score_ops = {n.target for n in score_graph.graph.nodes if n.op == "call_function"}
        assert torch.ops.aten.index.Tensor in score_ops
        placeholders = [n for n in score_graph.graph.nodes if n.op == "placeholder"]
        assert len(placeholders) == 6  # score, b, h, q_idx, kv_idx, slopes
        assert any(n.target == torch.ops.aten.ge.Tensor for n in mask_graph.graph.nodes)
    out = make_fx(fn)(q, k, v, slopes)(q, k, v, slopes)[0]
    torch.testing.assert_close(out, fn(q, k, v, slopes)[0])


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compile_one_frame_several_calls(backend):
    """Closures over tensors, Python scalars and other mods; and/or masks; one frame. On
    the test device: on CUDA, Inductor compiles the fused kernels (CPU tensors there
    would take the dense path through Inductor's C++ backend, minutes of compiling)."""
    B, H, L, S, E = 2, 4, 48, 48, 16
    q, k, v = _qkv(B, H, L, S, E, requires_grad=True, Hkv=2, device=DEVICE)
    table = torch.randn(H, 2 * S - 1, requires_grad=True, device=DEVICE)
    doc_ids = torch.sort(torch.randint(0, 3, (S,), device=DEVICE)).values
    softcap = mods.tanh_softcap(20.0)
    offset = 3

    def composed(score, b, h, qi, ki):
        return softcap(score, b, h, qi, ki) + offset * 0.01 * (qi - ki)

    bm_causal = flexattn.create_block_mask(mods.causal_mask, None, None, L, S, device=DEVICE, BLOCK_SIZE=16)
    bm_doc = flexattn.create_block_mask(
        flexattn.and_masks(mods.document_mask(doc_ids), flexattn.or_masks(mods.causal_mask, mods.prefix_lm(5))),
        B, None, L, S, device=DEVICE, BLOCK_SIZE=16,
    )

    def model(q, k, v):
        a = flexattn.flex_attention(q, k, v, mods.relative_bias(table), bm_causal, enable_gqa=True)
        b = flexattn.flex_attention(q, k, v, composed, bm_doc, enable_gqa=True)
        c, lse = flexattn.flex_attention(q, k, v, None, None, scale=0.1, enable_gqa=True, return_lse=True)
        return a + b + c, lse

    eager_out, eager_lse = model(q, k, v)
    loss = eager_out.sum() + eager_lse.sum()
    eager_grads = torch.autograd.grad(loss, [q, k, v, table])

    counter = CompileCounterWithBackend(backend)
    out, lse = torch.compile(model, backend=counter, fullgraph=True)(q, k, v)
    grads = torch.autograd.grad(out.sum() + lse.sum(), [q, k, v, table])
    assert counter.frame_count == 1
    torch.testing.assert_close(out, eager_out)
    torch.testing.assert_close(lse, eager_lse)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)
    (graph,) = counter.graphs
    nodes = _hop_nodes(graph)
    assert len(nodes) == 3
    # The relative-bias table is lifted into an explicit buffer input of the first call.
    assert len(nodes[0].args[7]) == 1 and len(nodes[1].args[8]) == 1
    # flexattn's code version is part of the graph, hence of Inductor's FX-graph cache key.
    from flexattn.api import CODE_VERSION
    from flexattn.options import INTERNAL_KEY

    assert all(n.args[6][INTERNAL_KEY]["CODE_VERSION"] == CODE_VERSION for n in nodes)


def test_captured_parameter_gets_gradient_under_compile():
    torch.manual_seed(0)
    B, H, L, E = 1, 2, 24, 8
    q, k, v = _qkv(B, H, L, L, E, requires_grad=True)
    slopes = torch.nn.Parameter(torch.rand(H))

    def model(q, k, v):
        return flexattn.flex_attention(q, k, v, mods.alibi_bias(slopes))

    out = torch.compile(model, backend="aot_eager", fullgraph=True)(q, k, v)
    out.sum().backward()
    assert slopes.grad is not None and slopes.grad.abs().sum() > 0
    expected = torch.autograd.grad(model(q, k, v).sum(), [slopes])[0]
    # aot_eager runs the reference; the eager call runs the kernels, whose float32 sum of
    # the slope's L*S contributions goes in another order.
    torch.testing.assert_close(slopes.grad, expected, atol=1e-4, rtol=1e-4)


def _mod_error_calls():
    """A flexattn call with a faulty mod, three ways: inside torch.compile with and without
    fullgraph, and eagerly (which compiles the operator itself)."""
    def call(q, k, v, score_mod):
        return flexattn.flex_attention(q, k, v, score_mod)

    return {"fullgraph": torch.compile(call, backend="aot_eager", fullgraph=True),
            "graph_breaks_allowed": torch.compile(call, backend="aot_eager"), "eager": call}


@pytest.mark.parametrize("way", ["fullgraph", "graph_breaks_allowed", "eager"])
def test_mutating_score_mod_is_rejected_with_flexattns_error_on_top(way):
    """The user's error reaches the caller as flexattn's exception (not wrapped as an
    internal Dynamo error), under torch.compile or not."""
    q, k, v = _qkv()
    counts = torch.zeros(4)

    def mutating(score, b, h, qi, ki):
        counts.add_(1)
        return score

    with pytest.raises(MutatingModError, match="must be a pure function") as caught:
        _mod_error_calls()[way](q, k, v, mutating)
    assert type(caught.value) is MutatingModError
    assert isinstance(caught.value, RuntimeError)


def test_mods_closing_over_views_of_one_tensor():
    """A mask_mod and a score_mod whose captured tensors share storage (a table and a view
    of it) compile whole: the lifted inputs alias each other, which is harmless in a mod."""
    q, k, v = _qkv(L=32, S=32)
    ids = torch.arange(64).div(8, rounding_mode="floor")
    first, second = ids[:32], ids[32:]
    table = torch.randn(4, 64)
    row = table[1]

    def mask_mod(b, h, qi, ki):
        return first[qi] == second[ki] - 4

    def score_mod(score, b, h, qi, ki):
        return score + table[h, ki] - row[qi]

    block_mask = flexattn.create_block_mask(mask_mod, None, None, 32, 32, device="cpu", BLOCK_SIZE=16)
    compiled = torch.compile(lambda q, k, v: flexattn.flex_attention(q, k, v, score_mod, block_mask),
                             backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), flexattn.flex_attention(q, k, v, score_mod, block_mask),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("way", ["fullgraph", "graph_breaks_allowed", "eager"])
def test_reducing_score_mod_is_rejected_with_flexattns_error_on_top(way):
    q, k, v = _qkv()
    table = torch.randn(4, 8)

    def reducing(score, b, h, qi, ki):
        return score + table[h]  # shape (8,): not one value per entry

    with pytest.raises(ModError, match="must return one value per .* a 0-d tensor") as caught:
        _mod_error_calls()[way](q, k, v, reducing)
    assert type(caught.value) is ModError and isinstance(caught.value, ValueError)


def test_dynamic_shapes_do_not_recompile_endlessly():
    counter = CompileCounterWithBackend("eager")
    table = torch.randn(4, 2 * 512 - 1)

    def model(q, k, v):
        return flexattn.flex_attention(q, k, v, mods.relative_bias(table))

    compiled = torch.compile(model, backend=counter, fullgraph=True)
    for L in (32, 48, 64, 80, 96, 112):
        q, k, v = _qkv(B=1, H=4, L=L, S=L, E=8)
        torch.testing.assert_close(compiled(q, k, v), model(q, k, v))
    for B in (2, 3):
        q, k, v = _qkv(B=B, H=4, L=40, S=40, E=8)
        torch.testing.assert_close(compiled(q, k, v), model(q, k, v))
    # First shape, then one recompile that makes the lengths (and then batch) dynamic.
    assert counter.frame_count <= 3, counter.frame_count


def test_autocast_runs_in_low_precision():
    q, k, v = _qkv(E=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.compile(lambda q, k, v: flexattn.flex_attention(q, k, v), backend="eager", fullgraph=True)(q, k, v)
    assert out.dtype == torch.bfloat16
    ref = flexattn.flex_attention(q, k, v)
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_eager_call_compiles_once_per_signature():
    q, k, v = _qkv()
    out1 = flexattn.flex_attention(q, k, v, mods.tanh_softcap(3.0))
    out2 = flexattn.flex_attention(q, k, v, mods.tanh_softcap(3.0))
    torch.testing.assert_close(out1, out2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(16)
    ref = torch.softmax(3.0 * torch.tanh(scores / 3.0), -1) @ v
    torch.testing.assert_close(out1, ref, atol=1e-5, rtol=1e-5)


def test_eager_backward_grads_have_the_promised_strides():
    """Under aot_eager the backward operator runs its reference implementation; the
    traced graph reshapes its gradients by the strides the fake implementation promised
    (those of q, k, v), so the real ones must have them: transposed projections here."""
    proj = torch.nn.Linear(32, 96)
    x = torch.randn(1, 64, 32, requires_grad=True)

    def model(x):
        q, k, v = (t.reshape(1, 64, 2, 16).transpose(1, 2) for t in proj(x).split(32, dim=2))
        return flexattn.flex_attention(q, k, v).transpose(1, 2).reshape(1, 64, 32)

    out = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    (grad,) = torch.autograd.grad(out.square().sum(), x)
    (expected,) = torch.autograd.grad(model(x).square().sum(), x)
    torch.testing.assert_close(grad, expected, atol=1e-5, rtol=1e-4)

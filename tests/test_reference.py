"""The dense reference (the operator's CPU path) against torch's FlexAttention.

torch's ``flex_attention`` is the peer: outputs and log-sum-exps must agree in float64
on every mod of ``flexattn.mods`` and on captured-tensor mods. torch refuses backward on
CPU through its public function, so gradients are checked against torch's operator
called directly (captured tensors passed explicitly) and against a plain broadcasting
formula written here, and with ``torch.autograd.gradcheck``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

import flexattn
from flexattn import mods

import _harness as harness

F64 = torch.float64
LN2 = math.log(2.0)

# (B, Hq, Hkv, L, S, E, Ev)
SHAPES = [
    (2, 4, 4, 37, 53, 16, 16),
    (1, 4, 2, 17, 17, 32, 8),
    (2, 2, 1, 129, 100, 16, 24),
    (1, 2, 2, 1, 33, 8, 8),
]


def _cases(B, H, L, S, device):
    """name -> (score_mod or None, mask_mod or None, learnable tensors)."""
    n = max(L, S)
    doc_ids = torch.sort(torch.randint(0, 3, (n,), device=device)).values
    slopes = torch.rand(H, dtype=F64, device=device, requires_grad=True)
    table = torch.randn(H, 2 * n - 1, dtype=F64, device=device, requires_grad=True)
    full_bias = torch.randn(B, H, L, S, dtype=F64, device=device, requires_grad=True)
    buckets = torch.randn(8, dtype=F64, device=device, requires_grad=True)
    prefix = torch.randint(1, max(2, L), (B,), device=device)

    def bias_bhqk(score, b, h, q_idx, kv_idx):
        return score + full_bias[b, h, q_idx, kv_idx]

    def bucketed(score, b, h, q_idx, kv_idx):
        return score + buckets[(kv_idx - q_idx).abs().clamp(max=7)]

    def late_rows(b, h, q_idx, kv_idx):
        return (q_idx >= 5) & (kv_idx <= q_idx)

    return {
        "none": (None, None, []),
        "causal": (None, mods.causal_mask, []),
        "sliding_window": (None, mods.sliding_window(8), []),
        "prefix_lm": (None, mods.prefix_lm(6), []),
        "prefix_lm_per_batch": (None, mods.prefix_lm(prefix), []),
        "document": (None, mods.document_mask(doc_ids), []),
        "document_causal": (None, flexattn.and_masks(mods.document_mask(doc_ids), mods.causal_mask), []),
        "prefix_or_causal": (None, flexattn.or_masks(mods.prefix_lm(4), mods.causal_mask), []),
        "alibi": (mods.alibi(H, device=device), mods.causal_mask, []),
        "alibi_learnable": (mods.alibi_bias(slopes), None, [slopes]),
        "softcap": (mods.tanh_softcap(5.0), mods.causal_mask, []),
        "relative_bias": (mods.relative_bias(table), None, [table]),
        "bias_b_h_q_kv": (bias_bhqk, None, [full_bias]),
        "bucket_table": (bucketed, mods.sliding_window(16, causal=False), [buckets]),
        "fully_masked_rows": (None, late_rows, []),
    }


CASE_NAMES = list(_cases(1, 1, 4, 4, "cpu"))


@pytest.fixture(autouse=True)
def _seeded():
    """Each test draws its inputs from the same seed, whatever ran before it in the
    process (test order and xdist's distribution otherwise change them)."""
    torch.manual_seed(0)


def _inputs(shape, device):
    """float64 q, k, v (requiring grad) of a (B, Hq, Hkv, L, S, E, Ev) shape, from seed 0."""
    B, H, Hkv, L, S, E, Ev = shape
    return harness.make_inputs(0, B=B, Hq=H, Hkv=Hkv, L=L, S=S, E=E, Ev=Ev, dtype=F64, device=device,
                               requires_grad=True)


def _masked_rows_to_zero(lse):
    """The lse with fully masked rows' -inf as 0 (a loss of it stays finite)."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def plain_attention(q, k, v, score_mod, mask_mod, scale):
    """Attention by broadcasting index grids: an implementation independent of flexattn."""
    B, H, L, _ = q.shape
    S = k.shape[-2]
    group = H // k.shape[1]
    k = k.repeat_interleave(group, 1)
    v = v.repeat_interleave(group, 1)
    b = torch.arange(B, device=q.device).view(B, 1, 1, 1)
    h = torch.arange(H, device=q.device).view(1, H, 1, 1)
    m = torch.arange(L, device=q.device).view(1, 1, L, 1)
    n = torch.arange(S, device=q.device).view(1, 1, 1, S)
    scores = q @ k.transpose(-1, -2) * scale
    if score_mod is not None:
        scores = score_mod(scores, b, h, m, n)
    if mask_mod is not None:
        scores = scores.masked_fill(~mask_mod(b, h, m, n).expand_as(scores), -math.inf)
    live = torch.isfinite(scores).any(-1, keepdim=True)
    scores = torch.where(live, scores, torch.zeros_like(scores))
    p = torch.softmax(scores, -1) * live
    lse = torch.where(live[..., 0], torch.logsumexp(scores, -1), torch.full_like(scores[..., 0], -math.inf))
    return p @ v, lse


def _run_flexattn(q, k, v, score_mod, mask_mod, block_size=16):
    B, H, L, _ = q.shape
    S = k.shape[-2]
    bm = None
    if mask_mod is not None:
        bm = flexattn.create_block_mask(mask_mod, B, H, L, S, device=q.device, BLOCK_SIZE=block_size)
    return flexattn.flex_attention(q, k, v, score_mod, bm, enable_gqa=True, return_aux=flexattn.AuxRequest(lse=True, max_scores=True))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("case", CASE_NAMES)
def test_forward_matches_torch_flex(case, shape):
    B, H, Hkv, L, S, E, Ev = shape
    score_mod, mask_mod, _ = _cases(B, H, L, S, "cpu")[case]
    q, k, v = (t.detach() for t in _inputs(shape, "cpu"))
    out, aux = _run_flexattn(q, k, v, score_mod, mask_mod)
    tbm = None
    if mask_mod is not None:
        tbm = torch_flex.create_block_mask(mask_mod, B, H, L, S, device="cpu", BLOCK_SIZE=16)
    t_out = torch_flex.flex_attention(q, k, v, score_mod, tbm, enable_gqa=True)
    assert out.shape == (B, H, L, Ev) and out.dtype == F64
    torch.testing.assert_close(out, t_out, atol=1e-10, rtol=1e-10)
    # torch's public function returns no lse or max on CPU; its operator does (in log2 units).
    from torch._higher_order_ops.flex_attention import flex_attention as torch_hop

    if tbm is None:
        tbm = torch_flex.create_block_mask(torch_flex.noop_mask, B, H, L, S, device="cpu", BLOCK_SIZE=16)
    options = {"PRESCALE_QK": False, "ROWS_GUARANTEED_SAFE": False, "BLOCKS_ARE_CONTIGUOUS": False,
               "WRITE_DQ": True, "OUTPUT_LOGSUMEXP": True, "OUTPUT_MAX": True}
    _, t_lse, t_max = torch_hop(q, k, v, score_mod or (lambda s, b, h, qi, ki: s), tbm.as_tuple(),
                                1 / math.sqrt(E), options, (), ())
    # lse in the inputs' working precision in both (float64 here); -inf on fully masked rows in both.
    torch.testing.assert_close(aux.lse, t_lse * LN2, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(aux.max_scores, t_max * LN2, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("shape", SHAPES[1:3], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("case", CASE_NAMES)
def test_gradients_match_plain_formula(case, shape):
    B, H, Hkv, L, S, E, Ev = shape
    score_mod, mask_mod, learnable = _cases(B, H, L, S, "cpu")[case]
    q, k, v = _inputs(shape, "cpu")
    grad_out = torch.randn(B, H, L, Ev, dtype=F64)
    grad_lse = torch.randn(B, H, L, dtype=F64)

    def ours_attend(q, k, v):
        out, aux = _run_flexattn(q, k, v, score_mod, mask_mod)
        return out, _masked_rows_to_zero(aux.lse)

    def plain_attend(q, k, v):
        ref_out, ref_lse = plain_attention(q, k, v, score_mod, mask_mod, 1 / math.sqrt(E))
        return ref_out, _masked_rows_to_zero(ref_lse)

    ours = harness.attention_grads(ours_attend, (q, k, v), grad_out, grad_lse, captured=learnable)[2]
    expected = harness.attention_grads(plain_attend, (q, k, v), grad_out, grad_lse, captured=learnable)[2]
    for name, got, want in zip(["dq", "dk", "dv"] + [f"d_buffer{i}" for i in range(len(learnable))], ours, expected):
        assert not torch.isnan(got).any(), name
        # lse is float32, so the lse-weighted part of each gradient carries float32 error;
        # a captured tensor's gradient sums it over every (q, kv) pair of its entries
        # (ALiBi's slopes: terms up to |q_idx - kv_idx| ~ 100 times that error).
        tol = 1e-4 if name.startswith("d_buffer") else 1e-5
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=lambda m: f"{case} {name}: {m}")


def test_gradients_match_torch_operator():
    """Gradients of q, k, v and of a captured table against torch's own operator."""
    from torch._higher_order_ops.flex_attention import flex_attention as torch_hop

    B, H, L, S, E = 2, 4, 45, 61, 16
    q, k, v = _inputs((B, H, H, L, S, E, E), "cpu")
    table = torch.randn(H, 2 * S - 1, dtype=F64, requires_grad=True)
    scale = 0.3

    def torch_score_mod(score, b, h, q_idx, kv_idx, tab):
        return score + tab[h, kv_idx - q_idx + S - 1]

    tbm = torch_flex.create_block_mask(mods.causal_mask, None, None, L, S, device="cpu", BLOCK_SIZE=16)
    options = {"PRESCALE_QK": False, "ROWS_GUARANTEED_SAFE": False, "BLOCKS_ARE_CONTIGUOUS": False,
               "WRITE_DQ": True, "OUTPUT_LOGSUMEXP": True, "OUTPUT_MAX": False}
    grad_out = torch.randn(B, H, L, E, dtype=F64)
    grad_lse = torch.randn(B, H, L, dtype=F64)

    def torch_attend(q, k, v):
        t_out, t_lse_log2, _ = torch_hop(q, k, v, torch_score_mod, tbm.as_tuple(), scale, options, (table,), ())
        return t_out, t_lse_log2.double() * LN2

    t_out, _, expected = harness.attention_grads(torch_attend, (q, k, v), grad_out, grad_lse, captured=[table])

    bm = flexattn.create_block_mask(mods.causal_mask, None, None, L, S, device="cpu", BLOCK_SIZE=16)

    def ours_attend(q, k, v):
        out, lse = flexattn.flex_attention(
            q, k, v, lambda s, b, h, qi, ki: s + table[h, ki - qi + S - 1], bm, scale=scale, return_lse=True
        )
        return out, lse.double()

    out, _, ours = harness.attention_grads(ours_attend, (q, k, v), grad_out, grad_lse, captured=[table])
    torch.testing.assert_close(out, t_out, atol=1e-10, rtol=1e-10)
    for name, got, want in zip(["dq", "dk", "dv", "dtable"], ours, expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def test_fully_masked_rows_are_zero_with_zero_gradients():
    B, H, L, S, E = 1, 2, 20, 24, 8
    q, k, v = _inputs((B, H, H, L, S, E, E), "cpu")
    bm = flexattn.create_block_mask(lambda b, h, qi, ki: qi >= 7, B, H, L, S, device="cpu", BLOCK_SIZE=8)
    out, lse = flexattn.flex_attention(q, k, v, block_mask=bm, return_lse=True)
    assert torch.isfinite(lse[:, :, 7:]).all()
    out.sum().backward()
    harness.check_masked_rows(lambda t: t[:, :, :7], out=out, lse=lse, grads=(q.grad,))
    for t in (q, k, v):
        assert not torch.isnan(t.grad).any()


def test_gradcheck_float64():
    B, H, L, S, E = 1, 2, 5, 7, 4
    q, k, v = _inputs((B, H, H, L, S, E, 3), "cpu")
    slopes = torch.rand(H, dtype=F64, requires_grad=True)
    bm = flexattn.create_block_mask(mods.causal_mask, None, None, L, S, device="cpu", BLOCK_SIZE=4)

    def fn(q, k, v, slopes):
        # lse is float32 by contract, too coarse for finite differences; its gradient is
        # checked against the formula above.
        return flexattn.flex_attention(q, k, v, mods.alibi_bias(slopes), bm)

    assert torch.autograd.gradcheck(fn, (q, k, v, slopes), atol=1e-5, rtol=1e-4)


def test_output_layout_follows_query():
    """A query made by transposing (B, L, H, E) gives an output laid out as (B, L, H, Ev)."""
    B, L, H, E = 2, 10, 3, 8
    q = torch.randn(B, L, H, E, dtype=F64).transpose(1, 2)
    k = torch.randn(B, H, L, E, dtype=F64)
    v = torch.randn(B, H, L, E, dtype=F64)
    out = flexattn.flex_attention(q, k, v)
    assert out.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(out, plain_attention(q, k, v, None, None, 1 / math.sqrt(E))[0])


def test_kv_batch_broadcast():
    B, H, L, S, E = 3, 2, 9, 11, 8
    q = torch.randn(B, H, L, E, dtype=F64)
    k = torch.randn(1, H, S, E, dtype=F64)
    v = torch.randn(1, H, S, E, dtype=F64)
    out = flexattn.flex_attention(q, k, v)
    torch.testing.assert_close(out, plain_attention(q, k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1), None, None, 1 / math.sqrt(E))[0])

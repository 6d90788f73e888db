"""Dot products of captured rows in a score_mod (MLA's decoupled RoPE), folded into QK^T.

Two parts: the graph rule (``flexattn.row_products.find_row_products``) on literal
score_mods, what it folds and what it leaves; and the numerics of folded mods through
the public API, forward and backward, against the dense reference that evaluates the
dot product as written (tests/_harness.py's three-way bound), on every kernel path.
"""

from __future__ import annotations

import pytest
import torch

import flexattn
from flexattn import AuxRequest, create_block_mask, mods
from flexattn._hop import ModError, scalar_examples
from flexattn._compat import make_fx
from flexattn.lowering.subgraph import ModLoweringError
from flexattn.numerics import IndexWithTensors
from flexattn.reference import dense_math
from flexattn.row_products import RowProductError, find_row_products

import _harness as harness
from conftest import DEVICE

aten = torch.ops.aten


# --------------------------------------------------------------------------------------
# The graph rule
# --------------------------------------------------------------------------------------
def _graph(score_mod, *buffers):
    q = torch.zeros(1, 1, 1, 1)
    with IndexWithTensors():
        return make_fx(score_mod)(*scalar_examples(q, True), *buffers)


def _run(gm, *args):
    return gm(*[torch.tensor(a, dtype=torch.int32) if isinstance(a, int) else a for a in args])


QP, KP, KP_HEADS = torch.randn(2, 4, 5, 3), torch.randn(2, 6, 3), torch.randn(2, 2, 6, 3)
FORMS = {
    "dot": lambda s, b, h, q, kv, qp, kp: s + 0.5 * torch.dot(qp[b, h, q], kp[b, kv]),
    "matmul_left": lambda s, b, h, q, kv, qp, kp: (kp[b, kv] @ qp[b, h, q]) * 0.5 + s,
    "sum_last": lambda s, b, h, q, kv, qp, kp: s + (qp[b, h, q] * kp[b, kv]).sum(-1) / 2,
    "sum_all": lambda s, b, h, q, kv, qp, kp: s - (qp[b, h, q] * kp[b, kv]).sum() * -0.5,
    "cast": lambda s, b, h, q, kv, qp, kp: s + torch.dot(qp[b, h, q], kp[b, kv]).float() * 0.5,
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_folds_the_written_forms(form):
    folding = find_row_products(_graph(FORMS[form], QP, KP), num_groups=1)
    assert folding is not None and len(folding.terms) == 1
    term = folding.terms[0]
    assert term.coefficient == pytest.approx(0.5) and term.width == 3 and term.key_reads_batch
    assert folding.kept_buffers == ()
    # The rest of the mod is the score itself; the rows are the ones read.
    assert torch.equal(_run(folding.score_graph, torch.tensor(1.25), 1, 2, 3, 4), torch.tensor(1.25))
    assert torch.equal(_run(term.query_rows, 1, 2, 3, QP, KP), QP[1, 2, 3])
    assert torch.equal(_run(term.key_rows, 1, 0, 4, QP, KP), KP[1, 4])


def test_query_side_factors_join_the_query_rows_and_the_rest_of_the_mod_stays():
    slopes = torch.rand(4)

    def score_mod(s, b, h, q, kv, qp, kp, sl):
        biased = s + sl[h] * torch.dot(qp[b, h, q], kp[b, kv]) * 3.0
        return torch.tanh(biased / 2.0) + sl[h] * (kv - q)

    folding = find_row_products(_graph(score_mod, QP, KP, slopes), num_groups=1)
    term, = folding.terms
    assert term.coefficient == pytest.approx(3.0)
    assert folding.kept_buffers == (2,)
    assert torch.allclose(_run(term.query_rows, 1, 2, 3, QP, KP, slopes), QP[1, 2, 3] * slopes[2])
    s = torch.tensor(0.7)
    expected = torch.tanh(s / 2.0) + slopes[2] * (4 - 3)
    assert torch.allclose(_run(folding.score_graph, s, 1, 2, 3, 4, slopes), expected)


def test_two_terms_fold():
    def score_mod(s, b, h, q, kv, qp, kp):
        return s + torch.dot(qp[b, h, q], kp[b, kv]) + 2.0 * torch.dot(qp[b, h, q] * 2, kp[b, kv] + 1)

    folding = find_row_products(_graph(score_mod, QP, KP), num_groups=1)
    assert [t.coefficient for t in folding.terms] == [1.0, 2.0]
    assert torch.allclose(_run(folding.terms[1].key_rows, 0, 0, 1, QP, KP), KP[0, 1] + 1)


def test_grouped_heads_key_rows_take_the_key_head():
    def score_mod(s, b, h, q, kv, qp, kp):
        return s + torch.dot(qp[b, h, q], kp[b, h // 2, kv])

    folding = find_row_products(_graph(score_mod, QP, KP_HEADS), num_groups=2)
    key_rows = folding.terms[0].key_rows
    assert torch.equal(_run(key_rows, 1, 1, 5, QP, KP_HEADS), KP_HEADS[1, 1, 5])
    # Without grouping the key head is the query head.
    assert find_row_products(_graph(score_mod, QP, KP_HEADS), num_groups=1) is not None


def test_grouped_heads_key_rows_reading_the_query_head_are_refused():
    def score_mod(s, b, h, q, kv, qp, kp):
        return s + torch.dot(qp[b, h, q], kp[b, h % 2, kv])

    with pytest.raises(RowProductError, match=r"reads the query head h other than as h // 2"):
        find_row_products(_graph(score_mod, QP, KP_HEADS), num_groups=2)


NOT_FOLDED = {
    "multiplies_the_score": lambda s, b, h, q, kv, qp, kp: s * torch.dot(qp[b, h, q], kp[b, kv]),
    "inside_a_nonlinearity": lambda s, b, h, q, kv, qp, kp: s + torch.tanh(torch.dot(qp[b, h, q], kp[b, kv])),
    "row_reads_both_positions": lambda s, b, h, q, kv, qp, kp: s + torch.dot(qp[b, h, q], kp[b, kv] * kv * q),
    "factor_reads_kv": lambda s, b, h, q, kv, qp, kp: s + torch.dot(qp[b, h, q], kp[b, kv]) * kv,
    "term_used_twice": lambda s, b, h, q, kv, qp, kp: (lambda t: s + t + t * t)(torch.dot(qp[b, h, q], kp[b, kv])),
    "no_reduction": lambda s, b, h, q, kv, qp, kp: s + qp[b, h, q, 0] * kp[b, kv, 0],
}


@pytest.mark.parametrize("case", sorted(NOT_FOLDED))
def test_leaves_what_is_not_a_row_product_added_to_the_score(case):
    assert find_row_products(_graph(NOT_FOLDED[case], QP, KP), num_groups=1) is None


REFUSED = {
    # Folded, the dot product would reach the other use of the score too.
    "score_used_again": (lambda s, b, h, q, kv, qp, kp: torch.where(kv <= q, s + torch.dot(qp[b, h, q], kp[b, kv]), s),
                         r"uses its score argument again"),
    # Folded, the truncation would be lost.
    "integer_cast": (lambda s, b, h, q, kv, qp, kp: s + torch.dot(qp[b, h, q], kp[b, kv]).to(torch.int32),
                     r"cast to a non-floating dtype"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refuses_a_row_product_whose_fold_would_change_the_mod(case):
    score_mod, message = REFUSED[case]
    with pytest.raises(RowProductError, match=message):
        find_row_products(_graph(score_mod, QP, KP), num_groups=1)


# --------------------------------------------------------------------------------------
# Numerics through the public API
# --------------------------------------------------------------------------------------
def _run_mla(*, dtype, B=2, Hq=4, Hkv=2, L=40, S=48, E=32, Ev=16, R=16, shared_key_rows=True,
             on_top=None, causal=True, seed=0, dynamic=False, mod_outside=False):
    """Forward and backward of attention with MLA's decoupled RoPE (q_pe and k_pe learnable,
    in the test dtype as MLA keeps them), three ways. ``mod_outside``: the score_mod is
    made outside the compiled function (its scale a captured number, its group count read
    off captured shapes)."""
    gen = harness.generator(seed)
    q, k, v = harness.make_inputs(gen, B=B, Hq=Hq, Hkv=Hkv, L=L, S=S, E=E, Ev=Ev, dtype=dtype)
    q_pe = harness.randn(gen, B, Hq, L, R, dtype=dtype)
    k_pe = harness.randn(gen, *((B, S, R) if shared_key_rows else (B, Hkv, S, R)), dtype=dtype)
    grad_out, grad_lse = harness.make_output_grads(gen, q, v, with_lse=True)
    q, k, v, q_pe, k_pe = (t.requires_grad_(True) for t in (q, k, v, q_pe, k_pe))
    scale = (E + R) ** -0.5
    block_mask = create_block_mask(mods.causal_mask if causal else flexattn.noop_mask, None, None, L, S,
                                   device=DEVICE, BLOCK_SIZE=harness.scaled(16, 128))

    def score_mod_of(q_pe, k_pe):
        rope = mods.decoupled_rope(q_pe, k_pe, scale)
        if on_top is None:
            return rope
        return lambda s, b, h, qi, ki: on_top(rope(s, b, h, qi, ki), b, h, qi, ki)

    def reference(q, k, v, grad_out, grad_lse, q_pe, k_pe):
        def attend(q, k, v):
            out, lse, _ = dense_math(q, k, v, score_mod_of(q_pe, k_pe), block_mask.as_tuple(), scale, (), ())
            return out, lse

        return harness.attention_grads(attend, (q, k, v), grad_out, grad_lse, captured=(q_pe, k_pe))

    golden, ref = harness.reference_runs(reference, (q, k, v, grad_out, grad_lse, q_pe, k_pe))
    cq, ck, cv, cq_pe, ck_pe = harness.copies((q, k, v, q_pe, k_pe))

    made_outside = score_mod_of(cq_pe, ck_pe)

    def attend(q, k, v):
        score_mod = made_outside if mod_outside else score_mod_of(cq_pe, ck_pe)
        out, aux = flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                           scale=scale, enable_gqa=Hq != Hkv, return_aux=AuxRequest(lse=True))
        return out, aux.lse

    compiled = torch.compile(attend, backend="inductor", fullgraph=True, dynamic=dynamic)
    test = harness.attention_grads(compiled, (cq, ck, cv), grad_out, grad_lse, captured=(cq_pe, ck_pe))
    harness.check_attention(test, ref, golden, dtype, max_scores=False)
    harness.check_gradients(test[2], ref[2], golden[2], dtype)


@pytest.mark.usefixtures("flexattn_kernels")
@pytest.mark.parametrize("shared_key_rows", [True, False], ids=["k_pe_shared", "k_pe_per_kv_head"])
def test_decoupled_rope_forward_and_backward(shared_key_rows):
    _run_mla(dtype=torch.float16, shared_key_rows=shared_key_rows)


@pytest.mark.usefixtures("flexattn_kernels")
def test_decoupled_rope_with_softcap_and_alibi_on_top_float32():
    softcap, alibi = mods.tanh_softcap(4.0), mods.alibi(4, device=DEVICE)

    def on_top(s, b, h, q, kv):
        return alibi(softcap(s, b, h, q, kv), b, h, q, kv)

    _run_mla(dtype=torch.float32, on_top=on_top, causal=False, Hkv=1, L=33, S=17, E=16, Ev=16, R=8, seed=1)


@pytest.mark.usefixtures("flexattn_kernels")
def test_decoupled_rope_decoding_one_query_on_a_shared_key_head():
    _run_mla(dtype=torch.float16, L=1, S=70, Hq=8, Hkv=1, causal=False, seed=3)


@pytest.mark.usefixtures("inductor_runs_flexattn_kernels")
def test_decoupled_rope_dynamic_lengths():
    for L in (24, 40):
        _run_mla(dtype=torch.float16, L=L, S=L, dynamic=True, seed=L)


@pytest.mark.usefixtures("inductor_runs_flexattn_kernels")
def test_decoupled_rope_made_outside_the_compiled_function_dynamic_lengths_per_kv_head_rows():
    """Under dynamic shapes the mod's scale arrives as a number read from a 0-d input and
    its group count (q_pe's heads // k_pe's) as a symbolic size: both still fold."""
    for L in (24, 40):
        _run_mla(dtype=torch.float16, L=L, S=L, dynamic=True, seed=L, shared_key_rows=False, mod_outside=True)


@pytest.mark.usefixtures("inductor_runs_flexattn_kernels")
def test_a_row_product_is_not_folded_into_float8_keys():
    q = torch.randn(1, 2, 16, 16, device=DEVICE)
    k, v = (torch.randn(1, 2, 16, 16, device=DEVICE).to(torch.float8_e4m3fn) for _ in range(2))
    q_pe, k_pe = torch.randn(1, 2, 16, 8, device=DEVICE), torch.randn(1, 16, 8, device=DEVICE)
    with pytest.raises(ModError, match=r"key is torch.float8_e4m3fn: its folded rows would be rounded"):
        flexattn.flex_attention(q, k, v, score_mod=mods.decoupled_rope(q_pe, k_pe, 0.2))


@pytest.mark.usefixtures("inductor_runs_flexattn_kernels")
def test_a_reduction_that_cannot_fold_names_the_rewrite():
    q, k, v = harness.make_inputs(0, B=1, Hq=2, L=16, S=16, E=16, dtype=torch.float32)
    table = torch.randn(1, 2, 16, 8, device=DEVICE)

    def score_mod(s, b, h, q_idx, kv_idx):
        return s * torch.dot(table[b, h, q_idx], table[b, h, kv_idx])

    with pytest.raises(Exception, match=r"decoupled_rope|folded into the attention's matrix product") as info:
        flexattn.flex_attention(q, k, v, score_mod=score_mod)
    assert isinstance(info.value, ModLoweringError) or any(
        isinstance(e, ModLoweringError) for e in _chain(info.value))


@pytest.mark.usefixtures("inductor_runs_flexattn_kernels")
def test_an_unfoldable_grouped_row_product_is_a_mod_error():
    q, k, v = harness.make_inputs(0, B=1, Hq=4, Hkv=2, L=16, S=16, E=16, dtype=torch.float32)
    q_pe = torch.randn(1, 4, 16, 8, device=DEVICE)
    k_pe = torch.randn(1, 2, 16, 8, device=DEVICE)

    def score_mod(s, b, h, q_idx, kv_idx):
        return s + torch.dot(q_pe[b, h, q_idx], k_pe[b, h % 2, kv_idx])

    with pytest.raises(ModError, match=r"reads the query head h other than as h // 2"):
        flexattn.flex_attention(q, k, v, score_mod=score_mod, enable_gqa=True)


def test_decoupled_rope_checks_its_arguments():
    with pytest.raises(ValueError, match=r"k_pe's last dim must equal q_pe's \(8\)"):
        mods.decoupled_rope(torch.zeros(1, 2, 3, 8), torch.zeros(1, 3, 4), 0.1)
    with pytest.raises(ValueError, match=r"k_pe's heads \(3\) must divide q_pe's \(2\)"):
        mods.decoupled_rope(torch.zeros(1, 2, 3, 8), torch.zeros(1, 3, 3, 8), 0.1)
    with pytest.raises(ValueError, match=r"q_pe must be 4-D"):
        mods.decoupled_rope(torch.zeros(2, 3, 8), torch.zeros(1, 3, 8), 0.1)


def _chain(e):
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__

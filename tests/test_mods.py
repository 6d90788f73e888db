"""Each mod in flexattn.mods against a hand-written dense formula, and its traceability."""

from __future__ import annotations

import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from flexattn.block_mask import create_mask
from flexattn.mask_evaluation import evaluate_mod
from flexattn.mods import (
    alibi,
    alibi_bias,
    alibi_slopes,
    causal_mask,
    document_mask,
    document_mask_from_offsets,
    prefix_lm,
    relative_bias,
    sliding_window,
    tanh_softcap,
)

B, H, Q, KV = 2, 3, 37, 45


def _grid(q_len=Q, kv_len=KV):
    """Broadcastable (q, kv) position grids of shape (Q, 1) and (1, KV)."""
    return torch.arange(q_len)[:, None], torch.arange(kv_len)[None, :]


def _mask(mask_mod, b=B, h=H, q_len=Q, kv_len=KV):
    return create_mask(mask_mod, b, h, q_len, kv_len, device="cpu")


def _scores(score_mod, scores):
    b, h, q, kv = (torch.arange(n) for n in scores.shape)
    return evaluate_mod(score_mod, b, h, q, kv, score=scores)


def _expand(mask2d):
    return mask2d.expand(B, H, *mask2d.shape)


# --------------------------------------------------------------------------------------
# mask_mods
# --------------------------------------------------------------------------------------


def test_causal_mask():
    q, kv = _grid()
    assert torch.equal(_mask(causal_mask), _expand(q >= kv))


@pytest.mark.parametrize("window", [1, 5, 100])
def test_sliding_window_causal(window):
    q, kv = _grid()
    expected = (kv <= q) & (kv > q - window)
    assert torch.equal(_mask(sliding_window(window)), _expand(expected))


@pytest.mark.parametrize("window", [1, 5])
def test_sliding_window_bidirectional(window):
    q, kv = _grid()
    expected = (kv < q + window) & (kv > q - window)
    assert torch.equal(_mask(sliding_window(window, causal=False)), _expand(expected))


@pytest.mark.parametrize("window", [0, -4, 2.5, True])
def test_sliding_window_rejects_bad_window(window):
    with pytest.raises(ValueError, match="window must be a positive int"):
        sliding_window(window)


@pytest.mark.parametrize("prefix", [0, 7, 1000])
def test_prefix_lm_shared_prefix(prefix):
    q, kv = _grid()
    expected = (kv < prefix) | (kv <= q)
    assert torch.equal(_mask(prefix_lm(prefix)), _expand(expected))


def test_prefix_lm_per_batch_prefix():
    prefixes = torch.tensor([3, 20])
    mask = _mask(prefix_lm(prefixes))
    q, kv = _grid()
    for b in range(B):
        expected = (kv < int(prefixes[b])) | (kv <= q)
        assert torch.equal(mask[b], expected.expand(H, Q, KV))


def test_prefix_lm_validation():
    with pytest.raises(ValueError, match="prefix_len must be a non-negative int"):
        prefix_lm(-1)
    with pytest.raises(ValueError, match="prefix_len must be 1-D"):
        prefix_lm(torch.tensor(4))


def test_document_mask_shared_ids():
    ids = torch.tensor([0] * 10 + [1] * 3 + [2] * 32)
    q, kv = _grid()
    expected = ids[:Q][:, None] == ids[None, :KV]
    assert torch.equal(_mask(document_mask(ids)), _expand(expected))


def test_document_mask_per_batch_ids():
    ids = torch.stack([torch.arange(KV) // 9, torch.arange(KV) // 20])
    mask = _mask(document_mask(ids))
    for b in range(B):
        expected = ids[b, :Q][:, None] == ids[b, None, :KV]
        assert torch.equal(mask[b], expected.expand(H, Q, KV))


def test_document_mask_validation():
    with pytest.raises(TypeError, match="doc_ids must be a torch.Tensor"):
        document_mask([0, 0, 1])
    with pytest.raises(ValueError, match="doc_ids must be 1-D or 2-D"):
        document_mask(torch.zeros(2, 2, 2, dtype=torch.long))
    with pytest.raises(TypeError, match="integer tensor"):
        document_mask(torch.zeros(4))


def test_document_mask_from_offsets_builds_the_ids():
    offsets = torch.tensor([0, 4, 4, 11, 30])
    total = KV
    expected_ids = []
    for token in range(total):
        doc = sum(1 for end in offsets[1:].tolist() if token >= end)
        expected_ids.append(doc)
    ids = torch.tensor(expected_ids)
    assert ids[29] == 3 and ids[30] == 4 and ids[3] == 0 and ids[4] == 2
    mask = _mask(document_mask_from_offsets(offsets, total))
    expected = ids[:Q][:, None] == ids[None, :KV]
    assert torch.equal(mask, _expand(expected))
    assert document_mask_from_offsets(offsets, total).__name__ == "document_mask_from_offsets"


def test_document_mask_from_offsets_validation():
    with pytest.raises(ValueError, match="total_len must be a positive int"):
        document_mask_from_offsets(torch.tensor([0, 3]), 0)
    with pytest.raises(TypeError, match="cu_seqlens must be an integer tensor"):
        document_mask_from_offsets(torch.tensor([0.0, 3.0]), 4)


# --------------------------------------------------------------------------------------
# score_mods
# --------------------------------------------------------------------------------------


def test_alibi_slopes_power_of_two_and_not():
    assert alibi_slopes(8).tolist() == [2.0 ** -(i + 1) for i in range(8)]
    twelve = alibi_slopes(12).tolist()
    expected = [2.0 ** -(i + 1) for i in range(8)] + [2.0 ** (-(2 * i + 1) / 2) for i in range(4)]
    assert twelve == pytest.approx(expected)
    assert alibi_slopes(1).tolist() == [2.0**-8]


def test_alibi_matches_formula():
    scores = torch.randn(B, H, Q, KV, dtype=torch.float64)
    slopes = alibi_slopes(H).to(torch.float64)
    q, kv = _grid()
    expected = scores + slopes[None, :, None, None] * (kv - q)
    assert torch.allclose(_scores(alibi(H), scores), expected.to(torch.float32).to(torch.float64), atol=1e-5)
    assert alibi(H).__name__ == f"alibi_{H}_heads"


def test_alibi_bias_learnable_slopes_get_gradients():
    slopes = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64, requires_grad=True)
    scores = torch.randn(B, H, Q, KV, dtype=torch.float64)
    out = _scores(alibi_bias(slopes), scores)
    q, kv = _grid()
    assert torch.allclose(out, scores + slopes.detach()[None, :, None, None] * (kv - q))
    out.sum().backward()
    assert torch.allclose(slopes.grad, torch.full((H,), float(B * (kv - q).sum()), dtype=torch.float64))


@pytest.mark.parametrize("cap", [1.0, 30, 0.25])
def test_tanh_softcap_matches_formula(cap):
    scores = 50 * torch.randn(B, H, Q, KV, dtype=torch.float64)
    out = _scores(tanh_softcap(cap), scores)
    assert torch.allclose(out, cap * torch.tanh(scores / cap))
    assert out.abs().max() <= cap


@pytest.mark.parametrize("cap", [0, -1.0, "30", True])
def test_tanh_softcap_validation(cap):
    with pytest.raises(ValueError, match="cap must be a positive number"):
        tanh_softcap(cap)


def test_relative_bias_per_head_table_with_clipping():
    max_len = 20  # shorter than Q/KV: distances beyond ±19 clip to the edge entries
    table = torch.randn(H, 2 * max_len - 1, dtype=torch.float64, requires_grad=True)
    scores = torch.randn(B, H, Q, KV, dtype=torch.float64)
    out = _scores(relative_bias(table), scores)
    expected = torch.empty_like(scores)
    for q in range(Q):
        for kv in range(KV):
            distance = min(max(kv - q, -(max_len - 1)), max_len - 1)
            expected[:, :, q, kv] = scores[:, :, q, kv] + table.detach()[:, distance + max_len - 1]
    assert torch.allclose(out, expected)
    out.sum().backward()
    q, kv = _grid()
    offsets = ((kv - q).clamp(-(max_len - 1), max_len - 1) + max_len - 1).flatten()
    counts = torch.bincount(offsets, minlength=2 * max_len - 1).to(torch.float64)
    assert torch.allclose(table.grad, B * counts.expand(H, -1))


def test_relative_bias_shared_table():
    table = torch.arange(2 * KV - 1, dtype=torch.float64)
    scores = torch.zeros(B, H, Q, KV, dtype=torch.float64)
    q, kv = _grid()
    assert torch.equal(_scores(relative_bias(table), scores), _expand((kv - q + KV - 1).to(torch.float64)))


def test_relative_bias_validation():
    with pytest.raises(ValueError, match="must be 2\\*S - 1 \\(odd\\)"):
        relative_bias(torch.zeros(4, 10))
    with pytest.raises(ValueError, match="table must be 1-D or 2-D"):
        relative_bias(torch.zeros(2, 2, 3))


# --------------------------------------------------------------------------------------
# Traceability and names
# --------------------------------------------------------------------------------------

MASK_MODS = {
    "causal_mask": causal_mask,
    "sliding_window_8_causal": sliding_window(8),
    "sliding_window_8": sliding_window(8, causal=False),
    "prefix_lm_5": prefix_lm(5),
    "prefix_lm_per_batch": prefix_lm(torch.tensor([3, 4])),
    "document_mask": document_mask(torch.arange(64) // 7),
    "document_mask_from_offsets": document_mask_from_offsets(torch.tensor([0, 9, 40]), 64),
}
SCORE_MODS = {
    "alibi_4_heads": alibi(4),
    "alibi_bias_4_heads": alibi_bias(torch.ones(4, requires_grad=True)),
    f"tanh_softcap_{30:g}": tanh_softcap(30),
    "relative_bias_32": relative_bias(torch.zeros(4, 63)),
}


@pytest.mark.parametrize("name", sorted(MASK_MODS))
def test_mask_mods_trace_with_fake_tensors(name):
    mask_mod = MASK_MODS[name]
    assert mask_mod.__name__ == name
    index = (torch.tensor(1), torch.tensor(2), torch.tensor(20), torch.tensor(13))
    graph = make_fx(mask_mod, tracing_mode="fake", _allow_non_fake_inputs=True)(*index)
    assert graph(*index).dtype == torch.bool
    assert torch.equal(graph(*index), mask_mod(*index))


@pytest.mark.parametrize("name", sorted(SCORE_MODS))
def test_score_mods_trace_with_fake_tensors(name):
    score_mod = SCORE_MODS[name]
    assert score_mod.__name__ == name
    args = (torch.tensor(0.7), torch.tensor(1), torch.tensor(2), torch.tensor(20), torch.tensor(13))
    graph = make_fx(score_mod, tracing_mode="fake", _allow_non_fake_inputs=True)(*args)
    assert math.isclose(float(graph(*args).detach()), float(score_mod(*args).detach()), rel_tol=1e-6)


def test_mods_compile_without_graph_breaks():
    mask_mod = MASK_MODS["document_mask"]
    score_mod = SCORE_MODS["relative_bias_32"]

    @torch.compile(fullgraph=True, backend="eager")
    def apply(score, b, h, q, kv):
        return torch.where(mask_mod(b, h, q, kv), score_mod(score, b, h, q, kv), -math.inf)

    args = (torch.tensor(1.5), torch.tensor(0), torch.tensor(1), torch.tensor(8), torch.tensor(9))
    assert float(apply(*args)) == 1.5
    assert float(apply(args[0], args[1], args[2], torch.tensor(6), torch.tensor(7))) == -math.inf

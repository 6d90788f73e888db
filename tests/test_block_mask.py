"""BlockMask, create_block_mask and mask helpers, checked against torch's flex_attention.

torch.nn.attention.flex_attention is used here only as the peer to compare with.
"""

from __future__ import annotations

import inspect

import re

import pytest
import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.attention import flex_attention as torch_flex

import flexattn
import flexattn.block_mask as bm
import flexattn.mask_evaluation as mask_evaluation
from flexattn.block_tables import lists_from_flags
from flexattn.block_mask import (
    BlockMask,
    and_masks,
    create_block_mask,
    create_mask,
    noop_mask,
    or_masks,
)
from flexattn.mods import causal_mask, document_mask, sliding_window
from tests._mask_cases import (
    MASK_CASES,
    TENSOR_FIELDS,
    assert_same_block_mask,
    reference_block_kinds,
)

CPU = "cpu"
SIZES = [(1, 1), (17, 17), (127, 127), (129, 129), (255, 255), (1000, 1000), (17, 1000), (1000, 129), (256, 384)]
SIZES_FOR_LAYOUTS = [(1, 1), (17, 17), (129, 129), (1000, 1000), (17, 1000), (1000, 129)]
BLOCK_SIZES = [128, (128, 64), (64, 128)]
BATCH_HEADS = [(None, None), (2, 3), (1, 3), (3, None)]


def _both(mask_mod, B, H, Q, KV, block_size=128):
    ours = create_block_mask(mask_mod, B, H, Q, KV, device=CPU, BLOCK_SIZE=block_size)
    theirs = torch_flex.create_block_mask(mask_mod, B, H, Q, KV, device=CPU, BLOCK_SIZE=block_size)
    return ours, theirs


def _block_kinds(mask: BlockMask) -> torch.Tensor:
    return mask._block_kinds().to(torch.int64)


# --------------------------------------------------------------------------------------
# create_block_mask == torch's create_block_mask
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("case", sorted(MASK_CASES))
def test_matches_torch_for_every_case_and_size(case, size):
    Q, KV = size
    mask_mod = MASK_CASES[case](2, 3, Q, KV)
    ours, theirs = _both(mask_mod, 2, 3, Q, KV)
    assert_same_block_mask(ours, theirs)
    assert ours.mask_mod is mask_mod


@pytest.mark.parametrize("batch_heads", BATCH_HEADS, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=str)
@pytest.mark.parametrize("size", SIZES_FOR_LAYOUTS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("case", ["causal", "document_per_batch", "head_dependent"])
def test_matches_torch_for_block_sizes_and_broadcast_dims(case, size, block_size, batch_heads):
    B, H = batch_heads
    Q, KV = size
    mask_mod = MASK_CASES[case](B, H, Q, KV)
    ours, theirs = _both(mask_mod, B, H, Q, KV, block_size)
    assert_same_block_mask(ours, theirs)
    assert ours.kv_num_blocks.shape[:2] == (B or 1, H or 1)


@pytest.mark.parametrize("case", sorted(MASK_CASES))
def test_block_kinds_match_brute_force(case):
    B, H, Q, KV = 2, 2, 300, 200
    mask_mod = MASK_CASES[case](B, H, Q, KV)
    dense = create_mask(mask_mod, B, H, Q, KV, device=CPU)
    for block_size in [(64, 32), (128, 128), (48, 12)]:
        mask = create_block_mask(mask_mod, B, H, Q, KV, device=CPU, BLOCK_SIZE=block_size)
        assert torch.equal(_block_kinds(mask), reference_block_kinds(dense, *block_size))


def test_long_causal_mask_has_closed_form_layout():
    Q = KV = 16384
    mask = create_block_mask(causal_mask, None, None, Q, KV, device=CPU)
    rows = torch.arange(Q // 128)
    assert torch.equal(mask.kv_num_blocks[0, 0], torch.ones_like(rows, dtype=torch.int32))
    assert torch.equal(mask.full_kv_num_blocks[0, 0], rows.to(torch.int32))
    assert torch.equal(mask.kv_indices[0, 0, :, 0], rows.to(torch.int32))


# --------------------------------------------------------------------------------------
# Chunked evaluation
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [1, 128 * 1000, 3 * 128 * 1000 + 5, 2 * 3 * 9 * 128 * 1000 - 1])
@pytest.mark.parametrize("case", ["causal_and_document", "head_dependent", "prefix_lm_per_batch"])
def test_chunked_equals_one_shot(monkeypatch, case, budget):
    """``budget`` is in mask elements; the byte budget is set to match it."""
    B, H, Q, KV = 2, 3, 1100, 1000
    mask_mod = MASK_CASES[case](B, H, Q, KV)
    one_shot = create_block_mask(mask_mod, B, H, Q, KV, device=CPU)
    calls = []
    original = mask_evaluation.evaluate_mod

    def counting(mod, b, h, q, kv, score=None):
        calls.append(b.numel() * h.numel() * q.numel() * kv.numel())
        return original(mod, b, h, q, kv, score)

    monkeypatch.setattr(bm, "MASK_CHUNK_BYTES", budget * bm.BYTES_PER_MASK_ELEMENT)
    monkeypatch.setattr(mask_evaluation, "evaluate_mod", counting)
    chunked = create_block_mask(mask_mod, B, H, Q, KV, device=CPU)
    assert_same_block_mask(chunked, one_shot)
    assert len(calls) > 1
    assert sum(calls) == B * H * Q * KV
    assert max(calls) <= max(budget, 128 * KV)


@pytest.mark.parametrize(
    "B, H, QB, budget_units, expected",
    [
        (2, 3, 9, 1, (1, 1, 1)),
        (2, 3, 9, 4, (1, 1, 4)),
        (2, 3, 9, 9, (1, 1, 9)),
        (2, 3, 9, 20, (1, 2, 9)),
        (2, 3, 9, 27, (1, 3, 9)),
        (2, 3, 9, 60, (2, 3, 9)),
        (2, 3, 9, 10**6, (2, 3, 9)),
    ],
)
def test_chunk_plan_fits_budget(B, H, QB, budget_units, expected):
    q_block, KV = 128, 1000
    plan = mask_evaluation.chunk_plan(B, H, QB, q_block, KV, budget_units * q_block * KV)
    assert plan == expected
    assert plan[0] * plan[1] * plan[2] <= budget_units


def test_compiled_chunks_equal_eager_without_graph_breaks(monkeypatch):
    from torch._dynamo.utils import counters

    monkeypatch.setattr(bm, "COMPILE_BACKEND", "aot_eager")
    monkeypatch.setattr(bm, "MASK_CHUNK_BYTES", 4 * 128 * 300 * bm.BYTES_PER_MASK_ELEMENT)
    counters.clear()
    for case in ["causal_and_document", "head_dependent"]:
        mask_mod = MASK_CASES[case](2, 1, 600, 300)
        compiled = create_block_mask(mask_mod, 2, 1, 600, 300, device=CPU, _compile=True)
        eager = create_block_mask(mask_mod, 2, 1, 600, 300, device=CPU)
        assert_same_block_mask(compiled, eager)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1


def test_non_bool_mask_mod_is_rejected():
    with pytest.raises(TypeError, match="must return a bool tensor, got torch.int64"):
        create_block_mask(lambda b, h, q, kv: q - kv, 1, 1, 64, 64, device=CPU)


def test_non_scalar_mask_mod_output_is_rejected():
    table = torch.ones(8, 8, dtype=torch.bool)
    with pytest.raises(ValueError, match="one 0-d tensor per"):
        create_block_mask(lambda b, h, q, kv: table[q], 1, 1, 8, 8, device=CPU)


# --------------------------------------------------------------------------------------
# Argument validation
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (dict(mask_mod=3), TypeError, "mask_mod must be a callable.*got int"),
        (dict(mask_mod=lambda b, h, q: q), TypeError, "mask_mod must take 4 positional.*takes 3"),
        (dict(mask_mod=lambda *a: a[0]), TypeError, r"takes a variable number \(\*args\)"),
        (dict(mask_mod=lambda s, b, h, q, kv: s), TypeError, "takes 5, i.e. it is a score_mod"),
        (dict(Q_LEN=-1), ValueError, "Q_LEN must be a non-negative int, got -1"),
        (dict(separate_full_blocks=1), TypeError, "separate_full_blocks must be bool, got int"),
        (dict(compute_dq_write_order=None), TypeError, "compute_dq_write_order must be bool, got NoneType"),
        (dict(dq_kv_order="yes"), TypeError, "dq_kv_order must be bool, got str"),
        (dict(KV_LEN=-3), ValueError, "KV_LEN must be a positive int, got -3"),
        (dict(KV_LEN=12.0), ValueError, "KV_LEN must be a positive int, got 12.0"),
        (dict(B=0), ValueError, "B must be a positive int or None, got 0"),
        (dict(H="2"), ValueError, "H must be a positive int or None, got '2'"),
        (dict(BLOCK_SIZE=0), ValueError, "BLOCK_SIZE must be a positive int or a .* got 0"),
        (dict(BLOCK_SIZE=(128,)), ValueError, r"BLOCK_SIZE .* got \(128,\)"),
        (dict(BLOCK_SIZE=(64, 0)), ValueError, r"BLOCK_SIZE .* got \(64, 0\)"),
        (dict(BLOCK_SIZE=True), ValueError, "BLOCK_SIZE .* got True"),
    ],
)
def test_create_block_mask_validation(kwargs, error, pattern):
    arguments = dict(mask_mod=causal_mask, B=1, H=1, Q_LEN=64, KV_LEN=64, device=CPU)
    arguments.update(kwargs)
    with pytest.raises(error, match=pattern):
        create_block_mask(**arguments)


def test_create_block_mask_takes_torch_213_keywords():
    """torch 2.13's keywords: separate_full_blocks=False lists every visited block as
    partial (no full lists, as torch's); the dQ write-order ones are accepted."""
    separated = create_block_mask(causal_mask, 2, 1, 300, 300, device=CPU)
    merged = create_block_mask(causal_mask, 2, 1, 300, 300, device=CPU, separate_full_blocks=False,
                               compute_dq_write_order=True, dq_kv_order=False)
    assert merged.full_kv_num_blocks is None and merged.full_q_num_blocks is None
    assert torch.equal(merged.to_dense(), separated.to_dense())
    assert merged.kv_num_blocks.tolist() == [[[1, 2, 3]]] * 2
    q = torch.randn(2, 2, 300, 16)
    torch.testing.assert_close(flexattn.flex_attention(q, q, q, block_mask=merged),
                               flexattn.flex_attention(q, q, q, block_mask=separated))
    if "separate_full_blocks" in inspect.signature(torch_flex.create_block_mask).parameters:  # torch >= 2.13
        reference = torch_flex.create_block_mask(causal_mask, 2, 1, 300, 300, device=CPU, separate_full_blocks=False)
        assert reference.full_kv_num_blocks is None
        assert torch.equal(merged.kv_num_blocks, reference.kv_num_blocks)


def test_from_kv_blocks_takes_and_checks_the_dq_order_keywords():
    mask = create_block_mask(causal_mask, 1, 1, 256, 256, device=CPU)
    order = torch.zeros(1, 1, 2, 2, dtype=torch.int32)
    built = BlockMask.from_kv_blocks(mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks,
                                     mask.full_kv_indices, dq_write_order=order, dq_write_order_full=order,
                                     dq_kv_order=True)
    assert torch.equal(built.to_dense(), mask.to_dense())
    with pytest.raises(TypeError, match="dq_write_order must be Tensor or None, got list"):
        BlockMask.from_kv_blocks(mask.kv_num_blocks, mask.kv_indices, dq_write_order=[0])
    with pytest.raises(TypeError, match="dq_kv_order must be Tensor or bool or None, got str"):
        BlockMask.from_kv_blocks(mask.kv_num_blocks, mask.kv_indices, dq_kv_order="x")


def test_an_empty_query_gives_an_empty_mask_and_empty_results():
    """Q_LEN=0, as torch allows: no query blocks; flex_attention returns empty results
    (eager and compiled) with gradients of the right shapes."""
    mask = create_block_mask(causal_mask, 1, 2, 0, 300, device=CPU)
    assert mask.shape == (1, 2, 0, 300) and mask.kv_num_blocks.shape == (1, 2, 0)
    assert mask.q_num_blocks.tolist() == [[[0, 0, 0]] * 2]
    q = torch.randn(1, 2, 0, 16, requires_grad=True)
    k = torch.randn(1, 2, 300, 16, requires_grad=True)
    for attend in (flexattn.flex_attention, torch.compile(flexattn.flex_attention)):
        out, aux = attend(q, k, k, block_mask=mask, return_aux=flexattn.AuxRequest(lse=True, max_scores=True))
        assert out.shape == (1, 2, 0, 16) and aux.lse.shape == aux.max_scores.shape == (1, 2, 0)
        grad_q, grad_k = torch.autograd.grad(out.sum(), (q, k))
        assert grad_q.shape == q.shape and torch.count_nonzero(grad_k) == 0


def test_default_device_is_accelerator_or_cpu():
    expected = torch.accelerator.current_accelerator() or torch.device("cpu")
    if not torch.accelerator.is_available() and expected.type != "cpu":
        # A torch built for an accelerator on a machine without one (a CUDA wheel on a CPU
        # host): the default is that accelerator all the same, as torch's, and unusable.
        with pytest.raises(RuntimeError):
            torch_flex.create_block_mask(causal_mask, 1, 1, 64, 64)
        with pytest.raises(RuntimeError):
            create_block_mask(causal_mask, 1, 1, 64, 64)
        return
    mask = create_block_mask(causal_mask, 1, 1, 64, 64)
    assert mask.kv_indices.device.type == torch.device(expected).type


# --------------------------------------------------------------------------------------
# create_mask, noop_mask, and_masks, or_masks
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["causal", "document_per_batch", "head_dependent", "all_false"])
def test_create_mask_matches_torch(case):
    mask_mod = MASK_CASES[case](2, 3, 70, 50)
    ours = create_mask(mask_mod, 2, 3, 70, 50, device=CPU)
    theirs = torch_flex.create_mask(mask_mod, 2, 3, 70, 50, device=CPU)
    assert ours.dtype == torch.bool and ours.shape == (2, 3, 70, 50)
    assert torch.equal(ours, theirs)


def test_create_mask_of_score_mod_marks_non_neg_inf_scores():
    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.where((q_idx + h) >= kv_idx, score + q_idx, -float("inf"))

    ours = create_mask(score_mod, None, 2, 9, 11, device=CPU)
    theirs = torch_flex.create_mask(score_mod, None, 2, 9, 11, device=CPU)
    assert ours.dtype == torch.bool
    assert torch.equal(ours, theirs)
    q, kv = torch.arange(9)[:, None], torch.arange(11)
    assert torch.equal(ours[0, 1], (q + 1) >= kv)


def test_noop_mask_is_traceable_true():
    index = torch.tensor(3)
    assert noop_mask(index, index, index, index).dtype == torch.bool
    assert noop_mask(index, index, index, index).shape == ()
    assert bool(noop_mask(index, index, index, index))
    graph = make_fx(noop_mask, tracing_mode="fake")(index, index, index, index)
    assert torch.equal(graph(index, index, index, index), torch.tensor(True))
    assert bool(create_mask(noop_mask, 2, 2, 5, 7, device=CPU).all())


def test_and_or_masks_combine_elementwise():
    window = sliding_window(3)
    even_kv = lambda b, h, q, kv: kv % 2 == 0  # noqa: E731
    causal = create_mask(causal_mask, 1, 1, 16, 16, device=CPU)
    windowed = create_mask(window, 1, 1, 16, 16, device=CPU)
    evens = create_mask(even_kv, 1, 1, 16, 16, device=CPU)
    assert torch.equal(create_mask(and_masks(causal_mask, even_kv), 1, 1, 16, 16, device=CPU), causal & evens)
    assert torch.equal(create_mask(or_masks(window, even_kv), 1, 1, 16, 16, device=CPU), windowed | evens)
    assert torch.equal(create_mask(and_masks(window), 1, 1, 16, 16, device=CPU), windowed)
    assert and_masks(causal_mask, window).__name__ == "and_masks(causal_mask, sliding_window_3_causal)"
    assert or_masks(causal_mask).__name__ == "or_masks(causal_mask)"


@pytest.mark.parametrize("combinator", [and_masks, or_masks])
def test_and_or_masks_validation(combinator):
    with pytest.raises(TypeError, match="needs at least one mask_mod"):
        combinator()
    with pytest.raises(TypeError, match="argument 1 must be a callable .* got int"):
        combinator(causal_mask, 5)


# --------------------------------------------------------------------------------------
# BlockMask methods
# --------------------------------------------------------------------------------------


def test_as_tuple_is_the_hop_contract():
    mask = create_block_mask(causal_mask, 2, 1, 300, 200, device=CPU, BLOCK_SIZE=(128, 64))
    values = mask.as_tuple()
    assert len(values) == 13
    assert values[:2] == (300, 200)
    for position, name in enumerate(TENSOR_FIELDS, start=2):
        assert values[position] is getattr(mask, name)
    assert values[10:] == (128, 64, causal_mask)
    nested = mask.as_tuple(flatten=False)
    assert nested[0] == (300, 200) and nested[-2] == (128, 64) and len(nested) == 11
    plain = BlockMask.from_kv_blocks(mask.kv_num_blocks, mask.kv_indices)
    assert plain.as_tuple()[-1] is noop_mask


@pytest.mark.parametrize("case", ["causal", "some_rows_empty", "head_dependent", "all_false"])
def test_to_dense_matches_torch(case):
    mask_mod = MASK_CASES[case](2, 2, 500, 700)
    ours, theirs = _both(mask_mod, 2, 2, 500, 700, (64, 128))
    dense = ours.to_dense()
    assert dense.dtype == torch.int32 and dense.shape == (2, 2, 8, 6)
    assert torch.equal(dense, theirs.to_dense())


def test_sparsity_counts_skipped_blocks():
    mask = create_block_mask(causal_mask, None, None, 1024, 1024, device=CPU)
    assert mask.sparsity() == pytest.approx(100 * (1 - 36 / 64))
    assert mask.sparsity() == pytest.approx(torch_flex.create_block_mask(causal_mask, None, None, 1024, 1024, device=CPU).sparsity())
    ragged = create_block_mask(causal_mask, 2, None, 1000, 300, device=CPU)
    computed = int(ragged.kv_num_blocks.sum() + ragged.full_kv_num_blocks.sum())
    assert ragged.sparsity() == pytest.approx(100 * (1 - computed / (2 * 8 * 3)))
    assert create_block_mask(MASK_CASES["all_false"](1, 1, 1, 1), 1, 1, 100, 100, device=CPU).sparsity() == 100.0
    assert create_block_mask(noop_mask, 1, 1, 1, 1, device=CPU).sparsity() == 0.0


def test_shape_and_numel():
    mask = create_block_mask(causal_mask, 2, 3, 1000, 129, device=CPU)
    assert mask.shape == (2, 3, 1000, 129)
    assert mask.numel() == 2 * 3 * 1000 * 129


def test_to_string_draws_full_partial_and_empty_blocks():
    mask = create_block_mask(causal_mask, None, None, 512, 512, device=CPU)
    lines = mask.to_string().splitlines()
    grid = [line for line in lines if line.startswith("|")]
    assert grid == ["|░░      |", "|██░░    |", "|████░░  |", "|██████░░|"]
    assert "[b=0, h=0]" in lines
    assert "█ full" in lines[0] and "░ partial" in lines[0]


def test_to_string_groups_blocks_and_limits_pictures():
    mask = create_block_mask(causal_mask, 2, 3, 2048, 2048, device=CPU, BLOCK_SIZE=32)
    text = mask.to_string(grid_size=(8, 16), limit=2)
    pictures = [line for line in text.splitlines() if line.startswith("[b=")]
    assert pictures == ["[b=0, h=0]", "[b=0, h=1]"]
    assert "4 more" in text
    rows = [line for line in text.splitlines() if line.startswith("|")]
    assert len(rows) == 2 * 8 and all(len(row) == 2 + 2 * 16 for row in rows)
    full_grid = mask[0, 0].to_string(grid_size=-1)
    assert sum(line.startswith("|") for line in full_grid.splitlines()) == 64
    assert "one cell = 8x4 blocks of 32x32" in text


def test_repr_and_str_tell_what_the_mask_holds():
    mask = create_block_mask(sliding_window(256), 2, 4, 1000, 1000, device=CPU, BLOCK_SIZE=(128, 64))
    text = repr(mask)
    for expected in [
        "shape=(2, 4, 1000, 1000)",
        "seq_lengths=(1000, 1000)",
        "BLOCK_SIZE=(128, 64)",
        "block_grid=8x16",
        f"sparsity={mask.sparsity():.2f}%",
        "mask_mod=sliding_window_256_causal",
        "device=cpu",
    ]:
        assert expected in text
    assert str(mask).startswith("BlockMask(shape=(2, 4, 1000, 1000)")


@pytest.mark.parametrize(
    "B, H, Q, KV, block_size",
    [(1, 1, 2048, 2048, 128), (2, 2, 1024, 512, (128, 64)), (None, 3, 2048, 1024, 32), (2, 1, 256, 4096, 128)],
    ids=["causal-16x16", "4-pictures", "grouped-cells", "wide"],
)
def test_str_is_torchs_text_character_for_character(B, H, Q, KV, block_size):
    """str() draws torch's picture (computed vs skipped blocks, no borders or legend), so
    expected strings written against torch's BlockMask hold; to_string keeps flexattn's.
    The lengths are block multiples: for others the two sparsity figures differ."""
    mask_mod = MASK_CASES["head_dependent"](B, H, Q, KV)
    ours, theirs = _both(mask_mod, B, H, Q, KV, block_size)
    assert str(ours) == str(theirs)
    assert ours.to_string().startswith("█ full  ░ partial")


def test_str_of_the_upstream_causal_example():
    text = str(create_block_mask(causal_mask, 1, 1, 2048, 2048, device=CPU))
    lines = text.splitlines()
    assert lines[0] == "BlockMask(shape=(1, 1, 2048, 2048), sparsity=46.88%, "
    assert lines[1] == "(0, 0)" and lines[-1] == ")"
    assert lines[2:-1] == ["█" * (2 * r) + " " * (32 - 2 * r) for r in range(1, 17)]


def test_str_lists_four_pictures_then_says_how_to_see_the_rest():
    mask_mod = MASK_CASES["head_dependent"](8, 1, 512, 512)
    ours, theirs = _both(mask_mod, 8, 1, 512, 512)
    head, _, rest = str(ours).partition("\n...\n")
    assert head == str(theirs).partition("\n...\n")[0]
    assert [line for line in head.splitlines() if line.startswith("(")] == [f"({b}, 0)" for b in range(4)]
    assert rest.startswith("4 more not shown") and rest.endswith("\n)")


@pytest.mark.parametrize(
    "index",
    [0, -1, (1, 2), (slice(0, 2), slice(1, 3)), (1, slice(None), slice(2, 5)), (0, 1, torch.tensor([0, 3]))],
    ids=["b0", "b-1", "b1h2", "slices", "q-slice", "q-tensor"],
)
def test_indexing_matches_torch(index):
    mask_mod = MASK_CASES["head_dependent"](2, 3, 700, 600)
    ours, theirs = _both(mask_mod, 2, 3, 700, 600)
    assert_same_block_mask(ours[index], theirs[index])
    assert ours[index].kv_num_blocks.dim() == 3


def test_indexing_errors_and_sliced_mask_mod():
    mask = create_block_mask(causal_mask, 2, 3, 300, 300, device=CPU)
    with pytest.raises(IndexError, match="out of range"):
        mask[2]
    with pytest.raises(IndexError, match="at most"):
        mask[0, 0, 0, 0]
    zero = torch.tensor(0)
    with pytest.raises(RuntimeError, match="obtained by indexing"):
        mask[0].mask_mod(zero, zero, zero, zero)


@pytest.mark.parametrize("case", ["causal", "sliding_window_64", "prefix_lm_70"])
@pytest.mark.parametrize("new_lengths", [(1000, 1000), (500, 700), (129, 17), (1, 1), (640, 256)])
def test_adjust_equals_building_at_the_new_lengths(case, new_lengths):
    mask_mod = MASK_CASES[case](2, 2, 1000, 1000)
    mask = create_block_mask(mask_mod, 2, 2, 1000, 1000, device=CPU, BLOCK_SIZE=(128, 64))
    adjusted = mask._adjust(*new_lengths)
    rebuilt = create_block_mask(mask_mod, 2, 2, *new_lengths, device=CPU, BLOCK_SIZE=(128, 64))
    # A full block that hangs over a new end stays full when cropped (as torch's _adjust
    # keeps it), where a rebuild counts its positions past the end as masked: the helper
    # allows that difference, in that direction only.
    assert_same_block_mask(rebuilt, adjusted, hanging_full_in_theirs=True)
    assert adjusted.mask_mod is mask_mod
    assert_same_block_mask(rebuilt, mask.adjust(*new_lengths), hanging_full_in_theirs=True)


def test_adjust_valid_blocks_match_torch_for_causal():
    ours, theirs = _both(causal_mask, 1, 2, 1024, 1024)
    assert_same_block_mask(ours._adjust(512, 512), theirs._adjust(512, 512))


def test_adjust_cannot_grow():
    mask = create_block_mask(causal_mask, 1, 1, 300, 300, device=CPU)
    with pytest.raises(ValueError, match="can only shrink"):
        mask._adjust(600, 300)
    assert mask._adjust(384, 384).seq_lengths == (384, 384)
    with pytest.raises(ValueError, match="new_q_len must be a positive int"):
        mask._adjust(0, 300)


def test_to_device_returns_a_moved_copy():
    mask = create_block_mask(causal_mask, 1, 2, 300, 300, device=CPU)
    moved = mask.to("meta")
    for name in TENSOR_FIELDS:
        assert getattr(moved, name).device.type == "meta"
        assert getattr(mask, name).device.type == "cpu"
    assert moved.seq_lengths == mask.seq_lengths and moved.mask_mod is causal_mask
    assert_same_block_mask(mask.to(CPU), mask)


@pytest.mark.parametrize("with_full", [True, False])
def test_from_kv_blocks_derives_torchs_transposed_view(with_full):
    mask_mod = MASK_CASES["document_per_batch"](2, 1, 900, 1000)
    theirs = torch_flex.create_block_mask(mask_mod, 2, 1, 900, 1000, device=CPU, BLOCK_SIZE=(64, 128))
    full = (theirs.full_kv_num_blocks, theirs.full_kv_indices) if with_full else (None, None)
    ours = BlockMask.from_kv_blocks(
        theirs.kv_num_blocks, theirs.kv_indices, *full, BLOCK_SIZE=(64, 128), seq_lengths=(900, 1000)
    )
    expected = torch_flex.BlockMask.from_kv_blocks(
        theirs.kv_num_blocks, theirs.kv_indices, *full, BLOCK_SIZE=(64, 128), seq_lengths=(900, 1000)
    )
    assert_same_block_mask(ours, expected)
    assert ours.mask_mod is noop_mask


def test_from_kv_blocks_defaults_and_validation():
    num = torch.tensor([[[1, 2]]], dtype=torch.int32)
    idx = torch.tensor([[[[1, 0, 2], [0, 2, 1]]]], dtype=torch.int32)
    mask = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=64)
    assert mask.seq_lengths == (128, 192) and mask.BLOCK_SIZE == (64, 64)
    assert mask.q_num_blocks.tolist() == [[[1, 1, 1]]]
    assert mask.q_indices.tolist() == [[[[1, 0], [0, 1], [1, 0]]]]
    with pytest.raises(ValueError, match="given together"):
        BlockMask.from_kv_blocks(num, idx, full_kv_num_blocks=num)
    with pytest.raises(ValueError, match="at least 2 dims"):
        BlockMask.from_kv_blocks(num[0, 0], idx[0, 0, 0])
    with pytest.raises(ValueError, match="BLOCK_SIZE"):
        BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=(64, -1))


@pytest.mark.parametrize("given, missing", [
    ("full_kv_num_blocks", "full_kv_indices"), ("full_kv_indices", "full_kv_num_blocks"),
    ("full_q_num_blocks", "full_q_indices"), ("full_q_indices", "full_q_num_blocks"),
])
def test_half_of_a_block_list_pair_is_a_value_and_an_assertion_error(given, missing):
    """torch's BlockMask raises AssertionError here, flexattn's argument errors are
    ValueErrors: the error is both, so code written against either catches it."""
    num = torch.tensor([[[1]]], dtype=torch.int32)
    idx = torch.tensor([[[[1, 0]]]], dtype=torch.int32)
    fields = dict(kv_num_blocks=num, kv_indices=idx, full_kv_num_blocks=None, full_kv_indices=None,
                  q_num_blocks=num, q_indices=idx, full_q_num_blocks=None, full_q_indices=None)
    fields[given] = num if given.endswith("num_blocks") else idx
    message = f"must be given together or both be None; got {given} without {missing}"
    for expected in (bm.BlockMaskArgumentError, ValueError, AssertionError):
        with pytest.raises(expected, match=message):
            BlockMask(seq_lengths=(1, 1), **fields, BLOCK_SIZE=(64, 64), mask_mod=noop_mask)
    if given.startswith("full_kv"):
        with pytest.raises(AssertionError, match=message):
            BlockMask.from_kv_blocks(num, idx, **{given: fields[given]})


def test_zero_width_index_rows_are_rejected():
    """The kernels read a row's first entry whatever its count: index rows need at least
    one entry. A mask without rows (no query blocks) may have zero-width ones."""
    num = torch.zeros(1, 1, 1, dtype=torch.int32)
    empty, one = torch.zeros(1, 1, 1, 0, dtype=torch.int32), torch.zeros(1, 1, 1, 1, dtype=torch.int32)
    expected = r"must hold at least one entry per row .* got shape \(1, 1, 1, 0\)"
    with pytest.raises(ValueError, match="kv_indices " + expected):
        BlockMask.from_kv_blocks(num, empty, BLOCK_SIZE=16, seq_lengths=(16, 16))
    with pytest.raises(ValueError, match="full_kv_indices " + expected):
        BlockMask.from_kv_blocks(num, one, num, empty, BLOCK_SIZE=16, seq_lengths=(16, 16))
    with pytest.raises(ValueError, match="kv_indices " + expected):
        BlockMask((16, 16), num, empty, None, None, None, None, None, None, BLOCK_SIZE=16)
    rowless = BlockMask.from_kv_blocks(num[..., :0], empty[..., :0, :], BLOCK_SIZE=16, seq_lengths=(0, 16))
    assert rowless.kv_indices.shape == (1, 1, 0, 0)
    # Tiny lengths still give one-entry rows.
    tiny = create_block_mask(causal_mask, 1, 1, 1, 1, device=CPU)
    assert tiny.kv_indices.shape[-1] == 1 and tiny._adjust(1, 1).kv_indices.shape[-1] == 1


def test_narrow_rows_without_seq_lengths_are_reported():
    """Without seq_lengths the KV length is the rows' width: a listed id beyond it (rows
    narrower than the KV blocks they refer to) raises on the CPU, naming seq_lengths,
    instead of being dropped or failing in a scatter; with seq_lengths it is a block."""
    num = torch.tensor([[[1, 2]]], dtype=torch.int32)
    idx = torch.tensor([[[[5, 0], [1, 2]]]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"kv_indices\[0, 0, 0, 0\] = 5 is not a KV block id in \[0, 2\).*"
                                         r"need seq_lengths"):
        BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=16)
    with pytest.raises(ValueError, match=r"full_kv_indices\[0, 0, 1, 1\] = 2 is not a KV block id"):
        BlockMask.from_kv_blocks(num * 0, idx, num, torch.tensor([[[[0, 5], [0, 2]]]], dtype=torch.int32),
                                 BLOCK_SIZE=16)
    mask = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=16, seq_lengths=(32, 96))
    assert mask.to_dense().tolist() == [[[[0, 0, 0, 0, 0, 1], [0, 1, 1, 0, 0, 0]]]]
    assert mask.q_num_blocks.tolist() == [[[0, 1, 1, 0, 0, 1]]]
    # Ids beyond the given seq_lengths are not checked (that would read the values),
    # and the block views drop them rather than fail.
    over = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=16, seq_lengths=(32, 64))
    assert over.to_dense().tolist() == [[[[0, 0, 0, 0], [0, 1, 1, 0]]]]


def _narrowed(mask: BlockMask, width: int, pad: int = 0, **kwargs) -> BlockMask:
    """The same mask with index rows cut to ``width`` entries (at least every row's
    count), padding ``pad`` in place of the entries past each count."""
    def cut(num, idx):
        if num is None:
            return None, None
        idx = idx[..., :width]
        return num, torch.where(torch.arange(width) < num[..., None], idx, pad).to(torch.int32)

    partial = cut(mask.kv_num_blocks, mask.kv_indices)
    full = cut(mask.full_kv_num_blocks, mask.full_kv_indices)
    return BlockMask.from_kv_blocks(*partial, *full, BLOCK_SIZE=mask.BLOCK_SIZE, mask_mod=mask.mask_mod,
                                    seq_lengths=mask.seq_lengths, **kwargs)


@pytest.mark.parametrize("pad", [0, 3])
def test_narrow_index_rows_describe_the_same_mask(pad):
    """Index rows only need their counted entries: a mask whose rows are cut to the
    longest count (padding repeating a block id) has the same block views, transposed
    lists, crops and slices as the full-width one."""
    mask = create_block_mask(sliding_window(200), 2, 1, 1000, 1000, device=CPU, BLOCK_SIZE=(64, 128))
    width = int(max(mask.kv_num_blocks.max(), mask.full_kv_num_blocks.max()))
    assert width < mask.kv_indices.shape[-1]
    narrow = _narrowed(mask, width, pad)
    assert narrow.kv_indices.shape[-1] == width and narrow.shape == mask.shape
    assert torch.equal(narrow.to_dense(), mask.to_dense())
    assert torch.equal(narrow._block_kinds(), mask._block_kinds())
    for name in ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(narrow, name), getattr(mask, name)), name
    assert narrow.sparsity() == mask.sparsity() and "block_grid=16x8" in repr(narrow)
    assert narrow.to_string() == mask.to_string()
    assert torch.equal(narrow[1].to_dense(), mask[1].to_dense())
    assert torch.equal(narrow._adjust(500, 700).to_dense(), mask._adjust(500, 700).to_dense())


@pytest.mark.parametrize("new_lengths", [(1000, 1000), (500, 700), (129, 300), (1, 1), (640, 256)])
@pytest.mark.parametrize("compute_q_blocks", [True, False])
def test_adjust_keeps_narrow_rows(new_lengths, compute_q_blocks):
    """_adjust of a mask with narrow index rows crops the rows in place: the same block
    kinds (full stays full, partial partial) and transposed lists as the full-width
    mask's crop, rows as wide as before (or the new KV blocks, where fewer), the listed
    blocks first in their order, padding 0."""
    mask = create_block_mask(sliding_window(200), 2, 1, 1000, 1000, device=CPU, BLOCK_SIZE=(64, 128))
    width = int(max(mask.kv_num_blocks.max(), mask.full_kv_num_blocks.max()))
    narrow = _narrowed(mask, width, pad=3, compute_q_blocks=compute_q_blocks)
    adjusted, expected = narrow._adjust(*new_lengths), mask._adjust(*new_lengths)
    cols = -(-new_lengths[1] // 128)
    assert adjusted.kv_indices.shape[-1] == adjusted.full_kv_indices.shape[-1] == min(width, cols)
    assert adjusted.seq_lengths == new_lengths and adjusted.mask_mod is mask.mask_mod
    assert torch.equal(adjusted.to_dense(), expected.to_dense())
    assert torch.equal(adjusted._block_kinds(), expected._block_kinds())
    for name in ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        if compute_q_blocks:
            assert torch.equal(getattr(adjusted, name), getattr(expected, name)), name
        else:
            assert getattr(adjusted, name) is None, name
    for num, idx in ((adjusted.kv_num_blocks, adjusted.kv_indices),
                     (adjusted.full_kv_num_blocks, adjusted.full_kv_indices)):
        padding = torch.arange(idx.shape[-1]) >= num[..., None]
        assert (idx[padding] == 0).all()


def test_from_kv_blocks_without_q_blocks():
    """compute_q_blocks=False (torch's argument) leaves the transposed lists out, and
    slices and crops of such a mask stay without them."""
    mask = create_block_mask(causal_mask, 1, 2, 300, 300, device=CPU, BLOCK_SIZE=64)
    bare = BlockMask.from_kv_blocks(mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks,
                                    mask.full_kv_indices, BLOCK_SIZE=64, seq_lengths=(300, 300),
                                    compute_q_blocks=False)
    for candidate in (bare, bare[:, 1], bare._adjust(200, 200)):
        assert all(getattr(candidate, name) is None
                   for name in ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"))
    assert torch.equal(bare.to_dense(), mask.to_dense())
    leaves, spec = pytree.tree_flatten(bare)
    assert pytree.tree_unflatten(leaves, spec).q_indices is None


# --------------------------------------------------------------------------------------
# pytree and torch.compile
# --------------------------------------------------------------------------------------


def test_pytree_round_trip_keeps_everything():
    mask = create_block_mask(causal_mask, 2, 1, 300, 200, device=CPU, BLOCK_SIZE=(128, 64))
    leaves, spec = pytree.tree_flatten(mask)
    assert len(leaves) == 8 and all(isinstance(leaf, torch.Tensor) for leaf in leaves)
    rebuilt = pytree.tree_unflatten(leaves, spec)
    assert isinstance(rebuilt, BlockMask) and rebuilt.mask_mod is causal_mask
    assert_same_block_mask(rebuilt, mask)
    partial_only = BlockMask.from_kv_blocks(mask.kv_num_blocks, mask.kv_indices)
    assert len(pytree.tree_leaves(partial_only)) == 4
    keyed, _ = pytree.tree_flatten_with_path(mask)
    assert pytree.keystr(keyed[0][0]) == ".kv_num_blocks"


def test_pytree_specs_of_recreated_closures_compare_equal():
    doc_ids = torch.arange(300) // 100

    def build(ids):
        return create_block_mask(document_mask(ids), 1, 1, 300, 300, device=CPU)

    _, spec_a = pytree.tree_flatten(build(doc_ids))
    _, spec_b = pytree.tree_flatten(build(doc_ids))
    _, spec_c = pytree.tree_flatten(build(doc_ids.clone()))
    _, spec_d = pytree.tree_flatten(create_block_mask(causal_mask, 1, 1, 300, 300, device=CPU))
    assert spec_a == spec_b
    assert spec_a != spec_c
    assert spec_a != spec_d


def test_block_mask_is_a_fullgraph_compile_argument():
    mask = create_block_mask(causal_mask, 2, 1, 300, 300, device=CPU)

    @torch.compile(fullgraph=True, backend="eager")
    def use(x, block_mask):
        q_len, kv_len, kv_num, *_rest, q_block, kv_block, mask_mod = block_mask.as_tuple()
        index = torch.tensor(7)
        allowed = mask_mod(index, index, index, index - 1)
        return x * q_len + kv_num.sum() + allowed.int() + block_mask.full_q_indices.sum()

    x = torch.ones(3)
    expected = 300 + mask.kv_num_blocks.sum() + 1 + mask.full_q_indices.sum()
    assert torch.equal(use(x, mask), x * expected)


def test_block_mask_built_inside_compiled_function():
    @torch.compile(fullgraph=True, backend="eager")
    def build(num, idx):
        return BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=64)

    num = torch.tensor([[[1, 2]]], dtype=torch.int32)
    idx = torch.tensor([[[[1, 0, 2], [0, 2, 1]]]], dtype=torch.int32)
    compiled = build(num, idx)
    assert isinstance(compiled, BlockMask)
    assert_same_block_mask(compiled, BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=64))


def test_block_mask_is_an_export_input():
    mask = create_block_mask(causal_mask, 1, 1, 256, 256, device=CPU)

    class CountBlocks(torch.nn.Module):
        def forward(self, x, block_mask):
            return x + block_mask.kv_num_blocks.sum() + block_mask.full_kv_num_blocks.sum()

    program = torch.export.export(CountBlocks(), (torch.zeros(2), mask))
    inputs = program.graph_signature.user_inputs
    assert any(re.search("kv_num_blocks", name) for name in inputs)
    assert torch.equal(program.module()(torch.zeros(2), mask), torch.full((2,), 3.0))



@pytest.mark.parametrize("case", ["causal_and_document", "document_per_batch", "head_dependent"])
def test_same_layout_on_the_test_device(device, case):
    on_cpu = create_block_mask(MASK_CASES[case](2, 3, 1000, 600), 2, 3, 1000, 600, device=CPU)
    mask_mod = MASK_CASES[case](2, 3, 1000, 600, device=device)
    on_device = create_block_mask(mask_mod, 2, 3, 1000, 600, device=device)
    assert on_device.kv_indices.device.type == torch.device(device).type
    assert_same_block_mask(on_device, on_cpu)


@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (1, 1, 1, 1), (4, 2, 33, 1), (2, 1, 8, 64), (1, 1, 0, 4), (3, 0, 1)])
def test_lists_from_flags_is_a_stable_sort_of_the_flags(shape):
    """The sort-free block lists equal a stable descending sort of the 0/1 flags: set
    blocks first, ascending, then the unset ones, ascending."""
    dense = torch.rand(shape, generator=torch.Generator().manual_seed(len(shape) + shape[-1])) < 0.4
    num, indices = lists_from_flags(dense)
    expected = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    assert torch.equal(indices, expected) and torch.equal(num, dense.sum(-1, dtype=torch.int32))
    assert num.dtype == indices.dtype == torch.int32


def test_create_block_mask_traced_by_torch_compile(device):
    """create_block_mask called inside a compiled function (as model code does) gives the
    eager mask, for lengths that are and are not whole words of 8 positions."""
    for length in (256, 300):
        torch._dynamo.reset()
        eager = create_block_mask(causal_mask, 2, 1, length, length, device=device)
        traced = torch.compile(create_block_mask)(causal_mask, 2, 1, length, length, device=device)
        for name in BlockMask._TENSOR_FIELDS:
            torch.testing.assert_close(getattr(traced, name), getattr(eager, name), msg=name)


@pytest.mark.parametrize("case", ["causal", "document_per_batch", "head_dependent", "some_rows_empty", "all_false"])
@pytest.mark.parametrize("size", [(1, 1), (5, 300), (129, 129), (1000, 129), (300, 700)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("block_size", [(128, 128), (64, 128), (128, 32)], ids=str)
def test_whole_grid_flags_of_a_trace_equal_the_chunked_ones(case, size, block_size):
    """The branch-free evaluation create_block_mask uses under torch.compile (padded to
    whole tiles, padding clamped to the last index and left out) gives the chunked
    eager flags, hanging edge tiles included. It is plain torch, so it runs eagerly."""
    Q, KV = size
    mask_mod = MASK_CASES[case](2, 3, Q, KV)
    traced = mask_evaluation.traced_block_flags(mask_mod, 2, 3, Q, KV, torch.device(CPU), *block_size)
    chunked = mask_evaluation.chunked_block_flags(mask_mod, 2, 3, Q, KV, torch.device(CPU), *block_size,
                                                  chunk_elements=bm.MASK_CHUNK_BYTES // bm.BYTES_PER_MASK_ELEMENT)
    assert torch.equal(traced[0], chunked[0]) and torch.equal(traced[1], chunked[1])


def test_a_trace_evaluates_a_short_query_length_only_at_its_rows():
    """A static query length under the tile (a decoding step) is evaluated at its own rows,
    not padded to the tile's 128: the mask_mod sees one query row for a one-query step."""
    rows = []

    def recording(b, h, q_idx, kv_idx):
        rows.append(q_idx.numel())
        return kv_idx <= q_idx + 40

    any_blocks, all_blocks = mask_evaluation.traced_block_flags(recording, 2, 3, 1, 300, torch.device(CPU), 128, 128)
    assert rows == [1]
    assert any_blocks.tolist() == [[[[True, False, False]]] * 3] * 2
    assert not all_blocks.any()


def test_create_block_mask_takes_symbolic_lengths_in_a_fullgraph_trace():
    """Lengths taken from tensor sizes are SymInts under dynamic=True: no signature
    check (Dynamo cannot trace inspect.signature), no int() that would specialize them,
    no branch on them; the mask equals the eager one for tile and non-tile lengths."""
    from torch._dynamo.testing import CompileCounter

    def build(q, k):
        frame = 32
        q_len, kv_len = q.size(-2), k.size(-2)

        def limited(b, h, q_idx, kv_idx):
            return (q_idx < (q_len // frame + kv_len // frame) * frame) & (kv_idx <= q_idx)

        return create_block_mask(limited, B=q.size(0), H=q.size(1), Q_LEN=q_len, KV_LEN=kv_len, device=CPU)

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(build, fullgraph=True, dynamic=True, backend=counter)
    for q_len, kv_len in [(192, 128), (160, 96), (300, 1000), (1000, 600), (129, 257)]:
        q, k = torch.empty(1, 2, q_len, 8), torch.empty(1, 2, kv_len, 8)
        traced = compiled(q, k)
        assert traced.seq_lengths == (q_len, kv_len)
        assert_same_block_mask(traced, build(q, k))
    # PyTorch's layout rules treat dims of size 1 apart, so going from one KV block to
    # several recompiles once; nothing else does.
    assert counter.frame_count == 2


def test_create_block_mask_with_symbolic_batch_compiles_once():
    """dynamic=True makes B symbolic; a mask_mod indexing a captured (B, Q) table by b
    and q_idx traces once for every batch size (upstream test_free_symbol_dynamic)."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    for batch in [4, 16, 32]:
        table = torch.rand(batch, 256, generator=torch.Generator().manual_seed(batch)) < 0.5

        def drop_rows(b, h, q_idx, kv_idx):
            return ~table[b, q_idx]

        build = torch.compile(create_block_mask, dynamic=True, backend=counter)
        traced = build(B=batch, BLOCK_SIZE=128, mask_mod=drop_rows, H=None, Q_LEN=256, KV_LEN=256, device=CPU)
        assert_same_block_mask(traced, create_block_mask(drop_rows, batch, None, 256, 256, device=CPU))
    assert counter.frame_count == 1


def test_compiled_create_block_mask_recompiles_once_then_serves_every_size():
    """torch.compile(create_block_mask) compiles for the first sizes, once more with
    dynamic sizes, then no more (upstream test_compiling_create_block_mask_no_recompile):
    nothing in the trace branches on B, H or the lengths, and seq_lengths stay SymInts."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    for args in [(2, 4, 256, 256), (4, 8, 512, 384), (6, 16, 768, 640), (3, 5, 300, 200)]:
        traced = torch.compile(create_block_mask, backend=counter)(causal_mask, *args, device=CPU)
        assert_same_block_mask(traced, create_block_mask(causal_mask, *args, device=CPU))
        assert traced.seq_lengths == args[2:] and all(type(n) is int for n in traced.seq_lengths)
    assert counter.frame_count == 2


def test_create_mask_and_create_block_mask_tell_mods_apart_under_torch_compile():
    """Traced, the arity comes from the function's code object (Dynamo cannot trace
    inspect.signature): create_mask still tells a score_mod from a mask_mod, and
    create_block_mask still rejects a score_mod."""

    def bias_or_mask(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx >= kv_idx, score + 1, -float("inf"))

    torch._dynamo.reset()
    for mod in (causal_mask, bias_or_mask):
        traced = torch.compile(create_mask, fullgraph=True, backend="eager")(mod, 2, 1, 100, 70, device=CPU)
        assert torch.equal(traced, create_mask(mod, 2, 1, 100, 70, device=CPU))
    with pytest.raises(TypeError, match="bias_or_mask takes 5, i.e. it is a score_mod"):
        torch.compile(create_block_mask, backend="eager")(bias_or_mask, 2, 1, 100, 70, device=CPU)


@pytest.mark.parametrize("entry", [slice(None), slice(2, 5), slice(4, None), slice(5, 6), slice(None, None, 2),
                                   slice(1, None, 2), slice(3, 3), slice(2, 9)])
@pytest.mark.parametrize("num_blocks", [6, 8])
def test_kept_query_length_counts_the_kept_rows(entry, num_blocks):
    """The query length of a query-block slice (torch 2.14 on) is the number of query
    positions below the mask's length in the kept blocks; blocks past the end count none."""
    block, length = 128, 700
    positions = torch.arange(num_blocks * block).view(num_blocks, block)[entry]
    kept = bm._kept_query_length(entry, positions.shape[0], block, length, num_blocks)
    assert kept == int((positions < length).sum())


def test_kept_query_length_of_an_index_tensor_is_whole_blocks():
    """An index tensor's values are not read (no device sync): its rows count as whole
    blocks, the last block's included."""
    assert bm._kept_query_length(torch.tensor([0, 5]), 2, 128, 700, 6) == 2 * 128


# --------------------------------------------------------------------------------------
# partial_heavy: what the forward kernel's choice reads off the listing
# --------------------------------------------------------------------------------------
def test_partial_heavy_is_known_for_masks_that_read_captured_tensors():
    """create_block_mask records whether nearly all listed blocks are partial for a mask_mod
    that reads captured tensors (in its closure, in a global it names, or through a
    combined mask); arithmetic masks leave it unknown (no device sync for them). It
    survives the copies a call makes (to, adjust, the per-call tiling, the pytree round
    trip); a CPU call does not hand it to the operator (it picks no kernel there, and a
    listing that changes between masks would recompile for nothing)."""
    S, W = 256, 16
    cells = torch.randperm(S, generator=torch.Generator().manual_seed(0)).to(CPU)
    doc = (torch.arange(S, device=CPU) // 96)

    def scattered(b, h, q_idx, kv_idx):  # every block partial
        return (cells[q_idx] - cells[kv_idx]).abs() <= W

    def documents(b, h, q_idx, kv_idx):  # mostly full blocks at BLOCK_SIZE 16
        return doc[q_idx] == doc[kv_idx]

    heavy = create_block_mask(scattered, None, None, S, S, device=CPU, BLOCK_SIZE=16)
    light = create_block_mask(documents, None, None, S, S, device=CPU, BLOCK_SIZE=16)
    combined = create_block_mask(bm.and_masks(causal_mask, scattered), None, None, S, S, device=CPU, BLOCK_SIZE=16)
    assert heavy.partial_heavy is True and light.partial_heavy is False and combined.partial_heavy is True
    # Causal documents of 100 tokens list 36 partial blocks against 28 full (56%): below the share.
    docs_100 = torch.arange(S, device=CPU) // 100
    middling = create_block_mask(bm.and_masks(causal_mask, lambda b, h, q_idx, kv_idx: docs_100[q_idx] == docs_100[kv_idx]),
                                 None, None, S, S, device=CPU, BLOCK_SIZE=16)
    assert (middling.kv_num_blocks.sum().item(), middling.full_kv_num_blocks.sum().item()) == (36, 28)
    assert middling.partial_heavy is False
    assert create_block_mask(causal_mask, None, None, S, S, device=CPU).partial_heavy is None
    assert heavy.to(CPU).partial_heavy and heavy.adjust(128, 128).partial_heavy
    leaves, spec = pytree.tree_flatten(heavy)
    assert pytree.tree_unflatten(leaves, spec).partial_heavy is True
    per_batch = create_block_mask(scattered, 2, None, S, S, device=CPU, BLOCK_SIZE=16)
    assert bm.tile_for_call(per_batch, 4, 3).partial_heavy is True

    seen = {}
    real_run = flexattn.api._run_eagerly

    def spy(*args):
        seen["options"] = args[6]
        return real_run(*args)

    q = torch.randn(1, 1, S, 16, device=CPU)
    try:
        flexattn.api._run_eagerly = spy
        flexattn.flex_attention(q, q, q, block_mask=heavy)
    finally:
        flexattn.api._run_eagerly = real_run
    assert flexattn.options.read_internal(seen["options"], "MASK_PARTIAL_HEAVY") is None


def test_partial_heavy_is_unknown_when_built_under_compile():
    cells = torch.arange(64, device=CPU).flip(0)

    def scattered(b, h, q_idx, kv_idx):
        return (cells[q_idx] - cells[kv_idx]).abs() <= 4

    built = torch.compile(lambda: create_block_mask(scattered, None, None, 64, 64, device=CPU, BLOCK_SIZE=16),
                          backend="eager", fullgraph=True)()
    assert built.partial_heavy is None


def test_partial_heavy_is_unknown_for_fake_and_meta_masks():
    """Building under FakeTensorMode or on the meta device (shape tracing, export) never
    reads the block counts: partial_heavy stays unknown and nothing raises."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    lengths = torch.tensor([40, 64])

    def within(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]

    on_meta = lengths.to("meta")

    def within_on_meta(b, h, q_idx, kv_idx):
        return kv_idx < on_meta[b]

    assert create_block_mask(within_on_meta, 2, None, 64, 64, device="meta", BLOCK_SIZE=16).partial_heavy is None
    with FakeTensorMode(allow_non_fake_inputs=True):
        assert create_block_mask(within, 2, None, 64, 64, device=CPU, BLOCK_SIZE=16).partial_heavy is None

"""The dense reference of flexattn's attention: the test oracle, the definition of
correct every kernel is tested against (``dense_math``).

It builds the full (B, H, L, S) score matrix, so it is a reference, not a fast path:
mods run under ``torch.vmap`` over every (b, h, q_idx, kv_idx) (``apply_score_mod``,
``apply_mask_mod``), and a BlockMask is turned into the entries it lets through exactly
as the kernels read it (``block_mask_visibility``). The numerics it shares with the
kernels (statistics dtype, dropout's keep mask, sink rows, vmapped indexing) live in
``numerics.py``; no kernel lowering imports this module.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from torch import Tensor

from ._mask_tuple import BlockMaskView
from .block_tables import flags_from_lists, kv_columns
from .numerics import Dropout, IndexWithTensors, dropout_scale, sink_rows, stats_dtype, vmap_over_bhmn


# --------------------------------------------------------------------------------------
# Running mods elementwise
# --------------------------------------------------------------------------------------
def _index_grid(B: int, H: int, L: int, S: int, device: torch.device) -> list[Tensor]:
    return [torch.arange(n, dtype=torch.int32, device=device) for n in (B, H, L, S)]


def apply_score_mod(score_mod: Callable, scores: Tensor, buffers: Sequence) -> Tensor:
    """score_mod applied to every entry of a (B, H, L, S) score tensor."""
    B, H, L, S = scores.shape
    fn = vmap_over_bhmn(score_mod, True, len(buffers))
    with IndexWithTensors():
        return fn(scores, *_index_grid(B, H, L, S, scores.device), *buffers)


def apply_mask_mod(mask_mod: Callable, B: int, H: int, L: int, S: int, device, buffers: Sequence) -> Tensor:
    """mask_mod evaluated on every (b, h, q_idx, kv_idx): a bool (B, H, L, S) tensor."""
    fn = vmap_over_bhmn(mask_mod, False, len(buffers))
    with IndexWithTensors():
        out = fn(*_index_grid(B, H, L, S, device), *buffers)
    return out.to(torch.bool).expand(B, H, L, S)


# --------------------------------------------------------------------------------------
# The dense reference
# --------------------------------------------------------------------------------------
def block_mask_visibility(block_mask: tuple, B: int, H: int, L: int, S: int, device, mask_mod_buffers: Sequence) -> Tensor:
    """Which (b, h, q, kv) entries the block mask lets through, as a bool (B, H, L, S).

    This is the kernels' semantics, block for block: a KV block listed as partial for
    a query block applies mask_mod, a block listed as full lets every entry through, and
    an unlisted block masks every entry.
    """
    bm = BlockMaskView(*block_mask)
    kv_num, kv_idx, full_num, full_idx = bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices
    q_block, kv_block = bm.block_sizes
    mask_mod = bm.mask_mod

    def listed_flags(num: Tensor, idx: Tensor) -> Tensor:
        return flags_from_lists(num, idx, kv_columns(idx, S, kv_block))

    def to_entries(grid: Tensor) -> Tensor:
        grid = grid.repeat_interleave(q_block, dim=-2).repeat_interleave(kv_block, dim=-1)
        grid = _fit_last_two(grid, L, S)
        return grid.expand(B, H, L, S)

    partial = to_entries(listed_flags(kv_num, kv_idx).to(device))
    allowed = partial & apply_mask_mod(mask_mod, B, H, L, S, device, mask_mod_buffers)
    if full_num is not None:
        allowed = allowed | to_entries(listed_flags(full_num, full_idx).to(device))
    return allowed


def _fit_last_two(grid: Tensor, L: int, S: int) -> Tensor:
    """Crop or zero-pad the last two dims of an entry grid to (L, S)."""
    grid = grid[..., :L, :S]
    pad_l, pad_s = L - grid.shape[-2], S - grid.shape[-1]
    if pad_l or pad_s:
        grid = torch.nn.functional.pad(grid, (0, pad_s, 0, pad_l), value=False)
    return grid


def _expand_kv(t: Tensor, B: int, Hq: int) -> Tensor:
    """(Bkv, Hkv, S, D) -> (B, Hq, S, D): broadcast the KV batch, repeat each KV head
    over the query heads of its group."""
    group = Hq // t.shape[1]
    return t.repeat_interleave(group, dim=1).expand(B, Hq, *t.shape[2:])


def dense_math(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    score_mod: Callable,
    block_mask: tuple,
    scale: float,
    score_mod_buffers: Sequence,
    mask_mod_buffers: Sequence,
    sinks: Tensor | None = None,
    dropout: Dropout | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Attention computed the plain way, differentiable by autograd.

    Products are taken in the inputs' dtype and the softmax in float32 (float64 for
    float64 inputs), with the probabilities cast back before the product with V: the
    same roundings a fused kernel makes, so that a same-dtype run of this function is a
    fair yardstick for a kernel's error.

    ``sinks``: per-head logits, shape (Hq,) or (B, Hq), each joining its rows' softmax
    as one more key whose value is zero (never masked, untouched by score_mod). The
    lse includes it; max_scores is the max over the real keys.

    ``dropout``: the probabilities are multiplied by ``numerics.dropout_keep``'s mask and
    ``dropout_scale(p)`` before the product with V; lse and max_scores are those of the
    probabilities before dropout.
    """
    B, Hq = query.shape[:2]
    v = _expand_kv(value.to(query.dtype), B, Hq)  # float8 keys and values are widened, as the kernels do
    scores, allowed = _masked_scores(query, key, score_mod, block_mask, scale, score_mod_buffers, mask_mod_buffers)
    return softmax_times_values(scores, allowed.any(dim=-1), v, sinks, dropout)


def _masked_scores(query, key, score_mod, block_mask, scale, score_mod_buffers, mask_mod_buffers):
    """(scores, allowed): the modified scores (B, Hq, L, S) in the softmax's dtype, -inf
    where the block mask hides them, and the bool visibility."""
    B, Hq, L, _ = query.shape
    S = key.shape[-2]
    work = stats_dtype(query.dtype)
    k = _expand_kv(key.to(query.dtype), B, Hq)
    scores = (query @ k.transpose(-2, -1)).to(work) * scale
    scores = apply_score_mod(score_mod, scores, score_mod_buffers).to(work)
    allowed = block_mask_visibility(block_mask, B, Hq, L, S, query.device, mask_mod_buffers)
    return scores.masked_fill(~allowed, -math.inf), allowed


def attention_probabilities(query, key, score_mod, block_mask, scale, score_mod_buffers, mask_mod_buffers,
                            sinks: Tensor | None = None, dropout: Dropout | None = None) -> Tensor:
    """The probabilities (B, Hq, L, S) as ``dense_math`` applies them (in the softmax's
    dtype, 0 where masked and on rows without a visible key), with dropout the kept ones
    times ``dropout_scale`` and the dropped ones negated (sign bit set, also on zeros):
    ``AuxRequest(probabilities=True)``."""
    scores, allowed = _masked_scores(query, key, score_mod, block_mask, scale, score_mod_buffers, mask_mod_buffers)
    probs, _, _, live = _softmax(scores, allowed.any(dim=-1), sinks)
    probs = torch.where(live[..., None], probs, torch.zeros_like(probs))
    if dropout is None:
        return probs
    scaled = probs * dropout_scale(dropout.p)
    return torch.where(dropout.keep_mask(*probs.shape), scaled, -scaled)


def softmax_times_values(scores: Tensor, has_keys: Tensor, v: Tensor, sinks: Tensor | None,
                         dropout: Dropout | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(out, lse, max_scores) from masked scores (B, Hq, L, S) (-inf where masked) in
    the softmax's dtype: the probabilities (``applied_probabilities``) rounded to ``v``'s
    dtype before the product, rows without a key (``has_keys`` False, or every score
    -inf) giving out 0 and lse -inf, unless a sink (``dense_math``) gives them lse = sink."""
    probs, lse, max_scores, live = _softmax(scores, has_keys, sinks)
    out = applied_probabilities(probs, dropout).to(v.dtype) @ v
    out = torch.where(live[..., None], out, torch.zeros_like(out))
    return out, lse, max_scores


def applied_probabilities(probs: Tensor, dropout: Dropout | None) -> Tensor:
    """The probabilities as they multiply V: with dropout, the kept ones times
    ``dropout_scale`` and the dropped ones 0."""
    if dropout is None:
        return probs
    keep = dropout.keep_mask(*probs.shape)
    return torch.where(keep, probs * dropout_scale(dropout.p), torch.zeros_like(probs))


def _softmax(scores: Tensor, has_keys: Tensor, sinks: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(probs, lse, max_scores, live) of masked scores, a sink joining each row."""
    B, Hq, L, S = scores.shape
    row_max = scores.amax(dim=-1)
    live = has_keys & (row_max > -math.inf)
    max_scores = torch.where(live, row_max, torch.full_like(row_max, -math.inf))
    if sinks is not None:
        sink = sink_rows(sinks, Hq, scores.dtype).expand(B, Hq, L)
        scores = torch.cat([scores, sink[..., None]], dim=-1)
        row_max = torch.maximum(row_max, sink)
        live = torch.ones_like(live)
    safe_max = torch.where(live, row_max, torch.zeros_like(row_max)).detach()
    p = torch.exp(scores - safe_max[..., None])
    denom = p.sum(dim=-1)
    safe_denom = torch.where(live, denom, torch.ones_like(denom))
    lse = torch.where(live, torch.log(safe_denom) + safe_max, torch.full_like(denom, -math.inf))
    probs = (p / safe_denom[..., None])[..., :S]
    return probs, lse, max_scores, live

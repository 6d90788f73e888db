"""A decoding or chunked-prefill step over a KV cache: append, rotary, attention in one call.

``flex_attention_with_kvcache`` is flexattn's counterpart of FlashAttention's
``flash_attn_with_kvcache``: it rotates the queries and the new keys (rotary embeddings
at each sequence's positions), writes the new keys and values into the cache at each
sequence's length, and attends over the updated cache, with flex_attention's mods.

The cache is a contiguous (B_cache, Hkv, S_max, D) tensor pair, or the pools of a
``PagedKVCache`` (``page_cache`` and ``slots``: the append and the attention go through
its pages). In a contiguous cache ``cache_batch_idx`` picks each sequence's row. Without
it the cache's rows are the batch's and attention reads the cache as it is. With it, the
cache is read in place through a strided view
with one row after another (a pool, as ``PagedKVCache``'s "pages" layout, one page per
row), and the block mask lists each sequence's blocks in its row: no row is copied.

On a GPU the rotary, the cache write and the block lists of the lengths are one prologue
kernel (``kvcache_prologue``) launched before the attention kernel; elsewhere they are
torch ops. Under ``torch.compile`` the step is one graph: the mutation of the cache is
functionalised and the lengths are tensors, so the step compiles once however long the
sequences grow.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor

from .api import AuxRequest, flex_attention
from .block_mask import BlockMask, and_masks, create_block_mask
from .kvcache_prologue import apply_rotary, kv_step_prologue
from .paged import PagedKVCache

__all__ = ["apply_rotary", "flex_attention_with_kvcache"]

#: KV block of the cache's block mask; a smaller power of two where a pool's rows do not
#: start at multiples of it.
KV_BLOCK = 128
MIN_KV_BLOCK = 16


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _check_arguments(query, k_cache, v_cache, key, value, cache_seqlens, rotary_cos, rotary_sin,
                     cache_batch_idx, enable_gqa, page_cache, slots) -> None:
    """Every check, before anything is written."""
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, Tensor):
            raise TypeError(f"flexattn: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"flexattn: {name} must be 4-D, got shape {_shape(t)}")
    B, Hq, L, E = query.shape
    Bc, Hkv, S_max, Ek = k_cache.shape
    if page_cache is not None:
        if not isinstance(page_cache, PagedKVCache):
            raise TypeError(f"flexattn: page_cache must be a flexattn.PagedKVCache, got {type(page_cache).__name__}")
        if cache_batch_idx is not None:
            raise ValueError("flexattn: with page_cache the sequences are named by slots, not cache_batch_idx")
        if not isinstance(slots, Tensor) or _shape(slots) != (B,):
            got = f"shape {_shape(slots)}" if isinstance(slots, Tensor) else type(slots).__name__
            raise ValueError(f"flexattn: with page_cache, slots must be a ({B},) integer tensor, got {got}")
        if Bc != 1 or S_max != page_cache.pool_length:
            raise ValueError(f"flexattn: with page_cache, k_cache and v_cache are its pools (1, Hkv, "
                             f"{page_cache.pool_length}, D), got k_cache shape {_shape(k_cache)}")
        page_cache._check_pool(k_cache, v_cache)
        page_cache._as_slots(slots, True)  # range and repeats: checked eagerly only
        Bc, S_max = B, page_cache.max_length
    elif slots is not None:
        raise ValueError("flexattn: slots name the sequences of a page_cache; pass page_cache too")
    if Ek != E:
        raise ValueError(f"flexattn: k_cache's head dim must equal query's ({E}), got k_cache shape {_shape(k_cache)}")
    if page_cache is None and _shape(v_cache)[:3] != (Bc, Hkv, S_max):
        raise ValueError(f"flexattn: v_cache must have k_cache's batch, heads and length {(Bc, Hkv, S_max)}, "
                         f"got shape {_shape(v_cache)}")
    if Hq != Hkv and not (enable_gqa and Hq % Hkv == 0):
        raise ValueError(f"flexattn: query has {Hq} heads and the cache {Hkv}: pass enable_gqa=True with a "
                         f"multiple of the cache's heads")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("key", key), ("value", value)):
        if t is None:
            continue
        if t.device != query.device:
            raise ValueError(f"flexattn: {name} must be on query's device ({query.device}), got {t.device}")
        if t.dtype != query.dtype:
            raise ValueError(f"flexattn: {name} must have query's dtype ({query.dtype}), got {t.dtype}")
    if (key is None) != (value is None):
        raise ValueError("flexattn: key and value go together: pass both new keys and values, or neither")
    L_new = 0
    if key is not None:
        if key.dim() != 4 or _shape(key)[:2] != (B, Hkv) or key.shape[-1] != E:
            raise ValueError(f"flexattn: key must be (B, Hkv, L_new, E) = ({B}, {Hkv}, L_new, {E}), "
                             f"got shape {_shape(key)}")
        L_new = key.shape[2]
        if _shape(value) != (B, Hkv, L_new, v_cache.shape[-1]):
            raise ValueError(f"flexattn: value must be (B, Hkv, L_new, Ev) = {(B, Hkv, L_new, v_cache.shape[-1])}, "
                             f"got shape {_shape(value)}")
    if not isinstance(cache_seqlens, Tensor) or cache_seqlens.dim() != 1 or cache_seqlens.shape[0] != B \
            or cache_seqlens.dtype not in (torch.int32, torch.int64):
        got = f"shape {_shape(cache_seqlens)} {cache_seqlens.dtype}" if isinstance(cache_seqlens, Tensor) \
            else type(cache_seqlens).__name__
        raise ValueError(f"flexattn: cache_seqlens must be an int, or an int32/int64 tensor of shape ({B},), got {got}")
    if cache_batch_idx is None:
        if Bc != B:
            raise ValueError(f"flexattn: the cache has {Bc} rows for a batch of {B}: pass cache_batch_idx to say "
                             f"which row each sequence uses")
    elif not isinstance(cache_batch_idx, Tensor) or _shape(cache_batch_idx) != (B,) \
            or cache_batch_idx.dtype not in (torch.int32, torch.int64):
        got = f"shape {_shape(cache_batch_idx)} {cache_batch_idx.dtype}" if isinstance(cache_batch_idx, Tensor) \
            else type(cache_batch_idx).__name__
        raise ValueError(f"flexattn: cache_batch_idx must be an int32/int64 tensor of shape ({B},), got {got}")
    elif not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("flexattn: with cache_batch_idx, k_cache and v_cache must be contiguous (the cache is "
                         "read in place as a pool of rows)")
    else:
        _pool_kv_block(Hkv * S_max)  # each cache row must start a KV block of the pool
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("flexattn: rotary_cos and rotary_sin go together: pass both or neither")
    if rotary_cos is not None:
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if not isinstance(t, Tensor) or t.dim() != 2 or not t.is_floating_point():
                got = f"shape {_shape(t)} {t.dtype}" if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(f"flexattn: {name} must be a floating (S_rot, rotary_dim / 2) tensor, got {got}")
            if t.device != query.device:
                raise ValueError(f"flexattn: {name} must be on query's device ({query.device}), got {t.device}")
        if rotary_sin.shape != rotary_cos.shape:
            raise ValueError(f"flexattn: rotary_sin must have rotary_cos's shape {_shape(rotary_cos)}, "
                             f"got {_shape(rotary_sin)}")
        if not 0 < 2 * rotary_cos.shape[1] <= E:
            raise ValueError(f"flexattn: rotary_dim (2 * rotary_cos.shape[1] = {2 * rotary_cos.shape[1]}) must be "
                             f"between 2 and the head dim {E}")
    if torch.compiler.is_compiling():  # the values are unknown while tracing; eagerly they cost a sync
        return
    if cache_seqlens.device != query.device:
        raise ValueError(f"flexattn: cache_seqlens must be on query's device ({query.device}), got "
                         f"{cache_seqlens.device}")
    lengths = cache_seqlens.tolist()
    longest = max(lengths, default=0)
    if min(lengths, default=0) < 0 or longest + L_new > S_max:
        raise ValueError(f"flexattn: cache_seqlens + the {L_new} new tokens must lie in [0, {S_max}] (the cache's "
                         f"length), got cache_seqlens {lengths}")
    if rotary_cos is not None and longest + max(L, L_new) > rotary_cos.shape[0]:
        raise ValueError(f"flexattn: the rotary tables have {rotary_cos.shape[0]} positions, the step needs "
                         f"{longest + max(L, L_new)} (cache_seqlens up to {longest}, {max(L, L_new)} new rows)")
    if page_cache is not None:
        for b, (slot, length) in enumerate(zip(slots.tolist(), lengths)):
            if length + L_new > page_cache.capacity(slot):
                raise ValueError(f"flexattn: cache_seqlens[{b}] + the {L_new} new tokens = {length + L_new} is past "
                                 f"slot {slot}'s reserved pages (capacity {page_cache.capacity(slot)} tokens); call "
                                 f"page_cache.reserve({slot}, length) first")
    if cache_batch_idx is not None:
        if cache_batch_idx.device != query.device:
            raise ValueError(f"flexattn: cache_batch_idx must be on query's device ({query.device}), got "
                             f"{cache_batch_idx.device}")
        rows = cache_batch_idx.tolist()
        if min(rows) < 0 or max(rows) >= Bc:
            raise ValueError(f"flexattn: cache_batch_idx must lie in [0, {Bc}) (k_cache's rows), got {rows}")
        if len(set(rows)) != len(rows):
            raise ValueError(f"flexattn: cache_batch_idx must name each cache row once, got {rows}")


def _pool_kv_block(row_length: int) -> int:
    """The KV block at which every row of a pool starts on a block boundary."""
    block = KV_BLOCK
    while block > MIN_KV_BLOCK and row_length % block:
        block //= 2
    if row_length % block:
        raise ValueError(f"flexattn: with cache_batch_idx, Hkv * S_max ({row_length}) must be a multiple of "
                         f"{MIN_KV_BLOCK} (each cache row starts a block of the pool)")
    return block


def _length_blocks(lists: tuple[Tensor, Tensor, Tensor, Tensor], L: int, kv_len: int, block: int,
                   mask_mod: Callable) -> BlockMask:
    """The block mask of keys before each sequence's length on (B, 1, L, kv_len), from the
    prologue's lists (each row's full blocks, then its one partial block)."""
    kv_num, kv_idx, full_num, full_idx = lists
    B, width = kv_idx.shape
    q_blocks = max(1, math.ceil(L / KV_BLOCK))

    def rows(t: Tensor) -> Tensor:
        return t.view(B, 1, 1, *t.shape[1:]).expand(B, 1, q_blocks, *t.shape[1:])

    return BlockMask.from_kv_blocks(rows(kv_num), rows(kv_idx), rows(full_num), rows(full_idx),
                                    BLOCK_SIZE=(KV_BLOCK, block), mask_mod=mask_mod, seq_lengths=(L, kv_len),
                                    compute_q_blocks=False)


def flex_attention_with_kvcache(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    key: Tensor | None = None,
    value: Tensor | None = None,
    *,
    cache_seqlens: Tensor | int,
    rotary_cos: Tensor | None = None,
    rotary_sin: Tensor | None = None,
    rotary_interleaved: bool = False,
    cache_batch_idx: Tensor | None = None,
    page_cache: PagedKVCache | None = None,
    slots: Tensor | None = None,
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_aux: AuxRequest | None = None,
    kernel_options: dict[str, Any] | None = None,
):
    """Append to a KV cache, apply rotary embeddings and attend, in one call.

    For each sequence b of the batch, with ``n = cache_seqlens[b]`` tokens in its cache
    row ``r = cache_batch_idx[b]`` (b without it):

    1. with ``rotary_cos``/``rotary_sin``, query row i is rotated at position n + i and,
       when given, new key j at position n + j (``apply_rotary``; half-split layout, or
       ``rotary_interleaved``; rotary_dim = 2 * rotary_cos.shape[1] <= E);
    2. the new keys and values (rotated keys) are written in place into
       ``k_cache[r, :, n:n + L_new]`` and ``v_cache[r, :, n:n + L_new]``;
    3. the queries attend to the row's first n + L_new keys.

    Args:
        query: (B, Hq, L, E). k_cache: (B_cache, Hkv, S_max, E). v_cache: (B_cache, Hkv,
            S_max, Ev). key, value: the new tokens, (B, Hkv, L_new, E) and (B, Hkv,
            L_new, Ev), or None to attend without appending.
        cache_seqlens: tokens in each sequence's cache before the append, an int or a
            (B,) int32/int64 tensor on query's device.
        rotary_cos, rotary_sin: (S_rot, rotary_dim / 2) tables, or None for no rotary.
        cache_batch_idx: (B,) int tensor, the cache row of each sequence (each row named
            once); without it B_cache must be B. With it the cache is read in place as
            a pool of rows, so Hkv * S_max must be a multiple of 16.
        page_cache, slots: a ``PagedKVCache`` whose pools are k_cache and v_cache, and
            the (B,) slots of the batch's sequences (instead of cache_batch_idx): the new
            tokens go through ``page_cache.append`` (reserve the pages first) and
            attention runs on the pages. The cache's length S_max is then its max_length.
        score_mod, mask_mod: as flex_attention's, in logical positions: ``q_idx`` is the
            query's position n + i, ``kv_idx`` the key's position in its sequence.
            Keys at or past n + L_new are masked whatever mask_mod says. A mask_mod
            costs one mask evaluation per step (``create_block_mask`` over the batch,
            Hq heads, L queries and S_max keys); without one the mask is built from
            the lengths alone.
        scale, enable_gqa, return_aux, kernel_options: as flex_attention's.

    Returns the attention output (B, Hq, L, Ev), and with ``return_aux`` flex_attention's
    AuxOutput. The caches are mutated. Every argument is checked before anything is
    written; checks of tensor values (lengths within the cache and the rotary tables,
    rows in range) run eagerly and are skipped under torch.compile. A forward-only call:
    the block mask carries no backward lists.
    """
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((query.shape[0],), cache_seqlens, dtype=torch.int32, device=query.device)
    _check_arguments(query, k_cache, v_cache, key, value, cache_seqlens, rotary_cos, rotary_sin,
                     cache_batch_idx, enable_gqa, page_cache, slots)
    B, Hq, L, E = query.shape
    Bc, Hkv, S_max, _ = k_cache.shape
    device = query.device
    seqlens = cache_seqlens.to(torch.int64)
    lengths = seqlens + (0 if key is None else key.shape[2])
    rows = page_table = None
    row_shift, page_size, page_stride = 0, 1, 1
    if page_cache is not None:
        block, width = page_cache.page_size, page_cache.max_pages_per_slot
        page_table, page_size, page_stride = page_cache.page_table, page_cache.page_size, page_cache.page_stride
    elif cache_batch_idx is None:
        block, width = KV_BLOCK, math.ceil(S_max / KV_BLOCK)
    else:
        # The cache as one pool row after another: position r * Hkv * S_max + s of head h
        # is k_cache[r, h, s] (the rows overlap other heads' entries, never listed).
        row_length = Hkv * S_max
        block = _pool_kv_block(row_length)
        width, rows, row_shift = math.ceil(S_max / block), cache_batch_idx, row_length // block
    rotated, *lists = kv_step_prologue(
        query, key, value, k_cache, v_cache, cache_seqlens, rows, slots if page_cache is not None else None,
        page_table, rotary_cos, rotary_sin, rotary_interleaved, block, width, row_shift, page_size, page_stride)
    if rotary_cos is not None:
        query = rotated

    def in_length(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]

    user_mask = None
    logical_mask = in_length
    if mask_mod is not None:
        def user_mask(b, h, q_idx, kv_idx):
            return mask_mod(b, h, seqlens[b] + q_idx, kv_idx)

        logical_mask = and_masks(in_length, user_mask)

    logical_score_mod = None
    if score_mod is not None:
        def logical_score_mod(score, b, h, q_idx, kv_idx):
            return score_mod(score, b, h, seqlens[b] + q_idx, kv_idx)

    if page_cache is not None:
        max_len = page_cache.max_length
        if mask_mod is None:
            paged = page_cache._paged_mask_mod(in_length, page_cache._as_slots(slots, False), None)
            block_mask = _length_blocks(lists, L, page_cache.pool_length, block, paged)
        else:
            logical = create_block_mask(logical_mask, B, Hq, L, max_len, device=device, BLOCK_SIZE=(KV_BLOCK, block))
            block_mask = page_cache.block_mask_on_pages(logical, slots)
        return flex_attention(
            query, k_cache, v_cache, block_mask=block_mask,
            score_mod=None if score_mod is None else page_cache.score_mod_on_pages(logical_score_mod, slots),
            scale=scale, enable_gqa=enable_gqa, return_aux=return_aux, kernel_options=kernel_options)

    if cache_batch_idx is None:
        if mask_mod is None:
            block_mask = _length_blocks(lists, L, S_max, block, logical_mask)
        else:
            block_mask = create_block_mask(logical_mask, B, Hq, L, S_max, device=device)
        return flex_attention(query, k_cache, v_cache, score_mod=logical_score_mod, block_mask=block_mask,
                              scale=scale, enable_gqa=enable_gqa, return_aux=return_aux, kernel_options=kernel_options)

    kv_len = (Bc - 1) * row_length + S_max
    keys = k_cache.as_strided((1, Hkv, kv_len, E), (0, S_max * E, E, 1))
    Ev = v_cache.shape[-1]
    values = v_cache.as_strided((1, Hkv, kv_len, Ev), (0, S_max * Ev, Ev, 1))
    base = cache_batch_idx.to(torch.int64) * row_length

    # A row's last block runs into the next row: the length masks those keys, and the
    # user's mods see them clamped into the row (their own tables are S_max long).
    def pool_mask(b, h, q_idx, kv_idx):
        in_row = kv_idx - base[b]
        visible = in_length(b, h, q_idx, in_row)
        if user_mask is not None:
            visible = visible & user_mask(b, h, q_idx, in_row.clamp(0, S_max - 1))
        return visible

    if mask_mod is None:
        block_mask = _length_blocks(lists, L, kv_len, block, pool_mask)
    else:
        logical = create_block_mask(logical_mask, B, Hq, L, S_max, device=device, BLOCK_SIZE=(KV_BLOCK, block))
        offsets = (base // block).to(torch.int32).view(B, 1, 1, 1)
        block_mask = BlockMask.from_kv_blocks(
            logical.kv_num_blocks, logical.kv_indices + offsets, logical.full_kv_num_blocks,
            None if logical.full_kv_indices is None else logical.full_kv_indices + offsets,
            BLOCK_SIZE=(KV_BLOCK, block), mask_mod=pool_mask, seq_lengths=(L, kv_len), compute_q_blocks=False)

    pool_score_mod = None
    if score_mod is not None:
        def pool_score_mod(score, b, h, q_idx, kv_idx):
            return logical_score_mod(score, b, h, q_idx, (kv_idx - base[b]).clamp(0, S_max - 1))

    return flex_attention(query, keys, values, score_mod=pool_score_mod, block_mask=block_mask, scale=scale,
                          enable_gqa=enable_gqa, return_aux=return_aux, kernel_options=kernel_options)

"""The paged KV cache (flexattn/paged.py): page bookkeeping, and attention on the pool
against the dense reference on each sequence's contiguous (logical) cache."""

from __future__ import annotations

import pytest
import torch

import flexattn
import flexattn.lowering
from flexattn import _compat
from flexattn._hop import dense_flex_attention
from flexattn.paged import PagedKVCache

from _numerics import assert_close_3way
from conftest import DEVICE

flexattn.lowering.register()
_compat.use_interpreter_libdevice()
pytestmark = pytest.mark.usefixtures("inductor_runs_flexattn_kernels")
ON_CUDA = DEVICE == "cuda"


def test_reserve_append_free():
    cache = PagedKVCache(n_pages=8, page_size=4, max_slots=3, device=DEVICE)
    cache.reserve(0, 5)
    cache.reserve(1, 4)
    cache.reserve(0, 9)
    assert cache.capacity(0) == 12 and cache.capacity(1) == 4 and cache.free_pages() == 4
    assert cache.page_table[0, :3].tolist() == [0, 1, 3] and cache.page_table[1, 0].item() == 2
    assert cache.owner_page[0, 3].item() == 2 and cache.owner_page[1, 3].item() == -1
    pos = cache.pool_positions(torch.tensor([0, 1]), torch.tensor([[9], [2]]))
    assert pos.tolist() == [[3 * 4 + 1], [2 * 4 + 2]]
    cache.free(0)
    assert cache.free_pages() == 7 and cache.capacity(0) == 0
    with pytest.raises(RuntimeError, match="out of pages"):
        cache.reserve(2, 40)
    with pytest.raises(RuntimeError, match="reserve first"):
        cache.pool_positions(torch.tensor([1]), torch.tensor([[4]]))


@pytest.mark.parametrize("L", [1, 3])
def test_decode_on_pages_matches_contiguous(L):
    """Three sequences of different lengths, their pages interleaved in the pool; a
    decode step of L tokens each, causal + sliding window and ALiBi in logical positions."""
    page, Hq, Hkv, E = 16, 4, 2, 16
    lengths = [37, scaled(150, 1500), 70]
    B = len(lengths)
    cache = PagedKVCache(n_pages=sum(-(-n // page) for n in lengths) + 2, page_size=page, max_slots=4, device=DEVICE)
    gen = torch.Generator().manual_seed(L)
    dtype = torch.float16
    k_logical = [torch.randn(1, Hkv, n, E, generator=gen).to(DEVICE, dtype) for n in lengths]
    v_logical = [torch.randn(1, Hkv, n, E, generator=gen).to(DEVICE, dtype) for n in lengths]
    k_cache = torch.zeros(1, Hkv, cache.pool_length, E, device=DEVICE, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([2, 0, 1], device=DEVICE)
    # Grow the sequences in steps of 10 tokens, round robin, so their pages interleave.
    for start in range(0, max(lengths), 10):
        for b, n in enumerate(lengths):
            stop = min(n, start + 10)
            if start >= stop:
                continue
            cache.reserve(int(slots[b]), stop)
            pos = torch.arange(start, stop, device=DEVICE)[None]
            cache.append(slots[b:b + 1], pos, k_logical[b][:, :, start:stop], v_logical[b][:, :, start:stop],
                         k_cache, v_cache)

    seq_len = torch.tensor(lengths, device=DEVICE)
    max_len = max(lengths)
    slopes = flexattn.mods.alibi_slopes(Hq, device=DEVICE)

    def mask_mod(b, h, q_idx, kv_idx):   # logical positions; the queries are the last L tokens
        pos = q_idx + seq_len[b] - L
        return (kv_idx <= pos) & (pos - kv_idx < 64)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - (q_idx + seq_len[b] - L))

    q = torch.randn(B, Hq, L, E, generator=gen).to(DEVICE, dtype)
    logical_mask = flexattn.create_block_mask(mask_mod, B, None, L, max_len, device=DEVICE, BLOCK_SIZE=(16, page))
    paged_mask = cache.block_mask_on_pages(logical_mask, slots)
    paged_score = cache.score_mod_on_pages(score_mod, slots)
    out = flexattn.flex_attention(q, k_cache, v_cache, score_mod=paged_score, block_mask=paged_mask,
                                  enable_gqa=True, return_lse=True, kernel_options={"FORCE_DECODE": True})

    # The reference: each sequence's cache contiguous, padded to max_len (padding masked).
    k_dense = torch.zeros(B, Hkv, max_len, E, device=DEVICE, dtype=dtype)
    v_dense = torch.zeros_like(k_dense)
    for b, n in enumerate(lengths):
        k_dense[b, :, :n], v_dense[b, :, :n] = k_logical[b][0], v_logical[b][0]
    options = {"OUTPUT_LOGSUMEXP": True, "OUTPUT_MAX": False}
    t = logical_mask.as_tuple()
    golden = dense_flex_attention(q.double(), k_dense.double(), v_dense.double(), score_mod, t, E ** -0.5,
                                  options, (), ())
    ref = dense_flex_attention(q, k_dense, v_dense, score_mod, t, E ** -0.5, options, (), ())
    assert_close_3way("out", out[0], ref[0], golden[0], dtype)
    assert_close_3way("lse", out[1], ref[1], golden[1], dtype)


def scaled(cpu, cuda):
    return cuda if ON_CUDA else cpu


def test_block_size_must_match_pages():
    cache = PagedKVCache(n_pages=4, page_size=16, max_slots=1, device=DEVICE)
    bm = flexattn.create_block_mask(flexattn.mods.causal_mask, 1, None, 1, 64, device=DEVICE, BLOCK_SIZE=32)
    with pytest.raises(ValueError, match="must equal the page size"):
        cache.block_mask_on_pages(bm, torch.tensor([0]))

"""The paged KV cache (flexattn/paged.py): page bookkeeping, argument checks, attention on
the pool against the dense reference on each sequence's contiguous (logical) cache, and
per-step decoding under torch.compile without recompiles.

Numerics as everywhere (tests/_harness.py): golden = the float64 dense reference of
each sequence on its own contiguous cache, ref = the same in the test dtype, and the
paged run must satisfy ``err(paged, golden) <= 2 * err(ref, golden) + floor``.

Queries are the last L tokens of their sequences (decoding for L = 1, a prefill chunk
for larger L); the mods are written in logical positions and add each sequence's offset
``seq_len[b] - L`` themselves. Pages are handed out round robin in chunks, so every
sequence's pages interleave with the others' in the pool.

Two paths: most cases run flex_attention's dense CPU path (fast; it honours the
BlockMask block for block, so the page translation is fully exercised); the cases marked
``kernel`` run the Triton kernels through the interpreter (the ``inductor_runs_flexattn_kernels``
fixture), the decode kernel and the main kernel.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import flexattn
from flexattn import PagedKVCache, mods
from flexattn.paged import POOL_LAYOUTS

import _harness as harness
from conftest import DEVICE

ON_CUDA = DEVICE == "cuda"
DECODE_MARK = "def attend_kv_tile("   # the decode kernel's step
MAIN_MARK = "def attend_kv_blocks("    # the main forward kernel's inner loop
kernel = pytest.mark.usefixtures("inductor_runs_flexattn_kernels")


# --------------------------------------------------------------------------------------
# Harness
# --------------------------------------------------------------------------------------
def logical_mods(seq_len: torch.Tensor, L: int, Hq: int, window: int | None):
    """Causal (+ sliding window) mask and ALiBi in logical positions, for queries that
    are the last L tokens of sequences of lengths ``seq_len`` (a captured tensor)."""
    slopes = mods.alibi_slopes(Hq, device=seq_len.device)

    def causal_window(b, h, q_idx, kv_idx):
        pos = q_idx + seq_len[b] - L
        visible = kv_idx <= pos
        return visible & (pos - kv_idx < window) if window is not None else visible

    def alibi_logical(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - (q_idx + seq_len[b] - L))

    return causal_window, alibi_logical


class Sequences:
    """Random logical K/V of several sequences, written into a fresh pool page by page."""

    def __init__(self, cache: PagedKVCache, slots: list[int], lengths: list[int], Hkv: int, E: int,
                 dtype: torch.dtype, seed: int, chunk: int = 10):
        self.cache, self.slots, self.lengths = cache, slots, list(lengths)
        self.gen = harness.generator(seed)
        self.dtype, self.Hkv, self.E = dtype, Hkv, E
        self.k_cache, self.v_cache = cache.allocate(Hkv, E, dtype)
        # Poison the pool with a large finite value: a position that is visible but was
        # never written wrecks the result (NaN would poison masked positions too: 0 * NaN).
        self.k_cache.fill_(300.0)
        self.v_cache.fill_(300.0)
        self.k = [self.randn(n) for n in lengths]
        self.v = [self.randn(n) for n in lengths]
        for start in range(0, max(lengths), chunk):      # round robin: pages interleave
            for i, n in enumerate(lengths):
                if start < n:
                    self.write(i, start, min(n, start + chunk))

    def randn(self, n: int) -> torch.Tensor:
        return harness.randn(self.gen, 1, self.Hkv, n, self.E, dtype=self.dtype)

    def write(self, i: int, start: int, stop: int) -> None:
        slot = self.slots[i]
        self.cache.reserve(slot, stop)
        pos = torch.arange(start, stop, device=DEVICE)[None]
        self.cache.append([slot], pos, self.k[i][:, :, start:stop], self.v[i][:, :, start:stop],
                          self.k_cache, self.v_cache)

    def grow(self, i: int, n: int) -> None:
        """Append n new random tokens to sequence i."""
        start = self.lengths[i]
        self.k[i] = torch.cat([self.k[i], self.randn(n)], dim=2)
        self.v[i] = torch.cat([self.v[i], self.randn(n)], dim=2)
        self.lengths[i] += n
        self.write(i, start, start + n)

    def replace(self, i: int, slot: int, n: int) -> None:
        """Sequence i ends; a new one of n tokens takes ``slot``."""
        self.cache.free(self.slots[i])
        self.slots[i] = slot
        self.k[i], self.v[i] = self.randn(n), self.randn(n)
        self.lengths[i] = n
        self.write(i, 0, n)

    def reference(self, q, ks, vs, mask_mod, score_mod):
        """Each sequence on its own contiguous cache (keys ``ks``, values ``vs``): dense
        attention, (out, lse)."""
        outs, lses = [], []
        for i, n in enumerate(self.lengths):
            def mask_i(b, h, q_idx, kv_idx, i=i):
                return mask_mod(b + i, h, q_idx, kv_idx)

            def score_i(score, b, h, q_idx, kv_idx, i=i):
                return score_mod(score, b + i, h, q_idx, kv_idx)

            L = q.shape[2]
            bm = flexattn.create_block_mask(mask_i, 1, None, L, n, device=DEVICE, BLOCK_SIZE=16)
            options = {"OUTPUT_LOGSUMEXP": True, "OUTPUT_MAX": False}
            out, lse, _ = harness.dense_reference(score_i, bm.as_tuple(), self.E ** -0.5, options)(
                q[i:i + 1], ks[i], vs[i])
            outs.append(out)
            lses.append(lse)
        return torch.cat(outs), torch.cat(lses)

    def check(self, name, q, out, lse, mask_mod, score_mod):
        golden, ref = harness.reference_runs(
            lambda q, ks, vs: self.reference(q, ks, vs, mask_mod, score_mod), (q, self.k, self.v))
        harness.check_attention((out, lse), ref, golden, self.dtype, max_scores=False, prefix=f"{name} ")


def paged_attention(cache, seqs, q, mask_mod, score_mod, *, q_block=16, options=None, sinks=None):
    """Logical BlockMask -> pool BlockMask, mods -> pool mods, flex_attention on the pool."""
    B, Hq, L, _ = q.shape
    slots = torch.tensor(seqs.slots, device=DEVICE)
    logical = flexattn.create_block_mask(mask_mod, B, None, L, max(seqs.lengths), device=DEVICE,
                                         BLOCK_SIZE=(q_block, cache.page_size))
    paged_mask = cache.block_mask_on_pages(logical, slots)
    paged_score = cache.score_mod_on_pages(score_mod, slots)
    return flexattn.flex_attention(q, seqs.k_cache, seqs.v_cache, score_mod=paged_score, block_mask=paged_mask,
                                   enable_gqa=True, return_lse=True, kernel_options=options, sinks=sinks)


def make_case(group: int, L: int, *, Hkv=2, E=16, page=16, lengths=(36, 100, 70), dtype=torch.float16,
              window=48, seed=0, spare_pages=3, layout="heads", capped=False):
    """capped: max_pages_per_slot = the longest sequence's pages (else n_pages)."""
    lengths = [n + L for n in lengths]
    n_pages = sum(-(-n // page) for n in lengths) + spare_pages
    cache = PagedKVCache(n_pages=n_pages, page_size=page, max_slots=5, device=DEVICE, layout=layout,
                         num_kv_heads=Hkv, max_pages_per_slot=-(-max(lengths) // page) if capped else None)
    cache.shuffle_free_pages(torch.Generator().manual_seed(seed))   # pages in no particular order
    seqs = Sequences(cache, [3, 0, 4][:len(lengths)], lengths, Hkv, E, dtype, seed)
    Hq = Hkv * group
    q = harness.randn(harness.generator(seed + 1), len(lengths), Hq, L, E, dtype=dtype)
    seq_len = torch.tensor(lengths, device=DEVICE)
    mask_mod, score_mod = logical_mods(seq_len, L, Hq, window)
    return cache, seqs, q, mask_mod, score_mod


# --------------------------------------------------------------------------------------
# Bookkeeping
# --------------------------------------------------------------------------------------
def test_exported():
    assert flexattn.PagedKVCache is PagedKVCache and "PagedKVCache" in flexattn.__all__


def test_reserve_free_reuse():
    cache = PagedKVCache(n_pages=8, page_size=4, max_slots=3, device=DEVICE)
    cache.reserve(0, 5)
    cache.reserve(1, 4)
    cache.reserve(0, 9)
    cache.reserve(0, 2)                      # already holds more: no-op
    assert cache.capacity(0) == 12 and cache.capacity(1) == 4 and cache.free_pages() == 4
    assert cache.pages(0) == [0, 1, 3] and cache.pages(1) == [2]
    assert cache.page_table[0, :4].tolist() == [0, 1, 3, -1] and cache.page_table[1, 0].item() == 2
    assert cache.owner_page[0, :4].tolist() == [0, 1, -1, 2] and cache.owner_page[1, :4].tolist() == [-1, -1, 0, -1]
    pos = cache.pool_positions(torch.tensor([0, 1], device=DEVICE), torch.tensor([[9], [2]], device=DEVICE))
    assert pos.tolist() == [[3 * 4 + 1], [2 * 4 + 2]]
    cache.free(0)
    assert cache.free_pages() == 7 and cache.capacity(0) == 0 and cache.pages(0) == []
    assert (cache.page_table[0] == -1).all() and (cache.owner_page[0] == -1).all()
    cache.reserve(2, 8)                      # the freed pages come back first, in order
    assert cache.pages(2) == [0, 1]
    with pytest.raises(RuntimeError, match="out of pages"):
        cache.reserve(2, 32)
    with pytest.raises(ValueError, match="more than max_pages_per_slot = 8"):
        cache.reserve(2, 33)
    assert cache.pages(2) == [0, 1] and cache.free_pages() == 5   # a failed reserve changes nothing
    assert "pages_in_use=3" in repr(cache)


def test_max_pages_per_slot_caps_a_slot():
    """A slot holds at most max_pages_per_slot pages: the page tables are that wide, and
    so are the paged BlockMask's index rows (the pool keeps all its blocks)."""
    cache = PagedKVCache(n_pages=10, page_size=4, max_slots=2, device=DEVICE, max_pages_per_slot=3)
    assert cache.max_length == 12 and tuple(cache.page_table.shape) == (2, 3)
    assert "max_pages_per_slot=3" in repr(cache)
    cache.reserve(1, 2)
    cache.reserve(0, 12)
    with pytest.raises(ValueError, match=r"reserve length 13 needs 4 pages .* max_pages_per_slot = 3"):
        cache.reserve(0, 13)
    assert cache.pages(0) == [1, 2, 3] and cache.free_pages() == 6
    with pytest.raises(ValueError, match="outside slot 0's reserved pages"):
        cache.pool_positions([0], torch.tensor([[12]], device=DEVICE))
    logical = flexattn.create_block_mask(flexattn.noop_mask, None, None, 1, 12, device=DEVICE, BLOCK_SIZE=(16, 4))
    paged = cache.block_mask_on_pages(logical, [0, 1])
    assert paged.seq_lengths == (1, cache.pool_length) and paged.kv_indices.shape == (2, 1, 1, 3)
    # The one-token query hangs over its 16-row block, so its blocks are partial (torch's rule).
    assert paged.kv_num_blocks.flatten().tolist() == [3, 1] and paged.full_kv_num_blocks.sum().item() == 0
    assert paged.kv_indices[0, 0, 0].tolist() == [1, 2, 3] and paged.kv_indices[1, 0, 0, 0].item() == 0
    assert paged.to_dense().shape == (2, 1, 1, 10)
    with pytest.raises(ValueError, match=r"KV length 16 exceeds max_length = 12 tokens \(max_pages_per_slot = 3 "
                                         r"pages of page_size = 4\)"):
        cache.block_mask_on_pages(flexattn.create_block_mask(flexattn.noop_mask, None, None, 1, 16, device=DEVICE,
                                                             BLOCK_SIZE=(16, 4)), [0, 1])


@pytest.mark.parametrize("layout", POOL_LAYOUTS)
def test_append_writes_each_token_at_its_page(layout):
    cache = PagedKVCache(n_pages=6, page_size=4, max_slots=2, device=DEVICE, layout=layout, num_kv_heads=2)
    k_cache, v_cache = cache.allocate(2, 8, torch.float32, value_head_dim=3)
    # pages: page p starts at pool position 2 * 4 * p; the positions between belong to the other head.
    length = {"heads": 24, "tokens": 24, "pages": 44}[layout]
    assert cache.pool_length == length and cache.max_length == 24
    assert k_cache.shape == (1, 2, length, 8) and v_cache.shape == (1, 2, length, 3)
    # heads: each head's pool positions contiguous; tokens: each position's heads
    # contiguous; pages: each page's heads contiguous, each head's page contiguous.
    assert k_cache.stride() == {"heads": (384, 192, 8, 1), "tokens": (384, 8, 16, 1),
                                "pages": (384, 32, 8, 1)}[layout]
    stride = cache.page_stride
    cache.reserve(1, 3)
    cache.reserve(0, 6)
    cache.reserve(1, 7)                      # slot 1: pages [0, 3]; slot 0: pages [1, 2]
    k = torch.randn(2, 2, 3, 8, device=DEVICE)
    v = torch.randn(2, 2, 3, 3, device=DEVICE)
    positions = torch.tensor([[4, 5, 6], [0, 1, 5]], device=DEVICE)
    cache.append(torch.tensor([1, 0], device=DEVICE), positions, k, v, k_cache, v_cache)
    # (slot, logical position) -> (page, offset)
    expect = {(1, 4): (3, 0), (1, 5): (3, 1), (1, 6): (3, 2), (0, 0): (1, 0), (0, 1): (1, 1), (0, 5): (2, 1)}
    for row, slot in enumerate([1, 0]):
        for col in range(3):
            page, offset = expect[(slot, int(positions[row, col]))]
            at = page * stride + offset
            assert torch.equal(k_cache[0, :, at], k[row, :, col]) and torch.equal(v_cache[0, :, at], v[row, :, col])
    # Six token rows per head written and nothing else, counting each head's own
    # positions (in the pages layout's view, a head's positions between its pages show
    # the other head's rows).
    own = torch.arange(length, device=DEVICE) % stride < cache.page_size
    assert (k_cache[0, :, own].abs().sum(-1) != 0).sum(-1).tolist() == [6, 6]


def _bad_inputs():
    cache = PagedKVCache(n_pages=4, page_size=16, max_slots=2, device=DEVICE)
    cache.reserve(0, 20)
    k_cache, v_cache = cache.allocate(2, 8, torch.float16)
    slots = torch.tensor([0], device=DEVICE)
    pos = torch.tensor([[3, 4]], device=DEVICE)
    k = torch.randn(1, 2, 2, 8, device=DEVICE, dtype=torch.float16)
    v = torch.randn(1, 2, 2, 8, device=DEVICE, dtype=torch.float16)
    bm = flexattn.create_block_mask(mods.causal_mask, 1, None, 1, 32, device=DEVICE, BLOCK_SIZE=16)
    append = cache.append
    return [
        ("n_pages", lambda: PagedKVCache(0, 16, 1)),
        ("page_size", lambda: PagedKVCache(4, 16.0, 1)),
        ("max_slots", lambda: PagedKVCache(4, 16, True)),
        ("device", lambda: PagedKVCache(4, 16, 1, device="nowhere")),
        ("slot must be an int", lambda: cache.reserve(2, 4)),
        ("length", lambda: cache.reserve(0, -1)),
        ("slot must be an int", lambda: cache.free(-1)),
        ("k_cache must have shape", lambda: append(slots, pos, k, v, k_cache[:, :, :32], v_cache)),
        ("v_cache must be a torch.Tensor", lambda: append(slots, pos, k, v, k_cache, None)),
        ("same number of heads", lambda: append(slots, pos, k, v, k_cache, v_cache[:, :1])),
        ("k_cache must be on the cache's device", lambda: append(slots, pos, k, v, k_cache.to("meta"), v_cache)),
        ("slots must be a non-empty 1-D", lambda: append(slots[None], pos, k, v, k_cache, v_cache)),
        ("slots must have an integer dtype", lambda: append(slots.float(), pos, k, v, k_cache, v_cache)),
        ("slots must be a 1-D integer tensor or a list", lambda: append(0, pos, k, v, k_cache, v_cache)),
        (r"slots must hold slots in \[0, 2\)", lambda: append([5], pos, k, v, k_cache, v_cache)),
        ("must not name a slot twice", lambda: cache.mask_mod_on_pages(mods.causal_mask, [0, 0])),
        ("positions must have shape", lambda: append(slots, pos[0], k, v, k_cache, v_cache)),
        ("positions must have an integer dtype", lambda: append(slots, pos.float(), k, v, k_cache, v_cache)),
        (r"positions\[0, 1\] = 40 is outside slot 0's reserved pages \(capacity 32",
         lambda: append(slots, torch.tensor([[3, 40]], device=DEVICE), k, v, k_cache, v_cache)),
        (r"positions\[0, 0\] = -1", lambda: append(slots, torch.tensor([[-1, 4]], device=DEVICE), k, v,
                                                  k_cache, v_cache)),
        ("outside slot 1's reserved pages", lambda: cache.pool_positions([1], pos)),
        ("must not repeat a position", lambda: append(slots, torch.tensor([[4, 4]], device=DEVICE), k, v,
                                                      k_cache, v_cache)),
        (r"k must have shape \(B, Hkv, L, D\) = \(1, 2, 2, 8\)", lambda: append(slots, pos, k[:, :1], v,
                                                                               k_cache, v_cache)),
        ("v must have shape", lambda: append(slots, pos, k, v[..., :4], k_cache, v_cache)),
        ("k must have k_cache's dtype", lambda: append(slots, pos, k.float(), v, k_cache, v_cache)),
        ("v must be a torch.Tensor", lambda: append(slots, pos, k, v.tolist(), k_cache, v_cache)),
        ("mask_mod must be a callable", lambda: cache.mask_mod_on_pages(lambda s, b, h, q, kv: s, slots)),
        ("score_mod must be a callable", lambda: cache.score_mod_on_pages(mods.causal_mask, slots)),
        ("block_mask must be a flexattn.BlockMask", lambda: cache.block_mask_on_pages(bm.as_tuple(), slots)),
        (r"KV block size \(32\) must equal the page size \(16\)", lambda: cache.block_mask_on_pages(
            flexattn.create_block_mask(mods.causal_mask, 1, None, 1, 64, device=DEVICE, BLOCK_SIZE=32), slots)),
        ("block_mask must have batch 1 or len", lambda: cache.block_mask_on_pages(
            flexattn.create_block_mask(mods.causal_mask, 3, None, 1, 32, device=DEVICE, BLOCK_SIZE=16), [0, 1])),
        (r"exceeds max_length = 64 tokens \(max_pages_per_slot = 4 pages of page_size = 16\)", lambda: cache.block_mask_on_pages(
            flexattn.create_block_mask(mods.causal_mask, 1, None, 1, 65, device=DEVICE, BLOCK_SIZE=16), slots)),
        ("block_mask must be on the cache's device", lambda: cache.block_mask_on_pages(bm.to("meta"), slots)),
        ("allocate dtype", lambda: cache.allocate(2, 8, torch.int32)),
        ("allocate head_dim", lambda: cache.allocate(2, 0)),
        ("layout must be one of", lambda: PagedKVCache(4, 16, 1, layout="blocks")),
        ("needs num_kv_heads", lambda: PagedKVCache(4, 16, 1, layout="pages")),
        ("num_kv_heads must be a positive int", lambda: PagedKVCache(4, 16, 1, num_kv_heads=0)),
        ("allocate num_kv_heads must be the cache's num_kv_heads 2, got 3",
         lambda: PagedKVCache(4, 16, 1, layout="pages", num_kv_heads=2).allocate(3, 8)),
        ("k_cache must have the cache's num_kv_heads = 2 heads", lambda: PagedKVCache(
            4, 16, 1, device=DEVICE, num_kv_heads=2).append([0], torch.zeros(1, 1, dtype=torch.long, device=DEVICE),
                                                            *(torch.zeros(1, 3, 1, 8, device=DEVICE),) * 2,
                                                            *(torch.zeros(1, 3, 64, 8, device=DEVICE),) * 2)),
    ]


BAD_INPUTS = _bad_inputs()


@pytest.mark.parametrize("match,call", BAD_INPUTS, ids=[f"{i}-{m[:30]}" for i, (m, _) in enumerate(BAD_INPUTS)])
def test_bad_input_names_the_argument(match, call):
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        call()


def test_checks_leave_the_cache_unchanged():
    cache = PagedKVCache(n_pages=4, page_size=16, max_slots=2, device=DEVICE)
    cache.reserve(0, 16)
    k_cache, v_cache = cache.allocate(1, 8, torch.float32)
    k = torch.ones(1, 1, 2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="reserved pages"):
        cache.append([0], torch.tensor([[15, 16]], device=DEVICE), k, k, k_cache, v_cache)
    assert k_cache.abs().sum() == 0 and v_cache.abs().sum() == 0


@pytest.mark.parametrize("layout", ["heads", "pages"])
def test_blocks_beyond_reserved_pages_are_dropped(layout):
    """A logical mask shared by the batch (B=None) lists every block up to the longest
    sequence; on the pages each row keeps only the blocks its slot owns, in order (on a
    page-major pool of 3 heads page p is block 3 * p of 28). Rows are n_pages wide (the
    default max_pages_per_slot), padded with block 0."""
    cache = PagedKVCache(n_pages=10, page_size=16, max_slots=3, device=DEVICE, layout=layout, num_kv_heads=3)
    step = cache.page_stride // cache.page_size
    blocks = 9 * step + 1
    cache.reserve(2, 20)      # pages 0, 1
    cache.reserve(0, 70)      # pages 2..6
    cache.reserve(2, 40)      # page 7
    logical = flexattn.create_block_mask(flexattn.noop_mask, None, None, 16, 70, device=DEVICE, BLOCK_SIZE=16)
    paged = cache.block_mask_on_pages(logical, [2, 0])
    assert paged.seq_lengths == (16, cache.pool_length) and paged.kv_indices.shape == (2, 1, 1, 10)
    assert paged.q_indices is None                  # no transposed lists unless asked for
    full_num, full_idx = paged.full_kv_num_blocks, paged.full_kv_indices
    partial_num = paged.kv_num_blocks
    # KV length 70: blocks 0..3 full, block 4 partial (it hangs over the end).
    assert full_num[:, 0, 0].tolist() == [3, 4] and partial_num[:, 0, 0].tolist() == [0, 1]
    assert full_idx[0, 0, 0, :3].tolist() == [step * p for p in (0, 1, 7)]
    assert full_idx[1, 0, 0, :4].tolist() == [step * p for p in (2, 3, 4, 5)]
    assert paged.kv_indices[1, 0, 0, 0].item() == step * 6
    for num, idx in ((partial_num, paged.kv_indices), (full_num, paged.full_kv_indices)):
        padding = torch.arange(10, device=DEVICE) >= num[..., None]
        assert (idx[padding] == 0).all()
    dense = paged.to_dense()[:, 0, 0]       # (rows, blocks): which blocks are visited
    assert dense.shape == (2, blocks)
    assert dense[0].nonzero().flatten().tolist() == [step * p for p in (0, 1, 7)]
    assert dense[1].nonzero().flatten().tolist() == [step * p for p in (2, 3, 4, 5, 6)]


def test_a_block_listed_twice_keeps_the_count_within_the_row():
    """An invalid logical row that lists a block twice keeps each listing; its count on
    the pages is clamped to the row width (max_pages_per_slot), so the kernels never
    read past the row."""
    cache = PagedKVCache(n_pages=6, page_size=16, max_slots=2, device=DEVICE, max_pages_per_slot=2)
    cache.reserve(1, 32)
    idx = torch.tensor([[[[0, 1, 0]]]], dtype=torch.int32, device=DEVICE)
    num = torch.tensor([[[3]]], dtype=torch.int32, device=DEVICE)
    logical = flexattn.BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=16, seq_lengths=(16, 32))
    paged = cache.block_mask_on_pages(logical, [1])
    assert paged.kv_indices.shape[-1] == 2 and paged.kv_num_blocks.flatten().tolist() == [2]
    assert paged.kv_indices.flatten().tolist() == cache.pages(1)


@pytest.mark.parametrize("layout", ["heads", "pages"])
def test_adjust_keeps_the_paged_width(layout):
    """Cropping a paged mask to a shorter pool (flex_attention does so for shorter keys)
    keeps its max_pages_per_slot-wide rows and gives the blocks that the crop of the
    mask of an uncapped cache gives (n_pages wide: the pool's blocks for "heads", whose
    crop goes through the dense flags; fewer for "pages")."""
    masks = []
    for cap in (None, 3):
        cache = PagedKVCache(n_pages=10, page_size=16, max_slots=2, device=DEVICE, layout=layout, num_kv_heads=2,
                             max_pages_per_slot=cap)
        cache.reserve(0, 20)        # pages 0, 1
        cache.reserve(1, 48)        # pages 2, 3, 4
        logical = flexattn.create_block_mask(mods.causal_mask, None, None, 40, 40, device=DEVICE, BLOCK_SIZE=16)
        masks.append(cache.block_mask_on_pages(logical, [0, 1], compute_q_blocks=True))
    wide, narrow = masks
    assert narrow.kv_indices.shape[-1] == 3 and wide.kv_indices.shape[-1] == 10    # n_pages
    kv_len = 3 * cache.page_stride + 7        # cuts page 3 (of slot 1): blocks 0..3 stay
    cropped = narrow._adjust(40, kv_len)
    assert cropped.kv_indices.shape[-1] == cropped.full_kv_indices.shape[-1] == 3
    assert torch.equal(cropped.to_dense(), wide._adjust(40, kv_len).to_dense())
    assert torch.equal(cropped._block_kinds(), wide._adjust(40, kv_len)._block_kinds())
    assert torch.equal(cropped.q_indices, wide._adjust(40, kv_len).q_indices)


# --------------------------------------------------------------------------------------
# Attention on the pool vs each sequence's contiguous cache
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("L", [1, 3, 17, 64])
def test_paged_matches_contiguous_dense_path(group, L):
    layout = POOL_LAYOUTS[(group + L) % len(POOL_LAYOUTS)]
    cache, seqs, q, mask_mod, score_mod = make_case(group, L, seed=group * 100 + L, layout=layout)
    out, lse = paged_attention(cache, seqs, q, mask_mod, score_mod)
    seqs.check("paged", q, out, lse, mask_mod, score_mod)


@kernel
@pytest.mark.parametrize("group,L,options,layout", [
    (4, 1, None, "heads"),                     # decode kernel, chosen automatically
    (2, 17, None, "heads"),                    # a prefill chunk through the decode kernel
    (8, 5, {"FORCE_DECODE": False}, "heads"),  # the main kernel on the pages
    (4, 1, {"USE_TMA": True}, "heads"),        # descriptor loads of the pool's pages
    (4, 1, {"LIST_CHUNK": 2}, "heads"),        # page indices two at a time: several chunks
    (2, 1, None, "tokens"),                    # token-major pool (two KV heads interleaved)
    (2, 1, None, "pages"),                     # page-major pool (two KV heads per page)
    (2, 5, {"FORCE_DECODE": False}, "pages"),  # the main kernel on a page-major pool
], ids=["decode-L1-gqa4", "decode-L17-gqa2", "main-L5-gqa8", "decode-L1-gqa4-tma", "decode-L1-gqa4-chunk2",
        "decode-L1-gqa2-tokens", "decode-L1-gqa2-pages", "main-L5-gqa2-pages"])
def test_paged_matches_contiguous_kernels(group, L, options, layout):
    # Two sequences and one KV head keep the interpreter's work small; the token-major
    # and page-major pools need two heads to differ from the head-major one.
    Hkv = 1 if layout == "heads" else 2
    cache, seqs, q, mask_mod, score_mod = make_case(group, L, Hkv=Hkv, seed=group + L, lengths=(152, 70),
                                                    layout=layout)
    assert cache.pool_length >= 256             # long enough for the automatic decode choice
    (out, lse), code = run_and_get_code(paged_attention, cache, seqs, q, mask_mod, score_mod, options=options)
    mark = MAIN_MARK if options and options.get("FORCE_DECODE") is False else DECODE_MARK
    assert mark in "\n".join(code), f"{mark} is not in the generated code"
    seqs.check("paged", q, out, lse, mask_mod, score_mod)


@kernel
@pytest.mark.parametrize("options", [None, {"FORCE_DECODE": False}], ids=["decode", "main"])
def test_paged_with_sinks(options):
    """A sink renormalises each row: out * exp(lse - lse'), lse' = logaddexp(lse, sink),
    from the same paged call without sinks (whose numerics the tests above check)."""
    cache, seqs, q, mask_mod, score_mod = make_case(4, 3, Hkv=1, seed=21, lengths=(152, 70))
    sinks = harness.randn(harness.generator(22), q.shape[0], q.shape[1]) * 2
    out, lse = paged_attention(cache, seqs, q, mask_mod, score_mod, options=options)
    out_s, lse_s = paged_attention(cache, seqs, q, mask_mod, score_mod, options=options, sinks=sinks)
    want_lse = torch.logaddexp(lse, sinks[:, :, None])
    torch.testing.assert_close(lse_s, want_lse, atol=1e-4, rtol=1e-4)
    want = (out.float() * torch.exp(lse - want_lse)[..., None]).to(out.dtype)
    torch.testing.assert_close(out_s, want, atol=2e-3, rtol=2e-3)


@kernel
@pytest.mark.parametrize("layout,options", [("heads", None), ("pages", None), ("heads", {"FORCE_DECODE": False})],
                         ids=["decode-heads", "decode-pages", "main-heads"])
def test_capped_slots_kernels(layout, options):
    """max_pages_per_slot at the longest sequence's pages: block lists of 10 entries in
    a pool of 18 pages (head-major) or 35 blocks (page-major), through the kernels."""
    cache, seqs, q, mask_mod, score_mod = make_case(2, 1, Hkv=2, seed=11, lengths=(152, 70), layout=layout,
                                                    capped=True)
    assert cache.max_pages_per_slot == 10 and cache.pool_length // cache.page_size >= 18
    (out, lse), code = run_and_get_code(paged_attention, cache, seqs, q, mask_mod, score_mod, options=options)
    mark = MAIN_MARK if options else DECODE_MARK
    assert mark in "\n".join(code), f"{mark} is not in the generated code"
    seqs.check("paged", q, out, lse, mask_mod, score_mod)


def test_logical_kv_length_bounds_the_keys():
    """A hand-built logical mask of full blocks over KV_LEN = 37, not a multiple of the
    page: on the pages, keys at logical positions >= 37 stay masked (the block KV_LEN
    cuts becomes partial), as flex_attention masks keys beyond the key length. The
    reserved but unwritten tail of the last page holds poison that would show."""
    page, E = 16, 16
    cache = PagedKVCache(n_pages=6, page_size=page, max_slots=2, device=DEVICE)
    cache.shuffle_free_pages(torch.Generator().manual_seed(3))
    seqs = Sequences(cache, [1], [37], 2, E, torch.float16, seed=3)
    n = 3
    order = torch.arange(n, dtype=torch.int32, device=DEVICE).view(1, 1, 1, n)
    zero = torch.zeros(1, 1, 1, dtype=torch.int32, device=DEVICE)
    full = flexattn.BlockMask.from_kv_blocks(zero, order, zero + n, order, BLOCK_SIZE=(16, page),
                                             seq_lengths=(4, 37))
    paged = cache.block_mask_on_pages(full, [1])
    assert paged.full_kv_num_blocks.flatten().tolist() == [2] and paged.kv_num_blocks.flatten().tolist() == [1]
    q = harness.randn(harness.generator(4), 1, 4, 4, E, dtype=torch.float16)
    out, lse = flexattn.flex_attention(q, seqs.k_cache, seqs.v_cache, block_mask=paged, enable_gqa=True,
                                       return_lse=True)
    seqs.check("full blocks", q, out, lse, flexattn.noop_mask, lambda score, b, h, q_idx, kv_idx: score)


def test_mask_mod_on_pages_alone():
    """A BlockMask built directly over the pool from ``mask_mod_on_pages`` gives the same
    attention (slower to build: it evaluates the mask at every pool position)."""
    cache, seqs, q, mask_mod, score_mod = make_case(2, 2, window=None)
    slots = torch.tensor(seqs.slots, device=DEVICE)
    over_pool = flexattn.create_block_mask(cache.mask_mod_on_pages(mask_mod, slots), 3, None, 2,
                                           cache.pool_length, device=DEVICE, BLOCK_SIZE=16)
    out, lse = flexattn.flex_attention(q, seqs.k_cache, seqs.v_cache, score_mod=cache.score_mod_on_pages(
        score_mod, slots), block_mask=over_pool, enable_gqa=True, return_lse=True)
    seqs.check("over the pool", q, out, lse, mask_mod, score_mod)


# --------------------------------------------------------------------------------------
# Decoding step by step under torch.compile
# --------------------------------------------------------------------------------------
def _decode_steps(backend: str, steps: int, options=None):
    """``steps`` decode steps of a compiled step function (append the new token, attend
    on the pool); the sequences grow across page boundaries, and halfway one ends and a
    new one takes its slot and, after it, its freed pages. Checks every step's output
    and that the step compiled once."""
    group, Hkv, E, page = 2, 1, 16, 16
    Hq = group * Hkv
    cache = PagedKVCache(n_pages=24, page_size=page, max_slots=4, device=DEVICE)
    seqs = Sequences(cache, [1, 3], [30, 63], Hkv, E, torch.float16, seed=7)
    gen = torch.Generator().manual_seed(8)
    slots = torch.tensor(seqs.slots, device=DEVICE)
    seq_len = torch.tensor(seqs.lengths, device=DEVICE)       # updated in place every step

    def window_mask(b, h, q_idx, kv_idx):                     # decode: the query is token seq_len - 1
        pos = seq_len[b] - 1
        return (kv_idx <= pos) & (pos - kv_idx < 40)

    slopes = mods.alibi_slopes(Hq, device=DEVICE)

    def alibi_logical(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - seq_len[b] + 1)

    @torch.compile(backend=backend, fullgraph=True)
    def step(q, k_new, v_new, k_cache, v_cache, slots, positions, block_mask):
        cache.append(slots, positions, k_new, v_new, k_cache, v_cache)
        return flexattn.flex_attention(q, k_cache, v_cache, score_mod=cache.score_mod_on_pages(alibi_logical, slots),
                                       block_mask=block_mask, enable_gqa=True, return_lse=True,
                                       kernel_options=options)

    counters.clear()
    for t in range(steps):
        if t == steps // 2:
            seqs.replace(0, slot=2, n=45)            # slot 1 ends; its pages go back to the pool
            slots[0] = 2
            seqs.replace(1, slot=1, n=20)            # and a new sequence in slot 1 reuses pages
            slots[1] = 1
        for i in range(2):
            seqs.lengths[i] += 1
            cache.reserve(seqs.slots[i], seqs.lengths[i])
        seq_len.copy_(torch.tensor(seqs.lengths))
        k_new = [seqs.randn(1) for _ in range(2)]
        v_new = [seqs.randn(1) for _ in range(2)]
        for i in range(2):
            seqs.k[i] = torch.cat([seqs.k[i], k_new[i]], dim=2)
            seqs.v[i] = torch.cat([seqs.v[i], v_new[i]], dim=2)
        q = harness.randn(gen, 2, Hq, 1, E, dtype=torch.float16)
        logical = flexattn.create_block_mask(window_mask, 2, None, 1, max(seqs.lengths), device=DEVICE,
                                             BLOCK_SIZE=(16, page))
        paged_mask = cache.block_mask_on_pages(logical, slots)
        args = (q, torch.cat(k_new), torch.cat(v_new), seqs.k_cache, seqs.v_cache, slots, (seq_len - 1)[:, None],
                paged_mask)
        if t == 0 and backend == "inductor":
            (out, lse), code = run_and_get_code(step, *args)
            assert DECODE_MARK in "\n".join(code), "the decode kernel did not run"
        else:
            out, lse = step(*args)
        seqs.check(f"step {t}", q, out, lse, window_mask, alibi_logical)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_decode_steps_compile_once_dense_path():
    with torch._dynamo.config.patch(error_on_recompile=True):
        _decode_steps("eager", steps=8)


@kernel
def test_decode_steps_compile_once_kernels():
    with torch._dynamo.config.patch(error_on_recompile=True):
        _decode_steps("inductor", steps=3, options={"SPLIT_KV": 2})

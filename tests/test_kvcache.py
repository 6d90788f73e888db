"""flexattn.flex_attention_with_kvcache: append, rotary and attention in one call.

The reference below rotates with complex multiplication (not the implementation's
real-pair formula), writes the new tokens into a copy of the cache, gathers each
sequence's row into a contiguous cache and runs the dense reference over it with the
mods in logical positions; output and updated caches are checked three ways
(tests/_harness.py) on every kernel path.
"""

from __future__ import annotations

import pytest
import torch

import flexattn
from flexattn import AuxRequest, create_block_mask, mods
from flexattn._compat import compiled_graph_count
from flexattn.reference import dense_math

import _harness as harness
from conftest import DEVICE


def _rotate_reference(x, cos, sin, positions, interleaved):
    """Rotary by complex multiplication: feature pairs as complex numbers times e^(i theta)."""
    half = cos.shape[-1]
    rot = x[..., :2 * half]
    if interleaved:
        pairs = torch.complex(rot[..., 0::2], rot[..., 1::2])
    else:
        pairs = torch.complex(rot[..., :half], rot[..., half:])
    turned = pairs * torch.complex(cos[positions], sin[positions])[:, None]
    parts = (torch.stack([turned.real, turned.imag], -1).flatten(-2) if interleaved
             else torch.cat([turned.real, turned.imag], -1))
    return torch.cat([parts, x[..., 2 * half:]], -1)


def _rotary_tables(gen, positions, rotary_dim, dtype=torch.float32):
    angles = torch.arange(positions)[:, None] * (0.5 + torch.rand(rotary_dim // 2, generator=gen))[None]
    return torch.cos(angles).to(DEVICE, dtype), torch.sin(angles).to(DEVICE, dtype)


def reference_step(q, k_cache, v_cache, k, v, seqlens, cos, sin, interleaved, rows, score_mod, mask_mod, scale):
    """(out, lse, k_cache', v_cache') of one step, on copies, in the inputs' dtype."""
    B, Hq, L, E = q.shape
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    rows = torch.arange(B, device=q.device) if rows is None else rows
    complex_ok = q.dtype in (torch.float32, torch.float64)
    if cos is not None:
        def rotate(x, pos):
            if complex_ok:
                return _rotate_reference(x, cos.to(x.dtype), sin.to(x.dtype), pos, interleaved)
            return _rotate_reference(x.float(), cos, sin, pos, interleaved).to(x.dtype)

        q = rotate(q, seqlens[:, None] + torch.arange(L, device=q.device))
    lengths = seqlens.clone()
    if k is not None:
        L_new = k.shape[2]
        pos = seqlens[:, None] + torch.arange(L_new, device=q.device)
        if cos is not None:
            k = rotate(k, pos)
        for b in range(B):
            for j in range(L_new):
                k_cache[rows[b], :, pos[b, j]] = k[b, :, j]
                v_cache[rows[b], :, pos[b, j]] = v[b, :, j]
        lengths = seqlens + L_new
    keys, values = k_cache[rows], v_cache[rows]

    def mask(b, h, q_idx, kv_idx):
        visible = kv_idx < lengths[b]
        return visible if mask_mod is None else visible & mask_mod(b, h, seqlens[b] + q_idx, kv_idx)

    def shifted_score(score, b, h, q_idx, kv_idx):
        return score if score_mod is None else score_mod(score, b, h, seqlens[b] + q_idx, kv_idx)

    S_max = k_cache.shape[2]
    block_mask = create_block_mask(mask, B, Hq, L, S_max, device=q.device, BLOCK_SIZE=16)
    out, lse, _ = dense_math(q, keys, values, shifted_score, block_mask.as_tuple(), scale, (), ())
    return out, lse, k_cache, v_cache


def run_step(*, dtype, B=3, Hq=4, Hkv=2, E=32, Ev=None, S_max=96, L=1, L_new=1, lengths=(5, 0, 40),
             rotary_dim=None, interleaved=False, cache_rows=None, make_mods=None, seed=0, compiled=False):
    gen = harness.generator(seed)
    Ev = Ev or E
    Bc = B if cache_rows is None else cache_rows[1]
    q = harness.randn(gen, B, Hq, L, E, dtype=dtype)
    k_cache = harness.randn(gen, Bc, Hkv, S_max, E, dtype=dtype)
    v_cache = harness.randn(gen, Bc, Hkv, S_max, Ev, dtype=dtype)
    k = harness.randn(gen, B, Hkv, L_new, E, dtype=dtype) if L_new else None
    v = harness.randn(gen, B, Hkv, L_new, Ev, dtype=dtype) if L_new else None
    seqlens = torch.tensor(lengths, device=DEVICE)
    rows = None if cache_rows is None else torch.tensor(cache_rows[0], device=DEVICE)
    cos = sin = None
    if rotary_dim:
        cos, sin = _rotary_tables(gen, S_max + L, rotary_dim)
    score_mod, mask_mod = make_mods(Hq) if make_mods else (None, None)
    scale = E ** -0.5

    def reference(q, k_cache, v_cache, k, v, cos, sin):
        return reference_step(q, k_cache, v_cache, k, v, seqlens, cos, sin, interleaved, rows, score_mod,
                              mask_mod, scale)

    golden, ref = harness.reference_runs(reference, (q, k_cache, v_cache, k, v, cos, sin))

    def step(q, k_cache, v_cache, k, v):
        out, aux = flexattn.flex_attention_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=seqlens, rotary_cos=cos, rotary_sin=sin,
            rotary_interleaved=interleaved, cache_batch_idx=rows, score_mod=score_mod, mask_mod=mask_mod,
            scale=scale, enable_gqa=Hq != Hkv, return_aux=AuxRequest(lse=True))
        return out, aux.lse

    if compiled:
        step = torch.compile(step, fullgraph=True)
    out, lse = step(q, k_cache, v_cache, k, v)
    harness.check_attention((out, lse), ref, golden, dtype, max_scores=False)
    for name, got, r, g in (("k_cache", k_cache, ref[2], golden[2]), ("v_cache", v_cache, ref[3], golden[3])):
        harness.check_three_way(name, got, r, g, dtype)
    return q, k_cache, v_cache


def _alibi_causal(Hq):
    slopes = mods.alibi_slopes(Hq, device=DEVICE)
    return mods.alibi_bias(slopes), mods.causal_mask


def _window_softcap(Hq):
    return mods.tanh_softcap(3.0), mods.sliding_window(8)


CASES = {
    "decode_gqa_rotary": dict(dtype=torch.float16, rotary_dim=32),
    "decode_interleaved_partial_rotary_cache_rows": dict(dtype=torch.float32, rotary_dim=16, interleaved=True,
                                                         cache_rows=([4, 0, 2], 5), Ev=16),
    "prefill_chunk_causal_alibi": dict(dtype=torch.float16, L=5, L_new=5, lengths=(0, 17, 60), rotary_dim=32,
                                       make_mods=_alibi_causal),
    "chunk_rows_window_softcap": dict(dtype=torch.float16, L=4, L_new=4, lengths=(30, 3, 70), rotary_dim=8,
                                      cache_rows=([1, 3, 0], 4), make_mods=_window_softcap, Hkv=1),
    "attend_without_append": dict(dtype=torch.float32, L_new=0, lengths=(9, 1, 96), make_mods=_window_softcap),
}


@pytest.mark.usefixtures("flexattn_kernels")
@pytest.mark.parametrize("case", sorted(CASES))
def test_step_matches_the_reference(case):
    run_step(**CASES[case])


@pytest.mark.usefixtures("inductor_runs_flexattn_kernels")
def test_compiled_step_matches_the_reference():
    run_step(**CASES["chunk_rows_window_softcap"], compiled=True)


@pytest.mark.workflow
@pytest.mark.usefixtures("flexattn_kernels")
@pytest.mark.parametrize("cache_rows", [None, ([1, 0], 3)], ids=["contiguous", "cache_rows"])
@pytest.mark.parametrize("mask_mod", [mods.causal_mask, None], ids=["causal", "lengths_only"])
def test_generation_under_compile_compiles_once(cache_rows, mask_mod):
    """32 steps of one new token, each step's output checked against the dense reference;
    the step compiles once, however long the sequences grow (without a mask_mod the
    block lists come from the lengths alone, the prologue's on a GPU)."""
    gen = harness.generator(7)
    B, Hq, Hkv, E, S_max, steps = 2, 4, 2, 16, 48, 32
    Bc = B if cache_rows is None else cache_rows[1]
    rows = None if cache_rows is None else torch.tensor(cache_rows[0], device=DEVICE)
    k_cache = torch.zeros(Bc, Hkv, S_max, E, device=DEVICE)
    v_cache = torch.zeros(Bc, Hkv, S_max, E, device=DEVICE)
    cos, sin = _rotary_tables(gen, S_max, E)
    seqlens = torch.tensor([3, 10], device=DEVICE)

    @torch.compile(fullgraph=True)
    def step(q, k, v, seqlens):
        return flexattn.flex_attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                                    rotary_cos=cos, rotary_sin=sin, cache_batch_idx=rows,
                                                    mask_mod=mask_mod, enable_gqa=True)

    graphs = None
    for i in range(steps):
        q, k, v = (harness.randn(gen, B, h, 1, E) for h in (Hq, Hkv, Hkv))
        expected = reference_step(q, k_cache, v_cache, k, v, seqlens, cos, sin, False, rows, None,
                                  mask_mod, E ** -0.5)
        out = step(q, k, v, seqlens)
        torch.testing.assert_close(out, expected[0], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(k_cache, expected[2], atol=1e-6, rtol=1e-6)
        if i == 0:
            graphs = compiled_graph_count()
        seqlens = seqlens + 1
    assert compiled_graph_count() == graphs, "a step after the first compiled again"


@pytest.mark.usefixtures("flexattn_kernels")
@pytest.mark.parametrize("layout", ["heads", "pages"])
def test_paged_step_matches_the_contiguous_reference(layout):
    """The same step on a PagedKVCache (pages of 16 tokens, shuffled) as on contiguous
    caches holding each slot's tokens: output, and the new tokens in the pool."""
    gen = harness.generator(11)
    B, Hq, Hkv, E, S_max, L = 3, 4, 2, 32, 64, 2
    lengths = torch.tensor([5, 0, 33], device=DEVICE)
    slots = torch.tensor([2, 0, 3], device=DEVICE)
    cache = flexattn.PagedKVCache(n_pages=16, page_size=16, max_slots=4, device=DEVICE, layout=layout,
                                  num_kv_heads=Hkv if layout == "pages" else None, max_pages_per_slot=4)
    cache.shuffle_free_pages(torch.Generator().manual_seed(1))
    k_pool, v_pool = cache.allocate(num_kv_heads=Hkv, head_dim=E, dtype=torch.float32)
    k_cache, v_cache = harness.randn(gen, B, Hkv, S_max, E), harness.randn(gen, B, Hkv, S_max, E)
    for b in range(B):
        n = int(lengths[b])
        cache.reserve(int(slots[b]), n + L)
        if n:
            cache.append(slots[b:b + 1], torch.arange(n, device=DEVICE)[None], k_cache[b:b + 1, :, :n],
                         v_cache[b:b + 1, :, :n], k_pool, v_pool)
    q, k, v = harness.randn(gen, B, Hq, L, E), harness.randn(gen, B, Hkv, L, E), harness.randn(gen, B, Hkv, L, E)
    cos, sin = _rotary_tables(gen, S_max, 16)
    # The "heads" layout without mods (the mask from the lengths alone), "pages" with them.
    score_mod, mask_mod = _alibi_causal(Hq) if layout == "pages" else (None, None)
    expected = reference_step(q, k_cache, v_cache, k, v, lengths, cos, sin, True, None, score_mod, mask_mod,
                              E ** -0.5)
    out = flexattn.flex_attention_with_kvcache(q, k_pool, v_pool, k, v, cache_seqlens=lengths, rotary_cos=cos,
                                               rotary_sin=sin, rotary_interleaved=True, page_cache=cache,
                                               slots=slots, score_mod=score_mod, mask_mod=mask_mod, enable_gqa=True)
    torch.testing.assert_close(out, expected[0], atol=2e-5, rtol=2e-5)
    new = lengths[:, None] + torch.arange(L, device=DEVICE)
    where = cache.pool_positions(slots, new)
    for b in range(B):
        torch.testing.assert_close(k_pool[0][:, where[b]], expected[2][b][:, new[b]], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(v_pool[0][:, where[b]], expected[3][b][:, new[b]])


# --------------------------------------------------------------------------------------
# The prologue kernel (rotary, append, length lists) against its torch reference
# --------------------------------------------------------------------------------------
PROLOGUE_CASES = {
    # name: (layout, rotary ("half", "interleaved", "partial" or None), L, L_new, dtype)
    "plain_half_decode": ("plain", "half", 1, 1, torch.float16),
    "plain_interleaved_chunk": ("plain", "interleaved", 3, 3, torch.float32),
    "plain_no_rotary": ("plain", None, 2, 2, torch.float16),
    "rows_partial_rotary": ("rows", "partial", 1, 2, torch.float32),
    "rows_no_new_tokens": ("rows", "half", 2, 0, torch.float16),
    "paged_heads": ("paged", "interleaved", 1, 1, torch.float16),
    "paged_pages_layout": ("paged_pages", "half", 2, 2, torch.float32),
}


def _strided(vector: torch.Tensor) -> torch.Tensor:
    """The same values as a view with stride 2."""
    return torch.stack([vector, torch.zeros_like(vector)], dim=1)[:, 0]


@pytest.mark.parametrize("case", sorted(PROLOGUE_CASES))
def test_prologue_kernel_matches_its_reference(case):
    """The Triton prologue (interpreted on the CPU) writes the caches and returns the
    rotated queries and block lists that the torch reference gives, for every layout (the
    pools as PagedKVCache lays them out, overlapping views for "pages"); head dims that
    are not powers of two (40, Ev 24) leave masked features in both rows; lengths,
    cache rows and slots come as strided views; one sequence ends on a block boundary."""
    layout, rotary, L, L_new, dtype = PROLOGUE_CASES[case]
    from flexattn.kvcache_prologue import launch, prologue_reference
    gen = harness.generator(21)
    B, Hq, Hkv, E, Ev, S_max = 3, 4, 2, 40, 24, 48
    seqlens = _strided(torch.tensor([0, 32 - L_new, 45 - L_new], dtype=torch.int32, device=DEVICE))
    rows = slots = page_table = None
    block, width, row_shift, page_size, page_stride = 16, 3, 0, 1, 1
    if layout == "rows":
        k_cache, v_cache = harness.randn(gen, 4, Hkv, S_max, E, dtype=dtype), harness.randn(gen, 4, Hkv, S_max, Ev, dtype=dtype)
        rows, row_shift = _strided(torch.tensor([3, 0, 2], device=DEVICE)), Hkv * S_max // block
    elif layout.startswith("paged"):
        pages = "pages" if layout == "paged_pages" else "heads"
        cache = flexattn.PagedKVCache(n_pages=12, page_size=16, max_slots=4, device=DEVICE, layout=pages,
                                      num_kv_heads=Hkv if pages == "pages" else None, max_pages_per_slot=3)
        cache.shuffle_free_pages(torch.Generator().manual_seed(2))
        slots = _strided(torch.tensor([1, 3, 0], device=DEVICE))
        for b in range(B):
            cache.reserve(int(slots[b]), int(seqlens[b]) + L_new)
        k_cache, v_cache = cache.allocate(num_kv_heads=Hkv, head_dim=E, dtype=dtype, value_head_dim=Ev)
        k_cache.copy_(harness.randn(gen, *k_cache.shape, dtype=dtype))
        v_cache.copy_(harness.randn(gen, *v_cache.shape, dtype=dtype))
        page_table, page_size, page_stride = cache.page_table, cache.page_size, cache.page_stride
    else:
        k_cache, v_cache = harness.randn(gen, B, Hkv, S_max, E, dtype=dtype), harness.randn(gen, B, Hkv, S_max, Ev, dtype=dtype)
    q = harness.randn(gen, B, Hq, L, E, dtype=dtype).transpose(1, 2).contiguous().transpose(1, 2)  # strided heads
    # New keys with features L_new apart (rotary partners read at the feature stride).
    key = harness.randn(gen, B, Hkv, E, L_new, dtype=dtype).transpose(2, 3) if L_new else None
    value = harness.randn(gen, B, Hkv, L_new, Ev, dtype=dtype) if L_new else None
    cos = sin = None
    if rotary:
        cos, sin = _rotary_tables(gen, S_max + 4, 16 if rotary == "partial" else E)
    args = (q, key, value, seqlens, rows, slots, page_table, cos, sin, rotary == "interleaved", block, width,
            row_shift, page_size, page_stride)

    def run(fn):
        if layout.startswith("paged"):  # fresh pools in the cache's own layout
            kc, vc = cache.allocate(num_kv_heads=Hkv, head_dim=E, dtype=dtype, value_head_dim=Ev)
            kc.copy_(k_cache)
            vc.copy_(v_cache)
        else:
            kc, vc = k_cache.clone(), v_cache.clone()
        out = fn(*args[:3], kc, vc, *args[3:])
        return (*out, kc, vc)

    got, expected = run(launch), run(prologue_reference)
    names = ("q", "kv_num", "kv_idx", "full_num", "full_idx", "k_cache", "v_cache")
    for name, g, e in zip(names, got, expected):
        if e is None:
            assert g is None, name
            continue
        tol = dict(atol=0, rtol=0) if not e.is_floating_point() or name == "v_cache" else {}
        torch.testing.assert_close(g, e, msg=lambda m: f"{case} {name}: {m}", **tol)


# --------------------------------------------------------------------------------------
# Bad input: a clear error before anything is written
# --------------------------------------------------------------------------------------
def _bad_inputs():
    q = torch.randn(2, 4, 1, 16, device=DEVICE)
    k_cache = torch.randn(2, 2, 32, 16, device=DEVICE)
    v_cache = torch.randn(2, 2, 32, 16, device=DEVICE)
    k = torch.randn(2, 2, 1, 16, device=DEVICE)
    v = torch.randn(2, 2, 1, 16, device=DEVICE)
    cos, sin = torch.ones(40, 8, device=DEVICE), torch.zeros(40, 8, device=DEVICE)
    good = dict(cache_seqlens=torch.tensor([3, 7], device=DEVICE), rotary_cos=cos, rotary_sin=sin, enable_gqa=True)
    return q, k_cache, v_cache, k, v, good


BAD = {
    "past_capacity": (dict(cache_seqlens=torch.tensor([3, 32])), r"cache_seqlens \+ the 1 new tokens must lie in \[0, 32\]"),
    "negative_length": (dict(cache_seqlens=torch.tensor([-1, 3])), r"cache_seqlens"),
    "short_rotary_table": (dict(rotary_cos=torch.ones(5, 8), rotary_sin=torch.zeros(5, 8)),
                           r"the rotary tables have 5 positions, the step needs 8"),
    "rotary_above_head_dim": (dict(rotary_cos=torch.ones(40, 9), rotary_sin=torch.zeros(40, 9)),
                              r"rotary_dim \(2 \* rotary_cos.shape\[1\] = 18\) must be between 2 and the head dim 16"),
    "rotary_sin_alone": (dict(rotary_cos=None), r"rotary_cos and rotary_sin go together"),
    "rotary_shapes_differ": (dict(rotary_sin=torch.zeros(40, 4)), r"rotary_sin must have rotary_cos's shape"),
    "cache_row_out_of_range": (dict(cache_batch_idx=torch.tensor([0, 2])), r"cache_batch_idx must lie in \[0, 2\)"),
    "cache_row_twice": (dict(cache_batch_idx=torch.tensor([1, 1])), r"name each cache row once"),
    "lengths_wrong_shape": (dict(cache_seqlens=torch.tensor([3])), r"cache_seqlens must be an int, or an int32/int64 tensor of shape \(2,\)"),
    "lengths_float": (dict(cache_seqlens=torch.tensor([3.0, 1.0])), r"cache_seqlens must be"),
    "no_gqa": (dict(enable_gqa=False), r"pass enable_gqa=True"),
    "slots_without_page_cache": (dict(slots=torch.tensor([0, 1])), r"slots name the sequences of a page_cache"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_refused_before_any_write(case):
    q, k_cache, v_cache, k, v, args = _bad_inputs()
    change, message = BAD[case]
    args.update({name: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for name, t in change.items()})
    before = (k_cache.clone(), v_cache.clone())
    with pytest.raises(ValueError, match=message):
        flexattn.flex_attention_with_kvcache(q, k_cache, v_cache, k, v, **args)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_bad_tensors_are_refused_before_any_write():
    q, k_cache, v_cache, k, v, args = _bad_inputs()
    before = k_cache.clone()
    for call, message in (
        (lambda: flexattn.flex_attention_with_kvcache(q, k_cache, v_cache, k.half(), v, **args), r"key must have query's dtype"),
        (lambda: flexattn.flex_attention_with_kvcache(q, k_cache, v_cache, k, None, **args), r"key and value go together"),
        (lambda: flexattn.flex_attention_with_kvcache(q, k_cache, v_cache[:, :, :16], k, v, **args),
         r"v_cache must have k_cache's batch, heads and length"),
        (lambda: flexattn.flex_attention_with_kvcache(q, k_cache[:1], v_cache[:1], k, v, **args),
         r"the cache has 1 rows for a batch of 2: pass cache_batch_idx"),
        (lambda: flexattn.flex_attention_with_kvcache(q, k_cache, v_cache, k[:, :, :, :8], v, **args),
         r"key must be \(B, Hkv, L_new, E\)"),
    ):
        with pytest.raises(ValueError, match=message):
            call()
    assert torch.equal(k_cache, before)


def test_a_cache_that_cannot_be_read_as_a_pool_is_refused_before_any_write():
    """With cache_batch_idx each cache row must start a KV block of the pool: Hkv * S_max
    = 2 * 20 is no multiple of 16."""
    q, _, _, k, v, args = _bad_inputs()
    k_cache, v_cache = torch.randn(3, 2, 20, 16, device=DEVICE), torch.randn(3, 2, 20, 16, device=DEVICE)
    before = (k_cache.clone(), v_cache.clone())
    with pytest.raises(ValueError, match=r"Hkv \* S_max \(40\) must be a multiple of 16"):
        flexattn.flex_attention_with_kvcache(q, k_cache, v_cache, k, v, cache_batch_idx=torch.tensor([2, 0], device=DEVICE),
                                             **{**args, "cache_seqlens": torch.tensor([3, 7], device=DEVICE)})
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


@pytest.mark.parametrize("new_tokens", [0, 1])
def test_lengths_past_a_slots_reserved_pages_are_refused(new_tokens):
    """A page_cache slot holds only its reserved pages: lengths past them (with or without
    new tokens, and on a slot with no pages) are an error, not a silently shorter row."""
    cache = flexattn.PagedKVCache(n_pages=8, page_size=16, max_slots=3, device=DEVICE, max_pages_per_slot=4)
    k_pool, v_pool = cache.allocate(num_kv_heads=2, head_dim=16, dtype=torch.float32)
    cache.reserve(0, 32)
    q = torch.randn(2, 2, 1, 16, device=DEVICE)
    k, v = (torch.randn(2, 2, new_tokens, 16, device=DEVICE) for _ in range(2)) if new_tokens else (None, None)
    before = k_pool.clone()
    for lengths, message in (([40 - new_tokens, 0], r"cache_seqlens\[0\] \+ the \d new tokens = 40 is past slot 0's "
                                                    r"reserved pages \(capacity 32 tokens\)"),
                             ([3, 5], r"cache_seqlens\[1\] .* past slot 2's reserved pages \(capacity 0 tokens\)")):
        with pytest.raises(ValueError, match=message):
            flexattn.flex_attention_with_kvcache(q, k_pool, v_pool, k, v, cache_seqlens=torch.tensor(lengths, device=DEVICE),
                                                 page_cache=cache, slots=torch.tensor([0, 2], device=DEVICE))
    assert torch.equal(k_pool, before)

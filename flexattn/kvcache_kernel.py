"""The prologue kernel of a KV-cache step (``kvcache_prologue``): rotary, append and the
length block lists in one launch. Imported on a GPU call's first use (Triton loads then).

What one program computes (grid ``(Q_ROWS + K_ROWS + 1, B)``; program (r, b), sequence b
with ``n = seqlens[b]`` tokens cached before the step):

* r < Q_ROWS (only with ROTARY; Q_ROWS = Hq * L): query row (h, t) = (r // L, r % L),
  rotated at position n + t, stored to the contiguous ``Q_OUT``.
* Q_ROWS <= r < Q_ROWS + K_ROWS (K_ROWS = Hkv * L_new): new key and value rows (h, t),
  the key rotated at position n + t when ROTARY, written into the cache at logical
  position n + t of the sequence's row (``ROWS[b]`` with HAS_ROWS, else b) or, with
  PAGED, at pool position ``PAGE_TABLE[SLOTS[b], p // PAGE_SIZE] * PAGE_STRIDE + p % PAGE_SIZE``.
* r = Q_ROWS + K_ROWS: the block lists of keys before ``n + L_new`` (FULL_NUM full
  blocks, then at most one partial block), as ``kvcache._length_blocks`` builds them with
  torch ops: full list entry j is block j, the partial list's entry j is block
  ``min(full + j, WIDTH - 1)``; block ids shifted by ``ROWS[b] * ROW_SHIFT`` (a cache read as
  a pool of rows) or, with PAGED, the slot's page ``max(PAGE_TABLE[slot, j], 0) *
  PAGE_BLOCKS``.

Rotary (``kvcache_prologue.apply_rotary``): features below ROTARY_DIM = 2 * HALF turn in pairs,
(i, i + HALF) half-split or (2i, 2i + 1) with INTERLEAVED, in float32; the rest pass.
A position outside the cache (values unchecked under torch.compile) is not written.

Constexprs: ROTARY, INTERLEAVED, PAGED, HAS_ROWS (layout choices); HALF; BLOCK_D (a power
of two at least both head dims; one row per program, so decoding's few rows fill the grid
across heads); BLOCK_W (block-list entries per step of the list program's loop).
"""

import triton
import triton.language as tl


@triton.jit
def rotate_row(x, ptr, offs, stride, pos, COS, SIN, stride_cos0, stride_cos1, stride_sin0, stride_sin1,
               HALF: tl.constexpr, INTERLEAVED: tl.constexpr, mask):
    """x (features offs of the row at ptr, stride apart) turned at position pos, in float32."""
    in_rot = offs < 2 * HALF
    if INTERLEAVED:
        partner = offs ^ 1
        sign = tl.where(offs % 2 == 0, -1.0, 1.0)
        col = offs // 2
    else:
        partner = tl.where(offs < HALF, offs + HALF, offs - HALF)
        sign = tl.where(offs < HALF, -1.0, 1.0)
        col = offs % HALF
    other = tl.load(ptr + partner * stride, mask=mask & in_rot, other=0.0).to(tl.float32)
    c = tl.load(COS + pos * stride_cos0 + col * stride_cos1, mask=mask & in_rot, other=1.0).to(tl.float32)
    s = tl.load(SIN + pos * stride_sin0 + col * stride_sin1, mask=mask & in_rot, other=0.0).to(tl.float32)
    return x.to(tl.float32) * c + sign * other * s

@triton.jit
def prologue_kernel(
    Q, Q_OUT, KEY, VALUE, K_CACHE, V_CACHE, SEQLENS, ROWS, SLOTS, PAGE_TABLE, COS, SIN,
    KV_NUM, KV_IDX, FULL_NUM, FULL_IDX,
    stride_qb, stride_qh, stride_ql, stride_qd,
    stride_kb, stride_kh, stride_kl, stride_kd,
    stride_vb, stride_vh, stride_vl, stride_vd,
    stride_kcb, stride_kch, stride_kcl, stride_kcd,
    stride_vcb, stride_vch, stride_vcl, stride_vcd,
    stride_cos0, stride_cos1, stride_sin0, stride_sin1, stride_pt0,
    HQ, L, HKV, L_NEW, S_MAX, QK_HEAD_DIM, V_HEAD_DIM,
    KV_BLOCK, WIDTH, ROW_SHIFT, PAGE_SIZE, PAGE_STRIDE, PAGE_BLOCKS, TABLE_WIDTH,
    ROTARY: tl.constexpr, INTERLEAVED: tl.constexpr, PAGED: tl.constexpr, HAS_ROWS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr,
):
    tl.static_assert(BLOCK_D >= 2 * HALF)
    r = tl.program_id(0)
    # int64 offsets: a head's or a batch row's stride times its index can pass 2**31
    off_b = tl.program_id(1).to(tl.int64)
    n = tl.load(SEQLENS + off_b).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    q_rows = HQ * L if ROTARY else 0
    k_rows = HKV * L_NEW
    if r < q_rows:
        off_h = (r // L).to(tl.int64)
        t = r % L
        q_ptr = Q + off_b * stride_qb + off_h * stride_qh + t * stride_ql
        in_d = offs_d < QK_HEAD_DIM
        x = tl.load(q_ptr + offs_d * stride_qd, mask=in_d, other=0.0)
        if ROTARY:
            x = rotate_row(x, q_ptr, offs_d, stride_qd, n + t, COS, SIN, stride_cos0, stride_cos1,
                           stride_sin0, stride_sin1, HALF, INTERLEAVED, in_d)
        out_ptr = Q_OUT + ((off_b * HQ + off_h) * L + t) * QK_HEAD_DIM
        tl.store(out_ptr + offs_d, x.to(Q_OUT.dtype.element_ty), mask=in_d)
    elif r < q_rows + k_rows:
        off_h = ((r - q_rows) // L_NEW).to(tl.int64)
        t = (r - q_rows) % L_NEW
        pos = n + t
        if PAGED:
            slot = tl.load(SLOTS + off_b).to(tl.int64)
            logical_page = tl.minimum(pos // PAGE_SIZE, TABLE_WIDTH - 1)
            page = tl.maximum(tl.load(PAGE_TABLE + slot * stride_pt0 + logical_page), 0).to(tl.int64)
            k_dst = K_CACHE + off_h * stride_kch + (page * PAGE_STRIDE + pos % PAGE_SIZE) * stride_kcl
            v_dst = V_CACHE + off_h * stride_vch + (page * PAGE_STRIDE + pos % PAGE_SIZE) * stride_vcl
            inside = (pos >= 0) & (pos < TABLE_WIDTH * PAGE_SIZE)
        else:
            row = off_b.to(tl.int64)
            if HAS_ROWS:
                row = tl.load(ROWS + off_b).to(tl.int64)
            k_dst = K_CACHE + row * stride_kcb + off_h * stride_kch + pos * stride_kcl
            v_dst = V_CACHE + row * stride_vcb + off_h * stride_vch + pos * stride_vcl
            inside = (pos >= 0) & (pos < S_MAX)
        k_ptr = KEY + off_b * stride_kb + off_h * stride_kh + t * stride_kl
        in_k = offs_d < QK_HEAD_DIM
        k = tl.load(k_ptr + offs_d * stride_kd, mask=in_k, other=0.0)
        if ROTARY:
            k = rotate_row(k, k_ptr, offs_d, stride_kd, pos, COS, SIN, stride_cos0, stride_cos1,
                           stride_sin0, stride_sin1, HALF, INTERLEAVED, in_k)
        # a position past the cache writes no feature
        tl.store(k_dst + offs_d * stride_kcd, k.to(K_CACHE.dtype.element_ty),
                 mask=offs_d < tl.where(inside, QK_HEAD_DIM, 0))
        in_v = offs_d < V_HEAD_DIM
        v = tl.load(VALUE + off_b * stride_vb + off_h * stride_vh + t * stride_vl + offs_d * stride_vd,
                    mask=in_v, other=0.0)
        tl.store(v_dst + offs_d * stride_vcd, v.to(V_CACHE.dtype.element_ty),
                 mask=offs_d < tl.where(inside, V_HEAD_DIM, 0))
    else:
        length = n + L_NEW
        full = length // KV_BLOCK
        tl.store(FULL_NUM + off_b, full.to(tl.int32))
        tl.store(KV_NUM + off_b, (length % KV_BLOCK > 0).to(tl.int32))
        for start in range(0, WIDTH, BLOCK_W):
            offs_w = start + tl.arange(0, BLOCK_W)
            in_w = offs_w < WIDTH
            partial = tl.minimum(full + offs_w, WIDTH - 1)
            if PAGED:
                slot = tl.load(SLOTS + off_b).to(tl.int64)
                full_ids = tl.maximum(tl.load(PAGE_TABLE + slot * stride_pt0 + offs_w, mask=in_w, other=0), 0)
                partial_ids = tl.maximum(tl.load(PAGE_TABLE + slot * stride_pt0 + partial, mask=in_w, other=0), 0)
                full_ids = full_ids * PAGE_BLOCKS
                partial_ids = partial_ids * PAGE_BLOCKS
            else:
                full_ids = offs_w
                partial_ids = partial
                if HAS_ROWS:
                    shift = tl.load(ROWS + off_b) * ROW_SHIFT
                    full_ids += shift
                    partial_ids += shift
            tl.store(FULL_IDX + off_b * WIDTH + offs_w, full_ids.to(tl.int32), mask=in_w)
            tl.store(KV_IDX + off_b * WIDTH + offs_w, partial_ids.to(tl.int32), mask=in_w)

"""The GPU prologue of a KV-cache step: rotary, append and the length block mask in one launch.

``flex_attention_with_kvcache`` runs a step as this prologue and the decode (or forward)
kernel. Written as torch ops, the work before attention was ten kernels under
torch.compile (rotating queries and keys, two cache writes, six small kernels building
the block lists from the lengths); on a GPU each costs a launch and a few microseconds of
latency, more than the attention itself at batch 1 (``bench/DECISIONS.md``
``kvcache-step-prologue``). Here it is one Triton kernel.

What one program computes (grid ``(Q_ROWS + K_ROWS + 1, B)``; program (r, b), sequence b
with ``n = seqlens[b]`` tokens cached before the step):

* r < Q_ROWS (only with ROTARY; Q_ROWS = Hq * L): query row (h, t) = (r // L, r % L),
  rotated at position n + t, stored to the contiguous ``Q_OUT``.
* Q_ROWS <= r < Q_ROWS + K_ROWS (K_ROWS = Hkv * L_new): new key and value rows (h, t),
  the key rotated at position n + t when ROTARY, written into the cache at logical
  position n + t of the sequence's row (``ROWS[b]`` with HAS_ROWS, else b) or, with PAGED, at pool position
  ``PAGE_TABLE[SLOTS[b], p // PAGE_SIZE] * PAGE_STRIDE + p % PAGE_SIZE``.
* r = Q_ROWS + K_ROWS: the length after the step, ``LENGTHS[b] = n + L_new``, and the
  block lists of keys before it (FULL_NUM full
  blocks, then at most one partial block), as ``kvcache._length_blocks`` builds them with
  torch ops: full list entry j is block j, the partial list's entry j is block
  ``min(full + j, WIDTH - 1)``; block ids shifted by ``ROWS[b] * ROW_SHIFT`` (a cache read as
  a pool of rows) or, with PAGED, the slot's page ``max(PAGE_TABLE[slot, j], 0) *
  PAGE_BLOCKS``.

Rotary (``kvcache.apply_rotary``): features below ROTARY_DIM = 2 * HALF turn in pairs,
(i, i + HALF) half-split or (2i, 2i + 1) with INTERLEAVED, in float32; the rest pass.
A position past the cache (values unchecked under torch.compile) is not written.

Constexprs: ROTARY, INTERLEAVED, PAGED, HAS_ROWS (layout choices); HALF; BLOCK_D (a power of two
at least both head dims; one row per program, so decoding's few rows fill the grid
across heads); BLOCK_W (block-list entries per step of the list program's loop).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["apply_rotary", "kv_step_prologue", "prologue_reference"]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool = False) -> Tensor:
    """Rotary embeddings on the first ``2 * cos.shape[-1]`` features of ``x``.

    ``x``: (B, H, L, D); ``cos``, ``sin``: (S_rot, R / 2); ``positions``: (B, L) rows of
    the tables. Half-split layout (GPT-NeoX) rotates feature i with i + R/2;
    ``interleaved`` (GPT-J) rotates 2i with 2i + 1. Computed in float32, returned in
    x's dtype; features past R pass through.
    """
    half = cos.shape[-1]
    rot = x[..., :2 * half].float()
    c = cos[positions].float()[:, None]  # (B, 1, L, R/2)
    s = sin[positions].float()[:, None]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        rotated = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return torch.cat([rotated.to(x.dtype), x[..., 2 * half:]], dim=-1)


try:  # Triton comes with torch's CUDA builds; CPU-only installs take the torch ops below
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:
    @triton.jit
    def rotate_row(x, ptr, offs, pos, COS, SIN, stride_cos0, stride_cos1, stride_sin0, stride_sin1,
                   HALF: tl.constexpr, INTERLEAVED: tl.constexpr, mask):
        """x (the row at ptr + offs) turned at position pos, in float32."""
        in_rot = offs < 2 * HALF
        if INTERLEAVED:
            partner = offs ^ 1
            sign = tl.where(offs % 2 == 0, -1.0, 1.0)
            col = offs // 2
        else:
            partner = tl.where(offs < HALF, offs + HALF, offs - HALF)
            sign = tl.where(offs < HALF, -1.0, 1.0)
            col = offs % HALF
        other = tl.load(ptr + partner, mask=mask & in_rot, other=0.0).to(tl.float32)
        c = tl.load(COS + pos * stride_cos0 + col * stride_cos1, mask=mask & in_rot, other=1.0).to(tl.float32)
        s = tl.load(SIN + pos * stride_sin0 + col * stride_sin1, mask=mask & in_rot, other=0.0).to(tl.float32)
        return x.to(tl.float32) * c + sign * other * s

    @triton.jit
    def _prologue_kernel(
        Q, Q_OUT, KEY, VALUE, K_CACHE, V_CACHE, SEQLENS, ROWS, SLOTS, PAGE_TABLE, COS, SIN,
        LENGTHS, KV_NUM, KV_IDX, FULL_NUM, FULL_IDX,
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
        off_b = tl.program_id(1)
        n = tl.load(SEQLENS + off_b).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        q_rows = HQ * L if ROTARY else 0
        k_rows = HKV * L_NEW
        if r < q_rows:
            off_h = r // L
            t = r % L
            q_ptr = Q + off_b * stride_qb + off_h * stride_qh + t * stride_ql
            in_d = offs_d < QK_HEAD_DIM
            x = tl.load(q_ptr + offs_d * stride_qd, mask=in_d, other=0.0)
            if ROTARY:
                x = rotate_row(x, q_ptr, offs_d * stride_qd, n + t, COS, SIN, stride_cos0, stride_cos1,
                               stride_sin0, stride_sin1, HALF, INTERLEAVED, in_d)
            out_ptr = Q_OUT + ((off_b * HQ + off_h) * L + t) * QK_HEAD_DIM
            tl.store(out_ptr + offs_d, x.to(Q_OUT.dtype.element_ty), mask=in_d)
        elif r < q_rows + k_rows:
            off_h = (r - q_rows) // L_NEW
            t = (r - q_rows) % L_NEW
            pos = n + t
            if PAGED:
                slot = tl.load(SLOTS + off_b).to(tl.int64)
                logical_page = tl.minimum(pos // PAGE_SIZE, TABLE_WIDTH - 1)
                page = tl.maximum(tl.load(PAGE_TABLE + slot * stride_pt0 + logical_page), 0).to(tl.int64)
                k_dst = K_CACHE + off_h * stride_kch + (page * PAGE_STRIDE + pos % PAGE_SIZE) * stride_kcl
                v_dst = V_CACHE + off_h * stride_vch + (page * PAGE_STRIDE + pos % PAGE_SIZE) * stride_vcl
                inside = pos < TABLE_WIDTH * PAGE_SIZE
            else:
                row = off_b.to(tl.int64)
                if HAS_ROWS:
                    row = tl.load(ROWS + off_b).to(tl.int64)
                k_dst = K_CACHE + row * stride_kcb + off_h * stride_kch + pos * stride_kcl
                v_dst = V_CACHE + row * stride_vcb + off_h * stride_vch + pos * stride_vcl
                inside = pos < S_MAX
            k_ptr = KEY + off_b * stride_kb + off_h * stride_kh + t * stride_kl
            in_k = offs_d < QK_HEAD_DIM
            k = tl.load(k_ptr + offs_d * stride_kd, mask=in_k, other=0.0)
            if ROTARY:
                k = rotate_row(k, k_ptr, offs_d * stride_kd, pos, COS, SIN, stride_cos0, stride_cos1,
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
            tl.store(LENGTHS + off_b, length.to(tl.int32))
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


def _next_power_of_2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def launch(q: Tensor, key: Tensor | None, value: Tensor | None, k_cache: Tensor, v_cache: Tensor,
           seqlens: Tensor, rows: Tensor | None, slots: Tensor | None, page_table: Tensor | None,
           cos: Tensor | None, sin: Tensor | None, interleaved: bool, kv_block: int, width: int,
           row_shift: int, page_size: int, page_stride: int, launcher=None):
    """Run the prologue; returns (q_out or None, lengths, kv_num, kv_idx, full_num,
    full_idx): the lengths after the step and the counts (B,), the lists (B, width), int32. ``launcher`` wraps the kernel (``wrap_triton``
    inside the custom op)."""
    B, Hq, L, E = q.shape
    Hkv = k_cache.shape[1]
    Ev = v_cache.shape[-1]
    L_new = 0 if key is None else key.shape[2]
    rotary = cos is not None
    device = q.device
    q_out = torch.empty((B, Hq, L, E), dtype=q.dtype, device=device) if rotary else q.new_empty(0)
    lengths = torch.empty((B,), dtype=torch.int32, device=device)
    kv_num = torch.empty((B,), dtype=torch.int32, device=device)
    full_num = torch.empty((B,), dtype=torch.int32, device=device)
    kv_idx = torch.empty((B, width), dtype=torch.int32, device=device)
    full_idx = torch.empty((B, width), dtype=torch.int32, device=device)
    # Absent tensors are never read; seqlens stands in (not a mutated tensor: the
    # compiler must not see a written argument twice).
    key = seqlens.view(1, 1, 1, -1) if key is None else key
    value = seqlens.view(1, 1, 1, -1) if value is None else value
    paged, has_rows = page_table is not None, rows is not None
    rows = seqlens if rows is None else rows
    slots = seqlens if slots is None else slots
    page_table = seqlens.view(1, -1) if page_table is None else page_table
    table_width = page_table.shape[-1] if paged else 1
    cos_t = cos if rotary else seqlens.view(1, -1)
    sin_t = sin if rotary else seqlens.view(1, -1)
    half = cos.shape[-1] if rotary else 0
    kernel = _prologue_kernel
    if launcher is not None:
        kernel = launcher(kernel)
    grid = ((Hq * L if rotary else 0) + Hkv * L_new + 1, B)
    kernel[grid](
        q, q_out, key, value, k_cache, v_cache, seqlens, rows, slots, page_table, cos_t, sin_t,
        lengths, kv_num, kv_idx, full_num, full_idx,
        *q.stride(), *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        *cos_t.stride(), *sin_t.stride(), page_table.stride(0),
        Hq, L, Hkv, L_new, k_cache.shape[2], E, Ev,
        kv_block, width, row_shift, page_size, page_stride, page_stride // page_size if paged else 1, table_width,
        ROTARY=rotary, INTERLEAVED=interleaved, PAGED=paged, HAS_ROWS=has_rows, HALF=half,
        BLOCK_D=_next_power_of_2(max(E, Ev)), BLOCK_W=min(1024, _next_power_of_2(width)),
    )
    return (q_out if rotary else None), lengths, kv_num, kv_idx, full_num, full_idx


def prologue_reference(q: Tensor, key: Tensor | None, value: Tensor | None, k_cache: Tensor, v_cache: Tensor,
                       seqlens: Tensor, rows: Tensor | None, slots: Tensor | None, page_table: Tensor | None,
                       cos: Tensor | None, sin: Tensor | None, interleaved: bool, kv_block: int, width: int,
                       row_shift: int, page_size: int, page_stride: int):
    """The prologue in torch ops (the CPU path, and the kernel's reference): the same
    writes and the same returns as ``launch``."""
    B, _, L, _ = q.shape
    device = q.device
    n = seqlens.long()
    q_out = None
    if cos is not None:
        q_out = apply_rotary(q, cos, sin, n[:, None] + torch.arange(L, device=device), interleaved)
    L_new = 0
    if key is not None:
        L_new = key.shape[2]
        positions = n[:, None] + torch.arange(L_new, device=device)  # (B, L_new)
        if cos is not None:
            key = apply_rotary(key, cos, sin, positions, interleaved)
        Hkv = k_cache.shape[1]
        if page_table is not None:
            table_width = page_table.shape[-1]
            logical_page = (positions // page_size).clamp(max=table_width - 1)
            page = page_table[slots.long()[:, None], logical_page].clamp(min=0).long()
            where = (page * page_stride + positions % page_size).reshape(-1)
            k_cache[:, :, where] = key.transpose(0, 1).reshape(1, Hkv, B * L_new, key.shape[-1])
            v_cache[:, :, where] = value.transpose(0, 1).reshape(1, Hkv, B * L_new, value.shape[-1])
        else:
            row = torch.arange(B, device=device) if rows is None else rows.long()
            where = (row.view(B, 1, 1), torch.arange(Hkv, device=device).view(1, Hkv, 1),
                     positions.view(B, 1, L_new))
            k_cache.index_put_(where, key)
            v_cache.index_put_(where, value)
    lengths = n + L_new
    full = lengths // kv_block
    ids = torch.arange(width, device=device)
    partial = (ids + full[:, None]).clamp(max=width - 1)
    if page_table is not None:
        table = page_table[slots.long()].long()
        blocks = page_stride // page_size
        full_idx = table[:, :width].clamp(min=0) * blocks
        kv_idx = torch.gather(table, 1, partial).clamp(min=0) * blocks
    else:
        shift = 0 if rows is None else rows.long()[:, None] * row_shift
        full_idx = ids[None] + shift
        kv_idx = partial + shift
    return (q_out, lengths.to(torch.int32), (lengths % kv_block > 0).to(torch.int32), kv_idx.to(torch.int32),
            full.to(torch.int32), full_idx.expand(B, width).to(torch.int32))


@torch.library.triton_op("flexattn::kv_step_prologue", mutates_args={"k_cache", "v_cache"})
def kv_step_prologue(q: Tensor, key: Tensor | None, value: Tensor | None, k_cache: Tensor, v_cache: Tensor,
                     seqlens: Tensor, rows: Tensor | None, slots: Tensor | None, page_table: Tensor | None,
                     cos: Tensor | None, sin: Tensor | None, interleaved: bool, kv_block: int, width: int,
                     row_shift: int, page_size: int, page_stride: int
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Rotate, append, list the blocks: the Triton kernel on CUDA, torch ops elsewhere.
    Returns (q rotated, or an empty tensor without rotary tables; the lengths after the
    step (B,); kv_num (B,), kv_idx (B, width), full_num (B,), full_idx (B, width)), int32."""
    args = (q, key, value, k_cache, v_cache, seqlens, rows, slots, page_table, cos, sin, interleaved, kv_block,
            width, row_shift, page_size, page_stride)
    if q.device.type == "cuda":
        q_out, *rest = launch(*args, launcher=torch.library.wrap_triton)
    else:
        q_out, *rest = prologue_reference(*args)
    return (q.new_empty(0) if q_out is None else q_out, *rest)

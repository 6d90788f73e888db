"""The GPU prologue of a KV-cache step: rotary, append and the length block mask in one launch.

``flex_attention_with_kvcache`` runs a step as this prologue and the decode (or forward)
kernel. Written as torch ops, the work before attention was ten kernels under
torch.compile (rotating queries and keys, two cache writes, six small kernels building
the block lists from the lengths); on a GPU each costs a launch and a few microseconds of
latency, more than the attention itself at batch 1 (``bench/DECISIONS.md``
``kvcache-step-prologue``). Here it is one Triton kernel.

The kernel and its description: ``kvcache_kernel.py``; ``prologue_reference`` here is the
same work in torch ops (the CPU path and the kernel's reference). The operator is defined
when Dynamo is imported or at the first call, so that ``import flexattn`` stays light.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _compat

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


def launch(q: Tensor, key: Tensor | None, value: Tensor | None, k_cache: Tensor, v_cache: Tensor,
           seqlens: Tensor, rows: Tensor | None, slots: Tensor | None, page_table: Tensor | None,
           cos: Tensor | None, sin: Tensor | None, interleaved: bool, kv_block: int, width: int,
           row_shift: int, page_size: int, page_stride: int, launcher=None):
    """Run the prologue; returns (q_out or None, kv_num, kv_idx, full_num, full_idx), the
    counts (B,) and lists (B, width) int32. ``launcher`` wraps the kernel (``wrap_triton``
    inside the custom op)."""
    B, Hq, L, E = q.shape
    Hkv = k_cache.shape[1]
    Ev = v_cache.shape[-1]
    L_new = 0 if key is None else key.shape[2]
    rotary = cos is not None
    device = q.device
    q_out = torch.empty((B, Hq, L, E), dtype=q.dtype, device=device) if rotary else q.new_empty(0)
    kv_num = torch.empty((B,), dtype=torch.int32, device=device)
    full_num = torch.empty((B,), dtype=torch.int32, device=device)
    kv_idx = torch.empty((B, width), dtype=torch.int32, device=device)
    full_idx = torch.empty((B, width), dtype=torch.int32, device=device)
    # The kernel reads these (B,) vectors at unit stride.
    seqlens = seqlens.contiguous()
    rows = None if rows is None else rows.contiguous()
    slots = None if slots is None else slots.contiguous()
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
    import triton

    from .kvcache_kernel import prologue_kernel as kernel

    if launcher is not None:
        kernel = launcher(kernel)
    grid = ((Hq * L if rotary else 0) + Hkv * L_new + 1, B)
    kernel[grid](
        q, q_out, key, value, k_cache, v_cache, seqlens, rows, slots, page_table, cos_t, sin_t,
        kv_num, kv_idx, full_num, full_idx,
        *q.stride(), *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        *cos_t.stride(), *sin_t.stride(), page_table.stride(0),
        Hq, L, Hkv, L_new, k_cache.shape[2], E, Ev,
        kv_block, width, row_shift, page_size, page_stride, page_stride // page_size if paged else 1, table_width,
        ROTARY=rotary, INTERLEAVED=interleaved, PAGED=paged, HAS_ROWS=has_rows, HALF=half,
        BLOCK_D=triton.next_power_of_2(max(E, Ev)), BLOCK_W=min(1024, triton.next_power_of_2(width)),
    )
    return (q_out if rotary else None), kv_num, kv_idx, full_num, full_idx


def prologue_reference(q: Tensor, key: Tensor | None, value: Tensor | None, k_cache: Tensor, v_cache: Tensor,
                       seqlens: Tensor, rows: Tensor | None, slots: Tensor | None, page_table: Tensor | None,
                       cos: Tensor | None, sin: Tensor | None, interleaved: bool, kv_block: int, width: int,
                       row_shift: int, page_size: int, page_stride: int):
    """The prologue in torch ops (the CPU path, and the kernel's reference): the same
    writes and returns as ``launch`` for positions inside the cache. A position past it
    (possible only where values go unchecked, under torch.compile) is dropped by the
    kernel; here a contiguous cache raises IndexError and a paged one writes where
    ``PagedKVCache.append`` would (the last table entry, or pool page 0)."""
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
    return (q_out, (lengths % kv_block > 0).to(torch.int32), kv_idx.to(torch.int32), full.to(torch.int32),
            full_idx.expand(B, width).to(torch.int32))


def _step_prologue(q: Tensor, key: Tensor | None, value: Tensor | None, k_cache: Tensor, v_cache: Tensor,
                   seqlens: Tensor, rows: Tensor | None, slots: Tensor | None, page_table: Tensor | None,
                   cos: Tensor | None, sin: Tensor | None, interleaved: bool, kv_block: int, width: int,
                   row_shift: int, page_size: int, page_stride: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """flexattn::kv_step_prologue: rotate, append, list the blocks; the Triton kernel on
    CUDA, torch ops elsewhere.
    Returns (q rotated, or an empty tensor without rotary tables; kv_num (B,), kv_idx
    (B, width), full_num (B,), full_idx (B, width)), int32 lists."""
    args = (q, key, value, k_cache, v_cache, seqlens, rows, slots, page_table, cos, sin, interleaved, kv_block,
            width, row_shift, page_size, page_stride)
    if q.device.type == "cuda":
        q_out, *lists = launch(*args, launcher=torch.library.wrap_triton)
    else:
        q_out, *lists = prologue_reference(*args)
    return (q.new_empty(0) if q_out is None else q_out, *lists)


_OPERATOR = None


def kv_step_prologue(*args):
    """Run ``flexattn::kv_step_prologue`` (``_step_prologue``'s arguments), defining the
    operator on first use."""
    return prologue_operator()(*args)


def prologue_operator():
    """The ``torch.library.triton_op`` of the prologue (its kernel visible to Inductor,
    the cache writes declared as mutations), defined once."""
    global _OPERATOR
    if _OPERATOR is None:
        _OPERATOR = torch.library.triton_op("flexattn::kv_step_prologue", _step_prologue,
                                            mutates_args={"k_cache", "v_cache"})
    return _OPERATOR


# Defined before Dynamo traces a step (a definition inside a trace would break the graph).
_compat.when_dynamo_imported(prologue_operator)

"""A library of common mask_mods and score_mods, as small named factories.

A *mask_mod* ``(b, h, q_idx, kv_idx) -> bool`` says which (query, key) pairs may attend;
a *score_mod* ``(score, b, h, q_idx, kv_idx) -> score`` rewrites one attention logit.
All arguments are 0-d tensors when the kernels call them (and batched tensors under
``torch.vmap``), so every function here uses only torch ops on its arguments and on the
tensors it captured, indexes captured tensors with the index arguments, and never
branches in Python on a tensor value. Each returned function carries a descriptive
``__name__`` (it shows up in ``BlockMask`` reprs, traces and benchmark tables).

Tensors are captured by reference: move them to the attention's device before use, and
a captured tensor with ``requires_grad=True`` (e.g. learnable ALiBi slopes or a bias
table) receives gradients through flex_attention's backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = [
    "alibi",
    "alibi_bias",
    "alibi_slopes",
    "causal_mask",
    "decoupled_rope",
    "document_mask",
    "document_mask_from_offsets",
    "prefix_lm",
    "relative_bias",
    "sliding_window",
    "tanh_softcap",
]

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


def _require_positive_int(value, argument: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{argument} must be a positive int, got {value!r}")


def _require_tensor(value, argument: str, dims: tuple[int, ...]) -> None:
    if not isinstance(value, Tensor):
        raise TypeError(f"{argument} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() not in dims:
        expected = " or ".join(f"{d}-D" for d in dims)
        raise ValueError(f"{argument} must be {expected}, got shape {tuple(value.shape)}")


def _lookup(table: Tensor, *indices: Tensor) -> Tensor:
    """``table[indices]`` for 0-d index tensors, as a single ``aten.index`` op.

    Plain ``table[i]`` turns a 0-d tensor index into a Python int, which fake-tensor
    tracing and Dynamo cannot do without a data-dependent guard; ``aten.index`` keeps
    the index a tensor, so the lookup traces and batches under vmap.
    """
    return torch.ops.aten.index.Tensor(table, list(indices))


# --------------------------------------------------------------------------------------
# mask_mods
# --------------------------------------------------------------------------------------


def causal_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Causal mask_mod: ``q_idx >= kv_idx`` (a query sees itself and earlier keys).

    Query and key positions are counted from the start of their own sequences, so with
    Q_LEN != KV_LEN the diagonal starts at the top-left corner.
    """
    return q_idx >= kv_idx


def sliding_window(window: int, causal: bool = True) -> MaskMod:
    """Sliding-window (local) attention of width ``window`` tokens.

    causal=True:  ``0 <= q_idx - kv_idx < window`` (itself and the window-1 keys before).
    causal=False: ``|q_idx - kv_idx| < window`` (window-1 keys on each side).
    """
    _require_positive_int(window, "window")

    if causal:

        def mask_mod(b, h, q_idx, kv_idx):
            distance = q_idx - kv_idx
            return (distance >= 0) & (distance < window)

        mask_mod.__name__ = f"sliding_window_{window}_causal"
    else:

        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx).abs() < window

        mask_mod.__name__ = f"sliding_window_{window}"
    return mask_mod


def prefix_lm(prefix_len: int | Tensor) -> MaskMod:
    """Prefix-LM mask: the prefix is attended bidirectionally, the rest causally.

    Formula: ``(kv_idx < prefix_len) | (q_idx >= kv_idx)``. ``prefix_len`` is an int
    shared by the batch, or an integer tensor of shape (B,) with one prefix length per
    batch element (indexed by ``b``).
    """
    if isinstance(prefix_len, Tensor):
        _require_tensor(prefix_len, "prefix_len", (1,))

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx < _lookup(prefix_len, b)) | (q_idx >= kv_idx)

        mask_mod.__name__ = "prefix_lm_per_batch"
    else:
        if isinstance(prefix_len, bool) or not isinstance(prefix_len, int) or prefix_len < 0:
            raise ValueError(
                f"prefix_len must be a non-negative int or a (B,) tensor, got {prefix_len!r}"
            )

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx < prefix_len) | (q_idx >= kv_idx)

        mask_mod.__name__ = f"prefix_lm_{prefix_len}"
    return mask_mod


def document_mask(doc_ids: Tensor) -> MaskMod:
    """Block-diagonal mask of packed documents: attend only within the same document.

    ``doc_ids`` holds one document id per token, shape (S,) shared by the batch or (B, S)
    per batch element; S must cover both Q_LEN and KV_LEN (self-attention over a packed
    sequence). Formula: ``doc_ids[q_idx] == doc_ids[kv_idx]`` (with ``[b, .]`` for 2-D
    ids). Combine with causal_mask through ``and_masks`` for causal packed training.
    """
    _require_tensor(doc_ids, "doc_ids", (1, 2))
    if doc_ids.dtype.is_floating_point or doc_ids.dtype.is_complex:
        raise TypeError(f"doc_ids must be an integer tensor, got {doc_ids.dtype}")

    if doc_ids.dim() == 1:

        def mask_mod(b, h, q_idx, kv_idx):
            return _lookup(doc_ids, q_idx) == _lookup(doc_ids, kv_idx)

    else:

        def mask_mod(b, h, q_idx, kv_idx):
            return _lookup(doc_ids, b, q_idx) == _lookup(doc_ids, b, kv_idx)

    mask_mod.__name__ = "document_mask"
    return mask_mod


def document_mask_from_offsets(cu_seqlens: Tensor, total_len: int) -> MaskMod:
    """Document mask from cumulative sequence offsets (the varlen ``cu_seqlens`` layout).

    ``cu_seqlens`` is a 1-D non-decreasing integer tensor ``[0, end_0, end_1, ...]`` of
    N+1 offsets for N documents; token t belongs to document d when
    ``cu_seqlens[d] <= t < cu_seqlens[d + 1]``. Tokens at or after ``cu_seqlens[-1]``
    (padding up to ``total_len``) form one more document of their own, so they never
    attend to real tokens. Returns ``document_mask(ids)`` with ids of shape (total_len,).
    """
    _require_tensor(cu_seqlens, "cu_seqlens", (1,))
    _require_positive_int(total_len, "total_len")
    if cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must hold at least one offset")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex:
        raise TypeError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
    positions = torch.arange(total_len, device=cu_seqlens.device)
    doc_ids = torch.bucketize(positions, cu_seqlens[1:].to(positions.dtype), right=True)
    mask_mod = document_mask(doc_ids)
    mask_mod.__name__ = "document_mask_from_offsets"
    return mask_mod


# --------------------------------------------------------------------------------------
# score_mods
# --------------------------------------------------------------------------------------


def alibi_slopes(num_heads: int, device=None) -> Tensor:
    """The standard ALiBi head slopes, float32 of shape (num_heads,).

    For a power of two n: ``2 ** (-8 * (i + 1) / n)``, i = 0..n-1. Otherwise the slopes
    of the largest power of two m < n, followed by every other slope of 2m until n.
    """
    _require_positive_int(num_heads, "num_heads")

    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    power = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = geometric(power)
    if power < num_heads:
        slopes += geometric(2 * power)[0::2][: num_heads - power]
    return torch.tensor(slopes, dtype=torch.float32, device=device)


def alibi_bias(slopes: Tensor) -> ScoreMod:
    """ALiBi score_mod with given per-head slopes: ``score + slopes[h] * (kv_idx - q_idx)``.

    ``slopes`` has shape (H,); it may require grad (learnable slopes). The bias is 0 on
    the diagonal and falls linearly with distance for keys before the query.
    """
    _require_tensor(slopes, "slopes", (1,))

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + _lookup(slopes, h) * (kv_idx - q_idx)

    score_mod.__name__ = f"alibi_bias_{slopes.numel()}_heads"
    return score_mod


def alibi(num_heads: int, device=None) -> ScoreMod:
    """ALiBi score_mod with the standard slopes for ``num_heads`` heads (see alibi_slopes)."""
    score_mod = alibi_bias(alibi_slopes(num_heads, device=device))
    score_mod.__name__ = f"alibi_{num_heads}_heads"
    return score_mod


def tanh_softcap(cap: float) -> ScoreMod:
    """Logit soft-capping: ``cap * tanh(score / cap)`` keeps scores in (-cap, cap)."""
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
        raise ValueError(f"cap must be a positive number, got {cap!r}")
    cap = float(cap)

    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    score_mod.__name__ = f"tanh_softcap_{cap:g}"
    return score_mod


def relative_bias(table: Tensor) -> ScoreMod:
    """Learned relative-position bias: ``score + table[..., kv_idx - q_idx + S - 1]``.

    ``table`` has shape (H, 2*S - 1), one row per head, or (2*S - 1,) shared by all
    heads; entry ``S - 1 + d`` is the bias for ``kv_idx - q_idx = d``. Distances beyond
    ±(S - 1) use the edge entries (clipped), so the mod is safe for any length. The
    table may require grad.
    """
    _require_tensor(table, "table", (1, 2))
    width = table.shape[-1]
    if width % 2 != 1:
        raise ValueError(
            f"table's last dim must be 2*S - 1 (odd) to cover distances -(S-1)..S-1, got {width}"
        )
    max_distance = (width - 1) // 2

    if table.dim() == 2:

        def score_mod(score, b, h, q_idx, kv_idx):
            offset = (kv_idx - q_idx).clamp(-max_distance, max_distance) + max_distance
            return score + _lookup(table, h, offset)

    else:

        def score_mod(score, b, h, q_idx, kv_idx):
            offset = (kv_idx - q_idx).clamp(-max_distance, max_distance) + max_distance
            return score + _lookup(table, offset)

    score_mod.__name__ = f"relative_bias_{max_distance + 1}"
    return score_mod


def decoupled_rope(q_pe: Tensor, k_pe: Tensor, scale: float) -> ScoreMod:
    """MLA's decoupled RoPE (DeepSeek-V2): ``score + scale * <q_pe[b, h, q_idx], k_pe[b, kv_idx]>``.

    ``q_pe`` has shape (B, H, L, R): the rotated query part of each head. ``k_pe`` has
    shape (B, S, R), one rotated key part shared by every head, or (B, Hkv, S, R), one
    per key head (read as ``h // (H // Hkv)``). ``scale`` is the attention's (the
    product joins ``q . k`` before softmax, so it takes the same factor). The dot
    product is folded into the kernels' ``QK^T`` as R extra head-dim columns; both
    tables may require grad.
    """
    _require_tensor(q_pe, "q_pe", (4,))
    _require_tensor(k_pe, "k_pe", (3, 4))
    if k_pe.shape[-1] != q_pe.shape[-1]:
        raise ValueError(f"k_pe's last dim must equal q_pe's ({q_pe.shape[-1]}), got shape {tuple(k_pe.shape)}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a number, got {type(scale).__name__}")
    scale = float(scale)

    if k_pe.dim() == 3:

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + scale * torch.dot(_lookup(q_pe, b, h, q_idx), _lookup(k_pe, b, kv_idx))

    else:
        if q_pe.shape[1] % k_pe.shape[1]:
            raise ValueError(f"k_pe's heads ({k_pe.shape[1]}) must divide q_pe's ({q_pe.shape[1]})")
        groups = q_pe.shape[1] // k_pe.shape[1]

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + scale * torch.dot(_lookup(q_pe, b, h, q_idx), _lookup(k_pe, b, h // groups, kv_idx))

    score_mod.__name__ = f"decoupled_rope_{q_pe.shape[-1]}"
    return score_mod

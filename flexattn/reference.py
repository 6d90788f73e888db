"""The dense reference of flexattn's attention: the definition of correct every kernel
is tested against (``dense_math``), and the elementwise evaluation of mods it rests on.

It builds the full (B, H, L, S) score matrix, so it is a reference, not a fast path:
mods run under ``torch.vmap`` over every (b, h, q_idx, kv_idx), tensor indexing inside a
mod is made vmap-safe by ``IndexWithTensors``, and a BlockMask is turned into the
entries it lets through exactly as the kernels read it (``block_mask_visibility``).
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ._mask_tuple import BlockMaskView
from .block_tables import flags_from_lists, kv_columns


# --------------------------------------------------------------------------------------
# Running mods elementwise: tensor indexing inside a vmapped mod
# --------------------------------------------------------------------------------------
class IndexWithTensors(TorchFunctionMode):
    """Route ``table[idx]`` with tensor indices to ``aten.index``.

    Inside a mod, ``b``, ``h``, ``q_idx`` and ``kv_idx`` are 0-d tensors. Python's
    ``Tensor.__getitem__`` turns a 0-d index into an int, which neither vmap nor tracing
    can do; ``aten.index`` takes it as a tensor, so under this mode a mod may index its
    captured tables with the index arguments (and with tensors computed from them).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is Tensor.__getitem__:
            indices = _as_aten_indices(args[1], args[0].device)
            if indices is not None:
                return torch.ops.aten.index.Tensor(args[0], indices)
        return func(*args, **kwargs)


def _as_aten_indices(index: Any, device: torch.device) -> list[Tensor | None] | None:
    """The ``aten.index`` form of a getitem index, or None when it has no tensors or
    uses something ``aten.index`` cannot express (a non-trivial slice, Ellipsis)."""
    items = index if isinstance(index, tuple) else (index,)
    if not any(isinstance(i, Tensor) for i in items):
        return None
    out: list[Tensor | None] = []
    for item in items:
        if isinstance(item, Tensor):
            out.append(item)
        elif isinstance(item, int) and not isinstance(item, bool):
            out.append(torch.tensor(item, dtype=torch.int64, device=device))
        elif isinstance(item, slice) and item == slice(None):
            out.append(None)
        else:
            return None
    return out


def vmap_over_bhmn(fn: Callable, with_score: bool, num_buffers: int) -> Callable:
    """Lift a mod on 0-d arguments to one on (B, H, L, S) grids by nested vmaps.

    The innermost vmap runs over kv_idx, the outermost over b; the score (when present)
    is batched at every level, captured buffers at none.
    """
    score_dim = (0,) if with_score else ()
    per_level = [(None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)]
    for dims in per_level:
        fn = torch.vmap(fn, in_dims=score_dim + dims + (None,) * num_buffers, out_dims=0)
    return fn


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


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of the softmax and its row statistics (lse, max_scores) for ``dtype``
    inputs: float32, float64 for float64 inputs (as torch's flex returns eagerly, and as
    gradcheck needs)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------------------
# Dropout: the keep mask, a pure function of (seed, position), shared with the kernels
# --------------------------------------------------------------------------------------
#: Philox-4x32 constants (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", 2011).
PHILOX_ROUND_A, PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
PHILOX_KEY_A, PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
#: Rounds per draw: 7, FlashAttention-2's choice; Philox-4x32-7 already passes BigCrush
#: (the paper's "crush-resistant" count; 10 is its safety margin).
PHILOX_ROUNDS = 7
# Keep decisions per Philox draw: eight, its four 32-bit words split into 16-bit halves
# (a draw per entry would cost the kernels more integer work than their matrix products).
# A draw covers the entries (q + 8r, k + 8j + e), r, j, e in {0, 1}, which one GPU thread
# holds of a matrix-product tile (dropout_draw_slots; bench/DECISIONS.md#dropout-draw-layout).
_MASK32 = 0xFFFFFFFF


class Dropout(NamedTuple):
    """A call's dropout: the probability and its (2,) int64 seed tensor (key, stream);
    or, for tests that replay a mask read off ``AuxRequest(probabilities=True)``, the bool
    keep mask itself (B, H, L, S) in place of the seed."""

    p: float
    seed: Tensor | None
    keep: Tensor | None = None

    def keep_mask(self, B: int, H: int, L: int, S: int) -> Tensor:
        return self.keep if self.keep is not None else dropout_keep(self.seed, self.p, B, H, L, S)


def dropout_threshold(p: float) -> int:
    """An entry is kept when its 16-bit random value is at least this: the keep
    probability is 1 - p rounded to a multiple of 2**-16."""
    return min(round(p * 65536), 65536)


def dropout_scale(p: float) -> float:
    """The factor on kept probabilities, 1 / (1 - p) as in SDPA and FlashAttention-2."""
    return 1.0 / (1.0 - p)


def _umul32(a: Tensor, b: int) -> tuple[Tensor, Tensor]:
    """(high, low) 32-bit words of a * b for uint32 values held in int64, without the
    64-bit product (it would overflow int64): b is split into 16-bit halves."""
    b_hi, b_lo = b >> 16, b & 0xFFFF
    with_hi = a * b_hi
    with_lo = a * b_lo
    high = (with_hi + (with_lo >> 16)) >> 16
    low = (((with_hi & 0xFFFF) << 16) + with_lo) & _MASK32
    return high, low


def philox_4x32(c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor, k0: Tensor, k1: Tensor,
                rounds: int = PHILOX_ROUNDS) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox-4x32 of the counter (c0, c1, c2, c3) under the key (k0, k1): uint32 values
    held in int64 tensors (broadcastable), the four output words likewise. The kernels'
    ``philox_4x32`` (common.py.jinja) computes the same words."""
    for _ in range(rounds):
        hi_b, lo_b = _umul32(c2, PHILOX_ROUND_B)
        hi_a, lo_a = _umul32(c0, PHILOX_ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + PHILOX_KEY_A) & _MASK32
        k1 = (k1 + PHILOX_KEY_B) & _MASK32
    return c0, c1, c2, c3


def dropout_draw_slots(L: int, S: int, device=None) -> tuple[Tensor, Tensor, Tensor]:
    """Where entry (i, j) of an L x S score matrix takes its random value: the Philox
    counter words (c0, c1) of its draw and its slot 0-7 in the draw (word slot // 2, low
    half for even slots). With i = 16 qb + 8 r + u and j = 16 kb + 8 jj + 2 t + e:
    c0 = 4 kb + t, c1 = 8 qb + u, slot = 4 r + 2 jj + e."""
    i = torch.arange(L, dtype=torch.int64, device=device).view(L, 1)
    j = torch.arange(S, dtype=torch.int64, device=device).view(1, S)
    c0 = (j // 16) * 4 + (j // 2) % 4
    c1 = (i // 16) * 8 + i % 8
    slot = ((i // 8) % 2) * 4 + ((j // 8) % 2) * 2 + j % 2
    return c0, c1, slot


def dropout_keep(seed: Tensor, p: float, B: int, H: int, L: int, S: int) -> Tensor:
    """The keep mask (B, H, L, S) of a call with dropout ``p`` and ``seed``, exactly as the
    kernels draw it: entry (b, h, i, j) takes the 16-bit half ``slot % 2`` (low first) of
    word ``slot // 2`` of the Philox-4x32 draw with counter (c0, c1, b * H + h, stream)
    and key seed (its low and high words), (c0, c1, slot) as ``dropout_draw_slots`` says;
    it is kept when that value is at least ``dropout_threshold(p)``. Positions are the
    kernel's (for a paged cache, positions in the page pool)."""
    seed = seed.to(torch.int64)
    key, stream = seed[0], seed[1]
    k0, k1 = key & _MASK32, (key >> 32) & _MASK32
    dev = seed.device
    c0, c1, slot = dropout_draw_slots(L, S, dev)
    c2 = torch.arange(B * H, dtype=torch.int64, device=dev).view(B * H, 1, 1)
    words = torch.stack(philox_4x32(c0 + 0 * c1, c1 + 0 * c0, c2, stream & _MASK32, k0, k1), dim=-1)
    word = torch.gather(words, -1, (slot // 2).expand(B * H, L, S).unsqueeze(-1)).squeeze(-1)
    values = torch.where(slot % 2 == 0, word & 0xFFFF, word >> 16)
    return (values >= dropout_threshold(p)).view(B, H, L, S)


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

    ``dropout``: the probabilities are multiplied by ``dropout_keep``'s mask and
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


def sink_rows(sinks: Tensor, Hq: int, dtype: torch.dtype) -> Tensor:
    """Sinks (Hq,) or (B, Hq) as (1 or B, Hq, 1) in ``dtype``: one logit per row of (B, Hq, L)."""
    return sinks.to(dtype).reshape(-1 if sinks.dim() == 2 else 1, Hq, 1)


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

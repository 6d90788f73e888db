"""The numerics the kernels and the dense reference share, so that both compute the
same thing by construction: the dtype of the softmax statistics, dropout's keep mask
(Philox-4x32 draws, the 16-bit threshold, the scale on kept probabilities), the per-row
sink logits, and running a mod elementwise under ``torch.vmap``.

The reference (``reference.py``) is the test oracle built on these; the lowerings, the
CPU engine and the operators import them from here, never from the oracle.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode


# --------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------
def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of the softmax and its row statistics (lse, max_scores) for ``dtype``
    inputs: float32, float64 for float64 inputs (as torch's flex returns eagerly, and as
    gradcheck needs)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def sink_rows(sinks: Tensor, Hq: int, dtype: torch.dtype) -> Tensor:
    """Sinks (Hq,) or (B, Hq) as (1 or B, Hq, 1) in ``dtype``: one logit per row of (B, Hq, L)."""
    return sinks.to(dtype).reshape(-1 if sinks.dim() == 2 else 1, Hq, 1)


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


# --------------------------------------------------------------------------------------
# Dropout: the keep mask, a pure function of (seed, position)
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

"""Block-sparse attention masks: ``BlockMask``, ``create_block_mask`` and mask helpers.

A *mask_mod* is a tiny function ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` that says
whether query ``q_idx`` of batch ``b`` and head ``h`` may attend to key ``kv_idx``. The
attention kernels never evaluate it on the whole (Q_LEN x KV_LEN) grid. They walk over
tiles of ``Q_BLOCK_SIZE x KV_BLOCK_SIZE`` positions and need to know, per tile, one of
three things:

* *empty*:   every position is masked out, so the tile is skipped;
* *full*:    every position is allowed, so the tile is computed without calling mask_mod;
* *partial*: some positions are allowed, so the tile is computed and mask_mod applied.

``BlockMask`` stores this classification in the compressed-row layout the kernels read.
For every (batch, head, query block) row it holds the number of partial KV blocks and
their ids (``kv_num_blocks``, ``kv_indices``), and the same for full blocks
(``full_kv_num_blocks``, ``full_kv_indices``). The backward pass walks the grid along
the other axis, so the transposed lists per KV block (``q_num_blocks``, ``q_indices``,
``full_q_num_blocks``, ``full_q_indices``) are kept next to them. Each id row lists its
counted block ids first (``num_blocks`` of them); the entries after them are padding,
whose values are never used and may repeat ids. Rows may be narrower than the KV blocks
(``PagedKVCache.block_mask_on_pages`` makes them ``max_pages_per_slot`` wide) but hold
at least one entry. ``create_block_mask`` lists the ids ascending and pads with the
remaining ones, ascending, so its rows are permutations of ``range(num_cols)`` and its
shapes are PyTorch's.

How ``create_block_mask`` stays cheap
-------------------------------------
Building the element mask for all of (B, H, Q_LEN, KV_LEN) at once costs B*H*Q*KV bytes:
16 GiB for a single 128k x 128k head. Instead the grid is cut into chunks whose element
mask fits in ``MASK_CHUNK_BYTES`` (query blocks first, then heads, then batches). Each
chunk is evaluated with ``torch.vmap`` over the four index axes (the same calling
convention the kernels use, so a mask_mod that works here works there) and immediately
reduced to per-block ``any`` / ``all`` flags; only those (B, H, QB, KVB) flags are kept.
Peak memory is therefore the chunk budget plus the block flags, whatever the sequence
length. Traced by torch.compile (``torch.compile(create_block_mask)``, or model code that
calls it), the grid is evaluated in one piece instead, with no branch on a size, so one
graph serves every B, H and length (see ``_traced_block_flags``).

Edge blocks: when a length is not a multiple of its block size, a tile hangs over the
end. Its positions past the end count as masked, as in torch's create_block_mask, so a
hanging tile is *partial* when some in-range position is allowed and *empty* otherwise,
never full: full_kv_num_blocks, sparsity() and the pictures match torch's for the same
inputs. (The kernels would be as correct with such a tile full, since they mask
positions past the end by bounds; that saves mask_mod on every block a one-token decode
query sees, bench/DECISIONS.md#block-mask-hanging-blocks-full.)
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import math
import numbers
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ._compat import BLOCK_MASK_INDEXING_PACKS_QUERIES, pytree
from .reference import IndexWithTensors, kv_block_columns, listed_grid, vmap_over_bhmn

log = logging.getLogger("flexattn.block_mask")
#: create_block_mask builds at least this long are logged (at INFO, see flexattn/_logging.py).
LONG_BUILD_SECONDS = 0.5

__all__ = [
    "BlockMask",
    "BlockMaskArgumentError",
    "COMPILE_BACKEND",
    "DEFAULT_BLOCK_SIZE",
    "BYTES_PER_MASK_ELEMENT",
    "MASK_CHUNK_BYTES",
    "and_masks",
    "create_block_mask",
    "create_mask",
    "noop_mask",
    "or_masks",
]

DEFAULT_BLOCK_SIZE = 128
"""Default tile edge, in tokens, for both the query and the KV axis."""

MASK_CHUNK_BYTES = 1024 * 1024 * 1024
"""Working-memory budget, in bytes, for one chunk of mask evaluation in create_block_mask.

A chunk evaluates ``MASK_CHUNK_BYTES // BYTES_PER_MASK_ELEMENT`` (b, h, q, kv) points:
the bool result plus the int64 temporaries a typical mask_mod computes on the way
(``q_idx - kv_idx`` and the like). Read at call time, so tests (or memory-starved
users) may lower it."""

BYTES_PER_MASK_ELEMENT = 16
"""Assumed working bytes per evaluated mask element (two int64 temporaries)."""

COMPILE_BACKEND = "inductor"
"""torch.compile backend used by ``create_block_mask(..., _compile=True)``."""

_MASK_MOD_ARITY = 4
_SCORE_MOD_ARITY = 5
_FULL_CHAR = "█"
_PARTIAL_CHAR = "░"
_EMPTY_CHAR = " "

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


# --------------------------------------------------------------------------------------
# mask_mod helpers
# --------------------------------------------------------------------------------------


def noop_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """The mask_mod that allows every (query, key) pair: a 0-d ``True`` tensor.

    It is built from ``b`` (not with ``torch.tensor``) so that it lands on the index
    tensors' device and traces as one ``new_ones`` op under make_fx and Dynamo.
    """
    return b.new_ones((), dtype=torch.bool)


def _check_mask_mods(combinator: str, mask_mods: tuple[Any, ...]) -> None:
    if not mask_mods:
        raise TypeError(f"{combinator}() needs at least one mask_mod, got none")
    for position, mask_mod in enumerate(mask_mods):
        if not callable(mask_mod):
            raise TypeError(
                f"{combinator}(): argument {position} must be a callable "
                f"mask_mod(b, h, q_idx, kv_idx), got {type(mask_mod).__name__}: {mask_mod!r}"
            )


def _mod_name(mod: Any) -> str:
    return getattr(mod, "__name__", type(mod).__name__)


def and_masks(*mask_mods: MaskMod) -> MaskMod:
    """Return a mask_mod allowing a position only where *all* of ``mask_mods`` allow it."""
    _check_mask_mods("and_masks", mask_mods)

    def and_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        allowed = mask_mods[0](b, h, q_idx, kv_idx)
        for mask_mod in mask_mods[1:]:
            allowed = allowed & mask_mod(b, h, q_idx, kv_idx)
        return allowed

    and_mask.__name__ = "and_masks(" + ", ".join(_mod_name(m) for m in mask_mods) + ")"
    return and_mask


def or_masks(*mask_mods: MaskMod) -> MaskMod:
    """Return a mask_mod allowing a position where *any* of ``mask_mods`` allows it."""
    _check_mask_mods("or_masks", mask_mods)

    def or_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        allowed = mask_mods[0](b, h, q_idx, kv_idx)
        for mask_mod in mask_mods[1:]:
            allowed = allowed | mask_mod(b, h, q_idx, kv_idx)
        return allowed

    or_mask.__name__ = "or_masks(" + ", ".join(_mod_name(m) for m in mask_mods) + ")"
    return or_mask


def _sliced_mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Placeholder mask_mod of a BlockMask obtained by indexing another one.

    Indexing renumbers batches, heads and query blocks, so the original mask_mod no
    longer matches the block lists; calling it silently would give wrong masks.
    """
    raise RuntimeError(
        "This BlockMask was obtained by indexing (block_mask[...]); indexing renumbers "
        "batches, heads and query blocks, so it has no valid mask_mod. Assign one that "
        "matches the sliced layout: sliced.mask_mod = my_mask_mod_for_the_slice"
    )


# --------------------------------------------------------------------------------------
# Evaluating mods over an index grid
# --------------------------------------------------------------------------------------


def _required_positional_count(fn: Callable[..., Any]) -> int | None:
    """Number of positional parameters without defaults; None if it takes ``*args``."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    count = 0
    for parameter in parameters:
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            return None
        if (
            parameter.kind
            in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
            and parameter.default is inspect.Parameter.empty
        ):
            count += 1
    return count


def _code_arity(fn: Any) -> int | None:
    """_required_positional_count of a plain function, read from its code object (which
    Dynamo can trace); None for other callables (methods, partials, objects) and *args."""
    code = getattr(fn, "__code__", None)
    if code is None or inspect.ismethod(fn) or code.co_flags & inspect.CO_VARARGS:
        return None
    return code.co_argcount - len(fn.__defaults__ or ())


def _mod_arity(fn: Any, argument: str) -> int:
    """Validate a score_mod/mask_mod and return its arity (4: mask_mod, 5: score_mod)."""
    if not callable(fn):
        raise TypeError(
            f"{argument} must be a callable mask_mod(b, h, q_idx, kv_idx) or "
            f"score_mod(score, b, h, q_idx, kv_idx), got {type(fn).__name__}: {fn!r}"
        )
    if torch.compiler.is_compiling():
        # Dynamo cannot trace inspect.signature. Other callables than plain functions
        # are taken as mask_mods: Dynamo checks the call when it traces the mod.
        arity = _code_arity(fn)
        if arity is None:
            return _MASK_MOD_ARITY
    else:
        arity = _required_positional_count(fn)
    if arity not in (_MASK_MOD_ARITY, _SCORE_MOD_ARITY):
        received = "a variable number (*args)" if arity is None else str(arity)
        raise TypeError(
            f"{argument} must take 4 positional arguments (b, h, q_idx, kv_idx) for a "
            f"mask_mod or 5 (score, b, h, q_idx, kv_idx) for a score_mod; "
            f"{_mod_name(fn)} takes {received}"
        )
    return arity


def _kept_query_length(entry: Any, kept_blocks: int, block_size: int, query_length: int, num_blocks: int) -> int:
    """The query length of the rows a BlockMask index keeps, from its query-block entry
    (an int arrives as a one-block slice): for a slice, each kept block's tokens, a block
    hanging over ``query_length`` clipped there; for an index tensor or list, whose values
    are not read (no device sync), ``kept_blocks`` whole blocks."""
    if not isinstance(entry, slice):
        return kept_blocks * block_size
    return sum(max(0, min(block_size, query_length - i * block_size)) for i in range(num_blocks)[entry])


def _resolve_device(device: Any) -> torch.device:
    if device is None:
        accelerator = torch.accelerator.current_accelerator()
        return torch.device(accelerator) if accelerator is not None else torch.device("cpu")
    return torch.device(device)


def _evaluate_mod(
    mod: Callable[..., Tensor],
    b: Tensor,
    h: Tensor,
    q: Tensor,
    kv: Tensor,
    score: Tensor | None = None,
) -> Tensor:
    """Evaluate ``mod`` at every point of the grid b x h x q x kv (1-D int64 vectors).

    Returns a (len(b), len(h), len(q), len(kv)) tensor. With ``score`` (same shape) the
    mod is treated as a score_mod.
    """
    with IndexWithTensors():
        if score is None:
            result = vmap_over_bhmn(mod, False, 0)(b, h, q, kv)
        else:
            result = vmap_over_bhmn(mod, True, 0)(score, b, h, q, kv)
    expected = (b.numel(), h.numel(), q.numel(), kv.numel())
    if not isinstance(result, Tensor) or tuple(result.shape) != expected:
        shape = tuple(result.shape) if isinstance(result, Tensor) else type(result).__name__
        raise ValueError(
            f"{_mod_name(mod)} must return one 0-d tensor per (b, h, q_idx, kv_idx); "
            f"over the grid {expected} it returned {shape}"
        )
    return result


def _index_vectors(B: int, H: int, q_start: int, q_stop: int, KV_LEN: int, device):
    arange = lambda start, stop: torch.arange(start, stop, device=device)  # noqa: E731
    return arange(0, B), arange(0, H), arange(q_start, q_stop), arange(0, KV_LEN)


def _cell_steps(rows: int, cols: int, grid_size: int | tuple[int, int]) -> tuple[int, int]:
    """Blocks per picture cell (down, across) so that a (rows, cols) block grid fits in
    ``grid_size`` cells (an int for both axes; -1: one cell per block)."""
    if grid_size == -1:
        max_rows, max_cols = rows, cols
    elif isinstance(grid_size, int):
        max_rows = max_cols = grid_size
    else:
        max_rows, max_cols = grid_size
    return max(1, _cdiv(rows, max(1, max_rows))), max(1, _cdiv(cols, max(1, max_cols)))


def _shown_pictures(batch_dims: Sequence[int], limit: int) -> tuple[list[tuple[int, ...]], int]:
    """The batch indices (b, h, ...) of the first ``limit`` pictures (all of them for a
    negative limit), and how many more there are."""
    every = itertools.product(*(range(n) for n in batch_dims))
    indices = list(itertools.islice(every, limit if limit >= 0 else None))
    return indices, math.prod(batch_dims) - len(indices)


def _picture_rows(grid: Tensor, row_step: int, col_step: int, cell: Callable[[Tensor], str]) -> list[str]:
    """One string per cell row of a (rows, cols) block grid; each cell, ``cell`` of its
    group of blocks, drawn two characters wide so that the picture looks square."""
    rows, cols = grid.shape
    return [
        "".join(cell(grid[r : r + row_step, c : c + col_step]) * 2 for c in range(0, cols, col_step))
        for r in range(0, rows, row_step)
    ]


def _check_positive_int(value: Any, argument: str, allow_none: bool = False) -> Any:
    """``value`` as a Python int (a NumPy integer too), or None where allowed; a
    ValueError naming ``argument`` for anything else. A SymInt (a size traced by
    torch.compile, e.g. ``q.size(-2)``) is kept symbolic, so the trace is not
    specialized to its value."""
    if allow_none and value is None:
        return None
    integral = isinstance(value, (int, numbers.Integral, torch.SymInt)) and not isinstance(value, bool)
    if not integral or value < 1:
        expected = "a positive int or None" if allow_none else "a positive int"
        raise ValueError(f"{argument} must be {expected}, got {value!r}")
    return value if isinstance(value, (int, torch.SymInt)) else int(value)


def create_mask(
    mod_fn: Callable[..., Tensor],
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    device: Any = None,
) -> Tensor:
    """Dense (B, H, Q_LEN, KV_LEN) bool mask of a mask_mod or a score_mod.

    For a mask_mod (4 arguments) this is the mask_mod at every position. For a score_mod
    (5 arguments) it is True where the score_mod, applied to a zero score, does not give
    ``-inf`` (the positions the score_mod leaves attendable). ``B``/``H`` of None mean 1.
    ``device`` defaults to the current accelerator, else the CPU. This materializes the
    whole grid: use it for small shapes, tests and pictures.
    """
    arity = _mod_arity(mod_fn, "mod_fn")
    B = _check_positive_int(B, "B", allow_none=True)
    H = _check_positive_int(H, "H", allow_none=True)
    Q_LEN = _check_positive_int(Q_LEN, "Q_LEN")
    KV_LEN = _check_positive_int(KV_LEN, "KV_LEN")
    B = 1 if B is None else B
    H = 1 if H is None else H
    device = _resolve_device(device)
    b, h, q, kv = _index_vectors(B, H, 0, Q_LEN, KV_LEN, device)
    if arity == _MASK_MOD_ARITY:
        return _evaluate_mod(mod_fn, b, h, q, kv)
    zeros = torch.zeros(B, H, Q_LEN, KV_LEN, device=device)
    scores = _evaluate_mod(mod_fn, b, h, q, kv, score=zeros)
    return ~torch.isneginf(scores)


# --------------------------------------------------------------------------------------
# Block-level layout conversions
# --------------------------------------------------------------------------------------


def _cdiv(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def _kv_columns(kv_indices: Tensor, seq_lengths: tuple[int, int], block_size: tuple[int, int]) -> int:
    """KV block columns of a mask (kv_block_columns of its index rows' width)."""
    return kv_block_columns(kv_indices.shape[-1], seq_lengths[1], block_size[1])


def _compact_kept(keep: Tensor, ids: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """Block lists of the kept entries: ``keep`` / ``ids`` (..., M) -> (num (...),
    indices (..., width)), the kept ids first in their order (each at its rank among
    the kept ones), then padding 0. The count is clamped to ``width``: ranks past it
    (an invalid row that lists a block twice) go to a scratch column and are dropped."""
    place = torch.where(keep, (torch.cumsum(keep, -1) - 1).clamp(max=width), width)
    order = torch.zeros(*ids.shape[:-1], width + 1, dtype=ids.dtype, device=ids.device)
    order = order.scatter(-1, place, ids)[..., :width].contiguous()
    return keep.sum(-1, dtype=torch.int32).clamp(max=width), order


def _dense_to_ordered(dense: Tensor) -> tuple[Tensor, Tensor]:
    """Block flags (..., rows, cols) -> (num_blocks (..., rows), indices (..., rows, cols)).

    Lists the set block ids first, ascending, followed by the unset ones, ascending (a
    stable descending sort of the 0/1 flags, computed without a sort: a set block's place
    is its rank among the set ones, an unset block's is num_blocks plus its rank among
    the unset ones).
    """
    flags = dense.to(torch.bool)
    if flags.shape[-1] == 1:    # one column (the transposed lists of one query block)
        return flags.squeeze(-1).to(torch.int32).contiguous(), torch.zeros(flags.shape, dtype=torch.int32,
                                                                           device=flags.device)
    num_blocks = flags.sum(dim=-1, dtype=torch.int64)
    place = torch.where(flags, torch.cumsum(flags, -1), num_blocks.unsqueeze(-1) + torch.cumsum(~flags, -1)) - 1
    ids = torch.arange(flags.shape[-1], dtype=torch.int32, device=flags.device).expand(flags.shape)
    indices = torch.empty(flags.shape, dtype=torch.int32, device=flags.device).scatter_(-1, place, ids)
    return num_blocks.to(torch.int32).contiguous(), indices.contiguous()


def _ordered_to_dense(num_blocks: Tensor, indices: Tensor, num_cols: int) -> Tensor:
    """(num_blocks, indices) -> int32 flags (..., rows, num_cols); padding is ignored."""
    return listed_grid(num_blocks, indices, num_cols).to(torch.int32)


def _transpose_ordered(num_blocks: Tensor, indices: Tensor, num_cols: int) -> tuple[Tensor, Tensor]:
    """Per-row block lists over ``num_cols`` columns -> per-column block lists (the
    layout the backward walks)."""
    dense = _ordered_to_dense(num_blocks, indices, num_cols)
    return _dense_to_ordered(dense.transpose(-2, -1))


def _reduce_axis_to_blocks(
    any_flags: Tensor, all_flags: Tensor, dim: int, block: int
) -> tuple[Tensor, Tensor]:
    """Group axis ``dim`` (negative) in runs of ``block``; reduce each run to any / all.

    A trailing run shorter than ``block`` stands for a block that hangs past the end of
    the sequence; its missing positions count as masked, as in torch's create_block_mask,
    so such a block is partial at best (see the module docstring, "Edge blocks").
    """
    length = any_flags.shape[dim]
    whole = length // block
    aligned = whole * block
    any_parts, all_parts = [], []
    if whole:
        # Splitting a dim in place is a view, even on a narrowed tensor; after the split
        # the run axis sits at ``dim`` because ``dim`` counts from the end.
        runs_any = any_flags.narrow(dim, 0, aligned).unflatten(dim, (whole, block))
        runs_all = all_flags.narrow(dim, 0, aligned).unflatten(dim, (whole, block))
        any_parts.append(runs_any.any(dim))
        all_parts.append(runs_all.all(dim))
    if aligned < length:
        tail_any = any_flags.narrow(dim, aligned, length - aligned).any(dim, keepdim=True)
        any_parts.append(tail_any)
        all_parts.append(torch.zeros_like(tail_any))
    if len(any_parts) == 1:
        return any_parts[0], all_parts[0]
    return torch.cat(any_parts, dim), torch.cat(all_parts, dim)


_BYTES_PER_WORD = 8
_ALL_TRUE_WORD = int.from_bytes(bytes([1] * _BYTES_PER_WORD), "little")


def _as_words(allowed: Tensor, kv_block: int) -> Tensor | None:
    """View a bool mask as int64 words of 8 consecutive KV positions, if the layout allows.

    A bool is one byte holding 0 or 1, so a word is 0 when its 8 positions are all
    masked and ``_ALL_TRUE_WORD`` when all are allowed; reducing words instead of bools
    does 8x fewer element operations. Needs whole words per block and 8-byte aligned rows.
    """
    if kv_block % _BYTES_PER_WORD or allowed.dim() == 0 or allowed.stride(-1) != 1:
        return None
    if allowed.shape[-1] % _BYTES_PER_WORD or allowed.storage_offset() % _BYTES_PER_WORD:
        return None
    if any(stride % _BYTES_PER_WORD for stride in allowed.stride()[:-1]):
        return None  # Tensor.view checks every stride, those of size-1 dims too
    return allowed.view(torch.uint8).view(torch.int64)


def _reduce_kv_axis(allowed: Tensor, kv_block: int, use_words: bool) -> tuple[Tensor, Tensor]:
    """(..., rows, KV) bool -> per KV block (any, all) flags (..., rows, KVB).

    ``use_words`` enables the int64-word shortcut (eager only: under torch.compile the
    layout checks cannot be traced, and Inductor fuses the plain reduction anyway).
    """
    kv_len = allowed.shape[-1]
    whole = kv_len // kv_block
    aligned_part = allowed.narrow(-1, 0, whole * kv_block)
    words = _as_words(aligned_part, kv_block) if whole and use_words else None
    if words is None:
        return _reduce_axis_to_blocks(allowed, allowed, -1, kv_block)
    runs = words.unflatten(-1, (whole, kv_block // _BYTES_PER_WORD))
    any_kv = runs.ne(0).any(-1)
    all_kv = runs.eq(_ALL_TRUE_WORD).all(-1)
    if whole * kv_block < kv_len:
        tail = allowed.narrow(-1, whole * kv_block, kv_len - whole * kv_block)
        tail_any = tail.any(-1, keepdim=True)
        any_kv = torch.cat([any_kv, tail_any], -1)
        all_kv = torch.cat([all_kv, torch.zeros_like(tail_any)], -1)  # hanging: never full
    return any_kv, all_kv


def _block_flags(
    allowed: Tensor, q_block: int, kv_block: int, use_words: bool = True
) -> tuple[Tensor, Tensor]:
    """Element mask (b, h, rows, KV) -> per-block (any, all) flags (b, h, QB, KVB).

    The KV axis is reduced first (it is the contiguous one and shrinks the data
    kv_block-fold), then the query axis on the already small tensor.
    """
    any_kv, all_kv = _reduce_kv_axis(allowed, kv_block, use_words)
    return _reduce_axis_to_blocks(any_kv, all_kv, -2, q_block)


def _chunk_plan(B: int, H: int, QB: int, q_block: int, KV_LEN: int, budget: int):
    """Chunk sizes (batches, heads, query blocks) of at most ``budget`` mask elements.

    The unit is one query block of one (batch, head): q_block * KV_LEN elements. Query
    blocks are grown first, then heads, then batches. At least one unit is evaluated
    per chunk even if it alone exceeds the budget.
    """
    units = max(1, budget // (q_block * KV_LEN))
    q_blocks = min(QB, units)
    heads = min(H, max(1, units // q_blocks)) if q_blocks == QB else 1
    batches = min(B, max(1, units // (q_blocks * heads))) if heads == H and q_blocks == QB else 1
    return batches, heads, q_blocks


def _evaluate_chunk(
    mask_mod: MaskMod,
    b: Tensor,
    h: Tensor,
    q: Tensor,
    kv: Tensor,
    q_block: int,
    kv_block: int,
    use_words: bool = True,
) -> tuple[Tensor, Tensor]:
    """Evaluate ``mask_mod`` on one chunk of the grid and reduce it to block flags."""
    return _block_flags(_evaluate_mask(mask_mod, b, h, q, kv), q_block, kv_block, use_words=use_words)


def _evaluate_mask(mask_mod: MaskMod, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    """``_evaluate_mod`` of a mask_mod, which must give bools."""
    allowed = _evaluate_mod(mask_mod, b, h, q, kv)
    if allowed.dtype != torch.bool:
        raise TypeError(
            f"mask_mod {_mod_name(mask_mod)} must return a bool tensor, got {allowed.dtype}"
        )
    return allowed


def _traced_block_flags(
    mask_mod: MaskMod, B: Any, H: Any, Q_LEN: Any, KV_LEN: Any, device: torch.device, q_block: int, kv_block: int
) -> tuple[Tensor, Tensor]:
    """Block (any, all) flags (B, H, QB, KVB) of the whole grid in one evaluation, for
    create_block_mask traced by torch.compile.

    Dynamo would unroll the chunk loop, and its trip counts and the short edge tiles
    guard on the exact sizes, so every new B, H or length would recompile (and a long
    grid would trace for minutes). Here nothing branches on a size: the grid is padded
    to whole tiles, padded positions are evaluated at the last real index (mask_mod
    never sees an index out of range) and then left out of the reduction, so one trace
    serves all sizes and takes them symbolically. The element mask is built whole, as
    torch's create_block_mask does; Inductor fuses it into the reduction.
    """
    QB, KVB = _cdiv(Q_LEN, q_block), _cdiv(KV_LEN, kv_block)
    q = torch.arange(QB * q_block, device=device)
    kv = torch.arange(KVB * kv_block, device=device)
    b, h = torch.arange(B, device=device), torch.arange(H, device=device)
    allowed = _evaluate_mask(mask_mod, b, h, q.clamp(max=Q_LEN - 1), kv.clamp(max=KV_LEN - 1))
    inside = (q < Q_LEN).unsqueeze(-1) & (kv < KV_LEN)

    def per_tile(flags: Tensor) -> Tensor:
        return flags.view(*flags.shape[:2], QB, q_block, KVB, kv_block)

    # Padded positions count as masked: a tile hanging over an end is never full, as in
    # the eager path.
    any_blocks = per_tile(allowed & inside).any(-1).any(-2)
    all_blocks = per_tile(allowed & inside).all(-1).all(-2)
    return any_blocks, all_blocks


def _compiled_chunk_evaluator_uncached(backend: str):
    def evaluate(mask_mod, b, h, q, kv, q_block, kv_block):
        return _evaluate_chunk(mask_mod, b, h, q, kv, q_block, kv_block, use_words=False)

    # Not fullgraph: should a mask_mod defeat tracing, or the recompile limit be reached
    # after many distinct mask_mods, Dynamo falls back to eager instead of failing.
    return torch.compile(evaluate, backend=backend)


_COMPILED_EVALUATORS: dict[str, Callable[..., Any]] = {}


def _compiled_chunk_evaluator() -> Callable[..., Any]:
    """One compiled chunk evaluator per backend, shared by all calls.

    The mask_mod is an argument (not a closure of a per-call function), so Dynamo's
    cache entries are reused across create_block_mask calls with the same mask_mod
    code, and chunk shapes become dynamic after the first recompile.
    """
    if COMPILE_BACKEND not in _COMPILED_EVALUATORS:
        _COMPILED_EVALUATORS[COMPILE_BACKEND] = _compiled_chunk_evaluator_uncached(COMPILE_BACKEND)
    return _COMPILED_EVALUATORS[COMPILE_BACKEND]


def _compute_block_flags(
    mask_mod: MaskMod,
    B: int,
    H: int,
    Q_LEN: int,
    KV_LEN: int,
    device: torch.device,
    q_block: int,
    kv_block: int,
    compile_chunks: bool,
) -> tuple[Tensor, Tensor]:
    """Block (any, all) flags (B, H, QB, KVB) of ``mask_mod``, evaluated chunk by chunk
    (in one piece when traced by torch.compile: see _traced_block_flags)."""
    if torch.compiler.is_compiling():
        with torch.no_grad():
            return _traced_block_flags(mask_mod, B, H, Q_LEN, KV_LEN, device, q_block, kv_block)
    QB, KVB = _cdiv(Q_LEN, q_block), _cdiv(KV_LEN, kv_block)
    any_blocks = torch.empty(B, H, QB, KVB, dtype=torch.bool, device=device)
    all_blocks = torch.empty(B, H, QB, KVB, dtype=torch.bool, device=device)

    if compile_chunks:
        evaluate_chunk = functools.partial(_compiled_chunk_evaluator(), mask_mod)
    else:
        evaluate_chunk = functools.partial(_evaluate_chunk, mask_mod)

    budget = max(1, MASK_CHUNK_BYTES // BYTES_PER_MASK_ELEMENT)
    batches, heads, q_blocks = _chunk_plan(B, H, QB, q_block, KV_LEN, budget)
    kv = torch.arange(KV_LEN, device=device)
    with torch.no_grad():
        for b0 in range(0, B, batches):
            b = torch.arange(b0, min(b0 + batches, B), device=device)
            for h0 in range(0, H, heads):
                h = torch.arange(h0, min(h0 + heads, H), device=device)
                for qb0 in range(0, QB, q_blocks):
                    qb1 = min(qb0 + q_blocks, QB)
                    q = torch.arange(qb0 * q_block, min(qb1 * q_block, Q_LEN), device=device)
                    chunk_any, chunk_all = evaluate_chunk(b, h, q, kv, q_block, kv_block)
                    where = (slice(b0, b0 + b.numel()), slice(h0, h0 + h.numel()), slice(qb0, qb1))
                    any_blocks[where] = chunk_any
                    all_blocks[where] = chunk_all
    return any_blocks, all_blocks


# --------------------------------------------------------------------------------------
# BlockMask
# --------------------------------------------------------------------------------------


def _normalize_block_size(BLOCK_SIZE: Any) -> tuple[int, int]:
    if isinstance(BLOCK_SIZE, int) and not isinstance(BLOCK_SIZE, bool):
        pair: Sequence[Any] = (BLOCK_SIZE, BLOCK_SIZE)
    elif isinstance(BLOCK_SIZE, (tuple, list)) and len(BLOCK_SIZE) == 2:
        pair = BLOCK_SIZE
    else:
        raise ValueError(
            f"BLOCK_SIZE must be a positive int or a (q_block, kv_block) pair of positive "
            f"ints, got {BLOCK_SIZE!r}"
        )
    for size in pair:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(
                f"BLOCK_SIZE must be a positive int or a (q_block, kv_block) pair of "
                f"positive ints, got {BLOCK_SIZE!r}"
            )
    return int(pair[0]), int(pair[1])


def _as_length(value: Any) -> Any:
    """A sequence length as an int; a SymInt stays one (int() would specialize a trace
    of create_block_mask to the length it was first called with)."""
    return value if isinstance(value, torch.SymInt) else int(value)


class BlockMaskArgumentError(ValueError, AssertionError):
    """A BlockMask was given one tensor of a (num_blocks, indices) pair without the other.

    It is a ValueError, like flexattn's other argument errors, and an AssertionError,
    which is what torch's BlockMask raises for the same call, so code catching either
    keeps working.
    """


def _check_pair(num_name: str, num_blocks: Any, indices_name: str, indices: Any) -> None:
    if (num_blocks is None) != (indices is None):
        given, missing = (num_name, indices_name) if indices is None else (indices_name, num_name)
        raise BlockMaskArgumentError(
            f"{num_name} and {indices_name} must be given together or both be None; "
            f"got {given} without {missing}"
        )


def _check_kv_lists(kv_num_blocks: Any, kv_indices: Any, full_kv_num_blocks: Any, full_kv_indices: Any) -> None:
    """Shape checks of the per-query-block KV lists (BlockMask and from_kv_blocks)."""
    if not isinstance(kv_indices, Tensor) or kv_indices.dim() < 2:
        raise ValueError(
            "kv_indices must be a tensor with at least 2 dims (..., query_blocks, "
            f"kv_blocks), got {getattr(kv_indices, 'shape', kv_indices)!r}"
        )
    if not isinstance(kv_num_blocks, Tensor) or kv_num_blocks.shape != kv_indices.shape[:-1]:
        raise ValueError(
            f"kv_num_blocks must have shape kv_indices.shape[:-1] = "
            f"{tuple(kv_indices.shape[:-1])}, got {getattr(kv_num_blocks, 'shape', kv_num_blocks)!r}"
        )
    _check_pair("full_kv_num_blocks", full_kv_num_blocks, "full_kv_indices", full_kv_indices)
    for name, indices in (("kv_indices", kv_indices), ("full_kv_indices", full_kv_indices)):
        # The kernels read a row's first entry whatever its count (a zero-width row
        # would be read out of bounds); a tensor without rows has nothing to read.
        if isinstance(indices, Tensor) and indices.dim() and indices.shape[-1] == 0 \
                and math.prod(indices.shape[:-1]) > 0:
            raise ValueError(
                f"{name} must hold at least one entry per row (its last dim, the row width, "
                f"must be >= 1, even for rows that list no block), got shape {tuple(indices.shape)}"
            )


def _values_readable(*tensors: Tensor | None) -> bool:
    """Whether a check may read these tensors' values at no device sync and without a
    data-dependent branch in a trace: plain CPU tensors (not fake, meta or functional
    ones), outside torch.compile."""
    return not torch.compiler.is_compiling() and all(
        type(t) is Tensor and t.device.type == "cpu" for t in tensors if t is not None
    )


def _check_listed_ids(argument: str, num_blocks: Tensor, indices: Tensor, num_cols: int, kv_block: int) -> None:
    """Raise if a counted entry of ``indices`` is not a block id in [0, num_cols), the
    KV blocks of from_kv_blocks' default seq_lengths (the rows' width)."""
    counted = torch.arange(indices.shape[-1], device=indices.device) < num_blocks.unsqueeze(-1)
    bad = counted & ((indices < 0) | (indices >= num_cols))
    if not bool(bad.any()):
        return
    where = tuple(int(i) for i in bad.nonzero()[0])
    raise ValueError(
        f"{argument}[{', '.join(map(str, where))}] = {int(indices[where])} is not a KV block id in "
        f"[0, {num_cols}): without seq_lengths the KV length is the rows' width, {num_cols} blocks of "
        f"{kv_block}; index rows narrower than the KV blocks need seq_lengths (the KV length the ids "
        f"refer to)"
    )


class BlockMask:
    """Block-sparse description of an attention mask, in the layout the kernels read.

    Attributes (leading ``...`` are the batch dims, normally (B, H); B or H of 1
    broadcasts over the batch or heads of the attention call):

    * ``kv_num_blocks`` int32 (..., QB), ``kv_indices`` int32 (..., QB, KVB): per query
      block, the KV blocks that are partly masked (the kernel applies mask_mod there).
    * ``full_kv_num_blocks``, ``full_kv_indices``: same for KV blocks with no masked
      position (the kernel skips mask_mod there), or None when not separated.
    * ``q_num_blocks`` (..., KVB), ``q_indices`` (..., KVB, QB), ``full_q_num_blocks``,
      ``full_q_indices``: the transposed lists, per KV block, for the backward; None
      when the mask was built without them (``compute_q_blocks=False``), which only a
      call without a backward accepts.
    * ``seq_lengths`` (q_len, kv_len), ``BLOCK_SIZE`` (q_block, kv_block), ``mask_mod``.

    Each index row starts with its valid block ids (the first ``num_blocks`` entries,
    ascending for masks built here); the entries after them are padding that nothing
    reads (masks built here pad with the remaining ids). A row may hold fewer entries
    than there are KV blocks (KVB = cdiv(kv_len, kv_block)) as long as it holds its
    ``num_blocks``: ``PagedKVCache.block_mask_on_pages`` makes rows as wide as a
    sequence's pages, not the pool's. Rows hold at least one entry (the kernels read a
    row's first entry whatever its count). The constructor checks shapes, not values:
    listed ids must lie in [0, cdiv(kv_len, kv_block)) (or the rows' width, where that
    is larger).
    """

    _TENSOR_FIELDS = (
        "kv_num_blocks",
        "kv_indices",
        "full_kv_num_blocks",
        "full_kv_indices",
        "q_num_blocks",
        "q_indices",
        "full_q_num_blocks",
        "full_q_indices",
    )

    def __init__(
        self,
        seq_lengths: tuple[int, int],
        kv_num_blocks: Tensor,
        kv_indices: Tensor,
        full_kv_num_blocks: Tensor | None,
        full_kv_indices: Tensor | None,
        q_num_blocks: Tensor | None,
        q_indices: Tensor | None,
        full_q_num_blocks: Tensor | None,
        full_q_indices: Tensor | None,
        BLOCK_SIZE: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
        mask_mod: MaskMod | None = None,
    ) -> None:
        _check_kv_lists(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
        _check_pair("full_q_num_blocks", full_q_num_blocks, "full_q_indices", full_q_indices)
        self.seq_lengths = (_as_length(seq_lengths[0]), _as_length(seq_lengths[1]))
        self.kv_num_blocks = kv_num_blocks
        self.kv_indices = kv_indices
        self.full_kv_num_blocks = full_kv_num_blocks
        self.full_kv_indices = full_kv_indices
        self.q_num_blocks = q_num_blocks
        self.q_indices = q_indices
        self.full_q_num_blocks = full_q_num_blocks
        self.full_q_indices = full_q_indices
        self.BLOCK_SIZE = _normalize_block_size(BLOCK_SIZE)
        self.mask_mod = noop_mask if mask_mod is None else mask_mod

    @classmethod
    def from_kv_blocks(
        cls,
        kv_num_blocks: Tensor,
        kv_indices: Tensor,
        full_kv_num_blocks: Tensor | None = None,
        full_kv_indices: Tensor | None = None,
        BLOCK_SIZE: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
        mask_mod: MaskMod | None = None,
        seq_lengths: tuple[int, int] | None = None,
        compute_q_blocks: bool = True,
    ) -> BlockMask:
        """Build a BlockMask from the per-query-block KV lists; derives the transposed view.

        ``seq_lengths`` defaults to the block grid times ``BLOCK_SIZE``, i.e. a KV
        length of the index rows' width in blocks: rows narrower than the KV blocks
        (see the class docstring) need ``seq_lengths``, the KV length their block ids
        refer to. Listed ids must lie in [0, cdiv(kv_len, kv_block)). They are checked
        only against the default seq_lengths, and only where that costs no device sync
        (CPU tensors, outside torch.compile); an id out of range that is not caught is
        dropped by the block views (to_dense, the transposed lists) and read out of
        range by the kernels. ``mask_mod`` defaults to ``noop_mask``.
        ``compute_q_blocks=False`` leaves the transposed lists out (they cost a pass
        over every KV block of every row): the mask then serves forward calls only,
        and a call that needs a backward raises.
        """
        _check_kv_lists(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
        block_size = _normalize_block_size(BLOCK_SIZE)
        if seq_lengths is None:
            seq_lengths = (
                kv_indices.shape[-2] * block_size[0],
                kv_indices.shape[-1] * block_size[1],
            )
            if _values_readable(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices):
                for name, num, idx in (("kv_indices", kv_num_blocks, kv_indices),
                                       ("full_kv_indices", full_kv_num_blocks, full_kv_indices)):
                    if idx is not None:
                        _check_listed_ids(name, num, idx, kv_indices.shape[-1], block_size[1])
        num_cols = _kv_columns(kv_indices, seq_lengths, block_size)
        q_num_blocks = q_indices = full_q_num_blocks = full_q_indices = None
        if compute_q_blocks:
            q_num_blocks, q_indices = _transpose_ordered(kv_num_blocks, kv_indices, num_cols)
            if full_kv_num_blocks is not None:
                full_q_num_blocks, full_q_indices = _transpose_ordered(
                    full_kv_num_blocks, full_kv_indices, num_cols
                )
        return cls(
            seq_lengths,
            kv_num_blocks,
            kv_indices,
            full_kv_num_blocks,
            full_kv_indices,
            q_num_blocks,
            q_indices,
            full_q_num_blocks,
            full_q_indices,
            BLOCK_SIZE=block_size,
            mask_mod=mask_mod,
        )

    def as_tuple(self, flatten: bool = True) -> tuple[Any, ...]:
        """The fields in the order the attention higher-order op takes them.

        ``(q_len, kv_len, kv_num_blocks, kv_indices, full_kv_num_blocks,
        full_kv_indices, q_num_blocks, q_indices, full_q_num_blocks, full_q_indices,
        Q_BLOCK_SIZE, KV_BLOCK_SIZE, mask_mod)``; with ``flatten=False`` the lengths and
        block sizes stay as pairs.
        """
        # _TENSOR_FIELDS' order, spelled out: iterating it would add a compiled call's
        # guards on each of its entries.
        tensors = (self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks, self.full_kv_indices,
                   self.q_num_blocks, self.q_indices, self.full_q_num_blocks, self.full_q_indices)
        if flatten:
            return (*self.seq_lengths, *tensors, *self.BLOCK_SIZE, self.mask_mod)
        return (self.seq_lengths, *tensors, self.BLOCK_SIZE, self.mask_mod)

    @property
    def shape(self) -> tuple[int, ...]:
        """``(*batch dims, q_len, kv_len)``, e.g. ``(B, H, Q_LEN, KV_LEN)``."""
        return (*self.kv_indices.shape[:-2], *self.seq_lengths)

    def numel(self) -> int:
        """Number of (b, h, q, kv) elements the mask describes (ignoring sparsity)."""
        return math.prod(self.shape)

    def _block_grid(self) -> tuple[int, int]:
        """Number of query and KV blocks that the sequence lengths cover."""
        return (
            _cdiv(self.seq_lengths[0], self.BLOCK_SIZE[0]),
            _cdiv(self.seq_lengths[1], self.BLOCK_SIZE[1]),
        )

    def _kv_columns(self) -> int:
        """KV block columns of the block-level views (to_dense): the blocks kv_len
        covers, or the index rows' width where that is larger."""
        return _kv_columns(self.kv_indices, self.seq_lengths, self.BLOCK_SIZE)

    def sparsity(self) -> float:
        """Percentage of the blocks of the grid that are skipped (neither partial nor full)."""
        total = self.kv_num_blocks.numel() * self._block_grid()[1]
        computed = int(self.kv_num_blocks.sum().item())
        if self.full_kv_num_blocks is not None:
            computed += int(self.full_kv_num_blocks.sum().item())
        return 100.0 * (1.0 - computed / total) if total else 0.0

    def to_dense(self) -> Tensor:
        """Block-level int32 (..., QB, KVB) mask: 1 where a block is computed (partial or full)."""
        num_cols = self._kv_columns()
        dense = _ordered_to_dense(self.kv_num_blocks, self.kv_indices, num_cols)
        if self.full_kv_num_blocks is not None:
            dense = dense | _ordered_to_dense(self.full_kv_num_blocks, self.full_kv_indices, num_cols)
        return dense

    def _block_kinds(self) -> Tensor:
        """int8 (..., QB, KVB): 0 empty, 1 partial, 2 full."""
        num_cols = self._kv_columns()
        kinds = _ordered_to_dense(self.kv_num_blocks, self.kv_indices, num_cols).to(torch.int8)
        if self.full_kv_num_blocks is not None:
            full = _ordered_to_dense(self.full_kv_num_blocks, self.full_kv_indices, num_cols)
            kinds = torch.where(full.bool(), 2, kinds).to(torch.int8)
        return kinds

    def to_string(self, grid_size: int | tuple[int, int] = (20, 20), limit: int = 4) -> str:
        """Text picture of the block layout, one grid per (batch, head), up to ``limit``.

        Each cell is two characters wide and stands for a group of blocks when the grid
        has more than ``grid_size`` rows/cols (``grid_size=-1``: one cell per block):
        '█' all blocks of the group are full, ' ' all are empty, '░' anything else
        (partial blocks, or a mix). Query blocks run down, KV blocks across.
        ``str(block_mask)`` draws torch's picture instead (see ``__str__``).
        """
        kinds = self._block_kinds().cpu()
        *batch_dims, rows, cols = kinds.shape
        row_step, col_step = _cell_steps(rows, cols, grid_size)

        def cell(group: Tensor) -> str:
            if bool((group == 2).all()):
                return _FULL_CHAR
            if bool((group == 0).all()):
                return _EMPTY_CHAR
            return _PARTIAL_CHAR

        lines = [
            f"{_FULL_CHAR} full  {_PARTIAL_CHAR} partial  '{_EMPTY_CHAR}' empty; "
            f"one cell = {row_step}x{col_step} blocks of {self.BLOCK_SIZE[0]}x{self.BLOCK_SIZE[1]}"
        ]
        shown, hidden = _shown_pictures(batch_dims, limit)
        border = "+" + "-" * (2 * _cdiv(cols, col_step)) + "+"
        for batch_index in shown:
            label = ", ".join(f"{name}={i}" for name, i in zip(("b", "h", "d2", "d3"), batch_index))
            lines.append(f"[{label}]" if label else "[]")
            lines.append(border)
            lines.extend("|" + row + "|" for row in _picture_rows(kinds[batch_index], row_step, col_step, cell))
            lines.append(border)
        if hidden:
            lines.append(f"... ({hidden} more; raise limit= or index the BlockMask, e.g. block_mask[b, h], "
                         f"to see others)")
        return "\n".join(lines)

    def _computed_blocks_picture(self, grid_size: int | tuple[int, int] = (20, 20), limit: int = 4) -> str:
        """The pictures of ``__str__``: per (batch, head), its index tuple on a line, then
        one line per cell row with '█' where all blocks of the cell are computed (partial
        or full), ' ' where none is, '░' for a mix; pictures separated by a blank line."""
        computed = self.to_dense().cpu().bool()
        *batch_dims, rows, cols = computed.shape
        row_step, col_step = _cell_steps(rows, cols, grid_size)

        def cell(group: Tensor) -> str:
            if bool(group.all()):
                return _FULL_CHAR
            if not bool(group.any()):
                return _EMPTY_CHAR
            return _PARTIAL_CHAR

        shown, hidden = _shown_pictures(batch_dims, limit)
        pictures = []
        for batch_index in shown:
            grid_rows = _picture_rows(computed[batch_index], row_step, col_step, cell)
            pictures.append(f"{batch_index}\n" + "".join(row + "\n" for row in grid_rows))
        if hidden:
            pictures.append(f"...\n{hidden} more not shown: index the BlockMask (block_mask[b, h]) or call "
                            f"to_string(limit=...) to see them")
        return "\n".join(pictures)

    def __repr__(self) -> str:
        rows, cols = self.kv_indices.shape[-2], self._kv_columns()
        partial = int(self.kv_num_blocks.sum().item())
        full = int(self.full_kv_num_blocks.sum().item()) if self.full_kv_num_blocks is not None else 0
        return (
            "BlockMask(\n"
            f"    shape={self.shape},  # (*batch, q_len, kv_len)\n"
            f"    seq_lengths={self.seq_lengths},\n"
            f"    BLOCK_SIZE={self.BLOCK_SIZE},\n"
            f"    block_grid={rows}x{cols},  # query blocks x kv blocks\n"
            f"    partial_blocks={partial}, full_blocks={full}"
            f"{'' if self.full_kv_num_blocks is not None else ' (not separated)'},\n"
            f"    sparsity={self.sparsity():.2f}%,\n"
            f"    mask_mod={_mod_name(self.mask_mod)},\n"
            f"    device={self.kv_indices.device},\n"
            ")"
        )

    def __str__(self) -> str:
        """torch's text form of a BlockMask, so that expected strings written against
        torch's match: the shape and sparsity on the first line, then up to four
        pictures of which blocks are computed (each headed by its batch index tuple),
        then ``)``. Its cells do not tell full from partial blocks; ``to_string()`` draws
        flexattn's picture, which does. Two things differ from torch's text: the text
        after ``...`` when pictures are left out, and the sparsity where a length is not
        a multiple of its block size (flexattn counts skipped blocks of the grid, torch
        counts blocks times BLOCK_SIZE against the positions, which overhanging tiles
        exceed).
        """
        return (
            f"BlockMask(shape={self.shape}, sparsity={self.sparsity():.2f}%, \n"
            f"{self._computed_blocks_picture().strip()}\n)"
        )

    def __getitem__(self, index: Any) -> BlockMask:
        """Select batches, heads and query blocks; keeps all three dims.

        ``index`` is up to three entries (batch, head, query block), each an int, a
        slice or an index tensor. Ints keep their dim (size 1). The result's mask_mod is
        a placeholder that raises, because indices are renumbered. Its query length is,
        as the installed torch's (``_compat.BLOCK_MASK_INDEXING_PACKS_QUERIES``), either
        that of the query blocks kept (``_kept_query_length``) or the whole mask's.
        """
        entries = index if isinstance(index, tuple) else (index,)
        if len(entries) > 3:
            raise IndexError(
                f"BlockMask can be indexed by at most (batch, head, query block), got {len(entries)} indices"
            )
        entries = (*entries, *(slice(None),) * (3 - len(entries)))
        if self.kv_num_blocks.dim() < 3:
            raise IndexError(
                f"indexing needs a (batch, head, query block) layout; kv_num_blocks has "
                f"shape {tuple(self.kv_num_blocks.shape)}"
            )
        sizes = self.kv_num_blocks.shape[:3]
        normalized = []
        for entry, size in zip(entries, sizes):
            if isinstance(entry, int) and not isinstance(entry, bool):
                if not -size <= entry < size:
                    raise IndexError(f"index {entry} is out of range for a dim of size {size}")
                start = entry % size
                normalized.append(slice(start, start + 1))
            else:
                normalized.append(entry)
        where = tuple(normalized)
        full_num = self.full_kv_num_blocks[where] if self.full_kv_num_blocks is not None else None
        full_idx = self.full_kv_indices[where] if self.full_kv_indices is not None else None
        kv_indices = self.kv_indices[where]
        seq_lengths = self.seq_lengths
        if BLOCK_MASK_INDEXING_PACKS_QUERIES:
            kept = _kept_query_length(where[2], kv_indices.shape[-2], self.BLOCK_SIZE[0], self.seq_lengths[0],
                                      self.kv_num_blocks.shape[2])
            seq_lengths = (kept, self.seq_lengths[1])
        return BlockMask.from_kv_blocks(
            self.kv_num_blocks[where],
            kv_indices,
            full_num,
            full_idx,
            BLOCK_SIZE=self.BLOCK_SIZE,
            mask_mod=_sliced_mask_mod,
            seq_lengths=seq_lengths,
            compute_q_blocks=self.q_indices is not None,
        )

    def _tile_to(self, batch: int, heads: int) -> BlockMask:
        """The mask a call with ``batch`` x ``heads`` query rows reads: batch b and head h
        use the mask's entry (b % mask batch, h % mask heads), as torch's flex does. A
        mask dim of 1 or of the call's size is kept (1 broadcasts in the kernels); a
        larger one is narrowed (a view); a smaller one is gathered (the tables are per
        block, small). mask_mod still sees the call's b and h."""
        sizes = self.kv_num_blocks.shape[:2]
        if all(size in (1, want) for size, want in zip(sizes, (batch, heads))):
            return self

        def tile(table: Tensor | None) -> Tensor | None:
            if table is None:
                return None
            for dim, want in enumerate((batch, heads)):
                size = table.shape[dim]
                if size in (1, want):
                    continue
                if size > want:
                    table = table.narrow(dim, 0, want)
                else:
                    rows = torch.arange(want, device=table.device) % size
                    table = table.index_select(dim, rows)
            return table

        tables = {name: tile(getattr(self, name)) for name in self._TENSOR_FIELDS}
        return BlockMask(self.seq_lengths, **tables, BLOCK_SIZE=self.BLOCK_SIZE, mask_mod=self.mask_mod)

    def _adjust(self, new_q_len: int, new_kv_len: int) -> BlockMask:
        """Crop to the upper-left (new_q_len, new_kv_len) corner of the mask.

        Block lists are re-derived so that only blocks inside the new grid stay valid. A
        full block stays full (all of its positions were allowed, so those left inside
        the new lengths are); a partial block that now hangs over a new end stays
        partial, where create_block_mask at the new lengths may find it full. Valid for
        masks whose value at a position does not depend on the sequence lengths, such
        as causal or sliding-window masks. Index rows narrower than the KV blocks (a
        paged mask's) are cropped in place and keep their width (at most the new KV
        blocks), without going through the (..., QB, KVB) flags of the whole grid.
        """
        new_q_len = _check_positive_int(new_q_len, "new_q_len")
        new_kv_len = _check_positive_int(new_kv_len, "new_kv_len")
        q_block, kv_block = self.BLOCK_SIZE
        rows, cols = _cdiv(new_q_len, q_block), _cdiv(new_kv_len, kv_block)
        old_rows, old_cols = self.kv_indices.shape[-2], self._kv_columns()
        if rows > old_rows or cols > old_cols:
            raise ValueError(
                f"_adjust can only shrink a BlockMask: ({new_q_len}, {new_kv_len}) needs "
                f"{rows}x{cols} blocks of {self.BLOCK_SIZE}, the mask has {old_rows}x{old_cols}"
            )
        widths = [idx.shape[-1] for idx in (self.kv_indices, self.full_kv_indices) if idx is not None]
        if min(widths) < self._block_grid()[1]:
            return self._adjust_narrow(new_q_len, new_kv_len, rows, cols)
        partial = _ordered_to_dense(self.kv_num_blocks, self.kv_indices, old_cols)[..., :rows, :cols].bool()
        full = None
        if self.full_kv_num_blocks is not None:
            full = _ordered_to_dense(self.full_kv_num_blocks, self.full_kv_indices, old_cols)[..., :rows, :cols].bool()
        return _from_block_flags(partial, full, (new_q_len, new_kv_len), self.BLOCK_SIZE, self.mask_mod,
                                 compute_q_blocks=self.q_indices is not None)

    def _adjust_narrow(self, new_q_len: int, new_kv_len: int, rows: int, cols: int) -> BlockMask:
        """_adjust of a mask with index rows narrower than its KV blocks: the first
        ``rows`` query blocks' rows, with the listed ids below ``cols`` moved to the
        front in their order (each to its rank among the kept ones, as
        PagedKVCache._page_lists places them), padding 0, at most ``cols`` wide."""

        def crop(num: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
            num, idx = num[..., :rows], idx[..., :rows, :]
            slots = torch.arange(idx.shape[-1], device=idx.device)
            keep = (slots < num.unsqueeze(-1)) & (idx >= 0) & (idx < cols)
            kept_num, order = _compact_kept(keep, idx, min(idx.shape[-1], cols))
            return kept_num.to(num.dtype), order

        partial = crop(self.kv_num_blocks, self.kv_indices)
        full = (None, None)
        if self.full_kv_num_blocks is not None:
            full = crop(self.full_kv_num_blocks, self.full_kv_indices)
        return BlockMask.from_kv_blocks(*partial, *full, BLOCK_SIZE=self.BLOCK_SIZE, mask_mod=self.mask_mod,
                                        seq_lengths=(new_q_len, new_kv_len),
                                        compute_q_blocks=self.q_indices is not None)

    def adjust(self, new_q_len: int, new_kv_len: int) -> BlockMask:
        """Public name of :meth:`_adjust`: crop the mask to shorter sequence lengths."""
        return self._adjust(new_q_len, new_kv_len)

    def to(self, device: torch.device | str) -> BlockMask:
        """A new BlockMask whose tensors are on ``device`` (this one is unchanged)."""
        moved = {
            name: None if getattr(self, name) is None else getattr(self, name).to(device)
            for name in self._TENSOR_FIELDS
        }
        return BlockMask(
            self.seq_lengths, **moved, BLOCK_SIZE=self.BLOCK_SIZE, mask_mod=self.mask_mod
        )


def _from_block_flags(
    partial: Tensor,
    full: Tensor | None,
    seq_lengths: tuple[int, int],
    block_size: tuple[int, int],
    mask_mod: MaskMod | None,
    compute_q_blocks: bool = True,
) -> BlockMask:
    """BlockMask from bool block flags (..., QB, KVB) of partial and full blocks (with
    the transposed lists unless compute_q_blocks is False)."""
    kv_num, kv_idx = _dense_to_ordered(partial)
    full_kv_num = full_kv_idx = q_num = q_idx = full_q_num = full_q_idx = None
    if compute_q_blocks:
        q_num, q_idx = _dense_to_ordered(partial.transpose(-2, -1))
    if full is not None:
        full_kv_num, full_kv_idx = _dense_to_ordered(full)
        if compute_q_blocks:
            full_q_num, full_q_idx = _dense_to_ordered(full.transpose(-2, -1))
    return BlockMask(
        seq_lengths,
        kv_num,
        kv_idx,
        full_kv_num,
        full_kv_idx,
        q_num,
        q_idx,
        full_q_num,
        full_q_idx,
        BLOCK_SIZE=block_size,
        mask_mod=mask_mod,
    )


def create_block_mask(
    mask_mod: MaskMod,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    device: Any = None,
    BLOCK_SIZE: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
    _compile: bool = False,
) -> BlockMask:
    """Build the BlockMask of ``mask_mod`` for (B, H, Q_LEN, KV_LEN) without a dense mask.

    Args:
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = may attend).
        B, H: batch size and number of heads; None (or 1) gives a mask of size 1 on that
            dim, which broadcasts over the attention call's batch / heads.
        Q_LEN, KV_LEN: sequence lengths (any positive ints, not only block multiples).
        device: where to evaluate and store; defaults to the current accelerator, else CPU.
        BLOCK_SIZE: tile size, an int or a (q_block, kv_block) pair.
        _compile: evaluate each chunk through ``torch.compile`` (fuses mask evaluation
            and block reduction; worth it for long sequences on a GPU).

    The mask is evaluated a chunk at a time (``MASK_CHUNK_BYTES`` of bools per chunk)
    and reduced to block flags at once, so memory stays bounded at any length.
    """
    if _mod_arity(mask_mod, "mask_mod") != _MASK_MOD_ARITY:
        raise TypeError(
            f"mask_mod must take 4 arguments (b, h, q_idx, kv_idx); {_mod_name(mask_mod)} "
            "takes 5, i.e. it is a score_mod. Pass score_mods to flex_attention(score_mod=...) "
            "and build block masks from a mask_mod."
        )
    B = _check_positive_int(B, "B", allow_none=True)
    H = _check_positive_int(H, "H", allow_none=True)
    Q_LEN = _check_positive_int(Q_LEN, "Q_LEN")
    KV_LEN = _check_positive_int(KV_LEN, "KV_LEN")
    block_size = _normalize_block_size(BLOCK_SIZE)
    B = 1 if B is None else B
    H = 1 if H is None else H
    device = _resolve_device(device)
    timed = not torch.compiler.is_compiling() and log.isEnabledFor(logging.INFO)
    started = time.perf_counter() if timed else 0.0
    any_blocks, all_blocks = _compute_block_flags(
        mask_mod, B, H, Q_LEN, KV_LEN, device, *block_size, compile_chunks=_compile
    )
    mask = _from_block_flags(
        any_blocks & ~all_blocks, all_blocks, (Q_LEN, KV_LEN), block_size, mask_mod
    )
    if timed and time.perf_counter() - started >= LONG_BUILD_SECONDS:
        log.info("flexattn: create_block_mask(%s) for B=%s H=%s Q_LEN=%s KV_LEN=%s BLOCK_SIZE=%s on %s took %.2f s",
                 _mod_name(mask_mod), B, H, Q_LEN, KV_LEN, block_size, device, time.perf_counter() - started)
    return mask


# --------------------------------------------------------------------------------------
# pytree registration
# --------------------------------------------------------------------------------------


class _MaskModContext:
    """Holds a BlockMask's mask_mod inside a pytree spec, with value-style equality.

    Specs are compared to decide whether a traced program can be reused. Functions
    compare by identity, which is too strict when the same mask_mod is re-created on
    every call (a closure defined in ``forward``). Two mask_mods are equal here when
    they are the same object, or functions with the same code whose closure cells hold
    the same objects (or equal non-tensor values).
    """

    __slots__ = ("fn",)

    def __init__(self, fn: MaskMod) -> None:
        self.fn = fn

    @staticmethod
    def _cells(fn: Any) -> tuple[Any, ...]:
        return tuple(cell.cell_contents for cell in (getattr(fn, "__closure__", None) or ()))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _MaskModContext):
            return NotImplemented
        if self.fn is other.fn:
            return True
        if not (inspect.isfunction(self.fn) and inspect.isfunction(other.fn)):
            return False
        if self.fn.__code__ is not other.fn.__code__:
            return False
        mine, theirs = self._cells(self.fn), self._cells(other.fn)
        if len(mine) != len(theirs):
            return False
        for a, b in zip(mine, theirs):
            if a is b:
                continue
            if isinstance(a, Tensor) or isinstance(b, Tensor):
                return False
            try:
                if not bool(a == b):
                    return False
            except Exception:
                return False
        return True

    def __hash__(self) -> int:
        if inspect.isfunction(self.fn):
            return hash(self.fn.__code__)
        return hash(id(self.fn))

    def __repr__(self) -> str:
        return f"mask_mod={_mod_name(self.fn)}"


def _flatten_block_mask(mask: BlockMask) -> tuple[list[Tensor], tuple[Any, ...]]:
    present = tuple(name for name in BlockMask._TENSOR_FIELDS if getattr(mask, name) is not None)
    leaves = [getattr(mask, name) for name in present]
    context = (mask.seq_lengths, mask.BLOCK_SIZE, _MaskModContext(mask.mask_mod), present)
    return leaves, context


def _flatten_block_mask_with_keys(mask: BlockMask):
    leaves, context = _flatten_block_mask(mask)
    return [(pytree.GetAttrKey(name), leaf) for name, leaf in zip(context[3], leaves)], context


def _unflatten_block_mask(leaves, context) -> BlockMask:
    seq_lengths, block_size, mask_mod_context, present = context
    tensors = dict.fromkeys(BlockMask._TENSOR_FIELDS)
    tensors.update(zip(present, leaves))
    return BlockMask(seq_lengths, **tensors, BLOCK_SIZE=block_size, mask_mod=mask_mod_context.fn)


pytree.register_pytree_node(
    BlockMask,
    _flatten_block_mask,
    _unflatten_block_mask,
    serialized_type_name="flexattn.block_mask.BlockMask",
    flatten_with_keys_fn=_flatten_block_mask_with_keys,
)

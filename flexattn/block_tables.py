"""The block-table format: the eight tensors a BlockMask holds and the kernels read, their
conversions and their invariants.

Blocks
------
A mask over ``q_len x kv_len`` positions is cut into tiles of ``q_block x kv_block``
positions (``BLOCK_SIZE``): ``QB = cdiv(q_len, q_block)`` query blocks down and ``KVB =
cdiv(kv_len, kv_block)`` KV blocks across. Every tile is one of

* *empty*:   no position is allowed; the tile is not listed and the kernels skip it;
* *partial*: some positions are allowed; listed as partial, the kernels compute it and
  apply mask_mod;
* *full*:    every position is allowed; listed as full, the kernels compute it without
  calling mask_mod.

The kernels mask positions past the ends by bounds, so a tile hanging over an end may be
listed either way; create_block_mask counts its positions past the end as masked (partial
at best, as torch does). *Block flags* are bool ``(..., rows, cols)`` grids, True where a
block is listed (``flags_from_lists``).

The tables
----------
``...`` are the batch dims, normally ``(B, H)``; a dim of 1 broadcasts over the
attention call's batch or heads, another size is read at ``b % size`` (``tile_table``).
The tables are int32 as create_block_mask and the conversions here build them (BlockMask
checks shapes, not dtypes).

==========================  ======================  ===================================
``kv_num_blocks``           ``(..., QB)``           per query block, how many partial
                                                    KV blocks its row lists
``kv_indices``              ``(..., QB, W)``        the rows: those KV block ids
``full_kv_num_blocks``      ``(..., QB)``           the same for full KV blocks
``full_kv_indices``         ``(..., QB, W)``
``q_num_blocks``            ``(..., C)``            the transposes: per KV block, how
                                                    many query blocks list it as partial
``q_indices``               ``(..., C, QB)``        those query block ids
``full_q_num_blocks``       ``(..., C)``            the same for full blocks
``full_q_indices``          ``(..., C, QB)``
==========================  ======================  ===================================

``full_kv_*`` are both present or both None: None means full blocks are not separated,
every computed block is listed as partial. The ``q_*`` tables (what the backward walks)
are None for a mask built with ``compute_q_blocks=False``, which serves forward calls
only; the full ones among them exist when ``full_kv_*`` do.

Rules of a row (a last-dim slice of an ``*_indices`` table with its count):

* Its first ``num_blocks`` entries are the listed (*counted*) ids: distinct, each in
  ``[0, C)`` for a KV row, where ``C = kv_columns(...)`` is KVB, or the row width W
  where that is larger, and in ``[0, QB)`` for a query row. A block is listed in at
  most one of a row's two lists (partial or full).
* The entries after the count are padding: nothing uses their values, and they may
  repeat ids. The kernels load a row's first entry whatever its count (and do not use
  it when the count is 0), so a row holds at least one entry: ``W >= 1`` and ``W >=
  num_blocks``.
* ``W`` is KVB for masks built from flags; it may be narrower (a paged mask's rows are
  ``max_pages_per_slot`` wide, ``compact_kept``).
* Order: rows built from flags (``lists_from_flags``: create_block_mask, the
  transposes) list their ids ascending and pad with the unlisted ids ascending, so each
  row is a permutation of ``range(cols)``, torch's layout. Compacted rows keep the
  given order and pad with 0.

The ``q_*`` tables are the KV lists read along the other axis, over the whole ``C``
columns: KV block ``c``'s row lists the query blocks whose KV rows count ``c``
(``transposed_tables``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ._mask_tuple import BLOCK_TABLE_FIELDS

#: The per-query-block tables (the forward's and the decode kernel's) and their
#: transposes (the backward's), each in the operator tuple's order.
KV_TABLE_FIELDS = BLOCK_TABLE_FIELDS[:4]
Q_TABLE_FIELDS = BLOCK_TABLE_FIELDS[4:]
#: Codes of ``block_kinds``.
EMPTY, PARTIAL, FULL = 0, 1, 2


class BlockTables(NamedTuple("_BlockTableFields", [(name, Any) for name in BLOCK_TABLE_FIELDS])):
    """The eight tables by name, in BlockMask's argument order (None where absent)."""

    __slots__ = ()


def cdiv(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def block_size_pair(BLOCK_SIZE: Any) -> tuple[int, int]:
    """A BLOCK_SIZE argument (an int, or a (q_block, kv_block) pair) as the pair; a
    ValueError for anything but positive ints."""
    if isinstance(BLOCK_SIZE, int) and not isinstance(BLOCK_SIZE, bool):
        pair: Sequence[Any] = (BLOCK_SIZE, BLOCK_SIZE)
    elif isinstance(BLOCK_SIZE, (tuple, list)) and len(BLOCK_SIZE) == 2:
        pair = BLOCK_SIZE
    else:
        pair = (0,)
    if any(isinstance(size, bool) or not isinstance(size, int) or size < 1 for size in pair):
        raise ValueError(
            f"BLOCK_SIZE must be a positive int or a (q_block, kv_block) pair of positive "
            f"ints, got {BLOCK_SIZE!r}"
        )
    return int(pair[0]), int(pair[1])


def block_grid(seq_lengths: tuple[int, int], block_size: tuple[int, int]) -> tuple[int, int]:
    """(QB, KVB): the query and KV blocks that the sequence lengths cover."""
    return cdiv(seq_lengths[0], block_size[0]), cdiv(seq_lengths[1], block_size[1])


def kv_columns(indices: Tensor, kv_len: int, kv_block: int) -> int:
    """C, the KV block columns of a mask's block grid: the blocks kv_len covers, or the
    index rows' width where that is larger (rows may be narrower than the KV blocks)."""
    return max(indices.shape[-1], cdiv(kv_len, kv_block))


# --------------------------------------------------------------------------------------
# Conversions
# --------------------------------------------------------------------------------------


def flags_from_lists(num_blocks: Tensor, indices: Tensor, num_cols: int) -> Tensor:
    """Block lists -> bool flags (..., rows, num_cols): column c of row r is set when c
    is among the first num_blocks[..., r] entries of indices[..., r, :]. Padding is sent
    to a scratch column and dropped, and so are listed ids outside [0, num_cols) (an
    invalid mask, which ``check_listed_ids`` reports where it can read the values for
    free), instead of failing in the scatter (on a GPU, a device-side assert)."""
    slots = torch.arange(indices.shape[-1], device=indices.device)
    ids = indices.to(torch.int64)
    listed = (slots < num_blocks.unsqueeze(-1)) & (ids >= 0) & (ids < num_cols)
    columns = torch.where(listed, ids, num_cols)
    grid = torch.zeros(*indices.shape[:-1], num_cols + 1, dtype=torch.bool, device=indices.device)
    return grid.scatter_(-1, columns, True)[..., :num_cols]


def lists_from_flags(flags: Tensor) -> tuple[Tensor, Tensor]:
    """Block flags (..., rows, cols) -> (num_blocks (..., rows), indices (..., rows, cols)),
    int32.

    Lists the set block ids first, ascending, followed by the unset ones, ascending (a
    stable descending sort of the 0/1 flags, computed without a sort: a set block's place
    is its rank among the set ones, an unset block's is num_blocks plus its rank among
    the unset ones).
    """
    flags = flags.to(torch.bool)
    if flags.shape[-1] == 1:    # one column (the transposed lists of one query block)
        return flags.squeeze(-1).to(torch.int32).contiguous(), torch.zeros(flags.shape, dtype=torch.int32,
                                                                           device=flags.device)
    num_blocks = flags.sum(dim=-1, dtype=torch.int64)
    place = torch.where(flags, torch.cumsum(flags, -1), num_blocks.unsqueeze(-1) + torch.cumsum(~flags, -1)) - 1
    ids = torch.arange(flags.shape[-1], dtype=torch.int32, device=flags.device).expand(flags.shape)
    indices = torch.empty(flags.shape, dtype=torch.int32, device=flags.device).scatter_(-1, place, ids)
    return num_blocks.to(torch.int32).contiguous(), indices.contiguous()


def transpose_lists(num_blocks: Tensor, indices: Tensor, num_cols: int) -> tuple[Tensor, Tensor]:
    """Per-row block lists over ``num_cols`` columns -> per-column block lists (the
    layout the backward walks)."""
    return lists_from_flags(flags_from_lists(num_blocks, indices, num_cols).transpose(-2, -1))


def transposed_tables(kv_num_blocks: Tensor, kv_indices: Tensor, full_kv_num_blocks: Tensor | None,
                      full_kv_indices: Tensor | None, num_cols: int) -> tuple[Tensor | None, ...]:
    """(q_num_blocks, q_indices, full_q_num_blocks, full_q_indices) of the KV lists
    over ``num_cols`` columns; the full ones None without full KV lists."""
    q_num_blocks, q_indices = transpose_lists(kv_num_blocks, kv_indices, num_cols)
    full_q_num_blocks = full_q_indices = None
    if full_kv_num_blocks is not None:
        full_q_num_blocks, full_q_indices = transpose_lists(full_kv_num_blocks, full_kv_indices, num_cols)
    return q_num_blocks, q_indices, full_q_num_blocks, full_q_indices


def tables_from_flags(partial: Tensor, full: Tensor | None, compute_q_blocks: bool = True) -> BlockTables:
    """The tables of bool block flags (..., QB, KVB) of partial and full blocks (``full``
    None: not separated), with the transposes unless ``compute_q_blocks`` is False."""
    kv_num, kv_idx = lists_from_flags(partial)
    full_kv_num = full_kv_idx = q_num = q_idx = full_q_num = full_q_idx = None
    if compute_q_blocks:
        q_num, q_idx = lists_from_flags(partial.transpose(-2, -1))
    if full is not None:
        full_kv_num, full_kv_idx = lists_from_flags(full)
        if compute_q_blocks:
            full_q_num, full_q_idx = lists_from_flags(full.transpose(-2, -1))
    return BlockTables(kv_num, kv_idx, full_kv_num, full_kv_idx, q_num, q_idx, full_q_num, full_q_idx)


def compact_kept(keep: Tensor, ids: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """Block lists of the kept entries: ``keep`` / ``ids`` (..., M) -> (num (...) int32,
    indices (..., width)), the kept ids first in their order (each at its rank among
    the kept ones), then padding 0. The count is clamped to ``width``: ranks past it
    (an invalid row that lists a block twice) go to a scratch column and are dropped."""
    place = torch.where(keep, (torch.cumsum(keep, -1) - 1).clamp(max=width), width)
    order = torch.zeros(*ids.shape[:-1], width + 1, dtype=ids.dtype, device=ids.device)
    order = order.scatter(-1, place, ids)[..., :width].contiguous()
    return keep.sum(-1, dtype=torch.int32).clamp(max=width), order


def crop_lists(num_blocks: Tensor, indices: Tensor, rows: int, cols: int) -> tuple[Tensor, Tensor]:
    """The lists of the first ``rows`` query blocks restricted to KV blocks below
    ``cols``, without going through flags of the whole grid (for rows narrower than the
    KV blocks): the counted ids below ``cols`` compacted to the front in their order,
    padding 0, at most ``cols`` wide; the count keeps ``num_blocks``' dtype."""
    num_blocks, indices = num_blocks[..., :rows], indices[..., :rows, :]
    slots = torch.arange(indices.shape[-1], device=indices.device)
    keep = (slots < num_blocks.unsqueeze(-1)) & (indices >= 0) & (indices < cols)
    kept_num, order = compact_kept(keep, indices, min(indices.shape[-1], cols))
    return kept_num.to(num_blocks.dtype), order


def crop_tables(kv_num_blocks: Tensor, kv_indices: Tensor, full_kv_num_blocks: Tensor | None,
                full_kv_indices: Tensor | None, rows: int, cols: int, grid_cols: int,
                compute_q_blocks: bool = True) -> BlockTables:
    """The tables of the upper-left ``rows`` x ``cols`` blocks of a mask whose lengths
    cover ``grid_cols`` KV blocks (BlockMask._adjust). Listed blocks stay listed as they
    were, partial or full. Rows at least ``grid_cols`` wide are cropped through the
    flags and come back as lists_from_flags orders them; narrower rows (a paged mask's)
    are cropped in place (``crop_lists``) and stay at most ``cols`` wide. The transposes
    span ``cols`` columns."""
    widths = [idx.shape[-1] for idx in (kv_indices, full_kv_indices) if idx is not None]
    if min(widths) < grid_cols:
        partial = crop_lists(kv_num_blocks, kv_indices, rows, cols)
        full = (None, None)
        if full_kv_num_blocks is not None:
            full = crop_lists(full_kv_num_blocks, full_kv_indices, rows, cols)
        q_tables = transposed_tables(*partial, *full, cols) if compute_q_blocks else (None,) * 4
        return BlockTables(*partial, *full, *q_tables)
    num_cols = max(kv_indices.shape[-1], grid_cols)
    partial = flags_from_lists(kv_num_blocks, kv_indices, num_cols)[..., :rows, :cols]
    full = None
    if full_kv_num_blocks is not None:
        full = flags_from_lists(full_kv_num_blocks, full_kv_indices, num_cols)[..., :rows, :cols]
    return tables_from_flags(partial, full, compute_q_blocks)


def tile_table(table: Tensor | None, batch: int, heads: int) -> Tensor | None:
    """A table as a call with ``batch`` x ``heads`` query rows reads it: batch b and head
    h use entry (b % table batch, h % table heads). A dim of 1 or of the call's size is
    kept (1 broadcasts in the kernels); a larger one is narrowed (a view); a smaller one
    is gathered."""
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


def row_selection(index: Any, kv_num_blocks: Tensor) -> tuple[Any, ...]:
    """A (batch, head, query block) index as the key that picks those rows of the KV
    tables, keeping all three dims: up to three entries, each an int, a slice or an
    index tensor; an int becomes a slice of one. IndexError for more entries, an int
    out of range, or tables without the three dims."""
    entries = index if isinstance(index, tuple) else (index,)
    if len(entries) > 3:
        raise IndexError(
            f"BlockMask can be indexed by at most (batch, head, query block), got {len(entries)} indices"
        )
    entries = (*entries, *(slice(None),) * (3 - len(entries)))
    if kv_num_blocks.dim() < 3:
        raise IndexError(
            f"indexing needs a (batch, head, query block) layout; kv_num_blocks has "
            f"shape {tuple(kv_num_blocks.shape)}"
        )
    normalized = []
    for entry, size in zip(entries, kv_num_blocks.shape[:3]):
        if isinstance(entry, int) and not isinstance(entry, bool):
            if not -size <= entry < size:
                raise IndexError(f"index {entry} is out of range for a dim of size {size}")
            start = entry % size
            normalized.append(slice(start, start + 1))
        else:
            normalized.append(entry)
    return tuple(normalized)


def block_kinds(kv_num_blocks: Tensor, kv_indices: Tensor, full_kv_num_blocks: Tensor | None,
                full_kv_indices: Tensor | None, num_cols: int) -> Tensor:
    """int8 (..., QB, num_cols): EMPTY, PARTIAL or FULL per block."""
    kinds = flags_from_lists(kv_num_blocks, kv_indices, num_cols).to(torch.int8)
    if full_kv_num_blocks is not None:
        full = flags_from_lists(full_kv_num_blocks, full_kv_indices, num_cols)
        kinds = torch.where(full, FULL, kinds).to(torch.int8)
    return kinds


# --------------------------------------------------------------------------------------
# Invariants
# --------------------------------------------------------------------------------------


class BlockMaskArgumentError(ValueError, AssertionError):
    """A BlockMask was given one tensor of a (num_blocks, indices) pair without the other.

    It is a ValueError, like flexattn's other argument errors, and an AssertionError,
    which is what torch's BlockMask raises for the same call, so code catching either
    keeps working.
    """


def check_pair(num_name: str, num_blocks: Any, indices_name: str, indices: Any) -> None:
    """Raise BlockMaskArgumentError unless both tables of a list are given or neither."""
    if (num_blocks is None) != (indices is None):
        given, missing = (num_name, indices_name) if indices is None else (indices_name, num_name)
        raise BlockMaskArgumentError(
            f"{num_name} and {indices_name} must be given together or both be None; "
            f"got {given} without {missing}"
        )


def check_kv_lists(kv_num_blocks: Any, kv_indices: Any, full_kv_num_blocks: Any, full_kv_indices: Any) -> None:
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
    check_pair("full_kv_num_blocks", full_kv_num_blocks, "full_kv_indices", full_kv_indices)
    for name, indices in (("kv_indices", kv_indices), ("full_kv_indices", full_kv_indices)):
        # The kernels read a row's first entry whatever its count (a zero-width row
        # would be read out of bounds); a tensor without rows has nothing to read.
        if isinstance(indices, Tensor) and indices.dim() and indices.shape[-1] == 0 \
                and math.prod(indices.shape[:-1]) > 0:
            raise ValueError(
                f"{name} must hold at least one entry per row (its last dim, the row width, "
                f"must be >= 1, even for rows that list no block), got shape {tuple(indices.shape)}"
            )


def values_readable(*tensors: Tensor | None) -> bool:
    """Whether a check may read these tensors' values at no device sync and without a
    data-dependent branch in a trace: plain CPU tensors (not fake, meta or functional
    ones), outside torch.compile."""
    return not torch.compiler.is_compiling() and all(
        type(t) is Tensor and t.device.type == "cpu" for t in tensors if t is not None
    )


def check_listed_kv_ids(kv_num_blocks: Tensor, kv_indices: Tensor, full_kv_num_blocks: Tensor | None,
                        full_kv_indices: Tensor | None, kv_block: int) -> None:
    """check_listed_ids of both KV lists against the rows' width (from_kv_blocks without
    seq_lengths), where their values are readable at no cost (``values_readable``)."""
    if not values_readable(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices):
        return
    for name, num, idx in (("kv_indices", kv_num_blocks, kv_indices),
                           ("full_kv_indices", full_kv_num_blocks, full_kv_indices)):
        if idx is not None:
            check_listed_ids(name, num, idx, kv_indices.shape[-1], kv_block)


def check_listed_ids(argument: str, num_blocks: Tensor, indices: Tensor, num_cols: int, kv_block: int) -> None:
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

"""Block-sparse attention masks: ``BlockMask``, ``create_block_mask`` and mask helpers.

A *mask_mod* is a tiny function ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` that says
whether query ``q_idx`` of batch ``b`` and head ``h`` may attend to key ``kv_idx``. The
attention kernels never evaluate it on the whole (Q_LEN x KV_LEN) grid. They walk over
tiles of ``Q_BLOCK_SIZE x KV_BLOCK_SIZE`` positions and need to know, per tile, one of
three things:

* *empty*:   every position is masked out, so the tile is skipped;
* *full*:    every position is allowed, so the tile is computed without calling mask_mod;
* *partial*: some positions are allowed, so the tile is computed and mask_mod applied.

``BlockMask`` stores this classification in the block tables the kernels read: per
(batch, head, query block) row the partial and the full KV blocks, and their transposes
per KV block for the backward. flexattn/block_tables.py defines that format (shapes,
order, padding) and converts it. ``create_block_mask`` evaluates the mask_mod a chunk of
the grid at a time and keeps only per-block flags (flexattn/mask_evaluation.py), so its
memory stays bounded at any sequence length.
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ._compat import BLOCK_MASK_INDEXING_PACKS_QUERIES, is_fake, pytree
from ._mask_tuple import BLOCK_TABLE_FIELDS
from .block_tables import (BlockMaskArgumentError, block_grid, block_kinds, block_size_pair, cdiv,
                           check_kv_lists, check_listed_kv_ids, check_pair, crop_tables, flags_from_lists,
                           kv_columns, row_selection, tables_from_flags, tile_table, transposed_tables)
from .mask_evaluation import chunked_block_flags, evaluate_mod, index_vectors, traced_block_flags
from .mask_pictures import computed_picture, kinds_picture
from .mod_signature import MASK_MOD_ARITY, MaskMod, captured_tensors, check_mask_mods, mod_arity, mod_name

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

PARTIAL_HEAVY_SHARE = 0.8
"""A BlockMask is ``partial_heavy`` when more than this share of its listed blocks are
partial: the neighbourhood tables whose tiles it picks list all blocks partial, document
masks 17-55% (bench/DECISIONS.md#forward-partial-heavy-memory-mask)."""

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



# --------------------------------------------------------------------------------------
# mask_mod helpers
# --------------------------------------------------------------------------------------


def noop_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """The mask_mod that allows every (query, key) pair: a 0-d ``True`` tensor.

    It is built from ``b`` (not with ``torch.tensor``) so that it lands on the index
    tensors' device and traces as one ``new_ones`` op under make_fx and Dynamo.
    """
    return b.new_ones((), dtype=torch.bool)


def and_masks(*mask_mods: MaskMod) -> MaskMod:
    """Return a mask_mod allowing a position only where *all* of ``mask_mods`` allow it."""
    check_mask_mods("and_masks", mask_mods)

    def and_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        allowed = mask_mods[0](b, h, q_idx, kv_idx)
        for mask_mod in mask_mods[1:]:
            allowed = allowed & mask_mod(b, h, q_idx, kv_idx)
        return allowed

    and_mask.__name__ = "and_masks(" + ", ".join(mod_name(m) for m in mask_mods) + ")"
    return and_mask


def or_masks(*mask_mods: MaskMod) -> MaskMod:
    """Return a mask_mod allowing a position where *any* of ``mask_mods`` allows it."""
    check_mask_mods("or_masks", mask_mods)

    def or_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        allowed = mask_mods[0](b, h, q_idx, kv_idx)
        for mask_mod in mask_mods[1:]:
            allowed = allowed | mask_mod(b, h, q_idx, kv_idx)
        return allowed

    or_mask.__name__ = "or_masks(" + ", ".join(mod_name(m) for m in mask_mods) + ")"
    return or_mask


def sliced_mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Placeholder mask_mod of a BlockMask obtained by indexing another one.

    Indexing renumbers batches, heads and query blocks, so the original mask_mod no
    longer matches the block lists; calling it silently would give wrong masks.
    """
    raise RuntimeError(
        "This BlockMask was obtained by indexing (block_mask[...]); indexing renumbers "
        "batches, heads and query blocks, so it has no valid mask_mod. Assign one that "
        "matches the sliced layout: sliced.mask_mod = my_mask_mod_for_the_slice"
    )


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


def _check_positive_int(value: Any, argument: str, allow_none: bool = False, allow_zero: bool = False) -> Any:
    """``value`` as a Python int (a NumPy integer too), or None where allowed; a
    ValueError naming ``argument`` for anything else. A SymInt (a size traced by
    torch.compile, e.g. ``q.size(-2)``) is kept symbolic, so the trace is not
    specialized to its value."""
    if allow_none and value is None:
        return None
    integral = isinstance(value, (int, numbers.Integral, torch.SymInt)) and not isinstance(value, bool)
    if not integral or value < (0 if allow_zero else 1):
        expected = "a non-negative int" if allow_zero else "a positive int or None" if allow_none else "a positive int"
        raise ValueError(f"{argument} must be {expected}, got {value!r}")
    return value if isinstance(value, (int, torch.SymInt)) else int(value)


def _check_types(kinds: tuple[type, ...], **values: Any) -> None:
    for argument, value in values.items():
        if not isinstance(value, kinds):
            names = " or ".join("None" if k is type(None) else k.__name__ for k in kinds)
            raise TypeError(f"{argument} must be {names}, got {type(value).__name__}")


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
    arity = mod_arity(mod_fn, "mod_fn")
    B = _check_positive_int(B, "B", allow_none=True)
    H = _check_positive_int(H, "H", allow_none=True)
    Q_LEN = _check_positive_int(Q_LEN, "Q_LEN")
    KV_LEN = _check_positive_int(KV_LEN, "KV_LEN")
    B = 1 if B is None else B
    H = 1 if H is None else H
    device = _resolve_device(device)
    b, h, q, kv = index_vectors(B, H, 0, Q_LEN, KV_LEN, device)
    if arity == MASK_MOD_ARITY:
        return evaluate_mod(mod_fn, b, h, q, kv)
    zeros = torch.zeros(B, H, Q_LEN, KV_LEN, device=device)
    scores = evaluate_mod(mod_fn, b, h, q, kv, score=zeros)
    return ~torch.isneginf(scores)


# --------------------------------------------------------------------------------------
# BlockMask
# --------------------------------------------------------------------------------------


def _as_length(value: Any) -> Any:
    """A sequence length as an int; a SymInt stays one (int() would specialize a trace
    of create_block_mask to the length it was first called with)."""
    return value if isinstance(value, torch.SymInt) else int(value)


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
    * ``partial_heavy``: whether nearly all listed blocks are partial (mask_mod evaluated:
      more than ``PARTIAL_HEAVY_SHARE`` of them), as
      ``create_block_mask`` records it for a mask_mod that reads captured tensors (where
      the forward kernel's choice depends on it); None when not known.

    Each index row starts with its valid block ids (the first ``num_blocks`` entries,
    ascending for masks built here); the entries after them are padding that nothing
    reads. A row may hold fewer entries than there are KV blocks (KVB = cdiv(kv_len,
    kv_block)), as ``PagedKVCache.block_mask_on_pages`` makes them, but at least one and
    at least its ``num_blocks``. The constructor checks shapes, not values: listed ids
    must lie in [0, KVB) (or the rows' width, where that is larger). The format in full:
    flexattn/block_tables.py.
    """

    _TENSOR_FIELDS = BLOCK_TABLE_FIELDS

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
        partial_heavy: bool | None = None,
    ) -> None:
        check_kv_lists(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
        check_pair("full_q_num_blocks", full_q_num_blocks, "full_q_indices", full_q_indices)
        self.seq_lengths = (_as_length(seq_lengths[0]), _as_length(seq_lengths[1]))
        self.kv_num_blocks = kv_num_blocks
        self.kv_indices = kv_indices
        self.full_kv_num_blocks = full_kv_num_blocks
        self.full_kv_indices = full_kv_indices
        self.q_num_blocks = q_num_blocks
        self.q_indices = q_indices
        self.full_q_num_blocks = full_q_num_blocks
        self.full_q_indices = full_q_indices
        self.BLOCK_SIZE = block_size_pair(BLOCK_SIZE)
        self.mask_mod = noop_mask if mask_mod is None else mask_mod
        self.partial_heavy = partial_heavy

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
        *,
        dq_write_order: Tensor | None = None,
        dq_write_order_full: Tensor | None = None,
        dq_kv_order: Tensor | bool | None = None,
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
        and a call that needs a backward raises. ``dq_write_order``, ``dq_write_order_full``
        and ``dq_kv_order``: torch's metadata for its FLASH backend's deterministic dQ,
        accepted for compatibility and unused (see ``create_block_mask``).
        """
        _check_types((Tensor, type(None)), dq_write_order=dq_write_order, dq_write_order_full=dq_write_order_full)
        _check_types((Tensor, bool, type(None)), dq_kv_order=dq_kv_order)
        kv_lists = (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
        check_kv_lists(*kv_lists)
        block_size = block_size_pair(BLOCK_SIZE)
        if seq_lengths is None:
            seq_lengths = (kv_indices.shape[-2] * block_size[0], kv_indices.shape[-1] * block_size[1])
            check_listed_kv_ids(*kv_lists, block_size[1])
        q_lists = (None,) * 4
        if compute_q_blocks:
            q_lists = transposed_tables(*kv_lists, kv_columns(kv_indices, seq_lengths[1], block_size[1]))
        return cls(seq_lengths, *kv_lists, *q_lists, BLOCK_SIZE=block_size, mask_mod=mask_mod)

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
        return block_grid(self.seq_lengths, self.BLOCK_SIZE)

    def _kv_columns(self) -> int:
        """KV block columns of the block-level views (to_dense): the blocks kv_len
        covers, or the index rows' width where that is larger."""
        return kv_columns(self.kv_indices, self.seq_lengths[1], self.BLOCK_SIZE[1])

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
        dense = flags_from_lists(self.kv_num_blocks, self.kv_indices, num_cols)
        if self.full_kv_num_blocks is not None:
            dense = dense | flags_from_lists(self.full_kv_num_blocks, self.full_kv_indices, num_cols)
        return dense.to(torch.int32)

    def _block_kinds(self) -> Tensor:
        """int8 (..., QB, KVB): 0 empty, 1 partial, 2 full (block_tables.block_kinds)."""
        return block_kinds(self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks, self.full_kv_indices,
                           self._kv_columns())

    def to_string(self, grid_size: int | tuple[int, int] = (20, 20), limit: int = 4) -> str:
        """Text picture of the block layout, one grid per (batch, head), up to ``limit``.

        Each cell is two characters wide and stands for a group of blocks when the grid
        has more than ``grid_size`` rows/cols (``grid_size=-1``: one cell per block):
        '█' all blocks of the group are full, ' ' all are empty, '░' anything else
        (partial blocks, or a mix). Query blocks run down, KV blocks across.
        ``str(block_mask)`` draws torch's picture instead (see ``__str__``).
        """
        return kinds_picture(self._block_kinds().cpu(), self.BLOCK_SIZE, grid_size, limit)

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
            f"    mask_mod={mod_name(self.mask_mod)},\n"
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
            f"{computed_picture(self.to_dense().cpu().bool()).strip()}\n)"
        )

    def __getitem__(self, index: Any) -> BlockMask:
        """Select batches, heads and query blocks; keeps all three dims.

        ``index`` is up to three entries (batch, head, query block), each an int, a
        slice or an index tensor. Ints keep their dim (size 1). The result's mask_mod is
        a placeholder that raises, because indices are renumbered. Its query length is,
        as the installed torch's (``_compat.BLOCK_MASK_INDEXING_PACKS_QUERIES``), either
        that of the query blocks kept (``_kept_query_length``) or the whole mask's.
        """
        where = row_selection(index, self.kv_num_blocks)
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
            mask_mod=sliced_mask_mod,
            seq_lengths=seq_lengths,
            compute_q_blocks=self.q_indices is not None,
        )

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
        rows, cols = cdiv(new_q_len, q_block), cdiv(new_kv_len, kv_block)
        old_rows, old_cols = self.kv_indices.shape[-2], self._kv_columns()
        if rows > old_rows or cols > old_cols:
            raise ValueError(
                f"_adjust can only shrink a BlockMask: ({new_q_len}, {new_kv_len}) needs "
                f"{rows}x{cols} blocks of {self.BLOCK_SIZE}, the mask has {old_rows}x{old_cols}"
            )
        tables = crop_tables(self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks, self.full_kv_indices,
                             rows, cols, self._block_grid()[1], compute_q_blocks=self.q_indices is not None)
        return BlockMask((new_q_len, new_kv_len), *tables, BLOCK_SIZE=self.BLOCK_SIZE, mask_mod=self.mask_mod,
                         partial_heavy=self.partial_heavy)

    def adjust(self, new_q_len: int, new_kv_len: int) -> BlockMask:
        """Public name of :meth:`_adjust`: crop the mask to shorter sequence lengths."""
        return self._adjust(new_q_len, new_kv_len)

    def to(self, device: torch.device | str) -> BlockMask:
        """A new BlockMask whose tensors are on ``device`` (this one is unchanged)."""
        moved = {name: None if getattr(self, name) is None else getattr(self, name).to(device)
                 for name in self._TENSOR_FIELDS}
        return BlockMask(self.seq_lengths, **moved, BLOCK_SIZE=self.BLOCK_SIZE, mask_mod=self.mask_mod,
                         partial_heavy=self.partial_heavy)


def tile_for_call(block_mask: BlockMask, batch: int, heads: int) -> BlockMask:
    """The mask a call with ``batch`` x ``heads`` query rows reads: batch b and head h
    use the mask's entry (b % mask batch, h % mask heads), as torch's flex does. A mask
    dim of 1 or of the call's size is kept (1 broadcasts in the kernels); a larger one
    is narrowed (a view); a smaller one is gathered (the tables are per block, small).
    mask_mod still sees the call's b and h."""
    sizes = block_mask.kv_num_blocks.shape[:2]
    if all(size in (1, want) for size, want in zip(sizes, (batch, heads))):
        return block_mask
    tables = {name: tile_table(getattr(block_mask, name), batch, heads) for name in BLOCK_TABLE_FIELDS}
    return BlockMask(block_mask.seq_lengths, **tables, BLOCK_SIZE=block_mask.BLOCK_SIZE, mask_mod=block_mask.mask_mod,
                     partial_heavy=block_mask.partial_heavy)


def _partial_heavy(tables: tuple, mask_mod: MaskMod) -> bool | None:
    """``BlockMask.partial_heavy`` of freshly built tables: known (one device sync) only
    for an eager build of a mask_mod that reads captured tensors, the masks whose
    forward kernel it picks; None otherwise."""
    kv_num_blocks, _, full_kv_num_blocks = tables[:3]
    if (torch.compiler.is_compiling() or full_kv_num_blocks is None or kv_num_blocks.device.type == "meta"
            or is_fake(kv_num_blocks) or not captured_tensors(mask_mod)
            or (kv_num_blocks.is_cuda and torch.cuda.is_current_stream_capturing())):
        return None
    partial, full = torch.stack([kv_num_blocks.sum(), full_kv_num_blocks.sum()]).tolist()
    return partial > PARTIAL_HEAVY_SHARE * (partial + full)


def create_block_mask(
    mask_mod: MaskMod,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    device: Any = None,
    BLOCK_SIZE: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
    _compile: bool = False,
    separate_full_blocks: bool = True,
    compute_dq_write_order: bool = False,
    dq_kv_order: bool = True,
) -> BlockMask:
    """Build the BlockMask of ``mask_mod`` for (B, H, Q_LEN, KV_LEN) without a dense mask.

    Args:
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = may attend).
        B, H: batch size and number of heads; None (or 1) gives a mask of size 1 on that
            dim, which broadcasts over the attention call's batch / heads.
        Q_LEN, KV_LEN: sequence lengths (not only block multiples; Q_LEN may be 0).
        device: where to evaluate and store; defaults to the current accelerator, else CPU.
        BLOCK_SIZE: tile size, an int or a (q_block, kv_block) pair.
        _compile: evaluate each chunk through ``torch.compile`` (fuses mask evaluation
            and block reduction; worth it for long sequences on a GPU).
        separate_full_blocks: list blocks that need no mask_mod apart (the kernels skip
            mask_mod there); False lists every visited block as partial.
        compute_dq_write_order, dq_kv_order: torch's metadata for its FLASH backend's
            deterministic dQ; accepted for compatibility and unused (flexattn's backward
            orders its dQ writes itself: kernel_options DETERMINISTIC).

    The mask is evaluated a chunk at a time (``MASK_CHUNK_BYTES`` of bools per chunk)
    and reduced to block flags at once, so memory stays bounded at any length. For a
    mask_mod that reads captured tensors, an eager build (not under torch.compile, not
    while a CUDA graph is captured) also counts the partial and full blocks (one device
    sync) to record ``partial_heavy``, which picks the forward kernel.
    """
    if mod_arity(mask_mod, "mask_mod") != MASK_MOD_ARITY:
        raise TypeError(
            f"mask_mod must take 4 arguments (b, h, q_idx, kv_idx); {mod_name(mask_mod)} "
            "takes 5, i.e. it is a score_mod. Pass score_mods to flex_attention(score_mod=...) "
            "and build block masks from a mask_mod."
        )
    B = _check_positive_int(B, "B", allow_none=True)
    H = _check_positive_int(H, "H", allow_none=True)
    Q_LEN = _check_positive_int(Q_LEN, "Q_LEN", allow_zero=True)
    KV_LEN = _check_positive_int(KV_LEN, "KV_LEN")
    _check_types((bool,), separate_full_blocks=separate_full_blocks, compute_dq_write_order=compute_dq_write_order,
                 dq_kv_order=dq_kv_order)
    block_size = block_size_pair(BLOCK_SIZE)
    B = 1 if B is None else B
    H = 1 if H is None else H
    device = _resolve_device(device)
    timed = not torch.compiler.is_compiling() and log.isEnabledFor(logging.INFO)
    started = time.perf_counter() if timed else 0.0
    if isinstance(Q_LEN, int) and Q_LEN == 0:
        any_blocks = all_blocks = torch.zeros(B, H, 0, cdiv(KV_LEN, block_size[1]), dtype=torch.bool, device=device)
    elif torch.compiler.is_compiling():
        any_blocks, all_blocks = traced_block_flags(mask_mod, B, H, Q_LEN, KV_LEN, device, *block_size)
    else:
        any_blocks, all_blocks = chunked_block_flags(
            mask_mod, B, H, Q_LEN, KV_LEN, device, *block_size,
            chunk_elements=max(1, MASK_CHUNK_BYTES // BYTES_PER_MASK_ELEMENT),
            compile_backend=COMPILE_BACKEND if _compile else None,
        )
    tables = (tables_from_flags(any_blocks & ~all_blocks, all_blocks) if separate_full_blocks
              else tables_from_flags(any_blocks, None))
    mask = BlockMask((Q_LEN, KV_LEN), *tables, BLOCK_SIZE=block_size, mask_mod=mask_mod,
                     partial_heavy=_partial_heavy(tables, mask_mod))
    if timed and time.perf_counter() - started >= LONG_BUILD_SECONDS:
        log.info("flexattn: create_block_mask(%s) for B=%s H=%s Q_LEN=%s KV_LEN=%s BLOCK_SIZE=%s on %s took %.2f s",
                 mod_name(mask_mod), B, H, Q_LEN, KV_LEN, block_size, device, time.perf_counter() - started)
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
        return f"mask_mod={mod_name(self.fn)}"


def _flatten_block_mask(mask: BlockMask) -> tuple[list[Tensor], tuple[Any, ...]]:
    present = tuple(name for name in BlockMask._TENSOR_FIELDS if getattr(mask, name) is not None)
    leaves = [getattr(mask, name) for name in present]
    context = (mask.seq_lengths, mask.BLOCK_SIZE, _MaskModContext(mask.mask_mod), present, mask.partial_heavy)
    return leaves, context


def _flatten_block_mask_with_keys(mask: BlockMask):
    leaves, context = _flatten_block_mask(mask)
    return [(pytree.GetAttrKey(name), leaf) for name, leaf in zip(context[3], leaves)], context


def _unflatten_block_mask(leaves, context) -> BlockMask:
    seq_lengths, block_size, mask_mod_context, present, partial_heavy = context
    tensors = dict.fromkeys(BlockMask._TENSOR_FIELDS)
    tensors.update(zip(present, leaves))
    return BlockMask(seq_lengths, **tensors, BLOCK_SIZE=block_size, mask_mod=mask_mod_context.fn,
                     partial_heavy=partial_heavy)


pytree.register_pytree_node(
    BlockMask,
    _flatten_block_mask,
    _unflatten_block_mask,
    serialized_type_name="flexattn.block_mask.BlockMask",
    flatten_with_keys_fn=_flatten_block_mask_with_keys,
)

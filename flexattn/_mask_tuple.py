"""The block-mask tuple that the operators take (``BlockMask.as_tuple()``), by name."""

from __future__ import annotations

from typing import Any, NamedTuple

#: The fields of the block-mask tuple, in the operator's order (``BlockMask.as_tuple()``).
BLOCK_MASK_FIELDS = (
    "q_len", "kv_len",
    "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
    "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices",
    "q_block_size", "kv_block_size", "mask_mod",
)
#: The eight block tables, the tensor fields between the lengths and the block sizes.
BLOCK_TABLE_FIELDS = tuple(f for f in BLOCK_MASK_FIELDS if f.endswith(("_num_blocks", "_indices")))


class BlockMaskView(NamedTuple("_BlockMaskFields", [(name, Any) for name in BLOCK_MASK_FIELDS])):
    """The block-mask tuple by name: ``BlockMaskView(*block_mask)``. Every consumer reads
    the operator's plain tuple through this view; none indexes it by position."""

    __slots__ = ()

    @property
    def tables(self) -> tuple:
        """The eight block tables (full_* and q_* entries may be None)."""
        return tuple(getattr(self, name) for name in BLOCK_TABLE_FIELDS)

    @property
    def block_sizes(self) -> tuple:
        return self.q_block_size, self.kv_block_size

    def without_mask_mod(self) -> tuple:
        """Every field but the last, mask_mod (the part made of tensors and sizes)."""
        return tuple(getattr(self, name) for name in BLOCK_MASK_FIELDS if name != "mask_mod")

    def with_tables(self, tables) -> "BlockMaskView":
        return self._replace(**dict(zip(BLOCK_TABLE_FIELDS, tables)))


BLOCK_MASK_TUPLE_LEN = len(BLOCK_MASK_FIELDS)

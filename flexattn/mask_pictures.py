"""Text pictures of a BlockMask's block grid (``BlockMask.to_string`` and ``str()``).

A picture draws one grid per (batch, head) index, query blocks down and KV blocks
across, each cell two characters wide so that it looks square; a cell stands for a
group of blocks when the grid is larger than the picture.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

from torch import Tensor

from .block_tables import EMPTY, FULL, cdiv

FULL_CHAR = "█"
PARTIAL_CHAR = "░"
EMPTY_CHAR = " "


def cell_steps(rows: int, cols: int, grid_size: int | tuple[int, int]) -> tuple[int, int]:
    """Blocks per picture cell (down, across) so that a (rows, cols) block grid fits in
    ``grid_size`` cells (an int for both axes; -1: one cell per block)."""
    if grid_size == -1:
        max_rows, max_cols = rows, cols
    elif isinstance(grid_size, int):
        max_rows = max_cols = grid_size
    else:
        max_rows, max_cols = grid_size
    return max(1, cdiv(rows, max(1, max_rows))), max(1, cdiv(cols, max(1, max_cols)))


def shown_pictures(batch_dims: Sequence[int], limit: int) -> tuple[list[tuple[int, ...]], int]:
    """The batch indices (b, h, ...) of the first ``limit`` pictures (all of them for a
    negative limit), and how many more there are."""
    every = itertools.product(*(range(n) for n in batch_dims))
    indices = list(itertools.islice(every, limit if limit >= 0 else None))
    return indices, math.prod(batch_dims) - len(indices)


def picture_rows(grid: Tensor, row_step: int, col_step: int, cell: Callable[[Tensor], str]) -> list[str]:
    """One string per cell row of a (rows, cols) block grid; each cell, ``cell`` of its
    group of blocks, drawn two characters wide."""
    rows, cols = grid.shape
    return [
        "".join(cell(grid[r : r + row_step, c : c + col_step]) * 2 for c in range(0, cols, col_step))
        for r in range(0, rows, row_step)
    ]


def kinds_picture(kinds: Tensor, block_size: tuple[int, int], grid_size: int | tuple[int, int] = (20, 20),
                  limit: int = 4) -> str:
    """flexattn's picture of block kinds (int8 (..., QB, KVB), ``block_tables.block_kinds``):
    '█' all blocks of a cell full, ' ' all empty, '░' anything else, framed, each grid
    headed by its batch index."""
    *batch_dims, rows, cols = kinds.shape
    row_step, col_step = cell_steps(rows, cols, grid_size)

    def cell(group: Tensor) -> str:
        if bool((group == FULL).all()):
            return FULL_CHAR
        if bool((group == EMPTY).all()):
            return EMPTY_CHAR
        return PARTIAL_CHAR

    lines = [
        f"{FULL_CHAR} full  {PARTIAL_CHAR} partial  '{EMPTY_CHAR}' empty; "
        f"one cell = {row_step}x{col_step} blocks of {block_size[0]}x{block_size[1]}"
    ]
    shown, hidden = shown_pictures(batch_dims, limit)
    border = "+" + "-" * (2 * cdiv(cols, col_step)) + "+"
    for batch_index in shown:
        label = ", ".join(f"{name}={i}" for name, i in zip(("b", "h", "d2", "d3"), batch_index))
        lines.append(f"[{label}]" if label else "[]")
        lines.append(border)
        lines.extend("|" + row + "|" for row in picture_rows(kinds[batch_index], row_step, col_step, cell))
        lines.append(border)
    if hidden:
        lines.append(f"... ({hidden} more; raise limit= or index the BlockMask, e.g. block_mask[b, h], "
                     f"to see others)")
    return "\n".join(lines)


def computed_picture(computed: Tensor, grid_size: int | tuple[int, int] = (20, 20), limit: int = 4) -> str:
    """torch's picture of which blocks are computed (bool (..., QB, KVB)): per (batch,
    head), its index tuple on a line, then one line per cell row with '█' where all
    blocks of the cell are computed (partial or full), ' ' where none is, '░' for a mix;
    pictures separated by a blank line."""
    *batch_dims, rows, cols = computed.shape
    row_step, col_step = cell_steps(rows, cols, grid_size)

    def cell(group: Tensor) -> str:
        if bool(group.all()):
            return FULL_CHAR
        if not bool(group.any()):
            return EMPTY_CHAR
        return PARTIAL_CHAR

    shown, hidden = shown_pictures(batch_dims, limit)
    pictures = []
    for batch_index in shown:
        grid_rows = picture_rows(computed[batch_index], row_step, col_step, cell)
        pictures.append(f"{batch_index}\n" + "".join(row + "\n" for row in grid_rows))
    if hidden:
        pictures.append(f"...\n{hidden} more not shown: index the BlockMask (block_mask[b, h]) or call "
                        f"to_string(limit=...) to see them")
    return "\n".join(pictures)

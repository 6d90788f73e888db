"""Tile-configuration tables, one module per kernel (``forward``, ``backward``,
``decode``), the TMA defaults beside them (``tma``), and what they share (``base``: the
config type, the dtype-width rule, the table lookup and the one fitting filter)."""

from . import backward, base, decode, forward, tma

__all__ = ["backward", "base", "decode", "forward", "tma"]

"""The tiling of the CPU engine (``csrc/engine.cpp``): a pure function
from a call's frozen inputs to its plan.

A query tile is at most ``MAX_Q_TILE`` rows: an even split of a sparse query block
taller than that, else the block, or in the forward several consecutive blocks whose KV
lists are the same (``q_tile``: the most whole blocks that fit; the backward's tiles
stay within one block). A KV span merges consecutive listed blocks up to ``KV_TILE`` keys
(one larger matrix product instead of several), and a KV block wider than that is
walked ``KV_TILE`` keys at a time. Why these sizes: ``bench/DECISIONS.md#cpu-tiles``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import abi

#: Rows of a query tile at most (bench/DECISIONS.md#cpu-tiles).
MAX_Q_TILE = 256
#: Keys of a KV span at most; also the longest row a mod function is called with.
KV_TILE = abi.MAX_ROW


@dataclass(frozen=True)
class CpuPlanInputs:
    q_block: int
    kv_block: int


@dataclass(frozen=True)
class CpuPlan:
    q_tile: int
    kv_tile: int


def plan(inputs: CpuPlanInputs) -> CpuPlan:
    if inputs.q_block <= MAX_Q_TILE:
        q_tile = (MAX_Q_TILE // inputs.q_block) * inputs.q_block
    else:
        tiles_per_block = math.ceil(inputs.q_block / MAX_Q_TILE)
        q_tile = math.ceil(inputs.q_block / tiles_per_block)
    if inputs.kv_block >= KV_TILE:
        kv_tile = KV_TILE
    else:
        kv_tile = (KV_TILE // inputs.kv_block) * inputs.kv_block
    return CpuPlan(q_tile=q_tile, kv_tile=kv_tile)

"""What one rank's attention calls see: local BlockMasks and mods in global positions.

A rank's queries are its plan positions; the keys of a call are one rank's positions (a
ring step) or every rank's in rank order (the all-gather). The local mask is the global
mask's block flags at those query rows and key columns (chunks are whole blocks, so this
is exact), and its mask_mod and the call's score_mod see global positions: they index
the captured position tables with the local indices. Built once per (mask, plan, rank)
and reused by every call (``LocalMasks``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from ..block_mask import BlockMask, _from_block_flags
from .plan import ShardPlan, block_flags


def global_mask_mod(mask_mod: Callable, q_pos: Tensor, kv_pos: Tensor) -> Callable:
    """``mask_mod`` evaluated at the global positions of local indices."""

    def mask_mod_at_global_positions(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_pos[q_idx], kv_pos[kv_idx])

    return mask_mod_at_global_positions


def global_score_mod(score_mod: Callable, q_pos: Tensor, kv_pos: Tensor) -> Callable:
    """``score_mod`` evaluated at the global positions of local indices."""

    def score_mod_at_global_positions(score, b, h, q_idx, kv_idx):
        return score_mod(score, b, h, q_pos[q_idx], kv_pos[kv_idx])

    return score_mod_at_global_positions


def _block_ids(plan: ShardPlan, rank: int, block: int) -> Tensor:
    """The global block ids of rank ``rank``'s tokens, in local order."""
    per_chunk = plan.chunk_len // block
    return torch.cat([torch.arange(c * per_chunk, (c + 1) * per_chunk) for c in plan.chunks[rank]])


@dataclass
class LocalCall:
    """One attention call of a rank: the KV ranks it reads (in order), its mask and
    score_mod, and the blocks it computes (0: the call is skipped)."""

    kv_ranks: tuple[int, ...]
    block_mask: BlockMask
    score_mod: Callable | None
    blocks: int


class LocalMasks:
    """Per rank and KV source, the local BlockMask and mods of a (global mask, plan).

    ``needed[r][s]``: whether rank r's queries list any block of rank s's keys (ranks
    exchange only what is needed). ``ring_call(r, s)`` is rank r's call on rank s's keys;
    ``gathered_call(r)`` is its call on every rank's keys in rank order.
    """

    def __init__(self, block_mask: BlockMask, plan: ShardPlan, score_mod: Callable | None, device: torch.device):
        if block_mask.seq_lengths != (plan.seq_len, plan.seq_len):
            raise ValueError(f"flexattn: the block mask's lengths {tuple(block_mask.seq_lengths)} are not the "
                             f"plan's sequence ({plan.seq_len}, {plan.seq_len}); plan with this mask")
        self.plan = plan
        self.block_mask = block_mask
        self.score_mod = score_mod
        self.device = device
        q_block, kv_block = block_mask.BLOCK_SIZE
        self._partial, self._full = block_flags(block_mask)
        self._q_blocks = [_block_ids(plan, r, q_block).to(self._partial.device) for r in range(plan.world_size)]
        self._kv_blocks = [_block_ids(plan, r, kv_block).to(self._partial.device) for r in range(plan.world_size)]
        self._positions = [plan.positions(r, device) for r in range(plan.world_size)]
        listed = self._partial | self._full if self._full is not None else self._partial
        listed = listed.flatten(0, -3).any(0)
        self.needed = [[bool(listed[self._q_blocks[r]][:, self._kv_blocks[s]].any()) for s in range(plan.world_size)]
                       for r in range(plan.world_size)]
        self._calls: dict[tuple[int, tuple[int, ...]], LocalCall] = {}

    def _call(self, rank: int, kv_ranks: tuple[int, ...]) -> LocalCall:
        key = (rank, kv_ranks)
        if key not in self._calls:
            rows = self._q_blocks[rank]
            cols = torch.cat([self._kv_blocks[s] for s in kv_ranks])

            def pick(flags: Tensor | None) -> Tensor | None:
                return None if flags is None else flags.index_select(-2, rows).index_select(-1, cols)

            partial, full = pick(self._partial), pick(self._full)
            q_pos = self._positions[rank]
            kv_pos = torch.cat([self._positions[s] for s in kv_ranks])
            length = (q_pos.numel(), kv_pos.numel())
            mask = _from_block_flags(partial, full, length, self.block_mask.BLOCK_SIZE,
                                     global_mask_mod(self.block_mask.mask_mod, q_pos, kv_pos)).to(self.device)
            score_mod = None if self.score_mod is None else global_score_mod(self.score_mod, q_pos, kv_pos)
            blocks = int(partial.sum()) + (int(full.sum()) if full is not None else 0)
            self._calls[key] = LocalCall(kv_ranks, mask, score_mod, blocks)
        return self._calls[key]

    def ring_call(self, rank: int, kv_rank: int) -> LocalCall:
        return self._call(rank, (kv_rank,))

    def gathered_call(self, rank: int) -> LocalCall:
        return self._call(rank, tuple(range(self.plan.world_size)))

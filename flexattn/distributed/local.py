"""What one rank's attention calls see: local BlockMasks and mods in global positions.

A rank's queries are its plan positions; the keys of a call are one rank's positions (a
ring step) or the chunks its queries list, in owner-rank then chunk order (the gather). The local mask is the global
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


def _chunk_blocks(plan: ShardPlan, chunks, block: int) -> Tensor:
    """The global block ids of ``chunks``' tokens, in the given chunk order."""
    per_chunk = plan.chunk_len // block
    return torch.cat([torch.arange(c * per_chunk, (c + 1) * per_chunk) for c in chunks])


def _chunk_positions(plan: ShardPlan, chunks) -> Tensor:
    """The global positions of ``chunks``' tokens, in the given chunk order."""
    return torch.cat([torch.arange(c * plan.chunk_len, (c + 1) * plan.chunk_len) for c in chunks])


def _block_ids(plan: ShardPlan, rank: int, block: int) -> Tensor:
    """The global block ids of rank ``rank``'s tokens, in local order."""
    return _chunk_blocks(plan, plan.chunks[rank], block)


#: Above this share of the whole all-gather's bytes, the gather takes every rank's keys by
#: one collective instead of the listed chunks peer to peer (bench/DECISIONS.md#cp-chunk-gather).
GATHER_ALL_FRACTION = 0.5


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
    exchange only what is needed); ``needed_chunks[r]``: the chunks whose keys rank r's
    queries list, in owner-rank then chunk order. ``ring_call(r, s)`` is rank r's call on
    rank s's keys; ``gathered_call(r)`` is its call on the keys of ``needed_chunks[r]``.
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
        world = plan.world_size
        self.needed = [[bool(listed[self._q_blocks[r]][:, self._kv_blocks[s]].any()) for s in range(world)]
                       for r in range(world)]
        kv_per_chunk = plan.chunk_len // kv_block
        self.needed_chunks = []
        for r in range(world):
            chunk_listed = listed[self._q_blocks[r]].any(0).view(-1, kv_per_chunk).any(1)
            chunks = tuple(c for s in range(world) for c in plan.chunks[s] if chunk_listed[c])
            # Queries that list nothing still make one (empty) call: on their own keys.
            self.needed_chunks.append(chunks or plan.chunks[r])
        self._calls: dict[tuple[int, tuple[int, ...]], LocalCall] = {}

    def _call(self, rank: int, kv_ranks: tuple[int, ...], kv_chunks: tuple[int, ...]) -> LocalCall:
        key = (rank, kv_chunks)
        if key not in self._calls:
            rows = self._q_blocks[rank]
            cols = _chunk_blocks(self.plan, kv_chunks, self.block_mask.BLOCK_SIZE[1]).to(rows.device)

            def pick(flags: Tensor | None) -> Tensor | None:
                return None if flags is None else flags.index_select(-2, rows).index_select(-1, cols)

            partial, full = pick(self._partial), pick(self._full)
            q_pos = self._positions[rank]
            kv_pos = _chunk_positions(self.plan, kv_chunks).to(self.device)
            length = (q_pos.numel(), kv_pos.numel())
            mask = _from_block_flags(partial, full, length, self.block_mask.BLOCK_SIZE,
                                     global_mask_mod(self.block_mask.mask_mod, q_pos, kv_pos)).to(self.device)
            score_mod = None if self.score_mod is None else global_score_mod(self.score_mod, q_pos, kv_pos)
            blocks = int(partial.sum()) + (int(full.sum()) if full is not None else 0)
            self._calls[key] = LocalCall(kv_ranks, mask, score_mod, blocks)
        return self._calls[key]

    def ring_call(self, rank: int, kv_rank: int) -> LocalCall:
        return self._call(rank, (kv_rank,), self.plan.chunks[kv_rank])

    def gathered_chunks(self, rank: int) -> tuple[int, ...]:
        """The chunks of rank ``rank``'s gathered call: every chunk in rank order where the
        gather is a whole all-gather (``gathers_all``), else ``needed_chunks[rank]``."""
        if self.gathers_all():
            return tuple(c for chunks in self.plan.chunks for c in chunks)
        return self.needed_chunks[rank]

    def gathered_call(self, rank: int) -> LocalCall:
        chunks = self.gathered_chunks(rank)
        owners = tuple(sorted({self.plan.owner(c) for c in chunks}))
        return self._call(rank, owners, chunks)

    def received_fraction(self) -> float:
        """Other ranks' chunks the ranks' queries list, over what a whole all-gather moves."""
        world, per_rank = self.plan.world_size, len(self.plan.chunks[0])
        if world == 1:
            return 0.0
        received = sum(len(chunks) - sum(c in self.plan.chunks[r] for c in chunks)
                       for r, chunks in enumerate(self.needed_chunks))
        return received / (world * (world - 1) * per_rank)

    def gathers_all(self) -> bool:
        """Whether the gather moves every rank's keys (one all-gather collective) rather
        than each rank's listed chunks peer to peer: where the listed chunks are more than
        GATHER_ALL_FRACTION of the whole."""
        return self.received_fraction() > GATHER_ALL_FRACTION

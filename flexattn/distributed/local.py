"""What one rank's attention calls see: local BlockMasks and mods in global positions.

A rank's queries are its plan positions; the keys of a call are one rank's positions (a
ring step) or the blocks its queries list, in owner-rank then local order (the gather).
The local mask is the global mask's block flags at those query rows and key columns
(chunks are whole blocks, so this is exact), and its mask_mod and the call's score_mod
see global positions: they index the captured position tables with the local indices.
Built once per (mask, plan, rank) and reused by every call (``LocalMasks``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from ..block_mask import BlockMask
from ..block_tables import tables_from_flags
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


def block_positions(blocks: Tensor, block: int) -> Tensor:
    """The token positions of ``blocks`` (ids of ``block`` tokens each), in their order."""
    return (blocks[:, None] * block + torch.arange(block, device=blocks.device)).flatten()


#: Above this share of the whole all-gather's bytes, the gather takes every rank's keys by
#: one collective instead of the listed blocks peer to peer (bench/DECISIONS.md#cp-chunk-gather).
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
    exchange only what is needed); ``needed_blocks[r]``: the global ids of the KV blocks
    rank r's queries list, in owner-rank then local order. ``ring_call(r, s)`` is rank
    r's call on rank s's keys; ``gathered_call(r)`` is its call on ``gathered_blocks(r)``.
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
        world = plan.world_size
        self._q_blocks = [_block_ids(plan, r, q_block).to(self._partial.device) for r in range(world)]
        self._kv_blocks = [_block_ids(plan, r, kv_block).to(self._partial.device) for r in range(world)]
        self._positions = [plan.positions(r, device) for r in range(world)]
        listed = self._partial | self._full if self._full is not None else self._partial
        listed = listed.flatten(0, -3).any(0)
        self.needed = [[bool(listed[self._q_blocks[r]][:, self._kv_blocks[s]].any()) for s in range(world)]
                       for r in range(world)]
        # Every KV block's owner and index in its owner's shard.
        kv_total = listed.shape[-1]
        self._owner = torch.empty(kv_total, dtype=torch.int64)
        self._local_index = torch.empty(kv_total, dtype=torch.int64)
        for r in range(world):
            ids = self._kv_blocks[r].cpu()
            self._owner[ids] = r
            self._local_index[ids] = torch.arange(ids.numel())
        everything = torch.cat(self._kv_blocks)
        self._all_kv_blocks = everything.cpu()
        self.needed_blocks = []
        for r in range(world):
            wanted = listed[self._q_blocks[r]].any(0)[everything].cpu()
            # Queries that list nothing still make one (empty) call: on their own keys.
            self.needed_blocks.append(self._all_kv_blocks[wanted] if wanted.any() else self._kv_blocks[r].cpu())
        # Built once: LocalCalls and the gather's transfers by (kind, rank[, KV rank]), the
        # gather's choice under "gathers_all".
        self._calls: dict[Any, Any] = {}

    def _call(self, key: tuple, rank: int, kv_ranks: tuple[int, ...], kv_blocks: Tensor) -> None:
        """Build rank ``rank``'s call on the keys of ``kv_blocks`` (global KV block ids, in
        the order the call's keys are laid out) under ``key``."""
        rows = self._q_blocks[rank]
        cols = kv_blocks.to(rows.device)

        def pick(flags: Tensor | None) -> Tensor | None:
            return None if flags is None else flags.index_select(-2, rows).index_select(-1, cols)

        partial, full = pick(self._partial), pick(self._full)
        q_pos = self._positions[rank]
        kv_pos = block_positions(kv_blocks, self.block_mask.BLOCK_SIZE[1]).to(self.device)
        length = (q_pos.numel(), kv_pos.numel())
        mask = BlockMask(length, *tables_from_flags(partial, full), BLOCK_SIZE=self.block_mask.BLOCK_SIZE,
                         mask_mod=global_mask_mod(self.block_mask.mask_mod, q_pos, kv_pos)).to(self.device)
        score_mod = None if self.score_mod is None else global_score_mod(self.score_mod, q_pos, kv_pos)
        blocks = int(partial.sum()) + (int(full.sum()) if full is not None else 0)
        self._calls[key] = LocalCall(kv_ranks, mask, score_mod, blocks)

    def ring_call(self, rank: int, kv_rank: int) -> LocalCall:
        key = ("ring", rank, kv_rank)
        if key not in self._calls:
            self._call(key, rank, (kv_rank,), self._kv_blocks[kv_rank].cpu())
        return self._calls[key]

    def gathered_blocks(self, rank: int) -> Tensor:
        """The KV blocks of rank ``rank``'s gathered call: every block in rank order where
        the gather is a whole all-gather (``gathers_all``), else ``needed_blocks[rank]``."""
        return self._all_kv_blocks if self.gathers_all() else self.needed_blocks[rank]

    def gathered_call(self, rank: int) -> LocalCall:
        if ("gathered", rank) not in self._calls:
            blocks = self.gathered_blocks(rank)
            owners = tuple(sorted(set(self._owner[blocks].tolist())))
            self._call(("gathered", rank), rank, owners, blocks)
        return self._calls[("gathered", rank)]

    def transfers(self, rank: int) -> tuple[list[tuple[int, Tensor]], list[tuple[int, Tensor]]]:
        """The gather's peer-to-peer transfers of rank ``rank``: (source or destination
        rank, token positions in the owner's shard, on the calls' device) of the blocks it
        receives from each source and sends to each destination, sources and destinations
        in rank order; its own listed blocks are the entry with source ``rank``."""
        key = ("transfers", rank)
        if key not in self._calls:
            kv_block = self.block_mask.BLOCK_SIZE[1]

            def owned_by(blocks: Tensor, owner: int) -> Tensor | None:
                """Positions of those of ``blocks`` ``owner`` owns, None if none."""
                blocks = blocks[self._owner[blocks] == owner]
                return block_positions(self._local_index[blocks], kv_block).to(self.device) if blocks.numel() else None

            world = self.plan.world_size
            receives = [(src, owned_by(self.needed_blocks[rank], src)) for src in range(world)]
            sends = [(dst, owned_by(self.needed_blocks[dst], rank)) for dst in range(world) if dst != rank]
            self._calls[key] = ([(r, p) for r, p in receives if p is not None],
                                [(r, p) for r, p in sends if p is not None])
        return self._calls[key]

    def returned(self, rank: int) -> tuple[Tensor, list[Tensor]]:
        """Where the gradients that come back to rank ``rank`` land: the sorted union of
        the positions it sends (``transfers``), and each send's positions as indices
        into that union (on the calls' device)."""
        key = ("returned", rank)
        if key not in self._calls:
            sends = [positions.cpu() for _, positions in self.transfers(rank)[1]]
            union = torch.unique(torch.cat(sends)) if sends else torch.empty(0, dtype=torch.int64)
            self._calls[key] = (union.to(self.device),
                                [torch.searchsorted(union, positions).to(self.device) for positions in sends])
        return self._calls[key]

    def received_fraction(self) -> float:
        """Other ranks' KV blocks the ranks' queries list, over what a whole all-gather moves."""
        world = self.plan.world_size
        if world == 1:
            return 0.0
        received = sum(int((self._owner[blocks] != r).sum()) for r, blocks in enumerate(self.needed_blocks))
        return received / ((world - 1) * sum(b.numel() for b in self._kv_blocks))

    def gathers_all(self) -> bool:
        """Whether the gather moves every rank's keys (one all-gather collective) rather
        than each rank's listed blocks peer to peer: where the listed blocks are more than
        GATHER_ALL_FRACTION of the whole."""
        if "gathers_all" not in self._calls:
            self._calls["gathers_all"] = self.received_fraction() > GATHER_ALL_FRACTION
        return self._calls["gathers_all"]

"""Sharding plans for context parallelism: which sequence positions each rank owns.

The sequence (queries, keys and values alike) is cut into equal chunks of whole sparse
blocks, and every rank owns the same number of chunks, so activations stay balanced.
Which chunks a rank owns is chosen from the BlockMask's block counts so that every rank
computes about the same number of blocks: a chunk's cost is the number of (query block,
KV block) pairs its query blocks list, over the mask's batch and heads. The pure function
``plan_shards`` takes a frozen ``ShardInputs`` (the costs) and returns a ``ShardPlan``;
``plan_context_parallel`` derives the inputs from a BlockMask.

The plan tries one chunk per rank first (contiguous shards: neighbours only for a sliding
window), then 2, 4, ... chunks per rank, assigning chunks longest-first to the least
loaded rank that still has room (for a causal mask at two chunks per rank this is the
zigzag split), and keeps the first whose most loaded rank is within ``max_imbalance`` of
the mean (the finest one otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..block_mask import BlockMask
from ..block_tables import block_grid, flags_from_lists


@dataclass(frozen=True)
class ShardInputs:
    """What a plan is computed from.

    ``block_costs``: int64 (QB,), the KV blocks each query block lists (partial and
    full, summed over the mask's batch and heads); ``blocks_per_unit``: the query blocks
    of the smallest chunk (one KV block must also fit it whole); ``world_size``: ranks;
    ``max_imbalance``: the most loaded rank's cost over the mean, minus 1, a plan may
    have before a finer one is tried.
    """

    block_costs: Tensor
    blocks_per_unit: int
    world_size: int
    max_imbalance: float = 0.05


@dataclass(frozen=True)
class ShardPlan:
    """Which chunks of the sequence each rank owns (ascending), and what that costs.

    ``chunks[r]``: rank r's chunk ids; ``chunk_len``: tokens per chunk; ``seq_len``:
    the whole sequence; ``loads[r]``: rank r's blocks; ``imbalance``: max load over the
    mean load, minus 1. A rank's local shard is its chunks' tokens, concatenated in
    chunk order (``positions``).
    """

    world_size: int
    seq_len: int
    chunk_len: int
    chunks: tuple[tuple[int, ...], ...]
    loads: tuple[int, ...]
    imbalance: float
    _positions: tuple[Tensor, ...] = field(default=(), repr=False, compare=False)

    @property
    def local_len(self) -> int:
        """Tokens each rank owns."""
        return self.seq_len // self.world_size

    def positions(self, rank: int, device: torch.device | str | None = None) -> Tensor:
        """int64 (local_len,): the global positions of rank ``rank``'s tokens, in order."""
        _check_rank(rank, self.world_size)
        return self._positions[rank].to(device) if device is not None else self._positions[rank]

    def shard(self, tensor: Tensor, rank: int, dim: int = 2) -> Tensor:
        """Rank ``rank``'s part of a whole-sequence ``tensor`` (sequence along ``dim``)."""
        _check_seq_dim(tensor, dim, self.seq_len, "tensor")
        return tensor.index_select(dim, self.positions(rank, tensor.device))

    def unshard(self, parts: list[Tensor] | tuple[Tensor, ...], dim: int = 2) -> Tensor:
        """The whole-sequence tensor from every rank's part (``parts[r]`` is rank r's)."""
        if len(parts) != self.world_size:
            raise ValueError(f"flexattn: unshard needs one part per rank ({self.world_size}), got {len(parts)}")
        for rank, part in enumerate(parts):
            _check_seq_dim(part, dim, self.local_len, f"parts[{rank}]")
        joined = torch.cat(list(parts), dim=dim)
        order = torch.cat([self.positions(r) for r in range(self.world_size)]).to(joined.device)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return joined.index_select(dim, inverse)


def _check_rank(rank: int, world_size: int) -> None:
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"flexattn: rank must be an int in [0, {world_size}), got {rank!r}")


def _check_seq_dim(tensor: Tensor, dim: int, length: int, name: str) -> None:
    if not isinstance(tensor, Tensor):
        raise TypeError(f"flexattn: {name} must be a Tensor, got {type(tensor).__name__}")
    if tensor.shape[dim] != length:
        raise ValueError(f"flexattn: {name} must have {length} positions along dim {dim}, got shape "
                         f"{tuple(tensor.shape)}")


def _assign(costs: list[int], world_size: int) -> tuple[list[list[int]], list[int]]:
    """Chunks longest-first to the least loaded rank with room (equal counts per rank);
    returns each rank's chunks and load."""
    per_rank = len(costs) // world_size
    order = sorted(range(len(costs)), key=lambda c: (-costs[c], c))
    owned: list[list[int]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for chunk in order:
        rank = min((r for r in range(world_size) if len(owned[r]) < per_rank), key=lambda r: (loads[r], r))
        owned[rank].append(chunk)
        loads[rank] += costs[chunk]
    # Ranks in the order of their first chunk: contiguous shards keep rank order.
    ranked = sorted(range(world_size), key=lambda r: min(owned[r]))
    return [sorted(owned[r]) for r in ranked], [loads[r] for r in ranked]


def _imbalance(loads: list[int]) -> float:
    mean = sum(loads) / len(loads)
    return max(loads) / mean - 1.0 if mean > 0 else 0.0


def plan_shards(inputs: ShardInputs, block_len: int) -> ShardPlan:
    """The plan for ``inputs`` (pure: the same inputs give the same plan on every rank).

    ``block_len`` is the tokens of one query block. Chunks per rank go 1, 2, 4, ... while
    the whole sequence still divides into them; the first plan within
    ``inputs.max_imbalance`` is kept, else the most balanced one seen.
    """
    world = inputs.world_size
    costs = [int(c) for c in inputs.block_costs.tolist()]
    units = len(costs) // inputs.blocks_per_unit
    if units % world:
        raise ValueError(
            f"flexattn: context parallelism needs the sequence to split into an equal number of whole "
            f"chunks per rank: {len(costs)} query blocks of {block_len} tokens make {units} chunks of "
            f"{inputs.blocks_per_unit} block(s), not a multiple of world_size={world}")
    best = None
    per_rank = 1
    while units % (per_rank * world) == 0:
        n_chunks = per_rank * world
        blocks = len(costs) // n_chunks
        chunk_costs = [sum(costs[c * blocks:(c + 1) * blocks]) for c in range(n_chunks)]
        owned, loads = _assign(chunk_costs, world)
        candidate = (_imbalance(loads), n_chunks, owned, loads, blocks)
        if best is None or candidate[0] < best[0] - 1e-12:
            best = candidate
        if candidate[0] <= inputs.max_imbalance:
            best = candidate
            break
        per_rank *= 2
    imbalance, n_chunks, owned, loads, blocks = best
    chunk_len = blocks * block_len
    positions = tuple(
        torch.cat([torch.arange(c * chunk_len, (c + 1) * chunk_len) for c in chunks]) for chunks in owned
    )
    return ShardPlan(world, len(costs) * block_len, chunk_len, tuple(tuple(c) for c in owned), tuple(loads),
                     imbalance, positions)


def block_flags(block_mask: BlockMask) -> tuple[Tensor, Tensor | None]:
    """The mask's partial and full block flags, bool (..., QB, KVB)."""
    q_blocks, kv_blocks = block_grid(block_mask.seq_lengths, block_mask.BLOCK_SIZE)
    partial = flags_from_lists(block_mask.kv_num_blocks, block_mask.kv_indices, kv_blocks)
    full = None
    if block_mask.full_kv_num_blocks is not None:
        full = flags_from_lists(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, kv_blocks)
    return partial, full


def plan_context_parallel(block_mask: BlockMask, world_size: int, *, max_imbalance: float = 0.05) -> ShardPlan:
    """A sharding plan of ``block_mask``'s sequence over ``world_size`` ranks.

    Self-attention only (query and KV lengths equal); the sequence must split into
    ``world_size`` x (a power of two) equal chunks of whole blocks, and a query block
    must be a whole number of KV blocks or the reverse. Every rank must compute the
    same plan: it depends only on the mask's block lists.
    """
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"flexattn: block_mask must be a BlockMask, got {type(block_mask).__name__}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"flexattn: world_size must be a positive int, got {world_size!r}")
    q_len, kv_len = block_mask.seq_lengths
    if q_len != kv_len:
        raise ValueError(f"flexattn: context parallelism shards one sequence (self-attention); the mask's "
                         f"lengths are q_len={q_len}, kv_len={kv_len}")
    q_block, kv_block = block_mask.BLOCK_SIZE
    if q_block % kv_block and kv_block % q_block:
        raise ValueError(f"flexattn: context parallelism needs one block size to divide the other, got "
                         f"BLOCK_SIZE={block_mask.BLOCK_SIZE}")
    if q_len % q_block or kv_len % kv_block:
        raise ValueError(f"flexattn: context parallelism needs the sequence ({q_len}) to be a whole number of "
                         f"blocks {block_mask.BLOCK_SIZE}")
    partial, full = block_flags(block_mask)
    listed = partial | full if full is not None else partial
    costs = listed.flatten(0, -3).sum(dim=(0, 2)).to(torch.int64).cpu()
    blocks_per_unit = max(1, kv_block // q_block)
    return plan_shards(ShardInputs(costs, blocks_per_unit, world_size, max_imbalance), q_block)

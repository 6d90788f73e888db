"""Moving keys and values between ranks, and their gradients back, on torch.distributed.

The ring and the all-gather move keys and values packed as one tensor (B, Hkv, S,
E + Ev); the block gather moves them side by side.

* ``RingExchange``: W steps; at step t rank r reads rank (r - t) mod W's keys, sent
  directly by their owner (no relaying), so a pair of ranks whose blocks are all masked
  exchanges nothing. Step t + 1's transfer is posted before step t is computed
  (``batch_isend_irecv``: NCCL runs it on its own stream, overlapping the kernels).
  Gradients go back the same way, and each step's are received before the next step
  starts, so at most two steps' buffers are alive.
* ``AllGather``: one all-gather of every rank's keys and values (W times the local
  memory; one collective) for one call, differentiable (a reduce-scatter of the
  gradients), where the ranks' queries list most blocks (``LocalMasks.gathers_all``).
* ``BlockGather``: otherwise, each rank receives only the KV blocks its queries list
  (``LocalMasks.needed_blocks``), every pair of ranks in one batch of peer-to-peer
  transfers; the gradients of those blocks go back to their owners the same way.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from .local import LocalCall, LocalMasks
from .merge import accumulation_dtype


def _peer(group, rank: int) -> int:
    """A group rank as the global rank P2P operations take."""
    return rank if group is None else dist.get_global_rank(group, rank)


def _start(ops: list) -> list:
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(works: list) -> None:
    for work in works:
        work.wait()


class RingExchange:
    def __init__(self, masks: LocalMasks, rank: int, group) -> None:
        self.masks, self.rank, self.group = masks, rank, group
        self.world = masks.plan.world_size
        self._dkv: Tensor | None = None
        self._pending_grads: list = []

    def _sources(self, step: int) -> tuple[int, int]:
        """(rank whose keys this rank reads at ``step``, rank that reads this rank's)."""
        return (self.rank - step) % self.world, (self.rank + step) % self.world

    def _post_keys(self, step: int, kv: Tensor, into: dict[int, Tensor] | None) -> tuple[Tensor | None, list]:
        src, dst = self._sources(step)
        ops, buffer = [], None
        if self.masks.needed[self.rank][src]:
            if into is not None and step in into:
                buffer = into[step]
                buffer.untyped_storage().resize_(kv.numel() * kv.element_size())
            else:
                buffer = torch.empty_like(kv)
            ops.append(dist.P2POp(dist.irecv, buffer, _peer(self.group, src), self.group, tag=step))
        if self.masks.needed[dst][self.rank]:
            ops.append(dist.P2POp(dist.isend, kv, _peer(self.group, dst), self.group, tag=step))
        return buffer, _start(ops)

    def calls(self, kv: Tensor, backward: bool = False, into: dict[int, Tensor] | None = None
              ) -> Iterator[tuple[int, LocalCall, Tensor]]:
        """(step, call, keys and values) of this rank in step order; ``kv`` must be
        contiguous. ``into``: per step, the buffer to receive into (the forward's, its
        storage released in between), else new ones. In the backward every step,
        skipped or not, also receives the gradient of this rank's keys from the rank
        that read them then (``give_back`` sends; a skipped step only receives)."""
        self._dkv, self._pending_grads = None, []
        pending = self._post_keys(1, kv, into) if self.world > 1 else None
        if self.masks.needed[self.rank][self.rank]:
            yield 0, self.masks.ring_call(self.rank, self.rank), kv
        for step in range(1, self.world):
            buffer, works = pending
            if step + 1 < self.world:
                pending = self._post_keys(step + 1, kv, into)
            _wait(works)
            if buffer is not None:
                yield step, self.masks.ring_call(self.rank, self._sources(step)[0]), buffer
            elif backward:
                self._post_grads(step, None, kv)

    def _add(self, dkv: Tensor) -> None:
        self._dkv = dkv.to(accumulation_dtype(dkv.dtype)) if self._dkv is None else self._dkv.add_(dkv)

    def give_back(self, call: LocalCall, dkv: Tensor) -> None:
        """Send the gradient of the keys ``call`` read to their owner (this rank's own
        are kept)."""
        src = call.kv_ranks[0]
        if src == self.rank:
            self._add(dkv)
        else:
            self._post_grads((self.rank - src) % self.world, dkv, dkv)

    def _post_grads(self, step: int, dkv: Tensor | None, like: Tensor) -> None:
        """Step ``step``'s gradient exchange, after the previous one has landed."""
        self._finish_grads()
        src, dst = self._sources(step)
        ops, buffer = [], None
        if dkv is not None:
            dkv = dkv.contiguous()
            ops.append(dist.P2POp(dist.isend, dkv, _peer(self.group, src), self.group, tag=self.world + step))
        if self.masks.needed[dst][self.rank]:
            buffer = torch.empty(like.shape, dtype=like.dtype, device=like.device)
            ops.append(dist.P2POp(dist.irecv, buffer, _peer(self.group, dst), self.group, tag=self.world + step))
        self._pending_grads = [(buffer, _start(ops), dkv)]

    def _finish_grads(self) -> None:
        for buffer, works, _ in self._pending_grads:
            _wait(works)
            if buffer is not None:
                self._add(buffer)
        self._pending_grads = []

    def collect(self, kv: Tensor) -> Tensor:
        """This rank's key/value gradient (in the accumulation dtype), once every step has
        been given back."""
        self._finish_grads()
        if self._dkv is None:
            return torch.zeros(kv.shape, dtype=accumulation_dtype(kv.dtype), device=kv.device)
        return self._dkv


class AllGather(torch.autograd.Function):
    """Every rank's packed keys and values, concatenated in rank order along the
    sequence (dim 2); the backward sums each rank's gradient over the group and keeps
    this rank's part (a reduce-scatter on NCCL; gloo has none, so an all-reduce)."""

    @staticmethod
    def forward(ctx, kv: Tensor, group, world: int, rank: int) -> Tensor:
        ctx.group, ctx.world, ctx.rank = group, world, rank
        parts = [torch.empty_like(kv) for _ in range(world)]
        dist.all_gather(parts, kv.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, dkv: Tensor):
        local = dkv.shape[2] // ctx.world
        if dist.get_backend(ctx.group) == dist.Backend.NCCL:
            parts = [part.contiguous() for part in dkv.split(local, dim=2)]
            mine = torch.empty_like(parts[0])
            dist.reduce_scatter(mine, parts, group=ctx.group)
        else:
            total = dkv.contiguous()
            dist.all_reduce(total, group=ctx.group)
            mine = total.narrow(2, ctx.rank * local, local)
        return mine, None, None, None


class BlockGather(torch.autograd.Function):
    """The KV blocks this rank's queries list of each of ``parts`` (keys and values,
    gathered side by side so nothing packs them), in owner-rank then local order
    (``LocalMasks.needed_blocks``): its own copied in, the others received from their
    owners, each rank sending every peer the blocks that peer lists
    (``LocalMasks.transfers``). The backward places the own blocks' gradient (each listed
    once: no sum), sends each received block's gradient back to its owner and adds what
    comes back, in float32 (float64 for float64), at the positions the peers read
    (``LocalMasks.returned``)."""

    @staticmethod
    def forward(ctx, masks: LocalMasks, rank: int, group, *parts: Tensor) -> tuple[Tensor, ...]:
        parts = tuple(part.contiguous() for part in parts)
        receives, sends = masks.transfers(rank)
        sizes = [positions.numel() for _, positions in receives]
        ops, received, gathered = [], [], []
        for tag, part in enumerate(parts, start=1):
            gathered.append(part.new_empty((*part.shape[:2], sum(sizes), part.shape[3])))
            for (src, positions), slot in zip(receives, gathered[-1].split(sizes, dim=2)):
                if src == rank:
                    # needed_blocks are distinct and in local order, so all L positions are
                    # the shard itself, 0..L-1.
                    slot.copy_(part if positions.numel() == part.shape[2] else part.index_select(2, positions))
                else:
                    received.append((slot, part.new_empty(slot.shape)))
                    ops.append(dist.P2POp(dist.irecv, received[-1][1], _peer(group, src), group, tag=tag))
            ops += [dist.P2POp(dist.isend, part.index_select(2, positions), _peer(group, dst), group, tag=tag)
                    for dst, positions in sends]
        _wait(_start(ops))
        for slot, piece in received:
            slot.copy_(piece)
        ctx.masks, ctx.rank, ctx.group = masks, rank, group
        ctx.shapes = [part.shape for part in parts]
        return tuple(gathered)

    @staticmethod
    def backward(ctx, *dgathered: Tensor):
        masks, rank, group = ctx.masks, ctx.rank, ctx.group
        receives, sends = masks.transfers(rank)
        sizes = [positions.numel() for _, positions in receives]
        ops, grads, incoming = [], [], []
        for tag, (shape, dpart) in enumerate(zip(ctx.shapes, dgathered), start=1):
            grad = None
            for (src, positions), piece in zip(receives, dpart.split(sizes, dim=2)):
                if src != rank:
                    ops.append(dist.P2POp(dist.isend, piece.contiguous(), _peer(group, src), group, tag=tag))
                elif positions.numel() == shape[2]:
                    grad = piece.clone(memory_format=torch.contiguous_format)
                else:
                    grad = piece.new_zeros(shape).index_copy_(2, positions, piece)
            grads.append(dpart.new_zeros(shape) if grad is None else grad)
            incoming.append([dpart.new_empty((*shape[:2], positions.numel(), shape[3])) for _, positions in sends])
            ops += [dist.P2POp(dist.irecv, t, _peer(group, dst), group, tag=tag)
                    for (dst, _), t in zip(sends, incoming[-1])]
        _wait(_start(ops))
        if sends:
            union, indices = masks.returned(rank)
            for grad, pieces in zip(grads, incoming):
                acc = accumulation_dtype(grad.dtype)
                total = grad.index_select(2, union).to(acc)
                for index, t in zip(indices, pieces):
                    total.index_add_(2, index, t.to(acc))
                grad.index_copy_(2, union, total.to(grad.dtype))
        return (None, None, None, *grads)

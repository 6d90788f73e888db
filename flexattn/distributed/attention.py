"""Context-parallel attention: every rank holds a shard of one sequence's q, k and v.

``context_parallel_attention`` runs, on each rank, flexattn's kernels on its queries
against the keys and values of the ranks its queries need (``exchange``), merges the
partial results by their log-sum-exps (``merge``), and returns its shard of the output
(and lse). With the ring, the backward walks the same steps again: it receives the keys
once more (the forward released them: key memory of two shards, whatever the world
size; each step's output and lse stay, W outputs' worth), runs the kernels' backward of
each step with the gradient the merge gives its partial result, and sends each
key/value gradient back to the rank that owns those keys. The all-gather is one call
with autograd through it.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..api import AuxRequest, flex_attention
from ..block_mask import BlockMask
from ..mod_signature import captured_tensors as mod_captured_tensors
from . import merge
from .exchange import AllGather, BlockGather, RingExchange
from .local import LocalMasks
from .plan import ShardPlan, plan_context_parallel

STRATEGIES = ("auto", "ring", "allgather")


def captured_tensors(fn: Callable | None) -> list[Tensor]:
    """Tensors ``fn`` closes over (through nested closures too) that require grad: the
    inputs of the call whose gradients it returns."""
    return [t for t in mod_captured_tensors(fn) if t.requires_grad]


def choose_strategy(strategy: str) -> str:
    """``auto``: the all-gather, which moves only the blocks a rank's queries list and
    makes one kernel call each way: faster than the ring on every mask and length
    measured, at 2 and 4 ranks (bench/DECISIONS.md#cp-strategy). The ring stays for
    memory: it holds two shards' keys, where a causal mask's gather holds all of them."""
    if strategy not in STRATEGIES:
        raise ValueError(f"flexattn: strategy must be one of {STRATEGIES}, got {strategy!r}")
    return "allgather" if strategy == "auto" else strategy


def _split(kv: Tensor, head_dim: int) -> tuple[Tensor, Tensor]:
    return kv[..., :head_dim], kv[..., head_dim:]


class _Unpack(torch.autograd.Function):
    """Keys and values as views of their packed tensor, whose gradient is one
    concatenation of theirs (autograd's slice backward would zero-fill the packed shape
    once per view and add the two; bench/DECISIONS.md#cp-unpack)."""

    @staticmethod
    def forward(ctx, kv: Tensor, head_dim: int):
        return _split(kv, head_dim)

    @staticmethod
    def backward(ctx, dk: Tensor, dv: Tensor):
        # Autograd materialises a missing gradient as zeros, so both are tensors.
        return torch.cat([dk, dv], dim=-1), None


class _Setup:
    """What a call needs besides tensors: the local masks, the exchange, the kernels' arguments."""

    def __init__(self, masks: LocalMasks, exchange, scale, enable_gqa, kernel_options, head_dim: int):
        self.masks, self.exchange = masks, exchange
        self.scale, self.enable_gqa, self.kernel_options = scale, enable_gqa, kernel_options
        self.head_dim = head_dim

    def attend(self, call, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        out, aux = flex_attention(q, k, v, score_mod=call.score_mod, block_mask=call.block_mask, scale=self.scale,
                                  enable_gqa=self.enable_gqa, kernel_options=self.kernel_options,
                                  return_aux=AuxRequest(lse=True))
        return out, aux.lse


def _release(t: Tensor) -> None:
    """Free a received buffer's memory until the backward receives into it again."""
    t.untyped_storage().resize_(0)


class _Ring(torch.autograd.Function):
    """The ring strategy. The forward keeps each step's autograd graph (its output,
    lse and the kernels' saved tensors) but releases the received keys' memory; the
    backward receives them again into the same buffers and runs each step's kernels'
    backward with the gradient the merge gives that step's (out_s, lse_s)."""

    @staticmethod
    def forward(ctx, setup: _Setup, q: Tensor, k: Tensor, v: Tensor, *captured: Tensor):
        kv = torch.cat([k, v], dim=-1)
        B, H, L = q.shape[:3]
        acc = merge.accumulation_dtype(q.dtype)
        out = torch.zeros(B, H, L, v.shape[-1], dtype=acc, device=q.device)
        lse = torch.full((B, H, L), float("-inf"), dtype=acc, device=q.device)
        q_leaf = q.detach().requires_grad_()
        steps, buffers = [], {}
        for step, call, kv_s in setup.exchange.calls(kv):
            # kv_s.data: a receive into the buffer later must not count as an in-place
            # change of the tensor the kernels saved.
            raw = kv_s.detach()
            kv_leaf = raw.data.requires_grad_()
            with torch.enable_grad():
                out_s, lse_s = setup.attend(call, q_leaf, *_Unpack.apply(kv_leaf, setup.head_dim))
            out, lse = merge.merge(out, lse, out_s.detach(), lse_s.detach())
            steps.append((step, kv_leaf, out_s, lse_s))
            if step:
                # Safe while the kernels may still read it: the allocator reuses the
                # memory in stream order, and a receive into it waits for this stream.
                buffers[step] = raw
                _release(raw)
        out = out.to(q.dtype)
        ctx.setup, ctx.steps, ctx.buffers, ctx.q_leaf = setup, steps, buffers, q_leaf
        ctx.save_for_backward(out, lse, kv, *captured)
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor | None, dlse: Tensor | None):
        setup: _Setup = ctx.setup
        out, lse, kv, *captured = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        dlse = torch.zeros_like(lse) if dlse is None else dlse
        q_leaf = ctx.q_leaf
        dq = torch.zeros(q_leaf.shape, dtype=merge.accumulation_dtype(q_leaf.dtype), device=q_leaf.device)
        wanted = [t for t in captured if t.requires_grad]
        dcaptured = [None] * len(wanted)
        graphs = {step: (kv_leaf, out_s, lse_s) for step, kv_leaf, out_s, lse_s in ctx.steps}
        for step, call, _ in setup.exchange.calls(kv, backward=True, into=ctx.buffers):
            kv_leaf, out_s, lse_s = graphs.pop(step)
            d_out_s, d_lse_s = merge.partial_grads(dout, dlse, out, lse, out_s.detach(), lse_s.detach())
            grads = torch.autograd.grad((out_s, lse_s), [q_leaf, kv_leaf, *wanted], (d_out_s, d_lse_s),
                                        allow_unused=True)
            if grads[0] is not None:
                dq += grads[0]
            setup.exchange.give_back(call, torch.zeros_like(kv_leaf) if grads[1] is None else grads[1])
            if step:
                _release(ctx.buffers[step])
            for i, grad in enumerate(grads[2:]):
                if grad is not None:
                    dcaptured[i] = grad if dcaptured[i] is None else dcaptured[i] + grad
        ctx.steps = ctx.buffers = None
        dkv = setup.exchange.collect(kv)
        dk, dv = _split(dkv, setup.head_dim)
        grad_of = iter(dcaptured)
        captured_grads = [next(grad_of) if t.requires_grad else None for t in captured]
        return (None, dq.to(q_leaf.dtype), dk.to(kv.dtype), dv.to(kv.dtype), *captured_grads)


def _all_gathered(setup: _Setup, query: Tensor, key: Tensor, value: Tensor, rank: int, world: int, group):
    """The all-gather strategy: one call on the keys of the blocks this rank's queries
    list (every rank's, by one all-gather, where the ranks list most of them), autograd
    through it all."""
    if setup.masks.gathers_all():
        kv = AllGather.apply(torch.cat([key, value], dim=-1), group, world, rank)
        key, value = _Unpack.apply(kv, setup.head_dim)
    else:
        key, value = BlockGather.apply(setup.masks, rank, group, key, value)
    return setup.attend(setup.masks.gathered_call(rank), query, key, value)


_MASKS: "weakref.WeakKeyDictionary[BlockMask, dict]" = weakref.WeakKeyDictionary()


def _local_masks(block_mask: BlockMask, plan: ShardPlan, score_mod, device) -> LocalMasks:
    """The LocalMasks of (mask, plan, score_mod, device), built once while the mask lives."""
    per_mask = _MASKS.setdefault(block_mask, {})
    key = (plan, score_mod, device)
    if key not in per_mask:
        per_mask[key] = LocalMasks(block_mask, plan, score_mod, device)
    return per_mask[key]


def _group_rank(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flexattn: context_parallel_attention needs torch.distributed initialised "
                           "(torch.distributed.init_process_group)")
    return dist.get_rank(group), dist.get_world_size(group)


def _check_shards(query: Tensor, key: Tensor, value: Tensor, plan: ShardPlan) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"flexattn: {name} must be a 4-D tensor (B, H, local_len, E), got "
                             f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
        if t.shape[2] != plan.local_len:
            raise ValueError(f"flexattn: {name} must be this rank's shard of {plan.local_len} positions "
                             f"(sequence {plan.seq_len} over {plan.world_size} ranks), got shape {tuple(t.shape)}")


@torch.compiler.disable
def context_parallel_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    block_mask: BlockMask,
    plan: ShardPlan,
    score_mod: Callable | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    strategy: str = "auto",
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: dict[str, Any] | None = None,
):
    """Attention over a sequence sharded across the ranks of ``group``.

    Each rank passes its shards (``plan.shard(x, rank)``, sequence on dim 2) of query,
    key and value, the same global ``block_mask`` (its mask_mod and ``score_mod`` see
    global positions; tensors they capture are whole-sequence tables, the same on every
    rank) and the same ``plan`` (``plan_context_parallel(block_mask, world_size)``).
    Returns this rank's shard of the output (and of the lse with ``return_lse``),
    differentiable in q, k, v (key and value gradients reach their owners) and in the
    tensors score_mod captures; a captured tensor's gradient on each rank is that rank's
    queries' share, so summing it over the group (as data-parallel training does for
    every parameter) gives the whole sequence's.

    ``strategy``: ``"ring"`` (peer-to-peer steps, overlapped with the kernels, skipping
    pairs of ranks the mask keeps apart), ``"allgather"`` (one all-gather of keys and
    values, or of the blocks the rank's queries list) or ``"auto"`` (the all-gather).
    Attention dropout and sinks are not supported here.
    """
    rank, world = _group_rank(group)
    if not isinstance(plan, ShardPlan):
        raise TypeError(f"flexattn: plan must be a ShardPlan (plan_context_parallel), got {type(plan).__name__}")
    if plan.world_size != world:
        raise ValueError(f"flexattn: the plan is for {plan.world_size} ranks, the process group has {world}")
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"flexattn: block_mask must be a BlockMask, got {type(block_mask).__name__}")
    _check_shards(query, key, value, plan)
    masks = _local_masks(block_mask, plan, score_mod, query.device)
    chosen = choose_strategy(strategy)
    if chosen == "ring":
        setup = _Setup(masks, RingExchange(masks, rank, group), scale, enable_gqa, kernel_options, key.shape[-1])
        out, lse = _Ring.apply(setup, query, key, value, *captured_tensors(score_mod))
    else:
        setup = _Setup(masks, None, scale, enable_gqa, kernel_options, key.shape[-1])
        out, lse = _all_gathered(setup, query, key, value, rank, world, group)
    return (out, lse) if return_lse else out


class ContextParallelAttention(nn.Module):
    """``context_parallel_attention`` with its mask, mods, plan and options held: build
    it once per mask (every rank the same), call it on each step's shards.

    ``block_mask``: the global mask; ``world_size`` defaults to the group's.
    """

    def __init__(self, block_mask: BlockMask, score_mod: Callable | None = None, *, group=None,
                 world_size: int | None = None, strategy: str = "auto", scale: float | None = None,
                 enable_gqa: bool = False, kernel_options: dict[str, Any] | None = None,
                 max_imbalance: float = 0.05) -> None:
        super().__init__()
        if world_size is None:
            world_size = _group_rank(group)[1]
        self.block_mask, self.score_mod, self.group = block_mask, score_mod, group
        self.plan = plan_context_parallel(block_mask, world_size, max_imbalance=max_imbalance)
        self.options = dict(strategy=strategy, scale=scale, enable_gqa=enable_gqa, kernel_options=kernel_options)

    def shard(self, tensor: Tensor, dim: int = 2) -> Tensor:
        """This rank's shard of a whole-sequence tensor."""
        return self.plan.shard(tensor, _group_rank(self.group)[0], dim)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, return_lse: bool = False):
        """Attention of this rank's query shard over the whole sequence's keys and values
        (each rank passes its own shards); the output (and lse) of this rank's rows."""
        return context_parallel_attention(query, key, value, self.block_mask, self.plan, self.score_mod,
                                          group=self.group, return_lse=return_lse, **self.options)

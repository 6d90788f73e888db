"""Which backward kernel a call takes: the Triton template, or the Gluon kernel for
Hopper (``templates/gluon_backward.py.jinja``).

A pure function of a frozen ``BackwardInputs``. kernel_options BWD_BACKEND="GLUON" forces
the Gluon kernel (a ValueError naming the obstacle where it cannot run the call); AUTO
takes it for long, large calls, where it measured faster, but for a mask_mod reading captured
tensors on nearly all partial blocks at D=128, and the Triton template otherwise
(bench/DECISIONS.md#gluon-backward-default, #gluon-backward-small-calls,
#gluon-backward-memory-masks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .configs import gluon_backward as gluon_configs
from .forward_plan import gluon_device_obstacle


@dataclass(frozen=True)
class BackwardInputs:
    """What the backward kernel choice depends on."""

    device_type: str
    #: (major, minor) of a CUDA device, else None.
    capability: tuple[int, int] | None
    interpreter: bool
    gluon_available: bool
    dtype: torch.dtype
    qk_head_dim: int
    v_head_dim: int
    sparse_q: int
    sparse_kv: int
    has_dropout: bool
    #: Captured tensors that need gradients (the Gluon kernel does not form them yet).
    buffer_grads: bool
    #: Deterministic mode (the Gluon kernel adds dQ with float atomics).
    deterministic: bool
    #: Why Q, K, V or dO cannot be read through tensor descriptors (None: they can).
    tma_obstacle: str | None
    backend: str
    #: The mask_mod reads captured tensors.
    mask_reads_memory: bool = False
    #: The BlockMask's partial_heavy (nearly all listed blocks partial; None: not known).
    partial_heavy: bool | None = None
    #: Query and key lengths (None: symbolic, one kernel for every length).
    q_len: int | None = None
    kv_len: int | None = None
    #: batch x query heads x queries x keys x QK head dim (None: a size is symbolic).
    work: int | None = None
    #: flex_attention's own mask (DENSE_KV) and no score_mod: the tile may differ.
    unmodified: bool = False


@dataclass(frozen=True)
class BackwardPlan:
    kernel: str  # "gluon" or "triton"
    reason: str


def gluon_obstacle(inputs: BackwardInputs) -> str | None:
    """Why the Gluon backward cannot run the call (None: it can)."""
    obstacle = gluon_device_obstacle(inputs.device_type, inputs.capability, inputs.interpreter,
                                     inputs.gluon_available, inputs.dtype, "the Gluon backward")
    if obstacle is not None:
        return obstacle
    if inputs.qk_head_dim != inputs.v_head_dim or inputs.qk_head_dim not in gluon_configs.SM90:
        return (f"head dims {inputs.qk_head_dim}/{inputs.v_head_dim} (the Gluon backward takes equal head dims "
                f"in {sorted(gluon_configs.SM90)})")
    cfg = gluon_configs.config_for(inputs.qk_head_dim, inputs.unmodified)
    if inputs.sparse_q % cfg.block_m or inputs.sparse_kv % cfg.block_n:
        return (f"BlockMask block size ({inputs.sparse_q}, {inputs.sparse_kv}) is not a multiple of the "
                f"Gluon backward's tile ({cfg.block_m}, {cfg.block_n})")
    if inputs.has_dropout:
        return "dropout (the Triton backward regenerates the keep mask)"
    if inputs.buffer_grads:
        return "gradients of captured tensors (the Triton backward forms them)"
    if inputs.deterministic:
        return "deterministic mode (the Gluon backward adds dQ with float atomics)"
    if inputs.tma_obstacle is not None:
        return inputs.tma_obstacle
    return None


def plan_backward(inputs: BackwardInputs) -> BackwardPlan:
    """The backward kernel of a call and why."""
    if inputs.backend == "TRITON":
        return BackwardPlan("triton", "kernel_options BWD_BACKEND='TRITON'")
    obstacle = gluon_obstacle(inputs)
    if inputs.backend == "GLUON":
        if obstacle is not None:
            raise ValueError(f"flexattn: kernel_options BWD_BACKEND='GLUON' cannot run this call: {obstacle}")
        return BackwardPlan("gluon", "kernel_options BWD_BACKEND='GLUON'")
    if obstacle is not None:
        return BackwardPlan("triton", obstacle)
    if inputs.q_len is None or inputs.kv_len is None:
        return BackwardPlan("triton", "symbolic lengths (the Gluon backward is taken by length)")
    shortest = gluon_configs.AUTO_MIN_LENGTH[inputs.qk_head_dim]
    if min(inputs.q_len, inputs.kv_len) < shortest:
        return BackwardPlan("triton", f"lengths {inputs.q_len}/{inputs.kv_len} below {shortest} at head dim "
                                      f"{inputs.qk_head_dim}: the Triton backward measured faster")
    if inputs.work is not None and inputs.work < gluon_configs.AUTO_MIN_WORK:
        return BackwardPlan("triton", f"a small call (batch x heads x queries x keys x head dim {inputs.work} "
                                      f"< 2**{gluon_configs.AUTO_MIN_WORK.bit_length() - 1}): the Triton backward's "
                                      f"launch costs the host less")
    if (inputs.mask_reads_memory and inputs.partial_heavy
            and inputs.qk_head_dim in gluon_configs.PARTIAL_HEAVY_MEMORY_MASK_TRITON_HEAD_DIMS):
        return BackwardPlan("triton", "a mask_mod reading captured tensors on nearly all partial blocks: the "
                                      "Triton backward measured faster")
    return BackwardPlan("gluon", "sm90, 16-bit, TMA-ready layouts, long sequences")

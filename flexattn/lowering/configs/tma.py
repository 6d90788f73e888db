"""Where each kernel loads its tiles through tensor descriptors (USE_TMA) by default.

Descriptors need the copy engine of sm90 and later and 16-bit inputs here; the
(GPU generation, QK head-dim bucket) pairs below are where they measured faster
(bench/DECISIONS.md#tma-tma-defaults), from TMA_MIN_KV_LENGTH keys on. kernel_options
USE_TMA overrides it per call.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .base import gpu_generation, head_dim_bucket

TMA_DEFAULTS: dict[str, frozenset[tuple[str, int]]] = {
    "forward": frozenset({("sm90", 64), ("sm90", 128), ("sm90", 256)}),
    "backward": frozenset({("sm90", 128)}),
}


#: Below this many keys a program's few KV tiles do not repay building its descriptors, and
#: the launch's descriptor scratch adds host time (bench/DECISIONS.md#tma-short-sequences).
TMA_MIN_KV_LENGTH = 4096

#: A forward call below this much work (batch x heads x queries x keys x head dim) keeps
#: pointer loads: its kernel takes about the host's time to issue it, and descriptors
#: (device-built, in Triton's global scratch) keep it off Inductor's static launcher, 25-34 us
#: more a call for the same kernel time (bench/DECISIONS.md#tma-small-forward-calls).
TMA_MIN_FORWARD_WORK = 2 ** 36

#: The same for the Triton backward (its dQ programs' descriptors): a few percent of a small
#: call's kernel time against the launcher's host time, in calls the host already bounds
#: (bench/DECISIONS.md#tma-small-backward-calls).
TMA_MIN_BACKWARD_WORK = 2 ** 36

#: Per kernel, the least work at which descriptors are the default.
TMA_MIN_WORK = {"forward": TMA_MIN_FORWARD_WORK, "backward": TMA_MIN_BACKWARD_WORK}


def tma_by_default(kernel: str, device: torch.device, padded_head_dim: int, dtype: torch.dtype,
                   kv_length: int, work: int | None = None) -> bool:
    """Whether ``kernel`` uses tensor descriptors when USE_TMA is not given (``kv_length``:
    the keys per head, ``work``: batch x heads x queries x keys x head dim, hints when
    symbolic)."""
    if dtype not in (torch.float16, torch.bfloat16) or kv_length < TMA_MIN_KV_LENGTH:
        return False
    if work is not None and work < TMA_MIN_WORK.get(kernel, 0):
        return False
    key = (gpu_generation(device), head_dim_bucket(padded_head_dim))
    return key in TMA_DEFAULTS.get(kernel, frozenset())


class BackwardTma(NamedTuple):
    """Which of the backward's program kinds load their walked tiles through descriptors."""

    dkdv: bool
    dq: bool


def backward_tma_programs(use_tma: bool, requested: bool | None, dq_atomic: bool) -> BackwardTma:
    """The backward's USE_TMA_DKDV / USE_TMA_DQ from its USE_TMA, the call's kernel_options
    USE_TMA (``requested``; None: automatic) and DQ_ATOMIC. Automatic descriptors go to the
    dQ programs only: the dK/dV programs' gain under 2% on causal rows and cost 7-11% on
    packed documents (bench/DECISIONS.md#tma-backward-programs). True asks for both; so
    does DQ_ATOMIC (no dQ programs; its dQ shares are bulk reductions through descriptors,
    a trade that split did not measure)."""
    return BackwardTma(dkdv=use_tma and (bool(requested) or dq_atomic), dq=use_tma)

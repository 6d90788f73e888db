"""Tile configurations of the Gluon backward kernel (``templates/gluon_backward.py.jinja``).

A ``GluonBackwardConfig`` is one launch shape of the warp-specialised backward: the keys
of a program (two consumer warpgroups of BLOCK_N / 2), the query tile each step reads,
the depth of the Q/dO ring and the register budgets of the producer and the consumers.
Keyed by the head dim (QK and V alike: 64 or 128). The tiles and budgets are the standalone
probe's (bench/experiments/gluon_backward_probe.py), not yet tuned on the kernel; the
kernel's readings against the Triton backward: bench/DECISIONS.md#gluon-backward-default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import TileConfig


@dataclass(frozen=True)
class GluonBackwardConfig(TileConfig):
    """One launch configuration of the Gluon backward template."""

    block_m: int
    block_n: int
    num_stages: int
    #: Registers per thread of the one-warp producer and of the worker consumer warpgroup
    #: (the default warpgroup takes the rest of 168 a warpgroup): the probe's budgets.
    load_regs: int = 24
    mma_regs: int = 240
    num_warps: int = 4
    #: Issue dP^T = V dO^T once the tile's scores are masked and exponentiated instead of
    #: beside S^T: its accumulator then holds no registers while score_mod and mask_mod run
    #: (``late_dp_default``).
    late_dp: bool = False
    #: Land each query tile's log-sum-exp and delta in shared memory with its Q and dO (read
    #: there in the S^T columns' layout) instead of loading them in the consumers and spreading
    #: them through shared memory (bench/DECISIONS.md#gluon-backward-rows-by-tma).
    rows_by_tma: bool = False
    #: Issue a tile's dQ product between dV's and dK's and store and add dQ while dK's runs,
    #: instead of after both, all three waited together
    #: (bench/DECISIONS.md#gluon-backward-dq-before-dk, #gluon-backward-early-dq).
    dq_before_dk: bool = True
    #: dS^T tiles in shared memory, by tile: with two, a warpgroup writes its rows of the next
    #: tile's without waiting for the other's dQ product of this one.
    ds_buffers: int = 1

    OPTION_NAMES: ClassVar[dict[str, str]] = {}
    OPTION_PREFIX: ClassVar[str] = "bwd_"

    def constexprs(self) -> dict[str, int]:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "NUM_STAGES": self.num_stages,
                "LOAD_REGS": self.load_regs, "MMA_REGS": self.mma_regs, "LATE_DP": self.late_dp,
                "ROWS_BY_TMA": self.rows_by_tma, "DQ_BEFORE_DK": self.dq_before_dk, "DS_BUFFERS": self.ds_buffers}


#: By head dim (sm90, 16-bit inputs).
SM90: dict[int, GluonBackwardConfig] = {
    64: GluonBackwardConfig(64, 128, 2, dq_before_dk=False),
    128: GluonBackwardConfig(64, 128, 2, rows_by_tma=True, ds_buffers=2),
}

#: By head dim, for unmodified calls (flex_attention's own mask, no score_mod): at D=64 query
#: tiles as tall as the program's keys, which lost on a causal mask
#: (bench/DECISIONS.md#gluon-backward-tall-tiles).
UNMODIFIED_SM90: dict[int, GluonBackwardConfig] = {
    64: GluonBackwardConfig(128, 128, 2, ds_buffers=2),
}


def config_for(head_dim: int, unmodified: bool) -> GluonBackwardConfig:
    """The call's configuration (``unmodified``: flex_attention's own mask and no score_mod)."""
    return (UNMODIFIED_SM90.get(head_dim) if unmodified else None) or SM90[head_dim]


#: AUTO takes the Gluon backward for calls whose query and key lengths both reach this, by head
#: dim: shorter calls ran slower on it (H200, bench/DECISIONS.md#gluon-backward-default).
AUTO_MIN_LENGTH: dict[int, int] = {64: 8192, 128: 4096}

#: AUTO also needs batch x query heads x queries x keys x head dim of at least this: below
#: it the kernel saves less than its launch adds on the host (Triton's own launcher, for the
#: descriptors it builds on the device, and two more kernels for the float32 dQ)
#: (bench/DECISIONS.md#gluon-backward-small-calls).
AUTO_MIN_WORK = 2 ** 36

#: Head dims where AUTO leaves a mask_mod that reads captured tensors on a BlockMask of nearly
#: all partial blocks (``BlockMask.partial_heavy``) to the Triton backward: every score there
#: waits on the mask's gathers, which its more warps per tile overlap; every other memory mask
#: ran faster on the Gluon backward (bench/DECISIONS.md#gluon-backward-memory-masks).
PARTIAL_HEAVY_MEMORY_MASK_TRITON_HEAD_DIMS = (128,)


#: Head dims at which a call whose mods hold index tiles issues dP^T late (``late_dp``): at
#: D=128 the consumers spill where a score_mod's index tiles, or a mask_mod's quotients by a
#: divisor other than a power of two, meet both accumulators in flight; at D=64, without
#: such mods and under a soft-cap of the score alone, the lost overlap measured slower
#: (bench/DECISIONS.md#gluon-backward-late-dp).
LATE_DP_HEAD_DIMS: frozenset[int] = frozenset({128})


def late_dp_default(head_dim: int, score_mod_reads_positions: bool, mask_mod_divides: bool) -> bool:
    """``late_dp`` when kernel_options BWD_LATE_DP leave it unset: the score_mod reads q_idx
    or kv_idx, or the mask_mod divides indices by a divisor other than a power of two."""
    return (score_mod_reads_positions or mask_mod_divides) and head_dim in LATE_DP_HEAD_DIMS

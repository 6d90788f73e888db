"""Tile configurations of the Gluon forward kernel (``templates/gluon_forward.py.jinja``).

A ``GluonForwardConfig`` is one launch shape of the warp-specialised kernel: the query
tile (consumer warpgroups of 64 rows: two, or three at D=64 with neither a block mask nor
a score_mod), the KV step, the depth of the K/V ring, and the register budgets of the
producer and consumer partitions. The tables are keyed by the QK head dim (the kernel
takes 64, 128 and 256); the measurements behind each entry:
bench/DECISIONS.md#gluon-forward-tiles and #gluon-forward-three-warpgroups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import TileConfig


@dataclass(frozen=True)
class GluonForwardConfig(TileConfig):
    """One launch configuration of the Gluon forward template."""

    block_m: int
    block_n: int
    num_stages: int
    #: Registers per thread of the one-warp TMA producer and of each worker consumer
    #: warpgroup; the default warpgroup takes the rest of the 65536 registers shared by the
    #: warpgroups (the producer's one warp counts as a warpgroup): 168 a warpgroup with two
    #: consumers, 32 + 232 + 240 = 504 (the producer walks each query tile's block lists: at
    #: 24 it spills); 128 with three, 32 + 160 * 3 = 512.
    load_regs: int = 32
    mma_regs: int = 232
    #: The default partition: one consumer warpgroup (the others are worker partitions).
    num_warps: int = 4

    OPTION_NAMES: ClassVar[dict[str, str]] = {"block_m": "BLOCK_M", "block_n": "BLOCK_N",
                                              "num_stages": "num_stages"}
    OPTION_PREFIX: ClassVar[str] = "fwd_"

    def constexprs(self) -> dict[str, int]:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "NUM_STAGES": self.num_stages,
                "LOAD_REGS": self.load_regs, "MMA_REGS": self.mma_regs, "CONSUMERS": self.block_m // 64}


#: By QK head dim (sm90, 16-bit inputs).
SM90: dict[int, GluonForwardConfig] = {
    64: GluonForwardConfig(128, 128, 2),
    128: GluonForwardConfig(128, 128, 2),
    256: GluonForwardConfig(128, 64, 2),
}

#: Calls with neither a block mask (flex_attention's own default mask, DENSE_KV: the tile
#: need not divide a BlockMask's query blocks) nor a score_mod, by QK head dim where the V
#: head dim is the same: at D=64 a consumer's products are shorter than its softmax, so three
#: warpgroups take turns; a score_mod's registers spill at 160 a thread (ALiBi ran 3.6x
#: slower), hence none (bench/DECISIONS.md#gluon-forward-three-warpgroups).
UNMODIFIED_SM90: dict[int, GluonForwardConfig] = {
    64: GluonForwardConfig(192, 128, 2, load_regs=32, mma_regs=160),
}

#: Head dims where flex_attention takes this kernel unless told otherwise: at D=64 the
#: Triton template measured faster (bench/DECISIONS.md#gluon-forward-head-dims) but for
#: unmodified calls (UNMODIFIED_SM90, `takes_by_default`).
DEFAULT_HEAD_DIMS = (128, 256)

#: Head dims where a mask_mod that reads captured tensors on a BlockMask of nearly all partial
#: blocks takes the Triton template: the consumers' softmax waits on the mask's gathers,
#: which the template's eight warps overlap (bench/DECISIONS.md#forward-partial-heavy-memory-mask).
PARTIAL_HEAVY_MEMORY_MASK_TRITON_HEAD_DIMS = (128,)

#: Shared memory one program may use on sm90 (227 KiB).
SMEM_LIMIT = 232448


def shared_memory_estimate(cfg: GluonForwardConfig, qk_head_dim: int, v_head_dim: int, elem_bytes: int) -> int:
    """The Q tile and the K/V ring, in bytes (the mbarriers add a few dozen)."""
    return elem_bytes * (cfg.block_m * qk_head_dim + cfg.num_stages * cfg.block_n * (qk_head_dim + v_head_dim))


#: Extra candidates benchmarked under Inductor's max_autotune (those that fit).
AUTOTUNE_CANDIDATES: tuple[GluonForwardConfig, ...] = (
    GluonForwardConfig(128, 128, 3),
    GluonForwardConfig(128, 64, 2),
    GluonForwardConfig(128, 64, 3),
)


def fits(cfg: GluonForwardConfig, qk_head_dim: int, v_head_dim: int, elem_bytes: int) -> bool:
    return shared_memory_estimate(cfg, qk_head_dim, v_head_dim, elem_bytes) <= SMEM_LIMIT


def unmodified_config(qk_head_dim: int, v_head_dim: int, unmodified: bool) -> GluonForwardConfig | None:
    """UNMODIFIED_SM90's entry for an unmodified call (no block mask, no score_mod), if any."""
    return UNMODIFIED_SM90.get(qk_head_dim) if unmodified and qk_head_dim == v_head_dim else None


def takes_by_default(qk_head_dim: int, v_head_dim: int, unmodified: bool) -> bool:
    """Whether flex_attention takes this kernel for these head dims unless told otherwise."""
    return qk_head_dim in DEFAULT_HEAD_DIMS or unmodified_config(qk_head_dim, v_head_dim, unmodified) is not None


def config_for(qk_head_dim: int, v_head_dim: int, elem_bytes: int,
               unmodified: bool = False) -> GluonForwardConfig | None:
    """The call's default configuration (``unmodified``: neither a block mask nor a
    score_mod), or None where none fits shared memory."""
    cfg = unmodified_config(qk_head_dim, v_head_dim, unmodified) or SM90.get(qk_head_dim)
    if cfg is None or not fits(cfg, qk_head_dim, v_head_dim, elem_bytes):
        return None
    return cfg


def candidate_configs(qk_head_dim: int, v_head_dim: int, elem_bytes: int, max_autotune: bool,
                      sparse_kv: int, unmodified: bool = False) -> list[GluonForwardConfig]:
    """The default, then under max_autotune the other candidates that fit shared memory
    and divide the BlockMask's KV block."""
    default = config_for(qk_head_dim, v_head_dim, elem_bytes, unmodified)
    configs = [default] if default is not None else []
    if max_autotune:
        configs += [c for c in AUTOTUNE_CANDIDATES if c not in configs and sparse_kv % c.block_n == 0
                    and fits(c, qk_head_dim, v_head_dim, elem_bytes)]
    return configs

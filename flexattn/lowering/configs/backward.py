"""Tile configurations of the backward kernel (``templates/backward.py.jinja``).

The kernel has two kinds of programs, each with its own tiles: dK/dV programs own
BLOCK_N1 keys and step through the listed query blocks BLOCK_M1 rows at a time; dQ
programs own BLOCK_M2 query rows and step through the listed KV blocks BLOCK_N2 keys at
a time. Candidates, pinning (``bwd_``-prefixed keys win over unprefixed ones) and
fitting work as for the forward (``configs/forward.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .base import (MIN_TILE, TileConfig, check_pinned, dtype_width, fit_candidates, generation_table,
                   gpu_generation, no_config_error, with_pinned)


@dataclass(frozen=True)
class BackwardConfig(TileConfig):
    """One launch configuration of the backward template."""

    block_m1: int
    block_n1: int
    block_m2: int
    block_n2: int
    num_warps: int
    num_stages: int
    #: Walk the partial and the full blocks of each program in one loop (ONE_KV_LOOP).
    #: Off in every default: it removes spills but measured slower
    #: (bench/DECISIONS.md#backward-one-kv-loop).
    one_kv_loop: bool = False

    OPTION_NAMES: ClassVar[dict[str, str]] = {
        "block_m1": "BLOCK_M1", "block_n1": "BLOCK_N1", "block_m2": "BLOCK_M2", "block_n2": "BLOCK_N2",
        "num_warps": "num_warps", "num_stages": "num_stages", "one_kv_loop": "ONE_KV_LOOP"}
    OPTION_PREFIX: ClassVar[str] = "bwd_"

    def constexprs(self) -> dict[str, Any]:
        return {"BLOCK_M1": self.block_m1, "BLOCK_N1": self.block_n1, "BLOCK_M2": self.block_m2,
                "BLOCK_N2": self.block_n2, "ONE_KV_LOOP": self.one_kv_loop}


# Defaults per GPU generation, keyed by (padded QK head-dim bucket, dtype width). The
# dK/dV programs keep K, V and two accumulators resident, so their KV tile is the wide
# one (BLOCK_N1) and their query step narrow (BLOCK_M1); dQ programs mirror that. sm90
# 16-bit tiles: bench/DECISIONS.md#backward-defaults.
SM90: dict[tuple[int, str], BackwardConfig] = {
    (64, "16bit"): BackwardConfig(64, 64, 64, 64, 4, 3),
    (128, "16bit"): BackwardConfig(64, 64, 64, 64, 4, 2),
    (256, "16bit"): BackwardConfig(64, 64, 64, 64, 8, 2),
    (64, "fp32"): BackwardConfig(32, 64, 64, 32, 4, 2),
    (128, "fp32"): BackwardConfig(32, 64, 64, 32, 4, 1),
    (256, "fp32"): BackwardConfig(16, 32, 32, 16, 4, 1),
}
SM80: dict[tuple[int, str], BackwardConfig] = {
    (64, "16bit"): BackwardConfig(64, 128, 128, 64, 8, 2),
    (128, "16bit"): BackwardConfig(64, 64, 64, 64, 8, 2),
    (256, "16bit"): BackwardConfig(32, 64, 64, 32, 4, 1),
    (64, "fp32"): BackwardConfig(32, 64, 64, 32, 4, 1),
    (128, "fp32"): BackwardConfig(32, 64, 64, 32, 4, 1),
    (256, "fp32"): BackwardConfig(16, 32, 32, 16, 4, 1),
}
GENERIC: dict[tuple[int, str], BackwardConfig] = {
    (64, "16bit"): BackwardConfig(64, 64, 64, 64, 4, 1),
    (128, "16bit"): BackwardConfig(32, 64, 64, 32, 4, 1),
    (256, "16bit"): BackwardConfig(16, 32, 32, 16, 4, 1),
    (64, "fp32"): BackwardConfig(64, 64, 64, 64, 4, 1),
    (128, "fp32"): BackwardConfig(32, 64, 64, 32, 4, 1),
    (256, "fp32"): BackwardConfig(16, 32, 32, 16, 4, 1),
}
TABLES = {"sm90": SM90, "sm80": SM80, "generic": GENERIC}

#: Extra candidates benchmarked under max_autotune (after fitting).
AUTOTUNE_CANDIDATES: tuple[BackwardConfig, ...] = (
    BackwardConfig(64, 64, 64, 64, 8, 2),
    BackwardConfig(32, 64, 64, 64, 8, 2),
    BackwardConfig(64, 128, 128, 64, 8, 3),
    BackwardConfig(64, 128, 128, 64, 8, 2),
    BackwardConfig(64, 128, 128, 64, 4, 3),
    BackwardConfig(32, 128, 128, 32, 4, 3),
    BackwardConfig(64, 64, 64, 64, 4, 3),
    BackwardConfig(32, 64, 64, 32, 4, 3),
    BackwardConfig(32, 64, 64, 32, 4, 2),
    BackwardConfig(16, 64, 64, 16, 4, 2),
)

#: (GPU generation, dtype width) pairs whose backward adds dQ with atomics by default
#: (DQ_ATOMIC): none, as it measured slower (bench/DECISIONS.md#backward-dq-atomic-generations).
DQ_ATOMIC_GENERATIONS: frozenset[tuple[str, str]] = frozenset()

#: REVERSED_Q_TILES when kernel_options leave it unset (bench/DECISIONS.md#backward-reversed-q-tiles).
REVERSED_Q_TILES = True

#: Shared-memory fitting order: fewer stages, then narrower loop steps.
SMEM_STEPS = (("num_stages", 1), ("block_m1", MIN_TILE), ("block_n2", MIN_TILE))


def dq_atomic_default(device: torch.device, dtype: torch.dtype) -> bool:
    return (gpu_generation(device), dtype_width(dtype)) in DQ_ATOMIC_GENERATIONS


def default_config(device: torch.device, padded_head_dim: int, dtype: torch.dtype) -> BackwardConfig:
    return generation_table(TABLES, device, padded_head_dim, dtype)


def candidate_configs(device: torch.device, padded_head_dim: int, dtype: torch.dtype,
                      max_autotune: bool, kernel_options: dict[str, Any]) -> list[BackwardConfig]:
    """Default (+ autotune candidates), with pinned fields applied, deduplicated."""
    configs = [default_config(device, padded_head_dim, dtype)]
    if max_autotune:
        configs += list(AUTOTUNE_CANDIDATES)
    return with_pinned(configs, BackwardConfig.pinned_fields(kernel_options))


def shared_memory_estimate(cfg: BackwardConfig, qk_dim_pad: int, v_dim_pad: int, elem_bytes: int,
                           gathered_bytes: int = 0, staged_dq: bool = False) -> int:
    """Bytes of the larger program kind: its resident tiles plus num_stages buffered
    tiles of the loop operand (Q and dO for dK/dV programs, K and V for dQ programs),
    plus the mods' score-shaped gathers buffered for each extra stage, plus with
    ``staged_dq`` the float32 dQ share that a bulk reduction (DQ_ATOMIC with USE_TMA_DKDV)
    copies out of shared memory."""
    row = qk_dim_pad + v_dim_pad
    extra = (cfg.num_stages - 1) * gathered_bytes
    dkv = elem_bytes * (cfg.block_n1 * row + cfg.num_stages * cfg.block_m1 * row) + extra * cfg.block_n1 * cfg.block_m1
    if staged_dq:
        dkv += 4 * cfg.block_m1 * qk_dim_pad
    dq = elem_bytes * (cfg.block_m2 * row + cfg.num_stages * cfg.block_n2 * row) + extra * cfg.block_m2 * cfg.block_n2
    return max(dkv, dq)


def usable_configs(candidates: list[BackwardConfig], kernel_options: dict[str, Any], *,
                   sparse_q: int, sparse_kv: int, qk_dim_pad: int, v_dim_pad: int,
                   elem_bytes: int, smem_limit: int | None, gathered_bytes: int = 0,
                   staged_dq: bool = False) -> list[BackwardConfig]:
    """The candidates that satisfy every constraint (see configs/forward.py)."""
    pinned = BackwardConfig.pinned_fields(kernel_options)
    check_pinned(pinned, {"block_m1": ("BLOCK_M1", "Q", sparse_q), "block_n1": ("BLOCK_N1", "KV", sparse_kv),
                          "block_m2": ("BLOCK_M2", "Q", sparse_q), "block_n2": ("BLOCK_N2", "KV", sparse_kv)},
                 prefix="bwd_")
    usable = fit_candidates(
        candidates, block_limits={"block_m1": sparse_q, "block_n1": sparse_kv, "block_m2": sparse_q,
                                  "block_n2": sparse_kv},
        estimate=lambda c: shared_memory_estimate(c, qk_dim_pad, v_dim_pad, elem_bytes, gathered_bytes, staged_dq),
        smem_limit=smem_limit, pinned=pinned, steps=SMEM_STEPS)
    if not usable:
        raise no_config_error("backward", candidates, sparse_q=sparse_q, sparse_kv=sparse_kv, qk_dim_pad=qk_dim_pad,
                              v_dim_pad=v_dim_pad, smem_limit=smem_limit)
    return usable

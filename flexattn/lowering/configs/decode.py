"""Launch configurations of the split-KV decode kernel (``templates/decode.py.jinja``).

A decode tile's rows follow from the GQA packing (``lowering/decode_plan.py``), so a
``DecodeConfig`` is the KV step (BLOCK_N), warps and stages. A decode program has few
rows and is bound by its K/V loads: 64-column steps 3-4 deep keep enough bytes in flight
on Ampere/Hopper; float32 and D=256 halve the step to stay within shared memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import torch

from .base import (MIN_TILE, ConfigError, TileConfig, check_pinned, dtype_width, fit_candidates, head_dim_bucket,
                   with_pinned)


@dataclass(frozen=True)
class DecodeConfig(TileConfig):
    """One launch configuration of the decode template (the row tile is fixed per call)."""

    block_n: int
    num_warps: int
    num_stages: int

    OPTION_NAMES: ClassVar[dict[str, str]] = {"block_n": "BLOCK_N", "num_warps": "num_warps",
                                              "num_stages": "num_stages"}


# Defaults per GPU generation, keyed by (padded QK head-dim bucket, dtype width)
# (bench/DECISIONS.md#decode-defaults).
SM90: dict[tuple[int, str], DecodeConfig] = {
    (64, "16bit"): DecodeConfig(64, 4, 4),
    (128, "16bit"): DecodeConfig(64, 4, 3),
    (256, "16bit"): DecodeConfig(32, 4, 3),
    (64, "fp32"): DecodeConfig(64, 4, 3),
    (128, "fp32"): DecodeConfig(32, 4, 3),
    (256, "fp32"): DecodeConfig(16, 4, 3),
}
SM80: dict[tuple[int, str], DecodeConfig] = {
    (64, "16bit"): DecodeConfig(64, 4, 3),
    (128, "16bit"): DecodeConfig(64, 4, 3),
    (256, "16bit"): DecodeConfig(32, 4, 2),
    (64, "fp32"): DecodeConfig(32, 4, 3),
    (128, "fp32"): DecodeConfig(32, 4, 2),
    (256, "fp32"): DecodeConfig(16, 4, 2),
}
GENERIC: dict[tuple[int, str], DecodeConfig] = {
    (64, "16bit"): DecodeConfig(64, 4, 2),
    (128, "16bit"): DecodeConfig(64, 4, 2),
    (256, "16bit"): DecodeConfig(32, 4, 2),
    (64, "fp32"): DecodeConfig(64, 4, 2),
    (128, "fp32"): DecodeConfig(32, 4, 2),
    (256, "fp32"): DecodeConfig(32, 4, 2),
}
TABLES = {"sm90": SM90, "sm80": SM80, "generic": GENERIC}

#: The step of long unsplit default-mask rows on sm90 (bench/DECISIONS.md#decode-stream-keys).
STREAM_CONFIG = DecodeConfig(128, 4, 2)

#: Extra candidates benchmarked under max_autotune (after fitting).
AUTOTUNE_CANDIDATES: tuple[DecodeConfig, ...] = (
    DecodeConfig(32, 2, 4),
    DecodeConfig(32, 4, 4),
    DecodeConfig(64, 2, 3),
    DecodeConfig(64, 4, 4),
    DecodeConfig(128, 4, 3),
    DecodeConfig(128, 8, 2),
)

#: REVERSED_Q_TILES: the decode kernel has no such order.
REVERSED_Q_TILES = False

#: Shared-memory fitting order: fewer stages, then a narrower KV step.
SMEM_STEPS = (("num_stages", 1), ("block_n", MIN_TILE))


def shared_memory_estimate(cfg: DecodeConfig, block_m: int, qk_dim_pad: int, v_dim_pad: int, elem_bytes: int) -> int:
    """The packed query tile plus num_stages buffered K and V steps, in bytes."""
    return elem_bytes * (block_m * qk_dim_pad + cfg.num_stages * cfg.block_n * (qk_dim_pad + v_dim_pad))


def candidate_configs(generation: str, padded_head_dim: int, dtype: torch.dtype, max_autotune: bool,
                      kernel_options: dict[str, Any]) -> list[DecodeConfig]:
    """Default of the GPU ``generation`` (+ autotune candidates), with pinned fields
    applied, deduplicated."""
    configs = [TABLES[generation][(head_dim_bucket(padded_head_dim), dtype_width(dtype))]]
    if max_autotune:
        configs += list(AUTOTUNE_CANDIDATES)
    return with_pinned(configs, DecodeConfig.pinned_fields(kernel_options))


def usable_configs(candidates: Sequence[DecodeConfig], kernel_options: dict[str, Any], *, sparse_kv: int,
                   block_m: int, qk_dim_pad: int, v_dim_pad: int, elem_bytes: int,
                   smem_limit: int | None) -> list[DecodeConfig]:
    """The candidates with BLOCK_N fitted to the BlockMask's KV block and the steps to
    shared memory (a pinned BLOCK_N that does not divide the block raises)."""
    pinned = DecodeConfig.pinned_fields(kernel_options)
    check_pinned(pinned, {"block_n": ("BLOCK_N", "KV", sparse_kv)})
    usable = fit_candidates(
        candidates, block_limits={"block_n": sparse_kv},
        estimate=lambda c: shared_memory_estimate(c, block_m, qk_dim_pad, v_dim_pad, elem_bytes),
        smem_limit=smem_limit, pinned=pinned, steps=SMEM_STEPS)
    if not usable:
        raise ConfigError(
            f"flexattn: no decode configuration fits the BlockMask's KV_BLOCK_SIZE={sparse_kv} "
            f"(it must be a multiple of {MIN_TILE}) and shared memory ({smem_limit} bytes); candidates were "
            f"{[c.describe() for c in candidates]}")
    return usable

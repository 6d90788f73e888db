"""Tile configurations of the forward kernel (``templates/forward.py.jinja``).

A ``ForwardConfig`` is one launch shape: the query tile (BLOCK_M), the KV step (BLOCK_N),
warps, software-pipeline stages and the one-loop flag. A call tries its generation's
default (``TABLES``), plus ``AUTOTUNE_CANDIDATES`` under Inductor's max_autotune; pinned
kernel_options fields replace that field in every candidate, and ``usable_configs``
fits them to the BlockMask's blocks and shared memory (raising for a pinned value that
cannot fit).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .base import (MIN_TILE, TileConfig, check_pinned, fit_candidates, generation_table, no_config_error,
                   table_entry, with_pinned)
from .tma import TMA_MIN_FORWARD_WORK


@dataclass(frozen=True)
class ForwardConfig(TileConfig):
    """One launch configuration of the forward template."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    #: Walk the partial and the full KV blocks in one loop (ONE_KV_LOOP): fewer registers
    #: for a branch per tile; pays where two loops spill (bench/DECISIONS.md#forward-one-kv-loop).
    one_kv_loop: bool = False

    OPTION_NAMES: ClassVar[dict[str, str]] = {"block_m": "BLOCK_M", "block_n": "BLOCK_N", "num_warps": "num_warps",
                                              "num_stages": "num_stages", "one_kv_loop": "ONE_KV_LOOP"}
    OPTION_PREFIX: ClassVar[str] = "fwd_"


# Defaults per GPU generation, keyed by (padded QK head-dim bucket, dtype width).
# sm90 16-bit tiles were chosen by sweeps (bench/DECISIONS.md#forward-defaults); sm80 are
# FlashAttention-2 style tiles; float32 halves the bytes per tile; "generic" (incl. the
# interpreter) favours large tiles, i.e. fewer interpreted steps.
SM90: dict[tuple[int, str], ForwardConfig] = {
    (64, "16bit"): ForwardConfig(64, 128, 4, 2),
    (128, "16bit"): ForwardConfig(128, 64, 4, 2, one_kv_loop=True),
    (256, "16bit"): ForwardConfig(128, 64, 8, 2),
    (64, "fp32"): ForwardConfig(128, 32, 4, 3),
    (128, "fp32"): ForwardConfig(32, 64, 4, 3),
    (256, "fp32"): ForwardConfig(32, 32, 4, 3),
}
SM80: dict[tuple[int, str], ForwardConfig] = {
    (64, "16bit"): ForwardConfig(128, 64, 4, 3),
    (128, "16bit"): ForwardConfig(128, 64, 8, 3),
    (256, "16bit"): ForwardConfig(32, 64, 4, 3),
    (64, "fp32"): ForwardConfig(128, 32, 4, 3),
    (128, "fp32"): ForwardConfig(128, 32, 4, 3),
    (256, "fp32"): ForwardConfig(64, 16, 4, 3),
}
GENERIC: dict[tuple[int, str], ForwardConfig] = {
    (64, "16bit"): ForwardConfig(64, 64, 4, 2),
    (128, "16bit"): ForwardConfig(64, 64, 4, 2),
    (256, "16bit"): ForwardConfig(32, 32, 4, 2),
    (64, "fp32"): ForwardConfig(64, 64, 4, 2),
    (128, "fp32"): ForwardConfig(64, 32, 4, 2),
    (256, "fp32"): ForwardConfig(32, 32, 4, 2),
}
# Entries where H100s (3.35 TB/s against the H200's 4.8) measured better with other tiles
# than the sm90 table; none at present (bench/DECISIONS.md#forward-defaults-h100).
SM90_H100: dict[tuple[int, str], ForwardConfig] = {}
TABLES = {"sm90": SM90, "sm90-h100": SM90_H100, "sm80": SM80, "generic": GENERIC}

# Defaults, by the same keys, for a mask_mod that reads captured tensors (document ids,
# per-batch lengths). Packed documents give such masks short rows, where one loop over
# 64x64 tiles at D=64 beats the two-loop 64x128 tile; elsewhere the generation's tile with
# two loops (bench/DECISIONS.md#forward-memory-mask-tiles, #forward-mask-reads-memory).
SM90_MEMORY_MASK: dict[tuple[int, str], ForwardConfig] = {
    (64, "16bit"): ForwardConfig(64, 64, 4, 2, one_kv_loop=True),
}
MEMORY_MASK_TABLES = {"sm90": SM90_MEMORY_MASK}
# The same for a BlockMask whose listed blocks are nearly all partial (neighbourhoods in tiled
# or Morton token orders): every tile evaluates the mask's gathers, and eight warps over
# 128x128 tiles keep more of them in flight (bench/DECISIONS.md#forward-partial-heavy-memory-mask).
SM90_PARTIAL_HEAVY_MEMORY_MASK: dict[tuple[int, str], ForwardConfig] = {
    (128, "16bit"): ForwardConfig(128, 128, 8, 2),
}
PARTIAL_HEAVY_MEMORY_MASK_TABLES = {"sm90": SM90_PARTIAL_HEAVY_MEMORY_MASK}
# The same for a small call (below SMALL_CALL_WORK, where sm90 takes the Triton template):
# its few programs each walk a short row, and 64-row tiles with one loop double the
# programs and drop the two-loop tile's spills; this wins over both tiles above on
# documents and prefix-LM, a third stage by 1-10% more (bench/DECISIONS.md#forward-small-call-memory-mask).
SM90_SMALL_CALL_MEMORY_MASK: dict[tuple[int, str], ForwardConfig] = {
    (128, "16bit"): ForwardConfig(64, 64, 4, 3, one_kv_loop=True),
}
SMALL_CALL_MEMORY_MASK_TABLES = {"sm90": SM90_SMALL_CALL_MEMORY_MASK}
# The same on a partial-heavy BlockMask (table-driven neighbourhoods, text-to-image spans):
# two stages (a third fell off a cliff under ALiBi there), and two loops where the call writes
# the log-sum-exp and its score_mod reads no positions: the one-loop kernel then loses its
# register allocation (bench/DECISIONS.md#forward-small-call-partial-heavy).
SM90_SMALL_CALL_PARTIAL_HEAVY_MEMORY_MASK: dict[tuple[int, str], ForwardConfig] = {
    (128, "16bit"): ForwardConfig(64, 64, 4, 2, one_kv_loop=True),
}
SMALL_CALL_PARTIAL_HEAVY_MEMORY_MASK_TABLES = {"sm90": SM90_SMALL_CALL_PARTIAL_HEAVY_MEMORY_MASK}
# Before both tables above, a small call whose mask_mod gathers at most FEW_KEY_GATHERS
# values a key (document ids, image spans, per-sequence prompt lengths): two loops and three
# stages, the full blocks' loop streaming K and V unhindered; masks gathering more a key
# (offsets of the key's document, row and column tables) lost 20-60% on it
# (bench/DECISIONS.md#forward-small-call-few-key-gathers).
SM90_SMALL_CALL_FEW_KEY_GATHERS: dict[tuple[int, str], ForwardConfig] = {
    (64, "16bit"): ForwardConfig(64, 64, 4, 3),
    (128, "16bit"): ForwardConfig(64, 64, 4, 3),
}
SMALL_CALL_FEW_KEY_GATHERS_TABLES = {"sm90": SM90_SMALL_CALL_FEW_KEY_GATHERS}
FEW_KEY_GATHERS = 1
#: batch x heads x queries x keys x QK head dim below which a call is small for the tables
#: above: the forward's small-call bound (``configs.tma``), the calls these tiles were measured on.
SMALL_CALL_WORK = TMA_MIN_FORWARD_WORK

#: Extra candidates benchmarked under max_autotune (after fitting).
AUTOTUNE_CANDIDATES: tuple[ForwardConfig, ...] = (
    ForwardConfig(128, 64, 8, 3),
    ForwardConfig(128, 128, 4, 3),
    ForwardConfig(128, 128, 8, 3),
    ForwardConfig(128, 64, 4, 3),
    ForwardConfig(128, 64, 8, 2),
    ForwardConfig(128, 32, 4, 3),
    ForwardConfig(64, 128, 4, 3),
    ForwardConfig(64, 64, 4, 3),
    ForwardConfig(64, 64, 4, 4),
    ForwardConfig(64, 32, 4, 3),
)

#: REVERSED_Q_TILES when kernel_options leave it unset (bench/DECISIONS.md#forward-reversed-q-tiles-default).
REVERSED_Q_TILES = False

#: Shared-memory fitting order: fewer stages, then a narrower KV step.
SMEM_STEPS = (("num_stages", 2), ("block_n", 32), ("num_stages", 1), ("block_n", MIN_TILE))


def default_config(device: torch.device, padded_head_dim: int, dtype: torch.dtype,
                   mask_reads_memory: bool = False, partial_heavy: bool = False,
                   work: int | None = None, writes_lse: bool = False,
                   score_reads_positions: bool = False, mask_key_gathers: int | None = None) -> ForwardConfig:
    """The call's default tile; ``mask_reads_memory``: the mask_mod reads captured tensors;
    ``partial_heavy``: the BlockMask lists nearly all blocks partial; ``work``: batch x heads x
    queries x keys x QK head dim (None where a size is symbolic); ``writes_lse``: the kernel
    writes the log-sum-exp; ``score_reads_positions``: the score_mod reads q_idx or kv_idx;
    ``mask_key_gathers``: the mask_mod's reads at key-dependent positions (``subgraph.key_gathers``;
    None: not known)."""
    config = generation_table(TABLES, device, padded_head_dim, dtype)
    if not mask_reads_memory:
        return config
    if work is not None and work < SMALL_CALL_WORK:
        few = (mask_key_gathers is not None and mask_key_gathers <= FEW_KEY_GATHERS
               and table_entry(SMALL_CALL_FEW_KEY_GATHERS_TABLES, device, padded_head_dim, dtype))
        if few:
            return few
        tables = SMALL_CALL_PARTIAL_HEAVY_MEMORY_MASK_TABLES if partial_heavy else SMALL_CALL_MEMORY_MASK_TABLES
        small = table_entry(tables, device, padded_head_dim, dtype)
        if small:
            two_loops = partial_heavy and writes_lse and not score_reads_positions
            return dataclasses.replace(small, one_kv_loop=False) if two_loops else small
    heavy = partial_heavy and table_entry(PARTIAL_HEAVY_MEMORY_MASK_TABLES, device, padded_head_dim, dtype)
    return (heavy or table_entry(MEMORY_MASK_TABLES, device, padded_head_dim, dtype)
            or dataclasses.replace(config, one_kv_loop=False))


def shared_memory_estimate(cfg: ForwardConfig, qk_dim_pad: int, v_dim_pad: int, elem_bytes: int,
                           gathered_bytes: int = 0) -> int:
    """The Q tile plus num_stages buffered K and V tiles, plus the score-shaped gathers
    of the mods (``gathered_bytes`` per element, see ``subgraph.gathered_tile_bytes``)
    buffered for each extra stage (each stage with ONE_KV_LOOP, as Triton 3.6 pipelines
    the branch), plus for float64 the probability tile, which its FMA dot reads from
    shared memory; in bytes."""
    q_tile = cfg.block_m * qk_dim_pad
    kv_stage = cfg.block_n * (qk_dim_pad + v_dim_pad)
    gather_stages = cfg.num_stages if cfg.one_kv_loop else cfg.num_stages - 1
    gathers = gather_stages * cfg.block_m * cfg.block_n * gathered_bytes
    p_tile = cfg.block_m * cfg.block_n if elem_bytes == 8 else 0
    return elem_bytes * (q_tile + cfg.num_stages * kv_stage + p_tile) + gathers


def candidate_configs(device: torch.device, padded_head_dim: int, dtype: torch.dtype, max_autotune: bool,
                      kernel_options: dict[str, Any], mask_reads_memory: bool = False,
                      partial_heavy: bool = False, work: int | None = None, writes_lse: bool = False,
                      score_reads_positions: bool = False, mask_key_gathers: int | None = None) -> list[ForwardConfig]:
    """Default (+ autotune candidates), with pinned fields applied, deduplicated.

    A mask_mod that reads captured tensors takes, in a call of less ``work`` than
    ``SMALL_CALL_WORK``, ``SMALL_CALL_FEW_KEY_GATHERS_TABLES``' tile where it reads at most
    ``FEW_KEY_GATHERS`` values a key, else ``SMALL_CALL_MEMORY_MASK_TABLES``' tile
    (``SMALL_CALL_PARTIAL_HEAVY_MEMORY_MASK_TABLES``' when the BlockMask lists nearly all
    blocks partial, with two loops under ``writes_lse`` unless ``score_reads_positions``); in
    a larger call ``PARTIAL_HEAVY_MEMORY_MASK_TABLES``' when the BlockMask lists nearly all
    blocks partial, else ``MEMORY_MASK_TABLES``' where they have one;
    otherwise it keeps one loop per block group unless ONE_KV_LOOP is pinned: behind
    the one loop's branch its loads are not software-pipelined
    (bench/DECISIONS.md#forward-mask-reads-memory). The autotune candidates are all
    two-loop tiles.
    """
    configs = [default_config(device, padded_head_dim, dtype, mask_reads_memory, partial_heavy, work,
                              writes_lse, score_reads_positions, mask_key_gathers)]
    if max_autotune:
        configs += list(AUTOTUNE_CANDIDATES)
    return with_pinned(configs, ForwardConfig.pinned_fields(kernel_options))


def usable_configs(candidates: list[ForwardConfig], kernel_options: dict[str, Any], *, sparse_q: int,
                   sparse_kv: int, qk_dim_pad: int, v_dim_pad: int, elem_bytes: int, smem_limit: int | None,
                   gathered_bytes: int = 0) -> list[ForwardConfig]:
    """The candidates that satisfy every constraint (tiles dividing the BlockMask's
    blocks, shared memory); a pinned value that breaks one raises ``ConfigError``."""
    pinned = ForwardConfig.pinned_fields(kernel_options)
    check_pinned(pinned, {"block_m": ("BLOCK_M", "Q", sparse_q), "block_n": ("BLOCK_N", "KV", sparse_kv)})
    usable = fit_candidates(
        candidates, block_limits={"block_m": sparse_q, "block_n": sparse_kv},
        estimate=lambda c: shared_memory_estimate(c, qk_dim_pad, v_dim_pad, elem_bytes, gathered_bytes),
        smem_limit=smem_limit, pinned=pinned, steps=SMEM_STEPS)
    if not usable:
        raise no_config_error("forward", candidates, sparse_q=sparse_q, sparse_kv=sparse_kv, qk_dim_pad=qk_dim_pad,
                              v_dim_pad=v_dim_pad, smem_limit=smem_limit)
    return usable

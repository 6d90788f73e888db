"""Tile configurations of the backward kernel: tables, overrides, constraints.

A ``BackwardConfig`` is one launch shape of ``templates/backward.py.jinja``. The kernel
has two kinds of programs, each with its own tiles:

* dK/dV programs own BLOCK_N1 keys and step through the listed query blocks BLOCK_M1
  rows at a time;
* dQ programs own BLOCK_M2 query rows and step through the listed KV blocks BLOCK_N2
  keys at a time.

Which configs are tried for a call: the default for (GPU generation, padded head dim,
dtype width) from ``DEFAULTS``, plus ``AUTOTUNE_CANDIDATES`` under
``torch._inductor.config.max_autotune``. ``kernel_options`` may pin any field:
``bwd_BLOCK_M1``, ``bwd_BLOCK_N1``, ``bwd_BLOCK_M2``, ``bwd_BLOCK_N2``,
``bwd_num_warps``, ``bwd_num_stages`` (the unprefixed ``BLOCK_M1`` ... ``BLOCK_N2``,
``num_warps``, ``num_stages`` pin them too; a ``bwd_`` key wins over its unprefixed
twin). ``usable_configs`` shrinks unpinned tiles to divide the BlockMask's block sizes,
steps configs over the shared-memory limit down (fewer stages, then narrower loop
steps) or drops them, and raises ``ConfigError`` when a pinned
value breaks a constraint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .configs import (MIN_TILE, ConfigError, TileConfig, check_pinned, fit_candidates, gpu_generation,
                      head_dim_bucket, with_pinned)


@dataclass(frozen=True)
class BackwardConfig(TileConfig):
    """One launch configuration of the backward template."""

    block_m1: int
    block_n1: int
    block_m2: int
    block_n2: int
    num_warps: int
    num_stages: int
    #: Walk the partial and the full blocks of each program in one loop (ONE_KV_LOOP in
    #: the template; the dK/dV programs' loop runs over query blocks): the loop body's
    #: registers are allocated once, for a uniform branch per tile. Off in every default:
    #: on sm90 it removes the D=128 spills (ptxas: causal 80 -> 0 bytes with USE_TMA) but
    #: measured slower on an H200 (fwd+bwd bf16, S=8192, 64/64/64/64 w4 s2 with TMA:
    #: causal 352 vs 403 TFLOP/s, causal ALiBi 332 vs 372, GQA 353 vs 387, no mask 421
    #: vs 424; D=64 causal w4 s3 250 vs 309).
    one_kv_loop: bool = False

    OPTION_NAMES: ClassVar[dict[str, str]] = {
        "block_m1": "BLOCK_M1", "block_n1": "BLOCK_N1", "block_m2": "BLOCK_M2", "block_n2": "BLOCK_N2",
        "num_warps": "num_warps", "num_stages": "num_stages", "one_kv_loop": "ONE_KV_LOOP"}
    OPTION_PREFIX: ClassVar[str] = "bwd_"


# Default per (GPU generation, padded QK head dim bucket, dtype width). The dK/dV
# programs keep K, V and two accumulators resident, so their KV tile is the wide one
# (BLOCK_N1) and their query step narrow (BLOCK_M1); the dQ programs mirror that.
# float32 halves the tiles (twice the bytes). "generic" covers the Triton interpreter,
# where bigger tiles mean fewer interpreted steps. sm90 16-bit D=256 was chosen with
# bench/tune_backward.py on an H200 (causal, S=4096, B=2, H=16): 64/64/64/64 with 8 warps
# and 2 stages gave 207 TFLOP/s fwd+bwd, against 92 for the old 32/64/64/32 w4 s1 and
# 154 for torch's flex; 4 warps or 1 stage lost 20-40%. The same sweep at B=4: D=128
# 64/64/64/64 w4 s2 366 TFLOP/s (64/128/128/64 w8 s2: 349; torch 362), D=64
# 64/64/64/64 w4 s3 300 (64/128/128/64 w8 s3: 265; torch 280); 8 warps on 64x64 tiles
# lose half.
DEFAULTS: dict[tuple[str, int, str], BackwardConfig] = {
    ("sm90", 64, "16bit"): BackwardConfig(64, 64, 64, 64, 4, 3),
    ("sm90", 128, "16bit"): BackwardConfig(64, 64, 64, 64, 4, 2),
    ("sm90", 256, "16bit"): BackwardConfig(64, 64, 64, 64, 8, 2),
    ("sm90", 64, "fp32"): BackwardConfig(32, 64, 64, 32, 4, 2),
    ("sm90", 128, "fp32"): BackwardConfig(32, 64, 64, 32, 4, 1),
    ("sm90", 256, "fp32"): BackwardConfig(16, 32, 32, 16, 4, 1),
    ("sm80", 64, "16bit"): BackwardConfig(64, 128, 128, 64, 8, 2),
    ("sm80", 128, "16bit"): BackwardConfig(64, 64, 64, 64, 8, 2),
    ("sm80", 256, "16bit"): BackwardConfig(32, 64, 64, 32, 4, 1),
    ("sm80", 64, "fp32"): BackwardConfig(32, 64, 64, 32, 4, 1),
    ("sm80", 128, "fp32"): BackwardConfig(32, 64, 64, 32, 4, 1),
    ("sm80", 256, "fp32"): BackwardConfig(16, 32, 32, 16, 4, 1),
    ("generic", 64, "16bit"): BackwardConfig(64, 64, 64, 64, 4, 1),
    ("generic", 128, "16bit"): BackwardConfig(32, 64, 64, 32, 4, 1),
    ("generic", 256, "16bit"): BackwardConfig(16, 32, 32, 16, 4, 1),
    ("generic", 64, "fp32"): BackwardConfig(64, 64, 64, 64, 4, 1),
    ("generic", 128, "fp32"): BackwardConfig(32, 64, 64, 32, 4, 1),
    ("generic", 256, "fp32"): BackwardConfig(16, 32, 32, 16, 4, 1),
}

#: (GPU generation, dtype width) pairs whose backward adds dQ with atomics by default
#: (kernel_options DQ_ATOMIC; see backward.use_dq_atomics). None: measured on an H200
#: (bench/tune_backward.py --dq-atomic on, bf16, fwd+bwd TFLOP/s, best tiles of each):
#: D=128 S=8192 no mask 403 with atomics vs 414 with dQ programs, causal 375 vs 382;
#: D=256 causal S=4096 191 vs 220. The five-matmul schedule does not pay for its
#: float32 atomics (and the registers of the dQ share) in these kernels. Those were
#: per-element atomics. The bulk reductions of DQ_ATOMIC with USE_TMA (the default at
#: D=128) did not pay either, in a first short sweep (same GPU, S=8192, fwd+bwd):
#: 64/128/64/64 w8 s2 349 no mask and 342 causal, 64/64/64/64 w8 s2 243 and 231, against
#: 431 and 403 for the default dQ programs (sm90 ptxas: 64/64/64/64 spills 232 bytes with
#: 4 warps, none with 8).
DQ_ATOMIC_GENERATIONS: frozenset[tuple[str, str]] = frozenset()


def dq_atomic_default(device: torch.device, dtype: torch.dtype) -> bool:
    width = "fp32" if dtype in (torch.float32, torch.float64) else "16bit"
    return (gpu_generation(device), width) in DQ_ATOMIC_GENERATIONS


# Extra candidates benchmarked under max_autotune (after filtering).
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


def default_config(device: torch.device, padded_head_dim: int, dtype: torch.dtype) -> BackwardConfig:
    width = "fp32" if dtype in (torch.float32, torch.float64) else "16bit"
    return DEFAULTS[(gpu_generation(device), head_dim_bucket(padded_head_dim), width)]


def pinned_fields(kernel_options: dict[str, Any]) -> dict[str, Any]:
    """The config fields kernel_options pin, keyed by BackwardConfig field name."""
    return BackwardConfig.pinned_fields(kernel_options)


def candidate_configs(device: torch.device, padded_head_dim: int, dtype: torch.dtype,
                      max_autotune: bool, kernel_options: dict[str, Any]) -> list[BackwardConfig]:
    """Default (+ autotune candidates), with pinned fields applied, deduplicated."""
    configs = [default_config(device, padded_head_dim, dtype)]
    if max_autotune:
        configs += list(AUTOTUNE_CANDIDATES)
    return with_pinned(configs, pinned_fields(kernel_options))


def shared_memory_estimate(cfg: BackwardConfig, qk_dim_pad: int, v_dim_pad: int, elem_bytes: int,
                           gathered_bytes: int = 0, staged_dq: bool = False) -> int:
    """Bytes of the larger program kind: its resident tiles plus num_stages buffered
    tiles of the loop operand (Q and dO for dK/dV programs, K and V for dQ programs),
    plus the mods' score-shaped gathers buffered for each extra stage, plus with
    ``staged_dq`` the float32 dQ share that a bulk reduction (DQ_ATOMIC with USE_TMA)
    copies out of shared memory."""
    row = qk_dim_pad + v_dim_pad
    extra = (cfg.num_stages - 1) * gathered_bytes
    dkv = elem_bytes * (cfg.block_n1 * row + cfg.num_stages * cfg.block_m1 * row) + extra * cfg.block_n1 * cfg.block_m1
    if staged_dq:
        dkv += 4 * cfg.block_m1 * qk_dim_pad
    dq = elem_bytes * (cfg.block_m2 * row + cfg.num_stages * cfg.block_n2 * row) + extra * cfg.block_m2 * cfg.block_n2
    return max(dkv, dq)


def _block_limits(sparse_q: int, sparse_kv: int) -> dict[str, int]:
    return {"block_m1": sparse_q, "block_n1": sparse_kv, "block_m2": sparse_q, "block_n2": sparse_kv}


def usable_configs(candidates: list[BackwardConfig], kernel_options: dict[str, Any], *,
                   sparse_q: int, sparse_kv: int, qk_dim_pad: int, v_dim_pad: int,
                   elem_bytes: int, smem_limit: int | None, gathered_bytes: int = 0,
                   staged_dq: bool = False) -> list[BackwardConfig]:
    """The candidates that satisfy every constraint (see the module docstring)."""
    pinned = pinned_fields(kernel_options)
    check_pinned(pinned, {"block_m1": ("BLOCK_M1", "Q", sparse_q), "block_n1": ("BLOCK_N1", "KV", sparse_kv),
                          "block_m2": ("BLOCK_M2", "Q", sparse_q), "block_n2": ("BLOCK_N2", "KV", sparse_kv)},
                 prefix="bwd_")
    usable = fit_candidates(
        candidates, block_limits=_block_limits(sparse_q, sparse_kv),
        estimate=lambda c: shared_memory_estimate(c, qk_dim_pad, v_dim_pad, elem_bytes, gathered_bytes, staged_dq),
        smem_limit=smem_limit, pinned=pinned,
        steps=(("num_stages", 1), ("block_m1", MIN_TILE), ("block_n2", MIN_TILE)))
    if not usable:
        raise ConfigError(
            f"flexattn: no backward tile configuration fits this call (BlockMask block sizes "
            f"Q={sparse_q}, KV={sparse_kv}; padded head dims {qk_dim_pad}/{v_dim_pad}; "
            f"shared memory limit {smem_limit}); candidates were "
            f"{[c.describe() for c in candidates]}. Block sizes must be multiples of {MIN_TILE}.")
    return usable

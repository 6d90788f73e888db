"""Tile configurations of the forward kernel: tables, overrides, constraints.

A ``ForwardConfig`` is one launch shape of ``templates/forward.py.jinja``: the query tile
(BLOCK_M), the KV step (BLOCK_N), warps and software-pipeline stages. Which ones are
tried for a call:

* without ``torch._inductor.config.max_autotune``: the one default for the call's
  (GPU generation, padded head dim, dtype width) from ``DEFAULTS``;
* with it: that default plus ``AUTOTUNE_CANDIDATES``, benchmarked by Inductor.

``kernel_options`` may pin any field (``BLOCK_M``, ``BLOCK_N``, ``num_warps``,
``num_stages``, ``ONE_KV_LOOP``, or their ``fwd_``-prefixed forms); a pinned field
replaces that field in every candidate. ``usable_configs`` then drops candidates that break a constraint (the
BlockMask's block sizes must be multiples of the tiles; the pipelined K/V tiles must fit
in shared memory) and raises when a pinned choice itself breaks one.

The machinery shared with the backward (backward_configs.py) and decode (decode.py)
tables lives here too: ``TileConfig`` (option names, pinning, ``describe``),
``with_pinned``, ``check_pinned``, ``fit_tiles``, ``fit_to_shared_memory`` and
``fit_candidates``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

import torch

MIN_TILE = 16  # tl.dot needs every dimension >= 16


class ConfigError(ValueError):
    """kernel_options pin a tile configuration the call cannot use."""


class TileConfig:
    """What the kernels' frozen config dataclasses (ForwardConfig, BackwardConfig,
    decode's DecodeConfig) share: ``OPTION_NAMES`` maps each field to the kernel_options
    key that pins it, and ``OPTION_PREFIX`` (``fwd_``, ``bwd_``) spells a key that pins
    it for this kernel alone and wins over the unprefixed one."""

    OPTION_NAMES: ClassVar[dict[str, str]] = {}
    OPTION_PREFIX: ClassVar[str] = ""

    def describe(self) -> str:
        """The fields as kernel_options would pin them; a flag only when it is set."""
        parts = []
        for field, option in self.OPTION_NAMES.items():
            value = getattr(self, field)
            if isinstance(value, bool):
                parts += [option] if value else []
            else:
                parts.append(f"{option}={value}")
        return " ".join(parts)

    @classmethod
    def pinned_fields(cls, kernel_options: dict[str, Any]) -> dict[str, Any]:
        """The fields kernel_options pin, keyed by field name (flags as bool, the rest int)."""
        flags = {f.name for f in dataclasses.fields(cls) if f.type in ("bool", bool)}
        pinned: dict[str, Any] = {}
        for field, option in cls.OPTION_NAMES.items():
            spellings = (option, f"{cls.OPTION_PREFIX}{option}") if cls.OPTION_PREFIX else (option,)
            for spelled in spellings:  # the prefixed spelling is read last and wins
                if kernel_options.get(spelled) is not None:
                    value = kernel_options[spelled]
                    pinned[field] = bool(value) if field in flags else int(value)
        return pinned


def with_pinned(configs: Sequence[TileConfig], pinned: dict[str, Any]) -> list:
    """``configs`` with the pinned fields replaced, duplicates dropped (order kept)."""
    out: list = []
    for cfg in configs:
        cfg = dataclasses.replace(cfg, **pinned)
        if cfg not in out:
            out.append(cfg)
    return out


def check_pinned(pinned: dict[str, Any], tile_limits: dict[str, tuple[str, str, int]], prefix: str = "") -> None:
    """Raise ConfigError for a pinned tile that is not a power of two >= MIN_TILE dividing
    its BlockMask block size, or a pinned num_warps / num_stages below 1.
    ``tile_limits``: field -> (its kernel_options name, "Q" or "KV", the block size);
    ``prefix`` is put before the names in the messages."""
    for field, (option, which, limit) in tile_limits.items():
        if field in pinned:
            value = pinned[field]
            if value < MIN_TILE or value & (value - 1) or limit % value:
                raise ConfigError(
                    f"flexattn: kernel_options {prefix}{option}={value} must be a power of two >= {MIN_TILE} "
                    f"that divides the BlockMask's {which}_BLOCK_SIZE={limit}")
    for field in ("num_warps", "num_stages"):
        if field in pinned and pinned[field] < 1:
            raise ConfigError(f"flexattn: kernel_options {prefix}{field}={pinned[field]} must be >= 1")


def fit_tiles(cfg, limits: dict[str, int]):
    """``cfg`` with each tile field in ``limits`` halved until it divides its limit (the
    BlockMask's block size); None when one cannot."""
    fitted = {}
    for field, limit in limits.items():
        value = getattr(cfg, field)
        while value > MIN_TILE and limit % value:
            value //= 2
        if limit % value:
            return None
        fitted[field] = value
    return dataclasses.replace(cfg, **fitted)


def fit_candidates(candidates: Sequence, *, block_limits: dict[str, int],
                   estimate: Callable[[Any], int] | None = None, smem_limit: int | None = None,
                   pinned: dict[str, Any] | None = None, steps=()) -> list:
    """Each candidate fitted to the BlockMask's blocks (``fit_tiles``) and then, given an
    ``estimate``, to shared memory (``fit_to_shared_memory`` with ``steps``); those that
    cannot be dropped, duplicates too."""
    usable: list = []
    for cfg in candidates:
        fitted = fit_tiles(cfg, block_limits)
        if fitted is not None and estimate is not None:
            fitted = fit_to_shared_memory(fitted, estimate, smem_limit, pinned or {}, steps)
        if fitted is not None and fitted not in usable:
            usable.append(fitted)
    return usable


@dataclass(frozen=True)
class ForwardConfig(TileConfig):
    """One launch configuration of the forward template."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    #: Walk the partial and the full KV blocks in one loop (ONE_KV_LOOP in the template)
    #: instead of one loop per list: fewer registers (the loop body is allocated once),
    #: for a branch per tile. Pays where the two-loop kernel spills (D=128 with four
    #: warps on 128-row tiles); elsewhere the two loops measured faster.
    one_kv_loop: bool = False

    OPTION_NAMES: ClassVar[dict[str, str]] = {"block_m": "BLOCK_M", "block_n": "BLOCK_N", "num_warps": "num_warps",
                                              "num_stages": "num_stages", "one_kv_loop": "ONE_KV_LOOP"}
    OPTION_PREFIX: ClassVar[str] = "fwd_"


# Default per (GPU generation, padded QK head dim, dtype width). "sm90" is Hopper and
# newer, "sm80" Ampere/Ada; "generic" is any other device, including CPU tensors run by
# the Triton interpreter (where large tiles simply mean fewer interpreted steps).
# The 16-bit sm90 entries were measured with bench/tune_forward.py on an H200 (bf16,
# S=8192, no mask and causal; TFLOP/s, torch flex's own defaults in brackets):
#   D=64:  128x128 w4 s3: 410 no mask [406], 389 causal [367]
#   D=128: 128x64  w4 s2: 488 no mask [470], 459 causal [411]; w8 s3 gave 447 / 432
#   D=256: 128x64  w8 s2: 456 no mask [377], 454 causal [305]; 64x32 w4 s3 far behind
# With tensor-descriptor loads (USE_TMA) and, at D=128, one loop over both block lists
# (ONE_KV_LOOP; two loops spilled there), same GPU and sweep:
#   D=64:  128x128 w4 s3: 418 no mask [402], 383 causal [372]
#   D=128: 128x64  w4 s2, one loop: 515 no mask [474], 464 causal [408], 400 soft-cap
#          [194]; two loops: 470, 456, 413
#   D=256: 128x64  w8 s2: 528 no mask [374], 532 causal [306]
# Two stages with four warps at D=128 leave each warp 32 query rows and more registers
# for the score tile; at D=256 the 128-row tile needs eight warps to hold its
# accumulator. The sm80 entries are the FlashAttention-2 style tiles (128-row query
# tiles, a 3-stage K/V pipeline, a narrow KV step at D=256), not measured here.
# float32 doubles the bytes per tile, so its tiles are smaller; float64 (a correctness
# mode, no tensor cores) takes the float32 tiles.
DEFAULTS: dict[tuple[str, int, str], ForwardConfig] = {
    ("sm90", 64, "16bit"): ForwardConfig(128, 128, 4, 3),
    ("sm90", 128, "16bit"): ForwardConfig(128, 64, 4, 2, one_kv_loop=True),
    ("sm90", 256, "16bit"): ForwardConfig(128, 64, 8, 2),
    ("sm90", 64, "fp32"): ForwardConfig(128, 32, 4, 3),
    ("sm90", 128, "fp32"): ForwardConfig(32, 64, 4, 3),
    ("sm90", 256, "fp32"): ForwardConfig(32, 32, 4, 3),
    ("sm80", 64, "16bit"): ForwardConfig(128, 64, 4, 3),
    ("sm80", 128, "16bit"): ForwardConfig(128, 64, 8, 3),
    ("sm80", 256, "16bit"): ForwardConfig(32, 64, 4, 3),
    ("sm80", 64, "fp32"): ForwardConfig(128, 32, 4, 3),
    ("sm80", 128, "fp32"): ForwardConfig(128, 32, 4, 3),
    ("sm80", 256, "fp32"): ForwardConfig(64, 16, 4, 3),
    ("generic", 64, "16bit"): ForwardConfig(64, 64, 4, 2),
    ("generic", 128, "16bit"): ForwardConfig(64, 64, 4, 2),
    ("generic", 256, "16bit"): ForwardConfig(32, 32, 4, 2),
    ("generic", 64, "fp32"): ForwardConfig(64, 64, 4, 2),
    ("generic", 128, "fp32"): ForwardConfig(64, 32, 4, 2),
    ("generic", 256, "fp32"): ForwardConfig(32, 32, 4, 2),
}

# Extra candidates benchmarked under max_autotune (after filtering).
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


def gpu_generation(device: torch.device) -> str:
    """The DEFAULTS row for a device: "sm90", "sm80" or "generic"."""
    if device.type != "cuda" or torch.version.hip:
        return "generic"
    major, _ = torch.cuda.get_device_capability(device)
    if major >= 9:
        return "sm90"
    if major == 8:
        return "sm80"
    return "generic"


def head_dim_bucket(padded_head_dim: int) -> int:
    return 64 if padded_head_dim <= 64 else 128 if padded_head_dim <= 128 else 256


#: Where each kernel loads its Q/K/V (and dO) tiles through tensor descriptors unless
#: kernel_options USE_TMA says otherwise: (GPU generation, QK head-dim bucket) pairs, for
#: 16-bit inputs (descriptors need the copy engine of sm90 and later). Measured on an
#: H200, bf16, same tiles with and without (bench/tune_forward.py, tune_backward.py):
#:   forward D=256 528 vs 457 TFLOP/s no mask, 532 vs 464 causal; D=128 and D=64 within
#:   3% either way, the one-loop D=128 default gaining (515 vs 470).
#:   backward (fwd+bwd, S=8192) D=128 no mask 424 vs 399, causal 403 vs 372, causal ALiBi
#:   372 vs 348, GQA 32/8 387 vs 377; but D=64 causal 295 vs 309 and D=256 causal 220
#:   vs 223, so there the backward keeps pointer loads.
#:   decode (bench/tune_decode.py, CUDA-graph us, one token, 32 on 8 heads, D=128):
#:   slower at every point, B=1 KV 8192 12.5 vs 11.7, 32768 39.4 vs 38.4, B=8 8192 75.0
#:   vs 71.2, 32768 251.8 vs 252.9 (tie), so its descriptor path is taken on request only.
TMA_DEFAULTS: dict[str, frozenset[tuple[str, int]]] = {
    "forward": frozenset({("sm90", 64), ("sm90", 128), ("sm90", 256)}),
    "backward": frozenset({("sm90", 128)}),
}


def tma_by_default(kernel: str, device: torch.device, padded_head_dim: int, dtype: torch.dtype) -> bool:
    """Whether ``kernel`` uses tensor descriptors when USE_TMA is not given."""
    if dtype not in (torch.float16, torch.bfloat16):
        return False
    key = (gpu_generation(device), head_dim_bucket(padded_head_dim))
    return key in TMA_DEFAULTS.get(kernel, frozenset())


def default_config(device: torch.device, padded_head_dim: int, dtype: torch.dtype) -> ForwardConfig:
    width = "fp32" if dtype in (torch.float32, torch.float64) else "16bit"
    return DEFAULTS[(gpu_generation(device), head_dim_bucket(padded_head_dim), width)]


def shared_memory_limit(device: torch.device) -> int | None:
    """Bytes of shared memory one program may use, or None where it is not known."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", None) or None


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


def fit_to_shared_memory(cfg, estimate, limit: int | None, pinned: dict[str, int], steps):
    """Step ``cfg`` down until ``estimate(cfg) <= limit``: each of ``steps`` (field,
    floor) in turn, fields the user pinned excepted; num_stages drops by one, tiles
    halve. None when nothing fits. Used by the forward and the backward tables."""
    if limit is None:
        return cfg
    for field, floor in steps:
        while estimate(cfg) > limit and field not in pinned and getattr(cfg, field) > floor:
            value = getattr(cfg, field)
            cfg = dataclasses.replace(cfg, **{field: value - 1 if field == "num_stages" else value // 2})
    return cfg if estimate(cfg) <= limit else None


def pinned_fields(kernel_options: dict[str, Any]) -> dict[str, Any]:
    """The config fields kernel_options pin, keyed by ForwardConfig field name."""
    return ForwardConfig.pinned_fields(kernel_options)


def candidate_configs(
    device: torch.device,
    padded_head_dim: int,
    dtype: torch.dtype,
    max_autotune: bool,
    kernel_options: dict[str, Any],
    mask_reads_memory: bool = False,
) -> list[ForwardConfig]:
    """Default (+ autotune candidates), with pinned fields applied, deduplicated.

    A mask_mod that reads captured tensors (document ids, say) keeps one loop per block
    group unless ONE_KV_LOOP is pinned: behind the one loop's branch its loads are not
    software-pipelined (document mask, H200, D=128: 194 vs 335 TFLOP/s for torch flex).
    """
    configs = [default_config(device, padded_head_dim, dtype)]
    if max_autotune:
        configs += list(AUTOTUNE_CANDIDATES)
    if mask_reads_memory:
        configs = [dataclasses.replace(cfg, one_kv_loop=False) for cfg in configs]
    return with_pinned(configs, pinned_fields(kernel_options))


def usable_configs(
    candidates: list[ForwardConfig],
    kernel_options: dict[str, Any],
    *,
    sparse_q: int,
    sparse_kv: int,
    qk_dim_pad: int,
    v_dim_pad: int,
    elem_bytes: int,
    smem_limit: int | None,
    gathered_bytes: int = 0,
) -> list[ForwardConfig]:
    """The candidates that satisfy every constraint.

    Unpinned tiles that do not divide the BlockMask's block sizes are shrunk to fit;
    configs over the shared-memory limit get fewer stages, then a narrower BLOCK_N
    (unless pinned), and are dropped if that is not enough. A pinned tile or stage count
    that breaks a constraint raises ``ConfigError``.
    """
    pinned = pinned_fields(kernel_options)
    check_pinned(pinned, {"block_m": ("BLOCK_M", "Q", sparse_q), "block_n": ("BLOCK_N", "KV", sparse_kv)})
    usable = fit_candidates(
        candidates, block_limits={"block_m": sparse_q, "block_n": sparse_kv},
        estimate=lambda c: shared_memory_estimate(c, qk_dim_pad, v_dim_pad, elem_bytes, gathered_bytes),
        smem_limit=smem_limit, pinned=pinned,
        steps=(("num_stages", 2), ("block_n", 32), ("num_stages", 1), ("block_n", MIN_TILE)))
    if not usable:
        raise ConfigError(
            f"flexattn: no forward tile configuration fits this call (BlockMask block sizes "
            f"Q={sparse_q}, KV={sparse_kv}; padded head dims {qk_dim_pad}/{v_dim_pad}; "
            f"shared memory limit {smem_limit}); candidates were "
            f"{[c.describe() for c in candidates]}. Block sizes must be multiples of {MIN_TILE}."
        )
    return usable

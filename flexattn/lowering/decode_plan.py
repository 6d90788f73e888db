"""The decode kernel's host-side plan, as a pure function: ``plan_decode(DecodeInputs)``.

Every choice is made from sizes (hints when symbolic: a choice only affects speed, every
choice is correct for every size), the device's facts and kernel_options; nothing here
reads Inductor IR, so the plan is unit-testable without compiling. ``lowering/decode.py``
turns a plan into IR.

* the kernel (``wants_decode_kernel``): decode when ``L <= DECODE_MAX_Q_LEN`` and
  ``S >= DECODE_MIN_KV_LEN``; FORCE_DECODE forces it either way, as torch's BACKEND
  (TRITON_DECODE, TRITON) does; torch's FORCE_USE_FLEX_ATTENTION=True means the main
  kernel;
* the packing (``packing``): HEADS_PER_TILE query heads x BLOCK_Q positions per tile, at
  most ``MAX_TILE_ROWS`` rows; heads are packed only when the BlockMask is the same for
  every head (a tile walks one BlockMask row);
* the split (``split_count``): tiles against multiprocessors and the *wave*
  (``RESIDENT_PROGRAMS_PER_SM`` programs per multiprocessor); SPLIT_KV pins it;
* the indices read per register chunk (``list_chunk_size``); LIST_CHUNK pins it;
* the KV step (``DecodeConfig``): the table's, widened for latency-bound calls
  (``widen_for_latency``) or streamed in long unsplit rows (``stream_step``), fitted to
  shared memory; BLOCK_N, num_warps, num_stages pin it;
* the merge (``fused_merge``): FUSED_MERGE, one launch or a second merge pass.

Measurements behind each constant: bench/DECISIONS.md (``decode-<constant>`` rows).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

import torch

from .. import options as _options
from .configs import decode as decode_configs
from .configs.base import MIN_TILE, head_dim_bucket
from .configs.decode import STREAM_CONFIG, DecodeConfig

#: Automatic choice: the decode kernel for queries at most this long ...
DECODE_MAX_Q_LEN = 64
#: ... against at least this many keys (below it both kernels are a few tiles of work).
DECODE_MIN_KV_LEN = 256
#: Rows of a packed tile (HEADS_PER_TILE * BLOCK_Q): bounds the accumulator's registers.
MAX_TILE_ROWS = 64
#: Programs wanted per multiprocessor (bench/DECISIONS.md#decode-programs-per-sm).
PROGRAMS_PER_SM = 1
#: Splits at least, when a row has the steps (bench/DECISIONS.md#decode-min-split-kv).
MIN_SPLIT_KV = 4
#: Decode programs resident at once on one multiprocessor; ``sms`` times this is a wave
#: (bench/DECISIONS.md#decode-resident-programs-per-sm).
RESIDENT_PROGRAMS_PER_SM = 3
#: Tiles beyond one wave are split into at least this many waves, so the last, partly
#: filled wave is a small part of the time (bench/DECISIONS.md#decode-min-waves).
MIN_WAVES = 4
#: KV step of a latency-bound call: wider steps put more bytes in flight per program
#: (bench/DECISIONS.md#decode-latency-block-n).
LATENCY_BLOCK_N = 128
#: Unsplit default-mask rows of at least this many keys stream in STREAM_CONFIG's steps
#: on sm90 (bench/DECISIONS.md#decode-stream-keys).
STREAM_KEYS = 16384
#: A share of a row's KV steps is at least this many BLOCK_N steps (when the row has them).
MIN_STEPS_PER_SPLIT = 2
#: Upper bound of SPLIT_KV (the partial results grow with it).
MAX_SPLIT_KV = 256
#: Block indices read per register chunk (bench/DECISIONS.md#decode-list-chunk-default).
LIST_CHUNK_DEFAULT = 16
#: Rows merged per program in the second pass (at most; fewer for shorter queries).
MERGE_ROWS = 16
#: FUSED_MERGE when kernel_options leave it unset (bench/DECISIONS.md#decode-fused-merge-default).
FUSED_MERGE_DEFAULT = False


class DecodeOptionError(ValueError):
    """kernel_options ask for something the decode kernel cannot do."""


def power_of_two_at_most(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def wants_decode_kernel(q_len: int, kv_len: int, kernel_options: Mapping[str, Any]) -> bool:
    """Whether a call with these (hinted) lengths runs the split-KV decode kernel."""
    forced = _options.read(kernel_options, "FORCE_DECODE")
    main_forced = bool(_options.read(kernel_options, "FORCE_USE_FLEX_ATTENTION"))
    if forced is not None and bool(forced) and main_forced:
        raise DecodeOptionError(
            "flexattn: kernel_options FORCE_DECODE=True and FORCE_USE_FLEX_ATTENTION=True "
            "contradict each other; pass one of them")
    backend = _options.read(kernel_options, "BACKEND")
    if main_forced or backend in ("TRITON", "GLUON"):
        return False
    if forced is not None:
        return bool(forced)
    if backend == "TRITON_DECODE":
        return True
    return q_len <= DECODE_MAX_Q_LEN and kv_len >= DECODE_MIN_KV_LEN


@dataclass(frozen=True)
class Packing:
    """How query rows fill a tile: HEADS_PER_TILE heads x BLOCK_Q positions in BLOCK_M rows."""

    heads_per_tile: int
    block_q: int
    block_m: int


def packing(group: int, q_len_hint: int, sparse_q: int, mask_varies_over_heads: bool) -> Packing:
    """The packing for a GQA group of ``group`` query heads and queries of ~q_len_hint rows.

    Heads first (each packed head saves a read of K/V), then as many query positions as
    fit in MAX_TILE_ROWS; BLOCK_Q is a power of two dividing the BlockMask's Q block.
    """
    if mask_varies_over_heads:
        heads = 1
    else:
        heads = max(d for d in range(1, group + 1) if group % d == 0 and d <= MAX_TILE_ROWS)
    block_q = min(next_power_of_two(q_len_hint), power_of_two_at_most(MAX_TILE_ROWS // heads))
    while sparse_q % block_q:
        block_q //= 2
    block_m = max(MIN_TILE, next_power_of_two(heads * block_q))
    return Packing(heads, block_q, block_m)


def _pinned_int(kernel_options: Mapping[str, Any], name: str, valid, expected: str) -> int | None:
    pinned = _options.read(kernel_options, name)
    if pinned is not None and (not isinstance(pinned, int) or isinstance(pinned, bool) or not valid(pinned)):
        raise DecodeOptionError(f"flexattn: kernel_options {name} must be {expected}, got {pinned!r}")
    return pinned


def split_count(*, sms: int, programs: int, max_steps: int, kernel_options: Mapping[str, Any],
                max_blocks: int | None = None) -> int:
    """SPLIT_KV for ``programs`` tiles on ``sms`` multiprocessors (a wave: sms *
    RESIDENT_PROGRAMS_PER_SM programs at once):

    * fewer tiles than multiprocessors: PROGRAMS_PER_SM programs per multiprocessor and at
      least MIN_SPLIT_KV splits, but no more programs than a wave;
    * at least one tile per multiprocessor, within one wave: 1 (no split);
    * more tiles than a wave: enough splits for MIN_WAVES waves, rounded up to a power of
      two (bench/DECISIONS.md#decode-split-power-of-two);

    each split keeping at least MIN_STEPS_PER_SPLIT steps of a dense row (of max_steps)
    and, where shares take whole blocks (every call with BlockMask lists), at least one
    of its max_blocks blocks; at most MAX_SPLIT_KV; pinned by kernel_options["SPLIT_KV"].
    No exception for long rows (bench/DECISIONS.md#decode-long-row-rule)."""
    pinned = _pinned_int(kernel_options, "SPLIT_KV", lambda v: 1 <= v <= MAX_SPLIT_KV,
                         f"an int in [1, {MAX_SPLIT_KV}]")
    if pinned is not None:
        return pinned
    programs = max(programs, 1)
    wave = sms * RESIDENT_PROGRAMS_PER_SM
    if programs > wave:
        wanted = next_power_of_two(math.ceil(MIN_WAVES * wave / programs))
    elif programs >= sms:
        # The tiles alone fill the GPU in one wave: a split would only add partials, a
        # merge and a second wave.
        return 1
    else:
        # Rounded down: one program past a whole number per SM is a second round.
        wanted = min(max(PROGRAMS_PER_SM * sms // programs, MIN_SPLIT_KV), max(wave // programs, 1))
    useful = math.ceil(max_steps / MIN_STEPS_PER_SPLIT)
    if max_blocks is not None:
        useful = min(useful, max_blocks)
    return max(1, min(wanted, useful, MAX_SPLIT_KV))


def list_chunk_size(blocks_per_share: int, kernel_options: Mapping[str, Any]) -> int:
    """LIST_CHUNK: kernel_options["LIST_CHUNK"] (a power of two >= 2), else
    LIST_CHUNK_DEFAULT, or the power of two that holds a share's ``blocks_per_share``
    blocks (at least 2) when that is smaller."""
    pinned = _pinned_int(kernel_options, "LIST_CHUNK", lambda v: v >= 2 and not v & (v - 1),
                         "a power of two >= 2")
    if pinned is not None:
        return pinned
    return max(2, min(LIST_CHUNK_DEFAULT, next_power_of_two(blocks_per_share)))


def fused_merge(kernel_options: Mapping[str, Any]) -> bool:
    """kernel_options["FUSED_MERGE"] (a bool), FUSED_MERGE_DEFAULT when absent."""
    value = _options.read(kernel_options, "FUSED_MERGE", FUSED_MERGE_DEFAULT)
    if not isinstance(value, bool):
        raise DecodeOptionError(f"flexattn: kernel_options FUSED_MERGE must be True or False, got {value!r}")
    return value


def widen_for_latency(usable: list[DecodeConfig], programs: int, sms: int, keys_per_split: int, dtype,
                      sparse_kv: int, kernel_options: Mapping[str, Any]) -> list[DecodeConfig]:
    """The configs with BLOCK_N widened to LATENCY_BLOCK_N when the call is latency-bound
    (``programs`` <= ``sms``), 16-bit, BLOCK_N is not pinned, LATENCY_BLOCK_N divides the
    BlockMask's KV block and each split keeps MIN_STEPS_PER_SPLIT steps of it."""
    if ("block_n" in DecodeConfig.pinned_fields(kernel_options) or programs > sms
            or dtype not in (torch.float16, torch.bfloat16) or sparse_kv % LATENCY_BLOCK_N
            or keys_per_split < MIN_STEPS_PER_SPLIT * LATENCY_BLOCK_N):
        return usable
    widened: list[DecodeConfig] = []
    for cfg in usable:
        cfg = dataclasses.replace(cfg, block_n=max(cfg.block_n, LATENCY_BLOCK_N))
        if cfg not in widened:
            widened.append(cfg)
    return widened


def stream_step(usable: list[DecodeConfig], *, generation: str, tiles: int, sms: int, split_kv: int,
                dense_keys: int | None, dtype, qk_dim_pad: int, sparse_kv: int,
                kernel_options: Mapping[str, Any]) -> list[DecodeConfig]:
    """STREAM_CONFIG first, in place of the table's default, when the call streams long
    rows unsplit: sm90, 16-bit, the QK head dim in the table's 128 row, the default mask
    over at least STREAM_KEYS keys (``dense_keys``), one share per tile (``split_kv`` 1)
    and more tiles than multiprocessors (fewer or as many are widen_for_latency's),
    STREAM_CONFIG's step dividing the BlockMask's KV block, and no BLOCK_N, num_warps or
    num_stages pinned. Under autotuning (more than one config) the others stay
    candidates, the default among them; otherwise the configs are returned unchanged."""
    streams = (not DecodeConfig.pinned_fields(kernel_options)
               and generation == "sm90"
               and dtype in (torch.float16, torch.bfloat16)
               and head_dim_bucket(qk_dim_pad) == 128
               and dense_keys is not None and dense_keys >= STREAM_KEYS
               and split_kv == 1
               and tiles > sms
               and sparse_kv % STREAM_CONFIG.block_n == 0)
    if not streams:
        return usable
    candidates = usable if len(usable) > 1 else []
    return [STREAM_CONFIG, *(cfg for cfg in candidates if cfg != STREAM_CONFIG)]


@dataclass(frozen=True)
class DecodeInputs:
    """What the plan is computed from (sizes are hints where symbolic)."""

    batch: int
    q_heads: int
    q_len: int
    kv_len: int
    gqa_group: int
    qk_dim_pad: int
    v_dim_pad: int
    dtype: torch.dtype
    generation: str
    sms: int
    smem_limit: int | None
    sparse_q: int
    sparse_kv: int
    #: A BlockMask head dimension above 1: the mask may differ per head.
    mask_varies_over_heads: bool
    #: flex_attention's own default mask: no tables, every KV position in order.
    dense_kv: bool
    #: The widest BlockMask index row (None with dense_kv): a row lists at most that many blocks.
    row_width: int | None
    max_autotune: bool
    kernel_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernel_options", MappingProxyType(dict(self.kernel_options)))


@dataclass(frozen=True)
class DecodePlan:
    packing: Packing
    head_tiles: int
    #: Programs before the split: batch x head tiles x query tiles.
    tiles: int
    split_kv: int
    list_chunk: int
    configs: tuple[DecodeConfig, ...]
    #: One launch (the last program of a tile merges) or a second merge pass.
    fused_merge: bool

    @property
    def split_kv_pad(self) -> int:
        return next_power_of_two(self.split_kv)


def plan_decode(inputs: DecodeInputs) -> DecodePlan:
    """The decode kernel's packing, split, list chunk, configurations and merge."""
    options = inputs.kernel_options
    pack = packing(inputs.gqa_group, inputs.q_len, inputs.sparse_q, inputs.mask_varies_over_heads)
    head_tiles = inputs.q_heads // pack.heads_per_tile
    elem_bytes = inputs.dtype.itemsize

    def fitted(configs):
        return decode_configs.usable_configs(
            configs, options, sparse_kv=inputs.sparse_kv, block_m=pack.block_m, qk_dim_pad=inputs.qk_dim_pad,
            v_dim_pad=inputs.v_dim_pad, elem_bytes=elem_bytes, smem_limit=inputs.smem_limit)

    usable = fitted(decode_configs.candidate_configs(inputs.generation, inputs.qk_dim_pad, inputs.dtype,
                                                     inputs.max_autotune, options))
    # One SPLIT_KV for all configs (it shapes the partial buffers), sized for the
    # smallest KV step among them.
    smallest_step = min(cfg.block_n for cfg in usable)
    tiles = inputs.batch * head_tiles * math.ceil(inputs.q_len / pack.block_q)
    max_blocks = math.ceil(inputs.kv_len / inputs.sparse_kv)
    if not inputs.dense_kv:
        max_blocks = min(max_blocks, inputs.row_width)
    split_kv = split_count(sms=inputs.sms, programs=tiles, max_steps=math.ceil(inputs.kv_len / smallest_step),
                           kernel_options=options, max_blocks=None if inputs.dense_kv else max_blocks)
    usable = widen_for_latency(usable, tiles * split_kv, inputs.sms, inputs.kv_len // split_kv, inputs.dtype,
                               inputs.sparse_kv, options)
    usable = stream_step(usable, generation=inputs.generation, tiles=tiles, sms=inputs.sms, split_kv=split_kv,
                         dense_keys=inputs.kv_len if inputs.dense_kv else None, dtype=inputs.dtype,
                         qk_dim_pad=inputs.qk_dim_pad, sparse_kv=inputs.sparse_kv, kernel_options=options)
    return DecodePlan(
        packing=pack, head_tiles=head_tiles, tiles=tiles, split_kv=split_kv,
        list_chunk=list_chunk_size(math.ceil(max_blocks / split_kv), options),
        configs=tuple(fitted(usable)),
        # A single share needs no merge.
        fused_merge=split_kv == 1 or fused_merge(options),
    )

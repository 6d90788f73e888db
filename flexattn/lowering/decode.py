"""Inductor lowering of ``flex_attention_hop`` onto the split-KV decode kernel.

For short queries (decoding: a few new tokens against a long KV cache) the forward
lowering hands the call here (``use_decode_kernel``). ``templates/decode.py.jinja`` packs
the query heads of one GQA group into one tile of rows and shares the KV steps the
BlockMask lists for the tile among ``SPLIT_KV`` programs; each ends with an unnormalised
partial result (acc, running max, running sum). The shares are merged (rescaled to a
common max, normalised; out, lse and max written) in one of two ways,
``kernel_options["FUSED_MERGE"]`` (default ``FUSED_MERGE_DEFAULT``, False):

* True, one launch: the last program of a tile to finish merges the tile's partials
  itself; it learns that it is last from a per-tile counter (an atomic add) in an
  int32 workspace that Inductor zeroes once per compiled-graph call, shared by every
  decode kernel of the graph (``COUNTERS_WORKSPACE``; each kernel leaves it zero). A tile
  whose steps fit in one share, and every tile with ``SPLIT_KV == 1``, is finished by
  that one program without partials or counter;
* False, two launches: every program writes its partials in float32 and
  ``templates/decode_merge.py.jinja`` merges them, one program per few query rows.

The merge arithmetic is the pair of helpers at the end of decode_merge.py.jinja, used by
both ways.

Choices made here on the host, from static shapes (size hints when symbolic: a choice
only affects speed, every choice is correct for every size):

* the kernel: decode when ``L <= DECODE_MAX_Q_LEN`` and ``S >= DECODE_MIN_KV_LEN``;
  ``kernel_options["FORCE_DECODE"]`` True / False forces it either way, and torch's
  ``FORCE_USE_FLEX_ATTENTION=True`` means the main kernel;
* the packing (``packing``): HEADS_PER_TILE query heads x BLOCK_Q query positions per
  tile, at most ``MAX_TILE_ROWS`` rows. Heads are packed only when the BlockMask is the
  same for every head (its head dimension is 1): a tile walks one BlockMask row;
* the number of splits (``split_count``), from the tiles against the multiprocessors
  and the *wave* (``RESIDENT_PROGRAMS_PER_SM`` programs per multiprocessor): fewer
  tiles than multiprocessors split into ``PROGRAMS_PER_SM`` programs per multiprocessor,
  at least ``MIN_SPLIT_KV`` splits, at most one wave; tiles that fill the
  multiprocessors within one wave do not split; more tiles than a wave split into
  ``MIN_WAVES`` waves. At most one split per ``MIN_STEPS_PER_SPLIT`` KV steps of a
  dense row and, with BlockMask lists (whose shares take every SPLIT_KV-th block, see
  decode.py.jinja), one per KV block; at most ``MAX_SPLIT_KV``;
  ``kernel_options["SPLIT_KV"]`` pins it;
* the block indices a program reads per register chunk (``list_chunk_size``):
  ``LIST_CHUNK_DEFAULT``, or fewer when a share has fewer blocks;
  ``kernel_options["LIST_CHUNK"]`` pins it;
* the KV step (``DecodeConfig``): BLOCK_N, warps and stages from ``DEFAULTS`` (plus
  ``AUTOTUNE_CANDIDATES`` under max_autotune), widened to ``LATENCY_BLOCK_N`` for 16-bit
  calls with no more programs than multiprocessors, or ``STREAM_CONFIG`` (128-key steps
  2 deep) for long unsplit default-mask rows on sm90 (``stream_step``);
  ``kernel_options`` ``BLOCK_N``, ``num_warps`` and ``num_stages`` (the keys the forward
  kernel reads too) pin them. ``BLOCK_M`` and the ``fwd_*`` keys tile the main kernel
  only: the decode tile's rows follow from the packing;
* the merge (``fused_merge``): ``kernel_options["FUSED_MERGE"]`` as above;
* DENSE_KV: when flex_attention built the default mask itself (``block_mask=None``;
  ``block_mask.DEFAULT_MASK_KEY`` in kernel_options), the kernel takes no BlockMask
  tables and walks every KV position in order: no table loads in the loop, and no
  kernel in the compiled graph to compute the tables (a decode step is a few
  microseconds; that kernel and its launch were about one of them).

The chosen configuration is logged on the ``flexattn.lowering`` logger like the
forward's (at INFO; WARNING with DEBUG_CONFIG).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import sympy
import torch
from torch._inductor import config as inductor_config
from torch._inductor import ir
from torch._inductor.lowering import empty_strided
from torch._inductor.select_algorithm import SymbolicGridFn, TritonTemplate
from torch._inductor.virtualized import V
from torch.utils._sympy.functions import FloorDiv

from .. import _compat
from ..templates import kernel_source, read_template
from . import configs as cfgs
from .forward import (
    _benchmark_block_counts,
    _benchmark_block_indices,
    _benchmark_full_block_indices,
    REPORTED_SPECIALISATIONS,
    forward_specialisations,
    output_layout,
    prepare_call,
    realize_fixed,
    report_choice,
    template_choices,
)

log = logging.getLogger("flexattn.lowering")

DECODE_TEMPLATE_NAME = "flexattn_decode"
MERGE_TEMPLATE_NAME = "flexattn_decode_merge"

#: Automatic choice: the decode kernel for queries at most this long ...
DECODE_MAX_Q_LEN = 64
#: ... against at least this many keys (below it both kernels are a few tiles of work).
DECODE_MIN_KV_LEN = 256
#: Rows of a packed tile (HEADS_PER_TILE * BLOCK_Q): bounds the accumulator's registers.
MAX_TILE_ROWS = 64
#: Programs wanted per multiprocessor (H200 sweep, bench/tune_decode.py: at B=1 one
#: program per SM, 16 splits of 8 KV heads, took 13.3 us at KV 8k where 4 per SM took 18).
PROGRAMS_PER_SM = 1
#: Splits at least, when a row has the steps. H200, B=8 (64 tiles), KV 8k / 32k, BLOCK_N
#: 64, CUDA-graph us (bench/tune_decode.py): 4 splits 64.9 / 238.4, 8 splits 65.0 / 238.5
#: (2 stages), 16 splits 68.6 / 267.5, against SDPA's 64.8 / 237.9, once the default
#: mask's walk read no tables (DENSE_KV); with the tables 16 had beaten 2-3 (73.9 vs 75.7
#: us at 8k, 253 vs 263 at 32k).
MIN_SPLIT_KV = 4
#: Decode programs resident at once on one multiprocessor (shared memory allows about
#: three of the D=128 default, 64-column steps 3 deep); ``sms`` times this is a *wave*.
#: Inferred from H200 sweeps at KV 8k (bench/tune_decode.py, CUDA-graph us, SDPA
#: beside): 256 programs (under a wave) ran level with SDPA whatever the split (B=8 x 4,
#: B=16 x 2: 125.8 vs 123.3, B=32 x 1: 242.4 vs 240.3), 512 (1.3 waves) 12-15% behind it
#: whatever the split (B=16 x 4, B=32 x 2, B=64 x 1: 553 vs 484), 2048 (B=64 x 4) level.
RESIDENT_PROGRAMS_PER_SM = 3
#: Tiles beyond one wave are split into at least this many waves of programs, so that the
#: last, partly filled wave is a small part of the time (B=64, 512 tiles: 4 splits 487 us,
#: 2 splits 502, none 553; SDPA 484).
MIN_WAVES = 4
#: KV step of a latency-bound call (no more programs than multiprocessors): wider steps
#: put more bytes in flight per program (B=1 KV 32k: 40 us with 128, 49 with 64).
LATENCY_BLOCK_N = 128
#: An unsplit default-mask call (one program per tile, more tiles than multiprocessors)
#: over rows of at least this many keys streams them in STREAM_CONFIG's steps on sm90, in
#: place of the table's default: 128-key steps 2 deep (one program per multiprocessor at
#: D=128, each asking for 64 KB of contiguous K and V rows per step). H200,
#: bench/ab_decode.py, five CUDA-graph timings in turn, median us, default (64, 4, 3) /
#: STREAM_CONFIG / SDPA: B=32 KV 16k 479.1 / 476.9 / 476.2, 32k 954.9 / 946.3 / 951.5,
#: B=24 32k 729.6 / 727.3 / 766.8, B=40 32k 1277.2 / 1257.5 / 1355.6. At KV 8k other
#: 128-key steps were 0.25-1% slower than the default (B=32: 8 warps 2 deep 243.9 against
#: 241.6, 4 warps 3 deep 236.5 against 235.9, on two machines; STREAM_CONFIG itself was not
#: timed there), so the rule starts at 16k, where its gain (0.46%) is about the spread of
#: one case's rounds (0.1-0.5%).
STREAM_KEYS = 16384
#: A share of a row's KV steps is at least this many BLOCK_N steps (when the row has them).
MIN_STEPS_PER_SPLIT = 2
#: Upper bound of SPLIT_KV (the partial results grow with it).
MAX_SPLIT_KV = 256
#: Block indices a program of a call with BlockMask lists reads per register chunk
#: (LIST_CHUNK in decode.py.jinja; fewer when no share has that many blocks). Kernel
#: times on an H200 (bench/profile_decode.py --paged, 32 query heads on 8 KV heads,
#: D=128, bf16, us), paged cache without a mask at B=1 KV 2k / 8k / 32k: 4.2 / 8.2 / 34.5
#: with chunks of 16, 4.4 / 8.3 / 34.2 with 64, 4.6 / 8.6 / 36.4 with an index load per
#: step (the contiguous default mask: 4.1 / 7.6 / 33.4); B=32 KV 32k 955.0 / 958.9 /
#: 955.8; sliding window 1024 at B=8 KV 8k, contiguous cache: 8.3 / 8.4 / 9.2.
LIST_CHUNK_DEFAULT = 16
#: Multiprocessors assumed where the device has none to ask (CPU tensors in the Triton
#: interpreter): small, so that interpreted calls stay cheap, yet above the tile count of
#: small test shapes (a few batches x KV heads), so that those split as on a GPU, while
#: calls with at least this many tiles take the unsplit path.
VIRTUAL_SMS = 8
#: Rows merged per program in the second pass (at most; fewer for shorter queries).
MERGE_ROWS = 16
#: FUSED_MERGE when kernel_options does not set it: the two-launch merge. Measured on an
#: H200 (bf16, 32 query heads on 8 KV heads, D=128, CUDA-graph times, SDPA beside):
#: B=1 KV 8192 16.4 us fused vs 11.8 us two launches (SDPA 10.7); KV 32768 42.6 vs 38.5
#: (37.2); B=8 KV 8192 79.9 vs 71.4 (65.9); KV 32768 260.7 vs 253.1 (238.4). The zeroing
#: of the counters is a launch of its own in a one-call graph, and the release/acquire
#: tail of every program costs more than the merge kernel saves.
FUSED_MERGE_DEFAULT = False
#: Name of the tile-counter workspace of the one-launch merge (per device; one buffer for
#: every decode kernel of a compiled graph) and its name inside the kernel.
COUNTERS_WORKSPACE = "flexattn_decode_counters"
COUNTERS_ARG = "TILE_COUNTERS"
#: decode_merge.py.jinja from this line on holds the merge helpers that the decode
#: kernel shares.
MERGE_HELPERS_MARK = "{#- ---- merge helpers"


@dataclass(frozen=True)
class DecodeConfig(cfgs.TileConfig):
    """One launch configuration of the decode template (the row tile is fixed per call)."""

    block_n: int
    num_warps: int
    num_stages: int

    OPTION_NAMES: ClassVar[dict[str, str]] = {"block_n": "BLOCK_N", "num_warps": "num_warps",
                                              "num_stages": "num_stages"}


# Default per (GPU generation, padded QK head dim, dtype width), as in configs.DEFAULTS.
# A decode tile has few rows, so a program is bound by its K/V loads: 64-column steps
# with a 3-4 deep pipeline keep enough bytes in flight on Ampere/Hopper; float32 and
# D=256 halve the step to stay within shared memory.
DEFAULTS: dict[tuple[str, int, str], DecodeConfig] = {
    ("sm90", 64, "16bit"): DecodeConfig(64, 4, 4),
    ("sm90", 128, "16bit"): DecodeConfig(64, 4, 3),
    ("sm90", 256, "16bit"): DecodeConfig(32, 4, 3),
    ("sm90", 64, "fp32"): DecodeConfig(64, 4, 3),
    ("sm90", 128, "fp32"): DecodeConfig(32, 4, 3),
    ("sm90", 256, "fp32"): DecodeConfig(16, 4, 3),
    ("sm80", 64, "16bit"): DecodeConfig(64, 4, 3),
    ("sm80", 128, "16bit"): DecodeConfig(64, 4, 3),
    ("sm80", 256, "16bit"): DecodeConfig(32, 4, 2),
    ("sm80", 64, "fp32"): DecodeConfig(32, 4, 3),
    ("sm80", 128, "fp32"): DecodeConfig(32, 4, 2),
    ("sm80", 256, "fp32"): DecodeConfig(16, 4, 2),
    ("generic", 64, "16bit"): DecodeConfig(64, 4, 2),
    ("generic", 128, "16bit"): DecodeConfig(64, 4, 2),
    ("generic", 256, "16bit"): DecodeConfig(32, 4, 2),
    ("generic", 64, "fp32"): DecodeConfig(64, 4, 2),
    ("generic", 128, "fp32"): DecodeConfig(32, 4, 2),
    ("generic", 256, "fp32"): DecodeConfig(32, 4, 2),
}

#: The step of long unsplit default-mask rows on sm90 (STREAM_KEYS).
STREAM_CONFIG = DecodeConfig(128, 4, 2)

AUTOTUNE_CANDIDATES: tuple[DecodeConfig, ...] = (
    DecodeConfig(32, 2, 4),
    DecodeConfig(32, 4, 4),
    DecodeConfig(64, 2, 3),
    DecodeConfig(64, 4, 4),
    DecodeConfig(128, 4, 3),
    DecodeConfig(128, 8, 2),
)

@SymbolicGridFn
def decode_grid(batch, head_tiles, q_len, meta, *, cdiv):
    """Launch grid of the decode kernel, from ``call_sizes`` = (batch, HEAD_TILES, Q_LEN).

    program_id(0) = batch index * HEAD_TILES + head tile (the tiles of one KV head are
    neighbours, so unpacked heads of a group share K/V through the L2 cache);
    program_id(1) the share of the KV steps; program_id(2) the tile of BLOCK_Q query
    positions.
    """
    return (batch * head_tiles, meta["SPLIT_KV"], cdiv(q_len, meta["BLOCK_Q"]))


@SymbolicGridFn
def merge_grid(batch, q_heads, q_len, meta, *, cdiv):
    """Launch grid of the merge pass: (cdiv(Q_LEN, BLOCK_R), batch, query heads)."""
    return (cdiv(q_len, meta["BLOCK_R"]), batch, q_heads)


def _merge_helpers_source() -> str:
    text = read_template("decode_merge")
    at = text.index(MERGE_HELPERS_MARK)
    return text[at:]


decode_template = TritonTemplate(
    name=DECODE_TEMPLATE_NAME,
    grid=decode_grid,
    source=read_template("decode") + "\n" + _merge_helpers_source() + "\n" + read_template("common"),
)
merge_template = TritonTemplate(
    name=MERGE_TEMPLATE_NAME,
    grid=merge_grid,
    source=kernel_source("decode_merge"),
)


class DecodeOptionError(ValueError):
    """kernel_options ask for something the decode kernel cannot do."""


# --------------------------------------------------------------------------------------
# Which kernel
# --------------------------------------------------------------------------------------
def _hint(expr) -> int:
    return int(V.graph.sizevars.optimization_hint(expr))


def use_decode_kernel(query, key, kernel_options: dict[str, Any]) -> bool:
    """Whether this call runs the split-KV decode kernel (see the module docstring)."""
    forced = kernel_options.get("FORCE_DECODE")
    main_forced = bool(kernel_options.get("FORCE_USE_FLEX_ATTENTION", False))
    if forced is not None and bool(forced) and main_forced:
        raise DecodeOptionError(
            "flexattn: kernel_options FORCE_DECODE=True and FORCE_USE_FLEX_ATTENTION=True "
            "contradict each other; pass one of them")
    if main_forced:
        return False
    if forced is not None:
        return bool(forced)
    q_len, kv_len = _hint(query.get_size()[2]), _hint(key.get_size()[2])
    return q_len <= DECODE_MAX_Q_LEN and kv_len >= DECODE_MIN_KV_LEN


# --------------------------------------------------------------------------------------
# Host-side choices
# --------------------------------------------------------------------------------------
def _power_of_two_at_most(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


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
    block_q = min(_next_power_of_two(q_len_hint), _power_of_two_at_most(MAX_TILE_ROWS // heads))
    while sparse_q % block_q:
        block_q //= 2
    block_m = max(cfgs.MIN_TILE, _next_power_of_two(heads * block_q))
    return Packing(heads, block_q, block_m)


def multiprocessor_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return VIRTUAL_SMS


def split_count(*, sms: int, programs: int, max_steps: int, kernel_options: dict[str, Any],
                max_blocks: int | None = None) -> int:
    """SPLIT_KV for ``programs`` tiles on ``sms`` multiprocessors (a wave: sms *
    RESIDENT_PROGRAMS_PER_SM programs at once):

    * fewer tiles than multiprocessors: PROGRAMS_PER_SM programs per multiprocessor and at
      least MIN_SPLIT_KV splits, but no more programs than a wave;
    * at least one tile per multiprocessor, within one wave: 1 (no split);
    * more tiles than a wave: enough splits for MIN_WAVES waves (a power of two);

    each split keeping at least MIN_STEPS_PER_SPLIT steps of a dense row (of max_steps)
    and, where shares take whole blocks (every call with BlockMask lists), at least one
    of its max_blocks blocks; at most MAX_SPLIT_KV; pinned by kernel_options["SPLIT_KV"]."""
    pinned = kernel_options.get("SPLIT_KV")
    if pinned is not None:
        if not isinstance(pinned, int) or isinstance(pinned, bool) or not 1 <= pinned <= MAX_SPLIT_KV:
            raise DecodeOptionError(
                f"flexattn: kernel_options SPLIT_KV must be an int in [1, {MAX_SPLIT_KV}], got {pinned!r}")
        return pinned
    programs = max(programs, 1)
    wave = sms * RESIDENT_PROGRAMS_PER_SM
    # Session 10 split long default-mask rows (KV >= 64k) apart from this rule: B=8 into
    # one program per multiprocessor (2 splits) and B=32 into MIN_WAVES waves (8 splits),
    # each up to 0.8% ahead on its H200. On another H200 (session 14, bench/ab_decode.py,
    # CUDA-graph us, KV 128k) those lost 1-2.2%: B=32 3763.0 against 3682.5 unsplit (a
    # pure read of the bytes: 3683.3; SDPA 3668.9), B=8 942.8 against 933.1 with 4 splits
    # (read 924.0; SDPA 925.8). This rule's worst reading over both machines is the better.
    if programs > wave:
        # More tiles than one wave: MIN_WAVES waves (see there), the split rounded up to
        # a power of two (whole, equal shares of a power-of-two row: at B=32 KV 128k 7
        # splits took 3919.9 us where 8 took 3751.4).
        wanted = _next_power_of_two(math.ceil(MIN_WAVES * wave / programs))
    elif programs >= sms:
        # The tiles alone fill the GPU in one wave: splitting would only add partials, a
        # merge and a second wave (B=32, 256 tiles, KV 8k: 1 split 242.4 us, 2 splits
        # 277.1, 4 splits 253.1; SDPA 240.3).
        return 1
    else:
        # Rounded down: one program past a whole number per SM is a second round; and no
        # more programs than one wave.
        wanted = min(max(PROGRAMS_PER_SM * sms // programs, MIN_SPLIT_KV), max(wave // programs, 1))
    useful = math.ceil(max_steps / MIN_STEPS_PER_SPLIT)
    if max_blocks is not None:
        useful = min(useful, max_blocks)
    return max(1, min(wanted, useful, MAX_SPLIT_KV))


def list_chunk_size(blocks_per_share: int, kernel_options: dict[str, Any]) -> int:
    """LIST_CHUNK: kernel_options["LIST_CHUNK"] (a power of two >= 2), else
    LIST_CHUNK_DEFAULT, or the power of two that holds a share's ``blocks_per_share``
    blocks (at least 2) when that is smaller."""
    pinned = kernel_options.get("LIST_CHUNK")
    if pinned is not None:
        if not isinstance(pinned, int) or isinstance(pinned, bool) or pinned < 2 or pinned & (pinned - 1):
            raise DecodeOptionError(
                f"flexattn: kernel_options LIST_CHUNK must be a power of two >= 2, got {pinned!r}")
        return pinned
    return max(2, min(LIST_CHUNK_DEFAULT, _next_power_of_two(blocks_per_share)))


def fused_merge(kernel_options: dict[str, Any]) -> bool:
    """kernel_options["FUSED_MERGE"] (a bool), FUSED_MERGE_DEFAULT when absent."""
    value = kernel_options.get("FUSED_MERGE")
    if value is None:
        return FUSED_MERGE_DEFAULT
    if not isinstance(value, bool):
        raise DecodeOptionError(f"flexattn: kernel_options FUSED_MERGE must be True or False, got {value!r}")
    return value


def decode_configs(device, qk_dim_pad: int, dtype, sparse_kv: int, kernel_options) -> list[DecodeConfig]:
    """The default (+ autotune candidates), pinned fields applied, BLOCK_N fitted to the
    BlockMask's KV block (a pinned BLOCK_N that does not divide it raises)."""
    width = "fp32" if dtype == torch.float32 else "16bit"
    candidates = [DEFAULTS[(cfgs.gpu_generation(device), cfgs.head_dim_bucket(qk_dim_pad), width)]]
    if inductor_config.max_autotune:
        candidates += list(AUTOTUNE_CANDIDATES)
    pinned = DecodeConfig.pinned_fields(kernel_options)
    cfgs.check_pinned(pinned, {"block_n": ("BLOCK_N", "KV", sparse_kv)})
    out = cfgs.fit_candidates(cfgs.with_pinned(candidates, pinned), block_limits={"block_n": sparse_kv})
    if not out:
        raise cfgs.ConfigError(
            f"flexattn: no decode configuration fits the BlockMask's KV_BLOCK_SIZE={sparse_kv} "
            f"(it must be a multiple of {cfgs.MIN_TILE})")
    return out


def widen_for_latency(usable: list[DecodeConfig], programs: int, sms: int, keys_per_split: int, dtype,
                      sparse_kv: int, kernel_options: dict[str, Any]) -> list[DecodeConfig]:
    """The configs with BLOCK_N widened to LATENCY_BLOCK_N when the call is latency-bound
    (``programs`` <= ``sms``), 16-bit, BLOCK_N is not pinned, LATENCY_BLOCK_N divides the
    BlockMask's KV block and each split keeps MIN_STEPS_PER_SPLIT steps of it."""
    if ("block_n" in DecodeConfig.pinned_fields(kernel_options) or programs > sms
            or dtype not in (torch.float16, torch.bfloat16) or sparse_kv % LATENCY_BLOCK_N or keys_per_split < MIN_STEPS_PER_SPLIT * LATENCY_BLOCK_N):
        return usable
    widened: list[DecodeConfig] = []
    for cfg in usable:
        cfg = dataclasses.replace(cfg, block_n=max(cfg.block_n, LATENCY_BLOCK_N))
        if cfg not in widened:
            widened.append(cfg)
    return widened


def stream_step(usable: list[DecodeConfig], *, generation: str, tiles: int, sms: int, split_kv: int,
                dense_keys: int | None, dtype, qk_dim_pad: int, sparse_kv: int,
                kernel_options: dict[str, Any]) -> list[DecodeConfig]:
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
               and cfgs.head_dim_bucket(qk_dim_pad) == 128
               and dense_keys is not None and dense_keys >= STREAM_KEYS
               and split_kv == 1
               and tiles > sms
               and sparse_kv % STREAM_CONFIG.block_n == 0)
    if not streams:
        return usable
    candidates = usable if len(usable) > 1 else []
    return [STREAM_CONFIG, *(cfg for cfg in candidates if cfg != STREAM_CONFIG)]


# --------------------------------------------------------------------------------------
# The lowering proper
# --------------------------------------------------------------------------------------
def lower_to_decode_template(
    query, key, value, score_mod, block_mask, scale, kernel_options,
    score_mod_buffers, mask_mod_buffers,
):
    kernel_options = dict(kernel_options or {})
    sizevars = V.graph.sizevars
    device = query.get_device()
    dtype = query.get_dtype()
    B, Hq, L, _ = query.get_size()
    S = key.get_size()[2]
    q_heads = sizevars.guard_int(Hq)
    call = prepare_call(query, key, value, score_mod, block_mask, kernel_options, score_mod_buffers, mask_mod_buffers)
    query, key, value = call.query, call.key, call.value

    spec = forward_specialisations(
        query=query, key=key, value=value, scale=scale, kernel_options=kernel_options,
        sparse_q=call.sparse_q, sparse_kv=call.sparse_kv, has_full_blocks=call.has_full_blocks,
        has_score_mod=call.has_score_mod, kernel="decode",
    )
    group = spec["GQA_GROUP_SIZE"]
    pack = packing(group, _hint(L), call.sparse_q, call.mask_varies_over_heads)
    head_tiles = q_heads // pack.heads_per_tile

    usable = decode_configs(device, spec["QK_HEAD_DIM_PAD"], dtype, call.sparse_kv, kernel_options)
    # One SPLIT_KV for all configs (it shapes the partial buffers); sized for the
    # smallest KV step among them.
    smallest_step = min(cfg.block_n for cfg in usable)
    programs = _hint(B) * head_tiles * math.ceil(_hint(L) / pack.block_q)
    sms = multiprocessor_count(device)
    max_blocks = math.ceil(_hint(S) / call.sparse_kv)
    if not spec["DENSE_KV"]:
        # A row lists at most its index row's width of blocks (narrower than the KV
        # blocks for a paged cache's masks).
        # (Without full blocks full_kv_indices is a placeholder of width 0.)
        max_blocks = min(max_blocks, max(_hint(t.get_size()[-1]) for t in (call.kv_indices, call.full_kv_indices)))
    split_kv = split_count(sms=sms, programs=programs,
                           max_steps=math.ceil(_hint(S) / smallest_step), kernel_options=kernel_options,
                           max_blocks=None if spec["DENSE_KV"] else max_blocks)
    usable = widen_for_latency(usable, programs * split_kv, sms, _hint(S) // split_kv, dtype, call.sparse_kv,
                               kernel_options)
    usable = stream_step(usable, generation=cfgs.gpu_generation(device), tiles=programs, sms=sms,
                         split_kv=split_kv, dense_keys=_hint(S) if spec["DENSE_KV"] else None, dtype=dtype,
                         qk_dim_pad=spec["QK_HEAD_DIM_PAD"], sparse_kv=call.sparse_kv, kernel_options=kernel_options)

    # One launch unless FUSED_MERGE=False asks for the merge pass (one share needs none).
    fused = split_kv == 1 or fused_merge(kernel_options)
    v_dim = spec["V_HEAD_DIM"]
    part_size = [B, Hq, L, split_kv]

    def scratch(size):
        return realize_fixed(empty_strided(size, None, dtype=torch.float32, device=device))

    workspace = None
    if not fused:
        # The template's output is the partial acc; the merge pass makes out, lse and max.
        layout = ir.FixedLayout(device, torch.float32, [*part_size, v_dim],
                                ir.FlexibleLayout.contiguous_strides([*part_size, v_dim]))
        m_part, l_part = scratch(part_size), scratch(part_size)
        buffers = [m_part, l_part]
    else:
        layout = output_layout(query, v_dim)
        lse, row_max = scratch([B, Hq, L]), scratch([B, Hq, L])
        buffers = [lse, row_max]
        if split_kv > 1:
            buffers = [scratch([*part_size, v_dim]), scratch(part_size), scratch(part_size), *buffers]
            tiles = B * head_tiles * FloorDiv(L + pack.block_q - 1, pack.block_q)
            workspace = _compat.graph_zeroed_workspace(
                tiles, device, f"{COUNTERS_WORKSPACE}_{device.type}_{device.index or 0}", COUNTERS_ARG, torch.int32)

    # The order of decode.py.jinja's def_kernel; flex_attention's own default mask (every
    # block full, in order) needs no tables (DENSE_KV).
    dense_kv = spec["DENSE_KV"]
    mask_tables = [] if dense_kv else [call.kv_num_blocks, call.kv_indices, call.full_kv_num_blocks,
                                       call.full_kv_indices]
    input_nodes = [query, key, value, *buffers, *mask_tables]
    known = sizevars.statically_known_true
    shared = {
        **spec,
        "HEADS_PER_TILE": pack.heads_per_tile,
        "HEAD_TILES": head_tiles,
        "BLOCK_Q": pack.block_q,
        "BLOCK_M": pack.block_m,
        "SPLIT_KV": split_kv,
        "SPLIT_KV_PAD": _next_power_of_two(split_kv),
        "LIST_CHUNK": list_chunk_size(math.ceil(max_blocks / split_kv), kernel_options),
        "FUSED_MERGE": fused,
        "IS_DIVISIBLE_N": known(sympy.Eq(sympy.Mod(S, call.sparse_kv), 0)),
    }
    choices, config_of_choice = template_choices(
        decode_template, usable, "decode", lambda cfg: {**shared, "BLOCK_N": cfg.block_n},
        on_choice=None if workspace is None else (lambda choice: _compat.share_template_workspace(choice, workspace)),
        input_nodes=input_nodes,
        layout=layout,
        subgraphs=[call.score_buffer, call.mask_buffer],
        mutated_inputs=buffers,
        call_sizes=[B, sympy.Integer(head_tiles), L],
        workspace_arg=workspace,
    )

    captured = [b for b in (*call.score_mod_buffers, *call.mask_mod_buffers) if isinstance(b, ir.IRNode)]
    n = 3 + len(buffers)   # the index of KV_NUM_BLKS
    if dense_kv:
        input_gen_fns = None
    elif call.has_full_blocks:
        input_gen_fns = {n: _benchmark_block_counts(call.kv_indices, 0.5), n + 1: _benchmark_block_indices,
                         n + 2: _benchmark_block_counts(call.full_kv_indices, 0.5), n + 3: _benchmark_full_block_indices}
    else:
        input_gen_fns = {n: _benchmark_block_counts(call.kv_indices, 1.0), n + 1: _benchmark_block_indices}
    result = _compat.autotune_select_node(
        DECODE_TEMPLATE_NAME, choices, input_nodes + captured, layout, input_gen_fns=input_gen_fns)

    if fused:
        out, lse, row_max = result, ir.TensorBox(lse), ir.TensorBox(row_max)
    else:
        out, lse, row_max = _merge(result, m_part, l_part, query, spec, split_kv)
    report_choice("decode", result, config_of_choice, usable, spec, REPORTED_SPECIALISATIONS, query, key, value,
                  kernel_options,
                  details=(f", SPLIT_KV={split_kv}, HEADS_PER_TILE={pack.heads_per_tile} BLOCK_Q={pack.block_q} "
                           f"BLOCK_M={pack.block_m}, "
                           + ("one launch (FUSED_MERGE)" if fused else "two launches (merge pass)")))
    return out, lse, row_max


def _merge(acc, m_part, l_part, query, spec, split_kv):
    """The second pass: partial results -> out (query's layout), lse, max."""
    B, Hq, L, _ = query.get_size()
    device = query.get_device()
    acc = realize_fixed(acc)
    layout = output_layout(query, spec["V_HEAD_DIM"])
    lse = realize_fixed(empty_strided([B, Hq, L], None, dtype=torch.float32, device=device))
    row_max = realize_fixed(empty_strided([B, Hq, L], None, dtype=torch.float32, device=device))
    choices: list[Any] = []
    error = merge_template.maybe_append_choice(
        choices,
        input_nodes=[acc, m_part, l_part, lse, row_max],
        layout=layout,
        mutated_inputs=[lse, row_max],
        call_sizes=[B, Hq, L],
        num_stages=1,
        num_warps=4,
        BLOCK_R=min(MERGE_ROWS, _next_power_of_two(_hint(L))),
        SPLIT_KV=split_kv,
        SPLIT_KV_PAD=_next_power_of_two(split_kv),
        V_HEAD_DIM=spec["V_HEAD_DIM"],
        V_HEAD_DIM_PAD=spec["V_HEAD_DIM_PAD"],
        ROWS_GUARANTEED_SAFE=spec["ROWS_GUARANTEED_SAFE"],
        OUTPUT_LOGSUMEXP=spec["OUTPUT_LOGSUMEXP"],
        OUTPUT_MAX=spec["OUTPUT_MAX"],
    )
    if error is not None or not choices:
        raise RuntimeError(f"flexattn: the decode merge template could not be generated: {error}")
    out = _compat.autotune_select_node(MERGE_TEMPLATE_NAME, choices, [acc, m_part, l_part, lse, row_max], layout)
    return out, ir.TensorBox(lse), ir.TensorBox(row_max)


__all__ = [
    "DecodeConfig",
    "decode_grid",
    "decode_template",
    "fused_merge",
    "lower_to_decode_template",
    "merge_grid",
    "merge_template",
    "use_decode_kernel",
]

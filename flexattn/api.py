"""``flex_attention``: the public entry point, argument checks and the eager path.

Same names, argument names, defaults and results as
``torch.nn.attention.flex_attention.flex_attention``, so moving code between the two is
a change of import. The function validates every input with an error that names the
argument, fills defaults, turns the BlockMask into the operator's tuple and calls
``flex_attention_hop``.

Under ``torch.compile`` the call is captured whole (see ``_dynamo_capture``). Called
eagerly, it compiles the operator itself with Inductor, so eager users get the same
fused kernels: on a GPU once per input signature; on the CPU (whose C++ engine takes
sizes at run time) with automatic dynamic shapes, so a second length makes the graph
dynamic instead of compiling once per length.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
import os
import pathlib
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from . import _compat
from . import options as _options
from ._hop import NO_Q_BLOCKS_ERROR, MissingQBlocksError, call_dropout, flex_attention_hop, identity_score_mod
from .block_mask import DEFAULT_BLOCK_SIZE, BlockMask, noop_mask, sliced_mask_mod, tile_for_call
from .cpu import uses_engine
from .lowering.configs import gluon_backward as _gluon_backward_configs
from .lowering.configs import gluon_forward as _gluon_forward_configs
from .mod_signature import required_positional_count
from .reference import attention_probabilities, dense_math

#: Head dims where a BlockMask's partial_heavy picks the forward or the backward kernel.
_PARTIAL_HEAVY_HEAD_DIMS = frozenset(_gluon_forward_configs.PARTIAL_HEAVY_MEMORY_MASK_TRITON_HEAD_DIMS
                                     + _gluon_backward_configs.PARTIAL_HEAVY_MEMORY_MASK_TRITON_HEAD_DIMS)

log = logging.getLogger("flexattn.api")

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Keys and values may be float8 under a 16- or 32-bit query (quantized KV caches; the
#: kernels widen each tile to the query's dtype, forward and decode only).
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


# The two tests below say what the tuples above hold through the dtype's own attributes
# and torch's names: a compiled call then guards on no module tuple (about 1 us a call;
# tests/test_validation.py holds them equal to the tuples).
def _is_supported_dtype(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize >= 2


def _is_fp8_kv_dtype(dtype: torch.dtype) -> bool:
    return dtype == torch.float8_e4m3fn or dtype == torch.float8_e5m2


#: Head dims the Triton kernels take (their tiles and shared memory), and the C++ CPU
#: engine's (its scratch grows with the head dim; tested up to here).
MAX_HEAD_DIM = 256
CPU_ENGINE_MAX_HEAD_DIM = 1024

def _code_version() -> str:
    """A digest of the sources that decide what flexattn compiles to.

    Inductor's FX-graph cache keys a compiled graph by the graph and torch's own code,
    not by a plugin's lowerings and templates. The digest travels in every call's
    kernel_options (part of the graph), so a changed flexattn never reuses a graph
    compiled by an older one.
    """
    root = pathlib.Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(p for suffix in ("*.py", "*.jinja", "*.cpp", "*.h") for p in root.rglob(suffix)):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


CODE_VERSION = _code_version()


@dataclass(frozen=True)
class AuxRequest:
    """Which auxiliary results ``flex_attention(..., return_aux=AuxRequest(...))`` returns.

    lse: the log-sum-exp of each query row's scores (natural log, (B, H, L), float32;
    float64 for float64 inputs).
    max_scores: the largest modified score of each query row ((B, H, L), as lse).
    probabilities: a debugging aid (FlashAttention's return-softmax): the attention
    probabilities as the call applies them, (B, H, L, S) float32 (float64 for float64
    inputs), after score_mod, the mask and the sinks; with dropout the kept entries are
    scaled by 1 / (1 - dropout_p) and the dropped ones carry a minus sign (their sign bit
    is set, also where the probability is 0), so ``probabilities.clamp(min=0)`` is what
    multiplies the values and ``torch.signbit(probabilities)`` the dropout mask. Computed
    densely beside the fused call (the kernels never hold the matrix), so only for
    shapes with at most ``MAX_PROBABILITIES`` entries.
    """

    lse: bool = False
    max_scores: bool = False
    probabilities: bool = False


class AuxOutput(NamedTuple):
    """Auxiliary results; a field not requested is None."""

    lse: Tensor | None = None
    max_scores: Tensor | None = None
    probabilities: Tensor | None = None


#: The most entries (B * H * L * S) that AuxRequest(probabilities=True) returns.
MAX_PROBABILITIES = 1 << 26


# --------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------
def _shape(t: Tensor) -> tuple:
    return tuple(t.shape)


def _check_sinks(sinks: Any, query: Tensor) -> None:
    if sinks is None:
        return
    if not isinstance(sinks, Tensor):
        raise TypeError(f"flexattn: sinks must be a torch.Tensor or None, got {type(sinks).__name__}")
    B, Hq = query.shape[:2]
    if tuple(sinks.shape) not in ((Hq,), (B, Hq)):
        raise ValueError(f"flexattn: sinks must have shape (H,) = ({Hq},) or (B, H) = ({B}, {Hq}) for query "
                         f"shape {_shape(query)}, got {_shape(sinks)}")
    if not sinks.is_floating_point():
        raise TypeError(f"flexattn: sinks must have a floating dtype, got {sinks.dtype}")
    if sinks.device != query.device:
        raise ValueError(f"flexattn: sinks must be on query's device {query.device}, got {sinks.device}")


def _check_dropout_p(dropout_p: Any, kernel_options: dict[str, Any]) -> float:
    """dropout_p as a float in [0, 1) (TypeError / ValueError otherwise, as SDPA's
    arguments); a call that forces the decode kernel cannot have dropout (it is the
    forward kernel's)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"flexattn: dropout_p must be a float in [0, 1), got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"flexattn: dropout_p must be in [0, 1), got {dropout_p}")
    forced = kernel_options.get("FORCE_DECODE") or kernel_options.get("BACKEND") == "TRITON_DECODE"
    if dropout_p > 0 and forced:
        raise ValueError("flexattn: dropout_p > 0 runs in the forward kernel; kernel_options FORCE_DECODE=True / "
                         "BACKEND='TRITON_DECODE' ask for the decode kernel, which has no dropout")
    return float(dropout_p)


def _check_qkv(query: Any, key: Any, value: Any, enable_gqa: bool) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"flexattn: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            layout = "(B, H, L, E)" if name == "query" else "(B, Hkv, S, E)" if name == "key" else "(B, Hkv, S, Ev)"
            raise ValueError(f"flexattn: {name} must be 4-D {layout}, got shape {_shape(t)}")
        if not (_is_supported_dtype(t.dtype) or (name != "query" and _is_fp8_kv_dtype(t.dtype))):
            allowed = SUPPORTED_DTYPES if name == "query" else SUPPORTED_DTYPES + FP8_KV_DTYPES
            raise TypeError(
                f"flexattn: {name} must have a floating dtype in {[str(d) for d in allowed]}, got {t.dtype}"
            )
    low_precision_kv = key.dtype == value.dtype and _is_fp8_kv_dtype(key.dtype) and query.dtype != torch.float64
    if not (query.dtype == key.dtype == value.dtype or low_precision_kv):
        # torch's phrase (its tests match it), then what is allowed.
        raise ValueError(
            f"flexattn: Expected query, key, and value to have the same dtype, but got query.dtype: "
            f"{query.dtype}, key.dtype: {key.dtype}, and value.dtype: {value.dtype} instead (key and "
            f"value may also both be float8 under a float16, bfloat16 or float32 query)"
        )
    if not (query.device == key.device == value.device):
        raise ValueError(
            f"flexattn: Expected query, key, and value to have the same device type, but got "
            f"query.device: {query.device}, key.device: {key.device}, and value.device: {value.device} instead."
        )
    B, Hq, _, E = query.shape
    Bk, Hk, S, Ek = key.shape
    Bv, Hv, Sv, _ = value.shape
    if Ek != E:
        raise ValueError(f"flexattn: key's head dim must equal query's ({E}), got key shape {_shape(key)}")
    if (Bk, Hk, S) != (Bv, Hv, Sv):
        raise ValueError(
            f"flexattn: key and value must agree in batch, heads and length, got key "
            f"{_shape(key)} and value {_shape(value)}"
        )
    if Bk not in (1, B):
        raise ValueError(
            f"flexattn: key/value batch must be 1 (broadcast) or query's batch {B}, got {Bk}"
        )
    if S == 0 and not torch.compiler.is_compiling():  # compiled: the lowering raises (as torch's does)
        raise ValueError(
            f"flexattn: key/value must hold at least one position (S >= 1) for a query to attend "
            f"to, got key shape {_shape(key)}"
        )
    if Hk == 0 or (Hq != Hk and not enable_gqa):
        raise ValueError(
            f"flexattn: query has {Hq} heads and key/value {Hk}; different head counts need "
            f"enable_gqa=True (grouped-query attention)"
        )
    if Hq % Hk != 0:
        raise ValueError(
            f"flexattn: with enable_gqa, query heads ({Hq}) must be a multiple of key/value "
            f"heads ({Hk})"
        )
    engine = uses_engine(query.device)
    limit = CPU_ENGINE_MAX_HEAD_DIM if engine else MAX_HEAD_DIM
    for name, d in (("query/key head dim E", E), ("value head dim Ev", value.shape[-1])):
        if not 1 <= d <= limit:
            where = "the CPU engine" if engine else f"the {query.device.type} kernels"
            raise ValueError(f"flexattn: {name} must be between 1 and {limit} on {where}, got {d}")


def _check_mod(name: str, fn: Any, arity: int, signature: str) -> None:
    if not callable(fn):
        raise TypeError(f"flexattn: {name} must be callable {signature}, got {type(fn).__name__}")
    if torch.compiler.is_compiling():
        return  # Dynamo checks the call when it speculates the mod
    n = required_positional_count(fn)
    if n is not None and n != arity:
        raise TypeError(f"flexattn: {name} must take {arity} arguments {signature}, but it takes {n}")


def _check_block_mask(block_mask: Any, query: Tensor, key: Tensor) -> BlockMask:
    if not isinstance(block_mask, BlockMask):
        raise TypeError(
            f"flexattn: block_mask must be a flexattn.BlockMask (from create_block_mask), "
            f"got {type(block_mask).__name__}"
        )
    B, Hq, L, _ = query.shape
    S = key.shape[-2]
    if block_mask.kv_num_blocks.dim() != 3:
        raise ValueError(
            f"flexattn: block_mask must have (batch, heads, query blocks) tables, got kv_num_blocks "
            f"of shape {tuple(block_mask.kv_num_blocks.shape)}"
        )
    if block_mask.kv_num_blocks.device != query.device:
        raise ValueError(
            f"flexattn: block_mask is on {block_mask.kv_num_blocks.device} but query is on "
            f"{query.device}; move it with block_mask.to(query.device)"
        )
    block_mask = tile_for_call(block_mask, B, Hq)
    mask_q, mask_kv = block_mask.seq_lengths
    if (mask_q, mask_kv) != (L, S):
        if mask_q < L or mask_kv < S:
            raise ValueError(
                f"flexattn: block_mask was created for (Q_LEN, KV_LEN) = ({mask_q}, {mask_kv}) but "
                f"query/key have ({L}, {S}); build it for at least those lengths"
            )
        block_mask = block_mask.adjust(L, S)
    return block_mask


def full_block_mask(query: Tensor, key: Tensor) -> BlockMask:
    """A BlockMask in which every KV block is fully visible to every query block.

    All eight tables are views of one ``arange`` (counts as one-element slices, block
    lists as rows, expanded with stride 0), so under torch.compile the default mask costs
    one tiny kernel per call rather than one per table (a decode step is a few
    microseconds long).
    """
    L, S = query.shape[-2], key.shape[-2]
    block = DEFAULT_BLOCK_SIZE
    q_blocks, kv_blocks = math.ceil(L / block), math.ceil(S / block)
    counting = torch.arange(max(q_blocks, kv_blocks) + 1, dtype=torch.int32, device=query.device)

    def count(value: int, rows: int) -> Tensor:
        return counting[value:value + 1].view(1, 1, 1).expand(1, 1, rows)

    def every_block(rows: int, columns: int) -> Tensor:
        return counting[:columns].view(1, 1, 1, columns).expand(1, 1, rows, columns)

    kv_order, q_order = every_block(q_blocks, kv_blocks), every_block(kv_blocks, q_blocks)
    return BlockMask(
        (L, S),
        count(0, q_blocks), kv_order, count(kv_blocks, q_blocks), kv_order,
        count(0, kv_blocks), q_order, count(q_blocks, kv_blocks), q_order,
        BLOCK_SIZE=block, mask_mod=noop_mask,
    )


# --------------------------------------------------------------------------------------
# Eager path: compile the operator once per signature
# --------------------------------------------------------------------------------------
def _call_hop(query, key, value, score_mod, block_mask_tuple, scale, kernel_options, sinks, dropout_seed):
    return flex_attention_hop(query, key, value, score_mod, block_mask_tuple, scale, kernel_options, sinks=sinks,
                              dropout_seed=dropout_seed)


@functools.lru_cache(maxsize=None)
def _compiled_hop(dynamic: bool | None) -> Callable:
    return torch.compile(_call_hop, backend="inductor", fullgraph=True, dynamic=dynamic)


#: Set by ``eager_mods``: calls outside torch.compile run the reference without compiling.
_EAGER_MODS_ENV = "FLEXATTN_EAGER_MODS"
_eager_mods_depth = 0


@contextlib.contextmanager
def eager_mods():
    """Debug switch: inside this block (or with FLEXATTN_EAGER_MODS=1), ``flex_attention``
    called outside torch.compile runs the dense reference without compiling anything, so
    score_mod and mask_mod run as Python (``print``, breakpoints; they see batched 0-d
    values, as under torch.vmap). Slow and memory-hungry: for debugging small shapes.
    Calls inside a compiled function are compiled as usual."""
    global _eager_mods_depth
    _eager_mods_depth += 1
    try:
        yield
    finally:
        _eager_mods_depth -= 1


def _run_eagerly(query, key, value, score_mod, block_mask_tuple, scale, kernel_options, sinks, dropout_seed):
    if _eager_mods_depth or os.environ.get(_EAGER_MODS_ENV, "0") == "1":
        # Plain autograd through the math: tensors the mods close over get their gradients.
        return dense_math(query, key, value, score_mod, block_mask_tuple, scale, (), (), sinks,
                          call_dropout(kernel_options, dropout_seed))
    compiled = _compiled_hop(None if uses_engine(query.device) else False)
    timed = log.isEnabledFor(logging.INFO)
    if timed:
        graphs, started = _compat.compiled_graph_count(), time.perf_counter()
    with _compat.unlimited_recompiles():
        result = compiled(query, key, value, score_mod, block_mask_tuple, scale, kernel_options, sinks, dropout_seed)
    if timed and _compat.compiled_graph_count() != graphs:
        log.info("flexattn: compiled the operator for q %s k %s v %s %s on %s in %.2f s; "
                 "later calls with this signature reuse it", list(query.shape), list(key.shape),
                 list(value.shape), query.dtype, query.device, time.perf_counter() - started)
    return result


# --------------------------------------------------------------------------------------
# torch's own objects
# --------------------------------------------------------------------------------------
def _is_torch_flex(obj: Any, name: str) -> bool:
    cls = type(obj)
    return cls.__name__ == name and cls.__module__.startswith("torch.nn.attention")


def _from_torch_object(obj: Any) -> Any:
    """torch's AuxRequest or BlockMask as flexattn's (a BlockMask shares its tensors, no
    copy), so code written for torch's FlexAttention passes its objects unchanged;
    anything else as it came."""
    if obj is None or isinstance(obj, (AuxRequest, BlockMask)):
        return obj  # flexattn's own: a compiled call guards on no class name
    if _is_torch_flex(obj, "AuxRequest"):
        return AuxRequest(lse=bool(obj.lse), max_scores=bool(obj.max_scores),
                          probabilities=bool(getattr(obj, "probabilities", False)))
    if _is_torch_flex(obj, "BlockMask"):
        return BlockMask(obj.seq_lengths, obj.kv_num_blocks, obj.kv_indices, obj.full_kv_num_blocks,
                         obj.full_kv_indices, obj.q_num_blocks, obj.q_indices, obj.full_q_num_blocks,
                         obj.full_q_indices, BLOCK_SIZE=obj.BLOCK_SIZE, mask_mod=obj.mask_mod)
    return obj


def _warn_return_lse_deprecated() -> None:
    # Every call warns; Python's default filter shows it once per calling line.
    warnings.warn("flexattn: return_lse is deprecated (as in torch's flex_attention); use "
                  "return_aux=AuxRequest(lse=True)", FutureWarning, stacklevel=3)


# --------------------------------------------------------------------------------------
# The public function
# --------------------------------------------------------------------------------------
def flex_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    score_mod: Callable | None = None,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: dict[str, Any] | None = None,
    *,
    return_aux: AuxRequest | None = None,
    sinks: Tensor | None = None,
    # An int: Dynamo takes a float default for a symbolic input, then restarts to specialise it.
    dropout_p: float = 0,
):
    """Attention with a user-defined score modification and block-sparse mask.

    ``out[b, h, i] = sum_j softmax_j(score_mod(scale * q_i . k_j, b, h, i, j)) v_j`` over
    the (i, j) the block mask allows.

    Args:
        query: (B, H, L, E). key: (Bkv, Hkv, S, E). value: (Bkv, Hkv, S, Ev). Bkv is 1 or B.
        score_mod: ``(score, b, h, q_idx, kv_idx) -> score``, applied to every entry; it
            may read tensors it closes over (indexed by b, h, q_idx, kv_idx).
        block_mask: from ``create_block_mask``; None means every entry is visible.
        scale: the factor on q . k; defaults to 1/sqrt(E).
        enable_gqa: allow H to be a multiple of Hkv (grouped-query attention).
        return_lse: also return the log-sum-exp (kept for compatibility; prefer return_aux).
        kernel_options: tuning and behaviour switches for the kernels (see the docs).
        return_aux: ``AuxRequest(lse=..., max_scores=...)``.
        sinks: per-head attention-sink logits, (H,) or (B, H), any float dtype: each joins
            its rows' softmax as one more key whose value is zero (gpt-oss style), never
            masked and untouched by score_mod. Gradients flow to it. The lse includes
            the sink (a row with every key masked gets lse = sink); max_scores does not.
        dropout_p: attention dropout, as SDPA's: each probability is dropped with this
            probability and the kept ones are scaled by 1 / (1 - dropout_p), in the
            fused forward and backward kernels (lse and max_scores are those before
            dropout). Applied whenever it is > 0, also under torch.no_grad(), as SDPA
            does. The mask comes from a Philox counter generator keyed by a seed drawn
            from torch's generator on the inputs' device: ``torch.manual_seed`` repeats a
            call bitwise, consecutive calls differ, and the backward regenerates the
            forward's mask instead of storing it. ``AuxRequest(probabilities=True)``
            shows it.

    Returns:
        out (B, H, L, Ev) in query's dtype; ``(out, lse)`` with return_lse; ``(out,
        AuxOutput)`` with return_aux.
    """
    _check_qkv(query, key, value, enable_gqa)
    if return_lse and return_aux is not None:
        raise ValueError("Cannot specify both return_lse and return_aux (flexattn: return_aux=AuxRequest(lse=True) alone returns the lse)")
    if return_lse and not torch.compiler.is_compiling():
        _warn_return_lse_deprecated()
    return_aux = _from_torch_object(return_aux)
    block_mask = _from_torch_object(block_mask)
    if return_aux is not None and not isinstance(return_aux, AuxRequest):
        raise TypeError(f"flexattn: return_aux must be an AuxRequest, got {type(return_aux).__name__}")
    if score_mod is None:
        score_mod = identity_score_mod
    _check_mod("score_mod", score_mod, 5, "(score, b, h, q_idx, kv_idx)")
    default_mask = block_mask is None
    if default_mask:
        block_mask = full_block_mask(query, key)
    block_mask = _check_block_mask(block_mask, query, key)
    if block_mask.mask_mod is sliced_mask_mod:
        # Raised here, not when the kernel's mask_mod is traced (torch.compile would wrap it).
        raise RuntimeError(
            "flexattn: Cannot use mask_mod from a sliced BlockMask: block_mask[...] renumbers batches, "
            "heads and query blocks, so the original mask_mod no longer fits; assign "
            "block_mask.mask_mod a mask_mod for the slice (e.g. with the query offset added)"
        )
    _check_mod("block_mask.mask_mod", block_mask.mask_mod, 4, "(b, h, q_idx, kv_idx)")
    _check_sinks(sinks, query)
    dropout_p = _check_dropout_p(dropout_p, kernel_options or {})
    if scale is None:
        scale = 1.0 / math.sqrt(query.size(-1))
    elif not isinstance(scale, (int, float)):
        raise TypeError(f"flexattn: scale must be a float or None, got {type(scale).__name__}")

    # Only the keys given: the lowering reads each default from the registry, so a compiled
    # call does not guard on every registry entry.
    options = _options.validate(kernel_options)
    if options.get("FAST_TANH"):
        from .lowering.subgraph import use_fast_tanh
        use_fast_tanh(options, query.dtype, query.device)  # raises where it cannot be had
    want_lse = return_lse or (return_aux is not None and return_aux.lse)
    want_max = return_aux is not None and return_aux.max_scores
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if needs_grad and block_mask.q_indices is None:
        raise MissingQBlocksError(NO_Q_BLOCKS_ERROR.format(what="query, key or value"))
    if "OUTPUT_LOGSUMEXP" not in (kernel_options or {}):
        # A backward's own need for the lse is the autograd operator's to add.
        options["OUTPUT_LOGSUMEXP"] = bool(want_lse)
    # Read directly (its registry default is False): _options.read would have a compiled
    # call guard on the registry entry.
    options["OUTPUT_MAX"] = bool(options.get("OUTPUT_MAX") or want_max)
    internal = {"DEFAULT_MASK": default_mask, "CODE_VERSION": CODE_VERSION}
    if dropout_p:
        internal["DROPOUT_P"] = dropout_p
    if block_mask.partial_heavy is not None and query.is_cuda and query.size(-1) in _PARTIAL_HEAVY_HEAD_DIMS:
        # Only where it picks the kernel: elsewhere a listing that changes between masks
        # would recompile for nothing.
        internal["MASK_PARTIAL_HEAVY"] = block_mask.partial_heavy
    if not torch.compiler.is_compiling():
        # (Traced, the check would guard on each registry entry it reads.)
        _options.check_internal(internal)
    options[_options.INTERNAL_KEY] = internal
    if return_aux is not None and return_aux.probabilities:
        _check_probabilities_size(query, key)
    # Two int64 draws, [0, 2**62): the Philox key and its stream (numerics.dropout_keep).
    seed = torch.randint(0, 1 << 62, (2,), dtype=torch.int64, device=query.device) if dropout_p else None

    args = (query, key, value, score_mod, block_mask.as_tuple(), float(scale), options)
    if query.shape[2] == 0 and key.shape[2] > 0:
        # No query rows, nothing for a kernel to do: the math gives the empty results (as torch's).
        out, lse, max_scores = dense_math(*args[:6], (), (), sinks, call_dropout(options, seed))
    elif torch.compiler.is_compiling():
        out, lse, max_scores = flex_attention_hop(*args, sinks=sinks, dropout_seed=seed)
    else:
        out, lse, max_scores = _run_eagerly(*args, sinks, seed)

    if return_lse:
        return out, lse
    if return_aux is not None:
        probabilities = None
        if return_aux.probabilities:
            # Run as Python under torch.compile too (a graph break): a debugging aid, dense.
            # Disabled here rather than by a decorator, which would import Dynamo with flexattn.
            probabilities = torch.compiler.disable(_applied_probabilities)(
                query, key, score_mod, block_mask.as_tuple(), float(scale), sinks, call_dropout(options, seed))
        return out, AuxOutput(lse if return_aux.lse else None, max_scores if return_aux.max_scores else None,
                              probabilities)
    return out


def _check_probabilities_size(query: Tensor, key: Tensor) -> None:
    entries = query.shape[0] * query.shape[1] * query.shape[2] * key.shape[2]
    if entries > MAX_PROBABILITIES:
        raise ValueError(f"flexattn: AuxRequest(probabilities=True) returns the (B, H, L, S) probabilities, a "
                         f"debugging aid for small shapes: at most {MAX_PROBABILITIES} entries, got "
                         f"{entries} for query {_shape(query)} and key {_shape(key)}")


def _applied_probabilities(query, key, score_mod, block_mask_tuple, scale, sinks, dropout):
    with torch.no_grad():
        return attention_probabilities(query, key, score_mod, block_mask_tuple, scale, (), (), sinks, dropout)


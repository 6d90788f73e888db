"""Evaluating a mod over an index grid, and a mask_mod into per-block flags.

``evaluate_mod`` calls a mask_mod or score_mod at every point of a (b, h, q, kv) grid with
``torch.vmap`` over the four index axes (the calling convention of the kernels, so a mod
that works here works there). ``chunked_block_flags`` and ``traced_block_flags`` reduce a
mask_mod to per-block ``any`` / ``all`` flags (B, H, QB, KVB), the input of the block
tables (flexattn/block_tables.py): create_block_mask's work.

Staying cheap
-------------
Building the element mask for all of (B, H, Q_LEN, KV_LEN) at once costs B*H*Q*KV bytes:
16 GiB for a single 128k x 128k head. ``chunked_block_flags`` cuts the grid into chunks of
at most ``chunk_elements`` mask elements (query blocks first, then heads, then batches,
``chunk_plan``), evaluates each and reduces it to block flags at once (eight KV
positions per int64 word where the layout allows); only the flags are kept. Peak memory
is therefore one chunk plus the block flags, whatever the sequence length. Traced by
torch.compile, the grid is evaluated in one piece instead, with no branch on a size, so
one graph serves every B, H and length (``traced_block_flags``).

Edge blocks: when a length is not a multiple of its block size, a tile hangs over the
end. Its positions past the end count as masked, as in torch's create_block_mask, so a
hanging tile is *partial* when some in-range position is allowed and *empty* otherwise,
never full: full_kv_num_blocks, sparsity() and the pictures match torch's for the same
inputs. (The kernels would be as correct with such a tile full, since they mask
positions past the end by bounds; that saves mask_mod on every block a one-token decode
query sees, bench/DECISIONS.md#block-mask-hanging-blocks-full.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .block_tables import cdiv
from .mod_signature import MaskMod, mod_name
from .numerics import IndexWithTensors, vmap_over_bhmn


def evaluate_mod(
    mod: Callable[..., Tensor],
    b: Tensor,
    h: Tensor,
    q: Tensor,
    kv: Tensor,
    score: Tensor | None = None,
) -> Tensor:
    """Evaluate ``mod`` at every point of the grid b x h x q x kv (1-D int64 vectors).

    Returns a (len(b), len(h), len(q), len(kv)) tensor. With ``score`` (same shape) the
    mod is treated as a score_mod.
    """
    with IndexWithTensors():
        if score is None:
            result = vmap_over_bhmn(mod, False, 0)(b, h, q, kv)
        else:
            result = vmap_over_bhmn(mod, True, 0)(score, b, h, q, kv)
    expected = (b.numel(), h.numel(), q.numel(), kv.numel())
    if not isinstance(result, Tensor) or tuple(result.shape) != expected:
        shape = tuple(result.shape) if isinstance(result, Tensor) else type(result).__name__
        raise ValueError(
            f"{mod_name(mod)} must return one 0-d tensor per (b, h, q_idx, kv_idx); "
            f"over the grid {expected} it returned {shape}"
        )
    return result


def index_vectors(B: int, H: int, q_start: int, q_stop: int, KV_LEN: int, device):
    """The grid's index vectors: batches, heads, queries q_start..q_stop-1, keys."""
    arange = lambda start, stop: torch.arange(start, stop, device=device)  # noqa: E731
    return arange(0, B), arange(0, H), arange(q_start, q_stop), arange(0, KV_LEN)


def _reduce_axis_to_blocks(
    any_flags: Tensor, all_flags: Tensor, dim: int, block: int
) -> tuple[Tensor, Tensor]:
    """Group axis ``dim`` (negative) in runs of ``block``; reduce each run to any / all.

    A trailing run shorter than ``block`` stands for a block that hangs past the end of
    the sequence; its missing positions count as masked, as in torch's create_block_mask,
    so such a block is partial at best (see the module docstring, "Edge blocks").
    """
    length = any_flags.shape[dim]
    whole = length // block
    aligned = whole * block
    any_parts, all_parts = [], []
    if whole:
        # Splitting a dim in place is a view, even on a narrowed tensor; after the split
        # the run axis sits at ``dim`` because ``dim`` counts from the end.
        runs_any = any_flags.narrow(dim, 0, aligned).unflatten(dim, (whole, block))
        runs_all = all_flags.narrow(dim, 0, aligned).unflatten(dim, (whole, block))
        any_parts.append(runs_any.any(dim))
        all_parts.append(runs_all.all(dim))
    if aligned < length:
        tail_any = any_flags.narrow(dim, aligned, length - aligned).any(dim, keepdim=True)
        any_parts.append(tail_any)
        all_parts.append(torch.zeros_like(tail_any))
    if len(any_parts) == 1:
        return any_parts[0], all_parts[0]
    return torch.cat(any_parts, dim), torch.cat(all_parts, dim)


_BYTES_PER_WORD = 8
_ALL_TRUE_WORD = int.from_bytes(bytes([1] * _BYTES_PER_WORD), "little")


def _as_words(allowed: Tensor, kv_block: int) -> Tensor | None:
    """View a bool mask as int64 words of 8 consecutive KV positions, if the layout allows.

    A bool is one byte holding 0 or 1, so a word is 0 when its 8 positions are all
    masked and ``_ALL_TRUE_WORD`` when all are allowed; reducing words instead of bools
    does 8x fewer element operations. Needs whole words per block and 8-byte aligned rows.
    """
    if kv_block % _BYTES_PER_WORD or allowed.dim() == 0 or allowed.stride(-1) != 1:
        return None
    if allowed.shape[-1] % _BYTES_PER_WORD or allowed.storage_offset() % _BYTES_PER_WORD:
        return None
    if any(stride % _BYTES_PER_WORD for stride in allowed.stride()[:-1]):
        return None  # Tensor.view checks every stride, those of size-1 dims too
    return allowed.view(torch.uint8).view(torch.int64)


def _reduce_kv_axis(allowed: Tensor, kv_block: int, use_words: bool) -> tuple[Tensor, Tensor]:
    """(..., rows, KV) bool -> per KV block (any, all) flags (..., rows, KVB).

    ``use_words`` enables the int64-word shortcut (eager only: under torch.compile the
    layout checks cannot be traced, and Inductor fuses the plain reduction anyway).
    """
    kv_len = allowed.shape[-1]
    whole = kv_len // kv_block
    aligned_part = allowed.narrow(-1, 0, whole * kv_block)
    words = _as_words(aligned_part, kv_block) if whole and use_words else None
    if words is None:
        return _reduce_axis_to_blocks(allowed, allowed, -1, kv_block)
    runs = words.unflatten(-1, (whole, kv_block // _BYTES_PER_WORD))
    any_kv = runs.ne(0).any(-1)
    all_kv = runs.eq(_ALL_TRUE_WORD).all(-1)
    if whole * kv_block < kv_len:
        tail = allowed.narrow(-1, whole * kv_block, kv_len - whole * kv_block)
        tail_any = tail.any(-1, keepdim=True)
        any_kv = torch.cat([any_kv, tail_any], -1)
        all_kv = torch.cat([all_kv, torch.zeros_like(tail_any)], -1)  # hanging: never full
    return any_kv, all_kv


def _reduce_to_block_flags(
    allowed: Tensor, q_block: int, kv_block: int, use_words: bool = True
) -> tuple[Tensor, Tensor]:
    """Element mask (b, h, rows, KV) -> per-block (any, all) flags (b, h, QB, KVB).

    The KV axis is reduced first (it is the contiguous one and shrinks the data
    kv_block-fold), then the query axis on the already small tensor.
    """
    any_kv, all_kv = _reduce_kv_axis(allowed, kv_block, use_words)
    return _reduce_axis_to_blocks(any_kv, all_kv, -2, q_block)


def chunk_plan(B: int, H: int, QB: int, q_block: int, KV_LEN: int, budget: int):
    """Chunk sizes (batches, heads, query blocks) of at most ``budget`` mask elements.

    The unit is one query block of one (batch, head): q_block * KV_LEN elements. Query
    blocks are grown first, then heads, then batches. At least one unit is evaluated
    per chunk even if it alone exceeds the budget.
    """
    units = max(1, budget // (q_block * KV_LEN))
    q_blocks = min(QB, units)
    heads = min(H, max(1, units // q_blocks)) if q_blocks == QB else 1
    batches = min(B, max(1, units // (q_blocks * heads))) if heads == H and q_blocks == QB else 1
    return batches, heads, q_blocks


def _evaluate_chunk(
    mask_mod: MaskMod,
    b: Tensor,
    h: Tensor,
    q: Tensor,
    kv: Tensor,
    q_block: int,
    kv_block: int,
    use_words: bool = True,
) -> tuple[Tensor, Tensor]:
    """Evaluate ``mask_mod`` on one chunk of the grid and reduce it to block flags."""
    return _reduce_to_block_flags(evaluate_mask(mask_mod, b, h, q, kv), q_block, kv_block, use_words=use_words)


def evaluate_mask(mask_mod: MaskMod, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    """``evaluate_mod`` of a mask_mod, which must give bools."""
    allowed = evaluate_mod(mask_mod, b, h, q, kv)
    if allowed.dtype != torch.bool:
        raise TypeError(
            f"mask_mod {mod_name(mask_mod)} must return a bool tensor, got {allowed.dtype}"
        )
    return allowed


def traced_block_flags(
    mask_mod: MaskMod, B: Any, H: Any, Q_LEN: Any, KV_LEN: Any, device: torch.device, q_block: int, kv_block: int
) -> tuple[Tensor, Tensor]:
    """Block (any, all) flags (B, H, QB, KVB) of the whole grid in one evaluation, for
    create_block_mask traced by torch.compile.

    Dynamo would unroll the chunk loop, and its trip counts and the short edge tiles
    guard on the exact sizes, so every new B, H or length would recompile (and a long
    grid would trace for minutes). Here nothing branches on a size: the grid is padded
    to whole tiles, padded positions are evaluated at the last real index (mask_mod
    never sees an index out of range) and then left out of the reduction, so one trace
    serves all sizes and takes them symbolically. The element mask is built whole, as
    torch's create_block_mask does; Inductor fuses it into the reduction.

    A static query length shorter than the tile (a decoding step, a prefill chunk) is one
    tile of its own rows: padded to the tile, a one-query step would evaluate the mask 128
    times over.
    """
    QB, KVB = cdiv(Q_LEN, q_block), cdiv(KV_LEN, kv_block)
    q_rows = Q_LEN if isinstance(Q_LEN, int) and Q_LEN < q_block else q_block
    with torch.no_grad():
        q = torch.arange(QB * q_rows, device=device)
        kv = torch.arange(KVB * kv_block, device=device)
        b, h = torch.arange(B, device=device), torch.arange(H, device=device)
        allowed = evaluate_mask(mask_mod, b, h, q.clamp(max=Q_LEN - 1), kv.clamp(max=KV_LEN - 1))
        inside = (q < Q_LEN).unsqueeze(-1) & (kv < KV_LEN)

        def per_tile(flags: Tensor) -> Tensor:
            return flags.view(*flags.shape[:2], QB, q_rows, KVB, kv_block)

        # Padded positions count as masked: a tile hanging over an end is never full, as
        # in the chunked path.
        any_blocks = per_tile(allowed & inside).any(-1).any(-2)
        if q_rows < q_block:
            # The tile's rows past the query length are padding: never full.
            all_blocks = torch.zeros_like(any_blocks)
        else:
            all_blocks = per_tile(allowed & inside).all(-1).all(-2)
    return any_blocks, all_blocks


def _compiled_chunk_evaluator_uncached(backend: str):
    def evaluate(mask_mod, b, h, q, kv, q_block, kv_block):
        return _evaluate_chunk(mask_mod, b, h, q, kv, q_block, kv_block, use_words=False)

    # Not fullgraph: should a mask_mod defeat tracing, or the recompile limit be reached
    # after many distinct mask_mods, Dynamo falls back to eager instead of failing.
    return torch.compile(evaluate, backend=backend)


_COMPILED_EVALUATORS: dict[str, Callable[..., Any]] = {}


def _compiled_chunk_evaluator(backend: str) -> Callable[..., Any]:
    """One compiled chunk evaluator per backend, shared by all calls.

    The mask_mod is an argument (not a closure of a per-call function), so Dynamo's
    cache entries are reused across create_block_mask calls with the same mask_mod
    code, and chunk shapes become dynamic after the first recompile.
    """
    if backend not in _COMPILED_EVALUATORS:
        _COMPILED_EVALUATORS[backend] = _compiled_chunk_evaluator_uncached(backend)
    return _COMPILED_EVALUATORS[backend]


def chunked_block_flags(
    mask_mod: MaskMod,
    B: int,
    H: int,
    Q_LEN: int,
    KV_LEN: int,
    device: torch.device,
    q_block: int,
    kv_block: int,
    *,
    chunk_elements: int,
    compile_backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    """Block (any, all) flags (B, H, QB, KVB) of ``mask_mod``, evaluated a chunk of at
    most ``chunk_elements`` mask elements at a time (at least one query block of one
    (batch, head)); each chunk through ``torch.compile`` with ``compile_backend`` (fuses
    evaluation and reduction), or eagerly when it is None."""
    QB, KVB = cdiv(Q_LEN, q_block), cdiv(KV_LEN, kv_block)
    any_blocks = torch.empty(B, H, QB, KVB, dtype=torch.bool, device=device)
    all_blocks = torch.empty(B, H, QB, KVB, dtype=torch.bool, device=device)

    if compile_backend is not None:
        evaluate_chunk = functools.partial(_compiled_chunk_evaluator(compile_backend), mask_mod)
    else:
        evaluate_chunk = functools.partial(_evaluate_chunk, mask_mod)

    batches, heads, q_blocks = chunk_plan(B, H, QB, q_block, KV_LEN, chunk_elements)
    kv = torch.arange(KV_LEN, device=device)
    with torch.no_grad():
        for b0 in range(0, B, batches):
            b = torch.arange(b0, min(b0 + batches, B), device=device)
            for h0 in range(0, H, heads):
                h = torch.arange(h0, min(h0 + heads, H), device=device)
                for qb0 in range(0, QB, q_blocks):
                    qb1 = min(qb0 + q_blocks, QB)
                    q = torch.arange(qb0 * q_block, min(qb1 * q_block, Q_LEN), device=device)
                    chunk_any, chunk_all = evaluate_chunk(b, h, q, kv, q_block, kv_block)
                    where = (slice(b0, b0 + b.numel()), slice(h0, h0 + h.numel()), slice(qb0, qb1))
                    any_blocks[where] = chunk_any
                    all_blocks[where] = chunk_all
    return any_blocks, all_blocks

"""The two operators flexattn's CPU lowering (``lowering.py``) emits, which run the C++
engine.

``flexattn::cpu_flash_forward`` and ``flexattn::cpu_flash_backward`` take the call's
tensors, its block tables, the tensors its mods capture, the values of the symbolic
sizes the mods' indexing uses, the C++ source of its mod library and its plan (a JSON
object, ``plan.py``). They allocate the outputs and hand one ``abi.CallArgs`` to the
engine (``csrc/engine.cpp``), which runs the tile loops and calls the mod library
through function pointers. The libraries come from ``build.py``.
"""

from __future__ import annotations

import ctypes
import functools
import json
from typing import Any, Sequence

import torch

from .._hop import output_strides
from ..numerics import stats_dtype
from . import abi
from .build import CpuKernelError, blas_symbols, engine, mod_library

#: Engine return codes.
_ENGINE_ERRORS = {1: "an internal error", 2: "an unsupported dtype", 3: "running out of memory"}


@functools.lru_cache(maxsize=256)
def parse_plan(plan: str) -> dict[str, Any]:
    return json.loads(plan)


def _pointer_array(tensors: Sequence[torch.Tensor]):
    array = (ctypes.c_void_p * max(1, len(tensors)))()
    for i, t in enumerate(tensors):
        array[i] = t.data_ptr()
    return array


@functools.lru_cache(maxsize=256)
def _prototype(plan: str, mods: str) -> tuple[dict[str, Any], abi.CallArgs, int]:
    """(plan dict, the CallArgs fields that depend only on the plan and the mods, the math
    table's address): built once per compiled call, copied per run."""
    plan_dict = parse_plan(plan)
    args = abi.CallArgs()
    args.q_block, args.kv_block = plan_dict["q_block"], plan_dict["kv_block"]
    args.q_tile, args.kv_tile = plan_dict["q_tile"], plan_dict["kv_tile"]
    args.scale = plan_dict["scale"]
    args.deterministic = int(bool(plan_dict.get("deterministic")))
    args.sgemm, args.dgemm, args.blas_threads_local = blas_symbols()
    if mods:
        _, score, mask, joint = mod_library(mods)
        args.score_fn = score if plan_dict.get("score") else None
        args.mask_fn = mask if plan_dict.get("mask") else None
        args.joint_fn = joint if plan_dict.get("joint") else None
    return plan_dict, args, engine().fa_math()


def _call_args(plan: str, query, key, value, kv_num, kv_idx, full_num, full_idx, buffers, symbols, mods,
               keep_alive: list) -> tuple[dict[str, Any], abi.CallArgs]:
    """The plan's dict and the CallArgs fields that forward and backward share."""
    plan_dict, prototype, math = _prototype(plan, mods)
    args = abi.CallArgs.from_buffer_copy(prototype)
    B, Hq, L, E = query.shape
    args.dtype = abi.DTYPE_CODES[query.dtype]
    args.B, args.Hq, args.Hkv, args.L, args.S, args.E, args.Ev = B, Hq, key.shape[1], L, key.shape[2], E, value.shape[-1]
    args.q, args.q_strides = abi.data(query), abi.strides(query, 4)
    args.k, args.k_strides = abi.data(key), abi.strides(key, 4)
    args.v, args.v_strides = abi.data(value), abi.strides(value, 4)
    if _present(kv_num, kv_idx):
        args.kv_num, args.kv_num_strides = kv_num.data_ptr(), abi.strides(kv_num, 3)
        args.kv_idx, args.kv_idx_strides = kv_idx.data_ptr(), abi.strides(kv_idx, 4)
        args.kv_idx_width = kv_idx.shape[-1]
    if _present(full_num, full_idx):
        args.full_num, args.full_num_strides = full_num.data_ptr(), abi.strides(full_num, 3)
        args.full_idx, args.full_idx_strides = full_idx.data_ptr(), abi.strides(full_idx, 4)
        args.full_idx_width = full_idx.shape[-1]
    args.threads = torch.get_num_threads()

    ctx = abi.ModContext()
    ctx.math = math
    if buffers:
        buffer_ptrs = _pointer_array(buffers)
        ctx.buffers = ctypes.addressof(buffer_ptrs)
        keep_alive += [buffer_ptrs, buffers]
    if symbols:
        symbol_values = (ctypes.c_int64 * len(symbols))(*[int(s) for s in symbols])
        ctx.symbols = ctypes.addressof(symbol_values)
        keep_alive.append(symbol_values)
    keep_alive.append(ctx)
    args.ctx = ctypes.addressof(ctx)
    return plan_dict, args


def _present(num: torch.Tensor | None, idx: torch.Tensor | None) -> bool:
    return num is not None and idx is not None and num.numel() > 0 and idx.numel() > 0


def _set_dropout(args: abi.CallArgs, plan: dict, seed: torch.Tensor | None) -> None:
    if seed is None or not plan.get("dropout_threshold"):
        return
    key, stream = (int(x) for x in seed.tolist())
    args.dropout_threshold = plan["dropout_threshold"]
    args.dropout_scale = plan["dropout_scale"]
    args.seed_key, args.seed_stream = key & (2**64 - 1), stream & (2**64 - 1)


@functools.lru_cache(maxsize=None)
def _entry(name: str):
    return getattr(engine(), name)


def _run(entry: str, args: abi.CallArgs) -> None:
    rc = _entry(entry)(ctypes.addressof(args))
    if rc:
        raise CpuKernelError(f"flexattn: the CPU attention {entry[3:]} failed with {_ENGINE_ERRORS.get(rc, rc)}")


# --------------------------------------------------------------------------------------
# The operators
# --------------------------------------------------------------------------------------
_LIBRARY = torch.library.Library("flexattn", "DEF")  # noqa: TOR901 - flexattn's own namespace
_LIBRARY.define(
    "cpu_flash_forward(Tensor query, Tensor key, Tensor value, Tensor kv_num_blocks, Tensor kv_indices, "
    "Tensor? full_kv_num_blocks, Tensor? full_kv_indices, Tensor? sinks, Tensor? dropout_seed, "
    "Tensor[] buffers, SymInt[] symbols, str mods, str plan) -> (Tensor, Tensor, Tensor)")
_LIBRARY.define(
    "cpu_flash_backward(Tensor query, Tensor key, Tensor value, Tensor out, Tensor logsumexp, "
    "Tensor grad_out, Tensor? grad_logsumexp, Tensor kv_num_blocks, Tensor kv_indices, Tensor? full_kv_num_blocks, "
    "Tensor? full_kv_indices, Tensor? dropout_seed, Tensor[] buffers, SymInt[] symbols, SymInt[] grad_sizes, "
    "str mods, str plan) -> (Tensor, Tensor, Tensor, Tensor[])")


def _forward_outputs(query, value, run: bool = False):
    """out, lse and max_scores; ``run`` (the real kernel, concrete sizes) takes a dense
    query's output without output_strides' sort, whose answer it is."""
    B, Hq, L, E = query.shape
    Ev = value.shape[-1]
    if run and query.stride() == (Hq * L * E, L * E, E, 1):
        out = torch.empty((B, Hq, L, Ev), dtype=query.dtype, device=query.device)
    else:
        out = torch.empty_strided((B, Hq, L, Ev), output_strides(query, Ev), dtype=query.dtype, device=query.device)
    lse = torch.empty((B, Hq, L), dtype=stats_dtype(query.dtype), device=query.device)
    return out, lse, torch.empty_like(lse)


def _grad_shapes(plan: dict, grad_sizes: Sequence) -> list[list]:
    shapes, at = [], 0
    for rank in plan.get("grad_ranks", []):
        shapes.append(list(grad_sizes[at:at + rank]))
        at += rank
    return shapes


def _backward_outputs(plan, query, key, value, grad_sizes):
    grads = [query.new_zeros(shape, dtype=stats_dtype(query.dtype)) for shape in _grad_shapes(plan, grad_sizes)]
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), grads


@torch.library.impl(_LIBRARY, "cpu_flash_forward", "CPU")
def _cpu_flash_forward(query, key, value, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, sinks,
                       dropout_seed, buffers, symbols, mods, plan):
    out, lse, max_scores = _forward_outputs(query, value, run=True)
    keep_alive: list = []
    plan_dict, args = _call_args(plan, query, key, value, kv_num_blocks, kv_indices, full_kv_num_blocks,
                                 full_kv_indices, buffers, symbols, mods, keep_alive)
    args.out, args.out_strides = out.data_ptr(), abi.strides(out, 4)
    args.lse, args.lse_strides = lse.data_ptr(), abi.strides(lse, 3)
    args.max_scores, args.max_strides = max_scores.data_ptr(), abi.strides(max_scores, 3)
    if sinks is not None:
        args.sinks, args.sinks_strides = sinks.data_ptr(), abi.strides(sinks, 2)
    _set_dropout(args, plan_dict, dropout_seed)
    _run("fa_forward", args)
    return out, lse, max_scores


@torch.library.register_fake("flexattn::cpu_flash_forward")
def _fake_cpu_flash_forward(query, key, value, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                            sinks, dropout_seed, buffers, symbols, mods, plan):
    return _forward_outputs(query, value)


@torch.library.impl(_LIBRARY, "cpu_flash_backward", "CPU")
def _cpu_flash_backward(query, key, value, out, logsumexp, grad_out, grad_logsumexp, kv_num_blocks, kv_indices,
                        full_kv_num_blocks, full_kv_indices, dropout_seed, buffers, symbols, grad_sizes, mods, plan):
    grad_query, grad_key, grad_value, grads = _backward_outputs(parse_plan(plan), query, key, value, grad_sizes)
    keep_alive: list = []
    plan_dict, args = _call_args(plan, query, key, value, kv_num_blocks, kv_indices, full_kv_num_blocks,
                                 full_kv_indices, buffers, symbols, mods, keep_alive)
    for name, t, n in (("out", out, 4), ("lse", logsumexp, 3), ("grad_out", grad_out, 4),
                       ("grad_lse", grad_logsumexp, 3), ("grad_q", grad_query, 4), ("grad_k", grad_key, 4),
                       ("grad_v", grad_value, 4)):
        setattr(args, name, abi.data(t))
        setattr(args, f"{name}_strides", abi.strides(t, n))
    grad_ptrs = _pointer_array(grads)
    numels = (ctypes.c_int64 * max(1, len(grads)))(*[g.numel() for g in grads])
    ctx = abi.ModContext.from_address(args.ctx)
    ctx.grads = ctypes.cast(grad_ptrs, ctypes.c_void_p)
    args.grad_numels, args.num_grads = ctypes.cast(numels, ctypes.c_void_p).value, len(grads)
    keep_alive += [grad_ptrs, numels]
    _set_dropout(args, plan_dict, dropout_seed)
    _run("fa_backward", args)
    return grad_query, grad_key, grad_value, grads


@torch.library.register_fake("flexattn::cpu_flash_backward")
def _fake_cpu_flash_backward(query, key, value, out, logsumexp, grad_out, grad_logsumexp, kv_num_blocks, kv_indices,
                             full_kv_num_blocks, full_kv_indices, dropout_seed, buffers, symbols, grad_sizes, mods,
                             plan):
    return _backward_outputs(parse_plan(plan), query, key, value, grad_sizes)

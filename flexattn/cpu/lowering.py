"""Lowering of CPU calls onto flexattn's C++ CPU engine (the calls ``uses_engine`` in
``flexattn/cpu/__init__.py`` gives it).

Forward and backward are one extern call each, of the operators in ``ops.py``:

1. The call is prepared as for the Triton kernels (``prepare_call`` of
   ``lowering/common.py``): q, k, v and the block tables realized and broadcast to the
   query's batch and heads, the mods lowered to Inductor IR.
2. ``mod_library.ModLibrary`` renders the mods' IR as the C++ of the call's mod library:
   score_mod (unless it is the identity), mask_mod (unless it is constant true) and, for
   the backward, score_mod's joint graph with the scatters of the captured tensors'
   gradients (``buffer_grads.scatter_terms``).
3. The plan (``plan.py``) and the call's constants travel as a JSON string; the
   captured tensors the library reads and the symbolic sizes its indexing uses are
   operator inputs, so the same graph serves every shape.

The engine computes the backward's delta (rowsum(dO * O) - dlse) itself, so a call's
graph holds no Inductor kernel of its own to compile; the captured tensors' gradients
come back as float32 (float64) accumulators and are cast to their tensors' dtypes after
it.
"""

from __future__ import annotations

import json
from typing import Any

import sympy
import torch
from torch._inductor import ir
from torch._inductor.lowering import fallback_handler, lowerings, to_dtype
from torch._inductor.virtualized import V

from .. import options as _options
from .._hop import buffers_with_grad
from ..lowering.buffer_grads import (JOINT_ARGS, finish_buffer_grad, graph_returning, joint_outputs, scalar_loader,
                                     scatter_terms)
from ..lowering.common import (PreparedCall, as_tensor_boxes, deterministic_requested, nonzero_or_none, prepare_call,
                               realize_fixed, sinks_for_kernel)
from ..lowering.subgraph import build_mod_buffer
from ..numerics import dropout_scale, dropout_threshold, stats_dtype
from . import ops  # noqa: F401 - defines the operators the calls below emit
from . import plan as cpu_plan
from .mod_library import GradTerm, ModLibrary

aten = torch.ops.aten


def _whole_buffer(name: str):
    """The IR of the buffer ``name`` that a mod reads (its loads index its storage)."""
    if name in V.graph.graph_inputs:
        return V.graph.graph_inputs[name]
    return ir.TensorBox.create(V.graph.get_buffer(name))


def _same_dtype_kv(query, key, value):
    """float8 keys and values (a quantised cache) widened to the query's dtype."""
    dtype = query.get_dtype()
    key = key if key.get_dtype() == dtype else to_dtype(key, dtype)
    value = value if value.get_dtype() == dtype else to_dtype(value, dtype)
    return key, value


def _plan_json(call: PreparedCall, scale: float, kernel_options: dict, library_flags: dict,
               **extra: Any) -> str:
    plan = cpu_plan.plan(cpu_plan.CpuPlanInputs(q_block=call.sparse_q, kv_block=call.sparse_kv))
    p = float(_options.read_internal(kernel_options, "DROPOUT_P"))
    return json.dumps({"q_block": call.sparse_q, "kv_block": call.sparse_kv, "q_tile": plan.q_tile,
                       "kv_tile": plan.kv_tile, "scale": float(scale),
                       "dropout_threshold": dropout_threshold(p) if p > 0 else 0,
                       "dropout_scale": dropout_scale(p) if p > 0 else 1.0, **library_flags, **extra},
                      sort_keys=True)


def _full_tables(call: PreparedCall) -> tuple:
    tables = call.tables
    if not call.has_full_blocks:
        return None, None
    return tables.full_kv_num_blocks, tables.full_kv_indices


def _mods(call: PreparedCall, dtype: torch.dtype) -> tuple[ModLibrary, dict]:
    """The library with score_mod and mask_mod, and which of the two it holds."""
    library = ModLibrary(stats_dtype(dtype))
    flags = {"score": bool(call.has_score_mod), "mask": False}
    if call.has_score_mod:
        library.add_score(call.score_buffer, dtype)
    flags["mask"] = library.add_mask(call.mask_buffer)
    return library, flags


def lower_cpu_forward(query, key, value, score_mod, block_mask, scale, kernel_options, score_mod_buffers,
                      mask_mod_buffers, sinks=None, dropout_seed=None):
    """out, lse, max_scores of a CPU call, from the engine's forward."""
    kernel_options = dict(kernel_options or {})
    dtype = query.get_dtype()
    key, value = _same_dtype_kv(query, key, value)
    call = prepare_call(query, key, value, score_mod, block_mask, kernel_options, score_mod_buffers,
                               mask_mod_buffers)
    library, flags = _mods(call, dtype)
    full_num, full_idx = _full_tables(call)
    kernel_sinks = sinks_for_kernel(sinks, call.query) if sinks is not None else None
    seed = realize_fixed(dropout_seed) if dropout_seed is not None else None
    outputs = fallback_handler(torch.ops.flexattn.cpu_flash_forward.default, add_to_fallback_set=False)(
        call.query, call.key, call.value, call.tables.kv_num_blocks, call.tables.kv_indices, full_num, full_idx,
        kernel_sinks, seed, [_whole_buffer(n) for n in library.buffers], list(library.symbols),
        library.source() if library.exports else "", _plan_json(call, scale, kernel_options, flags))
    return tuple(outputs)


def lower_cpu_backward(query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph, joint_graph,
                       block_mask, scale, kernel_options, score_mod_buffers, mask_mod_buffers, dropout_seed=None):
    """grad_query, grad_key, grad_value and the captured tensors' gradients of a CPU call."""
    kernel_options = dict(kernel_options or {})
    sizevars = V.graph.sizevars
    dtype = query.get_dtype()
    if key.get_dtype() != dtype or value.get_dtype() != dtype:
        raise ValueError("flexattn: Backward pass with mixed query, key, and value dtype is not supported "
                         f"(float8 keys and values serve inference), got query.dtype={dtype}, "
                         f"key.dtype={key.get_dtype()}, and value.dtype={value.get_dtype()}")
    B = query.get_size()[0]
    Bkv = key.get_size()[0]
    call = prepare_call(query, key, value, fw_graph, block_mask, kernel_options, score_mod_buffers,
                               mask_mod_buffers)
    library, flags = _mods(call, dtype)

    joint_gm = joint_graph.graph_module
    wants = buffers_with_grad(joint_gm, len(score_mod_buffers))
    captured = as_tensor_boxes(call.score_mod_buffers)
    terms: list[GradTerm] = []
    grad_shapes: list[list] = []
    for i, (buf, want, node) in enumerate(zip(call.score_mod_buffers, wants, joint_outputs(joint_gm)[1:])):
        if not want:
            continue
        what = f"captured tensor #{i} of score_mod"
        sizes = list(buf.get_size())
        for term in scatter_terms(node, len(sizes), what):
            terms.append(GradTerm(
                slot=len(grad_shapes),
                value_fn=scalar_loader(joint_gm, term.value, dtype, call.query.get_device(), captured, what),
                index_fns=[scalar_loader(joint_gm, idx, dtype, call.query.get_device(), captured, what)
                           for idx in term.indices],
                sizes=sizes))
        grad_shapes.append(sizes)
    flags["joint"] = bool(call.has_score_mod or terms)
    if flags["joint"]:
        grad_score = build_mod_buffer(graph_returning(joint_gm, joint_outputs(joint_gm)[0]), JOINT_ARGS, dtype,
                                      call.query.get_device(), captured, "score_mod's gradient (joint graph)",
                                      out_dtype=stats_dtype(dtype))
        library.add_joint(grad_score, terms, dtype)

    full_num, full_idx = _full_tables(call)
    seed = realize_fixed(dropout_seed) if dropout_seed is not None else None
    plan = _plan_json(call, scale, kernel_options, flags, grad_ranks=[len(s) for s in grad_shapes],
                      deterministic=deterministic_requested(kernel_options))
    grad_query, grad_key, grad_value, grads = fallback_handler(
        torch.ops.flexattn.cpu_flash_backward.default, add_to_fallback_set=False)(
        call.query, call.key, call.value, out, logsumexp, grad_out,
        nonzero_or_none(grad_logsumexp), call.tables.kv_num_blocks, call.tables.kv_indices, full_num, full_idx, seed,
        [_whole_buffer(n) for n in library.buffers], list(library.symbols),
        [s for shape in grad_shapes for s in shape], library.source() if library.exports else "", plan)

    # A KV batch of 1 shared by every query batch: its gradients are the sums over the
    # batch (as in the Triton lowering).
    if sizevars.statically_known_true(sympy.Eq(Bkv, 1)) and not sizevars.statically_known_true(sympy.Eq(B, 1)):
        grad_key = lowerings[aten.sum.dim_IntList](grad_key, [0], True)
        grad_value = lowerings[aten.sum.dim_IntList](grad_value, [0], True)
    grads = iter(grads)
    buffer_grads = tuple(finish_buffer_grad(next(grads), buf) if want else None
                         for buf, want in zip(score_mod_buffers, wants))
    return grad_query, grad_key, grad_value, buffer_grads

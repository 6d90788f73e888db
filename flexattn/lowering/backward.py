"""Inductor lowering of ``flex_attention_backward_hop``.

``lower_flex_attention_backward`` is the function registered for the backward HOP. Per
call it picks the backend from the device, as the forward does (``use_triton_template``):

* Triton (CUDA tensors; CPU tensors when ``cpu_backend == "triton"``): the fused,
  block-sparse template ``templates/backward.py.jinja`` (see ``lower_to_template``).
* Other CPU calls: the dense decomposition (``lower_dense_backward``): autograd through
  the forward engineer's dense attention, traced by ``make_fx`` and lowered node by node
  with the machinery of ``dense.py``, so Inductor's C++ backend compiles it.

Template path, step by step:

1. delta = rowsum(dO * O) in float32 as an Inductor reduction (one fused pass over dO
   and O). With a gradient of the log-sum-exp, d lse_i / d s_ij = p_ij, so
   ds_ij = p_ij * (dp_ij - delta_i + dlse_i): the kernel reads ``delta - dlse`` and needs
   no extra input.
2. The score_mod forward graph, the mask_mod graph and the grad-score output of the
   joint graph become the template's subgraphs 0, 1 and 2 (``subgraph.build_mod_buffer``).
3. Each captured-buffer gradient of the joint graph is recognised as a sum of scatters
   (``index_put(zeros, indices, values, accumulate=True)``, or a 0-d buffer's
   elementwise gradient) and rebuilt as Inductor ``Scatter`` nodes with mode
   ``atomic_add`` into a zero-filled float32 buffer (subgraph 3). The kernel's KV-tile
   programs issue them; the result is cast to the buffer's dtype afterwards.
4. One template choice per usable tile configuration (``backward_configs.py``).

kernel_options read here: the ``bwd_*`` tile keys (see ``backward_configs``),
DETERMINISTIC (also on under ``torch.use_deterministic_algorithms(True)``),
DEBUG_CONFIG (log the chosen configuration at WARNING).
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any, Sequence

import sympy
import torch
from torch._inductor import config as inductor_config
from torch._inductor import ir
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.lowering import empty_strided, lowerings, to_dtype
from torch._inductor.select_algorithm import SymbolicGridFn, TritonTemplate
from torch._inductor.subgraph_lowering import PointwiseSubgraphLowering
from torch._inductor.virtualized import V, ops
from torch.utils._sympy.functions import FloorDiv, Mod

from .. import _compat
from .._hop import BM_MASK_MOD, buffers_with_grad, dense_math
from ..templates import kernel_source
from . import backward_configs as bcfgs
from .configs import shared_memory_limit
from .dense import _example, _lower_graph, _static, broadcastable_mod, dense_attention
from .forward import (
    as_tensor_boxes,
    broadcast_to,
    float32_precision,
    next_power_of_two_at_least_16,
    realize_fixed,
    use_triton_template,
)
from .subgraph import MASK_MOD_ARGS, SCORE_MOD_ARGS, ModLoweringError, build_mod_buffer, is_identity_score_mod

log = logging.getLogger("flexattn.lowering")

aten = torch.ops.aten
TEMPLATE_NAME = "flexattn_backward"

#: Placeholders of the joint graph: score_mod's, then the incoming gradient of the score.
JOINT_ARGS: tuple[tuple[str, torch.dtype | None], ...] = SCORE_MOD_ARGS + (("grad_score_out", None),)


class DeterministicBufferGradError(RuntimeError):
    """Deterministic mode was asked for, but a captured tensor needs a gradient, which
    the kernel accumulates with float atomics (order-dependent)."""


def lower_flex_attention_backward(
    query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph, joint_graph,
    block_mask, scale, kernel_options, score_mod_buffers=(), mask_mod_buffers=(),
):
    """The lowering registered for ``flexattn._hop.flex_attention_backward_hop``."""
    device = query.get_device()
    if use_triton_template(device):
        return lower_to_template(query, key, value, out, logsumexp, grad_out, grad_logsumexp,
                                 fw_graph, joint_graph, block_mask, scale, kernel_options,
                                 score_mod_buffers, mask_mod_buffers)
    if device.type == "cpu":
        log.info("flexattn backward on CPU with cpu_backend=%r: dense decomposition",
                 _compat.inductor_cpu_backend())
        return lower_dense_backward(query, key, value, out, logsumexp, grad_out, grad_logsumexp,
                                    fw_graph, joint_graph, block_mask, scale,
                                    score_mod_buffers, mask_mod_buffers)
    raise NotImplementedError(f"flexattn: no backward kernel for device type {device.type!r}")


# --------------------------------------------------------------------------------------
# Dense CPU path
# --------------------------------------------------------------------------------------
def _trace_dense_backward(graph_inputs, grad_logsumexp_present, score_graph, joint_graph,
                          block_mask, scale, n_score_buffers):
    """The aten graph of the dense gradients (autograd through the dense attention)."""
    mask_graph = block_mask[BM_MASK_MOD]
    mask_tensors = list(block_mask[2:10])
    present = [i for i, t in enumerate(mask_tensors) if t is not None]
    wants = buffers_with_grad(joint_graph, n_score_buffers)
    n_fixed = 5 if grad_logsumexp_present else 4
    use_broadcast = broadcastable_mod(score_graph) and broadcastable_mod(mask_graph)

    def dense_backward(q, k, v, grad_out, *rest):
        grad_lse = rest[0] if grad_logsumexp_present else None
        rest = rest[n_fixed - 4:]
        tensors = [None] * len(mask_tensors)
        for slot, t in zip(present, rest[: len(present)]):
            tensors[slot] = t
        buffers = list(rest[len(present):])
        bm = (*block_mask[:2], *tensors, *block_mask[10:BM_MASK_MOD], mask_graph)
        score_buffers = buffers[:n_score_buffers]
        grad_positions = [i for i, w in enumerate(wants) if w]
        # The broadcasting variant computes its softmax in float32; float64 calls keep
        # the reference's float64 math.
        math = dense_attention if use_broadcast and q.dtype != torch.float64 else dense_math

        def attention(q, k, v, *differentiable_buffers):
            full = list(score_buffers)
            for i, b in zip(grad_positions, differentiable_buffers):
                full[i] = b
            o, lse, _ = math(q, k, v, score_graph, bm, scale, full, buffers[n_score_buffers:])
            return o, lse

        # torch.func.vjp, not torch.autograd: it composes with the functionalize
        # transform the trace runs under.
        (o, lse), vjp = torch.func.vjp(attention, q, k, v, *(score_buffers[i] for i in grad_positions))
        grads = vjp((grad_out, grad_lse if grad_lse is not None else torch.zeros_like(lse)))
        return tuple(grads)

    examples = [_example(x) for x in graph_inputs]
    traced = _compat.make_fx(torch.func.functionalize(dense_backward),
                             decomposition_table=select_decomp_table(),
                             tracing_mode="fake")(*examples)
    return traced, wants


def lower_dense_backward(query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph,
                         joint_graph, block_mask, scale, score_mod_buffers, mask_mod_buffers):
    """grad_q, grad_k, grad_v, grad_buffers computed densely (see the module docstring)."""
    block_mask = tuple(block_mask)
    lengths = tuple(_static(n) for n in block_mask[:2])
    block_sizes = tuple(_static(n) for n in block_mask[10:BM_MASK_MOD])
    graph_block_mask = (*lengths, *block_mask[2:10], *block_sizes, block_mask[BM_MASK_MOD].graph_module)
    mask_tensors = [t for t in block_mask[2:10] if t is not None]
    graph_inputs = [query, key, value, grad_out]
    if grad_logsumexp is not None:
        graph_inputs.append(grad_logsumexp)
    graph_inputs += [*mask_tensors, *score_mod_buffers, *mask_mod_buffers]
    graph_inputs = [realize_fixed(x) for x in graph_inputs]
    traced, wants = _trace_dense_backward(
        graph_inputs, grad_logsumexp is not None, fw_graph.graph_module, joint_graph.graph_module,
        graph_block_mask, scale, len(score_mod_buffers))
    grads = _lower_graph(traced, as_tensor_boxes(graph_inputs))
    buffer_grads = iter(grads[3:])
    grad_buffers = tuple(next(buffer_grads) if w else None for w in wants)
    return grads[0], grads[1], grads[2], grad_buffers


def lower_to_template(*args, **kwargs):
    raise NotImplementedError("flexattn: the fused backward template is not written yet")

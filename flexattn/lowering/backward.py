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
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch._inductor import config as inductor_config
from torch._inductor import ir
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.lowering import empty_strided, lowerings, to_dtype
from torch._inductor.select_algorithm import SymbolicGridFn, TritonTemplate
from torch._inductor.virtualized import V, ops
from torch.utils._sympy.functions import Mod

from .. import _compat
from .._hop import BM_MASK_MOD, buffers_with_grad, dense_math
from ..templates import kernel_source
from . import backward_configs as bcfgs
from .configs import shared_memory_limit
from .dense import _example, _lower_graph, _static, broadcastable_mod, dense_attention
from .forward import (as_tensor_boxes, broadcast_to, captured_for_kernel, realize_fixed, report_choice,
                      template_choices, use_triton_template)
from .subgraph import (MASK_MOD_ARGS, SCORE_MOD_ARGS, build_mod_buffer, depends_on, gathered_tile_bytes,
                       is_identity_score_mod, use_fast_tanh)

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
    from .subgraph import inline_scalar_items

    inline_scalar_items(fw_graph, joint_graph, block_mask[-1])
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



# --------------------------------------------------------------------------------------
# Template path: the joint graph as subgraphs
# --------------------------------------------------------------------------------------
def graph_returning(gm: torch.fx.GraphModule, node: torch.fx.Node) -> torch.fx.GraphModule:
    """A copy of ``gm`` that returns ``node`` alone (placeholders kept, dead code dropped)."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "output":
            break
        env[n] = graph.node_copy(n, lambda x: env[x])
    graph.output(env[node])
    # Dead-code elimination that also drops the in-place scatters of buffer gradients
    # (fx's own keeps every mutating node).
    for n in reversed(list(graph.nodes)):
        if n.op == "call_function" and not n.users:
            graph.erase_node(n)
    return torch.fx.GraphModule(gm, graph)


def _joint_outputs(joint_gm: torch.fx.GraphModule) -> list:
    output = next(n for n in joint_gm.graph.nodes if n.op == "output")
    results = output.args[0]
    return list(results) if isinstance(results, (tuple, list)) else [results]


_ZERO_FILLS = {aten.new_zeros.default, aten.zeros.default, aten.zeros_like.default}
_INDEX_PUTS = {aten.index_put.default, aten.index_put_.default, aten._unsafe_index_put.default}


@dataclass
class ScatterTerm:
    """One ``grad[indices] += value`` of a captured buffer's gradient (0-d buffers have
    no indices: every (q, kv) pair adds into the single entry)."""

    indices: list[torch.fx.Node]
    value: torch.fx.Node


def _is_zero_fill(node: Any) -> bool:
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    if node.target in _ZERO_FILLS:
        return True
    return node.target in (aten.full.default, aten.new_full.default) and node.args[-1] == 0


def _index_put_term(node: torch.fx.Node, buffer_rank: int) -> ScatterTerm | None:
    """``base[indices] += values`` as a ScatterTerm (None unless it accumulates with one
    tensor index per dimension)."""
    _, indices, values = node.args[:3]
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    if accumulate and len(indices) == buffer_rank and all(isinstance(i, torch.fx.Node) for i in indices):
        return ScatterTerm(list(indices), values)
    return None


def scatter_terms(node: torch.fx.Node, buffer_rank: int, what: str) -> list[ScatterTerm]:
    """A buffer gradient of the joint graph as a sum of scatters (see the module doc)."""
    if node.op == "call_function" and node.target is aten.add.Tensor and len(node.args) == 2 \
            and all(isinstance(a, torch.fx.Node) for a in node.args):
        return scatter_terms(node.args[0], buffer_rank, what) + scatter_terms(node.args[1], buffer_rank, what)
    if node.op == "call_function" and node.target in _INDEX_PUTS:
        term = _index_put_term(node, buffer_rank)
        if term is not None and _is_zero_fill(node.args[0]):
            return [term]
    if _is_zero_fill(node):
        # Functionalized graphs scatter in place into the zero fill they return.
        writers = [u for u in node.users if u.target is aten.index_put_.default and u.args[0] is node]
        terms = [_index_put_term(u, buffer_rank) for u in writers]
        if all(t is not None for t in terms):
            return terms
    if buffer_rank == 0:
        return [ScatterTerm([], node)]
    raise NotImplementedError(
        f"flexattn: cannot compute the gradient of {what} inside the backward kernel: its "
        f"gradient is built by {node.format_node()}. Supported: a tensor indexed with one "
        f"index per dimension (e.g. table[h, kv_idx - q_idx]), possibly several times, or a "
        f"0-d tensor used directly. Slices and partial indexing are not supported.")


def _scalar_loader(gm: torch.fx.GraphModule, node: torch.fx.Node, dtype, device, captured, what: str,
                   fast_tanh: bool = False):
    """An IR loader of ``node`` (a 0-d value of the joint graph) for the template."""
    buffer = build_mod_buffer(graph_returning(gm, node), JOINT_ARGS, dtype, device, captured, what,
                              fast_tanh=fast_tanh)
    return buffer.data.inner_fn


@dataclass
class BufferGradPlan:
    """How the backward kernel produces the gradients of captured tensors.

    * ``scatters`` (template subgraph 3, empty when none): per-element atomic adds, for
      buffers indexed by q_idx or kv_idx (a relative-bias table): each (q, kv) pair of a
      tile adds into its own entry.
    * ``reduced`` (pairs of subgraphs from ``REDUCED_GRAD_SUBGRAPH`` on): terms whose
      entry depends on b and h only (ALiBi slopes[h], a per-head scale, a 0-d
      temperature). The kernel sums such a term's values over the tile first and adds
      the sum with one atomic into ``workspace`` at the term's index subgraph: one
      atomic per tile instead of one per element, and a tree sum instead of a long
      chain of float32 additions into one address.
    * ``scatter_grads``: the zero-filled float32 buffers the scatters add into.
    * ``grads[i]``: the float32 gradient of captured tensor i (None if it needs none),
      a view into ``workspace`` for the reduced ones.
    """

    scatters: list
    scatter_grads: list
    reduced: list
    workspace: Any
    grads: list


def _linear_index_buffer(index_fns, sizes, base: int, device) -> ir.ComputedBuffer:
    """A 0-d int64 subgraph: ``base`` + the row-major offset of the entry the index
    loaders name in a tensor of ``sizes`` (negative indices wrap, as in Python)."""

    def inner_fn(_):
        total = ops.constant(base, torch.int64)
        stride = 1
        for fn, size in reversed(list(zip(index_fns, sizes))):
            idx = ops.to_dtype(fn(()), torch.int64)
            idx = ops.where(ops.lt(idx, ops.constant(0, torch.int64)),
                            ops.add(idx, ops.constant(size, torch.int64)), idx)
            total = ops.add(total, ops.mul(idx, ops.constant(stride, torch.int64)))
            stride *= size
        return total

    buffer = ir.ComputedBuffer(
        name=None, layout=ir.FlexibleLayout(device=device, dtype=torch.int64, size=[]),
        data=ir.Pointwise(device=device, dtype=torch.int64, inner_fn=inner_fn, ranges=[]))
    buffer.freeze_layout()
    return buffer


def plan_buffer_grads(joint_gm, score_mod_buffers, wants, dtype, device, fast_tanh: bool) -> BufferGradPlan:
    """The subgraphs and float32 buffers of the captured-tensor gradients (see
    ``BufferGradPlan``)."""
    results = _joint_outputs(joint_gm)[1:]
    captured = as_tensor_boxes(score_mod_buffers)
    placeholders = [n for n in joint_gm.graph.nodes if n.op == "placeholder"]
    per_pair = {placeholders[3], placeholders[4]}  # q_idx, kv_idx (JOINT_ARGS order)

    terms_of: dict[int, list[ScatterTerm]] = {}
    reducible: dict[int, bool] = {}
    for i, (buf, want, node) in enumerate(zip(score_mod_buffers, wants, results)):
        if want:
            sizes = list(buf.get_size())
            terms_of[i] = scatter_terms(node, len(sizes), f"captured tensor #{i} of score_mod")
            reducible[i] = all(isinstance(s, (int, sympy.Integer)) for s in sizes) and not any(
                depends_on(idx, per_pair) for t in terms_of[i] for idx in t.indices)

    offsets, total = {}, 0
    for i in terms_of:
        if reducible[i]:
            offsets[i] = total
            total += int(sympy.prod([int(s) for s in score_mod_buffers[i].get_size()]))
    workspace = realize_fixed(lowerings[aten.full.default]([max(total, 1)], 0.0, dtype=torch.float32,
                                                           device=device))

    scatters: list[ir.ComputedBuffer] = []
    reduced: list[ir.ComputedBuffer] = []
    scatter_grads: list[Any] = []
    grads: list[Any] = [None] * len(score_mod_buffers)
    for i, terms in terms_of.items():
        what = f"captured tensor #{i} of score_mod"
        sizes = [int(s) for s in score_mod_buffers[i].get_size()] if reducible[i] \
            else list(score_mod_buffers[i].get_size())
        if reducible[i]:
            numel = int(sympy.prod(sizes))
            view = lowerings[aten.slice.Tensor](ir.TensorBox(workspace), 0, offsets[i], offsets[i] + numel)
            grads[i] = lowerings[aten.view.default](view, sizes)
            for term in terms:
                value = build_mod_buffer(graph_returning(joint_gm, term.value), JOINT_ARGS, dtype, device,
                                         captured, what, fast_tanh=fast_tanh)
                index_fns = [_scalar_loader(joint_gm, idx, dtype, device, captured, what) for idx in term.indices]
                reduced += [value, _linear_index_buffer(index_fns, sizes, offsets[i], device)]
            continue
        grad = realize_fixed(lowerings[aten.full.default](sizes, 0.0, dtype=torch.float32, device=device))
        grads[i] = grad
        scatter_grads.append(grad)
        for term in terms:
            value_fn = _scalar_loader(joint_gm, term.value, dtype, device, captured, what, fast_tanh)
            index_fns = [_scalar_loader(joint_gm, idx, dtype, device, captured, what) for idx in term.indices]

            def output_indexer(_, index_fns=index_fns, sizes=sizes):
                return [ops.indirect_indexing(fn(()), size, check=False) for fn, size in zip(index_fns, sizes)]

            def value(_, value_fn=value_fn):
                return ops.to_dtype(value_fn(()), torch.float32)

            scatter = ir.Scatter(device=device, dtype=torch.float32, inner_fn=value, ranges=[],
                                 output_indexer=output_indexer, scatter_mode="atomic_add")
            scatters.append(ir.ComputedBuffer(name=grad.get_name(), layout=ir.MutationLayoutSHOULDREMOVE(grad),
                                              data=scatter))
    return BufferGradPlan(scatters=scatters, scatter_grads=scatter_grads, reduced=reduced, workspace=workspace, grads=grads)


# --------------------------------------------------------------------------------------
# Template path: the kernel
# --------------------------------------------------------------------------------------
@SymbolicGridFn
def backward_grid(batch, kv_heads, q_len, kv_len, meta, *, cdiv):
    """Launch grid of the backward kernel, from ``call_sizes`` = (B, Hkv, Q_LEN, KV_LEN).

    program_id(0) below cdiv(kv_len, BLOCK_N1) is a dK/dV program for that key tile; the
    rest are dQ programs, GQA_GROUP_SIZE * cdiv(q_len, BLOCK_M2) of them (query head of
    the group, then query tile, last tile first with REVERSED_Q_TILES), none with
    DQ_ATOMIC. program_id(1) is the batch index, program_id(2) the KV head.
    """
    dq_programs = 0 if meta["DQ_ATOMIC"] else meta["GQA_GROUP_SIZE"] * cdiv(q_len, meta["BLOCK_M2"])
    return cdiv(kv_len, meta["BLOCK_N1"]) + dq_programs, batch, kv_heads


backward_template = TritonTemplate(
    name=TEMPLATE_NAME,
    grid=backward_grid,
    source=kernel_source("backward"),
)


def deterministic_requested(kernel_options: dict[str, Any]) -> bool:
    return bool(kernel_options.get("DETERMINISTIC")) or torch.are_deterministic_algorithms_enabled()


def use_dq_atomics(kernel_options: dict[str, Any], device: torch.device, dtype: torch.dtype) -> bool:
    """Whether dQ comes from the dK/dV programs through float32 atomics (DQ_ATOMIC)
    rather than from dQ programs that recompute the scores.

    ``kernel_options["DQ_ATOMIC"]`` decides when given; by default the GPU generations
    and dtypes in ``bcfgs.DQ_ATOMIC_DEFAULT`` use it. Deterministic mode never does
    (asking for both is an error), nor do float64 inputs by default (gradcheck-grade
    sums want a fixed order).
    """
    requested = kernel_options.get("DQ_ATOMIC")
    deterministic = deterministic_requested(kernel_options)
    if requested is None:
        return not deterministic and dtype != torch.float64 and bcfgs.dq_atomic_default(device, dtype)
    if bool(requested) and deterministic:
        raise ValueError(
            "flexattn: kernel_options DQ_ATOMIC=True adds dQ with float atomics, whose order varies "
            "between runs, but deterministic mode (kernel_options DETERMINISTIC or "
            "torch.use_deterministic_algorithms) is on; drop one of them")
    return bool(requested)


def compute_delta(out, grad_out, grad_logsumexp):
    """rowsum(dO * O) in float32, minus the lse gradient when there is one (one fused
    reduction; see the module docstring for why the lse gradient folds in here)."""
    prod = lowerings[aten.mul.Tensor](to_dtype(out, torch.float32), to_dtype(grad_out, torch.float32))
    delta = lowerings[aten.sum.dim_IntList](prod, [-1])
    if grad_logsumexp is not None:
        delta = lowerings[aten.sub.Tensor](delta, to_dtype(grad_logsumexp, torch.float32))
    return realize_fixed(delta)


def _dense_like(sizes, device, dtype):
    return realize_fixed(empty_strided(sizes, None, dtype=dtype, device=device))


def lower_to_template(query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph,
                      joint_graph, block_mask, scale, kernel_options, score_mod_buffers,
                      mask_mod_buffers):
    from .forward import forward_specialisations

    kernel_options = dict(kernel_options or {})
    sizevars = V.graph.sizevars
    (_, _, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
     q_num_blocks, q_indices, full_q_num_blocks, full_q_indices,
     sparse_q, sparse_kv, mask_graph) = block_mask
    sparse_q = sizevars.guard_int(sparse_q)
    sparse_kv = sizevars.guard_int(sparse_kv)
    device = query.get_device()
    dtype = query.get_dtype()
    if key.get_dtype() != dtype or value.get_dtype() != dtype:
        raise ValueError("flexattn: the backward needs query, key and value of one dtype, got "
                         f"{dtype}, {key.get_dtype()}, {value.get_dtype()}")

    B, Hq, L, E = query.get_size()
    Bkv, Hkv, S, _ = key.get_size()
    Ev = value.get_size()[3]
    for name, length in (("query", L), ("key", S)):
        if sizevars.statically_known_true(sympy.Eq(length, 0)):
            raise ValueError(f"flexattn: the {name} length must be positive")

    joint_gm = joint_graph.graph_module
    wants = buffers_with_grad(joint_gm, len(score_mod_buffers))
    if any(wants) and deterministic_requested(kernel_options):
        raise DeterministicBufferGradError(
            "flexattn: deterministic mode (kernel_options DETERMINISTIC or "
            "torch.use_deterministic_algorithms) cannot give gradients to captured tensors: "
            "the backward kernel accumulates them with float32 atomic adds, whose order varies "
            "between runs. Detach the captured tensors (or turn deterministic mode off); the "
            "gradients of query, key and value are deterministic either way.")

    query = realize_fixed(query)
    key = broadcast_to(key, [B, Hkv, S, E])
    value = broadcast_to(value, [B, Hkv, S, Ev])
    logsumexp = realize_fixed(logsumexp)
    grad_out = realize_fixed(grad_out)
    delta = compute_delta(out, grad_out, grad_logsumexp)

    def per_query_head(node):
        if node is None:
            return None
        return broadcast_to(node, [B, Hq, *node.get_size()[2:]])

    kv_num_blocks, kv_indices = per_query_head(kv_num_blocks), per_query_head(kv_indices)
    q_num_blocks, q_indices = per_query_head(q_num_blocks), per_query_head(q_indices)
    has_full_blocks = full_kv_num_blocks is not None
    if has_full_blocks:
        full_kv_num_blocks, full_kv_indices = per_query_head(full_kv_num_blocks), per_query_head(full_kv_indices)
        full_q_num_blocks, full_q_indices = per_query_head(full_q_num_blocks), per_query_head(full_q_indices)
    else:
        # The kernel never reads these (HAS_FULL_BLOCKS=False); they fill the signature.
        full_kv_num_blocks, full_kv_indices, full_q_num_blocks, full_q_indices = (
            realize_fixed(empty_strided([0], [1], dtype=torch.int32, device=device)) for _ in range(4))

    score_mod_buffers = [captured_for_kernel(b, query) for b in score_mod_buffers]
    mask_mod_buffers = [captured_for_kernel(b, query) for b in mask_mod_buffers]
    captured = as_tensor_boxes(score_mod_buffers)
    has_score_mod = not is_identity_score_mod(fw_graph.graph_module)
    # The forward's choice (same options, dtype and device): the recomputed scores must
    # match the ones its logsumexp was taken over.
    fast_tanh = use_fast_tanh(kernel_options, dtype, device)
    score_buffer = build_mod_buffer(fw_graph.graph_module, SCORE_MOD_ARGS, dtype, device, captured, "score_mod",
                                    fast_tanh=fast_tanh)
    mask_buffer = build_mod_buffer(mask_graph.graph_module, MASK_MOD_ARGS, dtype, device,
                                   as_tensor_boxes(mask_mod_buffers), "mask_mod", fast_tanh=fast_tanh)
    grad_score_node = _joint_outputs(joint_gm)[0]
    grad_score_buffer = build_mod_buffer(graph_returning(joint_gm, grad_score_node), JOINT_ARGS, dtype,
                                         device, captured, "score_mod's gradient (joint graph)",
                                         fast_tanh=fast_tanh)
    grad_plan = plan_buffer_grads(joint_gm, score_mod_buffers, wants, dtype, device, fast_tanh)
    # Subgraph 3 is always present (an empty scatter list renders nothing), so the
    # reduced terms' pairs start at 4.
    subgraphs: list[Any] = [score_buffer, mask_buffer, grad_score_buffer, grad_plan.scatters,
                            *grad_plan.reduced]

    dq_atomic = use_dq_atomics(kernel_options, device, dtype)
    if dq_atomic:
        # Unscaled float32 sums of the atomic adds; scaled and cast after the kernel.
        grad_query = realize_fixed(lowerings[aten.full.default]([B, Hq, L, E], 0.0, dtype=torch.float32,
                                                                device=device))
    else:
        grad_query = _dense_like([B, Hq, L, E], device, dtype)
    # Tiles read (or, the dQ accumulator, reduced into) through descriptors with USE_TMA.
    tma_operands = [(grad_out, "output gradient")] + ([(grad_query, "dQ accumulator")] if dq_atomic else [])
    spec = forward_specialisations(
        query=query, key=key, value=value, scale=scale, kernel_options=kernel_options,
        sparse_q=sparse_q, sparse_kv=sparse_kv, has_full_blocks=has_full_blocks,
        has_score_mod=has_score_mod, kernel="backward", extra_tma_operands=tma_operands)
    spec["DQ_ATOMIC"] = dq_atomic
    known = sizevars.statically_known_true
    spec.update(
        HAS_BUFFER_GRADS=bool(grad_plan.scatters),
        NUM_REDUCED_GRAD_TERMS=len(grad_plan.reduced) // 2,
        REDUCED_GRAD_SUBGRAPH=4,
        FLOAT64_ACC=dtype == torch.float64,
        IS_DIVISIBLE_M=known(sympy.Eq(Mod(L, sparse_q), 0)),
        IS_DIVISIBLE_N=known(sympy.Eq(Mod(S, sparse_kv), 0)),
    )

    dk_layout = ir.FixedLayout(device, dtype, [B, Hkv, S, E], ir.FlexibleLayout.contiguous_strides([B, Hkv, S, E]))
    grad_value = _dense_like([B, Hkv, S, Ev], device, dtype)

    candidates = bcfgs.candidate_configs(device, spec["QK_HEAD_DIM_PAD"], dtype,
                                         bool(inductor_config.max_autotune), kernel_options)
    usable = bcfgs.usable_configs(
        candidates, kernel_options, sparse_q=sparse_q, sparse_kv=sparse_kv,
        qk_dim_pad=spec["QK_HEAD_DIM_PAD"], v_dim_pad=spec["V_HEAD_DIM_PAD"],
        elem_bytes=torch.empty((), dtype=dtype).element_size(), smem_limit=shared_memory_limit(device),
        gathered_bytes=(gathered_tile_bytes(fw_graph.graph_module, len(SCORE_MOD_ARGS))
                        + gathered_tile_bytes(mask_graph.graph_module, len(MASK_MOD_ARGS))),
        staged_dq=dq_atomic and spec["USE_TMA"])

    input_nodes = [query, key, value, logsumexp, delta, grad_out, grad_query, grad_value,
                   kv_num_blocks, kv_indices, q_num_blocks, q_indices,
                   full_kv_num_blocks, full_kv_indices, full_q_num_blocks, full_q_indices,
                   grad_plan.workspace]
    scatter_grads = grad_plan.scatter_grads
    mutated = [grad_query, grad_value, *scatter_grads] + ([grad_plan.workspace] if grad_plan.reduced else [])
    choices, config_of_choice = template_choices(
        backward_template, usable, "backward",
        lambda cfg: {**spec, "BLOCK_M1": cfg.block_m1, "BLOCK_N1": cfg.block_n1,
                     "BLOCK_M2": cfg.block_m2, "BLOCK_N2": cfg.block_n2, "ONE_KV_LOOP": cfg.one_kv_loop},
        input_nodes=input_nodes,
        layout=dk_layout,
        subgraphs=subgraphs,
        mutated_inputs=mutated,
        call_sizes=[B, Hkv, L, S],
    )

    extra = [b for b in (*score_mod_buffers, *mask_mod_buffers) if isinstance(b, ir.IRNode)]
    input_gen_fns = _benchmark_inputs(has_full_blocks, kv_indices, q_indices, full_kv_indices, full_q_indices)
    grad_key = _compat.autotune_select_node(
        TEMPLATE_NAME, choices, input_nodes + extra + scatter_grads, dk_layout, input_gen_fns=input_gen_fns)
    report_choice("backward", grad_key, config_of_choice, usable, spec,
                  ("GQA_GROUP_SIZE", "QK_HEAD_DIM_PAD", "V_HEAD_DIM_PAD", "HAS_FULL_BLOCKS", "HAS_SCORE_MOD",
                   "HAS_BUFFER_GRADS", "IS_DIVISIBLE_M", "IS_DIVISIBLE_N", "DQ_ATOMIC", "USE_TMA", "DENSE_KV"),
                  query, key, value, kernel_options)

    grad_key, grad_value = ir.TensorBox(grad_key) if not isinstance(grad_key, ir.TensorBox) else grad_key, \
        ir.TensorBox(grad_value)
    # A KV batch of 1 shared by every query batch: its gradients are the sums over the
    # batch. Any other KV batch equals the query batch (the API checks it), also when the
    # two are different symbols under dynamic shapes (Dynamo specialises sizes 0 and 1).
    if sizevars.statically_known_true(sympy.Eq(Bkv, 1)) and not sizevars.statically_known_true(sympy.Eq(B, 1)):
        grad_key = lowerings[aten.sum.dim_IntList](grad_key, [0], True)
        grad_value = lowerings[aten.sum.dim_IntList](grad_value, [0], True)
    buffer_grads = tuple(
        None if g is None else _finish_buffer_grad(g, buf) for g, buf in zip(grad_plan.grads, score_mod_buffers))
    grad_query = ir.TensorBox(grad_query)
    if spec["DQ_ATOMIC"]:
        grad_query = to_dtype(lowerings[aten.mul.Tensor](grad_query, float(scale)), dtype)
    return grad_query, grad_key, grad_value, buffer_grads


def _finish_buffer_grad(grad, buf):
    """The float32 accumulation ``grad`` as the gradient of the captured ``buf``."""
    grad = grad if isinstance(grad, ir.TensorBox) else ir.TensorBox(grad)
    if buf.get_dtype() != torch.float32:
        grad = to_dtype(grad, buf.get_dtype())
    return grad


def _benchmark_inputs(has_full_blocks, kv_indices, q_indices, full_kv_indices, full_q_indices):
    """Autotuning stand-ins for the block tables (positions in ``input_nodes``): every
    row visits all blocks (half partial, half full when there are full blocks)."""
    from .forward import _benchmark_block_counts, _benchmark_block_indices, _benchmark_full_block_indices

    if has_full_blocks:
        return {8: _benchmark_block_counts(kv_indices, 0.5), 9: _benchmark_block_indices,
                10: _benchmark_block_counts(q_indices, 0.5), 11: _benchmark_block_indices,
                12: _benchmark_block_counts(full_kv_indices, 0.5), 13: _benchmark_full_block_indices,
                14: _benchmark_block_counts(full_q_indices, 0.5), 15: _benchmark_full_block_indices}
    return {8: _benchmark_block_counts(kv_indices, 1.0), 9: _benchmark_block_indices,
            10: _benchmark_block_counts(q_indices, 1.0), 11: _benchmark_block_indices}


__all__ = ["backward_grid", "backward_template", "lower_flex_attention_backward"]

"""The gradients of a score_mod's captured tensors, computed inside the backward kernel.

The joint graph of score_mod (its forward and vjp over 0-d values) returns the score's
gradient and one gradient per captured tensor. Each captured-tensor gradient is
recognised as a sum of scatters (``index_put(zeros, indices, values, accumulate=True)``,
or a 0-d buffer's elementwise gradient) and rebuilt as template subgraphs
(``plan_buffer_grads``): per-element ``atomic_add`` scatters into zero-filled float32
buffers; for terms whose entry reads at most one of q_idx and kv_idx, the tile summed
over the other (or over both) with one atomic per key, query or tile into a workspace; for
terms whose entry reads them only through kv_idx - q_idx (a relative-position table), the
tile summed along its diagonals with one atomic per diagonal into the workspace. The
result is cast to the buffer's dtype afterwards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch._inductor import ir
from torch._inductor.lowering import lowerings, to_dtype
from torch._inductor.virtualized import ops

from .common import as_tensor_boxes, realize_fixed, signature_filler
from .subgraph import SCORE_MOD_ARGS, build_mod_buffer, depends_on

aten = torch.ops.aten

#: Placeholders of the joint graph: score_mod's, then the incoming gradient of the score.
JOINT_ARGS: tuple[tuple[str, torch.dtype | None], ...] = SCORE_MOD_ARGS + (("grad_score_out", None),)


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


def joint_outputs(joint_gm: torch.fx.GraphModule) -> list:
    output = next(n for n in joint_gm.graph.nodes if n.op == "output")
    results = output.args[0]
    return list(results) if isinstance(results, (tuple, list)) else [results]


def score_grad_is_upstream(joint_gm: torch.fx.GraphModule) -> bool:
    """True when the joint graph's score gradient is its ``grad_score_out`` argument, cast
    or times finite constants (no score_mod, additive biases, a fixed scale): the gradient
    is then 0 wherever dS is."""
    placeholders = [n for n in joint_gm.graph.nodes if n.op == "placeholder"]
    upstream = placeholders[[name for name, _ in JOINT_ARGS].index("grad_score_out")]
    node = joint_outputs(joint_gm)[0]
    while node is not upstream:
        if not isinstance(node, torch.fx.Node) or node.op != "call_function":
            return False
        if node.target in _CASTS:
            node = node.args[0]
        elif node.target in (aten.mul.Tensor, aten.div.Tensor) and len(node.args) == 2 \
                and isinstance(node.args[1], (int, float)) and math.isfinite(node.args[1]) and node.args[1] != 0:
            node = node.args[0]
        elif node.target is aten.mul.Tensor and isinstance(node.args[0], (int, float)) \
                and math.isfinite(node.args[0]):
            node = node.args[1]
        else:
            return False
    return True


_CASTS = {torch.ops.prims.convert_element_type.default, aten._to_copy.default, aten.clone.default}


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
    tensor index per dimension). Chained indexing (``table[q_idx][kv_idx]``) scatters a
    scatter: the outer index picks a row, the values are the row's own scatter into zeros;
    the two make one term indexed by both."""
    _, indices, values = node.args[:3]
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    if not accumulate or not all(isinstance(i, torch.fx.Node) for i in indices):
        return None
    if len(indices) == buffer_rank:
        return ScatterTerm(list(indices), values)
    if 0 < len(indices) < buffer_rank and isinstance(values, torch.fx.Node) and values.op == "call_function" \
            and values.target in _INDEX_PUTS and _is_zero_fill(values.args[0]):
        inner = _index_put_term(values, buffer_rank - len(indices))
        if inner is not None:
            return ScatterTerm([*indices, *inner.indices], inner.value)
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


def _through_difference(index: torch.fx.Node, pair: set) -> bool:
    """Whether ``index`` reads q_idx and kv_idx (``pair``) only through ``kv_idx - q_idx``
    (or ``q_idx - kv_idx``): then it is the same for every (q, kv) pair of a diagonal."""
    def not_the_difference(n: torch.fx.Node) -> bool:
        return not (n.target is aten.sub.Tensor and len(n.args) == 2 and set(n.args) == pair
                    and n.kwargs.get("alpha", 1) == 1)

    return not depends_on(index, pair, through=not_the_difference)


def scalar_loader(gm: torch.fx.GraphModule, node: torch.fx.Node, dtype, device, captured, what: str,
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
    * ``per_key`` and ``per_query`` (pairs after the reduced ones, in that order): terms
      whose entry reads kv_idx but not q_idx (a learnable bias per key), or q_idx but
      not kv_idx. The kernel sums the tile over its queries (keys) and adds each key's
      (query's) sum with one atomic, at the index subgraph evaluated on that key
      (query): a tile's keys or queries in atomics instead of all its pairs.
    * ``diagonal`` (pairs after the per-query ones): terms whose entry reads q_idx and
      kv_idx only through kv_idx - q_idx (a relative-position table, a bucket of the
      distance). Every pair of a tile's diagonal adds into one entry, so the kernel sums
      the tile along its diagonals (through its scratch slot in ``workspace``) and adds
      each sum with one atomic, at the index subgraph evaluated on one pair of the
      diagonal: BLOCK_N1 + BLOCK_M1 - 1 atomics per tile instead of one per pair.
    * ``scatter_grads``: the zero-filled float32 buffers the scatters add into.
    * ``grads[i]``: the float32 gradient of captured tensor i (None if it needs none),
      a view into ``workspace`` for the terms summed in the kernel.
    * ``scratch_offset``: the workspace element where the dK/dV programs' scratch slots
      start, after every gradient entry (0 without diagonal terms, which alone use it).
    """

    scatters: list
    scatter_grads: list
    reduced: list
    per_key: list
    per_query: list
    diagonal: list
    workspace: Any
    grads: list
    scratch_offset: int

    @property
    def summed(self) -> list:
        """The (value, workspace index) subgraphs of every term the kernel sums first."""
        return [*self.reduced, *self.per_key, *self.per_query, *self.diagonal]


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


def plan_buffer_grads(joint_gm, score_mod_buffers, wants, dtype, device, fast_tanh: bool,
                      scratch_elements: int | None) -> BufferGradPlan:
    """The subgraphs and float32 buffers of the captured-tensor gradients (see
    ``BufferGradPlan``). ``scratch_elements``: the workspace the diagonal terms' scratch
    slots take, None where the call's sizes are not static (such terms then scatter)."""
    results = joint_outputs(joint_gm)[1:]
    captured = as_tensor_boxes(score_mod_buffers)
    placeholders = [n for n in joint_gm.graph.nodes if n.op == "placeholder"]
    q_idx, kv_idx = placeholders[3], placeholders[4]  # JOINT_ARGS order

    terms_of: dict[int, list[ScatterTerm]] = {}
    # How the kernel adds each buffer's gradient: "reduced", "per_key", "per_query",
    # "diagonal" (into the workspace, so static sizes only) or "scatter" (see BufferGradPlan).
    kind: dict[int, str] = {}
    for i, (buf, want, node) in enumerate(zip(score_mod_buffers, wants, results)):
        if want:
            sizes = list(buf.get_size())
            terms_of[i] = scatter_terms(node, len(sizes), f"captured tensor #{i} of score_mod")
            indices = [idx for t in terms_of[i] for idx in t.indices]
            reads_q = any(depends_on(idx, {q_idx}) for idx in indices)
            reads_kv = any(depends_on(idx, {kv_idx}) for idx in indices)
            static = all(isinstance(s, (int, sympy.Integer)) for s in sizes)
            if not static:
                kind[i] = "scatter"
            elif reads_q and reads_kv:
                diagonal = scratch_elements is not None and all(
                    _through_difference(idx, {q_idx, kv_idx}) for idx in indices)
                kind[i] = "diagonal" if diagonal else "scatter"
            else:
                kind[i] = "per_query" if reads_q else "per_key" if reads_kv else "reduced"

    offsets, total = {}, 0
    for i in terms_of:
        if kind[i] != "scatter":
            offsets[i] = total
            total += int(sympy.prod([int(s) for s in score_mod_buffers[i].get_size()]))
    scratch_offset = 0
    if "diagonal" in kind.values():
        scratch_offset, total = total, total + scratch_elements
    # Without summed terms the kernel never touches the workspace: an empty buffer spares
    # the call a fill kernel's launch.
    workspace = (realize_fixed(lowerings[aten.full.default]([total], 0.0, dtype=torch.float32, device=device))
                 if total else signature_filler(device))

    scatters: list[ir.ComputedBuffer] = []
    summed: dict[str, list[ir.ComputedBuffer]] = {"reduced": [], "per_key": [], "per_query": [], "diagonal": []}
    scatter_grads: list[Any] = []
    grads: list[Any] = [None] * len(score_mod_buffers)
    for i, terms in terms_of.items():
        what = f"captured tensor #{i} of score_mod"
        sizes = [int(s) for s in score_mod_buffers[i].get_size()] if kind[i] != "scatter" \
            else list(score_mod_buffers[i].get_size())
        if kind[i] != "scatter":
            numel = int(sympy.prod(sizes))
            view = lowerings[aten.slice.Tensor](ir.TensorBox(workspace), 0, offsets[i], offsets[i] + numel)
            grads[i] = lowerings[aten.view.default](view, sizes)
            for term in terms:
                value = build_mod_buffer(graph_returning(joint_gm, term.value), JOINT_ARGS, dtype, device,
                                         captured, what, fast_tanh=fast_tanh)
                index_fns = [scalar_loader(joint_gm, idx, dtype, device, captured, what) for idx in term.indices]
                summed[kind[i]] += [value, _linear_index_buffer(index_fns, sizes, offsets[i], device)]
            continue
        grad = realize_fixed(lowerings[aten.full.default](sizes, 0.0, dtype=torch.float32, device=device))
        grads[i] = grad
        scatter_grads.append(grad)
        for term in terms:
            value_fn = scalar_loader(joint_gm, term.value, dtype, device, captured, what, fast_tanh)
            index_fns = [scalar_loader(joint_gm, idx, dtype, device, captured, what) for idx in term.indices]

            def output_indexer(_, index_fns=index_fns, sizes=sizes):
                return [ops.indirect_indexing(fn(()), size, check=False) for fn, size in zip(index_fns, sizes)]

            def value(_, value_fn=value_fn):
                return ops.to_dtype(value_fn(()), torch.float32)

            scatter = ir.Scatter(device=device, dtype=torch.float32, inner_fn=value, ranges=[],
                                 output_indexer=output_indexer, scatter_mode="atomic_add")
            scatters.append(ir.ComputedBuffer(name=grad.get_name(), layout=ir.MutationLayoutSHOULDREMOVE(grad),
                                              data=scatter))
    return BufferGradPlan(scatters=scatters, scatter_grads=scatter_grads, reduced=summed["reduced"],
                          per_key=summed["per_key"], per_query=summed["per_query"], diagonal=summed["diagonal"],
                          workspace=workspace, grads=grads, scratch_offset=scratch_offset)


def finish_buffer_grad(grad, buf):
    """The float32 accumulation ``grad`` as the gradient of the captured ``buf``."""
    grad = grad if isinstance(grad, ir.TensorBox) else ir.TensorBox(grad)
    if buf.get_dtype() != torch.float32:
        grad = to_dtype(grad, buf.get_dtype())
    return grad



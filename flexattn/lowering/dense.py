"""CPU path when Inductor's CPU backend is not Triton: the dense decomposition, lowered,
forward (``lower_dense``) and backward (``lower_dense_backward``).

The dense attention below (the reference's math, ``flexattn.reference.dense_math``) is traced
by ``make_fx`` with Inductor's decomposition table into an aten graph over the call's
tensors, and that graph's nodes are lowered one by one with Inductor's own lowerings
into the enclosing graph, so Inductor's C++ backend compiles it like any other aten code.

The mods are applied to whole (B, H, L, S) grids by broadcasting: b, h, q_idx, kv_idx
enter as (B,1,1,1), (1,H,1,1), (1,1,L,1), (1,1,1,S) index tensors. That is exact for
graphs made only of elementwise ops and tensor indexing (``broadcastable_mod``); a mod
graph with any other op goes through ``torch.vmap`` as in the reference, which is
correct but traces slowly (vmap loops over elements for ops without batching rules). It builds the full (B, H, L, S) score matrix:
correct, memory-hungry, and meant as the CPU path until a memory-bounded CPU kernel
exists. Shapes are specialised (guarded) to the call's sizes. The backward is autograd
(``torch.func.vjp``) through the same dense attention, traced and lowered the same way.
"""

from __future__ import annotations

from typing import Any, Sequence

import sympy
import torch
import torch.utils._pytree as pytree
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.lowering import fallback_handler, lowerings
from torch._inductor.virtualized import V

from .. import _compat
from .. import options as _options
from .._hop import buffers_with_grad
from .._mask_tuple import BlockMaskView
from ..reference import Dropout, dense_math, kv_block_columns, listed_grid, softmax_times_values
from .common import as_tensor_boxes, realize_fixed

#: Ops besides pointwise-tagged ones that act elementwise under broadcasting.
_BROADCAST_SAFE = {
    torch.ops.aten.full.default,
    torch.ops.aten.scalar_tensor.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.lift_fresh_copy.default,
    torch.ops.prims.convert_element_type.default,
}


def _reads_elements(index_node: torch.fx.Node) -> bool:
    """Whether an ``aten.index`` reads one element of a captured tensor per position: every
    dim indexed by a tensor. Partial indexing (``bias[b]``) leaves trailing dims that a
    later index (``bias[b][q_idx]``) would take for broadcast dims."""
    source, indices = index_node.args[0], index_node.args[1]
    if not isinstance(source, torch.fx.Node) or source.op not in ("placeholder", "get_attr"):
        return False
    value = source.meta.get("val")
    return value is not None and len(indices) == value.dim() and all(i is not None for i in indices)


def broadcastable_mod(gm: torch.fx.GraphModule) -> bool:
    """True when every op of the mod graph is elementwise (see the module docstring)."""
    for node in gm.graph.nodes:
        if node.op == "call_function":
            target = node.target
            if target in _BROADCAST_SAFE or (target is torch.ops.aten.index.Tensor and _reads_elements(node)):
                continue
            if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
                continue
            return False
        elif node.op not in ("placeholder", "output", "get_attr"):
            return False
    return True


def _index_grids(B: int, H: int, L: int, S: int, device) -> list[torch.Tensor]:
    shapes = ((B, 1, 1, 1), (1, H, 1, 1), (1, 1, L, 1), (1, 1, 1, S))
    return [torch.arange(n, dtype=torch.int32, device=device).view(shape)
            for n, shape in zip((B, H, L, S), shapes)]


def _block_grid(num: torch.Tensor, idx: torch.Tensor, L: int, S: int, q_block: int, kv_block: int) -> torch.Tensor:
    """(Bm, Hm, L, S) bool: entries inside a KV block listed among the first num of its row."""
    grid = listed_grid(num, idx, kv_block_columns(idx.shape[-1], S, kv_block))
    q_block_of = torch.arange(L, device=idx.device) // q_block
    kv_block_of = torch.arange(S, device=idx.device) // kv_block
    return grid[..., q_block_of, :][..., kv_block_of]


def dense_attention(query, key, value, score_mod, block_mask, scale, score_mod_buffers, mask_mod_buffers,
                    sinks=None, dropout=None):
    """``dense_math`` with the mods applied by broadcasting (same results)."""
    B, Hq, L, _ = query.shape
    S = key.shape[-2]
    group = Hq // key.shape[1]
    k = key.to(query.dtype).repeat_interleave(group, dim=1).expand(B, Hq, S, key.shape[-1])
    v = value.to(query.dtype).repeat_interleave(group, dim=1).expand(B, Hq, S, value.shape[-1])
    grids = _index_grids(B, Hq, L, S, query.device)
    scores = (query @ k.transpose(-2, -1)).to(torch.float32) * scale
    scores = score_mod(scores, *grids, *score_mod_buffers).to(torch.float32)
    bm = BlockMaskView(*block_mask)
    q_block, kv_block = bm.block_sizes
    allowed = _block_grid(bm.kv_num_blocks, bm.kv_indices, L, S, q_block, kv_block)
    allowed = allowed & bm.mask_mod(*grids, *mask_mod_buffers).to(torch.bool)
    if bm.full_kv_num_blocks is not None:
        allowed = allowed | _block_grid(bm.full_kv_num_blocks, bm.full_kv_indices, L, S, q_block, kv_block)
    allowed = allowed.expand(B, Hq, L, S)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return softmax_times_values(scores, allowed.any(dim=-1), v, sinks, dropout)


def _static(expr) -> int:
    return V.graph.sizevars.guard_int(expr)


def _example(node) -> Any:
    """A fake tensor (or int) standing for one IR input of the call."""
    if node is None:
        return None
    if isinstance(node, (sympy.Expr, int)):
        return _static(node)
    sizes = [_static(s) for s in node.get_size()]
    try:
        strides = [_static(s) for s in node.get_stride()]
    except NotImplementedError:
        # Views such as ExpandView have no fixed strides yet; the trace only needs a
        # tensor of the right size and dtype.
        strides = list(torch.empty(sizes, device="meta").stride())
    with V.fake_mode:
        return torch.empty_strided(sizes, strides, dtype=node.get_dtype(), device=node.get_device())


class _GraphBlockMask:
    """The block mask of a traced dense graph: static sizes, the mask_mod's graph, and
    the tables that are present as graph inputs (absent ones stay None)."""

    def __init__(self, block_mask):
        bm = BlockMaskView(*block_mask)
        self.view = bm._replace(q_len=_static(bm.q_len), kv_len=_static(bm.kv_len),
                                q_block_size=_static(bm.q_block_size), kv_block_size=_static(bm.kv_block_size),
                                mask_mod=bm.mask_mod.graph_module)
        self.present = [i for i, t in enumerate(bm.tables) if t is not None]

    def inputs(self) -> list:
        """The present tables, in order: graph inputs after q, k, v (and dO, dlse)."""
        return [self.view.tables[i] for i in self.present]

    def with_inputs(self, tensors) -> tuple:
        """The block-mask tuple inside the trace, from the traced present tables."""
        tables = [None] * len(self.view.tables)
        for slot, t in zip(self.present, tensors):
            tables[slot] = t
        return tuple(self.view.with_tables(tables))


def _attention_math(score_graph, mask_graph, dtype):
    """dense_attention (mods by broadcasting) when both mods allow it, else dense_math.
    The broadcasting variant computes its softmax in float32; float64 calls keep the
    reference's float64 math."""
    if broadcastable_mod(score_graph) and broadcastable_mod(mask_graph) and dtype != torch.float64:
        return dense_attention
    return dense_math


def _traced(fn, graph_inputs):
    examples = [_example(x) for x in graph_inputs]
    return _compat.make_fx(torch.func.functionalize(fn), decomposition_table=select_decomp_table(),
                           tracing_mode="fake")(*examples)


def _clamped_indices(source, indices: Sequence) -> list:
    """Integer indices clamped into ``source``'s dims. The dense path evaluates score_mod
    on every position, also those the block mask excludes, where a mod may index out of
    range (a page table past a sequence's pages); those scores are discarded, and the
    kernels never read them. Inductor's C++ bounds check would abort the process there."""
    sizes = source.get_size()
    clamped = []
    for dim, index in enumerate(indices):
        if index is not None and not index.get_dtype().is_floating_point and index.get_dtype() != torch.bool:
            size = sizes[dim]
            index = lowerings[torch.ops.aten.clamp_min.default](index, -size)
            index = lowerings[torch.ops.aten.clamp_max.default](index, size - 1)
        clamped.append(index)
    return clamped


def _lower_graph(gm: torch.fx.GraphModule, inputs: Sequence) -> list:
    """Lower every node of ``gm`` into the current Inductor graph; its outputs' IR."""
    env: dict[torch.fx.Node, Any] = {}
    placeholders = iter(inputs)
    saved_node = V.graph.current_node
    try:
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(placeholders)
            elif node.op == "get_attr":
                env[node] = V.graph.add_tensor_constant(getattr(gm, node.target))
            elif node.op == "call_function":
                args, kwargs = pytree.tree_map_only(torch.fx.Node, env.__getitem__, (node.args, node.kwargs))
                V.graph.current_node = node
                if node.target is torch.ops.aten.index.Tensor:
                    args = (args[0], _clamped_indices(args[0], args[1]))
                if node.target in lowerings:
                    env[node] = lowerings[node.target](*args, **kwargs)
                else:
                    env[node] = fallback_handler(node.target, add_to_fallback_set=False)(*args, **kwargs)
            elif node.op == "output":
                return pytree.tree_map_only(torch.fx.Node, env.__getitem__, node.args[0])
    finally:
        V.graph.current_node = saved_node
    raise AssertionError("graph without output")


def _optional_inputs(sinks, dropout_seed) -> list:
    """The sinks and the dropout seed among a dense graph's inputs (those present)."""
    return [t for t in (sinks, dropout_seed) if t is not None]


def _split_optional(rest, sinks, dropout_seed, kernel_options):
    """(sink, dropout, rest) inside a traced dense graph: the inputs ``_optional_inputs``
    added, as ``dense_math`` takes them, and the inputs after them."""
    sink, rest = (rest[0], rest[1:]) if sinks is not None else (None, rest)
    if dropout_seed is None:
        return sink, None, rest
    return sink, Dropout(float(_options.read_internal(kernel_options, "DROPOUT_P")), rest[0]), rest[1:]


def lower_dense(query, key, value, score_mod, block_mask, scale, kernel_options,
                score_mod_buffers, mask_mod_buffers, sinks=None, dropout_seed=None):
    """out, lse, max_scores of the call, computed densely (see the module docstring)."""
    graph_mask = _GraphBlockMask(block_mask)
    score_graph = score_mod.graph_module
    tables = graph_mask.inputs()
    n_tables, n_score = len(tables), len(score_mod_buffers)
    graph_inputs = [query, key, value, *_optional_inputs(sinks, dropout_seed), *tables, *score_mod_buffers,
                    *mask_mod_buffers]
    math = _attention_math(score_graph, graph_mask.view.mask_mod, query.get_dtype())

    def dense(q, k, v, *rest):
        sink, dropout, rest = _split_optional(rest, sinks, dropout_seed, kernel_options)
        bm = graph_mask.with_inputs(rest[:n_tables])
        buffers = rest[n_tables:]
        return math(q, k, v, score_graph, bm, scale, buffers[:n_score], buffers[n_score:], sink, dropout)

    out, lse, max_scores = _lower_graph(_traced(dense, graph_inputs), as_tensor_boxes(graph_inputs))
    return out, lse, max_scores


def lower_dense_backward(query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph,
                         joint_graph, block_mask, scale, score_mod_buffers, mask_mod_buffers, sinks=None,
                         kernel_options=None, dropout_seed=None):
    """grad_q, grad_k, grad_v, grad_buffers computed densely: the vjp of the dense
    attention (see the module docstring; the sinks' gradient is the autograd operator's)."""
    graph_mask = _GraphBlockMask(block_mask)
    score_graph = fw_graph.graph_module
    tables = graph_mask.inputs()
    n_tables, n_score = len(tables), len(score_mod_buffers)
    has_grad_lse = grad_logsumexp is not None
    graph_inputs = [query, key, value, grad_out, *([grad_logsumexp] if has_grad_lse else []),
                    *_optional_inputs(sinks, dropout_seed), *tables, *score_mod_buffers, *mask_mod_buffers]
    graph_inputs = [realize_fixed(x) for x in graph_inputs]
    wants = buffers_with_grad(joint_graph.graph_module, n_score)
    grad_positions = [i for i, w in enumerate(wants) if w]
    math = _attention_math(score_graph, graph_mask.view.mask_mod, query.get_dtype())

    def dense_backward(q, k, v, grad_out, *rest):
        grad_lse, rest = (rest[0], rest[1:]) if has_grad_lse else (None, rest)
        sink, dropout, rest = _split_optional(rest, sinks, dropout_seed, kernel_options)
        bm = graph_mask.with_inputs(rest[:n_tables])
        buffers = list(rest[n_tables:])
        score_buffers = buffers[:n_score]

        def attention(q, k, v, *differentiable_buffers):
            full = list(score_buffers)
            for i, b in zip(grad_positions, differentiable_buffers):
                full[i] = b
            o, lse, _ = math(q, k, v, score_graph, bm, scale, full, buffers[n_score:], sink, dropout)
            return o, lse

        # torch.func.vjp, not torch.autograd: it composes with the functionalize
        # transform the trace runs under.
        (o, lse), vjp = torch.func.vjp(attention, q, k, v, *(score_buffers[i] for i in grad_positions))
        return tuple(vjp((grad_out, grad_lse if grad_lse is not None else torch.zeros_like(lse))))

    grads = _lower_graph(_traced(dense_backward, graph_inputs), as_tensor_boxes(graph_inputs))
    buffer_grads = iter(grads[3:])
    return grads[0], grads[1], grads[2], tuple(next(buffer_grads) if w else None for w in wants)

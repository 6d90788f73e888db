"""CPU path when Inductor's CPU backend is not Triton: the dense decomposition, lowered.

The dense attention below (the reference's math, ``flexattn._hop.dense_math``) is traced
by ``make_fx`` with Inductor's decomposition table into an aten graph over the call's
tensors, and that graph's nodes are lowered one by one with Inductor's own lowerings
into the enclosing graph, so Inductor's C++ backend compiles it like any other aten code.

The mods are applied to whole (B, H, L, S) grids by broadcasting: b, h, q_idx, kv_idx
enter as (B,1,1,1), (1,H,1,1), (1,1,L,1), (1,1,1,S) index tensors. That is exact for
graphs made only of elementwise ops and tensor indexing (``broadcastable_mod``); a mod
graph with any other op goes through ``torch.vmap`` as in the reference, which is
correct but traces slowly (vmap loops over elements for ops without batching rules). It builds the full (B, H, L, S) score matrix:
correct, memory-hungry, and meant as the CPU path until a memory-bounded CPU kernel
exists. Shapes are specialised (guarded) to the call's sizes.
"""

from __future__ import annotations

from typing import Any, Sequence

import sympy
import torch
import torch.utils._pytree as pytree
from torch._inductor import ir
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.lowering import fallback_handler, lowerings
from torch._inductor.virtualized import V

from .. import _compat
from .._hop import BM_MASK_MOD, dense_math, kv_block_columns, listed_grid

#: Ops besides pointwise-tagged ones that act elementwise under broadcasting.
_BROADCAST_SAFE = {
    torch.ops.aten.index.Tensor,
    torch.ops.aten.full.default,
    torch.ops.aten.scalar_tensor.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.lift_fresh_copy.default,
    torch.ops.prims.convert_element_type.default,
}


def broadcastable_mod(gm: torch.fx.GraphModule) -> bool:
    """True when every op of the mod graph is elementwise (see the module docstring)."""
    for node in gm.graph.nodes:
        if node.op == "call_function":
            target = node.target
            if target in _BROADCAST_SAFE:
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


def dense_attention(query, key, value, score_mod, block_mask, scale, score_mod_buffers, mask_mod_buffers):
    """``dense_math`` with the mods applied by broadcasting (same results)."""
    B, Hq, L, _ = query.shape
    S = key.shape[-2]
    group = Hq // key.shape[1]
    k = key.repeat_interleave(group, dim=1).expand(B, Hq, S, key.shape[-1])
    v = value.repeat_interleave(group, dim=1).expand(B, Hq, S, value.shape[-1])
    grids = _index_grids(B, Hq, L, S, query.device)
    scores = (query @ k.transpose(-2, -1)).to(torch.float32) * scale
    scores = score_mod(scores, *grids, *score_mod_buffers).to(torch.float32)
    q_block, kv_block = block_mask[10], block_mask[11]
    allowed = _block_grid(block_mask[2], block_mask[3], L, S, q_block, kv_block)
    allowed = allowed & block_mask[BM_MASK_MOD](*grids, *mask_mod_buffers).to(torch.bool)
    if block_mask[4] is not None:
        allowed = allowed | _block_grid(block_mask[4], block_mask[5], L, S, q_block, kv_block)
    allowed = allowed.expand(B, Hq, L, S)
    scores = scores.masked_fill(~allowed, float("-inf"))
    row_max = scores.amax(dim=-1)
    live = row_max > float("-inf")
    safe_max = torch.where(live, row_max, torch.zeros_like(row_max))
    p = torch.exp(scores - safe_max[..., None])
    denom = p.sum(dim=-1)
    safe_denom = torch.where(live, denom, torch.ones_like(denom))
    lse = torch.where(live, torch.log(safe_denom) + safe_max, torch.full_like(denom, float("-inf")))
    out = (p / safe_denom[..., None]).to(query.dtype) @ v
    out = torch.where(live[..., None], out, torch.zeros_like(out))
    max_scores = torch.where(live, row_max, torch.full_like(row_max, float("-inf")))
    return out, lse, max_scores


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


def _trace(query, key, value, score_graph, block_mask, scale, score_mod_buffers, mask_mod_buffers):
    """The aten graph of dense_math for these inputs, and the IR inputs it takes in order."""
    mask_graph = block_mask[BM_MASK_MOD]
    mask_tensors = list(block_mask[2:10])
    present = [i for i, t in enumerate(mask_tensors) if t is not None]
    graph_inputs = [query, key, value, *(mask_tensors[i] for i in present),
                    *score_mod_buffers, *mask_mod_buffers]
    n_smb = len(score_mod_buffers)
    broadcastable = broadcastable_mod(score_graph) and broadcastable_mod(mask_graph)

    def dense(q, k, v, *rest):
        tensors = [None] * len(mask_tensors)
        for slot, t in zip(present, rest[: len(present)]):
            tensors[slot] = t
        buffers = rest[len(present):]
        bm = (*block_mask[:2], *tensors, *block_mask[10:BM_MASK_MOD], mask_graph)
        math = dense_attention if broadcastable else dense_math
        out, lse, max_scores = math(q, k, v, score_graph, bm, scale, buffers[:n_smb], buffers[n_smb:])
        return out, lse, max_scores

    examples = [_example(x) for x in graph_inputs]
    traced = _compat.make_fx(torch.func.functionalize(dense), decomposition_table=select_decomp_table(),
                             tracing_mode="fake")(*examples)
    return traced, graph_inputs


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
                if node.target in lowerings:
                    env[node] = lowerings[node.target](*args, **kwargs)
                else:
                    env[node] = fallback_handler(node.target, add_to_fallback_set=False)(*args, **kwargs)
            elif node.op == "output":
                return pytree.tree_map_only(torch.fx.Node, env.__getitem__, node.args[0])
    finally:
        V.graph.current_node = saved_node
    raise AssertionError("graph without output")


def lower_dense(query, key, value, score_mod, block_mask, scale, kernel_options,
                score_mod_buffers, mask_mod_buffers):
    """out, lse, max_scores of the call, computed densely (see the module docstring)."""
    block_mask = tuple(block_mask)
    lengths = tuple(_static(n) for n in block_mask[:2])
    block_sizes = tuple(_static(n) for n in block_mask[10:BM_MASK_MOD])
    graph_block_mask = (*lengths, *block_mask[2:10], *block_sizes, block_mask[BM_MASK_MOD].graph_module)
    traced, graph_inputs = _trace(query, key, value, score_mod.graph_module, graph_block_mask,
                                  scale, list(score_mod_buffers), list(mask_mod_buffers))
    inputs = [ir.TensorBox(x) if isinstance(x, ir.IRNode) and not isinstance(x, ir.TensorBox) else x
              for x in graph_inputs]
    out, lse, max_scores = _lower_graph(traced, inputs)
    return out, lse, max_scores

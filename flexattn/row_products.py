"""Dot products of captured rows in a score_mod, folded into the kernels' QK^T.

MLA's decoupled RoPE (DeepSeek-V2) is a score_mod that reduces over a captured tensor's
last dimension::

    score + c * torch.dot(q_pe[b, h, q_idx], k_pe[b, kv_idx])

No kernel can evaluate that elementwise per (q_idx, kv_idx): it is a matrix product.
It is the product of a row that depends on the query position and a row that depends on
the key position, which is what extra head-dim columns compute: with
``q' = [q, (c / scale) * q_rows]`` and ``k' = [k, k_rows]``,
``scale * <q', k'> = scale * <q, k> + c * <q_rows, k_rows>``. ``fold_row_products``
finds such terms in a score_mod's graph, drops them from it, and returns the widened
query and key; the rows are gathered with differentiable ops, so autograd gives the
captured tensors their gradients through the attention's dq and dk.

A term folds when, in the score_mod's graph:

- a reduction (``torch.dot``, ``@`` on vectors, or ``(x * y).sum(-1)``) takes two
  vectors of one length, one a function of (b, h, q_idx) and the captured tensors, the
  other of (b, h, kv_idx) and the captured tensors;
- its value is scaled by numbers or by 0-d values of (b, h, q_idx), possibly cast, and
  added to the score argument itself (``score + term``; ``score - term`` too);
- with grouped-query attention, the key-side row reads the query head only as
  ``h // G`` (G query heads per key head), or not at all.

Anything else is left in the graph, where the kernels' lowering names the rewrite.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor
from torch.fx import Graph, GraphModule, Node

aten = torch.ops.aten

#: The score_mod's scalar arguments, in the order of its graph's placeholders.
SCALAR_ARGS = ("score", "b", "h", "q_idx", "kv_idx")
_CASTS = (aten._to_copy.default, aten.to.dtype, aten.clone.default)


def _floating_cast(node: Node) -> bool:
    """A cast to a floating dtype (or a copy): one that keeps the dot product's value."""
    dtype = node.kwargs.get("dtype", node.args[1] if len(node.args) > 1 else None)
    return dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point)


class RowProductError(ValueError):
    """A row product that looks foldable but cannot be folded, with the reason."""


@dataclass(frozen=True)
class RowProduct:
    """One folded term ``coefficient * <query row, key row>`` of a score_mod.

    ``query_rows(b, h, q_idx, *buffers)`` and ``key_rows(b, hkv, kv_idx, *buffers)``
    give one row each; the 0-d factors of (b, h, q_idx) the term was scaled by are part
    of ``query_rows``, the numbers are ``coefficient``. ``key_reads_batch``: the key row
    depends on b (a key batch of 1 broadcast over the queries' cannot hold it).
    """

    coefficient: float
    query_rows: GraphModule
    key_rows: GraphModule
    width: int
    key_reads_batch: bool


@dataclass(frozen=True)
class Folding:
    """A score_mod graph with its row products taken out.

    ``score_graph`` takes ``(score, b, h, q_idx, kv_idx, *kept buffers)``, where
    ``kept_buffers`` are the positions of the original buffers it still reads.
    """

    score_graph: GraphModule
    kept_buffers: tuple[int, ...]
    terms: tuple[RowProduct, ...]


def _dependencies(graph: Graph) -> dict[Node, frozenset[str]]:
    """Node -> the scalar arguments (``SCALAR_ARGS``) its value depends on."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    deps: dict[Node, frozenset[str]] = {}
    for i, node in enumerate(placeholders):
        deps[node] = frozenset({SCALAR_ARGS[i]}) if i < len(SCALAR_ARGS) else frozenset()
    for node in graph.nodes:
        if node.op != "placeholder":
            found: set[str] = set()
            for arg in node.all_input_nodes:
                found |= deps[arg]
            deps[node] = frozenset(found)
    return deps


def _vector_length(node: Any) -> int | None:
    val = node.meta.get("val") if isinstance(node, Node) else None
    # A row's width becomes head-dim columns, which the kernels specialise on.
    return int(val.shape[0]) if isinstance(val, Tensor) and val.dim() == 1 else None


def _is_zero_d(node: Any) -> bool:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return isinstance(val, Tensor) and val.dim() == 0


def _reduced_pair(node: Node) -> tuple[Node, Node] | None:
    """(x, y) when ``node`` is ``<x, y>`` of two vectors of one length."""
    if node.target is aten.dot.default:
        x, y = node.args[0], node.args[1]
    elif node.target in (aten.sum.default, aten.sum.dim_IntList):
        if node.target is aten.sum.dim_IntList:
            dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
            if keepdim or list(dims or []) not in ([-1], [0]):
                return None
        if node.kwargs.get("dtype") is not None:
            return None
        product = node.args[0]
        if not isinstance(product, Node) or product.target is not aten.mul.Tensor or len(product.users) != 1:
            return None
        x, y = product.args
    else:
        return None
    width = _vector_length(x)
    if width is None or width != _vector_length(y):
        return None
    return x, y


def _sides(x: Node, y: Node, deps: dict[Node, frozenset[str]]) -> tuple[Node, Node] | None:
    """(query-side row, key-side row), or None when the rows do not split that way; where
    both orders would do, the one whose rows read their own position."""
    orders = [(a, c) for a, c in ((x, y), (y, x))
              if not deps[a] & {"score", "kv_idx"} and not deps[c] & {"score", "q_idx"}]
    orders.sort(key=lambda pair: ("q_idx" not in deps[pair[0]]) + ("kv_idx" not in deps[pair[1]]))
    return orders[0] if orders else None


@dataclass
class _Term:
    reduction: Node
    query_row: Node
    key_row: Node
    numbers: float
    factors: list[tuple[Node, bool]]  # (0-d node of (b, h, q_idx), divides)
    chain: list[Node]                 # reduction .. the node added to the score
    add: Node


def _follow_to_score(reduction: Node, query_row: Node, key_row: Node, score: Node,
                     deps: dict[Node, frozenset[str]]) -> _Term | None:
    """Walk from the reduction through scalings and casts to ``score + term``."""
    numbers, factors, chain, node = 1.0, [], [reduction], reduction
    while len(node.users) == 1:
        user = next(iter(node.users))
        args = user.args
        if user.target in _CASTS and not set(user.kwargs) - {"dtype"} and args[0] is node:
            if not _floating_cast(user):
                raise RowProductError(
                    "the dot product is cast to a non-floating dtype, which changes its value, and folded into "
                    "QK^T it could not be: cast it to a floating dtype or not at all")
        elif user.target in (aten.mul.Tensor, aten.div.Tensor) and not user.kwargs and node in args:
            other = args[1] if args[0] is node else args[0]
            divides = user.target is aten.div.Tensor
            if divides and args[0] is not node:
                return None
            if isinstance(other, Node) and other.target is aten._local_scalar_dense.default:
                # A captured number made a 0-d graph input (dynamic shapes) and read back.
                other = other.args[0]
            if isinstance(other, (int, float)) and not isinstance(other, bool):
                numbers = numbers / other if divides else numbers * other
            elif _is_zero_d(other) and not deps[other] & {"score", "kv_idx"}:
                factors.append((other, divides))
            else:
                return None
        elif user.target in (aten.add.Tensor, aten.sub.Tensor) and not user.kwargs and len(args) == 2 \
                and score in args and node in args and args[0] is not args[1]:
            if user.target is aten.sub.Tensor:
                if args[1] is not node:
                    return None
                numbers = -numbers
            if len(score.users) != 1:
                raise RowProductError(
                    "the score_mod uses its score argument again besides adding the dot product to it; folded "
                    "into QK^T the dot product would reach those uses too: add it to the score once, first "
                    "(score = score + dot(...)), and use only that sum afterwards")
            return _Term(reduction, query_row, key_row, numbers, factors, chain, user)
        else:
            return None
        chain.append(user)
        node = user
    return None


def _closure(outputs: Sequence[Node]) -> set[Node]:
    seen: set[Node] = set()
    stack = list(outputs)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def _row_graph(gm: GraphModule, row: Node, factors: Sequence[tuple[Node, bool]], index_name: str,
               head_map: dict[Node, str] | None) -> GraphModule:
    """A graph ``(b, h_or_hkv, index, *buffers) -> row`` copied out of the score graph.

    ``head_map``: nodes of the score graph (``h // G``) that the new graph's head
    argument replaces; the score graph's ``h`` is then not an argument of the row.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    needed = _closure([row, *(f for f, _ in factors)])
    graph = Graph()
    env: dict[Node, Node] = {}
    b, h, q_idx, kv_idx = placeholders[1:5]
    new_b = graph.placeholder("b")
    new_h = graph.placeholder("hkv" if head_map is not None else "h")
    new_index = graph.placeholder(index_name)
    env[b] = new_b
    env[q_idx if index_name == "q_idx" else kv_idx] = new_index
    if head_map is None:
        env[h] = new_h
    else:
        env.update({node: new_h for node in head_map})
    for buf in placeholders[5:]:
        env[buf] = graph.placeholder(buf.name)
    for node in gm.graph.nodes:
        if node in needed and node not in env and node.op != "placeholder":
            env[node] = graph.node_copy(node, lambda n: env[n])
    result = env[row]
    for factor, divides in factors:
        result = graph.call_function(aten.div.Tensor if divides else aten.mul.Tensor, (result, env[factor]))
    graph.output(result)
    return GraphModule(gm, graph)


def _key_head_map(gm: GraphModule, key_row: Node, num_groups: int) -> dict[Node, str] | None:
    """How the key-side row reads the query head: None when directly (no GQA) or not at
    all, else the ``h // G`` nodes the key head replaces. Raises when it reads it otherwise."""
    h = [n for n in gm.graph.nodes if n.op == "placeholder"][2]
    needed = _closure([key_row])
    if h not in needed or num_groups == 1:
        return None
    uses = [u for u in h.users if u in needed]

    def is_groups(divisor) -> bool:
        # Under dynamic shapes the divisor is a node holding a SymInt.
        value = divisor.meta.get("val") if isinstance(divisor, Node) else divisor
        try:
            return bool(value == num_groups)
        except (TypeError, RuntimeError):
            return False

    def is_group_of(u: Node) -> bool:
        if u.target is aten.floor_divide.default or u.target is operator.floordiv:
            return u.args[0] is h and is_groups(u.args[1])
        if u.target is aten.div.Tensor_mode:
            return u.args[0] is h and is_groups(u.args[1]) and u.kwargs.get("rounding_mode") == "floor"
        return False

    if not all(is_group_of(u) for u in uses):
        raise RowProductError(
            f"the key-side row of a dot product reads the query head h other than as h // {num_groups} "
            f"({num_groups} query heads share a key head), so it is not one row per key head")
    return {u: "hkv" for u in uses}


def find_row_products(gm: GraphModule, num_groups: int) -> Folding | None:
    """The score graph's foldable row products taken out, or None when it has none.

    ``gm``: the score_mod traced to aten ops, ``(score, b, h, q_idx, kv_idx, *buffers)``.
    ``num_groups``: query heads per key head.
    """
    gm = GraphModule(gm, _copy_graph(gm.graph))
    terms: list[RowProduct] = []
    while True:
        deps = _dependencies(gm.graph)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        score = placeholders[0]
        term = None
        for node in gm.graph.nodes:
            pair = _reduced_pair(node) if node.op == "call_function" else None
            sides = _sides(*pair, deps) if pair else None
            term = _follow_to_score(node, *sides, score, deps) if sides else None
            if term is not None:
                break
        if term is None:
            break
        head_map = _key_head_map(gm, term.key_row, num_groups)
        terms.append(RowProduct(
            coefficient=term.numbers,
            query_rows=_row_graph(gm, term.query_row, term.factors, "q_idx", None),
            key_rows=_row_graph(gm, term.key_row, (), "kv_idx", head_map),
            width=_vector_length(term.query_row),
            key_reads_batch="b" in deps[term.key_row],
        ))
        term.add.replace_all_uses_with(score)
        gm.graph.eliminate_dead_code()
    if not terms:
        return None
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    kept = tuple(i for i, n in enumerate(placeholders[5:]) if n.users)
    for i, node in enumerate(placeholders[5:]):
        if i not in kept:
            gm.graph.erase_node(node)
    gm.recompile()
    return Folding(gm, kept, tuple(terms))


def _copy_graph(graph: Graph) -> Graph:
    new = Graph()
    output = new.graph_copy(graph, {})
    new.output(output)
    return new


def _grid_rows(rows: GraphModule, sizes: tuple[Any, Any, Any], buffers: Sequence[Tensor],
               device: torch.device) -> Tensor:
    """``rows`` at every (b, h, index) of ``sizes``: a (B, H, L, width) tensor."""
    fn = rows
    for dims in ((None, None, 0), (None, 0, None), (0, None, None)):
        fn = torch.vmap(fn, in_dims=dims + (None,) * len(buffers), out_dims=0)
    grids = [torch.arange(n, device=device, dtype=torch.int32) for n in sizes]
    return fn(*grids, *buffers)


def plan_folding(score_graph: GraphModule, query_shape: Sequence[Any], key_shape: Sequence[Any],
                 scale: float, key_dtype: torch.dtype) -> Folding | None:
    """The row products of ``score_graph`` to fold for a query and key of these shapes
    (and key dtype), or None when it has none; raises ``RowProductError`` when one cannot
    be folded.

    ``score_graph``: the score_mod traced to aten ops with its buffers as placeholders.
    """
    B, H = query_shape[0], query_shape[1]
    Bk, Hkv = key_shape[0], key_shape[1]
    folding = find_row_products(score_graph, H // Hkv)
    if folding is None:
        return None
    if scale == 0:
        raise RowProductError("scale is 0, so the query-side rows cannot be scaled into the query")
    if any(term.key_reads_batch for term in folding.terms) and Bk != B:
        raise RowProductError(f"the key-side row reads b, but key has batch {Bk} for the query's {B}")
    if key_dtype.itemsize == 1:
        raise RowProductError(f"key is {key_dtype}: its folded rows would be rounded to it; pass the key in "
                              f"the query's dtype to fold a dot product into QK^T")
    return folding


def fold_row_products(query: Tensor, key: Tensor, score_graph: GraphModule, scale: float,
                      score_mod_buffers: Sequence[Tensor]):
    """``(query', key', score_graph', buffers')`` with the row products of ``score_graph``
    folded into extra head-dim columns (each row cast to the query's dtype), or None
    when it has none."""
    folding = plan_folding(score_graph, query.shape, key.shape, scale, key.dtype)
    if folding is None:
        return None
    B, H, L, _ = query.shape
    Bk, Hkv, S, _ = key.shape
    query_cols, key_cols = [query], [key]
    for term in folding.terms:
        q_rows = _grid_rows(term.query_rows, (B, H, L), score_mod_buffers, query.device)
        k_rows = _grid_rows(term.key_rows, (Bk, Hkv, S), score_mod_buffers, key.device)
        query_cols.append((q_rows * (term.coefficient / scale)).to(query.dtype))
        key_cols.append(k_rows.to(key.dtype))
    buffers = tuple(score_mod_buffers[i] for i in folding.kept_buffers)
    return torch.cat(query_cols, dim=-1), torch.cat(key_cols, dim=-1), folding.score_graph, buffers

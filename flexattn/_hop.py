"""The flexattn higher-order operators.

``flex_attention_hop`` and ``flex_attention_backward_hop`` are the two operators that
every flexattn call becomes. A HOP takes functions (score_mod, mask_mod) as well as
tensors; each dispatch path below says what the operator means there:

* CompositeExplicitAutograd: the dense reference (``dense_flex_attention``, the math in
  ``reference.py``). It builds
  the full score matrix, so it is the definition of correct, not a fast path.
* FakeTensorMode: output metadata only.
* ProxyTorchDispatchMode (make_fx, AOT): score_mod and mask_mod are traced into small FX
  subgraphs of scalar ops and the call is recorded as one node.
* Functionalization: tensors are unwrapped; a mod that mutates anything is rejected.
* Autograd: an ``autograd.Function`` whose backward is the backward HOP, fed with a
  forward graph and a joint (forward+vjp) graph of score_mod.
* Autocast: q, k, v are cast to the autocast dtype.

Operator contract (the lowering relies on it)::

    out, lse, max_scores = flex_attention_hop(
        query, key, value, score_mod, block_mask, scale, kernel_options,
        score_mod_buffers, mask_mod_buffers, sinks=None, dropout_seed=None)

query (B, Hq, L, E); key (Bkv, Hkv, S, E); value (Bkv, Hkv, S, Ev); Bkv in {1, B};
Hq % Hkv == 0. ``block_mask`` is ``BlockMask.as_tuple()``: ``(q_len, kv_len,
kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, q_num_blocks,
q_indices, full_q_num_blocks, full_q_indices, Q_BLOCK_SIZE, KV_BLOCK_SIZE, mask_mod)``.
``out`` is (B, Hq, L, Ev) in query's dtype with query's dimension order (see
``output_strides``); ``lse`` and ``max_scores`` are float32 (B, Hq, L), natural log,
``-inf`` on rows where every key is masked (whose ``out`` row is 0). ``sinks``: None
or per-head logits (Hq,) or (B, Hq) of any float dtype, each one more key of value zero
in its rows' softmax (``reference.dense_math``); with sinks the lse includes them and
a row with every key masked has lse = sink. ``dropout_seed``: None, or with
``kernel_options``' internal DROPOUT_P > 0 the call's (2,) int64 seed (key, stream) of
the keep mask (``numerics.dropout_keep``); the backward operator takes the same seed
and regenerates the mask.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from . import _compat
from ._compat import DispatchKey, FakeTensorMode, ProxyTorchDispatchMode, pytree
from ._mask_tuple import BlockMaskView
from . import options as _options
from .numerics import Dropout, IndexWithTensors, sink_rows, stats_dtype
from .reference import dense_math
from .row_products import RowProductError, fold_row_products, plan_folding

#: The error of a call that needs a backward with a mask built without the transposed lists.
NO_Q_BLOCKS_ERROR = (
    "flexattn: BlockMask q_indices is None. Backward pass requires q_indices to be computed. "
    "Please create the BlockMask with compute_q_blocks=True: it was built with compute_q_blocks=False, "
    "without the transposed (per-KV-block) lists, but {what} requires grad (a paged mask: "
    "PagedKVCache.block_mask_on_pages(..., compute_q_blocks=True)), or run the call under torch.no_grad()"
)


class MissingQBlocksError(ValueError, RuntimeError):
    """A backward was asked of a BlockMask built without its transposed lists (a
    RuntimeError, as torch raises; a ValueError, as the argument is at fault)."""


class ModError(ValueError, AssertionError):
    """A score_mod or mask_mod that flexattn cannot run (wrong output shape, say).

    A ValueError, and an AssertionError too: torch.compile passes an AssertionError
    raised while it traces to the caller as it is, where it wraps others as an internal
    Dynamo error, so the caller sees this type and message on top."""


class MutatingModError(RuntimeError, AssertionError):
    """A score_mod or mask_mod wrote to a tensor; flexattn mods must be pure. (An
    AssertionError too, so that torch.compile passes it on as it is; see ``ModError``.)"""


# --------------------------------------------------------------------------------------
# The operators
# --------------------------------------------------------------------------------------
class FlexAttentionHOP(_compat.HigherOrderOperator):
    def __init__(self) -> None:
        super().__init__("flexattn_attention", **_compat.hop_init_kwargs())

    def __call__(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        score_mod: Callable,
        block_mask: tuple,
        scale: float,
        kernel_options: dict[str, Any],
        score_mod_buffers: tuple = (),
        mask_mod_buffers: tuple = (),
        sinks: Tensor | None = None,
        dropout_seed: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        _check_buffers("score_mod_buffers", score_mod_buffers)
        _check_buffers("mask_mod_buffers", mask_mod_buffers)
        return super().__call__(
            query, key, value, score_mod, block_mask, scale, kernel_options,
            tuple(score_mod_buffers), tuple(mask_mod_buffers), sinks, dropout_seed,
        )


class FlexAttentionBackwardHOP(_compat.HigherOrderOperator):
    def __init__(self) -> None:
        super().__init__("flexattn_attention_backward", **_compat.hop_init_kwargs())

    def __call__(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        out: Tensor,
        logsumexp: Tensor,
        grad_out: Tensor,
        grad_logsumexp: Tensor | None,
        fw_graph: Callable,
        joint_graph: Callable,
        block_mask: tuple,
        scale: float,
        kernel_options: dict[str, Any],
        score_mod_buffers: tuple = (),
        mask_mod_buffers: tuple = (),
        sinks: Tensor | None = None,
        dropout_seed: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor | None, ...]]:
        _check_buffers("score_mod_buffers", score_mod_buffers)
        _check_buffers("mask_mod_buffers", mask_mod_buffers)
        return super().__call__(
            query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph,
            joint_graph, block_mask, scale, kernel_options,
            tuple(score_mod_buffers), tuple(mask_mod_buffers), sinks, dropout_seed,
        )


flex_attention_hop = FlexAttentionHOP()
flex_attention_backward_hop = FlexAttentionBackwardHOP()


def _through_checkpoint_mode(mode, *args, **kwargs):
    # Selective activation checkpointing decides per op whether to save or recompute;
    # the operator is one op to it (``ops_to_save=[flex_attention_hop]``).
    return mode.__torch_dispatch__(flex_attention_hop, [], args, kwargs)


for _checkpoint_mode in _compat.selective_checkpoint_modes():
    flex_attention_hop.py_impl(_checkpoint_mode)(_through_checkpoint_mode)


def _check_buffers(name: str, buffers: Sequence) -> None:
    for i, buf in enumerate(buffers):
        if not isinstance(buf, (Tensor, int, float, bool, torch.SymInt, torch.SymFloat)):
            raise TypeError(
                f"flexattn: {name}[{i}] must be a tensor or a Python scalar captured by the "
                f"mod, got {type(buf).__name__}"
            )


def call_dropout(kernel_options: dict[str, Any], dropout_seed: Tensor | None) -> Dropout | None:
    """The call's dropout (the internal DROPOUT_P option and the seed), or None."""
    p = _options.read_internal(kernel_options, "DROPOUT_P")
    if not p:
        return None
    if dropout_seed is None:
        raise RuntimeError("flexattn: a call with dropout reached the operator without its seed")
    return Dropout(float(p), dropout_seed)


def identity_score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """The score_mod used when the caller gives none."""
    return score


def output_strides(query: Tensor, ev: int) -> tuple[int, ...]:
    """Strides of the (B, Hq, L, Ev) output: dense, with query's dimension order.

    A query made by ``x.view(B, L, H, E).transpose(1, 2)`` gives an output laid out as
    (B, L, H, Ev), so the usual ``out.transpose(1, 2).reshape(B, L, H * Ev)`` is free.
    """
    shape = list(query.shape[:-1]) + [ev]
    # Order dims from outermost to innermost by query's strides; ties keep dim order.
    order = sorted(range(4), key=lambda d: (-query.stride(d), d))
    if order[-1] != 3:
        order = [d for d in order if d != 3] + [3]
    strides = [0] * 4
    running = 1
    for d in reversed(order):
        strides[d] = running
        running *= shape[d]
    return tuple(strides)


def _empty_outputs(query: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    B, Hq, L, _ = query.shape
    ev = value.shape[-1]
    out = torch.empty_strided((B, Hq, L, ev), output_strides(query, ev), dtype=query.dtype, device=query.device)
    lse = torch.empty((B, Hq, L), dtype=stats_dtype(query.dtype), device=query.device)
    max_scores = torch.empty((B, Hq, L), dtype=stats_dtype(query.dtype), device=query.device)
    return out, lse, max_scores


@flex_attention_hop.py_impl(DispatchKey.CompositeExplicitAutograd)
def dense_flex_attention(
    query, key, value, score_mod, block_mask, scale, kernel_options,
    score_mod_buffers=(), mask_mod_buffers=(), sinks=None, dropout_seed=None,
):
    """The reference: ``dense_math`` with its output laid out as the kernels lay it."""
    out, lse, max_scores = dense_math(
        query, key, value, score_mod, block_mask, scale, score_mod_buffers, mask_mod_buffers, sinks,
        call_dropout(kernel_options, dropout_seed),
    )
    result, _, _ = _empty_outputs(query, value)
    result.copy_(out)
    return result, lse, max_scores


@flex_attention_hop.py_impl(FakeTensorMode)
def _fake_flex_attention(mode, query, key, value, score_mod, block_mask, scale, kernel_options,
                         score_mod_buffers=(), mask_mod_buffers=(), sinks=None, dropout_seed=None):
    with mode:
        return _empty_outputs(query, value)


# --------------------------------------------------------------------------------------
# Tracing: score_mod and mask_mod become FX subgraphs
# --------------------------------------------------------------------------------------
def scalar_examples(query: Tensor, with_score: bool, score_requires_grad: bool = False) -> list[Tensor]:
    """0-d example arguments for tracing a mod: (score,) b, h, q_idx, kv_idx."""
    idx = [query.new_zeros((), dtype=torch.int32) for _ in range(4)]
    if not with_score:
        return idx
    score = query.new_zeros((), requires_grad=score_requires_grad)
    return [score, *idx]


def _trace_mods_in(mode: ProxyTorchDispatchMode, query: Tensor, score_mod, block_mask, score_mod_buffers, mask_mod_buffers):
    with IndexWithTensors():
        score_graph = _compat.reenter_make_fx(score_mod)(*scalar_examples(query, True), *score_mod_buffers)
        mask_graph = _compat.reenter_make_fx(BlockMaskView(*block_mask).mask_mod)(*scalar_examples(query, False), *mask_mod_buffers)
    score_name = _compat.unique_graph_name(mode, "flexattn_score_mod")
    mode.tracer.root.register_module(score_name, score_graph)
    mask_name = _compat.unique_graph_name(mode, "flexattn_mask_mod")
    mode.tracer.root.register_module(mask_name, mask_graph)
    return score_graph, tuple(BlockMaskView(*block_mask)._replace(mask_mod=mask_graph))


def _record(mode: ProxyTorchDispatchMode, op, args: tuple, example_out):
    proxy_args = pytree.tree_map(mode.tracer.unwrap_proxy, args)
    out_proxy = mode.tracer.create_proxy("call_function", op, proxy_args, {}, name=op._name)
    return _compat.track_tensor_tree(example_out, out_proxy, constant=None, tracer=mode.tracer)


@flex_attention_hop.py_impl(ProxyTorchDispatchMode)
def _proxy_flex_attention(mode, query, key, value, score_mod, block_mask, scale, kernel_options,
                          score_mod_buffers=(), mask_mod_buffers=(), sinks=None, dropout_seed=None):
    example_out = flex_attention_hop(query, key, value, score_mod, block_mask, scale, kernel_options,
                                     score_mod_buffers, mask_mod_buffers, sinks, dropout_seed)
    score_graph, traced_block_mask = _trace_mods_in(mode, query, score_mod, block_mask,
                                                    score_mod_buffers, mask_mod_buffers)
    args = (query, key, value, score_graph, traced_block_mask, scale, kernel_options,
            score_mod_buffers, mask_mod_buffers, sinks, dropout_seed)
    return _record(mode, flex_attention_hop, args, example_out)


# --------------------------------------------------------------------------------------
# Functionalization: mods must be pure
# --------------------------------------------------------------------------------------
def _mutated_inputs(graph: torch.fx.GraphModule) -> list[str]:
    """Names of the nodes that ``graph`` writes to in place (inputs or buffers)."""
    written = []
    for node in graph.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        for arg_schema, arg in zip(schema.arguments, node.args):
            if arg_schema.alias_info is not None and arg_schema.alias_info.is_write:
                written.append(str(arg))
    return written


def _plain_copy_like(t: Any, requires_grad: bool | None = None) -> Any:
    """A fresh, non-functional tensor with ``t``'s metadata, zero-filled: tracing runs the
    mod on it for real, and a captured index tensor (``bias[b][which, q_idx]``) must hold
    a valid index."""
    if not isinstance(t, Tensor):
        return t
    if requires_grad is None:
        requires_grad = t.requires_grad and t.is_floating_point()
    copy = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device).zero_()
    return copy.requires_grad_(requires_grad)


@contextlib.contextmanager
def _tracing_for_real():
    """Trace a mod with make_fx on plain tensors, outside the functionalization and proxy
    tracing of the call being traced (indexing with tensors as mods do)."""
    with _compat.suspend_functionalization(), _compat.disable_functional_mode(), \
            _compat.disable_proxy_modes_tracing(), IndexWithTensors():
        yield


def reject_mutating_mod(name: str, mod: Callable, example_args: Sequence) -> None:
    """Raise ``MutatingModError`` when ``mod`` writes to any tensor in place."""
    with _tracing_for_real():
        plain = [_plain_copy_like(a) for a in example_args]
        graph = _compat.make_fx(mod)(*plain)
    written = _mutated_inputs(graph)
    if written:
        raise MutatingModError(
            f"flexattn: {name} must be a pure function of its arguments, but it writes in "
            f"place to {', '.join(written)}. Return a new value instead of mutating "
            f"(e.g. use `score + x`, not `score.add_(x)` or `table[i] = ...`)."
        )


@flex_attention_hop.py_functionalize_impl
def _functionalize_flex_attention(ctx, query, key, value, score_mod, block_mask, scale, kernel_options,
                                  score_mod_buffers=(), mask_mod_buffers=(), sinks=None, dropout_seed=None):
    q, k, v = ctx.unwrap_tensors([query, key, value])
    sinks = None if sinks is None else ctx.unwrap_tensors(sinks)
    dropout_seed = None if dropout_seed is None else ctx.unwrap_tensors(dropout_seed)
    bm = BlockMaskView(*ctx.unwrap_tensors(block_mask))
    smb = ctx.unwrap_tensors(score_mod_buffers)
    mmb = ctx.unwrap_tensors(mask_mod_buffers)
    reject_mutating_mod("score_mod", score_mod, [*scalar_examples(q, True), *smb])
    reject_mutating_mod("mask_mod", bm.mask_mod, [*scalar_examples(q, False), *mmb])
    with ctx.redispatch_to_next():
        functional_score_mod = ctx.functionalize(score_mod)
        functional_bm = tuple(bm._replace(mask_mod=ctx.functionalize(bm.mask_mod)))
        out = flex_attention_hop(q, k, v, functional_score_mod, functional_bm, scale, kernel_options,
                                 tuple(smb), tuple(mmb), sinks, dropout_seed)
    return ctx.wrap_tensors(out)


# --------------------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------------------
def _grad_capable(t: Any) -> bool:
    return isinstance(t, Tensor) and t.requires_grad and (t.is_floating_point() or t.is_complex())


def build_score_mod_graphs(score_mod: Callable, query: Tensor, score_mod_buffers: Sequence):
    """The forward graph of score_mod and its joint graph.

    ``fw_graph(score, b, h, q_idx, kv_idx, *buffers) -> score``.
    ``joint_graph(score, b, h, q_idx, kv_idx, grad_score_out, *buffers) ->
    (grad_score, *grad_buffers)``, where a buffer that does not require grad gets None.
    The backward kernels inline the joint graph to turn dP-scaled scores into gradients
    of the raw scores and scatter the buffer gradients.
    """
    wants_grad = [_grad_capable(b) for b in score_mod_buffers]

    def joint(score, b, h, q_idx, kv_idx, grad_score_out, *buffers):
        with torch.enable_grad():
            leaves = [score] + [buf for buf, w in zip(buffers, wants_grad) if w]
            modded = score_mod(score, b, h, q_idx, kv_idx, *buffers)
            grads = torch.autograd.grad(modded, leaves, grad_score_out, allow_unused=True,
                                        materialize_grads=True)
        grads_iter = iter(grads[1:])
        buffer_grads = [next(grads_iter) if w else None for w in wants_grad]
        return (grads[0], *buffer_grads)

    with _tracing_for_real():
        buffers = [_plain_copy_like(b) for b in score_mod_buffers]
        query = _plain_copy_like(query, requires_grad=False)
        fw_examples = scalar_examples(query, True)
        fw_graph = _compat.make_fx(score_mod)(*fw_examples, *buffers)
        joint_examples = scalar_examples(query, True, score_requires_grad=True)
        grad_example = query.new_zeros(())
        joint_graph = _without_mutations(_compat.make_fx(joint)(*joint_examples, grad_example, *buffers),
                                         (*joint_examples, grad_example, *buffers))
    return fw_graph, joint_graph


def _without_mutations(graph: torch.fx.GraphModule, examples: Sequence[Tensor]) -> torch.fx.GraphModule:
    """``graph`` with no op that writes in place: autograd formulas may (maximum's and
    minimum's fill a mask into their gradient, traced as ``copy_``), and the kernels inline
    pure graphs only; such a graph is traced again through functionalization."""
    if not any(_compat.is_mutating_op(node.target) for node in graph.graph.nodes):
        return graph
    pure = torch.func.functionalize(graph, remove="mutations_and_views")
    return _compat.make_fx(pure)(*(e.detach() for e in examples))


def trace_score_mod(score_mod: Callable, query: Tensor, score_mod_buffers: Sequence) -> torch.fx.GraphModule:
    """score_mod traced to aten ops: ``(score, b, h, q_idx, kv_idx, *buffers) -> score``."""
    with _tracing_for_real():
        buffers = [_plain_copy_like(b, requires_grad=False) for b in score_mod_buffers]
        examples = scalar_examples(_plain_copy_like(query, requires_grad=False), True)
        return _compat.make_fx(score_mod)(*examples, *buffers)


def _row_product_error(e: RowProductError) -> ModError:
    return ModError(f"flexattn: score_mod's dot product of captured rows cannot be folded into the "
                    f"attention's matrix product: {e}")


def check_score_mod_row_products(score_mod: Callable, query: Tensor, key: Tensor, scale: float,
                                 score_mod_buffers: Sequence) -> None:
    """Raise ``ModError`` when score_mod has a row product that cannot be folded (at
    capture, so the error reaches the caller before any compile work)."""
    try:
        plan_folding(trace_score_mod(score_mod, query, score_mod_buffers), query.shape, key.shape, scale,
                     key.dtype)
    except RowProductError as e:
        raise _row_product_error(e) from e


def fold_score_mod_row_products(query: Tensor, key: Tensor, score_mod: Callable, scale: float,
                                score_mod_buffers: Sequence):
    """``row_products.fold_row_products`` on score_mod (None when it has no row
    products); a row product that cannot be folded is a ``ModError``."""
    graph = trace_score_mod(score_mod, query, score_mod_buffers)
    try:
        return fold_row_products(query, key, graph, scale, tuple(score_mod_buffers))
    except RowProductError as e:
        raise _row_product_error(e) from e


#: Marks a place in FlexAttentionAutogradOp's saved inputs that holds a saved tensor.
_SAVED = object()


class FlexAttentionAutogradOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, fw_graph, joint_graph, block_mask, scale, kernel_options,
                sinks, dropout_seed, mask_mod_buffers, *score_mod_buffers):
        with _compat.below_autograd():
            out, lse, max_scores = flex_attention_hop(
                query, key, value, fw_graph, block_mask, scale, kernel_options,
                score_mod_buffers, mask_mod_buffers, sinks, dropout_seed,
            )
        ctx.mark_non_differentiable(max_scores)
        ctx._fw_graph = fw_graph
        ctx._joint_graph = joint_graph
        ctx._scale = scale
        ctx._kernel_options = kernel_options
        ctx._counts = (len(block_mask), len(score_mod_buffers))
        # save_for_backward takes tensors only; sizes (SymInts under dynamic shapes), the
        # mask_mod and absent tables stay on ctx in their places.
        items = [query, key, value, out, lse, sinks, dropout_seed, *block_mask, *score_mod_buffers,
                 *mask_mod_buffers]
        ctx._layout = [_SAVED if isinstance(x, Tensor) else x for x in items]
        ctx.save_for_backward(*(x for x in items if isinstance(x, Tensor)))
        return out, lse, max_scores

    @staticmethod
    def backward(ctx, grad_out, grad_lse, grad_max_scores):
        saved = iter(ctx.saved_tensors)
        items = [next(saved) if x is _SAVED else x for x in ctx._layout]
        query, key, value, out, lse, sinks, dropout_seed = items[:7]
        n_mask, n_score = ctx._counts
        block_mask = tuple(items[7:7 + n_mask])
        score_mod_buffers = tuple(items[7 + n_mask:7 + n_mask + n_score])
        mask_mod_buffers = tuple(items[7 + n_mask + n_score:])
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        grad_q = grad_k = grad_v = None
        grad_buffers = [None] * n_score
        if any(ctx.needs_input_grad[:3]) or any(ctx.needs_input_grad[11:]):
            grad_q, grad_k, grad_v, grad_buffers = flex_attention_backward_hop(
                query, key, value, out, lse, grad_out, grad_lse, ctx._fw_graph, ctx._joint_graph,
                block_mask, ctx._scale, ctx._kernel_options, score_mod_buffers, mask_mod_buffers, sinks,
                dropout_seed,
            )
        grad_sinks = sink_grad(sinks, out, lse, grad_out, grad_lse) if ctx.needs_input_grad[8] else None
        return (grad_q, grad_k, grad_v, None, None, None, None, None, grad_sinks, None, None, *grad_buffers)


@flex_attention_hop.py_impl(DispatchKey.Autograd)
def _autograd_flex_attention(query, key, value, score_mod, block_mask, scale, kernel_options,
                             score_mod_buffers=(), mask_mod_buffers=(), sinks=None, dropout_seed=None):
    if _compat.is_fake(query):
        # Compiling for the kernels: a score_mod's dot products of captured rows become
        # extra head-dim columns (the dense path above evaluates them as written).
        folded = fold_score_mod_row_products(query, key, score_mod, scale, score_mod_buffers)
        if folded is not None:
            query, key, score_mod, score_mod_buffers = folded
    grad_enabled = torch.is_grad_enabled()
    needs_grad = grad_enabled and any(_grad_capable(t) for t in (query, key, value, *score_mod_buffers))
    if not needs_grad and not (grad_enabled and _grad_capable(sinks)):
        with _compat.below_autograd():
            return flex_attention_hop(query, key, value, score_mod, block_mask, scale, kernel_options,
                                      score_mod_buffers, mask_mod_buffers, sinks, dropout_seed)
    if needs_grad and BlockMaskView(*block_mask).q_indices is None:
        # q, k and v were checked in api.flex_attention: here it is a score_mod buffer.
        raise MissingQBlocksError(NO_Q_BLOCKS_ERROR.format(what="a tensor captured by score_mod"))
    fw_graph, joint_graph = build_score_mod_graphs(score_mod, query, score_mod_buffers)
    # The backward reads the forward's lse, also when only a captured tensor wants a
    # gradient (the API decides OUTPUT_LOGSUMEXP from q, k and v alone).
    kernel_options = {**kernel_options, "OUTPUT_LOGSUMEXP": True}
    return FlexAttentionAutogradOp.apply(
        query, key, value, fw_graph, joint_graph, block_mask, scale, kernel_options,
        sinks, dropout_seed, tuple(mask_mod_buffers), *score_mod_buffers,
    )


def sink_grad(sinks: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor, grad_lse: Tensor | None) -> Tensor:
    """The sinks' gradient from the forward's results alone.

    A sink is a key of value zero with probability P_sink = exp(sink - lse) in its row,
    so d out / d sink = -P_sink * out and d lse / d sink = P_sink: each row adds
    P_sink * (grad_lse - <grad_out, out>), summed over the rows (and the batch for a
    per-head sink). The kernels need no pass of their own for it.
    """
    work = lse.dtype
    Hq = lse.shape[1]
    row = -(grad_out.to(work) * out.to(work)).sum(-1)
    if grad_lse is not None:
        row = row + grad_lse.to(work)
    per_row = torch.exp(sink_rows(sinks, Hq, work) - lse) * row
    grad = per_row.sum(-1)
    return (grad if sinks.dim() == 2 else grad.sum(0)).to(sinks.dtype)


# --------------------------------------------------------------------------------------
# Autocast
# --------------------------------------------------------------------------------------
def _autocast(device_type: str, key: DispatchKey):
    def impl(query, key_, value, score_mod, block_mask, scale, kernel_options,
             score_mod_buffers=(), mask_mod_buffers=(), sinks=None, dropout_seed=None):
        dtype = torch.get_autocast_dtype(device_type)
        if query.is_floating_point() and query.dtype != torch.float64:
            query, key_, value = (t.to(dtype) for t in (query, key_, value))
        with _compat.exclude_dispatch_key(key):
            return flex_attention_hop(query, key_, value, score_mod, block_mask, scale, kernel_options,
                                      score_mod_buffers, mask_mod_buffers, sinks, dropout_seed)

    return impl


flex_attention_hop.py_impl(DispatchKey.AutocastCUDA)(_autocast("cuda", DispatchKey.AutocastCUDA))
flex_attention_hop.py_impl(DispatchKey.AutocastCPU)(_autocast("cpu", DispatchKey.AutocastCPU))


# --------------------------------------------------------------------------------------
# The backward operator
# --------------------------------------------------------------------------------------
@flex_attention_backward_hop.py_impl(DispatchKey.CompositeExplicitAutograd)
def dense_flex_attention_backward(query, key, value, out, logsumexp, grad_out, grad_logsumexp,
                                  fw_graph, joint_graph, block_mask, scale, kernel_options,
                                  score_mod_buffers=(), mask_mod_buffers=(), sinks=None, dropout_seed=None):
    """Reference gradients: autograd through ``dense_math`` with the forward graph.

    The joint graph is not needed here (autograd derives the same vjp); it is part of
    the contract for the fused kernels. The sinks' gradient is the autograd operator's
    (``sink_grad``), as for the kernels.
    """
    wants = buffers_with_grad(joint_graph, len(score_mod_buffers))
    with _compat.reenable_autograd(), torch.enable_grad():
        q = query.detach().requires_grad_(True)
        k = key.detach().requires_grad_(True)
        v = value.detach().requires_grad_(True)
        buffers = [b.detach().requires_grad_(True) if w else b for b, w in zip(score_mod_buffers, wants)]
        o, lse, _ = dense_math(q, k, v, fw_graph, block_mask, scale, buffers, mask_mod_buffers,
                               None if sinks is None else sinks.detach(),
                               call_dropout(kernel_options, dropout_seed))
        outputs, cotangents = [o], [grad_out]
        if grad_logsumexp is not None:
            outputs.append(lse)
            cotangents.append(grad_logsumexp)
        leaves = [q, k, v] + [b for b, w in zip(buffers, wants) if w]
        grads = torch.autograd.grad(outputs, leaves, cotangents, allow_unused=True, materialize_grads=True)
    # Laid out as the fake implementation promises (traced graphs view them by those strides).
    grad_q, grad_k, grad_v, empty_buffers = _empty_backward_outputs(query, key, value, score_mod_buffers, joint_graph)
    grads_iter = iter(grads[3:])
    grad_buffers = tuple(empty.copy_(next(grads_iter)) if w else None for empty, w in zip(empty_buffers, wants))
    return grad_q.copy_(grads[0]), grad_k.copy_(grads[1]), grad_v.copy_(grads[2]), grad_buffers


def buffers_with_grad(joint_graph: torch.fx.GraphModule, num_buffers: int) -> list[bool]:
    """Which score_mod buffers get a gradient: those whose joint-graph output is not None.

    The joint graph fixes this when it is built (from ``requires_grad`` at forward time),
    so the backward never has to guess from the tensors it is handed.
    """
    output = next(n for n in joint_graph.graph.nodes if n.op == "output")
    results = output.args[0]
    results = results if isinstance(results, (tuple, list)) else (results,)
    buffer_results = list(results[1:])
    if len(buffer_results) != num_buffers:
        raise RuntimeError(
            f"flexattn: the joint graph returns {len(buffer_results)} buffer gradients for "
            f"{num_buffers} score_mod buffers"
        )
    return [r is not None for r in buffer_results]


def _empty_backward_outputs(query, key, value, score_mod_buffers, joint_graph):
    wants = buffers_with_grad(joint_graph, len(score_mod_buffers))
    grad_buffers = tuple(torch.empty_like(b) if w else None for b, w in zip(score_mod_buffers, wants))
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), grad_buffers


@flex_attention_backward_hop.py_impl(FakeTensorMode)
def _fake_flex_attention_backward(mode, query, key, value, out, logsumexp, grad_out, grad_logsumexp,
                                  fw_graph, joint_graph, block_mask, scale, kernel_options,
                                  score_mod_buffers=(), mask_mod_buffers=(), sinks=None, dropout_seed=None):
    with mode:
        return _empty_backward_outputs(query, key, value, score_mod_buffers, joint_graph)


@flex_attention_backward_hop.py_impl(ProxyTorchDispatchMode)
def _proxy_flex_attention_backward(mode, query, key, value, out, logsumexp, grad_out, grad_logsumexp,
                                   fw_graph, joint_graph, block_mask, scale, kernel_options,
                                   score_mod_buffers=(), mask_mod_buffers=(), sinks=None, dropout_seed=None):
    example_out = flex_attention_backward_hop(
        query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph, joint_graph,
        block_mask, scale, kernel_options, score_mod_buffers, mask_mod_buffers, sinks, dropout_seed,
    )
    with IndexWithTensors():
        fw = _compat.reenter_make_fx(fw_graph)(*scalar_examples(query, True), *score_mod_buffers)
        joint = _compat.reenter_make_fx(joint_graph)(
            *scalar_examples(query, True), query.new_zeros(()), *score_mod_buffers
        )
        mask_graph = _compat.reenter_make_fx(BlockMaskView(*block_mask).mask_mod)(
            *scalar_examples(query, False), *mask_mod_buffers
        )
    for prefix, gm in (("flexattn_fw_graph", fw), ("flexattn_joint_graph", joint), ("flexattn_mask_mod", mask_graph)):
        mode.tracer.root.register_module(_compat.unique_graph_name(mode, prefix), gm)
    traced_block_mask = tuple(BlockMaskView(*block_mask)._replace(mask_mod=mask_graph))
    args = (query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw, joint, traced_block_mask,
            scale, kernel_options, score_mod_buffers, mask_mod_buffers, sinks, dropout_seed)
    return _record(mode, flex_attention_backward_hop, args, example_out)


@flex_attention_backward_hop.py_functionalize_impl
def _functionalize_flex_attention_backward(ctx, query, key, value, out, logsumexp, grad_out, grad_logsumexp,
                                           fw_graph, joint_graph, block_mask, scale, kernel_options,
                                           score_mod_buffers=(), mask_mod_buffers=(), sinks=None,
                                           dropout_seed=None):
    unwrapped = ctx.unwrap_tensors([query, key, value, out, logsumexp, grad_out])
    sinks = None if sinks is None else ctx.unwrap_tensors(sinks)
    dropout_seed = None if dropout_seed is None else ctx.unwrap_tensors(dropout_seed)
    g_lse = ctx.unwrap_tensors(grad_logsumexp) if grad_logsumexp is not None else None
    bm = BlockMaskView(*ctx.unwrap_tensors(block_mask))
    smb = ctx.unwrap_tensors(score_mod_buffers)
    mmb = ctx.unwrap_tensors(mask_mod_buffers)
    with ctx.redispatch_to_next():
        functional_bm = tuple(bm._replace(mask_mod=ctx.functionalize(bm.mask_mod)))
        grads = flex_attention_backward_hop(
            *unwrapped, g_lse, fw_graph, joint_graph,
            functional_bm, scale, kernel_options, tuple(smb), tuple(mmb), sinks, dropout_seed,
        )
    return ctx.wrap_tensors(grads)


@flex_attention_backward_hop.py_impl(DispatchKey.Autograd)
def _autograd_flex_attention_backward(*args):
    """Gradients of gradients are not supported: the backward runs below autograd, so
    its results carry no graph and a second-order request fails as for any constant."""
    with _compat.below_autograd():
        return flex_attention_backward_hop(*args)

"""Teach Dynamo to capture ``flex_attention_hop`` whole, with no graph break.

Dynamo meets the HOP with Python functions as arguments (score_mod, and mask_mod at
the end of the block-mask tuple). For each, it speculates the function on 0-d example
arguments, which yields an FX subgraph of scalar ops plus the tensors the function
closes over (bias tables, document ids, learnable parameters). Those free tensors are
lifted into explicit buffer arguments of the HOP node, so the graph says exactly what
each mod reads, and autograd and Inductor can treat them as ordinary inputs.

Registration is one entry in Dynamo's table from HOP name to variable class, made when
Dynamo is imported (``_compat.register_dynamo_hop``), so ``import flexattn`` stays cheap.
The first call Dynamo captures also registers the Inductor lowerings: every compiled
flexattn call passes through here before Inductor lowers it.
"""

from __future__ import annotations

import contextlib
import functools
import operator

import torch

from . import _compat
from ._hop import ModError, MutatingModError, check_score_mod_row_products, flex_attention_hop
from ._mask_tuple import BLOCK_MASK_TUPLE_LEN, BlockMaskView
from .numerics import IndexWithTensors

_HOP_ARG_NAMES = (
    "query", "key", "value", "score_mod", "block_mask", "scale", "kernel_options",
    "score_mod_buffers", "mask_mod_buffers", "sinks", "dropout_seed",
)

_registered = False


def _bind_args(args, kwargs) -> dict:
    bound = dict(zip(_HOP_ARG_NAMES, args))
    for name, value in kwargs.items():
        if name in bound:
            raise TypeError(f"flexattn: flex_attention_hop got argument {name!r} twice")
        bound[name] = value
    missing = [n for n in _HOP_ARG_NAMES[:7] if n not in bound]
    if missing:
        raise TypeError(f"flexattn: flex_attention_hop is missing arguments {missing}")
    return bound


def _make_variable_class():
    support = _compat.dynamo_hop_support()

    class FlexAttnHOPVariable(support.TorchHigherOrderOperatorVariable):
        """Dynamo's view of a ``flex_attention_hop`` call."""

        _HOP_NAME = "flexattn_attention"

        def _speculate_mod(self, tx, query, fn, with_score: bool, name: str):
            """Trace ``fn`` on 0-d examples; return (subgraph attribute, lifted tensors)."""
            build = _compat.build_variable

            def scalar(**kwargs):
                return query.call_method(tx, "new_empty", [build(tx, [])], {k: build(tx, v) for k, v in kwargs.items()})

            with support.discard_graph_changes(tx):
                examples = [scalar(dtype=torch.int32) for _ in range(4)]
                if with_score:
                    examples.insert(0, scalar(requires_grad=bool(getattr(query, "requires_grad", False))))

            with IndexWithTensors():
                (body_out, _spec), body_graph, lifted = support.speculate_subgraph(
                    tx, fn, examples, {},
                    description=f"flexattn {name}",
                    source_target=self.value,
                    set_subgraph_inputs="flatten_manual",
                )
            _check_mod_output(name, body_out)
            _reject_mutation(name, body_graph)
            attr_name = tx.output.install_subgraph(name, torch.fx.GraphModule(tx.output.nn_modules, body_graph))
            return support.make_attr(tx, attr_name), tuple(lifted)

        def _call_function(self, tx, args, kwargs):
            bound = _bind_args(list(args), dict(kwargs))
            for extra in ("score_mod_buffers", "mask_mod_buffers"):
                if extra in bound and len(getattr(bound[extra], "items", ())) != 0:
                    raise TypeError(
                        f"flexattn: under torch.compile pass captured tensors by closing over "
                        f"them in the mod, not through {extra}"
                    )
            query = bound["query"]
            block_mask = bound["block_mask"]
            items = list(block_mask.items)
            if len(items) != BLOCK_MASK_TUPLE_LEN:
                raise TypeError(
                    f"flexattn: block_mask must be BlockMask.as_tuple() with {BLOCK_MASK_TUPLE_LEN} "
                    f"entries, got {len(items)}"
                )
            score_node, score_lifted = self._speculate_mod(tx, query, bound["score_mod"], True, "score_mod")
            scale = float(_as_python_value(bound["scale"]))
            _check_row_products(tx, score_node, query, bound["key"], scale, score_lifted)
            fields = BlockMaskView(*items)
            mask_node, mask_lifted = self._speculate_mod(tx, query, fields.mask_mod, False, "mask_mod")

            # The mask_mod travels as its own graph node; the other fields are proxied.
            proxied = [
                bound["query"], bound["key"], bound["value"],
                support.TupleVariable(list(fields.without_mask_mod())),
            ]
            optional = [_tensor_or_none(bound.get(name)) for name in ("sinks", "dropout_seed")]
            (q, k, v, bm, *optional_proxies), _ = support.proxy_args_kwargs(
                proxied + [t for t in optional if t is not None], {})
            proxies = iter(optional_proxies)
            sinks_proxy, seed_proxy = (None if t is None else next(proxies) for t in optional)
            # The scale (read above) is folded into the kernel as a constant (1/sqrt(E)
            # follows the head dim, which the kernel specialises on anyway).
            kernel_options = _constant_kernel_options(bound["kernel_options"])
            proxy = tx.output.create_proxy(
                "call_function",
                self.value,
                args=(q, k, v, score_node, tuple(bm) + (mask_node,), scale, kernel_options,
                      score_lifted, mask_lifted, sinks_proxy, seed_proxy),
                kwargs={},
            )
            return support.wrap_fx_proxy(tx=tx, proxy=proxy, example_value=None)

    return FlexAttnHOPVariable


def _tensor_or_none(var):
    """An optional tensor argument's variable, or None where the call passed None."""
    if var is not None and var.is_python_constant() and var.as_python_constant() is None:
        return None
    return var


def _is_dict(var) -> bool:
    """Whether a variable is a dict's (a constant's ``items`` raises, so no hasattr)."""
    try:
        return isinstance(var.items, dict)
    except (AttributeError, NotImplementedError):
        return False


def _as_python_value(var):
    """A traced Python scalar as a constant; a symbolic one is specialised (guarded);
    a dict (the internal options' nested one) value by value."""
    if _is_dict(var):
        return _constant_kernel_options(var)
    if hasattr(var, "evaluate_expr"):
        return var.evaluate_expr()
    return var.as_python_constant()


def _constant_kernel_options(var) -> dict:
    """kernel_options as a plain dict of constants.

    They select and parametrise kernels, so the graph must hold their values: an int
    that Dynamo made symbolic (an option passed in from outside the compiled function
    and changed between calls) is specialised here, which guards on it.
    """
    if _is_dict(var):
        return {_as_python_value(key.vt): _as_python_value(value) for key, value in var.items.items()}
    return var.as_python_constant()


def _check_mod_output(name: str, body_out) -> None:
    """A mod maps one entry to one value: its output must be a 0-d tensor."""
    proxy = getattr(body_out, "proxy", None)
    example = proxy.node.meta.get("example_value") if proxy is not None else None
    if isinstance(example, torch.Tensor) and example.dim() != 0:
        raise ModError(
            f"flexattn: {name} must return one value per (b, h, q_idx, kv_idx): a 0-d tensor, "
            f"but it returned shape {tuple(example.shape)}. Reductions and broadcasts over "
            f"captured tensors are not allowed inside a mod."
        )


def _check_row_products(tx, score_node, query, key, scale: float, lifted) -> None:
    """A score_mod row product that cannot be folded fails here, where a ModError reaches
    the caller as it is (raised later, while Dynamo runs the node on fake tensors, it
    would arrive wrapped in Dynamo's own error)."""
    def example(var):
        return var.as_proxy().node.meta["example_value"]

    graph_module = tx.output.nn_modules[score_node.node.target]
    buffers = [proxy.node.meta["example_value"] for proxy in lifted]
    try:
        with _compat.detect_fake_mode([example(query), *buffers]) or contextlib.nullcontext():
            check_score_mod_row_products(graph_module, example(query), example(key), scale, buffers)
    except ModError:
        raise
    except Exception:  # noqa: BLE001 - the operator traces the mod again and reports its errors
        return


_IN_PLACE_OPERATORS = frozenset({
    operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
    operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior,
    operator.ixor, operator.ilshift, operator.irshift,
})


def _is_in_place_torch_function(target) -> bool:
    """torch.xxx_ style functions (``torch.relu_``, ``torch.Tensor.add_``)."""
    name = getattr(target, "__name__", "")
    module = getattr(target, "__module__", None) or ""
    return module.startswith("torch") and name.endswith("_") and not name.startswith("_")


def _reject_mutation(name: str, graph: torch.fx.Graph) -> None:
    """Raise ``MutatingModError`` when a speculated mod writes to a tensor in place."""
    for node in graph.nodes:
        in_place_method = node.op == "call_method" and node.target.endswith("_") and not node.target.startswith("_")
        in_place_function = node.op == "call_function" and (
            node.target in _IN_PLACE_OPERATORS or _is_in_place_torch_function(node.target)
        )
        if in_place_method or in_place_function:
            raise MutatingModError(
                f"flexattn: {name} must be a pure function of its arguments, but it writes in "
                f"place ({node.format_node()}). Return a new value instead of mutating "
                f"(e.g. use `score + x`, not `score.add_(x)` or `table[i] = ...`)."
            )


@functools.cache
def _variable_class():
    return _make_variable_class()


def _make_variable(value, source=None, **kwargs):
    """Dynamo's variable for a ``flex_attention_hop`` call (the class is built on first use)."""
    from . import lowering

    lowering.register()
    return _variable_class()(value, source, **kwargs)


def register() -> None:
    """Add flexattn's HOP to Dynamo's table once Dynamo is imported (idempotent)."""
    global _registered
    if _registered:
        return
    _compat.register_dynamo_hop(flex_attention_hop.__name__, _make_variable)
    _registered = True

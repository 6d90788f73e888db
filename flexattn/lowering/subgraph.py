"""score_mod / mask_mod FX subgraphs -> the Inductor IR a template modification inlines.

The HOP carries each mod as a small FX graph over 0-d tensors: ``(score, b, h, q_idx,
kv_idx, *buffers)`` for score_mod, ``(b, h, q_idx, kv_idx, *buffers)`` for mask_mod.
Inductor lowers such a graph with its ordinary pointwise lowerings when the scalar
arguments are named placeholder buffers: the result is a 0-d ``ComputedBuffer`` whose
``inner_fn`` issues ``ops.load(<placeholder name>, 0)`` for each scalar argument and
``ops.load(<buffer>, <index>)`` for each captured tensor.

In the template, ``TritonTemplateKernel.modification(subgraph_number, output_name,
**fixed_inputs)`` replays that ``inner_fn`` under a handler that answers a load of a
placeholder with the Triton expression given for it (``score="scores"``,
``q_idx="q_idx"``, ...) and a load of a captured tensor with a ``tl.load`` from a new
kernel argument. So the placeholder names below are the keyword names the templates
pass to ``modification``, and the captured tensors must be realized buffers of the
enclosing graph before the builder runs.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch._inductor import ir
from torch._inductor.ops_handler import WrapperHandler
from torch._inductor.subgraph_lowering import PointwiseSubgraphLowering
from torch._inductor.virtualized import V, ops

from .. import _compat

#: Placeholder names (= template ``modification`` keywords) and their dtypes; None means
#: "the query's dtype".
SCORE_MOD_ARGS: tuple[tuple[str, torch.dtype | None], ...] = (
    ("score", None),
    ("b", torch.int32),
    ("h", torch.int32),
    ("q_idx", torch.int32),
    ("kv_idx", torch.int32),
)
MASK_MOD_ARGS: tuple[tuple[str, torch.dtype | None], ...] = SCORE_MOD_ARGS[1:]


class ModLoweringError(RuntimeError):
    """A score_mod / mask_mod uses an operation that cannot be fused into the kernel."""


#: PTX of the hardware tanh (one MUFU instruction, sm_75 and later); its largest
#: relative error is about 2**-11, below the rounding of a bfloat16 or float16 score.
HARDWARE_TANH_ASM = "tanh.approx.f32 $0, $1;"

#: Query dtypes whose mods get the hardware tanh by default.
FAST_TANH_DTYPES = (torch.bfloat16, torch.float16)


def use_fast_tanh(kernel_options, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a mod's tanh compiles to the hardware instruction rather than libdevice's
    full-precision tanh (about twenty instructions per score).

    Soft-capping spends most of its time in that tanh, so the hardware one is the
    default for 16-bit inputs on NVIDIA GPUs. ``kernel_options["FAST_TANH"]`` False keeps
    libdevice's; True asks for the hardware tanh for float32 too (it is never used for
    float64, under the Triton interpreter or off NVIDIA GPUs, which lack the instruction:
    True there is an error rather than a silent fallback).
    """
    requested = kernel_options.get("FAST_TANH")
    available = device.type == "cuda" and torch.version.hip is None \
        and not _compat.triton_interpreter_requested() and dtype != torch.float64
    if requested is None:
        return available and dtype in FAST_TANH_DTYPES
    if bool(requested) and not available:
        raise ValueError(
            f"flexattn: kernel_options FAST_TANH=True needs an NVIDIA GPU and float16, bfloat16 or "
            f"float32 inputs, got {dtype} on {device}"
            f"{' under the Triton interpreter' if _compat.triton_interpreter_requested() else ''}")
    return bool(requested)


class _HardwareTanh(WrapperHandler):
    """Ops handler that answers ``tanh`` with the hardware instruction (float32 in and out)
    and passes every other op through."""

    def tanh(self, x):
        x32 = self._inner.to_dtype(x, torch.float32)
        return self._inner.inline_asm_elementwise(
            x32, asm=HARDWARE_TANH_ASM, constraints="=f,f", dtype=torch.float32, is_pure=True, pack=1)


def _with_hardware_tanh(loader):
    def inner_fn(index):
        with V.set_ops_handler(_HardwareTanh(V.get_ops_handler())):
            return loader(index)
    return inner_fn


def _placeholder(name: str, dtype: torch.dtype, device: torch.device) -> ir.TensorBox:
    layout = ir.FixedLayout(device, dtype, [], [])
    return ir.TensorBox.create(ir.InputBuffer(name=name, layout=layout))


def cast_loader(loader, dtype: torch.dtype):
    """``loader`` with its value converted to ``dtype``."""

    def inner_fn(index):
        return ops.to_dtype(loader(index), dtype)

    return inner_fn


def _read_as_bool(node, placeholder: torch.fx.Node):
    """A bool tensor the kernel reads from a wider copy (``captured_for_kernel``), as the
    bool values the mod's graph was traced with; any other node unchanged."""
    example = placeholder.meta.get("val")
    if not (isinstance(node, ir.IRNode) and isinstance(example, torch.Tensor) and example.dtype == torch.bool
            and node.get_dtype() != torch.bool):
        return node
    return ir.TensorBox(ir.Pointwise(device=node.get_device(), dtype=torch.bool,
                                     inner_fn=cast_loader(node.make_loader(), torch.bool),
                                     ranges=list(node.get_size())))


_REDUCTIONS = frozenset(("sum", "mean", "dot", "vdot", "mv", "mm", "bmm", "addmm", "prod", "amax", "amin",
                         "max", "min", "var", "std", "norm", "linalg_vector_norm", "logsumexp", "cumsum"))


def _reduction_hint(graph_module: torch.fx.GraphModule) -> str:
    """The rewrite that works, when the mod reduces over a tensor."""
    reduces = any(getattr(getattr(n.target, "_overloadpacket", None), "__name__", "") in _REDUCTIONS
                  for n in graph_module.graph.nodes if n.op == "call_function")
    if not reduces:
        return ""
    return ("; it reduces over a tensor, which no kernel can do per score. A dot product of a row "
            "read at the query position and one read at the key position, added to the score "
            "(score + c * torch.dot(x[b, h, q_idx], y[b, kv_idx]), y's head, when it has one, read as "
            "h // G under grouped-query attention), is folded into the attention's matrix product; "
            "write it that way (flexattn.mods.decoupled_rope builds MLA's), or concatenate the rows "
            "onto query and key yourself")


def build_mod_buffer(
    graph_module: torch.fx.GraphModule,
    arg_specs: Sequence[tuple[str, torch.dtype | None]],
    query_dtype: torch.dtype,
    device: torch.device,
    captured: Sequence,
    what: str,
    *,
    fast_tanh: bool = False,
    out_dtype: torch.dtype | None = None,
) -> ir.ComputedBuffer:
    """Lower one mod graph to a 0-d ComputedBuffer for ``modification``.

    ``captured`` are the realized IR nodes (or sympy scalars) of the mod's buffers, in
    the graph's placeholder order after the scalar arguments. ``fast_tanh``: the mod's
    tanh becomes the hardware instruction (``use_fast_tanh``). ``out_dtype``: the value
    is cast to it (a score the kernel carries across tiles keeps its dtype when the mod
    adds a wider captured tensor).
    """
    args = [_placeholder(name, dtype or query_dtype, device) for name, dtype in arg_specs]
    buffer_placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"][len(arg_specs):]
    captured = [_read_as_bool(node, placeholder) for node, placeholder in zip(captured, buffer_placeholders)] \
        + list(captured[len(buffer_placeholders):])
    round_comparison_scalars(graph_module)
    lowering = PointwiseSubgraphLowering(graph_module, root_graph_lowering=V.graph)
    try:
        with V.set_graph_handler(lowering):
            lowering.run(*args, *captured)
    except Exception as e:  # noqa: BLE001 - re-raised with the mod named
        raise ModLoweringError(
            f"flexattn: the {what} cannot be fused into the attention kernel: {e}. "
            f"A {what} must be elementwise on its scalar arguments (indexing captured "
            f"tensors is fine){_reduction_hint(graph_module)}; its graph was:\n{graph_module.code}"
        ) from e

    result = lowering.graph_outputs
    if isinstance(result, (list, tuple)):
        if len(result) != 1:
            raise ModLoweringError(f"flexattn: the {what} must return one value, got {len(result)}")
        result = result[0]
    if not isinstance(result, ir.IRNode):
        raise ModLoweringError(f"flexattn: the {what} must return a tensor, got {type(result).__name__}")
    if list(result.get_size()) != []:
        raise ModLoweringError(
            f"flexattn: the {what} must return a 0-d value per (b, h, q_idx, kv_idx), got shape "
            f"{list(result.get_size())}"
        )
    # Whatever the output node is (a pointwise op, a placeholder passed through, a view),
    # its loader is an elementwise expression of the loads above.
    loader = result.make_loader()
    if fast_tanh:
        loader = _with_hardware_tanh(loader)
    result_dtype = result.get_dtype()
    if out_dtype is not None and result_dtype != out_dtype:
        loader, result_dtype = cast_loader(loader, out_dtype), out_dtype
    body = ir.Pointwise(device=device, dtype=result_dtype, inner_fn=loader, ranges=[])
    buffer = ir.ComputedBuffer(
        name=None,
        layout=ir.FlexibleLayout(device=device, dtype=result_dtype, size=[]),
        data=body,
    )
    buffer.freeze_layout()
    return buffer


_COMPARISONS = {getattr(torch.ops.aten, name).Scalar for name in ("gt", "ge", "lt", "le", "eq", "ne")}
_HALF_DTYPES = (torch.float16, torch.bfloat16)


def round_comparison_scalars(graph_module: torch.fx.GraphModule) -> None:
    """Compare a 16-bit float tensor with a Python float as eager does, in place.

    Eager compares ``table > 0.59`` in the table's dtype, so the scalar is first rounded
    to it; Inductor before torch 2.12 compares the upcast value with the unrounded
    scalar. A table entry equal to the rounded scalar then counts differently in
    create_block_mask (eager) and in the kernel: a key kept there and dropped here.
    Rounding the scalar in the graph gives every torch version eager's answer (rounding
    twice changes nothing)."""
    changed = False
    for node in graph_module.graph.nodes:
        if node.op != "call_function" or node.target not in _COMPARISONS:
            continue
        tensor, scalar = node.args[0], node.args[1]
        example = tensor.meta.get("val") if isinstance(tensor, torch.fx.Node) else None
        if not (isinstance(example, torch.Tensor) and example.dtype in _HALF_DTYPES
                and isinstance(scalar, float)):
            continue
        rounded = torch.tensor(scalar, dtype=example.dtype).item()
        if rounded != scalar:
            node.args = (tensor, rounded, *node.args[2:])
            changed = True
    if changed:
        graph_module.recompile()


def depends_on(node: torch.fx.Node, targets: set, through=lambda n: True) -> bool:
    """Whether the fx ``node`` is computed from any of the nodes ``targets``, following
    only the inputs of nodes for which ``through`` holds."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in targets:
            return True
        if n not in seen:
            seen.add(n)
            if through(n):
                stack.extend(n.all_input_nodes)
    return False


def gathered_tile_bytes(graph_module: torch.fx.GraphModule, n_scalar_args: int) -> int:
    """Bytes per score-tile element that a mod reads from its captured tensors at an
    index depending on both q_idx and kv_idx (a bias table ``bias[h, q_idx - kv_idx]``).

    Triton's loop pipeliner stages such a gather in shared memory like the K and V
    tiles, one tile per extra stage, so it counts toward a configuration's shared-memory
    estimate. ``n_scalar_args``: the mod's scalar arguments before its captured tensors
    (q_idx and kv_idx are the last two of them).
    """
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    q_idx, kv_idx = placeholders[n_scalar_args - 2], placeholders[n_scalar_args - 1]
    total = 0
    for buffer in placeholders[n_scalar_args:]:
        example = buffer.meta.get("val")
        size = example.element_size() if isinstance(example, torch.Tensor) else 4
        for user in buffer.users:
            # Indexing in steps (bias[q_idx][kv_idx]) gathers at the end of the chain.
            while len(user.users) == 1:
                (step,) = user.users
                if step.target is not torch.ops.aten.index.Tensor or step.args[0] is not user:
                    break
                user = step
            if depends_on(user, {q_idx}) and depends_on(user, {kv_idx}):
                total += size
    return total


def key_gathers(graph_module: torch.fx.GraphModule, n_scalar_args: int) -> int:
    """How many distinct reads of captured tensors a mod makes at positions that depend on
    kv_idx: the gathers each KV block reloads (``doc[kv_idx]`` one however often written,
    ``offsets[doc[kv_idx]]`` two, an unrolled search over kv_idx one a step); a gather at both
    q_idx and kv_idx counts two (a tile-shaped read). Reads at q_idx, b or h alone are once
    per query tile."""
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    q_idx, kv_idx = placeholders[n_scalar_args - 2], placeholders[n_scalar_args - 1]
    expressions: dict[torch.fx.Node, Any] = {}

    def expression(arg):
        """What an argument computes, equal for equal computations (as CSE sees them)."""
        if isinstance(arg, (list, tuple)):
            return tuple(expression(a) for a in arg)
        if not isinstance(arg, torch.fx.Node):
            return arg
        if arg not in expressions:
            expressions[arg] = arg if arg.op != "call_function" else (
                arg.target, expression(arg.args), tuple(sorted((k, expression(v)) for k, v in arg.kwargs.items())))
        return expressions[arg]

    reads: dict[Any, int] = {}
    for node in graph_module.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.index.Tensor:
            continue
        indices = [i for i in node.args[1] if isinstance(i, torch.fx.Node)]
        if any(depends_on(i, {kv_idx}) for i in indices):
            reads[expression(node)] = 2 if any(depends_on(i, {q_idx}) for i in indices) else 1
    return sum(reads.values())


def is_identity_score_mod(graph_module: torch.fx.GraphModule) -> bool:
    """True when the score_mod graph returns its first argument unchanged."""
    nodes = list(graph_module.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    outputs = [n for n in nodes if n.op == "output"]
    if not placeholders or len(outputs) != 1:
        return False
    result = outputs[0].args[0]
    if isinstance(result, (list, tuple)) and len(result) == 1:
        result = result[0]
    return result is placeholders[0]


def reads_positions(graph_module: torch.fx.GraphModule) -> bool:
    """Whether a score_mod graph's result depends on q_idx or kv_idx (ALiBi, position tables;
    not a soft-cap of the score alone)."""
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    names = [name for name, _ in SCORE_MOD_ARGS]
    positions = {placeholders[names.index("q_idx")], placeholders[names.index("kv_idx")]}
    output = next(n for n in graph_module.graph.nodes if n.op == "output")
    return any(depends_on(node, positions) for node in output.all_input_nodes)


#: Integer quotients and remainders (``//``, ``%``, ``torch.div(..., rounding_mode=...)``).
_INTEGER_DIVISIONS = frozenset({
    torch.ops.aten.div.Tensor_mode, torch.ops.aten.div.Scalar_mode, torch.ops.aten.floor_divide.default,
    torch.ops.aten.floor_divide.Scalar, torch.ops.aten.remainder.Tensor, torch.ops.aten.remainder.Scalar,
    torch.ops.aten.fmod.Tensor, torch.ops.aten.fmod.Scalar,
})


def divides_by_non_power_of_two(graph_module: torch.fx.GraphModule) -> bool:
    """Whether a mod's graph takes an integer quotient or remainder by anything but a constant
    power of two (a 90-wide canvas's rows and columns; a divisor read at run time).

    A power of two divides by a shift; any other divisor by a multiply-high, shift and sign
    correction per index, whose temporaries the kernels hold beside their accumulators."""
    for node in graph_module.graph.nodes:
        if node.op != "call_function" or node.target not in _INTEGER_DIVISIONS:
            continue
        if node.target in (torch.ops.aten.div.Tensor_mode, torch.ops.aten.div.Scalar_mode) and \
                node.kwargs.get("rounding_mode") is None:
            continue
        divisor = node.args[1]
        if isinstance(divisor, bool) or not isinstance(divisor, int) or divisor <= 0 or divisor & (divisor - 1):
            return True
    return False


def inline_scalar_items(*subgraphs) -> None:
    """Let mods read captured Python floats as 0-d tensors, in place.

    After a recompile Dynamo passes a float that a mod closes over (a soft-cap, a
    temperature) as a 0-d float64 graph input that the mod's graph turns into a Python
    scalar with ``.item()``. The kernels cannot take a symbolic scalar, but they take the
    0-d tensor itself: each ``item`` of a 0-d input is replaced by the input, which
    every elementwise op accepts in its place (a 0-d tensor does not change the result
    dtype of an op on a dimensioned one).
    """
    def inline(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
        if node.op != "call_function" or node.target is not torch.ops.aten._local_scalar_dense.default:
            return False
        source = node.args[0]
        example = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
        if not (isinstance(example, torch.Tensor) and example.dim() == 0):
            return False
        node.replace_all_uses_with(source)
        gm.graph.erase_node(node)
        return True

    _rewrite_nodes(subgraphs, inline)


def _rewrite_nodes(subgraphs, rewrite: Callable[[torch.fx.GraphModule, torch.fx.Node], bool]) -> None:
    """``rewrite(graph_module, node)`` on every node of each subgraph's graph module (a HOP
    subgraph's or a GraphModule itself), which is recompiled where one returns True."""
    for subgraph in subgraphs:
        gm = getattr(subgraph, "graph_module", subgraph)
        if not isinstance(gm, torch.fx.GraphModule):
            continue
        changed = False
        for node in list(gm.graph.nodes):
            changed |= rewrite(gm, node)
        if changed:
            gm.graph.lint()
            gm.recompile()


def _search_operands(node: torch.fx.Node):
    """(value, sorted boundaries, right, out_int32) of a ``bucketize`` / ``searchsorted``
    node that ``unroll_sorted_searches`` can rewrite, else None."""
    aten = torch.ops.aten
    # Both ops take their options as keywords only.
    options = node.kwargs
    if node.target is aten.bucketize.Tensor:
        value, boundaries = node.args
    elif node.target is aten.searchsorted.Tensor and options.get("sorter") is None:
        boundaries, value = node.args
    else:
        return None
    out_int32 = options.get("out_int32", False)
    right = options.get("right", False) or options.get("side") == "right"
    examples = [n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in (value, boundaries)]
    if not all(isinstance(e, torch.Tensor) for e in examples) or examples[0].dim() != 0 or examples[1].dim() != 1:
        return None
    return value, boundaries, bool(right), bool(out_int32)


def unroll_sorted_searches(*subgraphs) -> None:
    """Let mods look a value up in a sorted captured tensor, in place.

    ``torch.bucketize(q_idx, offsets)`` and ``torch.searchsorted(offsets, q_idx)`` (a
    document's index from its start offsets) lower to an op that no kernel can inline
    ("buffers cannot be created while lowering a pointwise subgraph"). On a 1-d table of
    static length n both equal the number of entries before the value (``< value``, or
    ``<= value`` with right=True), which ceil(log2(n + 1)) steps of a branchless binary
    search find with elementwise ops and gathers only: each step reads one entry.
    """
    aten, convert = torch.ops.aten, torch.ops.prims.convert_element_type.default

    def unroll(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
        operands = _search_operands(node) if node.op == "call_function" else None
        if operands is None:
            return False
        value, boundaries, right, out_int32 = operands
        n = boundaries.meta["val"].shape[0]
        graph = gm.graph
        if not isinstance(n, int):
            raise ModLoweringError(
                f"flexattn: {node.target} in a mod needs a table of static length, got length {n} (a table "
                f"whose length changed between calls turns dynamic): pad it to one length, the entries past "
                f"the last start set to the sequence length, so that no position is found past them")
        with graph.inserting_before(node):
            # 0 of the position's dtype whatever the value's (NaN < NaN is false too).
            pos = graph.call_function(convert, (graph.call_function(aten.lt.Tensor, (value, value)), torch.int64))
            step = 1 << max(n.bit_length() - 1, 0)
            while n and step:
                candidate = graph.call_function(aten.add.Tensor, (pos, step))
                within = graph.call_function(aten.le.Scalar, (candidate, n))
                # Entry candidate - 1, or entry 0 (a valid read, not taken) past the end.
                index = graph.call_function(aten.mul.Tensor, (graph.call_function(aten.sub.Tensor, (candidate, 1)),
                                                              graph.call_function(convert, (within, torch.int64))))
                entry = graph.call_function(aten.index.Tensor, (boundaries, [index]))
                before = graph.call_function(aten.le.Tensor if right else aten.lt.Tensor, (entry, value))
                take = graph.call_function(aten.bitwise_and.Tensor, (before, within))
                pos = graph.call_function(aten.where.self, (take, candidate, pos))
                step >>= 1
            if out_int32:
                pos = graph.call_function(convert, (pos, torch.int32))
        node.replace_all_uses_with(pos)
        graph.erase_node(node)
        return True

    _rewrite_nodes(subgraphs, unroll)

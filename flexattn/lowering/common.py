"""Host code that every kernel lowering shares.

* realising inputs for a template (``realize_fixed``, ``broadcast_to``,
  ``captured_for_kernel``, ``as_tensor_boxes``);
* the call preparation (``prepare_call``): q/k/v and the block tables broadcast to the
  query's batch and heads (the transposed lists too, for the backward), captured tensors
  made kernel arguments, the mods lowered to the template's subgraphs;
* the constexprs every kernel shares (``kernel_specialisations``), among them the
  tensor-descriptor choice (``use_tma``) and the float32 dot precision;
* the output layout (``output_layout``);
* template choices (``template_choices``), the autotuning stand-ins for the block
  tables (``benchmark_table_inputs``) and the chosen-config report (``report_choice``).
"""

from __future__ import annotations

import logging
import math
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import sympy
import torch
from torch._inductor import ir
from torch._inductor.lowering import empty_strided, expand, lowerings, to_dtype
from torch._inductor.virtualized import V
from torch.utils._sympy.functions import FloorDiv, Mod

from .. import _compat
from .. import options as _options
from .._mask_tuple import BlockMaskView
from ..block_tables import KV_TABLE_FIELDS, Q_TABLE_FIELDS
from ..numerics import dropout_scale, dropout_threshold, stats_dtype
from .configs.tma import tma_by_default
from .subgraph import (
    MASK_MOD_ARGS,
    SCORE_MOD_ARGS,
    build_mod_buffer,
    cast_loader,
    is_identity_score_mod,
    use_fast_tanh,
)

log = logging.getLogger("flexattn.lowering")

DEBUG_ENV_VAR = "FLEXATTN_DEBUG_CONFIG"

#: The copy engine's alignment of base addresses and row strides, in bytes.
TMA_ALIGNMENT = 16

#: The boolean kernel_options every kernel takes as template flags of the same name.
BOOL_FLAGS = ("OUTPUT_LOGSUMEXP", "OUTPUT_MAX", "PRESCALE_QK", "ROWS_GUARANTEED_SAFE", "BLOCKS_ARE_CONTIGUOUS")

#: The specialisations that report_choice shows.
REPORTED_SPECIALISATIONS = ("GQA_GROUP_SIZE", "QK_HEAD_DIM_PAD", "V_HEAD_DIM_PAD", "HAS_FULL_BLOCKS",
                            "HAS_SCORE_MOD", "SPARSE_Q_BLOCK_SIZE", "SPARSE_KV_BLOCK_SIZE", "USE_TMA", "DENSE_KV")


def hint(expr) -> int:
    """A size's value for choices that only affect speed (its hint when symbolic)."""
    return int(V.graph.sizevars.optimization_hint(expr))


def next_power_of_two_at_least_16(n: int) -> int:
    return max(16, 1 << max(0, (n - 1).bit_length()))


# --------------------------------------------------------------------------------------
# Realising inputs
# --------------------------------------------------------------------------------------
def _reads_zero_dim_cpu_input(node) -> bool:
    """Whether ``node`` reads a 0-d CPU graph input (directly or through a view)."""
    try:
        names = node.get_read_names()
    except (AttributeError, NotImplementedError):
        return False
    for name in names:
        buffer = V.graph.graph_inputs.get(name)
        if buffer is not None and not buffer.get_size() and buffer.get_device().type == "cpu":
            return True
    return False


def realize_fixed(node):
    """A realized IR node whose strides are final (the template bakes them into code).

    Inductor hands a 0-d CPU graph input to Triton kernels as a Python scalar, which a
    template cannot ``tl.load``; a node reading one (the output gradient of ``out.sum()``
    is such an input, expanded) is first copied by a pointwise kernel into a buffer of
    its own.
    """
    if node is None or isinstance(node, sympy.Expr) or not isinstance(node, ir.IRNode):
        return node
    if _reads_zero_dim_cpu_input(node):
        node = ir.Pointwise.create(device=node.get_device(), dtype=node.get_dtype(), inner_fn=node.make_loader(),
                                   ranges=list(node.get_size()))
    node = ir.ExternKernel.realize_input(node)
    storage = node.data if isinstance(node, ir.ReinterpretView) else node
    while isinstance(storage, (ir.TensorBox, ir.StorageBox)):
        storage = storage.data
    if isinstance(storage, ir.Buffer) and isinstance(storage.layout, ir.FlexibleLayout):
        storage.freeze_layout()
    return node


def captured_for_kernel(node, query):
    """A captured tensor of a mod, realized for a Triton template running on the
    query's device.

    Dynamo makes a 0-d float64 CPU input of a Python float that a mod closes over, once
    the float has changed between calls. Such a tensor is copied onto the query's device
    (``realize_fixed`` would copy it on the CPU, see there), as float32 unless the query
    is float64: inside the mod every value is 0-d, so a float64 scalar would otherwise
    promote the whole score computation (as a Python float does not).

    A float16 or bfloat16 tensor captured by a float64 call is copied as float32, a bool
    one as int32 (``build_mod_buffer`` reads it back as bool): Triton (3.6, sm90) fails
    to compile an 8- or 16-bit load into the float64 dot's layout.
    """
    if not isinstance(node, ir.IRNode):
        return node
    dtype = node.get_dtype()
    if not node.get_size() and node.get_device().type == "cpu":
        if dtype == torch.float64 and query.get_dtype() != torch.float64:
            dtype = torch.float32
    elif query.get_dtype() == torch.float64 and dtype in (torch.float16, torch.bfloat16, torch.bool):
        dtype = torch.int32 if dtype == torch.bool else torch.float32
    else:
        return realize_fixed(node)
    node = ir.Pointwise.create(device=query.get_device(), dtype=dtype,
                               inner_fn=cast_loader(node.make_loader(), dtype), ranges=list(node.get_size()))
    return realize_fixed(node)


def as_tensor_boxes(nodes: Sequence) -> list:
    """Realized IR nodes wrapped as the TensorBoxes lowerings take (scalars unchanged)."""
    return [ir.TensorBox(n) if isinstance(n, ir.IRNode) and not isinstance(n, ir.TensorBox) else n
            for n in nodes]


def broadcast_to(node, sizes: Sequence):
    """``node`` expanded to ``sizes`` (stride 0 on broadcast dims), realized as a view."""
    if list(node.get_size()) == list(sizes):
        return realize_fixed(node)
    return realize_fixed(expand(node, list(sizes)))


def dense_buffer(sizes, device, dtype):
    """A new contiguous buffer the kernel writes."""
    return realize_fixed(empty_strided(sizes, None, dtype=dtype, device=device))


def signature_filler(device, dims: int = 1, dtype: torch.dtype = torch.int32):
    """A stand-in for a kernel argument the kernel never reads: a one-element constant of
    the compiled graph (``dims`` dimensions of size 1, for a template that reads the
    argument's strides), made when its module loads, so a call allocates nothing for it.
    One element gives each its own storage (Inductor merges constants that share one, and
    a template's parameters cannot share a buffer)."""
    with torch.utils._python_dispatch._disable_current_modes():
        data = torch.zeros([1] * dims, dtype=dtype, device=device)
    return V.graph.add_tensor_constant(data, "flexattn_unused")


def sinks_for_kernel(sinks, query):
    """The ``sinks`` argument of a forward or decode template: the sink logits as
    (B, Hq) in the softmax's dtype (a per-head vector broadcast over the batch with
    stride 0), or a filler when the call has none (HAS_SINKS False)."""
    if sinks is None:
        return signature_filler(query.get_device())
    B, Hq = query.get_size()[:2]
    dtype = stats_dtype(query.get_dtype())
    node = sinks if sinks.get_dtype() == dtype else to_dtype(sinks, dtype)
    return broadcast_to(node, [B, Hq])


def seed_for_kernel(dropout_seed, device):
    """The ``SEED`` argument of a forward or backward template: the call's (2,) int64
    dropout seed, or a filler when it has none (HAS_DROPOUT False). A seed drawn inside
    the graph and used by no backward is still a pointwise node: realized here."""
    return signature_filler(device) if dropout_seed is None else realize_fixed(dropout_seed)


def dropout_specialisations(kernel_options) -> dict[str, Any]:
    """HAS_DROPOUT, DROPOUT_THRESHOLD and DROPOUT_SCALE from the call's dropout_p (the
    internal DROPOUT_P option; the keep mask as ``numerics.dropout_keep`` draws it)."""
    p = float(_options.read_internal(kernel_options, "DROPOUT_P"))
    return {"HAS_DROPOUT": p > 0, "DROPOUT_THRESHOLD": dropout_threshold(p), "DROPOUT_SCALE": dropout_scale(p)}


def output_layout(query, v_head_dim) -> ir.FixedLayout:
    """Dense (B, Hq, L, Ev) layout in query's dimension order (as the HOP's fake impl)."""
    sizes = list(query.get_size()[:-1]) + [v_head_dim]
    hints = V.graph.sizevars.optimization_hints(query.get_stride())
    order = sorted(range(4), key=lambda d: (-hints[d], d))
    order = [d for d in order if d != 3] + [3]
    strides: list[Any] = [0] * 4
    running: Any = sympy.Integer(1)
    for d in reversed(order):
        strides[d] = running
        running = running * sizes[d]
    return ir.FixedLayout(query.get_device(), query.get_dtype(), sizes, strides)


# --------------------------------------------------------------------------------------
# The call preparation
# --------------------------------------------------------------------------------------
@dataclass
class PreparedCall:
    """The inputs of one call made ready for a template: q/k/v and the block tables
    realized and broadcast to (B, Hq, ...), captured tensors made kernel arguments, and
    the mods lowered to the template's subgraphs. The transposed (per-KV-block) tables
    are prepared for the backward only (None otherwise); absent full-block tables are
    0-element fillers the kernel never reads (``has_full_blocks`` False)."""

    query: Any
    key: Any
    value: Any
    tables: BlockMaskView
    has_full_blocks: bool
    sparse_q: int
    sparse_kv: int
    mask_graph: Any
    #: A BlockMask head dimension of 1 proves the mask is the same for every head.
    mask_varies_over_heads: bool
    score_mod_buffers: list
    mask_mod_buffers: list
    has_score_mod: bool
    score_buffer: Any
    mask_buffer: Any
    fast_tanh: bool


def check_positive_lengths(query, key) -> None:
    for name, node in (("Query", query), ("Key", key)):
        if V.graph.sizevars.statically_known_true(sympy.Eq(node.get_size()[2], 0)):
            # torch's phrase (its tests match it under torch.compile).
            raise ValueError(f"flexattn: {name} length must be greater than 0, got shape {list(node.get_size())}")


def prepare_call(query, key, value, score_graph, block_mask, kernel_options, score_mod_buffers, mask_mod_buffers,
                 *, transposed: bool = False) -> PreparedCall:
    """The shared input preparation of every kernel lowering (see ``PreparedCall``);
    ``transposed``: also the per-KV-block tables (the backward's)."""
    sizevars = V.graph.sizevars
    bm = BlockMaskView(*block_mask)
    device = query.get_device()
    dtype = query.get_dtype()

    B, Hq, _, _ = query.get_size()
    _, Hkv, S, _ = key.get_size()
    mask_varies_over_heads = not sizevars.statically_known_true(sympy.Eq(bm.kv_num_blocks.get_size()[1], 1))

    query = realize_fixed(query)
    key = broadcast_to(key, [B, Hkv, S, key.get_size()[3]])
    value = broadcast_to(value, [B, Hkv, S, value.get_size()[3]])

    def per_query_head(node):
        return broadcast_to(node, [B, Hq, *node.get_size()[2:]])

    has_full_blocks = bm.full_kv_num_blocks is not None
    names = KV_TABLE_FIELDS + (Q_TABLE_FIELDS if transposed else ())
    prepared = {}
    for name in names:
        if name.startswith("full_") and not has_full_blocks:
            prepared[name] = signature_filler(device)
        else:
            prepared[name] = per_query_head(getattr(bm, name))
    tables = bm._replace(**prepared, **{name: None for name in Q_TABLE_FIELDS if name not in prepared})

    score_mod_buffers = [captured_for_kernel(b, query) for b in score_mod_buffers]
    mask_mod_buffers = [captured_for_kernel(b, query) for b in mask_mod_buffers]
    fast_tanh = use_fast_tanh(kernel_options, dtype, device)
    return PreparedCall(
        query=query, key=key, value=value, tables=tables, has_full_blocks=has_full_blocks,
        sparse_q=sizevars.guard_int(bm.q_block_size), sparse_kv=sizevars.guard_int(bm.kv_block_size),
        mask_graph=bm.mask_mod, mask_varies_over_heads=mask_varies_over_heads,
        score_mod_buffers=score_mod_buffers, mask_mod_buffers=mask_mod_buffers,
        has_score_mod=not is_identity_score_mod(score_graph.graph_module),
        score_buffer=build_mod_buffer(score_graph.graph_module, SCORE_MOD_ARGS, dtype, device,
                                      as_tensor_boxes(score_mod_buffers), "score_mod", fast_tanh=fast_tanh,
                                      out_dtype=stats_dtype(dtype)),
        mask_buffer=build_mod_buffer(bm.mask_mod.graph_module, MASK_MOD_ARGS, dtype, device,
                                     as_tensor_boxes(mask_mod_buffers), "mask_mod", fast_tanh=fast_tanh),
        fast_tanh=fast_tanh,
    )


@dataclass(frozen=True)
class ForwardStats:
    """A forward call's (B, Hq, L) log-sum-exp and row-max outputs (``lse``, ``row_max``,
    what the lowering returns) and the kernel's arguments for them (``kernel_lse``,
    ``kernel_row_max``): the output buffer where OUTPUT_LOGSUMEXP / OUTPUT_MAX asks the
    kernel to write it, else a filler. An output the kernel does not write is left to
    Inductor, which allocates it only if the graph reads it (a call without grad reads
    neither, so it allocates neither)."""

    lse: Any
    row_max: Any
    kernel_lse: Any
    kernel_row_max: Any

    @property
    def written(self) -> list:
        """The buffers the kernel writes in place (the template's mutated inputs)."""
        return [b for b, arg in ((self.lse, self.kernel_lse), (self.row_max, self.kernel_row_max)) if b is arg]


def forward_outputs(query, spec: dict[str, Any]) -> ForwardStats:
    """The lse and row-max of a forward call whose constexprs are ``spec``."""
    B, Hq, L, _ = query.get_size()
    device, dtype = query.get_device(), stats_dtype(query.get_dtype())
    lse, row_max = (dense_buffer([B, Hq, L], device, dtype) for _ in range(2))
    return ForwardStats(lse, row_max,
                        lse if spec["OUTPUT_LOGSUMEXP"] else signature_filler(device, 3, dtype),
                        row_max if spec["OUTPUT_MAX"] else signature_filler(device, 3, dtype))


def forward_kernel_inputs(call: PreparedCall, stats: ForwardStats, sinks, dropout_seed) -> dict[str, Any]:
    """A forward kernel's inputs by name, in the order of forward.py.jinja's def_kernel
    (gluon_forward.py.jinja's too)."""
    tables = call.tables
    return {"query": call.query, "key": call.key, "value": call.value, "lse": stats.kernel_lse,
            "row_max": stats.kernel_row_max,
            "kv_num_blocks": tables.kv_num_blocks, "kv_indices": tables.kv_indices,
            "full_kv_num_blocks": tables.full_kv_num_blocks, "full_kv_indices": tables.full_kv_indices,
            "sinks": sinks_for_kernel(sinks, call.query),
            "seed": seed_for_kernel(dropout_seed, call.query.get_device())}


def select_forward(template, template_name: str, usable, what: str, constexprs_of, call: PreparedCall,
                   inputs: dict[str, Any], layout, stats: ForwardStats) -> tuple:
    """A forward template's choices (one per usable configuration, ``constexprs_of(cfg)``
    their constexprs) handed to Inductor's autotuner: (the chosen output node, the map
    from choices to configurations that ``report_choice`` reads)."""
    input_nodes = list(inputs.values())
    choices, config_of_choice = template_choices(
        template, usable, what, constexprs_of,
        input_nodes=input_nodes,
        layout=layout,
        subgraphs=[call.score_buffer, call.mask_buffer],
        mutated_inputs=stats.written,
        call_sizes=call.query.get_size(),
    )
    out = _compat.autotune_select_node(
        template_name, choices, input_nodes + captured_inputs(call), layout,
        input_gen_fns=benchmark_table_inputs(inputs, call.tables, call.has_full_blocks))
    return out, config_of_choice


def captured_inputs(call: PreparedCall) -> list:
    """The captured tensors a template reads, after its own inputs."""
    return [b for b in (*call.score_mod_buffers, *call.mask_mod_buffers) if isinstance(b, ir.IRNode)]


class _ConstantProbe:
    """Ops handler that evaluates a loader made of one constant (anything else raises)."""

    def constant(self, value, dtype):
        return ("constant", value)

    def __getattr__(self, name):
        raise LookupError(name)


def nonzero_or_none(node):
    """``node`` (None stays None), or None when it is a not yet realized fill of zeros:
    the lse gradient autograd materialises when the lse is not used, which the backward
    then neither reads nor subtracts."""
    data = getattr(getattr(node, "data", None), "data", None)
    if not isinstance(data, ir.Pointwise):
        return node
    try:
        with V.set_ops_handler(_ConstantProbe()):
            value = data.inner_fn([0] * len(data.ranges))
    except Exception:  # noqa: BLE001 - any other op: not a constant fill
        return node
    return None if isinstance(value, tuple) and value[0] == "constant" and value[1] == 0 else node


def compute_delta(out, grad_out, grad_logsumexp):
    """rowsum(dO * O) in float32 (float64 for float64 calls), minus the lse gradient when
    there is one (one fused reduction; see the module docstring for why the lse gradient
    folds in here)."""
    work = stats_dtype(out.get_dtype())
    prod = lowerings[torch.ops.aten.mul.Tensor](to_dtype(out, work), to_dtype(grad_out, work))
    delta = lowerings[torch.ops.aten.sum.dim_IntList](prod, [-1])
    grad_logsumexp = nonzero_or_none(grad_logsumexp)
    if grad_logsumexp is not None:
        delta = lowerings[torch.ops.aten.sub.Tensor](delta, to_dtype(grad_logsumexp, work))
    return realize_fixed(delta)


def deterministic_requested(kernel_options: dict[str, Any]) -> bool:
    return bool(_options.read(kernel_options, "DETERMINISTIC")) or torch.are_deterministic_algorithms_enabled()


# --------------------------------------------------------------------------------------
# Specialisations
# --------------------------------------------------------------------------------------
def float32_precision(device: torch.device, dtype: torch.dtype, force_ieee: bool = False) -> str:
    """The tl.dot input_precision for this call, quoted for a constexpr define: TF32 for
    float32 inputs where torch's matmul setting allows it, unless ``force_ieee``
    (kernel_options IEEE_FP32)."""
    if dtype == torch.float32 and device.type == "cuda" and not force_ieee and _compat.float32_matmul_allows_tf32() \
            and torch.cuda.get_device_capability(device) >= (8, 0) and not torch.version.hip:
        return "'tf32'"
    return "'ieee'"


def warn_inert_options(kernel_options: dict[str, Any]) -> None:
    """Warn for torch's kernel_options that flexattn accepts but whose effect it lacks."""
    if not _options.read(kernel_options, "WRITE_DQ"):
        warnings.warn("flexattn: kernel_options WRITE_DQ=False: flexattn's backward always computes dQ; the "
                      "option has no effect", stacklevel=2)


def static_size(n) -> int | None:
    """An IR size as an int, or None where it is symbolic (a dynamic graph keeps one kernel for
    every size, so no size decides it)."""
    return int(n) if isinstance(n, int) or getattr(n, "is_number", False) else None


def mask_reads_memory(mask_mod_buffers) -> bool:
    """Whether a call's mask_mod reads captured tensors (buffers that are IR nodes, not
    inlined scalars)."""
    return any(isinstance(b, ir.IRNode) for b in mask_mod_buffers)


def tma_obstacle(node, name: str) -> str | None:
    """Why ``node`` cannot be read through a tensor descriptor (None if it can)."""
    sizevars = V.graph.sizevars
    elem = node.get_dtype().itemsize
    stride = node.get_stride()
    if not sizevars.statically_known_true(sympy.Eq(stride[-1], 1)):
        return f"the {name}'s head dimension is not contiguous (stride {stride[-1]})"
    if not sizevars.statically_known_multiple_of(node.get_size()[-1] * elem, TMA_ALIGNMENT):
        return f"the {name}'s head dim ({node.get_size()[-1]}) is not a multiple of {TMA_ALIGNMENT} bytes"
    if not all(sizevars.statically_known_multiple_of(st * elem, TMA_ALIGNMENT) for st in stride[:-1]):
        return f"the {name}'s strides {list(stride)} are not multiples of {TMA_ALIGNMENT} bytes"
    # Inductor records GPU graph inputs whose example was misaligned (others it copies
    # when misaligned at run time); on the CPU (the interpreter emulates descriptors)
    # it records every input, and alignment does not matter there.
    misaligned_input = node.get_device().type != "cpu" and node.get_name() in V.graph.unaligned_buffers
    if misaligned_input or not sizevars.statically_known_multiple_of(node.get_layout().offset * elem, TMA_ALIGNMENT):
        return f"the {name}'s data is not {TMA_ALIGNMENT}-byte aligned"
    return None


def first_tma_obstacle(nodes_and_names) -> str | None:
    """The first ``tma_obstacle`` of (node, name) pairs (None: every node can be read through
    a tensor descriptor)."""
    return next(filter(None, (tma_obstacle(node, name) for node, name in nodes_and_names)), None)


def use_tma(kernel_options: dict[str, Any], query, key, value, kernel: str, qk_dim_pad: int,
            extra_operands: Sequence[tuple[Any, str]] = ()) -> bool:
    """The USE_TMA constexpr of one call.

    kernel_options["USE_TMA"] (default None: automatic) True asks for tensor-descriptor
    loads, False forbids them. Automatic means ``configs.tma.tma_by_default``. Either way
    the layouts must suit the copy engine (unit head-dim stride, 16-byte aligned base and
    strides); a request that cannot be honoured warns and loads through pointers.
    ``extra_operands``: further (node, name) tiles the kernel reads through descriptors
    (the backward's output gradient).
    """
    if _options.forbids_tma(kernel_options):
        return False
    requested = _options.read(kernel_options, "USE_TMA")
    if requested is None:
        B, H, L, E = (hint(n) for n in query.get_size())
        S = hint(key.get_size()[-2])
        if not tma_by_default(kernel, query.get_device(), qk_dim_pad, query.get_dtype(), S, B * H * L * S * E):
            return False
    if key.get_dtype() != query.get_dtype():
        # float8 keys and values: the tile shapes and configs are the query dtype's.
        if requested:
            warnings.warn(f"flexattn: kernel_options USE_TMA=True: key/value dtype {key.get_dtype()} differs "
                          f"from the query's; the {kernel} kernel loads through pointers", stacklevel=2)
        return False
    for node, name in ((query, "query"), (key, "key"), (value, "value"), *extra_operands):
        obstacle = tma_obstacle(node, name)
        if obstacle is not None:
            if requested:
                warnings.warn(f"flexattn: kernel_options USE_TMA=True: {obstacle}; the {kernel} kernel loads "
                              "through pointers", stacklevel=2)
            else:
                log.info("flexattn %s: pointer loads, no TMA: %s", kernel, obstacle)
            return False
    return True


def dense_kv(kernel_options: dict[str, Any], has_full_blocks: bool) -> bool:
    """DENSE_KV: flex_attention's own default mask (every block full, in order, in both
    views), whose kernels walk every position from 0 without reading its tables."""
    return bool(_options.read_internal(kernel_options, "DEFAULT_MASK")) and has_full_blocks


def read_bool_options(kernel_options: dict[str, Any], reversed_q_tiles_default: bool) -> dict[str, bool]:
    """The boolean kernel_options as template flags, defaults filled in;
    ``reversed_q_tiles_default``: the kernel's own default of REVERSED_Q_TILES."""
    flags = {key: bool(_options.read(kernel_options, key)) for key in BOOL_FLAGS}
    flags["REVERSED_Q_TILES"] = bool(_options.read(kernel_options, "REVERSED_Q_TILES", reversed_q_tiles_default))
    return flags


def kernel_specialisations(
    *, query, key, value, scale, kernel_options, sparse_q: int, sparse_kv: int,
    has_full_blocks: bool, has_score_mod: bool, kernel: str, reversed_q_tiles_default: bool,
    extra_tma_operands: Sequence[tuple[Any, str]] = (),
) -> dict[str, Any]:
    """Constexprs shared by every tile configuration of one call of ``kernel``
    ("forward", "decode" or "backward"); ``extra_tma_operands`` as in ``use_tma``."""
    warn_inert_options(kernel_options)
    sizevars = V.graph.sizevars
    qk_dim = sizevars.guard_int(query.get_size()[-1])
    v_dim = sizevars.guard_int(value.get_size()[-1])
    if sizevars.guard_int(key.get_size()[-1]) != qk_dim:
        raise ValueError("flexattn: query and key head dims differ")
    qk_pad = next_power_of_two_at_least_16(qk_dim)
    v_pad = next_power_of_two_at_least_16(v_dim)
    hq, hkv = query.get_size()[1], key.get_size()[1]
    group = sizevars.guard_int(FloorDiv(hq, hkv))
    if not sizevars.statically_known_true(sympy.Eq(Mod(hq, hkv), 0)):
        raise ValueError("flexattn: query heads must be a multiple of key/value heads")
    spec = {
        "SM_SCALE": float(scale),
        "GQA_GROUP_SIZE": group,
        "QK_HEAD_DIM": qk_dim,
        "QK_HEAD_DIM_PAD": qk_pad,
        "PAD_QK_HEAD_DIM": qk_pad != qk_dim,
        "V_HEAD_DIM": v_dim,
        "V_HEAD_DIM_PAD": v_pad,
        "PAD_V_HEAD_DIM": v_pad != v_dim,
        "SPARSE_Q_BLOCK_SIZE": sparse_q,
        "SPARSE_KV_BLOCK_SIZE": sparse_kv,
        "HAS_FULL_BLOCKS": has_full_blocks,
        "HAS_SCORE_MOD": has_score_mod,
        "FLOAT32_PRECISION": float32_precision(query.get_device(), query.get_dtype(),
                                               bool(_options.read(kernel_options, "IEEE_FP32"))),
        "FLOAT64_ACC": query.get_dtype() == torch.float64,
        "USE_TMA": use_tma(kernel_options, query, key, value, kernel, qk_pad, extra_tma_operands),
    }
    spec.update(read_bool_options(kernel_options, reversed_q_tiles_default))
    spec["EXP2_SCALE"] = exp2_scale(spec["SM_SCALE"], has_score_mod, spec["PRESCALE_QK"])
    spec["DENSE_KV"] = dense_kv(kernel_options, has_full_blocks)
    if spec["DENSE_KV"]:
        spec["BLOCKS_ARE_CONTIGUOUS"] = True
    return spec


#: log2(e), as common.py.jinja's LOG2_E.
LOG2_E = math.log2(math.e)


def exp2_scale(scale: float, has_score_mod: bool, prescale_qk: bool) -> float:
    """The EXP2_SCALE constexpr: the factor from a loop's scores to base-2 softmax
    exponents, applied after the row max and the masks, so it must be positive.
    score_mod's output is in natural units (LOG2_E); without one the loop keeps the raw
    product, which still needs the scale (scale * LOG2_E) unless PRESCALE_QK put it in
    q, or unless the scale is not positive: then the loop scales the scores itself
    (scale_scores in common.py.jinja), and it is 1. Derived here in double precision: a
    jitted helper's result reaches the kernel as a float32 value."""
    if has_score_mod:
        return LOG2_E
    if prescale_qk or scale <= 0:
        return 1.0
    return scale * LOG2_E


def divisible(length, block: int) -> bool:
    """Whether ``length`` is provably a multiple of ``block`` (IS_DIVISIBLE_* flags)."""
    return V.graph.sizevars.statically_known_true(sympy.Eq(Mod(length, block), 0))


# --------------------------------------------------------------------------------------
# Template choices and autotuning inputs
# --------------------------------------------------------------------------------------
def template_choices(template, usable, what: str, constexprs_of, *, on_choice=None,
                     **generate_kwargs) -> tuple[list, dict]:
    """One Inductor choice of ``template`` per configuration in ``usable``.

    ``constexprs_of(cfg)`` gives a configuration's own constexprs; ``generate_kwargs``
    are shared by all (inputs, layout, subgraphs, ...); ``on_choice(choice)`` may adjust
    each new choice. Returns the choices and a map from each choice's renderer to its
    configuration (for logging what Inductor picks); raises, listing every
    configuration's error, when none could be generated.
    """
    choices: list[Any] = []
    config_of_choice: dict[int, Any] = {}
    errors: list[str] = []
    for cfg in usable:
        error = template.maybe_append_choice(
            choices, num_stages=cfg.num_stages, num_warps=cfg.num_warps, **generate_kwargs, **constexprs_of(cfg))
        if error is not None:
            errors.append(f"{cfg.describe()}: {error}")
            continue
        if on_choice is not None:
            on_choice(choices[-1])
        config_of_choice[id(choices[-1].make_kernel_render)] = cfg
    if not choices:
        raise RuntimeError(f"flexattn: the {what} template could not be generated for any "
                           "configuration:\n" + "\n".join(errors))
    return choices, config_of_choice


def _benchmark_block_indices(node) -> torch.Tensor:
    """Every KV block listed in order: a valid, dense index table for benchmarking."""
    size = V.graph.sizevars.optimization_hints(node.get_size())
    row = torch.arange(size[-1], dtype=node.get_dtype(), device=node.get_device())
    return row.expand(size).contiguous()


def _benchmark_full_block_indices(node) -> torch.Tensor:
    """The block list rotated by half: disjoint from the first half of the partial list."""
    size = V.graph.sizevars.optimization_hints(node.get_size())
    n_blocks = size[-1]
    row = torch.arange(n_blocks, dtype=node.get_dtype(), device=node.get_device())
    row = torch.roll(row, -max(1, int(round(n_blocks * 0.5))))
    return row.expand(size).contiguous()


def _benchmark_block_counts(index_node, share: float) -> Callable:
    """Counts that make each benchmark row visit ``share`` of the KV blocks (at least one)."""

    def make(node) -> torch.Tensor:
        n_blocks = V.graph.sizevars.optimization_hint(index_node.get_size()[-1])
        count = max(1, int(round(n_blocks * share)))
        size = V.graph.sizevars.optimization_hints(node.get_size())
        return torch.full(size, count, dtype=node.get_dtype(), device=node.get_device())

    return make


def benchmark_table_inputs(inputs: dict[str, Any], tables: BlockMaskView, has_full_blocks: bool) -> dict[int, Callable]:
    """Autotuning stand-ins for the block tables among a template's ``inputs`` (its
    input nodes by name, in order): every row visits all blocks, half partial and half
    full when there are full blocks, so that both loops are timed."""
    share = 0.5 if has_full_blocks else 1.0
    pairs = [("kv_num_blocks", "kv_indices", False), ("q_num_blocks", "q_indices", False)]
    if has_full_blocks:
        pairs += [("full_kv_num_blocks", "full_kv_indices", True), ("full_q_num_blocks", "full_q_indices", True)]
    position = {name: i for i, name in enumerate(inputs)}
    gens: dict[int, Callable] = {}
    for count_name, index_name, full in pairs:
        if index_name in position:
            gens[position[count_name]] = _benchmark_block_counts(getattr(tables, index_name), share)
            gens[position[index_name]] = _benchmark_full_block_indices if full else _benchmark_block_indices
    return dict(sorted(gens.items()))


# --------------------------------------------------------------------------------------
# The chosen-config report
# --------------------------------------------------------------------------------------
def _debug_requested(kernel_options: dict[str, Any]) -> bool:
    return bool(_options.read(kernel_options, "DEBUG_CONFIG")) or os.environ.get(DEBUG_ENV_VAR, "0") == "1"


def report_choice(kernel: str, node, config_of_choice, usable, spec: dict[str, Any], spec_keys: Sequence[str],
                  query, key, value, kernel_options: dict[str, Any], started: float, details: str = "") -> None:
    """Log which tile configuration a call of ``kernel`` got (at WARNING with
    kernel_options DEBUG_CONFIG or FLEXATTN_DEBUG_CONFIG=1, else at INFO): the input
    shapes, the config (or the candidates when Inductor decides later), ``details``, the
    ``spec_keys`` specialisations, and the seconds since ``started`` (a perf_counter
    reading at the lowering's start: lowering, plus benchmarking under max_autotune)."""
    level = logging.WARNING if _debug_requested(kernel_options) else logging.INFO
    if not log.isEnabledFor(level):
        return
    buffer = node.data.data if isinstance(node, ir.TensorBox) else node
    chosen = config_of_choice.get(id(getattr(buffer, "make_kernel_render", None)))
    what = chosen.describe() if chosen is not None else (
        f"decided later by Inductor among {[c.describe() for c in usable]}")
    log.log(level, "flexattn %s: q %s k %s v %s %s -> %s%s (of %d candidate(s)), lowered%s in %.2f s; "
            "specialisations %s",
            kernel, list(query.get_size()), list(key.get_size()), list(value.get_size()), query.get_dtype(),
            what, details, len(usable), " and autotuned" if len(usable) > 1 else "", time.perf_counter() - started,
            {k: spec[k] for k in spec_keys})

"""Inductor lowering of ``flex_attention_hop`` onto the forward Triton template.

``lower_flex_attention`` is the function registered for the HOP. Per call it

1. picks the backend from the device (``use_triton_template``): CUDA tensors, and CPU
   tensors when ``torch._inductor.config.cpu_backend == "triton"``, go to the template
   (short queries to the split-KV decode kernel of ``decode.py`` instead:
   ``use_decode_kernel``); other CPU calls go to the dense path in ``dense.py``;
2. lowers score_mod and mask_mod to the IR the template inlines (``subgraph.py``);
3. derives the kernel's specialisations on the host (``forward_specialisations``);
4. builds one template choice per usable tile configuration (``configs.py``) and hands
   them to Inductor's autotuner;
5. logs the chosen configuration on the ``flexattn.lowering`` logger (at INFO; at
   WARNING with ``kernel_options["DEBUG_CONFIG"]=True`` or ``FLEXATTN_DEBUG_CONFIG=1``).

kernel_options keys read here (besides the tile keys of ``configs.py``):
OUTPUT_LOGSUMEXP, OUTPUT_MAX (write lse / max_scores; when False their contents are
unspecified), PRESCALE_QK, ROWS_GUARANTEED_SAFE, BLOCKS_ARE_CONTIGUOUS,
REVERSED_Q_TILES (see the flags in ``templates/forward.py.jinja``),
DEBUG_CONFIG (log the chosen config at WARNING).
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import sympy
import torch
from torch._inductor import config as inductor_config
from torch._inductor import ir
from torch._inductor.lowering import empty_strided, expand
from torch._inductor.select_algorithm import SymbolicGridFn, TritonTemplate
from torch._inductor.virtualized import V, ops
from torch.utils._sympy.functions import FloorDiv, Mod

from .. import _compat
from ..block_mask import DEFAULT_MASK_KEY
from ..templates import kernel_source
from . import configs as cfgs
from .subgraph import (MASK_MOD_ARGS, SCORE_MOD_ARGS, build_mod_buffer, gathered_tile_bytes, is_identity_score_mod,
                       use_fast_tanh)

log = logging.getLogger("flexattn.lowering")

DEBUG_ENV_VAR = "FLEXATTN_DEBUG_CONFIG"
TEMPLATE_NAME = "flexattn_forward"

#: kernel_options keys that are booleans with these defaults.
BOOL_OPTIONS = {
    "OUTPUT_LOGSUMEXP": True,
    "OUTPUT_MAX": False,
    "PRESCALE_QK": False,
    "ROWS_GUARANTEED_SAFE": False,
    "BLOCKS_ARE_CONTIGUOUS": False,
}


@SymbolicGridFn
def forward_grid(batch, q_heads, q_len, qk_head_dim, meta, *, cdiv):
    """Launch grid of the forward kernel, from ``call_sizes`` = the query's size.

    program_id(0) covers query rows [t * BLOCK_M, (t + 1) * BLOCK_M) of tile t = pid0,
    or t = cdiv(q_len, BLOCK_M) - 1 - pid0 with REVERSED_Q_TILES (the last tile may run
    past Q_LEN and is masked); program_id(1) the batch index;
    program_id(2) the query head. Each program walks every KV block the BlockMask lists
    for its rows.
    """
    return (cdiv(q_len, meta["BLOCK_M"]), batch, q_heads)


forward_template = TritonTemplate(
    name=TEMPLATE_NAME,
    grid=forward_grid,
    source=kernel_source("forward"),
)


def use_triton_template(device: torch.device) -> bool:
    if device.type == "cpu":
        return _compat.inductor_cpu_backend() == "triton"
    return device.type in ("cuda", "xpu")


def lower_flex_attention(
    query, key, value, score_mod, block_mask, scale, kernel_options,
    score_mod_buffers=(), mask_mod_buffers=(),
):
    """The lowering registered for ``flexattn._hop.flex_attention_hop``."""
    from .subgraph import inline_scalar_items

    inline_scalar_items(score_mod, block_mask[-1])
    device = query.get_device()
    if use_triton_template(device):
        # Short queries (decoding) go to the split-KV decode kernel: lowering/decode.py.
        from .decode import lower_to_decode_template, use_decode_kernel

        if use_decode_kernel(query, key, kernel_options or {}):
            return lower_to_decode_template(query, key, value, score_mod, block_mask, scale, kernel_options,
                                            score_mod_buffers, mask_mod_buffers)
        return lower_to_template(query, key, value, score_mod, block_mask, scale, kernel_options,
                                 score_mod_buffers, mask_mod_buffers)
    if device.type == "cpu":
        from .dense import lower_dense

        log.info("flexattn forward on CPU with cpu_backend=%r: dense decomposition",
                 _compat.inductor_cpu_backend())
        return lower_dense(query, key, value, score_mod, block_mask, scale, kernel_options,
                           score_mod_buffers, mask_mod_buffers)
    raise NotImplementedError(f"flexattn: no forward kernel for device type {device.type!r}")


# --------------------------------------------------------------------------------------
# Host-side preparation
# --------------------------------------------------------------------------------------
def next_power_of_two_at_least_16(n: int) -> int:
    return max(16, 1 << max(0, (n - 1).bit_length()))


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
    """
    if isinstance(node, ir.IRNode) and not node.get_size() and node.get_device().type == "cpu":
        dtype = node.get_dtype()
        if dtype == torch.float64 and query.get_dtype() != torch.float64:
            dtype = torch.float32
        loader = node.make_loader()
        node = ir.Pointwise.create(device=query.get_device(), dtype=dtype,
                                   inner_fn=lambda index: ops.to_dtype(loader(index), dtype), ranges=[])
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


def float32_precision(device: torch.device, dtype: torch.dtype, force_ieee: bool = False) -> str:
    """The tl.dot input_precision for this call, quoted for a constexpr define: TF32 for
    float32 inputs where torch's matmul setting allows it, unless ``force_ieee``
    (kernel_options IEEE_FP32)."""
    if dtype == torch.float32 and device.type == "cuda" and not force_ieee and _compat.float32_matmul_allows_tf32() \
            and torch.cuda.get_device_capability(device) >= (8, 0) and not torch.version.hip:
        return "'tf32'"
    return "'ieee'"


#: torch's kernel_options that flexattn accepts (a drop-in call keeps working) but whose
#: effect its kernels do not have; setting one to a non-default value warns at compile.
_INERT_OPTIONS = {
    "WRITE_DQ": (True, "flexattn's backward always computes dQ; the option has no effect"),
}


def warn_inert_options(kernel_options: dict[str, Any]) -> None:
    for key, (default, why) in _INERT_OPTIONS.items():
        if key in kernel_options and bool(kernel_options[key]) != default:
            warnings.warn(f"flexattn: kernel_options {key}={kernel_options[key]!r}: {why}", stacklevel=2)


#: The copy engine's alignment of base addresses and row strides, in bytes.
TMA_ALIGNMENT = 16


def _tma_obstacle(node, name: str) -> str | None:
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


def use_tma(kernel_options: dict[str, Any], query, key, value, kernel: str, qk_dim_pad: int,
            extra_operands: Sequence[tuple[Any, str]] = ()) -> bool:
    """The USE_TMA constexpr of one call.

    kernel_options["USE_TMA"] (default None: automatic) True asks for tensor-descriptor
    loads, False forbids them. Automatic means on for 16-bit inputs on a CUDA GPU with
    the tensor memory accelerator (sm90 and later), for the kernels and head dims where
    it measured faster (``configs.TMA_DEFAULTS``, by ``qk_dim_pad``). Either way the
    layouts must suit the copy engine (unit head-dim stride, 16-byte aligned base and
    strides); a request that cannot be honoured warns and loads through pointers.
    ``extra_operands``: further (node, name) tiles the kernel reads through descriptors
    (the backward's output gradient).
    """
    requested = kernel_options.get("USE_TMA")
    if requested is not None and not requested:
        return False
    if requested is None and not cfgs.tma_by_default(kernel, query.get_device(), qk_dim_pad, query.get_dtype()):
        return False
    for node, name in ((query, "query"), (key, "key"), (value, "value"), *extra_operands):
        obstacle = _tma_obstacle(node, name)
        if obstacle is not None:
            if requested:
                warnings.warn(f"flexattn: kernel_options USE_TMA=True: {obstacle}; the {kernel} kernel loads "
                              "through pointers", stacklevel=2)
            else:
                log.info("flexattn %s: pointer loads, no TMA: %s", kernel, obstacle)
            return False
    return True


#: Default of kernel_options REVERSED_Q_TILES per kernel (the template flag), measured on
#: an H200 (bf16, D=128, 4 x 16 heads, tune_forward / tune_backward, three runs each):
#: the forward lost with it (causal S=8192: 447-461 vs 452-465 TFLOP/s), the backward's
#: dQ programs gained at S=2048 (fwd+bwd causal 311-315 vs 283-310, no mask 398-408 vs
#: 394-396) and tied at S=8192 (401 vs 400-404). The decode kernel has no such order.
REVERSED_Q_TILES_DEFAULT = {"forward": False, "backward": True, "decode": False}


def read_bool_options(kernel_options: dict[str, Any], kernel: str = "forward") -> dict[str, bool]:
    """The boolean kernel_options as template flags for ``kernel``, defaults filled in."""
    flags = {key: bool(kernel_options.get(key, default)) for key, default in BOOL_OPTIONS.items()}
    flags["REVERSED_Q_TILES"] = bool(kernel_options.get("REVERSED_Q_TILES", REVERSED_Q_TILES_DEFAULT[kernel]))
    return flags


def forward_specialisations(
    *, query, key, value, scale, kernel_options, sparse_q: int, sparse_kv: int,
    has_full_blocks: bool, has_score_mod: bool, kernel: str = "forward",
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
                                               bool(kernel_options.get("IEEE_FP32"))),
        "FLOAT64_ACC": query.get_dtype() == torch.float64,
        "USE_TMA": use_tma(kernel_options, query, key, value, kernel, qk_pad, extra_tma_operands),
    }
    spec.update(read_bool_options(kernel_options, kernel))
    # flex_attention's own default mask (every block full, in order, in both views):
    # the kernels walk every position from 0 without reading its tables (DENSE_KV).
    spec["DENSE_KV"] = bool(kernel_options.get(DEFAULT_MASK_KEY, False)) and has_full_blocks
    if spec["DENSE_KV"]:
        spec["BLOCKS_ARE_CONTIGUOUS"] = True
    return spec


def divisibility(query, key, cfg: cfgs.ForwardConfig, sparse_kv: int) -> dict[str, bool]:
    """IS_DIVISIBLE_M / IS_DIVISIBLE_N for one config (False unless provable)."""
    known = V.graph.sizevars.statically_known_true
    return {
        "IS_DIVISIBLE_M": known(sympy.Eq(Mod(query.get_size()[2], cfg.block_m), 0)),
        "IS_DIVISIBLE_N": known(sympy.Eq(Mod(key.get_size()[2], sparse_kv), 0)),
    }


# --------------------------------------------------------------------------------------
# Autotuning inputs
# --------------------------------------------------------------------------------------
def _benchmark_block_indices(node) -> torch.Tensor:
    """Every KV block listed in order: a valid, dense index table for benchmarking."""
    size = V.graph.sizevars.optimization_hints(node.get_size())
    row = torch.arange(size[-1], dtype=node.get_dtype(), device=node.get_device())
    return row.expand(size).contiguous()


def _benchmark_block_counts(index_node, share: float):
    """Counts that make each benchmark row visit ``share`` of the KV blocks (at least one)."""

    def make(node) -> torch.Tensor:
        n_blocks = V.graph.sizevars.optimization_hint(index_node.get_size()[-1])
        count = max(1, int(round(n_blocks * share)))
        size = V.graph.sizevars.optimization_hints(node.get_size())
        return torch.full(size, count, dtype=node.get_dtype(), device=node.get_device())

    return make


# --------------------------------------------------------------------------------------
# The lowering proper
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


@dataclass
class PreparedCall:
    """The inputs of one forward or decode call made ready for a template: q/k/v and the
    block tables realized and broadcast to (B, Hq, ...), captured tensors made kernel
    arguments, and the mods lowered to the template's subgraphs."""

    query: Any
    key: Any
    value: Any
    kv_num_blocks: Any
    kv_indices: Any
    full_kv_num_blocks: Any
    full_kv_indices: Any
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


def prepare_call(query, key, value, score_mod, block_mask, kernel_options,
                 score_mod_buffers, mask_mod_buffers) -> PreparedCall:
    """Shared input preparation of the forward and decode lowerings."""
    sizevars = V.graph.sizevars
    (_, _, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
     _, _, _, _, sparse_q, sparse_kv, mask_graph) = block_mask
    device = query.get_device()
    dtype = query.get_dtype()

    B, Hq, L, _ = query.get_size()
    _, Hkv, S, _ = key.get_size()
    for name, length in (("query", L), ("key", S)):
        if sizevars.statically_known_true(sympy.Eq(length, 0)):
            raise ValueError(f"flexattn: the {name} length must be positive")
    mask_varies_over_heads = not sizevars.statically_known_true(sympy.Eq(kv_num_blocks.get_size()[1], 1))

    query = realize_fixed(query)
    key = broadcast_to(key, [B, Hkv, S, key.get_size()[3]])
    value = broadcast_to(value, [B, Hkv, S, value.get_size()[3]])

    n_q_blocks = kv_num_blocks.get_size()[-1]
    kv_num_blocks = broadcast_to(kv_num_blocks, [B, Hq, n_q_blocks])
    kv_indices = broadcast_to(kv_indices, [B, Hq, n_q_blocks, kv_indices.get_size()[-1]])
    has_full_blocks = full_kv_num_blocks is not None
    if has_full_blocks:
        full_kv_num_blocks = broadcast_to(full_kv_num_blocks, [B, Hq, full_kv_num_blocks.get_size()[-1]])
        full_kv_indices = broadcast_to(
            full_kv_indices, [B, Hq, full_kv_indices.get_size()[-2], full_kv_indices.get_size()[-1]])
    else:
        # The kernel never reads these (HAS_FULL_BLOCKS=False); they fill the signature.
        full_kv_num_blocks = realize_fixed(empty_strided([0], [1], dtype=torch.int32, device=device))
        full_kv_indices = realize_fixed(empty_strided([0], [1], dtype=torch.int32, device=device))

    score_mod_buffers = [captured_for_kernel(b, query) for b in score_mod_buffers]
    mask_mod_buffers = [captured_for_kernel(b, query) for b in mask_mod_buffers]
    fast_tanh = use_fast_tanh(kernel_options, dtype, device)
    return PreparedCall(
        query=query, key=key, value=value,
        kv_num_blocks=kv_num_blocks, kv_indices=kv_indices,
        full_kv_num_blocks=full_kv_num_blocks, full_kv_indices=full_kv_indices,
        has_full_blocks=has_full_blocks,
        sparse_q=sizevars.guard_int(sparse_q), sparse_kv=sizevars.guard_int(sparse_kv),
        mask_graph=mask_graph, mask_varies_over_heads=mask_varies_over_heads,
        score_mod_buffers=score_mod_buffers, mask_mod_buffers=mask_mod_buffers,
        has_score_mod=not is_identity_score_mod(score_mod.graph_module),
        score_buffer=build_mod_buffer(score_mod.graph_module, SCORE_MOD_ARGS, dtype, device,
                                      as_tensor_boxes(score_mod_buffers), "score_mod", fast_tanh=fast_tanh),
        mask_buffer=build_mod_buffer(mask_graph.graph_module, MASK_MOD_ARGS, dtype, device,
                                     as_tensor_boxes(mask_mod_buffers), "mask_mod", fast_tanh=fast_tanh),
    )


def lower_to_template(
    query, key, value, score_mod, block_mask, scale, kernel_options,
    score_mod_buffers, mask_mod_buffers,
):
    kernel_options = dict(kernel_options or {})
    device = query.get_device()
    dtype = query.get_dtype()
    B, Hq, L, _ = query.get_size()
    call = prepare_call(query, key, value, score_mod, block_mask, kernel_options, score_mod_buffers, mask_mod_buffers)
    query, key, value = call.query, call.key, call.value

    spec = forward_specialisations(
        query=query, key=key, value=value, scale=scale, kernel_options=kernel_options,
        sparse_q=call.sparse_q, sparse_kv=call.sparse_kv, has_full_blocks=call.has_full_blocks,
        has_score_mod=call.has_score_mod,
    )

    layout = output_layout(query, spec["V_HEAD_DIM"])
    lse = realize_fixed(empty_strided([B, Hq, L], None, dtype=torch.float32, device=device))
    row_max = realize_fixed(empty_strided([B, Hq, L], None, dtype=torch.float32, device=device))
    # The kernel writes lse and row_max in place: the template's extra outputs.

    mask_reads_memory = any(isinstance(b, ir.IRNode) for b in call.mask_mod_buffers)
    candidates = cfgs.candidate_configs(device, spec["QK_HEAD_DIM_PAD"], dtype,
                                        bool(inductor_config.max_autotune), kernel_options,
                                        mask_reads_memory=mask_reads_memory)
    usable = cfgs.usable_configs(
        candidates, kernel_options, sparse_q=call.sparse_q, sparse_kv=call.sparse_kv,
        qk_dim_pad=spec["QK_HEAD_DIM_PAD"], v_dim_pad=spec["V_HEAD_DIM_PAD"],
        elem_bytes=torch.empty((), dtype=dtype).element_size(),
        smem_limit=cfgs.shared_memory_limit(device),
        gathered_bytes=(gathered_tile_bytes(score_mod.graph_module, len(SCORE_MOD_ARGS))
                        + gathered_tile_bytes(call.mask_graph.graph_module, len(MASK_MOD_ARGS))),
    )

    input_nodes = [query, key, value, lse, row_max, call.kv_num_blocks, call.kv_indices,
                   call.full_kv_num_blocks, call.full_kv_indices]
    choices, config_of_choice = template_choices(
        forward_template, usable, "forward",
        lambda cfg: {**spec, **divisibility(query, key, cfg, call.sparse_kv),
                     "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "ONE_KV_LOOP": cfg.one_kv_loop},
        input_nodes=input_nodes,
        layout=layout,
        subgraphs=[call.score_buffer, call.mask_buffer],
        mutated_inputs=[lse, row_max],
        call_sizes=query.get_size(),
    )

    captured = [b for b in (*call.score_mod_buffers, *call.mask_mod_buffers) if isinstance(b, ir.IRNode)]
    if call.has_full_blocks:
        # Benchmark rows visit half of the KV blocks as partial and the other half as
        # full, so that both loops are timed.
        input_gen_fns = {5: _benchmark_block_counts(call.kv_indices, 0.5), 6: _benchmark_block_indices,
                         7: _benchmark_block_counts(call.full_kv_indices, 0.5), 8: _benchmark_full_block_indices}
    else:
        input_gen_fns = {5: _benchmark_block_counts(call.kv_indices, 1.0), 6: _benchmark_block_indices}
    out = _compat.autotune_select_node(
        "flexattn_forward", choices, input_nodes + captured, layout, input_gen_fns=input_gen_fns)

    report_choice("forward", out, config_of_choice, usable, spec, REPORTED_SPECIALISATIONS, query, key, value,
                  kernel_options)
    return out, ir.TensorBox(lse), ir.TensorBox(row_max)


def _benchmark_full_block_indices(node) -> torch.Tensor:
    """The block list rotated by half: disjoint from the first half of the partial list."""
    size = V.graph.sizevars.optimization_hints(node.get_size())
    n_blocks = size[-1]
    row = torch.arange(n_blocks, dtype=node.get_dtype(), device=node.get_device())
    row = torch.roll(row, -max(1, int(round(n_blocks * 0.5))))
    return row.expand(size).contiguous()


def _debug_requested(kernel_options: dict[str, Any]) -> bool:
    return bool(kernel_options.get("DEBUG_CONFIG")) or os.environ.get(DEBUG_ENV_VAR, "0") == "1"


def report_choice(kernel: str, node, config_of_choice, usable, spec: dict[str, Any], spec_keys: Sequence[str],
                  query, key, value, kernel_options: dict[str, Any], details: str = "") -> None:
    """Log which tile configuration a call of ``kernel`` got (at WARNING with
    kernel_options DEBUG_CONFIG or FLEXATTN_DEBUG=1, else at INFO): the input shapes,
    the config (or the candidates when Inductor decides later), ``details`` and the
    ``spec_keys`` specialisations."""
    level = logging.WARNING if _debug_requested(kernel_options) else logging.INFO
    if not log.isEnabledFor(level):
        return
    buffer = node.data.data if isinstance(node, ir.TensorBox) else node
    chosen = config_of_choice.get(id(getattr(buffer, "make_kernel_render", None)))
    what = chosen.describe() if chosen is not None else (
        f"decided later by Inductor among {[c.describe() for c in usable]}")
    log.log(level, "flexattn %s: q %s k %s v %s %s -> %s%s (of %d candidate(s)); specialisations %s",
            kernel, list(query.get_size()), list(key.get_size()), list(value.get_size()), query.get_dtype(),
            what, details, len(usable), {k: spec[k] for k in spec_keys})


#: The specialisations that report_choice shows for the forward and decode kernels.
REPORTED_SPECIALISATIONS = ("GQA_GROUP_SIZE", "QK_HEAD_DIM_PAD", "V_HEAD_DIM_PAD", "HAS_FULL_BLOCKS",
                            "HAS_SCORE_MOD", "SPARSE_Q_BLOCK_SIZE", "SPARSE_KV_BLOCK_SIZE", "USE_TMA", "DENSE_KV")


__all__ = ["forward_grid", "forward_template", "lower_flex_attention", "use_triton_template"]

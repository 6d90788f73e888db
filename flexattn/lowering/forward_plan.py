"""Which forward kernel a call takes: the Gluon kernel for Hopper or the Triton template.

``plan_forward`` is a pure function of ``ForwardInputs`` (sizes, dtypes, the GPU, the
options): the Gluon kernel (``templates/gluon_forward.py.jinja``) where it covers the
call, the Triton template (``templates/forward.py.jinja``) otherwise, with the reason.
kernel_options BACKEND="TRITON" forces the template; BACKEND="GLUON" forces the Gluon
kernel and raises, naming the obstacle, where it does not cover the call. ``forward_inputs``
reads the inputs off a call's IR nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import options as _options
from . import common
from .configs import gluon_forward as gluon_configs
from .configs import tma as tma_configs

#: Gluon's Hopper API, as the Gluon kernel uses it (Triton 3.6 and later).
_GLUON_HOPPER_MODULE = "triton.experimental.gluon.language.nvidia.hopper"


@dataclass(frozen=True)
class ForwardInputs:
    """What the forward kernel choice depends on."""

    device_type: str
    #: (major, minor) of a CUDA device, else None.
    capability: tuple[int, int] | None
    interpreter: bool
    gluon_available: bool
    dtype: torch.dtype
    kv_dtype: torch.dtype
    qk_head_dim: int
    v_head_dim: int
    sparse_q: int
    sparse_kv: int
    has_dropout: bool
    prescale_qk: bool
    #: Why Q, K or V cannot be read through tensor descriptors (None: they can).
    tma_obstacle: str | None
    #: kernel_options keys that pin a tile of the Triton template.
    pinned_tiles: tuple[str, ...]
    backend: str
    #: The mask_mod reads captured tensors.
    mask_reads_memory: bool = False
    #: The BlockMask's partial_heavy (nearly all listed blocks partial; None: not known).
    partial_heavy: bool | None = None
    #: kernel_options USE_TMA=False: the call forbids tensor-descriptor loads.
    tma_forbidden: bool = False
    #: kernel_options USE_TMA=True: the call asks for tensor-descriptor loads.
    tma_requested: bool = False
    #: batch x heads x queries x keys x QK head dim (size hints; None: not known).
    work: int | None = None
    #: No block mask (flex_attention's own default mask): the kernels walk every position.
    dense: bool = False
    #: A score_mod other than the identity.
    has_score_mod: bool = True


@dataclass(frozen=True)
class ForwardPlan:
    kernel: str  # "gluon" or "triton"
    reason: str


def gluon_device_obstacle(device_type: str, capability: tuple[int, int] | None, interpreter: bool,
                          gluon_available: bool, dtype: torch.dtype, what: str) -> str | None:
    """Why no Gluon kernel (``what``: its name in the reason) runs on this device and dtype."""
    if device_type != "cuda" or interpreter:
        return f"device {device_type}{' (interpreter)' if interpreter else ''} is not a Hopper GPU"
    if capability != (9, 0):
        return f"compute capability {capability} is not sm90"
    if not gluon_available:
        return "this Triton has no Gluon Hopper API"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {dtype} ({what} takes float16 and bfloat16)"
    return None


def gluon_obstacle(inputs: ForwardInputs) -> str | None:
    """Why the Gluon kernel cannot run the call (None: it can)."""
    obstacle = gluon_device_obstacle(inputs.device_type, inputs.capability, inputs.interpreter,
                                     inputs.gluon_available, inputs.dtype, "the Gluon kernel")
    if obstacle is not None:
        return obstacle
    if inputs.kv_dtype != inputs.dtype:
        return f"key/value dtype {inputs.kv_dtype} differs from the query's {inputs.dtype}"
    if inputs.qk_head_dim not in gluon_configs.SM90 or inputs.v_head_dim not in gluon_configs.SM90:
        return (f"head dims {inputs.qk_head_dim}/{inputs.v_head_dim} (the Gluon kernel takes "
                f"{sorted(gluon_configs.SM90)})")
    cfg = gluon_configs.config_for(inputs.qk_head_dim, inputs.v_head_dim, inputs.dtype.itemsize, _unmodified(inputs))
    if cfg is None:
        return f"head dims {inputs.qk_head_dim}/{inputs.v_head_dim} do not fit shared memory"
    if (not inputs.dense and inputs.sparse_q % cfg.block_m) or inputs.sparse_kv % cfg.block_n:
        return (f"BlockMask block size ({inputs.sparse_q}, {inputs.sparse_kv}) is not a multiple of the "
                f"Gluon tile ({cfg.block_m}, {cfg.block_n})")
    if inputs.has_dropout:
        return "dropout (the Triton template draws the keep mask)"
    if inputs.prescale_qk:
        return "PRESCALE_QK (the Gluon kernel reads Q from shared memory unscaled)"
    if inputs.tma_obstacle is not None:
        return inputs.tma_obstacle
    if inputs.pinned_tiles:
        return f"kernel_options pin Triton tiles ({', '.join(inputs.pinned_tiles)})"
    if inputs.tma_forbidden:
        return "kernel_options USE_TMA=False (the Gluon kernel loads its tiles through tensor descriptors)"
    return None


def _unmodified(inputs: ForwardInputs) -> bool:
    return inputs.dense and not inputs.has_score_mod


def plan_forward(inputs: ForwardInputs) -> ForwardPlan:
    """The forward kernel of a call and why."""
    if inputs.backend == "TRITON":
        return ForwardPlan("triton", "kernel_options BACKEND='TRITON'")
    obstacle = gluon_obstacle(inputs)
    if inputs.backend == "GLUON":
        if obstacle is not None:
            raise ValueError(f"flexattn: kernel_options BACKEND='GLUON' cannot run this call: {obstacle}")
        return ForwardPlan("gluon", "kernel_options BACKEND='GLUON'")
    if obstacle is not None:
        return ForwardPlan("triton", obstacle)
    if (not inputs.tma_requested and inputs.work is not None
            and inputs.work < tma_configs.TMA_MIN_FORWARD_WORK):
        # The Gluon kernel's device-built descriptors keep a call off Inductor's static
        # launcher, which a small call feels (bench/DECISIONS.md#tma-small-forward-calls).
        return ForwardPlan("triton", f"a small call (batch x heads x queries x keys x head dim {inputs.work} "
                                     f"< 2**{tma_configs.TMA_MIN_FORWARD_WORK.bit_length() - 1}): pointer loads "
                                     f"and Inductor's static launcher")
    if not gluon_configs.takes_by_default(inputs.qk_head_dim, inputs.v_head_dim, _unmodified(inputs)):
        return ForwardPlan("triton", f"head dim {inputs.qk_head_dim}: the Triton template measured faster")
    if (inputs.mask_reads_memory and inputs.partial_heavy
            and inputs.qk_head_dim in gluon_configs.PARTIAL_HEAVY_MEMORY_MASK_TRITON_HEAD_DIMS):
        return ForwardPlan("triton", "a mask_mod reading captured tensors on nearly all partial blocks: the Triton "
                                     "template measured faster")
    return ForwardPlan("gluon", "sm90, 16-bit, TMA-ready layouts")


def gluon_available() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(_GLUON_HOPPER_MODULE) is not None
    except ImportError:
        return False


def device_fields(query) -> dict[str, Any]:
    """The fields ForwardInputs and BackwardInputs share about the device, read off a call's
    query node."""
    from .._compat import triton_interpreter_requested

    device = query.get_device()
    return {"device_type": device.type,
            "capability": torch.cuda.get_device_capability(device) if device.type == "cuda" else None,
            "interpreter": triton_interpreter_requested(), "gluon_available": gluon_available()}


def call_work(query, key) -> int | None:
    """batch x heads x queries x keys x QK head dim of a call; None where a size is symbolic
    (a dynamic graph keeps one kernel for every size, so no size decides it)."""
    sizes = [common.static_size(n) for n in (*query.get_size(), key.get_size()[-2])]
    if None in sizes:
        return None
    B, H, L, E, S = sizes
    return B * H * L * S * E


def forward_inputs(query, key, value, block_mask, kernel_options: dict[str, Any], dropout_seed,
                   mask_mod_buffers, score_mod):
    """A call's ``ForwardInputs`` from its IR nodes, and the nodes. Where nothing else
    rules the Gluon kernel out, q, k and v are realized (their final strides decide
    whether tensor descriptors can read them) and returned realized."""
    import dataclasses

    from .._mask_tuple import BlockMaskView
    from .configs.forward import ForwardConfig
    from .subgraph import is_identity_score_mod

    sizevars = common.V.graph.sizevars
    bm = BlockMaskView(*block_mask)
    pinned = tuple(k for k in ForwardConfig.option_spellings() if kernel_options.get(k) is not None)
    inputs = ForwardInputs(
        **device_fields(query),
        dtype=query.get_dtype(),
        kv_dtype=key.get_dtype(),
        qk_head_dim=sizevars.guard_int(query.get_size()[-1]),
        v_head_dim=sizevars.guard_int(value.get_size()[-1]),
        sparse_q=sizevars.guard_int(bm.q_block_size),
        sparse_kv=sizevars.guard_int(bm.kv_block_size),
        has_dropout=dropout_seed is not None,
        prescale_qk=bool(_options.read(kernel_options, "PRESCALE_QK")),
        tma_obstacle=None,
        pinned_tiles=pinned,
        backend=_options.read(kernel_options, "BACKEND"),
        mask_reads_memory=common.mask_reads_memory(mask_mod_buffers),
        partial_heavy=_options.read_internal(kernel_options, "MASK_PARTIAL_HEAVY"),
        tma_forbidden=_options.forbids_tma(kernel_options),
        tma_requested=bool(_options.read(kernel_options, "USE_TMA")),
        work=call_work(query, key),
        dense=common.dense_kv(kernel_options, bm.full_kv_num_blocks is not None),
        has_score_mod=not is_identity_score_mod(score_mod.graph_module),
    )
    if plan_forward(inputs).kernel != "gluon":
        # Only a call the Gluon kernel would take has its inputs realized here; the
        # Triton template's calls reach their lowering as they came.
        return inputs, (query, key, value)
    nodes = tuple(common.realize_fixed(node) for node in (query, key, value))
    # The kernel reads the query through pointers now, but other query layouts have not met
    # the GPU tests yet: the query keeps the copy engine's rules for now.
    obstacle = common.first_tma_obstacle(zip(nodes, ("query", "key", "value")))
    return dataclasses.replace(inputs, tma_obstacle=obstacle), nodes

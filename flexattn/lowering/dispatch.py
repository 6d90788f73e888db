"""The lowerings registered for flexattn's operators, and the choice of kernel.

A CPU call the C++ engine serves (``flexattn.cpu.uses_engine`` decides) goes to the
engine's lowering (``flexattn/cpu/lowering.py``). Any other call on a CUDA or XPU device,
or on the CPU (Inductor's CPU backend is then Triton, the interpreter), goes to a Triton
template: the split-KV decode kernel for short queries against long keys
(``decode_plan.wants_decode_kernel``), else the forward kernel that
``forward_plan.plan_forward`` picks (the Gluon kernel on Hopper where it covers the call,
the Triton template otherwise); its backward to the backward kernel.
"""

from __future__ import annotations

import logging
import time
import warnings


from .._hop import flex_attention_backward_hop, flex_attention_hop
from .._mask_tuple import BlockMaskView
from ..cpu import uses_engine
from ..cpu.lowering import lower_cpu_backward, lower_cpu_forward
from .backward import lower_backward
from .common import check_positive_lengths, hint
from .decode import lower_decode
from .decode_plan import wants_decode_kernel
from .forward import lower_forward
from .forward_plan import forward_inputs, plan_forward
from .gluon_forward import lower_gluon_forward
from .subgraph import inline_scalar_items, unroll_sorted_searches

log = logging.getLogger("flexattn.lowering")


#: Device types the Triton templates lower for (the CPU through Triton's interpreter).
TRITON_DEVICE_TYPES = ("cuda", "xpu", "cpu")


def lower_flex_attention(query, key, value, score_mod, block_mask, scale, kernel_options,
                         score_mod_buffers=(), mask_mod_buffers=(), sinks=None, dropout_seed=None):
    """The lowering registered for ``flexattn._hop.flex_attention_hop``. Dropout is the
    forward kernel's alone: such a call never takes the decode kernel."""
    inline_scalar_items(score_mod, BlockMaskView(*block_mask).mask_mod)
    unroll_sorted_searches(score_mod, BlockMaskView(*block_mask).mask_mod)
    check_positive_lengths(query, key)
    args = (query, key, value, score_mod, block_mask, scale, kernel_options, score_mod_buffers, mask_mod_buffers,
            sinks)
    device = query.get_device()
    if uses_engine(device):
        started = time.perf_counter()
        result = lower_cpu_forward(*args, dropout_seed)
        log.info("flexattn forward on CPU: the C++ engine, q %s k %s v %s, lowered in %.2f s",
                 list(query.get_size()), list(key.get_size()), list(value.get_size()), time.perf_counter() - started)
        return result
    if device.type not in TRITON_DEVICE_TYPES:
        raise NotImplementedError(f"flexattn: no forward kernel for device type {device.type!r}")
    if dropout_seed is None and wants_decode_kernel(hint(query.get_size()[2]), hint(key.get_size()[2]),
                                                    kernel_options or {}):
        return lower_decode(*args)
    inputs, (query, key, value) = forward_inputs(query, key, value, block_mask, kernel_options or {}, dropout_seed,
                                                 mask_mod_buffers, score_mod)
    plan = plan_forward(inputs)
    log.info("flexattn: forward kernel %s (%s)", "Gluon" if plan.kernel == "gluon" else "Triton", plan.reason)
    args = (query, key, value, *args[3:])
    if plan.kernel == "gluon":
        return lower_gluon_forward(*args)
    return lower_forward(*args, dropout_seed)


def lower_flex_attention_backward(query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph,
                                  joint_graph, block_mask, scale, kernel_options, score_mod_buffers=(),
                                  mask_mod_buffers=(), sinks=None, dropout_seed=None):
    """The lowering registered for ``flexattn._hop.flex_attention_backward_hop``; the
    kernel recomputes probabilities from the forward's lse, which already holds the
    sinks, so only the dense path reads them."""
    inline_scalar_items(fw_graph, joint_graph, BlockMaskView(*block_mask).mask_mod)
    unroll_sorted_searches(fw_graph, joint_graph, BlockMaskView(*block_mask).mask_mod)
    check_positive_lengths(query, key)
    device = query.get_device()
    if uses_engine(device):
        started = time.perf_counter()
        result = lower_cpu_backward(query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph,
                                    joint_graph, block_mask, scale, kernel_options, score_mod_buffers,
                                    mask_mod_buffers, dropout_seed)
        log.info("flexattn backward on CPU: the C++ engine, lowered in %.2f s", time.perf_counter() - started)
        return result
    if device.type not in TRITON_DEVICE_TYPES:
        raise NotImplementedError(f"flexattn: no backward kernel for device type {device.type!r}")
    return lower_backward(query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph, joint_graph,
                          block_mask, scale, kernel_options, score_mod_buffers, mask_mod_buffers, dropout_seed)


def register() -> None:
    """Install both lowerings in Inductor's lowering table."""
    from torch._inductor.lowering import register_lowering

    register_lowering(flex_attention_hop, type_promotion_kind=None)(lower_flex_attention)
    register_lowering(flex_attention_backward_hop, type_promotion_kind=None)(lower_flex_attention_backward)
    # Inductor's FX utilities warn that they cannot propagate metadata through HOP
    # subgraph arguments; flexattn's fake implementations give the outputs' metadata.
    for op in (flex_attention_hop, flex_attention_backward_hop):
        warnings.filterwarnings("ignore", message=f"Please add support for subgraph args to function {op.__name__}!")

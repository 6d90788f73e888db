"""The lowerings registered for flexattn's operators, and the choice of kernel.

A call whose tensors live on a CUDA (or XPU) device, or on the CPU when Inductor's CPU
backend is Triton (the interpreter), goes to a Triton template: the split-KV decode
kernel for short queries against long keys (``decode_plan.wants_decode_kernel``), else
the forward kernel that ``forward_plan.plan_forward`` picks (the Gluon kernel on Hopper
where it covers the call, the Triton template otherwise); its backward to the backward
kernel. Other CPU calls go to the C++ CPU engine (``cpu_flash.py``).
"""

from __future__ import annotations

import logging
import time
import warnings

import torch

from .. import _compat
from .._hop import flex_attention_backward_hop, flex_attention_hop
from .._mask_tuple import BlockMaskView
from .backward import lower_backward
from .common import check_positive_lengths, hint
from .decode import lower_decode
from .decode_plan import wants_decode_kernel
from .cpu_flash import lower_cpu_backward, lower_cpu_forward
from .forward import lower_forward
from .forward_plan import forward_inputs, plan_forward
from .gluon_forward import lower_gluon_forward
from .subgraph import inline_scalar_items

log = logging.getLogger("flexattn.lowering")


def use_triton_template(device: torch.device) -> bool:
    if device.type == "cpu":
        return _compat.inductor_cpu_backend() == "triton"
    return device.type in ("cuda", "xpu")


def lower_flex_attention(query, key, value, score_mod, block_mask, scale, kernel_options,
                         score_mod_buffers=(), mask_mod_buffers=(), sinks=None, dropout_seed=None):
    """The lowering registered for ``flexattn._hop.flex_attention_hop``. Dropout is the
    forward kernel's alone: such a call never takes the decode kernel."""
    inline_scalar_items(score_mod, BlockMaskView(*block_mask).mask_mod)
    check_positive_lengths(query, key)
    args = (query, key, value, score_mod, block_mask, scale, kernel_options, score_mod_buffers, mask_mod_buffers,
            sinks)
    device = query.get_device()
    if use_triton_template(device):
        if dropout_seed is None and wants_decode_kernel(hint(query.get_size()[2]), hint(key.get_size()[2]),
                                                        kernel_options or {}):
            return lower_decode(*args)
        inputs, (query, key, value) = forward_inputs(query, key, value, block_mask, kernel_options or {},
                                                     dropout_seed)
        plan = plan_forward(inputs)
        log.info("flexattn: forward kernel %s (%s)", "Gluon" if plan.kernel == "gluon" else "Triton", plan.reason)
        args = (query, key, value, *args[3:])
        if plan.kernel == "gluon":
            return lower_gluon_forward(*args)
        return lower_forward(*args, dropout_seed)
    if device.type == "cpu":
        started = time.perf_counter()
        result = lower_cpu_forward(*args, dropout_seed)
        log.info("flexattn forward on CPU: the C++ engine, q %s k %s v %s, lowered in %.2f s",
                 list(query.get_size()), list(key.get_size()), list(value.get_size()), time.perf_counter() - started)
        return result
    raise NotImplementedError(f"flexattn: no forward kernel for device type {device.type!r}")


def lower_flex_attention_backward(query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph,
                                  joint_graph, block_mask, scale, kernel_options, score_mod_buffers=(),
                                  mask_mod_buffers=(), sinks=None, dropout_seed=None):
    """The lowering registered for ``flexattn._hop.flex_attention_backward_hop``; the
    kernel recomputes probabilities from the forward's lse, which already holds the
    sinks, so only the dense path reads them."""
    inline_scalar_items(fw_graph, joint_graph, BlockMaskView(*block_mask).mask_mod)
    check_positive_lengths(query, key)
    device = query.get_device()
    if use_triton_template(device):
        return lower_backward(query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph, joint_graph,
                              block_mask, scale, kernel_options, score_mod_buffers, mask_mod_buffers, dropout_seed)
    if device.type == "cpu":
        started = time.perf_counter()
        result = lower_cpu_backward(query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph,
                                    joint_graph, block_mask, scale, kernel_options, score_mod_buffers,
                                    mask_mod_buffers, dropout_seed)
        log.info("flexattn backward on CPU: the C++ engine, lowered in %.2f s", time.perf_counter() - started)
        return result
    raise NotImplementedError(f"flexattn: no backward kernel for device type {device.type!r}")


def register() -> None:
    """Install both lowerings in Inductor's lowering table."""
    from torch._inductor.lowering import register_lowering

    register_lowering(flex_attention_hop, type_promotion_kind=None)(lower_flex_attention)
    register_lowering(flex_attention_backward_hop, type_promotion_kind=None)(lower_flex_attention_backward)
    # Inductor's FX utilities warn that they cannot propagate metadata through HOP
    # subgraph arguments; flexattn's fake implementations give the outputs' metadata.
    for op in (flex_attention_hop, flex_attention_backward_hop):
        warnings.filterwarnings("ignore", message=f"Please add support for subgraph args to function {op.__name__}!")

"""Lowering of a forward call onto ``templates/gluon_forward.py.jinja`` (Hopper, Gluon).

Taken where ``forward_plan.plan_forward`` says so. ``lower_gluon_forward`` prepares the
call as the Triton forward does (``common.prepare_call``), derives the same constexprs
on the host plus the Gluon tile (``configs/gluon_forward.py``: the default, and under
max_autotune a few more), and hands the choices to Inductor; the kernel writes the output and, in place, the log-sum-exp and row maxima.
"""

from __future__ import annotations

import time

from torch._inductor import config as inductor_config
from torch._inductor import ir
from torch._inductor.select_algorithm import SymbolicGridFn

from .. import _compat
from .. import options as _options
from ..templates import kernel_source
from . import common
from .configs import gluon_forward as gluon_configs
from .configs.base import multiprocessor_count
from .gluon_template import GluonTemplate

TEMPLATE_NAME = "flexattn_gluon_forward"


@SymbolicGridFn
def gluon_forward_grid(batch, q_heads, q_len, qk_head_dim, meta, *, cdiv, min):
    """(programs per head, batch, query heads): each program walks every n-th query tile of
    one head, at most one program per tile; n is kernel_options PROGRAMS_PER_HEAD where
    given (meta 0: automatic, `programs_per_head` of the run-time sizes)."""
    tiles = cdiv(q_len, meta["BLOCK_M"])
    wanted = meta["PROGRAMS_PER_HEAD"] or programs_per_head(tiles, batch * q_heads, meta["NUM_SMS"])
    return (min(tiles, wanted), batch, q_heads)


def _static(n):
    """An int for a size known now (an int or a sympy number), else None."""
    if isinstance(n, int):
        return n
    return int(n) if getattr(n, "is_number", False) else None


def programs_per_head(tiles, heads, sms: int):
    """Programs per head: one per SM shared out among the heads (each walking several
    tiles, the next one's loads overlapping this one's end) where that takes no more waves
    of tiles than one program per tile does, else one program per tile; one per tile too
    where the sizes are symbolic (the grid then follows the run-time sizes)."""
    tiles_now, heads_now = _static(tiles), _static(heads)
    if tiles_now is None or heads_now is None:
        return tiles
    shared = max(1, sms // max(1, heads_now))
    waves_shared = -(-heads_now * shared // sms) * -(-tiles_now // shared)
    waves_per_tile = -(-heads_now * tiles_now // sms)
    return shared if waves_shared <= waves_per_tile else tiles_now


gluon_forward_template = GluonTemplate(
    name=TEMPLATE_NAME,
    grid=gluon_forward_grid,
    source=kernel_source("gluon_forward"),
)


def lower_gluon_forward(query, key, value, score_mod, block_mask, scale, kernel_options,
                        score_mod_buffers, mask_mod_buffers, sinks=None):
    """out, lse, max_scores of a forward call, from the Gluon forward template."""
    started = time.perf_counter()
    _compat.compile_gluon_kernels_as_gluon()  # for the autotuner's compiles in this process
    kernel_options = dict(kernel_options or {})
    call = common.prepare_call(query, key, value, score_mod, block_mask, kernel_options, score_mod_buffers,
                               mask_mod_buffers)
    query, key, value = call.query, call.key, call.value

    spec = common.kernel_specialisations(
        query=query, key=key, value=value, scale=scale, kernel_options=kernel_options,
        sparse_q=call.sparse_q, sparse_kv=call.sparse_kv, has_full_blocks=call.has_full_blocks,
        has_score_mod=call.has_score_mod, kernel="forward", reversed_q_tiles_default=False,
    )
    spec["HAS_SINKS"] = sinks is not None
    # 0: the grid picks the count from the run-time sizes; a constant, so one kernel serves all.
    spec["PROGRAMS_PER_HEAD"] = _options.read(kernel_options, "PROGRAMS_PER_HEAD", default=0)
    spec["NUM_SMS"] = multiprocessor_count(query.get_device())
    # This kernel loads its K and V tiles through descriptors whatever the Triton template's
    # default would be (a constant, so calls on either side of that default share a kernel).
    spec["USE_TMA"] = True
    usable = gluon_configs.candidate_configs(spec["QK_HEAD_DIM"], spec["V_HEAD_DIM"], query.get_dtype().itemsize,
                                             bool(inductor_config.max_autotune), call.sparse_kv)
    layout = common.output_layout(query, spec["V_HEAD_DIM"])
    lse, row_max = common.forward_outputs(query)
    inputs = common.forward_kernel_inputs(call, lse, row_max, sinks, None)
    out, config_of_choice = common.select_forward(
        gluon_forward_template, TEMPLATE_NAME, usable, "Gluon forward",
        lambda c: {**spec,
                   "IS_DIVISIBLE_M": common.divisible(query.get_size()[2], c.block_m),
                   "IS_DIVISIBLE_N": common.divisible(key.get_size()[2], call.sparse_kv),
                   **c.constexprs()},
        call, inputs, layout, lse, row_max)

    common.report_choice("forward (Gluon)", out, config_of_choice, usable, spec, common.REPORTED_SPECIALISATIONS,
                         query, key, value, kernel_options, started=started)
    return out, ir.TensorBox(lse), ir.TensorBox(row_max)

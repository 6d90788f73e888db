"""Lowering of a forward call onto ``templates/gluon_forward.py.jinja`` (Hopper, Gluon).

Taken where ``forward_plan.plan_forward`` says so. ``lower_gluon_forward`` prepares the
call as the Triton forward does (``common.prepare_call``), derives the same constexprs
on the host plus the Gluon tile (``configs/gluon_forward.py``: the default, and under
max_autotune a few more), and hands the choices to Inductor; the kernel writes the output
and, in place, the log-sum-exp and row maxima.
"""

from __future__ import annotations

import time

from torch._inductor import config as inductor_config
from torch._inductor import ir
from torch._inductor.select_algorithm import SymbolicGridFn

from .. import _compat
from .. import options as _options
from ..templates import gluon_kernel_source
from . import common
from .configs import gluon_forward as gluon_configs
from .configs.base import multiprocessor_count
from .gluon_template import GluonTemplate

TEMPLATE_NAME = "flexattn_gluon_forward"


@SymbolicGridFn
def gluon_forward_grid(batch, q_heads, q_len, qk_head_dim, meta, *, cdiv, min):
    """(programs, 1, 1): program p walks units p, p + programs, ... of the launch's
    batch x heads x units of a head (query tiles, in pairs with PAIRED_Q_TILES);
    programs: kernel_options NUM_PROGRAMS where given (meta 0: one per SM), at most one
    per unit (bench/DECISIONS.md#gluon-forward-persistent)."""
    paired = meta["PAIRED_Q_TILES"]
    units = cdiv(cdiv(q_len, meta["BLOCK_M"]), 1 + paired) * q_heads * batch
    return (min(units, programs(meta)), 1, 1)


def programs(meta) -> int:
    """The programs a launch wants: kernel_options NUM_PROGRAMS, or one per SM."""
    return meta["NUM_PROGRAMS"] or meta["NUM_SMS"]


def paired_q_tiles(batch: int, q_heads: int, q_len: int, block_m: int, meta) -> int:
    """PAIRED_Q_TILES: 1 where the query tiles outnumber the programs (at the size hints)."""
    return int(-(-q_len // block_m) * q_heads * batch > programs(meta))


gluon_forward_template = GluonTemplate(
    name=TEMPLATE_NAME,
    grid=gluon_forward_grid,
    source=gluon_kernel_source("gluon_forward"),
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
    # 0: one program per SM; the grid reads the count and the kernel gl.num_programs, so
    # one kernel serves every run-time size.
    spec["NUM_PROGRAMS"] = _options.read(kernel_options, "NUM_PROGRAMS", default=0)
    spec["NUM_SMS"] = multiprocessor_count(query.get_device())
    B, H, L = (common.hint(n) for n in query.get_size()[:3])
    # This kernel loads its K and V tiles through descriptors whatever the Triton template's
    # default would be (a constant, so calls on either side of that default share a kernel).
    spec["USE_TMA"] = True
    usable = gluon_configs.candidate_configs(spec["QK_HEAD_DIM"], spec["V_HEAD_DIM"], query.get_dtype().itemsize,
                                             bool(inductor_config.max_autotune), call.sparse_kv,
                                             unmodified=spec["DENSE_KV"] and not spec["HAS_SCORE_MOD"])
    layout = common.output_layout(query, spec["V_HEAD_DIM"])
    stats = common.forward_outputs(query, spec)
    inputs = common.forward_kernel_inputs(call, stats, sinks, None)
    out, config_of_choice = common.select_forward(
        gluon_forward_template, TEMPLATE_NAME, usable, "Gluon forward",
        lambda c: {**spec,
                   "IS_DIVISIBLE_M": common.divisible(query.get_size()[2], c.block_m),
                   "IS_DIVISIBLE_N": common.divisible(key.get_size()[2], call.sparse_kv),
                   "PAIRED_Q_TILES": paired_q_tiles(B, H, L, c.block_m, spec),
                   **c.constexprs()},
        call, inputs, layout, stats)

    common.report_choice("forward (Gluon)", out, config_of_choice, usable, spec, common.REPORTED_SPECIALISATIONS,
                         query, key, value, kernel_options, started=started)
    return out, ir.TensorBox(stats.lse), ir.TensorBox(stats.row_max)

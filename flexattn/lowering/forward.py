"""Lowering of a forward call onto ``templates/forward.py.jinja``.

``lower_forward`` prepares the call (``common.prepare_call``), derives the constexprs
on the host, builds one template choice per usable tile configuration
(``configs/forward.py``) and hands them to Inductor's autotuner; the kernel writes the
output and, in place, the log-sum-exp and row maxima.
"""

from __future__ import annotations

import time

from torch._inductor import config as inductor_config
from torch._inductor import ir
from torch._inductor.select_algorithm import SymbolicGridFn, TritonTemplate

from .. import options as _options
from ..templates import kernel_source
from . import common
from .configs import base as config_base
from .configs import forward as forward_configs
from .forward_plan import call_work
from .subgraph import MASK_MOD_ARGS, SCORE_MOD_ARGS, gathered_tile_bytes, key_gathers, reads_positions

TEMPLATE_NAME = "flexattn_forward"


@SymbolicGridFn
def forward_grid(batch, q_heads, q_len, qk_head_dim, meta, *, cdiv):
    """Launch grid of the forward kernel, from ``call_sizes`` = the query's size.

    program_id(0) covers query rows [t * BLOCK_M, (t + 1) * BLOCK_M) of tile t = pid0
    (the last tile may run past Q_LEN and is masked); program_id(1) the batch index;
    program_id(2) the query head. With REVERSED_Q_TILES the kernel maps its linear launch
    index to (tile, batch, head) with the tile slowest, from the last tile down. Each
    program walks every KV block the BlockMask lists for its rows.
    """
    return (cdiv(q_len, meta["BLOCK_M"]), batch, q_heads)


forward_template = TritonTemplate(
    name=TEMPLATE_NAME,
    grid=forward_grid,
    source=kernel_source("forward"),
)


def lower_forward(query, key, value, score_mod, block_mask, scale, kernel_options,
                  score_mod_buffers, mask_mod_buffers, sinks=None, dropout_seed=None):
    """out, lse, max_scores of a forward call, from the forward template."""
    started = time.perf_counter()
    kernel_options = dict(kernel_options or {})
    device = query.get_device()
    dtype = query.get_dtype()
    call = common.prepare_call(query, key, value, score_mod, block_mask, kernel_options, score_mod_buffers,
                               mask_mod_buffers)
    query, key, value = call.query, call.key, call.value

    spec = common.kernel_specialisations(
        query=query, key=key, value=value, scale=scale, kernel_options=kernel_options,
        sparse_q=call.sparse_q, sparse_kv=call.sparse_kv, has_full_blocks=call.has_full_blocks,
        has_score_mod=call.has_score_mod, kernel="forward",
        reversed_q_tiles_default=forward_configs.REVERSED_Q_TILES,
    )

    spec["HAS_SINKS"] = sinks is not None
    spec.update(common.dropout_specialisations(kernel_options))
    layout = common.output_layout(query, spec["V_HEAD_DIM"])
    # The kernel writes lse and row_max in place where asked: the template's extra outputs.
    stats = common.forward_outputs(query, spec)

    candidates = forward_configs.candidate_configs(
        device, spec["QK_HEAD_DIM_PAD"], dtype, bool(inductor_config.max_autotune), kernel_options,
        mask_reads_memory=common.mask_reads_memory(call.mask_mod_buffers),
        partial_heavy=bool(_options.read_internal(kernel_options, "MASK_PARTIAL_HEAVY")),
        work=call_work(query, key), writes_lse=bool(spec["OUTPUT_LOGSUMEXP"]),
        score_reads_positions=reads_positions(score_mod.graph_module),
        mask_key_gathers=key_gathers(call.mask_graph.graph_module, len(MASK_MOD_ARGS)))
    usable = forward_configs.usable_configs(
        candidates, kernel_options, sparse_q=call.sparse_q, sparse_kv=call.sparse_kv,
        qk_dim_pad=spec["QK_HEAD_DIM_PAD"], v_dim_pad=spec["V_HEAD_DIM_PAD"], elem_bytes=dtype.itemsize,
        smem_limit=config_base.shared_memory_limit(device),
        gathered_bytes=(gathered_tile_bytes(score_mod.graph_module, len(SCORE_MOD_ARGS))
                        + gathered_tile_bytes(call.mask_graph.graph_module, len(MASK_MOD_ARGS))),
    )

    inputs = common.forward_kernel_inputs(call, stats, sinks, dropout_seed)
    out, config_of_choice = common.select_forward(
        forward_template, TEMPLATE_NAME, usable, "forward",
        lambda cfg: {**spec,
                     "IS_DIVISIBLE_M": common.divisible(query.get_size()[2], cfg.block_m),
                     "IS_DIVISIBLE_N": common.divisible(key.get_size()[2], call.sparse_kv),
                     "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "ONE_KV_LOOP": cfg.one_kv_loop},
        call, inputs, layout, stats)

    common.report_choice("forward", out, config_of_choice, usable, spec, common.REPORTED_SPECIALISATIONS,
                         query, key, value, kernel_options, started=started)
    return out, ir.TensorBox(stats.lse), ir.TensorBox(stats.row_max)

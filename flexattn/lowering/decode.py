"""Lowering of a short-query call onto the split-KV decode kernel.

``templates/decode.py.jinja`` packs the query heads of one GQA group into one tile of
rows and shares the KV steps the BlockMask lists for the tile among SPLIT_KV programs;
each ends with an unnormalised partial result (acc, running max, running sum). The
shares are merged (rescaled to a common max, normalised; out, lse and max written)
either by the last program of a tile to finish (FUSED_MERGE, one launch: it learns that
it is last from a per-tile counter in an int32 workspace that Inductor zeroes once per
compiled-graph call, shared by every decode kernel of the graph, each leaving it zero),
or by ``templates/decode_merge.py.jinja``, one program per few query rows. A tile whose
steps fit in one share, and every tile with SPLIT_KV == 1, is finished by its one
program without partials or counter.

Every host-side choice is the plan's (``decode_plan.plan_decode``); this module turns
the plan into IR. With flex_attention's own default mask (DENSE_KV) the kernel takes no
BlockMask tables and walks every KV position in order.
"""

from __future__ import annotations

import time
from typing import Any

import sympy
import torch
from torch._inductor import config as inductor_config
from torch._inductor import ir
from torch._inductor.select_algorithm import SymbolicGridFn, TritonTemplate
from torch.utils._sympy.functions import FloorDiv

from .. import _compat
from ..numerics import stats_dtype
from ..templates import kernel_source
from . import common
from .configs.base import gpu_generation, multiprocessor_count, shared_memory_limit
from .configs.decode import REVERSED_Q_TILES
from .decode_plan import MERGE_ROWS, DecodeInputs, DecodePlan, next_power_of_two, plan_decode

DECODE_TEMPLATE_NAME = "flexattn_decode"
MERGE_TEMPLATE_NAME = "flexattn_decode_merge"
#: Name of the tile-counter workspace of the one-launch merge (per device; one buffer for
#: every decode kernel of a compiled graph) and its name inside the kernel.
COUNTERS_WORKSPACE = "flexattn_decode_counters"
COUNTERS_ARG = "TILE_COUNTERS"


@SymbolicGridFn
def decode_grid(batch, head_tiles, q_len, meta, *, cdiv):
    """Launch grid of the decode kernel, from ``call_sizes`` = (batch, HEAD_TILES, Q_LEN).

    program_id(0) = batch index * HEAD_TILES + head tile (the tiles of one KV head are
    neighbours, so unpacked heads of a group share K/V through the L2 cache);
    program_id(1) the share of the KV steps; program_id(2) the tile of BLOCK_Q query
    positions.
    """
    return (batch * head_tiles, meta["SPLIT_KV"], cdiv(q_len, meta["BLOCK_Q"]))


@SymbolicGridFn
def merge_grid(batch, q_heads, q_len, meta, *, cdiv):
    """Launch grid of the merge pass: (cdiv(Q_LEN, BLOCK_R), batch, query heads)."""
    return (cdiv(q_len, meta["BLOCK_R"]), batch, q_heads)


decode_template = TritonTemplate(
    name=DECODE_TEMPLATE_NAME,
    grid=decode_grid,
    source=kernel_source("decode", helpers=("merge_helpers",)),
)
merge_template = TritonTemplate(
    name=MERGE_TEMPLATE_NAME,
    grid=merge_grid,
    source=kernel_source("decode_merge", helpers=("merge_helpers",)),
)


def decode_inputs(call: common.PreparedCall, spec: dict[str, Any], query, key, kernel_options) -> DecodeInputs:
    """The plan's inputs from a prepared call (sizes as hints)."""
    device = query.get_device()
    B, Hq, L, _ = query.get_size()
    tables = call.tables
    dense_kv = spec["DENSE_KV"]
    return DecodeInputs(
        batch=common.hint(B), q_heads=common.hint(Hq), q_len=common.hint(L), kv_len=common.hint(key.get_size()[2]),
        gqa_group=spec["GQA_GROUP_SIZE"], qk_dim_pad=spec["QK_HEAD_DIM_PAD"], v_dim_pad=spec["V_HEAD_DIM_PAD"],
        dtype=query.get_dtype(), generation=gpu_generation(device), sms=multiprocessor_count(device),
        smem_limit=shared_memory_limit(device), sparse_q=call.sparse_q, sparse_kv=call.sparse_kv,
        mask_varies_over_heads=call.mask_varies_over_heads, dense_kv=dense_kv,
        # (Without full blocks full_kv_indices is a filler of width 0.)
        row_width=None if dense_kv else max(common.hint(t.get_size()[-1])
                                            for t in (tables.kv_indices, tables.full_kv_indices)),
        max_autotune=bool(inductor_config.max_autotune), kernel_options=kernel_options,
    )


def lower_decode(query, key, value, score_mod, block_mask, scale, kernel_options,
                 score_mod_buffers, mask_mod_buffers, sinks=None):
    """out, lse, max_scores of a short-query call, from the decode kernel (and the merge
    pass)."""
    started = time.perf_counter()
    kernel_options = dict(kernel_options or {})
    device = query.get_device()
    B, Hq, L, _ = query.get_size()
    S = key.get_size()[2]
    call = common.prepare_call(query, key, value, score_mod, block_mask, kernel_options, score_mod_buffers,
                               mask_mod_buffers)
    query, key, value = call.query, call.key, call.value
    spec = common.kernel_specialisations(
        query=query, key=key, value=value, scale=scale, kernel_options=kernel_options,
        sparse_q=call.sparse_q, sparse_kv=call.sparse_kv, has_full_blocks=call.has_full_blocks,
        has_score_mod=call.has_score_mod, kernel="decode", reversed_q_tiles_default=REVERSED_Q_TILES,
    )
    spec["HAS_SINKS"] = sinks is not None
    sinks = common.sinks_for_kernel(sinks, query)
    plan = plan_decode(decode_inputs(call, spec, query, key, kernel_options))
    pack, split_kv = plan.packing, plan.split_kv
    v_dim = spec["V_HEAD_DIM"]
    part_size = [B, Hq, L, split_kv]

    # The shares and statistics in the accumulator's precision: float64 for float64 inputs.
    work_dtype = stats_dtype(query.get_dtype())

    def scratch(size):
        return common.dense_buffer(size, device, work_dtype)

    workspace = None
    stats = None
    # parts: the kernel's scratch outputs (all written); with FUSED_MERGE, lse and max follow.
    if not plan.fused_merge:
        # The template's output is the partial acc; the merge pass makes out, lse and max.
        layout = ir.FixedLayout(device, work_dtype, [*part_size, v_dim],
                                ir.FlexibleLayout.contiguous_strides([*part_size, v_dim]))
        parts = {"m_part": scratch(part_size), "l_part": scratch(part_size)}
        buffers = parts
    else:
        layout = common.output_layout(query, v_dim)
        stats = common.forward_outputs(query, spec)
        parts = {}
        if split_kv > 1:
            parts = {"acc_part": scratch([*part_size, v_dim]), "m_part": scratch(part_size),
                     "l_part": scratch(part_size)}
            tiles = B * plan.head_tiles * FloorDiv(L + pack.block_q - 1, pack.block_q)
            workspace = _compat.graph_zeroed_workspace(
                tiles, device, f"{COUNTERS_WORKSPACE}_{device.type}_{device.index or 0}", COUNTERS_ARG, torch.int32)
        buffers = {**parts, "lse": stats.kernel_lse, "row_max": stats.kernel_row_max}

    # The order of decode.py.jinja's def_kernel; DENSE_KV takes no tables.
    tables = call.tables
    inputs = {"query": query, "key": key, "value": value, **buffers}
    if not spec["DENSE_KV"]:
        inputs.update(kv_num_blocks=tables.kv_num_blocks, kv_indices=tables.kv_indices,
                      full_kv_num_blocks=tables.full_kv_num_blocks, full_kv_indices=tables.full_kv_indices)
    if plan.fused_merge:
        inputs["sinks"] = sinks
    input_nodes = list(inputs.values())
    shared = {
        **spec,
        "HEADS_PER_TILE": pack.heads_per_tile,
        "HEAD_TILES": plan.head_tiles,
        "BLOCK_Q": pack.block_q,
        "BLOCK_M": pack.block_m,
        "SPLIT_KV": split_kv,
        "SPLIT_KV_PAD": plan.split_kv_pad,
        "LIST_CHUNK": plan.list_chunk,
        "FUSED_MERGE": plan.fused_merge,
        "IS_DIVISIBLE_N": common.divisible(S, call.sparse_kv),
    }
    choices, config_of_choice = common.template_choices(
        decode_template, plan.configs, "decode", lambda cfg: {**shared, "BLOCK_N": cfg.block_n},
        on_choice=None if workspace is None else (lambda choice: _compat.share_template_workspace(choice, workspace)),
        input_nodes=input_nodes,
        layout=layout,
        subgraphs=[call.score_buffer, call.mask_buffer],
        mutated_inputs=[*parts.values(), *(stats.written if stats else ())],
        call_sizes=[B, sympy.Integer(plan.head_tiles), L],
        workspace_arg=workspace,
    )
    result = _compat.autotune_select_node(
        DECODE_TEMPLATE_NAME, choices, input_nodes + common.captured_inputs(call), layout,
        input_gen_fns=None if spec["DENSE_KV"] else common.benchmark_table_inputs(inputs, tables,
                                                                                 call.has_full_blocks))

    if plan.fused_merge:
        out, lse, row_max = result, ir.TensorBox(stats.lse), ir.TensorBox(stats.row_max)
    else:
        out, lse, row_max = _merge(result, buffers["m_part"], buffers["l_part"], sinks, query, spec, plan)
    common.report_choice(
        "decode", result, config_of_choice, list(plan.configs), spec, common.REPORTED_SPECIALISATIONS,
        query, key, value, kernel_options, started=started,
        details=(f", SPLIT_KV={split_kv}, HEADS_PER_TILE={pack.heads_per_tile} BLOCK_Q={pack.block_q} "
                 f"BLOCK_M={pack.block_m}, "
                 + ("one launch (FUSED_MERGE)" if plan.fused_merge else "two launches (merge pass)")))
    return out, lse, row_max


def _merge(acc, m_part, l_part, sinks, query, spec: dict[str, Any], plan: DecodePlan):
    """The second pass: partial results -> out (query's layout), lse, max."""
    B, Hq, L, _ = query.get_size()
    acc = common.realize_fixed(acc)
    layout = common.output_layout(query, spec["V_HEAD_DIM"])
    stats = common.forward_outputs(query, spec)
    input_nodes = [acc, m_part, l_part, stats.kernel_lse, stats.kernel_row_max, sinks]
    choices: list[Any] = []
    error = merge_template.maybe_append_choice(
        choices,
        input_nodes=input_nodes,
        layout=layout,
        mutated_inputs=stats.written,
        call_sizes=[B, Hq, L],
        num_stages=1,
        num_warps=4,
        BLOCK_R=min(MERGE_ROWS, next_power_of_two(common.hint(L))),
        SPLIT_KV=plan.split_kv,
        SPLIT_KV_PAD=plan.split_kv_pad,
        V_HEAD_DIM=spec["V_HEAD_DIM"],
        V_HEAD_DIM_PAD=spec["V_HEAD_DIM_PAD"],
        ROWS_GUARANTEED_SAFE=spec["ROWS_GUARANTEED_SAFE"],
        HAS_SINKS=spec["HAS_SINKS"],
        OUTPUT_LOGSUMEXP=spec["OUTPUT_LOGSUMEXP"],
        OUTPUT_MAX=spec["OUTPUT_MAX"],
    )
    if error is not None or not choices:
        raise RuntimeError(f"flexattn: the decode merge template could not be generated: {error}")
    out = _compat.autotune_select_node(MERGE_TEMPLATE_NAME, choices, input_nodes, layout)
    return out, ir.TensorBox(stats.lse), ir.TensorBox(stats.row_max)

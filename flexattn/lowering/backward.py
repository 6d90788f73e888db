"""Lowering of a backward call onto ``templates/backward.py.jinja``.

Step by step:

1. delta = rowsum(dO * O) in float32 as an Inductor reduction (one fused pass over dO
   and O). With a gradient of the log-sum-exp, d lse_i / d s_ij = p_ij, so
   ds_ij = p_ij * (dp_ij - delta_i + dlse_i): the kernel reads ``delta - dlse`` and needs
   no extra input.
2. The score_mod forward graph, the mask_mod graph and the grad-score output of the
   joint graph become the template's subgraphs 0, 1 and 2 (``subgraph.build_mod_buffer``);
   the captured tensors' gradients subgraph 3 and the summed pairs after it
   (``buffer_grads.py``).
3. One template choice per usable tile configuration (``configs/backward.py``).

The kernel's output is dK; dQ, dV and the captured tensors' gradients are written in
place (dQ through float32 atomics and a scaling afterwards with DQ_ATOMIC).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import sympy
import torch
from torch._inductor import config as inductor_config
from torch._inductor import ir
from torch._inductor.lowering import lowerings, to_dtype
from torch._inductor.select_algorithm import SymbolicGridFn, TritonTemplate
from torch._inductor.virtualized import V

from .. import _compat
from .. import options as _options
from .._hop import buffers_with_grad
from ..numerics import stats_dtype
from ..templates import kernel_source
from . import common
from .buffer_grads import (JOINT_ARGS, finish_buffer_grad, graph_returning, joint_outputs, plan_buffer_grads,
                           score_grad_is_upstream)
from .backward_plan import BackwardInputs, plan_backward
from .forward_plan import call_work, device_fields
from .configs import backward as backward_configs
from .configs import gluon_backward as gluon_backward_configs
from .configs import tma as tma_configs
from .configs.base import shared_memory_limit
from .subgraph import (MASK_MOD_ARGS, SCORE_MOD_ARGS, build_mod_buffer, divides_by_non_power_of_two,
                       gathered_tile_bytes, reads_positions)

aten = torch.ops.aten
log = logging.getLogger("flexattn.lowering")
TEMPLATE_NAME = "flexattn_backward"

#: The specialisations that report_choice shows for the backward.
REPORTED_SPECIALISATIONS = ("GQA_GROUP_SIZE", "QK_HEAD_DIM_PAD", "V_HEAD_DIM_PAD", "HAS_FULL_BLOCKS", "HAS_SCORE_MOD",
                            "MASK_SCORE_GRADS", "HAS_BUFFER_GRADS", "IS_DIVISIBLE_M", "IS_DIVISIBLE_N", "DQ_ATOMIC", "USE_TMA",
                            "USE_TMA_DKDV", "USE_TMA_DQ", "DENSE_KV")

#: The first template subgraph of the summed buffer-gradient pairs (0-2: score, mask,
#: grad score; 3: the scatters, present even when empty).
REDUCED_GRAD_SUBGRAPH = 4


class DeterministicBufferGradError(RuntimeError):
    """Deterministic mode was asked for, but a captured tensor needs a gradient, which
    the kernel accumulates with float atomics (order-dependent)."""


@SymbolicGridFn
def backward_grid(batch, kv_heads, q_len, kv_len, meta, *, cdiv):
    """Launch grid of the backward kernel, from ``call_sizes`` = (B, Hkv, Q_LEN, KV_LEN).

    program_id(0) below cdiv(kv_len, BLOCK_N1) is a dK/dV program for that key tile; the
    rest are dQ programs, GQA_GROUP_SIZE * cdiv(q_len, BLOCK_M2) of them (query head of
    the group, then query tile, last tile first with REVERSED_Q_TILES), none with
    DQ_ATOMIC. program_id(1) is the batch index, program_id(2) the KV head.
    """
    dq_programs = 0 if meta["DQ_ATOMIC"] else meta["GQA_GROUP_SIZE"] * cdiv(q_len, meta["BLOCK_M2"])
    return cdiv(kv_len, meta["BLOCK_N1"]) + dq_programs, batch, kv_heads


backward_template = TritonTemplate(
    name=TEMPLATE_NAME,
    grid=backward_grid,
    source=kernel_source("backward"),
)


def use_dq_atomics(kernel_options: dict[str, Any], device: torch.device, dtype: torch.dtype) -> bool:
    """Whether dQ comes from the dK/dV programs through float32 atomics (DQ_ATOMIC)
    rather than from dQ programs that recompute the scores.

    ``kernel_options["DQ_ATOMIC"]`` decides when given; by default the GPU generations
    and dtypes in ``configs.backward.DQ_ATOMIC_GENERATIONS`` use it. Deterministic mode
    never does (asking for both is an error), nor do float64 inputs by default
    (gradcheck-grade sums want a fixed order).
    """
    requested = _options.read(kernel_options, "DQ_ATOMIC")
    deterministic = common.deterministic_requested(kernel_options)
    if requested is None:
        return not deterministic and dtype != torch.float64 and backward_configs.dq_atomic_default(device, dtype)
    if bool(requested) and deterministic:
        raise ValueError(
            "flexattn: kernel_options DQ_ATOMIC=True adds dQ with float atomics, whose order varies "
            "between runs, but deterministic mode (kernel_options DETERMINISTIC or "
            "torch.use_deterministic_algorithms) is on; drop one of them")
    return bool(requested)


def lower_backward(query, key, value, out, logsumexp, grad_out, grad_logsumexp, fw_graph, joint_graph,
                   block_mask, scale, kernel_options, score_mod_buffers, mask_mod_buffers, dropout_seed=None):
    """grad_query, grad_key, grad_value and the captured tensors' gradients, from the
    backward template (``dropout_seed``: the forward's, whose keep mask it regenerates)."""
    started = time.perf_counter()
    kernel_options = dict(kernel_options or {})
    sizevars = V.graph.sizevars
    device = query.get_device()
    dtype = query.get_dtype()
    if key.get_dtype() != dtype or value.get_dtype() != dtype:
        raise ValueError("flexattn: Backward pass with mixed query, key, and value dtype is not supported "
                         f"(float8 keys and values serve inference), got query.dtype={dtype}, "
                         f"key.dtype={key.get_dtype()}, and value.dtype={value.get_dtype()}")
    B, Hq, L, E = query.get_size()
    Bkv, Hkv, S, _ = key.get_size()
    Ev = value.get_size()[3]

    joint_gm = joint_graph.graph_module
    wants = buffers_with_grad(joint_gm, len(score_mod_buffers))
    if any(wants) and common.deterministic_requested(kernel_options):
        raise DeterministicBufferGradError(
            "flexattn: deterministic mode (kernel_options DETERMINISTIC or "
            "torch.use_deterministic_algorithms) cannot give gradients to captured tensors: "
            "the backward kernel accumulates them with float32 atomic adds, whose order varies "
            "between runs. Detach the captured tensors (or turn deterministic mode off); the "
            "gradients of query, key and value are deterministic either way.")

    # The forward's preparation (same options, dtype and device, so the same tanh): the
    # recomputed scores must match the ones its logsumexp was taken over.
    call = common.prepare_call(query, key, value, fw_graph, block_mask, kernel_options, score_mod_buffers,
                               mask_mod_buffers, transposed=True)
    query, key, value = call.query, call.key, call.value
    logsumexp = common.realize_fixed(logsumexp)
    grad_out = common.realize_fixed(grad_out)
    delta = common.compute_delta(out, grad_out, grad_logsumexp)

    captured = common.as_tensor_boxes(call.score_mod_buffers)
    grad_score_buffer = build_mod_buffer(graph_returning(joint_gm, joint_outputs(joint_gm)[0]), JOINT_ARGS, dtype,
                                         device, captured, "score_mod's gradient (joint graph)",
                                         fast_tanh=call.fast_tanh, out_dtype=stats_dtype(dtype))
    plan_inputs = backward_inputs(query, key, value, grad_out, call, kernel_options, dropout_seed, any(wants),
                                  mask_mod_buffers)
    plan = plan_backward(plan_inputs)
    log.info("flexattn: backward kernel %s (%s)", "Gluon" if plan.kernel == "gluon" else "Triton", plan.reason)
    gluon = plan.kernel == "gluon"
    # The Gluon backward adds dQ with float32 atomics (its DQ_ATOMIC form).
    dq_atomic = gluon or use_dq_atomics(kernel_options, device, dtype)
    if dq_atomic:
        # Unscaled float32 sums of the atomic adds; scaled and cast after the kernel.
        grad_query = common.realize_fixed(lowerings[aten.full.default]([B, Hq, L, E], 0.0, dtype=torch.float32,
                                                                       device=device))
    else:
        grad_query = common.dense_buffer([B, Hq, L, E], device, dtype)
    # Tiles read (or, the dQ accumulator, reduced into) through descriptors with USE_TMA.
    tma_operands = [(grad_out, "output gradient")] + ([(grad_query, "dQ accumulator")] if dq_atomic else [])
    spec = common.kernel_specialisations(
        query=query, key=key, value=value, scale=scale, kernel_options=kernel_options,
        sparse_q=call.sparse_q, sparse_kv=call.sparse_kv, has_full_blocks=call.has_full_blocks,
        has_score_mod=call.has_score_mod, kernel="backward",
        reversed_q_tiles_default=backward_configs.REVERSED_Q_TILES, extra_tma_operands=tma_operands)
    spec.update(
        DQ_ATOMIC=dq_atomic,
        REDUCED_GRAD_SUBGRAPH=REDUCED_GRAD_SUBGRAPH,
        MASK_SCORE_GRADS=not score_grad_is_upstream(joint_gm),
        IS_DIVISIBLE_M=common.divisible(L, call.sparse_q),
        IS_DIVISIBLE_N=common.divisible(S, call.sparse_kv),
        **common.dropout_specialisations(kernel_options),
    )
    programs_tma = tma_configs.backward_tma_programs(spec["USE_TMA"], _options.read(kernel_options, "USE_TMA"),
                                                       dq_atomic)
    spec.update(USE_TMA_DKDV=programs_tma.dkdv, USE_TMA_DQ=programs_tma.dq)

    dk_layout = ir.FixedLayout(device, dtype, [B, Hkv, S, E], ir.FlexibleLayout.contiguous_strides([B, Hkv, S, E]))
    grad_value = common.dense_buffer([B, Hkv, S, Ev], device, dtype)

    if gluon:
        from .gluon_backward import TEMPLATE_NAME as GLUON_TEMPLATE_NAME
        from .gluon_backward import gluon_backward_template
        spec["USE_TMA"] = True
        template, template_name, what = gluon_backward_template, GLUON_TEMPLATE_NAME, "Gluon backward"
        late_dp = _options.read(kernel_options, "BWD_LATE_DP")
        if late_dp is None:
            late_dp = gluon_backward_configs.late_dp_default(
                spec["QK_HEAD_DIM"], reads_positions(fw_graph.graph_module),
                divides_by_non_power_of_two(call.mask_graph.graph_module))
        cfg = gluon_backward_configs.config_for(spec["QK_HEAD_DIM"], plan_inputs.unmodified)
        # The rows' statistics by the copy engine only where it can read them (query lengths a
        # multiple of 4 and aligned buffers).
        rows_by_tma = cfg.rows_by_tma and common.first_tma_obstacle(
            [(logsumexp, "log-sum-exp"), (delta, "delta")]) is None
        usable = [dataclasses.replace(cfg, late_dp=bool(late_dp), rows_by_tma=rows_by_tma)]
    else:
        template, template_name, what = backward_template, TEMPLATE_NAME, "backward"
        usable = triton_backward_configs(device, spec, dtype, kernel_options, call, fw_graph, dq_atomic)

    # After the configs: the diagonal terms' scratch slots are sized by their widest BLOCK_M1.
    grad_plan = plan_buffer_grads(joint_gm, call.score_mod_buffers, wants, dtype, device, call.fast_tanh,
                                  None if gluon else diagonal_scratch_elements(B, Hkv, S, call.sparse_kv, usable))
    subgraphs: list[Any] = [call.score_buffer, call.mask_buffer, grad_score_buffer, grad_plan.scatters,
                            *grad_plan.summed]
    spec.update(
        HAS_BUFFER_GRADS=bool(grad_plan.scatters),
        NUM_REDUCED_GRAD_TERMS=len(grad_plan.reduced) // 2,
        NUM_KEY_GRAD_TERMS=len(grad_plan.per_key) // 2,
        NUM_QUERY_GRAD_TERMS=len(grad_plan.per_query) // 2,
        NUM_DIAGONAL_GRAD_TERMS=len(grad_plan.diagonal) // 2,
        DIAGONAL_SCRATCH_OFFSET=grad_plan.scratch_offset,
    )

    tables = call.tables
    # The order of backward.py.jinja's def_kernel.
    inputs = {"query": query, "key": key, "value": value, "logsumexp": logsumexp, "delta": delta,
              "grad_out": grad_out, "grad_query": grad_query, "grad_value": grad_value,
              **{name: getattr(tables, name) for name in ("kv_num_blocks", "kv_indices", "q_num_blocks", "q_indices",
                                                          "full_kv_num_blocks", "full_kv_indices",
                                                          "full_q_num_blocks", "full_q_indices")},
              "workspace": grad_plan.workspace, "seed": common.seed_for_kernel(dropout_seed, device)}
    input_nodes = list(inputs.values())
    scatter_grads = grad_plan.scatter_grads
    mutated = [grad_query, grad_value, *scatter_grads] + ([grad_plan.workspace] if grad_plan.summed else [])
    choices, config_of_choice = common.template_choices(
        template, usable, what,
        lambda cfg: {**spec, **cfg.constexprs()},
        input_nodes=input_nodes,
        layout=dk_layout,
        subgraphs=subgraphs,
        mutated_inputs=mutated,
        call_sizes=[B, Hkv, L, S],
    )
    grad_key = _compat.autotune_select_node(
        template_name, choices, input_nodes + common.captured_inputs(call) + scatter_grads, dk_layout,
        input_gen_fns=common.benchmark_table_inputs(inputs, tables, call.has_full_blocks))
    common.report_choice(what, grad_key, config_of_choice, usable, spec, REPORTED_SPECIALISATIONS,
                         query, key, value, kernel_options, started=started)

    grad_key = grad_key if isinstance(grad_key, ir.TensorBox) else ir.TensorBox(grad_key)
    grad_value = ir.TensorBox(grad_value)
    # A KV batch of 1 shared by every query batch: its gradients are the sums over the
    # batch. Any other KV batch equals the query batch (the API checks it), also when the
    # two are different symbols under dynamic shapes (Dynamo specialises sizes 0 and 1).
    if sizevars.statically_known_true(sympy.Eq(Bkv, 1)) and not sizevars.statically_known_true(sympy.Eq(B, 1)):
        grad_key = lowerings[aten.sum.dim_IntList](grad_key, [0], True)
        grad_value = lowerings[aten.sum.dim_IntList](grad_value, [0], True)
    buffer_grads = tuple(None if g is None else finish_buffer_grad(g, buf)
                         for g, buf in zip(grad_plan.grads, score_mod_buffers))
    grad_query = ir.TensorBox(grad_query)
    if dq_atomic:
        grad_query = to_dtype(lowerings[aten.mul.Tensor](grad_query, float(scale)), dtype)
    return grad_query, grad_key, grad_value, buffer_grads


def diagonal_scratch_elements(batch, kv_heads, kv_len, sparse_kv: int, configs) -> int | None:
    """Workspace elements for the dK/dV programs' scratch slots of diagonal sums (one
    float32 BLOCK_N1 x BLOCK_M1 slot per program, at most SPARSE_KV_BLOCK_SIZE keys per
    BLOCK_N1 of them; the widest BLOCK_M1 of the configs, any of which autotuning may
    pick), None where a size is not static."""
    sizes = [common.static_size(n) for n in (batch, kv_heads, kv_len)]
    if None in sizes:
        return None
    b, h, s = sizes
    return b * h * -(-s // sparse_kv) * sparse_kv * max(cfg.block_m1 for cfg in configs)


def triton_backward_configs(device, spec, dtype, kernel_options, call, fw_graph, dq_atomic: bool) -> list:
    """The Triton template's usable tile configurations for the call."""
    candidates = backward_configs.candidate_configs(device, spec["QK_HEAD_DIM_PAD"], dtype,
                                                    bool(inductor_config.max_autotune), kernel_options)
    return backward_configs.usable_configs(
        candidates, kernel_options, sparse_q=call.sparse_q, sparse_kv=call.sparse_kv,
        qk_dim_pad=spec["QK_HEAD_DIM_PAD"], v_dim_pad=spec["V_HEAD_DIM_PAD"], elem_bytes=dtype.itemsize,
        smem_limit=shared_memory_limit(device),
        gathered_bytes=(gathered_tile_bytes(fw_graph.graph_module, len(SCORE_MOD_ARGS))
                        + gathered_tile_bytes(call.mask_graph.graph_module, len(MASK_MOD_ARGS))),
        staged_dq=dq_atomic and spec["USE_TMA_DKDV"])


def backward_inputs(query, key, value, grad_out, call, kernel_options, dropout_seed, buffer_grads: bool,
                    mask_mod_buffers):
    """A call's ``BackwardInputs`` (the nodes realized, as the lowering has them)."""
    sizevars = V.graph.sizevars
    return BackwardInputs(
        **device_fields(query),
        dtype=query.get_dtype(),
        qk_head_dim=sizevars.guard_int(query.get_size()[-1]),
        v_head_dim=sizevars.guard_int(value.get_size()[-1]),
        sparse_q=call.sparse_q,
        sparse_kv=call.sparse_kv,
        has_dropout=dropout_seed is not None,
        buffer_grads=buffer_grads,
        deterministic=common.deterministic_requested(kernel_options),
        tma_obstacle=common.first_tma_obstacle(((query, "query"), (key, "key"), (value, "value"),
                                                (grad_out, "output gradient"))),
        backend=_options.read(kernel_options, "BWD_BACKEND"),
        mask_reads_memory=common.mask_reads_memory(mask_mod_buffers),
        partial_heavy=_options.read_internal(kernel_options, "MASK_PARTIAL_HEAVY"),
        q_len=common.static_size(query.get_size()[-2]),
        kv_len=common.static_size(key.get_size()[-2]),
        work=call_work(query, key),
        unmodified=common.dense_kv(kernel_options, call.has_full_blocks) and not call.has_score_mod,
    )

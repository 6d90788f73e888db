"""Can a hand-partitioned Gluon backward reach FlashAttention-4's speed on Hopper (issue #50)?

A standalone attention backward in Gluon (Triton 3.6, sm90), without flexattn's mods, to
settle the structure before it becomes a template: one program per BLOCK_N=128 keys of one
(batch, head), walking the query tiles (BLOCK_M rows) in order (from the diagonal on when
causal). Partitions:

* a one-warp loader: K and V of the program's keys once (two 64-row halves), then each
  query tile's Q and dO into a NUM_STAGES-deep ring (mbarriers ``q_ready``/``do_ready``,
  released by both consumers through ``tile_free``, count 2);
* two consumer warpgroups, each owning 64 of the keys (KV-stationary, FA2 Algorithm 2):
      S^T  = K_w Q^T,  dP^T = V_w dO^T                      (async wgmma, smem operands)
      P^T  = exp2(S^T * scale * log2 e - lse2),  causal mask on diagonal tiles
      dS^T = P^T * (dP^T - delta)
      dV_w += P^T dO,  dK_w += dS^T Q                        (P^T, dS^T as register operands)
      dQ   += dS K_w                                         (dS^T through shared memory,
                                                              float32 atomics into dq_acc)
  dK is scaled at the end; dQ = dq_acc * scale on the host, delta = rowsum(dO * O) too.

    python bench/experiments/gluon_backward_probe.py --offline     # CPU: compile for sm90, registers/spills
    python bench/experiments/gluon_backward_probe.py               # H200: against float64, TFLOP/s beside SDPA

Not flexattn code: once its readings say the structure pays, it becomes a template with
the mods inlined.
"""
from __future__ import annotations

import argparse
import itertools
import math
import re
import subprocess
import sys
import tempfile

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

#: Triton 3.6 names the TMA load async_copy_global_to_shared; later releases async_load.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
LOG2_E = 1.4426950408889634
#: Keys per consumer warpgroup; a program's BLOCK_N is twice this.
KEYS_PER_WG = 64


@builtin
def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """Bulk-add a shared-memory tile into global memory through TMA (cp.reduce.async.bulk
    .tensor ... add); Triton 3.6's Gluon has the op but no public wrapper. Completes like a
    TMA store: ``tma.store_wait`` before ``src`` is written again."""
    from triton._C.libtriton import ir

    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _load(q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_smem, v_smem, kv_ready, q_ready, do_ready, tile_free,
          q_row0, kv_row, first_tile, num_tiles):
    """The producer: K and V halves once, then Q and dO of each query tile into the ring."""
    NUM_STAGES: gl.constexpr = q_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HALF: gl.constexpr = k_desc.block_type.shape[0]
    mbarrier.expect(kv_ready, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    tma_load(k_desc, [kv_row, 0], kv_ready, k_smem.index(0))
    tma_load(k_desc, [kv_row + HALF, 0], kv_ready, k_smem.index(1))
    tma_load(v_desc, [kv_row, 0], kv_ready, v_smem.index(0))
    tma_load(v_desc, [kv_row + HALF, 0], kv_ready, v_smem.index(1))
    for j in range(num_tiles):
        stage = j % NUM_STAGES
        phase = (j // NUM_STAGES) & 1
        # A fresh barrier passes a wait on phase 1: the first lap finds every slot free.
        mbarrier.wait(tile_free.index(stage), phase ^ 1)
        row = q_row0 + (first_tile + j) * BLOCK_M
        mbarrier.expect(q_ready.index(stage), q_desc.block_type.nbytes)
        tma_load(q_desc, [row, 0], q_ready.index(stage), q_bufs.index(stage))
        mbarrier.expect(do_ready.index(stage), do_desc.block_type.nbytes)
        tma_load(do_desc, [row, 0], do_ready.index(stage), do_bufs.index(stage))


@gluon.constexpr_function
def flags_length(dq_mode, causal):
    return 1 + int(dq_mode) + 4 * int(bool(causal))


@gluon.constexpr_function
def mode_of(flags):
    return (flags.type.shape[0] - 1) % 4


@gluon.constexpr_function
def causal_of(flags):
    return (flags.type.shape[0] - 1) // 4 == 1


@gluon.jit
def _consume(q_bufs, do_bufs, k_smem, v_smem, ds_smem, dq_smem, kv_ready, q_ready, do_ready, tile_free, ds_bars, flags,
             LSE2, DELTA, DQ_ACC, dq_desc, DK, DV, bh, seq_len, off_n, first_tile, num_tiles, qk_scale_log2, sm_scale,
             WG: gl.constexpr):
    """One consumer warpgroup: dK and dV of its 64 keys, its share of dQ."""
    # Arguments reach a partition as run-time values, constexpr or not; the kernel's
    # flags come as the length of a small shared buffer, which stays a constant.
    DQ_MODE: gl.constexpr = mode_of(flags)
    CAUSAL: gl.constexpr = causal_of(flags)
    DQ_TMA: gl.constexpr = DQ_MODE == 1
    DQ_SPLIT: gl.constexpr = DQ_MODE >= 2
    # Overlapped split: dV and dK stay in flight through the dS exchange and the dQ products.
    OVERLAP: gl.constexpr = DQ_MODE == 3
    NUM_STAGES: gl.constexpr = q_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = q_bufs.type.shape[1]
    HEAD_D: gl.constexpr = q_bufs.type.shape[2]
    HALF: gl.constexpr = k_smem.type.shape[1]
    dtype: gl.constexpr = q_bufs.dtype
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    k_w = k_smem.index(WG)
    v_w = v_smem.index(WG)

    offs_n = off_n + WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, st_layout))
    cols_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
    no_scores = gl.zeros((HALF, BLOCK_M), dtype=gl.float32, layout=st_layout)
    HALF_D: gl.constexpr = HEAD_D // 2
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, HALF_D, 16])
    no_dq = gl.zeros((BLOCK_M, HALF_D), dtype=gl.float32, layout=dq_layout)
    dk = gl.zeros((HALF, HEAD_D), dtype=gl.float32, layout=acc_layout)
    dv = gl.zeros((HALF, HEAD_D), dtype=gl.float32, layout=acc_layout)
    rows_dq = gl.expand_dims(gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout)), 1)
    cols_dq = gl.expand_dims(gl.arange(0, HALF_D, layout=gl.SliceLayout(0, dq_layout)), 0)
    cols_d = gl.expand_dims(gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, acc_layout)), 0)

    mbarrier.wait(kv_ready, 0)
    for j in range(num_tiles):
        stage = j % NUM_STAGES
        phase = (j // NUM_STAGES) & 1
        off_m = (first_tile + j) * BLOCK_M
        mbarrier.wait(q_ready.index(stage), phase)
        q_tile = q_bufs.index(stage)
        st = warpgroup_mma(k_w, q_tile.permute((1, 0)), no_scores, use_acc=False, is_async=True)
        mbarrier.wait(do_ready.index(stage), phase)
        do_tile = do_bufs.index(stage)
        dpt = warpgroup_mma(v_w, do_tile.permute((1, 0)), no_scores, use_acc=False, is_async=True)
        offs_m = off_m + cols_m
        lse2 = gl.load(LSE2 + bh * seq_len + offs_m)
        delta = gl.load(DELTA + bh * seq_len + offs_m)
        st = warpgroup_mma_wait(num_outstanding=1, deps=(st, ))
        pt = gl.exp2(st * qk_scale_log2 - gl.expand_dims(lse2, 0))
        if CAUSAL:
            # Only the tiles that cross the diagonal hold keys past their queries.
            if off_m < off_n + 2 * HALF:
                pt = gl.where(gl.expand_dims(offs_m, 0) >= gl.expand_dims(offs_n, 1), pt, 0.0)
        dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt, ))
        dst = pt * (dpt - gl.expand_dims(delta, 0))
        dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), op_layout), do_tile, dv, is_async=True)
        ds_low = dst.to(dtype)
        dk = warpgroup_mma(gl.convert_layout(ds_low, op_layout), q_tile, dk, is_async=True)
        if DQ_SPLIT:
            # dS^T of both warpgroups in shared memory, two tiles' worth (by parity): a
            # buffer is rewritten once both warpgroups' dQ products of two tiles ago read it.
            par = j % 2
            lap = (j // 2) & 1
            mbarrier.wait(ds_bars.index(2 + par), lap ^ 1)
            ds_w = ds_smem.index(par * 2 + WG)
        else:
            ds_w = ds_smem.index(WG)
        ds_w.store(ds_low)
        fence_async_shared()
        if DQ_SPLIT:
            mbarrier.arrive(ds_bars.index(par))
        if not OVERLAP:
            dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
            mbarrier.arrive(tile_free.index(stage))
        if DQ_SPLIT:
            # dQ of the tile over all 128 keys once, this warpgroup's half of its columns:
            # dS_0 K_0[:, cols] + dS_1 K_1[:, cols], one bulk add.
            mbarrier.wait(ds_bars.index(par), lap)
            dq = warpgroup_mma(ds_smem.index(par * 2).permute((1, 0)), k_smem.index(0).slice(WG * HALF_D, HALF_D, dim=1),
                               no_dq, use_acc=False, is_async=True)
            dq = warpgroup_mma(ds_smem.index(par * 2 + 1).permute((1, 0)),
                               k_smem.index(1).slice(WG * HALF_D, HALF_D, dim=1), dq, is_async=True)
            if OVERLAP:
                # Groups complete in order: one wait retires dV, dK and dQ.
                dv, dk, dq = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, dq))
                mbarrier.arrive(tile_free.index(stage))
            else:
                dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
            mbarrier.arrive(ds_bars.index(2 + par))
            buf = dq_smem.index(WG)
            tma.store_wait(0)
            buf.store(dq)
            fence_async_shared()
            tma_reduce_add(dq_desc, [bh * seq_len + off_m, WG * HALF_D], buf)
        # dQ in column halves: a [BLOCK_M, HEAD_D] float32 tile beside dK and dV spills.
        for h in gl.static_range(0 if DQ_SPLIT else 2):
            dq = warpgroup_mma(ds_w.permute((1, 0)), k_w.slice(h * HALF_D, HALF_D, dim=1), no_dq, use_acc=False,
                               is_async=True)
            dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
            if DQ_TMA:
                # One bulk add per half tile from shared memory; the buffer's previous add
                # (a tile ago) must have read it first, the other half's may still run.
                buf = dq_smem.index(WG * 2 + h)
                tma.store_wait(1)
                buf.store(dq)
                fence_async_shared()
                tma_reduce_add(dq_desc, [bh * seq_len + off_m, h * HALF_D], buf)
            else:
                # Relaxed: the adds need no ordering (dQ is read after the kernel); the default
                # acq_rel put a GPU-wide fence and an L1 invalidate around every element's add.
                gl.atomic_add(DQ_ACC + (bh * seq_len + off_m + rows_dq) * HEAD_D + h * HALF_D + cols_dq, dq,
                              sem="relaxed")

    rows_kv = gl.expand_dims(off_n + WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, acc_layout)), 1)
    out = (bh * seq_len + rows_kv) * HEAD_D + cols_d
    gl.store(DK + out, (dk * sm_scale).to(dtype))
    gl.store(DV + out, dv.to(dtype))
    if DQ_MODE > 0:
        tma.store_wait(0)


@gluon.jit
def _consume_wg0(q_bufs, do_bufs, k_smem, v_smem, ds_smem, dq_smem, kv_ready, q_ready, do_ready, tile_free, ds_bars,
                 flags, LSE2, DELTA, DQ_ACC, dq_desc, DK, DV, bh, seq_len, off_n, first_tile, num_tiles, qk_scale_log2,
                 sm_scale):
    _consume(q_bufs, do_bufs, k_smem, v_smem, ds_smem, dq_smem, kv_ready, q_ready, do_ready, tile_free, ds_bars, flags,
             LSE2, DELTA, DQ_ACC, dq_desc, DK, DV, bh, seq_len, off_n, first_tile, num_tiles, qk_scale_log2, sm_scale,
             0)


@gluon.jit
def _consume_wg1(q_bufs, do_bufs, k_smem, v_smem, ds_smem, dq_smem, kv_ready, q_ready, do_ready, tile_free, ds_bars,
                 flags, LSE2, DELTA, DQ_ACC, dq_desc, DK, DV, bh, seq_len, off_n, first_tile, num_tiles, qk_scale_log2,
                 sm_scale):
    _consume(q_bufs, do_bufs, k_smem, v_smem, ds_smem, dq_smem, kv_ready, q_ready, do_ready, tile_free, ds_bars, flags,
             LSE2, DELTA, DQ_ACC, dq_desc, DK, DV, bh, seq_len, off_n, first_tile, num_tiles, qk_scale_log2, sm_scale,
             1)


@gluon.jit
def attn_bwd_kernel(q_desc, do_desc, k_desc, v_desc, dq_desc, LSE2, DELTA, DQ_ACC, DK, DV, seq_len, qk_scale_log2,
                    sm_scale, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr, MMA_REGS: gl.constexpr,
                    LOAD_REGS: gl.constexpr, DQ_MODE: gl.constexpr):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_D: gl.constexpr = q_desc.block_type.shape[1]
    HALF: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    gl.static_assert(HALF == BLOCK_M, "the dS^T tile of a warpgroup is HALF x BLOCK_M, stored square")
    off_n = gl.program_id(0) * 2 * HALF
    bh = gl.program_id(1)
    first_tile = 0
    if CAUSAL:
        first_tile = off_n // BLOCK_M
    num_tiles = gl.cdiv(seq_len, BLOCK_M) - first_tile

    q_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_D], q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, HEAD_D], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_D], v_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, BLOCK_M], dtype)
    # dS^T per warpgroup; with the split dQ per (tile parity, warpgroup).
    ds_smem = gl.allocate_shared_memory(dtype, [4 if DQ_MODE >= 2 else 2, HALF, BLOCK_M], ds_layout)
    # dQ staging for the bulk adds: per (warpgroup, column half), per warpgroup when split;
    # one unused slot with atomics.
    DQ_BUFS: gl.constexpr = 1 if DQ_MODE == 0 else 4 if DQ_MODE == 1 else 2
    dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_BUFS] + dq_desc.block_type.shape, dq_desc.layout)
    # The partitions' compile-time flags, as this buffer's length (never read).
    flags = gl.allocate_shared_memory(gl.int64, [flags_length(DQ_MODE, CAUSAL), 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    tile_free = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    # Split dQ: dS^T ready (by tile parity), then read (by tile parity), by both warpgroups.
    ds_bars = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(4):
        mbarrier.init(ds_bars.index(i), count=2)
    mbarrier.init(kv_ready, count=1)
    for stage in gl.static_range(NUM_STAGES):
        mbarrier.init(q_ready.index(stage), count=1)
        mbarrier.init(do_ready.index(stage), count=1)
        # Both consumer warpgroups read a slot before it is refilled.
        mbarrier.init(tile_free.index(stage), count=2)
    fence_async_shared()

    consumer_args = (q_bufs, do_bufs, k_smem, v_smem, ds_smem, dq_smem, kv_ready, q_ready, do_ready, tile_free, ds_bars,
                     flags, LSE2,
                     DELTA, DQ_ACC, dq_desc, DK, DV, bh, seq_len, off_n, first_tile, num_tiles, qk_scale_log2, sm_scale)
    gl.warp_specialize([
        (_consume_wg0, consumer_args),
        (_consume_wg1, consumer_args),
        (_load, (q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_smem, v_smem, kv_ready, q_ready, do_ready,
                 tile_free, bh * seq_len, bh * seq_len + off_n, first_tile, num_tiles)),
    ], [4, 1], [MMA_REGS, LOAD_REGS])


# ----------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------
CONFIG = dict(BLOCK_M=64, NUM_STAGES=2, MMA_REGS=240, LOAD_REGS=24, num_warps=4)


def _smem_layout(shape):
    return gl.NVMMASharedLayout.get_default_for(shape, gl.bfloat16)


def _dq_layout(block_m, head_d):
    return gl.NVMMASharedLayout.get_default_for([block_m, head_d // 2], gl.float32)


#: How dQ reaches global memory: relaxed float32 atomics of each warpgroup's 64-key partial;
#: bulk TMA adds of those partials by column half; "split": the tile's dQ over all 128 keys
#: once, each warpgroup its half of the columns, one bulk add each; "split_overlap": the
#: same with dV and dK left in flight until the dQ products are waited on.
DQ_MODES = {"atomic": 0, "tma": 1, "split": 2, "split_overlap": 3}


def compile_offline(head_dims=(64, 128)) -> int:
    """Compile for sm90 without a GPU; print warps, shared memory, registers and spills."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.experimental.gluon._runtime import GluonASTSource

    rc = 0
    c = CONFIG
    for D, causal, dq_mode in itertools.product(head_dims, (False, True), DQ_MODES):
        tile = _smem_layout([c["BLOCK_M"], D])
        half = _smem_layout([KEYS_PER_WG, D])
        sig = {"q_desc": f"tensordesc<bf16[{c['BLOCK_M']}, {D}],{tile!r}>",
               "do_desc": f"tensordesc<bf16[{c['BLOCK_M']}, {D}],{tile!r}>",
               "k_desc": f"tensordesc<bf16[{KEYS_PER_WG}, {D}],{half!r}>",
               "v_desc": f"tensordesc<bf16[{KEYS_PER_WG}, {D}],{half!r}>",
               "dq_desc": f"tensordesc<fp32[{c['BLOCK_M']}, {D // 2}],{_dq_layout(c['BLOCK_M'], D)!r}>",
               "LSE2": "*fp32", "DELTA": "*fp32", "DQ_ACC": "*fp32", "DK": "*bf16", "DV": "*bf16",
               "seq_len": "i32", "qk_scale_log2": "fp32", "sm_scale": "fp32",
               "CAUSAL": "constexpr", "NUM_STAGES": "constexpr", "MMA_REGS": "constexpr",
               "LOAD_REGS": "constexpr", "DQ_MODE": "constexpr"}
        consts = {"CAUSAL": causal, "NUM_STAGES": c["NUM_STAGES"], "MMA_REGS": c["MMA_REGS"],
                  "LOAD_REGS": c["LOAD_REGS"], "DQ_MODE": DQ_MODES[dq_mode]}
        name = f"bwd D={D} {'causal' if causal else 'no mask'} dQ {dq_mode}"
        try:
            k = triton.compile(GluonASTSource(attn_bwd_kernel, sig, constexprs=consts),
                               target=GPUTarget("cuda", 90, 32), options={"num_warps": c["num_warps"]})
            with tempfile.TemporaryDirectory() as tmp:
                with open(tmp + "/k.ptx", "w") as f:
                    f.write(k.asm["ptx"])
                report = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", tmp + "/k.ptx", "-o",
                                         tmp + "/k.o"], capture_output=True, text=True)
            log = report.stdout + report.stderr
            regs = re.findall(r"Used (\d+) registers", log)
            spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
            print(f"[{name}] compiled for sm90: warps={k.metadata.num_warps} shared={k.metadata.shared} "
                  f"registers={regs} spill_bytes={spills} setmaxnreg={'setmaxnreg' in k.asm['ptx']}")
        except Exception as error:  # noqa: BLE001 - a probe reports every failure
            rc = 1
            print(f"[{name}] COMPILE FAILED: {type(error).__name__}: {str(error)[:2000]}")
    return rc


def prepare(q, k, v, o, do, lse, causal, scale, dq_mode="tma"):
    """(launch, finish) for the Gluon kernel on (B, H, S, D) bf16 q, k, v, o, do and the
    forward's natural-log lse (B, H, S) float32: ``launch()`` runs the kernel alone (delta
    and the base-2 lse computed here, once), ``finish()`` returns (dq, dk, dv)."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    c = CONFIG
    B, H, S, D = q.shape
    assert S % (2 * KEYS_PER_WG) == 0 and S % c["BLOCK_M"] == 0
    delta = (o.float() * do.float()).sum(-1).contiguous()
    lse2 = (lse.float() * LOG2_E).contiguous()
    dq_acc = torch.zeros(B, H, S, D, device=q.device, dtype=torch.float32)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    flat = [t.contiguous().view(B * H * S, D) for t in (q, do, k, v)]
    tile, half = _smem_layout([c["BLOCK_M"], D]), _smem_layout([KEYS_PER_WG, D])
    descs = [TensorDescriptor.from_tensor(flat[0], [c["BLOCK_M"], D], tile),
             TensorDescriptor.from_tensor(flat[1], [c["BLOCK_M"], D], tile),
             TensorDescriptor.from_tensor(flat[2], [KEYS_PER_WG, D], half),
             TensorDescriptor.from_tensor(flat[3], [KEYS_PER_WG, D], half),
             TensorDescriptor.from_tensor(dq_acc.view(B * H * S, D), [c["BLOCK_M"], D // 2],
                                          _dq_layout(c["BLOCK_M"], D))]
    grid = (S // (2 * KEYS_PER_WG), B * H)

    def launch():
        dq_acc.zero_()
        attn_bwd_kernel[grid](*descs, lse2, delta, dq_acc, dk, dv, S, scale * LOG2_E, scale, causal,
                              c["NUM_STAGES"], c["MMA_REGS"], c["LOAD_REGS"], DQ_MODES[dq_mode],
                              num_warps=c["num_warps"])

    def finish():
        return (dq_acc * scale).to(q.dtype), dk, dv

    return launch, finish


def run_gpu(args) -> int:
    import torch

    assert torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0), "an sm90 GPU"
    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    flash = torch.ops.aten._scaled_dot_product_flash_attention
    ok_all = True
    modes = args.dq_modes.split(",")
    for D in (64, 128):
        for causal in (False, True):
            name = f"D={D} {'causal' if causal else 'no mask'}"
            scale = 1.0 / math.sqrt(D)
            gen = torch.Generator(device="cuda").manual_seed(0)
            # Three-way check on one (batch, head) pair at S=args.check_seq: float64 golden,
            # float32 reference rounded to bf16, the kernel.
            S = args.check_seq
            q, k, v, do = (torch.randn(1, 2, S, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                           for _ in range(4))

            def reference(dtype):
                qr, kr, vr = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
                scores = (qr @ kr.transpose(-1, -2)) * scale
                if causal:
                    scores = scores.masked_fill(torch.ones(S, S, device="cuda", dtype=torch.bool).triu(1),
                                                float("-inf"))
                out = scores.softmax(-1) @ vr
                out.backward(do.to(dtype))
                return out.detach(), torch.logsumexp(scores.detach(), -1), (qr.grad, kr.grad, vr.grad)

            golden_out, lse, golden = reference(torch.float64)
            _, _, same_dtype = reference(torch.float32)
            for mode in modes:
                launch, finish = prepare(q, k, v, golden_out.to(q.dtype), do, lse, causal, scale, mode)
                launch()
                errors = []
                for grad_name, got, g64, g32 in zip(("dq", "dk", "dv"), finish(), golden, same_dtype):
                    err = (got.double() - g64).abs().max().item()
                    ref_err = (g32.to(q.dtype).double() - g64).abs().max().item()
                    errors.append(f"{grad_name} {err:.2e} (bf16 rounding {ref_err:.2e})")
                    ok_all &= bool(err <= 3 * ref_err + 1e-3) and bool(torch.isfinite(got).all())
                print(f"[{name} dQ {mode}] S={S} errors vs float64: " + ", ".join(errors), flush=True)

            # Speed at the benchmark shape, the kernel alone, beside SDPA's flash backward.
            B, H, S = args.batch, args.heads, args.seq
            q, k, v, do = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                           for _ in range(4))
            out, lse = flash(q, k, v, 0.0, causal, False, scale=scale)[:2]
            flops = 2.5 * 4.0 * B * H * S * S * D * (0.5 if causal else 1.0)
            readings = []
            for mode in modes:
                launch, _ = prepare(q, k, v, out, do, lse, causal, scale, mode)
                readings.append(f"dQ {mode} {flops / triton.testing.do_bench(launch) / 1e9:.0f}")
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            sdpa_out = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal, scale=scale)
            ms_sdpa = triton.testing.do_bench(lambda: sdpa_out.backward(do, retain_graph=True),
                                              grad_to_none=[qg, kg, vg])
            print(f"[{name}] B={B} H={H} S={S}: Gluon backward kernel TFLOP/s {', '.join(readings)} "
                  f"(+ host delta and dQ cast not counted), SDPA backward {flops / ms_sdpa / 1e9:.0f}", flush=True)
    print("ALL OK" if ok_all else "SOME FAILED")
    return 0 if ok_all else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--offline", action="store_true", help="compile for sm90 on a machine without a GPU")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--dq-modes", default=",".join(DQ_MODES), help="comma-separated: " + ", ".join(DQ_MODES))
    parser.add_argument("--check-seq", type=int, default=1024, help="length of the float64 check")
    args = parser.parse_args()
    sys.exit(compile_offline() if args.offline else run_gpu(args))

"""Probe: can Triton 3.6 overlap the softmax of one KV tile with the next tile's Q.K^T?

A FlashAttention-3-style intra-warpgroup pipeline (Shah et al., 2024, section 3.2)
written in plain Triton, beside the same forward without it, on a bare attention kernel
(no score_mod, no BlockMask; Q, K, V (B, H, S, D) contiguous bf16, tensor descriptors):

* ``PIPELINED_QK=False``: per tile, Q.K^T, softmax, P.V (the order of flexattn's
  ``attend_kv_blocks``).
* ``PIPELINED_QK=True``: per tile, first P.V of the previous tile, then Q.K^T of the next
  tile, then this tile's softmax, so that the next Q.K^T can still run on the tensor cores
  while the softmax runs. Triton's WGMMA pipeliner (rule 3b of ``dotCanBeProperlyAsync``)
  then keeps the next Q.K^T in flight past the loop's one full wait. The price: one P.V
  of zeros before the first tile and one Q.K^T of the clamped last tile after it, and P
  carried to the next iteration, which Triton keeps in shared memory.

    python bench/experiments/probe_pipelined_qk.py        # GPU: TFLOP/s of both beside SDPA cuDNN
    PYTHONPATH=<triton 3.6> python bench/experiments/probe_pipelined_qk.py --aot OUT_DIR
                                                          # no GPU: sm90 compile, registers, waits

The reading: bench/DECISIONS.md, rejected-pipelined-qk.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
import triton.language as tl

LOG2_E = 1.4426950408889634
#: (BLOCK_M, BLOCK_N, num_warps, num_stages) timed at D=128.
CONFIGS = [(128, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 2)]


@triton.jit
def softmax_step(qk, m_i, l_i, offs_m, start_n, diagonal_start,
                 BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """One tile of the base-2 online softmax (FA2 Algorithm 1, lines 9-10) on scores
    already scaled by sm_scale * LOG2_E; returns (p, alpha, m_new, l_new)."""
    if CAUSAL:
        if start_n + BLOCK_N > diagonal_start:
            offs_n = start_n + tl.arange(0, BLOCK_N)
            qk = tl.where(offs_m[:, None] >= offs_n[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def attention_forward(Q, K, V, O, S, qk_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, PIPELINED_QK: tl.constexpr):
    """One BLOCK_M tile of query rows of one (batch, head): program_id(0) the tile,
    program_id(1) the batch-head. qk_scale = sm_scale * LOG2_E, folded into q."""
    off_m = tl.program_id(0)
    off_head = tl.program_id(1).to(tl.int64) * S * HEAD_DIM
    q_desc = tl.make_tensor_descriptor(Q + off_head, [S, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_M, HEAD_DIM])
    k_desc = tl.make_tensor_descriptor(K + off_head, [S, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(V + off_head, [S, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM])
    offs_m = off_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = (q_desc.load([off_m * BLOCK_M, 0]) * qk_scale).to(tl.bfloat16)
    m_i = tl.full([BLOCK_M], -3.0e38, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if CAUSAL:
        hi = (off_m + 1) * BLOCK_M
    else:
        hi = S
    diagonal_start = off_m * BLOCK_M
    if PIPELINED_QK:
        qk = tl.dot(q, k_desc.load([0, 0]).T)
        p = tl.zeros([BLOCK_M, BLOCK_N], tl.bfloat16)
        alpha = tl.full([BLOCK_M], 1.0, tl.float32)
        for start_n in range(0, hi, BLOCK_N):
            v = v_desc.load([tl.maximum(start_n - BLOCK_N, 0), 0])
            acc = tl.dot(p, v, acc * alpha[:, None])
            next_n = tl.minimum(start_n + BLOCK_N, hi - BLOCK_N)
            qk_next = tl.dot(q, k_desc.load([next_n, 0]).T)
            p32, alpha, m_i, l_i = softmax_step(qk, m_i, l_i, offs_m, start_n, diagonal_start, BLOCK_N, CAUSAL)
            p = p32.to(tl.bfloat16)
            qk = qk_next
        acc = tl.dot(p, v_desc.load([hi - BLOCK_N, 0]), acc * alpha[:, None])
    else:
        for start_n in range(0, hi, BLOCK_N):
            qk = tl.dot(q, k_desc.load([start_n, 0]).T)
            p, alpha, m_i, l_i = softmax_step(qk, m_i, l_i, offs_m, start_n, diagonal_start, BLOCK_N, CAUSAL)
            acc = tl.dot(p.to(tl.bfloat16), v_desc.load([start_n, 0]), acc * alpha[:, None])
    o_desc = tl.make_tensor_descriptor(O + off_head, [S, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_M, HEAD_DIM])
    o_desc.store([off_m * BLOCK_M, 0], (acc / l_i[:, None]).to(tl.bfloat16))


def compile_sm90(out_dir: str, head_dim: int = 128) -> None:
    """Compile every variant for sm90 without a GPU; print registers, spills and the
    wgmma wait counts of the PTX; write TTGIR and PTX to out_dir."""
    from triton.backends.compiler import GPUTarget

    os.makedirs(out_dir, exist_ok=True)
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    signature = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "S": "i32", "qk_scale": "fp32",
                 "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "HEAD_DIM": "constexpr", "CAUSAL": "constexpr",
                 "PIPELINED_QK": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(5)}
    for (m, n, w, s) in CONFIGS:
        for causal in (False, True):
            for pipelined in (False, True):
                constexprs = {"BLOCK_M": m, "BLOCK_N": n, "HEAD_DIM": head_dim, "CAUSAL": causal,
                              "PIPELINED_QK": pipelined}
                kernel = triton.compile(
                    triton.compiler.ASTSource(fn=attention_forward, signature=signature, constexprs=constexprs,
                                              attrs=attrs),
                    target=GPUTarget("cuda", 90, 32), options={"num_warps": w, "num_stages": s})
                tag = f"{m}x{n}w{w}s{s}{'-causal' if causal else ''}{'-pipelined' if pipelined else ''}"
                for stage in ("ttgir", "ptx"):
                    with open(os.path.join(out_dir, f"{tag}.{stage}"), "w") as f:
                        f.write(kernel.asm[stage])
                with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
                    f.write(kernel.asm["ptx"])
                report = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                                        capture_output=True, text=True).stderr
                regs = re.search(r"Used (\d+) registers", report).group(1)
                spill = re.search(r"(\d+) bytes spill stores", report).group(1)
                waits = re.findall(r"wgmma.wait_group.sync.aligned (\d+)", kernel.asm["ptx"])
                print(f"{tag}: {regs} registers, {spill} B spilled, wgmma waits {waits}")


def time_gpu(head_dim: int = 128, S: int = 8192, B: int = 4, H: int = 16) -> None:
    """TFLOP/s of both variants per config, beside SDPA's cuDNN backend, with the max
    |difference| from cuDNN's output."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    q, k, v = (torch.randn(B, H, S, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for causal in (False, True):
        flops = 4 * B * H * S * S * head_dim * (0.5 if causal else 1.0)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            ms = triton.testing.do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                                         warmup=25, rep=200, return_mode="median")
        print(f"D={head_dim} causal={causal}: SDPA cuDNN {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        for (m, n, w, s) in CONFIGS:
            for pipelined in (False, True):
                out = torch.empty_like(q)

                def call():
                    attention_forward[(S // m, B * H)](q, k, v, out, S, head_dim ** -0.5 * LOG2_E, BLOCK_M=m,
                                                       BLOCK_N=n, HEAD_DIM=head_dim, CAUSAL=causal,
                                                       PIPELINED_QK=pipelined, num_warps=w, num_stages=s)
                call()
                err = (out.float() - ref.float()).abs().max().item()
                ms = triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median")
                print(f"  {m}x{n} w{w} s{s} pipelined={pipelined}: {flops / ms / 1e9:.0f} TFLOP/s, "
                      f"max |diff| from cuDNN {err:.3g}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--aot", metavar="OUT_DIR", help="compile for sm90 without a GPU, write TTGIR/PTX here")
    args = parser.parse_args()
    if args.aot:
        compile_sm90(args.aot)
    else:
        time_gpu()

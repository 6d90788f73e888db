"""Does the dK/dV loop's keep mask get cheaper if each thread computes one Philox draw
instead of two? In the keys-as-rows tile a thread needs half e of the draws of queries
2p and 2p + 1; the template's ``dropout_keep_t`` computes both. The variant here
(``exchange_keep_t``) computes the draw of query 2p + e and takes the other from the
thread of the other parity through a sum over e (one lane shuffle in the matrix-product
layout), so each draw is computed once, as in the forward. A dK/dV-shaped micro-kernel
(S^T = K Q^T, exp2, the keep mask, dV += P^T dO) times no mask, the template's and the
variant's, and checks the two masks give the same dV. GPU only.

    PYTHONPATH=. python bench/experiments/dropout_keep_exchange.py

The real kernels' reading is a separate run of bench/bench_dropout.py per version
(bench/DECISIONS.md#rejected-dropout-keep-exchange).
"""

from __future__ import annotations

import importlib.util
import re
import sys
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from flexattn.templates import read_template


def _template_helpers():
    """common.py.jinja's helpers as an importable module (Triton reads a jit function's source file)."""
    source = re.sub(r"\{#.*?#\}", "", read_template("common"), flags=re.S)
    path = Path(tempfile.mkdtemp()) / "flexattn_common_helpers.py"
    path.write_text("import triton\nimport triton.language as tl\n" + source)
    spec = importlib.util.spec_from_file_location("flexattn_common_helpers", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_helpers = _template_helpers()
above_threshold = _helpers.above_threshold
dropout_words = _helpers.dropout_words
template_keep_t = _helpers.dropout_keep_t


@triton.jit
def own_and_partner(w, e):
    """Half e of word w of the draws of queries 2p (low 16 bits) and 2p + 1 (high), each
    moved to the top: w is this thread's draw (query 2p + e), the partner's is the sum over
    e less w."""
    partner = tl.sum(w, axis=2, keep_dims=True) - w
    both = tl.where(e == 0, (w & 0xFFFF) | (partner << 16), (partner >> 16) | (w & 0xFFFF0000))
    return tl.join(both << 16, both)


@triton.jit
def exchange_keep_t(SEED, off_bh, q_start, k_start, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                    THRESHOLD: tl.constexpr):
    kb = k_start // 16 + tl.arange(0, BLOCK_K // 16)
    t = tl.arange(0, 4)
    e = tl.arange(0, 2)[None, None, :, None, None]
    qb = q_start // 16 + tl.arange(0, BLOCK_Q // 16)
    p = tl.arange(0, 4)
    c0 = kb[:, None, None, None, None] * 4 + t[None, :, None, None, None]
    c1 = qb[None, None, None, :, None] * 8 + 2 * p[None, None, None, None, :] + e
    w0, w1, w2, w3 = dropout_words(SEED, off_bh, c0, c1)  # (kb, t, e, qb, p)
    x = tl.join(tl.join(own_and_partner(w0, e), own_and_partner(w1, e)),
                tl.join(own_and_partner(w2, e), own_and_partner(w3, e)))  # (kb, t, e, qb, p, s, jj, r)
    x = tl.permute(x, (0, 6, 1, 2, 3, 7, 4, 5))  # (kb, jj, t, e, qb, r, p, s)
    return tl.reshape(above_threshold(x, THRESHOLD), (BLOCK_K, BLOCK_Q))


@triton.jit
def dkv_micro(K, Q, DO, DV, SEED, N_Q_BLOCKS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
              THRESHOLD: tl.constexpr, VARIANT: tl.constexpr):
    off_bh = tl.program_id(1)
    start_n = tl.program_id(0) * BLOCK_N
    base = off_bh.to(tl.int64) * N_Q_BLOCKS * BLOCK_M * D
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    k = tl.load(K + base + offs_n[:, None] * D + offs_d[None, :])
    dv = tl.zeros((BLOCK_N, D), tl.float32)
    for i in range(N_Q_BLOCKS):
        offs_m = i * BLOCK_M + tl.arange(0, BLOCK_M)
        q = tl.load(Q + base + offs_m[:, None] * D + offs_d[None, :])
        do = tl.load(DO + base + offs_m[:, None] * D + offs_d[None, :])
        pT = tl.math.exp2(tl.dot(k, tl.trans(q)) * 0.01)
        if VARIANT == 1:
            pT = tl.where(template_keep_t(SEED, off_bh, i * BLOCK_M, start_n, BLOCK_M, BLOCK_N, THRESHOLD), pT, 0.0)
        elif VARIANT == 2:
            pT = tl.where(exchange_keep_t(SEED, off_bh, i * BLOCK_M, start_n, BLOCK_M, BLOCK_N, THRESHOLD), pT, 0.0)
        dv = tl.dot(pT.to(tl.bfloat16), do, dv)
    tl.store(DV + base + offs_n[:, None] * D + offs_d[None, :], dv)


def main() -> None:
    BH, S = 64, 8192
    seed = torch.tensor([1234, 5], dtype=torch.int64, device="cuda")
    print("| dK/dV micro-kernel | no mask ms | template ms | exchange ms | template overhead | exchange overhead | same dV |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for D, BM, BN, W, ST in ((64, 64, 64, 4, 3), (128, 64, 64, 4, 2), (128, 64, 128, 8, 2)):
        q, k, do = (torch.randn(BH, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        dv = torch.empty(BH, S, D, device="cuda", dtype=torch.float32)
        outs, ms = [], []
        for variant in (0, 1, 2):
            def call():
                dkv_micro[(S // BN, BH)](k, q, do, dv, seed, S // BM, BM, BN, D, 6554, variant,
                                         num_warps=W, num_stages=ST)
            call()
            outs.append(dv.clone())
            ms.append(min(do_bench(call, warmup=50, rep=200) for _ in range(3)))
        print(f"| D={D} {BN}x{BM} w{W} s{ST} | {ms[0]:.3f} | {ms[1]:.3f} | {ms[2]:.3f} | {ms[1] - ms[0]:.3f} | "
              f"{ms[2] - ms[0]:.3f} | {torch.equal(outs[1], outs[2])} |")


if __name__ == "__main__":
    main()

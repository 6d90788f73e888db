"""Which way to build issue #25's CPU flash path? A measurement before the code.

A forward over query tiles x key tiles with an online softmax, written as a loop of
plain torch ops batched over (batch, heads) (each tile pair: one bmm for the scores, the
mods on the tile's index grids by broadcasting, the rescale, one bmm into the
accumulator), skipping the tiles a causal mask rules out, run

* ``tiled_eager``: as Python (no compile);
* ``tiled_compiled``: through ``torch.compile`` (Inductor's C++ backend; the loop unrolls
  into one graph of fixed shapes);
* ``tiled_step_compiled``: the loop in Python, each tile pair one call of one compiled
  step (tile offsets as 0-d tensors: one graph for every pair),

beside torch's compiled flex_attention (its C++ CPU template), flexattn's compiled call
(when this probe was written, the dense decomposition; now the C++ engine it led to) and
SDPA's CPU flash kernel, on the machine's CPU: median ms and the max difference from
SDPA. Prints a table; the readings go to bench/DECISIONS.md.

    PYTHONPATH=. python bench/experiments/cpu_tiled_forward.py --lengths 1024,4096 --tile 128,256
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import flex_attention as torch_flex

import flexattn
from flexattn import mods


def tiled_forward(q, k, v, scale: float, tile_q: int, tile_k: int, causal: bool):
    """Online-softmax forward over (tile_q x tile_k) tiles of (B*H, L, D) tensors."""
    B, H, L, D = q.shape
    S = k.shape[2]
    q2, k2, v2 = (t.reshape(B * H, t.shape[2], t.shape[3]) for t in (q, k, v))
    outs = []
    for q0 in range(0, L, tile_q):
        q1 = min(q0 + tile_q, L)
        qt = q2[:, q0:q1] * scale
        m = torch.full((B * H, q1 - q0, 1), float("-inf"))
        l = torch.zeros(B * H, q1 - q0, 1)
        acc = torch.zeros(B * H, q1 - q0, v.shape[-1])
        k_end = min(S, q1) if causal else S
        for k0 in range(0, k_end, tile_k):
            k1 = min(k0 + tile_k, S)
            s = torch.bmm(qt, k2[:, k0:k1].transpose(1, 2))
            if causal and k1 > q0:
                rows = torch.arange(q0, q1).view(-1, 1)
                cols = torch.arange(k0, k1).view(1, -1)
                s = s.masked_fill(cols > rows, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new)
            l = l * alpha + p.sum(-1, keepdim=True)
            acc = torch.baddbmm(acc * alpha, p, v2[:, k0:k1])
            m = m_new
        outs.append(acc / l)
    return torch.cat(outs, 1).view(B, H, L, -1)


def _tile_step(qt, kt, vt, m, l, acc, q0, k0):
    """One tile pair of the online softmax, causal by the tiles' first positions (0-d
    tensors, so one compiled graph serves every tile pair)."""
    s = torch.bmm(qt, kt.transpose(1, 2))
    rows = q0 + torch.arange(qt.shape[1]).view(-1, 1)
    cols = k0 + torch.arange(kt.shape[1]).view(1, -1)
    s = s.masked_fill(cols > rows, float("-inf"))
    m_new = torch.maximum(m, s.amax(-1, keepdim=True))
    alpha = torch.exp(m - m_new)
    p = torch.exp(s - m_new)
    return m_new, l * alpha + p.sum(-1, keepdim=True), torch.baddbmm(acc * alpha, p, vt)


_compiled_step = torch.compile(_tile_step, dynamic=False)


def tiled_forward_compiled_step(q, k, v, scale: float, tile: int):
    """tiled_forward (causal, lengths divisible by ``tile``) with each tile pair one call
    of a compiled step: the mask, exps and rescales fused between the two bmm's."""
    B, H, L, D = q.shape
    q2, k2, v2 = (t.reshape(B * H, t.shape[2], t.shape[3]) for t in (q, k, v))
    outs = []
    for q0 in range(0, L, tile):
        qt = q2[:, q0:q0 + tile] * scale
        m = torch.full((B * H, tile, 1), float("-inf"))
        l = torch.zeros(B * H, tile, 1)
        acc = torch.zeros(B * H, tile, v.shape[-1])
        for k0 in range(0, q0 + tile, tile):
            m, l, acc = _compiled_step(qt, k2[:, k0:k0 + tile], v2[:, k0:k0 + tile], m, l, acc,
                                       torch.tensor(q0), torch.tensor(k0))
        outs.append(acc / l)
    return torch.cat(outs, 1).view(B, H, L, -1)


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,4096")
    parser.add_argument("--tile", default="128,256", help="tile sizes (query = key tile)")
    parser.add_argument("--skip-unrolled", action="store_true", help="leave out tiled_compiled (minutes to compile)")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    B, H, D = 1, 8, 64
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; B={B} H={H} D={D} float32 causal")
    print("| S | impl | median ms | x torch flex | max diff vs SDPA |")
    print("| --- | --- | --- | --- | --- |")
    for S in (int(s) for s in args.lengths.split(",")):
        q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
        scale = D ** -0.5
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        bm_torch = torch_flex.create_block_mask(mods.causal_mask, None, None, S, S, device="cpu")
        bm_ours = flexattn.create_block_mask(mods.causal_mask, None, None, S, S, device="cpu")
        impls = {
            "sdpa_flash": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "torch_flex": torch.compile(lambda: torch_flex.flex_attention(q, k, v, block_mask=bm_torch)),
            "flexattn": torch.compile(lambda: flexattn.flex_attention(q, k, v, block_mask=bm_ours)),
        }
        for t in (int(x) for x in args.tile.split(",")):
            impls[f"tiled_eager_{t}"] = lambda t=t: tiled_forward(q, k, v, scale, t, t, True)
            if not args.skip_unrolled:
                impls[f"tiled_compiled_{t}"] = torch.compile(lambda t=t: tiled_forward(q, k, v, scale, t, t, True))
            impls[f"tiled_step_compiled_{t}"] = lambda t=t: tiled_forward_compiled_step(q, k, v, scale, t)
        results = {}
        for name, fn in impls.items():
            with torch.no_grad():
                start = time.perf_counter()
                out = fn()
                first = time.perf_counter() - start
                results[name] = (median_ms(fn, args.reps), float((out - want).abs().max()), first)
        base = results["torch_flex"][0]
        for name, (ms, diff, first) in results.items():
            print(f"| {S} | {name} | {ms:.1f} (first call {first:.1f} s) | {base / ms:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()

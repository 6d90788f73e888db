"""What does building tensor descriptors in every program cost a short-row forward?

flexattn's kernels build their Q, K and V descriptors on the device, per program
(``tile_source``: ``tl.make_tensor_descriptor``), which writes each one to global scratch
and fences it before the first bulk copy. A program of a document mask walks few KV
tiles, so that fixed cost weighs; host-built descriptors (``TensorDescriptor``, passed as
kernel parameters) cost the program nothing to build. A bare attention forward (no
score_mod, no BlockMask: a document+causal or causal row computed from the indices)
with the three ways of loading its tiles, timed by CUDA-graph replay:

* ``pointer``: per-thread pointer loads;
* ``device``: three descriptors built per program, as flexattn's kernels do;
* ``host``: three 3-D descriptors of the (B*H, S, D) tensors built once on the host;
* ``device_kv``: Q through pointer loads, then the K and V descriptors built per program
  (two instead of three, built while the Q tile is in flight);
* ``persistent``: PROGRAMS_PER_SM programs per SM, each building three 3-D descriptors of
  the (B*H, S, D) tensors once and walking tiles launch-index apart, every head's last
  query tile first (longest rows first for causal masks);
* ``branch``: Q through pointer loads, then per program: a walk of at least
  ``--branch-min-tiles`` KV tiles builds K and V descriptors (as device_kv), a shorter one
  loads through pointers (two copies of the loop in one kernel).

    PYTHONPATH=. python bench/experiments/descriptor_cost.py --lengths 2048,4096,8192
    PYTHONPATH=. python bench/experiments/descriptor_cost.py --modes pointer,device_kv,branch --branch-min-tiles 6
    TRITON_INTERPRET=1 PYTHONPATH=. python bench/experiments/descriptor_cost.py --check   # no GPU

The output is stored with pointer stores in every mode (as flexattn's Inductor epilogue).
"""

from __future__ import annotations

import argparse
import time

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

LOG2_E = 1.4426950408889634
#: Resident programs per SM in the persistent mode (two fit 128x64 tiles at D=128).
PROGRAMS_PER_SM = 2
MODES = {"pointer": 0, "device": 1, "host": 2, "persistent": 3, "device_kv": 4, "branch": 5}


@triton.jit
def load_tile(ptr, desc, off_bh, start, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, MODE: tl.constexpr):
    """Rows [start, start + BLOCK) of head off_bh: ptr is the head's base pointer (MODE 0),
    desc a per-program descriptor of the head (MODE 1) or the host's (B*H, S, D) one (MODE 2)."""
    if MODE == 0:
        offs = start + tl.arange(0, BLOCK)
        return tl.load(ptr + offs[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :])
    elif MODE == 1:
        return desc.load([start, 0])
    else:
        return desc.load([off_bh, start, 0]).reshape([BLOCK, HEAD_DIM])


@triton.jit
def forward(Q, K, V, O, q_host, k_host, v_host, S, BH, DOC_LEN, qk_scale, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MODE: tl.constexpr, BRANCH_MIN_TILES: tl.constexpr):
    """One BLOCK_M tile of one (batch, head) per program, or (MODE 3) tiles launch-index
    apart: keys from the start of the tile's document (DOC_LEN tokens each; S for plain
    causal) to its diagonal."""
    if MODE == 3:
        q_src = tl.make_tensor_descriptor(Q, [BH, S, HEAD_DIM], [S * HEAD_DIM, HEAD_DIM, 1], [1, BLOCK_M, HEAD_DIM])
        k_src = tl.make_tensor_descriptor(K, [BH, S, HEAD_DIM], [S * HEAD_DIM, HEAD_DIM, 1], [1, BLOCK_N, HEAD_DIM])
        v_src = tl.make_tensor_descriptor(V, [BH, S, HEAD_DIM], [S * HEAD_DIM, HEAD_DIM, 1], [1, BLOCK_N, HEAD_DIM])
        num_m = S // BLOCK_M
        for tile in range(tl.program_id(0), num_m * BH, tl.num_programs(0)):
            off_m = num_m - 1 - tile // BH
            off_bh = tile % BH
            forward_tile(Q, K, V, O, q_src, k_src, v_src, off_m, off_bh, S, DOC_LEN, qk_scale, BLOCK_M, BLOCK_N,
                         HEAD_DIM, 2, BRANCH_MIN_TILES)
    else:
        off_head = tl.program_id(1).to(tl.int64) * S * HEAD_DIM
        if MODE == 1:
            q_src = tl.make_tensor_descriptor(Q + off_head, [S, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_M, HEAD_DIM])
            k_src = tl.make_tensor_descriptor(K + off_head, [S, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM])
            v_src = tl.make_tensor_descriptor(V + off_head, [S, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM])
        else:
            q_src, k_src, v_src = q_host, k_host, v_host  # the host's descriptors in MODE 2, else None
        forward_tile(Q, K, V, O, q_src, k_src, v_src, tl.program_id(0), tl.program_id(1), S, DOC_LEN, qk_scale,
                     BLOCK_M, BLOCK_N, HEAD_DIM, MODE, BRANCH_MIN_TILES)


@triton.jit
def forward_tile(Q, K, V, O, q_src, k_src, v_src, off_m, off_bh, S, DOC_LEN, qk_scale, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MODE: tl.constexpr, BRANCH_MIN_TILES: tl.constexpr):
    off_head = off_bh.to(tl.int64) * S * HEAD_DIM
    q_ptr, k_ptr, v_ptr = Q + off_head, K + off_head, V + off_head
    offs_m = off_m * BLOCK_M + tl.arange(0, BLOCK_M)
    lo = (off_m * BLOCK_M // DOC_LEN) * DOC_LEN
    hi = (off_m + 1) * BLOCK_M
    if MODE >= 4:
        q = load_tile(q_ptr, q_src, off_bh, off_m * BLOCK_M, BLOCK_M, HEAD_DIM, 0)
    else:
        q = load_tile(q_ptr, q_src, off_bh, off_m * BLOCK_M, BLOCK_M, HEAD_DIM, MODE)
    # The K and V descriptors are built while the Q tile is in flight (before its first use).
    if MODE == 4 or (MODE == 5 and tl.cdiv(hi - lo, BLOCK_N) >= BRANCH_MIN_TILES):
        k_desc = tl.make_tensor_descriptor(k_ptr, [S, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM])
        v_desc = tl.make_tensor_descriptor(v_ptr, [S, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM])
        acc, l_i = kv_walk(q, qk_scale, k_ptr, v_ptr, k_desc, v_desc, off_bh, offs_m, lo, hi, BLOCK_M, BLOCK_N,
                           HEAD_DIM, 1)
    elif MODE == 5:
        acc, l_i = kv_walk(q, qk_scale, k_ptr, v_ptr, None, None, off_bh, offs_m, lo, hi, BLOCK_M, BLOCK_N,
                           HEAD_DIM, 0)
    else:
        acc, l_i = kv_walk(q, qk_scale, k_ptr, v_ptr, k_src, v_src, off_bh, offs_m, lo, hi, BLOCK_M, BLOCK_N,
                           HEAD_DIM, MODE)
    out = (acc / l_i[:, None]).to(O.dtype.element_ty)
    tl.store(O + off_head + offs_m[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :], out)


@triton.jit
def kv_walk(q, qk_scale, k_ptr, v_ptr, k_src, v_src, off_bh, offs_m, lo, hi, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, KV_MODE: tl.constexpr):
    """The online softmax over keys [lo, hi) of one query tile: (acc, l_i), unnormalised."""
    q = (q * qk_scale).to(q.dtype)
    m_i = tl.full([BLOCK_M], -3.0e38, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        k = load_tile(k_ptr, k_src, off_bh, start_n, BLOCK_N, HEAD_DIM, KV_MODE)
        qk = tl.dot(q, tl.trans(k))
        if start_n + BLOCK_N > hi - BLOCK_M:
            offs_n = start_n + tl.arange(0, BLOCK_N)
            qk = tl.where(offs_m[:, None] >= offs_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_tile(v_ptr, v_src, off_bh, start_n, BLOCK_N, HEAD_DIM, KV_MODE)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i


def reference(q, k, v, doc_len):
    S = q.shape[-2]
    i = torch.arange(S, device=q.device)
    keep = (i[:, None] >= i[None, :]) & (i[:, None] // doc_len == i[None, :] // doc_len)
    s = (q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ v.double()


def launcher(q, k, v, out, doc_len, mode, block_m, block_n, num_warps, num_stages, branch_min_tiles=6):
    B, H, S, D = q.shape
    flat = [t.view(B * H, S, D) for t in (q, k, v)]
    if mode == "host":
        descs = [TensorDescriptor.from_tensor(t, [1, blk, D]) for t, blk in zip(flat, (block_m, block_n, block_n))]
    else:
        descs = [None, None, None]

    if mode == "persistent":
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        grid = (min(PROGRAMS_PER_SM * sms, S // block_m * B * H),)
    else:
        grid = (S // block_m, B * H)

    def call():
        forward[grid](q, k, v, out, *descs, S, B * H, doc_len, D ** -0.5 * LOG2_E, BLOCK_M=block_m,
                                       BLOCK_N=block_n, HEAD_DIM=D, MODE=MODES[mode], num_warps=num_warps,
                                       num_stages=num_stages, BRANCH_MIN_TILES=branch_min_tiles)
    return call


def set_scratch_allocator(device):
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device))


def check():
    """Every mode against float64 at a small shape (the interpreter, or a GPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    set_scratch_allocator(device)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 64, device=device, dtype=dtype) for _ in range(3))
    ref = reference(q, k, v, 128)
    for mode in MODES:
        out = torch.empty_like(q)
        # 128-token documents, 64-row query tiles, 32-key tiles: walks of 2 or 4 tiles, so the
        # branch takes both ways.
        launcher(q, k, v, out, 128, mode, 64, 32, 4, 2, branch_min_tiles=3)()
        err = (out.double() - ref).abs().max().item()
        print(f"{mode}: max |out - float64| {err:.3g}")
        assert err < 2e-2, mode


def time_modes(lengths, dims, doc_len, configs, rounds, modes, branch_min_tiles):
    """Median CUDA-graph replay time of each mode, in turn; also each mode's first call
    (Triton's compile of that specialisation, cold in-process)."""
    set_scratch_allocator("cuda")
    rows = []
    for S in lengths:
        for D in dims:
            B, H = 4, 16
            q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            for mask, doc in (("document_causal", doc_len), ("causal", S)):
                ref = reference(q[:1, :2], k[:1, :2], v[:1, :2], doc)
                for (m, n, w, s) in configs:
                    calls, times, first = {}, {}, {}
                    for mode in modes:
                        out = torch.empty_like(q)
                        calls[mode] = (launcher(q, k, v, out, doc, mode, m, n, w, s, branch_min_tiles), out)
                        start = time.perf_counter()
                        calls[mode][0]()
                        torch.cuda.synchronize()
                        first[mode] = time.perf_counter() - start
                        err = (out[:1, :2].double() - ref).abs().max().item()
                        assert err < 3e-2, (mode, err)
                        times[mode] = []
                    for _ in range(rounds):
                        for mode, (call, _) in calls.items():
                            times[mode].append(triton.testing.do_bench_cudagraph(call, rep=100) * 1e3)
                    med = {mode: sorted(t)[len(t) // 2] for mode, t in times.items()}
                    rows.append((S, D, mask, f"{m}x{n}w{w}s{s}", med, first))
                    print(f"S={S} D={D} {mask} {m}x{n}w{w}s{s}: "
                          + ", ".join(f"{name} {t:.1f} us ({t / med[modes[0]]:.3f})" for name, t in med.items()),
                          flush=True)
    base = modes[0]
    print("\n| S | D | mask | tiles | " + " | ".join(f"{name} us" for name in modes) + " | "
          + " | ".join(f"{name} / {base}" for name in modes[1:]) + " | "
          + " | ".join(f"{name} first call s" for name in modes) + " |")
    print("| --- " * (4 + 3 * len(modes) - 1) + "|")
    for S, D, mask, cfg, med, first in rows:
        print(f"| {S} | {D} | {mask} | {cfg} | " + " | ".join(f"{med[name]:.1f}" for name in modes) + " | "
              + " | ".join(f"{med[name] / med[base]:.3f}" for name in modes[1:]) + " | "
              + " | ".join(f"{first[name]:.2f}" for name in modes) + " |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,4096,8192")
    parser.add_argument("--dims", default="128,64")
    parser.add_argument("--doc-len", type=int, default=512)
    parser.add_argument("--configs", default="128x64w4s2,128x64w8s3,64x128w4s2",
                        help="MxNwWsS, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated; ratios are to the first")
    parser.add_argument("--branch-min-tiles", type=int, default=6,
                        help="branch mode: the shortest walk, in KV tiles, that builds descriptors")
    parser.add_argument("--check", action="store_true", help="only check every mode against float64")
    args = parser.parse_args()
    if args.check:
        check()
        return
    configs = []
    for text in args.configs.split(","):
        mn, rest = text.split("w")
        w, s = rest.split("s")
        m, n = mn.split("x")
        configs.append((int(m), int(n), int(w), int(s)))
    time_modes([int(x) for x in args.lengths.split(",")], [int(x) for x in args.dims.split(",")], args.doc_len,
               configs, args.rounds, args.modes.split(","), args.branch_min_tiles)


if __name__ == "__main__":
    main()

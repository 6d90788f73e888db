"""How much of a context-parallel step is the rank's own kernels, and are those kernels as
efficient per block as one GPU's over the whole sequence? On one GPU, for each rank of a
W-rank plan, the gathered call that rank makes (its query shard against the KV blocks its
queries list, the local BlockMask and mods in global positions, as
``context_parallel_attention`` builds them) is timed forward+backward on random inputs, beside
the whole sequence's call. No process group: the transfers are left out on purpose.

    PYTHONPATH=. python bench/experiments/cp_rank_kernels.py --lengths 65536,262144 --masks document,causal

Prints per rank: listed blocks, ms, us per block; and the whole call's ms / W (the ideal).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from triton.testing import do_bench

import flexattn
from bench.bench_context_parallel import BLOCK, D, H, mask_mod
from flexattn.distributed import plan_context_parallel
from flexattn.distributed.local import LocalMasks


def fwd_bwd_ms(bm, q, k, v, grad, score_mod=None) -> float:
    def step():
        out = flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
        torch.autograd.grad(out, (q, k, v), grad)

    step()
    torch.cuda.synchronize()
    return statistics.median(do_bench(step, warmup=25, rep=200) for _ in range(3))


def inputs(q_len: int, kv_len: int):
    make = lambda n: torch.randn(1, H, n, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # noqa: E731
    return make(q_len), make(kv_len), make(kv_len), torch.randn(1, H, q_len, D, device="cuda", dtype=torch.bfloat16)


def listed_blocks(bm) -> int:
    total = bm.kv_num_blocks.sum()
    if bm.full_kv_num_blocks is not None:
        total = total + bm.full_kv_num_blocks.sum()
    return int(total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="65536")
    parser.add_argument("--masks", default="document,causal")
    parser.add_argument("--world", type=int, default=4)
    args = parser.parse_args()
    print("| mask | S | call | listed blocks | ms | us per block |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in args.masks.split(","):
        for S in map(int, args.lengths.split(",")):
            bm = flexattn.create_block_mask(mask_mod(name, S, "cuda"), None, None, S, S, device="cuda",
                                            BLOCK_SIZE=BLOCK)
            whole = fwd_bwd_ms(bm, *inputs(S, S))
            blocks = listed_blocks(bm)
            print(f"| {name} | {S} | whole / {args.world} | {blocks / args.world:.0f} | {whole / args.world:.3f} | "
                  f"{1e3 * whole / blocks:.3f} |", flush=True)
            plan = plan_context_parallel(bm, args.world)
            masks = LocalMasks(bm, plan, None, torch.device("cuda"))
            for rank in range(args.world):
                call = masks.gathered_call(rank)
                kv_len = call.block_mask.seq_lengths[1]
                ms = fwd_bwd_ms(call.block_mask, *inputs(plan.local_len, kv_len), score_mod=call.score_mod)
                mine = listed_blocks(call.block_mask)
                print(f"| {name} | {S} | rank {rank} ({kv_len} keys) | {mine} | {ms:.3f} | {1e3 * ms / mine:.3f} |",
                      flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

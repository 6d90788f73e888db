"""Which forward tile should a paged prefill take? Its mask_mod reads the cache's page
tables, so the lowering treats it as a mask that reads memory (at D=64 on sm90: one loop
over 64x64 tiles, `forward-memory-mask-tiles`), though its rows are as long as a causal
mask's. Causal prefill of B sequences of S tokens each into a pool of shuffled pages:
flexattn on the pool with each ``--variants`` entry (kernel_options), beside flexattn and
torch's flex on a contiguous cache (the same attention without pages), timed in rounds in
turn through CUDA-graph replay. Every variant's output is checked against the contiguous
one first.

    PYTHONPATH=. python bench/experiments/paged_prefill_tiles.py --lengths 2048,4096 --dims 64,128
    PYTHONPATH=. python bench/experiments/paged_prefill_tiles.py --device cpu   # tiny, checks only
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.nn.attention import flex_attention as tflex

import flexattn
from flexattn import mods

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _in_turn import medians_in_turn  # noqa: E402

VARIANTS = {
    "default": {},
    "two64x128": {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 128, "fwd_ONE_KV_LOOP": False},
}


def prefill_case(B: int, H: int, S: int, D: int, page: int, device: torch.device, dtype: torch.dtype):
    """(q, contiguous k, v, pool k, v, paged BlockMask, paged mask_mod's BlockMask inputs)."""
    pages_per_seq = -(-S // page)
    cache = flexattn.PagedKVCache(n_pages=B * pages_per_seq + 2, page_size=page, max_slots=B, device=device,
                                  num_kv_heads=H, max_pages_per_slot=pages_per_seq)
    cache.shuffle_free_pages(torch.Generator().manual_seed(0))
    slots = torch.arange(B, device=device)
    for slot in range(B):
        cache.reserve(slot, S)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device=device, dtype=dtype, generator=gen) for _ in range(3))
    k_pool, v_pool = cache.allocate(H, D, dtype)
    positions = torch.arange(S, device=device).expand(B, S)
    cache.append(slots, positions, k, v, k_pool, v_pool)
    logical = flexattn.create_block_mask(mods.causal_mask, B, None, S, S, device=device, BLOCK_SIZE=(128, page))
    paged = cache.block_mask_on_pages(logical, slots)
    return q, k, v, k_pool, v_pool, paged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,4096")
    parser.add_argument("--dims", default="64,128")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--page-size", type=int, default=128)
    parser.add_argument("--variants", default=None, help="JSON {name: kernel_options}; default: " + json.dumps(VARIANTS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    variants = json.loads(args.variants) if args.variants else VARIANTS
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    lengths = [int(s) for s in args.lengths.split(",")] if on_gpu else [256]
    dims = [int(d) for d in args.dims.split(",")] if on_gpu else [64]
    B, H = (args.batch, args.heads) if on_gpu else (2, 2)
    torch._dynamo.config.cache_size_limit = 256
    names = [f"paged {n}" for n in variants] + ["contiguous", "torch contiguous"]
    print(f"{torch.cuda.get_device_name() if on_gpu else 'cpu'}, torch {torch.__version__}, B={B} H={H} {dtype}, "
          f"causal prefill, page {args.page_size}; variants {json.dumps(variants)}", flush=True)
    print("| S | D | " + " | ".join(f"{n} us" for n in names) + " | "
          + " | ".join(f"{n} / {names[0]}" for n in names[1:]) + " |")
    print("| --- " * (2 + 2 * len(names) - 1) + "|")
    for S in lengths:
        for D in dims:
            torch.compiler.reset()
            q, k, v, k_pool, v_pool, paged = prefill_case(B, H, S, D, args.page_size, device, dtype)
            contiguous = flexattn.create_block_mask(mods.causal_mask, None, None, S, S, device=device)
            fns = {f"paged {name}": torch.compile(lambda q, o=opts: flexattn.flex_attention(
                q, k_pool, v_pool, block_mask=paged, kernel_options=o)) for name, opts in variants.items()}
            fns["contiguous"] = torch.compile(lambda q: flexattn.flex_attention(q, k, v, block_mask=contiguous))
            expected = fns["contiguous"](q)
            for name in fns:
                error = (fns[name](q).float() - expected.float()).abs().max().item()
                if not error <= (2e-2 if on_gpu else 1e-4):
                    raise SystemExit(f"{name} S={S} D={D}: max abs error {error:.3e} against the contiguous call")
            if not on_gpu:
                print(f"| {S} | {D} | checked {len(fns)} calls against the contiguous one (CPU: no timing) |")
                continue
            from triton.testing import do_bench_cudagraph

            torch_mask = tflex.create_block_mask(mods.causal_mask, None, None, S, S, device=device)
            fns["torch contiguous"] = torch.compile(lambda q: tflex.flex_attention(q, k, v, block_mask=torch_mask))
            med = {name: ms * 1e3 for name, ms in medians_in_turn(
                fns, q, rounds=args.rounds, timer=lambda call: do_bench_cudagraph(call, rep=100)).items()}
            base = med[names[0]]
            print(f"| {S} | {D} | " + " | ".join(f"{med[n]:.1f}" for n in names) + " | "
                  + " | ".join(f"{med[n] / base:.3f}" for n in names[1:]) + " |", flush=True)


if __name__ == "__main__":
    main()

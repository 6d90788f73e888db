"""The demo (``python -m flexattn.demo``): several attention variants, each checked and timed.

For every variant of ``flexattn.mods`` it runs ``flexattn.flex_attention`` under
``torch.compile``, compares the result with the float64 dense reference, times it
beside torch's own ``flex_attention`` (compiled the same way), and prints a table. On a
GPU the shapes are a training-sized batch in bfloat16; on a CPU they are small and in
float32, and both libraries run their CPU paths.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

import flexattn
from flexattn import mods
from flexattn.cpu import uses_engine


def _time_ms(fn, device: str, reps: int) -> float:
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _variants(B: int, H: int, S: int, device: str):
    """name -> (score_mod, mask_mod)."""
    doc_ids = torch.arange(S, device=device) // max(1, S // 8)
    return {
        "full attention": (None, None),
        "causal": (None, mods.causal_mask),
        "sliding window 256": (None, mods.sliding_window(256)),
        "causal + ALiBi": (mods.alibi(H, device=device), mods.causal_mask),
        "causal + tanh soft-cap 30": (mods.tanh_softcap(30.0), mods.causal_mask),
        "document (8 docs) + causal": (None, flexattn.and_masks(mods.document_mask(doc_ids), mods.causal_mask)),
        "prefix-LM (S/4)": (None, mods.prefix_lm(S // 4)),
    }


def _reference(q, k, v, score_mod, block_mask):
    """float64 dense reference (the operator's definition), on the inputs' device."""
    from ._hop import identity_score_mod
    from .reference import dense_math

    q64, k64, v64 = (t.detach().to(torch.float64) for t in (q, k, v))
    if block_mask is None:
        from .api import full_block_mask

        block_mask = full_block_mask(q64, k64)
    out, _, _ = dense_math(q64, k64, v64, score_mod or identity_score_mod, block_mask.as_tuple(),
                           1.0 / math.sqrt(q.shape[-1]), (), ())
    return out


def _path_measured(device: str) -> str:
    """Which implementation the demo's flexattn calls run on this device."""
    if device == "cuda":
        return "flexattn's fused Triton kernels on the GPU"
    if not uses_engine(torch.device(device)):
        return "flexattn's Triton kernels in Triton's CPU interpreter (slow; for testing)"
    return ("flexattn's C++ CPU flash kernels (block-sparse tiles, the mods compiled in; the first call "
            "builds the engine once per machine, about 20 s)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    device = args.device
    on_gpu = device == "cuda"
    B, H, D = (4, 16, 128) if on_gpu else (1, 8, 64)
    S = args.seq_len or (4096 if on_gpu else 2048)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    ref_S = min(S, 1024)  # the dense float64 reference is checked on a prefix of the sequence
    print(f"flexattn {flexattn.__version__} demo on {torch.cuda.get_device_name() if on_gpu else 'cpu'}: "
          f"B={B} H={H} S={S} D={D} {dtype}; torch {torch.__version__}")
    print(f"measuring: {_path_measured(device)}", flush=True)

    from torch.nn.attention import flex_attention as torch_flex

    rows = []
    variants = _variants(B, H, S, device)
    for i, (name, (score_mod, mask_mod)) in enumerate(variants.items(), 1):
        print(f"[{i}/{len(variants)}] {name}: compiling both, checking against float64, timing", flush=True)
        # Each variant starts from fresh Dynamo caches, as a separate model would: after
        # recompiles Dynamo turns closed-over floats into inputs, which torch's own flex
        # does not lower on the CPU.
        torch.compiler.reset()
        ours = torch.compile(flexattn.flex_attention, fullgraph=True)
        theirs = torch.compile(torch_flex.flex_attention, fullgraph=True)
        q, k, v = (torch.randn(B, H, S, D, device=device, dtype=dtype) for _ in range(3))
        bm = flexattn.create_block_mask(mask_mod, None, None, S, S, device=device) if mask_mod else None
        tbm = torch_flex.create_block_mask(mask_mod, None, None, S, S, device=device) if mask_mod else None

        # Timed first: both libraries compile for these shapes alone. The check's smaller
        # call then makes Dynamo recompile with symbolic sizes, which is not timed.
        t_ours = _time_ms(lambda: ours(q, k, v, score_mod, bm), device, reps=5)
        t_theirs = _time_ms(lambda: theirs(q, k, v, score_mod, tbm), device, reps=5)

        small = [t[:1, :, :ref_S] for t in (q, k, v)]
        small_bm = flexattn.create_block_mask(mask_mod, None, None, ref_S, ref_S, device=device) if mask_mod else None
        got = ours(*small, score_mod, small_bm)
        want = _reference(*small, score_mod, small_bm)
        err = float((got.double() - want).abs().max())
        density = 1.0 if bm is None else 1.0 - bm.sparsity() / 100.0
        flops = 4 * B * H * S * S * D * density
        rows.append((name, err, t_ours, t_theirs, flops / t_ours / 1e9))

    print()
    print("| variant | max abs err vs float64 | flexattn ms | torch flex ms | flexattn/torch speed | flexattn TFLOP/s |")
    print("|---|---|---|---|---|---|")
    for name, err, t_ours, t_theirs, tflops in rows:
        print(f"| {name} | {err:.2e} | {t_ours:.3f} | {t_theirs:.3f} | {t_theirs / t_ours:.2f}x | {tflops:.3g} |")
    worst = max(r[1] for r in rows)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    status = "OK" if worst <= tolerance and not math.isnan(worst) else "FAILED"
    print(f"\n{status}: worst error {worst:.2e} (tolerance {tolerance:.0e})")
    if status != "OK":
        raise SystemExit(1)


if __name__ == "__main__":
    main()

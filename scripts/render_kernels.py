"""Render flexattn's kernels for a fixed set of calls and compare two renderings.

A refactor of the lowering must leave the generated Triton unchanged. This script
compiles ~20 calls (forward, backward, decode, paged, splits, TMA on and off, captured
tensors with and without gradients) with caches off and writes the source of every
Triton kernel Inductor generated for each call to ``OUT/<case>.py``:

    python3 scripts/render_kernels.py render OUT [--device cuda] [-k SUBSTRING]
    python3 scripts/render_kernels.py compare BEFORE AFTER

On a CPU the kernels are generated for Triton's interpreter (``cpu_backend="triton"``),
so the GPU-only choices (sm90 tables, hardware tanh) are rendered only with ``--device
cuda``. ``compare`` prints a unified diff per differing case and exits 1 when any differs.
"""

from __future__ import annotations

import argparse
import difflib
import os
import pathlib
import re
import sys
import traceback


def _cases(device: str):
    import torch

    import flexattn
    from flexattn import mods

    def rand(*shape, dtype=torch.float16, grad=False, seed=0):
        g = torch.Generator().manual_seed(seed)
        t = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
        return t.requires_grad_(grad)

    def qkv(B=2, Hq=4, Hkv=4, L=128, S=128, E=64, Ev=None, dtype=torch.float16, grad=False):
        return (rand(B, Hq, L, E, dtype=dtype, grad=grad, seed=1), rand(B, Hkv, S, E, dtype=dtype, grad=grad, seed=2),
                rand(B, Hkv, S, Ev or E, dtype=dtype, grad=grad, seed=3))

    def mask(mask_mod, B, H, L, S, **kw):
        return flexattn.create_block_mask(mask_mod, B, H, L, S, device=device, **kw)

    def fwd(q, k, v, **kw):
        def run():
            return flexattn.flex_attention(q, k, v, **kw)
        return run

    def fwd_bwd(q, k, v, *, lse_grad=False, **kw):
        def run():
            if lse_grad:
                out, lse = flexattn.flex_attention(q, k, v, return_lse=True, **kw)
                (out.sum() + lse.sum()).backward()
            else:
                flexattn.flex_attention(q, k, v, **kw).sum().backward()
        return run

    slopes = mods.alibi_slopes(4, device=device)
    table = rand(255, dtype=torch.float32, seed=7)
    learned_slopes = rand(4, dtype=torch.float32, grad=True, seed=8)
    learned_table = rand(255, dtype=torch.float32, grad=True, seed=9)
    doc_ids = torch.arange(256, device=device) // 40
    cases = {
        "fwd_default_mask_fp16": fwd(*qkv()),
        "fwd_causal_fp32": fwd(*qkv(dtype=torch.float32), block_mask=mask(mods.causal_mask, None, None, 128, 128)),
        "fwd_alibi_fp16": fwd(*qkv(), score_mod=mods.alibi_bias(slopes),
                              block_mask=mask(mods.causal_mask, None, None, 128, 128)),
        "fwd_gqa_document_fp16": fwd(*qkv(Hq=8, Hkv=2, L=256, S=256), enable_gqa=True,
                                     block_mask=mask(mods.document_mask(doc_ids), None, None, 256, 256)),
        "fwd_odd_lengths_vdim_fp16": fwd(*qkv(L=100, S=300, E=80, Ev=48),
                                         block_mask=mask(mods.sliding_window(64), 2, 4, 100, 300)),
        "fwd_lse_max_fp32": lambda: flexattn.flex_attention(
            *qkv(dtype=torch.float32), return_aux=flexattn.AuxRequest(lse=True, max_scores=True)),
        "fwd_pinned_tiles_fp16": fwd(*qkv(), kernel_options={"BLOCK_M": 32, "BLOCK_N": 32, "num_stages": 1}),
        "fwd_rel_bias_table_fp16": fwd(*qkv(), score_mod=mods.relative_bias(table)),
        "fwd_tma_on_fp16": fwd(*qkv(), kernel_options={"USE_TMA": True},
                               block_mask=mask(mods.causal_mask, None, None, 128, 128)),
        "bwd_causal_fp32": fwd_bwd(*qkv(dtype=torch.float32, grad=True),
                                   block_mask=mask(mods.causal_mask, None, None, 128, 128)),
        "bwd_learned_rel_bias_fp16": fwd_bwd(*qkv(grad=True), score_mod=mods.relative_bias(learned_table)),
        "bwd_learned_alibi_fp16": fwd_bwd(*qkv(grad=True), score_mod=mods.alibi_bias(learned_slopes),
                                          block_mask=mask(mods.causal_mask, None, None, 128, 128)),
        "bwd_gqa_full_blocks_fp16": fwd_bwd(*qkv(Hq=8, Hkv=2, L=256, S=256, grad=True), enable_gqa=True,
                                            block_mask=mask(mods.sliding_window(96), None, None, 256, 256)),
        "bwd_lse_grad_odd_fp32": fwd_bwd(*qkv(L=100, S=150, dtype=torch.float32, grad=True), lse_grad=True,
                                         block_mask=mask(mods.causal_mask, None, None, 100, 150)),
        "bwd_tma_on_fp16": fwd_bwd(*qkv(grad=True), kernel_options={"USE_TMA": True}),
        "decode_default_gqa_fp16": fwd(*qkv(Hq=8, Hkv=2, L=1, S=1024), enable_gqa=True),
        "decode_window_fp16": fwd(*qkv(Hq=8, Hkv=2, L=1, S=1024), enable_gqa=True,
                                  block_mask=mask(mods.sliding_window(256, causal=False), None, None, 1, 1024)),
        "decode_split4_fused_fp16": fwd(*qkv(Hq=8, Hkv=2, L=1, S=1024), enable_gqa=True,
                                        kernel_options={"SPLIT_KV": 4, "FUSED_MERGE": True}),
        "decode_split4_merge_pass_fp32": fwd(*qkv(Hq=8, Hkv=2, L=4, S=1024, dtype=torch.float32), enable_gqa=True,
                                             kernel_options={"SPLIT_KV": 4, "FUSED_MERGE": False}),
        "decode_alibi_lse_fp16": lambda: flexattn.flex_attention(
            *qkv(Hq=4, Hkv=4, L=2, S=512), score_mod=mods.alibi_bias(slopes), return_lse=True),
        "decode_paged_fp16": _paged_case(device, rand),
    }
    if device == "cuda":
        cases["fwd_softcap_bf16"] = fwd(*qkv(dtype=torch.bfloat16), score_mod=mods.tanh_softcap(30.0),
                                        block_mask=mask(mods.causal_mask, None, None, 128, 128))
        cases["bwd_softcap_bf16"] = fwd_bwd(*qkv(dtype=torch.bfloat16, grad=True), score_mod=mods.tanh_softcap(30.0))
        cases["fwd_tma_off_d128_bf16"] = fwd(*qkv(E=128, dtype=torch.bfloat16), kernel_options={"USE_TMA": False})
        cases["fwd_d256_bf16"] = fwd(*qkv(E=256, dtype=torch.bfloat16),
                                     block_mask=mask(mods.causal_mask, None, None, 128, 128))
        cases["bwd_d128_bf16"] = fwd_bwd(*qkv(E=128, dtype=torch.bfloat16, grad=True),
                                         block_mask=mask(mods.causal_mask, None, None, 128, 128))
        cases["decode_long_b32_bf16"] = fwd(*qkv(B=32, Hq=32, Hkv=8, L=1, S=32768, E=128, dtype=torch.bfloat16),
                                            enable_gqa=True)
    return cases


def _paged_case(device: str, rand):
    import torch

    import flexattn
    from flexattn import mods

    page, Hkv, E, lengths = 16, 2, 64, [40, 100]
    n_pages = sum(-(-n // page) for n in lengths) + 2
    cache = flexattn.PagedKVCache(n_pages=n_pages, page_size=page, max_slots=2, device=device)
    k_cache, v_cache = cache.allocate(Hkv, E, torch.float16)
    slots = torch.tensor([1, 0], device=device)
    for slot, n in zip(slots.tolist(), lengths):
        cache.reserve(slot, n)
    positions = torch.arange(max(lengths), device=device)
    for i, (slot, n) in enumerate(zip(slots.tolist(), lengths)):
        k = rand(1, Hkv, n, E, seed=20 + i)
        cache.append(torch.tensor([slot], device=device), positions[:n][None], k, k, k_cache, v_cache)
    q = rand(2, 4 * Hkv, 1, E, seed=30)
    logical = flexattn.create_block_mask(mods.causal_mask, 2, None, 1, max(lengths), device=device,
                                         BLOCK_SIZE=(16, page))
    paged_mask = cache.block_mask_on_pages(logical, slots)

    def run():
        return flexattn.flex_attention(q, k_cache, v_cache, block_mask=paged_mask, enable_gqa=True)
    return run


_SOURCE = re.compile(r"'''\n(.*?)''', device_str=", re.S)


def render(out_dir: pathlib.Path, device: str, only: str | None) -> int:
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    from torch._inductor.utils import run_and_get_code

    from flexattn import _compat

    if device == "cpu":
        _compat.enable_triton_interpreter()
        _compat.use_interpreter_libdevice()
    out_dir.mkdir(parents=True, exist_ok=True)
    failures = 0
    patches = {"force_disable_caches": True}
    if device == "cpu":
        patches["cpu_backend"] = "triton"
    for name, run in _cases(device).items():
        if only and only not in name:
            continue
        torch._dynamo.reset()
        try:
            with torch._inductor.config.patch(**patches):
                _, codes = run_and_get_code(torch.compile(run, dynamic=False))
        except Exception:
            failures += 1
            (out_dir / f"{name}.error").write_text(traceback.format_exc())
            print(f"{name}: FAILED", flush=True)
            continue
        kernels = [src for code in codes for src in _SOURCE.findall(code)]
        (out_dir / f"{name}.py").write_text("\n# ---- next kernel ----\n".join(kernels))
        print(f"{name}: {len(kernels)} kernel(s)", flush=True)
    return failures


def compare(before: pathlib.Path, after: pathlib.Path) -> int:
    names = sorted({p.name for p in before.iterdir()} | {p.name for p in after.iterdir()})
    differing = 0
    for name in names:
        a, b = before / name, after / name
        if not a.exists() or not b.exists():
            print(f"{name}: only in {'after' if not a.exists() else 'before'}")
            differing += 1
            continue
        if a.read_text() != b.read_text():
            differing += 1
            sys.stdout.writelines(difflib.unified_diff(a.read_text().splitlines(True), b.read_text().splitlines(True),
                                                       f"before/{name}", f"after/{name}", n=2))
    print(f"{len(names) - differing} of {len(names)} renderings identical")
    return 1 if differing else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("render")
    r.add_argument("out", type=pathlib.Path)
    r.add_argument("--device", default="cpu")
    r.add_argument("-k", dest="only")
    c = sub.add_parser("compare")
    c.add_argument("before", type=pathlib.Path)
    c.add_argument("after", type=pathlib.Path)
    args = parser.parse_args()
    if args.cmd == "render":
        return 1 if render(args.out, args.device, args.only) else 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())

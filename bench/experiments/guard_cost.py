"""What Dynamo's guards cost per compiled flex_attention call, flexattn beside torch's flex.

Each call of a compiled function first runs its guards (``guard_manager.check`` on the
frame's locals) before the compiled graph. This compiles both libraries' flex_attention
on one document+causal call, then times their guard check alone and counts guard nodes
by kind, the ones only flexattn has listed (``--list``).

    PYTHONPATH=. python bench/experiments/guard_cost.py [--device cuda] [--list]
"""
from __future__ import annotations

import argparse
import collections
import inspect
import re
import time

import torch
from torch.nn.attention import flex_attention as torch_flex

import flexattn
from flexattn import mods


def compiled_call(library, device: str, S: int = 512):
    doc = torch.arange(S, device=device) * 8 // S
    mask = flexattn.and_masks(mods.document_mask(doc), mods.causal_mask)
    block_mask = library.create_block_mask(mask, None, None, S, S, device=device)
    q, k, v = (torch.randn(2, 4, S, 64, device=device) for _ in range(3))
    kwargs = dict(block_mask=block_mask)
    fn = library.flex_attention
    torch.compile(fn, fullgraph=True, dynamic=False)(q, k, v, **kwargs)
    bound = inspect.signature(fn).bind(q, k, v, **kwargs)
    bound.apply_defaults()
    return fn, dict(bound.arguments)


def guard_manager(fn):
    entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(fn.__code__)
    assert len(entries) == 1, f"{len(entries)} cache entries"
    return entries[0].guard_manager


def check_us(manager, f_locals, n: int) -> float:
    assert manager.check(f_locals)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            manager.check(f_locals)
        best = min(best, (time.perf_counter() - start) / n * 1e6)
    return best


def guard_lines(manager) -> list[str]:
    return [line.strip() for line in str(manager).splitlines() if re.search(r"[A-Z_]{4,}:", line)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--checks", type=int, default=20000)
    parser.add_argument("--list", action="store_true", help="print the guards only flexattn has")
    args = parser.parse_args()
    rows, kinds = {}, {}
    for name, library in (("flexattn", flexattn), ("torch_flex", torch_flex)):
        fn, f_locals = compiled_call(library, args.device)
        manager = guard_manager(fn)
        lines = guard_lines(manager)
        kinds[name] = collections.Counter(line.split(":")[0].split()[-1] for line in lines)
        rows[name] = (check_us(manager, f_locals, args.checks), len(lines), lines)
    print(f"device {args.device}, torch {torch.__version__}")
    for name, (us, count, _) in rows.items():
        print(f"{name}: guard check {us:.2f} us, {count} guards: {dict(kinds[name].most_common())}")
    if args.list:
        ours = set(re.sub(r"\d{6,}", "N", g.split("#")[0]) for g in rows["flexattn"][2])
        theirs = set(re.sub(r"\d{6,}", "N", g.split("#")[0]) for g in rows["torch_flex"][2])
        for line in sorted(ours - theirs):
            print("  only flexattn:", line[:160])


if __name__ == "__main__":
    main()

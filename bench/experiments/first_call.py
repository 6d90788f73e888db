"""Where does the first call of a new score_mod go (issue #26: compile no slower than
torch's flex)? For each library, after one tiny throwaway compile (imports, worker pools),
a fresh ALiBi-like score_mod's first forward, then a fresh one's first forward+backward,
each timed whole, with the kernels it compiled (new entries of Triton's on-disk cache);
the first round's calls under cProfile (cumulative and own time; the compile workers'
time shows as waits unless TORCHINDUCTOR_COMPILE_THREADS=1). Later rounds find
Inductor's and Triton's caches warm: give fresh cache folders (TORCHINDUCTOR_CACHE_DIR,
TRITON_CACHE_DIR) to compare cold compiles.

    TORCHINDUCTOR_CACHE_DIR=/tmp/ic TRITON_CACHE_DIR=/tmp/tc PYTHONPATH=. \
        python bench/experiments/first_call.py --rounds 1 --out $OUT/first_call.log
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time
from pathlib import Path

import torch
from torch.nn.attention import flex_attention as tflex

import flexattn
from flexattn import mods

LIBS = {"flexattn": flexattn, "torch": tflex}


def fresh_score_mod(H: int, salt: float, mode: str):
    """A new closure (and a new captured tensor) each time, so no compiled graph is
    reused. The two modes' bodies differ in code, not only in what they capture: the
    same body compiles to the same kernel source, which Triton's cache would serve to a
    library whose inference and training forwards are one kernel (torch's, while grad
    mode is on) and not to one that leaves the lse out of inference (flexattn's)."""
    slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, device="cuda") / H) + salt

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def alibi_negated(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    return alibi if mode == "fwd" else alibi_negated


def compiled_kernels() -> set[tuple[str, str]]:
    """(kernel name, cache entry) of every kernel in Triton's on-disk cache."""
    root = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    found = set()
    for meta in root.glob("*/*.json"):
        if meta.name.startswith("__grp__"):
            continue
        try:
            found.add((json.loads(meta.read_text()).get("name", meta.stem), meta.parent.name))
        except (OSError, ValueError):
            continue
    return found


def first_call(lib, mode: str, S: int, D: int, salt: float, profile: bool):
    B, H = 4, 16
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=mode == "fwdbwd")
               for _ in range(3))
    block_mask = lib.create_block_mask(mods.causal_mask, None, None, S, S, device="cuda")
    score_mod = fresh_score_mod(H, salt, mode)
    torch._dynamo.reset()
    compiled = torch.compile(lib.flex_attention)
    torch.cuda.synchronize()
    prof = cProfile.Profile() if profile else None
    start = time.perf_counter()
    if prof:
        prof.enable()
    out = compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)
    if mode == "fwdbwd":
        out.sum().backward()
    torch.cuda.synchronize()
    if prof:
        prof.disable()
    return time.perf_counter() - start, prof


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--dims", default="64,128")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--out", default=None, help="file for the profiles (default: stdout)")
    args = parser.parse_args()
    torch._dynamo.config.cache_size_limit = 256
    log = open(args.out, "w") if args.out else None
    for name, lib in LIBS.items():
        first_call(lib, "fwdbwd", 256, 32, 0.0, profile=False)  # D=32: no kernel the rows reuse
    rows = []
    salt = 0.0
    for round_ in range(args.rounds):
        for D in (int(d) for d in args.dims.split(",")):
            for mode in ("fwd", "fwdbwd"):
                for name, lib in LIBS.items():
                    salt += 1e-3
                    profile = round_ == 0 and log is not None
                    before = compiled_kernels()
                    seconds, prof = first_call(lib, mode, args.seq, D, salt, profile)
                    new = sorted(kernel for kernel, _ in compiled_kernels() - before)
                    rows.append((round_, D, mode, name, seconds))
                    print(f"round {round_} D={D} {mode} {name}: first call {seconds:.2f} s; "
                          f"{len(new)} kernels compiled: {', '.join(new)}", flush=True)
                    if prof:
                        text = io.StringIO()
                        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(args.top)
                        log.write(f"===== D={D} {mode} {name}: {seconds:.2f} s\n{text.getvalue()}\n")
                        text = io.StringIO()
                        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
                        log.write(f"----- by own time\n{text.getvalue()}\n")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; S={args.seq} B=4 H=16 bf16 causal + "
          "a fresh score_mod per call; first call (compile + run) in seconds")
    print("| D | mode | round | flexattn s | torch s | flexattn / torch |")
    print("| --- | --- | --- | --- | --- | --- |")
    by = {(r, D, m, n): s for r, D, m, n, s in rows}
    for r, D, m, n, s in rows:
        if n == "flexattn":
            t = by[(r, D, m, "torch")]
            print(f"| {D} | {m} | {r} | {s:.2f} | {t:.2f} | {s / t:.2f} |")


if __name__ == "__main__":
    main()

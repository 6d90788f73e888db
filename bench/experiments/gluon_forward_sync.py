"""Does the Gluon forward lose time to the warpgroup barriers Triton puts around its mbarrier arrivals?

    PYTHONPATH=. python bench/experiments/gluon_forward_sync.py --variants base,file:PATH,opt:KEY=VALUE,cfg:FIELD=VALUE
    PYTHONPATH=. python bench/experiments/gluon_forward_sync.py --offline OUT_DIR   # CPU: render only

Triton 3.6's shared-memory barrier analysis puts a `bar.sync` of the warpgroup before each
`mbarrier.arrive` of a consumer warpgroup and between two waits on one mbarrier array: four
per KV tile in `templates/gluon_forward.py.jinja`. Variants of the template's text, each
compiled through flexattn (the lowering takes the patched template), timed in turn in one
process on the issue #48 shapes:

- base: the template as it is;
- expect: each consumer arrival written as `mbarrier.expect(bar, 0)` (an arrival that
  expects no bytes), which the analysis lets pass without a barrier;
- noturn: as expect, without the turns between the two consumer warpgroups;
- named: as expect, the turns through hardware named barriers (`bar.sync` / `bar.arrive` of
  both warpgroups' 256 threads, as FlashAttention-3 does), which no warp can overtake;
- file:PATH: another kernel source (e.g. a branch's ``gluon_kernel_source("gluon_forward")``);
- opt:KEY=VALUE: the template as it is, the call with kernel_options KEY=VALUE (JSON);
- cfg:FIELD=VALUE: the template as it is, every head dim's default configs with FIELD set;
- nodense: the template as it is, calls with neither a block mask nor a score_mod on the
  configs of other calls (two consumer warpgroups at D=64 instead of three).

expect, noturn and named rewrite the text of the one-tile-per-program template they were
written for (63816cf's: ``--variants file:...`` of its source, then theirs); on another
text their rewrites do not apply and they stop with an AssertionError.

Prints one JSON line per case: TFLOP/s per variant (median of rounds in turn) and each
variant's largest difference from base's output.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
import sys

#: Turn handshakes through named barriers 14 and 15 (Triton's partitions use the low ids).
_NAMED_TURN = """

@gluon.jit
def turn_{name}(WARPGROUP: gl.constexpr):
    \"\"\"{doc}\"\"\"
    lanes = gl.full([128], 0, gl.int32, layout=gl.BlockedLayout([1], [32], [4], [0]))
    if WARPGROUP == 0:
        gl.inline_asm_elementwise("bar.{op} 14, 256; mov.u32 $0, $1;", "=r,r", [lanes], dtype=gl.int32,
                                  is_pure=False, pack=1)
    else:
        gl.inline_asm_elementwise("bar.{op} 15, 256; mov.u32 $0, $1;", "=r,r", [lanes], dtype=gl.int32,
                                  is_pure=False, pack=1)
"""
NAMED_HELPERS = (_NAMED_TURN.format(name="sync", op="sync", doc="Wait until the other warpgroup hands this one its "
                                                                "turn (all 256 threads meet).")
                 + "\n" + _NAMED_TURN.format(name="give", op="arrive", doc="Hand warpgroup WARPGROUP its turn."))


def _expect_arrivals(text: str) -> str:
    return re.sub(r"mbarrier\.arrive\(((?:turn|k_empty|v_empty)\.index\([^)]*\))\)", r"mbarrier.expect(\1, 0)", text)


def variant_source(name: str, text: str) -> str:
    """The template's text for variant ``name`` (``file:PATH``: the kernel source saved in PATH,
    e.g. another revision's ``gluon_kernel_source("gluon_forward")``; ``opt:KEY=VALUE``: the
    template as it is, the call with kernel_options KEY=VALUE; ``cfg:FIELD=VALUE``: the
    template as it is, every head dim's default config with FIELD (a GluonForwardConfig
    field, e.g. num_stages) set to VALUE)."""
    if name in ("base", "nodense") or name.startswith(("opt:", "cfg:")):
        return text
    if name.startswith("file:"):
        with open(name[len("file:"):]) as f:
            return f.read()
    out = _expect_arrivals(text)
    if name == "expect":
        return out
    if name == "noturn":
        out = "\n".join(line for line in out.split("\n") if not re.search(r"mbarrier\.(expect|wait)\(turn", line))
        return out.replace("    if WARPGROUP == 1:\n    mbarrier.wait(q_ready, 0)", "    mbarrier.wait(q_ready, 0)")
    if name == "named":
        out = out.replace("mbarrier.wait(turn.index(WARPGROUP), 0)", "turn_sync(WARPGROUP)")
        out = out.replace("mbarrier.wait(turn.index(WARPGROUP), it & 1)", "turn_sync(WARPGROUP)")
        out = out.replace("    if WARPGROUP == 1:\n        mbarrier.expect(turn.index(0), 0)",
                          "    if WARPGROUP == 1:\n        if num_tiles > 0:\n            turn_give(0)")
        out = out.replace("mbarrier.expect(turn.index(1 - WARPGROUP), 0)", "turn_give(1 - WARPGROUP)")
        # Warpgroup 1 hands over once more than warpgroup 0 waits: a last wait consumes it, so
        # that no named barrier is left half arrived at exit.
        tail = ("        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))\n"
                "        mbarrier.expect(v_empty.index(last_stage), 0)\n")
        assert out.count(tail) == 1
        out = out.replace(tail, tail + "        if WARPGROUP == 0:\n            turn_sync(0)\n")
        assert "mbarrier.expect(turn" not in out and "mbarrier.wait(turn" not in out
        return out + NAMED_HELPERS
    raise ValueError(f"unknown variant {name!r}")


def install(name: str, text: str):
    """Point the Gluon forward lowering at variant ``name`` of the template."""
    sys.path.insert(0, "bench")
    from _tuning import install_gluon_template
    install_gluon_template("forward", name, variant_source(name, text))


# name: (B, H, S, D, mask: None, "causal", "window1024" or "document8"[, score_mod: "alibi" or "softcap"])
CASES = {
    "no_mask_s8192_d128": (4, 16, 8192, 128, None),
    "causal_s8192_d128": (4, 16, 8192, 128, "causal"),
    "window1024_s8192_d128": (4, 16, 8192, 128, "window1024"),
    "document8_s8192_d128": (4, 16, 8192, 128, "document8"),
    "no_mask_s8192_d64": (4, 16, 8192, 64, None),
    "causal_s8192_d64": (4, 16, 8192, 64, "causal"),
    "causal_s4096_d256_b2": (2, 16, 4096, 256, "causal"),
    "alibi_s8192_d64": (4, 16, 8192, 64, None, "alibi"),
    "softcap_s8192_d64": (4, 16, 8192, 64, None, "softcap"),
    "no_mask_s2048_d64": (4, 16, 2048, 64, None),
    "window1024_s8192_d64": (4, 16, 8192, 64, "window1024"),
    "document8_s8192_d64": (4, 16, 8192, 64, "document8"),
    "causal_alibi_s8192_d64": (4, 16, 8192, 64, "causal", "alibi"),
}


def score_mod(kind, H):
    from flexattn import mods
    return None if kind is None else {"alibi": lambda: mods.alibi(H, device="cuda"),
                                      "softcap": lambda: mods.tanh_softcap(30.0)}[kind]()


def mask_mod(kind, S):
    from bench_attention import document_ids

    from flexattn import mods
    return {"causal": lambda: mods.causal_mask, "window1024": lambda: mods.sliding_window(1024),
            "document8": lambda: mods.document_mask(document_ids(S, 8, "cuda"))}[kind]()


@contextlib.contextmanager
def variant_configs(name: str):
    """For a ``cfg:FIELD=VALUE`` variant, the default configs (both tables) with FIELD set,
    and for ``nodense`` no three-warpgroup configs, while its call compiles."""
    from flexattn.lowering.configs import gluon_forward as gluon_configs
    if name == "nodense":
        changes = [(gluon_configs.UNMODIFIED_SM90, {})]
    elif name.startswith("cfg:"):
        field, value = name[len("cfg:"):].split("=", 1)
        changes = [(table, {d: dataclasses.replace(c, **{field: int(value)}) for d, c in table.items()})
                   for table in (gluon_configs.SM90, gluon_configs.UNMODIFIED_SM90)]
    else:
        yield
        return
    saved = [dict(table) for table, _ in changes]
    for table, replaced in changes:
        table.clear()
        table.update(replaced)
    try:
        yield
    finally:
        for (table, _), old in zip(changes, saved):
            table.clear()
            table.update(old)


def variant_options(name: str) -> dict:
    """The call's kernel_options for variant ``name``."""
    options = {"BACKEND": "GLUON"}
    if name.startswith("opt:"):
        key, value = name[len("opt:"):].split("=", 1)
        options[key] = json.loads(value)
    return options


def compiled_call(tag: str, options: dict):
    """A compiled flexattn forward whose code object is its own, so Dynamo keeps one graph per variant."""
    import flexattn
    sys.path.insert(0, "bench")
    from _tuning import compiled_own_code
    return compiled_own_code(f"forward_{tag}", "q, k, v, block_mask, score_mod",
                             "return flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,\n"
                             f"                               kernel_options={options!r})",
                             {"flexattn": flexattn})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="base")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--offline", metavar="OUT_DIR", help="write each variant's template text and stop")
    args = parser.parse_args()
    from flexattn.templates import gluon_kernel_source
    text = gluon_kernel_source("gluon_forward")
    variants = args.variants.split(",")
    if args.offline:
        for name in variants:
            with open(f"{args.offline}/gluon_forward_{name}.py.jinja", "w") as f:
                f.write(variant_source(name, text))
        return

    import torch
    from torch._inductor import config as inductor_config

    import flexattn

    sys.path.insert(0, "bench")
    from _tuning import allow_recompiles, medians_in_turn
    allow_recompiles()
    inductor_config.force_disable_caches = True
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "triton": __import__("triton").__version__}), flush=True)
    for case in args.cases.split(","):
        B, H, S, D, mask, *score = CASES[case]
        mod = score_mod(score[0] if score else None, H)
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        block_mask = flexattn.create_block_mask(mask_mod(mask, S), None, None, S, S) if mask else None
        fns, outs, errors = {}, {}, {}
        for name in variants:
            install(name, text)
            fn = compiled_call(re.sub(r"\W", "_", f"{name}_{case}"), variant_options(name))
            try:
                with variant_configs(name):
                    outs[name] = fn(q, k, v, block_mask, mod)
                torch.cuda.synchronize()
                fns[name] = fn
            except Exception as e:  # noqa: BLE001 - a variant that fails to build is a reading
                errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
        ms = medians_in_turn(fns, q, k, v, block_mask, mod, rounds=args.rounds)
        flops = 4 * B * H * S * S * D * (0.5 if mask == "causal" else 1.0)
        row = {"case": case, "ms": {n: round(t, 4) for n, t in ms.items()}, "errors": errors}
        if mask in (None, "causal"):
            row["tflops"] = {n: round(flops / (t * 1e-3) / 1e12, 1) for n, t in ms.items()}
        first = next(iter(ms), None)
        if first is not None:
            row[f"speed_vs_{first}"] = {n: round(ms[first] / t, 3) for n, t in ms.items()}
        if "base" in outs:
            row["maxdiff_vs_base"] = {n: float((o.float() - outs["base"].float()).abs().max()) for n, o in outs.items()}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

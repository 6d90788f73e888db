"""Is the Gluon backward (kernel_options BWD_BACKEND="GLUON", issue #50) faster than the
Triton template's, and where does its time go?

    PYTHONPATH=. python bench/experiments/gluon_backward_ab.py [--cases causal_s8192_d128,...] [--rounds 3]
        [--variants TRITON,GLUON,GLUON:nodq,GLUON:noadd,GLUON:file:PATH,GLUON:rev:REVISION,GLUON:cfg:NAME]
        [--configs '{"NAME": {"64": {"block_m": 128}}}']
    PYTHONPATH=. python bench/experiments/gluon_backward_ab.py --offline OUT_DIR --variants ...   # CPU: texts only

Forward+backward of flexattn's compiled flex_attention with the backward on the Triton
template and on the Gluon kernel (the same forward), bf16, B=4 H=16, medians of rounds
taken in turn (do_bench), TFLOP/s over the unmasked entries (forward 4 and backward 10
multiply-adds x2 per entry and head dim), and the largest difference of each run's
gradients from the first variant's. Variants of the Gluon template's text:

- GLUON:nodq: without the dQ products, their stores and adds (the barriers around them
  kept; its dQ is 0: what dQ costs);
- GLUON:noadd: the dQ products and their shared-memory stores, no bulk adds (dQ is 0: what
  the adds cost);
- GLUON:file:PATH: the kernel source saved in PATH, helpers included (e.g. another
  revision's ``gluon_kernel_source("gluon_backward")``);
- GLUON:rev:REVISION: the template (and its helpers) of another git revision, which must
  read the constexprs this tree's lowering passes;
- GLUON:cfg:NAME: the template as it is, compiled with the fields of ``GluonBackwardConfig``
  that ``--configs`` gives NAME (by head dim) in place of the defaults'.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
import subprocess
import sys

import torch

import flexattn
from flexattn import mods

sys.path.insert(0, "bench")
from _tuning import (allow_recompiles, compiled_own_code, install_gluon_template,  # noqa: E402
                     medians_in_turn)

_DQ_END = r"buf\.reshape\(\[1, 1, BLOCK_M, HALF_D\]\)\)"
# The dQ products become zeros; the waits and barriers around them stay (the other warpgroup
# waits on them).
_DQ_PRODUCT = re.compile(r"dq = warpgroup_mma\(ds_tile[^\n]*")
# The dQ half-tile's store to shared memory and its add.
_DQ_STORE = re.compile(r"\n +buf = dq_smem\.index.*?" + _DQ_END, re.S)
_ADD = re.compile(r"\n +tma_atomic_add\(dq_desc,[^\n]*\n[^\n]*" + _DQ_END)


def _sub_once(pattern: re.Pattern, repl: str, text: str) -> str:
    out, n = pattern.subn(repl, text)
    assert n >= 1, f"the template no longer has the text {pattern.pattern[:60]!r}"
    return out


def variant_source(name: str, text: str) -> str:
    """The Gluon backward template's text for variant ``name`` (see the module docstring)."""
    kind = name.split(":", 1)[1] if ":" in name else ""
    if kind == "nodq":
        return _sub_once(_DQ_STORE, "", _sub_once(_DQ_PRODUCT, "dq = no_dq", text))
    if kind == "noadd":
        return _sub_once(_ADD, "", text)
    if kind == "" or kind.startswith("cfg:"):
        return text
    if kind.startswith("file:"):
        with open(kind[len("file:"):]) as f:
            return f.read()
    if kind.startswith("rev:"):
        return "\n".join(subprocess.run(["git", "show", f"{kind[len('rev:'):]}:flexattn/templates/{part}.py.jinja"],
                                        capture_output=True, text=True, check=True).stdout
                         for part in ("gluon_backward", "gluon_helpers", "common"))
    raise ValueError(f"unknown variant {name!r}")


@contextlib.contextmanager
def config_fields(by_head_dim: dict):
    """The Gluon backward's default configs (unmodified calls' too) with ``by_head_dim``'s fields
    replaced, inside."""
    from flexattn.lowering.configs import gluon_backward as configs
    saved = configs.SM90, configs.UNMODIFIED_SM90
    configs.SM90, configs.UNMODIFIED_SM90 = ({d: dataclasses.replace(c, **by_head_dim.get(str(d), {}))
                                             for d, c in table.items()} for table in saved)
    try:
        yield
    finally:
        configs.SM90, configs.UNMODIFIED_SM90 = saved


# name: (B, H, S, D, causal)
CASES = {
    "no_mask_s8192_d128": (4, 16, 8192, 128, False),
    "causal_s8192_d128": (4, 16, 8192, 128, True),
    "no_mask_s8192_d64": (4, 16, 8192, 64, False),
    "causal_s8192_d64": (4, 16, 8192, 64, True),
    # Shorter calls, where the Gluon backward ran slower (bench/DECISIONS.md#gluon-backward-default).
    "causal_s2048_d128": (4, 16, 2048, 128, True),
    "causal_s4096_d128": (4, 16, 4096, 128, True),
    "causal_s4096_d64": (4, 16, 4096, 64, True),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default="TRITON,GLUON")
    parser.add_argument("--configs", default="{}", help="JSON: NAME -> head dim -> GluonBackwardConfig fields")
    parser.add_argument("--offline", metavar="OUT_DIR", help="write each Gluon variant's template text and stop")
    args = parser.parse_args()
    from flexattn.templates import gluon_kernel_source
    text = gluon_kernel_source("gluon_backward")
    variants = args.variants.split(",")
    config_sets = json.loads(args.configs)
    if args.offline:
        for name in variants:
            if name.startswith("GLUON"):
                stem = re.sub(r"\W", "_", name)
                with open(f"{args.offline}/gluon_backward_{stem}.py.jinja", "w") as f:
                    f.write(variant_source(name, text))
        return
    from torch._inductor import config as inductor_config
    allow_recompiles()
    inductor_config.force_disable_caches = True
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}), flush=True)
    for case in args.cases.split(","):
        B, H, S, D, causal = CASES[case]
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, grad = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                         for _ in range(4))
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
        block_mask = flexattn.create_block_mask(mods.causal_mask, None, None, S, S) if causal else None
        steps, grads = {}, {}
        for name in variants:
            backend = name.split(":", 1)[0]
            if backend == "GLUON":
                install_gluon_template("backward", name, variant_source(name, text))
            fn = compiled_own_code(re.sub(r"\W", "_", f"call_{name}_{case}"), "q, k, v",
                                   f"return flexattn.flex_attention(q, k, v, block_mask=block_mask, "
                                   f"kernel_options={{'BWD_BACKEND': {backend!r}}})",
                                   {"flexattn": flexattn, "block_mask": block_mask})

            def step(fn=fn):
                q.grad = k.grad = v.grad = None
                fn(q, k, v).backward(grad)

            try:
                with config_fields(config_sets.get(name.split(":cfg:", 1)[1], {}) if ":cfg:" in name else {}):
                    step()  # the first call compiles, under the variant's config
                grads[name] = [t.grad.clone() for t in (q, k, v)]
                steps[name] = step
            except Exception as e:  # noqa: BLE001 - a variant that fails is a reading
                print(json.dumps({"case": case, "variant": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}))
        ms = medians_in_turn(steps, rounds=args.rounds)
        flops = 2 * (2 + 5) * B * H * S * S * D * (0.5 if causal else 1.0)
        row = {"case": case, "ms": {n: round(t, 3) for n, t in ms.items()},
               "fwdbwd_tflops": {n: round(flops / (t * 1e-3) / 1e12, 1) for n, t in ms.items()}}
        first = next(iter(grads), None)
        if first is not None:
            row[f"maxdiff_grads_vs_{first}"] = {n: [float((a.float() - b.float()).abs().max())
                                                    for a, b in zip(grads[first], g)] for n, g in grads.items()}
        print(json.dumps(row), flush=True)

if __name__ == "__main__":
    main()

"""Time of bench_user_masks.py formulations under kernel_options variants, beside torch's flex.

    python bench/experiments/mask_kernel_ab.py NAMES [D] [VARIANTS_JSON] [--mode fwd|fwd_grad|fwdbwd] [--top alibi|softcap]

NAMES: comma-separated formulations of bench/bench_user_masks.py, at B=4 H=16 S=8192 (or
``--shape bBhHsS``, the suite's or any other), bf16.
VARIANTS_JSON: {name: kernel_options} (default AUTO, BACKEND TRITON, BACKEND GLUON).
--mode fwd_grad times the forward of inputs requiring grad (it writes the log-sum-exp), fwdbwd
forward and backward together (backward tiles: the `bwd_` options);
--top puts the suite's ALiBi or soft-cap score_mod on the mask. Prints one JSON line per
formulation: the listed partial and full blocks per query block, each variant's and
torch's do_bench milliseconds (launch included; with --rounds N, N rounds taken in turn and
each one's list; ``--kernel-time``: the profiler's kernel milliseconds a call instead, for
calls short enough that do_bench reads the host), and the largest difference of each
variant's output (fwdbwd: and of its query gradient) from torch's.

A variant's options may carry another backward template's text, ``"_backward_text": "PATH"``
(an edited copy of `flexattn/templates/backward.py.jinja`) or ``"_gluon_backward_text":
"PATH"`` (of `gluon_backward.py.jinja`), assembled with the tree's helpers (Inductor's
caches off then), timed beside the tree's own.
"""
import argparse
import json
import re
import sys

sys.path.insert(0, "bench")
import torch  # noqa: E402
import triton.testing  # noqa: E402
from torch.nn.attention import flex_attention as tf  # noqa: E402

import _tuning  # noqa: E402
import bench_user_masks as um  # noqa: E402
import profiler  # noqa: E402
import flexattn  # noqa: E402
from flexattn.templates import gluon_kernel_source, kernel_source, read_template  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("names")
parser.add_argument("D", nargs="?", type=int, default=128)
parser.add_argument("variants", nargs="?",
                    default='{"AUTO": {}, "TRITON": {"BACKEND": "TRITON"}, "GLUON": {"BACKEND": "GLUON"}}')
parser.add_argument("--mode", choices=("fwd", "fwd_grad", "fwdbwd"), default="fwd")
parser.add_argument("--top", choices=("alibi", "softcap"))
parser.add_argument("--rounds", type=int, default=1)
parser.add_argument("--shape", default="b4h16s8192", help="bBhHsS, e.g. the suite's b4h16s8192 or b2h8s4096")
parser.add_argument("--kernel-time", action="store_true", help="time kernels (profiler), not do_bench")
args = parser.parse_args()
D, variants = args.D, json.loads(args.variants)
match = re.fullmatch(r"b(\d+)h(\d+)s(\d+)", args.shape)
if not match:
    parser.error(f"--shape: expected bBhHsS such as b2h8s4096, got {args.shape!r}")
shape = um.Shape(*map(int, match.groups()))
B, H = shape.B, shape.H
dev = torch.device("cuda")

if any(key in opts for opts in variants.values() for key in ("_backward_text", "_gluon_backward_text")):
    torch._inductor.config.force_disable_caches = True


def timed(fn, q, k, v, grad):
    """fn's output (and query gradient) and do_bench ms of a call (with backward in fwdbwd)."""
    def step():
        out = fn(q, k, v)
        if args.mode == "fwdbwd":
            out.backward(grad)
        return out
    # do_bench leaves its last call's gradients behind: cleared, or this call's would add to them.
    q.grad = k.grad = v.grad = None
    out = step()
    dq = None
    if args.mode == "fwdbwd":
        dq, q.grad, k.grad, v.grad = q.grad.clone(), None, None, None
    grads = [q, k, v] if args.mode == "fwdbwd" else []
    if args.kernel_time:
        ms = sum(us for _name, us, _launches in profiler.kernel_table(step, grads)) / 1e3
    else:
        ms = triton.testing.do_bench(step, warmup=25, rep=200, grad_to_none=grads or None)
    return out.detach(), dq, round(ms, 4)


for name in args.names.split(","):
    built = um.FORMULATIONS[name].build(shape, dev)
    score_mod = um.score_mod_on_top(args.top, shape.H, dev) if args.top else None
    fbm = flexattn.create_block_mask(built.mask_mod, None, None, built.q_len, built.kv_len, device=dev)
    tbm = tf.create_block_mask(built.mask_mod, None, None, built.q_len, built.kv_len, device=dev)
    g = torch.Generator(device="cuda").manual_seed(0)
    grad_on = args.mode != "fwd"
    q = torch.randn(B, H, built.q_len, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(grad_on)
    k = torch.randn(B, H, built.kv_len, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(grad_on)
    v = torch.randn(B, H, built.kv_len, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(grad_on)
    grad = torch.randn(B, H, built.q_len, D, device=dev, dtype=torch.bfloat16, generator=g)
    kv_num = fbm.kv_num_blocks.float().mean().item(); full = fbm.full_kv_num_blocks.float().mean().item()
    row = {"case": name, "D": D, "mode": args.mode, "top": args.top, "partial_blocks_per_row": round(kv_num, 1),
           "full_blocks_per_row": round(full, 1)}
    outs, fns = {}, {}
    torch._dynamo.reset()
    for i, (vname, opts) in enumerate(variants.items()):
        opts = dict(opts)
        text = opts.pop("_backward_text", None)
        _tuning.install_triton_backward_template(text or "base", "\n".join((open(text).read(), read_template("common"))) if text
                                               else kernel_source("backward"))
        gluon_text = opts.pop("_gluon_backward_text", None)
        _tuning.install_gluon_template("backward", gluon_text or "base", "\n".join(
            (open(gluon_text).read(), read_template("gluon_helpers"), read_template("common"))) if gluon_text
            else gluon_kernel_source("gluon_backward"))
        # A code object per variant: later rounds call each again, its graph and kernels kept.
        f = _tuning.compiled_own_code(f"variant_{i}", "q, k, v", "return flex_attention(q, k, v, score_mod=score_mod, "
                                      "block_mask=block_mask, kernel_options=opts)",
                                      {"flex_attention": flexattn.flex_attention, "score_mod": score_mod,
                                       "block_mask": fbm, "opts": opts})
        try:
            out, dq, row[vname] = timed(f, q, k, v, grad)
            outs[vname], fns[vname] = (out, dq), f
        except Exception as e:
            row[vname] = f"{type(e).__name__}: {str(e)[:200]}"
    t = torch.compile(lambda q, k, v: tf.flex_attention(q, k, v, score_mod=score_mod, block_mask=tbm))
    try:
        ref, ref_dq, row["torch"] = timed(t, q, k, v, grad)
        fns["torch"] = t
    except Exception as e:
        # Some formulations torch cannot lower (the suite records those too): flexattn's times stand alone.
        row["torch"], ref = f"{type(e).__name__}: {str(e)[:200]}", None
    if args.rounds > 1:
        # Compiled functions keep their kernels: later rounds time them again in turn.
        for vname in fns:
            row[vname] = [row[vname]]
        for _ in range(args.rounds - 1):
            for vname, fn in fns.items():
                row[vname].append(timed(fn, q, k, v, grad)[2])
    if ref is not None:
        row["maxdiff"] = {k_: float((o.float() - ref.float()).abs().max()) for k_, (o, _) in outs.items()}
    if args.mode == "fwdbwd" and ref is not None:
        row["maxdiff_dq"] = {k_: float((dq.float() - ref_dq.float()).abs().max()) for k_, (_, dq) in outs.items()}
    print(json.dumps(row), flush=True)

"""How far flexattn and torch's flex are from float64 on the masks users write (issue #49).

bench_user_masks.py flags a cell whose output or gradients differ from torch's flex by more
than its ERROR_FLAG; that says two bf16 kernels disagree, not which one is off. This runs a
few of its formulations (with their mod on top or not) at a reduced batch, and measures
flexattn, torch's compiled flex and a float32 dense computation rounded to the inputs'
dtype (the yardstick the tests use) against a float64 dense golden: output and the
gradients of q, k and v, max abs error each, and flexattn's error over the yardstick's.

    python bench/experiments/user_mask_accuracy.py --cases neighbourhood_2d_morton+alibi --shape 1,2,8192 --head-dim 128
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_user_masks as um  # noqa: E402

import flexattn  # noqa: E402
from torch.nn.attention import flex_attention as torch_flex  # noqa: E402


def dense(q, k, v, score_mod, allowed, scale, dtype):
    """Output of the plain computation in ``dtype``, differentiable."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    B, H, L, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    idx = [torch.arange(n, device=q.device).view(*[n if i == d else 1 for i in range(4)])
           for d, n in enumerate((B, H, L, S))]
    scores = score_mod((q @ k.transpose(-1, -2)) * scale, *idx) if score_mod else (q @ k.transpose(-1, -2)) * scale
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)
    return (q, k, v), probs @ v


def grads_of(inputs, out, grad_out):
    out.backward(grad_out.to(out.dtype))
    return [out.detach()] + [t.grad for t in inputs]


def run(case_name: str, B: int, H: int, S: int, D: int, device: torch.device) -> list[str]:
    name, _, top = case_name.partition("+")
    built = um.FORMULATIONS[name].build(um.Shape(B, H, S), device)
    score_mod = um.score_mod_on_top(top, H, device) if top else None
    gen = torch.Generator(device=device).manual_seed(um.SEED)
    q = torch.randn(B, H, built.q_len, D, generator=gen, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(B, H, built.kv_len, D, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(2))
    grad_out = torch.randn(q.shape, generator=gen, device=device, dtype=torch.bfloat16)
    scale = D ** -0.5
    allowed = flexattn.create_mask(built.mask_mod, B, H, built.q_len, built.kv_len, device=device)

    golden = grads_of(*dense(q, k, v, score_mod, allowed, scale, torch.float64), grad_out)
    yardstick = [t.to(torch.bfloat16) for t in grads_of(*dense(q, k, v, score_mod, allowed, scale, torch.float32),
                                                        grad_out)]
    results = {"yardstick": yardstick}
    # torch's flex has no CPU training path; on the CPU (a smoke run) flexattn alone.
    peers = (("flexattn", flexattn), ("torch_flex", torch_flex))[:2 if device.type == "cuda" else 1]
    for impl, library in peers:
        block_mask = library.create_block_mask(built.mask_mod, B, H, built.q_len, built.kv_len, device=device)
        compiled = torch.compile(library.flex_attention, fullgraph=True, dynamic=False)
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        out = compiled(*inputs, score_mod=score_mod, block_mask=block_mask, scale=scale)
        results[impl] = grads_of(inputs, out, grad_out)
    lines = []
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        errs = {impl: (r[i].double() - golden[i]).abs().max().item() for impl, r in results.items()}
        finite = all(bool(torch.isfinite(r[i]).all()) for r in results.values())
        lines.append(f"{case_name} b{B}h{H}s{S}d{D} {what}: flexattn {errs['flexattn']:.2e}, torch_flex "
                     f"{errs.get('torch_flex', float('nan')):.2e}, bf16 yardstick {errs['yardstick']:.2e}; flexattn / yardstick "
                     f"{errs['flexattn'] / max(errs['yardstick'], 1e-30):.2f}; |golden| max "
                     f"{golden[i].abs().max().item():.2e}{'' if finite else '; NON-FINITE'}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="neighbourhood_2d_morton+alibi,neighbourhood_2d_morton,doc_offsets_causal",
                        help="comma-separated formulation names, each optionally +<its mod on top>")
    parser.add_argument("--shape", default="1,2,8192", help="B,H,S")
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args(argv)
    B, H, S = (int(x) for x in args.shape.split(","))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for case in args.cases.split(","):
        for line in run(case, B, H, S, args.head_dim, device):
            print(line, flush=True)
        torch.cuda.empty_cache() if device.type == "cuda" else None
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Per-kernel GPU time of a learnable-bias training step (bench_learnable_bias.py's tables).

    PYTHONPATH=. python bench/experiments/learnable_bias_kernels.py rel,rel:frozen,key,key:frozen [OPTIONS_JSON]

Builds the causal B=4 H=16 S=8192 D=128 (B, H, S, D from the environment) bf16 step with
a float32 table captured by the score_mod: ``rel`` (H, 2S-1) at the clamped kv_idx - q_idx,
``key`` (H, S) at kv_idx, ``slope`` (H,) times kv_idx - q_idx; ``:frozen`` the same
table without grad (what the table's gradient costs). Compiles ``flexattn.flex_attention``
with OPTIONS_JSON as kernel_options, profiles 5 steps after 3 warm-ups and prints one JSON
line per case: the step's device us and its six busiest kernels. It does not put bench/ on
sys.path, so PYTHONPATH picks the flexattn tree (an A/B against an older commit: PYTHONPATH
at a `git archive` of it).
"""
import collections
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import flexattn
from flexattn import mods

B, H, S, D = (int(os.environ.get(k, d)) for k, d in (("B", 4), ("H", 16), ("S", 8192), ("D", 128)))
options = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
dev = torch.device("cuda")
gen = torch.Generator(device=dev).manual_seed(0)
q, k, v = (torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16, generator=gen).requires_grad_()
           for _ in range(3))
grad = torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16, generator=gen)
last = S - 1
block_mask = flexattn.create_block_mask(mods.causal_mask, None, None, S, S, device=dev)
print(json.dumps({"flexattn": flexattn.__file__, "options": options}), flush=True)


def bias_mod(kind: str, table: torch.Tensor):
    if kind == "key":
        return lambda score, b, h, q_idx, kv_idx: score + table[h, kv_idx]
    if kind == "slope":
        return lambda score, b, h, q_idx, kv_idx: score + table[h] * (kv_idx - q_idx)
    return lambda score, b, h, q_idx, kv_idx: score + table[h, (kv_idx - q_idx).clamp(-last, last) + last]


for case in sys.argv[1].split(","):
    kind, _, frozen = case.partition(":")
    size = {"key": (H, S), "slope": (H,), "rel": (H, 2 * S - 1)}[kind]
    table = (0.1 * torch.randn(*size, device=dev, generator=gen)).requires_grad_(not frozen)
    score_mod = bias_mod(kind, table)
    torch._dynamo.reset()
    call = torch.compile(lambda q, k, v: flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                                                 kernel_options=options), fullgraph=True)
    leaves = [t for t in (q, k, v, table) if t.requires_grad]

    def step():
        return torch.autograd.grad(call(q, k, v), leaves, grad)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    kernels = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name[:50]] += event.device_time / 5
    print(json.dumps({"case": case, "step_us": round(sum(kernels.values())),
                      "kernels_us": {name: round(us) for name, us in kernels.most_common(6)}}), flush=True)

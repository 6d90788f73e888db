"""Forward time of bench_user_masks.py formulations under kernel_options variants, beside torch's flex.

    python bench/experiments/mask_kernel_ab.py NAMES [D] [VARIANTS_JSON]

NAMES: comma-separated formulations of bench/bench_user_masks.py, at B=4 H=16 S=8192, bf16.
VARIANTS_JSON: {name: kernel_options} (default AUTO, BACKEND TRITON, BACKEND GLUON). Prints
one JSON line per formulation: the listed partial and full blocks per query block, each
variant's and torch's do_bench milliseconds (launch included), and the largest difference
of each variant's output from torch's.
"""
import sys, json
sys.path.insert(0, "bench")
import torch, triton.testing
import bench_user_masks as um
import flexattn
from torch.nn.attention import flex_attention as tf

names = sys.argv[1].split(",")
D = int(sys.argv[2]) if len(sys.argv) > 2 else 128
shape = um.Shape(4, 16, 8192)
dev = torch.device("cuda")
for name in names:
    built = um.FORMULATIONS[name].build(shape, dev)
    fbm = flexattn.create_block_mask(built.mask_mod, None, None, built.q_len, built.kv_len, device=dev)
    tbm = tf.create_block_mask(built.mask_mod, None, None, built.q_len, built.kv_len, device=dev)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(4, 16, built.q_len, D, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(4, 16, built.kv_len, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    kv_num = fbm.kv_num_blocks.float().mean().item(); full = fbm.full_kv_num_blocks.float().mean().item()
    row = {"case": name, "D": D, "partial_blocks_per_row": round(kv_num, 1), "full_blocks_per_row": round(full, 1)}
    variants = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {"AUTO": {}, "TRITON": {"BACKEND": "TRITON"}, "GLUON": {"BACKEND": "GLUON"}}
    outs = {}
    for vname, opts in variants.items():
        torch._dynamo.reset()
        f = torch.compile(lambda q, k, v, o=opts: flexattn.flex_attention(q, k, v, block_mask=fbm, kernel_options=o))
        try:
            outs[vname] = f(q, k, v)
            row[vname] = round(triton.testing.do_bench(lambda: f(q, k, v), warmup=25, rep=200), 3)
        except Exception as e:
            row[vname] = f"{type(e).__name__}: {str(e)[:200]}"
    torch._dynamo.reset()
    t = torch.compile(lambda q, k, v: tf.flex_attention(q, k, v, block_mask=tbm))
    ref = t(q, k, v)
    row["torch"] = round(triton.testing.do_bench(lambda: t(q, k, v), warmup=25, rep=200), 3)
    row["maxdiff"] = {k_: float((o.float() - ref.float()).abs().max()) for k_, o in outs.items()}
    print(json.dumps(row), flush=True)

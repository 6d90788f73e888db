"""Write the Inductor output code of a flexattn call as an sm90 build would choose it,
on a machine without a GPU (input for scripts/aot_check_sm90.py).

    TRITON_INTERPRET=1 python scripts/aot_generate.py --mask causal --dim 128 \
        --options '{"USE_TMA": true}' --backward --out /tmp/aot/causal128.py
    # a mask of bench/bench_user_masks.py, at one of its shapes:
    TRITON_INTERPRET=1 python scripts/aot_generate.py --formulation doc_offsets_causal --batch 2 --heads 8 \
        --seq 4096 --dim 128 --out /tmp/aot/offsets128.py

The kernels are generated for the CPU device under Triton's interpreter with the GPU
generation patched to "sm90", so the tile tables, stages and specialisations are the
ones an H100/H200 gets (USE_TMA must be asked for explicitly: the CPU has no copy
engine to detect).
"""
import argparse
import json
import os
import pathlib
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch._inductor.utils import run_and_get_code  # noqa: E402

import flexattn  # noqa: E402
from flexattn import _compat, mods  # noqa: E402
from flexattn.lowering import configs, decode as decode_lowering  # noqa: E402

#: The modules that read the GPU generation (each imported gpu_generation by name).
GENERATION_READERS = (configs.base, configs.backward, configs.tma, decode_lowering)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mask", default="none", choices=["none", "causal", "document", "window"])
    parser.add_argument("--formulation", help="a mask of bench/bench_user_masks.py instead of --mask")
    parser.add_argument("--score", default="none", choices=["none", "softcap", "alibi"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--q-seq", type=int, default=None, help="query length (default --seq; 1 for the decode kernel)")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--options", default="{}", help="kernel_options as JSON")
    parser.add_argument("--backward", action="store_true", help="also generate the backward")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    _compat.enable_triton_interpreter()
    _compat.use_interpreter_libdevice()
    for module in GENERATION_READERS:
        module.gpu_generation = lambda device: "sm90"
    torch._inductor.config.cpu_backend = "triton"

    dtype = getattr(torch, args.dtype)
    hkv = args.kv_heads or args.heads
    q_seq = args.q_seq or args.seq
    mask_mod = {"none": None, "causal": mods.causal_mask,
                "window": mods.sliding_window(128),
                "document": mods.document_mask(torch.arange(args.seq) // 200)}[args.mask]
    if args.formulation:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
        import bench_user_masks

        built = bench_user_masks.FORMULATIONS[args.formulation].build(
            bench_user_masks.Shape(args.batch, args.heads, args.seq), torch.device("cpu"))
        mask_mod, q_seq, kv_seq = built.mask_mod, built.q_len, built.kv_len
        mask_b, mask_h = (args.batch if built.reads_b else None), (args.heads if built.reads_h else None)
    else:
        kv_seq, mask_b, mask_h = args.seq, None, None
    q = torch.randn(args.batch, args.heads, q_seq, args.dim, dtype=dtype, requires_grad=args.backward)
    k = torch.randn(args.batch, hkv, kv_seq, args.dim, dtype=dtype, requires_grad=args.backward)
    v = torch.randn(args.batch, hkv, kv_seq, args.dim, dtype=dtype, requires_grad=args.backward)
    score_mod = {"none": None, "softcap": mods.tanh_softcap(30.0),
                 "alibi": mods.alibi(args.heads)}[args.score]
    block_mask = None
    if mask_mod is not None:
        block_mask = flexattn.create_block_mask(mask_mod, mask_b, mask_h, q_seq, kv_seq, device="cpu")
    options = json.loads(args.options)

    def run(q, k, v):
        out = flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                      enable_gqa=hkv != args.heads, kernel_options=options)
        if args.backward:
            out.sum().backward()
        return out

    _, codes = run_and_get_code(torch.compile(run, fullgraph=False), q, k, v)
    with open(args.out, "w") as f:
        f.write("\n".join(codes))
    print("wrote", args.out, len(codes), "code files")


if __name__ == "__main__":
    main()

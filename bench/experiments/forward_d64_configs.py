"""Forward tile configurations at D=64 (bf16, B=4, H=16) beside torch's compiled flex_attention:
causal, document (8 docs) and causal+ALiBi at S=1024/2048/8192, 5 rounds in turn, medians of
do_bench; prints torch time / flexattn time per config (bench/DECISIONS.md#forward-defaults-h100)."""
import torch
import flexattn
from flexattn import mods
from torch.nn.attention import flex_attention as tflex
from _in_turn import medians_in_turn
torch._dynamo.config.cache_size_limit = 256
B, H, D = 4, 16, 64
CFGS = {"128x128w4s3": (128, 128, 4, 3), "128x64w4s2": (128, 64, 4, 2), "64x128w4s2": (64, 128, 4, 2),
        "64x64w4s2": (64, 64, 4, 2), "128x64w4s3": (128, 64, 4, 3)}
def doc_mask(S):
    return mods.document_mask(torch.arange(S, device="cuda") * 8 // S)
print(torch.cuda.get_device_name())
for S in (1024, 2048, 8192):
    for mask in ("causal", "document", "alibi"):
        mm = doc_mask(S) if mask == "document" else mods.causal_mask
        sm = mods.alibi(H, device="cuda") if mask == "alibi" else None
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        bm = flexattn.create_block_mask(mm, None, None, S, S, device="cuda")
        tbm = tflex.create_block_mask(mm, None, None, S, S, device="cuda")
        fns = {}
        for name, (bm_, bn, w, st) in CFGS.items():
            opts = {"BLOCK_M": bm_, "BLOCK_N": bn, "num_warps": w, "num_stages": st}
            fns[name] = torch.compile(lambda q, k, v, opts=opts: flexattn.flex_attention(q, k, v, score_mod=sm, block_mask=bm, kernel_options=opts))
        fns["default"] = torch.compile(lambda q, k, v: flexattn.flex_attention(q, k, v, score_mod=sm, block_mask=bm))
        fns["torch"] = torch.compile(lambda q, k, v: tflex.flex_attention(q, k, v, score_mod=sm, block_mask=tbm))
        med = medians_in_turn(fns, q, k, v)
        print(f"S={S} {mask}: torch {med['torch']*1e3:.1f}us | " + "  ".join(f"{n} {med['torch']/m:.3f}" for n, m in med.items() if n != "torch"), flush=True)

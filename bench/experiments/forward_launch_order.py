"""The forward's REVERSED_Q_TILES (every head's last query tile first) against the launch order,
beside torch's compiled flex_attention: causal, document, sliding 1024, bf16 B=4 H=16, 5 rounds in
turn (bench/DECISIONS.md#forward-reversed-q-tiles-default)."""
import torch
import flexattn
from flexattn import mods
from torch.nn.attention import flex_attention as tflex
from _in_turn import medians_in_turn
torch._dynamo.config.cache_size_limit = 256
B, H = 4, 16
rows = []
def doc_mask(S):
    return mods.document_mask(torch.arange(S, device="cuda") * 8 // S)
for S in (2048, 8192):
    for D in (64, 128):
        for mask in ("causal", "document", "sliding"):
            if mask == "sliding" and S == 2048:
                continue
            mm = {"causal": mods.causal_mask, "document": doc_mask(S) if mask == "document" else None,
                  "sliding": mods.sliding_window(1024)}[mask]
            q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            bm = flexattn.create_block_mask(mm, None, None, S, S, device="cuda")
            tbm = tflex.create_block_mask(mm, None, None, S, S, device="cuda")
            fns = {}
            for rev in (False, True):
                fns[f"rev={rev}"] = torch.compile(lambda q, k, v, rev=rev: flexattn.flex_attention(q, k, v, block_mask=bm, kernel_options={"REVERSED_Q_TILES": rev}))
            fns["torch"] = torch.compile(lambda q, k, v: tflex.flex_attention(q, k, v, block_mask=tbm))
            med = medians_in_turn(fns, q, k, v)
            print(f"S={S} D={D} {mask}: " + "  ".join(f"{n} {m*1e3:.1f}us" for n, m in med.items())
                  + f"  | rev/off {med['rev=True']/med['rev=False']:.3f}  torch/off {med['torch']/med['rev=False']:.3f} torch/rev {med['torch']/med['rev=True']:.3f}", flush=True)

"""Would launching each head's heaviest query tiles first help (issue #26, work ordering)?
Emulated without a kernel change: the query rows are permuted so that the index order of
the query tiles is the order of their listed-block counts, heaviest first (for causal
masks: each head's tiles from the last), and the block mask is built for the permuted
rows (its mask_mod reads one more table: a cost the emulation adds, not the order). Heads
still launch one after another, so programs in flight share a head's keys in L2.
Forward and forward+backward of flexattn in index order and in that order, beside
torch's flex, timed in turn; the permuted output is checked against the original's rows.

    PYTHONPATH=. python bench/experiments/lpt_emulation.py
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch
import flexattn
from flexattn import mods
from torch.nn.attention import flex_attention as tf
from bench_attention import document_ids
from _tuning import medians_in_turn
torch._dynamo.config.cache_size_limit = 1000
B, H = 4, 16
rows = []
fa = torch.compile(flexattn.flex_attention, fullgraph=True)
tfc = torch.compile(tf.flex_attention, fullgraph=True)
for S in (2048, 4096, 8192):
    for D in (64, 128):
        for name in ("doc_causal", "causal"):
            ids = document_ids(S, 8, "cuda")
            if name == "doc_causal":
                mm = flexattn.and_masks(mods.causal_mask, mods.document_mask(ids))
            elif name == "doc":
                mm = mods.document_mask(ids)
            else:
                mm = mods.causal_mask
            bm = flexattn.create_block_mask(mm, None, None, S, S, device="cuda")
            counts = bm.kv_num_blocks[0, 0] + (bm.full_kv_num_blocks[0, 0] if bm.full_kv_num_blocks is not None else 0)
            order = torch.sort(-counts, stable=True).indices
            pos = (order[:, None] * 128 + torch.arange(128, device="cuda")).flatten()
            mm_perm = lambda b, h, qi, kv, mm=mm, pos=pos: mm(b, h, pos[qi], kv)
            bm_perm = flexattn.create_block_mask(mm_perm, None, None, S, S, device="cuda")
            tbm = tf.create_block_mask(mm, None, None, S, S, device="cuda")
            q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
            qp = q.detach()[:, :, pos].requires_grad_()
            g = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
            o1 = fa(q, k, v, block_mask=bm); o2 = fa(qp, k, v, block_mask=bm_perm)
            err = (o2.float() - o1[:, :, pos].float()).abs().max().item()
            with torch.no_grad():
                f = medians_in_turn({"index": lambda: fa(q, k, v, block_mask=bm), "lpt": lambda: fa(qp, k, v, block_mask=bm_perm),
                                     "torch": lambda: tfc(q, k, v, block_mask=tbm)}, rounds=5)
            fb = medians_in_turn({"index": lambda: fa(q, k, v, block_mask=bm).backward(g), "lpt": lambda: fa(qp, k, v, block_mask=bm_perm).backward(g),
                                  "torch": lambda: tfc(q, k, v, block_mask=tbm).backward(g)}, rounds=5)
            rows.append(f"| {name} | {S} | {D} | {f['index']*1e3:.1f} | {f['lpt']*1e3:.1f} | {f['torch']*1e3:.1f} | {f['lpt']/f['index']:.3f} | {fb['index']*1e3:.1f} | {fb['lpt']*1e3:.1f} | {fb['torch']*1e3:.1f} | {fb['lpt']/fb['index']:.3f} | {err:.3g} |")
            print(rows[-1], flush=True)
print("| mask | S | D | fwd index us | fwd LPT us | fwd torch us | LPT/index | fwdbwd index us | fwdbwd LPT us | fwdbwd torch us | LPT/index | max diff |")
print("|" + " --- |" * 12)
print("\n".join(rows))

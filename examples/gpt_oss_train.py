"""A small gpt-oss-style model trained with flexattn: learned attention sinks, attention
dropout, grouped-query attention, sliding-window and full causal layers in turn.

The model: token embedding, ``layers`` blocks of (RMSNorm -> attention -> residual,
RMSNorm -> SwiGLU MLP -> residual), a final RMSNorm and an output projection. Attention:
grouped-query heads with rotary position embeddings; even layers see a causal sliding
window of ``--window`` tokens, odd layers every earlier token (gpt-oss alternates them);
each head has a learned sink logit (``flex_attention(..., sinks=)``: a key of value zero
in every row's softmax); training applies attention dropout (``dropout_p=``) inside the
kernels. Random weights from ``--seed``; nothing is downloaded.

What the script does:

1. Check (eval mode, no dropout): the logits and the gradient of every parameter, the
   sinks included, of the flexattn model against the same weights with dense attention
   (a masked softmax with the sink as one more column), in float64 (golden) and in the
   run's dtype (reference). Each passes when
   ``err(flexattn, golden) <= 2 * err(reference, golden) + floor(dtype)`` (flexattn's
   test rule).
2. Train: ``--steps`` AdamW steps with dropout on sequences of a toy language (each
   token determines the next through a fixed random permutation), the loss under
   ``torch.compile``. It passes when the loss falls below half its first value, the
   sinks moved, and the step compiled once (the dropout seed is an input of the graph).

The script prints both and exits 1 on a failure.

    python examples/gpt_oss_train.py                      # CPU, about a minute
    python examples/gpt_oss_train.py --tiny               # the test's size
    python examples/gpt_oss_train.py --device cuda --dtype bfloat16 --seq 1024 --dim 512 --steps 200
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import flexattn  # noqa: E402
from flexattn import mods  # noqa: E402

#: err(flexattn) <= RATIO * err(reference) + FLOOR[dtype], errors against float64.
RATIO = 2.0
FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 256
    dim: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    window: int = 32
    dropout: float = 0.1

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


def rotary(x: Tensor) -> Tensor:
    """Rotary position embedding of (B, H, S, D) by position along S (rotate-half form)."""
    S, D = x.shape[-2], x.shape[-1]
    inv_freq = 10000.0 ** (-torch.arange(0, D, 2, device=x.device, dtype=torch.float64) / D)
    angles = torch.arange(S, device=x.device, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = (torch.cat([t, t], -1).to(x.dtype) for t in (angles.cos(), angles.sin()))
    half = D // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


#: attend(q, k, v, layer, sinks, dropout_p) -> (B, H, S, D); q has H heads, k and v H_kv.
Attend = Callable[[Tensor, Tensor, Tensor, int, Tensor, float], Tensor]


def layer_mask(layer: int, window: int):
    """gpt-oss's alternation: a causal sliding window on even layers, full causal on odd."""
    return mods.sliding_window(window) if layer % 2 == 0 else mods.causal_mask


def flexattn_attend(cfg: Config, seq: int, device: torch.device) -> Attend:
    masks = [flexattn.create_block_mask(layer_mask(i, cfg.window), None, None, seq, seq, device=device)
             for i in range(min(cfg.layers, 2))]

    def attend(q, k, v, layer, sinks, dropout_p):
        return flexattn.flex_attention(q, k, v, block_mask=masks[layer % 2], sinks=sinks, enable_gqa=True,
                                       dropout_p=dropout_p)

    return attend


def dense_attend(cfg: Config, seq: int, device: torch.device) -> Attend:
    """Plain masked softmax with the sink as one more column (no dropout: the check runs in eval)."""
    masks = [flexattn.create_mask(layer_mask(i, cfg.window), 1, 1, seq, seq, device=device)[0, 0]
             for i in range(min(cfg.layers, 2))]

    def attend(q, k, v, layer, sinks, dropout_p):
        assert dropout_p == 0.0
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~masks[layer % 2], float("-inf"))
        sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        weights = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
        return weights @ v

    return attend


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: Config, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.q = nn.Linear(cfg.dim, cfg.heads * cfg.head_dim, bias=True)
        self.kv = nn.Linear(cfg.dim, 2 * cfg.kv_heads * cfg.head_dim, bias=True)
        self.out = nn.Linear(cfg.heads * cfg.head_dim, cfg.dim, bias=True)
        # One learned logit per head; gpt-oss initialises them near zero.
        self.sinks = nn.Parameter(torch.zeros(cfg.heads))

    def forward(self, x: Tensor, attend: Attend) -> Tensor:
        B, S, _ = x.shape
        cfg = self.cfg
        q = self.q(x).view(B, S, cfg.heads, cfg.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(B, S, 2 * cfg.kv_heads, cfg.head_dim).transpose(1, 2).chunk(2, dim=1)
        p = cfg.dropout if self.training else 0.0
        y = attend(rotary(q), rotary(k), v.contiguous(), self.layer, self.sinks, p)
        return self.out(y.transpose(1, 2).reshape(B, S, -1))


class Block(nn.Module):
    def __init__(self, cfg: Config, layer: int):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(cfg.dim), RMSNorm(cfg.dim)
        self.attn = Attention(cfg, layer)
        self.gate_up = nn.Linear(cfg.dim, 4 * cfg.dim, bias=False)
        self.down = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)

    def forward(self, x: Tensor, attend: Attend) -> Tensor:
        x = x + self.attn(self.norm1(x), attend)
        gate, up = self.gate_up(self.norm2(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


class Model(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: Tensor, attend: Attend) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, attend)
        return self.head(self.norm(x))


def toy_batch(perm: Tensor, batch: int, seq: int, gen: torch.Generator) -> Tensor:
    """Sequences of a toy language: a random first token, then each token's successor
    through ``perm`` (what the model can learn)."""
    tokens = torch.empty(batch, seq, dtype=torch.long)
    tokens[:, 0] = torch.randint(perm.numel(), (batch,), generator=gen)
    for i in range(1, seq):
        tokens[:, i] = perm[tokens[:, i - 1]]
    return tokens


def loss_of(model: Model, tokens: Tensor, attend: Attend) -> Tensor:
    logits = model(tokens[:, :-1], attend)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def check(model: Model, cfg: Config, tokens: Tensor, dtype: torch.dtype) -> dict:
    """Logits and parameter gradients of flexattn against dense attention (eval mode)."""
    seq = tokens.shape[1] - 1
    device = tokens.device
    runs = {}
    for name, run_dtype, make in (("flexattn", dtype, flexattn_attend), ("reference", dtype, dense_attend),
                                  ("golden", torch.float64, dense_attend)):
        copy = Model(cfg).to(device)
        copy.load_state_dict(model.state_dict())
        copy = copy.to(run_dtype).eval()
        logits = copy(tokens[:, :-1], make(cfg, seq, device))
        loss = F.cross_entropy(logits.double().reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        runs[name] = {"logits": logits.detach().double(),
                      **{n: (torch.zeros_like(p) if p.grad is None else p.grad).double()
                         for n, p in copy.named_parameters()}}
    worst = {"ratio": 0.0}
    failures = []
    for key, golden in runs["golden"].items():
        err = (runs["flexattn"][key] - golden).abs().max().item()
        err_ref = (runs["reference"][key] - golden).abs().max().item()
        bound = RATIO * err_ref + FLOOR[dtype] * max(1.0, golden.abs().max().item())
        if not err <= bound:
            failures.append(f"{key}: err {err:.3g} > bound {bound:.3g}")
        ratio = err / bound
        if ratio >= worst["ratio"]:
            worst = {"ratio": ratio, "tensor": key, "err": err, "err_reference": err_ref}
    return {"failures": failures, "worst": worst, "tensors": len(runs["golden"])}


def train(model: Model, cfg: Config, perm: Tensor, args, device: torch.device) -> dict:
    from torch._dynamo.utils import counters

    attend = flexattn_attend(cfg, args.seq, device)
    step_loss = torch.compile(lambda tokens: loss_of(model, tokens, attend), backend=args.backend, fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed + 1)
    sinks_before = [b.attn.sinks.detach().clone() for b in model.blocks]
    model.train()
    losses, graphs_after_first = [], None
    for step in range(args.steps):
        tokens = toy_batch(perm, args.batch, args.seq + 1, gen).to(device)
        loss = step_loss(tokens)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step == 0:
            graphs_after_first = counters["stats"]["unique_graphs"]
    recompiles = counters["stats"]["unique_graphs"] - graphs_after_first
    moved = max(float((b.attn.sinks.detach() - s).abs().max()) for b, s in zip(model.blocks, sinks_before))
    return {"losses": losses, "recompiles": recompiles, "sinks_moved": moved}


def run(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--tiny", action="store_true", help="the test's size: short sequences, few steps")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.tiny:
        args.seq, args.batch, args.dim, args.steps = 48, 4, 64, 30
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    cfg = Config(dim=args.dim, layers=args.layers, window=max(8, args.seq // 4))
    model = Model(cfg).to(device)
    # Sinks away from zero, so the check sees them matter.
    for block in model.blocks:
        block.attn.sinks.data.normal_()
    perm = torch.randperm(cfg.vocab, generator=torch.Generator().manual_seed(args.seed))
    tokens = toy_batch(perm, 2, args.seq + 1, torch.Generator().manual_seed(args.seed + 2)).to(device)
    checked = check(model, cfg, tokens, dtype)
    trained = train(model.to(dtype), cfg, perm, args, device)
    losses = trained["losses"]
    failures = list(checked["failures"])
    if not losses[-1] < 0.5 * losses[0]:
        failures.append(f"the loss did not halve: {losses[0]:.3f} -> {losses[-1]:.3f}")
    if trained["recompiles"]:
        failures.append(f"the training step recompiled {trained['recompiles']} time(s)")
    if not trained["sinks_moved"] > 0:
        failures.append("the sinks did not move")
    summary = {"ok": not failures, "failures": failures, "worst": checked["worst"], "tensors": checked["tensors"],
               "first_loss": losses[0], "last_loss": losses[-1], "recompiles": trained["recompiles"],
               "sinks_moved": trained["sinks_moved"]}
    worst = checked["worst"]
    print(f"check: {checked['tensors']} tensors (logits and every parameter's gradient) against float64, "
          f"worst {worst['tensor']} at {worst['ratio']:.2f} of its bound (err {worst['err']:.3g}, "
          f"reference {worst['err_reference']:.3g})")
    print(f"train: {args.steps} steps with dropout {cfg.dropout}, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
          f"recompiles after the first step: {trained['recompiles']}, sinks moved by up to "
          f"{trained['sinks_moved']:.3g}")
    for failure in failures:
        print(f"FAIL: {failure}")
    return summary


if __name__ == "__main__":
    sys.exit(0 if run()["ok"] else 1)

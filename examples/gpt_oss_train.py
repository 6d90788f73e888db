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
   test rule), with no NaN.
2. Dropout: in training mode the compiled loss repeats bitwise after the same
   ``torch.manual_seed`` and differs from call to call (a new mask each step).
3. Train: ``--steps`` AdamW steps with dropout on sequences that repeat a random
   ``PERIOD``-token pattern, the loss under ``torch.compile`` and counted where the next
   token is predictable. Only attention can predict it (each token is random given the
   one before), so it passes when the loss falls below half its first value, the sinks
   (not weight-decayed) moved, and the step compiled once.

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
#: The training sequences repeat a random pattern of this many tokens.
PERIOD = 4


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 16  # a toy vocabulary: the training task is about positions, not words
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
    # Small blocks on the CPU, so short sequences still have skipped, full and partial blocks.
    block = 16 if device.type == "cpu" else 128
    masks = [flexattn.create_block_mask(layer_mask(i, cfg.window), None, None, seq, seq, device=device,
                                        BLOCK_SIZE=block) for i in range(min(cfg.layers, 2))]

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


def toy_batch(vocab: int, batch: int, seq: int, gen: torch.Generator) -> Tensor:
    """Sequences that repeat a random pattern of PERIOD tokens: from position PERIOD on,
    the next token is the one PERIOD - 1 positions back, which only attention can see."""
    pattern = torch.randint(vocab, (batch, PERIOD), generator=gen)
    return pattern.repeat(1, -(-seq // PERIOD))[:, :seq]


def loss_of(model: Model, tokens: Tensor, attend: Attend) -> Tensor:
    """Next-token cross entropy over the positions whose next token is predictable."""
    logits = model(tokens[:, :-1], attend)[:, PERIOD - 1:]
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, PERIOD:].reshape(-1))


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
    worst = {"ratio": -1.0}
    failures = []
    for key, golden in runs["golden"].items():
        err = (runs["flexattn"][key] - golden).abs().max().item()
        err_ref = (runs["reference"][key] - golden).abs().max().item()
        bound = RATIO * err_ref + FLOOR[dtype]
        if not err <= bound:  # NaN fails too
            failures.append(f"{key}: err {err:.3g} > bound {bound:.3g}")
        ratio = err / bound if err == err else math.inf
        if ratio >= worst["ratio"]:
            worst = {"ratio": ratio, "tensor": key, "err": err, "err_reference": err_ref}
    return {"failures": failures, "worst": worst, "tensors": len(runs["golden"])}


def train(model: Model, cfg: Config, args, device: torch.device) -> dict:
    from torch._dynamo.utils import counters

    attend = flexattn_attend(cfg, args.seq, device)
    step_loss = torch.compile(lambda tokens: loss_of(model, tokens, attend), backend=args.backend, fullgraph=True)
    sinks = [b.attn.sinks for b in model.blocks]
    others = [p for p in model.parameters() if all(p is not s for s in sinks)]
    # No weight decay on the sinks (gpt-oss's choice), so only their gradient moves them.
    opt = torch.optim.AdamW([{"params": others}, {"params": sinks, "weight_decay": 0.0}], lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed + 1)
    sinks_before = [s.detach().clone() for s in sinks]
    model.train()
    graphs_before = counters["stats"]["unique_graphs"]
    # Dropout's mask: the same seed repeats it bitwise, the next call draws another.
    probe = toy_batch(cfg.vocab, args.batch, args.seq + 1, torch.Generator().manual_seed(args.seed + 3)).to(device)
    with torch.no_grad():
        torch.manual_seed(args.seed + 4)
        first = step_loss(probe)
        torch.manual_seed(args.seed + 4)
        again, other = step_loss(probe), step_loss(probe)
    dropout = {"repeats": bool(torch.equal(first, again)), "differs": not bool(torch.equal(first, other))}
    losses, graphs_after_first = [], None
    for step in range(args.steps):
        tokens = toy_batch(cfg.vocab, args.batch, args.seq + 1, gen).to(device)
        loss = step_loss(tokens)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step == 0:
            graphs_after_first = counters["stats"]["unique_graphs"]
    recompiles = counters["stats"]["unique_graphs"] - graphs_after_first
    moved = max(float((s.detach() - b).abs().max()) for s, b in zip(sinks, sinks_before))
    return {"losses": losses, "recompiles": recompiles, "sinks_moved": moved, "dropout": dropout,
            "compiled": graphs_after_first > graphs_before}


def run(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--tiny", action="store_true", help="the test's size: short sequences, few steps")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.tiny:
        args.seq, args.batch, args.dim, args.steps = 48, 8, 64, 150
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    cfg = Config(dim=args.dim, layers=args.layers, window=max(8, args.seq // 4))
    model = Model(cfg).to(device)
    # Sinks away from zero, so the check sees them matter.
    for block in model.blocks:
        block.attn.sinks.data.normal_()
    tokens = toy_batch(cfg.vocab, 2, args.seq + 1, torch.Generator().manual_seed(args.seed + 2)).to(device)
    checked = check(model, cfg, tokens, dtype)
    trained = train(model.to(dtype), cfg, args, device)
    losses = trained["losses"]
    failures = list(checked["failures"])
    if not trained["dropout"]["repeats"]:
        failures.append("dropout: the same seed did not repeat the loss")
    if not trained["dropout"]["differs"]:
        failures.append("dropout: two calls gave the same loss (no new mask)")
    if not trained["compiled"]:
        failures.append("the training step was not compiled")
    first, last = (sum(window) / len(window) for window in (losses[:10], losses[-10:]))
    if not last < 0.5 * first:
        failures.append(f"the loss did not halve: {first:.3f} -> {last:.3f} (means of the first and last ten steps)")
    if trained["recompiles"]:
        failures.append(f"the training step recompiled {trained['recompiles']} time(s)")
    if not trained["sinks_moved"] > 0:
        failures.append("the sinks did not move")
    summary = {"ok": not failures, "failures": failures, "worst": checked["worst"], "tensors": checked["tensors"],
               "first_loss": first, "last_loss": last, "recompiles": trained["recompiles"],
               "sinks_moved": trained["sinks_moved"], "dropout": trained["dropout"]}
    worst = checked["worst"]
    print(f"check: {checked['tensors']} tensors (logits and every parameter's gradient) against float64, "
          f"worst {worst['tensor']} at {worst['ratio']:.2f} of its bound (err {worst['err']:.3g}, "
          f"reference {worst['err_reference']:.3g})")
    print(f"dropout: the same seed repeats the loss: {trained['dropout']['repeats']}, the next call differs: "
          f"{trained['dropout']['differs']}")
    print(f"train: {args.steps} steps with dropout {cfg.dropout}, loss {first:.3f} -> {last:.3f} (first and last ten "
          f"steps), "
          f"recompiles after the first step: {trained['recompiles']}, sinks moved by up to "
          f"{trained['sinks_moved']:.3g}")
    for failure in failures:
        print(f"FAIL: {failure}")
    return summary


if __name__ == "__main__":
    sys.exit(0 if run()["ok"] else 1)

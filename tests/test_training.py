"""Training through flexattn: a small transformer under torch.compile learns with the
fused forward and backward kernels as it does with dense attention.

The model (pre-norm blocks, document masking plus causal, a learnable relative-position
bias per head) is trained three times from the same initial weights on the same batches:

* ``flexattn``: attention through ``flexattn.flex_attention``, the whole training step
  under ``torch.compile``, in the test precision: bf16 autocast on the GPU, float32 on
  the CPU (the Triton interpreter cannot run Inductor's bf16 kernels);
* ``reference``: the same model with plain masked-softmax attention (eager), in the
  test precision;
* ``golden``: the plain attention one precision up (float32 on the GPU, float64 on the
  CPU).

The loss curves must match within the test precision's noise: per step,
``|loss(flexattn) - golden| <= 3 * max_step |loss(reference) - golden| + floor``, and on
the GPU the run must actually learn (the final loss well below the first).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import flexattn
from flexattn import mods

import _harness as harness
from conftest import DEVICE

pytestmark = pytest.mark.usefixtures("flexattn_kernels")
ON_CUDA = DEVICE == "cuda"

# GPU: the 100-step run the backward issue asks for; CPU (Triton interpreter): a short
# run of a tiny model, which still checks every kernel of a training step.
STEPS = 100 if ON_CUDA else 3
VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = (128, 256, 4, 3, 512, 4) if ON_CUDA else (32, 32, 2, 1, 64, 2)
BLOCK = 128 if ON_CUDA else 32
LOSS_FLOOR = 2e-2 if ON_CUDA else 1e-4


def _doc_ids(seq: int) -> torch.Tensor:
    """Packed documents of uneven lengths (the last one runs to the end)."""
    cuts = [0, seq // 5, seq // 2 + 3, (4 * seq) // 5]
    ids = torch.zeros(seq, dtype=torch.int64)
    for i, start in enumerate(cuts):
        ids[start:] = i
    return ids.to(DEVICE)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.proj = nn.Linear(DIM, DIM, bias=False)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.bias = nn.Parameter(torch.randn(HEADS, 2 * SEQ - 1) * 0.1)

    def forward(self, x, attention):
        B, S, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, S, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        x = x + self.proj(attention(q, k, v, self.bias).transpose(1, 2).reshape(B, S, DIM))
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens, attention):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, attention)
        return self.head(x)


def flex_attention_of(doc_ids):
    mask_mod = flexattn.and_masks(mods.document_mask(doc_ids), mods.causal_mask)
    block_mask = flexattn.create_block_mask(mask_mod, None, None, SEQ, SEQ, device=DEVICE, BLOCK_SIZE=BLOCK)

    def attention(q, k, v, bias):
        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bias[h, q_idx - kv_idx + SEQ - 1]

        return flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)

    return attention


def dense_attention_of(doc_ids):
    pos = torch.arange(SEQ, device=DEVICE)
    allowed = (doc_ids[:, None] == doc_ids[None, :]) & (pos[:, None] >= pos[None, :])
    rel = pos[:, None] - pos[None, :] + SEQ - 1

    def attention(q, k, v, bias):
        scores = (q @ k.transpose(-1, -2)).float() / math.sqrt(q.shape[-1]) + bias[:, rel]
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        return probs.to(v.dtype) @ v

    return attention


def _batches(gen):
    """A learnable task: each sequence repeats a random motif, so the next token is
    predictable from the context of its own document."""
    batches = []
    for _ in range(STEPS):
        period = int(torch.randint(3, 9, (), generator=gen))
        motif = torch.randint(0, VOCAB, (BATCH, period), generator=gen)
        tokens = motif.repeat(1, SEQ // period + 2)[:, : SEQ + 1]
        batches.append(tokens.to(DEVICE))
    return batches


def _train(model, attention, batches, low_precision: bool, compile_step: bool) -> list[float]:
    """Per-step losses. ``low_precision``: the test precision (see the module doc), else
    the golden one."""
    autocast = low_precision and ON_CUDA
    if not low_precision and not ON_CUDA:
        model = model.double()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)

    def step(tokens):
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            logits = model(tokens[:, :-1], attention)
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        return loss

    if compile_step:
        step = torch.compile(step)
    losses = []
    for tokens in batches:
        opt.zero_grad(set_to_none=True)
        losses.append(float(step(tokens)))
        opt.step()
    return losses


@pytest.mark.workflow
def test_loss_curve_matches_dense_reference():
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    init = Model().to(DEVICE)
    batches = _batches(gen)
    doc_ids = _doc_ids(SEQ)

    def fresh():
        model = Model().to(DEVICE)
        model.load_state_dict(init.state_dict())
        return model

    golden = _train(fresh(), dense_attention_of(doc_ids), batches, low_precision=False, compile_step=False)
    reference = _train(fresh(), dense_attention_of(doc_ids), batches, low_precision=True, compile_step=False)
    flex_model = fresh()
    ours = _train(flex_model, flex_attention_of(doc_ids), batches, low_precision=True, compile_step=True)

    assert all(math.isfinite(x) for x in ours), f"non-finite loss: {ours}"
    curves = [torch.tensor(c, dtype=torch.float64) for c in (ours, reference, golden)]
    harness.check_three_way(f"loss curve (flexattn {ours[:3]}...{ours[-3:]}, golden {golden[:3]}...{golden[-3:]})",
                            *curves, ratio=3.0, floor=LOSS_FLOOR)
    if ON_CUDA:
        assert ours[-1] < 0.5 * ours[0], f"the model did not learn: {ours[0]:.3f} -> {ours[-1]:.3f}"
    # The relative bias learns through the kernel's captured-tensor gradients.
    for block, init_block in zip(flex_model.blocks, init.blocks):
        assert not torch.equal(block.bias, init_block.bias)


@pytest.mark.workflow
@pytest.mark.parametrize("policy", ["save_attention", "recompute_attention"])
def test_selective_activation_checkpointing(policy):
    """torch.utils.checkpoint's selective checkpointing sees the operator as one op: saved
    when listed in ops_to_save, recomputed under a policy that prefers recomputing it;
    eager and compiled gradients equal the unchecked ones."""
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    from flexattn._hop import flex_attention_hop

    gen = harness.generator(2)
    proj = nn.Linear(32, 96).to(DEVICE)
    x = harness.randn(gen, 2, 64, 32, requires_grad=True)
    mask = flexattn.create_block_mask(mods.causal_mask, None, None, 64, 64, device=DEVICE, BLOCK_SIZE=16)

    def attend(x):
        q, k, v = (t.view(2, 64, 2, 16).transpose(1, 2) for t in proj(x).split(32, dim=2))
        return flexattn.flex_attention(q, k, v, block_mask=mask).transpose(1, 2).reshape(2, 64, 32)

    if policy == "save_attention":
        context_fn = lambda: create_selective_checkpoint_contexts([flex_attention_hop])  # noqa: E731
    else:
        def prefer_recompute(ctx, op, *args, **kwargs):
            return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

        context_fn = lambda: create_selective_checkpoint_contexts(prefer_recompute)  # noqa: E731

    def checkpointed(x):
        return checkpoint(attend, x, use_reentrant=False, context_fn=context_fn)

    (expected,) = torch.autograd.grad(attend(x).square().sum(), x)
    for fn in (checkpointed, torch.compile(checkpointed)):
        (grad,) = torch.autograd.grad(fn(x).square().sum(), x)
        torch.testing.assert_close(grad, expected, atol=1e-4, rtol=1e-4)

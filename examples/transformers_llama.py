"""flexattn as a Hugging Face transformers attention implementation, on a tiny Llama.

One line makes flexattn an ``attn_implementation`` of transformers (its attention
function and its mask function, registered together):

    import flexattn.integrations.transformers
    flexattn.integrations.transformers.register()  # attn_implementation="flexattn"

The script builds a tiny ``LlamaForCausalLM`` with random weights (nothing is downloaded)
twice from the same weights, once with transformers' own ``"eager"`` attention and once
with ``"flexattn"``, and on a batch of prompts with a left-padded row:

1. generates ``--new-tokens`` tokens greedily with both: the tokens must be equal;
2. takes one SGD training step with both (the loss transformers computes from
   ``labels``, without the padding): the losses, every parameter's gradient and the loss
   after the step must agree with eager's to within ``TOLERANCE`` (relative to the
   largest gradient for the gradients).

It prints what it compared and exits 1 on a mismatch.

    python examples/transformers_llama.py                  # CPU, well under a minute
    python examples/transformers_llama.py --device cuda
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import transformers  # noqa: E402

import flexattn.integrations.transformers  # noqa: E402

#: float32 agreement with eager attention: the two differ only in summation order.
TOLERANCE = 1e-4
VOCAB = 128
PAD = 0


def tiny_llama(attn_implementation: str) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, pad_token_id=PAD,
        attn_implementation=attn_implementation)
    return transformers.LlamaForCausalLM(config)


def prompts(batch: int, length: int, device: str, generator: torch.Generator):
    """Token ids (batch, length) and attention mask; row i is left-padded by 3 * i."""
    ids = torch.randint(1, VOCAB, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(batch):
        ids[row, :3 * row] = PAD
        mask[row, :3 * row] = 0
    return ids.to(device), mask.to(device)


def training_step(model, ids, mask):
    """(loss, gradients, loss after one SGD step) of next-token prediction on the batch.
    Neither padding nor what padding predicts (a padded query sees no key: eager's
    softmax spreads it over every key, flexattn's gives 0) counts in the loss."""
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1:].masked_fill_(mask[:, :-1] == 0, -100)
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    with torch.no_grad():
        after = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    return loss.item(), grads, after.item()


def run(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=3)
    parser.add_argument("--prompt-length", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    name = flexattn.integrations.transformers.register()
    torch.manual_seed(args.seed)
    eager = tiny_llama("eager").to(args.device)
    flex = tiny_llama(name).to(args.device)
    flex.load_state_dict(eager.state_dict())
    ids, mask = prompts(args.batch, args.prompt_length, args.device, torch.Generator().manual_seed(args.seed + 1))

    generated = {}
    for label, model in (("eager", eager), ("flexattn", flex)):
        model.eval()
        generated[label] = model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                                          min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=PAD)
    same_tokens = torch.equal(generated["eager"], generated["flexattn"])
    print(f"generate: {args.batch} prompts of {args.prompt_length} (left-padded), {args.new_tokens} new tokens; "
          f"flexattn's equal eager's: {same_tokens}")

    loss_e, grads_e, after_e = training_step(eager, ids, mask)
    loss_f, grads_f, after_f = training_step(flex, ids, mask)
    scale = max(g.abs().max().item() for g in grads_e.values())
    grad_err = max((grads_f[n] - g).abs().max().item() for n, g in grads_e.items()) / scale
    print(f"training step: loss eager {loss_e:.6f} flexattn {loss_f:.6f}; largest gradient difference "
          f"{grad_err:.1e} of the largest gradient; loss after the step eager {after_e:.6f} flexattn {after_f:.6f}")

    ok = (same_tokens and abs(loss_f - loss_e) <= TOLERANCE and grad_err <= TOLERANCE
          and abs(after_f - after_e) <= TOLERANCE and after_e < loss_e)
    print("OK" if ok else "MISMATCH")
    return {"ok": ok, "same_tokens": same_tokens, "generated": generated["flexattn"][:, args.prompt_length:].tolist(),
            "loss": (loss_e, loss_f), "grad_err": grad_err, "loss_after": (after_e, after_f)}


def main(argv: list[str] | None = None) -> int:
    return 0 if run(argv)["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

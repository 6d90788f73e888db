"""A real client: transformers' gpt-oss architecture (learned attention sinks, sliding
window on every other layer, GQA) with flexattn as its attention, against transformers'
own eager attention, for logits and every gradient (the sinks' included).

flexattn is registered as an attention implementation (``AttentionInterface``) that
passes the layer's sinks to ``flex_attention(..., sinks=)``; its masks are the ones
transformers builds for torch's flex_attention (torch BlockMasks, which flexattn takes
as they are). Runs where transformers is installed (the CPU CI installs it).
"""

from __future__ import annotations

import pytest
import torch

import flexattn

transformers = pytest.importorskip("transformers")
from transformers import AttentionInterface, AttentionMaskInterface  # noqa: E402
from transformers.masking_utils import flex_attention_mask  # noqa: E402

from conftest import DEVICE  # noqa: E402

pytestmark = pytest.mark.usefixtures("inductor_runs_flexattn_kernels")


def flexattn_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, s_aux=None,
                       **kwargs):
    """transformers' attention-function contract: (B, H, L, D) in, (B, L, H, D) out."""
    if dropout:
        raise ValueError("this client test runs without attention dropout")
    out = flexattn.flex_attention(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=True,
                                  sinks=s_aux)
    return out.transpose(1, 2).contiguous(), None


def _tiny_gpt_oss(attn_implementation: str):
    config = transformers.GptOssConfig(
        vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        max_position_embeddings=64, layer_types=["sliding_attention", "full_attention"],
        attn_implementation=attn_implementation)
    return transformers.GptOssForCausalLM(config).to(DEVICE)


def test_gpt_oss_matches_eager_attention():
    AttentionInterface.register("flexattn", flexattn_attention)
    AttentionMaskInterface.register("flexattn", flex_attention_mask)
    torch.manual_seed(0)
    eager = _tiny_gpt_oss("eager")
    with torch.no_grad():  # random sinks: transformers starts them at zero
        for layer in eager.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    flex = _tiny_gpt_oss("flexattn")
    flex.load_state_dict(eager.state_dict())
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1)).to(DEVICE)

    results = []
    for model in (eager, flex):
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.roll(-1, 1).flatten())
        loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        results.append((logits.detach(), grads))
    (eager_logits, eager_grads), (flex_logits, flex_grads) = results
    torch.testing.assert_close(flex_logits, eager_logits, atol=1e-4, rtol=1e-4)
    assert eager_grads.keys() == flex_grads.keys()
    assert any(name.endswith("self_attn.sinks") for name in flex_grads)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(flex_grads[name], grad, atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")

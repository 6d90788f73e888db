"""flexattn as a Hugging Face transformers attention implementation
(flexattn.integrations.transformers): ``register()`` once, then
``attn_implementation="flexattn"``.

Tiny random-weight models of three families, each against transformers' own eager
attention: Llama (GQA), Gemma 2 (logit soft-capping, a sliding window on every other
layer) and gpt-oss (learned attention sinks, a sliding window on every other layer, GQA,
mixture of experts). The logits and every parameter's gradient pass DESIGN.md's
three-way bound (eager attention in float64 as golden, eager in float32 as reference,
flexattn in float32 under test), on a batch with a left-padded row; greedy ``generate``
gives eager's tokens exactly, on padded and unpadded batches. Also: torch's own
BlockMasks (transformers' ``flex_attention_mask``) work, dropout is flexattn's, the model
runs under torch.compile, 4-D masks passed by the caller work, and an attention function
registered without its mask function fails loudly instead of attending to the future.

The golden run is the models' code in float64 with ``golden_attention``: eager's math
with its softmax in the inputs' dtype (eager's own runs the softmax in float32, which
would make a float64 run no golden). On the CPU every test runs on the C++ engine (the
path CPU users get; the Triton kernels' numerics have their own tests), on a GPU on the
Triton kernels.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AttentionInterface, AttentionMaskInterface  # noqa: E402

import flexattn.integrations.transformers as flexattn_hf  # noqa: E402
from flexattn import _compat  # noqa: E402
from _harness import ATOL_FLOOR, check_three_way  # noqa: E402
from conftest import DEVICE  # noqa: E402

pytestmark = pytest.mark.workflow

NAME = flexattn_hf.register()
GOLDEN = "flexattn_test_golden"
VOCAB = 96
PROMPT = 20
DTYPE = torch.float32


def golden_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None,
                     s_aux=None, **kwargs):
    """transformers' eager attention (GQA, soft-capping, the additive eager mask, sinks as
    one more softmax column) with every step in the inputs' dtype."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = query @ key.transpose(2, 3) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if attention_mask is not None:
        scores = scores + attention_mask[..., :key.shape[-2]]
    if s_aux is not None:
        scores = torch.cat([scores, s_aux.reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)], dim=-1)
    probabilities = scores.softmax(dim=-1)[..., :key.shape[-2]]
    return (probabilities @ value).transpose(1, 2).contiguous(), probabilities


AttentionInterface.register(GOLDEN, golden_attention)
AttentionMaskInterface.register(GOLDEN, AttentionMaskInterface._global_mapping["eager"])


# --------------------------------------------------------------------------------------
# Tiny models
# --------------------------------------------------------------------------------------
def _llama_config(**extra):
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0, **extra)


def _gemma2_config(**extra):
    # Scaling 1 (query_pre_attn_scalar=1) on the enlarged q/k weights: scores of a few units, which a cap of 1 bends.
    return transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, query_pre_attn_scalar=1,
        attn_logit_softcapping=1.0, final_logit_softcapping=None, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=0, **extra)


def _gpt_oss_config(**extra):
    # Eager experts: transformers 5 defaults to grouped_mm, which has no float64.
    return transformers.GptOssConfig(experts_implementation="eager",
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=0, **extra)


FAMILIES = {
    "llama": (_llama_config, transformers.LlamaForCausalLM),
    "gemma2": (_gemma2_config, transformers.Gemma2ForCausalLM),
    "gpt_oss": (_gpt_oss_config, transformers.GptOssForCausalLM),
}


def _model(family: str, attn_implementation: str, **extra):
    make_config, cls = FAMILIES[family]
    model = cls(make_config(attn_implementation=attn_implementation, **extra))
    assert model.config._attn_implementation == attn_implementation
    return model


def _eager_and_flex(family: str, **extra):
    """(eager, flexattn) models with the same random weights, in float32 on DEVICE; gpt-oss
    sinks drawn at random (transformers starts them at zero, where they change little)."""
    torch.manual_seed(0)
    eager = _model(family, "eager", **extra)
    with torch.no_grad():
        for name, p in eager.named_parameters():
            if name.endswith("self_attn.sinks"):
                p.normal_(0.0, 2.0)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)  # attention scores of a few units, so the mask and the mods matter
    flex = _model(family, NAME, **extra)
    flex.load_state_dict(eager.state_dict())
    return eager.to(DEVICE, DTYPE), flex.to(DEVICE, DTYPE)


def _batch(length: int, padded: bool = True):
    """Token ids (2, length) and their attention mask; the second row left-padded by 3."""
    ids = torch.randint(1, VOCAB, (2, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, length, dtype=torch.long)
    if padded:
        mask[1, :3] = 0
        ids[1, :3] = 0
    return ids.to(DEVICE), mask.to(DEVICE)


def _forward_backward(model, ids, mask, grad_logits):
    """Logits and every parameter's gradient of <logits, grad_logits> (zero at padded
    positions: a fully masked query row is 0 under flexattn and uniform under eager, and
    no real token reads it)."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask).logits
    logits.backward(grad_logits.to(logits.dtype))
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


# --------------------------------------------------------------------------------------
# Logits and gradients against eager attention
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_gradients_within_the_three_way_bound(family, flexattn_kernels):
    eager, flex = _eager_and_flex(family)
    golden_model = _model(family, GOLDEN).to(DEVICE, torch.float64)
    golden_model.load_state_dict(eager.state_dict())
    ids, mask = _batch(PROMPT)
    valid = mask.bool()
    grad_logits = torch.randn(2, PROMPT, VOCAB, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    grad_logits[~valid] = 0
    for model in (eager, flex, golden_model):
        model.train()
    golden = _forward_backward(golden_model, ids, mask, grad_logits)
    ref = _forward_backward(eager, ids, mask, grad_logits)
    test = _forward_backward(flex, ids, mask, grad_logits)

    check_three_way("logits", test[0][valid], ref[0][valid], golden[0][valid], DTYPE)
    assert test[1].keys() == ref[1].keys() == golden[1].keys()
    if family == "gpt_oss":
        assert any(name.endswith("self_attn.sinks") for name in test[1])
    for name in golden[1]:
        check_three_way(f"grad {name}", test[1][name], ref[1][name], golden[1][name], DTYPE)


@pytest.mark.parametrize("family, feature", [("gemma2", "attn_logit_softcapping"), ("gpt_oss", "sinks"),
                                             ("gpt_oss", "sliding_window"), ("llama", "padding")])
def test_each_feature_moves_the_logits(family, feature):
    """The three-way test can fail: dropping any one feature from eager attention moves
    the logits far past the bound that flexattn meets."""
    eager, _ = _eager_and_flex(family)
    ids, mask = _batch(PROMPT)
    valid = mask.bool()
    with torch.no_grad():
        base = eager(input_ids=ids, attention_mask=mask).logits
        if feature == "attn_logit_softcapping":
            for layer in eager.model.layers:
                layer.self_attn.attn_logit_softcapping = None
        elif feature == "sinks":
            for layer in eager.model.layers:
                layer.self_attn.sinks.fill_(-1e4)
        elif feature == "sliding_window":
            eager.config.sliding_window = 10_000
        else:
            mask = torch.ones_like(mask)
        changed = eager(input_ids=ids, attention_mask=mask).logits
    assert (changed - base)[valid].abs().max() > 100 * ATOL_FLOOR[DTYPE]


def test_torch_block_masks_from_transformers_own_mask_function(flexattn_kernels):
    """The attention function takes torch's BlockMasks as they are: with transformers'
    own flex_attention_mask registered beside it, gpt-oss's logits and gradients (the
    sinks' included) match eager attention."""
    from transformers.masking_utils import flex_attention_mask

    name = "flexattn_torch_masks"
    AttentionInterface.register(name, flexattn_hf.attention_forward)
    AttentionMaskInterface.register(name, flex_attention_mask)
    eager, flex = _eager_and_flex("gpt_oss")
    flex.config._attn_implementation = name
    flex.model.config._attn_implementation = name
    ids, _ = _batch(PROMPT, padded=False)
    results = []
    for model in (eager, flex):
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.roll(-1, 1).flatten())
        loss.backward()
        results.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (eager_logits, eager_grads), (flex_logits, flex_grads) = results
    torch.testing.assert_close(flex_logits, eager_logits, atol=1e-4, rtol=1e-4)
    assert eager_grads.keys() == flex_grads.keys()
    assert any(n.endswith("self_attn.sinks") for n in flex_grads)
    for n, grad in eager_grads.items():
        torch.testing.assert_close(flex_grads[n], grad, atol=1e-4, rtol=1e-4, msg=lambda m: f"{n}: {m}")


# --------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_generate_matches_eager_token_for_token(family, flexattn_kernels):
    """Prompts of 12 (past the sliding window of 6, so the windowed cache layers hold
    offsets), 6 new tokens, on a batch with a left-padded row and on one without, with
    transformers' default (growing) cache and with a static one. With the static cache
    the masks are built before each forward and every step has the same shapes: the
    operator compiles once per layer type for the prompt and once for the steps, not
    once a token."""
    eager, flex = _eager_and_flex(family)
    for model in (eager, flex):
        model.eval()
    layer_types = len(set(getattr(flex.config, "layer_types", None) or ["full_attention"]))
    for padded, cache in ((True, None), (False, None), (True, "static")):
        ids, mask = _batch(12, padded)
        generate = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        expected = eager.generate(ids, **generate)
        graphs = _compat.compiled_graph_count()
        got = flex.generate(ids, cache_implementation=cache, **generate)
        assert got.shape == (2, 18)
        assert torch.equal(got, expected), f"padded={padded} cache={cache}:\n{got[:, 12:]}\n!= eager\n{expected[:, 12:]}"
        if cache == "static":
            compiled = _compat.compiled_graph_count() - graphs
            if compiled > 2 * layer_types and family == "gpt_oss" and DEVICE == "cuda":
                pytest.xfail(f"gpt-oss with a static cache compiles {compiled} graphs over 6 steps on the GPU "
                             "(seen on an H200; the cause is not found yet: open work)")
            assert compiled <= 2 * layer_types


# --------------------------------------------------------------------------------------
# Dropout, torch.compile, 4-D masks
# --------------------------------------------------------------------------------------
def test_dropout_is_flexattns(flexattn_kernels):
    """Llama with attention_dropout trains through flexattn's fused dropout: the same
    seed repeats a step bitwise, another seed differs, gradients are finite, and eval
    mode drops nothing (eager's logits)."""
    eager, flex = _eager_and_flex("llama", attention_dropout=0.5)
    ids, mask = _batch(PROMPT)
    valid = mask.bool()
    flex.train()
    runs = []
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        runs.append(flex(input_ids=ids, attention_mask=mask).logits)
    runs[0][valid].square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in flex.parameters() if p.grad is not None)
    assert torch.equal(runs[0], runs[1])
    assert not torch.allclose(runs[0], runs[2])
    flex.eval()
    eager.eval()
    with torch.no_grad():
        kept = flex(input_ids=ids, attention_mask=mask).logits[valid]
        torch.testing.assert_close(kept, eager(input_ids=ids, attention_mask=mask).logits[valid],
                                   atol=1e-5, rtol=1e-5)
    assert not torch.allclose(runs[0][valid], kept)


def test_whole_model_under_torch_compile(flexattn_kernels):
    """The whole Gemma 2 model (soft-capping, sliding window, padding) under
    torch.compile(fullgraph=True): the mask is built and the attention runs inside the
    one compiled graph."""
    eager, flex = _eager_and_flex("gemma2")
    ids, mask = _batch(PROMPT)
    valid = mask.bool()
    compiled = torch.compile(flex, fullgraph=True)
    with torch.no_grad():
        expected = eager(input_ids=ids, attention_mask=mask).logits
        got = compiled(input_ids=ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(got[valid], expected[valid], atol=1e-5, rtol=1e-5)


def test_attention_function_under_torch_compile_fullgraph(flexattn_kernels):
    """attention_forward itself traces in one graph with a mask from create_mask,
    soft-capping, sinks and GQA."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 19, 16, generator=gen).to(DEVICE)
    k, v = (torch.randn(2, 2, 19, 16, generator=gen).to(DEVICE) for _ in range(2))
    sinks = torch.randn(4, generator=gen).to(DEVICE)
    padding = torch.ones(2, 19, dtype=torch.bool, device=DEVICE)
    padding[1, :4] = False
    layer = torch.nn.Module()
    layer.is_causal = True

    def attend(q, k, v):
        block_mask = flexattn_hf.create_mask(2, kv_length=19, q_length=19, attention_mask=padding, device=DEVICE)
        return flexattn_hf.attention_forward(layer, q, k, v, block_mask, scaling=0.5, softcap=2.0, s_aux=sinks)[0]

    expected = attend(q, k, v)
    got = torch.compile(attend, fullgraph=True)(q, k, v)
    torch.testing.assert_close(got[:, 4:], expected[:, 4:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[0], expected[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["float", "bool"])
def test_four_d_mask_from_the_caller(kind, flexattn_kernels):
    """A 4-D mask passed to the model goes to the attention function as it is: a float
    one is added to the scores, a bool one (True attends) becomes a BlockMask."""
    eager, flex = _eager_and_flex("llama")
    ids, _ = _batch(PROMPT, padded=False)
    allowed = torch.ones(PROMPT, PROMPT, dtype=torch.bool, device=DEVICE).tril()
    allowed[:, 0] = False  # nobody sees the first token
    allowed[0, 0] = True
    additive = torch.zeros(PROMPT, PROMPT, device=DEVICE).masked_fill(~allowed, torch.finfo(DTYPE).min)
    if kind == "float":
        additive = additive + 0.25 * torch.arange(PROMPT, device=DEVICE)  # a bias as well as a mask
    with torch.no_grad():
        expected = eager(input_ids=ids, attention_mask=additive[None, None].expand(2, 1, -1, -1)).logits
        mask = additive if kind == "float" else allowed
        got = flex(input_ids=ids, attention_mask=mask[None, None].expand(2, 1, -1, -1)).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------
# The attention function registered alone, registration, imports
# --------------------------------------------------------------------------------------
def test_attention_function_alone_raises_instead_of_attending_to_the_future():
    """AttentionInterface.register alone: transformers builds no mask, and the
    attention function refuses the causal layer's multi-query call, naming the fix."""
    AttentionInterface.register("flexattn_without_mask", flexattn_hf.attention_forward)
    model = _model("llama", "flexattn_without_mask").to(DEVICE)
    ids, _ = _batch(PROMPT, padded=False)
    with pytest.raises(RuntimeError, match=r"no attention mask.*LlamaAttention.*register\(name\)"):
        model(input_ids=ids)


def test_no_mask_is_fine_for_one_query_or_a_bidirectional_layer():
    gen = torch.Generator().manual_seed(6)
    layer = torch.nn.Module()
    layer.is_causal = True
    q = torch.randn(1, 2, 1, 16, generator=gen).to(DEVICE)
    k, v = (torch.randn(1, 2, 9, 16, generator=gen).to(DEVICE) for _ in range(2))
    out, weights = flexattn_hf.attention_forward(layer, q, k, v, None)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert weights is None
    torch.testing.assert_close(out, expected.transpose(1, 2), atol=1e-5, rtol=1e-5)
    q = torch.randn(1, 2, 9, 16, generator=gen).to(DEVICE)
    with pytest.raises(RuntimeError, match="no attention mask"):
        flexattn_hf.attention_forward(layer, q, k, v, None)
    out, _ = flexattn_hf.attention_forward(layer, q, k, v, None, is_causal=False)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, expected.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_register_checks_its_name():
    assert flexattn_hf.register() == "flexattn"  # again: harmless
    assert flexattn_hf.register("flexattn_second") == "flexattn_second"
    with pytest.raises(ValueError, match="already transformers'"):
        flexattn_hf.register("sdpa")
    with pytest.raises(TypeError, match="must be a str, got int"):
        flexattn_hf.register(3)
    with pytest.raises(ValueError, match="non-empty"):
        flexattn_hf.register("")


def test_head_mask_is_refused():
    q = torch.randn(1, 2, 4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="head_mask"):
        flexattn_hf.attention_forward(torch.nn.Module(), q, q, q, None, head_mask=torch.ones(2, device=DEVICE))


def test_register_without_transformers_raises_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"needs Hugging Face transformers 4.57 or newer.*pip install"):
        flexattn_hf.register()


def test_importing_flexattn_and_the_integration_does_not_import_transformers():
    probe = ("import sys, flexattn, flexattn.integrations.transformers; "
             "print('transformers' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True)
    assert result.stdout.strip().splitlines()[-1] == "False"


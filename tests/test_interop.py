"""Code written for torch's FlexAttention passes its own objects and options unchanged:
torch's BlockMask and AuxRequest, the BACKEND key, FlexKernelOptions, NumPy lengths, and
return_lse's deprecation warning."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex

import flexattn
from flexattn import mods

from conftest import DEVICE


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _qkv(L=128, E=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, L, E, generator=g).to(DEVICE) for _ in range(3)]


def test_torch_block_mask_and_aux_request():
    q, k, v = _qkv()
    theirs = torch_flex.create_block_mask(_causal, 1, 1, 128, 128, device=DEVICE, BLOCK_SIZE=64)
    ours = flexattn.create_block_mask(_causal, 1, 1, 128, 128, device=DEVICE, BLOCK_SIZE=64)
    out, aux = flexattn.flex_attention(q, k, v, block_mask=theirs, return_aux=torch_flex.AuxRequest(lse=True))
    expected, expected_aux = flexattn.flex_attention(q, k, v, block_mask=ours,
                                                     return_aux=flexattn.AuxRequest(lse=True))
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(aux.lse, expected_aux.lse)
    assert aux.max_scores is None


def test_backend_key():
    q, k, v = _qkv(L=1)
    k, v = (torch.randn(1, 2, 512, 16, device=DEVICE) for _ in range(2))
    expected = flexattn.flex_attention(q, k, v)
    for backend in ("AUTO", "TRITON", "TRITON_DECODE"):
        torch.testing.assert_close(flexattn.flex_attention(q, k, v, kernel_options={"BACKEND": backend}), expected,
                                   atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="BACKEND='FLASH'.*does not have"):
        flexattn.flex_attention(q, k, v, kernel_options={"BACKEND": "FLASH"})
    with pytest.raises(ValueError, match="BACKEND must be one of"):
        flexattn.flex_attention(q, k, v, kernel_options={"BACKEND": "CUDNN"})
    with pytest.raises(RuntimeError, match="BACKEND cannot be combined with FORCE_USE_FLEX_ATTENTION"):
        flexattn.flex_attention(q, k, v, kernel_options={"BACKEND": "TRITON", "FORCE_USE_FLEX_ATTENTION": True})
    with pytest.raises(ValueError, match="contradict"):
        flexattn.flex_attention(q, k, v, kernel_options={"BACKEND": "TRITON", "FORCE_DECODE": True})


def test_backend_picks_the_kernel():
    from flexattn.lowering.decode_plan import wants_decode_kernel

    assert wants_decode_kernel(1, 512, {"BACKEND": "AUTO"})
    assert not wants_decode_kernel(1, 512, {"BACKEND": "TRITON"})
    assert wants_decode_kernel(512, 512, {"BACKEND": "TRITON_DECODE"})


def test_flex_kernel_options_type():
    options: flexattn.FlexKernelOptions = {"BLOCK_M": 64, "PRESCALE_QK": True}
    assert set(flexattn.FlexKernelOptions.__annotations__) >= {"BLOCK_M", "bwd_BLOCK_M1", "BACKEND", "USE_TMA"}
    assert "DEFAULT_MASK" not in flexattn.FlexKernelOptions.__annotations__
    q, k, v = _qkv()
    flexattn.flex_attention(q, k, v, kernel_options=options)


def test_numpy_lengths():
    mask = flexattn.create_block_mask(mods.causal_mask, np.int64(1), None, np.int32(100), np.int64(130),
                                      device=DEVICE)
    assert mask.seq_lengths == (100, 130) and type(mask.seq_lengths[0]) is int
    with pytest.raises(ValueError, match="Q_LEN must be a non-negative int"):
        flexattn.create_block_mask(mods.causal_mask, 1, 1, np.float32(100), 100, device=DEVICE)


def test_return_lse_warns_like_torch():
    """Every return_lse call warns (code that clears torch's shown-warnings set sees it
    again); Python's default filter shows it once per calling line."""
    q, k, v = _qkv()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flexattn.flex_attention(q, k, v, return_lse=True)
        flexattn.flex_attention(q, k, v, return_lse=True)
    assert [w.category for w in caught if "return_lse" in str(w.message)] == [FutureWarning] * 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(2):
            flexattn.flex_attention(q, k, v, return_lse=True)
    assert len([w for w in caught if "return_lse" in str(w.message)]) == 1


def test_eager_mods_runs_mods_as_python(capsys, monkeypatch):
    """Inside flexattn.eager_mods() a call outside torch.compile compiles nothing and its
    mods run as Python: a print inside score_mod prints."""
    q, k, v = _qkv(L=16)

    def noisy(score, b, h, q_idx, kv_idx):
        print("score_mod ran")
        return score * 2

    def no_compile(backend):
        raise AssertionError("eager_mods compiled the operator")

    monkeypatch.setattr(flexattn.api, "_compiled_hop", no_compile)
    with flexattn.eager_mods():
        out = flexattn.flex_attention(q, k, v, score_mod=noisy)
    assert "score_mod ran" in capsys.readouterr().out
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=2 / 4)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_eager_mods_differentiates_captured_tensors():
    """Under eager_mods a tensor the score_mod closes over gets its gradient, as in a
    compiled call."""
    q, k, v = _qkv(L=16)
    bias = torch.randn(16, device=DEVICE, requires_grad=True)

    def shifted(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx] * q_idx

    with flexattn.eager_mods():
        (got,) = torch.autograd.grad(flexattn.flex_attention(q, k, v, score_mod=shifted).square().sum(), bias)
    (want,) = torch.autograd.grad(flexattn.flex_attention(q, k, v, score_mod=shifted).square().sum(), bias)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def _per_row_window(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() <= 8 * (b + 1) + 4 * h


@pytest.mark.parametrize("mask_bh, call_bh", [((4, 1), (1, 2)), ((2, 1), (4, 2)), ((1, 2), (2, 4)), ((3, 3), (2, 6))])
def test_block_mask_batch_and_heads_are_taken_modulo(mask_bh, call_bh):
    """torch's flex reads a mask of batch Bm and heads Hm at (b % Bm, h % Hm): a mask
    with more batches than the call (decoding a prefix of a batch), or built with the
    KV head count under GQA, is accepted and read that way; mask_mod sees the call's b, h."""
    (Bm, Hm), (B, H) = mask_bh, call_bh
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, H, 64, 16, generator=g).to(DEVICE) for _ in range(3))
    mask = flexattn.create_block_mask(_per_row_window, Bm, Hm, 64, 64, device=DEVICE, BLOCK_SIZE=16)
    out = flexattn.flex_attention(q, k, v, block_mask=mask)
    kinds = mask._block_kinds().cpu()[torch.arange(B).view(B, 1) % Bm, torch.arange(H).view(1, H) % Hm]
    kinds = kinds.repeat_interleave(16, -2).repeat_interleave(16, -1)
    i = torch.arange(64)
    exact = _per_row_window(torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1),
                            i.view(64, 1), i.view(1, 64))
    # Full blocks are taken whole; in partial blocks mask_mod decides with the call's (b, h).
    allowed = (kinds == 2) | ((kinds == 1) & exact)
    expected = torch.nn.functional.scaled_dot_product_attention(q.cpu(), k.cpu(), v.cpu(), attn_mask=allowed)
    torch.testing.assert_close(out.cpu(), expected, atol=2e-5, rtol=2e-5)

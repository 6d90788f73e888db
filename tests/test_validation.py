"""Bad input gets an error that names the argument, what was expected and what came."""

from __future__ import annotations

import pytest
import torch

import flexattn
from flexattn import mods


def _qkv(B=2, H=4, Hkv=4, L=16, S=16, E=8, Ev=8, dtype=torch.float32):
    return (
        torch.randn(B, H, L, E, dtype=dtype),
        torch.randn(B, Hkv, S, E, dtype=dtype),
        torch.randn(B, Hkv, S, Ev, dtype=dtype),
    )


def _call(*args, **kwargs):
    return flexattn.flex_attention(*args, **kwargs)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda q, k, v: (q[0], k, v), r"query must be 4-D \(B, H, L, E\), got shape \(4, 16, 8\)"),
        (lambda q, k, v: (q, k[0], v), r"key must be 4-D"),
        (lambda q, k, v: (q, k, v.unsqueeze(0)), r"value must be 4-D"),
        (lambda q, k, v: (q.long(), k, v), r"query must have a floating dtype"),
        (lambda q, k, v: (q, k.half(), v.half()), r"Expected query, key, and value to have the same dtype, but got "
                                                  r"query.dtype: torch.float32, key.dtype: torch.float16"),
        (lambda q, k, v: (q, k.to(torch.float8_e4m3fn), v), r"Expected query, key, and value to have the same dtype"),
        (lambda q, k, v: (q, k[..., :4], v), r"key's head dim must equal query's \(8\)"),
        (lambda q, k, v: (q, k, v[:, :, :8]), r"key and value must agree"),
        (lambda q, k, v: (q, k[:, :2], v[:, :2]), r"query has 4 heads and key/value 2.*enable_gqa=True"),
        (lambda q, k, v: (q, torch.cat([k, k]), torch.cat([v, v])), r"batch must be 1 \(broadcast\) or query's batch 2, got 4"),
        (lambda q, k, v: ("q", k, v), r"query must be a torch.Tensor, got str"),
    ],
)
def test_bad_tensors(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        _call(*make(*_qkv()))


def test_error_types_match_torch():
    """Code written against torch's flex catches what torch raises: ValueError for mixed
    dtypes and mixed devices (torch's phrases, which its own tests match)."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="Expected query, key, and value to have the same dtype"):
        _call(q.double(), k, v)
    with pytest.raises(ValueError, match="Expected query, key, and value to have the same device type, but got "
                                         "query.device: cpu, key.device: meta"):
        _call(q, k.to("meta"), v)


def test_empty_key_value_is_rejected():
    q, k, v = _qkv(S=0)
    with pytest.raises(ValueError, match=r"key/value must hold at least one position \(S >= 1\).*\(2, 4, 0, 8\)"):
        _call(q, k, v)


def test_gqa_needs_divisible_heads():
    q, k, v = _qkv(H=4, Hkv=3)
    with pytest.raises(ValueError, match=r"query heads \(4\) must be a multiple of key/value heads \(3\)"):
        _call(q, k, v, enable_gqa=True)


def test_head_dim_limits():
    """The CPU engine takes head dims up to 1024, the Triton kernels up to 256; the error
    names the limit of the path the call would take."""
    q, k, v = _qkv(E=2048, Ev=8)
    with pytest.raises(ValueError, match=r"head dim E must be between 1 and 1024 on the CPU engine, got 2048"):
        _call(q, k, v)
    q, k, v = _qkv(E=8, Ev=512)
    with torch._inductor.config.patch(cpu_backend="triton"), \
            pytest.raises(ValueError, match=r"value head dim Ev must be between 1 and 256 on the cpu kernels, got 512"):
        _call(q, k, v)


def test_block_mask_checks():
    q, k, v = _qkv(L=40, S=40)
    small = flexattn.create_block_mask(mods.causal_mask, None, None, 32, 32, device="cpu", BLOCK_SIZE=16)
    with pytest.raises(ValueError, match=r"created for \(Q_LEN, KV_LEN\) = \(32, 32\) but query/key have \(40, 40\)"):
        _call(q, k, v, block_mask=small)
    with pytest.raises(TypeError, match=r"block_mask must be a flexattn.BlockMask"):
        _call(q, k, v, block_mask=torch.ones(40, 40, dtype=torch.bool))


def test_backward_needs_the_transposed_lists():
    """A mask built with compute_q_blocks=False serves calls without a backward; one
    that needs a gradient (of q, k, v, or of a tensor the score_mod captures) raises,
    eagerly and under torch.compile, naming compute_q_blocks."""
    q, k, v = _qkv(L=40, S=40)
    full = flexattn.create_block_mask(mods.causal_mask, None, None, 40, 40, device="cpu", BLOCK_SIZE=16)
    bare = flexattn.BlockMask.from_kv_blocks(full.kv_num_blocks, full.kv_indices, full.full_kv_num_blocks,
                                             full.full_kv_indices, BLOCK_SIZE=16, seq_lengths=(40, 40),
                                             mask_mod=mods.causal_mask, compute_q_blocks=False)
    torch.testing.assert_close(_call(q, k, v, block_mask=bare), _call(q, k, v, block_mask=full))
    with pytest.raises(ValueError, match=r"compute_q_blocks=False.*query, key or value requires grad.*"
                                         r"block_mask_on_pages\(\.\.\., compute_q_blocks=True\)"):
        _call(q.requires_grad_(), k, v, block_mask=bare)
    with torch.no_grad():
        torch.testing.assert_close(_call(q, k, v, block_mask=bare), _call(q, k, v, block_mask=full))
    compiled = torch.compile(_call, backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="compute_q_blocks=False"):
        compiled(q, k, v, block_mask=bare)
    bias = torch.zeros(4, requires_grad=True)
    q.requires_grad_(False)
    # Found while tracing the call (the captured tensor is only known then): Dynamo's
    # error carries the message.
    with pytest.raises(Exception, match="compute_q_blocks=False.*a tensor captured by score_mod requires grad"):
        _call(q, k, v, score_mod=lambda score, b, h, q_idx, kv_idx: score + bias[h], block_mask=bare)


def test_block_mask_for_longer_sequences_is_retargeted():
    q, k, v = _qkv(L=40, S=40)
    big = flexattn.create_block_mask(mods.causal_mask, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)
    exact = flexattn.create_block_mask(mods.causal_mask, None, None, 40, 40, device="cpu", BLOCK_SIZE=16)
    torch.testing.assert_close(_call(q, k, v, block_mask=big), _call(q, k, v, block_mask=exact))


def test_mod_and_option_checks():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"score_mod must take 5 arguments \(score, b, h, q_idx, kv_idx\), but it takes 2"):
        _call(q, k, v, score_mod=lambda s, b: s)
    with pytest.raises(TypeError, match=r"score_mod must be callable"):
        _call(q, k, v, score_mod=3)
    with pytest.raises(ValueError, match=r"unknown kernel_options \['BLOCK_Q'\]"):
        _call(q, k, v, kernel_options={"BLOCK_Q": 64})
    with pytest.raises(ValueError, match=r"^Cannot specify both return_lse and return_aux"):
        _call(q, k, v, return_lse=True, return_aux=flexattn.AuxRequest(lse=True))
    with pytest.raises(TypeError, match=r"scale must be a float or None, got str"):
        _call(q, k, v, scale="0.5")


def test_mutating_score_mod_eager_is_rejected():
    q, k, v = _qkv()
    hits = torch.zeros(1)

    def mutating(score, b, h, qi, ki):
        hits.add_(1)
        return score

    with pytest.raises(Exception, match=r"score_mod must be a pure function"):
        _call(q, k, v, score_mod=mutating)


def test_return_shapes_and_dtypes():
    q, k, v = _qkv(B=2, H=4, Hkv=2, L=10, S=12, E=8, Ev=6)
    out = _call(q, k, v, enable_gqa=True)
    assert out.shape == (2, 4, 10, 6) and out.dtype == torch.float32
    out, lse = _call(q, k, v, enable_gqa=True, return_lse=True)
    assert lse.shape == (2, 4, 10) and lse.dtype == torch.float32
    out, aux = _call(q, k, v, enable_gqa=True, return_aux=flexattn.AuxRequest(max_scores=True))
    assert aux.lse is None and aux.max_scores.shape == (2, 4, 10)


def test_sliced_block_mask_needs_its_own_mask_mod():
    """block_mask[...] keeps no valid mask_mod: flex_attention says so with torch's
    RuntimeError, eagerly and compiled; assigning a mask_mod for the slice works."""
    q, k, v = _qkv(L=1, S=64)
    base = flexattn.create_block_mask(mods.causal_mask, 2, 4, 64, 64, device="cpu", BLOCK_SIZE=16)
    sliced = base[:, :, 2]
    for call in (_call, torch.compile(_call)):
        with pytest.raises(RuntimeError, match="Cannot use mask_mod from a sliced BlockMask"):
            call(q, k, v, block_mask=sliced)
    sliced.mask_mod = lambda b, h, q_idx, kv_idx: q_idx + 32 >= kv_idx
    sliced.seq_lengths = (1, 64)
    torch.testing.assert_close(_call(q, k, v, block_mask=sliced),
                               _call(q, k[:, :, :33], v[:, :, :33]), atol=1e-5, rtol=1e-5)


def test_zero_length_under_compile_raises_torchs_error():
    """A zero-length sequence: eagerly flexattn's ValueError, compiled the lowering's
    (Inductor wraps it), with torch's phrase."""
    q, k, v = _qkv(L=0, S=0)
    with pytest.raises(ValueError, match="at least one position"):
        _call(q, k, v)
    with pytest.raises(torch._inductor.exc.InductorError, match="Query length must be greater than 0"):
        torch.compile(_call, fullgraph=True)(q, k, v)



def test_dtype_tests_agree_with_the_dtype_tuples():
    """The API tests dtypes by their attributes (a compiled call then guards on no module
    tuple); over every torch dtype they say what SUPPORTED_DTYPES and FP8_KV_DTYPES say."""
    from flexattn import api

    dtypes = [d for d in vars(torch).values() if isinstance(d, torch.dtype)]
    assert len(dtypes) > 20
    for dtype in dtypes:
        assert api._is_supported_dtype(dtype) == (dtype in api.SUPPORTED_DTYPES), dtype
        assert api._is_fp8_kv_dtype(dtype) == (dtype in api.FP8_KV_DTYPES), dtype

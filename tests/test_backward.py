"""Numerics of the fused backward kernel, driven through torch.compile and Inductor.

Every case runs forward + backward three ways from the same fresh random inputs, output
gradient and (when the lse is used) lse gradient: the dense reference (``dense_math``
under autograd) in float64 (golden), the dense reference in the test dtype, and the
public ``flexattn.flex_attention`` compiled with Inductor, whose backward is our Triton
template (on CPU through the Triton interpreter). The compiled gradients pass when
``err(kernel, golden) <= 2 * err(reference, golden) + floor`` for q, k, v and every
captured tensor that requires grad, with no NaN (tests/_numerics.py). Allocator memory
is filled with NaN before the compiled run, so a gradient the kernel forgets to write
shows up as NaN.

Captured tensors are closed over by the mods (Dynamo lifts them into buffers); the
reference evaluates the same closures. Shapes: small in the interpreter (float16 and
float32; the interpreter is wrong for bfloat16), larger on CUDA (plus bfloat16).
"""

from __future__ import annotations

import zlib

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import flexattn
import flexattn.lowering
from flexattn import _compat, mods
from flexattn._hop import dense_math
from flexattn.api import AuxRequest
from flexattn.block_mask import BlockMask, and_masks, create_block_mask, noop_mask
from flexattn.lowering.backward import DeterministicBufferGradError

from _numerics import assert_close_3way
from conftest import DEVICE

flexattn.lowering.register()
_compat.use_interpreter_libdevice()

ON_CUDA = DEVICE == "cuda"
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if ON_CUDA else [])
BACKWARD_MARK = "def dkv_visit_q_blocks("  # our backward template's inner loop


@pytest.fixture(autouse=True)
def _fresh_compile_with_our_template():
    """No FX-graph / autotune cache hits; on CPU Inductor generates Triton (interpreted)."""
    patches = {"force_disable_caches": True}
    if not ON_CUDA:
        patches["cpu_backend"] = "triton"
    with torch._inductor.config.patch(**patches):
        yield


def scaled(cpu: int, cuda: int) -> int:
    return cuda if ON_CUDA else cpu


# --------------------------------------------------------------------------------------
# Harness
# --------------------------------------------------------------------------------------
def _poison_allocator(nbytes: int) -> None:
    junk = torch.full((max(nbytes // 4, 1),), float("nan"), device=DEVICE)
    del junk


def _randn(gen, *shape, dtype=torch.float32, requires_grad=False):
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype).requires_grad_(requires_grad)


def _attention_grads(attend, q, k, v, buffers, grad_out, grad_lse):
    """Gradients of <out, grad_out> (+ <lse, grad_lse>) wrt q, k, v and the buffers."""
    out, lse = attend(q, k, v)
    outputs, cotangents = [out], [grad_out]
    if grad_lse is not None:
        outputs.append(lse)
        cotangents.append(grad_lse)
    leaves = [q, k, v, *buffers]
    return out, lse, torch.autograd.grad(outputs, leaves, cotangents)


def run_case(
    *, dtype, B=2, Hq=2, Hkv=None, Bkv=None, L=64, S=64, E=32, Ev=None,
    make_mods=None, block_size=128, use_lse=False, options=None, seed=0,
    make_inputs=None, block_mask=None, check_out=True,
):
    """Run golden / reference / compiled forward+backward; check the 3-way bound.

    ``make_mods(gen)`` returns ``(mods_of, buffers)``: ``buffers`` are the learnable
    captured tensors (float32, requires_grad) and ``mods_of(buffers)`` the
    ``(score_mod, mask_mod)`` closing over them, so each run gets them in its dtype.
    """
    Hkv = Hkv or Hq
    Bkv = Bkv or B
    Ev = Ev or E
    gen = torch.Generator(device="cpu").manual_seed(seed)
    if make_inputs is not None:
        q, k, v = make_inputs(gen)
    else:
        q = _randn(gen, B, Hq, L, E, dtype=dtype)
        k = _randn(gen, Bkv, Hkv, S, E, dtype=dtype)
        v = _randn(gen, Bkv, Hkv, S, Ev, dtype=dtype)
    B, Hq, L, S, Ev = q.shape[0], q.shape[1], q.shape[2], k.shape[2], v.shape[3]
    if make_mods is None:
        mods_of, buffers = (lambda bufs: (None, None)), []
    else:
        mods_of, buffers = make_mods(gen)
    grad_out = _randn(gen, B, Hq, L, Ev, dtype=dtype)
    grad_lse = _randn(gen, B, Hq, L) if use_lse else None
    if block_mask is None:
        mask_mod = mods_of(buffers)[1]
        block_mask = create_block_mask(mask_mod or noop_mask, None, None, L, S, device=DEVICE,
                                       BLOCK_SIZE=block_size)
    scale = q.shape[-1] ** -0.5

    def reference(bufs):
        score_mod = mods_of(bufs)[0] or (lambda s, b, h, qi, ki: s)

        def attend(q, k, v):
            out, lse, _ = dense_math(q, k, v, score_mod, block_mask.as_tuple(), scale, (), ())
            return out, lse

        return attend

    def leaf(t, to_dtype=None):
        return t.detach().to(to_dtype or t.dtype).requires_grad_(True)

    def three(to):
        return [leaf(t, to) for t in (q, k, v)]

    # Golden (float64) and same-dtype reference.
    gq, gk, gv = three(torch.float64)
    gbufs = [leaf(b, torch.float64) for b in buffers]
    golden = _attention_grads(reference(gbufs), gq, gk, gv, gbufs,
                              grad_out.double(), None if grad_lse is None else grad_lse.double())
    rq, rk, rv = three(None)
    rbufs = [leaf(b) for b in buffers]
    ref = _attention_grads(reference(rbufs), rq, rk, rv, rbufs, grad_out, grad_lse)

    # Compiled, through the public API.
    cq, ck, cv = three(None)
    cbufs = [leaf(b) for b in buffers]
    score_mod, _ = mods_of(cbufs)

    def attend(q, k, v):
        out, aux = flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                           scale=scale, enable_gqa=Hq != Hkv, kernel_options=options,
                                           return_aux=AuxRequest(lse=True))
        return out, aux.lse

    compiled = torch.compile(attend, backend="inductor", fullgraph=True)
    _poison_allocator(8 * (q.numel() + 2 * k.numel() + v.numel()))
    test = _attention_grads(compiled, cq, ck, cv, cbufs, grad_out, grad_lse)

    if check_out:
        assert_close_3way("out", test[0], ref[0], golden[0], dtype)
        assert_close_3way("lse", test[1], ref[1], golden[1], dtype)
    names = ["grad_q", "grad_k", "grad_v"] + [f"grad_buffer{i}" for i in range(len(buffers))]
    for name, t, r, g in zip(names, test[2], ref[2], golden[2]):
        assert t.shape == g.shape and t.dtype == r.dtype, name
        assert_close_3way(name, t, r, g, dtype if not name.startswith("grad_buffer") else r.dtype)
    return test, golden


# --------------------------------------------------------------------------------------
# The library of mods (learnable captured tensors where the mod has any)
# --------------------------------------------------------------------------------------
def _doc_ids(n: int) -> torch.Tensor:
    bounds = [0, n // 5, n // 2, n - n // 7, n]
    ids = torch.zeros(n, dtype=torch.int32)
    for i in range(len(bounds) - 1):
        ids[bounds[i]:bounds[i + 1]] = i
    return ids.to(DEVICE)


def _no_buffers(score_mod, mask_mod):
    return lambda gen: ((lambda bufs: (score_mod, mask_mod)), [])


def _alibi_learnable(h: int):
    def make(gen):
        slopes = (torch.rand(h, generator=gen) * 0.5).to(DEVICE)
        return (lambda bufs: (mods.alibi_bias(bufs[0]), mods.causal_mask)), [slopes]

    return make


def _relative_bias_learnable(n: int, h: int, mask_mod=None):
    def make(gen):
        table = torch.randn(h, 2 * n - 1, generator=gen).to(DEVICE)
        return (lambda bufs: (mods.relative_bias(bufs[0]), mask_mod)), [table]

    return make


def mod_cases(n: int, h: int) -> dict:
    return {
        "none": _no_buffers(None, None),
        "causal": _no_buffers(None, mods.causal_mask),
        "sliding_window": _no_buffers(None, mods.sliding_window(n // 4)),
        "alibi_learnable": _alibi_learnable(h),
        "softcap_causal": _no_buffers(mods.tanh_softcap(2.0), mods.causal_mask),
        "document": _no_buffers(None, mods.document_mask(_doc_ids(n))),
        "prefix_lm": _no_buffers(None, mods.prefix_lm(n // 3)),
        "relative_bias_learnable": _relative_bias_learnable(n, h),
    }


MOD_NAMES = sorted(mod_cases(8, 2))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32] + ([torch.bfloat16] if ON_CUDA else []), ids=str)
@pytest.mark.parametrize("case", MOD_NAMES)
def test_mod_library(case, dtype):
    if not ON_CUDA and dtype == torch.float32 and case not in ("alibi_learnable", "relative_bias_learnable", "softcap_causal"):
        pytest.skip("interpreter budget: float32 runs for the mods with captured grads / joint graphs")
    n = scaled(80, 1000)
    run_case(dtype=dtype, L=n, S=n, make_mods=mod_cases(n, 2)[case], seed=zlib.crc32(case.encode()),
             block_size=scaled(32, 128))

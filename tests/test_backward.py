"""Numerics of the fused backward kernel, driven through torch.compile and Inductor.

Every case runs forward + backward three ways from the same fresh random inputs, output
gradient and (when the lse is used) lse gradient: the dense reference (``dense_math``
under autograd) in float64 (golden), the dense reference in the test dtype, and the
public ``flexattn.flex_attention`` compiled with Inductor, whose backward is our Triton
template (on CPU through the Triton interpreter). The compiled gradients pass when
``err(kernel, golden) <= 2 * err(reference, golden) + floor`` for q, k, v and every
captured tensor that requires grad, with no NaN (tests/_harness.py). Allocator memory
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
from flexattn.reference import dense_math
from flexattn.api import AuxRequest
from flexattn.block_mask import BlockMask, and_masks, create_block_mask, noop_mask

import _harness as harness
from _generated_code import constexpr
from conftest import DEVICE, HEAVY

flexattn.lowering.register()
_compat.use_interpreter_libdevice()

ON_CUDA, DTYPES, scaled = harness.ON_CUDA, harness.DTYPES, harness.scaled
BACKWARD_MARK = "def dkv_visit_q_blocks("  # our backward template's inner loop

pytestmark = pytest.mark.usefixtures("flexattn_kernels")


# --------------------------------------------------------------------------------------
# Harness
# --------------------------------------------------------------------------------------
def run_case(
    *, dtype, B=2, Hq=2, Hkv=None, Bkv=None, L=64, S=64, E=32, Ev=None,
    make_mods=None, block_size=128, use_lse=False, options=None, seed=0,
    make_inputs=None, block_mask=None, check_out=True, default_mask=False,
    captured_ratio=harness.CAPTURED_GRAD_RATIO,
):
    """Run golden / reference / compiled forward+backward; check the 3-way bound.

    ``default_mask``: the compiled call passes ``block_mask=None`` (flex_attention's own
    mask, the kernels' DENSE_KV walk); the references use the same all-visible mask.

    ``make_mods(gen)`` returns ``(mods_of, buffers)``: ``buffers`` are the learnable
    captured tensors (float32, requires_grad) and ``mods_of(buffers)`` the
    ``(score_mod, mask_mod)`` closing over them, so each run gets them in its dtype.
    ``captured_ratio``: the bound's factor for their gradients (see the harness).
    """
    Hkv = Hkv or Hq
    gen = harness.generator(seed)
    q, k, v = harness.make_inputs(gen, B=B, Hq=Hq, Hkv=Hkv, Bkv=Bkv, L=L, S=S, E=E, Ev=Ev, dtype=dtype,
                                  make=make_inputs)
    Hq, L, S = q.shape[1], q.shape[2], k.shape[2]
    if make_mods is None:
        mods_of, buffers = (lambda bufs: (None, None)), []
    else:
        mods_of, buffers = make_mods(gen)
    grad_out, grad_lse = harness.make_output_grads(gen, q, v, with_lse=use_lse)
    q, k, v, *buffers = (t.requires_grad_(True) for t in (q, k, v, *buffers))
    if block_mask is None:
        mask_mod = mods_of(buffers)[1]
        block_mask = create_block_mask(mask_mod or noop_mask, None, None, L, S, device=DEVICE,
                                       BLOCK_SIZE=block_size)
    scale = q.shape[-1] ** -0.5

    def reference(q, k, v, grad_out, grad_lse, *bufs):
        score_mod = mods_of(bufs)[0] or (lambda s, b, h, qi, ki: s)

        def attend(q, k, v):
            out, lse, _ = dense_math(q, k, v, score_mod, block_mask.as_tuple(), scale, (), ())
            return out, lse

        return harness.attention_grads(attend, (q, k, v), grad_out, grad_lse, captured=bufs)

    # Golden (float64) and same-dtype reference.
    golden, ref = harness.reference_runs(reference, (q, k, v, grad_out, grad_lse, *buffers))

    # Compiled, through the public API.
    cq, ck, cv, *cbufs = harness.copies((q, k, v, *buffers))
    score_mod, _ = mods_of(cbufs)

    assert not default_mask or mods_of(buffers)[1] is None, "default_mask: no mask_mod"

    def attend(q, k, v):
        out, aux = flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=None if default_mask else block_mask,
                                           scale=scale, enable_gqa=Hq != Hkv, kernel_options=options,
                                           return_aux=AuxRequest(lse=True))
        return out, aux.lse

    compiled = torch.compile(attend, backend="inductor", fullgraph=True)
    harness.poison_allocator(8 * (q.numel() + 2 * k.numel() + v.numel()))
    test = harness.attention_grads(compiled, (cq, ck, cv), grad_out, grad_lse, captured=cbufs)

    if check_out:
        harness.check_attention(test, ref, golden, dtype, max_scores=False)
    harness.check_gradients(test[2], ref[2], golden[2], dtype, captured_ratio=captured_ratio)
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


# Interpreter budget: every mod in float16; float32 for the mods with a joint graph or
# captured gradients. On CUDA every mod in every dtype.
_FP32_CPU_CASES = {"alibi_learnable", "relative_bias_learnable", "softcap_causal"}
MOD_LIBRARY_CASES = [(case, dtype) for case in MOD_NAMES for dtype in DTYPES
                     if ON_CUDA or dtype == torch.float16 or case in _FP32_CPU_CASES]


@pytest.mark.parametrize("case,dtype", MOD_LIBRARY_CASES, ids=lambda x: str(x))
def test_mod_library(case, dtype):
    n = scaled(80, 1000)
    run_case(dtype=dtype, L=n, S=n, make_mods=mod_cases(n, 2)[case], seed=zlib.crc32(case.encode()),
             block_size=scaled(32, 128))


# --------------------------------------------------------------------------------------
# Lengths, head dims, heads, batch
# --------------------------------------------------------------------------------------
LENGTHS = [(1, 17), (17, 1), (127, 129), (129, 127)] + ([(1000, 1000), (255, 1000)] if ON_CUDA else [])


@pytest.mark.parametrize("L,S", LENGTHS, ids=str)
def test_lengths(L, S):
    run_case(dtype=torch.float16, B=1, L=L, S=S, make_mods=_no_buffers(None, mods.causal_mask),
             block_size=scaled(32, 128))


HEAD_DIMS = [(16, 16), (64, 64), (80, 80), (96, 96), (128, 128), (32, 64), (64, 16)] + (
    [(256, 256), (192, 192)] if ON_CUDA else [])


@pytest.mark.parametrize("E,Ev", HEAD_DIMS, ids=str)
def test_head_dims(E, Ev):
    n = scaled(33, 513)
    run_case(dtype=torch.float16, B=1, Hq=1, L=n, S=n, E=E, Ev=Ev,
             make_mods=_no_buffers(mods.tanh_softcap(3.0), mods.causal_mask), block_size=scaled(32, 128))


@pytest.mark.parametrize("Hq,Hkv,Bkv", [(4, 2, None), (4, 1, None), (2, 2, 1), (4, 1, 1)],
                         ids=["gqa", "mqa", "kv_batch_1", "mqa_kv_batch_1"])
def test_heads_and_kv_batch(Hq, Hkv, Bkv):
    n = scaled(48, 700)
    run_case(dtype=torch.float16, Hq=Hq, Hkv=Hkv, Bkv=Bkv, L=n, S=n, make_mods=_alibi_learnable(Hq),
             block_size=scaled(16, 128))


def test_non_contiguous_inputs():
    B, H, L, S, E = 2, 2, scaled(40, 600), scaled(56, 900), 32

    def make(gen):
        q = harness.randn(gen, B, L, H, E, dtype=torch.float16).transpose(1, 2)
        k = harness.randn(gen, B, H, S, 2 * E, dtype=torch.float16)[..., ::2]
        v = harness.randn(gen, S, B, H, E, dtype=torch.float16).permute(1, 2, 0, 3)
        return q, k, v

    run_case(dtype=torch.float16, make_inputs=make, make_mods=_no_buffers(None, mods.causal_mask),
             block_size=scaled(32, 128))


# --------------------------------------------------------------------------------------
# Masked rows, the lse gradient, captured tensors
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_fully_masked_rows(dtype):
    n = scaled(72, 1000)
    dead = n // 3

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= dead) & (kv_idx <= q_idx)

    test, golden = run_case(dtype=dtype, L=n, S=n, make_mods=_no_buffers(None, mask_mod), use_lse=True,
                            block_size=scaled(16, 128))
    harness.check_masked_rows(lambda t: t[:, :, :dead], lse=test[1], grads=(test[2][0],))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_gradient_through_lse(dtype):
    n = scaled(70, 800)
    run_case(dtype=dtype, L=n, S=n, make_mods=_relative_bias_learnable(n, 2, mods.causal_mask),
             use_lse=True, block_size=scaled(32, 128))


def test_lse_only_loss():
    """A loss of the lse alone (zero output gradient): dS = P * dlse."""
    n = scaled(50, 500)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (harness.randn(gen, 1, 2, n, 16, requires_grad=True) for _ in range(3))
    bm = create_block_mask(mods.causal_mask, None, None, n, n, device=DEVICE, BLOCK_SIZE=scaled(16, 128))

    def lse_of(q, k, v):
        return flexattn.flex_attention(q, k, v, block_mask=bm, return_aux=AuxRequest(lse=True))[1].lse

    got = torch.autograd.grad(torch.compile(lse_of, backend="inductor", fullgraph=True)(q, k, v).sum(), (q, k, v))
    qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    lse = dense_math(qd, kd, vd, lambda s, b, h, qi, ki: s, bm.as_tuple(), 16 ** -0.5, (), ())[1]
    want = torch.autograd.grad(lse.sum(), (qd, kd, vd), allow_unused=True, materialize_grads=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, atol=1e-5, rtol=1e-4)


def test_captured_tensors_every_index():
    """Learnable tensors indexed by b, h, q_idx and kv_idx, one indexed twice, and a 0-d
    temperature: scatters at every kind of index, several terms into one buffer."""
    B, H, n = 2, 2, scaled(40, 400)

    def make(gen):
        temperature = torch.tensor(0.7)
        bufs = [torch.randn(B, generator=gen), torch.randn(H, n, generator=gen),
                torch.randn(n, generator=gen), temperature]
        bufs = [b.to(DEVICE) for b in bufs]

        def mods_of(b):
            by_batch, by_head_pos, by_pos, temperature = b

            def score_mod(score, bi, h, q_idx, kv_idx):
                return (score * temperature + by_batch[bi] + by_head_pos[h, q_idx] * by_head_pos[h, kv_idx]
                        + by_pos[kv_idx])

            return score_mod, mods.causal_mask

        return mods_of, bufs

    run_case(dtype=torch.float32, B=B, Hq=H, L=n, S=n, make_mods=make, block_size=scaled(16, 128))


def test_captured_tensors_indexed_in_steps():
    """Learnable tensors indexed one dim at a time (``bias[q_idx][kv_idx]``,
    ``table[h][kv_idx][q_idx]``): their gradient is a scatter of a scatter, one term
    indexed by all the steps' indices."""
    B, H, n = 1, 2, scaled(40, 256)

    def make(gen):
        bufs = [torch.randn(n, n, generator=gen).to(DEVICE), torch.randn(H, n, n, generator=gen).to(DEVICE)]

        def mods_of(b):
            pair, per_head = b

            def score_mod(score, bi, h, q_idx, kv_idx):
                return score + pair[q_idx][kv_idx] + per_head[h][kv_idx][q_idx]

            return score_mod, mods.causal_mask

        return mods_of, bufs

    run_case(dtype=torch.float16, B=B, Hq=H, L=n, S=n, make_mods=make, block_size=scaled(16, 128))


def test_elementwise_max_and_min_of_scores():
    """torch.maximum / torch.minimum of two score terms, one a learnable per-head floor:
    autograd's formulas for them write their gradient in place (a masked fill), which the
    joint graph must not keep for the kernels to inline it."""
    H, n = 2, scaled(48, 384)

    def make(gen):
        floor = torch.randn(H, generator=gen).to(DEVICE)

        def mods_of(b):
            (floor,) = b

            def score_mod(score, bi, h, q_idx, kv_idx):
                leaky = torch.maximum(score, 0.25 * score)
                return torch.minimum(leaky, 2.0 - 0.5 * score) + torch.maximum(score, floor[h])

            return score_mod, mods.causal_mask

        return mods_of, [floor]

    run_case(dtype=torch.float16, Hq=H, L=n, S=n, make_mods=make, block_size=scaled(16, 128))


def test_document_masks_from_start_offsets_by_search():
    """A document mask written as users write it from cumulative lengths, the document of a
    position found with torch.searchsorted (queries) and torch.bucketize (keys): forward
    and backward within the three-way bound."""
    n = scaled(80, 700)
    starts = torch.tensor([0, 9, 10, n // 3, n // 2 + 5, n - 1], device=DEVICE)

    def mask_mod(b, h, q_idx, kv_idx):
        q_doc = torch.searchsorted(starts, q_idx, right=True)
        kv_doc = torch.bucketize(kv_idx, starts, right=True)
        return (q_doc == kv_doc) & (q_idx >= kv_idx)

    run_case(dtype=torch.float16, Hq=2, L=n, S=n, make_mods=lambda gen: ((lambda bufs: (None, mask_mod)), []),
             block_size=scaled(16, 128))


def test_relative_bias_with_document_mask_gqa():
    n = scaled(64, 640)
    doc = mods.document_mask(_doc_ids(n))
    run_case(dtype=torch.float16, Hq=4, Hkv=2, L=n, S=n,
             make_mods=_relative_bias_learnable(n, 4, and_masks(doc, mods.causal_mask)),
             block_size=scaled(16, 128))



def _bucketed_distance_table(h: int, buckets: int = 8):
    """A T5-style learnable table read at a bucket of kv_idx - q_idx (floor division and a
    clamp): many (q, kv) pairs, on many diagonals, add into each entry."""
    def make(gen):
        table = torch.randn(h, 2 * buckets + 1, generator=gen).to(DEVICE)

        def mods_of(bufs):
            def score_mod(score, b, hi, q_idx, kv_idx):
                return score + bufs[0][hi, ((kv_idx - q_idx) // 3).clamp(-buckets, buckets) + buckets]

            return score_mod, None

        return mods_of, [table]

    return make


def _cyclic_position_table(h: int, period: int = 7):
    """A learnable table read at q_idx % period and kv_idx % period apart."""
    def make(gen):
        table = torch.randn(h, 2 * period - 1, generator=gen).to(DEVICE)

        def mods_of(bufs):
            def score_mod(score, b, hi, q_idx, kv_idx):
                return score + bufs[0][hi, kv_idx % period - q_idx % period + period - 1]

            return score_mod, mods.causal_mask

        return mods_of, [table]

    return make


_SHORT_Q, _SHORT_KV = (scaled(37, 301), scaled(75, 700)), (scaled(75, 700), scaled(37, 301))


@pytest.mark.parametrize("L,S", [_SHORT_Q, pytest.param(*_SHORT_KV, marks=HEAVY)], ids=str)
def test_position_tables_at_odd_and_unequal_lengths(L, S):
    # The last tiles' pairs, and whole diagonals of them, lie partly past the ends: they
    # must add nothing. An entry of the cyclic table sums up to 2 x 512 pairs one float32
    # atomic at a time (on the GPU: 17x the tree-summed reference's error seen at
    # 512 x 512), so the bound is wider than the default; a misplaced pair or diagonal is
    # off by the entries' own size, orders beyond it.
    n = max(L, S)
    for hq, hkv, make in ((4, 2, _relative_bias_learnable(n, 4, mods.causal_mask)), (2, 2, _bucketed_distance_table(2)),
                          (2, 2, _cyclic_position_table(2))):
        run_case(dtype=torch.float32, Hq=hq, Hkv=hkv, L=L, S=S, make_mods=make, block_size=scaled(16, 128),
                 captured_ratio=32.0)



def _distance_table(h: int, n: int, form: str, width: int = 5):
    """A learnable table read at a function of the distance between q_idx and kv_idx that
    saturates inside the lengths: ``clamped`` kv_idx - q_idx clamped on both sides
    (mods.relative_bias of a narrow table), ``reversed`` q_idx - kv_idx clamped on both
    sides, ``upper`` kv_idx - q_idx clamped from above only, ``lower`` q_idx - kv_idx
    clamped from below only, ``shared`` one row for every head (mods.relative_bias of a
    narrow 1-d table)."""
    def make(gen):
        shape = {"shared": (2 * width + 1,), "clamped": (h, 2 * width + 1), "reversed": (h, 2 * width + 1)}.get(
            form, (h, n + width))
        table = torch.randn(*shape, generator=gen).to(DEVICE)

        def mods_of(bufs):
            if form in ("clamped", "shared"):
                return mods.relative_bias(bufs[0]), mods.causal_mask

            def score_mod(score, b, hi, q_idx, kv_idx):
                at = {"reversed": (q_idx - kv_idx).clamp(-width, width) + width,
                      "upper": (kv_idx - q_idx).clamp(max=width) + n - 1,
                      "lower": (q_idx - kv_idx).clamp(min=-width) + width}[form]
                return score + bufs[0][hi, at]

            return score_mod, None

        return mods_of, [table]

    return make


@pytest.mark.triton_kernels
@pytest.mark.parametrize("form,L,S", [
    pytest.param("clamped", *_SHORT_Q, marks=HEAVY), pytest.param("clamped", *_SHORT_KV, marks=HEAVY),
    pytest.param("reversed", *_SHORT_Q, marks=HEAVY), pytest.param("upper", *_SHORT_KV, marks=HEAVY),
    pytest.param("lower", *_SHORT_Q, marks=HEAVY), ("shared", *_SHORT_KV)], ids=str)
def test_distance_tables_summed_along_diagonals(form, L, S):
    # The diagonal sums are the Triton backward's (the CPU engine sums per pair as before).
    # GQA: the group's query heads reuse one program's scratch slot in turn.
    run_case(dtype=torch.float32, Hq=4, Hkv=2, L=L, S=S, make_mods=_distance_table(4, max(L, S), form),
             block_size=scaled(16, 128))


@pytest.mark.triton_kernels
@pytest.mark.parametrize("options", [{"bwd_BLOCK_M1": 16, "bwd_BLOCK_N1": 32},
                                     {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 16, "ONE_KV_LOOP": True}], ids=str)
def test_distance_tables_with_unequal_tiles(options):
    # BLOCK_M1 != BLOCK_N1: more diagonals start on one edge of the tile than on the other.
    L, S = scaled(45, 301), scaled(83, 700)
    for make in (_distance_table(2, max(L, S), "clamped"), _bucketed_distance_table(2)):
        run_case(dtype=torch.float32, Hq=2, L=L, S=S, make_mods=make, options=options, block_size=scaled(32, 128))


def _summed_kinds_together(h: int, n: int):
    """Per-head slopes, a per-key bias and a relative table read twice (two diagonal terms)."""
    def make(gen):
        bufs = [torch.rand(h, generator=gen).to(DEVICE), torch.randn(h, n, generator=gen).to(DEVICE),
                torch.randn(h, 2 * n - 1, generator=gen).to(DEVICE)]

        def mods_of(b):
            slopes, per_key, table = b

            def score_mod(score, bi, hi, q_idx, kv_idx):
                near = table[hi, (kv_idx - q_idx).clamp(-4, 4) + n - 1]
                return score + slopes[hi] * (kv_idx - q_idx) + per_key[hi, kv_idx] + table[hi, kv_idx - q_idx + n - 1] \
                    + near

            return score_mod, mods.causal_mask

        return mods_of, bufs

    return make


@pytest.mark.triton_kernels
def test_summed_terms_share_the_workspace():
    # The terms' entries and the scratch slots after them in one workspace must not overlap.
    n = scaled(53, 400)
    run_case(dtype=torch.float32, Hq=2, L=n, S=n, make_mods=_summed_kinds_together(2, n), block_size=scaled(16, 128))


def _one_sided_table(h: int, n: int, side: str):
    """A learnable table read on one side of the pair: ``key`` bias[h, kv_idx], ``query``
    bias[h, q_idx], ``coarse_key`` bias[h, kv_idx // 3] (several keys of a tile share an
    entry)."""
    def make(gen):
        table = torch.randn(h, n, generator=gen).to(DEVICE)

        def mods_of(bufs):
            def score_mod(score, b, hi, q_idx, kv_idx):
                at = {"key": kv_idx, "query": q_idx, "coarse_key": kv_idx // 3}[side]
                return score + bufs[0][hi, at]

            return score_mod, mods.causal_mask

        return mods_of, [table]

    return make


@pytest.mark.parametrize("side,L,S", [
    pytest.param("key", *_SHORT_Q, marks=HEAVY), pytest.param("key", *_SHORT_KV, marks=HEAVY),
    ("query", *_SHORT_Q), pytest.param("query", *_SHORT_KV, marks=HEAVY),
    ("coarse_key", *_SHORT_Q), pytest.param("coarse_key", *_SHORT_KV, marks=HEAVY)], ids=str)
def test_tables_read_on_one_side_summed_over_the_other(side, L, S):
    # Odd and unequal lengths: the last tiles' keys or queries past the ends must add nothing.
    run_case(dtype=torch.float32, Hq=4, Hkv=2, L=L, S=S, make_mods=_one_sided_table(4, max(L, S), side),
             block_size=scaled(16, 128))


@pytest.mark.triton_kernels
@pytest.mark.parametrize("case,counts", [
    ("per_head", (1, 0, 0, 0, False)),
    ("key", (0, 1, 0, 0, False)),
    ("coarse_key", (0, 1, 0, 0, False)),
    ("query", (0, 0, 1, 0, False)),
    ("relative", (0, 0, 0, 1, False)),
    ("bucketed", (0, 0, 0, 1, False)),
    ("reversed", (0, 0, 0, 1, False)),
    ("cyclic", (0, 0, 0, 0, True)),
    ("together", (1, 1, 0, 2, False)),
], ids=str)
def test_which_captured_gradients_are_summed_in_the_kernel(case, counts):
    n = 32
    make = {"per_head": _alibi_learnable(2), "relative": _relative_bias_learnable(n, 2),
            "bucketed": _bucketed_distance_table(2), "reversed": _distance_table(2, n, "reversed"),
            "cyclic": _cyclic_position_table(2), "together": _summed_kinds_together(2, n)}.get(case) \
        or _one_sided_table(2, n, case)
    mods_of, bufs = make(harness.generator(0))
    bufs = [b.requires_grad_() for b in bufs]
    score_mod, mask_mod = mods_of(bufs)
    q, k, v = (harness.randn(harness.generator(1), 1, 2, n, 16, dtype=torch.float16, requires_grad=True)
               for _ in range(3))
    bm = create_block_mask(mask_mod or noop_mask, None, None, n, n, device=DEVICE, BLOCK_SIZE=16)

    def step(q, k, v):
        out = torch.compile(lambda q, k, v: flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm),
                            backend="inductor", fullgraph=True)(q, k, v)
        return torch.autograd.grad(out.float().square().sum(), (q, k, v, *bufs))

    _, code = run_and_get_code(step, q, k, v)
    (backward,) = [c for c in code if BACKWARD_MARK in c]
    names = ("NUM_REDUCED_GRAD_TERMS", "NUM_KEY_GRAD_TERMS", "NUM_QUERY_GRAD_TERMS", "NUM_DIAGONAL_GRAD_TERMS",
             "HAS_BUFFER_GRADS")
    assert tuple(constexpr(backward, name) for name in names) == tuple(str(c) for c in counts)


@pytest.mark.triton_kernels
@pytest.mark.parametrize("case,masked", [
    ("none", False), ("alibi", False), ("relative", False), ("softcap", True), ("doubled", False), ("squared", True),
], ids=str)
def test_score_gradients_masked_again_only_where_a_mod_could_make_them_nonzero(case, masked):
    # dS is 0 wherever P is; a derivative other than a constant may be infinite there.
    n = 32
    score_mod = {"none": None, "alibi": mods.alibi(2, device=DEVICE),
                 "relative": mods.relative_bias(torch.randn(2, 2 * n - 1, device=DEVICE)),
                 "softcap": mods.tanh_softcap(20.0),
                 "doubled": lambda score, b, h, q_idx, kv_idx: score * 2,
                 "squared": lambda score, b, h, q_idx, kv_idx: score * score}[case]
    flags = _backward_constexprs(16, {}, ("MASK_SCORE_GRADS",), score_mod)
    assert flags["MASK_SCORE_GRADS"] == str(masked)


# --------------------------------------------------------------------------------------
# Block masks and kernel options
# --------------------------------------------------------------------------------------
def _causal_without_full_blocks(n: int, block: int) -> BlockMask:
    """A causal BlockMask (HAS_FULL_BLOCKS=False) listing every block as partial, so
    mask_mod runs everywhere."""
    n_blocks = -(-n // block)
    kv_num_blocks = torch.arange(1, n_blocks + 1, dtype=torch.int32, device=DEVICE).view(1, 1, n_blocks)
    kv_indices = torch.arange(n_blocks, dtype=torch.int32, device=DEVICE).expand(1, 1, n_blocks, n_blocks).contiguous()
    return BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=block, mask_mod=mods.causal_mask,
                                    seq_lengths=(n, n))


def test_no_full_blocks():
    n = scaled(64, 1000)
    run_case(dtype=torch.float16, L=n, S=n, block_mask=_causal_without_full_blocks(n, scaled(32, 128)))


def test_narrow_index_rows():
    """Index rows cut to the longest count (as PagedKVCache.block_mask_on_pages makes
    them), padded with a block id that is also listed: forward and backward as with the
    full-width mask."""
    n, block = scaled(96, 1000), scaled(16, 128)
    mask = create_block_mask(mods.sliding_window(scaled(20, 200)), None, None, n, n, device=DEVICE,
                             BLOCK_SIZE=block)
    width = int(max(mask.kv_num_blocks.max(), mask.full_kv_num_blocks.max()))
    assert width < mask.kv_indices.shape[-1]

    def cut(num, idx):
        return num, torch.where(torch.arange(width, device=DEVICE) < num[..., None], idx[..., :width], 0)

    narrow = BlockMask.from_kv_blocks(*cut(mask.kv_num_blocks, mask.kv_indices),
                                      *cut(mask.full_kv_num_blocks, mask.full_kv_indices), BLOCK_SIZE=block,
                                      mask_mod=mask.mask_mod, seq_lengths=(n, n))
    run_case(dtype=torch.float16, L=n, S=n, block_mask=narrow)


@pytest.mark.triton_kernels
@pytest.mark.parametrize("options", [
    {"bwd_BLOCK_M1": 16, "bwd_BLOCK_N1": 32, "bwd_BLOCK_M2": 32, "bwd_BLOCK_N2": 16},
    {"bwd_num_warps": 2, "bwd_num_stages": 1, "BLOCK_M1": 16},
    {"REVERSED_Q_TILES": False, "bwd_BLOCK_M2": 16},
], ids=["tiles", "warps_stages", "dq_tiles_in_order"])
def test_backward_kernel_options(options):
    n = scaled(64, 1000)
    run_case(dtype=torch.float16, L=n, S=n, make_mods=_no_buffers(mods.tanh_softcap(4.0), mods.causal_mask),
             options=options, block_size=scaled(32, 128))


# ONE_KV_LOOP (one walk over the partial then the full blocks, mask_mod behind a branch)
# and USE_TMA (tensor-descriptor loads of the tiles each program's loop walks: Q and dO in
# the dK/dV programs, K and V in the dQ programs; the interpreter emulates them)
# at the edges: odd lengths, a padded head dim, GQA, captured tensors, with and without
# full blocks.
LOOP_AND_TMA_OPTIONS = [{"ONE_KV_LOOP": True}, {"USE_TMA": True}, {"ONE_KV_LOOP": True, "USE_TMA": True}]


# Every option set on an even shape; the odd shape (odd lengths, E=40 padded to 64, GQA)
# with both options at once, which covers the other two's edges (interpreter budget).
LOOP_AND_TMA_CASES = [(o, 64, 64, 32, 2, 2) for o in LOOP_AND_TMA_OPTIONS] + [
    pytest.param(LOOP_AND_TMA_OPTIONS[2], 77, 130, 40, 4, 2, marks=HEAVY)]


@pytest.mark.triton_kernels
@pytest.mark.parametrize("options,L,S,E,Hq,Hkv", LOOP_AND_TMA_CASES,
                         ids=lambda x: ",".join(x) if isinstance(x, dict) else str(x))
def test_one_loop_and_tma(options, L, S, E, Hq, Hkv):
    L, S = scaled(L, 9 * L + 3), scaled(S, 9 * S + 5)
    run_case(dtype=torch.float16, Hq=Hq, Hkv=Hkv, L=L, S=S, E=E, make_mods=_alibi_learnable(Hq),
             options=options, block_size=scaled(16, 128))
    run_case(dtype=torch.float32, Hq=Hq, Hkv=Hkv, L=L, S=S, E=E,
             make_mods=_no_buffers(mods.tanh_softcap(4.0), mods.causal_mask), options=options,
             block_size=scaled(32, 128), use_lse=True)


@pytest.mark.triton_kernels
@pytest.mark.parametrize("options", LOOP_AND_TMA_OPTIONS, ids=lambda o: ",".join(o))
def test_one_loop_and_tma_without_full_blocks(options):
    n = scaled(64, 1000)
    run_case(dtype=torch.float16, L=n, S=n, block_mask=_causal_without_full_blocks(n, scaled(32, 128)),
             options=options)


@pytest.mark.triton_kernels
def test_one_loop_with_captured_mask_tensor():
    """A document mask reading a captured tensor under the one loop's branch."""
    n = scaled(96, 1100)
    doc = (torch.arange(n, device=DEVICE) * 3) // n
    run_case(dtype=torch.float16, L=n, S=n, make_mods=_no_buffers(None, mods.document_mask(doc)),
             options={"ONE_KV_LOOP": True}, block_size=scaled(16, 128))


# flex_attention's default mask (block_mask=None): the forward and backward kernels walk
# every position from 0 without the BlockMask tables (DENSE_KV). Odd lengths (the last
# sparse block cut in both views), a padded head dim, GQA, a learnable captured tensor,
# and the loop and load variants.
@pytest.mark.parametrize("options,L,S,E,Hq,Hkv", [
    pytest.param({}, 77, 130, 40, 4, 2, marks=HEAVY),
    pytest.param({"USE_TMA": True, "ONE_KV_LOOP": True}, 77, 130, 40, 4, 2, marks=HEAVY),
    ({"DQ_ATOMIC": True}, 64, 100, 32, 2, 1),
], ids=["default", "tma_one_loop", "dq_atomic"])
def test_default_mask_dense_walk(options, L, S, E, Hq, Hkv):
    L, S = scaled(L, 9 * L + 3), scaled(S, 9 * S + 5)
    run_case(dtype=torch.float16, Hq=Hq, Hkv=Hkv, L=L, S=S, E=E, make_mods=_relative_bias_learnable(max(L, S), Hq),
             options=options, default_mask=True, block_size=scaled(32, 128), use_lse=True)
    run_case(dtype=torch.float32, Hq=Hq, Hkv=Hkv, L=L, S=S, E=E, make_mods=_no_buffers(None, None),
             options=options, default_mask=True)


@pytest.mark.triton_kernels
@pytest.mark.parametrize("default_mask", [True, False], ids=["block_mask_none", "explicit_full_mask"])
def test_dense_kv_only_for_the_default_mask(default_mask):
    """DENSE_KV in both kernels for block_mask=None; an explicit BlockMask, even one
    with every block full, keeps its tables (only flex_attention's own mask is known
    to list every block in order)."""
    n = 48
    gen = torch.Generator().manual_seed(0)
    q, k, v = (harness.randn(gen, 1, 2, n, 16, dtype=torch.float16, requires_grad=True) for _ in range(3))
    bm = None if default_mask else create_block_mask(noop_mask, None, None, n, n, device=DEVICE, BLOCK_SIZE=16)

    def step(q, k, v):
        out = torch.compile(lambda q, k, v: flexattn.flex_attention(q, k, v, block_mask=bm),
                            backend="inductor", fullgraph=True)(q, k, v)
        return torch.autograd.grad(out.float().square().sum(), (q, k, v))

    _, code = run_and_get_code(step, q, k, v)
    kernels = [c for c in code if BACKWARD_MARK in c or "def attend_kv_blocks(" in c]
    assert len(kernels) == 2, "expected the forward and the backward template"
    for c in kernels:
        assert c.split("DENSE_KV : tl.constexpr = ", 1)[1].split("\n", 1)[0].strip() == str(default_mask)


@pytest.mark.triton_kernels
def test_compiled_backward_uses_our_template():
    n = 32
    gen = torch.Generator().manual_seed(0)
    q, k, v = (harness.randn(gen, 1, 2, n, 16, dtype=torch.float16, requires_grad=True) for _ in range(3))
    bm = create_block_mask(mods.causal_mask, None, None, n, n, device=DEVICE, BLOCK_SIZE=16)

    def step(q, k, v):
        out = torch.compile(lambda q, k, v: flexattn.flex_attention(q, k, v, block_mask=bm),
                            backend="inductor", fullgraph=True)(q, k, v)
        return torch.autograd.grad(out.float().square().sum(), (q, k, v))

    _, code = run_and_get_code(step, q, k, v)
    assert any(BACKWARD_MARK in c for c in code), "the flexattn backward template is not in the compiled code"


def _backward_constexprs(E: int, options: dict, names: tuple[str, ...], score_mod=None) -> dict[str, str]:
    """The values the compiled backward kernel gives to the constexprs ``names`` (causal,
    n = 32, with ``score_mod``)."""
    n = 32
    gen = torch.Generator().manual_seed(0)
    q, k, v = (harness.randn(gen, 1, 2, n, E, dtype=torch.float16, requires_grad=True) for _ in range(3))
    bm = create_block_mask(mods.causal_mask, None, None, n, n, device=DEVICE, BLOCK_SIZE=16)

    def step(q, k, v):
        out = torch.compile(lambda q, k, v: flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm,
                                                                    kernel_options=options),
                            backend="inductor", fullgraph=True)(q, k, v)
        return torch.autograd.grad(out.float().square().sum(), (q, k, v))

    _, code = run_and_get_code(step, q, k, v)
    (backward,) = [c for c in code if BACKWARD_MARK in c]
    return {name: backward.split(f"{name} : tl.constexpr = ", 1)[1].split("\n", 1)[0].strip() for name in names}


@pytest.mark.triton_kernels
@pytest.mark.parametrize("E", [64, 128])
def test_backward_tma_and_one_loop_choice(E):
    """USE_TMA follows configs.tma.TMA_DEFAULTS["backward"] unless kernel_options say
    otherwise; bwd_ONE_KV_LOOP pins the backward's one loop (default off)."""
    from flexattn.lowering.configs import tma as configs
    auto = configs.tma_by_default("backward", torch.device(DEVICE), E, torch.float16, kv_length=32)
    assert _backward_constexprs(E, {}, ("USE_TMA", "ONE_KV_LOOP")) == {"USE_TMA": str(auto), "ONE_KV_LOOP": "False"}
    torch._dynamo.reset()
    assert _backward_constexprs(E, {"USE_TMA": True, "bwd_ONE_KV_LOOP": True}, ("USE_TMA", "ONE_KV_LOOP")) == \
        {"USE_TMA": "True", "ONE_KV_LOOP": "True"}
    torch._dynamo.reset()
    assert _backward_constexprs(E, {"USE_TMA": False}, ("USE_TMA",)) == {"USE_TMA": "False"}


@pytest.mark.triton_kernels
def test_backward_tma_programs_choice():
    """Automatic descriptors go to the dQ programs only (configs.tma.backward_tma_programs),
    with DQ_ATOMIC to the dK/dV programs too; kernel_options USE_TMA=True puts them in both
    program kinds, False in neither."""
    from flexattn.lowering.configs import tma as configs
    names = ("USE_TMA_DKDV", "USE_TMA_DQ")
    auto = configs.tma_by_default("backward", torch.device(DEVICE), 128, torch.float16, kv_length=1 << 20)
    both, dq_only, neither = (configs.BackwardTma(dkdv=True, dq=True), configs.BackwardTma(dkdv=False, dq=True),
                              configs.BackwardTma(dkdv=False, dq=False))
    assert configs.backward_tma_programs(True, None, dq_atomic=False) == dq_only
    assert configs.backward_tma_programs(True, None, dq_atomic=True) == both
    assert configs.backward_tma_programs(True, True, dq_atomic=False) == both
    assert configs.backward_tma_programs(True, 1, dq_atomic=False) == both
    assert configs.backward_tma_programs(False, None, dq_atomic=True) == neither
    assert configs.backward_tma_programs(False, False, dq_atomic=False) == neither
    assert configs.backward_tma_programs(auto, None, dq_atomic=False) == (dq_only if auto else neither)
    assert _backward_constexprs(32, {"USE_TMA": True}, names) == {"USE_TMA_DKDV": "True", "USE_TMA_DQ": "True"}
    torch._dynamo.reset()
    assert _backward_constexprs(32, {"USE_TMA": False}, names) == {"USE_TMA_DKDV": "False", "USE_TMA_DQ": "False"}


@pytest.mark.triton_kernels
@pytest.mark.parametrize("dkdv,dq", [pytest.param(False, True, marks=HEAVY), (True, False)], ids=["dq_only", "dkdv_only"])
def test_tma_in_one_program_kind(dkdv, dq, monkeypatch):
    """Descriptors in one backward program kind, pointers in the other (the automatic
    choice on Hopper is dQ only) at the edges: odd lengths, a padded head dim, GQA, a
    learnable captured tensor, and with DQ_ATOMIC (whose shares the dK/dV programs reduce)."""
    from flexattn.lowering.configs import tma as configs
    monkeypatch.setattr(configs, "backward_tma_programs",
                        lambda use_tma, requested, dq_atomic: configs.BackwardTma(dkdv=dkdv, dq=dq))
    L, S = scaled(77, 696), scaled(130, 1175)
    run_case(dtype=torch.float16, Hq=4, Hkv=2, L=L, S=S, E=40, make_mods=_alibi_learnable(4),
             options={"USE_TMA": True}, block_size=scaled(16, 128))
    run_case(dtype=torch.float16, L=scaled(48, 640), S=scaled(48, 640), options={"USE_TMA": True, "DQ_ATOMIC": True},
             make_mods=_no_buffers(mods.tanh_softcap(3.0), mods.causal_mask), block_size=scaled(16, 128))


@pytest.mark.triton_kernels
def test_reversed_q_tiles_default_per_kernel():
    """REVERSED_Q_TILES: on in the backward, off in the forward by default
    (configs.forward/backward.REVERSED_Q_TILES); a kernel_options value pins both."""
    names = ("REVERSED_Q_TILES",)
    assert _backward_constexprs(32, {}, names) == {"REVERSED_Q_TILES": "True"}
    torch._dynamo.reset()
    assert _backward_constexprs(32, {"REVERSED_Q_TILES": False}, names) == {"REVERSED_Q_TILES": "False"}
    from flexattn.lowering.common import read_bool_options
    from flexattn.lowering.configs import forward as forward_configs
    assert not read_bool_options({}, forward_configs.REVERSED_Q_TILES)["REVERSED_Q_TILES"]
    assert read_bool_options({"REVERSED_Q_TILES": True}, forward_configs.REVERSED_Q_TILES)["REVERSED_Q_TILES"]


# --------------------------------------------------------------------------------------
# dQ through atomics (DQ_ATOMIC): the same bounds as the dQ-program path
# --------------------------------------------------------------------------------------
DQ_ATOMIC_CASES = {
    "causal_odd": dict(L=scaled(47, 700), S=scaled(61, 900), make_mods=_no_buffers(None, mods.causal_mask)),
    "gqa_softcap": dict(Hq=4, Hkv=2, L=scaled(48, 640), S=scaled(48, 640),
                        make_mods=_no_buffers(mods.tanh_softcap(3.0), mods.causal_mask)),
    "alibi_learnable_lse": dict(Hq=2, L=scaled(40, 512), S=scaled(40, 512), make_mods=_alibi_learnable(2),
                                use_lse=True),
    "document_padded_dim": dict(L=scaled(64, 512), S=scaled(64, 512), E=24, Ev=40,
                                make_mods=_no_buffers(None, mods.document_mask(_doc_ids(scaled(64, 512))))),
}


@pytest.mark.triton_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32] + ([torch.bfloat16] if ON_CUDA else []), ids=str)
@pytest.mark.parametrize("case", sorted(DQ_ATOMIC_CASES))
@pytest.mark.parametrize("use_tma", [False, True], ids=lambda t: f"USE_TMA={t}")
def test_dq_atomic(case, dtype, use_tma):
    """With USE_TMA the dQ shares are bulk reductions through a descriptor of the
    float32 accumulator (the interpreter emulates them with atomic adds)."""
    if not ON_CUDA and dtype == torch.float32 and (case != "causal_odd" or use_tma):
        pytest.skip("interpreter budget: float32 on one case")
    run_case(dtype=dtype, options={"DQ_ATOMIC": True, "USE_TMA": use_tma}, block_size=scaled(16, 128),
             seed=zlib.crc32(case.encode()), **DQ_ATOMIC_CASES[case])


@pytest.mark.triton_kernels
@pytest.mark.parametrize("dq_atomic", [True, False])
def test_dq_atomic_option_reaches_the_kernel(dq_atomic):
    n = 32
    gen = torch.Generator().manual_seed(4)
    q, k, v = (harness.randn(gen, 1, 2, n, 16, dtype=torch.float16, requires_grad=True) for _ in range(3))

    def step(q, k, v):
        out = torch.compile(lambda q, k, v: flexattn.flex_attention(q, k, v, kernel_options={"DQ_ATOMIC": dq_atomic}),
                            backend="inductor", fullgraph=True)(q, k, v)
        return torch.autograd.grad(out.float().square().sum(), (q, k, v))

    _, code = run_and_get_code(step, q, k, v)
    backward = next(c for c in code if BACKWARD_MARK in c)
    assert f"DQ_ATOMIC : tl.constexpr = {dq_atomic}" in backward


@pytest.mark.triton_kernels
def test_dq_atomic_contradicts_deterministic():
    n = 32
    q, k, v = (torch.randn(1, 2, n, 16, device=DEVICE, requires_grad=True) for _ in range(3))

    def attend(q, k, v):
        return flexattn.flex_attention(q, k, v, kernel_options={"DQ_ATOMIC": True, "DETERMINISTIC": True})

    out = torch.compile(attend, backend="inductor", fullgraph=True)(q, k, v)
    with pytest.raises(Exception, match="DQ_ATOMIC=True.*deterministic mode"):
        torch.autograd.grad(out.sum(), (q, k, v))


@pytest.mark.parametrize("how", ["kernel_option", "torch_flag"])
def test_deterministic_gradients_are_bitwise_equal(how):
    n = scaled(32, 1000)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (harness.randn(gen, 1, 4, n, 16, dtype=torch.float16, requires_grad=True) for _ in range(3))
    k2, v2 = k[:, :2].detach().requires_grad_(True), v[:, :2].detach().requires_grad_(True)
    bm = create_block_mask(mods.causal_mask, None, None, n, n, device=DEVICE, BLOCK_SIZE=scaled(16, 128))
    options = {"DETERMINISTIC": True} if how == "kernel_option" else None
    alibi = mods.alibi(4, device=DEVICE)

    def attend(q, k, v):
        return flexattn.flex_attention(q, k, v, alibi, bm, enable_gqa=True, kernel_options=options)

    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(how == "torch_flag" or old)
    try:
        compiled = torch.compile(attend, backend="inductor", fullgraph=True)
        first = torch.autograd.grad(compiled(q, k2, v2).float().square().sum(), (q, k2, v2))
        second = torch.autograd.grad(compiled(q, k2, v2).float().square().sum(), (q, k2, v2))
    finally:
        torch.use_deterministic_algorithms(old)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.triton_kernels
def test_deterministic_refuses_captured_gradients():
    n = 32
    gen = torch.Generator().manual_seed(2)
    q, k, v = (harness.randn(gen, 1, 2, n, 16, requires_grad=True) for _ in range(3))
    slopes = torch.rand(2, device=DEVICE, requires_grad=True)

    def attend(q, k, v):
        return flexattn.flex_attention(q, k, v, mods.alibi_bias(slopes), kernel_options={"DETERMINISTIC": True})

    out = torch.compile(attend, backend="inductor", fullgraph=True)(q, k, v)
    with pytest.raises(Exception, match="deterministic mode"):
        torch.autograd.grad(out.sum(), (q, k, v, slopes))


# --------------------------------------------------------------------------------------
# float64 gradcheck of the compiled path
# --------------------------------------------------------------------------------------
def test_gradcheck_compiled_float64():
    """float64 gradcheck (fast mode) of the compiled path: q, k, v (GQA) and learnable
    ALiBi slopes, through the output and through the lse."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = harness.make_inputs(gen, B=1, Hq=2, Hkv=1, L=5, S=7, E=4, Ev=3, dtype=torch.float64,
                                  requires_grad=True)
    slopes = torch.rand(2, dtype=torch.float64, device=DEVICE, requires_grad=True)
    bm = create_block_mask(mods.causal_mask, None, None, 5, 7, device=DEVICE, BLOCK_SIZE=16)

    def attend(q, k, v, slopes):
        return flexattn.flex_attention(q, k, v, mods.alibi_bias(slopes), bm, enable_gqa=True,
                                       return_aux=AuxRequest(lse=True))

    compiled = torch.compile(attend, backend="inductor", fullgraph=True)
    assert torch.autograd.gradcheck(lambda *a: compiled(*a)[0], (q, k, v, slopes), fast_mode=True)
    # float64 inputs give a float64 lse (as torch's flex does): gradcheck's default step.
    assert compiled(q, k, v, slopes)[1].lse.dtype == torch.float64
    assert torch.autograd.gradcheck(lambda *a: compiled(*a)[1].lse, (q, k, v, slopes), fast_mode=True)


@pytest.mark.parametrize("q_dtype, bias_dtype", [(torch.float32, torch.float64), (torch.float64, torch.float16),
                                                 (torch.float16, torch.float64), (torch.float64, torch.float32)],
                         ids=str)
def test_captured_tensor_of_another_dtype(q_dtype, bias_dtype):
    """A learnable bias whose dtype is not the query's (torch's own tests build their
    float64 golden with the bias left in float16): the scores keep the kernel's dtype
    (float32, float64 for float64 calls) whatever the bias promotes them to, and the
    bias gets its gradient in its own dtype."""
    n, E = scaled(40, 300), 16
    gen = harness.generator(5)
    q, k, v = harness.make_inputs(gen, B=2, Hq=2, L=n, S=n, E=E, dtype=q_dtype, requires_grad=True)
    bias = harness.randn(gen, n, n, dtype=bias_dtype, requires_grad=True)
    grad_out = harness.randn(gen, 2, 2, n, E, dtype=q_dtype)
    mask = create_block_mask(mods.causal_mask, None, None, n, n, device=DEVICE, BLOCK_SIZE=scaled(16, 128))

    def attend(q, k, v, bias):
        out = flexattn.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + bias[i, j], block_mask=mask)
        return out, None

    def run(fn, q, k, v, bias):
        out, _, grads = harness.attention_grads(lambda *a: fn(*a, bias), (q, k, v), grad_out.to(q.dtype),
                                                captured=(bias,))
        return out, grads

    compiled = torch.compile(attend, backend="inductor", fullgraph=True)
    test = run(compiled, *harness.copies((q, k, v, bias)))
    with flexattn.eager_mods():
        ref = run(attend, *harness.copies((q, k, v, bias)))
        golden = run(attend, *harness.copies((q, k, v, bias), torch.float64))
    assert test[0].dtype == q_dtype and test[1][3].dtype == bias_dtype
    harness.check_three_way("out", test[0], ref[0], golden[0], q_dtype)
    for name, t, r, g in zip(("grad_q", "grad_k", "grad_v"), test[1], ref[1], golden[1]):
        harness.check_three_way(name, t, r, g, q_dtype)
    harness.check_three_way("grad_bias", test[1][3], ref[1][3], golden[1][3], bias_dtype,
                            ratio=harness.CAPTURED_GRAD_RATIO)


@pytest.mark.parametrize("q_dtype", [torch.float64, torch.float16], ids=str)
def test_captured_bool_tensor(q_dtype):
    """A bool table read by score_mod and mask_mod, negated and compared (torch's
    test_seq_masking, whose float64 golden call failed to compile on the H100: float64
    calls read bool tensors from an int32 copy), forward and backward."""
    n, E = scaled(40, 300), 16
    gen = harness.generator(9)
    q, k, v = harness.make_inputs(gen, B=2, Hq=2, L=n, S=n, E=E, dtype=q_dtype, requires_grad=True)
    grad_out = harness.randn(gen, 2, 2, n, E, dtype=q_dtype)
    second_half = torch.arange(n, device=DEVICE) >= n // 2
    flags = torch.rand(n, generator=gen).to(DEVICE) < 0.5

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.where(second_half[q_idx] == second_half[kv_idx], score, score - 2.0 * ~flags[kv_idx])

    def mask_mod(b, h, q_idx, kv_idx):
        return ~flags[kv_idx] | (q_idx >= kv_idx)

    mask = create_block_mask(mask_mod, None, None, n, n, device=DEVICE, BLOCK_SIZE=scaled(16, 128))

    def attend(q, k, v):
        return flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=mask), None

    compiled = torch.compile(attend, backend="inductor", fullgraph=True)
    test = harness.attention_grads(compiled, harness.copies((q, k, v)), grad_out)
    with flexattn.eager_mods():
        ref = harness.attention_grads(attend, harness.copies((q, k, v)), grad_out)
        golden = harness.attention_grads(attend, harness.copies((q, k, v), torch.float64), grad_out.double())
    harness.check_three_way("out", test[0], ref[0], golden[0], q_dtype)
    for name, t, r, g in zip(("grad_q", "grad_k", "grad_v"), test[2], ref[2], golden[2]):
        harness.check_three_way(name, t, r, g, q_dtype)


@pytest.mark.parametrize("default_mask", [True, False], ids=["default_mask", "block_mask"])
def test_only_a_captured_tensor_wants_a_gradient(default_mask):
    """q, k and v frozen, a learnable bias training alone (a frozen model with a tuned
    bias): the backward still has the forward's lse to read (the API had asked for none)."""
    n = scaled(48, 300)
    gen = harness.generator(9)
    q, k, v = harness.make_inputs(gen, B=1, Hq=2, L=n, S=n, E=16, dtype=torch.float32)
    bias = harness.randn(gen, n, requires_grad=True)
    mask = None if default_mask else create_block_mask(noop_mask, None, None, n, n, device=DEVICE,
                                                       BLOCK_SIZE=scaled(16, 128))

    def loss(fn, q, k, v, bias):
        return fn(q, k, v, score_mod=lambda s, b, h, i, j: s + bias[j], block_mask=mask).square().sum()

    (got,) = torch.autograd.grad(loss(torch.compile(flexattn.flex_attention), q, k, v, bias), bias)
    with flexattn.eager_mods():
        (ref,) = torch.autograd.grad(loss(flexattn.flex_attention, q, k, v, bias), bias)
        golden_bias = bias.detach().double().requires_grad_(True)
        (golden,) = torch.autograd.grad(loss(flexattn.flex_attention, q.double(), k.double(), v.double(),
                                             golden_bias), golden_bias)
    harness.check_three_way("grad_bias", got, ref, golden, torch.float32, ratio=harness.CAPTURED_GRAD_RATIO)

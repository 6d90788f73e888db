"""Numerics of the fused forward kernel, driven through torch.compile and Inductor.

Every case runs the HOP three ways from the same fresh random inputs: the dense reference
in float64 (golden), the dense reference in the test dtype, and the compiled call (our
Triton template; on CPU through the Triton interpreter). The compiled run passes when
``err(kernel, golden) <= 2 * err(reference, golden) + floor`` for the output, the
log-sum-exp and (when requested) the row max, with no NaN (tests/_harness.py).
Allocator memory is filled with NaN before each compiled call, so a row the kernel
forgets to write shows up as NaN.

Shapes depend on the device: small in the interpreter (float16/float32 only: the
interpreter is wrong for bfloat16), larger on CUDA (plus bfloat16).
"""

from __future__ import annotations

import os
import re
import zlib

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import flexattn
import flexattn.lowering
from flexattn import mods
from flexattn._hop import flex_attention_hop
from flexattn.block_mask import and_masks, create_block_mask, create_mask, noop_mask

import _harness as harness
from conftest import DEVICE

flexattn.lowering.register()


pytestmark = pytest.mark.usefixtures("flexattn_kernels")

ON_CUDA, DTYPES, scaled = harness.ON_CUDA, harness.DTYPES, harness.scaled
SLOW = os.environ.get("FLEXATTN_SLOW") == "1"

DEFAULT_OPTIONS = dict(OUTPUT_LOGSUMEXP=True, OUTPUT_MAX=True, PRESCALE_QK=False,
                       ROWS_GUARANTEED_SAFE=False, BLOCKS_ARE_CONTIGUOUS=False)



# --------------------------------------------------------------------------------------
# Harness
# --------------------------------------------------------------------------------------
def _compiled(score_mod, block_mask_tuple, scale, options):
    def fn(q, k, v):
        return flex_attention_hop(q, k, v, score_mod, block_mask_tuple, scale, options, (), ())

    return torch.compile(fn, backend="inductor", fullgraph=True)


def run_case(
    *, dtype, B=2, Hq=2, Hkv=None, Bkv=None, L=64, S=64, E=32, Ev=None,
    score_mod=None, mask_mod=None, block_size=128, options=None, make_inputs=None,
    block_mask_tuple=None, seed=0, scale=None, ratio=None,
):
    """Build inputs, run golden / reference / compiled, check the 3-way bound (scale:
    the softmax scale, 1/sqrt(E) by default; ratio: the bound's factor, RATIO by default)."""
    options = {**DEFAULT_OPTIONS, **(options or {})}
    q, k, v = harness.make_inputs(seed, B=B, Hq=Hq, Hkv=Hkv, Bkv=Bkv, L=L, S=S, E=E, Ev=Ev, dtype=dtype,
                                  make=make_inputs)
    L, S = q.shape[2], k.shape[2]
    score_mod = score_mod or (lambda score, b, h, q_idx, kv_idx: score)
    if block_mask_tuple is None:
        bm = create_block_mask(mask_mod or noop_mask, None, None, L, S, device=DEVICE,
                               BLOCK_SIZE=block_size)
        block_mask_tuple = bm.as_tuple()
    scale = q.shape[-1] ** -0.5 if scale is None else scale

    golden, ref = harness.reference_runs(harness.dense_reference(score_mod, block_mask_tuple, scale, options),
                                         (q, k, v))
    harness.poison_allocator(4 * (q.numel() + v.numel() // v.shape[2] * L + 2 * q.numel() // q.shape[-1]))
    out = _compiled(score_mod, block_mask_tuple, scale, options)(q, k, v)

    assert out[0].shape == (q.shape[0], q.shape[1], L, v.shape[-1])
    harness.check_attention(out, ref, golden, dtype, lse=options["OUTPUT_LOGSUMEXP"],
                            max_scores=options["OUTPUT_MAX"], ratio=ratio)
    return out, golden


# --------------------------------------------------------------------------------------
# The library of mods
# --------------------------------------------------------------------------------------
def _doc_ids(n: int) -> torch.Tensor:
    bounds = torch.tensor([0, n // 5, n // 2, n - n // 7, n])
    ids = torch.zeros(n, dtype=torch.int32)
    for i in range(len(bounds) - 1):
        ids[bounds[i]:bounds[i + 1]] = i
    return ids.to(DEVICE)


MOD_CASES = {
    "none": lambda n, h: (None, None),
    "causal": lambda n, h: (None, mods.causal_mask),
    "sliding_window": lambda n, h: (None, mods.sliding_window(n // 4)),
    "alibi_causal": lambda n, h: (mods.alibi(h, device=DEVICE), mods.causal_mask),
    "softcap_causal": lambda n, h: (mods.tanh_softcap(2.0), mods.causal_mask),
    "document": lambda n, h: (None, mods.document_mask(_doc_ids(n))),
    "prefix_lm": lambda n, h: (None, mods.prefix_lm(n // 3)),
    "relative_bias": lambda n, h: (
        mods.relative_bias(torch.randn(h, 2 * n - 1, generator=torch.Generator().manual_seed(3)).to(DEVICE)),
        None),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", sorted(MOD_CASES))
def test_mod_library(case, dtype):
    n = scaled(100, 1000)
    score_mod, mask_mod = MOD_CASES[case](n, 2)
    run_case(dtype=dtype, L=n, S=n, score_mod=score_mod, mask_mod=mask_mod, seed=zlib.crc32(case.encode()))


# --------------------------------------------------------------------------------------
# Lengths, head dims, heads, batch
# --------------------------------------------------------------------------------------
LENGTHS = [(1, 17), (17, 1), (127, 129), (255, 100)] + (
    [(1000, 1000), (4097, 129), (129, 4097)] if ON_CUDA else [])


@pytest.mark.parametrize("L,S", LENGTHS, ids=lambda x: str(x))
def test_lengths(L, S):
    run_case(dtype=torch.float16, L=L, S=S, mask_mod=None)


@pytest.mark.parametrize("L,S", [(127, 129), (255, 100)], ids=str)
def test_lengths_causal_fp32(L, S):
    run_case(dtype=torch.float32, L=L, S=S, mask_mod=mods.causal_mask)


HEAD_DIMS = [(16, 16), (80, 80), (96, 96), (128, 128), (256, 256), (32, 64), (64, 16), (8, 24)] + (
    [(192, 192), (64, 128)] if ON_CUDA else [])


@pytest.mark.parametrize("E,Ev", HEAD_DIMS, ids=str)
def test_head_dims(E, Ev):
    n = scaled(33, 513)
    run_case(dtype=torch.float16, B=1, L=n, S=n, E=E, Ev=Ev, mask_mod=mods.causal_mask)


@pytest.mark.parametrize("Hq,Hkv,Bkv", [(4, 2, None), (4, 1, None), (2, 2, 1), (4, 1, 1)],
                         ids=["gqa", "mqa", "kv_batch_1", "mqa_kv_batch_1"])
def test_heads_and_kv_batch(Hq, Hkv, Bkv):
    n = scaled(70, 700)
    run_case(dtype=torch.float16, Hq=Hq, Hkv=Hkv, Bkv=Bkv, L=n, S=n,
             score_mod=mods.alibi(Hq, device=DEVICE), mask_mod=mods.causal_mask)


def test_non_contiguous_inputs():
    B, H, L, S, E = 2, 3, scaled(60, 600), scaled(90, 900), 32

    def make(gen):
        q = harness.randn(gen, B, L, H, E, dtype=torch.float16).transpose(1, 2)
        k_big = harness.randn(gen, B, H, S, 2 * E, dtype=torch.float16)
        k = k_big[..., ::2]  # last-dim stride 2
        v = harness.randn(gen, S, B, H, E, dtype=torch.float16).permute(1, 2, 0, 3)
        return q, k, v

    run_case(dtype=torch.float16, make_inputs=make, mask_mod=mods.causal_mask)


# --------------------------------------------------------------------------------------
# Masked rows, captured tensors
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_fully_masked_rows(dtype):
    n = scaled(100, 1000)
    dead = n // 3

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= dead) & (kv_idx <= q_idx)

    out, golden = run_case(dtype=dtype, L=n, S=n, mask_mod=mask_mod)
    harness.check_masked_rows(lambda t: t[:, :, :dead], out=out[0], lse=out[1], max_scores=out[2])


def test_captured_tensors_indexed_by_every_index():
    B, H, n = 2, 3, scaled(80, 800)
    g = torch.Generator().manual_seed(7)
    bias_b, bias_h = torch.randn(B, generator=g).to(DEVICE), torch.randn(H, generator=g).to(DEVICE)
    bias_q, bias_kv = torch.randn(n, generator=g).to(DEVICE), torch.randn(n, generator=g).to(DEVICE)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias_b[b] + bias_h[h] + bias_q[q_idx] * bias_kv[kv_idx]

    run_case(dtype=torch.float32, B=B, Hq=H, L=n, S=n, score_mod=score_mod, mask_mod=mods.causal_mask)


def test_data_dependent_captures():
    """A bucket table indexed by a computed bucket, and a per-batch prefix length."""
    B, H, n = 2, 2, scaled(90, 900)
    g = torch.Generator().manual_seed(11)
    buckets = 16
    table = torch.randn(H, buckets, generator=g).to(DEVICE)
    prefix = torch.tensor([n // 4, n // 2], dtype=torch.int32).to(DEVICE)

    def score_mod(score, b, h, q_idx, kv_idx):
        bucket = ((kv_idx - q_idx).abs() // 8).clamp(max=buckets - 1)
        return score + table[h, bucket]

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < prefix[b]) | (kv_idx <= q_idx)

    bm = create_block_mask(mask_mod, B, None, n, n, device=DEVICE)
    run_case(dtype=torch.float16, B=B, Hq=H, L=n, S=n, score_mod=score_mod,
             block_mask_tuple=bm.as_tuple())


@pytest.mark.parametrize("table_dtype", [torch.float16] + ([torch.bfloat16] if ON_CUDA else []), ids=str)
def test_comparison_with_a_half_table_rounds_the_scalar_as_eager(table_dtype):
    """``table[kv_idx] > threshold`` compares in the table's dtype in eager (create_block_mask,
    the reference), so an entry equal to the rounded threshold is masked out; the kernel must
    agree (Inductor before torch 2.12 compared it with the unrounded scalar)."""
    B, H, n = 1, 2, scaled(64, 384)
    threshold = {torch.float16: -0.1, torch.bfloat16: -0.59}[table_dtype]
    rounded = torch.tensor(threshold, dtype=table_dtype).item()
    assert rounded > threshold, "the case needs a scalar that rounds up"
    g = torch.Generator().manual_seed(5)
    table = torch.randn(H, n, generator=g).to(table_dtype)
    table[:, ::3] = rounded
    table = table.to(DEVICE)

    def mask_mod(b, h, q_idx, kv_idx):
        return (table[h, kv_idx] > threshold) | (kv_idx == 0)

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.where(table[h, kv_idx] <= threshold, score - 4.0, score)

    bm = create_block_mask(mask_mod, None, H, n, n, device=DEVICE, BLOCK_SIZE=16)
    assert not create_mask(mask_mod, None, H, n, n, device=DEVICE)[..., 3].any()
    run_case(dtype=torch.float16, B=B, Hq=H, L=n, S=n, score_mod=score_mod, block_mask_tuple=bm.as_tuple())


@pytest.mark.parametrize("score_mod", [None, mods.tanh_softcap(5.0)], ids=["no_score_mod", "softcap"])
@pytest.mark.parametrize("options", [{}, {"PRESCALE_QK": True}], ids=["plain", "prescale"])
def test_float64_to_float64_precision(score_mod, options):
    """A float64 call meets float64's floor: the scale, log2(e) and ln(2) enter the kernel
    as float64 constants (a bare Python float enters Triton's arithmetic as float32,
    about 3e-8 relative error)."""
    n = scaled(48, 300)
    run_case(dtype=torch.float64, L=n, S=n, scale=1 / 3, score_mod=score_mod, mask_mod=mods.causal_mask,
             block_size=16, options=options)


# --------------------------------------------------------------------------------------
# kernel_options and block sizes
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("options", [
    {"PRESCALE_QK": True},
    {"ROWS_GUARANTEED_SAFE": True},
    {"BLOCK_M": 32, "BLOCK_N": 32},
    {"BLOCK_N": 16, "num_warps": 2, "num_stages": 1},
    {"OUTPUT_MAX": False, "OUTPUT_LOGSUMEXP": False},
    {"USE_TMA": True},
    {"USE_TMA": False},
    {"ONE_KV_LOOP": True},
    {"ONE_KV_LOOP": False},
    {"ONE_KV_LOOP": True, "USE_TMA": True, "BLOCK_N": 32},
    {"REVERSED_Q_TILES": True, "BLOCK_M": 32},
], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_kernel_options(options):
    n = scaled(100, 1000)
    run_case(dtype=torch.float16, L=n, S=n, score_mod=mods.tanh_softcap(5.0),
             mask_mod=mods.causal_mask, options=options)


@pytest.mark.triton_kernels
def test_longest_tiles_first_covers_every_program_once():
    """REVERSED_Q_TILES maps the launch index to (tile, batch, head) with the tile slowest:
    with 3 batches, 5 heads (odd, unequal) and a head-dependent score_mod, every tile of
    every head is computed once and lands in its place."""
    n = scaled(70, 300)
    run_case(dtype=torch.float16, B=3, Hq=5, L=n, S=n, score_mod=mods.alibi(5, device=DEVICE),
             mask_mod=mods.causal_mask, block_size=32, options={"REVERSED_Q_TILES": True, "BLOCK_M": 32})


@pytest.mark.triton_kernels
@pytest.mark.parametrize("use_tma", [True, False], ids=lambda t: f"USE_TMA={t}")
@pytest.mark.parametrize("L,S,E,Ev,Hq,Hkv", [(100, 77, 40, 24, 4, 2), (33, 130, 64, 64, 2, 1)], ids=str)
def test_tma_loads_at_the_edges(use_tma, L, S, E, Ev, Hq, Hkv):
    """Tensor-descriptor loads past KV_LEN and into the head-dim padding read 0 (the copy
    engine's zero fill), as the masked pointer loads do; the query tile past Q_LEN, read
    through masked pointers either way, too."""
    n = scaled(1, 10)
    run_case(dtype=torch.float16, L=L * n, S=S * n, E=E, Ev=Ev, Hq=Hq, Hkv=Hkv, block_size=64,
             score_mod=mods.alibi(Hq, device=DEVICE), mask_mod=mods.causal_mask,
             options={"USE_TMA": use_tma})


@pytest.mark.triton_kernels
@pytest.mark.parametrize("grad,aux,allocated", [
    (False, None, 0), (True, None, 1), (False, "lse", 1), (False, "max_scores", 1), (True, "max_scores", 2),
], ids=["no-grad", "grad", "lse", "max", "grad-max"])
def test_a_call_allocates_only_the_row_statistics_it_writes(grad, aux, allocated):
    """The forward allocates its (B, H, L) log-sum-exp and row maxima only where the call
    writes them (the lse for a backward or a caller, the maxima for a caller): an
    allocation is host time a call, which short calls feel. The results stay right."""
    B, H, n = 1, 2, 48
    q, k, v = (harness.randn(harness.generator(i), B, H, n, 16, dtype=torch.float16, requires_grad=grad)
               for i in range(3))
    bm = create_block_mask(mods.causal_mask, None, None, n, n, device=DEVICE, BLOCK_SIZE=16)
    request = flexattn.AuxRequest(**{aux: True}) if aux else None

    def call(q, k, v):
        return flexattn.flex_attention(q, k, v, block_mask=bm, return_aux=request)

    result, codes = run_and_get_code(torch.compile(call, backend="inductor", fullgraph=True), q, k, v)
    forward = next(c for c in codes if "flexattn_forward" in c or "IS_FULL_BLOCKS" in c)
    stats = re.findall(rf"empty_strided_\w+\(\({B}, {H}, {n}\), \(", forward)
    assert len(stats) == allocated, f"{len(stats)} (B, H, L) allocations, expected {allocated}"
    out, aux_out = result if aux else (result, None)
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(t.detach().float() for t in (q, k, v)), is_causal=True)
    assert (out.float() - expected).abs().max() < 2e-3
    if aux == "lse":
        scores = (q.detach().float() @ k.detach().float().transpose(-1, -2)) / 4.0
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=DEVICE).tril(), float("-inf"))
        assert (aux_out.lse - scores.logsumexp(-1)).abs().max() < 2e-3


@pytest.mark.triton_kernels
@pytest.mark.parametrize("grad,score", [(False, "softcap"), (True, "softcap"), (True, "alibi")])
def test_the_tile_choice_sees_what_the_call_writes_and_what_its_score_mod_reads(monkeypatch, grad, score):
    """The forward's default tile depends on whether the kernel writes the log-sum-exp
    (inputs requiring grad) and whether the score_mod reads positions (ALiBi does, a
    soft-cap of the score does not): the lowering passes both to the tile table."""
    from flexattn.lowering import forward as forward_lowering

    seen = []
    choose = forward_lowering.forward_configs.candidate_configs

    def recording(*args, **kwargs):
        seen.append(kwargs)
        return choose(*args, **kwargs)

    monkeypatch.setattr(forward_lowering.forward_configs, "candidate_configs", recording)
    B, H, n = 1, 2, 48
    q, k, v = (harness.randn(harness.generator(i), B, H, n, 16, dtype=torch.float16, requires_grad=grad)
               for i in range(3))
    docs = (torch.arange(n, device=DEVICE) >= 20).to(torch.int32)
    bm = create_block_mask(mods.document_mask(docs), None, None, n, n, device=DEVICE, BLOCK_SIZE=16)
    score_mod = mods.alibi(H, device=DEVICE) if score == "alibi" else mods.tanh_softcap(20.0)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: flexattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm),
                             backend="inductor", fullgraph=True)
    compiled(q, k, v)
    assert seen, "the forward lowering chose no tile"
    assert seen[0]["mask_reads_memory"] and seen[0]["writes_lse"] == grad
    assert seen[0]["score_reads_positions"] == (score == "alibi")


class _Chosen(Exception):
    """Stops a compile once the forward lowering has asked for its tiles."""


def _offsets_causal(docs, offsets):
    return lambda b, h, q, kv: (docs[q] == docs[kv]) & (q - offsets[docs[q]] >= kv - offsets[docs[kv]])


def _offsets_bounds(docs, offsets):
    return lambda b, h, q, kv: (kv >= offsets[docs[q]]) & (kv < offsets[docs[q] + 1])


def _searched(docs, offsets):
    return lambda b, h, q, kv: torch.searchsorted(offsets[1:].contiguous(), kv, right=True) == docs[q]


def _pair_table(docs, offsets):
    table = docs[:, None] == docs[None, :]
    return lambda b, h, q, kv: table[q, kv]


@pytest.mark.triton_kernels
@pytest.mark.parametrize("make_mask,gathers", [
    (lambda docs, offsets: mods.document_mask(docs), 1), (_offsets_bounds, 0), (_offsets_causal, 2),
    (_pair_table, 2), (_searched, 3)], ids=["ids", "bounds_by_query", "offsets_causal", "pair_table", "searched"])
def test_the_tile_choice_counts_the_mask_mods_reads_at_each_key(monkeypatch, make_mask, gathers):
    """The lowering hands the tile table the number of captured-tensor reads the mask_mod
    makes at positions depending on kv_idx (reads at q_idx alone are once a query tile, a
    read written twice is one; a search over a 6-entry table reads once at each of three steps)."""
    from flexattn.lowering import forward as forward_lowering

    seen = []

    def recording(*args, **kwargs):
        seen.append(kwargs)
        raise _Chosen

    monkeypatch.setattr(forward_lowering.forward_configs, "candidate_configs", recording)
    n = 48
    docs = (torch.arange(n, device=DEVICE) * 5 // n).to(torch.int64)
    offsets = torch.tensor([0, 10, 20, 29, 39, 48, 48], device=DEVICE)
    q, k, v = (harness.randn(harness.generator(i), 1, 2, n, 16, dtype=torch.float16) for i in range(3))
    bm = create_block_mask(make_mask(docs, offsets), None, None, n, n, device=DEVICE, BLOCK_SIZE=16)
    torch._dynamo.reset()
    with pytest.raises(Exception) as raised:
        torch.compile(lambda q, k, v: flexattn.flex_attention(q, k, v, block_mask=bm), fullgraph=True)(q, k, v)
    assert seen and raised.errisinstance((_Chosen, torch._dynamo.exc.BackendCompilerFailed))
    assert seen[0]["mask_reads_memory"] and seen[0]["mask_key_gathers"] == gathers


# Each scale with each way the loop may hold its scores (interpreter budget: 4 of the 8).
@pytest.mark.parametrize("scale,options,with_score_mod", [
    (0.0, {}, False), (-0.3, {}, False), (-0.3, {"PRESCALE_QK": True}, False), (0.0, {"PRESCALE_QK": True}, True),
], ids=["zero-plain", "negative-plain", "negative-prescaled", "zero-prescaled-score_mod"])
def test_zero_and_negative_scales(scale, options, with_score_mod):
    """A scale <= 0 is a valid softmax (uniform, or favouring the smallest products); the
    kernel may not take the row max before scaling then, and masked scores stay -inf."""
    n = scaled(70, 700)
    run_case(dtype=torch.float16, L=n, S=n, scale=scale, mask_mod=mods.causal_mask, options=options,
             score_mod=mods.tanh_softcap(20.0) if with_score_mod else None, block_size=32)


def test_prescale_without_score_mod():
    n = scaled(100, 1000)
    run_case(dtype=torch.float32, L=n, S=n, mask_mod=mods.sliding_window(n // 3),
             options={"PRESCALE_QK": True})


@pytest.mark.parametrize("one_kv_loop", [False, True], ids=lambda b: f"ONE_KV_LOOP={b}")
def test_blocks_are_contiguous(one_kv_loop):
    """A causal mask keeps the promise: per query block, the partial list is the diagonal
    block and the full list the blocks before it, each a run of consecutive blocks (a
    non-causal sliding window would not: its two edges are partial). In one loop the
    walk jumps from the diagonal back to the first full block."""
    n = scaled(200, 2000)
    run_case(dtype=torch.float16, L=n, S=n, mask_mod=mods.causal_mask,
             options={"BLOCKS_ARE_CONTIGUOUS": True, "ONE_KV_LOOP": one_kv_loop}, block_size=64)


@pytest.mark.parametrize("block_size", [64, (32, 64), (128, 64)], ids=str)
def test_block_sizes(block_size):
    n = scaled(130, 1300)
    run_case(dtype=torch.float16, L=n, S=n, mask_mod=and_masks(mods.causal_mask, mods.sliding_window(n // 2)),
             block_size=block_size)


@pytest.mark.parametrize("one_kv_loop", [False, True], ids=lambda b: f"ONE_KV_LOOP={b}")
def test_no_full_blocks(one_kv_loop):
    """A BlockMask tuple without full blocks (HAS_FULL_BLOCKS=False): only the partial
    blocks are visited, by the kernel and by the reference alike."""
    n = scaled(100, 1000)
    t = list(create_block_mask(mods.causal_mask, None, None, n, n, device=DEVICE).as_tuple())
    t[4], t[5] = None, None
    run_case(dtype=torch.float16, L=n, S=n, block_mask_tuple=tuple(t), options={"ONE_KV_LOOP": one_kv_loop})


@pytest.mark.parametrize("causal", [False, True], ids=["document", "document_causal"])
def test_memory_mask_tile(causal):
    """sm90's D=64 tile for a mask_mod that reads captured tensors (one loop over 64x64
    tiles, MEMORY_MASK_TABLES), pinned so that the interpreter runs it too: documents of
    unequal odd lengths (rows of a few blocks, a partial block at every boundary), GQA."""
    n = scaled(150, 1500)
    docs = mods.document_mask(_doc_ids(n))
    run_case(dtype=torch.float16, Hq=4, Hkv=2, L=n, S=n, E=64,
             mask_mod=and_masks(docs, mods.causal_mask) if causal else docs,
             options={"fwd_ONE_KV_LOOP": True, "fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64})


# --------------------------------------------------------------------------------------
# GPU-only: precision modes and 64-bit offsets
# --------------------------------------------------------------------------------------
@pytest.mark.skipif(not ON_CUDA, reason="TF32 is a GPU matmul mode")
def test_float32_tf32_follows_matmul_precision():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        # Both runs use TF32 products (torch's matmul follows allow_tf32 too), but Triton
        # truncates fp32 operands to TF32 where cuBLAS rounds them, which roughly doubles
        # the error of each product: the bound here is 5x the reference's, not 2x.
        run_case(ratio=5.0, dtype=torch.float32, L=512, S=512, mask_mod=mods.causal_mask)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.skipif(not (ON_CUDA and SLOW), reason="needs ~10 GB of GPU memory; FLEXATTN_SLOW=1")
def test_64bit_offsets():
    """K/V with more than 2**31 elements: the last KV blocks lie past 32-bit offsets."""
    S, E, L = (1 << 24) + 256, 128, 128
    q = torch.randn(1, 1, L, E, device=DEVICE, dtype=torch.float16)
    k = torch.randn(1, 1, S, E, device=DEVICE, dtype=torch.float16)
    v = torch.randn(1, 1, S, E, device=DEVICE, dtype=torch.float16)
    tail = 512

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx >= S - tail

    bm = create_block_mask(mask_mod, None, None, L, S, device=DEVICE)
    out = _compiled(lambda s, b, h, qi, ki: s, bm.as_tuple(), E ** -0.5, DEFAULT_OPTIONS)(q, k, v)
    expect = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k[:, :, -tail:].float(), v[:, :, -tail:].float())
    assert torch.allclose(out[0].float(), expect, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_table_driven_neighbourhood_with_alibi_on_the_partial_heavy_tile(dtype):
    """A 2-D neighbourhood whose token positions come from a table (every listed block
    partial, four gathers a score) with ALiBi on top, as create_block_mask marks it
    (partial_heavy): on sm90 at D=128 the call takes the Triton template's 128x128
    eight-warp tile (bench/DECISIONS.md#forward-partial-heavy-memory-mask), elsewhere the
    default tile; the three-way bound either way."""
    side = 32 if DEVICE == "cuda" else 16
    n = side * side
    order = torch.randperm(n, generator=torch.Generator().manual_seed(5))
    rows, cols = (order // side).to(DEVICE), (order % side).to(DEVICE)

    def neighbours(b, h, q_idx, kv_idx):
        return ((rows[q_idx] - rows[kv_idx]).abs() <= 2) & ((cols[q_idx] - cols[kv_idx]).abs() <= 2)

    bm = create_block_mask(neighbours, None, None, n, n, device=DEVICE)
    assert bm.partial_heavy is True
    options = flexattn.options.internal_options(MASK_PARTIAL_HEAVY=True)
    run_case(dtype=dtype, B=2 if DEVICE == "cuda" else 1, Hq=4 if DEVICE == "cuda" else 2, L=n, S=n, E=128,
             score_mod=mods.alibi(4 if DEVICE == "cuda" else 2, device=DEVICE), block_mask_tuple=bm.as_tuple(),
             options=options)

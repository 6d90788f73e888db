"""The split-KV decode kernel (lowering/decode.py, templates/decode*.py.jinja).

Numerics as in test_forward.py: every case runs the HOP three ways from the same fresh
random inputs (float64 reference = golden, reference in the test dtype, the compiled
call) and passes when ``err(kernel, golden) <= 2 * err(reference, golden) + floor`` for
out, lse and max, with no NaN (tests/_harness.py). The allocator is poisoned with NaN
before each compiled call.

Decoding as a server does it: the L new query tokens are the last L positions of a
sequence of S keys. The kernel hands the mods q_idx in 0..L-1 (the query's own index);
the mods below add the offset S - L themselves, read from a captured tensor.

Shapes depend on the device: small in the interpreter (float16/float32), larger on CUDA
(plus bfloat16). Most cases pin FORCE_DECODE=True so that short KV lengths exercise the
decode kernel too; ``test_kernel_choice`` checks the automatic choice.

The shares of a tile are merged by a second pass by default (FUSED_MERGE=False) or in
the kernel (FUSED_MERGE=True, one launch); the cases most likely to break a merge run both
(``MERGES``). The interpreter runs a grid's programs one after another in index order,
so the last share of a tile to finish is always its highest active one; the
``reordered_programs`` fixture runs them in a scrambled order instead, so that any share
may be the one that merges.
"""

from __future__ import annotations

import math
import os
import re
import zlib

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import flexattn
import flexattn.lowering
from flexattn import _compat, mods
from flexattn._hop import flex_attention_hop
from flexattn.block_mask import create_block_mask, noop_mask
from flexattn.lowering import decode as decode_lowering
from flexattn.lowering import decode_plan as plan
from flexattn.lowering.configs import decode as decode_configs
from flexattn.lowering.configs.base import multiprocessor_count
from flexattn.options import internal_options

from _generated_code import constexpr
import _harness as harness
from conftest import DEVICE

flexattn.lowering.register()
_compat.use_interpreter_libdevice()

ON_CUDA, DTYPES, scaled = harness.ON_CUDA, harness.DTYPES, harness.scaled
SLOW = os.environ.get("FLEXATTN_SLOW") == "1"
DECODE_MARK = "def attend_kv_tile("   # the decode kernel's step
MAIN_MARK = "def attend_kv_blocks("    # the main forward kernel's inner loop

OPTIONS = dict(OUTPUT_LOGSUMEXP=True, OUTPUT_MAX=True, PRESCALE_QK=False,
               ROWS_GUARANTEED_SAFE=False, BLOCKS_ARE_CONTIGUOUS=False, FORCE_DECODE=True)


pytestmark = pytest.mark.usefixtures("inductor_runs_flexattn_kernels")

#: The two ways of merging the shares (see lowering/decode.py).
MERGES = {"fused_merge": {"FUSED_MERGE": True}, "merge_pass": {"FUSED_MERGE": False}}



# --------------------------------------------------------------------------------------
# Harness
# --------------------------------------------------------------------------------------
def run_case(
    *, dtype=torch.float16, B=2, Hq=4, Hkv=2, Bkv=None, L=1, S=129, E=32, Ev=None,
    score_mod=None, mask_mod=None, block_mask=None, block_size=128, mask_heads=None,
    options=None, make_inputs=None, seed=0, with_code=False, scale=None,
):
    """Build inputs, run golden / reference / compiled, check the 3-way bound.

    The BlockMask is built over (B, mask_heads) (default: no head dimension).
    Returns (compiled outputs, golden outputs[, generated code]).
    """
    options = {**OPTIONS, **(options or {})}
    q, k, v = harness.make_inputs(seed, B=B, Hq=Hq, Hkv=Hkv, Bkv=Bkv, L=L, S=S, E=E, Ev=Ev, dtype=dtype,
                                  make=make_inputs)
    L, S = q.shape[2], k.shape[2]
    score_mod = score_mod or (lambda score, b, h, q_idx, kv_idx: score)
    if block_mask is None:
        block_mask = create_block_mask(mask_mod or noop_mask, B, mask_heads, L, S, device=DEVICE,
                                       BLOCK_SIZE=block_size).as_tuple()
    scale = q.shape[-1] ** -0.5 if scale is None else scale

    golden, ref = harness.reference_runs(harness.dense_reference(score_mod, block_mask, scale, options), (q, k, v))

    def fn(q, k, v):
        return flex_attention_hop(q, k, v, score_mod, block_mask, scale, options, (), ())

    harness.poison_allocator(8 * q.numel() * 64)
    out, code = run_and_get_code(torch.compile(fn, backend="inductor", fullgraph=True), q, k, v)
    code = "\n".join(code)
    if options.get("FORCE_DECODE"):
        assert DECODE_MARK in code, "the decode kernel did not run"

    assert out[0].shape == (q.shape[0], q.shape[1], L, v.shape[-1])
    harness.check_attention(out, ref, golden, dtype, lse=options["OUTPUT_LOGSUMEXP"], max_scores=options["OUTPUT_MAX"])
    return (out, golden, code) if with_code else (out, golden)


# Mods written in logical positions: the query row q_idx sits at position q_idx + offset.
# ``offset`` is a captured tensor of per-sequence offsets, indexed by b.
def causal_at(offset):
    def causal_with_offset(b, h, q_idx, kv_idx):
        return q_idx + offset[b] >= kv_idx
    return causal_with_offset


def window_at(offset, window):
    def sliding_window_with_offset(b, h, q_idx, kv_idx):
        pos = q_idx + offset[b]
        return (pos >= kv_idx) & (pos - kv_idx < window)
    return sliding_window_with_offset


def alibi_at(offset, num_heads):
    slopes = mods.alibi_slopes(num_heads, device=DEVICE)

    def alibi_with_offset(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - (q_idx + offset[b]))
    return alibi_with_offset


def document_at(offset, doc_ids):
    def document_with_offset(b, h, q_idx, kv_idx):
        pos = q_idx + offset[b]
        return (doc_ids[pos] == doc_ids[kv_idx]) & (pos >= kv_idx)
    return document_with_offset


MAX_BATCH = 8


def _offset(L, S):
    """The query's offset, S - L for every sequence, as a captured (MAX_BATCH,) tensor.

    (Not a 0-d tensor: Inductor hands a 0-d CPU graph input to Triton kernels as a
    Python scalar, which the templates' captured-tensor loads cannot take.)
    """
    return torch.full((MAX_BATCH,), S - L, device=DEVICE)


# --------------------------------------------------------------------------------------
# GQA groups, query lengths, KV lengths
# --------------------------------------------------------------------------------------
GROUPS_AND_LENGTHS = [(1, 1), (2, 3), (4, 1), (8, 1), (8, 7), (4, 16), (2, 64), (1, 33)] + (
    [(8, 64), (4, 40), (1, 64)] if ON_CUDA else [])


@pytest.mark.parametrize("merge", sorted(MERGES))
@pytest.mark.parametrize("group,L", GROUPS_AND_LENGTHS, ids=lambda x: str(x))
def test_groups_and_query_lengths(group, L, merge):
    S = scaled(200, 2000)
    run_case(B=2, Hq=2 * group, Hkv=2, L=L, S=S, mask_mod=causal_at(_offset(L, S)),
             options=MERGES[merge], seed=group * 100 + L)


KV_LENGTHS = [1, 17, 129, 1000] + ([4097, 32768] if ON_CUDA else [])


@pytest.mark.parametrize("S", KV_LENGTHS)
def test_kv_lengths(S):
    L = 1
    run_case(B=scaled(1, 4), Hq=8, Hkv=2, L=L, S=S, mask_mod=causal_at(_offset(L, S)), seed=S)


@pytest.mark.parametrize("scale", [0.0, -0.3], ids=["zero", "negative"])
def test_zero_and_negative_scales(scale):
    """The decode kernel takes the row max before a positive scale only (as the forward)."""
    L, S = 2, scaled(150, 1500)
    run_case(B=2, Hq=4, Hkv=2, L=L, S=S, mask_mod=causal_at(_offset(L, S)), scale=scale, seed=3)


def test_kv_length_not_a_multiple_no_mask():
    run_case(B=2, Hq=4, Hkv=4, L=2, S=scaled(333, 3333), seed=5)


@pytest.mark.parametrize("merge", sorted(MERGES))
@pytest.mark.parametrize("S,L,group,split", [(129, 1, 4, None), (333, 3, 2, 5), (1000, 1, 8, 3), (256, 16, 1, None)],
                         ids=str)
def test_dense_kv_default_mask(S, L, group, split, merge):
    """flex_attention's own default mask (the internal DEFAULT_MASK option): the kernel walks every KV
    position without the BlockMask tables (DENSE_KV), at odd lengths, with splits that
    leave shares empty, and with a score_mod."""
    options = {**MERGES[merge], **internal_options(DEFAULT_MASK=True), **({"SPLIT_KV": split} if split else {})}
    _, _, code = run_case(B=2, Hq=2 * group, Hkv=2, L=L, S=S, score_mod=mods.tanh_softcap(3.0),
                          options=options, seed=S + L, with_code=True)
    assert constexpr(code, "DENSE_KV") == "True"
    assert "KV_IDX" not in code


def test_dense_kv_public_api():
    """block_mask=None through the public API under torch.compile: the default mask's
    tables are not computed (the decode kernel and the merge pass are the only kernels)."""
    code = _code_for(1, scaled(300, 3000), {"FUSED_MERGE": False})
    assert constexpr(code, "DENSE_KV") == "True"
    launches = re.findall(r"(triton_\w+)\.run\(", code.split("def call(", 1)[1])
    assert len(launches) == 2 and all(name.startswith("triton_tem_") for name in launches), launches


# --------------------------------------------------------------------------------------
# Mods
# --------------------------------------------------------------------------------------
def _document_ids(S):
    bounds = torch.tensor([S // 7, S // 3, S - S // 5])
    return torch.bucketize(torch.arange(S), bounds, right=True).to(DEVICE)


MOD_CASES = {
    "causal_offset": lambda L, S, H: (None, causal_at(_offset(L, S))),
    "sliding_window": lambda L, S, H: (None, window_at(_offset(L, S), S // 3)),
    "alibi": lambda L, S, H: (alibi_at(_offset(L, S), H), causal_at(_offset(L, S))),
    "softcap": lambda L, S, H: (mods.tanh_softcap(2.0), causal_at(_offset(L, S))),
    "document": lambda L, S, H: (None, document_at(_offset(L, S), _document_ids(S))),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", sorted(MOD_CASES))
def test_mods(case, dtype):
    L, S, Hq = 3, scaled(300, 3000), 4
    score_mod, mask_mod = MOD_CASES[case](L, S, Hq)
    run_case(dtype=dtype, Hq=Hq, Hkv=2, L=L, S=S, score_mod=score_mod, mask_mod=mask_mod,
             seed=zlib.crc32(case.encode()))


@pytest.mark.parametrize("merge", sorted(MERGES))
def test_captured_tensors_indexed_by_every_index(merge):
    """Bias tables indexed by b, h (per packed row), q_idx and kv_idx, and per-batch
    cache lengths: each sequence of the batch has its own number of valid keys (so the
    tiles of one call have different numbers of active shares)."""
    B, Hq, Hkv, L, S = 3, 8, 2, 4, scaled(150, 1500)
    g = torch.Generator().manual_seed(7)
    bias_b, bias_h = torch.randn(B, generator=g).to(DEVICE), torch.randn(Hq, generator=g).to(DEVICE)
    bias_q, bias_kv = torch.randn(L, generator=g).to(DEVICE), torch.randn(S, generator=g).to(DEVICE)
    lengths = torch.tensor([S, S // 2, 5], device=DEVICE)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias_b[b] + bias_h[h] + bias_q[q_idx] * bias_kv[kv_idx]

    def mask_mod(b, h, q_idx, kv_idx):
        return q_idx + lengths[b] - L >= kv_idx

    run_case(dtype=torch.float32, B=B, Hq=Hq, Hkv=Hkv, L=L, S=S, score_mod=score_mod, mask_mod=mask_mod,
             options=MERGES[merge])


@pytest.mark.parametrize("merge", sorted(MERGES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_fully_masked_rows(dtype, merge):
    """Head 1 and query row 0 see nothing: out 0, lse and max -inf there."""
    L, S = 3, scaled(140, 1400)
    off = _offset(L, S)

    def mask_mod(b, h, q_idx, kv_idx):
        return (h != 1) & (q_idx > 0) & (q_idx + off[b] >= kv_idx)

    out, _ = run_case(dtype=dtype, Hq=4, Hkv=2, L=L, S=S, mask_mod=mask_mod, options=MERGES[merge])
    for rows in (lambda t: t[:, 1], lambda t: t[:, :, 0]):
        harness.check_masked_rows(rows, out=out[0], lse=out[1], max_scores=out[2])
    for aux in (out[1], out[2]):
        assert torch.isfinite(aux[:, 0, 1:]).all()


def test_per_head_block_mask():
    """A BlockMask with a head dimension: heads are not packed (HEADS_PER_TILE=1), each
    head walks its own block list."""
    L, S = 2, scaled(300, 3000)
    off = _offset(L, S)

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx + off[b] >= kv_idx) & (q_idx + off[b] - kv_idx < 40 * (h + 1))

    _, _, code = run_case(Hq=4, Hkv=2, L=L, S=S, mask_mod=mask_mod, mask_heads=4, block_size=32,
                          with_code=True)
    assert "'HEADS_PER_TILE': 1" in code


# --------------------------------------------------------------------------------------
# Splits, tiles, block sizes, options
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("merge", sorted(MERGES))
@pytest.mark.parametrize("split", [1, 3, 16])
def test_split_kv_pinned(split, merge):
    """One share, uneven shares, and more shares than KV steps (some shares empty)."""
    L, S = 2, scaled(250, 2500)
    _, _, code = run_case(Hq=4, Hkv=2, L=L, S=S, mask_mod=window_at(_offset(L, S), S // 2),
                          options={"SPLIT_KV": split, **MERGES[merge]}, with_code=True)
    assert f"'SPLIT_KV': {split}," in code
    # One share never needs a merge; otherwise FUSED_MERGE decides.
    two_launches = split > 1 and not MERGES[merge]["FUSED_MERGE"]
    assert len(_decode_kernels(code)) == (2 if two_launches else 1)


@pytest.mark.parametrize("merge", sorted(MERGES))
@pytest.mark.parametrize("split", [1, 3])
def test_float64_shares_and_statistics_stay_float64(split, merge):
    """float64 inputs: the shares, their merge and the returned lse and max in float64, as
    the main kernel's (within the harness's float64 floor, 1e-10)."""
    L, S = 1, 300
    out, _ = run_case(dtype=torch.float64, Hq=2, Hkv=2, L=L, S=S, E=16, mask_mod=causal_at(_offset(L, S)),
                      options={"SPLIT_KV": split, **MERGES[merge]})
    assert out[1].dtype == out[2].dtype == torch.float64


def test_split_kv_automatic():
    """Fewer tiles than (virtual) multiprocessors split the KV steps; as many tiles as
    multiprocessors or more run unsplit, in one launch (the host's rule, on the device
    the tests run on)."""
    L, S = 1, scaled(300, 3000)
    sms = multiprocessor_count(torch.device(DEVICE))
    few = max(1, sms // 4)   # (B, KV heads) tiles: B x 1 KV head of 2 query heads

    def last_half(b, h, q_idx, kv_idx):   # the query at position S - 1; no per-batch tensor
        return (kv_idx <= q_idx + S - 1) & (q_idx + S - 1 - kv_idx < S // 2)

    for B, expect_split in ((few, True), (sms, False)):
        _, _, code = run_case(B=B, Hq=2, Hkv=1, L=L, S=S, mask_mod=last_half,
                              options={"FUSED_MERGE": False}, with_code=True, seed=B)
        split = int(constexpr(code, "SPLIT_KV"))
        assert (split > 1) == expect_split, (B, split)
        assert len(_decode_kernels(code)) == (2 if expect_split else 1)


def _decode_kernels(code: str) -> list[str]:
    """Names of the template kernels launched by the generated code."""
    return re.findall(r"^\s+(triton_tem_\w+)\.run\(", code, re.M)


@pytest.fixture
def reordered_programs(monkeypatch):
    """Run each grid's programs in a scrambled order in the Triton interpreter (program
    i of n runs as program (i * a) mod n, a coprime with n), so that the last share of a
    tile to finish is not its last index."""
    if DEVICE != "cpu":
        pytest.skip("the interpreter's program order; a GPU runs programs in any order anyway")
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.set_grid_idx

    def set_grid_idx(self, x, y, z):
        nx, ny, nz = self.grid_dim
        n = nx * ny * nz
        step = next(a for a in range(n // 2 + 1, 2 * n + 2) if math.gcd(a, n) == 1)
        flat = ((x * ny + y) * nz + z) * step % n
        original(self, flat // (ny * nz), flat // nz % ny, flat % nz)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "set_grid_idx", set_grid_idx)


@pytest.mark.parametrize("split,S,L,group,window", [
    (2, 17, 1, 4, None),         # fewer steps than shares: one active share writes directly
    (5, 255, 3, 4, 100),         # a window: 2 of 5 shares active per tile
    (16, 1000, 7, 2, 300),       # many shares, odd lengths
    (4, 129, 64, 1, None),       # long query: several query tiles per head
    (3, 1000, 1, 8, 1000),       # every share active
], ids=str)
def test_fused_merge_in_any_program_order(reordered_programs, split, S, L, group, window):
    """Whichever share finishes last merges the tile, in one launch."""
    off = _offset(L, S)
    mask_mod = causal_at(off) if window is None else window_at(off, window)
    _, _, code = run_case(B=2, Hq=2 * group, Hkv=2, L=L, S=S, mask_mod=mask_mod, score_mod=alibi_at(off, 2 * group),
                          options={"SPLIT_KV": split, "FUSED_MERGE": True}, with_code=True, seed=split * S + L)
    assert len(_decode_kernels(code)) == 1


def test_fused_merge_fully_masked_tiles_any_order(reordered_programs):
    """Tiles with no visible key at all (every share empty) and rows masked inside
    otherwise live tiles."""
    L, S = 3, 300
    off = _offset(L, S)

    def mask_mod(b, h, q_idx, kv_idx):
        return (b == 0) & (q_idx != 1) & (q_idx + off[b] >= kv_idx)

    out, _ = run_case(B=2, Hq=4, Hkv=2, L=L, S=S, mask_mod=mask_mod, options={"SPLIT_KV": 4})
    for rows in (lambda t: t[1], lambda t: t[0, :, 1]):
        harness.check_masked_rows(rows, out=out[0], lse=out[1])


def test_tile_counters_shared_and_left_zero():
    """Decode calls of one graph share one counter workspace, zeroed once per graph call
    and sized for the call with the most tiles; each kernel leaves it zero for the next
    (a counter left non-zero would make the next call's last share miss its turn and
    leave its output unwritten: NaN from the poisoned allocator). Calling the compiled
    graph again gives the same outputs, bit for bit."""
    E, S = 16, scaled(200, 2000)
    g = torch.Generator().manual_seed(3)
    k, v = (torch.randn(2, 2, S, E, generator=g).to(DEVICE, torch.float16) for _ in range(2))
    queries = [torch.randn(2, 8, L, E, generator=g).to(DEVICE, torch.float16) for L in (1, 16, 1)]
    masks = [create_block_mask(causal_at(_offset(q.shape[2], S)), None, None, q.shape[2], S, device=DEVICE)
             for q in queries]
    options = {"SPLIT_KV": 3, "FUSED_MERGE": True, "FORCE_DECODE": True}

    def fn(k, v, *queries):
        return [flexattn.flex_attention(q, k, v, block_mask=bm, enable_gqa=True, kernel_options=options)
                for q, bm in zip(queries, masks)]

    compiled = torch.compile(fn, fullgraph=True)
    harness.poison_allocator(1 << 20)
    outs, code = run_and_get_code(compiled, k, v, *queries)
    code = "\n".join(code)
    assert len(_decode_kernels(code)) == 3
    assert len(re.findall(rf"^\s+{decode_lowering.COUNTERS_WORKSPACE}\w* = ", code, re.M)) == 1
    assert len(re.findall(rf"^\s+{decode_lowering.COUNTERS_WORKSPACE}\w*\.zero_\(\)", code, re.M)) == 1
    for q, bm, out in zip(queries, masks, outs):
        expect = flexattn.flex_attention(q.double(), k.double(), v.double(), block_mask=bm, enable_gqa=True)
        torch.testing.assert_close(out.double(), expect, atol=2e-3, rtol=2e-3)
    again = compiled(k, v, *queries)
    for first, second in zip(outs, again):
        assert torch.equal(first, second)


def test_fused_merge_autotuned():
    """max_autotune benchmarks every candidate config, each with its own zeroed counter
    workspace (run many times: each run leaves it zero for the next)."""
    with torch._inductor.config.patch(max_autotune=True):
        run_case(B=1, Hq=2, Hkv=1, L=1, S=129, E=16, options={"SPLIT_KV": 2, "FUSED_MERGE": True})


def test_bad_fused_merge():
    with pytest.raises(Exception, match="FUSED_MERGE must be True or False"):
        _code_for(1, 300, {"FUSED_MERGE": "yes"})


@pytest.mark.parametrize("block_size,L", [(16, 40), ((32, 64), 5), (64, 1)], ids=str)
def test_block_sizes(block_size, L):
    """Small Q blocks split the query over several tiles and BlockMask rows."""
    S = scaled(190, 1900)
    run_case(Hq=4, Hkv=1, L=L, S=S, mask_mod=causal_at(_offset(L, S)), block_size=block_size, seed=L)


@pytest.mark.parametrize("options", [
    {"PRESCALE_QK": True},
    {"ROWS_GUARANTEED_SAFE": True},
    {"BLOCKS_ARE_CONTIGUOUS": True},
    {"BLOCK_N": 16, "num_warps": 2, "num_stages": 1},
    {"OUTPUT_MAX": False, "OUTPUT_LOGSUMEXP": False},
    {"USE_TMA": True},
    {"USE_TMA": True, "SPLIT_KV": 3, "FUSED_MERGE": True},
], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_kernel_options(options):
    L, S = 2, scaled(200, 2000)
    run_case(Hq=4, Hkv=2, L=L, S=S, score_mod=mods.tanh_softcap(5.0), mask_mod=causal_at(_offset(L, S)),
             options=options, block_size=64)


@pytest.mark.parametrize("merge", sorted(MERGES))
@pytest.mark.parametrize("aux", [None, "lse"])
def test_a_decode_step_allocates_only_the_row_statistics_it_writes(merge, aux):
    """A decoding step without a log-sum-exp request allocates neither (B, H, L) statistic
    (each is host time a step); with one, one. Either merge; the results stay right."""
    B, H, L, S = 2, 4, 1, 300
    q, k, v = harness.make_inputs(0, B=B, Hq=H, Hkv=H, L=L, S=S, E=32, dtype=torch.float16)
    bm = create_block_mask(noop_mask, None, None, L, S, device=DEVICE, BLOCK_SIZE=64)
    options = {"FORCE_DECODE": True, "SPLIT_KV": 3, **MERGES[merge]}
    request = flexattn.AuxRequest(lse=True) if aux else None

    def step(q, k, v):
        return flexattn.flex_attention(q, k, v, block_mask=bm, kernel_options=options, return_aux=request)

    result, codes = run_and_get_code(torch.compile(step, backend="inductor", fullgraph=True), q, k, v)
    code = "\n".join(codes)
    assert DECODE_MARK in code, "the decode kernel did not run"
    stats = re.findall(rf"empty_strided_\w+\(\({B}, {H}, {L}\), \(", code)
    assert len(stats) == (1 if aux else 0), f"{len(stats)} (B, H, L) allocations"
    out, aux_out = result if aux else (result, None)
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    assert (out.float() - scores.softmax(-1) @ v.float()).abs().max() < 2e-3
    if aux:
        assert (aux_out.lse - scores.logsumexp(-1)).abs().max() < 2e-3


@pytest.mark.parametrize("split,chunk", [(1, None), (3, None), (7, None), (1, 2), (3, 2)])
def test_scattered_block_lists(split, chunk):
    """BlockMask lists in no particular order, with blocks left out, walked in steps of a
    quarter block: each share takes every split-th block of the partial list and then of
    the full list (strided views of both), shares differ in length, and with 7 splits of
    4 + 4 blocks some shares are empty. With chunks of 2 block indices a share of 4
    blocks walks two chunks per list, the second loaded while the first is walked."""
    B, Hkv, L, block, S = 2, 2, 1, 64, 9 * 64 + 13
    n = math.ceil(S / block)
    gen = torch.Generator().manual_seed(split)
    order = torch.stack([torch.randperm(n, generator=gen) for _ in range(B)]).to(torch.int32).view(B, 1, 1, n)
    partial_count, full_count = 4, 4
    full = torch.cat([order[..., partial_count:], order[..., :partial_count]], dim=-1)

    def every_third_key_hidden(b, h, q_idx, kv_idx):
        return kv_idx % 3 != (b + h) % 3

    counts = torch.full((B, 1, 1), partial_count, dtype=torch.int32)
    bm = flexattn.BlockMask.from_kv_blocks(
        counts.to(DEVICE), order.to(DEVICE), torch.full((B, 1, 1), full_count, dtype=torch.int32).to(DEVICE),
        full.to(DEVICE), BLOCK_SIZE=(128, block), mask_mod=every_third_key_hidden, seq_lengths=(L, S))
    options = {"FORCE_DECODE": True, "SPLIT_KV": split, "BLOCK_N": 16, "num_warps": 2, "num_stages": 1,
               **({"LIST_CHUNK": chunk} if chunk else {})}
    _, _, code = run_case(B=B, Hq=4, Hkv=Hkv, L=L, S=S, block_mask=bm.as_tuple(), options=options,
                          seed=split, with_code=True)
    assert constexpr(code, "BLOCKS_ARE_CONTIGUOUS") == "False"
    # Pinned, or the default: the power of two that holds a share's blocks (ceil(n / split)).
    assert int(constexpr(code, "LIST_CHUNK")) == (chunk or max(2, 1 << (math.ceil(n / split) - 1).bit_length()))


def test_no_full_blocks():
    L, S = 2, scaled(200, 2000)
    t = list(create_block_mask(causal_at(_offset(L, S)), None, None, L, S, device=DEVICE,
                               BLOCK_SIZE=64).as_tuple())
    t[4], t[5] = None, None
    run_case(Hq=4, Hkv=2, L=L, S=S, block_mask=tuple(t))


@pytest.mark.parametrize("E,Ev", [(16, 16), (80, 48), (64, 128)] + ([(128, 128), (256, 256)] if ON_CUDA else []),
                         ids=str)
def test_head_dims(E, Ev):
    L, S = 1, scaled(130, 1300)
    run_case(Hq=4, Hkv=1, L=L, S=S, E=E, Ev=Ev, mask_mod=causal_at(_offset(L, S)))


def test_tma_at_odd_lengths_and_padded_head_dims():
    """K/V tiles through descriptors: the copy engine zero-fills keys past KV_LEN and
    the head-dim padding (E=80 pads to 128, Ev=48 to 64)."""
    L, S = 3, scaled(131, 1301)
    run_case(Hq=4, Hkv=2, L=L, S=S, E=80, Ev=48, mask_mod=causal_at(_offset(L, S)), options={"USE_TMA": True})


def test_kv_batch_1_and_non_contiguous():
    """A KV cache shared by the batch (batch 1) in (S, H, D) order; a strided query."""
    B, Hq, Hkv, L, S, E = 2, 4, 2, 3, scaled(100, 1000), 32

    def make(gen):
        q = harness.randn(gen, B, L, Hq, E, dtype=torch.float16).transpose(1, 2)
        k = harness.randn(gen, 1, S, Hkv, E, dtype=torch.float16).transpose(1, 2)
        v = harness.randn(gen, 1, S, Hkv, E, dtype=torch.float16).transpose(1, 2)
        return q, k, v

    run_case(B=B, make_inputs=make, mask_mod=causal_at(_offset(L, S)))


# --------------------------------------------------------------------------------------
# Which kernel runs
# --------------------------------------------------------------------------------------
def _code_for(L, S, options):
    q = torch.randn(1, 4, L, 16, device=DEVICE, dtype=torch.float16)
    k = torch.randn(1, 2, S, 16, device=DEVICE, dtype=torch.float16)
    v = torch.randn(1, 2, S, 16, device=DEVICE, dtype=torch.float16)

    def fn(q, k, v):
        return flexattn.flex_attention(q, k, v, enable_gqa=True, kernel_options=options)

    out, code = run_and_get_code(torch.compile(fn, backend="inductor", fullgraph=True), q, k, v)
    expect = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(2, 1), v.float().repeat_interleave(2, 1))
    assert torch.allclose(out.float(), expect, atol=2e-3, rtol=2e-3)
    return "\n".join(code)


@pytest.mark.parametrize("L,S,options,expect", [
    (1, 300, None, "decode"),
    (64, 256, None, "decode"),
    (1, 300, {"FORCE_DECODE": False}, "main"),
    (1, 300, {"FORCE_USE_FLEX_ATTENTION": True}, "main"),
    (1, 40, None, "main"),
    (65, 300, None, "main"),
    (100, 40, {"FORCE_DECODE": True}, "decode"),
], ids=lambda x: str(x))
def test_kernel_choice(L, S, options, expect):
    code = _code_for(L, S, options)
    assert (DECODE_MARK in code) == (expect == "decode")
    assert (MAIN_MARK in code and DECODE_MARK not in code) == (expect == "main")


def test_contradicting_force_options():
    with pytest.raises(Exception, match="FORCE_DECODE=True and FORCE_USE_FLEX_ATTENTION=True"):
        _code_for(1, 300, {"FORCE_DECODE": True, "FORCE_USE_FLEX_ATTENTION": True})


@pytest.mark.parametrize("chunk", [1, 3, 0, True, "16"])
def test_bad_list_chunk(chunk):
    # Not an int: the registry's kind check in flex_attention; a bad int: the lowering's.
    with pytest.raises(Exception, match="LIST_CHUNK must be (a power of two >= 2|an int)"):
        _code_for(1, 300, {"LIST_CHUNK": chunk})


def test_list_chunk_size():
    assert plan.list_chunk_size(64, {}) == plan.LIST_CHUNK_DEFAULT
    assert plan.list_chunk_size(5, {}) == 8
    assert plan.list_chunk_size(1, {}) == 2
    assert plan.list_chunk_size(64, {"LIST_CHUNK": 4}) == 4


@pytest.mark.parametrize("split", [0, 1000, "4"])
def test_bad_split_kv(split):
    with pytest.raises(Exception, match="SPLIT_KV must be an int"):
        _code_for(1, 300, {"SPLIT_KV": split})


def test_public_api_decode_step_eager():
    """flexattn.flex_attention called eagerly (it compiles itself) with a decode-shaped
    GQA query, lse and max requested."""
    B, Hq, Hkv, L, S, E = 2, 8, 2, 1, scaled(300, 3000), 32
    q = torch.randn(B, Hq, L, E, device=DEVICE, dtype=torch.float16)
    k = torch.randn(B, Hkv, S, E, device=DEVICE, dtype=torch.float16)
    v = torch.randn(B, Hkv, S, E, device=DEVICE, dtype=torch.float16)
    bm = flexattn.create_block_mask(window_at(_offset(L, S), 100), None, None, L, S, device=DEVICE)
    out, aux = flexattn.flex_attention(q, k, v, block_mask=bm, enable_gqa=True,
                                       return_aux=flexattn.AuxRequest(lse=True, max_scores=True))
    keep = torch.arange(S, device=DEVICE) >= S - 100
    expect = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double()[:, :, keep].repeat_interleave(4, 1), v.double()[:, :, keep].repeat_interleave(4, 1))
    assert torch.allclose(out.double(), expect, atol=3e-3, rtol=3e-3)
    assert aux.lse.shape == aux.max_scores.shape == (B, Hq, L)


def _growing_cache_steps(B=2, Hq=4, Hkv=2, E=16):
    """(q, k, v) of three decode steps, one query token against caches of growing length
    (the second length makes Dynamo compile with a symbolic KV length)."""
    q = torch.randn(B, Hq, 1, E, device=DEVICE, dtype=torch.float16)
    for S in (scaled(300, 3000), scaled(333, 3333), scaled(410, 4100)):
        k = torch.randn(B, Hkv, S, E, device=DEVICE, dtype=torch.float16)
        v = torch.randn(B, Hkv, S, E, device=DEVICE, dtype=torch.float16)
        yield q, k, v


@pytest.mark.parametrize("merge", sorted(MERGES))
def test_growing_cache_dynamic_shapes(merge):
    """Decode steps against a cache that grows: after the second length Dynamo compiles
    with a symbolic KV length, and the same decode kernel serves every later step."""
    compiled = torch.compile(flexattn.flex_attention, fullgraph=True)
    for q, k, v in _growing_cache_steps():
        S = k.shape[2]
        bm = flexattn.create_block_mask(window_at(_offset(1, S), 100), None, None, 1, S, device=DEVICE)
        out = compiled(q, k, v, block_mask=bm, enable_gqa=True, kernel_options=MERGES[merge])
        ref = flexattn.flex_attention(q.double(), k.double(), v.double(), block_mask=bm, enable_gqa=True)
        torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)


def test_growing_cache_default_mask():
    """block_mask=None (DENSE_KV) against a growing cache: the symbolic KV length sets the
    number of steps, eagerly (flexattn compiles itself) and under torch.compile."""
    compiled = torch.compile(flexattn.flex_attention, fullgraph=True)
    for q, k, v in _growing_cache_steps():
        expect = torch.nn.functional.scaled_dot_product_attention(
            q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1))
        for out in (compiled(q, k, v, enable_gqa=True), flexattn.flex_attention(q, k, v, enable_gqa=True)):
            torch.testing.assert_close(out.double(), expect, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("merge", sorted(MERGES))
def test_dynamic_batch(merge):
    """A symbolic batch (marked dynamic): the number of tiles, and so of tile counters,
    is symbolic too, and one compiled graph serves every batch size."""
    Hq, Hkv, L, E, S = 4, 2, 3, 16, scaled(300, 3000)
    compiled = torch.compile(flexattn.flex_attention, fullgraph=True)
    g = torch.Generator().manual_seed(11)
    bm = flexattn.create_block_mask(causal_at(_offset(L, S)), None, None, L, S, device=DEVICE)
    options = {"FORCE_DECODE": True, "SPLIT_KV": 3, **MERGES[merge]}
    for i, B in enumerate((2, 3, 5)):
        q = torch.randn(B, Hq, L, E, generator=g).to(DEVICE, torch.float16)
        k, v = (torch.randn(B, Hkv, S, E, generator=g).to(DEVICE, torch.float16) for _ in range(2))
        for t in (q, k, v):
            torch._dynamo.mark_dynamic(t, 0)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            out = compiled(q, k, v, block_mask=bm, enable_gqa=True, kernel_options=options)
        ref = flexattn.flex_attention(q.double(), k.double(), v.double(), block_mask=bm, enable_gqa=True)
        torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)


# --------------------------------------------------------------------------------------
# Host-side choices (no kernels)
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("group,L,sparse_q,per_head,expect", [
    (4, 1, 128, False, (4, 1, 16)),
    (8, 1, 128, False, (8, 1, 16)),
    (8, 64, 128, False, (8, 8, 64)),
    (8, 64, 128, True, (1, 64, 64)),
    (1, 64, 128, False, (1, 64, 64)),
    (1, 40, 16, False, (1, 16, 16)),
    (6, 5, 128, False, (6, 8, 64)),
    (128, 1, 128, False, (64, 1, 64)),
], ids=str)
def test_packing(group, L, sparse_q, per_head, expect):
    p = plan.packing(group, L, sparse_q, per_head)
    assert (p.heads_per_tile, p.block_q, p.block_m) == expect


def test_split_count():
    # B=1, 8 KV heads, 1 token, 132 SMs: one program per SM; a 32k cache has the steps.
    assert plan.split_count(sms=132, programs=8, max_steps=512, kernel_options={}) == 16
    assert plan.split_count(sms=132, programs=4, max_steps=512, kernel_options={}) == 33
    # Short caches cap the split at MIN_STEPS_PER_SPLIT steps a share.
    assert plan.split_count(sms=132, programs=8, max_steps=8, kernel_options={}) == 4
    wave = 132 * plan.RESIDENT_PROGRAMS_PER_SM
    # Fewer tiles than multiprocessors: still MIN_SPLIT_KV splits when the row has the
    # steps, but no more programs than a wave.
    assert plan.split_count(sms=132, programs=64, max_steps=512, kernel_options={}) == plan.MIN_SPLIT_KV
    assert plan.split_count(sms=132, programs=131, max_steps=512, kernel_options={}) == max(1, min(
        plan.MIN_SPLIT_KV, wave // 131))
    # The tiles alone fill the multiprocessors within a wave: no split.
    assert plan.split_count(sms=132, programs=132, max_steps=512, kernel_options={}) == 1
    assert plan.split_count(sms=132, programs=wave, max_steps=512, kernel_options={}) == 1
    # More tiles than a wave: MIN_WAVES waves of programs.
    split = plan.split_count(sms=132, programs=wave + 1, max_steps=512, kernel_options={})
    assert split & (split - 1) == 0 and split // 2 * (wave + 1) < plan.MIN_WAVES * wave <= split * (wave + 1)
    assert plan.split_count(sms=132, programs=1024, max_steps=512, kernel_options={"SPLIT_KV": 1}) == 1
    assert plan.split_count(sms=132, programs=8, max_steps=512, kernel_options={"SPLIT_KV": 5}) == 5
    # With BlockMask lists a share takes whole blocks: at most one split per listed block.
    assert plan.split_count(sms=132, programs=8, max_steps=512, kernel_options={}, max_blocks=5) == 5
    assert plan.split_count(sms=132, programs=8, max_steps=512, kernel_options={}, max_blocks=64) == 16
    # Rows of any length follow the same rule (bench/DECISIONS.md#decode-long-row-rule).
    assert plan.split_count(sms=132, programs=64, max_steps=2048, kernel_options={}) == plan.MIN_SPLIT_KV
    assert plan.split_count(sms=132, programs=256, max_steps=2048, kernel_options={}) == 1


def test_widen_for_latency():
    base = [decode_configs.DecodeConfig(64, 4, 3)]
    wide = plan.widen_for_latency(base, 128, 132, 512, torch.bfloat16, 128, {})
    assert [c.block_n for c in wide] == [plan.LATENCY_BLOCK_N]
    # Throughput-bound, float32, a pinned BLOCK_N, a narrow BlockMask block or a short
    # split keep the table's step.
    assert plan.widen_for_latency(base, 1024, 132, 512, torch.bfloat16, 128, {}) == base
    assert plan.widen_for_latency(base, 128, 132, 512, torch.float32, 128, {}) == base
    assert plan.widen_for_latency(base, 128, 132, 512, torch.bfloat16, 128, {"BLOCK_N": 64}) == base
    assert plan.widen_for_latency(base, 128, 132, 512, torch.bfloat16, 64, {}) == base
    assert plan.widen_for_latency(base, 128, 132, 128, torch.bfloat16, 128, {}) == base


def test_stream_step():
    """Long unsplit default-mask rows on sm90 take STREAM_CONFIG in place of the default
    (under autotuning the other candidates, the default among them, stay); anything else
    keeps the table's configs."""
    default = decode_configs.DecodeConfig(64, 4, 3)
    call = dict(generation="sm90", tiles=256, sms=132, split_kv=1, dense_keys=32768, dtype=torch.bfloat16,
                qk_dim_pad=128, sparse_kv=128, kernel_options={})
    assert plan.stream_step([default], **call) == [decode_configs.STREAM_CONFIG]
    autotuned = plan.stream_step([default, *decode_configs.AUTOTUNE_CANDIDATES], **call)
    assert autotuned[0] == decode_configs.STREAM_CONFIG
    assert set(autotuned[1:]) == {default, *decode_configs.AUTOTUNE_CANDIDATES} - {decode_configs.STREAM_CONFIG}
    assert plan.stream_step([default], **{**call, "dense_keys": plan.STREAM_KEYS}) == [decode_configs.STREAM_CONFIG]
    for change in ({"generation": "sm80"}, {"tiles": 132}, {"tiles": 64}, {"split_kv": 8}, {"dense_keys": None},
                   {"dense_keys": plan.STREAM_KEYS - 1}, {"dtype": torch.float32}, {"qk_dim_pad": 64},
                   {"qk_dim_pad": 256}, {"sparse_kv": 64}, {"kernel_options": {"num_stages": 3}},
                   {"kernel_options": {"BLOCK_N": 64}}):
        assert plan.stream_step([default], **{**call, **change}) == [default], change


def test_plan_decode_is_a_pure_function_of_its_inputs():
    """plan_decode runs without Inductor: a B=1 GQA step on an H100-sized sm90 device
    splits to fill the multiprocessors, widens its KV step (latency-bound) and packs the
    whole group; a B=32 step of the default mask over a long row streams unsplit."""
    base = dict(batch=1, q_heads=32, q_len=1, kv_len=32768, gqa_group=4, qk_dim_pad=128, v_dim_pad=128,
                dtype=torch.bfloat16, generation="sm90", sms=132, smem_limit=227 * 1024, sparse_q=128,
                sparse_kv=128, mask_varies_over_heads=False, dense_kv=True, row_width=None, max_autotune=False)
    small = plan.plan_decode(plan.DecodeInputs(**base))
    assert small.packing == plan.Packing(heads_per_tile=4, block_q=1, block_m=16)
    assert small.head_tiles == 8 and small.tiles == 8
    assert small.split_kv == plan.split_count(sms=132, programs=8, max_steps=32768 // 64, kernel_options={})
    assert [c.block_n for c in small.configs] == [plan.LATENCY_BLOCK_N]
    assert not small.fused_merge
    assert plan.plan_decode(plan.DecodeInputs(**base)) == small
    big = plan.plan_decode(plan.DecodeInputs(**{**base, "batch": 32}))
    assert big.split_kv == 1 and big.fused_merge and big.configs == (decode_configs.STREAM_CONFIG,)
    pinned = plan.plan_decode(plan.DecodeInputs(**{**base, "kernel_options": {"SPLIT_KV": 3, "LIST_CHUNK": 4}}))
    assert pinned.split_kv == 3 and pinned.list_chunk == 4
    # A BlockMask call: shares take whole blocks, at most the index rows' width.
    listed = plan.plan_decode(plan.DecodeInputs(**{**base, "dense_kv": False, "row_width": 5}))
    assert listed.split_kv <= 5


def test_decode_configs_fit_shared_memory():
    """A latency-widened D=256 step (128 keys, 3 stages: 384 KiB) is stepped down to fit."""
    base = dict(batch=1, q_heads=8, q_len=1, kv_len=8192, gqa_group=1, qk_dim_pad=256, v_dim_pad=256,
                dtype=torch.bfloat16, generation="sm90", sms=132, smem_limit=227 * 1024, sparse_q=128,
                sparse_kv=128, mask_varies_over_heads=False, dense_kv=True, row_width=None, max_autotune=True)
    planned = plan.plan_decode(plan.DecodeInputs(**base))
    assert planned.configs
    for cfg in planned.configs:
        assert decode_configs.shared_memory_estimate(cfg, planned.packing.block_m, 256, 256, 2) <= 227 * 1024


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("L", [4, 64], ids=lambda L: f"L{L}")
def test_float8_keys_and_values(kv_dtype, L):
    """A float8 KV cache under a float16 query (per-head key scales dequantised in
    score_mod, as torch's tests do): the decode kernel (L=4) and the forward kernel
    (L=64) widen each K/V tile to the query's dtype; checked against the reference on the
    same float8 values. No backward: it raises, naming the mixed dtypes."""
    gen = harness.generator(11)
    B, H, S, E = 1, 4, scaled(96, 1024), 64
    q = harness.randn(gen, B, H, L, E, dtype=torch.float16)
    k_full, v_full = (harness.randn(gen, B, H, S, E) for _ in range(2))
    # Scaled to e4m3's range (448) for both formats: e5m2's 57344 would overflow the
    # reference's float16 product q k^T.
    k_scale = k_full.abs().amax(dim=(-2, -1)) / 448.0
    v_scale = v_full.abs().amax(dim=(-2, -1), keepdim=True) / 448.0
    k, v = (k_full / k_scale[..., None, None]).to(kv_dtype), (v_full / v_scale).to(kv_dtype)

    def dequantise(score, b, h, q_idx, kv_idx):
        return score * k_scale[b, h]

    out = torch.compile(flexattn.flex_attention, fullgraph=True)(q, k, v, score_mod=dequantise) * v_scale
    with flexattn.eager_mods():
        ref = flexattn.flex_attention(q, k, v, score_mod=dequantise) * v_scale
        golden = flexattn.flex_attention(q.double(), k.double(), v.double(), score_mod=dequantise) * v_scale
    harness.check_three_way("out", out, ref, golden, torch.float16)
    q.requires_grad_(True)
    with pytest.raises(Exception, match="Backward pass with mixed query, key, and value dtype is not supported"):
        torch.compile(flexattn.flex_attention, fullgraph=True)(q, k, v).sum().backward()

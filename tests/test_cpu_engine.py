"""The C++ CPU engine itself (Inductor's C++ backend; flexattn/cpu/).

The numerics matrix (test_forward, test_backward, test_sinks, test_dropout,
test_random_mods, test_training, test_dynamic) runs on this path too (the
``flexattn_kernels`` fixture's ``[cpp]`` ids). What is particular to the engine is here:
shapes larger than the interpreter takes (spans merged up to the KV tile, sparse query
blocks split into tiles), the plan, chained and out-of-range indexing in mods, one
compile for every length, determinism, the mod library's code, its memory.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._inductor.utils import run_and_get_code

import flexattn
from flexattn import AuxRequest, mods
from flexattn.block_mask import create_block_mask
from flexattn.cpu import plan as cpu_plan
from flexattn.reference import dense_math

import _harness as harness
from conftest import DEVICE

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="the CPU engine")


@pytest.fixture(autouse=True)
def cpp_backend():
    with torch._inductor.config.patch(cpu_backend="cpp", force_disable_caches=True):
        torch._dynamo.reset()
        yield


def _attend_and_grads(attend, inputs, grad_out, grad_lse, captured=()):
    return harness.attention_grads(attend, inputs, grad_out, grad_lse, captured)


def _three_way(score_mod, bm, q, k, v, captured=(), *, seed=0, dtype=torch.float32):
    """Compiled call (out, lse and every gradient) against golden and reference."""
    gen = harness.generator(seed)
    grad_out, grad_lse = harness.make_output_grads(gen, q, v, with_lse=True)
    scale = q.shape[-1] ** -0.5

    def compiled(q, k, v, *caps):
        out, aux = flexattn.flex_attention(q, k, v, score_mod=score_mod(*caps), block_mask=bm, enable_gqa=True,
                                           return_aux=AuxRequest(lse=True))
        return out, aux.lse

    def reference(q, k, v, *caps):
        out, lse, _ = dense_math(q, k, v, score_mod(*caps), bm.as_tuple(), scale, (), ())
        return out, lse

    test = _attend_and_grads(torch.compile(compiled, fullgraph=True), harness.copies((q, k, v, *captured)),
                             grad_out, grad_lse)
    golden = _attend_and_grads(reference, harness.copies((q, k, v, *captured), torch.float64),
                               grad_out.double(), grad_lse.double())
    ref = _attend_and_grads(reference, harness.copies((q, k, v, *captured)), grad_out, grad_lse)
    harness.check_three_way("out", test[0], ref[0], golden[0], dtype)
    harness.check_three_way("lse", test[1], ref[1], golden[1], dtype)
    harness.check_gradients(test[2], ref[2], golden[2], dtype)


# --------------------------------------------------------------------------------------
# Shapes the interpreter cannot take
# --------------------------------------------------------------------------------------
def _window_ending_at_the_last_key(L, S, window=600):
    """A query row i at position S - L + i sees the ``window`` keys up to itself."""
    def mask_mod(b, h, q_idx, kv_idx):
        position = q_idx + (S - L)
        return (kv_idx <= position) & (position - kv_idx < window)
    return mask_mod


@pytest.mark.parametrize("block, L, S, E, Ev, Hkv", [
    ((128, 128), 1000, 1000, 80, 96, 2),     # spans of 4 merged blocks, odd tails
    ((512, 64), 700, 1030, 64, 64, 4),        # a sparse query block split into tiles
    ((64, 1024), 300, 2100, 32, 16, 1),       # a KV block wider than the KV tile
    ((16, 16), 129, 255, 16, 16, 4),          # tiny blocks
    ((128, 128), 1, 1000, 64, 64, 1),         # a decode step (MQA)
])
def test_long_sequences_forward_and_backward(block, L, S, E, Ev, Hkv):
    gen = harness.generator(1)
    q, k, v = harness.make_inputs(gen, B=2, Hq=4, Hkv=Hkv, L=L, S=S, E=E, Ev=Ev, dtype=torch.float32,
                                  requires_grad=True)
    bias = harness.randn(gen, 4, S, requires_grad=True)
    bm = create_block_mask(_window_ending_at_the_last_key(L, S), None, None, L, S, device="cpu", BLOCK_SIZE=block)
    _three_way(lambda bias: (lambda s, b, h, qi, ki: s + bias[h, ki]), bm, q, k, v, (bias,))


@pytest.mark.parametrize("L", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_few_query_rows(L, dtype):
    """Tiles of at most four rows (decode steps, speculative tokens) multiply in the
    engine's own loops, not BLAS, and 16-bit rows convert a vector at a time
    (bench/DECISIONS.md#cpu-few-row-products): row counts on both sides of the limit,
    head dims that are not a multiple of any vector width, KV spans that end inside a
    group of keys, forward and backward."""
    S, E, Ev = 333, 40, 36
    gen = harness.generator(7)
    q, k, v = harness.make_inputs(gen, B=2, Hq=4, Hkv=2, L=L, S=S, E=E, Ev=Ev, dtype=dtype, requires_grad=True)
    bias = harness.randn(gen, 4, S, requires_grad=True)
    bm = create_block_mask(_window_ending_at_the_last_key(L, S, window=200), None, None, L, S, device="cpu",
                           BLOCK_SIZE=(128, 64))
    _three_way(lambda bias: (lambda s, b, h, qi, ki: s + bias[h, ki]), bm, q, k, v, (bias,), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_dtypes_at_length(dtype):
    """bfloat16 too (the interpreter computes it wrongly, so the matrix leaves it to the GPU
    and to this engine), and float64 to float64 precision."""
    gen = harness.generator(2)
    q, k, v = harness.make_inputs(gen, B=1, Hq=4, Hkv=2, L=300, S=517, E=64, dtype=dtype, requires_grad=True)
    bm = create_block_mask(mods.causal_mask, None, None, 300, 517, device="cpu")
    _three_way(lambda: mods.tanh_softcap(20.0), bm, q, k, v, dtype=dtype)


@pytest.mark.parametrize("E, Ev", [(512, 512), (1024, 96), (320, 640)])
def test_head_dims_above_the_triton_kernels_limit(E, Ev):
    """Head dims past the Triton kernels' 256, up to the engine's CPU_ENGINE_MAX_HEAD_DIM
    (as torch's compiled CPU flex takes them), forward and backward, GQA."""
    gen = harness.generator(11)
    q, k, v = harness.make_inputs(gen, B=1, Hq=4, Hkv=2, L=130, S=200, E=E, Ev=Ev, dtype=torch.float32,
                                  requires_grad=True)
    bm = create_block_mask(mods.causal_mask, None, None, 130, 200, device="cpu", BLOCK_SIZE=64)
    _three_way(lambda: mods.alibi(4), bm, q, k, v)


@pytest.mark.parametrize("mask_name", ["parity", "documents"])
def test_query_blocks_with_the_same_lists_share_a_tile(mask_name):
    """Consecutive query blocks whose KV lists are the same run as one taller forward
    tile: partial blocks (parity: every block partial, the mask depending on the row)
    and full ones (documents of 96 rows, six 16-row blocks each), with odd lengths."""
    L = 200
    if mask_name == "parity":
        mask_mod = lambda b, h, q_idx, kv_idx: (q_idx % 2) == (kv_idx % 2)  # noqa: E731
    else:
        mask_mod = mods.document_mask(torch.arange(L) // 96)
    gen = harness.generator(5)
    q, k, v = harness.make_inputs(gen, B=1, Hq=2, L=L, S=L, E=16, dtype=torch.float32, requires_grad=True)
    bm = create_block_mask(mask_mod, None, None, L, L, device="cpu", BLOCK_SIZE=16)
    _three_way(lambda: mods.alibi(2), bm, q, k, v)


def test_plan():
    plan = cpu_plan.plan
    inputs = cpu_plan.CpuPlanInputs
    assert plan(inputs(128, 128)) == cpu_plan.CpuPlan(q_tile=256, kv_tile=512)
    assert plan(inputs(16, 16)) == cpu_plan.CpuPlan(q_tile=256, kv_tile=512)
    assert plan(inputs(100, 64)) == cpu_plan.CpuPlan(q_tile=200, kv_tile=512)
    assert plan(inputs(512, 96)) == cpu_plan.CpuPlan(q_tile=256, kv_tile=480)
    assert plan(inputs(300, 1024)) == cpu_plan.CpuPlan(q_tile=150, kv_tile=512)


# --------------------------------------------------------------------------------------
# Mods
# --------------------------------------------------------------------------------------
B, H, S, E = 2, 3, 48, 16


@pytest.mark.parametrize("name", ["bias[b][q_idx]", "bias[b][h][which, q_idx]", "bias[b][h, kv_idx]"])
def test_chained_indexing_forward_and_backward(name):
    gen = harness.generator(0)
    bias2 = harness.randn(gen, B, S, requires_grad=True)
    bias4 = harness.randn(gen, B, H, 4, S)
    which = torch.tensor(2)
    chosen = {
        "bias[b][q_idx]": lambda s, b, h, q, kv: s + bias2[b][q],
        "bias[b][h][which, q_idx]": lambda s, b, h, q, kv: s + bias4[b][h][which, q],
        "bias[b][h, kv_idx]": lambda s, b, h, q, kv: s * bias4[b][h, which, kv],
    }[name]
    q, k, v = harness.make_inputs(gen, B=B, Hq=H, L=S, S=S, E=E, dtype=torch.float32, requires_grad=True)
    out = torch.compile(flexattn.flex_attention)(q, k, v, score_mod=chosen)
    golden = flexattn.flex_attention(*(t.double() for t in (q, k, v)), score_mod=chosen)
    with flexattn.eager_mods():
        ref = flexattn.flex_attention(q, k, v, score_mod=chosen)
    harness.check_three_way("out", out, ref, golden, torch.float32)
    if name == "bias[b][q_idx]":
        grads = torch.autograd.grad(out.sum(), (q, bias2))
        ref_grads = torch.autograd.grad(ref.sum(), (q, bias2))
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


_OUT_OF_RANGE_SCRIPT = textwrap.dedent("""
    import torch
    import flexattn
    torch._inductor.config.cpu_backend = "cpp"
    S, BLK = 256, 128
    table = torch.randn(BLK)

    def same_block(b, h, q, kv):
        return (q // BLK) == (kv // BLK)

    def score_mod(score, b, h, q, kv):  # in range exactly where same_block holds
        return score + table[kv - (q // BLK) * BLK]

    def clamped(score, b, h, q, kv):
        return score + table.to(score.dtype)[(kv - (q // BLK) * BLK).clamp(0, BLK - 1)]

    mask = flexattn.create_block_mask(same_block, 1, 1, S, S, device="cpu", BLOCK_SIZE=64)
    q, k, v = (torch.randn(1, 1, S, 16) for _ in range(3))
    with flexattn.eager_mods():
        ref = flexattn.flex_attention(q, k, v, score_mod=clamped, block_mask=mask)
        golden = flexattn.flex_attention(q.double(), k.double(), v.double(), score_mod=clamped, block_mask=mask)
    out = torch.compile(flexattn.flex_attention)(q, k, v, score_mod=score_mod, block_mask=mask)
    print("errors", (out.double() - golden).abs().max().item(), (ref.double() - golden).abs().max().item())
""")


def test_mod_out_of_range_where_the_mask_excludes_does_not_crash():
    """A score_mod valid only inside the mask (as a page table is) is evaluated on whole
    tiles, also where the mask excludes: indices are clamped there, never read out of
    bounds (run in a child process: a bad read could end it)."""
    done = subprocess.run([sys.executable, "-c", _OUT_OF_RANGE_SCRIPT], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    err_out, err_ref = (float(x) for x in done.stdout.split("errors")[-1].split())
    # The harness's three-way bound (the float32 reference's own error varies between processes).
    assert err_out <= harness.RATIO * err_ref + harness.ATOL_FLOOR[torch.float32], (err_out, err_ref)


def _mod_library_code(score_mod, mask_mod=mods.causal_mask, L=64) -> str:
    q, k, v = (torch.randn(1, 2, L, 16) for _ in range(3))
    bm = create_block_mask(mask_mod, None, None, L, L, device="cpu")
    _, code = run_and_get_code(torch.compile(flexattn.flex_attention), q, k, v, score_mod=score_mod, block_mask=bm)
    wrapper = next(c for c in code if "cpu_flash_forward" in c)
    # The mod library's source travels as a string argument of the operator.
    return wrapper.encode().decode("unicode_escape")


def test_mod_library_hoists_row_values_and_vectorises_transcendentals():
    """ALiBi reads its slope once per row, before the loop over keys; the soft-cap's tanh
    is one call of the engine's vectorised math table for the whole row."""
    alibi = _mod_library_code(mods.alibi(2))
    body = alibi.split("void fa_score_impl", 1)[1].split("void fa_mask_impl", 1)[0]
    assert body.index("buf0[") < body.index("for (int64_t j = 0;"), body
    softcap = _mod_library_code(mods.tanh_softcap(30.0))
    assert "math->tanh_f32" in softcap and "std::tanh" not in softcap.split("void fa_score_impl", 1)[1]


def test_constant_mask_has_no_mask_function():
    code = _mod_library_code(mods.alibi(2), mask_mod=flexattn.noop_mask)
    assert "fa_score" in code and "fa_mask" not in code


def test_unsupported_operation_is_named():
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + torch.special.i0(score)

    q, k, v = (torch.randn(1, 1, 16, 16) for _ in range(3))
    with pytest.raises(Exception, match="'i0'.*CPU kernels cannot evaluate"):
        torch.compile(flexattn.flex_attention)(q, k, v, score_mod=score_mod)


# --------------------------------------------------------------------------------------
# Compiles, threads, determinism, memory
# --------------------------------------------------------------------------------------
def test_one_compile_serves_every_length():
    """dynamic=True: a captured tensor as long as the sequence (its length a symbol the
    mod library reads at run time), forward and backward, five lengths: one graph for
    the lengths of one KV block and one for the longer ones (the default mask's tables
    have a size-1 dimension below 129 keys, which Dynamo specialises)."""
    counter = CompileCounterWithBackend("inductor")

    def step(q, k, v, bias):
        out = flexattn.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias[ki] - bias[qi])
        return out

    compiled = torch.compile(step, backend=counter, dynamic=True, fullgraph=True)
    for n in (17, 100, 129, 255, 300):
        gen = harness.generator(n)
        q, k, v = harness.make_inputs(gen, B=1, Hq=2, L=n, S=n, E=16, dtype=torch.float32, requires_grad=True)
        bias = harness.randn(gen, n, requires_grad=True)
        out = compiled(q, k, v, bias)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v, bias))
        qd, kd, vd, bd = harness.copies((q, k, v, bias), torch.float64)
        want = step(qd, kd, vd, bd)
        want_grads = torch.autograd.grad(want.square().sum(), (qd, kd, vd, bd))
        torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g.double(), w, atol=2e-4, rtol=2e-4)
    graphs = [g for g in counter.graphs if any(n.op == "call_function" for n in g.graph.nodes)]
    assert len(graphs) == 2, [g.code for g in graphs]


def test_results_do_not_depend_on_the_thread_count():
    gen = harness.generator(5)
    q, k, v = harness.make_inputs(gen, B=2, Hq=4, L=300, S=300, E=32, dtype=torch.float32)
    bm = create_block_mask(mods.causal_mask, None, None, 300, 300, device="cpu", BLOCK_SIZE=64)
    attend = torch.compile(lambda q, k, v: flexattn.flex_attention(q, k, v, mods.alibi(4), bm))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attend(q, k, v)
        torch.set_num_threads(max(2, threads))
        many = attend(q, k, v)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_deterministic_captured_gradients_are_bitwise_equal():
    """DETERMINISTIC: the captured tensors' gradients are summed in a fixed order (a
    static schedule, one accumulator per thread added in thread order), so two runs
    agree bitwise."""
    gen = harness.generator(6)
    q, k, v = harness.make_inputs(gen, B=2, Hq=4, L=200, S=200, E=16, dtype=torch.float32, requires_grad=True)
    table = harness.randn(gen, 4, 399, requires_grad=True)
    attend = torch.compile(lambda q, k, v: flexattn.flex_attention(
        q, k, v, mods.relative_bias(table), kernel_options={"DETERMINISTIC": True}))
    runs = [torch.autograd.grad(attend(q, k, v).sum(), (q, k, v, table)) for _ in range(3)]
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))


def test_memory_does_not_grow_with_the_score_matrix():
    """A causal call at S=8192 (H=2): the dense score matrix alone would be 512 MiB; the
    engine's peak resident growth stays under a tenth of it (outputs and per-thread
    tiles)."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "bench"))
    from bench_block_mask import PeakResidentMemory

    n, heads = 8192, 2
    q, k, v = (torch.randn(1, heads, n, 64) for _ in range(3))
    bm = create_block_mask(mods.causal_mask, None, None, n, n, device="cpu")
    attend = torch.compile(lambda q, k, v: flexattn.flex_attention(q, k, v, block_mask=bm))
    with torch.no_grad():
        attend(q, k, v)
        with PeakResidentMemory() as peak:
            attend(q, k, v)
    assert peak.peak_bytes < heads * n * n * 4 // 10, peak.peak_bytes

"""Attention dropout inside the fused kernels.

The keep mask is a pure function of the call's seed and each entry's position
(``numerics.dropout_keep``, Philox-4x32): checked against the generator's published
known answers and for its keep rate. The kernels (forward, backward, through
torch.compile and the eager API; on the CPU both kernel paths) are checked against the dense
reference given the same mask, read off ``AuxRequest(probabilities=True)``, with the
three-way bound of tests/_harness.py for out, lse and every gradient (q, k, v, a
captured bias, the sinks). Seeds: ``torch.manual_seed`` repeats a call bitwise,
consecutive calls differ, a compiled training loop compiles once.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import flexattn
from flexattn import AuxRequest, create_block_mask, mods
from flexattn.numerics import Dropout, dropout_draw_slots, dropout_keep, dropout_threshold, philox_4x32
from flexattn.reference import dense_math

import _harness as harness
from conftest import DEVICE

pytestmark = pytest.mark.usefixtures("flexattn_kernels")

ON_CUDA, DTYPES, scaled = harness.ON_CUDA, harness.DTYPES, harness.scaled



def _identity(score, b, h, q_idx, kv_idx):
    return score


def _kept(probabilities: torch.Tensor) -> torch.Tensor:
    return ~torch.signbit(probabilities)


def test_philox_known_answers():
    """Random123's known-answer vectors for Philox-4x32 at 10 rounds (the generator's
    definition; the kernels run the same rounds, 7 of them)."""
    zero = torch.tensor(0)
    ones = torch.tensor(0xFFFFFFFF)
    assert [int(w) for w in philox_4x32(zero, zero, zero, zero, zero, zero, rounds=10)] == \
        [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert [int(w) for w in philox_4x32(ones, ones, ones, ones, ones, ones, rounds=10)] == \
        [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_within_four_sigma(p):
    """Over 2**22 entries the kept share is within 4 sigma of 1 - p, for each of a draw's
    eight slots alike (no stripes: the values of one Philox draw are independent), and
    seeds differ."""
    B, H, L, S = 2, 4, 512, 1024
    seed = torch.tensor([12345, 678], dtype=torch.int64)
    keep = dropout_keep(seed, p, B, H, L, S)
    n = keep.numel()
    rate = 1.0 - dropout_threshold(p) / 65536
    sigma = math.sqrt(rate * (1 - rate) / n)
    assert abs(keep.double().mean().item() - rate) <= 4 * sigma
    assert abs(rate - (1 - p)) <= 2 ** -17
    slot = dropout_draw_slots(L, S)[2].expand(L, S)  # the eight entries of one draw
    by_slot = torch.stack([keep[..., slot == k].double().mean() for k in range(8)])
    assert torch.all((by_slot - rate).abs() <= 4 * math.sqrt(rate * (1 - rate) / (n // 8)))
    other = dropout_keep(torch.tensor([12345, 679], dtype=torch.int64), p, B, H, L, S)
    assert (keep != other).double().mean().item() > 0.5 * 2 * rate * (1 - rate)


def _bias_mod(bias):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h, kv_idx]

    return score_mod


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager_api"])
def test_forward_and_backward_match_the_reference_given_the_mask(dtype, compiled):
    """GQA, a sliding-window causal mask (full and partial blocks), a learnable bias
    captured by score_mod, learnable sinks, odd lengths, dropout 0.3: out, lse and the
    gradients of q, k, v, the bias and the sinks against the reference that applies the
    mask the call reports."""
    _check_against_the_reference(dtype, compiled, None)


@pytest.mark.parametrize("dtype", DTYPES[:1], ids=str)
def test_dq_atomic_backward_matches_the_reference_given_the_mask(dtype):
    """The same with dQ formed in the dK/dV programs (DQ_ATOMIC): one keep mask per tile
    pair serves dK, dV and dQ."""
    _check_against_the_reference(dtype, True, {"DQ_ATOMIC": True})


def _check_against_the_reference(dtype, compiled, kernel_options):
    B, Hq, Hkv, E = 2, 4, 2, 16
    L, S = scaled(37, 300), scaled(45, 333)
    p = 0.3
    gen = harness.generator(11)
    q, k, v = harness.make_inputs(gen, B=B, Hq=Hq, Hkv=Hkv, L=L, S=S, E=E, dtype=dtype, requires_grad=True)
    bias = harness.randn(gen, Hq, S, requires_grad=True)
    sinks = harness.randn(gen, Hq, requires_grad=True)
    grad_out, grad_lse = harness.make_output_grads(gen, q, v, with_lse=True)
    window = mods.sliding_window(scaled(20, 100))
    bm = create_block_mask(window, B, None, L, S, device=DEVICE, BLOCK_SIZE=scaled(16, 64))
    request = AuxRequest(lse=True, probabilities=True)
    seen = {}

    def attend(q, k, v, bias, sinks):
        out, aux = flexattn.flex_attention(q, k, v, score_mod=_bias_mod(bias), block_mask=bm, enable_gqa=True,
                                           sinks=sinks, dropout_p=p, return_aux=request,
                                           kernel_options=kernel_options)
        seen["probabilities"] = aux.probabilities
        return out, aux.lse

    fn = torch.compile(attend, backend="inductor") if compiled else attend
    test = harness.attention_grads(fn, harness.copies((q, k, v, bias, sinks)), grad_out, grad_lse)
    probabilities = seen["probabilities"]
    assert probabilities.shape == (B, Hq, L, S)
    keep = _kept(probabilities)
    dropout = Dropout(p, None, keep)

    def reference(q, k, v, bias, sinks, grad_out, grad_lse):
        return harness.attention_grads(
            lambda q, k, v, b, s: dense_math(q, k, v, _bias_mod(b), bm.as_tuple(), E ** -0.5, (), (), s, dropout)[:2],
            (q, k, v, bias, sinks), grad_out, grad_lse)

    golden, ref = harness.reference_runs(reference, (q, k, v, bias, sinks, grad_out, grad_lse))
    harness.check_attention(test, ref, golden, dtype, max_scores=False)
    harness.check_gradients(test[2], ref[2], golden[2], dtype)
    # The reported probabilities are the ones applied: their positive part times V is the output.
    torch.testing.assert_close(
        (probabilities.clamp(min=0).to(torch.float64) @ harness.copies(v, torch.float64).repeat_interleave(2, 1))
        .to(dtype), test[0].detach(), atol=harness.ATOL_FLOOR[dtype] * 10 + 2e-2, rtol=2e-2)
    visible = flexattn.create_mask(window, B, Hq, L, S, device=DEVICE)
    rate = keep[visible].double().mean().item()
    assert abs(rate - (1 - p)) < 5 * math.sqrt(p * (1 - p) / visible.sum().item())


def test_a_seed_sliced_from_a_stack_is_read_at_its_offset():
    """The operator called with a seed that is a view into a stack of seeds (one per layer,
    say) draws the same keep mask as with a copy of that seed: the kernels read the seed
    through the argument's view, not its storage's start."""
    from flexattn import options as _options
    from flexattn._hop import flex_attention_hop

    B, H, L, E = 1, 2, scaled(40, 200), 16
    q, k, v = harness.make_inputs(5, B=B, Hq=H, L=L, S=L, E=E, dtype=DTYPES[0])
    seeds = torch.tensor([[1, 2], [7, 9], [123, 4]], dtype=torch.int64, device=DEVICE)
    bm = create_block_mask(mods.causal_mask, None, None, L, L, device=DEVICE).as_tuple()
    options = {**_options.internal_options(DROPOUT_P=0.5), "OUTPUT_LOGSUMEXP": True}

    def attend(q, k, v, seed):
        return flex_attention_hop(q, k, v, _identity, bm, E ** -0.5, options, (), (), None, seed)[0]

    # Sliced inside the graph: the seed reaches the kernel as a view with an offset.
    out_view = torch.compile(lambda q, k, v, seeds: attend(q, k, v, seeds[1]), fullgraph=True)(q, k, v, seeds)
    out_copy = torch.compile(attend, fullgraph=True)(q, k, v, seeds[1].clone())
    out_other = torch.compile(attend, fullgraph=True)(q, k, v, seeds[0].clone())
    torch.testing.assert_close(out_view, out_copy, atol=0, rtol=0)
    assert not torch.equal(out_view, out_other)


def test_seeds_repeat_and_calls_differ():
    """torch.manual_seed repeats a call's output and gradients bitwise, eager API and
    compiled; two consecutive calls draw different masks."""
    gen = harness.generator(12)
    q, k, v = harness.make_inputs(gen, B=1, Hq=2, L=32, S=48, E=16, dtype=torch.float32, requires_grad=True)

    def attend(q, k, v):
        return flexattn.flex_attention(q, k, v, block_mask=None, dropout_p=0.2)

    for fn in (attend, torch.compile(attend, backend="inductor", fullgraph=True)):
        runs = []
        for _ in range(2):
            torch.manual_seed(7)
            first = fn(q, k, v)
            grads = torch.autograd.grad(first.sum(), (q, k, v))
            second = fn(q, k, v)
            runs.append((first.detach(), *grads, second.detach()))
        for a, b in zip(*runs):
            assert torch.equal(a, b)
        assert not torch.equal(runs[0][0], runs[0][-1])


@pytest.mark.workflow
def test_compiled_training_loop_compiles_once():
    """A compiled training step with dropout, several steps: one compile, no recompile
    per call (the seed is an input of the graph, not a constant), the loss changes."""
    counter = CompileCounterWithBackend("inductor")
    gen = harness.generator(13)
    B, H, L, E = 2, 2, 32, 16
    proj = torch.nn.Linear(E, 3 * E).to(DEVICE)
    opt = torch.optim.SGD(proj.parameters(), lr=0.1)
    bm = create_block_mask(mods.causal_mask, None, None, L, L, device=DEVICE, BLOCK_SIZE=16)

    @torch.compile(backend=counter, fullgraph=True)
    def step(x):
        q, k, v = proj(x).chunk(3, dim=-1)
        out = flexattn.flex_attention(q, k, v, block_mask=bm, dropout_p=0.1)
        return out.square().mean()

    losses = []
    for _ in range(4):
        x = harness.randn(gen, B, H, L, E)
        loss = step(x)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert counter.frame_count == 1
    assert all(math.isfinite(x) for x in losses)


def test_short_queries_use_the_forward_kernel():
    """A decode-shaped call (L=1 against many keys) with dropout runs the forward kernel
    (the decode kernel has none), also under torch.no_grad(), as SDPA applies dropout
    whenever dropout_p > 0."""
    gen = harness.generator(14)
    S = scaled(96, 2048)
    q, k, v = harness.make_inputs(gen, B=2, Hq=4, Hkv=1, L=1, S=S, E=16, dtype=torch.float16)
    with torch.no_grad():
        out, aux = flexattn.flex_attention(q, k, v, enable_gqa=True, dropout_p=0.5,
                                           return_aux=AuxRequest(lse=True, probabilities=True))
    dropout = Dropout(0.5, None, _kept(aux.probabilities))
    golden, ref = harness.reference_runs(
        lambda q, k, v: dense_math(q, k, v, _identity, flexattn.api.full_block_mask(q, k).as_tuple(), 0.25, (), (),
                                   None, dropout), (q, k, v))
    harness.check_attention((out, aux.lse), ref, golden, torch.float16, max_scores=False)
    assert 0.3 < _kept(aux.probabilities).double().mean().item() < 0.7


def test_eager_and_compiled_calls():
    """Compiled and eager calls (on the CPU: of either kernel path) match the reference
    given the reported mask, forward and backward."""
    gen = harness.generator(15)
    q, k, v = harness.make_inputs(gen, B=1, Hq=2, L=20, S=28, E=8, dtype=torch.float32, requires_grad=True)
    bm = create_block_mask(mods.causal_mask, None, None, 20, 28, device=DEVICE, BLOCK_SIZE=16)
    seen = {}

    def attend(q, k, v):
        out, aux = flexattn.flex_attention(q, k, v, block_mask=bm, dropout_p=0.4,
                                           return_aux=AuxRequest(lse=True, probabilities=True))
        # Read the mask outside the compiled region: the signbit would be a Triton kernel
        # there, and the interpreter cannot run libdevice's signbit.
        seen["probabilities"] = aux.probabilities
        return out, aux.lse

    grad_out = torch.ones(1, 2, 20, 8, device=DEVICE)
    for fn in (torch.compile(attend, backend="inductor"), attend):
        test = harness.attention_grads(fn, harness.copies((q, k, v)), grad_out)
        dropout = Dropout(0.4, None, _kept(seen["probabilities"]))
        golden = harness.attention_grads(
            lambda q, k, v: dense_math(q, k, v, _identity, bm.as_tuple(), 8 ** -0.5, (), (), None, dropout)[:2],
            harness.copies((q, k, v), torch.float64), grad_out.double())
        for t, g in zip((test[0], test[1], *test[2]), (golden[0], golden[1], *golden[2])):
            torch.testing.assert_close(t.double(), g, atol=2e-5, rtol=2e-5)


def test_bad_dropout_is_refused():
    q, k, v = harness.make_inputs(0, B=1, Hq=2, L=8, S=8, E=8, dtype=torch.float32)
    for bad in (1.0, -0.1, 2):
        with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
            flexattn.flex_attention(q, k, v, dropout_p=bad)
    for bad in ("0.1", True, None):
        with pytest.raises(TypeError, match=r"dropout_p must be a float in \[0, 1\)"):
            flexattn.flex_attention(q, k, v, dropout_p=bad)
    with pytest.raises(ValueError, match="no dropout"):
        flexattn.flex_attention(q, k, v, dropout_p=0.1, kernel_options={"FORCE_DECODE": True})
    big = torch.zeros(8, 16, 1024, 8, device=DEVICE)  # 2**27 probabilities
    with pytest.raises(ValueError, match=r"probabilities=True\) returns .* at most 67108864 entries"):
        flexattn.flex_attention(big, big, big, return_aux=AuxRequest(probabilities=True))


def test_compiled_call_with_changing_dropout_p():
    """A compiled function called with another dropout_p (train and eval in turn): Dynamo
    traces the changed float symbolically, and the operator's options hold its value
    (specialised, so one graph per value) instead of failing to capture."""
    gen = harness.generator(17)
    q, k, v = (harness.randn(gen, 1, 2, 32, 16) for _ in range(3))
    attend = torch.compile(lambda q, k, v, p: flexattn.flex_attention(q, k, v, dropout_p=p), fullgraph=True)
    plain = flexattn.flex_attention(q, k, v)
    for p in (0.1, 0.5, 0.0):
        out = attend(q, k, v, p)
        assert torch.isfinite(out).all()
        assert torch.equal(out, plain) if p == 0.0 else not torch.allclose(out, plain)

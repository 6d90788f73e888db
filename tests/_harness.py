"""The numerics harness of the tests: docs/architecture.md's three-way check, in one place.

For each case three runs from the same fresh random inputs (and the same random output
gradient): a golden run of the reference in float64, a run of the reference in the test
dtype, and the run under test in the test dtype. The run under test passes when

    err(test, golden) <= ratio * err(ref, golden) + floor

(``ratio`` = RATIO, ``floor`` = ATOL_FLOOR[dtype] unless a test says otherwise; err is
the largest absolute difference) for the output, the log-sum-exp, the row max and every
gradient (q, k, v and each captured tensor that requires grad), with no NaN. The floor
covers results the reference happens to get exactly right.

The API:

* ``make_inputs`` (q, k, v), ``make_output_grads`` (grad_out, grad_lse) and ``randn``:
  fresh random inputs from a seed or a generator, drawn on the CPU in float32 and cast;
* ``poison_allocator``: NaN in freed allocator memory, so that an output the kernel
  forgets to write reads as NaN;
* ``reference_runs(fn_ref, inputs)`` -> (golden, ref): ``fn_ref`` on float64 copies of
  the inputs and on copies as they are; ``dense_reference`` is ``fn_ref`` for a HOP call,
  ``attention_grads`` runs attention and its gradients;
* ``clamped_relative_score_mod``: a score_mod whose generated code calls Inductor's max and
  min helpers (a clamp, a leaky max), for the kernels that inline them differently;
* ``check_three_way``: the inequality above, the NaN and the shape check;
  ``check_attention`` applies it to (out, lse, max_scores), ``check_gradients`` to every
  gradient; ``check_masked_rows``: fully masked rows give out 0, lse and max -inf,
  gradients 0.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from conftest import DEVICE

RATIO = 2.0
ATOL_FLOOR = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 1e-3,
    torch.bfloat16: 8e-3,
}

#: Whether the suite runs on a GPU, and the dtypes the kernel tests take there (bfloat16
#: only on the GPU: the CPU interpreter's numpy has no bfloat16 arithmetic).
ON_CUDA = DEVICE == "cuda"
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if ON_CUDA else [])


def scaled(cpu: int, cuda: int) -> int:
    """A size for the CPU interpreter (small: it runs the kernels in numpy) or the GPU."""
    return cuda if ON_CUDA else cpu


# Gradients of captured tensors are sums over many (q, kv) pairs. The kernel adds the
# pairs' float32 contributions one atomic add at a time, in no fixed order; the reference
# sums them as a tree (torch's reduction). A sequential float32 sum of n terms can be
# O(n) eps off where the tree is O(log n), so these gradients get a wider factor.
CAPTURED_GRAD_RATIO = 8.0


# --------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------
def generator(seed: int | torch.Generator) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (a generator is returned as it is)."""
    return seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, device=None,
          requires_grad: bool = False) -> torch.Tensor:
    """Standard normal values drawn from ``gen`` on the CPU in float32, then cast."""
    return torch.randn(*shape, generator=gen).to(device or DEVICE, dtype).requires_grad_(requires_grad)


def make_inputs(seed: int | torch.Generator, *, B: int, Hq: int, L: int, S: int, E: int, Hkv: int | None = None,
                Bkv: int | None = None, Ev: int | None = None, dtype: torch.dtype, device=None,
                requires_grad: bool = False, make: Callable | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh random q (B, Hq, L, E), k (Bkv, Hkv, S, E) and v (Bkv, Hkv, S, Ev), in that
    order from ``seed`` (Hkv, Bkv, Ev default to Hq, B, E); or ``make(generator)``, a test's
    own (q, k, v) (non-contiguous ones, say), where ``make`` is given."""
    gen = generator(seed)
    if make is not None:
        return make(gen)
    Hkv, Bkv, Ev = Hkv or Hq, Bkv or B, Ev or E
    q = randn(gen, B, Hq, L, E, dtype=dtype, device=device, requires_grad=requires_grad)
    k = randn(gen, Bkv, Hkv, S, E, dtype=dtype, device=device, requires_grad=requires_grad)
    v = randn(gen, Bkv, Hkv, S, Ev, dtype=dtype, device=device, requires_grad=requires_grad)
    return q, k, v


def make_output_grads(gen: torch.Generator, q: torch.Tensor, v: torch.Tensor, *, with_lse: bool
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A random output gradient (B, Hq, L, Ev) in q's dtype and, ``with_lse``, a random
    float32 lse gradient (B, Hq, L) (else None), in that order from ``gen``."""
    B, Hq, L = q.shape[:3]
    grad_out = randn(gen, B, Hq, L, v.shape[-1], dtype=q.dtype, device=q.device)
    grad_lse = randn(gen, B, Hq, L, device=q.device) if with_lse else None
    return grad_out, grad_lse


def poison_allocator(nbytes: int, device=None) -> None:
    """Leave NaN in freed allocator memory so unwritten outputs read as NaN."""
    junk = torch.full((max(nbytes // 4, 1),), float("nan"), device=device or DEVICE)
    del junk


def copies(x, dtype: torch.dtype | None = None):
    """Detached copies of the floating tensors in ``x`` (a tensor, or a list or tuple of
    them, nested; anything else as it is), cast to ``dtype`` if given, each a leaf that
    requires grad where the original does."""
    if isinstance(x, (list, tuple)):
        return type(x)(copies(t, dtype) for t in x)
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().to(dtype or x.dtype).requires_grad_(x.requires_grad)
    return x


# --------------------------------------------------------------------------------------
# Reference runs
# --------------------------------------------------------------------------------------
def reference_runs(fn_ref: Callable, inputs: Sequence):
    """(golden, ref): ``fn_ref(*inputs)`` on float64 copies of the inputs, and on copies
    as they are (the test dtype; captured tensors and the lse gradient keep their
    float32)."""
    golden = fn_ref(*copies(tuple(inputs), torch.float64))
    ref = fn_ref(*copies(tuple(inputs)))
    return golden, ref


def clamped_relative_score_mod(device, radius: int = 32) -> Callable:
    """A frozen relative-position bias (``mods.relative_bias``: distances clamped to
    +-``radius``), then a leaky max of the biased score, ``max(s, s / 4)``."""
    from flexattn import mods

    bias = mods.relative_bias(torch.linspace(-1.0, 1.0, 2 * radius + 1, device=device))

    def score_mod(score, b, h, q_idx, kv_idx):
        biased = bias(score, b, h, q_idx, kv_idx)
        return torch.maximum(biased, 0.25 * biased)

    return score_mod


def dense_reference(score_mod, block_mask_tuple, scale, options) -> Callable:
    """``fn_ref`` for a forward HOP call: the dense reference, (out, lse, max_scores)."""
    from flexattn._hop import dense_flex_attention

    def fn_ref(q, k, v):
        return dense_flex_attention(q, k, v, score_mod, block_mask_tuple, scale, options, (), ())

    return fn_ref


def attention_grads(attend: Callable, inputs: Sequence[torch.Tensor], grad_out: torch.Tensor,
                    grad_lse: torch.Tensor | None = None, captured: Sequence[torch.Tensor] = ()):
    """(out, lse, grads): ``attend(*inputs)`` -> (out, lse), and the gradients of
    <out, grad_out> (+ <lse, grad_lse>) with respect to the inputs and then the captured
    tensors."""
    out, lse = attend(*inputs)
    outputs, cotangents = [out], [grad_out]
    if grad_lse is not None:
        outputs.append(lse)
        cotangents.append(grad_lse)
    return out, lse, torch.autograd.grad(outputs, [*inputs, *captured], cotangents)


# --------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------
def max_abs_err(x: torch.Tensor, golden: torch.Tensor) -> float:
    """Max |x - golden| over finite golden entries; mismatched infinities count as inf."""
    x = x.detach().to(torch.float64)
    golden = golden.detach().to(torch.float64)
    both_inf = torch.isinf(x) & torch.isinf(golden) & (torch.sign(x) == torch.sign(golden))
    diff = torch.where(both_inf, torch.zeros_like(x), (x - golden).abs())
    return float(diff.max()) if diff.numel() else 0.0


def check_three_way(name: str, test: torch.Tensor, ref: torch.Tensor, golden: torch.Tensor,
                    dtype: torch.dtype | None = None, *, ratio: float | None = None,
                    floor: float | None = None) -> tuple[float, float]:
    """err(test, golden) <= ratio * err(ref, golden) + floor, no NaN in ``test``, and the
    golden shape. ``ratio``: RATIO by default; ``floor``: ATOL_FLOOR[dtype] by default.
    Returns (err(test, golden), err(ref, golden))."""
    ratio = RATIO if ratio is None else ratio
    floor = ATOL_FLOOR[dtype] if floor is None else floor
    assert not torch.isnan(test).any(), f"{name}: NaN in the result under test"
    assert test.shape == golden.shape, f"{name}: shape {tuple(test.shape)} != {tuple(golden.shape)}"
    err_test = max_abs_err(test, golden)
    err_ref = max_abs_err(ref, golden)
    bound = ratio * err_ref + floor
    assert err_test <= bound, (
        f"{name}: error {err_test:.3e} vs golden exceeds {ratio} x reference error "
        f"{err_ref:.3e} + floor {floor:.0e} = {bound:.3e}"
    )
    return err_test, err_ref


def check_attention(test: Sequence, ref: Sequence, golden: Sequence, dtype: torch.dtype, *, lse: bool = True,
                    max_scores: bool = True, ratio: float | None = None, prefix: str = "") -> None:
    """The three-way check of an attention call's (out, lse, max_scores): the output
    (which must have the test dtype), and the lse and the row max where asked for."""
    assert test[0].dtype == dtype, f"{prefix}out: dtype {test[0].dtype} != {dtype}"
    check_three_way(f"{prefix}out", test[0], ref[0], golden[0], dtype, ratio=ratio)
    if lse:
        check_three_way(f"{prefix}lse", test[1], ref[1], golden[1], dtype, ratio=ratio)
    if max_scores:
        check_three_way(f"{prefix}max_scores", test[2], ref[2], golden[2], dtype, ratio=ratio)


def check_gradients(test: Sequence, ref: Sequence, golden: Sequence, dtype: torch.dtype, *,
                    captured_ratio: float = CAPTURED_GRAD_RATIO) -> None:
    """The three-way check of the gradients (grad_q, grad_k, grad_v, then one per
    captured tensor): q, k and v in ``dtype`` with RATIO, the captured tensors' in the
    reference's dtype (their own) with ``captured_ratio``."""
    assert len(test) == len(ref) == len(golden), (len(test), len(ref), len(golden))
    names = ["grad_q", "grad_k", "grad_v"] + [f"grad_captured{i}" for i in range(len(test) - 3)]
    for i, (name, t, r, g) in enumerate(zip(names, test, ref, golden)):
        assert t.shape == g.shape and t.dtype == r.dtype, (name, tuple(t.shape), t.dtype, tuple(g.shape), r.dtype)
        if i < 3:
            check_three_way(name, t, r, g, dtype)
        else:
            check_three_way(name, t, r, g, r.dtype, ratio=captured_ratio)


def check_masked_rows(rows: Callable[[torch.Tensor], torch.Tensor], *, out: torch.Tensor | None = None,
                      lse: torch.Tensor | None = None, max_scores: torch.Tensor | None = None,
                      grads: Sequence[torch.Tensor] = ()) -> None:
    """Fully masked rows, picked from each tensor by ``rows`` (e.g. ``lambda t: t[:, :, :8]``):
    output 0, lse and max -inf, gradients 0."""
    if out is not None:
        assert torch.all(rows(out) == 0), "out: a fully masked row is not 0"
    for name, aux in (("lse", lse), ("max_scores", max_scores)):
        if aux is not None:
            assert torch.all(rows(aux) == float("-inf")), f"{name}: a fully masked row is not -inf"
    for i, grad in enumerate(grads):
        assert torch.all(rows(grad) == 0), f"gradient {i}: a fully masked row is not 0"

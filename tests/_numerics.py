"""The three-way error bound of DESIGN.md, shared by the numerics tests.

For each case: a golden run in float64, a reference run in the test dtype, and the run
under test in the test dtype, all from the same inputs. The run under test passes when
``err(test, golden) <= RATIO * err(ref, golden) + ATOL_FLOOR[dtype]`` for every output,
with no NaN. The floor covers results the reference happens to get exactly right.
"""

from __future__ import annotations

import torch

RATIO = 2.0
ATOL_FLOOR = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 1e-3,
    torch.bfloat16: 8e-3,
}


def max_abs_err(x: torch.Tensor, golden: torch.Tensor) -> float:
    """Max |x - golden| over finite golden entries; mismatched infinities count as inf."""
    x = x.to(torch.float64)
    golden = golden.to(torch.float64)
    both_inf = torch.isinf(x) & torch.isinf(golden) & (torch.sign(x) == torch.sign(golden))
    diff = torch.where(both_inf, torch.zeros_like(x), (x - golden).abs())
    return float(diff.max()) if diff.numel() else 0.0


def assert_close_3way(name: str, test: torch.Tensor, ref: torch.Tensor, golden: torch.Tensor, dtype: torch.dtype, ratio: float | None = None) -> tuple[float, float]:
    ratio = RATIO if ratio is None else ratio
    assert not torch.isnan(test).any(), f"{name}: NaN in the result under test"
    assert test.shape == golden.shape, f"{name}: shape {tuple(test.shape)} != {tuple(golden.shape)}"
    err_test = max_abs_err(test, golden)
    err_ref = max_abs_err(ref, golden)
    bound = ratio * err_ref + ATOL_FLOOR[dtype]
    assert err_test <= bound, (
        f"{name}: error {err_test:.3e} vs golden exceeds {ratio} x reference error "
        f"{err_ref:.3e} + floor {ATOL_FLOOR[dtype]:.0e} = {bound:.3e}"
    )
    return err_test, err_ref


def assert_attention_outputs_close(out, ref, golden, dtype: torch.dtype, options: dict) -> None:
    """The three-way check of an attention call's (out, lse, max_scores), each auxiliary
    output where ``options`` asks for it."""
    assert out[0].dtype == dtype
    assert_close_3way("out", out[0], ref[0], golden[0], dtype)
    if options["OUTPUT_LOGSUMEXP"]:
        assert_close_3way("lse", out[1], ref[1], golden[1], dtype)
    if options["OUTPUT_MAX"]:
        assert_close_3way("max_scores", out[2], ref[2], golden[2], dtype)

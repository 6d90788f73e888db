"""Merging partial attention results by their log-sum-exps, and the merge's gradient.

A call over a subset of the keys gives (o_s, lse_s): its rows normalised over that
subset. Over all subsets, lse = logsumexp_s lse_s and out = sum_s w_s o_s with weights
w_s = exp(lse_s - lse). Rows no subset reaches keep lse = -inf and out = 0 (w_s = 0, not
NaN). On a GPU each function is compiled (Inductor fuses it into one kernel); the CPU
runs the few ATen ops it is made of.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What partial results and gradients of ``dtype`` are summed in: float32, float64 for
    float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _weights(lse_s: Tensor, lse: Tensor) -> Tensor:
    """exp(lse_s - lse), 0 where the merged row is empty (lse = -inf)."""
    finite = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    return torch.exp(lse_s - finite)


def _merge(out: Tensor, lse: Tensor, out_s: Tensor, lse_s: Tensor) -> tuple[Tensor, Tensor]:
    merged = torch.logaddexp(lse, lse_s.to(lse.dtype))
    out = out * _weights(lse, merged).unsqueeze(-1) + out_s.to(out.dtype) * _weights(lse_s, merged).unsqueeze(-1)
    return out, merged


def _partial_grads(dout: Tensor, dlse: Tensor, out: Tensor, lse: Tensor, out_s: Tensor, lse_s: Tensor
                   ) -> tuple[Tensor, Tensor]:
    """The loss's gradient at (out_s, lse_s): w_s dout, and w_s (dout . (out_s - out) + dlse)."""
    acc = accumulation_dtype(out_s.dtype)
    w = _weights(lse_s.to(lse.dtype), lse).to(acc)
    dout = dout.to(acc)
    d_out_s = dout * w.unsqueeze(-1)
    d_lse_s = w * ((dout * (out_s.to(acc) - out.to(acc))).sum(-1) + dlse.to(acc))
    return d_out_s.to(out_s.dtype), d_lse_s.to(lse_s.dtype)


@functools.lru_cache(maxsize=None)
def _compiled(fn):
    return torch.compile(fn, dynamic=False)


def _run(fn, device: torch.device):
    return _compiled(fn) if device.type == "cuda" else fn


def merge(out: Tensor, lse: Tensor, out_s: Tensor, lse_s: Tensor) -> tuple[Tensor, Tensor]:
    """(out, lse) merged with one more partial (out_s, lse_s); out in its accumulation dtype."""
    return _run(_merge, out.device)(out, lse, out_s, lse_s)


def partial_grads(dout: Tensor, dlse: Tensor, out: Tensor, lse: Tensor, out_s: Tensor, lse_s: Tensor
                  ) -> tuple[Tensor, Tensor]:
    """Gradients at one partial result given the merged result's."""
    return _run(_partial_grads, out.device)(dout, dlse, out, lse, out_s, lse_s)

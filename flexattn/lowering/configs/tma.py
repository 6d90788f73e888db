"""Where each kernel loads its tiles through tensor descriptors (USE_TMA) by default.

Descriptors need the copy engine of sm90 and later and 16-bit inputs here; the
(GPU generation, QK head-dim bucket) pairs below are where they measured faster
(bench/DECISIONS.md#tma-tma-defaults). kernel_options USE_TMA overrides it per call.
"""

from __future__ import annotations

import torch

from .base import gpu_generation, head_dim_bucket

TMA_DEFAULTS: dict[str, frozenset[tuple[str, int]]] = {
    "forward": frozenset({("sm90", 64), ("sm90", 128), ("sm90", 256)}),
    "backward": frozenset({("sm90", 128)}),
}


def tma_by_default(kernel: str, device: torch.device, padded_head_dim: int, dtype: torch.dtype) -> bool:
    """Whether ``kernel`` uses tensor descriptors when USE_TMA is not given."""
    if dtype not in (torch.float16, torch.bfloat16):
        return False
    key = (gpu_generation(device), head_dim_bucket(padded_head_dim))
    return key in TMA_DEFAULTS.get(kernel, frozenset())

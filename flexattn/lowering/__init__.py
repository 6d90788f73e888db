"""Inductor lowerings of the flexattn HOPs.

``register()`` installs them in Inductor's lowering table (idempotent); flexattn's
``__init__`` calls it. Modules: ``forward`` (the forward HOP onto the Triton template,
its grid and backend choice), ``subgraph`` (score_mod / mask_mod graphs to template IR),
``configs`` (tile configurations), ``dense`` (the CPU path when Inductor's CPU backend
is not Triton).
"""

from __future__ import annotations

import warnings

_registered = False


def register() -> None:
    """Register flexattn's lowerings with Inductor. Safe to call more than once."""
    global _registered
    if _registered:
        return
    from torch._inductor.lowering import register_lowering

    from .._hop import flex_attention_backward_hop, flex_attention_hop
    from .backward import lower_flex_attention_backward
    from .forward import lower_flex_attention

    register_lowering(flex_attention_hop, type_promotion_kind=None)(lower_flex_attention)
    register_lowering(flex_attention_backward_hop, type_promotion_kind=None)(lower_flex_attention_backward)
    # Inductor's FX utilities warn that they cannot propagate metadata through HOP
    # subgraph arguments; flexattn's fake implementations give the outputs' metadata.
    for op in (flex_attention_hop, flex_attention_backward_hop):
        warnings.filterwarnings("ignore", message=f"Please add support for subgraph args to function {op.__name__}!")
    _registered = True


__all__ = ["register"]

"""Inductor lowerings of the flexattn operators.

``register()`` installs them in Inductor's lowering table (idempotent); flexattn's
``__init__`` calls it. Modules, one concern each:

* ``dispatch``: the registered lowerings and the choice of kernel per call;
* ``forward``, ``backward``, ``decode``: one kernel's lowering each (the decode's plan, a
  pure function of sizes and options, in ``decode_plan``); none imports another;
* ``common``: the host code they share (realising inputs, the call preparation,
  specialisations, template choices, the chosen-config report);
* ``subgraph``: score_mod / mask_mod graphs to the IR a template inlines;
  ``buffer_grads``: the captured tensors' gradients as backward subgraphs;
* ``configs/``: the tile-configuration tables, one per kernel and GPU generation.

The C++ CPU engine's lowering lives with the engine, in ``flexattn/cpu/lowering.py``.
"""

from __future__ import annotations

_registered = False


def register() -> None:
    """Register flexattn's lowerings with Inductor. Safe to call more than once."""
    global _registered
    if _registered:
        return
    from . import dispatch

    dispatch.register()
    _registered = True


__all__ = ["register"]

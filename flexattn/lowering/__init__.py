"""Inductor lowerings of the flexattn operators.

``register()`` installs them in Inductor's lowering table (idempotent); flexattn's
``__init__`` calls it. Modules, one concern each:

* ``dispatch``: the registered lowerings and the choice of kernel per call;
* ``forward``, ``gluon_forward``, ``backward``, ``decode``: one kernel's lowering each;
  none imports another. The plans, pure functions of sizes and options: ``forward_plan``
  (the Triton or the Gluon forward) and ``decode_plan``;
* ``gluon_template``: Gluon kernels as Inductor templates;
* ``common``: the host code they share (realising inputs, the call preparation,
  specialisations, template choices, the chosen-config report);
* ``subgraph``: score_mod / mask_mod graphs to the IR a template inlines;
  ``buffer_grads``: the captured tensors' gradients as backward subgraphs;
* ``configs/``: the tile-configuration tables, one per kernel and GPU generation.

The C++ CPU engine's lowering lives with the engine, in ``flexattn/cpu/lowering.py``.
The layers and their import rules: ``docs/architecture.md``.
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

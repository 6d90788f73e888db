"""flexattn's C++ CPU engine: block-sparse flash attention on the CPU, forward and
backward, with a call's score_mod and mask_mod compiled into a small library of its own.

``uses_engine`` is the one place that decides which calls it serves; the public API
(``api.py``) and the lowering's kernel choice (``lowering/dispatch.py``) ask it. Modules,
one concern each:

* ``lowering``: the Inductor lowering of a CPU call onto the engine's operators;
* ``mod_library``, ``mod_ops``: the call's mods, from Inductor IR to C++;
* ``plan``: the engine's tiling, a pure function of the call's block sizes;
* ``ops``: the two torch operators that run the engine;
* ``abi``: the structs Python and C++ share (the C declarations are generated from it);
* ``sources``: the C++ in ``csrc/`` assembled into one translation unit per library;
* ``build``: compiling, caching and loading the libraries.

``csrc/`` holds the engine's C++ (``engine.cpp`` and its headers, one concern each) and
``mods.cpp.jinja``, the only part rendered per call.
"""

from __future__ import annotations

import torch

from .. import _compat


def uses_engine(device: torch.device) -> bool:
    """Whether a call on ``device`` runs on the C++ engine: a CPU call, unless Inductor's
    CPU backend is Triton (then the Triton kernels run, in Triton's interpreter)."""
    return device.type == "cpu" and _compat.inductor_cpu_backend() != "triton"

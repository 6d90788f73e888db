"""Gluon kernels as Inductor templates.

A Gluon kernel (``triton.experimental.gluon``) is Triton with explicit layouts, shared
memory, mbarriers and warp-specialised partitions. Inductor renders it like any Triton
template: the same Jinja hooks (``def_kernel``, ``modification`` for the inlined
score_mod / mask_mod, ``store_output``), the same autotuner and launcher. Three things
differ, and ``GluonTemplate`` owns them:

* the kernel is decorated ``@gluon.jit`` (``GluonTemplateKernel.jit_lines``);
* the code Inductor generates for the mods and the output store is Triton-language code
  on tensors that here carry layouts. Nearly all of it is valid Gluon as it stands; the
  exception is the ``tl.full([1, ...], value, dtype)`` Inductor writes for typed
  constants, which Gluon refuses (it needs a layout, and it broadcasts only between equal
  ranks). ``gluon_compatible`` makes those typed scalars, which broadcast to any tile
  (``GluonTemplateKernel.size`` does the same for the ``tl.full([], n, dtype=INDEX_DTYPE)``
  some torch releases write for sizes under 64-bit indexing), and calls the Gluon helpers'
  ``mod_maximum`` and ``mod_minimum`` for Inductor's Triton helpers of the same name, which
  build such a tensor inside (a clamp in a relative-position bias);
* Inductor's autotuner compiles every kernel as Triton-language source; the rendered
  module calls ``_compat.compile_gluon_kernels_as_gluon`` so that Gluon functions are
  compiled as Gluon (in compile workers too).
"""

from __future__ import annotations

import re

from torch._inductor.select_algorithm import TritonTemplate, TritonTemplateKernel

#: A typed constant as Inductor writes it: ``tl.full([1, 1], 0, tl.int32)``, the value a
#: literal (``-1.0``, ``0x80000000``, ``float("inf")``).
_TYPED_CONSTANT = re.compile(r"tl\.full\((\[1(?:, 1)*\]), ((?:float\(\"[^\"]*\"\)|[^,()\s]+)), (tl\.\w+)\)")
#: Inductor's Triton helpers that build layout-less tensors, called in a mod's code.
_LAYOUTLESS_HELPERS = re.compile(r"\btriton_helpers\.(maximum|minimum)\(")


def gluon_compatible(source: str) -> str:
    """Inductor's generated Triton-language ``source`` as Gluon accepts it inside a
    kernel whose tensors carry layouts: typed constants become typed scalars, and the
    helpers that build layout-less tensors become the Gluon helpers' ``mod_*``."""
    return _LAYOUTLESS_HELPERS.sub(r"mod_\1(", _TYPED_CONSTANT.sub(r"tl.cast(\2, \3)", source))


class GluonTemplateKernel(TritonTemplateKernel):
    """A ``TritonTemplateKernel`` whose kernel is a Gluon function."""

    def jit_lines(self):
        lines = super().jit_lines()
        if "@triton.jit" not in lines:
            raise RuntimeError("flexattn: Inductor's template header changed; the Gluon kernel cannot be declared")
        return lines.replace("@triton.jit", "@gluon.jit")

    def size(self, name, index) -> str:
        text = super().size(name, index)
        prefix, suffix = "tl.full([], ", ", dtype=INDEX_DTYPE)"
        if text.startswith(prefix) and text.endswith(suffix):
            return f"tl.cast({text[len(prefix):-len(suffix)]}, INDEX_DTYPE)"
        return text

    def modification(self, *args, **kwargs) -> str:
        return gluon_compatible(super().modification(*args, **kwargs))

    def _register_hook(self, hook_name, hook_fn, *args, **kwargs):
        # The output store (and any epilogue fused into it) is rendered late, by a hook.
        return super()._register_hook(hook_name, lambda: gluon_compatible(hook_fn()), *args, **kwargs)


class GluonTemplate(TritonTemplate):
    """A Jinja template of a Gluon kernel (``templates/gluon_*.py.jinja``)."""

    kernel_type = GluonTemplateKernel

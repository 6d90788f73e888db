"""The Jinja-templated Triton kernels of flexattn.

One ``.py.jinja`` per kernel, plus helper templates shared by several
(``merge_helpers``: the decode merge arithmetic; ``gluon_helpers``: the Gluon kernels';
``common``: every kernel's helpers).
``kernel_source`` assembles a kernel's source from whole files for Inductor's
``TritonTemplate``. The CPU engine's C++ lives in ``flexattn/cpu/csrc/``."""

from __future__ import annotations

from pathlib import Path

TEMPLATE_DIR = Path(__file__).parent


def read_template(name: str) -> str:
    """The text of ``<name>.py.jinja`` in this folder."""
    return (TEMPLATE_DIR / f"{name}.py.jinja").read_text()


def kernel_source(name: str, helpers: tuple[str, ...] = ()) -> str:
    """A kernel template followed by the given helper templates and the common helpers."""
    return "\n".join(read_template(part) for part in (name, *helpers, "common"))


def gluon_kernel_source(name: str) -> str:
    """A Gluon kernel template followed by the Gluon helpers and the common helpers."""
    return kernel_source(name, ("gluon_helpers",))

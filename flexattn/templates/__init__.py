"""Jinja-templated Triton kernels of flexattn (one ``.py.jinja`` per kernel, plus shared
helpers in ``common.py.jinja``). ``kernel_source(name)`` gives a kernel's template with
the shared helpers appended, ready for Inductor's ``TritonTemplate``."""

from __future__ import annotations

from pathlib import Path

TEMPLATE_DIR = Path(__file__).parent


def read_template(name: str) -> str:
    """The text of ``<name>.py.jinja`` in this folder."""
    return (TEMPLATE_DIR / f"{name}.py.jinja").read_text()


def kernel_source(name: str) -> str:
    """A kernel template followed by the shared helper template."""
    return read_template(name) + "\n" + read_template("common")

"""Jinja-templated kernels of flexattn.

Triton: one ``.py.jinja`` per kernel, plus helper templates shared by several
(``merge_helpers``: the decode merge arithmetic; ``common``: every kernel's helpers).
``kernel_source`` assembles a kernel's source from whole files for Inductor's
``TritonTemplate``.

C++ (the CPU path): ``cpu_flash.cpp.jinja`` (the engine), ``cpu_mods.cpp.jinja`` (a
call's mod library) and the head they share, ``cpu_common.h.jinja``; ``render_cpp``
renders one."""

from __future__ import annotations

from pathlib import Path

TEMPLATE_DIR = Path(__file__).parent


def read_template(name: str) -> str:
    """The text of ``<name>.py.jinja`` in this folder."""
    return (TEMPLATE_DIR / f"{name}.py.jinja").read_text()


def kernel_source(name: str, helpers: tuple[str, ...] = ()) -> str:
    """A kernel template followed by the given helper templates and the common helpers."""
    return "\n".join(read_template(part) for part in (name, *helpers, "common"))


def render_cpp(name: str, **values) -> str:
    """``<name>.jinja`` (a C++ template of the CPU path) rendered with ``values``."""
    import jinja2

    environment = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    return environment.from_string((TEMPLATE_DIR / f"{name}.jinja").read_text()).render(**values)

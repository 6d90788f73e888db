"""The C++ of the CPU kernels as the compiler gets it: one translation unit per library.

The engine is plain C++ in ``csrc/`` (``engine.cpp`` and the headers it includes), a
mod library the Jinja template ``csrc/mods.cpp.jinja`` around the functions generated
for a call. Each is handed to the compiler as one source text in which every
``#include "name"`` of a file in ``csrc/`` is replaced by that file's text (once per
library, as ``#pragma once`` would) and ``abi_generated.h`` by ``abi.generated_header()``.
The library cache is keyed by that text, so an edit to any file a library includes
rebuilds it; ``#line`` marks keep the compiler's messages pointing at the files.
"""

from __future__ import annotations

import re
from pathlib import Path

from . import abi

SOURCE_DIR = Path(__file__).parent / "csrc"
#: The header written from Python (``abi.generated_header``) rather than read from a file.
GENERATED_HEADER = "abi_generated.h"
_LOCAL_INCLUDE = re.compile(r'#include "([\w.]+)"\s*')
_PRAGMA_ONCE = re.compile(r"#pragma once\s*")


def _read(name: str) -> str:
    if name == GENERATED_HEADER:
        return abi.generated_header()
    path = SOURCE_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"flexattn: the CPU kernels' source {name!r} is not in {SOURCE_DIR}")
    return path.read_text()


def _inline(text: str, label: str, seen: set[str]) -> list[str]:
    """``text`` with its local includes replaced by their text; ``label`` names it in
    the ``#line`` marks."""
    lines = [f'#line 1 "{label}"']
    for number, line in enumerate(text.splitlines(), 1):
        include = _LOCAL_INCLUDE.fullmatch(line)
        if include is None:
            lines.append("" if _PRAGMA_ONCE.fullmatch(line) else line)
            continue
        if include.group(1) not in seen:
            seen.add(include.group(1))
            lines += _inline(_read(include.group(1)), f"flexattn/cpu/csrc/{include.group(1)}", seen)
        lines.append(f'#line {number + 1} "{label}"')
    return lines


def assemble(text: str, label: str) -> str:
    """One translation unit from the C++ ``text`` (``label`` names it in compiler
    messages)."""
    return "\n".join(_inline(text, label, set())) + "\n"


def engine_source() -> str:
    """The engine's translation unit."""
    return assemble(_read("engine.cpp"), "flexattn/cpu/csrc/engine.cpp")


def mod_library_source(functions: str, exports: str) -> str:
    """A mod library's translation unit: the generated C++ ``functions`` and their
    extern "C" ``exports`` in ``csrc/mods.cpp.jinja``."""
    import jinja2

    environment = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    text = environment.from_string(_read("mods.cpp.jinja")).render(FUNCTIONS=functions, EXPORTS=exports)
    return assemble(text, "mod library (flexattn/cpu/csrc/mods.cpp.jinja rendered)")

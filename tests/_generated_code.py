"""Reading Inductor's generated code in tests."""

from __future__ import annotations


def constexpr(code: str, name: str) -> str:
    """The value a kernel in ``code`` gives the constexpr ``name`` (its first definition)."""
    marker = f"{name} : tl.constexpr = "
    assert marker in code, f"{name} not defined in the kernel"
    return code.split(marker, 1)[1].split("\n", 1)[0].strip()

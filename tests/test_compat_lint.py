"""Lint: torch and Triton internals are reached only through ``flexattn/_compat.py``.

Rule: a module of ``flexattn/`` other than ``_compat.py`` and the lowering
(``flexattn/lowering/``; the CPU engine's ``flexattn/cpu/lowering.py`` and the mods'
translation to C++, ``mod_library.py`` and ``mod_ops.py``) must not import or name a
private torch or Triton API: a dotted name under ``torch`` or ``triton`` with a
component starting with an underscore (dunders such as ``torch.__version__`` are
public), or one under ``torch.fx.experimental``. The check reads the source (imports,
attribute chains on imported torch/triton names, and ``getattr(module, "_name")``); it
cannot see internals reached through objects, which ``_compat``'s docstring lists
instead.

And the other way round: every name ``_compat`` exports (its ``__all__``, which must hold
all its public names) is used somewhere in the repository.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "flexattn"
COMPAT = PACKAGE / "_compat.py"
EXEMPT_DIRS = (PACKAGE / "lowering",)
EXEMPT_FILES = tuple(PACKAGE / "cpu" / name for name in ("lowering.py", "mod_library.py", "mod_ops.py"))
PRIVATE_ROOTS = ("torch", "triton")
UNSTABLE_PREFIXES = ("torch.fx.experimental",)
#: Where _compat's names may be used: the package, its tests, scripts, benchmarks, examples.
USER_DIRS = ("flexattn", "tests", "scripts", "bench", "examples")

#: Private uses allowed for now, (file, name) -> the _compat name meant to replace each;
#: an entry no longer used fails the test, so the table only shrinks.
PENDING: dict[tuple[str, str], str] = {}


def _is_private(dotted: str) -> bool:
    parts = dotted.split(".")
    if parts[0] not in PRIVATE_ROOTS:
        return False
    if any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts[1:]):
        return True
    return any(dotted == p or dotted.startswith(p + ".") for p in UNSTABLE_PREFIXES)


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """``torch._C.X`` for an attribute chain rooted at a name bound to a torch/triton path."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in aliases:
        return None
    return ".".join([aliases[node.id], *reversed(attrs)])


def private_uses(source: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every private torch/triton API the source imports or names."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}  # local name -> the torch/triton path it is bound to
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] not in PRIVATE_ROOTS:
                    continue
                if _is_private(alias.name):
                    found.append((node.lineno, alias.name))
                if alias.asname:
                    aliases[alias.asname] = alias.name
                else:
                    root = alias.name.split(".")[0]
                    aliases[root] = root
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] not in PRIVATE_ROOTS:
                continue
            if _is_private(node.module):
                found.append((node.lineno, node.module))
                continue
            for alias in node.names:
                path = f"{node.module}.{alias.name}"
                if _is_private(path):
                    found.append((node.lineno, path))
                aliases[alias.asname or alias.name] = path
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parent = parents.get(node)
            if isinstance(parent, ast.Attribute) and parent.value is node:
                continue  # only the longest chain: torch._C.X, not also torch._C
            dotted = _dotted(node, aliases)
            if dotted and _is_private(dotted):
                found.append((node.lineno, dotted))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            base = _dotted(node.args[0], aliases) if isinstance(node.args[0], (ast.Name, ast.Attribute)) else None
            if base and _is_private(f"{base}.{node.args[1].value}"):
                found.append((node.lineno, f"{base}.{node.args[1].value}"))
    return sorted(set(found))


def _linted_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py")
                  if p != COMPAT and p not in EXEMPT_FILES and not any(d in p.parents for d in EXEMPT_DIRS))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_lint_sees_private_uses():
    """The checker itself: each spelling of a private use is caught, public ones are not."""
    source = "\n".join([
        "import torch",                                          # 1
        "import torch.utils._pytree as pytree",                  # 2
        "from torch._C import DispatchKey",                      # 3
        "from torch import _C, Tensor",                          # 4
        "import torch.fx.experimental.proxy_tensor",             # 5
        "import triton.language as tl",                          # 6
        "from torch.nn import functional as F",                  # 7
        "torch._dynamo.reset()",                                 # 8
        "x = torch._C._AutoDispatchBelowAutograd()",             # 9
        "y = getattr(torch, '_inductor')",                       # 10
        "z = tl._core",                                          # 11
        "ok = torch.compiler.reset, torch.__version__, F.relu, Tensor.add_",  # 12
        "def f():",                                              # 13
        "    import triton._C.libtriton as lib",                 # 14
        "    return lib",                                        # 15
    ])
    assert private_uses(source) == [
        (2, "torch.utils._pytree"), (3, "torch._C"), (4, "torch._C"),
        (5, "torch.fx.experimental.proxy_tensor"), (8, "torch._dynamo.reset"),
        (9, "torch._C._AutoDispatchBelowAutograd"), (10, "torch._inductor"),
        (11, "triton.language._core"), (14, "triton._C.libtriton"),
    ]


def test_private_torch_apis_go_through_compat():
    offending, pending_seen = [], set()
    for path in _linted_modules():
        for line, name in private_uses(path.read_text()):
            if (_rel(path), name) in PENDING:
                pending_seen.add((_rel(path), name))
            else:
                offending.append(f"{_rel(path)}:{line}: {name}")
    assert not offending, (
        "private torch/triton APIs outside flexattn/_compat.py (add a re-export or wrapper there "
        "and use it):\n" + "\n".join(offending))
    stale = sorted(set(PENDING) - pending_seen)
    assert not stale, f"no longer used, remove from PENDING in {Path(__file__).name}: {stale}"


def _compat_all(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError("flexattn/_compat.py has no __all__")


def _compat_public_names(tree: ast.Module) -> set[str]:
    """Names _compat defines, and those it imports from private torch/triton modules."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.ImportFrom) and node.module and _is_private(node.module):
            names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.asname for a in node.names if a.asname and _is_private(a.name))
    return {n for n in names if not n.startswith("_")}


def _compat_uses(source: str) -> set[str]:
    """Names used as ``_compat.NAME`` (``x._compat.NAME`` too) or imported from ``_compat``."""
    used: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            base = node.value
            if (isinstance(base, ast.Name) and base.id == "_compat") or \
                    (isinstance(base, ast.Attribute) and base.attr == "_compat"):
                used.add(node.attr)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[-1] == "_compat":
            used.update(a.name for a in node.names)
        elif (isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[0], ast.Attribute) and node.args[0].attr == "_compat"):
            used.add(node.args[1].value)  # monkeypatch.setattr(module._compat, "NAME", ...)
    return used


def test_compat_exports_are_declared_and_used():
    tree = ast.parse(COMPAT.read_text())
    exported = _compat_all(tree)
    assert len(exported) == len(set(exported)), "duplicate names in _compat.__all__"
    public = _compat_public_names(tree)
    assert set(exported) == public, (
        f"_compat.__all__ must list exactly its public names: missing {sorted(public - set(exported))}, "
        f"not defined {sorted(set(exported) - public)}")

    used = set(PENDING.values())
    for directory in USER_DIRS:
        for path in (ROOT / directory).rglob("*.py"):
            if path not in (COMPAT, Path(__file__).resolve()):
                used |= _compat_uses(path.read_text())
    # Kernel templates are Jinja, not Python: their run-time imports from _compat by line.
    for path in (ROOT / "flexattn" / "templates").glob("*.jinja"):
        for names in re.findall(r"^from flexattn\._compat import ([\w, ]+)$", path.read_text(), re.M):
            used |= {name.strip() for name in names.split(",")}
    unused = sorted(set(exported) - used)
    assert not unused, f"exported by flexattn/_compat.py but used nowhere (remove them): {unused}"

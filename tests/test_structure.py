"""The package's shape: no import circle inside flexattn, no kernel lowering importing
another, no kernel code importing the test oracle (flexattn.reference), no module or C++
source over 700 lines, no private name of one flexattn module used by another, no history
notes (session numbers, dates, run ids) in the package, the docs or the README, and no
stale imports of it in the scripts, benchmarks and examples."""

from __future__ import annotations

import ast
import pathlib
import re
from pathlib import Path

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "flexattn"
KERNEL_LOWERINGS = {"flexattn.lowering.forward", "flexattn.lowering.backward", "flexattn.lowering.decode",
                    "flexattn.lowering.gluon_forward", "flexattn.cpu.lowering"}
MAX_LINES = 700
#: The package's sources (Python, C++, Jinja templates), every one held to MAX_LINES.
SOURCE_SUFFIXES = ("*.py", "*.cpp", "*.h", "*.jinja")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path) -> set[str]:
    """flexattn modules imported by a file, at any depth of its code."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t.startswith("flexattn") and _exists(t)}
    return found - {name}


def _exists(module: str) -> bool:
    path = ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}


def test_no_import_circle():
    graph = _graph()
    # A package importing its own submodules (re-exports) is not a circle.
    edges = {m: {t for t in targets if not m.startswith(t + ".") and not t.startswith(m + ".")}
             for m, targets in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in sorted(edges.get(module, ())):
            if state.get(target) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(target):] + [target]))
            if target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module)


def test_no_kernel_lowering_imports_another():
    graph = _graph()
    for module in KERNEL_LOWERINGS:
        others = graph[module] & (KERNEL_LOWERINGS - {module})
        assert not others, f"{module} imports {sorted(others)}"


#: Kernel code: the Inductor lowerings, the CPU engine's package and the templates' Python.
KERNEL_CODE = ("flexattn.lowering", "flexattn.cpu", "flexattn.templates")
ORACLE = "flexattn.reference"


def test_no_kernel_code_imports_the_oracle():
    """The dense reference is the test oracle: kernels take what they share with it
    (statistics dtype, dropout's keep mask, ...) from flexattn.numerics, so an edit to
    the oracle cannot change a kernel."""
    graph = _graph()
    kernel_modules = [m for m in graph if any(m == p or m.startswith(p + ".") for p in KERNEL_CODE)]
    assert "flexattn.lowering.forward" in kernel_modules
    offenders = sorted(m for m in kernel_modules if ORACLE in graph[m])
    assert not offenders, f"kernel code importing {ORACLE}: {offenders}"


def test_module_lengths():
    paths = [p for suffix in SOURCE_SUFFIXES for p in PACKAGE.rglob(suffix)]
    assert any(p.suffix == ".cpp" for p in paths) and any(p.suffix == ".h" for p in paths)
    too_long = [f"{p.relative_to(ROOT)} has {n} lines" for p in paths
                if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not too_long, "\n".join(too_long)


HISTORY = re.compile(r"\bsessions? \d+\b|\bround \d+\b|\b20\d\d-\d\d-\d\d\b|\b20\d{6}-\d{6}\b", re.I)
#: A cited result file (the generated performance table links the runs it reads).
RESULT_FILE = re.compile(r"[\w./-]*\.(json|md|png)\b")


def test_no_history_notes():
    paths = [*(p for suffix in SOURCE_SUFFIXES for p in PACKAGE.rglob(suffix)), *(ROOT / "docs").rglob("*.md"),
             ROOT / "README.md"]
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in paths
            for i, line in enumerate(p.read_text().splitlines(), 1) if HISTORY.search(RESULT_FILE.sub("", line))]
    assert not hits, "history notes belong in bench/DECISIONS.md:\n" + "\n".join(hits)


def test_decision_records_cited_exist():
    """Every bench/DECISIONS.md#id that code, docs or the README points to is a row there."""
    decisions = (ROOT / "bench" / "DECISIONS.md").read_text()
    paths = [*(p for suffix in SOURCE_SUFFIXES for p in PACKAGE.rglob(suffix)), *(ROOT / "docs").rglob("*.md"),
             ROOT / "README.md", *(ROOT / "bench").rglob("*.py"),
             *(p for p in (ROOT / "tests").rglob("*.py") if p.name != Path(__file__).name)]
    cited = {(p.relative_to(ROOT), anchor) for p in paths
             for anchor in re.findall(r"DECISIONS\.md#([a-z0-9-]+)", p.read_text())}
    missing = sorted(f"{path}: {anchor}" for path, anchor in cited if f'id="{anchor}"' not in decisions)
    assert cited and not missing, "no such DECISIONS.md row:\n" + "\n".join(missing)


#: Code outside the package that imports from it (run by hand or on the GPU host, so a
#: stale import there fails no other CPU test).
TOOL_DIRS = ("scripts", "bench", "examples")


def test_tools_import_names_that_exist():
    """Every ``from flexattn... import name`` in scripts, benchmarks and examples names a
    module or an attribute that exists (a restructure once left a script importing
    config modules that had moved)."""
    import importlib

    stale = []
    for directory in TOOL_DIRS:
        for path in sorted((ROOT / directory).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    stale += [f"{path.relative_to(ROOT)}:{node.lineno}: {alias.name}" for alias in node.names
                              if alias.name.split(".")[0] == "flexattn" and not _exists(alias.name)]
                if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                        and node.module.split(".")[0] == "flexattn"):
                    continue
                if not _exists(node.module):
                    stale.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.module}")
                    continue
                module = importlib.import_module(node.module)
                for alias in node.names:
                    if alias.name != "*" and not hasattr(module, alias.name) \
                            and not _exists(f"{node.module}.{alias.name}"):
                        stale.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.module}.{alias.name}")
    assert not stale, "imports of names flexattn does not have:\n" + "\n".join(stale)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_uses(path: pathlib.Path) -> list[str]:
    """Where a file imports, or reads as a module attribute, a private name (one leading
    underscore) of another flexattn module. Private *modules* (``from . import _compat``,
    ``flexattn._hop``) are package-internal and allowed."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    modules: dict[str, str] = {}     # local name -> the flexattn module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "flexattn":
                    modules[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else "flexattn"
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                module = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != "flexattn":
                continue
            for alias in node.names:
                if _exists(f"{module}.{alias.name}"):
                    modules[alias.asname or alias.name] = f"{module}.{alias.name}"
                elif _private(alias.name) and module != name:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {module} import {alias.name}")

    def module_of(expr: ast.expr) -> str | None:
        if isinstance(expr, ast.Name):
            return modules.get(expr.id)
        if isinstance(expr, ast.Attribute):
            outer = module_of(expr.value)
            if outer is not None and _exists(f"{outer}.{expr.attr}"):
                return f"{outer}.{expr.attr}"
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            module = module_of(node.value)
            if module is not None and module != name and not _exists(f"{module}.{node.attr}"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {module}.{node.attr}")
    return found


def test_no_private_name_used_across_modules():
    """A name with a leading underscore is its module's own: no other module of the
    package, and no script, benchmark or example, imports it or reads it off the module.
    What several modules need is public in the package."""
    files = [*PACKAGE.rglob("*.py"), *(p for d in TOOL_DIRS for p in (ROOT / d).rglob("*.py"))]
    found = [hit for path in sorted(files) for hit in _private_uses(path)]
    assert not found, "private names used outside their module:\n" + "\n".join(found)


#: Paths into the package (``flexattn/lowering/forward.py``, ``flexattn/cpu/``), dotted names
#: (``flexattn.lowering.dispatch``, ``flexattn.cpu.uses_engine``) and bare source names in
#: double backticks (````forward.py````).
_PATH = re.compile(r"(?<![\w/.])flexattn/[\w/*-]*(?:(?:\.[\w*]+)+|/)")
_DOTTED = re.compile(r"(?<![\w.])flexattn(?:\.[A-Za-z_]\w*)+")
_BARE_SOURCE = re.compile(r"``([\w-]+\.(?:py|jinja|cpp|h))``")
#: Files the package writes at build time (the CPU engine's generated header).
_GENERATED = {"abi_generated.h"}


def _named_places(text: str) -> tuple[set[str], set[str], set[str]]:
    return set(_PATH.findall(text)), set(_DOTTED.findall(text)), set(_BARE_SOURCE.findall(text))


def test_module_paths_in_docs_and_docstrings_exist():
    """Every package path, dotted module name and source file named in the docs, the
    READMEs, the package's docstrings and comments, and the templates exists."""
    import importlib

    texts = [*(ROOT / "docs").rglob("*.md"), ROOT / "README.md", ROOT / "bench" / "README.md",
             *PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.jinja"), *(ROOT / "tests").glob("_*.py")]
    sources = {p.name for p in ROOT.rglob("*") if p.suffix in (".py", ".jinja", ".cpp", ".h") and ".git" not in p.parts}
    sources |= _GENERATED
    stale = []
    for path in texts:
        paths, dotted, bare = _named_places(path.read_text())
        where = path.relative_to(ROOT)
        stale += [f"{where}: {p}" for p in paths if not list(ROOT.glob(p.rstrip("/")))]
        stale += [f"{where}: ``{name}``" for name in bare if name not in sources]
        for name in dotted:
            parts = name.split(".")
            while len(parts) > 1 and not _exists(".".join(parts)):
                parts.pop()
            rest = name.split(".")[len(parts):]
            module = importlib.import_module(".".join(parts))
            if rest and not hasattr(module, rest[0]) and not _exists(".".join(parts + rest[:1])):
                stale.append(f"{where}: {name}")
    assert len(texts) > 50
    assert not stale, "names of modules or files that do not exist:\n" + "\n".join(sorted(stale))

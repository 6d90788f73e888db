"""bench/'s layout: bench/results holds exactly the files the docs cite, every tool and probe
is documented where a newcomer looks for it, and bench/DECISIONS.md names modules and
constants that exist.

A result file is cited by a ``results/NAME`` path (README.md, docs/, bench/README.md and
the rest), or in bench/DECISIONS.md and bench/experiments/README.md also by its bare name in
backticks (``NAME.{json,md}`` meaning both)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
RESULT_EXTENSIONS = ("json", "md", "png", "log", "txt")
#: Documents whose citations keep a result file.
CITING_PATHS = ("README.md", "bench/README.md", "bench/DECISIONS.md", "bench/experiments/README.md")
#: Those of them that may cite a result by its bare name.
BARE_NAME_PATHS = ("bench/DECISIONS.md", "bench/experiments/README.md")
#: What the tools write into bench/results as scratch, never committed (bench/.gitignore).
SCRATCH = re.compile(r"latest\.\w+|dry-run")
_EXT = "|".join(RESULT_EXTENSIONS)
RESULT_PATH = re.compile(rf"results/([A-Za-z0-9][\w.-]*\.(?:{_EXT}))\b")
BARE_NAME = re.compile(rf"`([a-z0-9][a-z0-9.-]*\.(?:{_EXT}|\{{[a-z,]+\}}))`")


def _expand(name: str) -> set[str]:
    """``stem.{json,md}`` -> {stem.json, stem.md}; other names as they are."""
    stem, _, suffix = name.partition(".")
    if not suffix.startswith("{"):
        return {name}
    return {f"{stem}.{ext}" for ext in suffix.strip("{}").split(",")}


def _citing_documents() -> list[Path]:
    docs = [ROOT / path for path in CITING_PATHS]
    return docs + sorted(p for p in (ROOT / "docs").rglob("*") if p.suffix in (".md", ".rst"))


def cited_results() -> dict[str, set[str]]:
    """Result file name -> the documents (relative paths) that cite it."""
    cited: dict[str, set[str]] = {}
    for path in _citing_documents():
        text = path.read_text()
        names = set(RESULT_PATH.findall(text))
        if str(path.relative_to(ROOT)) in BARE_NAME_PATHS:
            names |= {n for name in BARE_NAME.findall(text) for n in _expand(name)}
        for name in names:
            cited.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return cited


def stored_results() -> set[str]:
    return {p.name for p in RESULTS.iterdir() if not p.name.startswith(".") and not SCRATCH.fullmatch(p.name)}


def test_citations_are_found():
    """The parser sees the citations the docs are known to make (so that the two tests
    below cannot pass by finding none)."""
    cited = cited_results()
    assert "bench/DECISIONS.md" in cited["cpu-vm-20261126.md"]
    assert "README.md" in cited["attention-nvidia-h200-20261124-123324.png"]
    assert {"attention-nvidia-h200-20261122-055447.json", "attention-nvidia-h200-20261122-055447.md"} <= set(cited)
    assert _expand("a-1.{json,md}") == {"a-1.json", "a-1.md"}
    assert not RESULT_PATH.findall("results/attention-<gpu>-<stamp>.json and `results/`")


def test_every_cited_result_file_exists():
    missing = sorted(f"{name} (cited by {', '.join(sorted(docs))})"
                     for name, docs in cited_results().items() if not (RESULTS / name).is_file())
    assert not missing, "cited result files missing from bench/results:\n" + "\n".join(missing)


def test_every_result_file_is_cited():
    uncited = sorted(stored_results() - set(cited_results()))
    assert not uncited, ("bench/results files cited nowhere (cite them from bench/DECISIONS.md or a doc, or "
                         "git rm them):\n" + "\n".join(uncited))


def test_scratch_outputs_are_ignored():
    ignore = (BENCH / ".gitignore").read_text().split()
    assert "/results/latest.*" in ignore


def _scripts(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if p.suffix in (".py", ".sh") and not p.name.startswith("_")}


def test_bench_readme_documents_every_tool():
    readme = (BENCH / "README.md").read_text()
    tools_table = readme.split("## The tools", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `([\w.]+\.(?:py|sh))", tools_table, re.M))
    assert listed == _scripts(BENCH), f"bench/README.md's tool table: {sorted(listed ^ _scripts(BENCH))}"
    helpers = {p.name for p in BENCH.glob("_*.py")}
    assert helpers and all(f"`{name}`" in readme for name in helpers)


def test_experiments_readme_lists_every_probe():
    readme = (BENCH / "experiments" / "README.md").read_text()
    listed = set(re.findall(r"^\| `([\w.]+\.py)` \|", readme, re.M))
    probes = _scripts(BENCH / "experiments")
    assert listed == probes, f"bench/experiments/README.md's table: {sorted(listed ^ probes)}"


def _decision_rows() -> list[str]:
    return [line for line in (BENCH / "DECISIONS.md").read_text().splitlines() if line.startswith("| <a id=")]


def test_decisions_name_modules_that_exist():
    """Every flexattn path bench/DECISIONS.md names (``flexattn/...``, or ``configs/...``,
    ``distributed/...`` inside it) exists."""
    text = (BENCH / "DECISIONS.md").read_text()
    paths = set(re.findall(r"`((?:flexattn|configs|distributed)/[\w/.*]+)`", text))
    assert "flexattn/lowering/configs/forward.py" in paths
    bases = (ROOT, ROOT / "flexattn", ROOT / "flexattn" / "lowering")
    stale = sorted(p for p in paths if not any(list(base.glob(p.rstrip("/"))) for base in bases))
    assert not stale, "bench/DECISIONS.md names paths that do not exist:\n" + "\n".join(stale)


def test_decisions_name_constants_that_exist():
    """Every ALL_CAPS name a kept row puts in backticks is in flexattn's source (rows whose
    choice is 'removed' or 'rejected' name what is gone)."""
    source = "\n".join(p.read_text() for p in (ROOT / "flexattn").rglob("*") if p.suffix in (".py", ".jinja", ".cpp", ".h"))
    rows = _decision_rows()
    kept = [row for row in rows if not re.match(r"(removed|rejected)", row.split(" | ")[2])]
    assert len(rows) > len(kept) > 50
    names = {name for row in kept for name in re.findall(r"`([A-Z][A-Z0-9_]{2,})", row)}
    assert "MIN_SPLIT_KV" in names
    missing = sorted(name for name in names if not re.search(rf"\b{name}\b", source))
    assert not missing, "bench/DECISIONS.md names constants flexattn does not have:\n" + "\n".join(missing)

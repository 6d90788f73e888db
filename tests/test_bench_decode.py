"""The decode benchmark harness (bench/bench_decode.py) on the CPU: its --dry-run, in-process
(tiny shapes, float32, eager compile backend), with the paged-KV-cache variant.

Checks the JSON and markdown it writes, that every implementation ran, that the paged
variant's output matches the float32 reference as closely as the contiguous run's does,
and the paged/contiguous column.
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load():
    spec = importlib.util.spec_from_file_location("_bench_decode", BENCH / "bench_decode.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _load()


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_decode")
    return out, bench.main(["--dry-run", "--out", str(out)])


def test_dry_run_writes_json_and_markdown(dry_run):
    out, report = dry_run
    names = sorted(p.name for p in out.iterdir())
    stems = [n[:-len(".json")] for n in names if n.startswith("decode-cpu-") and n.endswith(".json")]
    assert len(stems) == 1 and f"{stems[0]}.md" in names
    saved = json.loads((out / f"{stems[0]}.json").read_text())
    assert saved["gpu"] == "cpu" and saved["results"] == report["results"]
    assert (out / f"{stems[0]}.md").read_text() == report["markdown"]


def test_paged_variant_matches_the_contiguous_run(dry_run):
    _, report = dry_run
    cells = {(r["case"], r["impl"]): r for r in report["results"]}
    cases = sorted({r["case"] for r in report["results"]})
    assert len(cases) == 4
    for case in cases:
        contiguous, paged = cells[(case, "flexattn")], cells[(case, "flexattn_paged")]
        assert "error" not in contiguous and "error" not in paged, (contiguous, paged)
        assert paged["max_abs_err"] <= 2 * contiguous["max_abs_err"] + 1e-6, (case, paged, contiguous)
        assert paged["bytes"] == contiguous["bytes"] and paged["ms"] > 0


def test_markdown_has_the_paged_ratio(dry_run):
    _, report = dry_run
    lines = report["markdown"].splitlines()
    header = next(line for line in lines if line.startswith("| case |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert "flexattn_paged" in columns and columns[-1] == "paged/contiguous"
    rows = [line for line in lines if line.startswith("| b")]
    assert len(rows) == 4
    for row in rows:
        ratio = row.strip("|").split("|")[-1].strip()
        assert float(ratio) > 0, row


def test_paging_options():
    args = bench.parse_args(["--dry-run", "--page-size", "32", "--no-paged"])
    assert args.page_size == 32 and args.no_paged
    assert bench.parse_args([]).page_size is None and not bench.parse_args([]).no_paged

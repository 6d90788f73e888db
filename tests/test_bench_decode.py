"""The decode benchmark harness (bench/bench_decode.py) on the CPU: its --dry-run, in-process
(tiny shapes, float32, eager compile backend), with the paged-KV-cache variant.

Checks the JSON and markdown it writes, that every implementation ran, that the paged
variant's output matches the float32 reference as closely as the contiguous run's does,
and the paged/contiguous column.
"""

import json

import pytest

from conftest import load_bench


bench = load_bench("bench_decode")


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
        contiguous = cells[(case, "flexattn")]
        for impl in ("flexattn_paged", "flexattn_paged_pages"):   # the default layouts: heads, pages
            paged = cells[(case, impl)]
            assert "error" not in contiguous and "error" not in paged, (contiguous, paged)
            assert paged["max_abs_err"] <= 2 * contiguous["max_abs_err"] + 1e-6, (case, paged, contiguous)
            assert paged["bytes"] == contiguous["bytes"] and paged["ms"] > 0


def test_markdown_has_the_paged_ratio(dry_run):
    _, report = dry_run
    lines = report["markdown"].splitlines()
    header = next(line for line in lines if line.startswith("| case |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    # The CPU run has no graph timings, so no cold ones and no cold columns.
    assert {"flexattn_paged", "flexattn_paged_pages", "paged/contiguous"} <= set(columns)
    assert columns[-1] == "paged/contiguous (pages)"
    assert not any("cold" in c for c in columns)
    rows = [line for line in lines if line.startswith("| b")]
    assert len(rows) == 4
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == len(columns) and float(cells[-1]) > 0, row


def test_markdown_cold_columns():
    """With cold timings the table gains a cold ratio beside each warm one."""
    base = {"case": "b8_kv8192_h32on8_d128_window1024", "ms": 0.1}
    results = [{**base, "impl": "flexattn", "ms_graph": 0.010, "ms_graph_cold": 0.013, "cold_copies": 7},
               {**base, "impl": "flexattn_paged", "ms_graph": 0.0103, "ms_graph_cold": 0.0134, "cold_copies": 7},
               {**base, "impl": "sdpa", "ms_graph": 0.011, "ms_graph_cold": 0.0143, "cold_copies": 7}]
    lines = bench.markdown(results, None, "gpu").splitlines()
    header = next(line for line in lines if line.startswith("| case |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    cells = dict(zip(columns, (c.strip() for c in lines[-1].strip("|").split("|"))))
    assert cells["flexattn/sdpa"] == "1.100x" and cells["flexattn/sdpa cold"] == "1.100x"
    assert cells["paged/contiguous"] == "1.030" and cells["paged/contiguous cold"] == "1.031"
    assert cells["flexattn"] == "0.100 (0.010) {0.013 x7}"


def test_paging_options():
    args = bench.parse_args(["--dry-run", "--page-size", "32", "--no-paged"])
    assert args.page_size == 32 and args.no_paged
    assert bench.parse_args([]).page_size is None and not bench.parse_args([]).no_paged


def test_cold_copies_span_the_l2_cache_within_memory():
    l2 = 50 << 20
    # Read bytes over 4 L2 caches: the cache alone is cold.
    assert bench.cold_copies(17 << 30, 17 << 30, l2, 100 << 30) == 1
    # A 37.7 MB window: 6 copies span 226 MB >= 200 MB.
    touched = 37_748_736
    copies = bench.cold_copies(touched, 4 << 30, l2, 100 << 30)
    assert copies == 6 and copies * touched >= bench.COLD_L2_SPAN * l2 > (copies - 1) * touched
    # Memory caps the copies: half of 10 GiB holds one 4 GiB copy beside the cache.
    assert bench.cold_copies(touched, 4 << 30, l2, 10 << 30) == 2
    assert bench.cold_copies(touched, 4 << 30, l2, 1 << 30) == 1


def test_cycling_calls_the_copies_in_turn():
    seen = []
    fn = bench.cycling(seen.append, 3)
    for _ in range(7):
        fn()
    assert seen == [0, 1, 2, 0, 1, 2, 0]


def test_warm_only_option():
    assert bench.parse_args(["--warm-only"]).warm_only and not bench.parse_args([]).warm_only


def test_strided_copy_keeps_an_overlapping_pool_view():
    import torch
    from flexattn import PagedKVCache
    cache = PagedKVCache(4, 2, 1, layout="pages", num_kv_heads=3)
    k_pool, _ = cache.allocate(3, 4, torch.float32)
    k_pool.normal_()
    copy = bench.strided_copy(k_pool)
    assert copy.stride() == k_pool.stride() and torch.equal(copy, k_pool)
    assert copy.untyped_storage().nbytes() == k_pool.untyped_storage().nbytes() == 4 * 3 * 2 * 4 * 4
    assert copy.data_ptr() != k_pool.data_ptr()

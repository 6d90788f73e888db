"""The benchmark harness itself (bench/bench_attention.py, bench/bench_sinks.py, bench/plot.py, bench/report.py,
the options of bench/tune.py and bench/profiler.py), on the CPU; what bench/results and
bench/DECISIONS.md cite is tests/test_bench_layout.py's.

Runs the harness's --dry-run in-process (tiny shapes, float32, eager compile backend)
into a temporary folder and checks the JSON and markdown it writes, the recording of a
failing implementation, merging of result files and the plot; checks that README.md's
performance section is what bench/report.py generates from bench/results.
"""

import json
import math
from pathlib import Path

import pytest

from conftest import load_bench

import flexattn

BENCH = Path(__file__).resolve().parents[1] / "bench"
CASES = "causal_s8192_d128,causal_alibi_s8192_d128,document8_s8192_d128,gqa32on8_causal_s8192_d128"


bench = load_bench("bench_attention")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    report = bench.main(["--dry-run", "--cases", CASES, "--out", str(out)])
    return out, report


def _cells(report):
    return {(r["case"], r["mode"], r["impl"]): r for r in report["results"]}


def test_dry_run_writes_json_markdown_and_latest(dry_run):
    out, report = dry_run
    written = sorted(p.name for p in out.iterdir())
    stems = [n[: -len(".json")] for n in written if n.startswith("attention-cpu-") and n.endswith(".json")]
    assert len(stems) == 1 and f"{stems[0]}.md" in written
    assert {"latest.json", "latest.md"} <= set(written)
    saved = json.loads((out / f"{stems[0]}.json").read_text())
    assert saved == json.loads((out / "latest.json").read_text())
    for key in ("gpu", "torch", "triton", "command", "date", "settings", "cases", "results", "summary"):
        assert key in saved, key
    assert saved["gpu"] == "cpu" and saved["settings"]["dtype"] == "float32"
    assert saved["settings"]["compile_backend"] == "eager"
    assert "--dry-run" in saved["command"]
    assert (out / f"{stems[0]}.md").read_text().startswith(saved["markdown"])


def test_every_case_mode_and_impl_has_a_cell(dry_run):
    _, report = dry_run
    names = CASES.split(",")
    assert [c["name"] for c in report["cases"]] == names
    cells = _cells(report)
    assert len(cells) == len(report["results"]) == len(names) * 2 * 4
    for name in names:
        for mode in ("fwd", "fwdbwd"):
            for impl in bench.IMPLS:
                cell = cells[(name, mode, impl)]
                assert ("ms" in cell) + ("error" in cell) + ("note" in cell) == 1, cell


def test_flex_cells_are_timed_checked_and_counted(dry_run):
    _, report = dry_run
    cells = _cells(report)
    info = {c["name"]: c for c in report["cases"]}
    for name in CASES.split(","):
        case = info[name]
        assert case["density_kind"] == "exact"
        assert 0 < case["density"] <= case["density_block_torch"] <= 1
        assert case["density_block_flexattn"] == pytest.approx(case["density_block_torch"])
        assert case["fwd_flops"] == pytest.approx(
            4 * case["B"] * case["H"] * case["S"] ** 2 * case["D"] * case["density"]
        )
        for impl in ("flexattn", "torch_flex"):
            cell = cells[(name, "fwd", impl)]
            assert cell["ms"] > 0 and cell["compile_s"] > 0
            assert cell["tflops"] == pytest.approx(case["fwd_flops"] / (cell["ms"] * 1e-3) / 1e12)
        fwd = cells[(name, "fwd", "flexattn")]
        assert fwd["max_abs_err"] < 1e-4 and fwd["err_flag"] is False
        fwdbwd = cells[(name, "fwdbwd", "flexattn")]
        assert fwdbwd["tflops"] == pytest.approx(3.5 * case["fwd_flops"] / (fwdbwd["ms"] * 1e-3) / 1e12)
        assert "note" in cells[(name, "fwdbwd", "torch_flex")]
    causal = CASES.split(",")[0]
    assert "ms" in cells[(causal, "fwd", "sdpa_flash")]
    assert cells[("causal_alibi_s8192_d128", "fwd", "sdpa_flash")]["note"] == "no SDPA variant"
    assert info[causal]["density"] == pytest.approx((256 * 257 / 2) / 256**2)


def test_rounds_in_turn_take_the_median(tmp_path, monkeypatch):
    # Each timing returns the next of a known sequence, so each record's ms must be the
    # median of its own rounds, taken in the rotated order time_in_turn promises.
    times = iter([5.0, 1.0, 3.0, 9.0, 2.0, 4.0, 7.0, 8.0, 6.0])

    def fake_median_ms(fn, grads, settings):
        fn()
        return next(times)

    monkeypatch.setattr(bench, "median_ms", fake_median_ms)
    report = bench.main(["--dry-run", "--cases", "causal_s8192_d128", "--mode", "fwd", "--rounds", "3",
                         "--out", str(tmp_path)])
    cells = _cells(report)
    # Round 1 in the impls' order, round 2 starting at the second impl, round 3 at the third.
    expected = {"torch_flex": [5.0, 4.0, 8.0], "flexattn": [1.0, 9.0, 6.0], "sdpa_flash": [3.0, 2.0, 7.0]}
    for impl, rounds in expected.items():
        cell = cells[("causal_s8192_d128", "fwd", impl)]
        assert cell["ms_rounds"] == rounds
        assert cell["ms"] == sorted(rounds)[1]
    assert cells[("causal_s8192_d128", "fwd", "flexattn")]["tflops"] == pytest.approx(
        report["cases"][0]["fwd_flops"] / 6e-3 / 1e12)
    assert report["settings"]["rounds"] == 3
    assert "median of 3 rounds taken in turn" in (tmp_path / "latest.md").read_text()
    with pytest.raises(SystemExit, match="--rounds"):
        bench.main(["--dry-run", "--cases", "causal_s8192_d128", "--rounds", "0", "--out", str(tmp_path)])


def test_short_suite_files_stay_out_of_the_readme_table(tmp_path):
    bench.main(["--dry-run", "--suite", "short", "--part", "1/18", "--mode", "fwd", "--out", str(tmp_path)])
    written = [p.name for p in tmp_path.glob("attention-*.json")]
    assert len(written) == 1 and written[0].endswith("-short-part1of18.json")
    assert not load_bench("report").result_files(tmp_path, "attention")


def test_ratios_geomean_and_table(dry_run):
    _, report = dry_run
    cells = _cells(report)
    summary = report["summary"]
    ratios = [summary["ratio"][name]["fwd"] for name in CASES.split(",")]
    for name, ratio in zip(CASES.split(","), ratios):
        expected = cells[(name, "fwd", "flexattn")]["tflops"] / cells[(name, "fwd", "torch_flex")]["tflops"]
        assert ratio == pytest.approx(expected)
    geomean = math.exp(sum(map(math.log, ratios)) / len(ratios))
    assert summary["geomean"]["fwd"] == pytest.approx(geomean)
    assert summary["geomean_count"]["fwd"] == len(ratios)
    table = report["markdown"]
    assert "| case | mode | flexattn | torch flex | ratio |" in table
    for name in CASES.split(","):
        assert f"| {name} | fwd |" in table and f"| {name} | fwdbwd |" in table
    assert "geomean flexattn/torch flex" in table


def test_a_failing_implementation_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(flexattn, "flex_attention", broken)
    report = bench.main(["--dry-run", "--cases", "causal_s8192_d128", "--mode", "fwd", "--out", str(tmp_path)])
    cells = _cells(report)
    failed = cells[("causal_s8192_d128", "fwd", "flexattn")]
    # Under torch.compile (CUDA) Dynamo reports the exception by its type.
    assert "kernel exploded" in failed["error"] or "RuntimeError" in failed["error"]
    assert "ms" in cells[("causal_s8192_d128", "fwd", "torch_flex")]
    assert "ms" in cells[("causal_s8192_d128", "fwd", "sdpa_flash")]
    captured = capsys.readouterr()
    assert "warning: flexattn causal_s8192_d128 fwd failed" in captured.err
    assert captured.out.rstrip().endswith(report["markdown"].splitlines()[-1])
    assert "| causal_s8192_d128 | fwd | ERR |" in report["markdown"]


def test_merge_combines_parts(dry_run, tmp_path):
    out, report = dry_run
    part = json.loads((out / "latest.json").read_text())
    part["results"] = [r for r in part["results"] if r["mode"] == "fwd"]
    first = tmp_path / "a.json"
    first.write_text(json.dumps(part))
    rest = dict(part, cases=part["cases"][:1], results=[r for r in report["results"] if r["mode"] == "fwdbwd"])
    second = tmp_path / "b.json"
    second.write_text(json.dumps(rest))
    merged = bench.main(["--merge", str(first), str(second), "--out", str(tmp_path / "merged")])
    assert len(merged["results"]) == len(report["results"])
    assert merged["summary"]["geomean"]["fwd"] == pytest.approx(report["summary"]["geomean"]["fwd"])
    assert [m["file"] for m in merged["merged_from"]] == [str(first), str(second)]


def test_case_selection_and_modes():
    names = [c.name for c in bench.full_suite()]
    assert len(names) == len(set(names)) == 12
    assert all(c.S == 4096 for c in bench.quick_suite())
    args = bench.parse_args(["--quick"])
    assert bench.select_modes(args) == ["fwd"]
    assert [c.name for c in bench.select_cases(args)] == [c.name for c in bench.quick_suite()]
    with pytest.raises(SystemExit):
        bench.select_cases(bench.parse_args(["--cases", "no_such_case"]))
    with pytest.raises(SystemExit):
        bench.select_modes(bench.parse_args(["--mode", "bwd"]))
    parts = [[c.name for c in bench.select_cases(bench.parse_args(["--part", f"{k}/3"]))] for k in (1, 2, 3)]
    assert sum(parts, []) == names and all(len(part) in (3, 4) for part in parts)
    with pytest.raises(SystemExit):
        bench.select_cases(bench.parse_args(["--part", "4/3"]))


def test_plot_writes_a_png(dry_run, tmp_path):
    pytest.importorskip("matplotlib")
    out, _ = dry_run
    plot = load_bench("plot")
    png = plot.main([str(out / "latest.json"), "-o", str(tmp_path / "chart.png")])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_readme_performance_section_is_generated():
    report = load_bench("report")
    readme = (BENCH.parent / "README.md").read_text()
    assert report.current_section(readme) == report.render(), \
        "README.md's performance section is not what bench/report.py writes: run python bench/report.py"


def test_report_takes_the_newest_suite_file_per_gpu(dry_run, tmp_path):
    report = load_bench("report")
    out, _ = dry_run
    stem = next(p.stem for p in out.glob("attention-cpu-*.json"))
    older = json.loads((out / f"{stem}.json").read_text())
    older["results"] = [dict(r, tflops=1.0) for r in older["results"]]
    (tmp_path / "attention-cpu-20000101-000000.json").write_text(json.dumps(older))
    (tmp_path / f"{stem}.json").write_text((out / f"{stem}.json").read_text())
    (tmp_path / f"{stem}-part1of2.json").write_text(json.dumps(older))
    section = report.render(tmp_path)
    assert f"`{stem}.json`" in section and "20000101" not in section and "part1of2" not in section
    assert "| `causal_s8192_d128` |" in section and "Decoding" not in section
    readme = f"intro\n{report.START}\nold\n{report.END}\nrest\n"
    updated = report.with_section(readme, section)
    assert report.current_section(updated) == section and updated.endswith(f"{report.END}\nrest\n")


def test_tune_and_profiler_options_depend_on_the_kernel(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    tune = load_bench("tune")
    args = tune.parse_args(["--kernel", "backward", "--exhaustive", "--kv-heads", "4"])
    assert (args.seq, args.cases, args.tokens, args.exhaustive, args.kv_heads, args.top) == (4096, "causal", 16384,
                                                                                             True, 4, 3)
    assert (tune.parse_args(["--kernel", "forward"]).seq, tune.parse_args(["--kernel", "decode"]).top) == (8192, 4)
    with pytest.raises(SystemExit):
        tune.parse_args(["--kernel", "decode", "--seq", "4096"])
    configs = tune.attention_configs(tune.parse_args(["--kernel", "backward", "--configs", "64/64/64/64w8s2",
                                                      "--dq-atomic", "on"]), 128)
    assert configs == [("64/64/64/64 w8 s2", {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64,
                                              "bwd_BLOCK_N2": 64, "bwd_num_warps": 8, "bwd_num_stages": 2,
                                              "DQ_ATOMIC": True})]
    assert tune.attention_configs(tune.parse_args(["--kernel", "forward", "--configs", "128x64w4s2"]), 128) == [
        ("128x64 w4 s2", {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2})]
    profiler = load_bench("profiler")
    args = profiler.parse_args(["--kernel", "decode", "--options", "{}", "--options", '{"FUSED_MERGE": true}'])
    assert args.options == ["{}", '{"FUSED_MERGE": true}'] and args.page_size == 128 and args.cases is None
    assert profiler.parse_args(["--kernel", "attention"]).mode == "fwdbwd"
    with pytest.raises(SystemExit):
        profiler.parse_args(["--kernel", "attention", "--paged"])


def test_sinks_benchmark_dry_run(tmp_path, monkeypatch):
    """bench/bench_sinks.py runs and records every case, with and without sinks timed
    (torch's compiled flex has no lse or backward on a CPU: its cells hold the error)."""
    monkeypatch.syspath_prepend(str(BENCH))
    sinks = load_bench("bench_sinks")
    report = sinks.main(sinks.SINKS, ["--dry-run", "--rounds", "1", "--out", str(tmp_path)])
    saved = json.loads(next(tmp_path.glob("sinks-cpu-*.json")).read_text())
    assert saved["rows"] and saved["command"].startswith("python")
    for row in report["rows"]:
        assert row["median_ms"]["flexattn"] > 0 and row["median_ms"]["flexattn_sinks"] > 0, row
        assert row["sinks_over_plain"] > 0
        assert "torch_renorm" in row["median_ms"] or "torch_renorm" in row["errors"]


def test_learnable_bias_benchmark_dry_run(tmp_path, monkeypatch):
    """bench/bench_learnable_bias.py runs and records every bias, flexattn with the table
    trained and frozen (torch's compiled flex has no backward on a CPU: its cells hold the error)."""
    monkeypatch.syspath_prepend(str(BENCH))
    learnable = load_bench("bench_learnable_bias")
    report = learnable.main(learnable.LEARNABLE_BIAS, ["--dry-run", "--rounds", "1", "--out", str(tmp_path)])
    assert json.loads(next(tmp_path.glob("learnable-bias-cpu-*.json")).read_text())["rows"]
    assert [row["name"].split("_")[0] for row in report["rows"]] == ["rel", "slope", "key", "pair"]
    for row in report["rows"]:
        assert row["median_ms"]["flexattn"] > 0 and row["grad_over_frozen"] > 0, row
        assert "torch_flex" in row["median_ms"] or "torch_flex" in row["errors"]


def test_dropout_benchmark_dry_run(tmp_path, monkeypatch):
    """bench/bench_dropout.py runs and records every case: flexattn with and without
    dropout and SDPA with the same dropout_p and without, and their ratios."""
    monkeypatch.syspath_prepend(str(BENCH))
    dropout = load_bench("bench_dropout")
    report = dropout.main(dropout.DROPOUT, ["--dry-run", "--rounds", "1", "--out", str(tmp_path)])
    assert json.loads(next(tmp_path.glob("dropout-cpu-*.json")).read_text())["rows"]
    for row in report["rows"]:
        assert set(row["median_ms"]) == set(dropout.DROPOUT.impls), row
        assert row["dropout_over_plain"] > 0 and row["dropout_over_sdpa"] > 0 and row["sdpa_dropout_over_sdpa"] > 0


def test_peer_columns_are_opt_in(tmp_path):
    """--peers adds flexattn on its Triton template and torch's FLASH backend as columns
    (FLASH is noted as not run on the CPU); without it the run has the four impls."""
    report = bench.main(["--dry-run", "--cases", "causal_s8192_d128", "--mode", "fwd", "--peers", "template,flash",
                         "--out", str(tmp_path)])
    cells = _cells(report)
    assert cells[("causal_s8192_d128", "fwd", "flexattn_triton")]["tflops"] > 0
    assert "CUDA GPUs only" in cells[("causal_s8192_d128", "fwd", "torch_flash")]["note"]
    table = (tmp_path / "latest.md").read_text()
    assert "flexattn Triton" in table and "torch FLASH" in table and "flexattn/FLASH" in table
    with pytest.raises(SystemExit, match="--peers takes"):
        bench.main(["--dry-run", "--peers", "cudnn", "--out", str(tmp_path)])


def test_kvcache_step_dry_run_checks_the_fused_step_against_the_unfused(tmp_path):
    """bench/bench_kvcache_step.py on the CPU: every implementation timed, the fused
    step's output and caches equal to the unfused sequence's, files written."""
    step = load_bench("bench_kvcache_step")
    report = step.main(["--dry-run", "--rounds", "1", "--out", str(tmp_path)])
    (row,) = report["rows"]
    assert not row["errors"], row["errors"]
    assert set(row["median_us"]) == set(step.IMPLS)
    assert row["max_abs_diff_out"] < 1e-5 and row["max_abs_diff_k_cache"] < 1e-5 and row["v_caches_equal"]
    assert len(list(tmp_path.glob("kvcache-step-cpu-*.json"))) == 1
    assert "unfused/fused" in (next(tmp_path.glob("kvcache-step-cpu-*.md")).read_text())

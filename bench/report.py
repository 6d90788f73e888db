"""The top-level README's performance section, generated from the latest results.

    python bench/report.py            # rewrite README.md between the perf-table markers
    python bench/report.py --check    # exit 1 when README.md's section differs from what this writes

Attention: per GPU, the newest suite file ``attention-<gpu>-<date>-<time>.json`` (one run
or a merge of parts; parts, quick runs and other suffixed files are left out): per case,
flexattn's TFLOP/s beside torch flex's with their ratio, forward and forward+backward,
flexattn over SDPA cuDNN where cuDNN ran, and the geometric means, with links to the file
and its plot. Decode: per GPU and case without a mask (batch, KV length), the newest
reading among the ``decode-<gpu>-<date>-<time>.json`` files that timed both flexattn and
SDPA on CUDA graphs, as SDPA's time over flexattn's, each cell marked with its file.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "bench" / "results"
README = REPO / "README.md"
START = "<!-- perf-table:start -->"
END = "<!-- perf-table:end -->"
#: A suite result's name: kind, GPU slug, date and time; nothing after it.
RESULT_NAME = re.compile(r"(?P<kind>attention|decode)-(?P<gpu>.+)-(?P<stamp>\d{8}-\d{6})\.json")
MODES = ("fwd", "fwdbwd")


def result_files(results_dir: Path, kind: str) -> dict[str, list[Path]]:
    """GPU slug -> the ``kind`` suite's result files of that GPU, oldest first."""
    found: dict[str, list[tuple[str, Path]]] = {}
    for path in results_dir.iterdir():
        match = RESULT_NAME.fullmatch(path.name)
        if match and match["kind"] == kind:
            found.setdefault(match["gpu"], []).append((match["stamp"], path))
    return {gpu: [path for _, path in sorted(files)] for gpu, files in sorted(found.items())}


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours and theirs else None


def attention_table(path: Path, link: str) -> list[str]:
    """The attention section of one result file (``link``: the path the README links)."""
    report = json.loads(path.read_text())
    cells = {(r["case"], r["mode"], r["impl"]): r.get("tflops") for r in report["results"]}
    settings = report["settings"]
    plot = path.with_suffix(".png")
    plot_link = f", [plot]({link}/{plot.name})" if plot.exists() else ""
    lines = [f"Attention on one {report['gpu']} (torch {report['torch']}, triton {report['triton']}, "
             f"{settings['dtype']}; B=4, H=16 unless the case says otherwise): TFLOP/s over the unmasked "
             f"entries, flexattn / torch's compiled flex_attention (ratio), and flexattn's speed over SDPA "
             f"cuDNN's where that runs ([`{path.name}`]({link}/{path.name}){plot_link}).", "",
             "| case | fwd flexattn / torch flex | fwd+bwd flexattn / torch flex | fwd / cuDNN | fwd+bwd / cuDNN |",
             "| --- | --- | --- | --- | --- |"]
    for case in (info["name"] for info in report["cases"]):
        row = [f"`{case}`"]
        for mode in MODES:
            ours, theirs = cells.get((case, mode, "flexattn")), cells.get((case, mode, "torch_flex"))
            ratio = _ratio(ours, theirs)
            row.append(f"{ours:.0f} / {theirs:.0f} ({ratio:.2f}x)" if ratio else "")
        for mode in MODES:
            ratio = _ratio(cells.get((case, mode, "flexattn")), cells.get((case, mode, "sdpa_cudnn")))
            row.append(f"{ratio:.2f}x" if ratio else "")
        lines.append("| " + " | ".join(row) + " |")
    summary = report["summary"]
    means = [f"{summary['geomean'][mode]:.2f}x" if mode in summary["geomean"] else "" for mode in MODES]
    count = max(summary["geomean_count"].get(mode, 0) for mode in MODES)
    lines.append(f"| geometric mean, {count} cases | {means[0]} | {means[1]} | | |")
    return lines


def decode_readings(paths: list[Path]) -> dict[tuple[int, int], tuple[float, Path]]:
    """(B, KV) -> (SDPA's graph time over flexattn's, file) of the cases without a mask,
    the newest file's reading where several have one."""
    readings: dict[tuple[int, int], tuple[float, Path]] = {}
    for path in paths:
        by_case: dict[str, dict[str, dict]] = {}
        for record in json.loads(path.read_text())["results"]:
            if record.get("window") is None and "error" not in record:
                by_case.setdefault(record["case"], {})[record["impl"]] = record
        for impls in by_case.values():
            ratio = _ratio(impls.get("sdpa", {}).get("ms_graph"), impls.get("flexattn", {}).get("ms_graph"))
            if ratio:
                record = impls["flexattn"]
                readings[(record["B"], record["S"])] = (ratio, path)
    return readings


def decode_table(paths: list[Path], link: str) -> list[str]:
    """The decode section of one GPU's result files (oldest first)."""
    readings = decode_readings(paths)
    if not readings:
        return []
    gpu = json.loads(paths[-1].read_text())["gpu"]
    sources = sorted({path for _, path in readings.values()}, key=lambda path: path.name)
    marks = {path: chr(ord("a") + index) for index, path in enumerate(sources)}
    batches = sorted({b for b, _ in readings})
    lengths = sorted({s for _, s in readings})
    lines = [f"Decoding one token against a KV cache on one {gpu} (32 query heads on 8 KV heads, D=128, bf16, "
             "no mask): SDPA's CUDA-graph time over flexattn's (> 1: flexattn faster), the newest reading of "
             "each case, marked with its file.", "",
             "| B | " + " | ".join(f"KV {s}" for s in lengths) + " |",
             "| --- |" + " --- |" * len(lengths)]
    for b in batches:
        row = [str(b)]
        for s in lengths:
            ratio, path = readings.get((b, s), (None, None))
            row.append(f"{ratio:.3f}x ({marks[path]})" if ratio else "")
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "; ".join(f"({marks[path]}) [`{path.name}`]({link}/{path.name})" for path in sources) + "."]
    return lines


def render(results_dir: Path = RESULTS_DIR, link: str = "bench/results") -> str:
    """The section between the markers (markers excluded), from ``results_dir``."""
    lines = ["<!-- generated by bench/report.py from bench/results: run it again, do not edit by hand -->", ""]
    for paths in result_files(results_dir, "attention").values():
        lines += attention_table(paths[-1], link) + [""]
    for paths in result_files(results_dir, "decode").values():
        table = decode_table(paths, link)
        lines += table + [""] if table else []
    lines.append("How these are measured, the commands and the other suites: [bench/README.md](bench/README.md); "
                 "why each kernel default is what it is: [bench/DECISIONS.md](bench/DECISIONS.md).")
    return "\n".join(lines) + "\n"


def current_section(text: str) -> str:
    """What ``text`` holds between the markers."""
    start, end = text.index(START) + len(START), text.index(END)
    return text[start:end].lstrip("\n")


def with_section(text: str, section: str) -> str:
    """``text`` with ``section`` between the markers."""
    start, end = text.index(START) + len(START), text.index(END)
    return text[:start] + "\n" + section + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when README.md is stale")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    parser.add_argument("--readme", type=Path, default=README)
    args = parser.parse_args(argv)
    text = args.readme.read_text()
    section = render(args.results)
    if args.check:
        stale = current_section(text) != section
        print(f"{args.readme}: performance section {'stale: run python bench/report.py' if stale else 'up to date'}")
        return int(stale)
    args.readme.write_text(with_section(text, section))
    print(f"wrote the performance section of {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

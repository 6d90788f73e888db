"""Bar chart of a bench_attention.py result file: TFLOP/s per case, one bar per impl.

One panel per mode (fwd, fwdbwd); a cell that failed or does not exist has no bar
(failures are marked with an x at the foot of their slot). The title names the GPU, the
torch and triton versions and the geometric mean of flexattn / torch flex.

    python bench/plot.py                                   # bench/results/latest.json
    python bench/plot.py bench/results/attention-nvidia-h100-...json -o chart.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
IMPLS = ("flexattn", "torch_flex", "sdpa_flash", "sdpa_cudnn")
LABELS = {"flexattn": "flexattn", "torch_flex": "torch flex", "sdpa_flash": "SDPA flash", "sdpa_cudnn": "SDPA cuDNN"}
MODE_TITLES = {"fwd": "forward", "fwdbwd": "forward + backward"}


def plot(report: dict, out_path: Path) -> Path:
    """Draw the TFLOP/s of every (case, impl) of ``report`` into a PNG at ``out_path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = {(r["case"], r["mode"], r["impl"]): r for r in report["results"]}
    cases = [info["name"] for info in report["cases"]]
    modes = [m for m in MODE_TITLES if any(r["mode"] == m for r in report["results"])]
    width = 0.8 / len(IMPLS)
    figure, axes = plt.subplots(
        len(modes), 1, figsize=(max(8.0, 1.1 * len(cases) + 2), 4.2 * len(modes)), squeeze=False
    )
    geomean = report.get("summary", {}).get("geomean", {})
    for axis, mode in zip(axes[:, 0], modes):
        for index, impl in enumerate(IMPLS):
            offsets = [c + (index - (len(IMPLS) - 1) / 2) * width for c in range(len(cases))]
            values = [cells.get((case, mode, impl), {}).get("tflops") or 0.0 for case in cases]
            axis.bar(offsets, values, width, label=LABELS[impl])
            failed = [x for x, case in zip(offsets, cases) if "error" in cells.get((case, mode, impl), {})]
            axis.plot(failed, [0.0] * len(failed), "x", color="red", markersize=6)
        ratio = geomean.get(mode)
        suffix = f" (geomean flexattn/torch flex {ratio:.2f}x)" if ratio else ""
        axis.set_title(MODE_TITLES[mode] + suffix, fontsize=10)
        axis.set_ylabel("TFLOP/s")
        axis.set_xticks(range(len(cases)))
        axis.set_xticklabels(cases, rotation=30, ha="right", fontsize=8)
        axis.grid(axis="y", alpha=0.3)
        axis.legend(fontsize=8, ncol=len(IMPLS))
    figure.suptitle(
        f"{report['gpu']}: torch {report['torch']}, triton {report['triton']}, {report['settings']['dtype']} "
        f"({report['date']})",
        fontsize=11,
    )
    figure.tight_layout()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out_path, dpi=120)
    plt.close(figure)
    return out_path


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description="Bar chart of a bench_attention.py result file.")
    parser.add_argument("results", nargs="?", type=Path, default=RESULTS_DIR / "latest.json")
    parser.add_argument("-o", "--output", type=Path, help="PNG path (default: beside the JSON, same name)")
    args = parser.parse_args(argv)
    report = json.loads(args.results.read_text())
    out_path = plot(report, args.output or args.results.with_suffix(".png"))
    print(f"wrote {out_path}")
    return out_path


if __name__ == "__main__":
    main()

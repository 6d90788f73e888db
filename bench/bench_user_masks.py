"""Benchmark: masks written the way users write them, flexattn beside torch's flex and FLASH.

The attention suite (bench_attention.py) builds its masks with flexattn's own factories.
This suite writes them as public collections and user code do: document masks from an
offsets table through chained gathers and from document ids, 2-D neighbourhoods in
row-major, tiled and Morton token orders (coordinates by arithmetic or from captured
tables), a 3-D video neighbourhood, dilated and bidirectional sliding windows, text
queries attending to their image's span (Q_LEN != KV_LEN), causal attention within
fixed-size chunks, spatial and temporal heads of a video model, and a prefix-LM with a
prompt length per sequence. Each formulation runs plain and with a score_mod on top
(ALiBi or a soft-cap, written inline), at two shapes (B=4 H=16 S=8192 and B=2 H=8
S=4096) and D=64 and 128, in three modes: ``fwd`` (no grad), ``fwd_grad`` (inputs that
require grad, forward only: the call a training step makes first) and ``fwdbwd``.

For every cell and implementation (``flexattn``; ``torch_flex``, torch's compiled
flex_attention; ``torch_flash``, torch's flex with ``BACKEND="FLASH"`` where it runs; on
request ``flexattn_triton``, flexattn with its Triton template forced, to judge the kernel
choice) it records

* ``kernel_us``: GPU kernel time per call, the sum over the call's kernels from
  torch.profiler (``profiler.kernel_table``);
* ``wall_us``: wall time per call, back-to-back calls between two host clock readings
  with a synchronize at the end (what a host-bound small call costs a user);
* ``max_abs_err``: flexattn's output (and gradients) against torch's flex.

and per case what flexattn's BlockMask lists per query block (``partial_per_row``,
``full_per_row``, ``walk_keys``): what a kernel choice by mask would read.

Times are the median of ``--rounds`` rounds taken in turn over the implementations.

    python bench/bench_user_masks.py                                   # everything (long: use parts)
    python bench/bench_user_masks.py --part 1/8 --out "$OUT"            # one eighth of the cases
    python bench/bench_user_masks.py --formulations doc_offsets_causal --shapes b4h16s8192 --head-dims 128
    python bench/bench_user_masks.py --impls torch_flex,flexattn,flexattn_triton --head-dims 128 --mode fwd
    python bench/bench_user_masks.py --merge part1.json part2.json      # one result file from parts
    python bench/bench_user_masks.py --dry-run                         # CPU, tiny shapes, seconds
    python bench/bench_user_masks.py --list
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import faulthandler
import json
import math
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import flex_attention as torch_flex

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
if str(REPO / "bench") not in sys.path:
    sys.path.insert(0, str(REPO / "bench"))

import bench_attention as ba  # noqa: E402
import flexattn  # noqa: E402

RESULTS_DIR = REPO / "bench" / "results"
IMPLS = ("torch_flex", "flexattn", "torch_flash", "flexattn_triton", "flexattn_gluon_bwd")
#: What a run measures unless --impls says otherwise; ``flexattn_triton`` (flexattn's
#: Triton template forced, BACKEND="TRITON") and ``flexattn_gluon_bwd`` (the Gluon backward
#: forced, BWD_BACKEND="GLUON") are on request, beside the default plan's kernels where a
#: kernel choice is in question.
DEFAULT_IMPLS = ("torch_flex", "flexattn", "torch_flash")
IMPL_OPTIONS = {"torch_flash": {"BACKEND": "FLASH"}, "flexattn_triton": {"BACKEND": "TRITON"},
                "flexattn_gluon_bwd": {"BWD_BACKEND": "GLUON"}}
MODES = ("fwd", "fwd_grad", "fwdbwd")
#: Calls per back-to-back wall-time batch.
WALL_CALLS = 20
#: The threshold under which a call counts as small: its wall time is judged there.
SMALL_CALL_US = 100.0
ERROR_FLAG = 2e-2
SEED = 0


# --------------------------------------------------------------------------------------
# Shapes and formulations
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Shape:
    B: int
    H: int
    S: int

    @property
    def name(self) -> str:
        return f"b{self.B}h{self.H}s{self.S}"


SHAPES = (Shape(4, 16, 8192), Shape(2, 8, 4096))
HEAD_DIMS = (64, 128)
DRY_SHAPE = Shape(1, 2, 256)


@dataclasses.dataclass(frozen=True)
class Built:
    """A formulation made concrete for a shape: its mask_mod, lengths, and whether the
    mask reads b or h (otherwise its BlockMask is built once for all, as users build it)."""

    mask_mod: Callable
    q_len: int
    kv_len: int
    reads_b: bool = False
    reads_h: bool = False


@dataclasses.dataclass(frozen=True)
class Formulation:
    name: str
    #: (shape, device) -> Built; captured tensors are made on the device, seeded.
    build: Callable[[Shape, torch.device], Built]
    #: The score_mod of the variant with one on top: "alibi" or "softcap".
    on_top: str


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(SEED)


def random_lengths(total: int, parts: int) -> list[int]:
    """``parts`` seeded random positive lengths summing to ``total``."""
    cuts = torch.randperm(total - 1, generator=_generator())[: parts - 1] + 1
    bounds = [0, *torch.sort(cuts).values.tolist(), total]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def _doc_tables(S: int, device: torch.device, docs: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """(document id per token, offsets: each document's first token, then S)."""
    lengths = random_lengths(S, docs)
    doc = torch.repeat_interleave(torch.arange(docs), torch.tensor(lengths)).to(device)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]).to(device)
    return doc, offsets


def doc_offsets_causal(shape: Shape, device: torch.device) -> Built:
    doc, offsets = _doc_tables(shape.S, device)

    def mask_mod(b, h, q_idx, kv_idx):
        same = doc[q_idx] == doc[kv_idx]
        return same & (q_idx - offsets[doc[q_idx]] >= kv_idx - offsets[doc[kv_idx]])

    return Built(mask_mod, shape.S, shape.S)


def doc_offsets_bounds(shape: Shape, device: torch.device) -> Built:
    doc, offsets = _doc_tables(shape.S, device)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx >= offsets[doc[q_idx]]) & (kv_idx < offsets[doc[q_idx] + 1])

    return Built(mask_mod, shape.S, shape.S)


def doc_ids_causal(shape: Shape, device: torch.device) -> Built:
    doc, _ = _doc_tables(shape.S, device)

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    return Built(mask_mod, shape.S, shape.S)


def doc_search_causal(shape: Shape, device: torch.device) -> Built:
    """The documents found by searching their start offsets (no per-token table)."""
    _, offsets = _doc_tables(shape.S, device)
    starts = offsets[:-1].contiguous()

    def mask_mod(b, h, q_idx, kv_idx):
        same = torch.searchsorted(starts, q_idx, right=True) == torch.searchsorted(starts, kv_idx, right=True)
        return same & (q_idx >= kv_idx)

    return Built(mask_mod, shape.S, shape.S)


def doc_ids(shape: Shape, device: torch.device) -> Built:
    doc, _ = _doc_tables(shape.S, device)

    def mask_mod(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    return Built(mask_mod, shape.S, shape.S)


def _canvas(S: int) -> int:
    """The side of the square canvas the tokens fill (90 for 8192, 64 for 4096)."""
    return math.isqrt(S)


#: Half the side of the 2-D neighbourhood (13x13) and of the 3-D one's frame window (7x7).
RADIUS_2D, RADIUS_3D = 6, 3


def neighbourhood_2d(shape: Shape, device: torch.device) -> Built:
    W = _canvas(shape.S)

    def mask_mod(b, h, q_idx, kv_idx):
        rows = (q_idx // W - kv_idx // W).abs() <= RADIUS_2D
        return rows & ((q_idx % W - kv_idx % W).abs() <= RADIUS_2D)

    return Built(mask_mod, shape.S, shape.S)


def canvas_coordinates(S: int, order: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of each token position on the canvas, tokens laid out in ``order``:
    "tiled" (8x8 tiles, row-major inside and across tiles) or "morton" (Z-order over the
    smallest power-of-two square holding the canvas, off-canvas cells skipped); tokens
    past the canvas continue on rows below it."""
    W = _canvas(S)
    cells = [(r, c) for r in range(W) for c in range(W)]
    if order == "tiled":
        cells.sort(key=lambda rc: (rc[0] // 8, rc[1] // 8, rc[0] % 8, rc[1] % 8))
    elif order == "morton":
        def z(rc):
            key = 0
            for bit in range(W.bit_length()):
                key |= ((rc[1] >> bit) & 1) << (2 * bit) | ((rc[0] >> bit) & 1) << (2 * bit + 1)
            return key

        cells.sort(key=z)
    else:
        raise ValueError(f"order must be 'tiled' or 'morton', got {order!r}")
    cells += [(W + (i // W), i % W) for i in range(S - W * W)]
    rows, cols = zip(*cells)
    return torch.tensor(rows), torch.tensor(cols)


def _neighbourhood_2d_table(order: str):
    def build(shape: Shape, device: torch.device) -> Built:
        rows, cols = (t.to(device) for t in canvas_coordinates(shape.S, order))

        def mask_mod(b, h, q_idx, kv_idx):
            near_rows = (rows[q_idx] - rows[kv_idx]).abs() <= RADIUS_2D
            return near_rows & ((cols[q_idx] - cols[kv_idx]).abs() <= RADIUS_2D)

        return Built(mask_mod, shape.S, shape.S)

    return build


def neighbourhood_3d(shape: Shape, device: torch.device) -> Built:
    """Video tokens frame by frame, 32x32 cells a frame: neighbours at most one frame and
    RADIUS_3D cells (rows and columns) away."""
    F = 32 * 32

    def mask_mod(b, h, q_idx, kv_idx):
        near_t = (q_idx // F - kv_idx // F).abs() <= 1
        q_cell, kv_cell = q_idx % F, kv_idx % F
        near_y = (q_cell // 32 - kv_cell // 32).abs() <= RADIUS_3D
        return near_t & near_y & ((q_cell % 32 - kv_cell % 32).abs() <= RADIUS_3D)

    return Built(mask_mod, shape.S, shape.S)


def dilated_window(shape: Shape, device: torch.device) -> Built:
    """Causal, every second token of the last 1024 (a window of 512 keys)."""
    def mask_mod(b, h, q_idx, kv_idx):
        distance = q_idx - kv_idx
        return (distance >= 0) & (distance < 1024) & (distance % 2 == 0)

    return Built(mask_mod, shape.S, shape.S)


def sliding_window_abs(shape: Shape, device: torch.device) -> Built:
    """Bidirectional window written with abs: 512 tokens either side."""
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= 512

    return Built(mask_mod, shape.S, shape.S)


def text_to_image(shape: Shape, device: torch.device) -> Built:
    """S/4 text queries over S image keys: 8 captions of random lengths, each attending
    to its image's span (images of random lengths)."""
    L = shape.S // 4
    text = torch.repeat_interleave(torch.arange(8), torch.tensor(random_lengths(L, 8))).to(device)
    image = torch.repeat_interleave(torch.arange(8), torch.tensor(random_lengths(shape.S, 8)[::-1])).to(device)

    def mask_mod(b, h, q_idx, kv_idx):
        return text[q_idx] == image[kv_idx]

    return Built(mask_mod, L, shape.S)


def chunked_causal(shape: Shape, device: torch.device) -> Built:
    """Causal within each chunk of 1024 tokens (the same mask repeated per chunk)."""
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx // 1024 == kv_idx // 1024) & (q_idx >= kv_idx)

    return Built(mask_mod, shape.S, shape.S)


def video_heads(shape: Shape, device: torch.device) -> Built:
    """Frames of 1024 tokens; the first half of the heads attend within their frame
    (spatial), the others to the same cell of every frame (temporal)."""
    F, half = 1024, shape.H // 2

    def mask_mod(b, h, q_idx, kv_idx):
        spatial = q_idx // F == kv_idx // F
        temporal = q_idx % F == kv_idx % F
        return torch.where(h < half, spatial, temporal)

    return Built(mask_mod, shape.S, shape.S, reads_h=True)


def prefix_lm_per_sequence(shape: Shape, device: torch.device) -> Built:
    """Each sequence's prompt (a random length up to S/2) bidirectional, causal after."""
    prompt = (torch.rand(shape.B, generator=_generator()) * shape.S / 2).long().to(device)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < prompt[b]) | (q_idx >= kv_idx)

    return Built(mask_mod, shape.S, shape.S, reads_b=True)


FORMULATIONS = {f.name: f for f in (
    Formulation("doc_offsets_causal", doc_offsets_causal, "alibi"),
    Formulation("doc_offsets_bounds", doc_offsets_bounds, "softcap"),
    Formulation("doc_ids_causal", doc_ids_causal, "alibi"),
    Formulation("doc_ids", doc_ids, "softcap"),
    Formulation("doc_search_causal", doc_search_causal, "softcap"),
    Formulation("neighbourhood_2d", neighbourhood_2d, "alibi"),
    Formulation("neighbourhood_2d_tiled", _neighbourhood_2d_table("tiled"), "softcap"),
    Formulation("neighbourhood_2d_morton", _neighbourhood_2d_table("morton"), "alibi"),
    Formulation("neighbourhood_3d", neighbourhood_3d, "softcap"),
    Formulation("dilated_window", dilated_window, "alibi"),
    Formulation("sliding_window_abs", sliding_window_abs, "softcap"),
    Formulation("text_to_image", text_to_image, "softcap"),
    Formulation("chunked_causal", chunked_causal, "alibi"),
    Formulation("video_heads", video_heads, "softcap"),
    Formulation("prefix_lm_per_sequence", prefix_lm_per_sequence, "alibi"),
)}


def score_mod_on_top(kind: str, H: int, device: torch.device) -> Callable:
    """ALiBi with the standard slopes, or a soft-cap at 30, written inline."""
    if kind == "alibi":
        slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / H) for i in range(H)], device=device)

        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)

        return alibi

    def softcap(score, b, h, q_idx, kv_idx):
        return 30.0 * torch.tanh(score / 30.0)

    return softcap


@dataclasses.dataclass(frozen=True)
class Case:
    formulation: str
    on_top: str | None
    shape: Shape
    D: int

    @property
    def name(self) -> str:
        top = f"+{self.on_top}" if self.on_top else ""
        return f"{self.formulation}{top}_{self.shape.name}_d{self.D}"


def all_cases(formulations=None, shapes=SHAPES, head_dims=HEAD_DIMS, tops=(False, True)) -> list[Case]:
    names = formulations or list(FORMULATIONS)
    return [Case(name, FORMULATIONS[name].on_top if top else None, shape, D)
            for shape in shapes for D in head_dims for name in names for top in tops]


# --------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------
def kernel_us(step: Callable, grads: list[torch.Tensor], device: torch.device) -> float | None:
    """GPU kernel time per call (µs): the call's kernels summed (profiler.kernel_table);
    None for a call on the CPU, on a machine with a GPU too."""
    if device.type != "cuda":
        return None
    import profiler

    return sum(us for _name, us, _launches in profiler.kernel_table(step, grads))


def wall_us(step: Callable, grads: list[torch.Tensor], device: torch.device, calls: int = WALL_CALLS) -> float:
    """Wall time per call (µs): ``calls`` back-to-back calls and one synchronize, median of 3."""
    batches = []
    for _ in range(3):
        ba.synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            step()
            for t in grads:
                t.grad = None
        ba.synchronize(device)
        batches.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(batches)


# --------------------------------------------------------------------------------------
# Running a case
# --------------------------------------------------------------------------------------
@dataclasses.dataclass
class Settings:
    device: torch.device
    dtype: torch.dtype
    compile_backend: str
    modes: tuple[str, ...]
    rounds: int
    impls: tuple[str, ...]
    wall_calls: int = WALL_CALLS


def _call(impl: str, score_mod, masks: dict, inputs, settings: Settings) -> Callable:
    ours = impl.startswith("flexattn")
    library = flexattn if ours else torch_flex
    compiled = torch.compile(library.flex_attention, fullgraph=True, dynamic=False, backend=settings.compile_backend)
    block_mask = masks["flexattn" if ours else "torch"]
    options = IMPL_OPTIONS.get(impl)
    q, k, v = inputs

    def call():
        return compiled(q, k, v, score_mod=score_mod, block_mask=block_mask, kernel_options=options)

    return call


def _inputs(case: Case, built: Built, settings: Settings, requires_grad: bool):
    gen = torch.Generator(device=settings.device).manual_seed(SEED)

    def randn(length):
        return torch.randn(case.shape.B, case.shape.H, length, case.D, generator=gen, device=settings.device,
                           dtype=settings.dtype).requires_grad_(requires_grad)

    q, k, v = randn(built.q_len), randn(built.kv_len), randn(built.kv_len)
    return (q, k, v), torch.randn(q.shape, generator=gen, device=settings.device, dtype=settings.dtype)


_STARTED = time.perf_counter()


def _progress(case: Case, what: str) -> None:
    print(f"[{time.perf_counter() - _STARTED:7.1f} s] {case.name}: {what}", file=sys.stderr, flush=True)


def listing(block_mask) -> dict[str, float]:
    """What the BlockMask lists per query block, on average: partial and full KV blocks,
    and the keys a program walks (``walk_keys``), the quantities a kernel choice by mask
    would read."""
    partial = block_mask.kv_num_blocks.float().mean().item()
    full = 0.0 if block_mask.full_kv_num_blocks is None else block_mask.full_kv_num_blocks.float().mean().item()
    return {"partial_per_row": partial, "full_per_row": full,
            "walk_keys": (partial + full) * block_mask.BLOCK_SIZE[1]}


def run_case(case: Case, settings: Settings) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Every impl and mode of one case; never raises (a failure becomes the cell's ``error``)."""
    device = settings.device
    info: dict[str, Any] = {"name": case.name, "formulation": case.formulation, "on_top": case.on_top,
                            **dataclasses.asdict(case.shape), "D": case.D}
    try:
        built = FORMULATIONS[case.formulation].build(case.shape, device)
        score_mod = score_mod_on_top(case.on_top, case.shape.H, device) if case.on_top else None
        B = case.shape.B if built.reads_b else None
        H = case.shape.H if built.reads_h else None
        masks = {"flexattn": flexattn.create_block_mask(built.mask_mod, B, H, built.q_len, built.kv_len, device=device),
                 "torch": torch_flex.create_block_mask(built.mask_mod, B, H, built.q_len, built.kv_len, device=device)}
        _progress(case, "block masks built")
    except Exception as error:  # noqa: BLE001 - a case that cannot be built is recorded
        info["error"] = ba.error_text(error)[:400]
        return info, [{"case": case.name, "mode": m, "impl": i, "error": info["error"]}
                      for m in settings.modes for i in settings.impls]
    info.update(q_len=built.q_len, kv_len=built.kv_len, block_density=ba.block_density(masks["torch"]),
                **listing(masks["flexattn"]))
    cells = []
    for mode in settings.modes:
        torch._dynamo.reset()
        inputs, grad_out = _inputs(case, built, settings, mode != "fwd")
        grads = list(inputs) if mode == "fwdbwd" else []
        records: dict[str, dict[str, Any]] = {}
        steps: dict[str, Callable] = {}
        reference = None
        for impl in settings.impls:
            record = records[impl] = {"case": case.name, "mode": mode, "impl": impl}
            if impl == "torch_flash" and device.type != "cuda":
                record["note"] = "torch's FLASH backend runs on CUDA GPUs only"
                continue
            if impl == "torch_flex" and mode != "fwd" and device.type != "cuda":
                record["note"] = "torch's flex_attention takes no inputs that require grad on CPU"
                continue
            forward = _call(impl, score_mod, masks, inputs, settings)

            def step(forward=forward):
                out = forward()
                if mode == "fwdbwd":
                    out.backward(grad_out)
                return out

            try:
                start = time.perf_counter()
                out = step()
                ba.synchronize(device)
                record["compile_s"] = time.perf_counter() - start
                _progress(case, f"{mode} {impl} first call {record['compile_s']:.1f} s")
                results = [out.detach().float()] + [t.grad.detach().float() for t in grads]
            except Exception as error:  # noqa: BLE001 - every failure becomes a cell
                record["error"] = ba.error_text(error)[:400]
                print(f"warning: {impl} {case.name} {mode} failed: {record['error'][:160]}", file=sys.stderr,
                      flush=True)
                continue
            finally:
                for t in grads:
                    t.grad = None
            if impl == "torch_flex":
                reference = results
            elif reference is not None:
                record["max_abs_err"] = max(float((a - b).abs().max()) for a, b in zip(results, reference))
                record["err_flag"] = bool(not record["max_abs_err"] <= ERROR_FLAG)
            steps[impl] = step
            record.update(kernel_us_rounds=[], wall_us_rounds=[])
        names = list(steps)
        for round_index in range(settings.rounds):
            shift = round_index % max(len(names), 1)
            for impl in names[shift:] + names[:shift]:
                try:
                    records[impl]["kernel_us_rounds"].append(kernel_us(steps[impl], grads, device))
                    records[impl]["wall_us_rounds"].append(wall_us(steps[impl], grads, device, settings.wall_calls))
                except Exception as error:  # noqa: BLE001
                    records[impl]["error"] = ba.error_text(error)[:400]
                    names.remove(impl)
        _progress(case, f"{mode} timed")
        for impl in names:
            rounds = records[impl]
            kernels = [x for x in rounds.pop("kernel_us_rounds") if x is not None]
            rounds["kernel_us"] = statistics.median(kernels) if kernels else None
            rounds["wall_us"] = statistics.median(rounds.pop("wall_us_rounds"))
        cells.extend(records.values())
        del steps, inputs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return info, cells


# --------------------------------------------------------------------------------------
# Summary and output
# --------------------------------------------------------------------------------------
def _geomean(values: list[float]) -> float | None:
    return math.exp(sum(math.log(x) for x in values) / len(values)) if values else None


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode: torch's time over flexattn's (> 1: flexattn faster), kernel and wall; the
    wall ratios only of calls whose flexattn kernels take under SMALL_CALL_US."""
    by_key = {(r["case"], r["mode"], r["impl"]): r for r in results}
    summary: dict[str, Any] = {}
    for mode in MODES:
        kernel, wall, behind = [], [], []
        for (case, m, impl), fa in by_key.items():
            tf = by_key.get((case, m, "torch_flex"), {})
            if m != mode or impl != "flexattn" or not fa.get("wall_us") or not tf.get("wall_us"):
                continue
            if fa.get("kernel_us") and tf.get("kernel_us"):
                ratio = tf["kernel_us"] / fa["kernel_us"]
                kernel.append(ratio)
                if ratio < 1:
                    behind.append(case)
                if fa["kernel_us"] < SMALL_CALL_US:
                    wall.append(tf["wall_us"] / fa["wall_us"])
            elif fa.get("kernel_us") is None:
                wall.append(tf["wall_us"] / fa["wall_us"])
        if kernel or wall:
            summary[mode] = {"kernel_geomean": _geomean(kernel), "kernel_cases": len(kernel),
                             "kernel_behind": behind, "small_wall_geomean": _geomean(wall),
                             "small_wall_cases": len(wall),
                             "small_wall_behind": sum(x < 1 for x in wall)}
    return summary


def _fmt(value: float | None, digits: str = ".0f") -> str:
    return "-" if value is None else format(value, digits)


def markdown(report: dict[str, Any]) -> str:
    by_key = {(r["case"], r["mode"], r["impl"]): r for r in report["results"]}
    dry = " (DRY RUN: tiny shapes, timings meaningless)" if report["settings"]["dry_run"] else ""
    lines = [f"Masks as users write them on {report['gpu']} (torch {report['torch']}, triton {report['triton']}), "
             f"{report['settings']['dtype']}: kernel and wall µs per call, flexattn / torch flex (torch's time over "
             f"flexattn's), median of {report['settings']['rounds']} rounds in turn{dry}", "",
             "| case | walk keys (partial %) | mode | kernel fa / tf | ratio | wall fa / tf | ratio | FLASH kernel "
             "| fa Triton kernel | max err |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for info in report["cases"]:
        for mode in MODES:
            fa = by_key.get((info["name"], mode, "flexattn"))
            if fa is None:
                continue
            tf = by_key.get((info["name"], mode, "torch_flex"), {})
            fl = by_key.get((info["name"], mode, "torch_flash"), {})
            ft = by_key.get((info["name"], mode, "flexattn_triton"), {})
            listed = info.get("partial_per_row", 0.0) + info.get("full_per_row", 0.0)
            walk = (f"{info['walk_keys']:.0f} ({100 * info['partial_per_row'] / listed:.0f}%)"
                    if "walk_keys" in info and listed else "-")

            def ratio(key):
                return _fmt(tf[key] / fa[key], ".2f") if fa.get(key) and tf.get(key) else "-"

            def cell(record, key):
                return "ERR" if "error" in record else "n/a" if "note" in record else _fmt(record.get(key))

            err = fa.get("max_abs_err")
            lines.append(f"| {info['name']} | {walk} | {mode} | {cell(fa, 'kernel_us')} / {cell(tf, 'kernel_us')} | "
                         f"{ratio('kernel_us')} | {cell(fa, 'wall_us')} / {cell(tf, 'wall_us')} | {ratio('wall_us')} | "
                         f"{cell(fl, 'kernel_us') if fl else '-'} | {cell(ft, 'kernel_us') if ft else '-'} | "
                         f"{'-' if err is None else format(err, '.1e') + (' !' if fa.get('err_flag') else '')} |")
    lines.append("")
    for mode, s in report["summary"].items():
        lines.append(f"{mode}: kernel geomean {_fmt(s['kernel_geomean'], '.2f')} over {s['kernel_cases']} cases, "
                     f"{len(s['kernel_behind'])} behind; wall of calls under {SMALL_CALL_US:.0f} µs of kernels: "
                     f"geomean {_fmt(s['small_wall_geomean'], '.2f')} over {s['small_wall_cases']}, "
                     f"{s['small_wall_behind']} behind")
    errors = [f"- ERR {r['impl']} {r['case']} {r['mode']}: {r['error'][:200]}" for r in report["results"] if "error" in r]
    return "\n".join(lines + ([""] + errors if errors else []))


def write(report: dict[str, Any], out_dir: Path, stem: str) -> Path:
    report["summary"] = summarize(report["results"])
    report["markdown"] = markdown(report)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    path.with_suffix(".md").write_text(report["markdown"] + f"\n\nCommand: `{report['command']}`\n")
    return path


def merge(paths: list[Path], out_dir: Path, command: str) -> Path:
    """One result file from parts of one GPU: cases and results concatenated."""
    parts = [json.loads(p.read_text()) for p in paths]
    gpus = {p["gpu"] for p in parts}
    if len(gpus) != 1:
        raise SystemExit(f"--merge takes parts of one GPU, got {sorted(gpus)}")
    report = {**parts[0], "command": command, "merged_from": [p.name for p in paths],
              "cases": [c for p in parts for c in p["cases"]], "results": [r for p in parts for r in p["results"]]}
    stem = paths[0].stem.rsplit("-part", 1)[0]
    return write(report, out_dir, stem)


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------
def _names(text: str | None, known, what: str) -> list[str] | None:
    if not text:
        return None
    names = text.split(",")
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise SystemExit(f"--{what} takes {sorted(known)}, got {unknown}")
    return names


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formulations", help="comma-separated formulation names (default: all)")
    parser.add_argument("--shapes", help=f"comma-separated of {[s.name for s in SHAPES]} (default: both)")
    parser.add_argument("--head-dims", help="comma-separated of 64,128 (default: both)")
    parser.add_argument("--tops", choices=("plain", "on_top", "both"), default="both",
                        help="the formulations plain, with their score_mod on top, or both")
    parser.add_argument("--mode", help=f"comma-separated of {list(MODES)} (default: all)")
    parser.add_argument("--impls", default=",".join(DEFAULT_IMPLS),
                        help=f"comma-separated of {list(IMPLS)} (default: {','.join(DEFAULT_IMPLS)})")
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds taken in turn (default 3)")
    parser.add_argument("--part", help="K/N: the K-th of N contiguous slices of the selected cases")
    parser.add_argument("--case-timeout", type=float, default=600.0,
                        help="seconds a case may take before every thread's stack is printed and the run ends "
                             "(the cases before it are already written; default 600)")
    parser.add_argument("--out", type=Path, help="results folder (default bench/results; dry run: bench/results/dry-run)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, float32, eager compile backend")
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    parser.add_argument("--merge", nargs="+", type=Path, metavar="JSON", help="combine part files into one")
    return parser.parse_args(argv)


def select_cases(args) -> list[Case]:
    shapes = {s.name: s for s in SHAPES}
    chosen_shapes = [shapes[n] for n in (_names(args.shapes, shapes, "shapes") or shapes)]
    head_dims = [int(d) for d in (_names(args.head_dims, ("64", "128"), "head-dims") or HEAD_DIMS)]
    tops = {"plain": (False,), "on_top": (True,), "both": (False, True)}[args.tops]
    if args.dry_run:
        chosen_shapes, head_dims = [DRY_SHAPE], [16]
    cases = all_cases(_names(args.formulations, FORMULATIONS, "formulations"), chosen_shapes, head_dims, tops)
    if args.part:
        k, n = (int(x) for x in args.part.split("/"))
        if not 1 <= k <= n:
            raise SystemExit(f"--part takes K/N with 1 <= K <= N, got {args.part}")
        cases = cases[(k - 1) * len(cases) // n: k * len(cases) // n]
    return cases


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    command = "python " + " ".join(shlex.quote(a) for a in
                                   ["bench/bench_user_masks.py", *(sys.argv[1:] if argv is None else argv)])
    if args.merge:
        return json.loads(merge(args.merge, args.out or RESULTS_DIR, command).read_text())
    cases = select_cases(args)
    if args.list:
        print("\n".join(c.name for c in cases))
        return {}
    if args.rounds < 1:
        raise SystemExit(f"--rounds takes a whole number >= 1, got {args.rounds}")
    if args.dry_run:
        device, dtype, gpu, backend = torch.device("cpu"), torch.float32, "cpu", "eager"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device; use --dry-run to check the harness on the CPU")
        device, dtype, backend = torch.device("cuda"), torch.bfloat16, "inductor"
        gpu = torch.cuda.get_device_name(device)
    settings = Settings(device, dtype, backend, tuple(_names(args.mode, MODES, "mode") or MODES),
                        1 if args.dry_run else args.rounds, tuple(_names(args.impls, IMPLS, "impls")),
                        wall_calls=2 if args.dry_run else WALL_CALLS)
    now = datetime.datetime.now()
    report: dict[str, Any] = {
        "schema": 1, "gpu": gpu, "torch": torch.__version__, "triton": ba.triton_version(),
        "flexattn": flexattn.__version__, **ba.git_state(), "command": command,
        "date": now.isoformat(timespec="seconds"),
        "settings": {"dtype": str(dtype).replace("torch.", ""), "modes": list(settings.modes),
                     "impls": list(settings.impls), "rounds": settings.rounds, "dry_run": args.dry_run,
                     "compile_backend": backend,
                     "wall_calls": settings.wall_calls, "small_call_us": SMALL_CALL_US},
        "cases": [], "results": [],
    }
    out_dir = args.out or (RESULTS_DIR / "dry-run" if args.dry_run else RESULTS_DIR)
    stem = f"user-masks-{ba.slug(gpu)}-{now:%Y%m%d-%H%M%S}"
    if args.part:
        stem += "-part{}of{}".format(*args.part.split("/"))
    path = None
    for case in cases:
        print(f"case {case.name}", file=sys.stderr, flush=True)
        # A case that hangs (a kernel that never finishes, a stuck compile) shows where.
        faulthandler.dump_traceback_later(args.case_timeout, exit=True)
        info, cells = run_case(case, settings)
        faulthandler.cancel_dump_traceback_later()
        report["cases"].append(info)
        report["results"].extend(cells)
        path = write(report, out_dir, stem)
    if path is not None:
        print(report["markdown"])
        print(f"wrote {path} (+ .md)")
    return report


if __name__ == "__main__":
    main()

"""Benchmark: attention kernels side by side, flexattn against its peers.

For every case of the suite (the anchor cases of the project's design brief, plus prefix-LM and GQA) and
every mode (``fwd``: forward; ``fwdbwd``: forward and backward together) it runs:

* ``flexattn``     ``torch.compile(flexattn.flex_attention, fullgraph=True)``
* ``torch_flex``   ``torch.compile(torch.nn.attention.flex_attention.flex_attention, fullgraph=True)``
* ``sdpa_flash``   ``scaled_dot_product_attention`` under ``SDPBackend.FLASH_ATTENTION``
* ``sdpa_cudnn``   ``scaled_dot_product_attention`` under ``SDPBackend.CUDNN_ATTENTION``

SDPA runs only where the variant exists (no mask, causal). Each cell records the median
time of many runs (``triton.testing.do_bench``, after compile and warm-up), TFLOP/s over
the unmasked entries, the first call's wall time (compile included, after
``torch._dynamo.reset()``, in a process warmed up by one throwaway compile per library and mode), the peak extra memory of one call and the largest absolute
difference of its output (and gradients) from torch_flex's. A cell that fails keeps its
error string and the run goes on. Writes ``attention-<gpu>-<date>.json``, ``latest.json``
and the markdown table beside them, and prints the table last.

    python bench/bench_attention.py                         # full suite, fwd and fwdbwd
    python bench/bench_attention.py --quick                 # S=4096 subset, fwd, < 3 min
    python bench/bench_attention.py --suite short           # S<=4096 causal/ALiBi/document, D=64 and 128
    python bench/bench_attention.py --suite short --rounds 3  # each cell timed 3 times in turn, median
    python bench/bench_attention.py --cases causal_s8192_d128 --mode fwdbwd
    python bench/bench_attention.py --dry-run               # CPU, tiny shapes, seconds
    python bench/bench_attention.py --merge a.json b.json   # one result file from parts
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention import flex_attention as torch_flex

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import flexattn  # noqa: E402
from flexattn import mods  # noqa: E402

RESULTS_DIR = REPO / "bench" / "results"
IMPLS = ("flexattn", "torch_flex", "sdpa_flash", "sdpa_cudnn")
FLEX_IMPLS = ("flexattn", "torch_flex")
#: Columns a run adds with --peers: flexattn forced onto its Triton template (beside its
#: default choice, the Gluon kernel on Hopper), flexattn with the Gluon backward forced (its
#: forward the default's) and torch's FLASH backend (FlashAttention-4, importable on the GPU
#: machine through ../shared/fa4/), each a flex call with these options.
PEER_IMPLS = {"template": "flexattn_triton", "gluon_bwd": "flexattn_gluon_bwd", "flash": "torch_flash"}
IMPL_OPTIONS = {"flexattn_triton": {"BACKEND": "TRITON"}, "flexattn_gluon_bwd": {"BWD_BACKEND": "GLUON"},
                "torch_flash": {"BACKEND": "FLASH"}}
PEER_LABELS = {"flexattn_triton": "flexattn Triton", "flexattn_gluon_bwd": "flexattn Gluon bwd",
               "torch_flash": "torch FLASH"}
MODES = ("fwd", "fwdbwd")
FLOP_FACTOR = {"fwd": 1.0, "fwdbwd": 3.5}
ERROR_FLAG = 2e-2
DRY_RUN_NOT_RUN = {
    ("sdpa_cudnn", "fwd"): "not run in the dry run",
    ("sdpa_cudnn", "fwdbwd"): "not run in the dry run",
    ("torch_flex", "fwdbwd"): "torch's flex_attention has no backward on CPU",
    ("torch_flash", "fwd"): "torch's FLASH backend runs on CUDA GPUs only",
    ("torch_flash", "fwdbwd"): "torch's FLASH backend runs on CUDA GPUs only",
}
SEED = 0

ModFactory = Callable[["Case", torch.device], Callable | None]


# --------------------------------------------------------------------------------------
# The suite
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention shape and variant: (B, H, S, D) queries on (B, Hkv, S, D) keys/values.

    ``score_mod`` and ``mask_mod`` are factories ``(case, device) -> mod or None`` so that
    captured tensors (ALiBi slopes, document ids) are built on the run's device and sized
    to the case. ``sdpa_causal`` is None where SDPA has no such variant, else whether
    SDPA runs with ``is_causal``.
    """

    name: str
    B: int
    H: int
    Hkv: int
    S: int
    D: int
    score_mod: ModFactory | None = None
    mask_mod: ModFactory | None = None
    sdpa_causal: bool | None = None

    def describe(self) -> dict[str, Any]:
        """The case's shape as plain JSON values."""
        return {"name": self.name, "B": self.B, "H": self.H, "Hkv": self.Hkv, "S": self.S, "D": self.D}


def _causal(case: Case, device: torch.device):
    return mods.causal_mask


def _alibi(case: Case, device: torch.device):
    return mods.alibi(case.H, device=device)


def _softcap_30(case: Case, device: torch.device):
    return mods.tanh_softcap(30.0)


def _window(case: Case) -> int:
    """1024 tokens, or S/8 for the tiny shapes of the dry run."""
    return 1024 if case.S >= 2048 else max(1, case.S // 8)


def _sliding_window(case: Case, device: torch.device):
    return mods.sliding_window(_window(case))


def _prefix_lm(case: Case, device: torch.device):
    return mods.prefix_lm(case.S // 4)


def document_ids(length: int, num_docs: int, device: torch.device) -> torch.Tensor:
    """Document id per token: ``num_docs`` documents of seeded random lengths covering ``length``."""
    generator = torch.Generator().manual_seed(SEED)
    cuts = torch.randperm(length - 1, generator=generator)[: num_docs - 1] + 1
    boundaries = torch.sort(cuts).values
    positions = torch.arange(length)
    return torch.bucketize(positions, boundaries, right=True).to(device)


def _document_8(case: Case, device: torch.device):
    return mods.document_mask(document_ids(case.S, 8, device))


def full_suite() -> list[Case]:
    """The anchor cases of the project's design brief (bf16, B=4, H=16 unless named), prefix-LM and GQA."""
    return [
        Case("no_mask_s8192_d128", 4, 16, 16, 8192, 128, sdpa_causal=False),
        Case("causal_s8192_d128", 4, 16, 16, 8192, 128, mask_mod=_causal, sdpa_causal=True),
        Case("causal_s8192_d64", 4, 16, 16, 8192, 64, mask_mod=_causal, sdpa_causal=True),
        Case("no_mask_s8192_d64", 4, 16, 16, 8192, 64, sdpa_causal=False),
        Case("causal_s2048_d128", 4, 16, 16, 2048, 128, mask_mod=_causal, sdpa_causal=True),
        Case("causal_alibi_s8192_d128", 4, 16, 16, 8192, 128, score_mod=_alibi, mask_mod=_causal),
        Case("causal_softcap30_s8192_d128", 4, 16, 16, 8192, 128, score_mod=_softcap_30, mask_mod=_causal),
        Case("sliding_window1024_s8192_d128", 4, 16, 16, 8192, 128, mask_mod=_sliding_window),
        Case("document8_s8192_d128", 4, 16, 16, 8192, 128, mask_mod=_document_8),
        Case("causal_s4096_d256_b2", 2, 16, 16, 4096, 256, mask_mod=_causal, sdpa_causal=True),
        Case("prefix_lm2048_s8192_d128", 4, 16, 16, 8192, 128, mask_mod=_prefix_lm),
        Case("gqa32on8_causal_s8192_d128", 4, 32, 8, 8192, 128, mask_mod=_causal, sdpa_causal=True),
    ]


def quick_suite() -> list[Case]:
    """Four cases at S=4096 (no mask, causal, soft-cap, document) for a run under 3 minutes."""
    return [
        Case("no_mask_s4096_d128", 4, 16, 16, 4096, 128, sdpa_causal=False),
        Case("causal_s4096_d128", 4, 16, 16, 4096, 128, mask_mod=_causal, sdpa_causal=True),
        Case("causal_softcap30_s4096_d128", 4, 16, 16, 4096, 128, score_mod=_softcap_30, mask_mod=_causal),
        Case("document8_s4096_d128", 4, 16, 16, 4096, 128, mask_mod=_document_8),
    ]


def short_suite() -> list[Case]:
    """Short sequences (issue #26): causal, causal + ALiBi and document (8 docs) masks at
    S = 1024, 2048, 4096 and D = 64, 128, bf16 B=4 H=16."""
    variants = (("causal", None, _causal, True), ("causal_alibi", _alibi, _causal, None),
                ("document8", None, _document_8, None))
    return [Case(f"{name}_s{S}_d{D}", 4, 16, 16, S, D, score_mod=score, mask_mod=mask, sdpa_causal=sdpa)
            for S in (1024, 2048, 4096) for D in (64, 128) for name, score, mask, sdpa in variants]


SUITES = {"full": full_suite, "short": short_suite, "all": lambda: full_suite() + short_suite()}


def shrink(case: Case) -> Case:
    """The same case at dry-run size: B=1, 2 KV heads (the GQA ratio kept), S=256, D<=32."""
    group = case.H // case.Hkv
    return dataclasses.replace(case, B=1, H=2 * group, Hkv=2, S=256, D=min(case.D, 32))


# --------------------------------------------------------------------------------------
# Masks and FLOPs
# --------------------------------------------------------------------------------------


def exact_density(mask_mod: Callable | None, S: int, device: torch.device) -> float:
    """Fraction of the S x S entries that ``mask_mod`` allows, for b = h = 0.

    Evaluates the mask on broadcast index tensors, a band of query rows at a time; valid
    for the masks of this suite, which depend on neither b nor h.
    """
    if mask_mod is None:
        return 1.0
    zero = torch.zeros((), dtype=torch.long, device=device)
    kv_idx = torch.arange(S, device=device)[None, :]
    rows = max(1, (1 << 26) // S)
    allowed = 0
    for start in range(0, S, rows):
        q_idx = torch.arange(start, min(S, start + rows), device=device)[:, None]
        allowed += int(mask_mod(zero, zero, q_idx, kv_idx).expand(q_idx.shape[0], S).sum().item())
    return allowed / (S * S)


def block_density(block_mask: Any) -> float:
    """Fraction of the blocks that a BlockMask computes (1 without a mask)."""
    return 1.0 if block_mask is None else 1.0 - block_mask.sparsity() / 100.0


def forward_flops(case: Case, density: float) -> float:
    """4 * B * H * S * S * D * density: two matrix products over the unmasked entries."""
    return 4.0 * case.B * case.H * case.S * case.S * case.D * density


# --------------------------------------------------------------------------------------
# Running one cell
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Settings:
    """How the cells are run: device, dtype, timing budget and compile backend."""

    device: torch.device
    dtype: torch.dtype
    compile_backend: str
    warmup_ms: int
    rep_ms: int
    cpu_reps: int
    not_run: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)
    #: The --peers columns of this run (PEER_IMPLS' values).
    peers: tuple[str, ...] = ()
    #: Timings per cell, taken in rounds in turn over a case's impls; a cell's ``ms`` is
    #: their median (host-bound cells move with the host from one moment to the next).
    rounds: int = 1


@dataclasses.dataclass
class Prepared:
    """A case made concrete on the device: its mods, each library's block mask, inputs."""

    case: Case
    score_mod: Callable | None
    mask_mod: Callable | None
    masks: dict[str, Any]
    inputs: dict[str, tuple[torch.Tensor, ...]]
    grad_out: torch.Tensor


def prepare(case: Case, settings: Settings, modes: list[str]) -> Prepared:
    """Build the mods, one block mask per flex library, and seeded inputs per mode."""
    device, dtype = settings.device, settings.dtype
    score_mod = case.score_mod(case, device) if case.score_mod else None
    mask_mod = case.mask_mod(case, device) if case.mask_mod else None
    masks = {"flexattn": None, "torch_flex": None}
    if mask_mod is not None:
        masks["flexattn"] = flexattn.create_block_mask(mask_mod, None, None, case.S, case.S, device=device)
        masks["torch_flex"] = torch_flex.create_block_mask(mask_mod, None, None, case.S, case.S, device=device)
    generator = torch.Generator(device=device).manual_seed(SEED)

    def randn(heads: int) -> torch.Tensor:
        return torch.randn(case.B, heads, case.S, case.D, generator=generator, device=device, dtype=dtype)

    base = (randn(case.H), randn(case.Hkv), randn(case.Hkv))
    grad_out = randn(case.H)
    inputs = {}
    for mode in modes:
        inputs[mode] = tuple(t.detach().clone().requires_grad_(mode == "fwdbwd") for t in base)
    return Prepared(case, score_mod, mask_mod, masks, inputs, grad_out)


def _library_key(impl: str) -> str:
    """Whose flex_attention (and block mask) an impl calls: "flexattn" or "torch_flex"."""
    return "flexattn" if impl.startswith("flexattn") else "torch_flex"


def _flex_call(impl: str, prepared: Prepared, settings: Settings, mode: str) -> Callable[[], torch.Tensor]:
    """A forward call through the compiled flex_attention of flexattn or torch."""
    library = flexattn if _library_key(impl) == "flexattn" else torch_flex
    compiled = torch.compile(library.flex_attention, fullgraph=True, dynamic=False, backend=settings.compile_backend)
    q, k, v = prepared.inputs[mode]
    block_mask = prepared.masks[_library_key(impl)]
    gqa = prepared.case.H != prepared.case.Hkv
    options = IMPL_OPTIONS.get(impl)

    def call() -> torch.Tensor:
        return compiled(q, k, v, score_mod=prepared.score_mod, block_mask=block_mask, enable_gqa=gqa,
                        kernel_options=options)

    return call


def _sdpa_call(prepared: Prepared, mode: str) -> Callable[[], torch.Tensor]:
    """A forward call of scaled_dot_product_attention (the backend is chosen by the caller)."""
    q, k, v = prepared.inputs[mode]
    causal = bool(prepared.case.sdpa_causal)
    gqa = prepared.case.H != prepared.case.Hkv

    def call() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    return call


def _backend_context(impl: str):
    """The SDPA backend restriction for an SDPA impl; nothing for the flex ones."""
    if impl == "sdpa_flash":
        return sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    if impl == "sdpa_cudnn":
        return sdpa_kernel(SDPBackend.CUDNN_ATTENTION)
    return contextlib.nullcontext()


def warm_up_compilers(settings: Settings, modes: list[str]) -> None:
    """Compile and run each flex library once on a tiny problem with a throwaway score_mod
    before the suite, per mode.

    The first compile in a process also pays for one-time start-up (Inductor's and
    AOTAutograd's first use, the first backward graph); without this that cost would land
    on whichever library the first case compiles first. The throwaway mod and shape share
    no kernel with the suite, so every case's compile_s is still the compile of a new
    score_mod in a warm process.
    """
    def halve(score, b, h, q_idx, kv_idx):
        return score * 0.5

    for impl in FLEX_IMPLS:
        if all((impl, mode) in settings.not_run for mode in modes):
            continue
        library = flexattn if impl == "flexattn" else torch_flex
        compiled = torch.compile(library.flex_attention, fullgraph=True, dynamic=False, backend=settings.compile_backend)
        for mode in modes:
            if (impl, mode) in settings.not_run:
                continue
            q, k, v = (torch.randn(1, 1, 256, 64, device=settings.device, dtype=settings.dtype,
                                   requires_grad=mode == "fwdbwd") for _ in range(3))
            torch._dynamo.reset()
            try:
                out = compiled(q, k, v, score_mod=halve)
                if mode == "fwdbwd":
                    out.sum().backward()
            except Exception as error:  # noqa: BLE001 - the suite's own cells report failures
                print(f"warning: warm-up of {impl} {mode} failed: {error_text(error)[:160]}", file=sys.stderr,
                      flush=True)
    synchronize(settings.device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], Any], grads: list[torch.Tensor], settings: Settings) -> float:
    """Median wall time of ``fn`` in ms; grads are set to None before each run, untimed.

    CUDA: ``triton.testing.do_bench`` (its own warm-up, L2 flushed between runs). CPU:
    ``cpu_reps`` runs timed with perf_counter after one warm-up run.
    """
    if settings.device.type == "cuda":
        import triton.testing

        return float(
            triton.testing.do_bench(
                fn, warmup=settings.warmup_ms, rep=settings.rep_ms, grad_to_none=grads, return_mode="median"
            )
        )
    times = []
    for _ in range(settings.cpu_reps + 1):
        for tensor in grads:
            tensor.grad = None
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


def peak_extra_mib(fn: Callable[[], Any], grads: list[torch.Tensor], device: torch.device) -> float | None:
    """Peak device memory one call allocates beyond what was live before it, in MiB (CUDA only)."""
    if device.type != "cuda":
        return None
    for tensor in grads:
        tensor.grad = None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def _max_abs_diff(got: list[torch.Tensor], reference: list[torch.Tensor]) -> float | None:
    """Largest |got - reference| over the given tensors, in float32 (None when there are none)."""
    if not got:
        return None
    return max(float((g.float() - r.float()).abs().max().item()) for g, r in zip(got, reference))


def error_text(error: BaseException) -> str:
    """``Type: first line`` of an error, with the first line of its innermost cause.

    Dynamo wraps errors raised while tracing ("Observed exception"); the cause says why.
    """
    def first_line(exc: BaseException) -> str:
        text = str(exc).strip()
        return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"

    innermost, seen = error, {id(error)}
    while (nxt := innermost.__cause__ or innermost.__context__) is not None and id(nxt) not in seen:
        innermost = nxt
        seen.add(id(nxt))
    text, cause = first_line(error), first_line(innermost)
    return text if cause.split(": ", 1)[-1] in text else f"{text} (cause: {cause})"


def _refusal(error: BaseException, caught: list[warnings.WarningMessage]) -> str:
    """A one-line note of why an SDPA backend refused, from its error and warnings."""
    reasons = [str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()]
    return "backend refused: " + ("; ".join(reasons[:2]) or str(error).splitlines()[0])[:240]


def run_cell(impl: str, prepared: Prepared, mode: str, settings: Settings,
             reference: dict) -> tuple[dict[str, Any], Callable[[], float] | None]:
    """Compile, check and time one (impl, case, mode); never raises.

    Returns a record with ``ms``, ``tflops``, ``compile_s`` (flex impls: wall time of the
    first call after ``torch._dynamo.reset()``), ``peak_mem_mib``, ``max_abs_err`` (output
    against torch_flex's; ``err_flag`` when above ERROR_FLAG or NaN) and
    ``max_abs_err_grads`` (fwdbwd: dq, dk, dv against torch_flex's, for information); or
    ``error`` / ``note`` instead.
    ``reference`` holds torch_flex's results, keyed by mode, for later cells to compare.
    Also returns a timer of the compiled call for later rounds (None when it failed).
    The caller resets Dynamo before a mode's cells, so every impl's compiled call stays
    valid for the rounds after them.
    """
    case = prepared.case
    record: dict[str, Any] = {"case": case.name, "mode": mode, "impl": impl}
    if (impl, mode) in settings.not_run:
        record["note"] = settings.not_run[(impl, mode)]
        return record, None
    if impl.startswith("sdpa") and case.sdpa_causal is None:
        record["note"] = "no SDPA variant"
        return record, None
    q, k, v = prepared.inputs[mode]
    grads = [q, k, v] if mode == "fwdbwd" else []
    for tensor in grads:
        tensor.grad = None
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught, _backend_context(impl):
            warnings.simplefilter("always")
            forward = (_flex_call(impl, prepared, settings, mode) if impl in FLEX_IMPLS + settings.peers
                       else _sdpa_call(prepared, mode))
            if mode == "fwd":

                def step():
                    return forward()

            else:

                def step():
                    out = forward()
                    out.backward(prepared.grad_out)
                    return out

            start = time.perf_counter()
            out = step()
            synchronize(settings.device)
            first_call_s = time.perf_counter() - start
            results = [out.detach().clone()] + [t.grad.detach().clone() for t in grads]
            ms = median_ms(step, grads, settings)
            peak = peak_extra_mib(step, grads, settings.device)
    except Exception as error:  # noqa: BLE001 - every failure becomes a cell
        for tensor in grads:
            tensor.grad = None
        if settings.device.type == "cuda":
            torch.cuda.empty_cache()
        if impl.startswith("sdpa") and "no available kernel" in str(error).lower():
            record["note"] = _refusal(error, caught)
            return record, None
        message = error_text(error)
        record["error"] = message[:400]
        print(f"warning: {impl} {case.name} {mode} failed: {message[:160]}", file=sys.stderr, flush=True)
        return record, None
    for tensor in grads:
        tensor.grad = None
    if impl == "torch_flex":
        reference[mode] = results
    elif mode in reference:
        expected = reference[mode]
        record["max_abs_err"] = _max_abs_diff(results[:1], expected[:1])
        record["err_flag"] = bool(not record["max_abs_err"] <= ERROR_FLAG)
        if mode == "fwdbwd":
            record["max_abs_err_grads"] = _max_abs_diff(results[1:], expected[1:])
    record["ms"] = ms
    record["ms_rounds"] = [ms]
    record["peak_mem_mib"] = peak
    if impl in FLEX_IMPLS + settings.peers:
        record["compile_s"] = first_call_s

    def timer() -> float:
        with _backend_context(impl):
            return median_ms(step, grads, settings)

    return record, timer


def time_in_turn(records: dict[str, dict[str, Any]], timers: dict[str, Callable[[], float]], rounds: int) -> None:
    """Rounds 2..``rounds`` of the timed cells of one (case, mode), in turn, each round
    starting one impl later; each record's ``ms`` becomes the median of its rounds."""
    names = list(timers)
    if not names:
        return
    for round_index in range(1, rounds):
        shift = round_index % len(names)
        for impl in names[shift:] + names[:shift]:
            records[impl]["ms_rounds"].append(timers[impl]())
    for impl in names:
        records[impl]["ms"] = statistics.median(records[impl]["ms_rounds"])


def run_case(case: Case, modes: list[str], settings: Settings) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Every impl and mode of one case: the case's description (densities, FLOPs) and its cells."""
    info = case.describe()
    try:
        prepared = prepare(case, settings, modes)
    except Exception as error:  # noqa: BLE001 - a case that cannot be built is recorded
        message = error_text(error)[:400]
        print(f"warning: case {case.name} could not be prepared: {message}", file=sys.stderr, flush=True)
        info["error"] = message
        return info, [{"case": case.name, "mode": m, "impl": i, "error": message} for m in modes for i in IMPLS]
    info["score_mod"] = getattr(prepared.score_mod, "__name__", None)
    info["mask_mod"] = getattr(prepared.mask_mod, "__name__", None)
    info["density_block_flexattn"] = block_density(prepared.masks["flexattn"])
    info["density_block_torch"] = block_density(prepared.masks["torch_flex"])
    try:
        info["density_exact"] = exact_density(prepared.mask_mod, case.S, settings.device)
        info["density_kind"] = "exact"
    except Exception as error:  # noqa: BLE001 - fall back to the block density
        info["density_exact"] = None
        info["density_kind"] = f"block (exact failed: {type(error).__name__})"
    info["density"] = info["density_exact"] if info["density_exact"] is not None else info["density_block_torch"]
    info["fwd_flops"] = forward_flops(case, info["density"])
    cells = []
    for mode in modes:
        reference: dict = {}
        records: dict[str, dict[str, Any]] = {}
        timers: dict[str, Callable[[], float]] = {}
        torch._dynamo.reset()
        for impl in ("torch_flex", "flexattn", "sdpa_flash", "sdpa_cudnn", *settings.peers):
            records[impl], timer = run_cell(impl, prepared, mode, settings, reference)
            if timer is not None:
                timers[impl] = timer
        time_in_turn(records, timers, settings.rounds)
        for cell in records.values():
            if "ms" in cell:
                cell["tflops"] = info["fwd_flops"] * FLOP_FACTOR[mode] / (cell["ms"] * 1e-3) / 1e12
            cells.append(cell)
        del reference, records, timers
    del prepared
    if settings.device.type == "cuda":
        torch.cuda.empty_cache()
    return info, cells


# --------------------------------------------------------------------------------------
# Summary and output
# --------------------------------------------------------------------------------------


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratio flexattn / torch_flex in TFLOP/s per (case, mode), and geometric means per mode and overall."""
    by_key = {(r["case"], r["mode"], r["impl"]): r for r in results}
    ratios: dict[str, dict[str, float]] = {}
    for (case, mode, impl), record in by_key.items():
        other = by_key.get((case, mode, "torch_flex"), {})
        if impl == "flexattn" and record.get("tflops") and other.get("tflops"):
            ratios.setdefault(case, {})[mode] = record["tflops"] / other["tflops"]

    def geomean(values: list[float]) -> float | None:
        return math.exp(sum(math.log(x) for x in values) / len(values)) if values else None

    modes = sorted({m for per_case in ratios.values() for m in per_case}, key=MODES.index)
    geo = {m: geomean([r[m] for r in ratios.values() if m in r]) for m in modes}
    geo["all"] = geomean([x for r in ratios.values() for x in r.values()])
    counts = {m: sum(m in r for r in ratios.values()) for m in modes}
    counts["all"] = sum(len(r) for r in ratios.values())
    return {"ratio": ratios, "geomean": geo, "geomean_count": counts}


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


def _cell_text(record: dict[str, Any] | None) -> str:
    if record is None:
        return "-"
    if "error" in record:
        return "ERR"
    if "note" in record:
        return "n/a"
    return _fmt(record.get("tflops"))


def markdown_table(report: dict[str, Any]) -> str:
    """The short table: TFLOP/s per impl, ratio, compile s, peak MiB and max error per (case, mode)."""
    by_key = {(r["case"], r["mode"], r["impl"]): r for r in report["results"]}
    ratios = report["summary"]["ratio"]
    peers = [p for p in PEER_IMPLS.values() if any(r["impl"] == p for r in report["results"])]
    flash = "torch_flash" in peers
    modes = [m for m in MODES if any(r["mode"] == m for r in report["results"])]
    dry = " (DRY RUN: tiny shapes, timings meaningless)" if report["settings"].get("dry_run") else ""
    count = report["settings"].get("rounds", 1)
    rounds = f", median of {count} rounds taken in turn" if count > 1 else ""
    lines = [
        f"flexattn vs torch flex on {report['gpu']} (torch {report['torch']}, triton {report['triton']}), "
        f"{report['settings']['dtype']}; TFLOP/s over unmasked entries{rounds}{dry}",
        "",
        "| case | mode | flexattn | torch flex | ratio | SDPA flash | SDPA cuDNN | compile s fa/tf | peak MiB fa/tf | "
        "max err |" + "".join(f" {PEER_LABELS[p]} |" for p in peers) + (" flexattn/FLASH |" if flash else ""),
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + " ---: |" * (len(peers) + flash),
    ]
    for info in report["cases"]:
        for mode in modes:
            cells = {impl: by_key.get((info["name"], mode, impl)) for impl in (*IMPLS, *peers)}
            if not any(cells.values()):
                continue
            fa, tf = cells["flexattn"] or {}, cells["torch_flex"] or {}
            err = fa.get("max_abs_err")
            err_text = "-" if err is None else f"{err:.1e}" + (" !" if fa.get("err_flag") else "")
            extra = "".join(f" {_cell_text(cells[p])} |" for p in peers)
            if flash:
                fl = cells["torch_flash"] or {}
                ratio = fa["tflops"] / fl["tflops"] if fa.get("tflops") and fl.get("tflops") else None
                extra += f" {_fmt(ratio)} |"
            lines.append(
                f"| {info['name']} | {mode} | {_cell_text(cells['flexattn'])} | {_cell_text(cells['torch_flex'])} | "
                f"{_fmt(ratios.get(info['name'], {}).get(mode))} | {_cell_text(cells['sdpa_flash'])} | "
                f"{_cell_text(cells['sdpa_cudnn'])} | {_fmt(fa.get('compile_s'))}/{_fmt(tf.get('compile_s'))} | "
                f"{_fmt(fa.get('peak_mem_mib'))}/{_fmt(tf.get('peak_mem_mib'))} | {err_text} |" + extra
            )
    geo, counts = report["summary"]["geomean"], report["summary"]["geomean_count"]
    parts = [f"{m} {_fmt(geo.get(m))} (n={counts.get(m, 0)})" for m in (*modes, "all")]
    lines += ["", "geomean flexattn/torch flex: " + ", ".join(parts)]
    return "\n".join(lines)


def problem_lines(report: dict[str, Any]) -> list[str]:
    """One line per failed cell, SDPA refusal and flagged output difference."""
    lines = []
    for r in report["results"]:
        where = f"{r['impl']} {r['case']} {r['mode']}"
        if "error" in r:
            lines.append(f"ERR {where}: {r['error'][:200]}")
        elif r.get("note", "").startswith("backend refused"):
            lines.append(f"n/a {where}: {r['note'][:200]}")
        elif r.get("err_flag"):
            lines.append(f"! {where}: max abs diff from torch flex {r['max_abs_err']:.3g} > {ERROR_FLAG}")
    return lines


def slug(name: str) -> str:
    """A file-name-safe lower-case form of a device name."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def git_state() -> dict[str, Any]:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "flexattn"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        return {"git_commit": commit, "git_flexattn_dirty": bool(dirty)}
    except (OSError, subprocess.CalledProcessError):
        return {"git_commit": None, "git_flexattn_dirty": None}


def triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return "absent"


def write_outputs(report: dict[str, Any], out_dir: Path, stem: str) -> Path:
    """Write ``<stem>.json``, ``<stem>.md`` and ``latest.json`` / ``latest.md``; returns the JSON path.

    Called after every case too, so a run cut short still leaves the cases it finished.
    """
    report["summary"] = summarize(report["results"])
    report["markdown"] = markdown_table(report)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{stem}.json"
    md_text = report["markdown"] + "\n"
    problems = problem_lines(report)
    if problems:
        md_text += "\n" + "\n".join(f"- {line}" for line in problems) + "\n"
    md_text += f"\nCommand: `{report['command']}`\n"
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    json_path.with_suffix(".md").write_text(md_text)
    shutil.copyfile(json_path, out_dir / "latest.json")
    shutil.copyfile(json_path.with_suffix(".md"), out_dir / "latest.md")
    return json_path


def _print_report(report: dict[str, Any], json_path: Path) -> None:
    for line in problem_lines(report):
        print(line)
    print(f"wrote {json_path} (+ .md, latest.json)")
    print()
    print(report["markdown"])


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="S=4096 subset, fwd by default, shorter timing")
    parser.add_argument("--suite", choices=tuple(SUITES), default="full",
                        help="full: the anchor cases; short: S<=4096 causal/ALiBi/document at D=64, 128; all: both")
    parser.add_argument("--cases", help="comma-separated case names (default: the whole suite)")
    parser.add_argument("--mode", help="fwd, fwdbwd or fwd,fwdbwd (default fwd,fwdbwd; fwd with --quick)")
    parser.add_argument("--out", type=Path, help="results folder (default bench/results; dry run: bench/results/dry-run)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, float32, 1 rep, no cuDNN")
    parser.add_argument(
        "--compile-backend",
        choices=("inductor", "eager"),
        help="torch.compile backend for both flex libraries (default inductor; eager in the dry run)",
    )
    parser.add_argument(
        "--keep-compile-caches",
        action="store_true",
        help="use the existing Inductor/Triton caches (default: fresh ones, so compile_s is a cold compile)",
    )
    parser.add_argument("--rounds", type=int, default=1,
                        help="time each cell this many times, in turn over a case's impls; ms is the median "
                             "(default 1; 3 or more where calls are host-bound, S <= 2048)")
    parser.add_argument("--part", help="K/N: run only the K-th of N contiguous slices of the selected cases")
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    parser.add_argument("--peers", default="",
                        help="extra columns, comma-separated: template (flexattn on its Triton template, beside "
                             "its default kernel), gluon_bwd (flexattn with BWD_BACKEND='GLUON'), flash "
                             "(torch's FLASH backend; ../shared/fa4/ makes it importable)")
    parser.add_argument("--merge", nargs="+", type=Path, metavar="JSON", help="combine result files into one")
    return parser.parse_args(argv)


def select_cases(args: argparse.Namespace) -> list[Case]:
    """The suite (quick or full), filtered by --cases, shrunk for the dry run."""
    suite = quick_suite() if args.quick else SUITES[args.suite]()
    if args.cases:
        known = {c.name: c for c in full_suite() + short_suite() + quick_suite()}
        wanted = [name.strip() for name in args.cases.split(",") if name.strip()]
        unknown = [name for name in wanted if name not in known]
        if unknown:
            raise SystemExit(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(known)}")
        suite = [known[name] for name in wanted]
    if args.part:
        index, count = _parse_part(args.part)
        suite = suite[(index - 1) * len(suite) // count : index * len(suite) // count]
    return [shrink(c) for c in suite] if args.dry_run else suite


def _parse_part(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not match or not 1 <= int(match[1]) <= int(match[2]):
        raise SystemExit(f"--part takes K/N with 1 <= K <= N, got {text!r}")
    return int(match[1]), int(match[2])


def select_modes(args: argparse.Namespace) -> list[str]:
    modes = [m.strip() for m in (args.mode or ("fwd" if args.quick else "fwd,fwdbwd")).split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise SystemExit(f"--mode takes fwd, fwdbwd or both, got {args.mode!r}")
    return modes


def _fresh_compile_caches() -> Path:
    """Point Inductor's and Triton's caches at a new temporary folder (read lazily by both)."""
    folder = Path(tempfile.mkdtemp(prefix="flexattn-bench-cache-"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(folder / "triton")
    return folder


def merge(paths: list[Path], out_dir: Path, command: str) -> Path:
    """One report from several result files of the same machine; later files win per cell.

    Written as the first file's name without its ``-partKofN`` suffix (``-merged`` added
    when that name is taken by an input), plus latest.json.
    """
    reports = [json.loads(p.read_text()) for p in paths]
    first = reports[0]
    for other, path in zip(reports[1:], paths[1:]):
        for key in ("gpu", "torch", "triton"):
            if other[key] != first[key]:
                print(f"warning: {path} has {key} {other[key]!r}, not {first[key]!r}", file=sys.stderr)
    cases: dict[str, dict] = {}
    cells: dict[tuple, dict] = {}
    for report in reports:
        for info in report["cases"]:
            cases[info["name"]] = info
        for record in report["results"]:
            cells[(record["case"], record["mode"], record["impl"])] = record
    merged = {key: value for key, value in first.items() if key not in ("cases", "results", "summary", "markdown")}
    merged.update(
        command=command,
        merged_from=[{"file": str(p), "command": r["command"], "date": r["date"]} for p, r in zip(paths, reports)],
        cases=list(cases.values()),
        results=list(cells.values()),
    )
    stem = re.sub(r"-part\d+of\d+$", "", paths[0].stem)
    if stem in {p.stem for p in paths}:
        stem += "-merged"
    json_path = write_outputs(merged, out_dir, stem)
    _print_report(merged, json_path)
    return json_path


def _peers(spec: str) -> tuple[str, ...]:
    names = [name for name in spec.split(",") if name]
    unknown = sorted(set(names) - set(PEER_IMPLS))
    if unknown:
        raise SystemExit(f"--peers takes {sorted(PEER_IMPLS)}, got {unknown}")
    return tuple(PEER_IMPLS[name] for name in names)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the selected cases and modes, write the result files, print the table; returns the report."""
    args = parse_args(argv)
    if args.rounds < 1:
        raise SystemExit(f"--rounds takes a whole number >= 1, got {args.rounds}")
    command = "python " + " ".join(shlex.quote(a) for a in ["bench/bench_attention.py", *(sys.argv[1:] if argv is None else argv)])
    if args.merge:
        return json.loads(merge(args.merge, args.out or RESULTS_DIR, command).read_text())
    cases = select_cases(args)
    if args.list:
        print("\n".join(c.name for c in cases))
        return {}
    modes = select_modes(args)
    if args.dry_run:
        device, dtype = torch.device("cpu"), torch.float32
        gpu = "cpu"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device; use --dry-run to check the harness on the CPU")
        device, dtype = torch.device("cuda"), torch.bfloat16
        gpu = torch.cuda.get_device_name(device)
    backend = args.compile_backend or ("eager" if args.dry_run else "inductor")
    cache_folder = None
    if backend == "inductor" and not args.keep_compile_caches:
        cache_folder = _fresh_compile_caches()
    settings = Settings(
        device=device,
        dtype=dtype,
        compile_backend=backend,
        warmup_ms=25 if args.quick else 100,
        rep_ms=100 if args.quick else 500,
        cpu_reps=1,
        not_run=DRY_RUN_NOT_RUN if args.dry_run else {},
        rounds=args.rounds,
        peers=_peers(args.peers),
    )
    now = datetime.datetime.now()
    report: dict[str, Any] = {
        "schema": 1,
        "gpu": gpu,
        "device": device.type,
        "torch": torch.__version__,
        "triton": triton_version(),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
        "flexattn": flexattn.__version__,
        "python": platform.python_version(),
        **git_state(),
        "command": command,
        "date": now.isoformat(timespec="seconds"),
        "settings": {
            "dtype": str(dtype).replace("torch.", ""),
            "modes": modes,
            "quick": args.quick,
            "dry_run": args.dry_run,
            "compile_backend": backend,
            "compile_caches": "fresh" if cache_folder else "kept",
            "compile_warm_up": "each flex library compiled a tiny throwaway case per mode before the suite",
            "warmup_ms": settings.warmup_ms,
            "rep_ms": settings.rep_ms,
            "timer": "triton.testing.do_bench median" if device.type == "cuda" else f"perf_counter median of {settings.cpu_reps}",
            "rounds": settings.rounds,
            "flops": "4*B*H*S*S*D*density forward; fwdbwd 3.5x that (backward 2.5x)",
            "density": "exact entry density of the mask where computable (density_kind per case), else block density",
            "error_flag": ERROR_FLAG,
        },
        "cases": [],
        "results": [],
    }
    out_dir = args.out or (RESULTS_DIR / "dry-run" if args.dry_run else RESULTS_DIR)
    # Suffixed runs (quick, short) stay out of the README's table (bench/report.py).
    stem = f"attention-{slug(gpu)}-{now:%Y%m%d-%H%M%S}" + ("-quick" if args.quick else "")
    if args.suite == "short" and not args.quick and not args.cases:
        stem += "-short"
    if args.part:
        stem += "-part{}of{}".format(*_parse_part(args.part))
    total_start = time.perf_counter()
    try:
        warm_up_compilers(settings, modes)
        for case in cases:
            print(f"case {case.name} ({', '.join(modes)})", file=sys.stderr, flush=True)
            info, cells = run_case(case, modes, settings)
            report["cases"].append(info)
            report["results"].extend(cells)
            report["wall_s"] = time.perf_counter() - total_start
            write_outputs(report, out_dir, stem)
    finally:
        if cache_folder is not None:
            shutil.rmtree(cache_folder, ignore_errors=True)
    report["wall_s"] = time.perf_counter() - total_start
    json_path = write_outputs(report, out_dir, stem)
    _print_report(report, json_path)
    return report


if __name__ == "__main__":
    main()

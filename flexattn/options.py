"""The registry of ``kernel_options`` keys: one entry per key with its type, default,
the kernels that read it and whether users set it.

``flex_attention`` validates a caller's dict against it (``validate``), fills the
defaults (``with_defaults``) and adds flexattn's own internal entries under one key of
their own (``INTERNAL_KEY``, see ``internal_options``), so the user's keys and
flexattn's never share a namespace. The lowering reads every key through ``read`` /
``read_internal``, which refuse names that are not registered. The kernel_options table
of docs/guide.md is ``markdown_table()``'s output: ``python3 scripts/kernel_options_table.py``
rewrites it, and a test keeps the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, TypedDict

import torch

#: Kernels that read options (the ``readers`` of an entry).
KERNELS = ("forward", "backward", "decode")

#: The key of the nested dict of flexattn's internal entries in the operator's options.
INTERNAL_KEY = "flexattn_internal"

#: The value of ``default`` for a key whose default the lowering picks per call.
PER_CALL = None


@dataclass(frozen=True)
class KernelOption:
    """One kernel_options key.

    ``kind``: "bool", "int", "float", "str" or "tristate" (True / False / None = automatic);
    ``default``: the value used when the key is absent (``PER_CALL``: chosen per call by
    the lowering, as ``default_doc`` says); ``readers``: the kernels that read it;
    ``origin``: "torch" for torch's FlexAttention keys (a drop-in call keeps them),
    "flexattn" for flexattn's own; ``public``: users may set it (internal entries travel
    under ``INTERNAL_KEY``).
    """

    name: str
    kind: str
    default: Any
    readers: tuple[str, ...]
    doc: str
    origin: str = "flexattn"
    public: bool = True
    default_doc: str = ""
    #: The values a "str" key takes (ValueError for another).
    choices: tuple[str, ...] = ()
    #: The least value an "int" key takes (ValueError below it).
    minimum: int | None = None

    def check(self, value: Any) -> None:
        """Raise TypeError when ``value`` is not of this key's kind."""
        if self.kind == "str":
            ok = isinstance(value, str)
        elif self.kind == "float":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif self.kind in ("bool", "tristate"):
            ok = isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)) \
                or (self.kind == "tristate" and value is None)
        else:
            ok = (isinstance(value, int) and not isinstance(value, bool)) or value is None
        if not ok:
            expected = {"bool": "True or False", "tristate": "True, False or None", "int": "an int",
                        "str": "a str", "float": "a float"}[self.kind]
            raise TypeError(f"flexattn: kernel_options {self.name} must be {expected}, got {value!r}")
        if self.choices and value not in self.choices:
            raise ValueError(f"flexattn: kernel_options {self.name} must be one of {self.choices}, got {value!r}")
        if self.minimum is not None and value is not None and value < self.minimum:
            raise ValueError(f"flexattn: kernel_options {self.name} must be {self.minimum} or more, got {value!r}")


def _tiles(names: tuple[str, ...], readers: tuple[str, ...], doc: str, origin: str = "torch") -> list[KernelOption]:
    return [KernelOption(name, "int", PER_CALL, readers, doc, origin, default_doc="tile table") for name in names]


_FWD = ("forward",)
_BWD = ("backward",)
_DEC = ("decode",)
_ALL = KERNELS

OPTIONS: tuple[KernelOption, ...] = (
    *_tiles(("BLOCK_M",), _FWD, "pin the forward's query tile"),
    *_tiles(("BLOCK_N",), ("forward", "decode"), "pin the forward's and the decode kernel's KV step"),
    *_tiles(("num_warps", "num_stages"), _ALL, "pin every kernel's warps / software-pipeline stages"),
    *_tiles(("fwd_BLOCK_M", "fwd_BLOCK_N", "fwd_num_warps", "fwd_num_stages"), _FWD,
            "pin the forward's tiles alone (wins over the unprefixed key)"),
    *_tiles(("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2"), _BWD,
            "pin the backward tiles (dK/dV programs: M1 query rows per step over N1 keys; dQ programs: "
            "M2 rows over N2 keys per step)"),
    *_tiles(("bwd_BLOCK_M1", "bwd_BLOCK_N1", "bwd_BLOCK_M2", "bwd_BLOCK_N2", "bwd_num_warps", "bwd_num_stages"),
            _BWD, "pin the backward's tiles alone (wins over the unprefixed key)"),
    KernelOption("ONE_KV_LOOP", "tristate", PER_CALL, ("forward", "backward"),
                 "walk the partial and the full blocks in one loop (mask_mod behind a branch on the tile "
                 "number) instead of one loop per group: fewer registers, for a branch per tile",
                 default_doc="tile table: forward on at D=128 16-bit on sm90, backward off "
                             "([decisions](../bench/DECISIONS.md#forward-one-kv-loop))"),
    KernelOption("fwd_ONE_KV_LOOP", "tristate", PER_CALL, _FWD, "ONE_KV_LOOP for the forward alone",
                 default_doc="tile table"),
    KernelOption("bwd_ONE_KV_LOOP", "tristate", PER_CALL, _BWD, "ONE_KV_LOOP for the backward alone",
                 default_doc="off ([decisions](../bench/DECISIONS.md#backward-one-kv-loop))"),
    KernelOption("PRESCALE_QK", "bool", False, _ALL,
                 "multiply q by the scale before the product (faster, slightly different rounding)", "torch"),
    KernelOption("ROWS_GUARANTEED_SAFE", "bool", False, _ALL,
                 "promise every query row sees at least one key (skips the guard for fully masked rows)", "torch"),
    KernelOption("BLOCKS_ARE_CONTIGUOUS", "bool", False, _ALL,
                 "promise the listed KV blocks are contiguous (cheaper block iteration)", "torch"),
    KernelOption("OUTPUT_LOGSUMEXP", "bool", True, _ALL,
                 "write the log-sum-exp (flex_attention sets it from return_lse / return_aux and autograd)",
                 "torch"),
    KernelOption("OUTPUT_MAX", "bool", False, _ALL,
                 "write the row maxima (flex_attention sets it from return_aux)", "torch"),
    KernelOption("WRITE_DQ", "bool", True, _BWD,
                 "accepted for compatibility with torch's FlexAttention; no effect here (a non-default value "
                 "warns)", "torch"),
    KernelOption("FORCE_USE_FLEX_ATTENTION", "bool", False, _DEC,
                 "never use the split-KV decode kernel (torch's spelling)", "torch"),
    KernelOption("USE_TMA", "tristate", PER_CALL, _ALL,
                 "load the tiles each program's loop walks (K, V; in the backward also Q, dO) through tensor "
                 "descriptors (Hopper's copy engine) instead of pointer loads, the tiles read once per program "
                 "through pointers; True asks for it anywhere the layouts allow, in both backward program kinds "
                 "(else warns and uses pointers) and keeps a small forward call on the Gluon kernel, False turns "
                 "it off (and so the Gluon forward, made of descriptor loads: the call takes the Triton "
                 "template)", "torch",
                 default_doc="on for 16-bit inputs on sm90+ where it measured faster: forward every head dim, "
                             "backward D 65-128 in its dQ programs only (with DQ_ATOMIC in its dK/dV programs), "
                             "from 4096 keys, never decode; a forward or backward call also needs batch x heads x "
                             "queries x keys x head dim of 2**36 or more "
                             "([decisions](../bench/DECISIONS.md#tma-tma-defaults), "
                             "[short sequences](../bench/DECISIONS.md#tma-short-sequences), "
                             "[small forward calls](../bench/DECISIONS.md#tma-small-forward-calls), "
                             "[small backward calls](../bench/DECISIONS.md#tma-small-backward-calls), "
                             "[backward programs](../bench/DECISIONS.md#tma-backward-programs))"),
    KernelOption("REVERSED_Q_TILES", "tristate", PER_CALL, ("forward", "backward"),
                 "start the query tiles from the last one (the Triton forward: every head's last tile before "
                 "any head's second-to-last; the Gluon forward and the backward's dQ programs: within each "
                 "head), so the longest rows of causal-like masks start first (no numerical effect)",
                 default_doc="backward on, forward off "
                             "([decisions](../bench/DECISIONS.md#forward-reversed-q-tiles-default))"),
    KernelOption("BACKEND", "str", "AUTO", ("forward", "decode"),
                 "which kernel: AUTO (flexattn's choice), TRITON (the Triton template), GLUON (the "
                 "warp-specialised Hopper forward; an error where it does not cover the call), TRITON_DECODE "
                 "(the split-KV decode kernel); torch's FLASH backend does not exist here (an error)", "torch",
                 choices=("AUTO", "TRITON", "GLUON", "TRITON_DECODE", "FLASH")),
    KernelOption("BWD_BACKEND", "str", "AUTO", _BWD,
                 "which backward kernel: AUTO (flexattn's choice: the warp-specialised Hopper backward for "
                 "queries and keys of 4096 or more at head dim 128 and 8192 or more at 64, batch x heads x "
                 "queries x keys x head dim of 2**36 or more, but at head dim 128 for a mask_mod reading captured "
                 "tensors on a BlockMask of nearly all partial blocks, else the Triton template), TRITON, GLUON "
                 "(the Hopper backward; an error "
                 "where it does not cover the call)",
                 choices=("AUTO", "TRITON", "GLUON")),
    KernelOption("BWD_LATE_DP", "tristate", PER_CALL, _BWD,
                 "Gluon backward: issue the dP product after the tile's scores are masked and exponentiated "
                 "instead of beside the scores' product (fewer registers while score_mod and mask_mod run, less "
                 "overlap)",
                 default_doc="on at head dim 128 when score_mod reads q_idx or kv_idx "
                             "([decisions](../bench/DECISIONS.md#gluon-backward-late-dp))"),
    KernelOption("NUM_PROGRAMS", "int", PER_CALL, ("forward",),
                 "Gluon forward: programs launched, each walking every n-th unit of the call (one query "
                 "tile, or tiles i and n-1-i where the tiles outnumber the programs; units of a head, then "
                 "heads, then batch); 1 or more, as many as the query tiles or more: one tile per program",
                 default_doc="the GPU's multiprocessors", minimum=1),
    KernelOption("FORCE_DECODE", "tristate", PER_CALL, _DEC,
                 "True / False: always / never use the split-KV decode kernel",
                 default_doc="decode kernel when the query has at most 64 rows and the keys at least 256"),
    KernelOption("SPLIT_KV", "int", PER_CALL, _DEC,
                 "decode kernel: the number of programs sharing one tile's KV blocks (1 to 256)",
                 default_doc="from the SM count and the KV length"),
    KernelOption("LIST_CHUNK", "int", PER_CALL, _DEC,
                 "decode kernel with BlockMask lists: block indices a program reads at once into registers, a "
                 "chunk ahead of the steps that use them (a power of two >= 2)",
                 default_doc="16, fewer when a program has fewer blocks"),
    KernelOption("FUSED_MERGE", "bool", False, _DEC,
                 "decode kernel: True lets the last split program of each tile merge the partial results in "
                 "the same launch (a counter per tile in a zeroed workspace); False runs a second merge kernel",
                 default_doc="False ([decisions](../bench/DECISIONS.md#decode-fused-merge-default))"),
    KernelOption("DQ_ATOMIC", "tristate", PER_CALL, _BWD,
                 "backward: compute dQ in the dK/dV programs and add it with float32 atomics (five matrix "
                 "products per tile pair instead of seven; order-dependent rounding); contradicts deterministic "
                 "mode", default_doc="off ([decisions](../bench/DECISIONS.md#backward-dq-atomic-generations))"),
    KernelOption("DETERMINISTIC", "bool", False, _BWD,
                 "bitwise-reproducible gradients (also on under torch.use_deterministic_algorithms(True)); "
                 "refuses captured-tensor gradients"),
    KernelOption("IEEE_FP32", "bool", False, _ALL,
                 "float32 inputs: full-precision products even where torch's matmul setting allows TF32"),
    KernelOption("FAST_TANH", "tristate", PER_CALL, _ALL,
                 "a mod's tanh as the hardware instruction tanh.approx.f32 (relative error about 2^-11) instead "
                 "of libdevice's; True also for float32 (an error where the instruction does not exist: CPU, "
                 "the Triton interpreter, float64)",
                 default_doc="on for 16-bit inputs on NVIDIA GPUs "
                             "([decisions](../bench/DECISIONS.md#tanh-fast-tanh-dtypes))"),
    KernelOption("DEBUG_CONFIG", "bool", False, _ALL,
                 "log the chosen tile configuration at WARNING (also FLEXATTN_DEBUG_CONFIG=1)"),
    KernelOption("DEFAULT_MASK", "bool", False, _ALL,
                 "flex_attention built the default mask itself (every block full, in order): the kernels walk "
                 "every KV position without reading the tables", public=False),
    KernelOption("DROPOUT_P", "float", 0.0, ("forward", "backward"),
                 "flex_attention's dropout_p: the kernels drop each probability with it and scale the kept ones "
                 "(the seed is an operator argument)", public=False),
    KernelOption("MASK_PARTIAL_HEAVY", "tristate", None, ("forward", "backward"),
                 "the BlockMask's partial_heavy (nearly all listed blocks partial), where create_block_mask knew it: "
                 "the forward and backward kernels' choice for a mask_mod that reads captured tensors", public=False),
    KernelOption("CODE_VERSION", "str", "", (),
                 "a digest of flexattn's lowering and templates, so Inductor's FX-graph cache never reuses a graph "
                 "compiled by another version", public=False),
)

REGISTRY: dict[str, KernelOption] = {opt.name: opt for opt in OPTIONS}
PUBLIC_KEYS = frozenset(name for name, opt in REGISTRY.items() if opt.public)


def _entry(name: str, public: bool) -> KernelOption:
    entry = REGISTRY.get(name)
    if entry is None or entry.public != public:
        raise KeyError(f"flexattn: {name!r} is not a registered {'public' if public else 'internal'} kernel option")
    return entry


def validate(kernel_options: Any) -> dict[str, Any]:
    """A copy of a caller's kernel_options, every key registered and public and every
    value of its kind (TypeError for a non-dict or a wrong kind, ValueError for an
    unknown key)."""
    if kernel_options is None:
        return {}
    if not isinstance(kernel_options, dict):
        raise TypeError(f"flexattn: kernel_options must be a dict or None, got {type(kernel_options).__name__}")
    unknown = sorted(str(k) for k in kernel_options if k not in PUBLIC_KEYS)
    if unknown:
        raise ValueError(f"flexattn: unknown kernel_options {unknown}; known keys are {sorted(PUBLIC_KEYS)}")
    for name, value in kernel_options.items():
        REGISTRY[name].check(value)
    _check_backend(kernel_options)
    return dict(kernel_options)


def _check_backend(kernel_options: dict[str, Any]) -> None:
    """BACKEND as torch reads it, and what flexattn lacks of it."""
    if "BACKEND" not in kernel_options:
        return
    backend = kernel_options["BACKEND"]
    if kernel_options.get("FORCE_USE_FLEX_ATTENTION"):
        raise RuntimeError("flexattn: kernel_options BACKEND cannot be combined with FORCE_USE_FLEX_ATTENTION "
                           "(BACKEND supersedes it); pass only BACKEND")
    if backend == "FLASH":
        raise ValueError("flexattn: kernel_options BACKEND='FLASH' selects torch's FlashAttention (CuTe) kernels, "
                         "which flexattn does not have; use 'AUTO', 'TRITON', 'GLUON' (flexattn's warp-specialised "
                         "Hopper forward) or 'TRITON_DECODE'")
    if backend == "GLUON" and forbids_tma(kernel_options):
        raise ValueError("flexattn: kernel_options BACKEND='GLUON' and USE_TMA=False contradict each other: the "
                         "Gluon forward loads its tiles through tensor descriptors; pass one of them")
    forced = kernel_options.get("FORCE_DECODE")
    if forced is not None and backend != "AUTO" and bool(forced) != (backend == "TRITON_DECODE"):
        raise ValueError(f"flexattn: kernel_options BACKEND={backend!r} and FORCE_DECODE={forced!r} contradict "
                         "each other; pass one of them")


def check_internal(values: dict[str, Any]) -> None:
    """Every internal entry registered and of its kind (KeyError, TypeError)."""
    for name, value in values.items():
        _entry(name, public=False).check(value)


def internal_options(**values: Any) -> dict[str, Any]:
    """The internal entries, checked, as the operator carries them: ``{INTERNAL_KEY: {...}}``."""
    check_internal(values)
    return {INTERNAL_KEY: dict(values)}


def read(kernel_options: dict[str, Any], name: str, default: Any = PER_CALL) -> Any:
    """A public key's value in the operator's options: the given value, else ``default``
    when one is passed (a per-call default the caller computed), else the registry's."""
    entry = _entry(name, public=True)
    value = kernel_options.get(name)
    if value is not None:
        return value
    return default if default is not PER_CALL else entry.default


def forbids_tma(kernel_options: dict[str, Any]) -> bool:
    """USE_TMA given and false (False or 0): no tensor-descriptor loads, and so no Gluon forward."""
    requested = read(kernel_options, "USE_TMA")
    return requested is not None and not requested


def read_internal(kernel_options: dict[str, Any], name: str) -> Any:
    """An internal entry's value (its registry default when absent)."""
    entry = _entry(name, public=False)
    return kernel_options.get(INTERNAL_KEY, {}).get(name, entry.default)


def markdown_table() -> str:
    """The kernel_options table of docs/guide.md."""
    rows = ["| key | reads it | default | effect |", "| --- | --- | --- | --- |"]
    for opt in OPTIONS:
        if not opt.public:
            continue
        default = opt.default_doc or repr(opt.default)
        origin = "" if opt.origin == "flexattn" else " (torch's key)"
        rows.append(f"| `{opt.name}` | {', '.join(opt.readers)} | {default} | {opt.doc}{origin} |")
    return "\n".join(rows) + "\n"


_KIND_TYPES = {"bool": bool, "int": int, "tristate": Optional[bool], "str": str, "float": float}

#: The kernel_options dict as a type (torch's ``FlexKernelOptions``): every public key,
#: none required.
FlexKernelOptions = TypedDict(  # type: ignore[misc]
    "FlexKernelOptions", {opt.name: _KIND_TYPES[opt.kind] for opt in OPTIONS if opt.public}, total=False)
FlexKernelOptions.__doc__ = (
    "The kernel_options dict of flex_attention, as a type (torch's FlexKernelOptions): every key optional.\n\n"
    "Keys:\n\n" + "\n".join(f"* {opt.name} ({opt.kind}, default {opt.default_doc or repr(opt.default)}): {opt.doc}"
                             for opt in OPTIONS if opt.public))

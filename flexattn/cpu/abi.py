"""The C interface between flexattn's Python side and its C++ CPU kernels, in one place.

The CPU attention kernels are two shared libraries compiled at first use (``build.py``):
the *engine* (``csrc/engine.cpp`` and the headers it includes: the tile loops, matrix
products, softmax, dropout; one build per machine) and, per score_mod/mask_mod, a *mod
library* (``csrc/mods.cpp.jinja`` around the code that ``mod_library.py`` generates).
Python fills one ``CallArgs`` struct per call and hands it to the engine, which calls the
mod library through the function pointers in it. The C declarations of the structs below,
and the list of the math table's functions, are generated from these field lists
(``generated_header``, the sources' ``abi_generated.h``), so the two sides cannot drift
apart.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import torch

#: Largest row segment (keys) a mod function is called with; its scratch arrays have
#: this size.
MAX_ROW = 512

#: The engine's dtype codes.
DTYPE_CODES = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3}

#: Elementwise math the engine lends the mod libraries, vectorised (``at::vec``):
#: (name, ``at::vec::Vectorized`` method or None for a scalar ``std::`` loop).
UNARY_MATH = (
    ("exp", "exp"), ("exp2", "exp2"), ("expm1", "expm1"), ("log", "log"), ("log2", "log2"),
    ("log10", "log10"), ("log1p", "log1p"), ("sqrt", "sqrt"), ("rsqrt", "rsqrt"), ("sin", "sin"),
    ("cos", "cos"), ("tan", "tan"), ("tanh", "tanh"), ("sinh", "sinh"), ("cosh", "cosh"),
    ("asin", "asin"), ("acos", "acos"), ("atan", "atan"), ("erf", "erf"), ("erfc", "erfc"),
    ("erfinv", "erfinv"), ("lgamma", "lgamma"), ("asinh", None), ("acosh", None), ("atanh", None),
)
BINARY_MATH = (("pow", "pow"), ("atan2", "atan2"), ("fmod", "fmod"), ("hypot", "hypot"),
               ("nextafter", None), ("copysign", None))


def _math_table() -> list[tuple[str, type]]:
    fields = []
    for name, _ in UNARY_MATH:
        fields += [(f"{name}_f32", ctypes.c_void_p), (f"{name}_f64", ctypes.c_void_p)]
    for name, _ in BINARY_MATH:
        fields += [(f"{name}_f32", ctypes.c_void_p), (f"{name}_f64", ctypes.c_void_p)]
    return fields


I64x4 = ctypes.c_int64 * 4
I64x3 = ctypes.c_int64 * 3
I64x2 = ctypes.c_int64 * 2

#: What a mod function sees besides its row: captured tensors, symbolic sizes, the
#: gradient accumulators of captured tensors, and the engine's math table.
MOD_CONTEXT_FIELDS = (
    ("buffers", ctypes.c_void_p),       # void* const*: captured tensors' data
    ("symbols", ctypes.c_void_p),       # const int64_t*: values of the symbolic sizes
    ("grads", ctypes.c_void_p),         # void* const*: accumulators of captured tensors' gradients
    ("grads_atomic", ctypes.c_int64),   # 1: several threads share the accumulators
    ("math", ctypes.c_void_p),          # const FaMath*
)

#: One call of the engine, forward or backward (the backward's fields unused forward).
CALL_FIELDS = (
    ("dtype", ctypes.c_int64),
    ("B", ctypes.c_int64), ("Hq", ctypes.c_int64), ("Hkv", ctypes.c_int64),
    ("L", ctypes.c_int64), ("S", ctypes.c_int64), ("E", ctypes.c_int64), ("Ev", ctypes.c_int64),
    ("q", ctypes.c_void_p), ("q_strides", I64x4),
    ("k", ctypes.c_void_p), ("k_strides", I64x4),
    ("v", ctypes.c_void_p), ("v_strides", I64x4),
    ("out", ctypes.c_void_p), ("out_strides", I64x4),
    ("lse", ctypes.c_void_p), ("lse_strides", I64x3),       # float32 (float64 for float64 calls)
    ("max_scores", ctypes.c_void_p), ("max_strides", I64x3),
    # Block tables, int32: counts (B, Hq, QB), lists (B, Hq, QB, W).
    ("kv_num", ctypes.c_void_p), ("kv_num_strides", I64x3),
    ("kv_idx", ctypes.c_void_p), ("kv_idx_strides", I64x4), ("kv_idx_width", ctypes.c_int64),
    ("full_num", ctypes.c_void_p), ("full_num_strides", I64x3),
    ("full_idx", ctypes.c_void_p), ("full_idx_strides", I64x4), ("full_idx_width", ctypes.c_int64),
    ("q_block", ctypes.c_int64), ("kv_block", ctypes.c_int64),
    ("scale", ctypes.c_double),
    ("sinks", ctypes.c_void_p), ("sinks_strides", I64x2),   # (B, Hq) in the softmax dtype, or null
    ("dropout_threshold", ctypes.c_int64),                   # 0: no dropout
    ("dropout_scale", ctypes.c_double),
    ("seed_key", ctypes.c_uint64), ("seed_stream", ctypes.c_uint64),
    # The plan (plan.py).
    ("q_tile", ctypes.c_int64), ("kv_tile", ctypes.c_int64), ("threads", ctypes.c_int64),
    ("deterministic", ctypes.c_int64),                       # 1: static schedule, ordered sums
    # The mods: function pointers of the mod library (null: identity score_mod, mask
    # always true, no captured-tensor gradients), and their context.
    ("score_fn", ctypes.c_void_p), ("mask_fn", ctypes.c_void_p), ("joint_fn", ctypes.c_void_p),
    ("ctx", ctypes.c_void_p),                                # const FaModContext*
    ("grad_numels", ctypes.c_void_p), ("num_grads", ctypes.c_int64),  # const int64_t*
    # Backward only (``out`` above is then the forward's output, an input).
    ("grad_out", ctypes.c_void_p), ("grad_out_strides", I64x4),
    ("grad_lse", ctypes.c_void_p), ("grad_lse_strides", I64x3),  # (B, Hq, L) or null
    ("grad_q", ctypes.c_void_p), ("grad_q_strides", I64x4),
    ("grad_k", ctypes.c_void_p), ("grad_k_strides", I64x4),
    ("grad_v", ctypes.c_void_p), ("grad_v_strides", I64x4),
    # BLAS: the Fortran sgemm_ / dgemm_ torch links and MKL's MKL_Set_Num_Threads_Local
    # (null where torch's BLAS is not MKL) (build.blas_symbols).
    ("sgemm", ctypes.c_void_p), ("dgemm", ctypes.c_void_p), ("blas_threads_local", ctypes.c_void_p),
)


class ModContext(ctypes.Structure):
    _fields_ = list(MOD_CONTEXT_FIELDS)


class CallArgs(ctypes.Structure):
    _fields_ = list(CALL_FIELDS)


class MathTable(ctypes.Structure):
    _fields_ = _math_table()


_C_TYPES = {ctypes.c_void_p: "void*", ctypes.c_int64: "int64_t", ctypes.c_uint64: "uint64_t",
            ctypes.c_double: "double"}


def _c_field(name: str, ctype) -> str:
    if isinstance(ctype, type) and issubclass(ctype, ctypes.Array):
        return f"  {_C_TYPES[ctype._type_]} {name}[{ctype._length_}];"
    return f"  {_C_TYPES[ctype]} {name};"


def _c_struct(name: str, fields: Sequence[tuple[str, type]]) -> str:
    return "struct " + name + " {\n" + "\n".join(_c_field(n, t) for n, t in fields) + "\n};"


def c_declarations() -> str:
    """The C structs ``FaModContext``, ``FaCallArgs`` and ``FaMath`` (every pointer
    ``void*``: each side casts to what the field's comment says)."""
    return "\n\n".join([_c_struct("FaModContext", MOD_CONTEXT_FIELDS), _c_struct("FaCallArgs", CALL_FIELDS),
                        _c_struct("FaMath", _math_table())])


def _x_macro(name: str, entries: Sequence[str]) -> str:
    return f"#define {name}(X)" + "".join(f" \\\n  X({e})" for e in entries)


def generated_header() -> str:
    """``abi_generated.h``: FA_MAX_ROW, the structs (``c_declarations``) and the X-macros
    listing the math table's functions (FA_MATH: every name; FA_UNARY_VEC_MATH and
    FA_BINARY_VEC_MATH: (name, ``at::vec`` method); FA_UNARY_STD_MATH and
    FA_BINARY_STD_MATH: the names computed by a loop of the ``std::`` function)."""
    macros = [
        _x_macro("FA_MATH", [name for name, _ in UNARY_MATH + BINARY_MATH]),
        _x_macro("FA_UNARY_VEC_MATH", [f"{name}, {method}" for name, method in UNARY_MATH if method]),
        _x_macro("FA_UNARY_STD_MATH", [name for name, method in UNARY_MATH if not method]),
        _x_macro("FA_BINARY_VEC_MATH", [f"{name}, {method}" for name, method in BINARY_MATH if method]),
        _x_macro("FA_BINARY_STD_MATH", [name for name, method in BINARY_MATH if not method]),
    ]
    return "\n\n".join([f"#define FA_MAX_ROW {MAX_ROW}", c_declarations(), *macros]) + "\n"


_STRIDE_ARRAYS = {n: ctypes.c_int64 * n for n in range(1, 5)}


def strides(t: torch.Tensor | None, n: int):
    """A tensor's strides as the fixed-size array of a CallArgs field (zeros for None)."""
    return _STRIDE_ARRAYS[n]() if t is None else _STRIDE_ARRAYS[n](*t.stride())


def data(t: torch.Tensor | None) -> int | None:
    return None if t is None or t.numel() == 0 else t.data_ptr()

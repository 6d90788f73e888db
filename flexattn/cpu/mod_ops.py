"""Inductor's ``ops`` -> C++ text: the ops handler that records one function of a CPU
mod library (``mod_library.py`` says how the statements become loops).

``RowEmitter`` answers each op Inductor's IR calls with a ``Val``: a C++ name (or a
constant's literal), its dtype, and whether it varies along the row of keys (it reads
kv_idx or the score) or is uniform (b, h, q_idx, captured tensors read at such
positions). Each op records a ``Stmt``; a transcendental function of a varying value
records a ``Boundary`` instead (one call of the engine's vectorised math table over the
whole row) and starts a new segment. float16/bfloat16 values are carried in float and
rounded where the IR converts to them; an index taken from a value
(``ops.indirect_indexing``) is clamped into its tensor's size.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import sympy
import torch
from torch._inductor.codegen.cpp_utils import cexpr
from torch._inductor.virtualized import OpsValue, V

from . import abi

#: C types of the values a mod computes (float16 and bfloat16 are carried in float and
#: rounded where the IR converts to them).
_CTYPES = {
    torch.bool: "bool", torch.uint8: "uint8_t", torch.int8: "int8_t", torch.int16: "int16_t",
    torch.int32: "int32_t", torch.int64: "int64_t", torch.float16: "float", torch.bfloat16: "float",
    torch.float32: "float", torch.float64: "double",
}
#: C types of captured tensors' elements in memory.
STORAGE = {**_CTYPES, torch.bool: "uint8_t", torch.float16: "uint16_t", torch.bfloat16: "uint16_t"}

_UNARY_MATH = {name for name, _ in abi.UNARY_MATH}
_BINARY_MATH = {name for name, _ in abi.BINARY_MATH}


class CppModError(RuntimeError):
    """A mod uses an operation flexattn's CPU kernels cannot evaluate."""


def ctype(dtype: torch.dtype) -> str:
    try:
        return _CTYPES[dtype]
    except KeyError:
        raise CppModError(f"flexattn: a mod computes with {dtype}, which the CPU kernels do not support") from None


@dataclass(eq=False)
class Val:
    """A value of the function being rendered: ``name`` in C (a constant's literal when
    ``literal``), its dtype, whether it varies along the row, and where it lives: the
    segment whose loop defines it as a scalar, or, when ``reload`` is set, an
    expression of ``j`` each loop that uses it reads it from (a row array, the input
    score, kv0 + j)."""

    name: str
    dtype: torch.dtype
    varying: bool
    segment: int = -1
    literal: bool = False
    reload: str | None = None
    value: Any = None  # a constant's Python value

    @property
    def ctype(self) -> str:
        return ctype(self.dtype)


@dataclass(eq=False)
class Stmt:
    """One C statement: ``text`` with ``{0}``, ``{1}``, ... standing for ``inputs``'
    names; ``result`` the value it defines (None for a store). ``children``: a masked
    block's statements, emitted inside it."""

    text: str
    inputs: list
    result: Val | None
    segment: int
    varying: bool
    children: list = field(default_factory=list)


@dataclass(eq=False)
class Boundary:
    """The end of segment ``segment``: ``fn`` of the math table maps ``args`` (row
    arrays) into ``result``'s array."""

    fn: str
    args: list
    result: Val
    segment: int


class RowEmitter:
    """The ops handler that records one function's statements (see the module doc)."""

    def __init__(self, library, placeholders: dict[str, Val]):
        """``library``: the ModLibrary whose buffer and symbol slots the loads take."""
        self.library = library
        self.placeholders = placeholders
        self.stmts: list[Any] = []
        self.segment = 0
        self.names = itertools.count()
        self.index_vals: dict[sympy.Symbol, Val] = {}
        self.nested: list | None = None

    # -- bookkeeping ----------------------------------------------------------------
    def _new_name(self, prefix: str = "t") -> str:
        return f"{prefix}{next(self.names)}"

    def _record(self, stmt) -> None:
        (self.nested if self.nested is not None else self.stmts).append(stmt)

    def value(self, text: str, inputs: Sequence, dtype: torch.dtype) -> Val:
        inputs = [self._as_val(x) for x in inputs]
        varying = any(v.varying for v in inputs)
        result = Val(self._new_name(), dtype, varying, self.segment if varying else -1)
        self._record(Stmt(f"const {result.ctype} {result.name} = {text};", inputs, result, result.segment, varying))
        return result

    def _as_val(self, x) -> Val:
        if isinstance(x, OpsValue):
            x = x.value
        if isinstance(x, Val):
            return x
        if isinstance(x, bool):
            return self.constant(x, torch.bool)
        if isinstance(x, int):
            return self.constant(x, torch.int64)
        if isinstance(x, float):
            return self.constant(x, torch.float32)
        raise CppModError(f"flexattn: unexpected operand {x!r} in a mod")

    def _math(self, fn: str, args: Sequence[Val], dtype: torch.dtype) -> Val:
        """A transcendental function: one std:: call for uniform arguments (and inside
        masked blocks), else the math table over the row (a segment boundary)."""
        args = [self._as_val(a) for a in args]
        if self.nested is not None or not any(a.varying for a in args):
            refs = ", ".join("{%d}" % i for i in range(len(args)))
            return self.value(f"static_cast<{ctype(dtype)}>(std::{fn}({refs}))", args, dtype)
        if dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            raise CppModError(f"flexattn: {fn} of {dtype} values in a mod is not supported on the CPU")
        suffix = "f64" if dtype == torch.float64 else "f32"
        result = Val(self._new_name("r"), dtype, True, self.segment + 1, reload="")
        result.reload = f"{result.name}_row[j]"
        self.stmts.append(Boundary(f"{fn}_{suffix}", args, result, self.segment))
        self.segment += 1
        return result

    # -- sympy ------------------------------------------------------------------------
    def _sympy(self, expr) -> tuple[str, list[Val]]:
        """C text of an index expression, and the values its symbols stand for."""
        expr = sympy.sympify(expr)
        inputs = []
        for sym in expr.free_symbols:
            if sym in self.index_vals:
                inputs.append(self.index_vals[sym])
            else:
                self.library.symbol_slot(sym)
        return cexpr(expr), inputs

    # -- ops --------------------------------------------------------------------------
    def constant(self, value, dtype: torch.dtype) -> Val:
        c = ctype(dtype)
        if dtype == torch.bool:
            text = "true" if value else "false"
        elif dtype.is_floating_point:
            value = float(value)
            if math.isnan(value):
                text = f"std::numeric_limits<{c}>::quiet_NaN()"
            elif math.isinf(value):
                text = f"{'-' if value < 0 else ''}std::numeric_limits<{c}>::infinity()"
            else:
                text = f"static_cast<{c}>({value!r})"
                if dtype in (torch.float16, torch.bfloat16):
                    text = _round_to(dtype, text)
        else:
            text = f"static_cast<{c}>({int(value)}LL)"
        return Val(text, dtype, False, literal=True, value=value)

    def load(self, name: str, index) -> Val:
        if name in self.placeholders:
            return self.placeholders[name]
        dtype = V.graph.get_dtype(name)
        slot = self.library.buffer_slot(name, dtype)
        text, inputs = self._sympy(index)
        element = f"buf{slot}[{text}]"
        if dtype == torch.bfloat16:
            element = f"fa_bf16_bits_to_float({element})"
        elif dtype == torch.float16:
            element = f"fa_half_bits_to_float({element})"
        elif dtype == torch.bool:
            element = f"({element} != 0)"
        return self.value(element, inputs, dtype)

    def indirect_indexing(self, x, size, check=True, wrap_neg=True):
        x = self._as_val(x)
        size_text, size_inputs = self._sympy(size)
        val = self.value(f"fa_clamp_index(static_cast<int64_t>({{0}}), {size_text}, {str(bool(wrap_neg)).lower()})",
                         [x, *size_inputs], torch.int64)
        sym = sympy.Symbol(val.name, integer=True)
        self.index_vals[sym] = val
        return sym

    def index_expr(self, expr, dtype: torch.dtype) -> Val:
        text, inputs = self._sympy(expr)
        return self.value(f"static_cast<{ctype(dtype)}>({text})", inputs, dtype)

    value_expr = index_expr

    def check_bounds(self, expr, size, lower, upper):
        return None

    def to_dtype(self, x, dtype: torch.dtype, src_dtype=None, use_compute_types=True) -> Val:
        x = self._as_val(x)
        if x.literal and x.value is not None:
            return self.constant(torch.tensor(x.value).to(dtype).item(), dtype)
        if dtype == torch.bool:
            return self.value("({0} != 0)", [x], dtype)
        text = "static_cast<%s>({0})" % ctype(dtype)
        if dtype in (torch.float16, torch.bfloat16):
            text = _round_to(dtype, text)
        return self.value(text, [x], dtype)

    def to_dtype_bitcast(self, x, dtype: torch.dtype, src_dtype: torch.dtype) -> Val:
        raise CppModError("flexattn: bitcasts (Tensor.view(dtype)) in a mod are not supported on the CPU")

    def where(self, cond, a, b) -> Val:
        a, b = self._as_val(a), self._as_val(b)
        dtype = torch.promote_types(a.dtype, b.dtype)
        return self.value("({0} ? static_cast<%s>({1}) : static_cast<%s>({2}))" % (ctype(dtype), ctype(dtype)),
                          [cond, a, b], dtype)

    def masked(self, mask, body: Callable, other) -> Val:
        mask = self._as_val(mask)
        outer, self.nested = self.nested, []
        try:
            result = self._as_val(body())
            children = self.nested
        finally:
            self.nested = outer
        other = self._as_val(other) if not isinstance(other, float) else self.constant(other, result.dtype)
        # Inputs from outside the block (uses inside it read them).
        defined = {s.result for s in children if s.result is not None}
        outside = [v for s in children for v in s.inputs if v not in defined and not v.literal]
        inputs = [mask, other, result] + outside
        varying = any(v.varying for v in [mask, other] + outside) or any(s.varying for s in children)
        name = self._new_name("m")
        out = Val(name, result.dtype, varying, self.segment if varying else -1)
        text = (f"{out.ctype} {name} = static_cast<{out.ctype}>({{1}});\n"
                f"if ({{0}}) {{{{\n@@CHILDREN@@\n{name} = static_cast<{out.ctype}>({{2}});\n}}}}")
        self._record(Stmt(text, inputs, out, out.segment, varying, children))
        return out

    # Arithmetic.
    def _binary(self, op: str, a, b, dtype=None) -> Val:
        a, b = self._as_val(a), self._as_val(b)
        dtype = dtype or torch.promote_types(a.dtype, b.dtype)
        return self.value("({0} %s {1})" % op, [a, b], dtype)

    def add(self, a, b):
        return self._binary("+", a, b)

    def sub(self, a, b):
        return self._binary("-", a, b)

    def mul(self, a, b):
        return self._binary("*", a, b)

    def truediv(self, a, b):
        return self._binary("/", a, b)

    div_rn = truediv

    def int_truediv(self, a, b):
        a, b = self._as_val(a), self._as_val(b)
        return self.value("(static_cast<double>({0}) / static_cast<double>({1}))", [a, b], torch.float64)

    def truncdiv(self, a, b):
        return self._binary("/", a, b)

    def floordiv(self, a, b):
        a, b = self._as_val(a), self._as_val(b)
        dtype = torch.promote_types(a.dtype, b.dtype)
        c = ctype(dtype)
        return self.value(f"fa_floordiv<{c}>(static_cast<{c}>({{0}}), static_cast<{c}>({{1}}))", [a, b], dtype)

    def mod(self, a, b):
        a, b = self._as_val(a), self._as_val(b)
        dtype = torch.promote_types(a.dtype, b.dtype)
        if dtype.is_floating_point:
            return self._math("fmod", [a, b], dtype)
        return self._binary("%", a, b, dtype)

    def remainder(self, a, b):
        a, b = self._as_val(a), self._as_val(b)
        dtype = torch.promote_types(a.dtype, b.dtype)
        c = ctype(dtype)
        helper = "fa_float_remainder" if dtype.is_floating_point else "fa_int_remainder"
        return self.value(f"{helper}<{c}>(static_cast<{c}>({{0}}), static_cast<{c}>({{1}}))", [a, b], dtype)

    def pow(self, a, b):
        a, b = self._as_val(a), self._as_val(b)
        dtype = torch.promote_types(a.dtype, b.dtype)
        if not dtype.is_floating_point:
            c = ctype(dtype)
            return self.value(f"fa_int_pow<{c}>(static_cast<{c}>({{0}}), static_cast<{c}>({{1}}))", [a, b], dtype)
        return self._math("pow", [self.to_dtype(a, dtype), self.to_dtype(b, dtype)], dtype)

    def minimum(self, a, b):
        return self._min_max("fa_minimum", "std::min", a, b)

    def maximum(self, a, b):
        return self._min_max("fa_maximum", "std::max", a, b)

    def _min_max(self, float_fn, int_fn, a, b):
        a, b = self._as_val(a), self._as_val(b)
        dtype = torch.promote_types(a.dtype, b.dtype)
        c = ctype(dtype)
        fn = float_fn if dtype.is_floating_point else int_fn
        return self.value(f"{fn}<{c}>(static_cast<{c}>({{0}}), static_cast<{c}>({{1}}))", [a, b], dtype)

    def neg(self, x):
        x = self._as_val(x)
        return self.value("(-{0})", [x], x.dtype)

    def abs(self, x):
        x = self._as_val(x)
        return self.value("std::abs({0})" if x.dtype != torch.bool else "{0}", [x], x.dtype)

    def reciprocal(self, x):
        x = self._as_val(x)
        return self.value("(static_cast<%s>(1) / {0})" % x.ctype, [x], x.dtype)

    def square(self, x):
        x = self._as_val(x)
        return self.value("({0} * {0})", [x], x.dtype)

    def relu(self, x):
        x = self._as_val(x)
        return self.value("({0} > 0 ? {0} : static_cast<%s>(0))" % x.ctype, [x], x.dtype)

    def sigmoid(self, x):
        x = self._as_val(x)
        e = self._math("exp", [self.neg(x)], x.dtype)
        return self.value("(static_cast<%s>(1) / (static_cast<%s>(1) + {0}))" % (x.ctype, x.ctype), [e], x.dtype)

    def fma(self, a, b, c):
        a, b, c = (self._as_val(v) for v in (a, b, c))
        return self.value("std::fma({0}, {1}, {2})", [a, b, c], a.dtype)

    def _rounding(self, fn: str, x):
        x = self._as_val(x)
        if not x.dtype.is_floating_point:
            return x
        return self.value(f"std::{fn}({{0}})", [x], x.dtype)

    def floor(self, x):
        return self._rounding("floor", x)

    def ceil(self, x):
        return self._rounding("ceil", x)

    def trunc(self, x):
        return self._rounding("trunc", x)

    def round(self, x):
        return self._rounding("nearbyint", x)

    def _to_int(self, fn: str, x, dtype):
        return self.to_dtype(self._rounding(fn, x), dtype)

    def trunc_to_int(self, x, dtype):
        return self._to_int("trunc", x, dtype)

    def floor_to_int(self, x, dtype):
        return self._to_int("floor", x, dtype)

    def ceil_to_int(self, x, dtype):
        return self._to_int("ceil", x, dtype)

    def round_to_int(self, x, dtype):
        return self._to_int("nearbyint", x, dtype)

    def sign(self, x):
        x = self._as_val(x)
        return self.value("static_cast<%s>(({0} > 0) - ({0} < 0))" % x.ctype, [x], x.dtype)

    def signbit(self, x):
        return self.value("std::signbit({0})", [x], torch.bool)

    def isnan(self, x):
        return self.value("({0} != {0})", [x], torch.bool)

    def isinf(self, x):
        return self.value("std::isinf({0})", [x], torch.bool)

    def identity(self, x):
        return self._as_val(x)

    # Comparisons and logic.
    def _compare(self, op, a, b):
        return self.value("({0} %s {1})" % op, [a, b], torch.bool)

    def eq(self, a, b):
        return self._compare("==", a, b)

    def ne(self, a, b):
        return self._compare("!=", a, b)

    def lt(self, a, b):
        return self._compare("<", a, b)

    def le(self, a, b):
        return self._compare("<=", a, b)

    def gt(self, a, b):
        return self._compare(">", a, b)

    def ge(self, a, b):
        return self._compare(">=", a, b)

    def logical_and(self, a, b):
        return self.value("(static_cast<bool>({0}) && static_cast<bool>({1}))", [a, b], torch.bool)

    def logical_or(self, a, b):
        return self.value("(static_cast<bool>({0}) || static_cast<bool>({1}))", [a, b], torch.bool)

    def logical_xor(self, a, b):
        return self.value("(static_cast<bool>({0}) != static_cast<bool>({1}))", [a, b], torch.bool)

    def logical_not(self, a):
        return self.value("(!static_cast<bool>({0}))", [a], torch.bool)

    def bitwise_and(self, a, b):
        return self._binary("&", a, b)

    def bitwise_or(self, a, b):
        return self._binary("|", a, b)

    def bitwise_xor(self, a, b):
        return self._binary("^", a, b)

    def bitwise_not(self, a):
        a = self._as_val(a)
        return self.value("(!{0})" if a.dtype == torch.bool else "(~{0})", [a], a.dtype)

    def bitwise_left_shift(self, a, b):
        return self._binary("<<", a, b, self._as_val(a).dtype)

    def bitwise_right_shift(self, a, b):
        return self._binary(">>", a, b, self._as_val(a).dtype)

    and_, or_, xor, lshift, rshift = bitwise_and, bitwise_or, bitwise_xor, bitwise_left_shift, bitwise_right_shift

    def __getattr__(self, name: str):
        if name in _UNARY_MATH:
            return lambda x: self._math(name, [x], self._as_val(x).dtype)
        if name in _BINARY_MATH:
            def binary(a, b):
                a, b = self._as_val(a), self._as_val(b)
                dtype = torch.promote_types(a.dtype, b.dtype)
                return self._math(name, [self.to_dtype(a, dtype), self.to_dtype(b, dtype)], dtype)
            return binary
        if name.startswith("_"):
            raise AttributeError(name)

        def unsupported(*args, **kwargs):
            raise CppModError(f"flexattn: a mod uses the operation {name!r}, which flexattn's CPU kernels "
                              "cannot evaluate")
        return unsupported


def _round_to(dtype: torch.dtype, text: str) -> str:
    return f"{'fa_round_bf16' if dtype == torch.bfloat16 else 'fa_round_half'}(static_cast<float>({text}))"

"""score_mod / mask_mod IR -> the C++ of a CPU mod library (``templates/cpu_mods.cpp.jinja``).

The CPU path lowers a call's mods exactly as the Triton path does (``subgraph.
build_mod_buffer``: a 0-d ``ComputedBuffer`` whose ``inner_fn`` calls Inductor's ``ops``)
and replays each ``inner_fn`` under ``_RowEmitter``, an ops handler of its own that
answers every op with C++ text. The result is a C function over one row segment of a
score tile (``cpu_common.h.jinja`` gives the signatures):

* values that depend only on b, h, q_idx (and captured tensors read at such positions)
  are *uniform*: computed once per row, before the loops;
* values that depend on kv_idx or the score are *varying*: computed inside loops over
  ``j`` (key ``kv0 + j``), one loop per *segment*. A transcendental function (exp, tanh,
  ...) of a varying value ends a segment: its argument is stored to a row array, one
  call of the engine's vectorised math table maps the whole row, and later segments
  read the result back. Each loop is plain elementwise C++ the compiler vectorises.

Captured tensors are read through ``ctx->buffers`` at the index Inductor computed from
their layout; an index taken from a value (``ops.indirect_indexing``) is clamped into
the tensor's size, since a tile also evaluates the mods at positions the block mask
excludes (their scores are discarded, and must not read out of bounds). Symbolic sizes
in indices come from ``ctx->symbols``, whose order ``ModLibrary.symbols`` records.
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

from .. import cpu_abi
from ..cpu_abi import common_header
from ..templates import render_cpp

#: C types of the values a mod computes (float16 and bfloat16 are carried in float and
#: rounded where the IR converts to them).
_CTYPES = {
    torch.bool: "bool", torch.uint8: "uint8_t", torch.int8: "int8_t", torch.int16: "int16_t",
    torch.int32: "int32_t", torch.int64: "int64_t", torch.float16: "float", torch.bfloat16: "float",
    torch.float32: "float", torch.float64: "double",
}
#: C types of captured tensors' elements in memory.
_STORAGE = {**_CTYPES, torch.bool: "uint8_t", torch.float16: "uint16_t", torch.bfloat16: "uint16_t"}

_UNARY_MATH = {name for name, _ in cpu_abi.UNARY_MATH}
_BINARY_MATH = {name for name, _ in cpu_abi.BINARY_MATH}


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


class _RowEmitter:
    """The ops handler that records one function's statements (see the module doc)."""

    def __init__(self, library: "ModLibrary", placeholders: dict[str, Val]):
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


# --------------------------------------------------------------------------------------
# Emission
# --------------------------------------------------------------------------------------
def _format(stmt: Stmt) -> str:
    text = stmt.text.format(*[v.name for v in stmt.inputs])
    if stmt.children:
        text = text.replace("@@CHILDREN@@", "\n".join(_format(c) for c in stmt.children))
    return text


def _row_array(v: Val) -> str:
    return f"{v.name}_row"


def _emit_body(stmts: list, outputs: list[Stmt], prelude: list[str], epilogue: list[str]) -> str:
    """The statements of one function: ``prelude``, the uniform statements, one loop per
    segment with the math-table calls between them, ``outputs`` (stores) in the last
    loop, then ``epilogue``.

    Inside a loop every value it uses is a scalar: defined by the loop itself, or read at
    the loop's top (``reload``: an input row, ``kv0 + j``, or the row array an earlier
    loop or a math call filled)."""
    boundaries = [s for s in stmts if isinstance(s, Boundary)]
    last = len(boundaries)
    uses: dict[Val, set[int]] = {}

    def note(values, segment):
        for v in values:
            if v.varying or segment >= 0:
                uses.setdefault(v, set()).add(segment)

    for s in stmts:
        if isinstance(s, Stmt) and s.varying:
            note(s.inputs, s.segment)
    for s in outputs:
        note(s.inputs, last)
    # Which values a loop must store to a row array, and in which loop.
    store_in: dict[Val, int] = {}
    for bnd in boundaries:
        for arg in bnd.args:
            if arg.reload != f"{_row_array(arg)}[j]":
                store_in.setdefault(arg, bnd.segment)
                if arg.varying:
                    uses.setdefault(arg, set()).add(bnd.segment)
    for v, used_in in uses.items():
        if v.varying and v.reload is None and any(u > v.segment for u in used_in):
            store_in[v] = min(store_in.get(v, v.segment), v.segment)

    lines = list(prelude)
    lines += [_format(s) for s in stmts if isinstance(s, Stmt) and not s.varying]
    declared = sorted(set(store_in) | {b.result for b in boundaries}, key=lambda v: v.name)
    lines += [f"{v.ctype} {_row_array(v)}[FA_MAX_ROW];" for v in declared]
    for segment in range(last + 1):
        body = []
        for v in sorted(uses, key=lambda v: v.name):
            if v.varying and segment in uses[v] and (v.reload is not None or v.segment < segment):
                body.append(f"const {v.ctype} {v.name} = {v.reload or _row_array(v) + '[j]'};")
        body += [_format(s) for s in stmts if isinstance(s, Stmt) and s.varying and s.segment == segment]
        body += [f"{_row_array(v)}[j] = {v.name};" for v in declared if store_in.get(v) == segment]
        if segment == last:
            body += [_format(s) for s in outputs]
        if body:
            lines.append("for (int64_t j = 0; j < n; ++j) {")
            lines += ["  " + line for text in body for line in text.split("\n")]
            lines.append("}")
        if segment < last:
            bnd = boundaries[segment]
            kind = "Unary" if len(bnd.args) == 1 else "Binary"
            suffix = "F64" if bnd.fn.endswith("f64") else "F32"
            rows = ", ".join(_row_array(a) for a in bnd.args)
            lines.append(f"reinterpret_cast<Fa{kind}{suffix}>(math->{bnd.fn})({_row_array(bnd.result)}, {rows}, n);")
    lines += epilogue
    return "\n".join(lines)


@dataclass
class GradTerm:
    """``grads[slot][linear(indices)] += value`` for one scatter term of a captured
    tensor's gradient (``buffer_grads.scatter_terms``); ``sizes`` is the tensor's shape."""

    slot: int
    value_fn: Callable
    index_fns: list
    sizes: list


class ModLibrary:
    """The mod library of one call: its functions, the captured tensors they read (in
    ``ctx->buffers`` order) and the symbolic sizes they use (``ctx->symbols`` order)."""

    def __init__(self, acc_dtype: torch.dtype):
        self.acc_dtype = acc_dtype
        self.acc = ctype(acc_dtype)
        self.buffers: list[str] = []
        self.buffer_dtypes: dict[str, torch.dtype] = {}
        self.symbols: list[sympy.Symbol] = []
        self.functions: list[str] = []
        self.exports: list[str] = []

    def buffer_slot(self, name: str, dtype: torch.dtype) -> int:
        if name not in self.buffers:
            self.buffers.append(name)
            self.buffer_dtypes[name] = dtype
        return self.buffers.index(name)

    def symbol_slot(self, sym: sympy.Symbol) -> int:
        if sym not in self.symbols:
            self.symbols.append(sym)
        return self.symbols.index(sym)

    def _prologue(self) -> list[str]:
        """Declarations of the captured tensors and symbols a function may use (the
        compiler drops the unused ones); written after rendering, when all are known."""
        lines = ["const FaMath* math = static_cast<const FaMath*>(ctx->math);", "(void)math;",
                 "const int32_t b = static_cast<int32_t>(b_), h = static_cast<int32_t>(h_);",
                 "const int32_t q_idx = static_cast<int32_t>(q_);", "(void)b; (void)h; (void)q_idx;"]
        for slot, name in enumerate(self.buffers):
            storage = _STORAGE[self.buffer_dtypes[name]]
            lines.append(f"const {storage}* buf{slot} = static_cast<const {storage}*>("
                         f"static_cast<void* const*>(ctx->buffers)[{slot}]); (void)buf{slot};")
        for slot, sym in enumerate(self.symbols):
            lines.append(f"const int64_t {cexpr(sym)} = static_cast<const int64_t*>(ctx->symbols)[{slot}]; "
                         f"(void){cexpr(sym)};")
        return lines

    def _placeholders(self, names_and_dtypes, reloads: dict[str, str]) -> dict[str, Val]:
        vals = {}
        for name, dtype in names_and_dtypes:
            if name in reloads:
                vals[name] = Val(name, dtype, True, reload=reloads[name])
            else:
                vals[name] = Val(name, dtype, False)
        return vals

    def _render(self, loaders: list[tuple[Callable, Callable[[Val], str]]], placeholders: dict[str, Val],
                grad_terms: Sequence[GradTerm] = ()) -> str:
        """The body of one function: each loader's value stored by its ``store``, and
        the captured-tensor gradient terms added into ``ctx->grads``."""
        emitter = _RowEmitter(self, placeholders)
        outputs: list[Stmt] = []
        for loader, store in loaders:
            with V.set_ops_handler(emitter):
                result = emitter._as_val(loader(()))
            outputs.append(Stmt(store(result), [result], None, -1, True))
        prelude, epilogue = [], []
        for k, term in enumerate(grad_terms):
            with V.set_ops_handler(emitter):
                value = emitter._as_val(emitter.to_dtype(term.value_fn(()), self.acc_dtype))
                indices = [emitter._as_val(emitter.to_dtype(fn(()), torch.int64)) for fn in term.index_fns]
            linear = "0"
            for i, size in enumerate(term.sizes):
                size_text = emitter._sympy(size)[0]
                linear = f"({linear}) * ({size_text}) + fa_clamp_index({{{i + 1}}}, {size_text}, true)"
            if any(v.varying for v in indices):
                text = f"if ({{0}} != 0) fa_grad_add<{self.acc}>(ctx, {term.slot}, {linear}, {{0}});"
                outputs.append(Stmt(text, [value, *indices], None, -1, True))
            else:
                # One entry for the whole row (an index of b, h, q_idx only): summed
                # over the row, then added once.
                total = f"grad_sum{k}"
                prelude.append(f"{self.acc} {total} = 0;")
                outputs.append(Stmt(f"{total} += {{0}};", [value], None, -1, True))
                names = [total] + [v.name for v in indices]
                epilogue.append(f"if ({{0}} != 0) fa_grad_add<{self.acc}>(ctx, {term.slot}, {linear}, {{0}});"
                                .format(*names))
        return _emit_body(emitter.stmts, outputs, prelude, epilogue)

    def add_score(self, score_buffer, score_dtype: torch.dtype) -> None:
        placeholders = self._placeholders(_score_args(score_dtype), {"score": "s[j]", "kv_idx": "static_cast<int32_t>(kv0 + j)"})
        store = lambda v: f"s[j] = static_cast<{self.acc}>({v.name});"  # noqa: E731
        body = self._render([(score_buffer.data.inner_fn, store)], placeholders)
        self._add("fa_score", f"void* s_, int64_t n, int64_t b_, int64_t h_, int64_t q_, int64_t kv0, "
                  "const FaModContext* ctx", [f"{self.acc}* s = static_cast<{self.acc}*>(s_);"], body)

    def add_mask(self, mask_buffer) -> bool:
        """The mask function; False (and nothing added) when the mask is constant true."""
        placeholders = self._placeholders(_score_args(torch.float32)[1:], {"kv_idx": "static_cast<int32_t>(kv0 + j)"})
        store = lambda v: f"keep[j] = static_cast<uint8_t>({v.name} != 0);"  # noqa: E731
        probe = _RowEmitter(ModLibrary(self.acc_dtype), placeholders)
        with V.set_ops_handler(probe):
            result = probe._as_val(mask_buffer.data.inner_fn(()))
        if result.literal and result.value is not None and bool(result.value):
            return False
        body = self._render([(mask_buffer.data.inner_fn, store)], placeholders)
        self._add("fa_mask", "uint8_t* keep, int64_t n, int64_t b_, int64_t h_, int64_t q_, int64_t kv0, "
                  "const FaModContext* ctx", [], body)
        return True

    def add_joint(self, grad_score_buffer, grad_terms: Sequence[GradTerm], score_dtype: torch.dtype) -> None:
        args = _score_args(score_dtype) + [("grad_score_out", score_dtype)]
        placeholders = self._placeholders(args, {"score": "s[j]", "kv_idx": "static_cast<int32_t>(kv0 + j)", "grad_score_out": "g[j]"})
        store = lambda v: f"g[j] = static_cast<{self.acc}>({v.name});"  # noqa: E731
        body = self._render([(grad_score_buffer.data.inner_fn, store)], placeholders, grad_terms)
        self._add("fa_joint", "void* g_, const void* s_, int64_t n, int64_t b_, int64_t h_, int64_t q_, "
                  "int64_t kv0, const FaModContext* ctx",
                  [f"{self.acc}* g = static_cast<{self.acc}*>(g_);",
                   f"const {self.acc}* s = static_cast<const {self.acc}*>(s_);"], body)

    def _add(self, name: str, params: str, locals_: list[str], body: str) -> None:
        self.functions.append((name, params, locals_, body))
        self.exports.append(name)

    def source(self) -> str:
        """The library's C++ (after every function was added)."""
        functions = []
        for name, params, locals_, body in self.functions:
            lines = [f"void {name}_impl({params}) {{"]
            lines += ["  " + x for x in self._prologue() + locals_]
            lines += ["  " + x for x in body.split("\n")]
            lines.append("}")
            functions.append("\n".join(lines))
        exports = "\n".join(
            f'extern "C" void {name}({params}) {{ {name}_impl({", ".join(_param_names(params))}); }}'
            for name, params, _, _ in self.functions)
        return render_cpp("cpu_mods.cpp", COMMON=common_header(), FUNCTIONS="\n\n".join(functions), EXPORTS=exports)


def _param_names(params: str) -> list[str]:
    return [p.strip().split()[-1].lstrip("*") for p in params.split(",")]


def _score_args(score_dtype: torch.dtype) -> list[tuple[str, torch.dtype]]:
    return [("score", score_dtype), ("b", torch.int32), ("h", torch.int32), ("q_idx", torch.int32),
            ("kv_idx", torch.int32)]

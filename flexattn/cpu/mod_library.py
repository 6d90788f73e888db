"""score_mod / mask_mod IR -> the C++ of a CPU mod library (``csrc/mods.cpp.jinja``).

The CPU path lowers a call's mods exactly as the Triton path does (``subgraph.
build_mod_buffer``: a 0-d ``ComputedBuffer`` whose ``inner_fn`` calls Inductor's ``ops``)
and replays each ``inner_fn`` under ``mod_ops.RowEmitter``, an ops handler of its own
that answers every op with C++ text. The result is a C function over one row segment of a
score tile (``csrc/abi.h`` gives the signatures):

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

from dataclasses import dataclass
from typing import Callable, Sequence

import sympy
import torch
from torch._inductor.codegen.cpp_utils import cexpr
from torch._inductor.virtualized import V

from .mod_ops import STORAGE, Boundary, RowEmitter, Stmt, Val, ctype
from .sources import mod_library_source


#: How a loop reads kv_idx.
_KV_IDX = "static_cast<int32_t>(kv0 + j)"


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
            storage = STORAGE[self.buffer_dtypes[name]]
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
        emitter = RowEmitter(self, placeholders)
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
        placeholders = self._placeholders(_score_args(score_dtype), {"score": "s[j]", "kv_idx": _KV_IDX})
        store = lambda v: f"s[j] = static_cast<{self.acc}>({v.name});"  # noqa: E731
        body = self._render([(score_buffer.data.inner_fn, store)], placeholders)
        self._add("fa_score", "void* s_, int64_t n, int64_t b_, int64_t h_, int64_t q_, int64_t kv0, "
                  "const FaModContext* ctx", [f"{self.acc}* s = static_cast<{self.acc}*>(s_);"], body)

    def add_mask(self, mask_buffer) -> bool:
        """The mask function; False (and nothing added) when the mask is constant true."""
        placeholders = self._placeholders(_score_args(torch.float32)[1:], {"kv_idx": _KV_IDX})
        store = lambda v: f"keep[j] = static_cast<uint8_t>({v.name} != 0);"  # noqa: E731
        probe = RowEmitter(ModLibrary(self.acc_dtype), placeholders)
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
        placeholders = self._placeholders(args, {"score": "s[j]", "kv_idx": _KV_IDX, "grad_score_out": "g[j]"})
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
        return mod_library_source("\n\n".join(functions), exports)


def _param_names(params: str) -> list[str]:
    return [p.strip().split()[-1].lstrip("*") for p in params.split(",")]


def _score_args(score_dtype: torch.dtype) -> list[tuple[str, torch.dtype]]:
    return [("score", score_dtype), ("b", torch.int32), ("h", torch.int32), ("q_idx", torch.int32),
            ("kv_idx", torch.int32)]

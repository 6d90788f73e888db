"""What kind of mod a callable is, read off its signature: a mask_mod takes
``(b, h, q_idx, kv_idx)``, a score_mod ``(score, b, h, q_idx, kv_idx)``; and the tensors
it captures."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
MASK_MOD_ARITY = 4
SCORE_MOD_ARITY = 5


def mod_name(mod: Any) -> str:
    """A mod's name for messages: its ``__name__``, else its type's."""
    return getattr(mod, "__name__", type(mod).__name__)


def check_mask_mods(combinator: str, mask_mods: tuple[Any, ...]) -> None:
    """The arguments of a mask combinator (and_masks, or_masks): one callable or more."""
    if not mask_mods:
        raise TypeError(f"{combinator}() needs at least one mask_mod, got none")
    for position, mask_mod in enumerate(mask_mods):
        if not callable(mask_mod):
            raise TypeError(
                f"{combinator}(): argument {position} must be a callable "
                f"mask_mod(b, h, q_idx, kv_idx), got {type(mask_mod).__name__}: {mask_mod!r}"
            )


def required_positional_count(fn: Callable[..., Any]) -> int | None:
    """Number of positional parameters without defaults; None if it takes ``*args``."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    count = 0
    for parameter in parameters:
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            return None
        if (
            parameter.kind
            in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
            and parameter.default is inspect.Parameter.empty
        ):
            count += 1
    return count


def code_arity(fn: Any) -> int | None:
    """required_positional_count of a plain function, read from its code object (which
    Dynamo can trace); None for other callables (methods, partials, objects) and *args."""
    code = getattr(fn, "__code__", None)
    if code is None or inspect.ismethod(fn) or code.co_flags & inspect.CO_VARARGS:
        return None
    return code.co_argcount - len(fn.__defaults__ or ())


def mod_arity(fn: Any, argument: str) -> int:
    """Validate a score_mod/mask_mod and return its arity (MASK_MOD_ARITY or
    SCORE_MOD_ARITY); a TypeError naming ``argument`` for anything else."""
    if not callable(fn):
        raise TypeError(
            f"{argument} must be a callable mask_mod(b, h, q_idx, kv_idx) or "
            f"score_mod(score, b, h, q_idx, kv_idx), got {type(fn).__name__}: {fn!r}"
        )
    if torch.compiler.is_compiling():
        # Dynamo cannot trace inspect.signature. Other callables than plain functions
        # are taken as mask_mods: Dynamo checks the call when it traces the mod.
        arity = code_arity(fn)
        if arity is None:
            return MASK_MOD_ARITY
    else:
        arity = required_positional_count(fn)
    if arity not in (MASK_MOD_ARITY, SCORE_MOD_ARITY):
        received = "a variable number (*args)" if arity is None else str(arity)
        raise TypeError(
            f"{argument} must take 4 positional arguments (b, h, q_idx, kv_idx) for a "
            f"mask_mod or 5 (score, b, h, q_idx, kv_idx) for a score_mod; "
            f"{mod_name(fn)} takes {received}"
        )
    return arity


def captured_tensors(fn: Any) -> list[Tensor]:
    """The tensors a mod reads without taking them as arguments: in its closure cells, in
    the globals its code names, in modules' parameters and buffers and bound methods'
    objects it holds, through the callables, lists and tuples it holds (combined masks),
    each once."""
    found: dict[int, Tensor] = {}
    seen: set[int] = set()

    def visit(obj: Any) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, Tensor):
            found.setdefault(id(obj), obj)
        elif isinstance(obj, torch.nn.Module):
            for tensor in (*obj.parameters(), *obj.buffers()):
                visit(tensor)
        elif callable(obj):
            for cell in getattr(obj, "__closure__", None) or ():
                try:
                    visit(cell.cell_contents)
                except ValueError:  # an empty cell
                    pass
            code, module_globals = getattr(obj, "__code__", None), getattr(obj, "__globals__", None)
            if code is not None and module_globals is not None:
                for name in code.co_names:
                    if name in module_globals:
                        visit(module_globals[name])
            visit(getattr(obj, "__self__", None))
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item)

    visit(fn)
    return list(found.values())

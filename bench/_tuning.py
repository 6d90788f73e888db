"""Shared setup of the GPU tools (tune.py, profiler.py, ab_decode.py, ab_forward.py and the
experiments): Dynamo settings for many pinned compiles, the ``--grid`` product, medians
taken in rounds in turn, a parser for tools whose options depend on ``--kernel``, and
template variants of the Gluon kernels compiled apart."""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from typing import Any, Callable, Sequence

import torch


def allow_recompiles() -> None:
    """Each pinned configuration is a recompile of the same frame; without this Dynamo
    stops compiling after its recompile limit and the rest of a sweep would time the
    uncompiled function. Shapes stay static: a sweep over batch sizes or lengths would
    otherwise reuse one symbolic-shape compile, whose host-side choices (tiles, splits)
    were made from the first changed shape's sizes."""
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 10_000)
    torch._dynamo.config.automatic_dynamic_shapes = False


def compiled_own_code(name: str, signature: str, body: str, namespace: dict) -> Callable:
    """``torch.compile`` of ``def name(signature): body`` made from source, so that it has a
    code object of its own: Dynamo keys its graphs by code object and guards, which calls
    differing only in a variant of a template (installed between compiles) share."""
    source = f"def {name}({signature}):\n" + "".join(f"    {line}\n" for line in body.splitlines())
    exec(compile(source, f"<{name}>", "exec"), namespace)
    return torch.compile(namespace[name])


_TEMPLATES: dict[tuple[str, str], Any] = {}


def install_gluon_template(kernel: str, name: str, source: str) -> None:
    """Point flexattn's lowering of the Gluon ``kernel`` ("forward" or "backward") at the
    template text ``source``, known as variant ``name``: Inductor keeps one template per
    name for the process, so each variant's is built once and later calls reuse it."""
    import importlib

    from flexattn.lowering.gluon_template import GluonTemplate

    module = importlib.import_module(f"flexattn.lowering.gluon_{kernel}")
    if (kernel, name) not in _TEMPLATES:
        _TEMPLATES[kernel, name] = GluonTemplate(name=f"{module.TEMPLATE_NAME}_{len(_TEMPLATES)}",
                                                       grid=getattr(module, f"gluon_{kernel}_grid"), source=source)
    setattr(module, f"gluon_{kernel}_template", _TEMPLATES[kernel, name])



def install_triton_backward_template(name: str, source: str) -> None:
    """Point flexattn's Triton backward lowering at the template text ``source``, known as
    variant ``name`` (one template per name for the process)."""
    from torch._inductor.select_algorithm import TritonTemplate

    from flexattn.lowering import backward

    if ("triton_backward", name) not in _TEMPLATES:
        _TEMPLATES["triton_backward", name] = TritonTemplate(
            name=f"{backward.TEMPLATE_NAME}_{len(_TEMPLATES)}", grid=backward.backward_grid, source=source)
    backward.backward_template = _TEMPLATES["triton_backward", name]

def grid_settings(grid_json: str) -> list[dict]:
    """Every combination of a ``--grid`` JSON object (kernel_options key -> list of
    values) as one kernel_options dict; [{}] for an empty grid."""
    grid = json.loads(grid_json)
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


def medians_in_turn(fns: dict[str, Callable], *args, rounds: int = 5,
                    timer: Callable[[Callable], float] | None = None) -> dict[str, float]:
    """{name: median ms} of ``fns[name](*args)`` over ``rounds`` rounds taken in turn (so a
    slow spell of the machine hits every call alike), after a first call of each (the
    compile); ``timer(call) -> ms`` defaults to do_bench with 25 ms warm-up, 100 ms timed."""
    if timer is None:
        from triton.testing import do_bench

        def timer(call):
            return do_bench(call, warmup=25, rep=100)
    for fn in fns.values():
        fn(*args)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(timer(lambda: fn(*args)))
    return {name: statistics.median(t) for name, t in times.items()}


class KernelParser:
    """An argparse parser with a required ``--kernel`` whose other options each apply to
    some of the kernels, with a default per kernel. Giving an option that the chosen
    kernel does not read is an error, so that no option is silently ignored."""

    def __init__(self, description: str, kernels: Sequence[str]):
        self.parser = argparse.ArgumentParser(description=description,
                                              formatter_class=argparse.RawDescriptionHelpFormatter)
        self.parser.add_argument("--kernel", required=True, choices=kernels)
        self.defaults: dict[str, dict[str, Any]] = {kernel: {} for kernel in kernels}

    def add(self, flag: str, defaults: dict[str, Any], help: str, **kwargs) -> None:
        """``--flag`` for the kernels in ``defaults`` (kernel -> its default value)."""
        dest = flag.lstrip("-").replace("-", "_")
        for kernel, value in defaults.items():
            self.defaults[kernel][dest] = value
        shown = ", ".join(f"{kernel}: {value!r}" for kernel, value in defaults.items())
        self.parser.add_argument(flag, default=None, help=f"{help} [{shown}]", **kwargs)

    def parse(self, argv: Sequence[str] | None = None) -> argparse.Namespace:
        args = self.parser.parse_args(argv)
        own = self.defaults[args.kernel]
        for dest, value in vars(args).items():
            if dest == "kernel":
                continue
            if dest not in own:
                if value is not None:
                    self.parser.error(f"--{dest.replace('_', '-')} does not apply to --kernel {args.kernel}")
            elif value is None:
                setattr(args, dest, own[dest])
        return args

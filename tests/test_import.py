"""``import flexattn`` is cheap: it imports neither Dynamo nor Inductor (they register
flexattn's pieces when they are imported or first trace a call), and takes well under
half a second over ``import torch``."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

import flexattn

PROBE = """
import json, sys, time
import torch
start = time.perf_counter()
import flexattn
took = time.perf_counter() - start
print(json.dumps({"seconds": took, "dynamo": "torch._dynamo" in sys.modules,
                  "inductor": "torch._inductor" in sys.modules}))
"""


def test_import_is_lazy_and_fast():
    result = json.loads(subprocess.run([sys.executable, "-c", PROBE], check=True, capture_output=True,
                                       text=True).stdout.strip().splitlines()[-1])
    assert not result["dynamo"] and not result["inductor"], result
    assert result["seconds"] < 0.5, result


def test_compiled_call_after_a_lazy_import():
    """A compiled call registers the Dynamo variable and the lowerings on its way."""
    q = torch.randn(1, 2, 32, 16)
    compiled = torch.compile(lambda q: flexattn.flex_attention(q, q, q, score_mod=lambda s, b, h, i, j: s * 2),
                             fullgraph=True)
    expected = torch.nn.functional.scaled_dot_product_attention(q, q, q, scale=2 / 4)
    torch.testing.assert_close(compiled(q), expected, atol=1e-5, rtol=1e-5)


def test_every_public_name_has_a_docstring_of_its_own():
    """help() on each public name (and each public method of a public class) shows
    flexattn's text, not an inherited one (a TypedDict would show dict's)."""
    import inspect

    import flexattn.distributed
    import flexattn.mods

    missing = []
    for module in (flexattn, flexattn.mods, flexattn.distributed):
        for name in getattr(module, "__all__", [n for n in dir(module) if not n.startswith("_")]):
            obj = getattr(module, name)
            if inspect.ismodule(obj) or not (callable(obj) or isinstance(obj, type)):
                continue
            if not obj.__doc__ or (isinstance(obj, type) and "__doc__" not in vars(obj)):
                missing.append(f"{module.__name__}.{name}")
            for attribute, value in vars(obj).items() if isinstance(obj, type) else ():
                function = getattr(value, "__func__", value)
                if not attribute.startswith("_") and callable(function) and not function.__doc__:
                    missing.append(f"{module.__name__}.{name}.{attribute}")
    assert not missing, f"public names without a docstring: {missing}"

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


NO_TRITON_PROBE = """
import importlib.util
import torch
import flexattn
from flexattn import mods
assert importlib.util.find_spec("triton") is None, "triton is importable"
q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
block_mask = flexattn.create_block_mask(mods.causal_mask, None, None, 64, 64, device="cpu")
out = torch.compile(flexattn.flex_attention)(q, k, v, block_mask=block_mask)
expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
print("ok")
"""


def test_cpu_engine_needs_no_triton(tmp_path):
    """A CPU user need not install Triton (flexattn does not depend on it): with no triton
    importable, ``import flexattn`` and a compiled call on the C++ engine work. The child
    sees the packages of torch's site-packages, linked one by one, minus Triton's."""
    import os
    from pathlib import Path

    site = Path(torch.__file__).resolve().parents[1]
    visible = tmp_path / "site"
    visible.mkdir()
    for entry in site.iterdir():
        if entry.name.split("-")[0].split(".")[0] != "triton":
            (visible / entry.name).symlink_to(entry)
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    env["PYTHONPATH"] = os.pathsep.join((str(root), str(visible)))
    run = subprocess.run([sys.executable, "-S", "-c", NO_TRITON_PROBE], env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-2000:] + run.stderr[-3000:]

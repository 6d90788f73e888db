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

"""Rendering the Gluon kernels on the CPU and compiling them for sm90 offline, for the
Gluon tests (the CPU suite has no Hopper GPU; Triton compiles for one without it)."""

from __future__ import annotations

import glob

import torch

from flexattn.lowering import backward as backward_lowering
from flexattn.lowering import dispatch
from flexattn.lowering.backward_plan import BackwardPlan
from flexattn.lowering.forward_plan import ForwardPlan


def rendered_gluon_sources(monkeypatch, tmp_path, run, kernel: str = "forward") -> list[str]:
    """The Gluon kernel modules Inductor writes for ``run`` with the ``kernel``'s plan
    ("forward" or "backward") forced to the Gluon kernel (on the CPU the compiled call
    then fails to launch, which is expected)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    if kernel == "forward":
        monkeypatch.setattr(dispatch, "plan_forward", lambda inputs: ForwardPlan("gluon", "forced"))
    else:
        monkeypatch.setattr(backward_lowering, "plan_backward", lambda inputs: BackwardPlan("gluon", "forced"))
    torch._dynamo.reset()
    with torch._inductor.config.patch(cpu_backend="triton", compile_threads=1, force_disable_caches=True):
        try:
            run()
        except Exception:  # noqa: BLE001 - the launch cannot work without a Hopper GPU
            pass
    sources = []
    for path in glob.glob(str(tmp_path / "**" / "*.py"), recursive=True):
        text = open(path).read()
        if text.lstrip().startswith("from triton.experimental import gluon"):
            sources.append(path)
    return sources


#: Compiles rendered Gluon kernel modules for sm90 and prints what the test checks, one JSON
#: line per module. It runs in a process of its own: under TRITON_INTERPRET=1 (the CPU
#: suite) Triton's standard library is interpreted and cannot be compiled. argv: another
#: ptxas to read the same PTX with ("" for none), then the modules.
_OFFLINE_COMPILE = r"""
import importlib.util, json, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.experimental.gluon._runtime import GluonASTSource


def ptxas_log(ptxas, ptx):
    with tempfile.TemporaryDirectory() as tmp:
        with open(tmp + "/kernel.ptx", "w") as f:
            f.write(ptx)
        report = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", tmp + "/kernel.ptx", "-o", tmp + "/kernel.o"],
                                capture_output=True, text=True, check=True)
    return report.stdout + report.stderr


def spill_bytes(log):
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))


for path in sys.argv[2:]:
    spec = importlib.util.spec_from_file_location("rendered_gluon_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    autotuner = getattr(module, re.search(r"@gluon\.jit\ndef (\w+)\(", open(path).read()).group(1))
    meta = autotuner.triton_meta
    source = GluonASTSource(autotuner.fn, dict(meta["signature"]), constexprs={},
                            attrs=meta["configs"][0] if meta.get("configs") else None)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = compiled.asm["ptx"]
    log = ptxas_log(get_ptxas(90).path, ptx)
    print(json.dumps({"num_warps": compiled.metadata.num_warps, "shared": compiled.metadata.shared,
                      "setmaxnreg": "setmaxnreg" in ptx, "spills": spill_bytes(log),
                      "ptxas_read": "bytes spill stores" in log, "triton": triton.__version__,
                      "registers": [int(n) for n in re.findall(r"Used (\d+) registers", log)],
                      "other_ptxas_spills": spill_bytes(ptxas_log(sys.argv[1], ptx)) if sys.argv[1] else None}))
"""


def compile_offline_for_sm90(paths: list[str], python: str | None = None, other_ptxas: str = "") -> list[dict]:
    """One report per rendered module, compiled by ``python``'s Triton (this one's by
    default): spill bytes (stores and loads) by its ptxas and by ``other_ptxas`` on the same PTX."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([python or sys.executable, "-c", _OFFLINE_COMPILE, other_ptxas, *paths],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]

"""Compile Inductor-generated Triton template kernels for Hopper (sm90) without a GPU.

Triton's passes up to PTX run on any machine, so compiler failures that only the GPU
image's Triton shows (e.g. Triton 3.6's loop scheduler) can be found here:

    pip download --no-deps triton==3.6.0 -d /tmp/tr36dl && unzip -q -d /tmp/tr36 /tmp/tr36dl/triton-3.6.0*.whl
    # write Inductor's output code (torch._inductor.utils.run_and_get_code, on CPU with
    # cpu_backend="triton" and TRITON_INTERPRET=1; patch flexattn.lowering.configs.gpu_generation
    # to return "sm90" so the GPU's tile configs are chosen) to files, then:
    PYTHONPATH=/tmp/tr36 python scripts/aot_check_sm90.py out_code_*.py

Every pointer argument gets 16-byte divisibility, as CUDA allocations do. With
--ptxas, each kernel's PTX also goes through Triton's bundled ptxas (-arch=sm_90a -v),
which prints its registers and spill bytes per thread. With AOT_PTX_DIR set, each
kernel's PTX and TTGIR (Triton's GPU IR after its passes, where the software
pipeline's stages show) are written there too (<file>.<kernel>.ptx / .ttgir). Each kernel's line gives its
compile time (Triton's passes, LLVM and ptxas to a cubin, on this machine's CPU).
"""
import os, sys, re, subprocess, tempfile, importlib.util, time
import triton
from triton.backends.compiler import GPUTarget
print("triton", triton.__version__)
PTXAS = "--ptxas" in sys.argv[1:]
PTX_DIR = os.environ.get("AOT_PTX_DIR", "")


def ptxas_usage(ptx: str) -> str:
    """'regs N spill-stores S spill-loads L' of one kernel's PTX, as ptxas reports it."""
    exe = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    out = subprocess.run([exe, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                         capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    return (f"regs {regs.group(1) if regs else '?'} spill-stores {spills.group(1) if spills else '?'} "
            f"spill-loads {spills.group(2) if spills else '?'}")


for path in (a for a in sys.argv[1:] if a != "--ptxas"):
    src = open(path).read()
    for m in re.finditer(r"async_compile\.triton\('(\w+)', '''\n(.*?)''', device_str='\w+'\)", src, re.S):
        name, ksrc = m.group(1), m.group(2)
        if "tem" not in name:
            continue
        meta = re.search(r"triton_meta=(\{.*?\}),\ninductor_meta", ksrc, re.S).group(1)
        sig = eval(re.search(r"'signature': (\{.*?\})", meta).group(1))
        warps = int(re.search(r"num_warps=(\d+)", ksrc).group(1)); stages = int(re.search(r"num_stages=(\d+)", ksrc).group(1))
        body = re.sub(r"@triton_heuristics\.template\((.|\n)*?\)\n@triton\.jit", "@triton.jit", ksrc, count=1)
        body = body.replace("from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math", "from triton.language.extra import libdevice\nfrom triton.language import math as tl_math")
        body = re.sub(r"from torch\._inductor.*\n", "", body)
        body = body.replace("import triton.language as tl\n", "import triton.language as tl\nfrom torch._inductor.runtime import triton_helpers\n", 1)
        mp = f"/tmp/kmod_{name}.py"; open(mp, "w").write(body)
        spec = importlib.util.spec_from_file_location(f"kmod_{name}", mp); mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
        fn = getattr(mod, name)
        ptr_idx = [i for i, a in enumerate(fn.arg_names) if str(sig.get(a, "")).startswith("*")]
        attrs = {(i,): [["tt.divisibility", 16]] for i in ptr_idx}
        try:
            start = time.perf_counter()
            k = triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs={}, attrs=attrs), target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
            seconds = time.perf_counter() - start
            usage = ptxas_usage(k.asm["ptx"]) if PTXAS else ""
            if PTX_DIR:
                for stage in ("ttgir", "ptx"):
                    with open(os.path.join(PTX_DIR, f"{os.path.basename(path)}.{name}.{stage}"), "w") as f:
                        f.write(k.asm[stage])
            print("OK  ", path, name, warps, stages, "shared", k.metadata.shared, f"compile {seconds:.2f} s", usage)
        except Exception as e:
            print("FAIL", path, name, warps, stages, " | ".join(l for l in str(e).splitlines() if l.strip())[-600:])

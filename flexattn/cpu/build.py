"""Building and loading the CPU kernels' libraries.

Both are compiled on first use by the compiler Inductor uses for its own C++ kernels,
with its flags, and cached on disk by Inductor's C++ code cache, keyed by the whole
translation unit (``sources.py``) and the compile command: the engine once per machine,
a mod library once per distinct score_mod/mask_mod/dtype (a fraction of a second). Sizes
are run-time arguments, so a new shape compiles nothing here. Within a process each
library is loaded once.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
from typing import Any

import torch

from .. import _compat
from . import sources

class CpuKernelError(RuntimeError):
    """flexattn's CPU kernels could not be built or run."""


@functools.lru_cache(maxsize=None)
def engine() -> ctypes.CDLL:
    """The engine library (compiled on first use, then cached on disk)."""
    source = sources.engine_source()
    try:
        lib = _compat.load_cpp_library(source)
    except Exception as error:  # noqa: BLE001 - re-raised with what failed
        raise CpuKernelError(f"flexattn: could not compile its CPU attention engine with Inductor's C++ "
                             f"compiler: {error}") from error
    for name in ("fa_forward", "fa_backward"):
        getattr(lib, name).argtypes = [ctypes.c_void_p]
        getattr(lib, name).restype = ctypes.c_int
    lib.fa_math.restype = ctypes.c_void_p
    return lib


_mod_lock = threading.Lock()
_mod_libraries: dict[str, tuple[Any, int | None, int | None, int | None]] = {}


def mod_library(source: str) -> tuple[Any, int | None, int | None, int | None]:
    """(library, fa_score, fa_mask, fa_joint addresses or None) of a mod library source."""
    found = _mod_libraries.get(source)
    if found is not None:
        return found
    with _mod_lock:
        if source not in _mod_libraries:
            try:
                lib = _compat.load_cpp_library(source)
            except Exception as error:  # noqa: BLE001 - re-raised with what failed
                raise CpuKernelError(f"flexattn: could not compile the C++ of this call's score_mod/mask_mod: "
                                     f"{error}") from error
            addresses = [ctypes.cast(getattr(lib, name), ctypes.c_void_p).value if hasattr(lib, name) else None
                         for name in ("fa_score", "fa_mask", "fa_joint")]
            _mod_libraries[source] = (lib, *addresses)
    return _mod_libraries[source]


def _torch_libraries() -> list[str]:
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    names = {"linux": ["libtorch_cpu.so"], "darwin": ["libtorch_cpu.dylib"], "win32": ["torch_cpu.dll"]}
    return [os.path.join(lib_dir, n) for n in names.get(sys.platform, ["libtorch_cpu.so"])]


@functools.lru_cache(maxsize=None)
def blas_symbols() -> tuple[int, int]:
    """Addresses of the Fortran BLAS ``sgemm_`` and ``dgemm_`` that torch links (MKL in
    torch's x86-64 wheels, OpenBLAS or Accelerate elsewhere)."""
    handles = []
    for path in _torch_libraries():
        if os.path.exists(path):
            handles.append(ctypes.CDLL(path))
    handles.append(ctypes.CDLL(None))
    found = []
    for name in ("sgemm_", "dgemm_"):
        for handle in handles:
            if hasattr(handle, name):
                found.append(ctypes.cast(getattr(handle, name), ctypes.c_void_p).value)
                break
        else:
            raise CpuKernelError(f"flexattn: its CPU kernels multiply tiles with the BLAS routine {name} that "
                                 "torch links, and this torch build exports none (torch.__config__.show() "
                                 "says which BLAS it uses)")
    return found[0], found[1]

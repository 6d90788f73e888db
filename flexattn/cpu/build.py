"""Building and loading the CPU kernels' libraries.

Both are compiled on first use by the compiler Inductor uses for its own C++ kernels,
with its flags, and cached on disk by Inductor's C++ code cache, keyed by the whole
translation unit (``sources.py``) and the compile command: the engine once per machine,
a mod library once per distinct score_mod/mask_mod/dtype (a fraction of a second). Sizes
are run-time arguments, so a new shape compiles nothing here. Within a process each
library is loaded once.

The engine's build takes long enough to look like a hang, so it is announced before it
starts and timed after, as WARNING records of the ``flexattn.cpu`` logger (shown on
stderr without any logging set up); a run that finds it cached says nothing at the
default level. ``FLEXATTN_LOG=info`` also reports the loads and the mod libraries'
compiles with their times.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
import threading
import time
from typing import Any, Callable

import torch

from .. import _compat
from . import sources

log = logging.getLogger("flexattn.cpu")

#: The engine build's duration on two cores, as the notice before it states it.
ENGINE_BUILD_SECONDS_ESTIMATE = 20


class CpuKernelError(RuntimeError):
    """flexattn's CPU kernels could not be built or run."""


def _load(source: str, on_build: Callable[[Callable[[], Any]], None]) -> tuple[Any, bool, float]:
    """(library, whether it was built, seconds taken) of a C++ source."""
    built = []

    def build(compile_step: Callable[[], Any]) -> None:
        built.append(True)
        on_build(compile_step)

    started = time.perf_counter()
    lib = _compat.load_cpp_library(source, on_build=build)
    return lib, bool(built), time.perf_counter() - started


def _build_engine(compile_step: Callable[[], Any]) -> None:
    log.warning("flexattn: building the CPU engine once (about %d s); cached in %s", ENGINE_BUILD_SECONDS_ESTIMATE,
                _compat.inductor_cache_dir())
    started = time.perf_counter()
    compile_step()
    log.warning("flexattn: built the CPU engine in %.1f s", time.perf_counter() - started)


@functools.lru_cache(maxsize=None)
def engine() -> ctypes.CDLL:
    """The engine library (built on first use, announced; then cached on disk)."""
    try:
        lib, built, seconds = _load(sources.engine_source(), _build_engine)
    except Exception as error:  # noqa: BLE001 - re-raised with what failed
        raise CpuKernelError(f"flexattn: could not compile its CPU attention engine with Inductor's C++ "
                             f"compiler: {error}") from error
    if not built:
        log.info("flexattn: loaded the CPU engine from %s in %.2f s", _compat.inductor_cache_dir(), seconds)
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
                lib, built, seconds = _load(source, lambda compile_step: compile_step())
            except Exception as error:  # noqa: BLE001 - re-raised with what failed
                raise CpuKernelError(f"flexattn: could not compile the C++ of this call's score_mod/mask_mod: "
                                     f"{error}") from error
            log.info("flexattn: %s the C++ of a call's score_mod/mask_mod in %.2f s",
                     "compiled" if built else "loaded", seconds)
            addresses = [ctypes.cast(getattr(lib, name), ctypes.c_void_p).value if hasattr(lib, name) else None
                         for name in ("fa_score", "fa_mask", "fa_joint")]
            _mod_libraries[source] = (lib, *addresses)
    return _mod_libraries[source]


def _torch_libraries() -> list[str]:
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    names = {"linux": ["libtorch_cpu.so"], "darwin": ["libtorch_cpu.dylib"], "win32": ["torch_cpu.dll"]}
    return [os.path.join(lib_dir, n) for n in names.get(sys.platform, ["libtorch_cpu.so"])]


@functools.lru_cache(maxsize=None)
def blas_symbols() -> tuple[int, int, int | None]:
    """Addresses of the Fortran BLAS ``sgemm_`` and ``dgemm_`` that torch links (MKL in
    torch's x86-64 wheels, OpenBLAS or Accelerate elsewhere), and of MKL's
    ``MKL_Set_Num_Threads_Local`` (None for another BLAS)."""
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
    # The C spelling, by value (MKL exports the lower-case name as its Fortran interface, by reference).
    local = next((ctypes.cast(getattr(h, "MKL_Set_Num_Threads_Local"), ctypes.c_void_p).value
                  for h in handles if hasattr(h, "MKL_Set_Num_Threads_Local")), None)
    return found[0], found[1], local

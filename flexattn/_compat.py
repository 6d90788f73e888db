"""The torch and Triton internals flexattn uses outside its lowering, in one place.

flexattn supports torch 2.11 (the GPU image) to 2.15 (CI runs 2.13, 2.14 and 2.15).
Private APIs move between releases, so a module of flexattn outside ``lowering/``
reaches them only through the names here; a version bump is then one file to fix.

What counts as private: a dotted name under ``torch`` or ``triton`` with a component that
starts with an underscore (``torch._C``, ``torch.utils._pytree``, ``triton._C``; dunders
such as ``torch.__version__`` are public), and anything under ``torch.fx.experimental``.
``tests/test_compat_lint.py`` enforces the rule over every module of ``flexattn/``
except this one and the lowering (``lowering/`` and the CPU engine's lowering files),
listing each offending ``file:line``, and checks that every name exported here is used.
Nothing is whitelisted: where torch has a public spelling flexattn uses it
(``torch.compiler.reset``, ``torch.compiler.is_compiling``).

What the lint cannot see: internals reached through objects torch hands to flexattn
rather than through a module path. These come with the names exported here and have the
same spelling in 2.11 to 2.15 (``tests/test_capture.py`` and ``tests/test_reference.py``
exercise them):

* ``HigherOrderOperator``: ``py_impl``, ``py_functionalize_impl``, ``_name``; the
  functionalization context's ``unwrap_tensors``, ``wrap_tensors``, ``functionalize``,
  ``redispatch_to_next``;
* ``ProxyTorchDispatchMode.tracer``: ``root``, ``unwrap_proxy``, ``create_proxy``;
* Dynamo (``_dynamo_capture.py``): the ``_call_function`` hook and ``value`` of
  ``TorchHigherOrderOperatorVariable``; ``tx.output.install_subgraph``, ``nn_modules``
  and ``create_proxy``; ``VariableTracker.call_method``, ``as_python_constant``,
  ``evaluate_expr`` and ``proxy``; the ``items`` of tuple and dict variables and a dict
  key's ``vt``.

The lowering (``lowering/``, with the Triton templates it renders) is exempt: it is
Inductor plugin code, written against ``torch._inductor`` throughout. The sections of
lowering shims and template workspaces hold the pieces of it that differ between torch
versions or need a shim under Triton's interpreter.

Version differences handled here: ``autotune_select_node`` (2.13 on returns ``(node,
choice)``, 2.11 the node), ``share_template_workspace`` (2.11 sizes the benchmark
workspace in bytes of ``count``), ``float32_matmul_allows_tf32`` (the ``fp32_precision``
setting where it exists), ``dynamo_hop_support().speculate_subgraph`` (2.15 refuses a
subgraph that aliases or mutates its inputs unless told otherwise),
``BLOCK_MASK_INDEXING_PACKS_QUERIES`` (2.14 on, a BlockMask indexed along query blocks
gets the kept blocks' query length; flexattn's BlockMask follows the installed torch).
Every other name has the same spelling in 2.11, 2.13, 2.14 and 2.15 (2.12 is not tested).

Sections: HOP and tracing utilities, Dynamo internals, Inductor/Triton plumbing,
lowering shims, public behaviour that differs between releases, template workspaces.
"""

from __future__ import annotations

import os
import re
import types
from typing import Any, Callable

import torch

# --------------------------------------------------------------------------------------
# HOP and tracing utilities
# --------------------------------------------------------------------------------------
from torch._C import DispatchKey  # noqa: E402
from torch._ops import HigherOrderOperator  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake  # noqa: E402
from torch._subclasses.functional_tensor import disable_functional_mode  # noqa: E402
from torch.fx.experimental.proxy_tensor import (  # noqa: E402
    ProxyTorchDispatchMode,
    disable_proxy_modes_tracing,
    make_fx,
    track_tensor_tree,
)
from torch._dispatch.python import suspend_functionalization  # noqa: E402
from torch._guards import detect_fake_mode  # noqa: E402
import torch.utils._pytree as _pytree  # noqa: E402

#: The three pytree functions flexattn uses (``torch.utils._pytree`` has no public
#: counterpart in 2.11 to 2.15); a namespace, so that a new use must be added here.
pytree = types.SimpleNamespace(
    tree_map=_pytree.tree_map,
    register_pytree_node=_pytree.register_pytree_node,
    GetAttrKey=_pytree.GetAttrKey,
)


def reenter_make_fx(fn):
    """Trace ``fn`` into a GraphModule inside the make_fx session that is running now."""
    from torch._higher_order_ops.utils import reenter_make_fx as _reenter

    return _reenter(fn)


def unique_graph_name(proxy_mode: ProxyTorchDispatchMode, prefix: str) -> str:
    """A submodule name not yet used on the tracer's root module."""
    root = proxy_mode.tracer.root
    i = 0
    while hasattr(root, f"{prefix}_{i}"):
        i += 1
    return f"{prefix}_{i}"


def reenable_autograd():
    """Undo ``_AutoDispatchBelowAutograd`` for a block, so a reference can use autograd.

    A HOP's backward runs below the Autograd key; the dense reference computes its
    gradients with ``torch.autograd.grad`` and needs that key back.
    """
    exclude = torch._C._dispatch_tls_local_exclude_set()
    exclude = exclude.remove(DispatchKey.AutogradFunctionality).remove(DispatchKey.ADInplaceOrView)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def below_autograd():
    """Redispatch below the Autograd key for a block (``_AutoDispatchBelowAutograd``): a
    HOP's autograd rule calls the operator again inside it to reach the next key."""
    return torch._C._AutoDispatchBelowAutograd()


def exclude_dispatch_key(key: DispatchKey):
    """Exclude one dispatch key for a block (an autocast rule redispatches past its key)."""
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key))


def hop_init_kwargs() -> dict[str, Any]:
    """Keyword arguments for ``HigherOrderOperator.__init__`` understood by this torch."""
    return {"cacheable": True}


# --------------------------------------------------------------------------------------
# Dynamo internals
# --------------------------------------------------------------------------------------
def _after_import(module_name: str, callback) -> None:
    """Run ``callback(module)`` once the module ``module_name`` is imported: at once if it
    already is, else right after its code has run. flexattn registers with Dynamo this
    way, so that ``import flexattn`` does not import Dynamo (seconds) for users who
    never compile."""
    import importlib.abc
    import importlib.util
    import sys

    module = sys.modules.get(module_name)
    if module is not None:
        callback(module)
        return

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != module_name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                callback(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())


def when_dynamo_imported(callback: Callable[[], Any]) -> None:
    """Run ``callback()`` once Dynamo is imported (at once if it is): for definitions a
    compiled call needs before tracing that ``import flexattn`` should not pay for."""
    _after_import("torch._dynamo", lambda module: callback())


#: The Dynamo module whose table maps a HOP's name to the variable class that traces it.
_DYNAMO_HOP_MODULE = "torch._dynamo.variables.higher_order_ops"


def register_dynamo_hop(hop_name: str, make_variable) -> None:
    """Have Dynamo trace the HOP ``hop_name`` with ``make_variable(value, source,
    **kwargs)`` (a variable class or a factory), from when Dynamo is imported."""
    _after_import(_DYNAMO_HOP_MODULE,
                 lambda module: module._hop_name_to_variable_class.__setitem__(hop_name, make_variable))


def dynamo_hop_support():
    """The Dynamo pieces a HOP variable needs, as a namespace.

    Imported lazily: importing torch._dynamo's variable modules at flexattn import time
    costs seconds and is only needed when Dynamo traces a flexattn call.
    """
    from torch._dynamo.variables import higher_order_ops as hoo
    from torch._dynamo.variables.builder import wrap_fx_proxy
    from torch._dynamo.variables.lists import TupleVariable
    from torch._dynamo.utils import proxy_args_kwargs

    return types.SimpleNamespace(
        TorchHigherOrderOperatorVariable=hoo.TorchHigherOrderOperatorVariable,
        speculate_subgraph=_lenient_speculate_subgraph(hoo.speculate_subgraph),
        discard_graph_changes=hoo.discard_graph_changes,
        make_attr=hoo.make_attr,
        name_to_variable_class=hoo._hop_name_to_variable_class,
        wrap_fx_proxy=wrap_fx_proxy,
        proxy_args_kwargs=proxy_args_kwargs,
        TupleVariable=TupleVariable,
    )


#: ``speculate_subgraph``'s switches that let a subgraph mutate or alias its inputs. They
#: default to on up to torch 2.14 and to off from 2.15, which then refuses a score_mod
#: returning its score unchanged (an output aliasing an input) and mods closing over views
#: of one tensor (inputs aliasing each other).
_SPECULATE_LENIENCY = ("supports_input_mutation", "supports_aliasing", "supports_input_input_aliasing")


def _lenient_speculate_subgraph(speculate):
    """``speculate`` with mutation and aliasing allowed wherever it has the switch: a mod's
    subgraph is inlined into a kernel, so aliasing is harmless, and flexattn rejects a
    mutating mod itself with its own error (``_dynamo_capture._reject_mutation``)."""
    import functools
    import inspect

    accepted = inspect.signature(speculate).parameters
    return functools.partial(speculate, **{name: True for name in _SPECULATE_LENIENCY if name in accepted})


def selective_checkpoint_modes() -> tuple[type, ...]:
    """torch.utils.checkpoint's dispatch modes of selective activation checkpointing (the
    one that saves chosen ops' outputs, the one that replays them); a HOP reaches their
    policy only by forwarding itself into their ``__torch_dispatch__``."""
    from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

    return (_CachingTorchDispatchMode, _CachedTorchDispatchMode)


def compiled_graph_count() -> int:
    """How many graphs Dynamo has compiled in this process (it grows when a call compiles)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def unlimited_recompiles():
    """Lift Dynamo's recompile limit for a block (the eager path compiles per signature)."""
    from torch._dynamo.utils import disable_cache_limit

    return disable_cache_limit()


def build_variable(tx, value, source=None):
    """``VariableTracker.build`` (both versions spell it the same; kept for one seam)."""
    from torch._dynamo.variables.base import VariableTracker

    if source is None:
        return VariableTracker.build(tx, value)
    return VariableTracker.build(tx, value, source=source)


# --------------------------------------------------------------------------------------
# Inductor / Triton plumbing
# --------------------------------------------------------------------------------------
_INTERPRETER_BACKEND_TAG = "flexattn-triton-interpreter"


def triton_interpreter_requested() -> bool:
    """True when Triton will run kernels through its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def enable_triton_interpreter() -> None:
    """Let Inductor compile Triton kernels on a machine without a GPU.

    Inductor hashes generated kernels with the active Triton backend's name; without a
    GPU there is no active backend and the hash raises. Under the interpreter any fixed
    string is a correct hash input. ``TRITON_INTERPRET=1`` must be in the environment
    before triton is imported; this function patches the hashing and gives the
    interpreter the tensor-descriptor reduction it lacks (``_interpret_descriptor_add``).
    """
    import torch.utils._triton as triton_utils

    triton_utils.triton_hash_with_backend = lambda: _INTERPRETER_BACKEND_TAG
    triton_utils.triton_backend = lambda: _INTERPRETER_BACKEND_TAG
    from triton.runtime.interpreter import InterpreterBuilder

    if not hasattr(InterpreterBuilder, "create_descriptor_reduce"):
        InterpreterBuilder.create_descriptor_reduce = _interpret_descriptor_add


def _interpret_descriptor_add(builder, kind, desc, value, indices):
    """``tensor_descriptor.atomic_add`` under Triton's interpreter (which emulates
    descriptor loads and stores, but not reductions): relaxed atomic adds of the tile at
    the descriptor's in-bounds positions, as the copy engine's bulk reduction does."""
    from triton._C.libtriton import ir

    if kind != ir.DESCRIPTOR_REDUCE_KIND.ADD:
        raise NotImplementedError(f"flexattn: the interpreter emulates descriptor additions only, not {kind}")
    ptrs, mask = desc.materialize_pointers(indices)
    op = ir.ATOMIC_OP.FADD if value.dtype.scalar.is_floating() else ir.ATOMIC_OP.ADD
    return builder.create_atomic_rmw(op, ptrs, value, mask, ir.MEM_SEMANTIC.RELAXED, ir.MEM_SYNC_SCOPE.GPU)


def inductor_cpu_backend() -> str:
    import torch._inductor.config as inductor_config

    return inductor_config.cpu_backend


def load_cpp_library(source: str, on_build: Callable[[Callable[[], Any]], None] | None = None):
    """A C++ source compiled into a shared library and loaded (``ctypes.CDLL``), with the
    compiler, flags (vector ISA, OpenMP, torch's headers and libraries) and on-disk
    cache Inductor uses for its own C++ kernels: where Inductor's CPU backend compiles,
    so do flexattn's CPU kernels.

    ``on_build``, when given, is called with the compile step (which it must call) when
    the library is not in the on-disk cache, and not at all on a cache hit: Inductor
    asks its ``submit_fn`` for a future exactly when the library file is missing, and
    the future here runs the step in ``on_build`` when the loader waits on it."""
    from torch._inductor.codecache import CppCodeCache

    if on_build is None:
        return CppCodeCache.load(source)

    class _BuildWhenAwaited:
        def __init__(self, compile_step: Callable[[], Any]):
            self._compile_step = compile_step

        def result(self) -> None:
            on_build(self._compile_step)

    return CppCodeCache.load_async(source, submit_fn=_BuildWhenAwaited)()


def is_mutating_op(target: Any) -> bool:
    """Whether an FX node's target is an ATen op that writes to one of its inputs."""
    return isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable


def inductor_cache_dir() -> str:
    """The directory of Inductor's on-disk caches (``TORCHINDUCTOR_CACHE_DIR`` or its
    default), where the C++ libraries are kept."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


#: Every public name of this module, those of the sections below included.
__all__ = [
    "BLOCK_MASK_INDEXING_PACKS_QUERIES",
    "DispatchKey",
    "FakeTensorMode",
    "HigherOrderOperator",
    "ProxyTorchDispatchMode",
    "autotune_select_node",
    "below_autograd",
    "build_variable",
    "detect_fake_mode",
    "disable_functional_mode",
    "disable_proxy_modes_tracing",
    "dynamo_hop_support",
    "register_dynamo_hop",
    "when_dynamo_imported",
    "enable_triton_interpreter",
    "exclude_dispatch_key",
    "is_mutating_op",
    "float32_matmul_allows_tf32",
    "is_fake",
    "graph_zeroed_workspace",
    "hop_init_kwargs",
    "inductor_cache_dir",
    "inductor_cpu_backend",
    "load_cpp_library",
    "selective_checkpoint_modes",
    "compiled_graph_count",
    "compile_gluon_kernels_as_gluon",
    "gluon_tma_atomic_add",
    "make_fx",
    "pytree",
    "reenable_autograd",
    "reenter_make_fx",
    "share_template_workspace",
    "suspend_functionalization",
    "track_tensor_tree",
    "triton_interpreter_requested",
    "unique_graph_name",
    "unlimited_recompiles",
    "use_interpreter_libdevice",
]

# --------------------------------------------------------------------------------------
# Lowering and templates (owned by the lowering; keep each shim small)
# --------------------------------------------------------------------------------------


def float32_matmul_allows_tf32() -> bool:
    """Whether torch's float32 matmul setting permits TF32 (new ``fp32_precision`` API
    first, then ``torch.get_float32_matmul_precision`` / ``allow_tf32``)."""
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", "none")
    if precision not in (None, "none"):
        return precision == "tf32"
    return torch.get_float32_matmul_precision() != "highest"


def autotune_select_node(name, choices, input_nodes, layout, input_gen_fns=None):
    """``autotune_select_algorithm``'s chosen output node. torch 2.13 on returns
    ``(node, choice)``, torch 2.11 the node alone."""
    from torch._inductor.select_algorithm import autotune_select_algorithm

    result = autotune_select_algorithm(name, choices, input_nodes, layout, input_gen_fns=input_gen_fns)
    return result[0] if isinstance(result, tuple) else result


class _InterpreterLibdevice:
    """Stand-in for ``triton_helpers.libdevice`` under the Triton interpreter, which
    cannot run libdevice's extern functions (they return None there): each function is
    answered by the ``tl.math`` / ``tl`` op of the same name where one exists (exp,
    rsqrt, erf, ...), tanh is rebuilt from exp, and anything else is the real module."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        import triton.language as tl

        for namespace in (tl.math, tl):
            if hasattr(namespace, name):
                return getattr(namespace, name)
        return getattr(self._real, name)

    @staticmethod
    def tanh(x):
        import triton.language as tl

        return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


def use_interpreter_libdevice() -> None:
    """Route Inductor-generated ``libdevice.*`` calls through ``_InterpreterLibdevice``
    (no-op unless the interpreter is requested; call before kernels are generated)."""
    if not triton_interpreter_requested():
        return
    from torch._inductor.runtime import triton_helpers

    if not isinstance(triton_helpers.libdevice, _InterpreterLibdevice):
        triton_helpers.libdevice = _InterpreterLibdevice(triton_helpers.libdevice)


def compile_gluon_kernels_as_gluon() -> None:
    """Let Inductor's autotuner compile ``@gluon.jit`` kernels (flexattn's Gluon templates).

    Inductor hands every kernel to Triton as an ``ASTSource`` (Triton-language source);
    a Gluon function must go as ``GluonASTSource``, which builds layout-annotated IR
    instead. Installs once per process a stand-in that builds the Gluon source for Gluon
    functions and the usual source for everything else; the generated module of each
    Gluon template calls this, so compile workers get it too.
    """
    from torch._inductor.runtime import triton_heuristics

    base = triton_heuristics.ASTSource
    if base is None or getattr(base, "FLEXATTN_GLUON_AWARE", False):
        return
    from triton.experimental.gluon._runtime import GluonASTSource

    class GluonAwareSource(base):
        FLEXATTN_GLUON_AWARE = True

        def __new__(cls, fn, *args, **kwargs):
            is_gluon = getattr(fn, "is_gluon", None)
            return (GluonASTSource if is_gluon is not None and is_gluon() else base)(fn, *args, **kwargs)

    triton_heuristics.ASTSource = GluonAwareSource


# --------------------------------------------------------------------------------------
# Public behaviour of torch that differs between releases (flexattn follows the installed one)
# --------------------------------------------------------------------------------------
#: The installed torch's (major, minor) release.
_TORCH_RELEASE = tuple(int(part) for part in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())

#: Whether indexing a BlockMask along query blocks gives the result the query length of
#: the blocks it keeps (torch 2.14 on) rather than the whole mask's (up to 2.13).
BLOCK_MASK_INDEXING_PACKS_QUERIES = _TORCH_RELEASE >= (2, 14)


# --------------------------------------------------------------------------------------
# Template workspaces (the decode kernel's tile counters)
# --------------------------------------------------------------------------------------
def graph_zeroed_workspace(count, device: torch.device, outer_name: str, inner_name: str, dtype: torch.dtype):
    """A template workspace of ``count`` elements that Inductor zeroes once per call of the
    compiled graph, before its first user (``WorkspaceZeroMode.ZERO_PER_GRAPH``): every
    kernel using it must leave it zero. Users of one ``outer_name`` share one buffer (sized
    for the largest) once ``share_template_workspace`` has been applied to their choices."""
    from torch._inductor.codegen.common import WorkspaceArg, WorkspaceZeroMode

    return WorkspaceArg(count=count, zero_mode=WorkspaceZeroMode.ZERO_PER_GRAPH, device=device,
                        outer_name=outer_name, inner_name=inner_name, dtype=dtype)


def share_template_workspace(choice, workspace) -> None:
    """Let the kernels rendered from template ``choice`` use ``workspace`` under its own name.

    ``TritonTemplate.generate`` (torch 2.11 to 2.15) gives each rendered kernel a fresh
    workspace name, so that no two kernels share a workspace buffer; for a
    ZERO_PER_GRAPH workspace that means an allocation and a zeroing kernel per call. Here
    the rendered kernel gets ``workspace`` back, so every kernel of a graph naming it
    shares one buffer, zeroed once per graph call.

    Also: torch 2.11 sizes the autotuning benchmark's workspace as ``count`` bytes
    (whatever the dtype, and unhinted when symbolic); 2.13 on as hint(count) * itemsize,
    which is set here for both.
    """
    import dataclasses

    from torch._inductor.virtualized import V

    original = choice.make_kernel_render

    def make_kernel_render(out_node, *args, **kwargs):
        kernel, render = original(out_node, *args, **kwargs)
        renamed = kernel.workspace_arg
        if renamed is not None:
            shared = dataclasses.replace(renamed, outer_name=workspace.outer_name)
            kernel.workspace_arg = shared
            kernel.args.workspace_args = [shared if arg is renamed else arg for arg in kernel.args.workspace_args]
        return kernel, render

    choice.make_kernel_render = make_kernel_render
    bmreq = getattr(choice, "bmreq", None)
    if bmreq is not None and getattr(bmreq, "workspace_size", None) is not None:
        count = int(V.graph.sizevars.optimization_hint(workspace.count))
        bmreq.workspace_size = count * workspace.dtype.itemsize


def gluon_tma_atomic_add():
    """Gluon's bulk add of a shared-memory tile into global memory through a tensor
    descriptor: ``tma.async_atomic_add(desc, coord, src)`` from Triton 3.7 on; Triton 3.6
    has the operation but no public wrapper, so one is made here from its builder call.
    Completes like a TMA store (``tma.store_wait`` before ``src`` is written again)."""
    from triton.experimental.gluon.language._core import builtin
    from triton.experimental.gluon.language.nvidia.hopper import tma

    public = getattr(tma, "async_atomic_add", None)
    if public is not None:
        return public

    @builtin
    def async_atomic_add(tensor_desc, coord, src, _semantic=None):
        from triton._C.libtriton import ir

        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)

    return async_atomic_add

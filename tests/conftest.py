"""Test set-up shared by every test file.

Device: CUDA when available (or FLEXATTN_TEST_DEVICE), else CPU. On CPU the Triton
kernels run through Triton's interpreter, which must be requested in the environment
before triton is imported, so it is set here, first.
"""

import os
from pathlib import Path

import pytest

import torch

DEVICE = os.environ.get("FLEXATTN_TEST_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: A parametrisation that takes over 20 s in the interpreter, whose feature another
#: parametrisation of the same test covers: the release subset (.ci/other_release.sh) leaves
#: it to the default torch's run.
HEAVY = pytest.mark.heavy

from flexattn import _compat  # noqa: E402

if DEVICE == "cpu":
    _compat.enable_triton_interpreter()
    _compat.use_interpreter_libdevice()


def _load_script(path: Path, prefix: str):
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(f"{prefix}{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def load_example(filename: str):
    """examples/<filename> imported as a module (the examples are scripts, not a package)."""
    return _load_script(Path(__file__).resolve().parents[1] / "examples" / filename, "_example_")


def load_bench(name: str):
    """bench/<name>.py imported as a module, with bench/ on sys.path as when it runs."""
    import sys

    bench = Path(__file__).resolve().parents[1] / "bench"
    if str(bench) not in sys.path:
        sys.path.insert(0, str(bench))
    return _load_script(bench / f"{name}.py", "_bench_")


def pytest_report_header(config):
    triton_version = "absent"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        pass
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (Triton interpreter)"
    return f"flexattn tests on {name}; torch {torch.__version__}, triton {triton_version}"


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield


@pytest.fixture
def inductor_runs_flexattn_kernels():
    """Inductor compiles flexattn's Triton templates afresh: no FX-graph or autotune cache
    hits, and on CPU Triton (run by the interpreter) instead of C++.

    Use it with ``pytestmark = pytest.mark.usefixtures("inductor_runs_flexattn_kernels")``.
    """
    with _fresh_compile("triton"):
        yield


#: The kernels a numerics test runs through: on a GPU its Triton kernels; on the CPU both
#: the Triton kernels (in the interpreter) and the C++ CPU engine, the path CPU users get.
KERNEL_PATHS = ["triton", "cpp"] if DEVICE == "cpu" else ["triton"]


@pytest.fixture(params=KERNEL_PATHS)
def flexattn_kernels(request):
    """``inductor_runs_flexattn_kernels`` for each of ``KERNEL_PATHS``: a test using it runs
    once per path (ids ``[triton]``, ``[cpp]``). ``@pytest.mark.triton_kernels`` marks a
    test about the Triton kernels themselves (their options, their generated code): it
    runs on the Triton path only. ``@pytest.mark.workflow`` marks a test of a whole
    workflow (a training loop over lengths, say) whose kernels' numerics the per-kernel
    tests already cover: on the CPU it runs on the C++ engine only (minutes in the
    interpreter), on a GPU on the Triton kernels as every test."""
    if request.param == "cpp" and request.node.get_closest_marker("triton_kernels"):
        pytest.skip("about the Triton kernels; the CPU engine has its own tests")
    if request.param == "triton" and DEVICE == "cpu" and request.node.get_closest_marker("workflow"):
        pytest.skip("a workflow test: on the CPU it runs on the C++ engine")
    with _fresh_compile(request.param):
        yield request.param


def _fresh_compile(cpu_backend: str):
    patches = {"force_disable_caches": True}
    if DEVICE == "cpu":
        patches["cpu_backend"] = cpu_backend
    return torch._inductor.config.patch(**patches)


def finished_tests(progress_logs: str) -> set[str]:
    """The ids that FLEXATTN_PROGRESS_LOG files (paths joined by os.pathsep) record as
    passed or skipped, by their last line."""
    last: dict[str, str] = {}
    for path in filter(None, progress_logs.split(os.pathsep)):
        for line in Path(path).read_text().splitlines():
            outcome, _seconds, _when, nodeid = line.split(" ", 3)
            last[nodeid] = outcome
    return {nodeid for nodeid, outcome in last.items() if outcome in ("passed", "skipped")}


def pytest_collection_modifyitems(config, items):
    """FLEXATTN_SHARD="i/n" keeps every n-th test from the i-th on (1-based), so the CUDA
    suite splits into n device calls of similar length (each shard takes tests of every
    file). Then FLEXATTN_RESUME (progress logs of earlier runs, joined by os.pathsep) drops
    the tests they finished, so a shard cut off by a device call's time limit goes on where
    it stopped (sharding first: the same FLEXATTN_SHARD then names the same tests)."""
    shard = os.environ.get("FLEXATTN_SHARD")
    if shard:
        index, count = (int(x) for x in shard.split("/"))
        if not 1 <= index <= count:
            raise pytest.UsageError(f"FLEXATTN_SHARD must be i/n with 1 <= i <= n, got {shard!r}")
        _keep_only(config, items, [position % count == index - 1 for position in range(len(items))])
    resume = os.environ.get("FLEXATTN_RESUME")
    if resume:
        done = finished_tests(resume)
        _keep_only(config, items, [item.nodeid not in done for item in items])


def _keep_only(config, items, keep: list[bool]) -> None:
    """Deselect the items whose ``keep`` entry is False (reported as deselected)."""
    config.hook.pytest_deselected(items=[item for item, kept in zip(items, keep) if not kept])
    items[:] = [item for item, kept in zip(items, keep) if kept]


#: Whether this process is an xdist worker (set per session; the environment variable
#: xdist sets would also reach pytest runs that a test starts).
_IS_XDIST_WORKER = False


def pytest_configure(config):
    global _IS_XDIST_WORKER
    _IS_XDIST_WORKER = hasattr(config, "workerinput")


def pytest_runtest_logreport(report):
    """With FLEXATTN_FAIL_LOG set, append each failure's report there as it happens (a
    run cut off by a time limit still leaves its failures behind); with
    FLEXATTN_PROGRESS_LOG set, one line per finished test (outcome, seconds, id), so such
    a run also says what it finished and what took its time."""
    if _IS_XDIST_WORKER:
        return  # under xdist the controller sees every report too; log each once
    progress = os.environ.get("FLEXATTN_PROGRESS_LOG")
    if progress and (report.when == "call" or report.outcome != "passed"):
        with open(progress, "a") as log:
            log.write(f"{report.outcome} {report.duration:.1f} {report.when} {report.nodeid}\n")
    path = os.environ.get("FLEXATTN_FAIL_LOG")
    if path and report.failed:
        with open(path, "a") as log:
            log.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")

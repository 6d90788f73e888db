"""The suite's own switches for device calls (tests/conftest.py): FLEXATTN_PROGRESS_LOG
writes one line per finished test, FLEXATTN_SHARD splits the suite, and FLEXATTN_RESUME
then drops what such logs finished; and the release subset CI runs on a second torch
release (tests/release_subset.txt)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = "tests/test_mods.py"
#: The switches of the run this test is part of, kept out of the runs it starts.
OWN_SWITCHES = ("FLEXATTN_SHARD", "FLEXATTN_RESUME", "FLEXATTN_PROGRESS_LOG", "FLEXATTN_FAIL_LOG")


def _environment(**switches: str) -> dict[str, str]:
    """This process's environment without the calling run's own switches, plus ``switches``
    (xdist's worker variables stay: a run started from a worker must still log)."""
    return {**{k: v for k, v in os.environ.items() if k not in OWN_SWITCHES}, **switches}


def _pytest(*args: str, **switches: str) -> str:
    """The output of a pytest run of ``args`` in the repository, which must succeed."""
    run = subprocess.run([sys.executable, "-m", "pytest", *args, "-q", "-p", "no:cacheprovider"], cwd=ROOT,
                         env=_environment(**switches), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


def _collected(env: dict[str, str]) -> list[str]:
    return [line for line in _pytest(TARGET, "--collect-only", **env).splitlines() if line.startswith(TARGET + "::")]


def test_shard_then_resume_drops_finished_tests(tmp_path):
    everything = _collected({})
    assert len(everything) >= 6
    first_log, second_log = tmp_path / "a.log", tmp_path / "b.log"
    first_log.write_text(f"passed 1.0 call {everything[0]}\nfailed 2.0 call {everything[1]}\n"
                         f"skipped 0.0 setup {everything[2]}\n")
    # The later log's line for a test wins: a failure rerun and passed counts as finished.
    second_log.write_text(f"passed 1.5 call {everything[1]}\nfailed 0.5 call {everything[3]}\n")
    rest = everything[3:]
    assert _collected({"FLEXATTN_RESUME": str(first_log)}) == everything[1:2] + rest
    assert _collected({"FLEXATTN_RESUME": os.pathsep.join(map(str, (first_log, second_log)))}) == rest
    # A shard cut off and resumed under the same FLEXATTN_SHARD runs that shard's remainder,
    # not every other test of what all shards left.
    shard = _collected({"FLEXATTN_SHARD": "2/2"})
    assert shard == everything[1::2]
    assert _collected({"FLEXATTN_RESUME": os.pathsep.join(map(str, (first_log, second_log))),
                       "FLEXATTN_SHARD": "2/2"}) == [t for t in shard if t in rest]


def test_progress_log_has_one_line_per_test_under_xdist(tmp_path):
    log = tmp_path / "progress.log"
    target = "tests/test_options.py"
    _pytest(target, "-n", "2", FLEXATTN_PROGRESS_LOG=str(log))
    ids = [line.split(" ", 3)[3] for line in log.read_text().splitlines()]
    assert ids and len(ids) == len(set(ids)), "a test logged twice"
    assert all(nodeid.startswith(target + "::") for nodeid in ids)


#: What the release subset must keep covering (tests/release_subset.txt says why each).
RELEASE_SUBSET_MUST_HOLD = {"tests/test_capture.py", "tests/test_forward.py", "tests/test_backward.py",
                            "tests/test_decode.py", "tests/test_cpu_engine.py", "tests/test_dynamic.py",
                            "tests/test_validation.py", "tests/test_block_mask.py"}


def release_subset() -> list[str]:
    """The entries of tests/release_subset.txt, in order (what .ci/other_release.sh runs):
    test files, or single test functions as ``path::name``."""
    lines = (line.split("#", 1)[0].strip() for line in (ROOT / "tests" / "release_subset.txt").read_text().splitlines())
    return [line for line in lines if line]


def test_release_subset_is_collected():
    """Every entry of the release subset exists and collects tests, and the subset keeps
    the areas it is there for."""
    entries = release_subset()
    assert len(entries) == len(set(entries)), "an entry listed twice"
    files = {entry.split("::", 1)[0] for entry in entries}
    assert RELEASE_SUBSET_MUST_HOLD <= files, RELEASE_SUBSET_MUST_HOLD - files
    missing = [p for p in files if not (ROOT / p).is_file()]
    assert not missing, missing
    collected = [line for line in _pytest(*entries, "--collect-only").splitlines() if "::" in line]
    empty = [e for e in entries if not any(c == e or c.startswith(e + ("[" if "::" in e else "::")) for c in collected)]
    assert not empty, f"collect no tests: {empty}"

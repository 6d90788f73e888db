"""The CPU engine's sources and their build: every file of ``flexattn/cpu/csrc/`` reaches
a library's translation unit, so the library cache (keyed by that text) rebuilds when any
of them changes; the engine's one-time build is announced, a cache hit is silent."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from flexattn.cpu import sources

from conftest import DEVICE


def _units() -> tuple[str, str]:
    return sources.engine_source(), sources.mod_library_source("void f() {}", 'extern "C" void g() {}')


def test_translation_units_have_no_local_include_left():
    for unit in _units():
        assert '#include "' not in unit
        assert "struct FaCallArgs {" in unit and "FA_MAX_ROW" in unit


def test_a_change_to_any_source_changes_a_translation_unit(tmp_path, monkeypatch):
    copy = tmp_path / "csrc"
    shutil.copytree(sources.SOURCE_DIR, copy)
    monkeypatch.setattr(sources, "SOURCE_DIR", copy)
    before = _units()
    files = sorted(copy.iterdir())
    assert {"engine.cpp", "abi.h", "mods.cpp.jinja"} <= {p.name for p in files}
    for path in files:
        text = path.read_text()
        path.write_text(text + "\n// edited\n")
        assert _units() != before, f"{path.name} reaches neither the engine nor a mod library"
        path.write_text(text)
    assert _units() == before


_FIRST_CALL = textwrap.dedent("""
    import torch
    import flexattn
    q = torch.randn(1, 2, 64, 16)
    out = flexattn.flex_attention(q, q, q)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, q, q))
""")


def _first_call(cache_dir) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("FLEXATTN_LOG", "TRITON_INTERPRET")}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    done = subprocess.run([sys.executable, "-c", _FIRST_CALL], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stderr


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU engine")
def test_engine_build_is_announced_once_and_a_cache_hit_is_silent(tmp_path):
    """With no logging set up, the build of the engine prints a notice before it starts
    and its time after (stderr); the next process, finding the engine in the cache,
    prints neither."""
    stderr = _first_call(tmp_path)
    notice = [line for line in stderr.splitlines() if "building the CPU engine once" in line]
    assert notice == [f"flexattn: building the CPU engine once (about 20 s); cached in {tmp_path}"], stderr[-2000:]
    built = [line for line in stderr.splitlines() if line.startswith("flexattn: built the CPU engine in ")]
    assert len(built) == 1 and float(built[0].split(" in ")[1].rstrip(" s")) > 1.0, stderr[-2000:]
    assert stderr.index(notice[0]) < stderr.index(built[0])
    again = _first_call(tmp_path)
    assert "CPU engine" not in again, again[-2000:]

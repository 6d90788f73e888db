"""The CPU engine's sources and their build: every file of ``flexattn/cpu/csrc/`` reaches
a library's translation unit, so the library cache (keyed by that text) rebuilds when any
of them changes."""

from __future__ import annotations

import shutil

from flexattn.cpu import sources


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

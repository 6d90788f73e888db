"""The API reference (docs/api, Sphinx autodoc from the docstrings) builds offline with
warnings as errors, and every public name has an entry."""

from __future__ import annotations

import inspect
import pathlib
import posixpath
import subprocess
import sys

import pytest

import flexattn
from flexattn import mods
import flexattn.distributed as flexattn_distributed
import flexattn.integrations.transformers as flexattn_transformers


def _import_inventory_file():
    """sphinx's InventoryFile, or None. The submodule, not just "sphinx": an unrelated
    namespace package of that name would pass. A failed import leaves no partial
    "sphinx" in sys.modules: scipy, imported later by transformers in the same worker,
    reads sphinx's presence from sys.modules and then imports sphinx.ext."""
    before = set(sys.modules)
    try:
        from sphinx.util.inventory import InventoryFile
    except ImportError:
        for name in set(sys.modules) - before:
            del sys.modules[name]
        return None
    return InventoryFile


InventoryFile = _import_inventory_file()
if InventoryFile is None:
    pytest.skip("sphinx is in the [test] extra", allow_module_level=True)

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "api"


def _public_methods(cls) -> list[str]:
    return [name for name, _ in inspect.getmembers(cls) if not name.startswith("_") and name in cls.__dict__]


def test_api_reference_builds_and_covers_every_public_name(tmp_path):
    result = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS),
                             str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    with open(tmp_path / "objects.inv", "rb") as f:
        inventory = InventoryFile.load(f, "", posixpath.join)
    documented = {name for entries in inventory.values() for name in entries}
    expected = {f"flexattn.{name}" for name in flexattn.__all__ if name != "mods"}
    expected |= {f"flexattn.mods.{name}" for name in mods.__all__}
    expected |= {f"flexattn.BlockMask.{name}" for name in _public_methods(flexattn.BlockMask)}
    expected |= {f"flexattn.PagedKVCache.{name}" for name in _public_methods(flexattn.PagedKVCache)}
    expected |= {f"flexattn.distributed.{name}" for name in flexattn_distributed.__all__}
    expected |= {f"flexattn.integrations.transformers.{name}" for name in flexattn_transformers.__all__}
    missing = sorted(expected - documented)
    assert not missing, f"public names without an API reference entry: {missing}"
    assert (tmp_path / "kernel_options.html").exists()

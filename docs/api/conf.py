"""Sphinx configuration of flexattn's API reference (built offline from the docstrings;
tests/test_docs.py builds it with warnings as errors)."""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import flexattn  # noqa: E402
from flexattn import options  # noqa: E402

project = "flexattn"
release = flexattn.__version__
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
autodoc_member_order = "bysource"
autodoc_typehints = "none"
autodoc_default_options = {"members": True, "undoc-members": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
html_theme = "alabaster"
exclude_patterns = ["_build"]


def _kernel_options_rst() -> str:
    """The kernel_options reference, from the registry (as the guide's table is)."""
    lines = ["kernel_options", "==============", "",
             "Every key ``flex_attention`` accepts in ``kernel_options``, from ``flexattn.options``; "
             "``flexattn.FlexKernelOptions`` is the dict's type.", "",
             ".. list-table::", "   :header-rows: 1", "", "   * - key", "     - read by", "     - default",
             "     - effect"]
    for opt in options.OPTIONS:
        if not opt.public:
            continue
        default = (opt.default_doc or repr(opt.default)).split(" ([decisions]")[0]
        lines += [f"   * - ``{opt.name}``", f"     - {', '.join(opt.readers)}", f"     - {default}",
                  f"     - {opt.doc}"]
    return "\n".join(lines) + "\n"


(pathlib.Path(__file__).parent / "kernel_options.rst").write_text(_kernel_options_rst())

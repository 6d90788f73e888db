"""Rewrite the kernel_options table of docs/guide.md from flexattn's options registry
(``flexattn.options.markdown_table``); ``--check`` exits 1 when the guide is stale."""

from __future__ import annotations

import pathlib
import sys

GUIDE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "guide.md"
START, END = "<!-- kernel-options:start", "<!-- kernel-options:end -->"


def render(text: str) -> str:
    from flexattn.options import markdown_table

    head_end = text.index("\n", text.index(START)) + 1
    return text[:head_end] + markdown_table() + text[text.index(END):]


def main() -> int:
    text = GUIDE.read_text()
    updated = render(text)
    if "--check" in sys.argv:
        return 0 if updated == text else 1
    GUIDE.write_text(updated)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The README's quickstart runs as written (on this machine's device) and prints what it
says it prints."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_quickstart_runs_as_written():
    block = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    expected = re.search(r"print\(out\.shape\)\s+# (.*)", block).group(1).strip()
    result = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == expected

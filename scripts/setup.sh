#!/usr/bin/env bash
# Install flexattn and what it needs, on a fresh machine or one that already has torch.
#   bash scripts/setup.sh        # the package (for the demo)
#   bash scripts/setup.sh test   # the package and the test tools
# What it does: if `import torch` fails, `pip install torch==2.13.0` (pinned, so that pip
# does not pick whatever is newest; whether that is a CPU or a CUDA build is up to the
# index pip uses: this project's CI machines resolve it to a CPU build); a machine that
# has torch (the GPU image: 2.11) keeps it. Then `pip install -e .` (with `test`, the
# [test] extra: pytest, pytest-xdist, numpy, pyflakes, sphinx, and transformers for
# tests/test_transformers_integration.py; an installed 4.57 or 5.x is kept).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
extra=""
[ "${1:-}" = "test" ] && extra="[test]"
"$PY" -m pip install -q --no-build-isolation -e ".${extra}" 2>/dev/null \
  || "$PY" -m pip install -q -e ".${extra}"

#!/usr/bin/env bash
# Install flexattn and what it needs, on a fresh machine or one that already has torch.
#   bash scripts/setup.sh        # the package (for the demo)
#   bash scripts/setup.sh test   # the package and the test tools
# A machine without torch gets the CPU build of torch 2.13.0 (a bare `torch` requirement
# could pull a multi-GB CUDA build); a machine with torch (the GPU image: 2.11) keeps it.
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

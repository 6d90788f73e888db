#!/usr/bin/env bash
# Install flexattn and what it needs, on a fresh machine or one that already has torch.
#   bash scripts/setup.sh            # the package (for the demo)
#   bash scripts/setup.sh test       # the package and the test tools (the [test] extra)
#   bash scripts/setup.sh ... --replace   # also let pip replace installed packages
# What it does: if `import torch` fails, `pip install torch==2.13.0` (the release CI runs
# the whole suite on; whether pip picks a CPU or a CUDA build is up to the index it uses:
# this project's CI machines resolve it to a CPU build); a machine that has a torch
# pyproject.toml accepts (2.11 to 2.15) keeps it. Then `pip install -e .` (with `test`,
# the [test] extra: pytest, pytest-xdist, triton for the interpreter, pyflakes, sphinx,
# and transformers for tests/test_transformers_integration.py; an installed 4.57 or 5.x is kept).
# pip replaces an installed package whose version pyproject.toml's ranges exclude (a torch
# too new, an older transformers): this script asks pip for its plan first and, when the
# plan replaces anything, lists it and stops without installing unless given --replace.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
target="."
replace=0
for arg in "$@"; do
  case "$arg" in
    test) target=".[test]" ;;
    --replace) replace=1 ;;
    *) echo "usage: bash scripts/setup.sh [test] [--replace]" >&2; exit 2 ;;
  esac
done

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q "torch==2.13.0"
fi

# The editable install, with the build tools already installed where they suffice.
pip_install() {
  "$PY" -m pip install -q --no-build-isolation "$@" -e "$target" 2>/dev/null \
    || "$PY" -m pip install -q "$@" -e "$target"
}

if [ "$replace" = 0 ]; then
  report=$(mktemp)
  trap 'rm -f "$report"' EXIT
  pip_install --dry-run --report "$report"
  replaced=$("$PY" - "$report" <<'EOF'
import json
import sys
from importlib import metadata

for item in json.load(open(sys.argv[1]))["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    if name.lower() == "flexattn":
        continue
    try:
        installed = metadata.version(name)
    except metadata.PackageNotFoundError:
        continue
    if installed != version:
        print(f"  {name} {installed} -> {version}")
EOF
)
  if [ -n "$replaced" ]; then
    {
      echo "scripts/setup.sh: installing flexattn ($target) would replace installed packages:"
      echo "$replaced"
      echo "Nothing was installed. Install versions pyproject.toml accepts yourself, or run"
      echo "again with --replace to let pip replace them."
    } >&2
    exit 1
  fi
fi
pip_install

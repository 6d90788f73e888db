#!/usr/bin/env bash
# The release subset (tests/release_subset.txt) on a torch release besides the default,
# in a venv outside the clone, reused while it holds that release.
#   bash .ci/other_release.sh           # the release this commit rotates to
#   bash .ci/other_release.sh 2.15.0    # a given one
# Installing a release and running the subset take about as long as the whole suite, so
# a run tests one of RELEASES, picked by the commit's hash: a commit always gets the same
# one, and consecutive commits spread over all of them.
set -euo pipefail
cd "$(dirname "$0")/.."
RELEASES=(2.14.1 2.15.0)
if [ $# -gt 0 ]; then
  release=$1
else
  head=$(git rev-parse HEAD)
  release=${RELEASES[$(( 0x${head:0:7} % ${#RELEASES[@]} ))]}
fi
venv=${FLEXATTN_CI_VENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/flexattn-ci}/torch-$release
echo "ci: the release subset on torch $release ($venv)"
if ! "$venv/bin/python" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$release')" 2>/dev/null; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  packages=("torch==$release" numpy jinja2 sympy pytest pytest-xdist)
  case "$release" in
    # Above the torch<=2.14.1 cap of the CI machines' pip configuration (the releases on
    # their disk): this one install reads no pip configuration and takes the index's.
    2.15.*) PIP_CONFIG_FILE=/dev/null "$venv/bin/pip" install -q "${packages[@]}" ;;
    *) "$venv/bin/pip" install -q "${packages[@]}" ;;
  esac
fi
mapfile -t subset < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' -e '/^$/d' tests/release_subset.txt)
# The heavy parametrisations (tests/conftest.py HEAVY) run on the default torch only.
PYTHONPATH=$PWD "$venv/bin/python" -m pytest "${subset[@]}" -q -n auto -m "not heavy"

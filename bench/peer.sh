#!/usr/bin/env bash
# PyTorch's own FlexAttention tests against flexattn: runs test/inductor/test_flex_attention.py
# ("fa") and test_flex_decoding.py ("fd"), torch 2.11's versions, through the shared peer
# runner with the public names bound to flexattn, one parametrisation per test function and
# torch-internal tests left out, then writes the results and their summary to
# bench/results/peer-<device>-<date>-{fa,fd}.{json,txt}. Not part of CI: the upstream files
# are not ours to commit. Needs a GPU for the counted (CUDA) tests.
#
#   PEER_UPSTREAM_DIR  folder holding the two upstream files (sizes and sha256 in the
#                      runner's README); default .peer/ (git-ignored)
#   PEER_RUNNER_DIR    the runner (run_peer.py, summarize.py); default ../shared/peer
#   PEER_WORKERS, PEER_BUDGET_FA, PEER_BUDGET_FD  workers and per-file wall budgets (s)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
export PEER_UPSTREAM_DIR=${PEER_UPSTREAM_DIR:-$root/.peer}
runner=${PEER_RUNNER_DIR:-$root/../shared/peer}
export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
# The workers compile in their own processes (scripts/gpu_run.sh says why).
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1}
device=$(python3 -c "import torch; print(torch.cuda.get_device_name().lower().replace(' ', '-') if torch.cuda.is_available() else 'cpu')")
stamp=$(date -u +%Y%m%d-%H%M%S)
for file in fa fd; do
  budget_var=PEER_BUDGET_$(echo $file | tr a-z A-Z)
  out=$root/bench/results/peer-$device-$stamp-$file
  python3 "$runner/run_peer.py" --out "$out.json" --files $file --device cuda --max-per-test 1 --skip-internal \
    --workers "${PEER_WORKERS:-12}" --timeout 150 --budget "${!budget_var:-470}" > "$out.log" 2>&1 || true
  python3 "$runner/summarize.py" "$out.json" > "$out.txt"
  rm -f "$out.log"
  head -4 "$out.txt"
done

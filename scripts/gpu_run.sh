#!/usr/bin/env bash
# One device-tool call: the CUDA test run and the benchmarks, logs under $OUT.
#   bash scripts/gpu_run.sh "<pytest targets>" "<bench args>" [test_budget_s] [bench_budget_s]
# Prints a short summary last. Uses the machine's own torch (2.11) and triton (3.6).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/flexattn-out}
mkdir -p "$OUT"
TESTS=${1:-tests}
BENCH=${2:---quick}
TEST_BUDGET=${3:-360}
BENCH_BUDGET=${4:-200}
{
  nvidia-smi -L
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/env.txt"
timeout "$TEST_BUDGET" python3 -m pytest $TESTS -q -p no:cacheprovider -rf --durations=10 >"$OUT/tests.log" 2>&1
echo "pytest exit: $?" >>"$OUT/tests.log"
if [ -n "$BENCH" ] && [ "$BENCH" != "none" ]; then
  timeout "$BENCH_BUDGET" python3 bench/bench_attention.py $BENCH --out "$OUT" >"$OUT/bench.log" 2>&1
  echo "bench exit: $?" >>"$OUT/bench.log"
fi
echo "===== tests (failures and summary)"
grep -E "^(FAILED|ERROR)|passed|failed|pytest exit" "$OUT/tests.log" | tail -25
echo "===== bench"
tail -30 "$OUT/bench.log" 2>/dev/null

#!/usr/bin/env bash
# One device-tool call: the CUDA test run and the benchmarks, logs under $OUT.
#   bash scripts/gpu_run.sh "<pytest targets>" "<bench args>" [test_budget_s] [bench_budget_s]
# Prints a short summary last. Uses the machine's own torch (2.11) and triton (3.6).
# The whole CUDA suite outgrew one 600 s call: FLEXATTN_SHARD=i/n (tests/conftest.py) runs
# every n-th test from the i-th, e.g. three calls with 1/3, 2/3 and 3/3. On a host with n
# GPUs, GPUS=n runs the n shards at once, one per GPU, each under $OUT/shard<i> (no
# benchmarks then). A run cut off by the limit goes on in the next call with
# FLEXATTN_RESUME=<its progress logs, ':'-joined> (with FLEXATTN_PROGRESS_LOG set).
# SHARDS=m FIRST_SHARD=f with GPUS=n runs shards f..f+n-1 of m, so two calls on two GPUs
# (FIRST_SHARD=1, then 3, SHARDS=4) cover a suite too long for one call.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/flexattn-out}
mkdir -p "$OUT"
GPUS=${GPUS:-1}
# pytest-xdist workers per shard: the suite is bound by compiling (one compile thread per
# worker), so each shard takes its GPU's share of the cores but two (8 on a 16-core host
# left half of them idle). WORKERS=n overrides it.
export WORKERS=${WORKERS:-$(( $(nproc) / GPUS > 6 ? $(nproc) / GPUS - 2 : 4 ))}
if [ "$GPUS" -gt 1 ]; then
  # One import first, so the shards' workers do not all read torch from a cold disk at once,
  # and the CPU engine built once into Inductor's on-disk cache before the workers start:
  # otherwise tests on the CPU path wait on one build made under every worker's compile
  # load (some such tests took 100-205 s in a suite run; the build's share is unmeasured).
  python3 -c "import torch, triton, flexattn; from flexattn.cpu import build; build.engine()" >/dev/null 2>&1
  SHARDS=${SHARDS:-$GPUS} FIRST_SHARD=${FIRST_SHARD:-1}
  for i in $(seq 1 "$GPUS"); do
    # (A prefix assignment sees the ones before it, so these are named first.)
    SHARD="$((FIRST_SHARD + i - 1))/$SHARDS" SHARD_OUT="$OUT/shard$i"
    CUDA_VISIBLE_DEVICES=$((i - 1)) FLEXATTN_SHARD=$SHARD GPUS=1 OUT="$SHARD_OUT" \
      FLEXATTN_PROGRESS_LOG="$SHARD_OUT/progress.log" bash "$0" "${1:-tests}" none "${3:-360}" 0 \
      >"$SHARD_OUT.summary" 2>&1 &
  done
  wait
  for i in $(seq 1 "$GPUS"); do echo "===== shard $((FIRST_SHARD + i - 1))/$SHARDS"; tail -20 "$OUT/shard$i.summary"; done
  exit 0
fi
TESTS=${1:-tests}
BENCH=${2:---quick}
TEST_BUDGET=${3:-360}
BENCH_BUDGET=${4:-200}
export FLEXATTN_FAIL_LOG="$OUT/failures.log"
PARALLEL=""
# Carried wheels, if any (the GPU image lacks a package the tests need).
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
# Compiling kernels is CPU-bound, so the tests run in parallel where pytest-xdist is
# installed (the GPU image has it).
if python3 -c "import xdist" >/dev/null 2>&1; then
  PARALLEL="-n $WORKERS"
  # Each worker compiles in its own process: by default every worker starts a pool of
  # cpu_count compile processes, too many for a multi-GPU host's shards.
  export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1}
fi
# (A single-shard run builds the CPU engine first for the same reason; a no-op once cached.)
[ "${FLEXATTN_SHARD:-}" ] || python3 -c "from flexattn.cpu import build; build.engine()" >/dev/null 2>&1
# The machine in the summary (a shard writes no env.txt: the device tool brings back at most
# eight files, and two shards' tests.log, progress.log and failures.log and summaries make eight).
{
  nvidia-smi -L
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} 2>&1 | if [ "${FLEXATTN_SHARD:-}" ]; then cat; else tee "$OUT/env.txt"; fi
timeout "$TEST_BUDGET" python3 -m pytest $TESTS $PARALLEL -q -p no:cacheprovider -rf --durations=10 >"$OUT/tests.log" 2>&1
echo "pytest exit: $?" >>"$OUT/tests.log"
if [ -n "$BENCH" ] && [ "$BENCH" != "none" ]; then
  timeout "$BENCH_BUDGET" python3 bench/bench_attention.py $BENCH --out "$OUT" >"$OUT/bench.log" 2>&1
  echo "bench exit: $?" >>"$OUT/bench.log"
fi
echo "===== tests (failures and summary)"
grep -E "^(FAILED|ERROR)|passed|failed|pytest exit" "$OUT/tests.log" | tail -25
grep "^=====" "$OUT/failures.log" 2>/dev/null | head -40
echo "===== bench"
tail -30 "$OUT/bench.log" 2>/dev/null

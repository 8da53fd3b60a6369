#!/usr/bin/env bash
# One device call: wheels, GPU tests, attention check, `python -m benchmarks.harness`, engine profile.
# Usage: bash benchmarks/run_device.sh [bench parts] [extra bench args...]; outputs under $OUT.
set -u
source "$(dirname "$0")/device_env.sh"
PARTS=${1:-ceilings,decode,prefill,e2e,hf}; shift || true
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm --format=csv
if [ "${RUN_TESTS:-1}" != 0 ]; then
  timeout 240 python3 -m pytest -q -x -m gpu tests/gpu -p no:cacheprovider 2>&1 | tail -25 > $OUT/gpu_tests.log; tail -3 $OUT/gpu_tests.log
fi
if [ "${RUN_ATTN:-0}" != 0 ]; then
  python3 benchmarks/attention_check.py --out $OUT > $OUT/attention_check.log 2>&1; tail -12 $OUT/attention_check.log
fi
python3 -m benchmarks.harness --parts "$PARTS" --out $OUT --workdir /tmp/twb "$@" 2>&1 | tee $OUT/bench.log | grep -v "^\s*$" | grep -v "Loading weights" | tail -60
if [ "${E2E_BATCH2:-0}" != 0 ]; then
  python3 -m benchmarks.harness --parts e2e --out /tmp/e2e2 --workdir /tmp/twb --e2e-max-batch-size $E2E_BATCH2 "$@" > /tmp/e2e2.log 2>&1
  cp /tmp/e2e2/results.json $OUT/e2e_batch$E2E_BATCH2.json; grep -A3 "End to end" /tmp/e2e2/RESULTS.md
fi
if [ "${RUN_PROFILE:-0}" != 0 ]; then
  python3 benchmarks/engine_profile.py /tmp/twb/llama3-8b-shape-32l --out $OUT > /tmp/engine_profile.log 2>&1; head -8 $OUT/engine_profile.txt
  python3 benchmarks/decode_profile.py /tmp/twb/llama3-8b-shape-32l --batches 1,64,256 --out $OUT 2>&1 | grep -v -i warn | tail -36
fi

#!/usr/bin/env bash
# Issue 27 on 2 GPUs, one device call: the fused all-reduce + norm / pushed-GEMV exactness test
# (which now records the dispatcher's backend per bucket and compares against both references)
# repeated until the time budget, then the 200-replay stress test. Summary lines under $OUT.
set -u
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name --format=csv,noheader
budget=${BUDGET_S:-400}
# One GEMV tuning cache for every run (tests/gpu/test_multi_gpu.py reads it): the first run
# measures the pushed-GEMV shape, the others read it.
export TUNING_CACHE_DIR=${TUNING_CACHE_DIR:-/tmp/tp_exactness_gemv_tuning}
start=$SECONDS
runs=0; passed=0
while (( SECONDS - start < budget )); do
  runs=$((runs + 1))
  if timeout 200 python3 -m pytest -q -s -m gpu tests/gpu/test_multi_gpu.py -p no:cacheprovider \
      -k "fused_all_reduce_add_rms_norm_equals_unfused" > $OUT/fused_run_$runs.log 2>&1; then
    passed=$((passed + 1))
  fi
  grep -E "passed|failed|\{" $OUT/fused_run_$runs.log | tail -3
done
echo "fused test: $passed of $runs runs passed" | tee $OUT/fused_summary.txt
timeout 300 python3 -m pytest -q -s -m gpu tests/gpu/test_multi_gpu.py -p no:cacheprovider \
  -k stress 2>&1 | tail -5 | tee $OUT/stress.log

#!/usr/bin/env bash
# Issue 23 in one device call (< 6 min on an H100): the overlap GPU test, then the engine-only
# bound of the 1,000-request e2e workload (overlap off and on, same process; pure-GPU bound;
# GPU-busy fraction from a torch.profiler trace) and the served e2e with the router's --overlap
# and --no-overlap, one after the other. Outputs under $OUT (RESULTS.md, results.json, logs).
# Usage: bash benchmarks/run_overlap_device.sh [extra bench args...]
set -u
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm --format=csv
timeout 150 python3 -m pytest -q -x -m gpu tests/gpu/test_overlap_gpu.py -p no:cacheprovider \
  2>&1 | tail -15 > $OUT/overlap_gpu_test.log; tail -3 $OUT/overlap_gpu_test.log
timeout 420 python3 -m benchmarks.harness --parts engine,e2e --e2e-overlap both --out $OUT \
  --workdir /tmp/twb "$@" 2>&1 | tee $OUT/bench.log | grep -v "^\s*$" | grep -v "Loading weights" | tail -40

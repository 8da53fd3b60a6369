#!/usr/bin/env bash
# Issue 23 in one device call (about 5 min on an H100): the overlap GPU test, then the engine-only
# bound of the 1,000-request e2e workload (overlap off and on, same process; pure-GPU bound;
# GPU-busy fraction from a torch.profiler trace, its pauses left out of the wall time) and the
# served e2e with the router's --overlap and --no-overlap, one after the other, each after 64
# warm-up requests, the shard recording its device timeline (--profile-from-step 0).
# Outputs under $OUT (RESULTS.md, results.json, bench.log, both servers' logs, the shards'
# steps.json in steps.tgz). Usage: bash benchmarks/run_overlap_device.sh [extra bench args...]
set -u
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm --format=csv
timeout 150 python3 -m pytest -q -x -m gpu tests/gpu/test_overlap_gpu.py -p no:cacheprovider \
  2>&1 | tail -15 > $OUT/overlap_gpu_test.log; tail -3 $OUT/overlap_gpu_test.log
timeout 420 python3 -m benchmarks.harness --parts engine,e2e --e2e-overlap both --out $OUT \
  --workdir /tmp/twb "$@" 2>&1 | grep -v "^\s*$" | grep -v "Loading weights" > $OUT/bench.log
sed -n '/Engine-only bound vs served/,/End to end/p' $OUT/RESULTS.md
grep -i "Traceback\|Error" $OUT/bench.log | head
(cd /tmp/twb/profiles && tar czf $OUT/steps.tgz */rank0/steps.json)

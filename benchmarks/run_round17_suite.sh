#!/usr/bin/env bash
# Round 17 device call: interleaved A/Bs of the batch-1 step (VARIANTS, as run_round17_ab.sh),
# then the whole GPU suite.
# run(command="bash benchmarks/run_round17_suite.sh VARIANTS", carry=[".whl-tw"]).
set -u
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
timeout 140 python3 -m benchmarks.moe_b1_bench --out $OUT --parts bf16,fp8 --variants "$1" 2>&1 \
  | grep -v Warn > $OUT/bench.log
grep "^model" $OUT/bench.log
timeout 430 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu 2>&1 | tail -25 > $OUT/gpu_suite.log
tail -6 $OUT/gpu_suite.log

#!/usr/bin/env bash
# Round 16's last device call: main's batch-1 step alone (its first variant: see MOE_B1.md on
# the drift over a process's variants), bf16 and fp8, then the whole GPU suite.
# run(command="bash benchmarks/run_round16_final.sh", carry=[".whl-tw"]).
set -u
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
timeout 130 python3 -m benchmarks.moe_b1_bench --out $OUT --parts bf16,fp8 --variants old 2>&1 \
  | grep -v Warn | tee $OUT/bench.log | grep -v "kernels:\|roofline bytes" | tail -8
timeout 440 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu 2>&1 | tail -25 > $OUT/gpu_suite.log
tail -6 $OUT/gpu_suite.log

#!/usr/bin/env bash
# Round 20, lease 6: main's batch-1 step broken down for the next round (benchmarks/MOE_B1.md,
# round 20 "Next"): the critical path by kernel (CUPTI, one profiled variant a process: the
# profiler slows later replays) and the stamped MoE and attention launches' phases.
# run(command="bash benchmarks/run_round20_breakdown.sh", carry=[".whl-tw"]).
set -u
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
for part in bf16 fp8; do
  timeout 110 python3 -m benchmarks.moe_b1_bench --out $OUT/prof_$part --parts $part \
    --variants old 2>&1 | grep -v Warn > $OUT/prof_$part.log
  grep -E "^model|rror" $OUT/prof_$part.log | cut -c1-100
done
timeout 150 python3 -m benchmarks.moe_b1_bench --out $OUT/stamps --no-profile --stamps \
  --parts bf16,fp8 --variants old 2>&1 | grep -v Warn > $OUT/stamps.log
grep -E "^model|stamps|rror" $OUT/stamps.log | cut -c1-160

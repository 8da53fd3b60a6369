#!/usr/bin/env bash
# Round 16: main's batch-1 step, bf16 and fp8, with the per-kernel critical path (the summary's
# `exposed` lines). run(command="bash benchmarks/run_round16_exposed.sh", carry=[".whl-tw"]).
set -u
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
timeout 200 python3 -m benchmarks.moe_b1_bench --out $OUT --parts bf16,fp8 --variants old 2>&1 \
  | grep -v Warn | tee $OUT/bench.log | tail -12

#!/usr/bin/env bash
# Round 20, lease 7: the o_proj GEMV's batch-1 candidates in the bf16 step (benchmarks/MOE_B1.md,
# round 20 "Next" item 2: o_proj streams at 63 % of copy in the step, q/k/v at 88 %), without the
# profiler; the tuned choice is printed with `old`.
# run(command="[ROUND20_OPROJ=tiles] bash benchmarks/run_round20_oproj.sh", carry=[".whl-tw"]).
set -u
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
# call 7: every candidate and cuBLAS; call 8 (ROUND20_OPROJ=tiles): tiles outside the candidates
v=old
if [ "${ROUND20_OPROJ:-}" = tiles ]; then
  t="old:oproj-2x2048w4st1,old:oproj-1x4096w4st1,old:oproj-2x4096w8st1,old:oproj-4x2048w8st1"
  v=old,$t,old:oproj-1x2048w4st1,old,$t
else
  for i in 0 1 2 3 4 5 6 7 8 9 10; do v=$v,old:oproj-c$i; done
  v=$v,old:oproj-cublas,old
fi
timeout 280 python3 -m benchmarks.moe_b1_bench --out $OUT/oproj --no-profile --parts bf16 \
  --variants $v 2>&1 | grep -v Warn > $OUT/oproj.log
grep -E "^model|o_proj|rror" $OUT/oproj.log | cut -c1-220

#!/usr/bin/env bash
# Round 16 device call 4 (benchmarks/MOE_B1.md, round 16): interleaved A/Bs of the batch-1 step
# (each variant next to an `old`, since a step time drifts over one process's variants):
# the one-warp routing launch, the input norm inside the q/k/v GEMV, the o_proj L2 warm.
# run(command="bash benchmarks/run_round16_ab.sh", carry=[".whl-tw"]).
set -u
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
# (Run at b861534 as old:route-w1 against 4 warps; one warp is the table's default since.)
v=old,old:route-w4,old:norm-prologue,old:warm-o,old,old:route-w4,old:norm-prologue,old:warm-o,old
timeout 560 python3 -m benchmarks.moe_b1_bench --out $OUT --parts bf16,fp8 --variants $v 2>&1 \
  | grep -v Warn | tee $OUT/bench.log | grep -v "kernels:\|roofline bytes" | tail -24

#!/usr/bin/env bash
# Round 17 device call (benchmarks/MOE_B1.md, round 17): the MoE GPU tests, then interleaved A/Bs
# of the batch-1 step (each variant between `old`s: a step time drifts over one process's
# variants). In fp8, old:down-early is the table's own config (its split down launch already
# guesses its ids), so it doubles as a noise control.
# run(command="[TESTS=0] [PARTS=attention,bf16,fp8] bash benchmarks/run_round17_ab.sh [VARIANTS]",
#     carry=[".whl-tw"]).
set -u
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv > $OUT/gpu.txt
if [ "${TESTS:-1}" = 1 ]; then
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_moe_cuda.py 2>&1 \
    | tail -15 > $OUT/gpu_moe.log
  tail -3 $OUT/gpu_moe.log
fi
r="old:route-trigger,old:down-early,old:split16,old:norm-prologue,old:route-trigger+down-early"
v=${1:-old,$r,old,$r,old}
timeout 330 python3 -m benchmarks.moe_b1_bench --out $OUT --parts ${PARTS:-bf16,fp8} --variants $v 2>&1 \
  | grep -v Warn > $OUT/bench.log
grep "^model" $OUT/bench.log

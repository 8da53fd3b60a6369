#!/usr/bin/env bash
# Round 19, fifth lease (benchmarks/MOE_B1.md, round 19): DecodeConfig.down_warm (the down
# launch's rows asked of L2 before its PDL wait, during gate/up): its GPU tests, then the step
# A/B without the profiler, interleaved.
# run(command="bash benchmarks/run_round19_d.sh", carry=[".whl-tw"]). A record (call 6, d22cf87):
# down_warm lost (bf16 +4.1 us a layer, fp8 +0.6) and was removed after it.
set -u
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
timeout -s INT 70 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_moe_cuda.py \
  -k "split_down_from or early_ids" -rfE 2>&1 | grep -v Warn | tail -4
timeout 110 python3 -m benchmarks.moe_b1_bench --out $OUT/ab --no-profile --parts bf16,fp8 \
  --variants old,old:down-warm,old,old:down-warm 2>&1 | grep -v Warn > $OUT/ab.log
grep -E "^model|rror" $OUT/ab.log | cut -c1-100

#!/usr/bin/env bash
# One nvidia-h200 call (issue 8, fp8 weights): GPU tests incl. the fp8 GEMV kernel, the GEMV
# micro-benchmark, then `python -m benchmarks.harness --parts decode` in bf16 and with --quantize fp8 on the
# same machine (batch-1 speedup = bf16 graph ms / fp8 graph ms). Outputs under $OUT.
set -u
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv
if [ "${RUN_TESTS:-1}" != 0 ]; then
  timeout 240 python3 -m pytest -q -m gpu tests/gpu tests/shard/test_quantization.py -p no:cacheprovider -rA 2>&1 \
    | grep -v -i warn > $OUT/gpu_tests.log; grep -E "passed|failed|FAILED|Error" $OUT/gpu_tests.log | tail -25
fi
timeout 150 python3 benchmarks/fp8_gemv_check.py --out $OUT/fp8_gemv.json > $OUT/fp8_gemv.log 2>&1; tail -40 $OUT/fp8_gemv.log
for q in none fp8; do
  extra=(); [ $q != none ] && extra=(--quantize $q)
  timeout 200 python3 -m benchmarks.harness --parts decode --decode-batches ${BATCHES:-1,8,16,64} \
    --out $OUT/bench_$q --workdir /tmp/twb "${extra[@]}" "$@" > $OUT/bench_$q.log 2>&1
  grep -E "^decode|Error|error" $OUT/bench_$q.log | tail -8
done

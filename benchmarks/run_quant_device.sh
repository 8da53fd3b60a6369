#!/usr/bin/env bash
# One nvidia-h200 call (issue 8): GPU tests with bitsandbytes, then benchmarks/quant_check.py
# on the Llama-3-8B shape. Outputs under $OUT.
set -u
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout 150 python3 -m pytest -q -m gpu tests/gpu tests/shard/test_quantization.py -p no:cacheprovider -s -rA 2>&1 \
  | grep -v -i warn > $OUT/gpu_tests.log; grep -E "passed|failed|FAILED|fp8 KV" $OUT/gpu_tests.log
timeout ${QUANT_TIMEOUT:-420} python3 benchmarks/quant_check.py --out $OUT/quant_check.json 2>&1 | tee $OUT/quant_check.log | tail -30

#!/usr/bin/env bash
# One nvidia-h200 call (issue 8): GPU tests with bitsandbytes, then benchmarks/quant_check.py
# on the Llama-3-8B shape. Outputs under $OUT.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
export PYTHONPATH=".:gen/python:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout 150 python3 -m pytest -q -m gpu tests/gpu tests/shard/test_quantization.py -p no:cacheprovider -s -rA 2>&1 \
  | grep -v -i warn > $OUT/gpu_tests.log; grep -E "passed|failed|FAILED|fp8 KV" $OUT/gpu_tests.log
timeout ${QUANT_TIMEOUT:-420} python3 benchmarks/quant_check.py --out $OUT/quant_check.json 2>&1 | tee $OUT/quant_check.log | tail -30

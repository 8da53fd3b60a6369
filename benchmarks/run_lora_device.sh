#!/usr/bin/env bash
# One device call for issue 25 (LoRA): the LoRA GPU tests, then benchmarks/lora.py on the
# Llama-3-8B shape at rank 16 (decode at batch 64: base vs 1 / 4 adapters; adapter load time).
# Usage: bash benchmarks/run_lora_device.sh; outputs under $OUT (lora.json, lora.log, gpu tests).
set -u
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
timeout 300 python3 -m pytest -q -m gpu tests/gpu/test_lora_cuda.py -p no:cacheprovider 2>&1 \
  | tail -25 > $OUT/gpu_tests_lora.log; tail -3 $OUT/gpu_tests_lora.log
python3 -m benchmarks.lora --device cuda --out $OUT/lora.json 2>&1 | grep -v "Loading weights" \
  | tail -20 | tee $OUT/lora.log

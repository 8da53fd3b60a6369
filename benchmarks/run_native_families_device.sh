#!/usr/bin/env bash
# One device call for issue 38 (native Qwen3 / OLMo-2 / Phi-3), < 8 minutes on one H100: the GPU
# tests of the new code (q/k-norm kernel vs torch, eagerly and in a CUDA graph; each family's tiny
# model decoding from CUDA graphs vs transformers), then the benchmark harness twice on random
# bf16 8B checkpoints, the Qwen3-8B shape and the Llama-3-8B shape (decode graph replay at batch
# 1/64/256 against the memory roofline, end-to-end req/s on the harness workload), then the
# comparison (Qwen3 batch 1 >= 85 % of roofline, Qwen3 req/s >= 90 % of Llama's).
# Outputs under $OUT: gpu_tests_native_families.log, qwen3/ and llama/ (each the harness's
# results.json, RESULTS.md, bench.log, e2e_server.log), native_families.md.
# Usage: bash benchmarks/run_native_families_device.sh
set -u
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
timeout 75 python3 -m pytest -q -m gpu tests/gpu/test_qk_norm_cuda.py \
  tests/gpu/test_native_families_cuda.py -p no:cacheprovider 2>&1 | tail -25 \
  > $OUT/gpu_tests_native_families.log; tail -3 $OUT/gpu_tests_native_families.log
for shape in qwen3 llama; do
  mkdir -p $OUT/$shape
  # SIGINT at the limit: the harness's finally blocks stop the e2e deployment before the next run.
  limit=185; [ $shape = qwen3 ] && limit=215  # 36 layers, a larger vocabulary; GEMV tuning at warm-up
  timeout -s INT -k 15 $limit python3 -m benchmarks.harness --model-type $shape --parts decode,e2e \
    --decode-batches 1,64,256 --skip-ab --e2e-overlap on --out $OUT/$shape --workdir /tmp/twb \
    2>&1 | grep -v "Loading weights\|Writing model shards" > $OUT/$shape/bench.log
  grep -E "^decode b=|requests_per_s|Traceback|Error" $OUT/$shape/bench.log | cut -c1-300 | tail -8
  [ $shape = qwen3 ] && rm -rf /tmp/twb/qwen3-8b-shape-*  # 16 GB; Llama's stays for other scripts
done
python3 benchmarks/native_family_compare.py $OUT/qwen3/results.json $OUT/llama/results.json \
  --out $OUT/native_families.md

#!/usr/bin/env bash
# One device call for issue 24 (speculative decoding), < 4 minutes on one H100: the verify-graph
# GPU test, then benchmarks/speculate.py's GPU part (trained tiny llama equality; 8B shape:
# verify-step costs, where verify logits differ from decode, batch-1 tokens/s on random and
# looping workloads with acceptance, batch 64 adaptive rule vs off). Outputs under $OUT
# (speculate_gpu.json / .md, speculate_gpu_partial.json while it runs, gpu_tests_speculate.log).
set -u
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
timeout 60 python3 -m pytest -q -m gpu tests/gpu/test_verify_graphs.py -p no:cacheprovider 2>&1 \
  | tail -25 > $OUT/gpu_tests_speculate.log; tail -3 $OUT/gpu_tests_speculate.log
timeout 230 python3 -m benchmarks.speculate gpu --out $OUT --workdir /tmp/twb 2>&1 \
  | grep -v "Loading weights\|Writing model shards\|nanobind\|leaked\|^ - " | tee $OUT/speculate_gpu.log

#!/usr/bin/env bash
# One device call for issue 25 (LoRA), ~3 min on an H100 (timeouts cap it at ~7): the LoRA GPU
# tests (incl. the folded path in CUDA graphs); the LoRA path of one Llama-3-8B layer alone
# (benchmarks/lora_kernels.py: every slot's A folded into the base weights, one expand per
# linear; per-layer us in CUDA graphs at batch 64 with 1 / 4 adapters / half base, the wide
# GEMMs' growth, each projection's cost, each expand alone, per-kernel us; then PDL off, the
# previous shrink + expand design in the same process, and the expands' block constants); then
# benchmarks/lora.py end to end (decode at batch 64: base vs 1 / 4 adapters; adapter load time).
# Usage: bash benchmarks/run_lora_device.sh; outputs under $OUT (gpu_tests_lora.log,
# lora_kernels.json + .log, lora.json + lora.log).
set -u
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
t0=$(date +%s)
timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_lora_cuda.py -p no:cacheprovider 2>&1 \
  | tail -60 > $OUT/gpu_tests_lora.log; tail -3 $OUT/gpu_tests_lora.log
echo "tests: $(( $(date +%s) - t0 )) s"
timeout 120 python3 -m benchmarks.lora_kernels --sweep-budget-s 25 --out $OUT/lora_kernels.json \
  > $OUT/lora_kernels.log 2>&1; grep -v UserWarning $OUT/lora_kernels.log | tail -30 | cut -c1-1500
echo "kernels: $(( $(date +%s) - t0 )) s"
timeout 150 python3 -m benchmarks.lora --device cuda --out $OUT/lora.json 2>&1 \
  | grep -v "Loading weights" | tail -20 | tee $OUT/lora.log
echo "total: $(( $(date +%s) - t0 )) s"

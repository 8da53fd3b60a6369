#!/usr/bin/env bash
# One nvidia-h100-x1 call (issue 40, W8A8-int8; ~3-5 minutes): benchmarks/w8a8_check.py (the
# Triton quantize / int8 GEMM vs the CPU reference, then W8A8 vs bf16 on the Llama-3-8B shapes at
# batches 1..2048, eager and under CUDA graphs). Outputs under $OUT: w8a8.json, w8a8.md, w8a8.log.
set -u
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout 480 python3 benchmarks/w8a8_check.py --out $OUT/w8a8.json > $OUT/w8a8.log 2>&1
echo "rc=$?"; tail -45 $OUT/w8a8.log

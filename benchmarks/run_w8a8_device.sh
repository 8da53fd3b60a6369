#!/usr/bin/env bash
# One nvidia-h100-x1 call (issue 40, W8A8-int8): benchmarks/w8a8_check.py (correctness vs the
# CPU int32 reference, W8A8 vs bf16 on the Llama-3-8B shapes, batches 1..1024). Outputs under $OUT.
set -u
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout 300 python3 benchmarks/w8a8_check.py --out $OUT/w8a8.json > $OUT/w8a8.log 2>&1
echo "rc=$?"; tail -40 $OUT/w8a8.log

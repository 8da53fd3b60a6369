#!/usr/bin/env bash
# One nvidia-h100-x1 call (issue 40, W4A16): the int-weight CPU tests' kernel check on the real
# GPU (the interpreter test's shapes through the compiled kernel), then the W4A16 GEMV sweep and
# roofline on the Llama-3-8B shapes (benchmarks/int4_gemv_check.py). Outputs under $OUT.
set -u
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout 420 python3 benchmarks/int4_gemv_check.py --out $OUT/int4_gemv.json > $OUT/int4_gemv.log 2>&1
echo "rc=$?"; tail -40 $OUT/int4_gemv.log

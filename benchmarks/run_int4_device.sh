#!/usr/bin/env bash
# One nvidia-h100-x1 (or H200) call, < 8 minutes (issue 40, W4A16 kernels): the int-kernel
# interpreter tests' checks through the compiled GEMV / GEMM on the GPU, split-K under CUDA-graph
# replay, then int4 vs bf16 on the Llama-3-8B shapes at M = 1, 16, 64, 256 (CUDA graphs) and 2048
# (prefill), per linear and per 32-layer stack (benchmarks/int4_kernels.py). Outputs under $OUT:
# int4_kernels.json, int4_kernels.md, int4_kernels.log.
#   run(command="bash benchmarks/run_int4_device.sh", carry=[".whl-tw"])
set -u
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout 450 python3 benchmarks/int4_kernels.py --out "$OUT" > "$OUT/int4_kernels.log" 2>&1
echo "rc=$?"
grep -E "check|CHECK|split-K|tuning|stack|lm_head|Targets" "$OUT/int4_kernels.log" | tail -40
tail -45 "$OUT/int4_kernels.log"

#!/usr/bin/env bash
# One nvidia-h100-x1 (or H200) call, < 10 minutes at worst (issue 40, W4A16 kernels; expected ~5:
# the GPU test compiles every candidate once, the benchmark then finds them in the Triton cache):
#   1. tests/gpu/test_int_kernels_cuda.py: IntLinear's tuned GEMV / GEMM captured in CUDA graphs
#      at batches 1..200 (int4 g128, GGUF-like group 32 with fractional zeros, int8), replayed
#      against fp32 references;
#   2. benchmarks/int4_kernels.py: the int-kernel interpreter tests' checks through the compiled
#      kernels, split-K under graph replay, then int4 vs bf16 on the Llama-3-8B shapes at
#      M = 1, 16, 64, 256 (CUDA graphs) and 2048 (prefill), per linear and per 32-layer stack;
#      `lop3 <shape>/<gemv|gemm>/<bucket>` lines: the fastest lop3 candidate (PRMT / LOP3 inline-PTX
#      unpack, branch int4v) vs the fastest other, and how many lop3 candidates failed the
#      tuner's output check ("wrong result" warnings; none expected); `family <shape>/gemm/<32|64>`
#      lines: the fastest of each GEMM family there (dq, dq 8 warps, dq split-K, lop3, lop3z,
#      cublas).
# Outputs under $OUT: int4_gpu_tests.log, int4_kernels.{json,md,log}.
#   run(command="bash benchmarks/run_int4_device.sh", carry=[".whl-tw"])
# INT4_M64=1: only the 32 / 64-row GEMM buckets (benchmarks/int4_kernels.py --m64, ~2 minutes;
# int4_kernels_m64.{json,md,log}):
#   run(command="INT4_M64=1 bash benchmarks/run_int4_device.sh", carry=[".whl-tw"])
set -u
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv
if [ "${INT4_M64:-0}" = 1 ]; then
  # The 32 / 64-row GEMM buckets alone (~2 minutes): benchmarks/int4_kernels.py --m64.
  timeout 280 python3 benchmarks/int4_kernels.py --m64 --out "$OUT" > "$OUT/int4_kernels_m64.log" 2>&1
  echo "m64 rc=$?"
  grep -E "precompiled|check|CHECK|split|tuning|^family|^graph|^stack|M= *(32|64) int4|wrong result|failed|done in" \
    "$OUT/int4_kernels_m64.log" | cut -c1-400 | tail -90
  exit 0
fi
timeout 250 python3 -m pytest -q -m gpu tests/gpu/test_int_kernels_cuda.py -p no:cacheprovider -rA \
  > "$OUT/int4_gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -15 "$OUT/int4_gpu_tests.log"
timeout 300 python3 benchmarks/int4_kernels.py --out "$OUT" > "$OUT/int4_kernels.log" 2>&1
echo "bench rc=$?"
grep -E "check|CHECK|split-K|tuning|stack|lm_head|Targets|candidate .* failed|wrong result|^lop3|^family" "$OUT/int4_kernels.log" | tail -80
tail -40 "$OUT/int4_kernels.log"

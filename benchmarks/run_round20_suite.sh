#!/usr/bin/env bash
# Round 20, last lease: the GPU suite on main's final code (the short-context decode graph on by
# default), the two-GPU file included where the machine has two; the int-kernel tuning case
# that times every candidate (120 s alone, int kernels untouched this round) deselected to fit
# one lease; then main's batch-1 step without the profiler.
# run(command="bash benchmarks/run_round20_suite.sh", carry=[".whl-tw"], kind="nvidia-h200-x2").
set -u
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
nvidia-smi -L
# SIGINT at the limit: pytest still prints its summary of what failed
timeout -s INT 470 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu -rfE \
  --deselect "tests/gpu/test_int_kernels_cuda.py::test_int_linear_graphs[4096-4096-128-4-False-False-True]" \
  2>&1 | grep -v Warn > $OUT/gpu_suite.log
grep -E "passed|failed|FAILED|ERROR" $OUT/gpu_suite.log | tail -12
timeout 80 python3 -m benchmarks.moe_b1_bench --out $OUT/main --no-profile --parts bf16,fp8 \
  --variants old,old:no-short-graph 2>&1 | grep -v Warn > $OUT/main.log
grep -E "^model|rror" $OUT/main.log | cut -c1-100

#!/usr/bin/env bash
# Round 19, last lease: the GPU suite on the final kernels (the int-kernel tuning case that
# times every candidate, 120 s alone and untouched this round, deselected to fit one lease),
# then main's batch-1 step without the profiler, twice per dtype.
# run(command="bash benchmarks/run_round19_c.sh", carry=[".whl-tw"]).
set -u
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
# SIGINT at the limit: pytest still prints its summary of what failed
timeout -s INT 440 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu -rfE \
  --deselect "tests/gpu/test_int_kernels_cuda.py::test_int_linear_graphs[4096-4096-128-4-False-False-True]" \
  2>&1 | grep -v Warn > $OUT/gpu_suite.log
grep -E "passed|failed|FAILED|ERROR" $OUT/gpu_suite.log | tail -12
timeout 100 python3 -m benchmarks.moe_b1_bench --out $OUT/main --no-profile --parts bf16,fp8 \
  --variants old,old 2>&1 | grep -v Warn > $OUT/main.log
grep -E "^model|rror" $OUT/main.log | cut -c1-100
